"""Datasets, the resumable global-order sampler, and the loaders built on them.

The data position of a run is one number: how many samples of the current epoch's global order the
optimizer has consumed (the *cursor*). The epoch's order is a permutation drawn from (seed, epoch); each
optimizer step takes the next `global_batch_size` samples of it and splits them across ranks and
micro-steps in a fixed way. So a resumed run — on the same or a different number of processes — sees
exactly the samples the uninterrupted run would have seen. Random augmentation is seeded per
(seed, epoch, sample), so it does not depend on which rank or loader worker reads a sample either.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import multiprocessing.context
import os
import pickle
import queue
import random
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset, TensorDataset, get_worker_info

from ddptrain.config import TEXT_DATASETS, DataSettings
from ddptrain.data.batch import _rebuild
from ddptrain.data import images, text
from ddptrain.data.batch import collate as collate_items
from ddptrain.errors import UsageError
from ddptrain.models import hf

EVAL_EPOCH = -1  # the epoch key of eval samples: no augmentation stream is tied to it


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from integers (splitmix64 over the parts)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & 0x7FFFFFFFFFFFFFFF


# --- the built-in synthetic dataset --------------------------------------------------------------

class SyntheticImages(Dataset):
    """Learnable synthetic images in constant memory: sample i is generated from a seed of (seed, i).

    Each image is Gaussian noise plus one of `num_classes` smooth prototype patterns; its label is the
    prototype it correlates with most — a deterministic function of the image, so accuracy can rise.
    """

    uses_global_rng = False  # every sample comes from its own generator: SeededSamples need not seed for it

    def __init__(self, size: int, num_classes: int, channels: int, image_size: int, seed: int, offset: int = 0):
        self.size, self.num_classes, self.offset, self.seed = size, num_classes, offset, seed
        self.shape = (channels, image_size, image_size)
        gen = torch.Generator().manual_seed(mix_seed(seed, 0x5EED))
        coarse = torch.randn(num_classes, channels, 4, 4, generator=gen)
        protos = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
        self.prototypes = protos / protos.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        # Signal strength relative to the noise's projection (std 1 per prototype direction).
        self.signal = 3.0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        gen = torch.Generator().manual_seed(mix_seed(self.seed, self.offset + index))
        hinted = int(torch.randint(self.num_classes, (1,), generator=gen))
        image = torch.randn(self.shape, generator=gen) + self.signal * self.prototypes[hinted]
        label = int(torch.einsum("chw,kchw->k", image, self.prototypes).argmax())
        return image, label


# --- per-sample seeding --------------------------------------------------------------------------

class SeededSamples(Dataset):
    """Wraps a map-style dataset; item keys are (epoch, index); returns (index, item).

    Before reading a sample, the global RNGs (torch CPU, numpy, random) are seeded from
    (seed, epoch, index), so random augmentation in any dataset — plug-ins included — is a function of
    the sample, not of the worker or rank that reads it. In the training process itself (no loader
    workers) the RNG states are restored afterwards, so dropout's stream is untouched. A dataset whose class
    sets `uses_global_rng = False` (its items draw nothing from those RNGs) is read without any of this.
    """

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed
        self.seeded = draws_from_global_rngs(dataset)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, Any]:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[tuple[int, Any]]:
        """A whole batch (the DataLoader's batched fetch). In the training process the RNG states are saved
        and restored once per batch rather than once per sample; each sample is still seeded by its key."""
        if not self.seeded or get_worker_info() is not None:  # a loader worker's RNGs serve nobody else
            return [self._read(key) for key in keys]
        saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        try:
            return [self._read(key) for key in keys]
        finally:
            torch.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])

    def _read(self, key: tuple[int, int]) -> tuple[int, Any]:
        epoch, index = key
        if self.seeded:
            seed_global_rngs(mix_seed(self.seed, epoch, index))
        return index, self.dataset[index]


def seed_global_rngs(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)


# --- samplers ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's global batch is split: micro-step m, rank r takes chunk m * world + r."""

    micro_batch_size: int
    world_size: int
    grad_accum_steps: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.world_size * self.grad_accum_steps

    def steps_per_epoch(self, num_samples: int, cursor: int = 0) -> int:
        """Whole global batches left in an epoch from `cursor`; the remainder is dropped (drop_last)."""
        return max(0, (num_samples - cursor) // self.global_batch_size)


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's global order: the same permutation on every rank, at every world size."""
    gen = torch.Generator().manual_seed(mix_seed(seed, epoch, 0x0DE5))
    return torch.randperm(num_samples, generator=gen)


class GlobalOrderSampler:
    """Batch sampler: this rank's micro-batches of one epoch, from a global sample cursor onwards.

    Yields lists of (epoch, index) keys for `SeededSamples`. `set_position` before each `iter()`.
    """

    def __init__(self, num_samples: int, layout: BatchLayout, rank: int, seed: int):
        self.num_samples, self.layout, self.rank, self.seed = num_samples, layout, rank, seed
        self.epoch, self.cursor = 0, 0

    def set_position(self, epoch: int, cursor: int) -> None:
        self.epoch, self.cursor = epoch, cursor

    def __len__(self) -> int:
        return self.layout.steps_per_epoch(self.num_samples, self.cursor) * self.layout.grad_accum_steps

    def micro_batches(self, epoch: int, cursor: int) -> Iterator[list[int]]:
        """This rank's sample indices for each micro-step from `cursor` to the end of `epoch`."""
        order = epoch_order(self.num_samples, self.seed, epoch).tolist()
        b, w, a = self.layout.micro_batch_size, self.layout.world_size, self.layout.grad_accum_steps
        for step in range(self.layout.steps_per_epoch(self.num_samples, cursor)):
            start = cursor + step * self.layout.global_batch_size
            for micro in range(a):
                chunk = start + (micro * w + self.rank) * b
                yield order[chunk:chunk + b]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.epoch
        for indices in self.micro_batches(epoch, self.cursor):
            yield [(epoch, i) for i in indices]


class ShardedEvalSampler:
    """Rank r reads samples r, r + world, r + 2*world, ...: every sample exactly once, no padding."""

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int):
        self.indices = list(range(rank, num_samples, world_size))
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for start in range(0, len(self.indices), self.batch_size):
            yield [(EVAL_EPOCH, i) for i in self.indices[start:start + self.batch_size]]


# --- building datasets and loaders ---------------------------------------------------------------

def build_datasets(data: DataSettings, seed: int, run_dir: Path) -> tuple[Dataset, Dataset | None]:
    """(train, eval or None) for the built-in `--dataset` or 'hf:PATH' records (tokenized into a cache beside
    them, or in `run_dir`); a 'pkg.mod:fn' plug-in is `loop.plugins`'s."""
    if data.dataset.startswith("hf:"):
        return hf.build_datasets(data, run_dir)
    if data.dataset == "synthetic":
        shape = dict(num_classes=data.num_classes, channels=data.in_channels, image_size=data.image_size, seed=seed)
        train = SyntheticImages(data.dataset_size, **shape)
        held_out = SyntheticImages(data.eval_size, offset=data.dataset_size, **shape) if data.eval_size else None
        return train, held_out
    if data.dataset in TEXT_DATASETS:
        return text.build(data)
    return images.build(data)


_END = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class BackgroundBatches:
    """Takes the loader workers' batches on a thread, off the training thread.

    Receiving a ready batch from a worker (unpickling, mapping its shared memory) costs milliseconds per batch.
    On CUDA, torch's pin-memory thread already does this in the background; this does the same on CPU. Only
    for loaders with workers: without them, reading a sample seeds the global RNGs the training thread uses.
    """

    def __init__(self, iterator: Iterator, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, args=(iterator,), name="ddptrain-batches", daemon=True)
        self._thread.start()

    def _pump(self, iterator: Iterator) -> None:
        try:
            for batch in iterator:
                if not self._put(batch):
                    return
            self._put(_END)
        except BaseException as exc:  # the training thread re-raises it, with its traceback
            self._put(_Failed(exc))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> BackgroundBatches:
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, _Failed):
            raise item.exc
        return item

    def close(self) -> None:
        """Stop and join the thread: a persistent-worker loader must not be iterated by two threads."""
        self._stop.set()
        self._thread.join()


def start_pass(loader: Iterable) -> Iterator:
    """`iter(loader)`, which starts the loader's worker processes where this pass does (a persistent-worker
    loader's first pass, every pass of a stream). Started from a forkserver (`worker_context`), each worker
    receives the dataset pickled: one that cannot cross is a UsageError saying what to change."""
    context = getattr(loader, "multiprocessing_context", None)
    forkserver = context is not None and context.get_start_method() == "forkserver"
    try:
        if not forkserver:
            return iter(loader)
        # A worker started by the forkserver receives its dataset pickled, each tensor's memory as a shared
        # file: by name, not as a file descriptor (a process start passes at most ~250 of those), so a
        # dataset of many tensors (tokenized records) crosses too.
        with _sharing_strategy("file_system"):
            return iter(loader)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
        if not forkserver:
            raise
        raise UsageError(
            f"the loader's worker processes could not start: {type(exc).__name__}: {exc}. On Python "
            f"{sys.version.split()[0]} they start from a forkserver, not by forking the trainer (CPython "
            "gh-112275, fixed in 3.11.10: a worker forked while a gloo thread enters Python can hang), so each "
            "receives the dataset pickled, as under spawn: define its class at module level (in the script "
            "itself under an `if __name__ == \"__main__\":` guard), keep what it holds picklable, or use "
            "--num_workers 0") from exc


@contextlib.contextmanager
def _sharing_strategy(strategy: str) -> Iterator[None]:
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


@contextlib.contextmanager
def epoch_batches(loader: Iterable, background: bool) -> Iterator[Iterator]:
    """The batches of one pass over `loader`; with `background`, received on a thread (see above)."""
    if not background:
        yield start_pass(loader)
        return
    batches = BackgroundBatches(start_pass(loader))
    try:
        yield batches
    finally:
        batches.close()


# --- how loader workers start ----------------------------------------------------------------------

# What every worker imports, once, in the forkserver; parallel.forkserver first: it takes the forkserver out of the
# trainer's signals. The trainer's main module is added where it has a name (`main_module_preload`).
FORKSERVER_PRELOAD = ["ddptrain.parallel.forkserver", "torch", "ddptrain.data.pipeline"]


def main_module_preload() -> list[str]:
    """The trainer's main module, where it was started as `python -m NAME` (torchrun -m, a benchmark): a worker
    started by the forkserver runs that module again as `__mp_main__` (multiprocessing's spawn rule), and
    what it imports would be imported anew in every worker, every pass (measured: docs/performance.md,
    "Loader workers"). Imported once in the forkserver, the workers find its imports there. A script
    run by path (`torchrun train.py`) is run again in each worker as before: CPython 3.11's forkserver never
    receives the path its `"__main__"` preload needs.
    """
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if not name or name == "__main__" or name.endswith(".__main__"):
        return []
    return [name]


def fork_is_safe(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether CPython `version` can fork a loader worker from a process whose other threads enter Python.

    A native thread entering Python (a gloo worker thread freeing a finished collective's tensors, for which
    pybind11 makes it a thread state) links its thread state in under CPython's runtime lock (HEAD_LOCK),
    without the GIL. A fork at that instant copies the lock held, and CPython before 3.11.10 takes it again
    in the child's PyOS_AfterFork_Child before resetting it: the worker hangs before its first line of
    Python, and its trainer waits for the batch for good. CPython gh-112275: fixed in 3.12.0, and for 3.11
    by python/cpython#112336 in 3.11.10 (its Misc/NEWS.d/3.11.10.rst). No look at the trainer's threads can
    rule the instant out: a collective in flight on any thread may finish during the fork.
    """
    return tuple(version) >= (3, 11, 10)


def worker_context() -> multiprocessing.context.BaseContext | None:
    """How this process's loader workers start: forked from the trainer where that is safe (None: torch's
    default), else by a forkserver (see `fork_is_safe`). The forkserver is a single-threaded process that
    imports torch and this module once and forks every worker from itself, so no thread can hold a lock at
    the fork. It is started at the first call (make_loader, while the Trainer is being built), so that its
    imports overlap the building of the model instead of delaying the first batch; a forkserver that died
    (a signal to the job's process group) is started again.

    A worker started so receives its dataset and collate function pickled, as under spawn (see `start_pass`):
    tensors cross in shared memory, memory-mapped arrays as their file's name (`_reduce_memmap`). Its
    parent process, as `multiprocessing.parent_process()` sees it, is still the trainer (`worker_init`).
    """
    if fork_is_safe():
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD + main_module_preload())  # no effect on one already running
    forkserver.ensure_running()
    return context


def _reduce_memmap(array: np.memmap) -> tuple:
    """A memory-mapped array crosses to a worker started by the forkserver as its file's name and the place
    of its bytes, mapped again there. Pickled like any array it would be copied whole into every worker (a
    token file, CIFAR's 150 MB) where a forked worker shared the trainer's pages."""
    if array._mmap is None:  # not a view of a file
        return array.__reduce__()
    mapping = np.frombuffer(array._mmap, dtype=np.uint8)
    mapped_from = array.offset - array.offset % mmap.ALLOCATIONGRANULARITY  # where numpy began the mapping
    start = mapped_from + array.__array_interface__["data"][0] - mapping.__array_interface__["data"][0]
    mode = "r+" if array.mode == "w+" else array.mode  # (w+ would truncate the file)
    return _map_again, (array.filename, mode, array.dtype, array.shape, array.strides, start)


def _map_again(filename: str, mode: str, dtype: np.dtype, shape: tuple, strides: tuple, start: int) -> np.ndarray:
    whole = np.memmap(filename, dtype=np.uint8, mode=mode)
    return np.ndarray(shape, dtype, buffer=whole, offset=start, strides=strides)


ForkingPickler.register(np.memmap, _reduce_memmap)  # the pickler of what a spawned or forkserver child receives


def worker_init(worker_id: int) -> None:
    # Preemption signals are for the training process, which checkpoints and then shuts its loader workers
    # down; they must not kill the workers first. torchelastic signals each worker's whole process group
    # (so leave it) and SLURM's --signal reaches every process of the step (so ignore SIGUSR1). The
    # loader still stops its workers directly, and they exit by themselves if the trainer dies.
    os.setpgrp()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # both ignored by the forkserver this worker may come from
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=_exit_with_trainer, name="ddptrain-orphan-check", daemon=True).start()
    # Workers get distinct torch seeds from the loader; numpy and random must follow them explicitly.
    seed = torch.initial_seed()
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)


def _exit_with_trainer() -> None:
    """End this loader worker as soon as its trainer dies (SIGKILL, a crash). torch's worker notices too,
    but then leaves gracefully: it joins its queue's feeder thread, and a feeder blocked on a full result
    pipe (batches sent by value fill it) waits for good, since the sibling workers hold the pipe's read
    end. The orphans would keep the trainer's stdout open and its memory mapped. The parent's sentinel pipe
    closes when it dies, even if that was before this worker got here. A worker started by the forkserver
    is the forkserver's child (torch's own check watches that one), but its `parent_process()` is still the
    trainer: the process that asked for it, whose end of the sentinel pipe nothing else holds."""
    trainer = multiprocessing.parent_process()
    if trainer is not None:
        trainer.join()
        os._exit(0)


def draws_from_global_rngs(dataset: Dataset) -> bool:
    """False only where the class that implements `__getitem__` itself declares `uses_global_rng = False`, or is
    one of torch's own that only index: `TensorDataset`, and `Subset`/`ConcatDataset` of datasets that draw
    nothing.

    The declaration is a promise about that one method: a subclass that overrides `__getitem__` (to add
    augmentation, say) does not inherit it and is seeded per sample unless it declares it again.
    """
    owner = next((cls for cls in type(dataset).__mro__ if "__getitem__" in vars(cls)), type(dataset))
    if owner is TensorDataset:
        return False
    if owner is Subset:
        return draws_from_global_rngs(dataset.dataset)
    if owner is ConcatDataset:
        return any(draws_from_global_rngs(part) for part in dataset.datasets)
    return vars(owner).get("uses_global_rng", True) is not False


# A loader worker hands a tensor over in shared memory: the training process fetches its file descriptor
# from the worker over a socket, a round trip that costs the same whatever the size. Up to this size copying
# the bytes through the result pipe is cheaper (measured: docs/performance.md, "Costs the code is shaped by").
BY_VALUE_BYTES = 256 * 1024


def _tensor_from_array(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array)


class _ByValue:
    """A tensor that pickles as its bytes and unpickles as a tensor again: the receiver never sees this."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __reduce__(self) -> tuple:
        return _tensor_from_array, (self.array,)


def by_value(batch: Any) -> Any:
    """`batch` with each small, plain tensor (contiguous, no grad, a dtype numpy has) wrapped to cross a
    process boundary by value; the others stay as they are (shared memory)."""
    if isinstance(batch, torch.Tensor):
        if (batch.layout != torch.strided or batch.requires_grad or not batch.is_contiguous()
                or batch.numel() * batch.element_size() > BY_VALUE_BYTES):
            return batch
        try:
            return _ByValue(batch.numpy())
        except (TypeError, RuntimeError):  # bfloat16, float8, ...: numpy has no such dtype
            return batch
    return _rebuild(batch, by_value)


class Collate:
    """A loader's collate: (indices as a list, the items made into one batch). `batch_of` is the user's
    collate_fn (fit's `collate_fn=`, or a dataset's `collate_fn` attribute); else ddptrain's, which stacks items
    of any structure and pads token sequences with `pad_id`. In a loader worker the batch's small tensors
    travel in its pickle (`by_value`) instead of as shared-memory tensors, whose handoff costs a socket round
    trip each, however small."""

    def __init__(self, batch_of: Callable[[list[Any]], Any] | None = None, pad_id: int = 0):
        self.batch_of, self.pad_id = batch_of, pad_id

    def __call__(self, items: list[tuple[int, Any]]) -> tuple[list[int], Any]:
        indices, samples = zip(*items)
        batch = self.batch_of(list(samples)) if self.batch_of is not None else collate_items(list(samples), self.pad_id)
        if get_worker_info() is not None:  # pickled to the training process next
            batch = by_value(batch)
        return list(indices), batch


def collate_for(dataset: Any, pad_token_id: int, collate_fn: Callable[[list[Any]], Any] | None = None) -> Collate:
    """The collate of `dataset`'s loader: `collate_fn`, else the dataset's own `collate_fn`, else ddptrain's with
    --pad_token_id (-1: the dataset's `pad_token_id`, as tokenized hf: datasets carry it, else 0)."""
    pad_id = pad_token_id if pad_token_id >= 0 else getattr(dataset, "pad_token_id", 0)
    return Collate(collate_fn or getattr(dataset, "collate_fn", None), pad_id)


collate = Collate()  # the default: ddptrain's own, padding with 0


@dataclass(frozen=True)
class Reading:
    """How a rank's loaders read, from the [data] and [training] sections: --num_workers processes, the run's
    --seed (each sample's randomness: `SeededSamples`), --pad_token_id (-1: the dataset's) and, for a stream,
    --batch_size (a map-style loader batches by its sampler)."""
    workers: int = 0
    seed: int = 0
    pad_token_id: int = -1
    batch_size: int = 1


def make_loader(dataset: Dataset, batch_sampler: Any, reading: Reading, device: torch.device,
                seed: int, collate_fn: Callable[[list[Any]], Any] | None = None) -> DataLoader:
    """A DataLoader over `SeededSamples` keys; yields (indices, batch) pairs. `seed`: its own generator's."""
    workers = reading.workers
    return DataLoader(
        SeededSamples(dataset, reading.seed),
        batch_sampler=batch_sampler,
        collate_fn=collate_for(dataset, reading.pad_token_id, collate_fn),
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,  # no restart of workers (and re-import of the dataset) per epoch
        prefetch_factor=4 if workers > 0 else None,
        worker_init_fn=worker_init if workers > 0 else None,
        multiprocessing_context=worker_context() if workers > 0 else None,
        generator=torch.Generator().manual_seed(seed),  # never draws from the global RNG
    )

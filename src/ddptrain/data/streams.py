"""Iterable (streaming) datasets: partitioned across ranks and loader workers, resumed exactly.

A plug-in dataset may be a `torch.utils.data.IterableDataset` — a stream with no length. Its elements are
numbered k = 0, 1, 2, ... in stream order. With W loader workers per rank there are S = world x max(W, 1)
readers; reader s = rank x max(W, 1) + worker takes the elements with k mod S = s. Every reader iterates
the whole stream and keeps its share, so an epoch reads each element exactly once across the job, whatever
the stream is. The stream itself sees `get_worker_info()` as None while ddptrain reads it: one that splits
itself by loader worker (as PyTorch's docs teach for plain DataLoaders) reads everything, and ddptrain's split
is the only one. Before element k is drawn, the global RNGs are seeded from (seed, epoch, k), so random
augmentation inside the stream is a function of the element; in the training process (no loader workers)
the trainer's own RNG states are put back after every element.

Position: each rank records, per reader, the largest k it has trained on (batch ids are stream indices, and
a loader batch comes from one reader). A resumed reader skips its elements up to there: exact at the same
world size and `--num_workers`. The shares depend on S, so a resume with another S is refused (exit 2).
When a rank's share ends, that rank starts its next epoch (the dataset's `set_epoch(epoch)` is called if it
has one); ranks never wait for each other on the data, and `--max_steps` ends training.

User docs: docs/tasks.md, section "Iterable datasets" (tests: tests/data/test_streams.py).
"""

from __future__ import annotations

import collections
import contextlib
import random
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils import worker as worker_state

from ddptrain.data.pipeline import (
    Reading,
    collate_for,
    epoch_batches,
    mix_seed,
    seed_global_rngs,
    worker_context,
    worker_init,
)
from ddptrain.errors import UsageError

STREAM_START = -1  # the element index whose seed a stream's own start-of-epoch draws take


def readers_per_rank(num_workers: int) -> int:
    return max(num_workers, 1)


class StreamShard(IterableDataset):
    """One rank's share of a stream, yielding (k, item). `epoch` and `done` are set before each iteration."""

    def __init__(self, dataset: IterableDataset, seed: int, rank: int, world_size: int):
        self.dataset, self.seed, self.rank, self.world_size = dataset, seed, rank, world_size
        self.epoch = 0
        self.done: dict[int, int] = {}  # reader -> the largest k already trained on

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        readers, reader = self.world_size * workers, self.rank * workers + worker
        after = self.done.get(reader, -1)
        read = _Reading(in_trainer=info is None)
        # Every reader must see the same stream: whatever it draws when it starts (a shuffle in set_epoch or
        # __iter__) and before each element is seeded alike on all of them.
        stream = read(mix_seed(self.seed, self.epoch, STREAM_START), self._start)
        k = 0
        while True:
            try:
                item = read(mix_seed(self.seed, self.epoch, k), lambda: next(stream))
            except StopIteration:
                return
            if k % readers == reader and k > after:
                yield k, item
            k += 1

    def _start(self) -> Iterator:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        return iter(self.dataset)


class _Reading:
    """Runs a piece of the user's stream as ddptrain's sharding needs it: the global RNGs seeded by the element,
    and `get_worker_info()` None (a stream that splits itself by loader worker, as PyTorch's docs teach, would
    otherwise split a second time what ddptrain already splits: half the data lost at 2 workers). In the
    training process the trainer's own RNG states are put back after each element, before control returns to
    anything else: between two elements of a batch, and between batches, dropout draws from the trainer's
    streams, never from the stream's seeds."""

    def __init__(self, in_trainer: bool):
        self.in_trainer = in_trainer

    def __call__(self, seed: int, part: Callable[[], Any]) -> Any:

        saved = (torch.get_rng_state(), np.random.get_state(), random.getstate()) if self.in_trainer else None
        info, worker_state._worker_info = worker_state._worker_info, None
        try:
            seed_global_rngs(seed)
            return part()
        finally:
            worker_state._worker_info = info
            if saved is not None:
                torch.set_rng_state(saved[0])
                np.random.set_state(saved[1])
                random.setstate(saved[2])


class StreamPosition:
    """This rank's place in its stream: the epoch, per reader the largest element index trained on, whose
    batch comes next (`turn`) and which of its readers have run out this epoch."""

    def __init__(self, readers: int, rank: int, num_workers: int):
        self.readers = readers  # S, the number of readers of the whole job
        per_rank = self.per_rank = readers_per_rank(num_workers)
        self.local = list(range(rank * per_rank, (rank + 1) * per_rank))  # this rank's readers, in turn order
        self.new_epoch(0)

    def new_epoch(self, epoch: int) -> None:
        self.epoch, self.done, self.turn, self.exhausted = epoch, {}, self.local[0], set()

    def took(self, ids: list[int]) -> None:
        for k in ids:
            reader = k % self.readers
            self.done[reader] = max(self.done.get(reader, -1), k)

    def after(self, reader: int) -> int:
        """The reader whose batch follows `reader`'s: the next one in turn that has not run out."""
        start = self.local.index(reader)
        for step in range(1, len(self.local) + 1):
            candidate = self.local[(start + step) % len(self.local)]
            if candidate not in self.exhausted:
                return candidate
        return reader

    def state_dict(self) -> dict[str, Any]:
        return {"readers": self.readers, "per_rank": self.per_rank, "epoch": self.epoch, "done": dict(self.done),
                "turn": self.turn, "exhausted": sorted(self.exhausted)}

    def load_state_dict(self, state: dict[str, Any], world_size: int, num_workers: int) -> None:
        """Restore this rank's saved position. The same decision on every rank: S and readers per rank are the
        same in every rank's saved state."""
        if state["readers"] != self.readers or state.get("per_rank") != self.per_rank:
            raise UsageError(f"the iterable dataset was split over {state['readers']} readers (processes x "
                             f"--num_workers) and this run has {self.readers} ({world_size} x "
                             f"{readers_per_rank(num_workers)}); resume with the same world size and --num_workers, "
                             "or start fresh (--no-auto_resume or another --run_dir)")
        self.epoch, self.turn, self.exhausted = state["epoch"], state["turn"], set(state["exhausted"])
        self.done = {int(k): v for k, v in state["done"].items()}


def stream_loader(shard: StreamShard, reading: Reading, device: torch.device, drop_last: bool,
                  seed: int, collate_fn: Callable[[list[Any]], Any] | None = None) -> DataLoader:
    workers = reading.workers
    return DataLoader(shard, batch_size=reading.batch_size, drop_last=drop_last,
                      collate_fn=collate_for(shard.dataset, reading.pad_token_id, collate_fn), num_workers=workers,
                      pin_memory=device.type == "cuda",
                      generator=torch.Generator().manual_seed(seed),  # never draws from the global RNG
                      # workers start anew each epoch: a persistent worker would keep the old epoch and position
                      persistent_workers=False, prefetch_factor=4 if workers > 0 else None,
                      worker_init_fn=worker_init if workers > 0 else None,
                      multiprocessing_context=worker_context() if workers > 0 else None)


@contextlib.contextmanager
def stream_batches(loader: DataLoader, shard: StreamShard, position: StreamPosition,
                   background: bool) -> Iterator[Iterator]:
    """Batches of this rank's share, epoch after epoch, in a fixed turn over its readers.

    The DataLoader hands out its workers' batches round-robin from worker 0 whenever an iterator starts; a
    resumed run must instead continue with the reader whose turn it was. So batches are taken in turn from
    a small stash (at most one per reader), and a reader whose batches are over when the loader ends leaves
    the turn: the same order in every run, whatever the timing. Each epoch starts the workers anew, with the
    shard's epoch and position of that moment.
    """
    def cycle() -> Iterator:
        while True:
            shard.epoch, shard.done = position.epoch, dict(position.done)
            stash: dict[int, collections.deque] = {reader: collections.deque() for reader in position.local}
            taken, ended, resumed = 0, False, bool(position.done)
            with epoch_batches(loader, background=background) as batches:
                while len(position.exhausted) < len(position.local):
                    want = position.turn
                    while not stash[want] and not ended:
                        try:
                            ids, batch = next(batches)
                        except StopIteration:
                            ended = True
                            break
                        stash[ids[0] % position.readers].append((ids, batch))
                    if stash[want]:
                        ids, batch = stash[want].popleft()
                        position.took(ids)
                        position.turn = position.after(want)
                        taken += 1
                        yield ids, batch
                    else:  # the loader has ended and this reader gave nothing more: its share is done
                        position.exhausted.add(want)
                        position.turn = position.after(want)
            if not taken and not resumed:  # (a resumed epoch may have had nothing left: saved after its end)
                raise UsageError(_too_short(shard, position, loader.batch_size))
            position.new_epoch(position.epoch + 1)

    batches = cycle()
    try:
        yield batches
    finally:
        batches.close()


def _too_short(shard: StreamShard, position: StreamPosition, batch_size: int) -> str:
    """Why a rank's share of an epoch gave no batch; the same words on every rank that finds it."""
    readers, per_rank = position.readers, position.per_rank
    return (f"the iterable dataset {type(shard.dataset).__name__} is too short for the {readers} readers that share "
            f"it ({shard.world_size} process(es) x {per_rank} loader worker(s); a process without workers is one "
            f"reader): each keeps one element in {readers} and drops a last batch short of --batch_size "
            f"{batch_size}, so an epoch of the stream needs about {readers * batch_size} elements for every rank to "
            "get a batch; lower --batch_size or --num_workers, use fewer processes, or give the stream more elements")

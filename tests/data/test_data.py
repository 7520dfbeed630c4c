"""Data order and sharding: unit tests of the samplers and datasets, then what a real 2-process run read."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pipeline_runs as runs
import pytest
import torch
from helpers import TINY, cli_env, read_jsonl, run_cli, run_python
from torch.utils.data import Dataset

from ddptrain.data.pipeline import (
    BackgroundBatches,
    BatchLayout,
    GlobalOrderSampler,
    Reading,
    SeededSamples,
    ShardedEvalSampler,
    SyntheticImages,
    draws_from_global_rngs,
    epoch_batches,
    epoch_order,
    make_loader,
)
from ddptrain.errors import UsageError


def epoch_samples(num_samples: int, layout: BatchLayout, seed: int, epoch: int) -> list[list[list[int]]]:
    """Per rank, the micro-batches of one epoch."""
    out = []
    for rank in range(layout.world_size):
        sampler = GlobalOrderSampler(num_samples, layout, rank, seed)
        sampler.set_position(epoch, 0)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert all(e == epoch for batch in batches for e, _ in batch)
        out.append([[i for _, i in batch] for batch in batches])
    return out


@pytest.mark.parametrize("num_samples", [96, 101])
@pytest.mark.parametrize("world_size,accum", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_ranks_partition_each_epoch_up_to_drop_last(num_samples: int, world_size: int, accum: int):
    layout = BatchLayout(micro_batch_size=4, world_size=world_size, grad_accum_steps=accum)
    steps = num_samples // layout.global_batch_size
    for epoch in range(3):
        per_rank = epoch_samples(num_samples, layout, seed=7, epoch=epoch)
        seen = [i for batches in per_rank for batch in batches for i in batch]
        assert all(len(batch) == 4 for batches in per_rank for batch in batches)
        assert len(seen) == len(set(seen)) == steps * layout.global_batch_size, "a sample was read twice"
        # What is dropped is documented: the tail of the epoch's order that does not fill a global batch.
        order = epoch_order(num_samples, 7, epoch).tolist()
        assert set(seen) == set(order[:steps * layout.global_batch_size])
        assert num_samples - len(seen) == num_samples % layout.global_batch_size


def test_order_changes_between_epochs_and_repeats_for_the_same_seed():
    layout = BatchLayout(micro_batch_size=8, world_size=2, grad_accum_steps=1)
    epoch0, epoch1 = epoch_samples(64, layout, 3, 0), epoch_samples(64, layout, 3, 1)
    assert epoch0 != epoch1
    assert sorted(i for b in epoch0[0] + epoch0[1] for i in b) == sorted(i for b in epoch1[0] + epoch1[1] for i in b)
    assert epoch_samples(64, layout, 3, 0) == epoch0
    assert epoch_samples(64, layout, 4, 0) != epoch0
    assert epoch_order(64, 3, 0).tolist() != list(range(64)), "epoch 0 must be shuffled too"


def test_global_order_is_the_same_at_every_world_size():
    """Step s takes the same global samples whether 1 process or 4 processes x 2 micro-steps read them."""
    one = epoch_samples(64, BatchLayout(16, 1, 1), 5, 2)[0]
    four = epoch_samples(64, BatchLayout(2, 4, 2), 5, 2)
    for step, batch in enumerate(one):
        # micro-step m, rank r reads chunk m * world + r of the step's global batch
        split = [i for micro in range(2) for rank in range(4) for i in four[rank][step * 2 + micro]]
        assert split == batch


def test_resuming_mid_epoch_continues_the_same_order():
    layout = BatchLayout(4, 2, 1)
    sampler = GlobalOrderSampler(40, layout, rank=1, seed=9)
    sampler.set_position(1, 0)
    whole = list(sampler)
    sampler.set_position(1, 3 * layout.global_batch_size)
    assert list(sampler) == whole[3:]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_eval_sampler_covers_every_sample_exactly_once(world_size: int):
    counts = Counter(i for rank in range(world_size)
                     for batch in ShardedEvalSampler(61, 8, rank, world_size) for _, i in batch)
    assert sorted(counts) == list(range(61))
    assert set(counts.values()) == {1}


def test_synthetic_images_are_deterministic_and_learnable():
    ds = SyntheticImages(200, num_classes=10, channels=3, image_size=8, seed=1)
    image, label = ds[17]
    again, label_again = SyntheticImages(200, 10, 3, 8, seed=1)[17]
    assert torch.equal(image, again) and label == label_again
    assert not torch.equal(SyntheticImages(200, 10, 3, 8, seed=2)[17][0], image)
    # The label is a function of the image: the prototype it correlates with most.
    for i in range(0, 200, 20):
        x, y = ds[i]
        assert y == int(torch.einsum("chw,kchw->k", x, ds.prototypes).argmax())
    labels = Counter(ds[i][1] for i in range(200))
    assert len(labels) == 10 and max(labels.values()) < 60, labels
    with pytest.raises(IndexError):
        ds[200]


class JitterDataset(Dataset):
    """Augmentation drawn from the global RNGs, as plug-in datasets commonly do."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        return torch.tensor([torch.rand(()).item(), float(np.random.rand()), random.random()]), index


def test_augmentation_is_a_function_of_the_sample_not_of_the_reader():
    seeded = SeededSamples(JitterDataset(), seed=11)
    first = seeded[(3, 5)][1][0]
    torch.manual_seed(123)  # whatever the caller's RNG state ...
    state = torch.get_rng_state()
    assert torch.equal(seeded[(3, 5)][1][0], first)  # ... the sample is the same
    assert torch.equal(torch.get_rng_state(), state), "reading a sample moved the training RNG"
    assert not torch.equal(seeded[(4, 5)][1][0], first), "a new epoch must draw new augmentation"
    assert not torch.equal(seeded[(3, 6)][1][0], first)


class JitteredSynthetic(SyntheticImages):
    """A subclass of a dataset that promises `uses_global_rng = False`, adding augmentation from the global RNG."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        return image + torch.randn_like(image), label


def test_seeding_is_skipped_only_where_the_reading_class_promises_it():
    shape = dict(num_classes=10, channels=1, image_size=4, seed=0)
    assert not draws_from_global_rngs(SyntheticImages(8, **shape))
    assert draws_from_global_rngs(JitterDataset())
    # torch's datasets that only index draw nothing, nor do their Subset/ConcatDataset; a wrapped drawer does.
    tensors = torch.utils.data.TensorDataset(torch.arange(8.0), torch.arange(8))
    assert not draws_from_global_rngs(tensors)
    assert not draws_from_global_rngs(torch.utils.data.Subset(tensors, [1, 3]))
    assert not draws_from_global_rngs(torch.utils.data.ConcatDataset([tensors, SyntheticImages(8, **shape)]))
    assert draws_from_global_rngs(torch.utils.data.Subset(JitterDataset(), [0]))
    assert draws_from_global_rngs(torch.utils.data.ConcatDataset([tensors, JitterDataset()]))
    jittered = SeededSamples(JitteredSynthetic(8, **shape), seed=11)
    assert jittered.seeded, "an overriding __getitem__ must not inherit its parent's promise"
    first = jittered[(0, 3)][1][0]
    torch.manual_seed(99)
    assert torch.equal(jittered[(0, 3)][1][0], first), "the subclass's augmentation must be seeded per sample"


def test_loader_workers_read_the_same_samples_as_the_main_process():
    layout = BatchLayout(4, 1, 1)
    read = {}
    for workers in (0, 2):
        sampler = GlobalOrderSampler(16, layout, 0, seed=11)
        loader = make_loader(JitterDataset(), sampler, Reading(workers=workers), torch.device("cpu"), seed=workers)
        read[workers] = [(ids, inputs) for ids, (inputs, _) in loader]
    assert [ids for ids, _ in read[0]] == [ids for ids, _ in read[2]]
    for (_, a), (_, b) in zip(read[0], read[2]):
        assert torch.equal(a, b)


# --- what a real 2-process run read ---------------------------------------------------------------

def recorded(run_dir: Path, rank: int) -> dict[tuple[int, int], list[int]]:
    return {(r["step"], r["micro"]): r["ids"] for r in read_jsonl(run_dir / "samples" / f"rank-{rank}.jsonl")}


def test_two_process_run_partitions_each_epoch(tmp_path_factory):
    pair, single = runs.pair(tmp_path_factory), runs.single(tmp_path_factory)
    rank0, rank1 = recorded(pair, 0), recorded(pair, 1)
    assert not (pair / "samples" / "rank-2.jsonl").exists()
    steps = runs.STEPS_PER_EPOCH
    used = steps * runs.GLOBAL_BATCH
    epochs = []
    for epoch in range(runs.EPOCHS):
        keys = [(step, 0) for step in range(epoch * steps + 1, (epoch + 1) * steps + 1)]
        ids = [i for key in keys for rank in (rank0, rank1) for i in rank[key]]
        assert len(ids) == len(set(ids)) == used, "a sample was read twice in one epoch"
        assert set(ids) == set(epoch_order(runs.NUM_TRAIN, 42, epoch)[:used].tolist())
        epochs.append(ids)
    assert epochs[0] != epochs[1], "the order must change between epochs"
    # The same seed on one process read the very same global batches in the same order.
    one = recorded(single, 0)
    assert sorted(one) == sorted(rank0) == sorted(rank1)
    for key, batch in one.items():
        assert batch == rank0[key] + rank1[key]


CLOSE_SCRIPT = """
import json, multiprocessing, sys
from pathlib import Path
from ddptrain.config import resolve_config
from ddptrain.parallel.distributed import distributed
from ddptrain.loop.trainer import Trainer

run_dir = Path(sys.argv[1])
cfg = resolve_config(sys.argv[2:] + ["--run_dir", str(run_dir)])
with distributed("gloo", 60, run_dir) as ctx:
    trainer = Trainer(cfg, ctx, run_dir)
    trainer.fit()
    workers = multiprocessing.active_children()
    trainer.close()
    trainer.close()  # twice is harmless
    print(json.dumps({"workers": len(workers), "left": len(multiprocessing.active_children())}))
"""


def test_trainer_close_stops_persistent_loader_workers_at_once(tmp_path):
    """After fit, persistent loader workers (train and eval) are alive; close() has stopped them by the time it
    returns, rather than leaving them to the garbage collector (where each can cost a 5 s join timeout)."""
    flags = [*TINY, "--num_workers", "2", "--max_steps", "3", "--epochs", "1"]
    proc = run_python(["-c", CLOSE_SCRIPT, str(tmp_path), *flags], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    closed = json.loads(proc.stdout.splitlines()[-1])
    assert closed["workers"] == 4, "expected 2 train + 2 eval loader workers alive after fit"
    assert closed["left"] == 0, closed


class _FailsAt(Dataset):
    def __init__(self, size: int, bad: int):
        self.size, self.bad = size, bad

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise KeyError(f"sample {i} is broken")
        return torch.full((3,), float(i))


def test_background_batches_are_the_loader_s_in_order_and_a_worker_s_error_reaches_the_training_thread():
    from torch.utils.data import DataLoader

    loader = DataLoader(_FailsAt(12, bad=-1), batch_size=4, num_workers=2)
    with epoch_batches(loader, background=True) as batches:
        assert isinstance(batches, BackgroundBatches)
        received = list(batches)
    assert [b[:, 0].tolist() for b in received] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]

    failing = DataLoader(_FailsAt(12, bad=6), batch_size=4, num_workers=2)
    with pytest.raises(KeyError, match="sample 6 is broken"):
        with epoch_batches(failing, background=True) as batches:
            list(batches)
    # Leaving early (the queue full, the thread blocked in put) stops and joins the thread.
    with epoch_batches(DataLoader(_FailsAt(64, bad=-1), batch_size=2, num_workers=1), background=True) as batches:
        next(batches)
        thread = batches._thread
    assert not thread.is_alive()


def test_loader_workers_fork_only_where_cpython_has_the_fork_fix():
    """CPython gh-112275 (a child forked while another thread makes a thread state hangs) is fixed in 3.11.10
    and 3.12.0: older interpreters start loader workers from a forkserver, newer ones fork them."""
    from ddptrain.data.pipeline import Reading, fork_is_safe, make_loader

    assert not fork_is_safe((3, 11, 7)) and not fork_is_safe((3, 11, 9))
    assert fork_is_safe((3, 11, 10)) and fork_is_safe((3, 12, 0)) and fork_is_safe((3, 13, 1))
    sampler = ShardedEvalSampler(8, 4, 0, 1)
    context = make_loader(SyntheticImages(8, 10, 3, 8, seed=0), sampler, Reading(workers=2), torch.device("cpu"), 0
                          ).multiprocessing_context
    expected = "fork" if fork_is_safe(tuple(sys.version_info[:3])) else "forkserver"
    assert (context.get_start_method() if context is not None else "fork") == expected
    assert make_loader(SyntheticImages(8, 10, 3, 8, seed=0), sampler, Reading(workers=0), torch.device("cpu"),
                       0).multiprocessing_context is None


def test_loader_workers_do_not_import_again_what_a_named_main_module_imported(tmp_path):
    """A trainer started as `python -m NAME`: its loader workers, started from the forkserver, run NAME again as
    multiprocessing's spawn rule says, but find its imports done in the forkserver — a module that the main
    module imports is imported by the trainer and the forkserver, by no worker. (Without the preload every
    worker imported it: a second per worker per pass for a trainer's imports on 2 cores.)"""
    imports, out = tmp_path / "imports", tmp_path / "workers"
    proc = run_python(["-m", "loader_main", str(out)], env={"LOADER_MAIN_IMPORTS": str(imports)}, fresh=True)
    assert proc.returncode == 0, proc.stderr
    workers = {int(line) for line in out.read_text().split()}
    importers = [int(line) for line in imports.read_text().split()]
    assert len(workers) == 4, workers  # 2 workers, 2 passes
    assert not workers & set(importers), f"loader workers imported the main module's imports: {importers}"


def test_loader_workers_start_while_another_thread_runs_collectives(tmp_path):
    """Loader workers started as ddptrain starts them, 30 times while 16 gloo threads keep entering Python
    to free collectives' tensors: every pass gets its batches, and on a CPython without the fork fix no
    worker is a fork of the trainer. (Plain fork on 3.11.7 hung 1 worker in about 2,400 forks of this
    script, stuck in PyOS_AfterFork_Child: rarely within one run of this test, hence the second check.)"""
    from ddptrain.data.pipeline import fork_is_safe

    out = tmp_path / "out"
    runs.torchrun([str(Path(__file__).parents[1] / "worker_loader_starts.py"), str(out), "30"], timeout=600)
    for rank in (0, 1):
        starts = json.loads((out / f"starts-{rank}.json").read_text())
        assert starts["passes"] == 30 and starts["timeouts"] == 0, starts
        assert starts["forked_from_trainer"] == fork_is_safe(tuple(sys.version_info[:3])), starts


def test_a_memory_mapped_array_crosses_to_a_worker_as_its_file_not_its_bytes(tmp_path):
    """Datasets reading files through np.memmap (token shards, CIFAR's records) are pickled to each worker a
    forkserver starts: they must cross as a file name and offset, not as a copy of the whole file."""
    from multiprocessing.reduction import ForkingPickler

    import ddptrain.data.pipeline  # noqa: F401  (registers the reducer)

    path = tmp_path / "tokens.bin"
    np.arange(1 << 18, dtype=np.uint16).tofile(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    records = np.memmap(path, dtype=np.uint8, mode="r", offset=4096).reshape(-1, 512)
    for array in (tokens, tokens[1000:5000:3], records, records[7:, 10:20], tokens[::-1]):
        pickled = ForkingPickler.dumps(array)
        assert len(pickled) < 1024, len(pickled)
        back = ForkingPickler.loads(pickled)
        assert back.dtype == array.dtype and np.array_equal(back, array)
    in_memory = np.array(tokens[:100])
    assert np.array_equal(ForkingPickler.loads(ForkingPickler.dumps(in_memory)), in_memory)


class _Unpicklable(Dataset):
    def __init__(self) -> None:
        self.source = (i for i in range(4))  # a generator: no pickle

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(float(i))


@pytest.mark.filterwarnings("ignore:Got pickle error")  # torch says so too
def test_a_dataset_a_forkserver_cannot_send_to_its_workers_is_a_usage_error():
    import multiprocessing

    from torch.utils.data import DataLoader

    from ddptrain.data.pipeline import start_pass

    loader = DataLoader(_Unpicklable(), batch_size=2, num_workers=1,
                        multiprocessing_context=multiprocessing.get_context("forkserver"))
    with pytest.raises(UsageError, match="could not start.*pickle.*--num_workers 0"):
        start_pass(loader)


def test_small_tensors_cross_from_a_loader_worker_by_value_and_the_rest_in_shared_memory():
    from multiprocessing.reduction import ForkingPickler

    from ddptrain.data.pipeline import BY_VALUE_BYTES, by_value

    small, labels = torch.arange(12.0).reshape(3, 4), torch.tensor([3, 1, 2])
    big = torch.ones(BY_VALUE_BYTES // 4 + 1)
    strided, bf16 = torch.arange(6.0).reshape(2, 3).t(), torch.ones(4, dtype=torch.bfloat16)
    batch = {"x": small, "y": (labels, bf16), "big": big, "strided": strided}
    back = ForkingPickler.loads(ForkingPickler.dumps(by_value(batch)))
    assert not small.is_shared() and not labels.is_shared()  # pickled as bytes, never moved to shared memory
    assert big.is_shared() and strided.is_shared() and bf16.is_shared()  # too big / not contiguous / no numpy dtype
    assert torch.equal(back["x"], small) and torch.equal(back["y"][0], labels) and back["y"][0].dtype == torch.int64
    assert torch.equal(back["big"], big) and torch.equal(back["y"][1], bf16)
    assert torch.equal(back["strided"], strided) and back["strided"].stride() == strided.stride()
    back["x"].add_(1)  # a tensor of its own, writable
    assert torch.equal(small, torch.arange(12.0).reshape(3, 4))


class _Mixed(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[int, dict]:
        return i, {"image": torch.full((3, 4, 4), float(i)), "big": torch.full((40_000,), float(i)),
                   "label": torch.tensor(i % 3)}


def test_a_worker_s_batches_equal_the_in_process_ones():
    from torch.utils.data import DataLoader

    from ddptrain.data.pipeline import collate

    def batches(workers: int) -> list:
        return list(DataLoader(_Mixed(), batch_size=4, collate_fn=collate, num_workers=workers))

    for (ids_a, a), (ids_b, b) in zip(batches(0), batches(2), strict=True):
        assert ids_a == ids_b and a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype and type(b[key]) is torch.Tensor


_KILLED_TRAINER = """
import multiprocessing, os, signal, sys, torch
from torch.utils.data import DataLoader, Dataset
from ddptrain.data.pipeline import collate, worker_init

class Big(Dataset):  # defined in the script run as __main__, as a user's own dataset is
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return i, torch.full((50_000,), float(i))  # 200 KB: crosses by value, more than a pipe holds

if __name__ == "__main__":
    loader = DataLoader(Big(), batch_size=1, collate_fn=collate, num_workers=2, persistent_workers=True,
                        prefetch_factor=4, worker_init_fn=worker_init,
                        multiprocessing_context=multiprocessing.get_context(sys.argv[1]))
    batches = iter(loader)
    next(batches)
    print(" ".join(str(w.pid) for w in batches._workers), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the workers' next batches now wait in a full pipe
"""


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_loader_workers_end_with_a_killed_trainer(tmp_path, start_method):
    """Without their own check the workers of a SIGKILLed trainer stay forever: each leaves by joining its
    queue's feeder thread, blocked on the full result pipe whose read end the siblings hold. Started by a
    forkserver, a worker is the forkserver's child, yet it must still follow the trainer."""
    import os
    import time

    script, out = tmp_path / "killed_trainer.py", tmp_path / "pids"
    script.write_text(_KILLED_TRAINER)
    with out.open("w") as stdout:
        proc = subprocess.run([sys.executable, str(script), start_method], env=cli_env(), stdout=stdout,
                              timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"the trainer was not killed (exit {proc.returncode})"
    pids = [int(p) for p in out.read_text().split()]
    assert len(pids) == 2

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 60  # a liveness bound: they exit within about a second
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"loader workers {left} outlived their trainer"


def test_more_loader_workers_than_cores_is_one_line_naming_num_workers(tmp_path):
    """Issue 35 item 11: torch's 4-line "excessive worker creation" warning came from every loader of every
    rank (6 times a run); ddptrain says it once, on rank 0, naming the flag."""
    workers = len(os.sched_getaffinity(0)) + 1
    proc = run_cli(["train", *TINY, "--run_dir", str(tmp_path), "--nproc", "2", "--max_steps", "2",
                    "--num_workers", str(workers)])
    assert proc.returncode == 0, proc.stderr
    console = proc.stdout + proc.stderr
    assert "excessive worker creation" not in console
    lines = [line for line in console.splitlines() if "--num_workers" in line]
    assert len(lines) == 1 and f"--num_workers {workers} on 2 ranks of this host" in lines[0], console


def test_max_steps_decides_how_long_a_run_trains_however_many_epochs_it_takes(tmp_path):
    """--max_steps 20 beside --epochs 1, at 8 steps an epoch: 20 steps into the third epoch (as transformers'
    and TRL's max_steps), said in one line; without it, --epochs decides. In this process."""
    import ddptrain
    from ddptrain.config import resolve_config

    job = [*TINY, "--eval_size", "0", "--save_every", "0", "--epochs", "1"]
    summary = ddptrain.fit(config=resolve_config([*job, "--max_steps", "20", "--run_dir", str(tmp_path / "a")]))
    assert (summary["step"], summary["epoch"]) == (20, 2)
    assert "--max_steps 20 decides the run's length: 2.5 epochs of 8 steps (--epochs 1 does not limit it)" \
        in (tmp_path / "a" / "logs" / "rank-0.log").read_text()
    assert ddptrain.fit(config=resolve_config([*job, "--run_dir", str(tmp_path / "b")]))["step"] == 8


def test_the_samples_each_epoch_leaves_out_are_said_in_one_line():
    """64 rows at --batch_size 48: 16 left out of each epoch (25 %), said with a batch size that leaves none; a
    global batch that divides the rows says nothing. In this process, the line on rank 0's log."""
    import logging

    from ddptrain.data.pipeline import BatchLayout
    from ddptrain.loop.loaders import say_left_out

    records, logger = [], logging.getLogger("ddptrain")
    handler, level = logging.Handler(), logger.level
    handler.emit = records.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        say_left_out(64, BatchLayout(48, 1, 1))
        say_left_out(64, BatchLayout(6, 2, 2))
        say_left_out(64, BatchLayout(16, 2, 2))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    said = [record.getMessage() for record in records]
    assert said == ["16 of the 64 training samples are left out of each epoch (25 %: a global batch of 48 takes 48 "
                    "whole ones); each epoch's shuffle leaves out others. --batch_size 32 leaves none",
                    "16 of the 64 training samples are left out of each epoch (25 %: a global batch of 24 takes 48 "
                    "whole ones); each epoch's shuffle leaves out others. --batch_size 4 leaves none"]

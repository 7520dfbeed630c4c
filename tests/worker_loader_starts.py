"""Loader workers started again and again while a thread keeps collectives running: none may hang.

Run under torchrun with 2 processes:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/worker_loader_starts.py OUT_DIR \
        PASSES [ddptrain|fork]

A thread keeps async all-reduces in flight on 8 gloo groups (16 gloo threads), whose tensors Python drops at
once: the groups' worker threads then free them, each time entering Python from C++ (the moment CPython
gh-112275 makes a fork unsafe). Meanwhile the main thread makes PASSES passes over a DataLoader with 2
non-persistent workers, started as ddptrain starts them (`data.worker_context`), or by plain fork. A worker
that never answers is a pass whose batch times out. OUT_DIR/starts-<rank>.json: {"passes", "timeouts",
"start_method", "forked_from_trainer"} (whether any worker's parent process was this one).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from ddptrain.data.pipeline import worker_context, worker_init

BATCH_TIMEOUT_S = 60  # a healthy worker answers in well under a second, a hung one never


class Squares(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i * i, os.getppid()])


def chatter(groups: list[dist.ProcessGroup], done: threading.Event) -> None:
    """Async all-reduces until every rank is done: each round's first all-reduce carries this rank's flag,
    so all ranks stop after the same round."""
    while True:
        flag = torch.tensor([float(done.is_set())])
        vote = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups[0], async_op=True)
        for _ in range(8):
            for group in groups:
                dist.all_reduce(torch.ones(64), group=group, async_op=True)  # tensor and work dropped at once
        vote.wait()
        if flag.item() > 0:
            return


def main(argv: list[str]) -> None:
    out, passes, how = Path(argv[0]), int(argv[1]), argv[2] if len(argv) > 2 else "ddptrain"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = [dist.new_group(backend="gloo") for _ in range(8)]
    context = worker_context() if how == "ddptrain" else None  # None: torch's default, fork
    done = threading.Event()
    thread = threading.Thread(target=chatter, args=(groups, done), daemon=True)
    thread.start()
    timeouts, parents = 0, set()
    for _ in range(passes):
        loader = DataLoader(Squares(), batch_size=2, num_workers=2, worker_init_fn=worker_init,
                            multiprocessing_context=context, timeout=BATCH_TIMEOUT_S)
        try:
            batches = list(loader)
            assert [b[:, 0].tolist() for b in batches] == [[0, 1], [4, 9]]
            parents.update(b[:, 1].tolist()[0] for b in batches)
        except RuntimeError as exc:  # "DataLoader timed out": a worker that never started
            if "timed out" not in str(exc):
                raise
            timeouts += 1
    done.set()
    thread.join()
    out.mkdir(parents=True, exist_ok=True)
    method = context.get_start_method() if context is not None else "fork"
    (out / f"starts-{rank}.json").write_text(json.dumps({"passes": passes, "timeouts": timeouts,
                                                          "start_method": method,
                                                          "forked_from_trainer": os.getpid() in parents}))
    del groups
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

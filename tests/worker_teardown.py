"""A training worker that reports the threads left in its process once training is over.

Run under torchrun with 2 processes:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/worker_teardown.py OUT_DIR \
        [--stuck-destroy] [ddptrain train flags]

It trains through `train_worker` (what `ddptrain train`, `fit` and its spawned workers run in each process)
and, as soon as it returns, writes the names of the process's OS threads to OUT_DIR/threads-<rank>.json.
Process-group threads still running then would run on into interpreter finalization.

--stuck-destroy: `destroy_process_group` blocks (as one waiting on work left in gloo's queue does) until
train_worker has returned, with a teardown limit of 2 s; OUT_DIR/returned-<rank>.json then says it returned.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import torch.distributed as dist

import ddptrain.distributed
from ddptrain.api import WorkerFailed, train_worker
from ddptrain.config import resolve_config


def os_thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(names)


def main(argv: list[str]) -> None:
    out, stuck = Path(argv[0]), argv[1:2] == ["--stuck-destroy"]
    cfg = resolve_config(argv[2:] if stuck else argv[1:])
    released, destroy = threading.Event(), dist.destroy_process_group
    if stuck:
        def stuck_destroy() -> None:
            released.wait()
            destroy()

        dist.destroy_process_group = stuck_destroy
        ddptrain.distributed.TEARDOWN_TIMEOUT_S = 2.0
    try:
        summary = train_worker(cfg)
    except WorkerFailed:
        summary = None
    out.mkdir(parents=True, exist_ok=True)
    if stuck:
        (out / f"returned-{os.environ['RANK']}.json").write_text(json.dumps(summary))
        released.set()  # the destroy goes ahead now, so that this process ends with its groups gone
        for thread in threading.enumerate():
            if thread.name == "ddptrain-teardown":
                thread.join()
    (out / f"threads-{os.environ['RANK']}.json").write_text(json.dumps(os_thread_names()))


if __name__ == "__main__":
    main(sys.argv[1:])

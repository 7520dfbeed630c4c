"""A training worker that reports the threads left in its process once training is over.

Run under torchrun with 2 processes:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/worker_teardown.py OUT_DIR \
        [ddptrain train flags]

It trains through `train_worker` (what `ddptrain train`, `fit` and its spawned workers run in each process)
and, as soon as it returns, writes the names of the process's OS threads to OUT_DIR/threads-<rank>.json.
Process-group threads still running then would run on into interpreter finalization.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

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
    out, cfg = Path(argv[0]), resolve_config(argv[1:])
    try:
        train_worker(cfg)
    except WorkerFailed:
        pass
    out.mkdir(parents=True, exist_ok=True)
    (out / f"threads-{os.environ['RANK']}.json").write_text(json.dumps(os_thread_names()))


if __name__ == "__main__":
    main(sys.argv[1:])

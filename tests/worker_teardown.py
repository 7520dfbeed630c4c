"""A training worker that reports what its teardown left behind.

Run under torchrun with 2 processes:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/worker_teardown.py OUT_DIR \
        [--peer-exits] [ddptrain train flags]

It trains through `train_worker` (what `ddptrain train`, `fit` and its spawned workers run in each process)
and, as soon as it returns, writes OUT_DIR/teardown-<rank>.json: the names of the process's OS threads
(process-group threads still running would run on into interpreter finalization), `summary` (train_worker's
return, None if it raised WorkerFailed) and `groups_registered_when_trainer_freed` (whether the process groups
were still registered when the Trainer was freed: DDP's reducer must not hold a group's last reference).

--peer-exits: rank 1 exits at once when its teardown begins (its 'destroying the process groups' line),
right after training's last collective; rank 0 must still tear down cleanly, and alone.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import weakref
from pathlib import Path

import torch.distributed as dist

from ddptrain.api import WorkerFailed, train_worker
from ddptrain.config import resolve_config
from ddptrain.loop.trainer import Trainer


def os_thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(names)


def exit_when_teardown_begins(record: logging.LogRecord) -> bool:
    if record.getMessage().startswith("destroying the process groups"):
        os._exit(0)
    return True


def main(argv: list[str]) -> None:
    out, peer_exits = Path(argv[0]), argv[1:2] == ["--peer-exits"]
    cfg = resolve_config(argv[2:] if peer_exits else argv[1:])
    if peer_exits and os.environ["RANK"] == "1":
        logging.getLogger("ddptrain").addFilter(exit_when_teardown_begins)  # a filter outlives setup_logging
    freed: dict[str, bool] = {}
    build = Trainer.__init__

    def watched_init(trainer: Trainer, *args, **kwargs) -> None:
        build(trainer, *args, **kwargs)
        weakref.finalize(trainer, lambda: freed.setdefault("groups_registered", dist.is_initialized()))

    Trainer.__init__ = watched_init
    try:
        summary = train_worker(cfg)
    except WorkerFailed:
        summary = None
    out.mkdir(parents=True, exist_ok=True)
    (out / f"teardown-{os.environ['RANK']}.json").write_text(json.dumps(
        {"threads": os_thread_names(), "summary": summary,
         "groups_registered_when_trainer_freed": freed.get("groups_registered")}))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Rank-aware logging: rank 0 talks to the console, every rank writes RUN_DIR/logs/rank-<R>.log."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGER = "ddptrain"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world_size: int, host: str):
        super().__init__()
        self.tag = f"rank {rank}/{world_size} {host}"

    def filter(self, record: logging.LogRecord) -> bool:
        record.where = self.tag
        return True


def setup_logging(run_dir: Path, rank: int, world_size: int, host: str) -> logging.Logger:
    """Configure the 'ddptrain' logger for this rank and return it.

    Console: rank 0 at INFO; other ranks at WARNING (their problems must still be visible).
    File: every rank at DEBUG into logs/rank-<R>.log, each line tagged with rank and host.
    """
    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    fmt = logging.Formatter("%(asctime)s [%(where)s] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    rank_filter = _RankFilter(rank, world_size, host)

    console = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(fmt)
    console.addFilter(rank_filter)
    logger.addHandler(console)

    path = rank_log_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(path)
    file_handler.setLevel(logging.DEBUG)
    file_handler.setFormatter(fmt)
    file_handler.addFilter(rank_filter)
    logger.addHandler(file_handler)
    return logger


def rank_log_path(run_dir: Path, rank: int) -> Path:
    """RUN_DIR/logs/rank-R.log: everything rank R logs, DEBUG included."""
    return run_dir / "logs" / f"rank-{rank}.log"

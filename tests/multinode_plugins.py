"""Plug-ins for the multi-node, watchdog and straggler tests (tests/ is on PYTHONPATH in helpers.cli_env)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ddptrain.data.pipeline import SyntheticImages

# Read by the plug-ins below; the tests set them per run.
SLOW_RANK_VAR = "DDPTRAIN_TEST_SLOW_RANK"
SLOW_SECONDS_VAR = "DDPTRAIN_TEST_SLOW_S"


def _shape(cfg) -> dict:
    return dict(num_classes=cfg.num_classes, channels=cfg.in_channels, image_size=cfg.image_size, seed=cfg.seed)


class OneSlowRank(SyntheticImages):
    """Synthetic images whose loading is slow on one rank only: a data-pipeline straggler."""

    def __init__(self, size: int, delay_s: float, **shape):
        super().__init__(size, **shape)
        self.delay_s = delay_s

    def __getitem__(self, index: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().__getitem__(index)


def slow_rank_synthetic(cfg):
    slow = os.environ.get("RANK", "0") == os.environ.get(SLOW_RANK_VAR, "-1")
    delay_s = float(os.environ.get(SLOW_SECONDS_VAR, "0.002")) if slow else 0.0
    return (OneSlowRank(cfg.dataset_size, delay_s, **_shape(cfg)),
            SyntheticImages(cfg.eval_size, offset=cfg.dataset_size, **_shape(cfg)))


# (seconds of the default group's collective timeout) at each training sample read, in order.
TIMEOUTS_SEEN: list[float] = []


class TimeoutProbe(SyntheticImages):
    """Records the process group's current collective timeout whenever a training sample is read."""

    def __getitem__(self, index: int):
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        TIMEOUTS_SEEN.append(backend.options._timeout.total_seconds())
        return super().__getitem__(index)


def timeout_probe_synthetic(cfg):
    return TimeoutProbe(cfg.dataset_size, **_shape(cfg)), None

"""Plug-ins for tests/loop/test_control_vote.py (importable because tests/ is on PYTHONPATH in helpers.cli_env)."""

from __future__ import annotations

import os
import signal

import torch.distributed as dist
from torch import nn

from ddptrain.models import MLP


class SignallingMLP(MLP):
    """The built-in MLP that sends SIGTERM to its own process in the training forward of step
    $VOTE_SIGNAL_STEP on rank $VOTE_SIGNAL_RANK: a preemption notice reaching one rank mid-step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rank = int(os.environ.get("RANK", "0"))
        self.signal_rank = int(os.environ["VOTE_SIGNAL_RANK"])
        self.signal_step = int(os.environ["VOTE_SIGNAL_STEP"])
        self.forwards = 0

    def forward(self, x):
        if self.training:
            self.forwards += 1  # one micro-batch per step in these tests
            if self.rank == self.signal_rank and self.forwards == self.signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
        return super().forward(x)


def signalling_mlp(cfg) -> nn.Module:
    return SignallingMLP(cfg.in_channels * cfg.image_size ** 2, cfg.num_classes, hidden=cfg.width)


class CountingMLP(MLP):
    """The built-in MLP that notes, for every collective ddptrain issues on its control group, how many training
    forwards this rank had run by then: the step boundary it was issued at (one micro-batch per step). One line
    per collective in $VOTE_COUNT_FILE.<rank>."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards = 0
        path = f"{os.environ['VOTE_COUNT_FILE']}.{os.environ.get('RANK', '0')}"
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                     "broadcast_object_list", "barrier"):
            setattr(dist, name, self._counted(getattr(dist, name), name, path))

    def _counted(self, original, name: str, path: str):
        def counted(*args, **kwargs):
            if kwargs.get("group") is not None:  # ddptrain names its control group in every call
                with open(path, "a") as fh:
                    fh.write(f"{self.forwards} {name}\n")
            return original(*args, **kwargs)

        return counted

    def forward(self, x):
        if self.training:
            self.forwards += 1
        return super().forward(x)


def counting_mlp(cfg) -> nn.Module:
    return CountingMLP(cfg.in_channels * cfg.image_size ** 2, cfg.num_classes, hidden=cfg.width)

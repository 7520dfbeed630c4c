"""Plug-ins for tests/test_control_vote.py (importable because tests/ is on PYTHONPATH in helpers.cli_env)."""

from __future__ import annotations

import os
import signal

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

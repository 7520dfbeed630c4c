"""What a checkpoint restores besides model and optimizer: every RNG stream of a rank, and the window of
train numbers not yet logged. (The data position is `checkpoint.Position`.)"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import torch

from ddptrain.data.pipeline import mix_seed


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states, as tensors and plain values (safe to load with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])


def seed_rank_rngs(seed: int, rank: int) -> None:
    """Per-rank streams for dropout and friends (model init is seeded identically before this)."""
    torch.manual_seed(mix_seed(seed, 1, rank))
    np.random.seed(mix_seed(seed, 2, rank) & 0xFFFFFFFF)
    random.seed(mix_seed(seed, 3, rank))


class MetricWindow:
    """The train numbers since the last log line. Sums stay on the device and are read once per log step;
    timings and counts are host numbers of this process."""

    def __init__(self, device: torch.device, log_interval: int):
        self.device, self.log_interval = device, log_interval
        self.reset()

    def reset(self) -> None:
        zero = lambda: torch.zeros((), dtype=torch.float64, device=self.device)  # noqa: E731
        self.loss, self.count, self.bad_loss = zero(), zero(), zero()
        self.bad_steps = torch.zeros(self.log_interval, dtype=torch.bool, device=self.device)
        self.last_norm = torch.zeros((), device=self.device)
        self.steps = 0  # optimizer steps in the window (a resumed window includes the previous process's)
        self.units = 0  # samples or tokens this rank trained on, as the task counts them
        self.data_wait = 0.0
        self.spans: list[list[tuple[str, Any, Any]]] = []  # per step this process ran: (name, start, end)
        self.started = time.perf_counter()

    def add_loss(self, loss: torch.Tensor, units: torch.Tensor | int = 1) -> torch.Tensor:
        """Count one micro-batch's loss, a sum over `units` (a mean: one unit), so that the logged loss is the
        unit-weighted mean; returns whether it was finite (a device tensor)."""
        finite = torch.isfinite(loss.detach())
        self.loss += torch.where(finite, loss.detach().double(), 0.0)
        self.count += finite.double() * units
        self.bad_loss += (~finite).double()
        return finite

    def end_step(self, step: int, bad: torch.Tensor, norm: torch.Tensor, spans: list) -> None:
        self.bad_steps[(step - 1) % self.log_interval] = bad
        self.last_norm = norm
        self.spans.append(spans)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"loss": self.loss.cpu(), "count": self.count.cpu(), "bad_loss": self.bad_loss.cpu(),
                "bad_steps": self.bad_steps.cpu(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss.copy_(state["loss"])
        self.count.copy_(state["count"])
        self.bad_loss.copy_(state["bad_loss"])
        bad_steps = state.get("bad_steps")
        if bad_steps is not None and bad_steps.shape == self.bad_steps.shape:  # else --log_interval changed
            self.bad_steps.copy_(bad_steps)
        self.steps = state["steps"]

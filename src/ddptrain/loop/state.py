"""What a checkpoint restores besides model and optimizer: every RNG stream of a rank, and the window of
train numbers not yet logged. (The data position is `checkpoint.Position`.)"""

from __future__ import annotations

import math
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
    timings and counts are host numbers of this process.

    A micro-step only keeps its loss and whether it was finite; a step only keeps its non-finite flag. The
    window adds them up when its line is written (`totals`, `flags`): a few batched ops per log step rather
    than a dozen tiny ones per micro-step, each a dispatch on the training thread (and a kernel on a GPU). The
    sum runs over the window's losses in order, whether or not a resume came between them: a checkpoint keeps
    them unsummed (`state_dict`), so a resumed run logs the losses of the run it continues, to the bit.
    """

    def __init__(self, device: torch.device, log_interval: int):
        self.device, self.log_interval = device, log_interval
        self.reset()

    def reset(self) -> None:
        # Sums carried in from a checkpoint of an older format or of another world size (loss, count, bad).
        self._carried: torch.Tensor | None = None
        self._kept: list[torch.Tensor] | None = None  # a checkpoint's unsummed (losses, finite, units)
        self._losses: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]] = []  # (loss, finite, units)
        self._flags: list[tuple[int, torch.Tensor]] = []  # (index in the window, non-finite step?)
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
        loss = loss.detach()
        finite = loss.abs() < math.inf  # isfinite's answer in 2 ops, not 4 (NaN compares false)
        self._losses.append((loss, finite, units))
        return finite

    def end_step(self, step: int, bad: torch.Tensor, norm: torch.Tensor, spans: list) -> None:
        self._flags.append(((step - 1) % self.log_interval, bad))
        self.last_norm = norm
        self.spans.append(spans)
        self.steps += 1

    def _vectors(self) -> list[torch.Tensor]:
        """Every loss of the window in order (float64), whether each was finite (0/1), and its units."""
        if not self._losses:
            empty = torch.zeros(0, dtype=torch.float64, device=self.device)
            return self._kept or [empty, empty, empty]
        loss, finite, units = zip(*self._losses)
        if all(isinstance(u, int) for u in units):  # host numbers: no read of the device, and no wait on it
            unit_vector = torch.tensor(units, dtype=torch.float64).to(self.device, non_blocking=True)
        else:
            unit_vector = torch.stack([torch.as_tensor(u, dtype=torch.float64, device=self.device) for u in units])
        fresh = [torch.stack(loss).double(), torch.stack(finite).double(), unit_vector]
        if self._kept is None:
            return fresh
        return [torch.cat([kept, new]) for kept, new in zip(self._kept, fresh)]

    def totals(self) -> torch.Tensor:
        """(loss sum of the finite losses, their units, non-finite losses): float64, on the device."""
        loss, finite, units = self._vectors()
        sums = torch.stack([torch.where(finite > 0, loss, 0.0), finite * units, 1 - finite]).sum(dim=1)
        return sums if self._carried is None else sums + self._carried

    def flags(self) -> torch.Tensor:
        """Which steps of the window had a non-finite gradient norm (update skipped), by index in the window."""
        if self._flags:
            index, bad = zip(*self._flags)
            first = index[0]
            if list(index) == list(range(first, first + len(index))):  # the usual run of steps: a slice
                self.bad_steps[first:first + len(index)] = torch.stack(bad)
            else:
                self.bad_steps[list(index)] = torch.stack(bad)
            self._flags = []
        return self.bad_steps

    def state_dict(self) -> dict[str, Any]:
        loss, finite, units = (v.cpu() for v in self._vectors())
        carried = (self._carried if self._carried is not None else torch.zeros(3, dtype=torch.float64)).cpu()
        return {"loss": carried[0], "count": carried[1], "bad_loss": carried[2],
                "losses": loss, "finite": finite, "units": units, "bad_steps": self.flags().cpu(),
                "steps": self.steps}

    @staticmethod
    def merged(states: list[dict[str, Any]]) -> dict[str, Any]:
        """One window's state holding every rank's (when the world size changed: rank 0 takes them all, so
        the totals stay right)."""
        merged = {key: sum(s[key] for s in states) for key in ("loss", "count", "bad_loss")}
        if all("losses" in s for s in states):
            merged.update({key: torch.cat([s[key] for s in states]) for key in ("losses", "finite", "units")})
        merged["bad_steps"] = torch.stack([s["bad_steps"] for s in states]).any(dim=0)
        return {**merged, "steps": states[0]["steps"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        carried = torch.stack([torch.as_tensor(state[key], dtype=torch.float64)
                               for key in ("loss", "count", "bad_loss")]).to(self.device)
        self._carried = carried if bool(carried.any()) else None
        # A checkpoint from before the window kept its losses has no "losses": its sums (carried) suffice.
        self._kept = ([state[key].to(self.device, torch.float64) for key in ("losses", "finite", "units")]
                      if "losses" in state else None)
        self._losses, self._flags = [], []
        bad_steps = state.get("bad_steps")
        if bad_steps is not None and bad_steps.shape == self.bad_steps.shape:  # else --log_interval changed
            self.bad_steps.copy_(bad_steps)
        self.steps = state["steps"]

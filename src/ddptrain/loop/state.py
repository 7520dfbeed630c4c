"""What a checkpoint restores besides model and optimizer: every RNG stream of a rank, and the window of
train numbers not yet logged. (The data position is `checkpoint.Position`.)"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
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
    """The train numbers since the last log line. Device numbers stay on the device until the line is
    written; timings and counts are host numbers of this process.

    A micro-step only keeps its loss (and its count of units, if the task counts on the device); a step only
    keeps its gradient norm, whose finiteness is the step's non-finite flag. At a log step `snapshot` stacks
    all of them into one vector (one op on the training thread, one copy to the host; a second for counts) and
    `WindowNumbers.read` adds them up on the host, once the copy has arrived: a dozen tiny device ops per log
    step, or per micro-step, would each be a dispatch on the training thread (and a kernel on a GPU). Sums are
    exactly rounded (`math.fsum`), so they do not depend on where a checkpoint split the window: it keeps the
    losses unsummed (`state_dict`), and a resumed run logs the losses of the run it continues, to the bit.
    """

    def __init__(self, device: torch.device, log_interval: int):
        self.device, self.log_interval = device, log_interval
        self._zero = torch.zeros((), device=device)  # ends the float vector: never empty
        self.reset()

    def reset(self) -> None:
        # Sums carried in from a checkpoint of an older format or of another world size (loss, count, bad).
        self._carried: tuple[float, float, float] | None = None
        self._kept: tuple[list[float], list[float], list[float]] | None = None  # a checkpoint's (losses, finite, units)
        self._kept_flags: list[bool] | None = None  # a checkpoint's non-finite flags, by index in the window
        self._losses: list[tuple[torch.Tensor, torch.Tensor | int]] = []  # (loss, units)
        self._norms: list[tuple[int, torch.Tensor]] = []  # (index in the window, the step's gradient norm)
        self.steps = 0  # optimizer steps in the window (a resumed window includes the previous process's)
        self.units = 0  # samples or tokens this rank trained on, as the task counts them
        self.positions = self.padding = 0  # of padded token batches (an attention_mask): positions, padded ones
        self.inputs = 0  # token batches' input tokens: the positions the model reads that are not padding
        self.data_wait = 0.0
        self.spans: list[list[tuple[str, Any, Any]]] = []  # per step this process ran: (name, start, end)
        self.started = time.perf_counter()

    def add_loss(self, loss: torch.Tensor, units: torch.Tensor | int = 1) -> torch.Tensor:
        """Count one micro-batch's loss, a sum over `units` (a mean: one unit), so that the logged loss is the
        unit-weighted mean of the finite losses. Returns 0 if it was finite and NaN if not (a device tensor in
        the loss's dtype): isfinite's answer in one op, in a form that poisons what it is added to."""
        loss = loss.detach()
        self._losses.append((loss, units))
        return loss * 0  # inf * 0 and NaN * 0 are NaN

    def count_tokens(self, batch: Any) -> None:
        """A host batch's input tokens: an attention_mask's ones, else every position of its `input_ids` (all but
        the last of a token window's, which only a label reads). Where an attention_mask says which positions
        are padding, those too: what --packing would not spend compute on."""
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            tokens = int(mask.count_nonzero())
            self.positions += mask.numel()
            self.padding += mask.numel() - tokens
            self.inputs += tokens
        elif isinstance(ids, torch.Tensor) and ids.dim() == 2:
            self.inputs += ids.numel() if isinstance(batch, Mapping) else ids[:, 1:].numel()

    def end_step(self, step: int, norm: torch.Tensor, spans: list) -> None:
        """A step ends with its global gradient norm: NaN or inf marks a skipped (non-finite) update."""
        self._norms.append(((step - 1) % self.log_interval, norm))
        self.spans.append(spans)
        self.steps += 1

    def snapshot(self) -> WindowNumbers:
        """The window's device numbers as one or two vectors (not read: nothing waits for the device) and what
        it takes to add them up on the host (`WindowNumbers.read`)."""
        losses, units = zip(*self._losses) if self._losses else ((), ())
        # One stack of floats (the losses, then each step's norm) and one of a LossSum's counts, if the task
        # counts on the device: a stack of mixed dtypes costs 4x one of a single dtype.
        vectors = [torch.stack([*losses, *(norm for _, norm in self._norms), self._zero])]
        counted = [u if u.device == self.device else u.to(self.device, non_blocking=True)  # counted on the host
                   for u in units if isinstance(u, torch.Tensor)]
        if counted:
            vectors.append(torch.stack(counted))
        host_units = [None if isinstance(u, torch.Tensor) else float(u) for u in units]
        return WindowNumbers(vectors, host_units, [index for index, _ in self._norms], self.log_interval,
                             self._kept, self._kept_flags, self._carried)

    def totals(self) -> tuple[float, float, float]:
        """(loss sum of the finite losses, their units, non-finite losses), read now (waits for the device)."""
        return self.snapshot().read().sums

    def state_dict(self) -> dict[str, Any]:
        numbers = self.snapshot().read()
        as_tensor = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
        carried = self._carried or (0.0, 0.0, 0.0)
        return {"loss": as_tensor(carried[0]), "count": as_tensor(carried[1]), "bad_loss": as_tensor(carried[2]),
                "losses": as_tensor(numbers.losses), "finite": as_tensor(numbers.finite),
                "units": as_tensor(numbers.units), "bad_steps": torch.tensor(numbers.flags, dtype=torch.bool),
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
        carried = tuple(float(state[key]) for key in ("loss", "count", "bad_loss"))
        self._carried = carried if any(carried) else None
        # A checkpoint from before the window kept its losses has no "losses": its sums (carried) suffice.
        self._kept = (tuple(state[key].double().tolist() for key in ("losses", "finite", "units"))
                      if "losses" in state else None)
        self._losses, self._norms = [], []
        bad_steps = state.get("bad_steps")
        shape_kept = bad_steps is not None and tuple(bad_steps.shape) == (self.log_interval,)
        # Without them (--log_interval changed) the window starts with no step flagged.
        self._kept_flags = [bool(flag) for flag in bad_steps.tolist()] if shape_kept else None
        self.steps = state["steps"]


@dataclass
class WindowTotals:
    """A window's numbers on the host: every loss of the window in order (with whether it was finite and its
    units), their sums, the non-finite flag of each step by index in the window, the last gradient norm."""

    losses: list[float]
    finite: list[float]
    units: list[float]
    sums: tuple[float, float, float]  # loss sum of the finite losses, their units, non-finite losses
    flags: list[bool]
    norm: float


class WindowNumbers:
    """A window's numbers at its log step: the device vectors `MetricWindow.snapshot` stacked, and how to add
    them up once they are on the host (`read`)."""

    def __init__(self, vectors: list[torch.Tensor], host_units: list[float | None], norm_index: list[int],
                 log_interval: int, kept: tuple[list[float], list[float], list[float]] | None,
                 kept_flags: list[bool] | None, carried: tuple[float, float, float] | None):
        self.vectors = vectors  # [the losses, each step's norm, 0], and the units counted on the device (if any)
        self._units, self._norm_index = host_units, norm_index
        self._log_interval, self._kept, self._kept_flags, self._carried = log_interval, kept, kept_flags, carried

    def read(self, values: list[list[float]] | None = None) -> WindowTotals:
        """The totals from the vectors' `values` (read from the device now if not given); a checkpoint's
        losses come first, its carried sums are added."""
        floats, *counts = [v.tolist() for v in self.vectors] if values is None else values
        n = len(self._units)
        losses, norms, counted = floats[:n], floats[n:n + len(self._norm_index)], iter(counts[0] if counts else ())
        units = [float(next(counted)) if u is None else u for u in self._units]
        finite = [1.0 if math.isfinite(loss) else 0.0 for loss in losses]
        if self._kept is not None:
            losses, finite, units = (kept + fresh for kept, fresh in zip(self._kept, (losses, finite, units)))
        flags = list(self._kept_flags) if self._kept_flags is not None else [False] * self._log_interval
        for index, norm in zip(self._norm_index, norms):
            flags[index] = not math.isfinite(norm)
        ok = [f > 0 for f in finite]
        sums = [math.fsum(loss for loss, good in zip(losses, ok) if good),
                math.fsum(u for u, good in zip(units, ok) if good), float(ok.count(False))]
        if self._carried is not None:
            sums = [math.fsum((total, carried)) for total, carried in zip(sums, self._carried)]
        return WindowTotals(losses, finite, units, (sums[0], sums[1], sums[2]), flags, norms[-1] if norms else 0.0)

"""Exact distributed eval over any task's `{name: (sum, count)}` metrics."""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.data.batch import to_device
from ddptrain.data.pipeline import start_pass
from ddptrain.errors import UsageError
from ddptrain.loop.tasks import Task, first_tensor
from ddptrain.models import eval_mode
from ddptrain.parallel.distributed import DistributedContext

log = logging.getLogger("ddptrain")


class Evaluator:
    """Each eval sample is read by one rank (`ShardedEvalSampler`); sums and counts are all-reduced."""

    def __init__(self, ctx: DistributedContext, loader: Iterable | None, task: Task, autocast: Any,
                 channels_last: bool, lockstep: bool = False):
        self.ctx, self.loader, self.task = ctx, loader, task
        self.autocast, self.channels_last = autocast, channels_last
        # Sharded models gather parameters in every forward: all ranks must run as many forwards.
        self.lockstep = lockstep and ctx.world_size > 1

    @torch.no_grad()
    def evaluate(self, module: nn.Module, heartbeat: Any = None) -> dict[str, float]:
        """Metric means over the whole eval set, plus the task's derived ones, `samples` and, for token tasks,
        `tokens` and `tokens_per_sec`. {} without an eval set. Must be called on all ranks.

        Runs the unwrapped module: ranks may hold different numbers of eval batches, and DDP's forward would
        start collectives a rank with fewer batches never joins. A sharded module cannot run without them:
        in `lockstep` a rank with fewer batches repeats its last one, uncounted, until all have run as many.
        """
        started = time.perf_counter()
        sums: dict[str, list[torch.Tensor]] = {}
        items, units = 0, 0
        loader: Iterable = self.loader if self.loader is not None else ()
        if self.lockstep and not _has_len(loader):
            loader = list(start_pass(loader))  # an iterable eval set: counted before the forwards that depend on it
        own = len(loader) if self.lockstep else 0  # type: ignore[arg-type]
        rounds, fewest = (int(v) for v in self.ctx.reduce_flags([own, -own])) if self.lockstep else (own, 0)
        if -fewest == 0 < rounds:  # every rank knows, so every rank stops here
            raise UsageError("a rank has no eval batch but its peers do, and a sharded model evaluates in "
                             "lockstep: use an eval set of at least one sample per rank (--eval_size)")
        batch = None
        with eval_mode(module):  # each submodule back in its own mode after (a frozen one stays frozen)
            for _, batch in start_pass(loader):
                if heartbeat is not None:
                    heartbeat()
                items += len(first_tensor(batch))
                units += self.task.count(batch)  # on the host batch: no device read
                batch = to_device(batch, self.ctx.device, self.channels_last)
                with self.autocast():
                    _, metrics = self.task.loss(module, batch)
                for name, (total, count) in metrics.items():
                    acc = sums.setdefault(name, [torch.zeros((), dtype=torch.float64, device=self.ctx.device),
                                                 torch.zeros((), dtype=torch.float64, device=self.ctx.device)])
                    acc[0] += total.double()
                    acc[1] += count.double() if isinstance(count, torch.Tensor) else count
            for _ in range(rounds - own):
                with self.autocast():
                    self.task.loss(module, batch)
        # A rank with no eval batch has no metric names: agree on the union, in one order.
        names = sorted(set().union(*self._gather(sorted(sums))), key=lambda name: (name != "loss", name))
        zero = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        flat = torch.stack([t for name in names for t in sums.get(name, [zero, zero])] +
                           [torch.tensor(float(items), dtype=torch.float64, device=self.ctx.device),
                            torch.tensor(float(units), dtype=torch.float64, device=self.ctx.device)])
        if self.ctx.world_size > 1:
            dist.all_reduce(flat)
        values = flat.tolist()
        items, units = int(values[-2]), int(values[-1])
        if items == 0:
            return {}
        means = {name: values[2 * i] / values[2 * i + 1] if values[2 * i + 1] else float("nan")
                 for i, name in enumerate(names)}
        result = {**self.task.report(means), "samples": items}
        if self.task.unit == "tokens":
            result["tokens"] = units
            result["tokens_per_sec"] = units / max(time.perf_counter() - started, 1e-9)
        return result

    def _gather(self, names: list[str]) -> list[list[str]]:
        if self.ctx.world_size == 1:
            return [names]
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, names, group=self.ctx.control_group)
        return out


def _has_len(loader: Iterable) -> bool:
    """Whether `len(loader)` answers: a DataLoader always has `__len__`, which raises TypeError over an
    iterable dataset without one."""
    try:
        len(loader)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True

"""Exact distributed eval over any task's `{name: (sum, count)}` metrics."""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.batch import to_device
from ddptrain.distributed import DistributedContext
from ddptrain.tasks import Task, first_tensor

log = logging.getLogger("ddptrain")


class Evaluator:
    """Each eval sample is read by one rank (`ShardedEvalSampler`); sums and counts are all-reduced."""

    def __init__(self, ctx: DistributedContext, loader: Iterable | None, task: Task, autocast: Any,
                 channels_last: bool):
        self.ctx, self.loader, self.task = ctx, loader, task
        self.autocast, self.channels_last = autocast, channels_last

    @torch.no_grad()
    def evaluate(self, module: nn.Module, heartbeat: Any = None) -> dict[str, float]:
        """Metric means over the whole eval set, plus the task's derived ones, `samples` and, for token tasks,
        `tokens` and `tokens_per_sec`. {} without an eval set. Must be called on all ranks.

        Runs the unwrapped module: ranks may hold different numbers of eval batches, and DDP's forward would
        start collectives a rank with fewer batches never joins.
        """
        started = time.perf_counter()
        sums: dict[str, list[torch.Tensor]] = {}
        items, units = 0, 0
        module.eval()
        try:
            for _, batch in self.loader if self.loader is not None else ():
                if heartbeat is not None:
                    heartbeat()
                batch = to_device(batch, self.ctx.device, self.channels_last)
                with self.autocast():
                    _, metrics = self.task.loss(module, batch)
                for name, (total, count) in metrics.items():
                    acc = sums.setdefault(name, [torch.zeros((), dtype=torch.float64, device=self.ctx.device),
                                                 torch.zeros((), dtype=torch.float64, device=self.ctx.device)])
                    acc[0] += total.double()
                    acc[1] += count.double() if isinstance(count, torch.Tensor) else count
                items += len(first_tensor(batch))
                units += self.task.count(batch)
        finally:
            module.train()
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

"""The division a task's loss needs, owned by the trainer: a `LossSum` is divided by the count of units of the
whole step — every rank, every micro-batch — so that N processes learn what one process learns from the
same global batch, whatever the padding and masking. (HF Trainer's `num_items_in_batch`, torchtitan's
global valid-token count.)

The count comes from the host batches before the first forward (`task.count`), so the one tiny all-reduce
that sums it over the ranks runs under that forward's compute; none at all when the task says its counts are
fixed by the batch's shape (`task.count_is_fixed`): then every rank knows the step's count by itself.
DDP and FSDP average gradients over the ranks, so a rank backpropagates `total x world / global count`: the
average of those over ranks is the gradient of the global unit-weighted mean.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ddptrain.errors import UsageError
from ddptrain.loop.tasks import LossSum, Task
from ddptrain.parallel.distributed import DistributedContext

log = logging.getLogger("ddptrain")


class StepScale:
    """One step's normalisation: the factor each micro-batch's loss is multiplied by before backward."""

    def __init__(self, units: int, mean_factor: float, global_count: Callable[[], float] | None, world: int,
                 step: int):
        self.units = units  # this rank's units in the step, as `task.count` counts them (for throughput)
        self._mean_factor, self._global_count, self._world, self._step = mean_factor, global_count, world, step
        self._factor: float | None = None

    def factor(self, sums: bool) -> float:
        """`world / global count` for a LossSum (waits for the count's all-reduce the first time), else the
        mean's `1 / grad_accum_steps`."""
        if not sums:
            return self._mean_factor
        if self._factor is None:
            count = self._global_count() if self._global_count is not None else 0.0
            if count == 0:
                log.warning("step %d counts no unit on any rank (every label -100?): it changes nothing",
                            self._step)
            self._factor = self._world / count if count else 0.0
        return self._factor


class LossNormaliser:
    """Turns a task's loss into what a micro-batch backpropagates. One per trainer; all ranks."""

    def __init__(self, task: Task, ctx: DistributedContext, grad_accum_steps: int):
        self.task, self.ctx, self.accum = task, ctx, grad_accum_steps
        self.sums: bool | None = None  # whether the task gives a LossSum: known after its first loss

    def start(self, batches: list[Any], step: int) -> StepScale:
        """Count the units of this rank's micro-batches of `step` (host batches, before they move to the
        device) and start agreeing on the step's total. All ranks, at the same point of every step."""
        units = sum(int(self.task.count(batch)) for batch in batches)
        world = self.ctx.world_size
        global_count = None
        if self.sums is not False:
            if world == 1 or all(self.task.count_is_fixed(batch) for batch in batches):
                global_count = lambda: float(units * world)  # noqa: E731  (every rank counts the same)
            else:
                global_count = self.ctx.start_sum([float(units)])
        return StepScale(units, 1.0 / self.accum, global_count, world, step)

    def split(self, output: torch.Tensor | LossSum) -> tuple[torch.Tensor, Any, bool]:
        """(what backward runs on before scaling, the units it covers for the logged mean, whether it is a sum)."""
        sums = isinstance(output, LossSum)
        if self.sums is None:
            self.sums = sums
        elif sums != self.sums:
            raise UsageError("the task's loss(model, batch) returned a LossSum at one step and a plain mean at "
                             "another: return one kind always")
        if sums:
            return output.total, output.count, True
        if not isinstance(output, torch.Tensor) or output.dim() != 0:
            raise UsageError(f"the task's loss(model, batch) must return a scalar tensor or a ddptrain.LossSum as "
                             f"its first value, not {_describe(output)}")
        return output, 1, False


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} (reduce it: .mean() or .sum() with a count)"
    return f"a {type(value).__name__}"

"""How the model is replicated and kept in sync: DistributedDataParallel over the job's ranks.

The loop asks this object three things — the module to call, a context that skips gradient
communication on accumulation micro-steps, and one model's state for eval and checkpoints — so a
different strategy is a different object with the same methods, not branches in the loop.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.config import TrainConfig
from ddptrain.distributed import DistributedContext
from ddptrain.errors import TrainingError

log = logging.getLogger("ddptrain")


class DataParallel:
    """DDP at world size > 1 (a plain module at 1): every rank holds the whole model; gradients are averaged
    by bucketed all-reduces during backward."""

    name = "ddp"
    communicating_phase = "backward+all-reduce"  # the watchdog's name for the last micro-step's backward

    def __init__(self, module: nn.Module, cfg: TrainConfig, ctx: DistributedContext):
        self.module, self.ctx = module, ctx
        self.ddp: DDP | None = None
        self.model: nn.Module = module
        if ctx.world_size > 1:
            device = ctx.device
            self.ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                           bucket_cap_mb=cfg.bucket_cap_mb, static_graph=cfg.static_graph,
                           gradient_as_bucket_view=cfg.gradient_as_bucket_view)
            self.model = self.ddp
        if cfg.compile:
            self.model = torch.compile(self.model)

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a micro-step's forward and backward: no gradient all-reduce unless it is the `last`."""
        return contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm running statistics). All ranks.

        DDP broadcasts them at the start of each forward, so after the last forward every rank holds the
        statistics of its own batches. Evaluating, checkpointing and exporting must all see one model: the
        one rank 0 saves. Training is unchanged, since the next forward would broadcast the same values.
        """
        if self.ddp is not None:
            for buffer in self.module.buffers():
                dist.broadcast(buffer, src=0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state, as rank 0 checkpoints and exports it (call `sync_buffers` first)."""
        return self.module.state_dict()

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Prove that DDP kept the ranks' parameters bitwise identical (a silent divergence is the worst bug).

        A fingerprint per parameter (sum and sum of squares in float64) is gathered on the control group.
        Must be called on all ranks.
        """
        if self.ctx.world_size == 1:
            return
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        prints = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()])
                              for _, p in named]).flatten().cpu()
        gathered = self.ctx.gather_floats(prints.tolist())
        for rank, theirs in enumerate(gathered[1:], start=1):
            if theirs != gathered[0]:
                first = next(i for i, (a, b) in enumerate(zip(theirs, gathered[0])) if a != b) // 2
                raise TrainingError(f"replicas diverged: rank {rank} ({self.ctx.hosts[rank]}) differs from rank 0 "
                                    f"in parameter {named[first][0]}")
        log.info("replicas identical across %d ranks (%d parameter tensors)", self.ctx.world_size, len(named))

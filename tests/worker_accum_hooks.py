"""A training worker that trains with the real Trainer while counting its gradient communication: DDP's
all-reduces, or under --strategy fsdp/hsdp the reduce-scatters of every FSDP unit.

Run under torchrun with 2 processes:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/worker_accum_hooks.py OUT.json \
        [ddptrain train flags]

It registers a communication hook on the trainer's DDP wrapper (the stock all-reduce, plus a counter), or
gives each FSDP unit the stock reduce-scatter plus a counter, and runs `Trainer.fit()` unchanged. The model's
training forwards are counted, so each hook call can be attributed to the micro-step whose backward pass
triggered it. Rank 0 writes OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddptrain.config import resolve_config
from ddptrain.loop.trainer import Trainer
from ddptrain.parallel.distributed import distributed


class CountingLoader:
    """Yields what the real loader yields; `taken` is the number of micro-batches handed out so far."""

    def __init__(self, loader):
        self.loader = loader
        self.taken = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.taken += 1
            yield batch


def main(argv: list[str]) -> None:
    out, cfg = Path(argv[0]), resolve_config(argv[1:])
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with distributed(cfg.backend, cfg.init_timeout_s, run_dir) as ctx:
        trainer = Trainer(cfg, ctx, run_dir)
        counter = CountingLoader(trainer.data.train)
        trainer.data.train = counter
        micro_of_call: list[int] = []  # for each hook call: index (from 0) of the micro-batch being trained
        # The trainer takes a step's micro-batches before its first forward (it counts their tokens first), so a
        # hook call belongs to the micro-batch of the latest training forward: each backward follows its own.
        forwards = [0]

        def count_forward(module, args):
            forwards[0] += module.training

        trainer.module.register_forward_pre_hook(count_forward)

        def counting_allreduce(state, bucket):
            micro_of_call.append(forwards[0] - 1)
            return default_hooks.allreduce_hook(state, bucket)

        if trainer.parallel.sharded:
            from torch.distributed.fsdp import FSDPModule
            from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

            class CountingReduceScatter(DefaultReduceScatter):
                def __call__(self, *args, **kwargs):
                    micro_of_call.append(forwards[0] - 1)
                    return super().__call__(*args, **kwargs)

            for unit in trainer.module.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_custom_reduce_scatter(CountingReduceScatter())
        else:
            trainer.parallel.ddp.register_comm_hook(None, counting_allreduce)
        summary = trainer.fit()
        if ctx.is_main:
            out.write_text(json.dumps({"world_size": ctx.world_size, "micro_batches": counter.taken,
                                       "steps": summary["step"], "hook_calls": micro_of_call}))


if __name__ == "__main__":
    main(sys.argv[1:])

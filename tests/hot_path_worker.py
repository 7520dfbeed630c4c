"""Counts reads of tensor values by the host during non-log steps of the real Trainer.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/hot_path_worker.py OUT.json [flags]

Every way Python code can pull a tensor's value to the host — `.item()`, `.tolist()`, `.numpy()`, `.cpu()`,
`.nonzero()`, truth value, `float()`, `int()`, use as an index, formatting — is wrapped on `torch.Tensor`
and counted while optimizer steps 2..log_interval-1 run: the steps that are not log steps, each from the
fetch of its first micro-batch to the next step's (train_step, scheduler, the step-boundary checks). On a
GPU each of these waits for the device, so a clean count is what keeps the device fed.

One read is expected and counted apart: `LaggedVote.drain`, the preemption/timed-save flags all-reduced on
the gloo control group between steps. That tensor is built on the CPU from Python bools on every device, so
reading it never waits for an accelerator.

Alongside, it records the step settings as the live objects hold them (the optimizer, the DDP wrapper, the
train loader), how each step's `zero_grad` left the gradients, and how `train_step` moved each micro-batch
to the device. Rank 0 writes OUT.json.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.probe import StepProbe
from ddptrain.config import resolve_config
from ddptrain.loop.trainer import Trainer
from ddptrain.parallel.distributed import distributed

HOST_READS = ("item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__float__", "__int__", "__index__",
              "__format__", "__repr__")
CONTROL_FLAGS = ("wait", str(Path("ddptrain") / "parallel" / "distributed.py"))


class HostReadCounter:
    def __init__(self) -> None:
        self.active = False
        self.reads: list[dict[str, Any]] = []
        self.control_reads = 0
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> HostReadCounter:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def counted(tensor: torch.Tensor, *args: Any, _name: str = name, _original: Any = original,
                        **kwargs: Any) -> Any:
                if self.active:
                    caller = sys._getframe(1).f_code
                    if caller.co_name == CONTROL_FLAGS[0] and caller.co_filename.endswith(CONTROL_FLAGS[1]):
                        self.control_reads += 1
                    else:
                        where = "".join(traceback.format_stack(limit=6)[:-1])
                        self.reads.append({"method": _name, "device": str(tensor.device), "where": where})
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)


def live_settings(trainer: Trainer) -> dict[str, Any]:
    """The settings that keep a step cheap, read off the objects the Trainer built."""
    ddp, loader = trainer.parallel.ddp, trainer.data.train
    return {"fused": trainer.optimizer.defaults.get("fused"), "optimizer": type(trainer.optimizer).__name__,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view, "static_graph": ddp.static_graph,
            "bucket_bytes_cap": ddp.bucket_bytes_cap, "num_workers": loader.num_workers,
            "persistent_workers": loader.persistent_workers, "pin_memory": loader.pin_memory,
            "prefetch_factor": loader.prefetch_factor}


def trace_zero_grad(trainer: Trainer) -> list[tuple[int, int]]:
    """Per `zero_grad` call: (parameters with a .grad before it, after it)."""
    calls: list[tuple[int, int]] = []
    zero_grad = trainer.optimizer.zero_grad

    def traced(*args: Any, **kwargs: Any) -> None:
        before = sum(p.grad is not None for p in trainer.stepper.params)
        zero_grad(*args, **kwargs)
        calls.append((before, sum(p.grad is not None for p in trainer.stepper.params)))

    trainer.optimizer.zero_grad = traced
    return calls


class DeviceMoves:
    """The `non_blocking` argument of every Tensor.to that moves a training batch (ddptrain.data.batch.to_device,
    called from StepRunner.run) while active."""

    def __init__(self) -> None:
        self.active = False
        self.non_blocking: list[bool] = []
        self._original = torch.Tensor.to

    def __enter__(self) -> DeviceMoves:
        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            frame = sys._getframe(1)
            moved_by_batch = frame.f_code.co_filename.endswith("batch.py")
            while frame is not None and frame.f_code.co_filename.endswith("batch.py"):
                frame = frame.f_back  # to_device recurses through the batch's structure
            caller = frame.f_code if frame is not None else None
            if (self.active and moved_by_batch and caller is not None and caller.co_name == "run"
                    and caller.co_filename.endswith("step.py")):
                self.non_blocking.append(kwargs.get("non_blocking", False))
            return self._original(tensor, *args, **kwargs)

        torch.Tensor.to = to
        return self

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.to = self._original


def main(argv: list[str]) -> None:
    out, cfg = Path(argv[0]), resolve_config(argv[1:])
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (distributed(cfg.backend, cfg.init_timeout_s, run_dir) as ctx, HostReadCounter() as counter,
          DeviceMoves() as moves):
        trainer = Trainer(cfg, ctx, run_dir)
        zero_grads = trace_zero_grad(trainer)
        counted_steps = []

        def on_boundary(steps_done: int) -> None:
            # Count from the start of step 2 (step 1 warms up) to the start of the first log step.
            counter.active = moves.active = 1 <= steps_done < cfg.log_interval - 1
            if counter.active:
                counted_steps.append(steps_done + 1)

        StepProbe(trainer, on_boundary)
        trainer.fit()
        counter.active = moves.active = False
        trainer.close()
        if ctx.is_main:
            out.write_text(json.dumps({"reads": counter.reads, "control_reads": counter.control_reads,
                                       "steps": counted_steps, "world_size": ctx.world_size,
                                       "settings": live_settings(trainer), "zero_grads": zero_grads,
                                       "non_blocking": moves.non_blocking}))


if __name__ == "__main__":
    main(sys.argv[1:])

"""The hand-written baseline: the loop a user writes with plain torch.distributed and no framework.

DistributedSampler, DataLoader, DDP, torch's SGD with its default settings, and the loss written out by hand
(`LOSSES`: cross-entropy of a classifier, or next-token cross-entropy of a language model); optionally
autocast (bf16), channels_last, torch.compile and gradient accumulation — with `no_sync`, or the seed
article's way, which all-reduces on every micro-step. It reads nothing back from the device per step: a
competent loop is the fair opponent, so every ratio measures the framework, not a careless baseline. Its
settings are torch's defaults, as a hand-written loop's would be (foreach SGD, DDP without
gradient_as_bucket_view); ddptrain's own defaults (fused SGD, gradients as bucket views) are part of what
the ratio measures.

It borrows only the model and dataset definitions from ddptrain (the same network and data on both sides).
The benchmark worker runs it in-process, interleaved with ddptrain's Trainer; `main` is the bare torchrun
script of the startup benchmark:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.raw_loop --out T.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def classification_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A (batch, seq_len + 1) window: the model reads all but the last token and predicts each next one."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def shifted_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A padded, masked batch's target for each position: the next label, -100 where nothing counts."""
    return F.pad(batch["labels"][:, 1:], (0, 1), value=-100)


def masked_token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed next-token cross-entropy of a padded, masked batch (the caller divides by the step's count)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted_labels(batch).reshape(-1),
                           reduction="sum")


LOSSES = {"classification": classification_loss, "language_model": next_token_loss}  # by ddptrain's --task


class RawLoop:
    """One DDP training loop over `dataset`; `run(n)` trains n optimizer steps and returns the seconds.

    Must be driven on all ranks in step. `micro` is the micro-step in progress (read by counting hooks).
    """

    def __init__(self, model: nn.Module, dataset: Dataset, *, device: torch.device, batch_size: int,
                 num_workers: int, lr: float, momentum: float, weight_decay: float, seed: int,
                 grad_accum_steps: int = 1, sync_every_micro_step: bool = False, use_amp: bool = False,
                 channels_last: bool = False, compile: bool = False, task: str = "classification",
                 data_parallel: bool = False, strategy: str = "ddp"):
        self.device, self.accum, self.use_amp = device, grad_accum_steps, use_amp
        self.loss_of = LOSSES[task]
        self.sync_every_micro_step, self.channels_last = sync_every_micro_step, channels_last
        model = model.to(device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        world = dist.get_world_size() if dist.is_initialized() else 1
        # One process has nothing to all-reduce; ddptrain does not wrap it either. `data_parallel`: the seed
        # explainer's nn.DataParallel instead, one process driving every visible GPU (batch_size is then global).
        # `strategy` "fsdp": the hand-written FSDP2 loop instead, each of the model's blocks sharded, then the root.
        self.sharded = strategy != "ddp"
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            for block in [m for m in model.modules() if isinstance(m, tuple(model.fsdp_blocks))]:
                fully_shard(block)
            fully_shard(model)
        wrap = world > 1 and not self.sharded
        self.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if wrap else None
        self.model: nn.Module = self.ddp if self.ddp is not None else nn.DataParallel(model) if data_parallel else model
        if compile:
            self.model = torch.compile(self.model)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed,
                                          drop_last=True)
        # Padded, masked items (dicts of 1-D sequences) are padded by the collate a user would borrow, and the
        # loss is token-weighted over the whole step by hand (`_masked_step`).
        self.masked = isinstance(dataset[0], dict)
        collate = None
        if self.masked:
            from ddptrain.data.batch import collate
        self.world = world
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, num_workers=num_workers,
                                 pin_memory=device.type == "cuda", drop_last=True, collate_fn=collate)
        self.epoch = 0
        self.micro = 0
        self._batches = None

    def _next_batch(self) -> Any:
        if self._batches is None:
            self.sampler.set_epoch(self.epoch)
            self._batches = iter(self.loader)
        try:
            return next(self._batches)
        except StopIteration:
            self.epoch, self._batches = self.epoch + 1, None
            return self._next_batch()

    def close(self) -> None:
        """Drop the epoch's batch iterator: its loader workers stop now, not at a later garbage collection."""
        self._batches = None

    def _to_device(self, batch: Any) -> Any:
        """A tensor (token windows) or an (inputs, targets) pair, on the device; images channels_last if asked."""
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, dict):
            return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        inputs, targets = (t.to(self.device, non_blocking=True) for t in batch)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets

    def step(self) -> None:
        if self.masked:
            return self._masked_step()
        self.optimizer.zero_grad(set_to_none=True)
        for micro in range(self.accum):
            self.micro = micro
            batch = self._to_device(self._next_batch())
            skip_sync = self.ddp is not None and micro < self.accum - 1 and not self.sync_every_micro_step
            if self.sharded and self.accum > 1:
                self.model.set_requires_gradient_sync(micro == self.accum - 1)
            with self.ddp.no_sync() if skip_sync else contextlib.nullcontext():
                with torch.autocast(self.device.type, torch.bfloat16, enabled=self.use_amp):
                    loss = self.loss_of(self.model, batch)
                (loss / self.accum).backward()
        self.optimizer.step()

    def _masked_step(self) -> None:
        """The careful hand-written step for padded, masked batches: the step's tokens counted from the labels
        and all-reduced (under the first forward) before any backward, each micro-batch's summed loss scaled
        by world / that count (DDP averages over the world)."""
        self.optimizer.zero_grad(set_to_none=True)
        batches = [self._next_batch() for _ in range(self.accum)]
        count = torch.tensor([float(sum(int((shifted_labels(b) != -100).sum()) for b in batches))])
        work = dist.all_reduce(count, async_op=True) if self.world > 1 else None
        for micro, batch in enumerate(batches):
            self.micro = micro
            batch = self._to_device(batch)
            skip_sync = self.ddp is not None and micro < self.accum - 1
            with self.ddp.no_sync() if skip_sync else contextlib.nullcontext():
                with torch.autocast(self.device.type, torch.bfloat16, enabled=self.use_amp):
                    total = masked_token_loss_sum(self.model, batch)
                if work is not None:
                    work.wait()
                    work = None
                (total * (self.world / count.item())).backward()
        self.optimizer.step()

    def run(self, steps: int) -> float:
        """Train `steps` optimizer steps; wall seconds from the first to the device finishing the last."""
        sync_device(self.device)
        started = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync_device(self.device)
        return time.perf_counter() - started


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the bare torchrun script of the startup benchmark ---------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="bare DDP script: time to the first optimizer step")
    parser.add_argument("--out", required=True, help="rank 0 writes {'first_step_time': unix seconds} here")
    parser.add_argument("--model", choices=("mini_resnet", "mlp"), default="mini_resnet")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--image_size", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--dataset_size", type=int, default=10000)
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--timed_steps", type=int, default=0, help="then time this many steps (after 2 warm-up "
                        "steps) and write their seconds to --out as 'steps_s'")
    parser.add_argument("--use_amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--tensor_dataset", action="store_true", help="the images as a torch TensorDataset "
                        "in memory (benchmarks.workloads.image_tensors), not ddptrain's SyntheticImages")
    parser.add_argument("--data_parallel", action="store_true", help="one process, nn.DataParallel over every "
                        "visible GPU, --batch_size per GPU (no torchrun)")
    args = parser.parse_args(argv)
    if args.data_parallel and not torch.cuda.is_available():
        print("--data_parallel needs CUDA devices: torch sees none", file=sys.stderr)
        raise SystemExit(2)

    from ddptrain.data.pipeline import SyntheticImages  # the same network and data as ddptrain trains
    from ddptrain.models import MLP, MiniResNet

    cuda = torch.cuda.is_available()
    if not args.data_parallel:
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(42)
    model = (MiniResNet(3, 10, args.width) if args.model == "mini_resnet"
             else MLP(3 * args.image_size ** 2, 10, hidden=args.width))
    if args.tensor_dataset:
        from benchmarks.workloads import image_tensors

        data = image_tensors(args.dataset_size, 3, args.image_size, 10)
    else:
        data = SyntheticImages(args.dataset_size, 10, 3, args.image_size, seed=42)
    gpus = torch.cuda.device_count() if args.data_parallel else 1
    loop = RawLoop(model, data, device=device, batch_size=args.batch_size * gpus, num_workers=args.num_workers,
                   lr=0.1, momentum=0.9, weight_decay=5e-4, seed=42, use_amp=args.use_amp,
                   data_parallel=args.data_parallel)
    loop.run(1)
    main_rank = args.data_parallel or dist.get_rank() == 0
    record: dict[str, Any] = {"first_step_time": time.time()}
    if main_rank:
        Path(args.out).write_text(json.dumps(record))
    if args.steps > 1:
        loop.run(args.steps - 1)
    if args.timed_steps:
        loop.run(2)
        record["steps_s"], record["steps"] = loop.run(args.timed_steps), args.timed_steps
        world = dist.get_world_size() if dist.is_initialized() else 1
        record["global_batch_size"] = args.batch_size * gpus * world
        if main_rank:
            Path(args.out).write_text(json.dumps(record))
    loop.close()
    # DDP's reducer goes before its process group: the other order can abort at exit ("terminate called without
    # an active exception", seen once in the suite's tiny bench). The loop may sit in reference cycles, so
    # collect it now, as ddptrain's own teardown does (parallel/distributed.py, `_teardown`).
    del loop
    gc.collect()
    if dist.is_initialized():
        dist.barrier()  # no rank tears down its connections while a peer still uses them
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

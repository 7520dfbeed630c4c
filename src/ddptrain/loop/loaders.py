"""Which loaders a run reads through: map-style datasets through the global-order sampler, iterable ones as
partitioned streams (streams.py); the eval split sharded so that each sample is read once."""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from torch.utils.data import DataLoader, IterableDataset

from ddptrain.config import DataSettings, TrainingSettings
from ddptrain.data import packing
from ddptrain.data.pipeline import BatchLayout, GlobalOrderSampler, Reading, ShardedEvalSampler, make_loader, mix_seed
from ddptrain.data.streams import StreamPosition, StreamShard, readers_per_rank, stream_loader
from ddptrain.errors import UsageError
from ddptrain.parallel.distributed import DistributedContext

log = logging.getLogger("ddptrain")

# torch says this in four lines for each loader of each rank (six times in a 2-process run); note_loader_processes
# says it once.
warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes", category=UserWarning)


@dataclass
class Loaders:
    layout: BatchLayout
    train: DataLoader
    eval: DataLoader | None
    sampler: GlobalOrderSampler | None  # map-style: set its position before each epoch
    stream: StreamShard | None  # iterable: this rank's share of the stream, and its position
    stream_position: StreamPosition | None
    num_train: int | None  # samples of a map-style training set
    steps_per_epoch: int | None
    background: bool  # whether a thread takes the training batches off the training thread (_in_background)

    def total_steps(self, epochs: int, max_steps: int, say: bool = False) -> int:
        """Optimizer steps in the run: --max_steps where it is given (as in transformers and TRL: as many epochs
        as it takes), else --epochs over the training set. `say`: one line where --max_steps outlasts --epochs."""
        if self.stream is not None or not max_steps:
            return max_steps or epochs * self.steps_per_epoch
        if say and max_steps > epochs * self.steps_per_epoch:
            log.info("--max_steps %d decides the run's length: %.1f epochs of %d steps (--epochs %d does not limit "
                     "it)", max_steps, max_steps / self.steps_per_epoch, self.steps_per_epoch, epochs)
        return max_steps

    def close(self) -> None:
        """Stop the loaders' worker processes now. Safe to call twice; a later epoch would start new ones.

        A Trainer sits in reference cycles (forward hooks hold bound methods), so without this it is freed
        by the cyclic garbage collector, which can finalize a loader's queues before the loader's iterator
        asks its workers to stop: the stop message is then never sent and every worker costs a 5 s join
        timeout. Dropping the iterators while everything is alive shuts the workers down in milliseconds.
        """
        for loader in (self.train, self.eval):
            if loader is not None:
                loader._iterator = None  # persistent workers: the iterator's __del__ sends them the stop


def build_loaders(data: DataSettings, training: TrainingSettings, ctx: DistributedContext, layout: BatchLayout,
                  train_ds: Any, eval_ds: Any, collate_fn: Callable[[list[Any]], Any] | None = None) -> Loaders:
    """The run's loaders, from the [data] and [training] sections; `collate_fn` (fit's) turns a list of items into
    a batch (default: see data.Collate). A rank reads as its data-parallel rank: under --tp the ranks of a group
    read the same batches, with the same seeds."""
    note_loader_processes(data.num_workers, ctx)
    device, seed = ctx.device, training.seed
    if data.packing:  # the bins are the samples: the global order, resume and a new world size need nothing else
        train_ds, eval_ds = (packing.packed(rows, data.seq_len, seed, data.pad_token_id, what)
                             for rows, what in ((train_ds, "training"), (eval_ds, "eval")))
    elif data.task == "language_model" and ctx.is_main:
        packing.hint(train_ds, training.batch_size, seed)
    reading = Reading(data.num_workers, seed, data.pad_token_id, training.batch_size)
    train_seed, eval_seed = mix_seed(seed, 4, ctx.dp_rank), mix_seed(seed, 5, ctx.dp_rank)
    if isinstance(eval_ds, IterableDataset):
        eval_loader = stream_loader(StreamShard(eval_ds, seed, ctx.dp_rank, ctx.dp_size), reading, device,
                                    drop_last=False, seed=eval_seed, collate_fn=collate_fn)
    elif eval_ds is not None and len(eval_ds) > 0:
        eval_sampler = ShardedEvalSampler(len(eval_ds), training.batch_size, ctx.dp_rank, ctx.dp_size)
        eval_loader = make_loader(eval_ds, eval_sampler, reading, device, seed=eval_seed, collate_fn=collate_fn)
    else:
        eval_loader = None
    if isinstance(train_ds, IterableDataset):
        if not training.max_steps:
            raise UsageError("the training dataset is an IterableDataset (a stream without a length): pass "
                             "--max_steps to say how long to train")
        stream = StreamShard(train_ds, seed, ctx.dp_rank, ctx.dp_size)
        position = StreamPosition(ctx.dp_size * readers_per_rank(data.num_workers), ctx.dp_rank, data.num_workers)
        train = stream_loader(stream, reading, device, drop_last=True, seed=train_seed, collate_fn=collate_fn)
        return Loaders(layout, train, eval_loader, None, stream, position, None, None, _in_background(train, device))
    num_train = len(train_ds)
    steps_per_epoch = layout.steps_per_epoch(num_train)
    if steps_per_epoch == 0:
        raise UsageError(f"--batch_size {training.batch_size} x {ctx.dp_size} processes x --grad_accum_steps "
                         f"{training.grad_accum_steps} = {layout.global_batch_size} exceeds the {num_train} training "
                         "samples; lower one of them")
    if ctx.is_main:
        say_left_out(num_train, layout)
    sampler = GlobalOrderSampler(num_train, layout, ctx.dp_rank, seed)
    train = make_loader(train_ds, sampler, reading, device, seed=train_seed, collate_fn=collate_fn)
    return Loaders(layout, train, eval_loader, sampler, None, None, num_train, steps_per_epoch,
                   _in_background(train, device))


def say_left_out(num_train: int, layout: BatchLayout) -> None:
    """One line where whole global batches leave samples out of every epoch (drop_last: every step has the same
    shape on every rank), with a per-process batch size that would leave none, where there is one."""
    left = num_train - layout.steps_per_epoch(num_train) * layout.global_batch_size
    if not left:
        return
    others = layout.world_size * layout.grad_accum_steps
    fits = next((b for b in range(layout.micro_batch_size - 1, 0, -1) if num_train % (b * others) == 0), None)
    log.info("%d of the %d training samples are left out of each epoch (%.0f %%: a global batch of %d takes %d "
             "whole ones); each epoch's shuffle leaves out others. %s", left, num_train, 100 * left / num_train,
             layout.global_batch_size, num_train - left,
             f"--batch_size {fits} leaves none" if fits else "A global batch that divides the samples leaves none")


def _in_background(train: DataLoader, device: Any) -> bool:
    """With loader workers on CPU, a thread takes their batches off the training thread (on CUDA, torch's
    pin-memory thread does). Without workers, reading a sample seeds the global RNGs: no thread then."""
    return device.type == "cpu" and train.num_workers > 0


def note_loader_processes(workers: int, ctx: DistributedContext) -> None:
    """One warning on rank 0 when this host's ranks start more loader workers than the ranks may use cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = workers * ctx.local_world_size  # the training loaders' workers, all reading at once
    if ctx.is_main and busy > cores:
        log.warning("--num_workers %d on %d ranks of this host: %d training-loader processes for %d CPU cores; "
                    "lower --num_workers (0 loads in the training process) if loading slows training",
                    workers, ctx.local_world_size, busy, cores)

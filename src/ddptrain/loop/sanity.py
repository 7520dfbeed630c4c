"""The sanity batch: before the first step, every rank takes one batch of the run's own data through its
collate, the task's loss and the task's eval metrics, so that a user's mistake is one line naming the plug-in,
the item or key and the fix (exit 2), not a traceback at the first step or, for a metric, after a whole epoch.

Checked: no item is None and the items have one structure (same keys, same kinds of values), under ddptrain's
own collate; token windows are not given to a classification or regression task; float64 inputs that a
float32 model cannot take; the loss is (loss, metrics) with a scalar loss or a LossSum; under DDP, every
trainable parameter gets a gradient (else --find_unused_parameters); the eval metrics are (sum, count) pairs
of tensors. The ranks agree: one rank's finding stops every rank with the same message.

It leaves training as it was. Items are read through `SeededSamples` (the global RNGs put back) from a
shallow copy of the dataset (what a read opens lazily stays with the copy), a plug-in task is called as a
shallow copy (a task that counts its calls counts the same), the model's buffers are put back (BatchNorm
statistics) and its gradients cleared. The model runs in eval mode throughout, so a training-mode forward is
never spent on it (a model that counts its training forwards counts the same). Its cost: `--batch_size`
items, two forwards and, under DDP, one backward. A stream (IterableDataset) is not read: only its readers may start it.

`usage_error_of` turns torch's errors that are a user's mistake the first batch cannot see (DDP's unused
parameters at a later step) into the same kind of one line.
"""

from __future__ import annotations

import copy
import logging
import numbers
import re
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from ddptrain.config import DataSettings
from ddptrain.data.batch import to_device
from ddptrain.data.packing import check_model as check_packable
from ddptrain.data.pipeline import SeededSamples
from ddptrain.errors import TrainingError, UsageError, first_line
from ddptrain.loop.tasks import Classification, LossSum, PluginTask, Regression
from ddptrain.models import eval_mode
from ddptrain.parallel import vocab
from ddptrain.parallel.distributed import DistributedContext
from ddptrain.parts import Parts

__all__ = ["check_first_batch", "plugin_names", "usage_error_of"]
log = logging.getLogger("ddptrain")


def check_first_batch(trainer: Any, names: dict[str, str], autocast: Any, channels_last: bool) -> None:
    """Run the checks above on this rank's first `--batch_size` items (items rank x batch_size onwards of the
    training set); raise the same UsageError on every rank if any rank finds a mistake, naming the dataset, model
    and task as `names` does (`plugin_names`). All ranks; call once the Trainer has its task, loaders and wrapped
    model, and before the per-rank RNG streams are seeded (the model's dropout draws are then of no consequence).
    What the check needs to know it reads from those objects, not from the config.
    """
    if trainer.data.stream is not None:
        return
    if getattr(trainer.data.train.dataset.dataset, "documents_apart", False):  # packed rows, or windows alike
        check_packable(trainer.module, names["model"])  # the same on every rank: the model's own structure
    batch = _FirstBatch(trainer, names, autocast, channels_last)
    steps = [batch.read, batch.train_loss, batch.eval_metrics]
    if trainer.parallel.sharded or any(isinstance(m, nn.SyncBatchNorm) for m in trainer.module.modules()):
        # Forwards that communicate (parameter gathers, SyncBatchNorm's statistics): every rank runs each, or none.
        for step in steps:
            _agreed(trainer.ctx, step)
    else:
        _agreed(trainer.ctx, lambda: [step() for step in steps])


class _FirstBatch:
    def __init__(self, trainer: Any, names: dict[str, str], autocast: Any, channels_last: bool):
        self.trainer, self.ctx, self.module, self.autocast = trainer, trainer.ctx, trainer.module, autocast
        self.task, self.channels_last = _own_copy(trainer.task), channels_last
        self.dataset_name, self.model_name, self.task_name = names["dataset"], names["model"], names["task"]
        self.batch: Any = None

    def read(self) -> None:
        """This rank's items, checked, collated and on the device."""
        loader, size = self.trainer.data.train, self.trainer.data.layout.micro_batch_size
        start = self.ctx.dp_rank * size  # the loaders' checks leave at least world x batch_size items
        samples = loader.dataset  # SeededSamples: the dataset and the run's seed
        keys = [(0, i) for i in range(start, start + size)]
        pairs = SeededSamples(_shallow_copy(samples.dataset), samples.seed).__getitems__(keys)
        collate = loader.collate_fn
        if collate.batch_of is None:  # ddptrain's collate: it stacks items of one structure
            self._check_items(pairs)
            try:
                _, batch = collate(pairs)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise UsageError(f"{self.dataset_name}: items {start}-{start + size - 1} do not stack into a batch "
                                 f"({type(exc).__name__}: {first_line(exc)}); give every item the same shapes, or "
                                 "the dataset a collate_fn") from None
        else:
            _, batch = collate(pairs)
        if isinstance(self.task, (Classification, Regression)) and isinstance(batch, torch.Tensor):
            if not batch.is_floating_point():
                raise UsageError(f"{self.dataset_name} gives token windows (batches of {tuple(batch.shape)} token "
                                 f"ids), which {self.task_name} cannot read: train on them with --task "
                                 "language_model and a language model (--model gpt)")
            raise UsageError(f"{self.dataset_name} gives items of one tensor, without a target, which "
                             f"{self.task_name} cannot read: return (inputs, target) pairs")
        self.batch = to_device(batch, self.ctx.device, self.channels_last)

    def _check_items(self, pairs: list[tuple[int, Any]]) -> None:
        for index, item in pairs:
            if item is None:
                raise UsageError(f"{self.dataset_name}: item {index} is None; return a sample for every index "
                                 "(leave out the ones that fail to load when you build the dataset), or give the "
                                 "dataset a collate_fn that drops None items")
        first_index, first = pairs[0]
        for index, item in pairs[1:]:
            difference = _difference(first, item, "")
            if difference is not None:
                found, expected = difference
                raise UsageError(f"{self.dataset_name}: item {index} {found} where item {first_index} {expected}; "
                                 "give every item the same structure (the same keys, the same kinds of values)")

    def train_loss(self) -> None:
        """The training call of the task, with the model in eval mode (as a validation sanity check runs it):
        the loss's contract and, under DDP, a gradient for every trainable parameter. Eval mode keeps the
        sanity batch off what training-mode forwards change or count (dropout draws, batch statistics, a
        model's own count of its training steps)."""
        module = self.module
        ddp = getattr(self.trainer.parallel, "ddp", None)
        every_parameter = ddp is not None and not (ddp.find_unused_parameters or ddp.static_graph)
        buffers = [buffer.detach().clone() for buffer in module.buffers()]
        try:
            with torch.set_grad_enabled(every_parameter), eval_mode(module), self.autocast():
                loss = self._loss(self._call())
            if every_parameter:
                loss.backward()
                unused = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
                if unused:
                    raise UsageError(_unused_message(self.model_name, unused, f"{self.task_name}'s loss"))
        finally:
            module.zero_grad(set_to_none=True)
            with torch.no_grad():
                for buffer, saved in zip(module.buffers(), buffers):
                    buffer.copy_(saved)

    def eval_metrics(self) -> None:
        """The metrics in eval mode, as `Evaluator` sums them; only where there is an eval set."""
        if self.trainer.data.eval is None:
            return
        with torch.no_grad(), eval_mode(self.module), self.autocast():
            result = self._call()
        self._loss(result)
        metrics = result[1]
        if not isinstance(metrics, Mapping):
            raise UsageError(f"{self.task_name}: loss(model, batch) returned {_describe(metrics)} as its metrics; "
                             "return a dict {name: (sum over the batch, count)}")
        for name, value in metrics.items():
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                raise UsageError(f"{self.task_name}: metric {name!r} is {_describe(value)}, not a (sum, count) "
                                 f"pair; return {{{name!r}: (sum over the batch, count)}}: eval reports the sums "
                                 "over the count of the whole eval set, across ranks")
            total, count = value
            if not (isinstance(total, torch.Tensor) and total.dim() == 0):
                raise UsageError(f"{self.task_name}: metric {name!r} has {_describe(total)} as its sum; give a "
                                 "scalar tensor, e.g. (predictions == labels).sum(), not int(...) or .item()")
            if not (isinstance(count, numbers.Real) or isinstance(count, torch.Tensor) and count.dim() == 0):
                raise UsageError(f"{self.task_name}: metric {name!r} has {_describe(count)} as its count; give a "
                                 "number or a scalar tensor")

    def _call(self) -> Any:
        """`task.loss(module, batch)`; a dtype error of float64 inputs is the dataset's mistake, floats given to
        a model that looks up token ids the pairing's."""
        try:
            return self.task.loss(self.module, self.batch)
        except (RuntimeError, TypeError) as exc:
            floats = _paths(self.batch, "", torch.is_floating_point)
            if floats and ("'indices'" in str(exc) or vocab.NOT_TOKEN_IDS in str(exc)):
                raise UsageError(f"{self.model_name} looks up token ids (an embedding), but {self.dataset_name} "
                                 f"gives it floating-point values at {floats[0]}; train it on token data "
                                 "(--task language_model with a text --dataset), or pick a model for these "
                                 "inputs") from None
            if isinstance(exc, TypeError):
                raise
            wide = _paths(self.batch, "", lambda tensor: tensor.dtype == torch.float64)
            dtype = next((p.dtype for p in self.module.parameters() if p.is_floating_point()), torch.float32)
            if not wide or dtype == torch.float64 or "double" not in str(exc).lower():
                raise
            name = str(dtype).removeprefix("torch.")
            fix = ".float()" if dtype == torch.float32 else f".to(torch.{name})"
            raise UsageError(f"{self.dataset_name}: the batch holds float64 at {wide[0]}, but {self.model_name}'s "
                             f"parameters are {name} ({type(exc).__name__}: {first_line(exc)}); return {name} "
                             f"from the dataset: {fix} on a tensor (numpy arrays and Python floats become "
                             "float64)") from None

    def _loss(self, result: Any) -> torch.Tensor:
        """What backward runs on, after checking that `result` is (a scalar loss or a LossSum, metrics)."""
        if isinstance(result, LossSum) or not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise UsageError(f"{self.task_name}: loss(model, batch) returned {_describe(result)}; return a pair "
                             "(loss, metrics), with metrics {} in training")
        loss = result[0]
        if isinstance(loss, LossSum):
            if not (isinstance(loss.total, torch.Tensor) and loss.total.dim() == 0):
                raise UsageError(f"{self.task_name}: the LossSum's total is {_describe(loss.total)}; sum it over the "
                                 "batch (.sum()) to a scalar")
            return loss.total
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise UsageError(f"{self.task_name}: loss(model, batch) returned {_describe(loss)} as its loss, which "
                             "must be a scalar; reduce it with .mean(), or return ddptrain.LossSum(losses.sum(), "
                             "len(losses))")
        return loss


def _agreed(ctx: DistributedContext, check: Callable[[], Any]) -> None:
    """`check()` on every rank; then every rank raises what the lowest failing rank found: its UsageError's
    message, else its exception (the failing rank re-raises its own, the others a TrainingError naming it)."""
    found: tuple[str, str] | None = None
    try:
        check()
    except UsageError as exc:
        found = ("usage", str(exc))
    except Exception as exc:
        error = exc
        found = ("error", f"{type(exc).__name__}: {first_line(exc)}")
    reports = ctx.all_gather_object(found)
    for kind in ("usage", "error"):
        for rank, report in enumerate(reports):
            if report is not None and report[0] == kind:
                log.debug("stopping: the first batch of rank %d: %s", rank, report[1])  # the rank log says why
                if kind == "usage":
                    raise UsageError(report[1])
                if found is not None and found[0] == "error":
                    raise error
                raise TrainingError(f"rank {rank} failed on its first batch: {report[1]}")


def _own_copy(task: Any) -> Any:
    """A plug-in task whose user object is a shallow copy: what the sanity calls set on it (a call counter)
    stays off the task training calls. The built-ins keep no state."""
    return PluginTask(_shallow_copy(task.task), task.ref) if isinstance(task, PluginTask) else task


def _shallow_copy(obj: Any) -> Any:
    try:
        return copy.copy(obj)
    except Exception:  # an object that refuses copying is read as it is
        return obj


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, numbers.Number) for v in value):
        return "sequence of numbers"  # token ids: any length (ddptrain's collate pads them)
    if isinstance(value, Mapping):
        return "dict"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return type(value).__name__


def _difference(first: Any, item: Any, where: str) -> tuple[str, str] | None:
    """(what `item` has, what `first` has) at the first place their structures differ, or None."""
    at = f" at {where}" if where else ""
    kinds = _kind(first), _kind(item)
    if kinds[0] != kinds[1]:
        return f"holds a {kinds[1]}{at}", f"holds a {kinds[0]}"
    if kinds[0] == "dict":
        if set(first) != set(item):
            return f"has keys {sorted(map(str, item))}{at}", f"has {sorted(map(str, first))}"
        parts = [(first[key], item[key], f"{where}[{key!r}]") for key in first]
    elif kinds[0] == "sequence":
        if len(first) != len(item):
            return f"has {len(item)} elements{at}", f"has {len(first)}"
        parts = [(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(first, item))]
    else:
        return None
    return next((d for a, b, w in parts if (d := _difference(a, b, w)) is not None), None)


def _paths(batch: Any, where: str, wanted: Callable[[torch.Tensor], bool]) -> list[str]:
    """Where `batch` holds tensors that are `wanted`, as [0] or ['x']."""
    if isinstance(batch, torch.Tensor):
        return [where or "the batch itself"] if wanted(batch) else []
    if isinstance(batch, Mapping):
        return [p for key, value in batch.items() for p in _paths(value, f"{where}[{key!r}]", wanted)]
    if isinstance(batch, (list, tuple)):
        return [p for i, value in enumerate(batch) for p in _paths(value, f"{where}[{i}]", wanted)]
    return []


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiouAEIOU" else f"a {name}"


def _unused_message(model_name: str, unused: list[str], by: str) -> str:
    shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
    which = f"{len(unused)} trainable parameter(s) ({shown})" if unused else "some trainable parameters"
    return (f"{model_name}: {which} got no gradient from {by}, which DDP cannot train: pass "
            "--find_unused_parameters, freeze them (requires_grad_(False)), or use them in the loss")


def plugin_names(data: DataSettings, parts: Parts) -> dict[str, str]:
    """How a message names the run's dataset, model and task: as the command line or `fit` gave them."""
    fit = "given to ddptrain.fit"
    return {"dataset": f"the train_data {fit}" if parts.datasets is not None else f"--dataset {data.dataset}",
            "model": f"the model {fit}" if parts.model is not None else f"--model {data.model}",
            "task": f"the task {fit}" if parts.task is not None else f"--task {data.task}"}


DDP_UNUSED = "Expected to have finished reduction in the prior iteration"


def usage_error_of(exc: BaseException, module: nn.Module | None, model_name: str) -> UsageError | None:
    """The UsageError that torch's `exc` stands for, naming the flag that fixes it; None for any other error.

    DDP's unused-parameter error at a step after the first (a head the loss uses only sometimes): its message
    numbers the unused parameters among the trainable ones of the rank that raised it; named here.
    """
    text = str(exc)
    if not (isinstance(exc, RuntimeError) and DDP_UNUSED in text):
        return None
    numbered = re.search(r"did not receive grad for rank \d+: ([\d ]+)", text)
    trainable = [name for name, p in module.named_parameters() if p.requires_grad] if module is not None else []
    indices = [int(i) for i in numbered.group(1).split()] if numbered else []
    unused = [trainable[i] for i in indices if i < len(trainable)]
    return UsageError(_unused_message(model_name, unused, "the loss of a step"))

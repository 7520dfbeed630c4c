"""Tasks: what one step computes from a batch — the loss to train on and the metrics to report.

A task is any object with `loss(model, batch) -> (loss, metrics)`:

- `loss` is either a `LossSum(total, count)` — the loss summed over the batch's counted units (tokens,
  samples, pixels) and how many units that sum covers — or a plain scalar, the mean over the batch.
  A `LossSum` is what makes N processes learn what one process learns when micro-batches count different
  numbers of units (padding, masked prompts): the trainer divides every micro-batch's sum by the count of
  the whole step, all ranks and all micro-batches together, so the update is the gradient of the
  unit-weighted mean over the global batch, whatever the padding, masking, world size or accumulation.
  The trainer gets that count before the forward, from `count(batch)`: it must count the units the sum
  covers (labels that are not -100, say). A plain mean keeps its old meaning: each micro-batch's mean weighs
  the same, so the update is the mean of the micro-batches' means — equal to one process on the global
  batch only when every micro-batch counts the same number of units.
- `metrics` is `{name: (sum, count)}` of tensors. Distributed eval all-reduces sums and counts and reports
  sum / count, so an eval metric is exact over the whole eval set, however it is split across ranks — never
  an average of per-rank averages. Include `"loss"` as a sum over the batch's units. Metrics are read at
  eval only (the module in eval mode); a task may return {} while `model.training`, as the built-ins do.

Optional: `unit` ("samples" or "tokens": what `count(batch)` counts, for throughput), `count(batch)`
(default: the leading size of the first tensor; called on the host batch before it moves to the device, so
it should not need a device), `count_is_fixed(batch)` (True when a batch of this kind counts the same units
on every rank — no masks, shapes fixed by the config — so the trainer needs no collective to know a step's
count; default False: one tiny all-reduce per step, started before the first forward and overlapped with
it), and `report(means) -> {name: value}` for metrics derived from the means (perplexity from the mean
loss, RMSE from the MSE). The built-ins below follow the same contract as a
`--task pkg.mod:fn` plug-in, whose `fn(cfg)` returns such an object.

Batches: the built-ins take a tuple `(inputs, targets)` or a dict in the Hugging Face convention — `labels`
(aligned with `input_ids` for language models, which the task shifts), `-100` for positions that do not
count, and every other key passed to the model as a keyword argument. A model may return the logits, or
an object or dict with `logits` (transformers' ModelOutput).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ddptrain.config import BUILTIN_TASKS, DataSettings
from ddptrain.errors import UsageError

Metrics = dict[str, tuple[torch.Tensor, torch.Tensor]]
IGNORE = -100  # the label of a position that does not count (padding, a masked prompt): PyTorch's and HF's


class LossSum(NamedTuple):
    """A loss given as a sum over counted units and their count; the trainer owns the division."""

    total: torch.Tensor  # scalar: the loss summed over the units
    count: torch.Tensor | int  # how many units `total` covers


class Task(Protocol):
    unit: str

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor | LossSum, Metrics]: ...

    def count(self, batch: Any) -> int: ...

    def report(self, means: dict[str, float]) -> dict[str, float]: ...


def first_tensor(batch: Any) -> torch.Tensor:
    """The first tensor met in a nested batch (dict, list, tuple, dataclass)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif isinstance(batch, dict):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        items = []
    for item in items:
        try:
            return first_tensor(item)
        except TypeError:
            continue
    raise TypeError(f"no tensor in a batch of type {type(batch).__name__}")


def logits_of(output: Any, task: str) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or an object or dict with `logits`."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise UsageError(f"--task {task}: the model returned a {type(output).__name__} without logits; return "
                         "the logits tensor, or an object or dict with a `logits` tensor")
    return logits


def _total(value: torch.Tensor) -> torch.Tensor:
    return torch.full((), value.numel(), dtype=torch.float64, device=value.device)  # a fill: no host copy


def _counted(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE).sum()


class Classification:
    """Cross-entropy of `model(inputs)` (batch, classes) against class indices; accuracy, optional top-k.

    A batch is `(inputs, labels)` or a dict with `labels` (the rest goes to the model); labels of -100 do
    not count."""

    unit = "samples"

    def __init__(self, top_k: int = 0):
        self.top_k = top_k

    def _forward(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, Mapping):
            if "labels" not in batch:
                raise UsageError(f"--task classification: a dict batch needs 'labels' (it has "
                                 f"{', '.join(map(repr, batch))})")
            labels, rest = batch["labels"], {k: v for k, v in batch.items() if k != "labels"}
            return logits_of(model(**rest), "classification"), labels
        inputs, labels = batch
        return logits_of(model(inputs), "classification"), labels

    def loss(self, model: nn.Module, batch: Any) -> tuple[LossSum, Metrics]:
        logits, labels = self._forward(model, batch)
        total = F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE)
        if model.training:
            return LossSum(total, _counted(labels)), {}  # metrics are read at eval only
        counted = labels != IGNORE
        logits, n = logits.detach(), counted.sum()
        metrics = {"loss": (total.detach(), n), "accuracy": (((logits.argmax(dim=1) == labels) & counted).sum(), n)}
        if self.top_k > 1:
            top = logits.topk(min(self.top_k, logits.shape[1]), dim=1).indices
            hit = (top == labels.unsqueeze(1)).any(dim=1) & counted
            metrics[f"top{self.top_k}_accuracy"] = (hit.sum(), n)
        return LossSum(total, n), metrics

    def count(self, batch: Any) -> int:
        if isinstance(batch, Mapping):
            return int(_counted(torch.as_tensor(batch["labels"])))
        return len(batch[1])  # (inputs, class indices): every sample counts

    def count_is_fixed(self, batch: Any) -> bool:
        return not isinstance(batch, Mapping)  # (inputs, class indices): one unit per sample

    def report(self, means: dict[str, float]) -> dict[str, float]:
        return means


class Regression:
    """Squared error of `model(inputs)` against float targets of the same shape, summed over every target
    element (the unit); MSE, MAE, RMSE."""

    unit = "samples"

    def loss(self, model: nn.Module, batch: Any) -> tuple[LossSum, Metrics]:
        inputs, targets = batch
        outputs = model(inputs)
        if outputs.shape != targets.shape:
            outputs = outputs.reshape(targets.shape)  # (batch, 1) predictions of (batch,) targets
        total = F.mse_loss(outputs, targets, reduction="sum")
        n = _total(targets)
        if model.training:
            return LossSum(total, targets.numel()), {}
        error = outputs.detach().float() - targets.float()
        squared = error.square().sum()
        return LossSum(total, targets.numel()), {"loss": (squared, n), "mse": (squared, n),
                                                 "mae": (error.abs().sum(), n)}

    def count(self, batch: Any) -> int:
        return batch[1].numel()

    def count_is_fixed(self, batch: Any) -> bool:
        return True

    def report(self, means: dict[str, float]) -> dict[str, float]:
        return {**means, "rmse": math.sqrt(means["mse"])}


class LanguageModel:
    """Next-token cross-entropy over the positions that count. Eval: loss and perplexity.

    A batch is (batch, seq_len + 1) token windows — the model sees all but the last token and predicts each
    next one — or a dict with `input_ids`, optional `attention_mask` and optional `labels` aligned with
    `input_ids` (the task shifts them, as transformers does; -100 does not count). Labels one longer than
    `input_ids` are a window's (`--packing` over `--dataset tokens`): label t + 1 is position t's target, the
    last one included. Without `labels` the target is the next token of `input_ids`, except where
    `attention_mask` is 0. The model returns (batch, length, vocab) logits, or an object or dict with `logits`.
    """

    unit = "tokens"

    def loss(self, model: nn.Module, batch: Any) -> tuple[LossSum, Metrics]:
        if isinstance(batch, Mapping):
            targets, kwargs = self._targets(batch)
            logits = logits_of(model(**kwargs), "language_model")
        else:
            tokens = batch if isinstance(batch, torch.Tensor) else batch[0]
            targets = tokens[:, 1:]
            logits = logits_of(model(tokens[:, :-1]), "language_model")
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum",
                                ignore_index=IGNORE)
        n = _counted(targets)
        if model.training:
            return LossSum(total, n), {}
        return LossSum(total, n), {"loss": (total.detach(), n)}

    @staticmethod
    def _targets(batch: Mapping) -> tuple[torch.Tensor, dict[str, Any]]:
        """(the label of each position: the next token, -100 where nothing counts, the model's kwargs)."""
        if "input_ids" not in batch:
            raise UsageError(f"--task language_model: a dict batch needs 'input_ids' (it has "
                             f"{', '.join(map(repr, batch))})")
        labels = batch.get("labels")
        kwargs = {k: v for k, v in batch.items() if k != "labels"}
        if labels is None:
            labels = batch["input_ids"]
            mask = batch.get("attention_mask")
            if mask is not None:
                labels = labels.masked_fill(mask == 0, IGNORE)
        # Position t predicts label t + 1: shift the labels, not the (length x vocab) logits, and let the
        # last position predict nothing (but a window's, whose next token is its last label).
        if labels.shape[-1] == batch["input_ids"].shape[-1] + 1:
            return labels[:, 1:], kwargs
        return F.pad(labels[:, 1:], (0, 1), value=IGNORE), kwargs

    def count(self, batch: Any) -> int:
        if isinstance(batch, Mapping):
            return int(_counted(self._targets(batch)[0]))
        tokens = batch if isinstance(batch, torch.Tensor) else batch[0]
        return tokens[:, 1:].numel()  # token ids: every position counts

    def count_is_fixed(self, batch: Any) -> bool:
        return not isinstance(batch, Mapping)  # token windows: the shape says it

    def report(self, means: dict[str, float]) -> dict[str, float]:
        return {**means, "perplexity": math.exp(min(means["loss"], 700.0))}


class PluginTask:
    """A user's task object, with the optional parts of the contract filled in."""

    def __init__(self, task: Any, ref: str):
        if not callable(getattr(task, "loss", None)):
            raise UsageError(f"--task {ref}: the function must return an object with a loss(model, batch) method")
        self.task, self.ref = task, ref
        self.unit = getattr(task, "unit", "samples")
        if self.unit not in ("samples", "tokens"):
            raise UsageError(f"--task {ref}: unit must be 'samples' or 'tokens', not {self.unit!r}")

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor | LossSum, Metrics]:
        return self.task.loss(model, batch)

    def count(self, batch: Any) -> int:
        count = getattr(self.task, "count", None)
        return int(count(batch)) if count is not None else len(first_tensor(batch))

    def count_is_fixed(self, batch: Any) -> bool:
        fixed = getattr(self.task, "count_is_fixed", None)
        return bool(fixed(batch)) if fixed is not None else False

    def report(self, means: dict[str, float]) -> dict[str, float]:
        report = getattr(self.task, "report", None)
        return report(means) if report is not None else means


TASK_CLASSES = (Classification, Regression, LanguageModel, PluginTask)


def build_task(data: DataSettings) -> Task:
    """The built-in task `--task` names (a 'pkg.mod:fn' plug-in is `loop.plugins`'s)."""
    if data.task == "classification":
        return Classification(data.top_k)
    if data.task == "regression":
        return Regression()
    if data.task == "language_model":
        return LanguageModel()
    raise UsageError(f"--task {data.task!r}: not a built-in ({', '.join(BUILTIN_TASKS)}) nor a 'pkg.mod:fn' plug-in")

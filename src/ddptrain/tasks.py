"""Tasks: what one step computes from a batch — the loss to train on and the metrics to report.

A task is any object with `loss(model, batch) -> (loss, metrics)`:

- `loss` is the scalar that backward runs on (a mean over the batch);
- `metrics` is `{name: (sum, count)}` of tensors. Distributed eval all-reduces sums and counts and reports
  sum / count, so an eval metric is exact over the whole eval set, however it is split across ranks — never
  an average of per-rank averages. Include `"loss"` as a sum over the batch's items. Metrics are read at
  eval only (the module in eval mode); a task may return {} while `model.training`, as the built-ins do.

Optional: `unit` ("samples" or "tokens": what `count(batch)` counts, for throughput), `count(batch)`
(default: the leading size of the first tensor), and `report(means) -> {name: value}` for metrics derived
from the means (perplexity from the mean loss, RMSE from the MSE). The built-ins below follow the same
contract as a `--task pkg.mod:fn` plug-in, whose `fn(cfg)` returns such an object.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ddptrain.config import BUILTIN_TASKS, TrainConfig, load_plugin
from ddptrain.errors import UsageError

Metrics = dict[str, tuple[torch.Tensor, torch.Tensor]]


class Task(Protocol):
    unit: str

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Metrics]: ...

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


def _total(value: torch.Tensor) -> torch.Tensor:
    return torch.full((), value.numel(), dtype=torch.float64, device=value.device)  # a fill: no host copy


def _sum_of_mean(mean: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A batch's loss sum from its mean: no second pass over logits that may be (tokens x vocab) large."""
    return mean.detach().double() * count


class Classification:
    """Cross-entropy of `model(inputs)` (batch, classes) against class indices; accuracy, optional top-k."""

    unit = "samples"

    def __init__(self, top_k: int = 0):
        self.top_k = top_k

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Metrics]:
        inputs, targets = batch
        logits = model(inputs)
        loss = F.cross_entropy(logits, targets)
        if model.training:
            return loss, {}  # metrics are read at eval only: no extra kernels in the training step
        logits, n = logits.detach(), _total(targets)
        metrics = {"loss": (_sum_of_mean(loss, n), n), "accuracy": ((logits.argmax(dim=1) == targets).sum(), n)}
        if self.top_k > 1:
            top = logits.topk(min(self.top_k, logits.shape[1]), dim=1).indices
            metrics[f"top{self.top_k}_accuracy"] = ((top == targets.unsqueeze(1)).any(dim=1).sum(), n)
        return loss, metrics

    def count(self, batch: Any) -> int:
        return len(batch[1])

    def report(self, means: dict[str, float]) -> dict[str, float]:
        return means


class Regression:
    """Mean squared error of `model(inputs)` against float targets of the same shape; MSE, MAE, RMSE."""

    unit = "samples"

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Metrics]:
        inputs, targets = batch
        outputs = model(inputs)
        if outputs.shape != targets.shape:
            outputs = outputs.reshape(targets.shape)  # (batch, 1) predictions of (batch,) targets
        loss = F.mse_loss(outputs, targets)
        if model.training:
            return loss, {}
        error, n = (outputs.detach().float() - targets.float()), _total(targets)
        squared = error.square().sum()
        return loss, {"loss": (squared, n), "mse": (squared, n), "mae": (error.abs().sum(), n)}

    def count(self, batch: Any) -> int:
        return len(batch[1])

    def report(self, means: dict[str, float]) -> dict[str, float]:
        return {**means, "rmse": math.sqrt(means["mse"])}


class LanguageModel:
    """Next-token cross-entropy: a batch is (batch, seq_len + 1) tokens; the model sees all but the last and
    predicts each next one, returning (batch, seq_len, vocab) logits. Eval: loss and perplexity."""

    unit = "tokens"

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Metrics]:
        tokens = batch if isinstance(batch, torch.Tensor) else batch[0]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)
        flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        loss = F.cross_entropy(flat_logits, flat_targets)
        if model.training:
            return loss, {}
        n = _total(flat_targets)
        return loss, {"loss": (_sum_of_mean(loss, n), n)}

    def count(self, batch: Any) -> int:
        tokens = batch if isinstance(batch, torch.Tensor) else batch[0]
        return tokens.shape[0] * (tokens.shape[1] - 1)

    def report(self, means: dict[str, float]) -> dict[str, float]:
        return {**means, "perplexity": math.exp(min(means["loss"], 700.0))}


class PluginTask:
    """A user's task object, with the optional parts of the contract filled in."""

    def __init__(self, task: Any, ref: str):
        if not callable(getattr(task, "loss", None)):
            raise UsageError(f"--task {ref}: the function must return an object with a loss(model, batch) method")
        self.task = task
        self.unit = getattr(task, "unit", "samples")
        if self.unit not in ("samples", "tokens"):
            raise UsageError(f"--task {ref}: unit must be 'samples' or 'tokens', not {self.unit!r}")

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Metrics]:
        return self.task.loss(model, batch)

    def count(self, batch: Any) -> int:
        count = getattr(self.task, "count", None)
        return int(count(batch)) if count is not None else len(first_tensor(batch))

    def report(self, means: dict[str, float]) -> dict[str, float]:
        report = getattr(self.task, "report", None)
        return report(means) if report is not None else means


TASK_CLASSES = (Classification, Regression, LanguageModel, PluginTask)


def build_task(cfg: TrainConfig) -> Task:
    """The task named by `--task`: a built-in or a 'pkg.mod:fn' plug-in."""
    if ":" in cfg.task:
        return PluginTask(load_plugin(cfg.task, "--task")(cfg), cfg.task)
    if cfg.task == "classification":
        return Classification(cfg.top_k)
    if cfg.task == "regression":
        return Regression()
    if cfg.task == "language_model":
        return LanguageModel()
    raise UsageError(f"--task {cfg.task!r}: not a built-in ({', '.join(BUILTIN_TASKS)}) nor a 'pkg.mod:fn' plug-in")

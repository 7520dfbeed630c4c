"""The task, data and model a config names, plug-in or built-in: the one place that chooses between them.

A plug-in ('pkg.mod:fn' in --task, --model or --dataset) is called with the whole TrainConfig, as its contract
has always said (docs/configuration.md). A built-in is built from its own section (`cfg.section("data")`, and
the run's --seed where it draws randomness), so no built-in component sees settings it does not own.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable

from torch import nn
from torch.utils.data import Dataset

from ddptrain.config import TrainConfig, load_plugin, names_plugin
from ddptrain.data.pipeline import build_datasets
from ddptrain.errors import UsageError
from ddptrain.loop.tasks import PluginTask, Task, build_task
from ddptrain.models import build_model
from ddptrain.parts import Parts

__all__ = ["datasets_of", "model_maker", "model_of", "plugged", "task_of"]


def task_of(cfg: TrainConfig) -> Task:
    """The task --task names."""
    if names_plugin("task", cfg.task):
        return PluginTask(load_plugin(cfg.task, "--task")(cfg), cfg.task)
    return build_task(cfg.section("data"))


def datasets_of(cfg: TrainConfig) -> tuple[Dataset, Dataset | None]:
    """(train, eval or None) of --dataset."""
    if not names_plugin("dataset", cfg.dataset):
        return build_datasets(cfg.section("data"), cfg.seed, Path(cfg.run_dir))
    result = load_plugin(cfg.dataset, "--dataset")(cfg)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise UsageError(f"--dataset {cfg.dataset}: the function must return (train_dataset, eval_dataset or None)")
    return result


def model_maker(cfg: TrainConfig, model: Any = None) -> nn.Module | Callable[[], nn.Module] | None:
    """What `models.instantiate` builds the run's module from: `model` (fit's nn.Module, or its fn(cfg)), else the
    --model plug-in, as a call that instantiate makes after seeding; None for a built-in, which instantiate builds
    from the [data] section (on the meta device where it can)."""
    if isinstance(model, nn.Module):
        return model
    if model is not None:
        return functools.partial(_module_of, model, cfg, "the model function given to ddptrain.fit")
    if names_plugin("model", cfg.model):  # imported when called: after the seed, as a plug-in's import always was
        return functools.partial(_module_of, None, cfg, f"--model {cfg.model}")
    return None


def model_of(cfg: TrainConfig, on_meta: bool = False) -> nn.Module:
    """The module --model names, built now (the tools' way: `plan`, `export`); see `models.build_model`."""
    maker = model_maker(cfg)
    return maker() if maker is not None else build_model(cfg.section("data"), on_meta)


def plugged(cfg: TrainConfig, parts: Parts) -> Parts:
    """`parts` (what the user's code supplied) completed by the config: the task and the datasets built, the model
    as `model_maker` gives it. Task first, then data: as a run has always built them."""
    task = parts.task if parts.task is not None else task_of(cfg)
    datasets = parts.datasets if parts.datasets is not None else datasets_of(cfg)
    return dataclasses.replace(parts, task=task, datasets=datasets, model=model_maker(cfg, parts.model))


def _module_of(fn: Callable[[TrainConfig], Any] | None, cfg: TrainConfig, name: str) -> nn.Module:
    """fn(cfg), checked to be a module; fn None: the --model plug-in's, imported now."""
    module = (fn or load_plugin(cfg.model, "--model"))(cfg)
    if not isinstance(module, nn.Module):
        raise UsageError(f"{name}: the function returned {type(module).__name__}, not a torch.nn.Module")
    return module

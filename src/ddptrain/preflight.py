"""What is checked before any process starts, beyond the config alone: the data's files against the flags,
a Hugging Face model's directory, --resume_from, the optional packages a flag needs.

`TrainConfig.validate` checks the config by itself; this module sits above it and the modules that know
files and packages (data, models, checkpoints, observe), so the dependency runs one way. Called once at the
edge: `ddptrain train` (every process, before a launcher starts workers) and `fit`.
"""

from __future__ import annotations

from pathlib import Path

from ddptrain.config import (
    BUILTIN_DATASETS,
    SYNC_BATCHNORM_ON_CPU,
    TEXT_DATASETS,
    TrainConfig,
    load_plugin,
    parse_trackers,
    plugin_refs,
)
from ddptrain.errors import UsageError
from ddptrain.observe.metrics import require_tensorboard
from ddptrain.observe.trackers import require_tracker


def check(cfg: TrainConfig, hf_aside: bool = False) -> None:
    """UsageError naming the flag and the fix when the devices, plug-ins, files, packages or checkpoints and the
    flags disagree. `hf_aside`: leave a Hugging Face model and dataset (`check_hf`) to the caller, a launcher
    that checks them in a process of their own."""
    check_devices(cfg)
    for flag, ref in plugin_refs(cfg):
        load_plugin(ref, flag)  # importable, the function there
    if cfg.resume_from and not Path(cfg.resume_from).is_dir():
        from ddptrain.checkpoints.format import continues_line  # a restart may find it purged, its line continued

        if not continues_line(cfg.checkpoint_path, cfg.resume_from):
            raise UsageError(f"--resume_from {cfg.resume_from}: no such directory; pass a checkpoints/step-N dir")
    for name in parse_trackers(cfg.tracker):
        require_tracker(name, cfg.section("observe"))
    if cfg.tensorboard:
        require_tensorboard()
    if not hf_aside:
        check_hf(cfg)
    check_data(cfg)


def uses_hf(cfg: TrainConfig) -> bool:
    return cfg.model.startswith("hf:") or cfg.dataset.startswith("hf:")


def check_hf(cfg: TrainConfig) -> None:
    """A Hugging Face model's directory, and a Hugging Face dataset's flags and records, tokenized once, here,
    before the workers start (they find them in the cache). What it imports and holds (transformers, datasets,
    the records) a launcher keeps out of itself: it runs this in a process of its own (`launch.run_aside`)."""
    if not uses_hf(cfg):
        return
    from ddptrain.models import hf

    if cfg.model.startswith("hf:"):
        hf.check_model(cfg.section("data"))
    if cfg.dataset.startswith("hf:"):
        hf.check_dataset(cfg.section("data"))
        hf.prepare(cfg.section("data"), Path(cfg.run_dir))


def check_devices(cfg: TrainConfig) -> None:
    """UsageError for a setting that needs CUDA on a machine without it."""
    needs_cuda = [message for asked, message in (
        (cfg.use_amp and cfg.amp_dtype == "fp16",
         "--amp_dtype fp16 needs CUDA; use --amp_dtype bf16 for mixed precision on CPU"),
        (cfg.backend == "nccl", "--backend nccl needs CUDA devices; use --backend gloo (or auto) on CPU"),
        (cfg.sync_batchnorm, SYNC_BATCHNORM_ON_CPU),
        # Measured on this fleet's CPU build: oneDNN's channels_last backward of some strided 1x1 convs returns
        # wrong gradients or crashes (uxlfoundation/oneDNN#6035). Silent wrong training is the worst outcome,
        # so the option is for CUDA only.
        (cfg.channels_last, "--channels_last is for CUDA: on CPU, oneDNN's channels_last convolution backward "
                            "can return wrong gradients (oneDNN#6035); drop the flag")) if asked]
    if not needs_cuda:
        return  # no torch to import: the launcher imports it while its workers' server does
    import torch  # this module stays torch-free (docs/development.md, "Imports")

    if not torch.cuda.is_available():
        raise UsageError(needs_cuda[0])


def check_data(cfg: TrainConfig) -> None:
    """UsageError naming the flag and the fix when a built-in dataset and the flags disagree."""
    if cfg.dataset.startswith("hf:"):
        return  # check_hf's
    if cfg.dataset in TEXT_DATASETS:
        from ddptrain.data import text  # imports torch and numpy: only when the dataset is asked for

        text.check(cfg.section("data"))
    elif cfg.dataset in BUILTIN_DATASETS and cfg.dataset != "synthetic":
        from ddptrain.data import images

        images.check(cfg.section("data"))

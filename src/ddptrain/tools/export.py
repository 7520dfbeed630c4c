"""`ddptrain export CHECKPOINT_DIR OUT.safetensors`: a verified checkpoint's weights as one safetensors file.

Writes OUT.safetensors (the model's state_dict: parameters and buffers, keys as `model.state_dict()`
names them; metadata: format, step, epoch, model, source checkpoint) and OUT.json next to it (the run's
resolved config, the keys of `ddptrain train`). The checkpoint is verified first: every file against its
manifest's sha256 and size, and nothing is unpickled except through torch's weights-only loader. A sharded
checkpoint (--strategy fsdp/hsdp) is consolidated: its shards, from any number of ranks, become whole tensors.
CHECKPOINT_DIR may also be a run dir or its checkpoints/ dir: the newest committed checkpoint is used.

`--hf OUT_DIR` (a run of a transformers model, `--model hf:...`) writes the save_pretrained layout instead of,
or as well as, OUT.safetensors: `AutoModelFor...from_pretrained(OUT_DIR)` loads the checkpoint's model. A LoRA
run's checkpoint holds what trained only: `--merge` reads its base model again and merges the adapters in.

CHECKPOINT_DIR may also be a save_pretrained directory in HF's sharded layout (`model.safetensors.index.json`
and its files: RUN_DIR/hf/ of a --strategy fsdp run, written shard by shard): it is consolidated into
OUT.safetensors and/or, with --hf, a save_pretrained directory with one model.safetensors.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from ddptrain.checkpoints.format import (
    BEST_ABOUT,
    MANIFEST,
    CheckpointError,
    committed_steps,
    read_json,
    safetensors_bytes,
    write_atomic,
)
from ddptrain.checkpoints.read import read_checkpoint
from ddptrain.cliargs import ArgParser
from ddptrain.config import TrainConfig
from ddptrain.errors import UsageError
from ddptrain.loop.callbacks import EMA
from ddptrain.loop.plugins import model_of
from ddptrain.models import hf, lora
from ddptrain.settings import FIELDS

FORMAT = "ddptrain-export/1"
INDEX = "model.safetensors.index.json"  # HF's sharded layout (RUN_DIR/hf/ of a --strategy fsdp run)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ArgParser(prog="ddptrain export",
                       description="Verify a checkpoint and write its weights as OUT.safetensors plus OUT.json "
                                   "(the config).")
    parser.add_argument("checkpoint", help="a committed checkpoints/step-N dir (or a run dir: its newest), or a save_pretrained dir "
                             "in HF's sharded layout (RUN_DIR/hf of an fsdp run)")
    parser.add_argument("out", nargs="?", default="",
                        help="the .safetensors file to write; the config goes next to it as .json")
    parser.add_argument("--hf", default="", metavar="OUT_DIR",
                        help="also (or instead) write the save_pretrained layout of a transformers model here")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA run's checkpoint (adapters only): merge them into the base model (--model of "
                             "the run, read again) and write whole weights")
    parser.add_argument("--weights", choices=("auto", "trained", "ema"), default="auto",
                        help="the trained weights or their --ema_decay average; auto: what a best/ dir is the "
                             "best of (its best.json), else the trained weights")
    args = parser.parse_args(argv)
    if not args.out and not args.hf:
        raise UsageError("ddptrain export: name what to write: OUT.safetensors, --hf OUT_DIR, or both")
    return args


def find_checkpoint(path: Path) -> Path:
    """`path` itself if it is a checkpoint, else the newest committed one under it (or its checkpoints/)."""
    if not path.is_dir():
        raise UsageError(f"{path}: no such directory; pass a checkpoints/step-N dir of a run")
    if (path / MANIFEST).is_file():
        return path
    for directory in (path, path / "checkpoints"):
        found = committed_steps(directory)
        if found:
            return found[0][1]
    raise UsageError(f"{path}: not a committed checkpoint (no {MANIFEST}) and holds none; pass a "
                     "checkpoints/step-N dir that has a manifest.json")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.out and out.suffix != ".safetensors":
        raise UsageError(f"{out}: the output file must end in .safetensors (the config is written next to it "
                         "as .json)")
    if (Path(args.checkpoint) / INDEX).is_file():
        return consolidate_pretrained(Path(args.checkpoint), out if args.out else None, Path(args.hf) if args.hf else None)
    checkpoint = find_checkpoint(Path(args.checkpoint))
    try:
        loaded = read_checkpoint(checkpoint, torch.device("cpu"))
    except CheckpointError as exc:
        raise UsageError(f"{checkpoint}: unusable checkpoint: {exc}") from None

    manifest = loaded.manifest
    if loaded.shards is not None:  # a sharded checkpoint: gathered into whole tensors here
        from ddptrain.checkpoints.shards import consolidate

        try:
            weights = consolidate(loaded)
        except CheckpointError as exc:
            raise UsageError(f"{checkpoint}: unusable checkpoint: {exc}") from None
    else:
        weights = loaded.model
    which = args.weights
    if which == "auto":
        about = read_json(checkpoint / BEST_ABOUT) or {}
        which = about.get("weights", "trained")
    if which == "ema":
        try:
            weights = EMA.weights_of(loaded.trainer, weights)
        except ValueError as exc:
            raise UsageError(f"--weights ema: {checkpoint}: {exc}") from None
    lora_rank = manifest["config"].get("lora_rank", 0)
    if args.merge:
        if not lora_rank:
            raise UsageError(f"--merge: {checkpoint} is not of a LoRA run (--lora_rank 0): it holds whole weights "
                             "already; export it without --merge")
        weights = merge_adapters(manifest["config"], weights, loaded.trainer.get("frozen"), checkpoint)
    elif lora_rank and args.hf:
        raise UsageError(f"--hf: {checkpoint} holds LoRA adapters only; add --merge to merge them into the base "
                         "model, or load RUN_DIR/adapter/ with peft")
    if args.hf:
        export_hf(manifest["config"], weights, checkpoint, Path(args.hf))
    if not args.out:
        return 0
    metadata = {"format": FORMAT, "step": str(manifest["step"]), "epoch": str(manifest["epoch"]),
                "model": str(manifest["config"].get("model", "")), "checkpoint": str(checkpoint.resolve())}
    config_path = out.with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, safetensors_bytes(weights, metadata=metadata))
    write_atomic(config_path, (json.dumps(manifest["config"], indent=1, sort_keys=True) + "\n").encode())
    size_mb = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    print(f"exported {len(weights)} tensors ({size_mb:.1f} MiB, {which} weights) of step {manifest['step']} from "
          f"{checkpoint} to {out}; config: {config_path}")
    return 0


def merge_adapters(config: dict, adapters: dict[str, torch.Tensor], frozen: dict | None,
                   checkpoint: Path) -> dict[str, torch.Tensor]:
    """The base model of a LoRA run (its --model, read again) with the checkpoint's adapters merged in by peft's
    own layers (as `merge_and_unload`: rsLoRA, DoRA, embeddings, --lora_modules_to_save), under the base model's
    own names. The base must be the one the adapters were trained on (the checkpoint's fingerprint of the
    frozen weights)."""
    cfg = TrainConfig(**{k: v for k, v in config.items() if k in FIELDS})
    torch.manual_seed(cfg.seed)  # a base built from a config alone is the run's seeded init
    module = lora.apply(model_of(cfg), cfg.section("finetune"), cfg.model)
    module.load_state_dict(adapters, strict=False)
    if frozen is None or not lora.same_weights(frozen["fingerprint"], lora.fingerprint(module, frozen["names"])):
        raise UsageError(f"--merge: --model {cfg.model} now gives other weights than {checkpoint}'s adapters were "
                         "trained on (their fingerprint differs); merge on the base model of the run")
    return lora.merged(module)


def export_hf(config: dict, weights: dict[str, torch.Tensor], checkpoint: Path, out_dir: Path) -> None:
    """The save_pretrained layout of a checkpoint of a transformers model (`--model hf:...`)."""
    cfg = TrainConfig(**{k: v for k, v in config.items() if k in FIELDS})
    run_hf_dir = checkpoint.parent.parent / hf.HF_DIR  # the run of a transformers model wrote its config there
    if not hf.is_hf(cfg.model) and not (run_hf_dir / "config.json").is_file():
        raise UsageError(f"--hf: {checkpoint} is not of a transformers model (--model {cfg.model}, and its run dir "
                         f"has no {hf.HF_DIR}/config.json); export it as OUT.safetensors")
    hf.save_pretrained(cfg.section("data"), weights, out_dir, source_config=run_hf_dir)
    print(f"exported {checkpoint.name} of {cfg.model} to {out_dir} (save_pretrained layout)")


def consolidate_pretrained(directory: Path, out: Path | None, hf_dir: Path | None) -> int:
    """A save_pretrained directory in HF's sharded layout (files + index, as an fsdp run writes RUN_DIR/hf/)
    as one file: OUT.safetensors, and/or with --hf the same layout with a single model.safetensors (its config,
    generation config and tokenizer files copied). Whole in this one process: run it where the memory is."""
    try:
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(set(weight_map.values())):
            with safe_open(directory / file, framework="pt") as fh:
                weights.update({name: fh.get_tensor(name) for name in fh.keys()})
    except (OSError, KeyError, ValueError) as exc:
        raise UsageError(f"{directory}: unreadable {INDEX} or weight files ({exc})") from None
    if set(weights) != set(weight_map):
        raise UsageError(f"{directory}: the files hold other tensors than {INDEX} names; pass a complete directory")
    data = safetensors_bytes(weights, metadata={"format": "pt"})
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, data)
    if hf_dir is not None:
        hf_dir.mkdir(parents=True, exist_ok=True)
        for extra in directory.iterdir():
            if extra.is_file() and not extra.name.startswith("model") and extra.suffix == ".json":
                shutil.copyfile(extra, hf_dir / extra.name)
        for stale in hf_dir.glob("model*.safetensors*"):
            stale.unlink()
        write_atomic(hf_dir / "model.safetensors", data)
    size_mb = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    print(f"consolidated {len(weights)} tensors ({size_mb:.1f} MiB) of {directory} into "
          f"{' and '.join(str(p) for p in (out, hf_dir) if p is not None)}")
    return 0

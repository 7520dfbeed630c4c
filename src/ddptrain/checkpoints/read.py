"""Reading a checkpoint back, either layout: every file verified against the manifest before a byte of it is
deserialized, and nothing executed from the files."""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

from ddptrain.checkpoints.format import (FORMAT, MANIFEST, CheckpointError, Loaded, MappedWeights, _read_verified,
                                        _safe_torch_load, _verify_file)


def read_checkpoint(path: Path, device: torch.device, share: tuple[int, int] = (0, 1),
                    mapped: bool = False) -> Loaded:
    """Verify every file against the manifest and deserialize without executing code from the files.

    A sharded checkpoint's tensors stay on disk (`Loaded.shards`); its small files are verified here, and of
    its shard files the `share` = (rank, world size) part: each rank hashes its share, and the caller
    agrees on the outcome, so together they verified every byte before any rank reads one.

    `mapped` (a sharded run reading a full checkpoint): the model and optimizer tensors stay on disk too
    (`MappedWeights`; an optimizer state whose tensors map optimizer.pt), each of the two files hashed by
    one rank of `share` as a stream, so that each rank then reads only the rows its shards hold.
    """
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError("no manifest.json: the checkpoint never committed")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"manifest.json is not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"manifest format {manifest.get('format')!r} is not {FORMAT!r}")
    files = manifest["files"]
    if manifest.get("layout", "full") == "sharded":
        from ddptrain.checkpoints import shards  # DCP: imported where a sharded checkpoint is read

        return shards.read_verified(path, manifest, share)
    for name in ("model.safetensors", "optimizer.pt", "trainer.pt"):
        if name not in files:
            raise CheckpointError(f"manifest lists no {name}")
    if mapped:
        rank, world = share
        for index, name in enumerate(("model.safetensors", "optimizer.pt")):
            if index % world == rank:
                _verify_file(path / name, files[name], name)
        trainer = _read_verified(path / "trainer.pt", files["trainer.pt"])
        return Loaded(path=path, manifest=manifest, model=MappedWeights(path / "model.safetensors"),
                      optimizer=_safe_torch_load(path / "optimizer.pt", "optimizer.pt", torch.device("cpu")),
                      trainer=_safe_torch_load(trainer, "trainer.pt", torch.device("cpu")))
    blobs = {name: _read_verified(path / name, entry) for name, entry in files.items()}
    try:
        model = safetensors.torch.load(blobs["model.safetensors"])
    except Exception as exc:
        raise CheckpointError(f"model.safetensors does not parse: {exc}") from None
    return Loaded(path=path, manifest=manifest, model=model,
                  optimizer=_safe_torch_load(blobs["optimizer.pt"], "optimizer.pt", device),
                  trainer=_safe_torch_load(blobs["trainer.pt"], "trainer.pt", torch.device("cpu")))

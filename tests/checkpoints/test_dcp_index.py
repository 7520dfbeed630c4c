"""A re-signed DCP index is still checked before DCP reads through it: every storage entry must name a shard
file the manifest lists, inside the checkpoint's shards/, and lie within it; every tensor's chunks must cover
it exactly. Real runs, gloo on CPU.

Reference run (once per module): fsdp on 2 processes, 4 steps, checkpoints at steps 2 and 4. Each test
tampers with a copy: it edits step-4's `.metadata` with plain pickle and re-signs it in the manifest, as an
attacker who can write the checkpoint would, so that only the index check stands in the way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from helpers import assert_bitwise_equal, cli_in_process, one_line_error, train, weights

RUN = ["--strategy", "fsdp", "--save_every_steps", "2", "--keep_last", "0", "--epochs", "2"]
WEIGHT = "model.net.1.weight"  # (32, 192): rank 0 wrote rows 0-15, rank 1 rows 16-31
SECRET_VALUE = 1234.5  # what the file outside the checkpoint holds: recognisable in any output
SECRET_BYTES = struct.pack("<f", SECRET_VALUE) * 16


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fsdp")
    train(run_dir, *RUN, "--max_steps", "4", nproc=2)
    return run_dir


@pytest.fixture
def copied(fsdp, tmp_path) -> Path:
    """A run dir holding copies of the reference run's step-2 and step-4 checkpoints."""
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp / "checkpoints", run_dir / "checkpoints")
    return run_dir


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step}"


def sign(checkpoint: Path, name: str) -> None:
    """List checkpoint/name in the manifest with its current digest (following a symlink, as a reader does)."""
    data = (checkpoint / name).read_bytes()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def resign_index(checkpoint: Path, edit: Callable) -> None:
    """Edit the DCP index with plain pickle (`edit(metadata)` changes it in place) and re-sign it."""
    path = checkpoint / "shards" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))
    sign(checkpoint, "shards/.metadata")


def storage_of(metadata, fqn: str, offsets: tuple[int, ...]):
    """The storage key and entry of `fqn`'s chunk at `offsets`."""
    return next((key, info) for key, info in metadata.storage_data.items()
                if key.fqn == fqn and tuple(key.offset) == offsets)


def point_storage(relative_path: str, offset: int, length: int) -> Callable:
    """An edit that makes WEIGHT's first chunk read `length` bytes at `offset` of `relative_path`."""
    def edit(metadata) -> None:
        key, info = storage_of(metadata, WEIGHT, (0, 0))
        metadata.storage_data[key] = dataclasses.replace(info, relative_path=relative_path, offset=offset,
                                                         length=length)
    return edit


def export(checkpoint: Path, out: Path):
    """`ddptrain export CHECKPOINT OUT`, which starts no process: in this one."""
    return cli_in_process(["export", str(checkpoint), str(out)])


def files_holding(directory: Path, data: bytes) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file() and data in p.read_bytes()]


@pytest.fixture
def secret(tmp_path) -> Path:
    """A file outside the checkpoint that DCP would read as WEIGHT's first chunk, were it pointed at it."""
    path = tmp_path / "secret.pt"
    torch.save(torch.full((16, 192), SECRET_VALUE), path)
    return path


# --- storage entries -------------------------------------------------------------------------------

def relative(checkpoint: Path, secret: Path) -> str:
    return os.path.relpath(secret, checkpoint / "shards")


def listed_relative(checkpoint: Path, secret: Path) -> str:
    name = relative(checkpoint, secret)
    sign(checkpoint, f"shards/{name}")  # listed and digest-verified, yet outside shards/
    return name


def absolute(checkpoint: Path, secret: Path) -> str:
    return str(secret)


def listed_symlink(checkpoint: Path, secret: Path) -> str:
    (checkpoint / "shards" / "extra.distcp").symlink_to(secret)
    sign(checkpoint, "shards/extra.distcp")
    return "extra.distcp"


@pytest.mark.parametrize("target", [relative, listed_relative, absolute, listed_symlink],
                         ids=["dotdot", "dotdot-listed", "absolute", "symlink-listed"])
def test_a_storage_path_outside_the_checkpoint_is_refused_and_nothing_leaks(copied, secret, tmp_path, target):
    checkpoint = step_dir(copied, 4)
    name = target(checkpoint, secret)
    resign_index(checkpoint, point_storage(name, 0, secret.stat().st_size))
    out_dir = tmp_path / "out"
    line = one_line_error(export(checkpoint, out_dir / "model.safetensors"))
    assert f"{WEIGHT}'s storage at (0, 0) points at {name!r}, outside the checkpoint's shards/; refused" in line, line
    assert not out_dir.exists() or not files_holding(out_dir, SECRET_BYTES), "the outside file was exported"


def test_a_storage_path_the_manifest_does_not_list_is_refused(copied, secret, tmp_path):
    checkpoint = step_dir(copied, 4)
    shutil.copy(secret, checkpoint / "shards" / "extra.distcp")  # inside shards/, but never digest-verified
    resign_index(checkpoint, point_storage("extra.distcp", 0, secret.stat().st_size))
    out_dir = tmp_path / "out"
    line = one_line_error(export(checkpoint, out_dir / "model.safetensors"))
    assert f"{WEIGHT}'s storage at (0, 0) points at 'extra.distcp', a file the manifest does not list" in line, line
    assert not out_dir.exists() or not files_holding(out_dir, SECRET_BYTES)


@pytest.mark.parametrize("byte_range", [lambda size: (-1, 100), lambda size: (0, -1), lambda size: (size - 10, 100)],
                         ids=["negative-offset", "negative-length", "past-the-end"])
def test_a_storage_range_outside_its_file_is_refused(copied, tmp_path, byte_range):
    """`byte_range(size of the shard file)` is (offset, length)."""
    checkpoint = step_dir(copied, 4)
    size = json.loads((checkpoint / "manifest.json").read_text())["files"]["shards/__0_0.distcp"]["size"]
    offset, length = byte_range(size)
    resign_index(checkpoint, point_storage("__0_0.distcp", offset, length))
    line = one_line_error(export(checkpoint, tmp_path / "out.safetensors"))
    assert (f"{WEIGHT}'s storage at (0, 0) reads {length} bytes at offset {offset} of '__0_0.distcp', which "
            f"has {size}; refused") in line, line


def test_a_transformed_storage_entry_is_refused(copied, tmp_path):
    """DCP's stream transforms (zstd decompression) are never written by ddptrain, and no size bounds their
    output."""
    checkpoint = step_dir(copied, 4)

    def transform(metadata) -> None:
        key, info = storage_of(metadata, WEIGHT, (0, 0))
        metadata.storage_data[key] = dataclasses.replace(info, transform_descriptors=["stream.zstd/1"])

    resign_index(checkpoint, transform)
    line = one_line_error(export(checkpoint, tmp_path / "out.safetensors"))
    assert (f"{WEIGHT}'s storage at (0, 0) is transformed (['stream.zstd/1']), which ddptrain never writes; "
            "refused") in line, line


# --- chunks --------------------------------------------------------------------------------------

def drop_chunk(metadata) -> None:
    """WEIGHT's rows 16-31 (rank 1's chunk) are in no chunk: a gap."""
    metadata.state_dict_metadata[WEIGHT].chunks.pop(1)


def duplicate_chunk(metadata) -> None:
    """WEIGHT's rows 0-15 are in two chunks (and 1.5 times its elements in all): an overlap."""
    chunks = metadata.state_dict_metadata[WEIGHT].chunks
    chunks.append(chunks[0])


def grow_tensor(metadata) -> None:
    """WEIGHT declared 10,000 times its rows, its second chunk stretched to tile them: export would allocate
    that much for bytes that hold 16 rows."""
    entry = metadata.state_dict_metadata[WEIGHT]
    entry.size = torch.Size([320_000, 192])
    entry.chunks[1].sizes = torch.Size([320_000 - 16, 192])


CHUNK_ERRORS = {
    drop_chunk: f"{WEIGHT}'s chunks cover 3072 of its 6144 elements; refused",
    duplicate_chunk: f"{WEIGHT}'s chunks at (0, 0) and (0, 0) overlap; refused",
}


@pytest.mark.parametrize("tamper,expected", [
    *CHUNK_ERRORS.items(),
    (grow_tensor, f"{WEIGHT}'s chunk at (16, 0) is {(320_000 - 16) * 192 * 4} bytes of float32, its storage "
                  "holds "),
], ids=["gap", "overlap", "larger-than-its-bytes"])
def test_an_index_whose_chunks_do_not_tile_its_tensors_is_refused_by_export(copied, tmp_path, tamper, expected):
    checkpoint = step_dir(copied, 4)
    resign_index(checkpoint, tamper)
    line = one_line_error(export(checkpoint, tmp_path / "out.safetensors"))
    assert f"shards/.metadata: {expected}" in line, line
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("tamper", list(CHUNK_ERRORS), ids=["gap", "overlap"])
def test_resume_falls_back_past_an_index_with_a_gap_or_an_overlap(copied, tamper):
    resign_index(step_dir(copied, 4), tamper)
    train(copied, *RUN, "--max_steps", "6", nproc=2)
    log = (copied / "logs" / "rank-0.log").read_text()
    assert (f"checkpoint {step_dir(copied, 4)} unusable on rank 0: shards/.metadata: {CHUNK_ERRORS[tamper]}; "
            "falling back to the previous committed one") in log, log
    assert f"resuming from {step_dir(copied, 2)} (step 2)" in log
    assert (step_dir(copied, 6) / "manifest.json").is_file()


# --- good checkpoints ----------------------------------------------------------------------------

def test_an_untampered_index_re_signed_as_is_still_exports_the_run_s_weights(copied, fsdp, tmp_path):
    """Also proves this module's re-signing alone refuses nothing: the refusals above are the edits'."""
    checkpoint = step_dir(copied, 4)
    resign_index(checkpoint, lambda metadata: None)
    out = tmp_path / "out.safetensors"
    proc = export(checkpoint, out)
    assert proc.returncode == 0, proc.stderr
    assert_bitwise_equal(weights(out), weights(fsdp / "model.safetensors"))


def test_an_untampered_checkpoint_still_resumes(copied):
    resign_index(step_dir(copied, 4), lambda metadata: None)
    train(copied, *RUN, "--max_steps", "6", nproc=2)
    log = (copied / "logs" / "rank-0.log").read_text()
    assert "unusable" not in log
    assert f"resuming from {step_dir(copied, 4)} (step 4)" in log
    assert (step_dir(copied, 6) / "manifest.json").is_file()

"""Checkpoints that are damaged, partial or hostile: detected, reported, and never trusted."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from helpers import REPO, cli_in_process, last_committed, metrics, one_line_error, plant_hostile, run_cli, train

SAVES = ["--save_every_steps", "2", "--keep_last", "0", "--epochs", "1"]
COMPAT = REPO / "tests" / "fixtures" / "compat-2026-12-06"  # checkpoints an earlier version wrote (test_compat)


@pytest.fixture
def three_checkpoints(tmp_path) -> Path:
    """A 1-process run stopped at step 6 with checkpoints at steps 2, 4 and 6."""
    train(tmp_path, *SAVES, "--max_steps", "6")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    return tmp_path


def rerun(run_dir: Path, *extra: str, check: bool = True):
    return train(run_dir, *SAVES, "--max_steps", "8", *extra, check=check)


def rank0_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "rank-0.log").read_text()


def truncate(ckpt: Path) -> str:
    path = ckpt / "shards" / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:-100])
    return "truncated"


def flip_byte(ckpt: Path) -> str:
    path = ckpt / "trainer.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return "sha256"


def drop_manifest(ckpt: Path) -> None:
    (ckpt / "manifest.json").unlink()


@pytest.mark.parametrize("damage", [truncate, flip_byte], ids=["truncated-file", "flipped-byte"])
def test_damaged_newest_checkpoint_falls_back_to_previous(three_checkpoints, damage):
    run_dir = three_checkpoints
    expected = damage(run_dir / "checkpoints" / "step-6")
    rerun(run_dir)
    log = rank0_log(run_dir)
    assert f"checkpoint {run_dir / 'checkpoints' / 'step-6'} unusable on rank 0" in log
    assert expected in log and "falling back to the previous committed one" in log
    assert f"resuming from {run_dir / 'checkpoints' / 'step-4'} (step 4)" in log
    assert last_committed(run_dir).name == "step-8"


def test_uncommitted_checkpoints_are_ignored_and_replaced(three_checkpoints):
    run_dir = three_checkpoints
    drop_manifest(run_dir / "checkpoints" / "step-6")           # died before committing step 6
    partial = run_dir / "checkpoints" / "step-8"                 # a leftover from a crash at step 8
    partial.mkdir()
    (partial / "trainer.pt").write_bytes(b"half a file")
    rerun(run_dir)
    assert f"resuming from {run_dir / 'checkpoints' / 'step-4'} (step 4)" in rank0_log(run_dir)
    assert (partial / "manifest.json").exists(), "the partial step-8 dir was not replaced by a committed one"
    assert json.loads((partial / "manifest.json").read_text())["step"] == 8


def test_no_usable_checkpoint_is_a_clear_error_and_nothing_is_overwritten(three_checkpoints):
    run_dir = three_checkpoints
    for step in (2, 4, 6):
        truncate(run_dir / "checkpoints" / f"step-{step}")
    before = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    line = one_line_error(rerun(run_dir, check=False))
    assert f"no usable checkpoint in {run_dir / 'checkpoints'}" in line and "--no-auto_resume" in line
    assert {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()} == before
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before



def checkpoint_files(run_dir: Path) -> dict[Path, bytes]:
    """Every file of every checkpoint directory, committed, partial or moved aside."""
    return {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("step-*/**/*") if p.is_file()}


def test_a_transient_read_error_is_retried_and_demotes_nothing(three_checkpoints):
    # Reading step-6 fails with EIO twice (a network filesystem's hiccup): that proves nothing against the
    # checkpoint, so it is read again, resumed from, and no checkpoint is moved aside or trained again.
    run_dir = three_checkpoints
    train(run_dir, *SAVES, "--max_steps", "8", env={"DDPTRAIN_FAULT": "rank=0,step=6,kind=ioerror,at=load,times=2"})
    log = rank0_log(run_dir)
    step_6 = run_dir / "checkpoints" / "step-6"
    assert f"reading checkpoint {step_6} failed on rank 0 (OSError: [Errno 5]" in log
    assert "trying again (2 of 3)" in log and "trying again (3 of 3)" in log
    assert f"resuming from {step_6} (step 6)" in log
    assert not (run_dir / "checkpoints" / "abandoned").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6", "step-8"]


def test_a_persistent_read_error_stops_the_run_and_moves_nothing(three_checkpoints):
    run_dir = three_checkpoints
    before, metrics_before = checkpoint_files(run_dir), (run_dir / "metrics.jsonl").read_bytes()
    proc = train(run_dir, *SAVES, "--max_steps", "8", check=False,
                 env={"DDPTRAIN_FAULT": "rank=0,step=6,kind=ioerror,at=load,times=10"})
    assert proc.returncode == 1, proc.stderr
    step_6 = run_dir / "checkpoints" / "step-6"
    assert f"cannot read checkpoint {step_6} on rank 0" in proc.stderr and "after 3 tries: OSError" in proc.stderr
    assert "nothing was moved or deleted" in proc.stderr
    assert checkpoint_files(run_dir) == before
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before

# --- hostile pickles ------------------------------------------------------------------------------
# torch >= 2.6 already defaults to weights_only=True; a user may turn that default off with this variable, and
# the checkpoint must stay safe: so the tests turn it off, and only the loader's own weights_only=True is left.
UNSAFE_DEFAULT = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


@pytest.fixture
def hostile_run(tmp_path) -> tuple[Path, Path]:
    """(run dir, sentinel): a 1-process run with one committed checkpoint, step 2, and a sentinel path that
    a payload would create."""
    run_dir = tmp_path / "run"
    train(run_dir, "--save_every_steps", "2", "--keep_last", "0", "--max_steps", "2")
    return run_dir, tmp_path / "pwned"


@pytest.mark.parametrize("name", ["trainer.pt"])
@pytest.mark.parametrize("path", ["auto", "explicit", "export"])
def test_hostile_pickle_is_refused_on_every_load_path(hostile_run, name, path):
    """Resuming (newest checkpoint or --resume_from) and `ddptrain export` refuse it: exit 2, code never run."""
    run_dir, sentinel = hostile_run
    checkpoint = run_dir / "checkpoints" / "step-2"
    plant_hostile(checkpoint, name, sentinel)
    out = run_dir / "exported.safetensors"
    if path == "export":
        proc = run_cli(["export", str(checkpoint), str(out)], env=UNSAFE_DEFAULT)
    else:
        extra = ["--resume_from", str(checkpoint)] if path == "explicit" else []
        proc = train(run_dir, "--max_steps", "4", *extra, env=UNSAFE_DEFAULT, check=False)
    line = one_line_error(proc)
    assert f"{name} refused by the safe loader" in line, line
    assert not sentinel.exists(), "unpickling ran the payload"
    assert not out.exists() and not (run_dir / "checkpoints" / "step-4").exists()


@pytest.mark.parametrize("name", ["optimizer.pt", "trainer.pt"])
def test_an_earlier_versions_full_checkpoint_with_a_hostile_pickle_is_refused(tmp_path, name):
    """The full layout (model.safetensors + optimizer.pt), which ddp runs wrote before the single write path,
    is still read, and as safely: resuming it and exporting it both refuse the pickle."""
    checkpoint, sentinel = tmp_path / "checkpoints" / "step-3", tmp_path / "pwned"
    shutil.copytree(COMPAT / "ddp" / "step-3", checkpoint)
    plant_hostile(checkpoint, name, sentinel)
    out = tmp_path / "exported.safetensors"
    line = one_line_error(cli_in_process(["export", str(checkpoint), str(out)], env=UNSAFE_DEFAULT))
    assert f"{name} refused by the safe loader" in line, line
    proc = run_cli(["train", "--config", str(COMPAT / "job.toml"), "--run_dir", str(tmp_path), "--max_steps", "4",
                    "--nproc", "0"], env=UNSAFE_DEFAULT)  # in this process: the job file says 2
    assert f"{name} refused by the safe loader" in one_line_error(proc)
    assert not sentinel.exists(), "unpickling ran the payload"
    assert not out.exists() and not (tmp_path / "checkpoints" / "step-4").exists()


def test_a_pickle_in_place_of_the_safetensors_file_does_not_parse_and_never_runs(tmp_path):
    """An earlier full checkpoint's model.safetensors is never unpickled, whatever it holds: a re-signed pickle
    there is an unparsable checkpoint (exit 2 from export), not a fallback to torch.load."""
    checkpoint, sentinel = tmp_path / "step-3", tmp_path / "pwned"
    shutil.copytree(COMPAT / "ddp" / "step-3", checkpoint)
    plant_hostile(checkpoint, "model.safetensors", sentinel)
    run_dir = tmp_path
    out = run_dir / "exported.safetensors"
    line = one_line_error(cli_in_process(["export", str(checkpoint), str(out)], env=UNSAFE_DEFAULT))
    assert f"{checkpoint}: unusable checkpoint: model.safetensors does not parse" in line, line
    assert not sentinel.exists(), "the weights file was unpickled"
    assert not out.exists()


# --- the manifest and retention ------------------------------------------------------------------

def test_manifest_describes_the_checkpoint(three_checkpoints):
    ckpt = three_checkpoints / "checkpoints" / "step-6"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["epoch"] == 0 and manifest["world_size"] == 1
    assert manifest["cursor"] == 6 * 32 and manifest["global_batch_size"] == 32
    assert set(manifest["versions"]) == {"torch", "python", "ddptrain"}
    assert manifest["config"]["max_steps"] == 6
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    assert files == sorted([*manifest["files"], "manifest.json"])


def test_retention_keeps_the_newest_and_survives_a_failed_delete(tmp_path, monkeypatch):
    train(tmp_path, "--save_every_steps", "1", "--keep_last", "2", "--max_steps", "5")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-4", "step-5"]

    # A delete that fails (e.g. a file held open on a network filesystem) is logged, never fatal.
    import logging

    from ddptrain.checkpoints.manager import CheckpointManager

    manager = CheckpointManager.__new__(CheckpointManager)
    manager.directory, manager.keep_last, manager._best_owed = tmp_path / "checkpoints", 1, None

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ddptrain").addHandler(handler)
    try:
        manager.purge(keep_step=5)
    finally:
        logging.getLogger("ddptrain").removeHandler(handler)
    assert any("could not delete old checkpoint" in r.getMessage() and "step-4" in r.getMessage() for r in records)


def test_checkpoints_by_wall_time(tmp_path):
    train(tmp_path, "--save_every", "0", "--save_every_minutes", "0.00001", "--keep_last", "0", "--max_steps", "4")
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoints").iterdir())
    assert steps == [1, 2, 3, 4]  # a world of one decides at once (a larger world one step later)


def test_finished_run_rerun_is_a_no_op(tmp_path):
    train(tmp_path, "--max_steps", "3")
    before = (tmp_path / "model.safetensors").read_bytes()
    proc = train(tmp_path, "--max_steps", "3")
    assert "already complete" in proc.stdout
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert [r["step"] for r in metrics(tmp_path, "train")] == [1, 2, 3]


def test_injected_corruption_is_caught_on_resume(tmp_path):
    train(tmp_path, *SAVES, "--max_steps", "6", "--inject_fault", "rank=0,step=6,kind=corrupt-checkpoint")
    rerun(tmp_path, "--inject_fault", "")
    log = rank0_log(tmp_path)
    assert "shards/__0_0.distcp fails its sha256 check (corrupted)" in log
    assert f"resuming from {tmp_path / 'checkpoints' / 'step-4'} (step 4)" in log


def test_injected_exit_then_rerun_resumes(tmp_path):
    proc = train(tmp_path, *SAVES, "--max_steps", "6", "--inject_fault", "rank=0,step=5,kind=exit", check=False)
    assert proc.returncode == 13
    assert last_committed(tmp_path).name == "step-4"
    rerun(tmp_path, "--inject_fault", "")
    assert f"resuming from {tmp_path / 'checkpoints' / 'step-4'} (step 4)" in rank0_log(tmp_path)
    assert [r["step"] for r in metrics(tmp_path, "train")] == list(range(1, 9))

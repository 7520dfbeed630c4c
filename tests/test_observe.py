"""Metric sinks, progress bar, FLOPs/MFU and profiler traces, checked on real 2-process gloo runs."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import socket
import struct
import subprocess
import sys
import termios
import threading

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import REPO, TINY, cli_env, metrics, read_jsonl
from observed_run import observed_run

from ddptrain import cli
from ddptrain.models import MiniResNet
from ddptrain.observe import perf

# The metrics.jsonl schema (README "Watching a run"): required keys and their JSON types, per split.
COMMON = {"time": float, "step": int, "epoch": int, "split": str, "loss": float}
TRAIN = {**COMMON, "lr": float, "samples_per_sec": float, "samples_per_sec_per_rank": float, "grad_norm": float,
         "step_time_s": float, "data_wait_s": float, "fwd_bwd_s": float, "optimizer_s": float,
         "peak_mem_mb": float, "nonfinite_steps": int, "slowest_rank": int, "slowest_host": str,
         "step_time_skew": float, "data_wait_max_s": float, "step_time_s_by_rank": list,
         "data_wait_s_by_rank": list}
EVAL = {**COMMON, "accuracy": float, "samples": int}
BAR_MARK = b"loss="  # tqdm's postfix; the log lines say "loss 1.23", never "loss="


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return observed_run(tmp_path_factory)


def test_every_jsonl_line_has_the_schema_of_its_split(run):
    lines = read_jsonl(run.run_dir / "metrics.jsonl")
    for line in lines:
        schema = {"train": TRAIN, "eval": EVAL}[line["split"]]
        for key, kind in schema.items():
            assert isinstance(line.get(key), kind) and not isinstance(line[key], bool), (key, line)
    train = [line for line in lines if line["split"] == "train"]
    evals = [line for line in lines if line["split"] == "eval"]
    # 256 samples / (32 x 2 ranks) = 4 steps per epoch, 3 epochs, --log_interval 1; one eval per epoch.
    assert [line["step"] for line in train] == list(range(1, 13))
    assert [(line["step"], line["epoch"]) for line in evals] == [(4, 0), (8, 1), (12, 2)]
    assert all(line["samples"] == 61 for line in evals)
    assert all(len(line["step_time_s_by_rank"]) == 2 for line in train)
    assert all(0.0 <= line["accuracy"] <= 1.0 for line in evals)
    assert all("mfu" in line for line in train)  # --peak_tflops given


def test_mfu_is_throughput_times_counted_flops_over_the_peak(run):
    model = MiniResNet(in_channels=3, num_classes=10, width=4, norm="batch")
    flops = perf.train_flops_per_sample(model, torch.zeros(1, 3, 8, 8))
    for line in metrics(run.run_dir, "train"):
        assert line["mfu"] == pytest.approx(line["samples_per_sec_per_rank"] * flops / 1e12, rel=1e-9)


def test_tensorboard_events_read_back_with_tensorboards_reader(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {f"train/{key}" for key in ("loss", "lr", "samples_per_sec", "samples_per_sec_per_rank",
                                            "step_time_s", "data_wait_s", "fwd_bwd_s", "optimizer_s",
                                            "peak_mem_mb", "grad_norm", "mfu")} | {"eval/loss", "eval/accuracy"}
    assert expected <= tags, expected - tags
    train = metrics(run.run_dir, "train")
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [line["step"] for line in train]
    assert [e.value for e in loss] == pytest.approx([line["loss"] for line in train], rel=1e-6)
    accuracy = events.Scalars("eval/accuracy")
    assert [e.value for e in accuracy] == pytest.approx([line["accuracy"] for line in metrics(run.run_dir, "eval")])


def test_no_progress_bar_when_output_is_not_a_terminal(run):
    # --progress was on, but stdout and stderr were pipes.
    assert BAR_MARK not in (run.proc.stdout + run.proc.stderr).encode()
    assert "\r" not in run.proc.stderr


def test_profiler_writes_one_chrome_trace_per_rank_with_events(run):
    traces = sorted((run.run_dir / "traces").glob("*.json"))
    assert [t.name for t in traces] == ["rank-0.pt.trace.json", "rank-1.pt.trace.json"]
    for trace in traces:
        data = json.loads(trace.read_text())
        events = data["traceEvents"]
        assert len(events) > 10
        names = {event.get("name") for event in events}
        assert {"forward", "backward", "optimizer"} <= names, trace
        assert any(str(name).startswith("ProfilerStep#") for name in names)


def test_flops_of_mini_resnet_match_a_hand_count():
    """FlopCounterMode counts a multiply-add as 2 FLOPs: a conv is 2 * Cin * Cout * k * k * Hout * Wout."""
    model = MiniResNet(in_channels=3, num_classes=10, width=8, norm="batch").eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, 16, 16))
    stem = sum(counter.get_flop_counts()["MiniResNet.stem.0"].values())
    assert stem == 2 * 3 * 8 * 3 * 3 * 16 * 16
    # The whole net by hand: stem; stage 1 (4 convs 8->8 at 16x16); stages 2 and 3 (first conv halves the
    # size and doubles the width, a 1x1 shortcut, then 3 convs at the new width); the linear head.
    stage1 = 4 * (2 * 8 * 8 * 9 * 16 * 16)
    stage2 = 2 * 8 * 16 * 9 * 8 * 8 + 2 * 8 * 16 * 1 * 8 * 8 + 3 * (2 * 16 * 16 * 9 * 8 * 8)
    stage3 = 2 * 16 * 32 * 9 * 4 * 4 + 2 * 16 * 32 * 1 * 4 * 4 + 3 * (2 * 32 * 32 * 9 * 4 * 4)
    head = 2 * 32 * 10
    forward = stem + stage1 + stage2 + stage3 + head
    assert counter.get_total_flops() == forward
    train_flops = perf.train_flops_per_sample(model, torch.zeros(1, 3, 16, 16))
    assert train_flops == 3 * forward
    # 1000 samples/s on a 0.5 TFLOP/s device.
    assert perf.mfu(1000.0, train_flops, 0.5) == pytest.approx(1000.0 * 3 * forward / 0.5e12)
    assert perf.mfu(1000.0, train_flops, 0.0) is None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _drain(fd: int, sink: bytearray) -> None:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: every process holding the terminal has exited
            return
        if not chunk:
            return
        sink.extend(chunk)


def test_progress_bar_draws_on_rank_0_only_under_a_terminal(tmp_path):
    """Both workers run under their own pseudo-terminal, as under an interactive launch: only rank 0 draws."""
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs, outputs, readers, masters = [], [], [], []
    for rank in range(2):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        args = [sys.executable, "-m", "ddptrain", "train", *TINY, "--epochs", "1", "--progress",
                "--run_dir", str(tmp_path / "run")]
        procs.append(subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=REPO,
                                      env=cli_env({**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})))
        os.close(slave)
        outputs.append(bytearray())
        readers.append(threading.Thread(target=_drain, args=(master, outputs[-1]), daemon=True))
        readers[-1].start()
        masters.append(master)
    try:
        codes = [proc.wait(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        for reader, master in zip(readers, masters):
            reader.join(timeout=10)
            os.close(master)
    assert codes == [0, 0], [bytes(o).decode(errors="replace")[-2000:] for o in outputs]
    rank0, rank1 = bytes(outputs[0]), bytes(outputs[1])
    assert BAR_MARK in rank0 and b"/4 [" in rank0  # tqdm's "n/total [elapsed<remaining" of the 4 steps
    assert BAR_MARK not in rank1 and b"\r" not in rank1.replace(b"\r\n", b"")


def test_tensorboard_missing_is_a_usage_error_at_the_edge(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    code = cli.main(["train", "--tensorboard", "--run_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "pip install 'ddptrain[tensorboard]'" in err[0]
    assert not (tmp_path / "run").exists()  # refused before anything started

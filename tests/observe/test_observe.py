"""Metric sinks, progress bar, FLOPs/MFU and profiler traces, checked on real 2-process gloo runs."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest
import torch
from helpers import REPO, TINY, cli_env, metrics, read_jsonl, train
from observed_run import observed_run
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ddptrain import cli
from ddptrain.models import MiniResNet
from ddptrain.observe import perf
from ddptrain.observe.gpu_util import GpuUtilisation, step_breakdown, utilisation_warning
from ddptrain.parallel.procenv import free_port

# The metrics.jsonl schema (docs/observability.md): required keys and their JSON types, per split.
COMMON = {"time": float, "step": int, "epoch": int, "split": str, "loss": float}
TRAIN = {**COMMON, "lr": float, "samples_per_sec": float, "samples_per_sec_per_rank": float, "grad_norm": float,
         "step_time_s": float, "data_wait_s": float, "fwd_bwd_s": float, "optimizer_s": float,
         "peak_mem_mb": float, "nonfinite_steps": int, "slowest_rank": int, "slowest_host": str,
         "step_time_skew": float, "data_wait_max_s": float, "step_time_s_by_rank": list,
         "data_wait_s_by_rank": list}
EVAL = {**COMMON, "accuracy": float, "samples": int}
MEMORY = {"time": float, "step": int, "epoch": int, "split": str, "strategy": str, "param_bytes": list,
          "grad_bytes": list, "optimizer_bytes": list, "peak_grad_bytes": list, "peak_device_bytes": list}
BAR_MARK = b"loss="  # tqdm's postfix; the log lines say "loss 1.23", never "loss="


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return observed_run(tmp_path_factory)


def test_every_jsonl_line_has_the_schema_of_its_split(run):
    lines = read_jsonl(run.run_dir / "metrics.jsonl")
    for line in lines:
        schema = {"train": TRAIN, "eval": EVAL, "memory": MEMORY}[line["split"]]
        for key, kind in schema.items():
            assert isinstance(line.get(key), kind) and not isinstance(line[key], bool), (key, line)
    train = [line for line in lines if line["split"] == "train"]
    evals = [line for line in lines if line["split"] == "eval"]
    (memory,) = [line for line in lines if line["split"] == "memory"]
    assert memory["step"] == 1 and all(len(memory[k]) == 2 and memory[k][0] > 0 for k in MEMORY if k.endswith(
        "bytes") and k != "peak_device_bytes")
    # 256 samples / (32 x 2 ranks) = 4 steps per epoch, 3 epochs, --log_interval 1; one eval per epoch.
    assert [line["step"] for line in train] == list(range(1, 13))
    assert [(line["step"], line["epoch"]) for line in evals] == [(4, 0), (8, 1), (12, 2)]
    assert all(line["samples"] == 61 for line in evals)
    assert all(len(line["step_time_s_by_rank"]) == 2 for line in train)
    assert all(0.0 <= line["accuracy"] <= 1.0 for line in evals)
    assert all("mfu" in line for line in train)  # --peak_tflops given


def mini_resnet_forward_flops(width: int, size: int, in_channels: int = 3, num_classes: int = 10) -> int:
    """MiniResNet's forward FLOPs for one sample, by hand; a multiply-add is 2 FLOPs, so a conv is
    2 * Cin * Cout * k * k * Hout * Wout: the stem; stage 1 (4 convs width->width at full size); stages 2 and 3
    (the first conv halves the size and doubles the width, a 1x1 shortcut, then 3 convs at the new width);
    the linear head. BatchNorm, ReLU, the residual adds and the pooling are not counted."""
    def conv(c_in: int, c_out: int, k: int, side: int) -> int:
        return 2 * c_in * c_out * k * k * side * side

    flops = conv(in_channels, width, 3, size) + 4 * conv(width, width, 3, size)
    for c_in, side in ((width, size // 2), (2 * width, size // 4)):
        flops += conv(c_in, 2 * c_in, 3, side) + conv(c_in, 2 * c_in, 1, side) + 3 * conv(2 * c_in, 2 * c_in, 3, side)
    return flops + 2 * 4 * width * num_classes


def test_mfu_is_throughput_times_hand_counted_flops_over_the_peak(run):
    # The observed run: MiniResNet width 4 on 3x8x8 images, 10 classes, --peak_tflops 1.
    train_flops = 3 * mini_resnet_forward_flops(width=4, size=8)
    assert train_flops == 3 * 218_944
    for line in metrics(run.run_dir, "train"):
        assert line["mfu"] == pytest.approx(line["samples_per_sec_per_rank"] * train_flops / 1e12, rel=1e-9)


def test_a_gpts_flops_count_its_attention_whether_built_whole_or_on_the_meta_device():
    """By hand: the built-in gpt's matmuls (qkv, proj, the MLP's two, the head) plus attention's two (q k^T and the
    weighted sum of v), 2 FLOPs a multiply-add. Built whole on the CPU, torch's counter skipped the CPU's fused
    attention kernel (ddp's count); built on the meta device it counted the math path's matmuls (fsdp's), so the
    two strategies reported MFU apart. In this process."""
    import lm_plugins
    import torch

    from ddptrain.config import TrainConfig
    from ddptrain.loop.tasks import build_task
    from ddptrain.models import instantiate
    from ddptrain.observe import perf

    cfg = TrainConfig(model="gpt", task="language_model", vocab_size=64, seq_len=24, width=32, num_layers=2,
                      num_heads=2)
    data = cfg.section("data")
    sample = lm_plugins.MaskedSequences(1, 64, 24, 0)[0]
    tokens, width = len(sample["input_ids"]), 32
    per_block = 2 * tokens * width * (3 * width + width + 4 * width + 4 * width) + 2 * 2 * tokens * tokens * width
    by_hand = 3 * (2 * per_block + 2 * tokens * width * 64)
    for sharded in (False, True):
        module = instantiate(data, cfg.section("finetune"), None, torch.device("cpu"), seed=0, sharded=sharded,
                             channels_last=False)
        on = torch.device("meta") if sharded else torch.device("cpu")
        collate = lambda items: ([i for i, _ in items], torch.utils.data.default_collate([x for _, x in items]))  # noqa: E731
        assert perf.task_flops_per_sample(module, build_task(data), [sample], on, collate) == by_hand, sharded


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


_UNITS_US = {"us": 1.0, "ms": 1e3, "s": 1e6}


def _op_rows(table: str) -> list[tuple[str, float]]:
    """(op name, self CPU time in us) for each op row of a `key_averages().table()`, in its order."""
    lines = table.splitlines()
    header = re.split(r"\s{2,}", next(line for line in lines if "Self CPU %" in line).strip())
    column = header.index("Self CPU")
    rows = []
    for line in lines[lines.index(next(line for line in lines if "Self CPU %" in line)) + 2:]:
        if line.startswith("---"):
            break
        cells = re.split(r"\s{2,}", line.strip())
        value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", cells[column]).groups()
        rows.append((cells[0], float(value) * _UNITS_US[unit]))
    return rows


def test_profiler_summary_sorted_by_self_device_time_and_its_top_rows_logged(tmp_path):
    proc = train(tmp_path, "--epochs", "1", "--eval_size", "0", "--enable_profiling", "--profile_wait", "1",
                 "--profile_warmup", "1", "--profile_active", "2")
    summary = (tmp_path / "traces" / "summary-rank-0.txt").read_text()
    rows = _op_rows(summary)
    names = [name for name, _ in rows]
    assert {"forward", "backward", "optimizer", "ProfilerStep*"} <= set(names), summary
    assert any(name.startswith("aten::") for name in names), summary
    times = [us for _, us in rows]
    assert times == sorted(times, reverse=True), "sorted by self CPU time (no CUDA here), largest first"
    assert proc.stdout.count("profiler: top 10 ops by self CPU time") == 1, proc.stdout
    logged = proc.stdout[proc.stdout.index("profiler: top 10 ops"):]
    assert [name for name, _ in _op_rows(logged)] == names[:10], "the log shows the summary's first rows"


def test_profiler_summary_per_rank_and_logged_by_rank_0_only(run):
    for rank in (0, 1):
        assert _op_rows((run.run_dir / "traces" / f"summary-rank-{rank}.txt").read_text())
    output = run.proc.stdout + run.proc.stderr
    assert output.count("profiler: top 10 ops by self CPU time") == 1
    assert "traces/summary-rank-0.txt" in output


def test_low_gpu_utilisation_warning_names_the_dominant_phase():
    waiting = step_breakdown(step_s=0.100, data_wait_s=0.060, fwd_bwd_s=0.030, optimizer_s=0.005)
    assert waiting == pytest.approx({"data_wait": 0.060, "fwd_bwd": 0.030, "optimizer": 0.005, "other": 0.005})
    warning = utilisation_warning([40.0, 55.0, 62.0, 51.0], waiting)
    assert warning.startswith("GPU utilisation 52% over this log window (below 80%)"), warning
    assert "waiting for data (60% of step time)" in warning and "--num_workers" in warning
    host = step_breakdown(step_s=0.100, data_wait_s=0.005, fwd_bwd_s=0.020, optimizer_s=0.005)
    assert "host work outside the timed phases (70% of step time)" in utilisation_warning([10.0] * 5, host)
    compute = step_breakdown(step_s=0.010, data_wait_s=0.0, fwd_bwd_s=0.009, optimizer_s=0.001)
    assert "forward/backward (90% of step time)" in utilisation_warning([30.0], compute)
    assert utilisation_warning([79.9], waiting) is not None
    assert utilisation_warning([80.0], waiting) is None, "80% is not below 80%"
    assert utilisation_warning([95.0, 60.0, 90.0], waiting) is None, "the window's mean decides, not one dip"
    assert utilisation_warning([], waiting) is None, "no samples (CPU, or a window shorter than NVML's period)"
    # Timed phases that overlap (host data wait beside device time) leave no negative remainder.
    assert step_breakdown(step_s=0.010, data_wait_s=0.006, fwd_bwd_s=0.008, optimizer_s=0.001)["other"] == 0.0


def test_no_gpu_utilisation_is_read_or_written_without_cuda(run):
    sampler = GpuUtilisation(torch.device("cpu"))
    assert not sampler.enabled and sampler.read() == []
    assert not any("gpu_util_pct" in line for line in metrics(run.run_dir, "train"))
    assert "GPU utilisation" not in run.proc.stdout + run.proc.stderr


@pytest.mark.gpu
def test_nvml_samples_the_utilisation_of_a_busy_gpu():
    pytest.importorskip("pynvml", reason="pip install 'ddptrain[gpu]'")
    device = torch.device("cuda", 0)
    sampler = GpuUtilisation(device)
    assert sampler.enabled
    x = torch.randn(8192, 8192, device=device)
    busy_until = time.monotonic() + 2.0
    while time.monotonic() < busy_until:
        for _ in range(20):
            x = torch.tanh(x @ x)
        torch.cuda.synchronize(device)
    samples = sampler.read()
    assert samples and all(0.0 <= s <= 100.0 for s in samples), samples
    assert max(samples) >= 50.0, f"2 s of matmuls, yet NVML saw {samples}"
    time.sleep(1.0)
    assert all(s <= 100.0 for s in sampler.read()), "a second read returns only the newer samples"


@pytest.mark.gpu
def test_cuda_run_records_gpu_utilisation_and_warns_on_a_starved_gpu(tmp_path):
    pytest.importorskip("pynvml", reason="pip install 'ddptrain[gpu]'")
    # A tiny MLP cannot keep an H100-class GPU busy: the run must record it and say what the step waits on.
    # 4096 steps in windows of 256: each window outlasts NVML's sample period (1/6 s to 1 s).
    proc = train(tmp_path, "--backend", "nccl", "--dataset_size", "131072", "--epochs", "1", "--eval_size", "0",
                 "--log_interval", "256", "--save_every", "0", timeout=600)
    lines = [line for line in metrics(tmp_path, "train") if "gpu_util_pct" in line]
    assert lines, "no train line carries gpu_util_pct"
    for line in lines:
        assert 0.0 <= line["gpu_util_pct"] <= 100.0 and len(line["gpu_util_pct_by_rank"]) == 1
    warnings = [w for w in proc.stdout.splitlines() if "GPU utilisation" in w]
    assert warnings and len(warnings) <= len(metrics(tmp_path, "train")), "at most one warning per log window"
    assert all(re.search(r"most of the step is .* \(\d+% of step time\)", w) for w in warnings), warnings


def test_flops_of_mini_resnet_match_a_hand_count():
    model = MiniResNet(in_channels=3, num_classes=10, width=8, norm="batch").eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, 16, 16))
    assert sum(counter.get_flop_counts()["MiniResNet.stem.0"].values()) == 2 * 3 * 8 * 3 * 3 * 16 * 16
    assert counter.get_total_flops() == mini_resnet_forward_flops(width=8, size=16) == 3_388_032
    assert perf.train_flops_per_sample(model, torch.zeros(1, 3, 16, 16)) == 3 * 3_388_032


def test_train_flops_per_sample_of_single_layers_by_hand():
    """Forward is 2 FLOPs per multiply-add, training 3x forward; a batch is counted as one sample."""
    linear = nn.Linear(20, 7, bias=False)
    assert perf.train_flops_per_sample(linear, torch.zeros(5, 20)) == 3 * 2 * 20 * 7 == 840
    # Conv1d 2 -> 6 channels, kernel 5, length 32 -> 28 outputs: 2 * 2 * 6 * 5 * 28 per sample.
    conv = nn.Conv1d(2, 6, kernel_size=5, bias=False)
    assert perf.train_flops_per_sample(conv, torch.zeros(3, 2, 32)) == 3 * 2 * 2 * 6 * 5 * 28 == 10_080
    assert conv.training  # counted in eval mode, given back in train mode


def test_mfu_from_literal_numbers():
    # 250 samples/s x 6 GFLOP per sample = 1.5 TFLOP/s achieved on a 2 TFLOP/s device.
    assert perf.mfu(250.0, 6e9, 2.0) == pytest.approx(0.75)
    assert perf.mfu(1000.0, 840.0, 0.5) == pytest.approx(1.68e-6)
    assert perf.mfu(1000.0, 840.0, 0.0) is None and perf.mfu(1000.0, 0.0, 0.5) is None


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
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
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


@pytest.mark.parametrize("flags", [["--tensorboard"], ["--tracker", "tensorboard"]])
def test_tensorboard_missing_is_a_usage_error_at_the_edge(monkeypatch, capsys, tmp_path, flags):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    code = cli.main(["train", *flags, "--run_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "pip install 'ddptrain[tensorboard]'" in err[0]
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_a_window_split_by_a_checkpoint_sums_to_the_bit_what_one_unbroken_window_sums():
    """The window keeps each micro-step's loss until its line is written; a checkpoint in between keeps them
    unsummed, so a resumed run logs the very bits of the run it continues. Another world size merges every
    rank's window into rank 0's: the totals stay those of all ranks."""
    from ddptrain.loop.state import MetricWindow

    cpu = torch.device("cpu")
    # Summed in two parts (before and after the checkpoint) these float64 sums round differently from one sum.
    losses = [torch.tensor(v) for v in (1e8, 0.1, float("nan"), 0.2, -1e8, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9)]
    units = [3, 3, 3, torch.tensor(2), 3, torch.tensor(5), 3, 1, 1, 1, 1]
    whole = MetricWindow(cpu, 4)
    for loss, unit in zip(losses, units):
        whole.add_loss(loss, unit)
    whole.end_step(2, torch.tensor(float("inf")), [])  # a non-finite norm: step 2 skipped
    first = MetricWindow(cpu, 4)
    for loss, unit in zip(losses[:3], units[:3]):
        first.add_loss(loss, unit)
    first.end_step(2, torch.tensor(float("inf")), [])
    resumed, summed_only = MetricWindow(cpu, 4), MetricWindow(cpu, 4)
    resumed.load_state_dict(first.state_dict())
    loss_sum, count, bad = first.totals()  # a checkpoint from before the window kept its losses
    summed_only.load_state_dict({"loss": loss_sum, "count": count, "bad_loss": bad, "steps": 1})
    for loss, unit in zip(losses[3:], units[3:]):
        resumed.add_loss(loss, unit)
        summed_only.add_loss(loss, unit)
    assert resumed.totals() == whole.totals()
    loss_sum, count, bad = whole.totals()
    assert count == 3 + 3 + 2 + 3 + 5 + 3 + 1 + 1 + 1 + 1 and bad == 1 and abs(loss_sum - 3.7) < 1e-6
    assert summed_only.totals() == pytest.approx((loss_sum, count, bad))  # still read, to rounding
    assert resumed.snapshot().read().flags == whole.snapshot().read().flags == [False, True, False, False]

    other = MetricWindow(cpu, 4)
    other.add_loss(torch.tensor(2.0), 4)
    other.end_step(4, torch.tensor(float("nan")), [])
    merged = MetricWindow(cpu, 4)
    merged.load_state_dict(MetricWindow.merged([whole.state_dict(), other.state_dict()]))
    assert merged.totals() == tuple(a + b for a, b in zip(whole.totals(), other.totals()))
    assert merged.snapshot().read().flags == [False, True, False, True]


def test_a_log_step_writes_its_line_at_the_next_boundary_and_loses_none(tmp_path):
    """TrainLog.write only starts a line (the gather, or on CUDA the copy to the host); finish writes it. A
    write while a line is pending finishes that one first: every log step gets its line, in order."""
    from ddptrain.loop.state import MetricWindow
    from ddptrain.loop.train_log import Clock, TrainLog
    from ddptrain.observe.metrics import MetricSinks, ProgressBar
    from ddptrain.parallel.distributed import distributed

    cpu = torch.device("cpu")
    with distributed("gloo", 30, tmp_path) as ctx:
        sinks = MetricSinks(tmp_path, tensorboard=False)
        log = TrainLog(ctx, sinks, Clock(cpu), global_batch_size=8, unit="samples", flops_per_sample=0.0,
                       peak_tflops=0.0, straggler_skew=3.0)
        window, bar = MetricWindow(cpu, 2), ProgressBar(False, 6, initial=0)
        for step in range(1, 7):
            window.add_loss(torch.tensor(float(step)))
            window.end_step(step, torch.tensor(0.5), [("fwd_bwd", 0.0, 0.001)])
            if step % 2 == 0:
                log.write(window, step, 0, 6, 0.1, bar)
                window.reset()
                if step == 2:
                    log.finish()  # the boundary after: the line of step 2 is complete here
                    log.finish()  # nothing pending: a no-op
        sinks.close()
        before_finish = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
        sinks = MetricSinks(tmp_path, tensorboard=False)
        log.sinks = sinks
        log.finish()
        sinks.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert before_finish == [2, 4]  # step 4's line was finished by the write of step 6; 6 is still pending
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert [r["loss"] for r in rows] == [1.5, 3.5, 5.5]  # each window's own losses
    assert all(r["grad_norm"] == 0.5 and r["nonfinite_steps"] == 0 for r in rows)

"""benchmarks/gpu.py's harness on CPU: which rows run for how many GPUs, the arguments each launch gets, the
MFU and throughput arithmetic of a row, and the JSON and RESULTS section it writes. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_bench import harness_python

from benchmarks import gpu


def test_rows_by_gpu_count_in_order_of_importance():
    one, two = gpu.specs(1, dry=False), gpu.specs(2, dry=False)
    kinds = [s.kind for s in one]
    assert "data_parallel" not in kinds, "DataParallel vs DDP needs >= 2 GPUs"
    assert [s for s in two if s.kind != "data_parallel"] == one and two[4].kind == "data_parallel"
    names = [s.name for s in one]
    # bf16 on every model first, then the hot-path check, then channels_last (no GPT: it has no images) and compile.
    assert names[:3] == [f"{m}, bf16" for m, _ in gpu.MODELS] and one[3].kind == "hot_path"
    assert [n for n in names if n.endswith(", bf16+channels_last")] == [f"{m}, bf16+channels_last"
                                                                         for m, _ in gpu.MODELS[:2]]
    assert sum(s.compiled for s in one) == len(gpu.MODELS)
    assert all("--use_amp" in s.argv and "bf16" in s.argv for s in one if s.kind == "interleave")
    dry = gpu.specs(2, dry=True)
    assert [s.kind for s in dry] == ["interleave"] * len(gpu.MODELS) + ["data_parallel"]
    assert all("--compile" not in s.argv and "--channels_last" not in s.argv for s in dry)


def test_jobs_give_each_model_its_data_and_enough_steps(tmp_path):
    image, lm = gpu.specs(1, dry=True)[0], gpu.specs(1, dry=True)[2]
    job = gpu.job(image.name, image.argv, tmp_path, compiled=False, block=2)
    argv = job["argv"]
    assert argv[argv.index("--dataset") + 1] == "benchmarks.workloads:cached_synthetic"
    assert job["blocks"] == 7 and argv[argv.index("--max_steps") + 1] == str(7 * 2 + 1)
    assert gpu.job("x", image.argv, tmp_path, compiled=True, block=2)["blocks"] == 5
    lm_argv = gpu.job(lm.name, lm.argv, tmp_path, compiled=False, block=2)["argv"]
    data_dir = Path(lm_argv[lm_argv.index("--data_dir") + 1])
    meta = json.loads((data_dir / "meta.json").read_text())
    tokens = (data_dir / meta["train"][0]).stat().st_size // 2
    windows_needed = 2 * 15 * 4 * 8  # both sides' steps x batch x up to 8 GPUs
    assert tokens >= windows_needed * 16, "an epoch would end inside a measured block"


def test_data_parallel_and_ddp_launch_the_same_loop():
    dp, ddp = gpu.data_parallel_cmds(4, Path("dp.json"), Path("ddp.json"), dry=False)
    assert "--data_parallel" in dp and "torch.distributed.run" not in dp
    assert "--nproc-per-node=4" in ddp and "--data_parallel" not in ddp
    strip = lambda cmd: cmd[cmd.index("benchmarks.raw_loop") + 3:]  # noqa: E731 (after --out PATH)
    assert [a for a in strip(dp) if a != "--data_parallel"] == strip(ddp)
    assert "--use_amp" in dp


def fake_result(world: int, batch: int, flops: float, peak: float) -> dict:
    return {"ours_s": [9.0, 2.0, 2.0, 2.0], "theirs_s": [9.0, 1.9, 1.9, 1.9], "global_batch_size": batch * world,
            "world_size": world, "flops_per_sample": flops, "peak_tflops": peak,
            "peak_mb": {"ours": 2048.0, "theirs": 1024.0}}


def test_row_mfu_and_throughput_arithmetic():
    # 2 GPUs x 100 images, 20-step blocks of 2 s: 0.1 s a step, 2000 img/s, 1000 per GPU; 1e9 FLOPs per image on
    # a 1-TFLOP/s peak: MFU 1000 * 1e9 / 1e12 = 100 %. Ratio 1.9 / 2.0 = 0.95 (a MISS, with its reason).
    r = gpu.row("m", fake_result(2, 100, 1e9, 1.0), 20, ["--model", "mini_resnet"])
    assert r.data["mfu"] == pytest.approx(1.0)
    assert r.ours.startswith("2,000 img/s, MFU 100.0%, peak 2.0 GiB") and r.theirs.startswith("2,105 img/s")
    assert r.figure == "0.950" and r.passed is False and "MISS" in r.note
    # A language model counts tokens: 16 windows of 1024 tokens per step; MFU is per window (sample) FLOPs.
    lm = gpu.row("g", fake_result(1, 16, 3e12, 989.0), 20, ["--task", "language_model", "--seq_len", "1024"])
    assert lm.data["units_per_s"] == pytest.approx(16 * 1024 / 0.1)
    assert lm.data["mfu"] == pytest.approx(160 * 3e12 / 989e12)
    assert "tok/s" in lm.ours
    assert gpu.row("n", fake_result(1, 16, 0.0, 0.0), 20, ["--model", "gpt"]).data["mfu"] is None


def test_results_section_goes_on_top_of_the_dated_log(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nIntro.\n\n## CPU, 2026-11-30\n\nold\n")
    record = {"date": "2026-12-02T10:00:00", "gpus": 8, "device": "NVIDIA H100", "torch": "2.13", "host": "h",
              "load_avg": [0.1, 0.1, 0.1], "wall_s": 400.0, "out": "/x/2026-12-02-h-gpu.json",
              "table": "| a |\n|---|", "skipped": ["GPT, compile"]}
    gpu.write_results_section(results, gpu.results_section(record))
    text = results.read_text()
    assert text.index("Intro.") < text.index("## GPU, 2026-12-02: 8 x NVIDIA H100") < text.index("## CPU")
    assert "`results/2026-12-02-h-gpu.json`" in text and "Skipped for time: GPT, compile." in text


def test_dry_run_writes_json_and_section(tmp_path):
    """The script end to end at toy size on 2 CPU processes: every dry-run row, the JSON, the section."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real script")
    out, results = tmp_path / "gpu.json", tmp_path / "RESULTS.md"
    with harness_python(tmp_path) as run:  # its launches are warm starts too
        proc = run(["-m", "benchmarks.gpu", "--cpu_dry_run", "--out", str(out), "--results", str(results)], 300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [r["key"] for r in record["rows"]] == [s.name for s in gpu.specs(2, dry=True)[:3]] + ["data_parallel"]
    assert all(r["figure"] != "ERROR" for r in record["rows"])
    assert "tok/s" in record["rows"][2]["ddptrain"]
    assert "## GPU, " in results.read_text() and record["table"] in results.read_text()

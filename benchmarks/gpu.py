"""The GPU benchmark (`bash benchmarks/gpu.sh`): ddptrain vs the raw DDP loop on CUDA, with AMP bf16.

On every visible GPU (one process each, NCCL):

* for MiniResNet at the seed's size, a larger MiniResNet and a GPT language model, ddptrain against the raw
  loop (the CPU bench's interleaved overhead measurement, benchmarks/worker.py) in three variants — bf16;
  bf16 + channels_last; bf16 + channels_last + torch.compile (channels_last does nothing for the GPT):
  images/s or tokens/s of both sides and their ratio, MFU (model FLOPs / the GPU's dense bf16 peak) and the
  allocator's peak memory during each side's blocks;
* the CUDA hot-path check: tests/loop/test_hot_path.py's GPU test, which runs non-log steps under
  `torch.cuda.set_sync_debug_mode("error")` (any host sync raises);
* with >= 2 GPUs, nn.DataParallel (one process driving every GPU, the seed explainer's first way) against
  DDP (one process per GPU), both the raw loop (benchmarks/raw_loop.py), alternating launches.

The data are synthetic images made once and cycled, or token windows of a file written once
(benchmarks/workloads.py, sections.write_token_files), so the loader is never what is measured. Finishes
within 8 minutes: rows run in order of importance, and one that no longer fits the remaining time is skipped
and listed as such. Results: benchmarks/results/<date>-<host>-gpu.json, the table, and a dated section at
the top of benchmarks/RESULTS.md's log.

    bash benchmarks/gpu.sh                    # on a CUDA machine
    bash benchmarks/gpu.sh --cpu_dry_run      # the script's code path on 2 CPU processes at toy size
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    BenchError,
    Launch,
    Row,
    bench_env,
    fmt_ms,
    load_average,
    median,
    paired_ratios,
    python,
    render_table,
    run_launch,
    run_logged,
    torchrun_cmd,
)
from benchmarks.sections import flag_value, write_token_files
from ddptrain.observe import perf

BUDGET_S = 460  # of the 8 minutes; gpu.sh kills at 480
MODELS = [("MiniResNet-64 32px", ["--model", "mini_resnet", "--width", "64", "--image_size", "32",
                                  "--batch_size", "256"]),
          ("MiniResNet-160 64px", ["--model", "mini_resnet", "--width", "160", "--image_size", "64",
                                   "--batch_size", "128"]),
          ("GPT-768x12 1024 tok", ["--task", "language_model", "--model", "gpt", "--width", "768", "--num_layers",
                                   "12", "--num_heads", "12", "--seq_len", "1024", "--batch_size", "16"])]
DRY_SIZES = {"mini_resnet": ["--width", "8", "--image_size", "8", "--batch_size", "8"],
             "gpt": ["--width", "32", "--num_layers", "1", "--num_heads", "2", "--seq_len", "16", "--batch_size", "4"]}
VARIANTS = [("bf16", ["--use_amp", "--amp_dtype", "bf16"]),
            ("bf16+channels_last", ["--use_amp", "--amp_dtype", "bf16", "--channels_last"]),
            ("bf16+channels_last+compile", ["--use_amp", "--amp_dtype", "bf16", "--channels_last", "--compile"])]
# Seconds a launch is expected to need (start, a warm-up pair, 6 block pairs or 4 compiled; compiling both
# models dominates the last).
EXPECTED_S = {"bf16": 60, "bf16+channels_last": 60, "bf16+channels_last+compile": 200, "hot path": 60,
              "DataParallel vs DDP": 90}
BLOCK_STEPS = 20
TARGET = 0.99


@dataclass
class Spec:
    """One row of the GPU table, not yet run: what it is and the seconds it is expected to take."""

    name: str
    kind: str  # "interleave", "hot_path" or "data_parallel"
    expected_s: float
    argv: list[str] = field(default_factory=list)  # interleave: ddptrain flags of the model and variant
    compiled: bool = False


def require_cuda() -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.sh needs a CUDA device: torch {torch.__version__} sees none "
              f"(built with CUDA {torch.version.cuda}). Run it on a GPU machine; `make bench` is the CPU "
              "benchmark.", file=sys.stderr)
        raise SystemExit(2)
    return torch.cuda.device_count()


def model_flags(flags: list[str], dry: bool) -> list[str]:
    """A model's flags; at dry-run size, its toy dimensions and a small synthetic set instead."""
    if not dry:
        return flags
    kind = flags[flags.index("--model") + 1]
    return [*flags, *DRY_SIZES[kind], "--num_workers", "1", "--dataset_size", "4096"]


def specs(gpus: int, dry: bool) -> list[Spec]:
    """Every row for `gpus` GPUs, in order of importance: bf16 on each model, the hot-path check, DataParallel
    vs DDP (>= 2 GPUs), then channels_last and compile. The dry run keeps bf16 and DataParallel vs DDP's
    argument building: compiling takes minutes on 2 CPU cores and ddptrain refuses --channels_last on CPU
    (oneDNN#6035); the hot-path check is the GPU test itself."""
    rows = [Spec(f"{model}, bf16", "interleave", EXPECTED_S["bf16"], [*model_flags(flags, dry), *VARIANTS[0][1]])
            for model, flags in MODELS]
    if not dry:
        rows.append(Spec("CUDA hot path: no host sync in non-log steps", "hot_path", EXPECTED_S["hot path"]))
    if gpus >= 2:
        rows.append(Spec(f"DataParallel vs DDP, {gpus} GPUs", "data_parallel", EXPECTED_S["DataParallel vs DDP"]))
    if not dry:
        for variant, flags in VARIANTS[1:]:
            rows += [Spec(f"{model}, {variant}", "interleave", EXPECTED_S[variant], [*model_flags(m, dry), *flags],
                          "compile" in variant) for model, m in MODELS
                     if not ("channels_last" in variant and "compile" not in variant and "gpt" in m)]
    return rows


def job(name: str, argv: list[str], work: Path, compiled: bool, block: int = BLOCK_STEPS) -> dict:
    blocks = (4 if compiled else 6) + 1  # the first pair warms up (and compiles)
    steps = blocks * block + 1
    if "--task" in argv:  # token windows: enough for every step of both sides without an epoch end
        windows = 2 * steps * flag_value(argv, "--batch_size") * 8  # up to 8 GPUs
        data = ["--dataset", "tokens", "--data_dir",
                str(write_token_files(work / "tokens", int(1.2 * windows * flag_value(argv, "--seq_len")) + 1))]
    else:
        data = ["--dataset", "benchmarks.workloads:cached_synthetic", "--dataset_size", "1000000"]
    return {"name": name, "mode": "interleave", "block_steps": block, "blocks": blocks, "settle_s": 0.05,
            "argv": ["--run_dir", str(work / slug(name)), "--no-progress", "--no-auto_resume", "--save_every", "0",
                     "--num_workers", "6", "--eval_size", "0", *data, *argv, "--max_steps", str(steps)]}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def row(name: str, res: dict, block: int, argv: list[str]) -> Row:
    """Throughput of both sides (images/s, or tokens/s for a language model), MFU, peak memory, their ratio."""
    ratios = paired_ratios(res["ours_s"], res["theirs_s"], 1)
    ours, theirs = median(res["ours_s"][1:]) / block, median(res["theirs_s"][1:]) / block
    samples = res["global_batch_size"]
    per_sample, unit = (flag_value(argv, "--seq_len"), "tok/s") if "--task" in argv else (1, "img/s")
    utilisation = perf.mfu(samples / ours / res["world_size"], res["flops_per_sample"] or 0.0, res["peak_tflops"] or 0.0)
    mfu_text = f", MFU {100 * utilisation:.1f}%" if utilisation is not None else ""
    peak = res["peak_mb"]
    ratio = median(ratios)
    note = f"{res['world_size']} GPU(s), steps {fmt_ms(ours)} vs {fmt_ms(theirs)}; global batch {samples}"
    if ratio < TARGET:
        note += (" MISS: ddptrain's per-step extras (the lagged control all-reduce, the gradient norm of the "
                 "non-finite guard, a log step every 10 steps) did not hide behind the device's work; the "
                 "worker logs in the scratch dir say more.")
    return Row(name, name, f"{samples * per_sample / ours:,.0f} {unit}{mfu_text}, peak {peak['ours'] / 1024:.1f} GiB",
               f"{samples * per_sample / theirs:,.0f} {unit}, peak {peak['theirs'] / 1024:.1f} GiB", f"{ratio:.3f}",
               f">= {TARGET}", ratio >= TARGET, note,
               {"ratios": ratios, "ours_s": res["ours_s"], "theirs_s": res["theirs_s"], "peak_mb": peak,
                "mfu": utilisation, "units_per_s": samples * per_sample / ours})


def hot_path_row(name: str, work: Path, timeout_s: float) -> Row:
    """tests/loop/test_hot_path.py's GPU test, and --packing's loss on CUDA's sdpa (tests/data/test_packing.py), in a
    subprocess: they must run (not skip) and pass."""
    log = work / "hot_path.log"
    cmd = [python(), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
           "tests/loop/test_hot_path.py::test_no_cuda_sync_in_non_log_steps",
           "tests/data/test_packing.py::test_on_cuda_packed_and_padded_agree_for_each_attention_kernel[sdpa]"]
    try:
        run_logged(cmd, log, bench_env(), timeout_s)
        passed = " passed" in log.read_text() and " skipped" not in log.read_text()
        message = "" if passed else " MISS: the test did not run (skipped); see its log."
    except BenchError as exc:
        passed, message = False, " MISS: " + str(exc).splitlines()[0]
    return Row("hot_path", name, "PASS" if passed else "FAIL", "-", "no sync" if passed else "sync found", "no sync",
               passed, "non-log steps under torch.cuda.set_sync_debug_mode('error') (tests/loop/test_hot_path.py); "
               "packed = padded loss on CUDA sdpa (tests/data/test_packing.py)"
               + message, {"log": str(log)})


def data_parallel_cmds(gpus: int, out_dp: Path, out_ddp: Path, dry: bool) -> tuple[list[str], list[str]]:
    """The two launches of the DataParallel row: one process over every GPU, and one process per GPU (DDP);
    the same raw loop, model, per-GPU batch and bf16 autocast."""
    size = ["--width", "8", "--image_size", "8", "--batch_size", "8", "--dataset_size", "4096", "--timed_steps",
            "3", "--num_workers", "1"] if dry else ["--width", "64", "--image_size", "32", "--batch_size", "256",
                                                     "--dataset_size", "200000", "--timed_steps", "50",
                                                     "--num_workers", "6", "--use_amp"]
    dp = [python(), "-m", "benchmarks.raw_loop", "--out", str(out_dp), "--data_parallel", *size]
    ddp = torchrun_cmd(gpus, "benchmarks.raw_loop", "--out", str(out_ddp), *size)
    return dp, ddp


def data_parallel_row(name: str, gpus: int, work: Path, dry: bool, reps: int = 2) -> Row:
    """Images/s of nn.DataParallel and of DDP on the same GPUs, alternating launches (A B A B)."""
    rates: dict[str, list[float]] = {"dp": [], "ddp": []}
    for rep in range(reps):
        outs = {side: work / f"{side}-{rep}.json" for side in rates}
        cmds = dict(zip(("dp", "ddp"), data_parallel_cmds(gpus, outs["dp"], outs["ddp"], dry)))
        if dry:  # no CUDA: the DataParallel side cannot run, and one DDP launch checks the rest of the row
            cmds = {"ddp": cmds["ddp"]}
            outs["dp"] = outs["ddp"]
        for side, cmd in cmds.items():
            run_logged(cmd, work / f"{side}-{rep}.log", bench_env(), 300)
            record = json.loads(outs[side].read_text())
            rates[side].append(record["global_batch_size"] * record["steps"] / record["steps_s"])
        if dry:
            rates["dp"] = rates["ddp"]
    ratio = median([d / p for d, p in zip(rates["ddp"], rates["dp"])])
    return Row("data_parallel", name, f"DDP: {median(rates['ddp']):,.0f} img/s",
               f"DataParallel: {median(rates['dp']):,.0f} img/s", f"DDP {ratio:.2f}x", "-", None,
               "MiniResNet-64 at 32 px, bf16, 256 images per GPU, the raw loop both ways: DataParallel replicates "
               "the model from GPU 0 and gathers the outputs there every step, in one Python process; DDP runs a "
               f"process per GPU and all-reduces gradients. {reps} launches each, alternating.",
               {"dp_images_per_s": rates["dp"], "ddp_images_per_s": rates["ddp"], "ratio": ratio})


def results_section(record: dict[str, Any]) -> str:
    """The dated section for benchmarks/RESULTS.md: machine, run, the table, what was skipped."""
    lines = [f"## GPU, {record['date'][:10]}: {record['gpus']} x {record['device']}", "",
             f"- **Machine:** {record['gpus']} x {record['device']}, torch {record['torch']}, host {record['host']}; "
             f"load average {record['load_avg']} at start.",
             f"- **Run:** `bash benchmarks/gpu.sh`, {record['wall_s']:.0f} s wall (budget: 8 minutes). JSON: "
             f"`results/{Path(record['out']).name}`.", "", record["table"]]
    if record["skipped"]:
        lines += ["", f"Skipped for time: {', '.join(record['skipped'])}."]
    return "\n".join(lines) + "\n"


def write_results_section(path: Path, section: str) -> None:
    """Insert `section` at the top of the dated log (before the first `## ` heading: newest first)."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    path.write_text("".join(lines[:at]) + section + "\n" + "".join(lines[at:]))


def run_spec(spec: Spec, gpus: int, work: Path, dry: bool, left_s: float) -> Row:
    block = 2 if dry else BLOCK_STEPS
    if spec.kind == "hot_path":
        return hot_path_row(spec.name, work, max(left_s, 60))
    if spec.kind == "data_parallel":
        return data_parallel_row(spec.name, gpus, work, dry, reps=1 if dry else 2)
    launch = Launch(slug(spec.name), gpus, [job(spec.name, spec.argv, work, spec.compiled, block)],
                    timeout_s=max(left_s, 60))
    [res] = run_launch(launch, work)
    return row(spec.name, res, block, spec.argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash benchmarks/gpu.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<date>-<host>-gpu.json)")
    parser.add_argument("--results", help="the RESULTS file to add the run's section to (default "
                        "benchmarks/RESULTS.md; the dry run: none unless given)")
    parser.add_argument("--cpu_dry_run", action="store_true", help="run this script's code path on 2 CPU "
                        "processes at toy size (checks the script without a GPU; the numbers mean nothing)")
    args = parser.parse_args(argv)
    import torch

    dry = args.cpu_dry_run
    gpus = 2 if dry else min(require_cuda(), 8)
    started = time.monotonic()
    host = socket.gethostname()
    out = Path(args.out) if args.out else (REPO / "benchmarks" / "results" /
                                           f"{datetime.date.today().isoformat()}-{host}-gpu.json")
    if dry and not args.out:
        out = Path(tempfile.gettempdir()) / "ddptrain-gpu-bench-dry-run.json"
    results = Path(args.results) if args.results else (None if dry else REPO / "benchmarks" / "RESULTS.md")
    work = Path(tempfile.mkdtemp(prefix="ddptrain-gpu-bench-"))
    device = "CPU (dry run)" if dry else torch.cuda.get_device_name(0)
    print(f"ddptrain GPU bench: {gpus} x {device}, torch {torch.__version__}", file=sys.stderr, flush=True)
    rows, skipped = [], []
    chosen = specs(gpus, dry)
    if dry:  # the interleaved rows share one launch (toy sizes; the numbers mean nothing anyway)
        grouped = [spec for spec in chosen if spec.kind == "interleave"]
        outputs = run_launch(Launch("dry-run", gpus, [job(spec.name, spec.argv, work, False, 2) for spec in grouped],
                                    timeout_s=300), work)
        rows = [row(spec.name, res, 2, spec.argv) for spec, res in zip(grouped, outputs)]
        chosen = [spec for spec in chosen if spec.kind != "interleave"]
    for spec in chosen:
        left = BUDGET_S - (time.monotonic() - started)
        if left < spec.expected_s and not dry:
            skipped.append(spec.name)
            continue
        print(f"[{spec.name}] running ({left:.0f} s left) ...", file=sys.stderr, flush=True)
        try:
            rows.append(run_spec(spec, gpus, work, dry, left))
        except BenchError as exc:
            rows.append(Row(slug(spec.name), spec.name, "-", "-", "ERROR", "-", False, str(exc).splitlines()[0]))
        print(f"[{spec.name}] {rows[-1].ours} vs {rows[-1].theirs}: {rows[-1].figure}", file=sys.stderr, flush=True)
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": host, "gpus": gpus,
              "device": device, "torch": torch.__version__, "load_avg": load_average(),
              "wall_s": round(time.monotonic() - started, 1), "skipped": skipped, "out": str(out),
              "rows": [r.to_json() for r in rows]}
    record["table"] = render_table(record["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    if results is not None:
        write_results_section(results, results_section(record))
    print(f"ddptrain GPU bench, {record['date']}, {host}: {gpus} x {device}, torch {torch.__version__}; "
          f"{record['wall_s']:.0f} s (ratio = ddptrain throughput over the raw DDP loop's, same run)\n")
    print(record["table"])
    if skipped:
        print(f"\nskipped for time: {', '.join(skipped)}")
    failed = any(r.figure == "ERROR" for r in rows)
    if dry and not failed:  # nothing in it to look at
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nJSON: {out}" + (f" · section added to {results}" if results else "")
          + ("" if dry and not failed else f" · scratch: {work}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

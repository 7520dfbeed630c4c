"""The GPU benchmark (`bash benchmarks/gpu.sh`): ddptrain vs the raw DDP loop on CUDA, with AMP bf16.

On every visible GPU (one process each, NCCL), for MiniResNet at the seed's size and a larger MiniResNet,
three variants — bf16; bf16 + channels_last; bf16 + channels_last + torch.compile — each an interleaved
comparison in the same processes (the CPU bench's overhead measurement, benchmarks/worker.py). Reports
images/s of both sides and their ratio, MFU (model FLOPs / the GPU's dense bf16 peak) and the allocator's
peak memory during each side's blocks (both models are resident throughout). The data are synthetic images
made once and cycled (benchmarks/workloads.py), so the loader is never what is measured.

Finishes within 8 minutes: variants run in order of importance, and one that no longer fits the remaining
time is skipped and listed as such. Results: benchmarks/results/<date>-<host>-gpu.json and the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (REPO, BenchError, Launch, Row, fmt_ms, load_average, median, paired_ratios,
                               render_table, run_launch)
from ddptrain.observe import perf

BUDGET_S = 460  # of the 8 minutes; gpu.sh kills at 480
MODELS = [("MiniResNet-64 32px", ["--model", "mini_resnet", "--width", "64", "--image_size", "32",
                                  "--batch_size", "256"]),
          ("MiniResNet-160 64px", ["--model", "mini_resnet", "--width", "160", "--image_size", "64",
                                   "--batch_size", "128"])]
VARIANTS = [("bf16", ["--use_amp", "--amp_dtype", "bf16"]),
            ("bf16+channels_last", ["--use_amp", "--amp_dtype", "bf16", "--channels_last"]),
            ("bf16+channels_last+compile", ["--use_amp", "--amp_dtype", "bf16", "--channels_last", "--compile"])]
# Seconds a launch is expected to need (start, a warm-up pair, 6 block pairs or 4 compiled; compiling both
# models dominates the last).
EXPECTED_S = {"bf16": 60, "bf16+channels_last": 60, "bf16+channels_last+compile": 200}


def require_cuda() -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.sh needs a CUDA device: torch {torch.__version__} sees none "
              f"(built with CUDA {torch.version.cuda}). Run it on a GPU machine; `make bench` is the CPU "
              "benchmark.", file=sys.stderr)
        raise SystemExit(2)
    return torch.cuda.device_count()


BLOCK_STEPS = 20


def job(name: str, argv: list[str], work: Path, compiled: bool, block: int = BLOCK_STEPS) -> dict:
    blocks = (4 if compiled else 6) + 1  # the first pair warms up (and compiles)
    return {"name": name, "mode": "interleave", "block_steps": block, "blocks": blocks, "settle_s": 0.05,
            "argv": ["--run_dir", str(work / name.replace(" ", "_").replace("+", "_").replace(",", "")),
                     "--no-progress", "--no-auto_resume", "--save_every", "0", "--num_workers", "6",
                     "--eval_size", "0", "--dataset", "benchmarks.workloads:cached_synthetic", "--dataset_size",
                     "1000000", *argv, "--max_steps", str(blocks * block + 1)]}


def row(name: str, res: dict, block: int) -> Row:
    ratios = paired_ratios(res["ours_s"], res["theirs_s"], 1)
    ours, theirs = median(res["ours_s"][1:]) / block, median(res["theirs_s"][1:]) / block
    images = res["global_batch_size"]
    utilisation = perf.mfu(images / ours / res["world_size"], res["flops_per_sample"] or 0.0, res["peak_tflops"] or 0.0)
    mfu_text = f", MFU {100 * utilisation:.1f}%" if utilisation is not None else ""
    peak = res["peak_mb"]
    return Row(name, name, f"{images / ours:,.0f} img/s{mfu_text}, peak {peak['ours'] / 1024:.1f} GiB",
               f"{images / theirs:,.0f} img/s, peak {peak['theirs'] / 1024:.1f} GiB", f"{median(ratios):.3f}",
               ">= 0.99", median(ratios) >= 0.99,
               f"{res['world_size']} GPU(s), steps {fmt_ms(ours)} vs {fmt_ms(theirs)}; global batch {images}",
               {"ratios": ratios, "ours_s": res["ours_s"], "theirs_s": res["theirs_s"], "peak_mb": peak})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash benchmarks/gpu.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<date>-<host>-gpu.json)")
    parser.add_argument("--cpu_dry_run", action="store_true", help="run this script's code path on 2 CPU "
                        "processes at toy size (checks the script without a GPU; the numbers mean nothing)")
    args = parser.parse_args(argv)
    import torch

    dry = args.cpu_dry_run
    gpus = 2 if dry else min(require_cuda(), 8)
    models = [(name, [*flags, "--width", "8", "--image_size", "8", "--batch_size", "8", "--num_workers", "1",
                      "--dataset_size", "4096"]) for name, flags in MODELS] if dry else MODELS
    block = 2 if dry else BLOCK_STEPS

    started = time.monotonic()
    host = socket.gethostname()
    out = Path(args.out) if args.out else (REPO / "benchmarks" / "results" /
                                           f"{datetime.date.today().isoformat()}-{host}-gpu.json")
    if dry and not args.out:
        out = Path(tempfile.gettempdir()) / "ddptrain-gpu-bench-dry-run.json"
    work = Path(tempfile.mkdtemp(prefix="ddptrain-gpu-bench-"))
    device = "CPU (dry run)" if dry else torch.cuda.get_device_name(0)
    print(f"ddptrain GPU bench: {gpus} x {device}, torch {torch.__version__}", file=sys.stderr, flush=True)
    rows, skipped = [], []
    for variant, flags in VARIANTS:
        for model, model_flags in models:
            name = f"{model}, {variant}"
            left = BUDGET_S - (time.monotonic() - started)
            if dry and variant != "bf16":
                # Compiling on 2 CPU cores takes minutes (the options bench covers --compile), and ddptrain
                # refuses --channels_last on CPU (oneDNN#6035).
                continue
            if left < EXPECTED_S[variant] and not dry:
                skipped.append(name)
                continue
            print(f"[{name}] running ({left:.0f} s left) ...", file=sys.stderr, flush=True)
            launch = Launch(name.replace(" ", "_").replace(",", "").replace("+", "_"), gpus,
                            [job(name, [*model_flags, *flags], work, "compile" in variant, block)],
                            timeout_s=max(left, 60))
            try:
                [res] = run_launch(launch, work)
                rows.append(row(name, res, block))
            except BenchError as exc:
                rows.append(Row(name, name, "-", "-", "ERROR", "-", False, str(exc).splitlines()[0]))
            print(f"[{name}] {rows[-1].ours} vs {rows[-1].theirs}: {rows[-1].figure}", file=sys.stderr, flush=True)
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": host, "gpus": gpus,
              "device": device, "torch": torch.__version__, "load_avg": load_average(),
              "wall_s": round(time.monotonic() - started, 1), "skipped": skipped,
              "rows": [r.to_json() for r in rows]}
    record["table"] = render_table(record["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"ddptrain GPU bench, {record['date']}, {host}: {gpus} x {device}, torch {torch.__version__}; "
          f"{record['wall_s']:.0f} s (ratio = ddptrain images/s over the raw DDP loop's, same run)\n")
    print(record["table"])
    if skipped:
        print(f"\nskipped for time: {', '.join(skipped)}")
    print(f"\nJSON: {out} · scratch: {work}")
    return 1 if any(r.figure == "ERROR" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Each performance option against the defaults, measured before it may become a default.

Two Trainers — defaults, and defaults plus one option — live in the same 2 processes and alternate blocks
of their own `train_step` (ABAB...). The figure is the defaults' time over the option's (> 1: the option
is faster). A default changes only when an option wins clearly on a quiet machine (the lead's rule:
>= 3% and its interquartile range above 1); benchmarks/RESULTS.md records the decisions.

    python -m benchmarks.run --only options [--compile]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import Launch, Plan, Row, median, paired_ratios, quartiles
from benchmarks.sections import BENCH_NET, MID_MLP, lm_flags, net, settle

# (label, flags added to B, network): DDP settings on the MLP (19 MB of gradients: buckets matter), the rest
# on MiniResNet.
OPTIONS = [
    ("--channels_last", ["--channels_last"], "conv"),
    ("--static_graph", ["--static_graph"], "conv"),
    ("--no-gradient_as_bucket_view", ["--no-gradient_as_bucket_view"], "mlp"),
    ("--bucket_cap_mb 5", ["--bucket_cap_mb", "5"], "mlp"),
    ("--bucket_cap_mb 100", ["--bucket_cap_mb", "100"], "mlp"),
    ("--compile", ["--compile"], "conv"),
    # A GPT compiled whole under ddp, and per block under fsdp (each block compiled before fully_shard).
    ("--compile, GPT under ddp", ["--compile"], "gpt"),
    ("--compile, GPT under fsdp (per block)", ["--compile"], "gpt_fsdp"),
]
NETS = {"conv": "MiniResNet", "mlp": "MLP 4.7M", "gpt": "GPT (the LM rows'), ddp",
        "gpt_fsdp": "GPT (the LM rows'), fsdp"}
WIN_MARGIN = 1.03
CAVEATS = {"--channels_last": " On CPU, oneDNN's AVX2 backward of 1x1 stride-2 convolutions with fewer than 8 input "
                              "channels in channels_last corrupts memory and gradients (uxlfoundation/oneDNN#6035; "
                              "MiniResNet below --width 8), so it cannot be a CPU default whatever its speed."}


def options(size: str, work: Path, with_compile: bool = False) -> Plan:
    """Each option vs the defaults; `--compile` only when asked (compiling takes minutes on 2 cores)."""
    block, blocks, warmup = {"full": (10, 7, 1), "quick": (10, 4, 1), "tiny": (2, 2, 1)}[size]
    import torch  # (the parent of the benchmark launches does not import torch otherwise)

    # --channels_last is refused on CPU (oneDNN#6035, see CAVEATS): benchmarks/gpu.sh measures it on CUDA.
    chosen = [o for o in OPTIONS if (with_compile or "--compile" not in o[1])
              and (o[0] != "--channels_last" or torch.cuda.is_available())]
    nets = {"conv": net(BENCH_NET, size), "mlp": net(MID_MLP, size)}
    if any(kind.startswith("gpt") for _, _, kind in chosen):
        nets["gpt"] = lm_flags(size, work)
        nets["gpt_fsdp"] = [*nets["gpt"], "--strategy", "fsdp"]
    jobs = []
    for i, (label, flags, kind) in enumerate(chosen):
        common = [*nets[kind], "--no-progress", "--no-auto_resume", "--save_every", "0"]
        jobs.append({"name": label, "mode": "pair", "block_steps": block, "blocks": blocks + warmup,
                     "settle_s": settle(size),
                     "argv": [*common, "--run_dir", str(work / f"option-{i}-a")],
                     "argv_b": [*common, *flags, "--run_dir", str(work / f"option-{i}-b")]})

    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        rows = []
        for res, (label, flags, kind) in zip(results["options"], chosen):
            ratios = paired_ratios(res["b_s"], res["a_s"], warmup)  # defaults' time / option's time
            speedup = median(ratios)
            q1, q3 = quartiles(ratios)
            wins = speedup >= WIN_MARGIN and q1 > 1.0
            note = f"{NETS[kind]}, {block}-step blocks"
            if "--compile" in flags:
                note += f"; its first block also compiled: {res['b_s'][0] - median(res['b_s'][warmup:]):.1f} s"
            note += (". Faster by the margin here (>= 3%, interquartile range above 1)." if wins else
                     ". Not a clear win here.") + CAVEATS.get(label, "")
            rows.append(Row(f"option {label}", f"option {label}", f"{block / median(res['b_s'][warmup:]):.2f} steps/s",
                            f"{block / median(res['a_s'][warmup:]):.2f} steps/s (defaults)",
                            f"{speedup:.3f}x (IQR {q1:.3f}-{q3:.3f})", "-", None, note,
                            {"ratios": ratios, "a_s": res["a_s"], "b_s": res["b_s"], "wins": wins}))
        return rows

    return Plan([Launch("options", 2, jobs, timeout_s=900)], finish)

"""The benchmarks. Each function takes a size ("full", "quick", "tiny") and a scratch dir and returns a Plan:
the worker launches it needs and a `finish` that turns their results into table rows.

Every figure is a ratio of two things measured in the same run. Where both sides can share the processes
(overhead, accumulation, checkpoint) they alternate in blocks inside them; where they cannot (startup,
1 vs 2 processes) whole launches alternate, A B A B.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    Launch,
    Plan,
    Row,
    bench_env,
    fmt_ms,
    median,
    paired_ratios,
    python,
    quartiles,
    run_logged,
    torchrun_cmd,
)
from benchmarks.probe import CPU_KINDS, cpu_ms_per_step
from ddptrain.observe.metrics import read_metrics
from ddptrain.tools import plan as scaling_model
from ddptrain.tools.doctor import bus_bandwidth

# The quickstart's network (MiniResNet, width 16, 16x16 images): a real conv net with BatchNorm that steps
# in tens of ms on one CPU core. Synthetic data large enough that no epoch ends while measuring. (Tiny: width 8,
# because oneDNN's AVX2 kernel for 1x1 stride-2 convs with < 8 input channels in channels_last corrupts memory,
# uxlfoundation/oneDNN#6035, and the options benchmark runs channels_last. The tiny nets read through one loader
# worker per rank: the loader workers' path, without starting the default's 4 per rank and per loader.)
BENCH_NET = {"full": ["--model", "mini_resnet", "--width", "16", "--image_size", "16", "--batch_size", "32",
                      "--dataset_size", "200000", "--eval_size", "64"],
             "tiny": ["--model", "mini_resnet", "--width", "8", "--image_size", "8", "--batch_size", "8",
                      "--dataset_size", "4096", "--eval_size", "16", "--num_workers", "1"]}
# Communication-heavy: a 5-hidden-layer MLP of 28.3M parameters (113 MB of gradients in several DDP buckets;
# 227 MB of weights + SGD momentum in a checkpoint) for accumulation and the checkpoint stall; the built-in
# MLP at 4.7M parameters (19 MB of gradients) for scaling and the DDP options.
BIG_NET = {"full": ["--model", "benchmarks.workloads:deep_mlp", "--width", "2304", "--image_size", "32",
                    "--batch_size", "16", "--dataset_size", "100000", "--eval_size", "16"],
           "tiny": ["--model", "benchmarks.workloads:deep_mlp", "--width", "32", "--image_size", "8",
                    "--batch_size", "8", "--dataset_size", "4096", "--eval_size", "16", "--num_workers", "1"]}
MID_MLP = {"full": ["--model", "mlp", "--width", "1536", "--image_size", "32", "--batch_size", "32",
                    "--dataset_size", "100000", "--eval_size", "16"],
           "tiny": ["--model", "mlp", "--width", "64", "--image_size", "8", "--batch_size", "8",
                    "--dataset_size", "4096", "--eval_size", "16", "--num_workers", "1"]}
# "Every observability feature": metrics (with straggler statistics and MFU) at the default --log_interval,
# TensorBoard, the per-micro-step sample-id log, plus what is always on (watchdog and heartbeat, rank logs).
# Not the profiler (a bounded window of steps, not a steady state) nor the progress bar (drawn only on a
# terminal).
OBSERVED = ["--tensorboard", "--record_sample_ids", "--peak_tflops", "1"]
# The language-model task: a GPT (4 pre-norm blocks of width 128, 0.83M parameters) trained on next-token
# cross-entropy over windows of 64 byte tokens of real English text (CPython's pydoc topics, repeated so that
# no epoch ends while measuring), ~80 ms a step on one core like the conv net. The raw loop writes the same
# loss by hand (raw_loop.next_token_loss). Target 0.97: a GPT step has ~3x the parameter tensors of
# MiniResNet, and the non-finite guard's gradient norm grows with the parameter count.
LM_NET = {"full": ["--task", "language_model", "--model", "gpt", "--width", "128", "--num_layers", "4",
                   "--num_heads", "4", "--seq_len", "64", "--batch_size", "16"],
          "tiny": ["--task", "language_model", "--model", "gpt", "--width", "32", "--num_layers", "1",
                   "--num_heads", "2", "--seq_len", "16", "--batch_size", "4"]}
LM_TOKENS = {"full": 2_000_000, "tiny": 1 << 16}
LM_TARGET = 0.97
# The padded, masked language model: the same GPT on variable-length sequences of the same text (24..64 tokens)
# whose prompt prefixes are masked (labels -100). ddptrain divides each micro-batch's summed loss by the step's
# token count, agreed by one tiny all-reduce per step; the raw loop does the same by hand.
MASKED_LM = {"full": ["--dataset", "benchmarks.workloads:masked_text", "--dataset_size", "100000"],
             "tiny": ["--dataset", "benchmarks.workloads:masked_text", "--dataset_size", "2048"]}


# Small, fast steps: 3x32x32 inputs, one hidden layer of 352 (1.09M parameters), ~15-20 ms a step on one core.
SMALL_MLP = {"full": ["--model", "mlp", "--width", "352", "--image_size", "32", "--batch_size", "64",
                      "--num_workers", "0", "--dataset_size", "100000", "--eval_size", "16"],
             "tiny": ["--model", "mlp", "--width", "32", "--image_size", "8", "--batch_size", "8",
                      "--num_workers", "0", "--dataset_size", "4096", "--eval_size", "16"]}


def net(table: dict[str, list[str]], size: str) -> list[str]:
    return table["tiny" if size == "tiny" else "full"]


def flag_value(flags: list[str], name: str) -> int:
    return int(flags[flags.index(name) + 1])


def write_token_files(directory: Path, num_tokens: int) -> Path:
    """A `--dataset tokens` directory (ddptrain-tokens/1) with one train shard and no eval split: the bytes
    of CPython's pydoc topics (`--dataset pydoc`'s text), repeated to `num_tokens`."""
    from ddptrain.data.text import FORMAT, pydoc_tokens

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train-00000.bin").write_bytes(np.resize(pydoc_tokens(), num_tokens).astype("<u2").tobytes())
    (directory / "meta.json").write_text(json.dumps({"format": FORMAT, "dtype": "uint16", "vocab_size": 256,
                                                     "tokenizer": "bytes", "train": ["train-00000.bin"],
                                                     "eval": []}))
    return directory


def lm_flags(size: str, work: Path) -> list[str]:
    """LM_NET on a token directory written into `work`."""
    data = write_token_files(work / "tokens", LM_TOKENS["tiny" if size == "tiny" else "full"])
    return [*net(LM_NET, size), "--dataset", "tokens", "--data_dir", str(data)]


def lm_note(flags: list[str], res: dict[str, Any]) -> str:
    tokens = res["global_batch_size"] * flag_value(flags, "--seq_len")
    return (f"GPT width {flag_value(flags, '--width')}, {flag_value(flags, '--num_layers')} blocks, "
            f"{res['grad_bytes'] / 4e6:.2f}M parameters, {tokens} tokens per step on {res['world_size']} ranks "
            f"({flag_value(flags, '--batch_size')} windows of {flag_value(flags, '--seq_len')} per rank); "
            f"ddptrain's LanguageModel task against a hand-written next-token cross-entropy.")


def common_flags(work: Path, name: str) -> list[str]:
    return ["--run_dir", str(work / name), "--no-progress", "--no-auto_resume", "--save_every", "0"]


def spread(values: list[float]) -> str:
    q1, q3 = quartiles(values)
    return f"IQR {q1:.3f}-{q3:.3f}, n={len(values)}"


PHASES = ("forward", "backward", "optimizer", "receiving batches", "gradient norm")


def cpu_by_side(res: dict[str, Any], warmup: int, block: int, key: str = "cpu_s") -> dict[str, dict[str, float]]:
    """Rank 0's CPU milliseconds per step for each side's timed blocks: by kind of thread ("cpu_s") or the
    training thread's by phase ("phase_cpu_s", with "rest": its total less the phases)."""
    out = {side: cpu_ms_per_step(blocks[warmup:], block * len(blocks[warmup:]))
           for side, blocks in res[key].items()}
    if key == "phase_cpu_s":
        for ms in out.values():
            ms["rest"] = ms.get("total", 0.0) - sum(ms.get(phase, 0.0) for phase in PHASES)
    return out


def phase_note(phases: dict[str, dict[str, float]]) -> str:
    """The training thread's CPU by phase, ddptrain vs the raw loop."""
    ours, theirs = phases["ours"], phases["theirs"]
    parts = ", ".join(f"{phase} {ours.get(phase, 0.0):.2f} vs {theirs.get(phase, 0.0):.2f}"
                      for phase in (*PHASES, "rest"))
    return (f"The training thread's CPU by phase, ms per step: {parts} (the gradient norm: ddptrain's non-finite "
            "guard, a read of every gradient; the rest: its fixed per-step cost, the guard's flags, loss sums, "
            "logging and schedule, against the raw loop's zero_grad and loop).")


def cpu_note(cpu: dict[str, dict[str, float]]) -> str:
    """Where the CPU went, ddptrain vs the raw loop (empty where /proc could not tell)."""
    ours, theirs = cpu["ours"], cpu["theirs"]
    if not ours.get("training thread"):
        return ""
    kinds = ", ".join(f"{kind} {ours[kind]:.2f} vs {theirs[kind]:.2f}" for kind in CPU_KINDS)
    return (f"CPU per step on rank 0, ddptrain vs raw, ms: {kinds}; the training thread waited for a core "
            f"{ours['training thread wait']:.2f} vs {theirs['training thread wait']:.2f}.")


def settle(size: str) -> float:
    """Seconds of quiet before each timed block (the other side's threads wind down); none at toy size."""
    return 0.0 if size == "tiny" else 0.1


# --- overhead ------------------------------------------------------------------------------------

def tracked_flags(work: Path) -> list[str]:
    """MLflow in a local SQLite store (its writes on the tracker thread, on the cores training uses) and an EMA
    of the weights updated after every step; metrics at the default --log_interval."""
    return ["--tracker", "mlflow", "--mlflow_tracking_uri", f"sqlite:///{work / 'mlflow.db'}", "--ema_decay", "0.999"]


def overhead(size: str, work: Path) -> Plan:
    """ddptrain's Trainer vs the raw DDP loop, same model/data/processes, in alternating blocks of K steps.

    32 pairs at full size: on a shared 2-core VM one pair's ratio spreads ±10 % (steal time, loader workers
    on the same cores), and the median of 16 moved by ±4 % between runs of one tree."""
    conv = net(BENCH_NET, size)
    return interleaved(size, [
        ("overhead", "overhead, default features", conv, 0.99),
        ("overhead_observed", "overhead, all observability on", [*conv, *OBSERVED], 0.97),
        ("overhead_tracked", "overhead, a tracker and an EMA on", [*conv, *tracked_flags(work)], 0.97),
        ("overhead_lm", "overhead, language model (GPT)", lm_flags(size, work), LM_TARGET),
        ("overhead_masked_lm", "overhead, padded masked LM (token-weighted)",
         [*net(LM_NET, size), *net(MASKED_LM, size)], LM_TARGET)], work)


def small_steps(size: str, work: Path) -> Plan:
    """The overhead on small, fast steps, where ddptrain's fixed per-step cost shows: a 1.1M-parameter MLP on
    in-memory synthetic images, batch 64 per rank, no loader workers, SGD with momentum, default logging; and
    the same job over a torch TensorDataset (issue 39's: the data a practitioner's own loop reads, costing
    nothing to make).

    Measured both ways: interleaved blocks inside one launch, and as a user compares, alternating separate
    launches of `ddptrain train --nproc 2` and the bare torchrun script (`benchmarks/raw_loop.py`), each timed
    over the same steady-state steps (ddptrain's from its metrics.jsonl, the script's by its own clock).
    """
    flags = net(SMALL_MLP, size)
    tensors = [*flags, "--dataset", "benchmarks.workloads:tensor_images"]
    inside = interleaved(size, [("overhead_small", "overhead, small steps (1.1M-param MLP, no loader workers)",
                                 flags, 0.99),
                                ("overhead_tensors", "overhead, small steps over a TensorDataset", tensors, 0.99)],
                         work, block_steps=20)
    pairs, warm, timed, interval = {"full": (8, 20, 200, 10), "quick": (3, 20, 100, 10), "tiny": (1, 2, 4, 2)}[size]
    same = [x for flag in ("--model", "--width", "--image_size", "--batch_size", "--dataset_size", "--num_workers")
            for x in (flag, flags[flags.index(flag) + 1])]

    def launches(name: str, ours_flags: list[str], raw_flags: list[str]) -> tuple[list[float], list[float]]:
        """Seconds per step of each side over `pairs` alternating pairs of launches."""
        ours, theirs = [], []
        for rep in range(pairs):
            _, _, raw = launch_pair(work, f"{name}-{rep}",
                                    [*ours_flags, "--max_steps", str(warm + timed), "--log_interval", str(interval)],
                                    [*raw_flags, "--steps", str(warm - 2), "--timed_steps", str(timed)], 600)
            metrics = read_metrics(work / f"{name}-{rep}" / "metrics.jsonl")
            at = {r["step"]: r["time"] for r in metrics if r["split"] == "train"}
            ours.append((at[warm + timed] - at[warm]) / timed)
            theirs.append(raw["steps_s"] / timed)
        return ours, theirs

    def row(key: str, label: str, ours: list[float], theirs: list[float]) -> Row:
        ratios = [t / o for o, t in zip(ours, theirs)]
        ratio = median(ratios)
        passed = ratio >= 0.99
        note = (f"{pairs} pair{'s' if pairs != 1 else ''} of separate launches, alternating: `ddptrain train "
                f"--nproc 2` (steps {warm + 1}-{warm + timed}, from its metrics.jsonl's line times, --log_interval "
                f"{interval}) and the bare torchrun script (the same steps by its own clock); the raw loop's step "
                f"{fmt_ms(median(theirs))}, ddptrain {1000 * (median(ours) - median(theirs)):+.2f} ms per step "
                "(medians). Separate launches also differ by where the kernel places each launch's processes: "
                "their spread is wider than the interleaved row's.")
        if not passed:
            note += (" MISS: what ddptrain adds per step is named in the interleaved row's phases: the gradient "
                     "norm (a pass over the gradients) and the fixed rest.")
        return Row(key, label, f"{1 / median(ours):.2f} steps/s", f"{1 / median(theirs):.2f} steps/s (raw DDP)",
                   f"{ratio:.3f} ({spread(ratios)})", ">= 0.99", passed, note,
                   {"ratios": ratios, "ddptrain_step_s": ours, "raw_step_s": theirs})

    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        synthetic = launches("small-launch", flags, same)
        in_memory = launches("tensors-launch", tensors, [*same, "--tensor_dataset"])
        return [*inside.finish(results),
                row("overhead_small_launches", "overhead, small steps, separate launches", *synthetic),
                row("overhead_tensors_launches", "overhead, small steps over a TensorDataset, separate launches",
                    *in_memory)]

    return Plan(inside.launches, finish)


def interleaved(size: str, cases: list[tuple[str, str, list[str], float]], work: Path,
                block_steps: int = 10) -> Plan:
    """One launch per case, ddptrain and the raw loop alternating blocks inside it; a row per case."""
    block, rounds, warmup = {"full": (block_steps, 32, 1), "quick": (block_steps, 6, 1), "tiny": (2, 2, 1)}[size]
    blocks = rounds + warmup
    launches = [Launch(key, 2, [{"name": key, "mode": "interleave", "block_steps": block, "blocks": blocks,
                                 "settle_s": settle(size),
                                 "argv": [*flags, *common_flags(work, key), "--max_steps", str(blocks * block + 1)]}])
                for key, _, flags, _ in cases]

    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        rows = []
        for key, label, flags, target in cases:
            [res] = results[key]
            ratios = paired_ratios(res["ours_s"], res["theirs_s"], warmup)
            ours = median(res["ours_s"][warmup:]) / block
            theirs = median(res["theirs_s"][warmup:]) / block
            ratio = median(ratios)
            passed = ratio >= target
            calls = res["calls_s"]
            note = (f"ddptrain {1000 * (ours - theirs):+.2f} ms per step vs the raw loop's {fmt_ms(theirs)} step "
                    f"(medians of {block}-step blocks); rank 0 spends {fmt_ms(calls['_between_steps']['median_s'])} "
                    "per step between steps (the control vote, every --control_interval steps), "
                    f"{fmt_ms(calls['_log_train']['median_s'])} per log step (median call) and "
                    f"{fmt_ms(calls['finish']['total_s'] / max(calls['_log_train']['count'], 1))} per line to finish "
                    "it at the next step boundary (mean).")
            cpu, phases = cpu_by_side(res, warmup, block), cpu_by_side(res, warmup, block, "phase_cpu_s")
            note = " ".join(filter(None, [note, cpu_note(cpu), phase_note(phases)]))
            if key == "overhead_lm":
                note = lm_note(flags, res) + " " + note
            if key == "overhead_masked_lm":
                note = ("Padded, masked sequences (24-64 tokens, prompts masked): both sides count the step's "
                        "tokens from the labels, all-reduce the count under the first forward and divide each "
                        "micro-batch's summed loss by it. " + note)
            if not passed and key == "overhead_observed":
                note += (" MISS: every 10th step is a log step: a device->host read of the loss sums and a "
                         "gather of every rank's sums and timings started, waited for at the next boundary; a "
                         "JSON line, ~15 TensorBoard scalars and a log line on the writer thread; every "
                         "micro-step writes a sample-id line — a fixed CPU cost on cores the training shares, "
                         "so the ratio rises with step time.")
            elif not passed:
                note += (" MISS: ddptrain adds the global gradient norm (non-finite guard) and on-device loss "
                         "sums per step, a tiny CPU all-gather on the control group every --control_interval "
                         "steps (preemption and timed-save agreement, read one step late) and a log step every "
                         "--log_interval steps; on a 2-core machine its threads (gloo's, the batch receiver) take "
                         "CPU from the same cores.")
            if key in ("overhead_lm", "overhead_masked_lm"):  # tokens/s: what a language model's throughput is read in
                tokens = res["global_batch_size"] * flag_value(flags, "--seq_len")
                speeds = f"{tokens / ours:,.0f} tokens/s", f"{tokens / theirs:,.0f} tokens/s (raw DDP)"
            else:
                speeds = f"{1 / ours:.2f} steps/s", f"{1 / theirs:.2f} steps/s (raw DDP)"
            rows.append(Row(key, label, *speeds,
                            f"{ratio:.3f} ({spread(ratios)})", f">= {target}", passed, note,
                            {"ratios": ratios, "ddptrain_step_s": ours, "raw_step_s": theirs, "block_steps": block,
                             "ours_s": res["ours_s"], "theirs_s": res["theirs_s"], "calls_s": calls,
                             "cpu_ms_per_step": cpu, "phase_cpu_ms_per_step": phases}))
        return rows

    return Plan(launches, finish)


# --- accumulation --------------------------------------------------------------------------------

def accumulation(size: str, work: Path) -> Plan:
    """Accumulation over 4 micro-steps: ddptrain (no_sync) vs the seed article's all-reduce on every micro-step."""
    block, rounds, warmup = {"full": (2, 6, 1), "quick": (2, 3, 1), "tiny": (1, 2, 1)}[size]
    accum, blocks = 4, rounds + warmup
    job = {"name": "accumulation", "mode": "accumulate", "block_steps": block, "blocks": blocks,
           "settle_s": settle(size),
           "argv": [*net(BIG_NET, size), *common_flags(work, "accumulation"), "--grad_accum_steps", str(accum),
                    "--max_steps", str(blocks * block + 1)]}

    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        [res] = results["accumulation"]
        sides = {}
        for side, steps in (("ddptrain", res["steps"]), ("raw", res["raw_steps"])):
            calls = {int(k): v for k, v in res[f"{side}_calls_by_micro"].items()}
            per_round = calls.get(accum - 1, 0) / steps  # bucket all-reduces of one full gradient sync
            # A round = the bucket all-reduces of one backward; every optimizer step repeats the same pattern,
            # so the micro-steps that ever communicated are the rounds of each step.
            sides[side] = {"calls_by_micro": calls, "calls_per_step": sum(calls.values()) / steps,
                           "buckets": per_round, "rounds_per_step": len(calls), "micro_steps_with_comm": sorted(calls)}
        ours, theirs = sides["ddptrain"], sides["raw"]
        ratios = paired_ratios(res["ours_s"], res["theirs_s"], warmup)
        t_ours, t_theirs = median(res["ours_s"][warmup:]) / block, median(res["theirs_s"][warmup:]) / block
        speedup = median(ratios)
        only_last = ours["micro_steps_with_comm"] == [accum - 1]
        passed = only_last and speedup > 1.0
        note = (f"{res['grad_bytes'] / 1e6:.0f} MB of gradients in {ours['buckets']:.1f} bucket all-reduces per round; "
                f"ddptrain all-reduces in micro-step(s) {ours['micro_steps_with_comm']} of 0..{accum - 1}, the "
                f"seed article's loop in {theirs['micro_steps_with_comm']}.")
        if not passed:
            note += (" MISS: " + ("gradient communication happened before the last micro-step" if not only_last else
                                  "no_sync saved no time: communication is cheap next to compute here"))
        params_m = res["grad_bytes"] / 4e6
        return [Row("accumulation", f"accumulation x{accum}, {params_m:.1f}M params",
                    f"{ours['rounds_per_step']} all-reduce round/step, {t_ours:.3f} s/step",
                    f"{theirs['rounds_per_step']} rounds/step, {t_theirs:.3f} s/step (sync every micro-step)",
                    f"{speedup:.2f}x faster ({spread(ratios)})", "1 round/step, faster", passed, note,
                    {"ddptrain": ours, "seed_way": theirs, "ratios": ratios, "ddptrain_step_s": t_ours,
                     "seed_way_step_s": t_theirs, "grad_bytes": res["grad_bytes"]})]

    return Plan([Launch("accumulation", 2, [job])], finish)


# --- checkpoint stall ----------------------------------------------------------------------------

def checkpoint(size: str, work: Path) -> Plan:
    """Training time lost to a save: ddptrain's sync vs async save, alternating in one run."""
    period, num_saves = {"full": (6, 6), "quick": (6, 6), "tiny": (2, 4)}[size]
    first = period + (5 if size != "tiny" else 1)
    last = first + 2 * period * (num_saves - 1)
    job = {"name": "checkpoint", "mode": "checkpoint", "first_save": first, "period": period,
           "num_saves": num_saves,
           "argv": [*net(BIG_NET, size), *common_flags(work, "checkpoint"), "--max_steps", str(last + period + 1),
                    "--keep_last", "2", "--batch_size", "8"]}

    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        [res] = results["checkpoint"]
        by_mode: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
        for save in res["saves"]:
            by_mode[save["mode"]].append(save)
        # The first async save also allocates the staging memory that later ones reuse: steady state is the rest.
        steady = {"sync": by_mode["sync"], "async": by_mode["async"][1:] or by_mode["async"]}
        stall = {m: median([s["blocked_s"] for s in saves]) for m, saves in steady.items()}
        first_async = by_mode["async"][0]["blocked_s"]
        lost = {m: median([s["lost_s"] for s in saves]) for m, saves in by_mode.items()}
        ratio = stall["async"] / stall["sync"]
        passed = ratio <= 0.05
        state_mb = res["checkpoint_bytes"] / 1e6
        note = (f"checkpoint of {state_mb:.0f} MB (weights + SGD momentum + trainer state). Stall = time the "
                f"training loop spends inside checkpoints.save; the first async save also allocates its staging copy "
                f"({fmt_ms(first_async)}), later ones reuse it. Lost = extra wall time of the "
                f"{period} steps from the save on, against the {period} clean steps before it: sync "
                f"{lost['sync']:.2f} s, async {lost['async']:.2f} s. Each rank copies and writes its share of the "
                "tensors (DCP; under ddp each tensor is written by one rank), the async writer in a thread: where "
                "training already uses every core (here 2 processes on 2 cores) that work still slows the steps "
                "around it; on a GPU node it runs on otherwise idle host cores.")
        if not passed:
            note += (" MISS: the async stall is the copy of the state into the staging memory plus the agreement "
                     "collectives; on a loaded machine the copy competes for memory bandwidth and cores.")
        return [Row("checkpoint", f"checkpoint stall, {state_mb:.0f} MB state", f"async: {fmt_ms(stall['async'])}",
                    f"sync: {fmt_ms(stall['sync'])}", f"{ratio:.3f} of sync", "<= 0.05 of sync", passed, note,
                    {"saves": res["saves"], "stall_s": stall, "lost_s": lost,
                     "checkpoint_bytes": res["checkpoint_bytes"]})]

    return Plan([Launch("checkpoint", 2, [job])], finish)


# --- data ----------------------------------------------------------------------------------------

def write_cifar_files(directory: Path, records_per_file: int, seed: int = 0) -> Path:
    """CIFAR-10 binary files of random images: data_batch_1..5.bin and test_batch.bin (1 label + 3072 bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        records = rng.integers(0, 256, size=(records_per_file, 3073), dtype=np.uint8)
        records[:, 0] = rng.integers(0, 10, size=records_per_file)
        (directory / name).write_bytes(records.tobytes())
    return directory


def data(size: str, work: Path) -> Plan:
    """Fraction of step time spent waiting for the loader (ddptrain's own metric), default loader settings."""
    interval, windows = {"full": (10, 4), "quick": (10, 2), "tiny": (2, 2)}[size]
    cifar = write_cifar_files(work / "cifar", 64 if size == "tiny" else 2000)
    conv = net(BENCH_NET, size)
    flag = lambda name: conv[conv.index(name) + 1]  # noqa: E731
    steps = ["--log_interval", str(interval), "--max_steps", str(interval * (windows + 1))]
    loader = ["--num_workers", flag("--num_workers")] if "--num_workers" in conv else []  # the tiny net's
    cases = [("data_synthetic", "synthetic", [*conv, *common_flags(work, "data_synthetic"), *steps]),
             ("data_cifar", "CIFAR-10 files", ["--model", "mini_resnet", "--width", flag("--width"), "--dataset",
                                               "cifar10", "--data_dir", str(cifar), "--batch_size",
                                               flag("--batch_size"), *loader, *common_flags(work, "data_cifar"),
                                               *steps])]
    handoff = {"handoff_fetches": 2, "handoff_wait_s": 0.05} if size == "tiny" else {}  # toy batches: made at once
    jobs = [{"name": key, "mode": "timeline", "handoff_probe": True, **handoff, "argv": argv} for key, _, argv in cases]

    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        rows = []
        for res, (key, label, _) in zip(results["data"], cases):
            lines = res["metrics"][1:]  # the first window includes starting the loader workers
            waits = [sum(r["data_wait_s_by_rank"][rank] for r in lines) for rank in range(res["world_size"])]
            total = sum(r["step_time_s"] for r in lines)
            fractions = [w / total for w in waits]
            worst = max(fractions)
            passed = worst < 0.02
            wait_ms, handoff_ms = 1000 * max(waits) / len(lines), 1000 * res["handoff_s"]
            note = (f"worst rank waits {wait_ms:.2f} ms per {1000 * total / len(lines):.1f} ms step ({len(lines)} log "
                    f"windows after the first; 2 loader workers per rank, prefetch 4). Receiving a batch that is "
                    f"already made costs {handoff_ms:.2f} ms: its ids and tensors of up to 256 KiB travel in the "
                    "batch's pickle, larger ones in shared memory whose descriptor is fetched from the worker over "
                    "a socket (torch's file_descriptor sharing) - on CPU a background thread of the training "
                    "process receives, so the step does not wait for it.")
            if not passed:
                note += (" MISS: the batches were not ready when the step asked: the loader workers share the 2 "
                         "cores with the 2 training processes. More --num_workers, a cheaper __getitem__ or "
                         "torch.multiprocessing's file_system sharing strategy (~3x cheaper handoff in a side "
                         "test) would help.")
            rows.append(Row(key, f"data wait, {label}", f"{100 * worst:.2f}% of step time (worst rank)", "-",
                            f"{100 * worst:.2f}%", "< 2%", passed, note,
                            {"fractions_by_rank": fractions, "step_s": total / len(lines)}))
        return rows

    return Plan([Launch("data", 2, jobs)], finish)


def launch_pair(work: Path, name: str, ddptrain_argv: list[str], raw_argv: list[str],
                timeout_s: float) -> tuple[float, float, dict[str, Any]]:
    """One pair of separate launches, as a user compares: `ddptrain train --nproc 2 ARGV` into WORK/NAME, then
    the bare torchrun script (`benchmarks/raw_loop.py`) with RAW_ARGV, one OpenMP thread per process each.
    Returns when each launch started (unix time) and the script's JSON."""
    env = bench_env(threads=1)
    ours_started = time.time()
    run_logged([python(), "-m", "ddptrain", "train", "--nproc", "2", *ddptrain_argv, *common_flags(work, name)],
               work / f"{name}-ddptrain.log", env, timeout_s)
    out = work / f"{name}-raw.json"
    raw_started = time.time()
    run_logged(torchrun_cmd(2, "benchmarks.raw_loop", "--out", str(out), *raw_argv), work / f"{name}-raw.log", env,
               timeout_s)
    return ours_started, raw_started, json.loads(out.read_text())


# --- startup -------------------------------------------------------------------------------------

def startup(size: str, work: Path) -> Plan:
    """Time from launch to the end of the first optimizer step: `ddptrain train --nproc 2` vs bare torchrun."""
    reps = {"full": 3, "quick": 1, "tiny": 1}[size]
    conv = net(BENCH_NET, size)
    same = [x for flag in ("--model", "--width", "--image_size", "--batch_size", "--dataset_size")
            for x in (flag, conv[conv.index(flag) + 1])]

    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        ours, theirs = [], []
        for rep in range(reps):
            name = f"startup-{rep}"
            ours_started, raw_started, raw = launch_pair(
                work, name, [*conv, "--max_steps", "1", "--log_interval", "1", "--eval_size", "0"], same, 300)
            first = json.loads((work / name / "metrics.jsonl").read_text().splitlines()[0])
            ours.append(first["time"] - ours_started)
            theirs.append(raw["first_step_time"] - raw_started)
        ratios = [o / t for o, t in zip(ours, theirs)]
        ratio = median(ratios)
        passed = ratio <= 1.2
        note = ("both start 2 workers through torch's elastic agent; the clock runs from launch to the first "
                "optimizer step done. ddptrain also validates the config, gathers host names, counts the model's "
                "FLOPs and sets up the run dir, logs, watchdog and checkpoint manager.")
        if not passed:
            note += " MISS: the worker logs in the bench's work dir (--keep) show where the extra time goes."
        return [Row("startup", "startup, time to first step", f"{median(ours):.2f} s",
                    f"{median(theirs):.2f} s (bare torchrun)", f"{ratio:.2f}x ({spread(ratios)})", "<= 1.2x", passed,
                    note, {"ddptrain_s": ours, "torchrun_s": theirs, "ratios": ratios})]

    return Plan([], finish)


# --- scaling -------------------------------------------------------------------------------------

SCALING_TOLERANCE = 0.05  # the plan's 2-process step within 5 % of the measured one


def scaling(size: str, work: Path) -> Plan:
    """Steps/s at 1 and 2 processes (one core each), alternating launches, and the plan's prediction for 2.

    The 2-process launches time every gradient all-reduce DDP makes (a communication hook: bytes, seconds),
    and a third launch runs the same 2 processes with the all-reduces skipped: the compute of 2 processes
    sharing the machine, which the plan (one device per process) takes to equal the 1-process step.
    """
    reps, steps, skip = {"full": (2, 41, 10), "quick": (1, 31, 10), "tiny": (1, 5, 1)}[size]
    nets = [("MiniResNet", net(BENCH_NET, size)), ("MLP 4.7M" if size != "tiny" else "MLP", net(MID_MLP, size))]
    sweep = [1 << 12, 1 << 20, 1 << 25] if size != "tiny" else [1 << 12, 1 << 16]
    variants = [(1, None), (2, "time"), (2, "skip")]
    launches = []
    for rep in range(reps):
        for nproc, comm in variants:
            tag = f"{nproc}{'-' + comm if comm else ''}"
            jobs = [{"name": f"scaling-{name}-{tag}", "mode": "timeline", "comm": comm,
                     "sweep_sizes": sweep if comm == "time" and i == 0 else [],
                     "argv": [*argv, *common_flags(work, f"scaling-{i}-{tag}-{rep}"), "--num_workers", "0",
                              "--max_steps", str(steps), "--log_interval", str(skip)]}
                    for i, (name, argv) in enumerate(nets)]
            launches.append(Launch(f"scaling-{tag}-{rep}", nproc, jobs, threads=1))

    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        step_s: dict[tuple[str, str], list[float]] = {}
        comm: dict[str, list[dict[str, float]]] = {}
        first: dict[tuple[str, str], dict[str, Any]] = {}
        for rep in range(reps):
            for nproc, mode in variants:
                tag = f"{nproc}{'-' + mode if mode else ''}"
                for res, (name, _) in zip(results[f"scaling-{tag}-{rep}"], nets):
                    step_s.setdefault((name, tag), []).append(median(res["step_s"][skip:]))
                    first.setdefault((name, tag), res)
                    if mode == "time":
                        comm.setdefault(name, []).extend(res["comm"][skip:])
        sweep_rows = first[(nets[0][0], "2-time")]["sweep"]
        busbw = bus_bandwidth(sweep_rows[-1]["bytes"] / sweep_rows[-1]["seconds"], 2)
        alpha = scaling_model.hop_latency(sweep_rows[0]["seconds"], 2)
        return [scaling_row(name, step_s[(name, "1")], step_s[(name, "2-time")], step_s[(name, "2-skip")],
                            comm[name], first[(name, "1")], skip, busbw, alpha) for name, _ in nets]

    return Plan(launches, finish)


def scaling_row(name: str, one: list[float], two: list[float], two_no_comm: list[float],
                comm: list[dict[str, float]], single: dict[str, Any], skip: int, busbw: float, alpha: float) -> Row:
    """Measured 1 -> 2 process efficiency against the plan, and the measurement that explains the difference."""
    efficiency = median([a / b for a, b in zip(one, two)])
    fwd_bwd = [r["fwd_bwd_s"] for r in single["metrics"] if r["step"] > skip and r["step"] % skip == 0]
    backward = (scaling_model.backward_fraction(median(fwd_bwd), median(one)) if fwd_bwd
                else scaling_model.DEFAULT_BACKWARD_FRACTION)
    cap = 25 * scaling_model.MIB  # ddptrain's default --bucket_cap_mb, passed to DDP (so the first bucket too)

    def predicted(compute_s: float) -> scaling_model.Prediction:
        return scaling_model.predict(scaling_model.Workload(
            step_s=compute_s, backward_fraction=backward, grad_bytes=single["grad_bytes"], busbw_bytes_per_s=busbw,
            latency_s=alpha, bucket_cap_bytes=cap, first_bucket_bytes=cap,
            tensor_bytes=tuple(single["grad_tensor_bytes"])), 2)

    plan_1 = predicted(median(one))  # what `ddptrain plan` says from the 1-process run
    plan_2 = predicted(median(two_no_comm))  # the same model, fed the compute of 2 processes sharing the machine
    measured_comm_s = median([c["all_reduce_s"] for c in comm])
    bytes_per_step = median([c["bytes"] for c in comm])
    buckets = median([c["buckets"] for c in comm])
    agreement = median(two) / plan_2.step_s
    passed = abs(agreement - 1) <= SCALING_TOLERANCE
    note = (f"the plan's inputs: 1-process step {fmt_ms(median(one))} ({100 * backward:.0f}% backward), "
            f"{single['grad_bytes'] / 1e6:.1f} MB of gradients in {plan_1.num_buckets} DDP bucket(s), gloo busbw "
            f"{busbw / 1e9:.2f} GB/s and hop latency {1e6 * alpha:.0f} us (an all-reduce sweep in the same launch): "
            f"it predicts {fmt_ms(plan_1.comm_s)} of all-reduce and a {fmt_ms(plan_1.step_s)} 2-process step "
            f"(efficiency {plan_1.efficiency:.3f}). Measured in the 2-process run by a DDP communication hook: "
            f"{bytes_per_step / 1e6:.1f} MB all-reduced per step in {buckets:.0f} bucket(s), "
            f"{fmt_ms(measured_comm_s)} of all-reduce per step; the same 2 processes with the all-reduces skipped "
            f"step in {fmt_ms(median(two_no_comm))} against 1 process's {fmt_ms(median(one))} (2 processes share "
            f"the caches, memory bandwidth and cores of one machine; the plan assumes a device each). The plan fed "
            f"that compute predicts {fmt_ms(plan_2.step_s)}; measured {fmt_ms(median(two))} "
            f"({agreement:.3f} of the prediction).")
    if not passed:
        note += (f" MISS: outside {100 * SCALING_TOLERANCE:.0f} %: the all-reduce inside the run took "
                 f"{measured_comm_s / plan_1.comm_s:.2f}x the sweep's time for its size (gloo reduces on the cores "
                 "that compute; on a loaded machine it also waits for them).")
    return Row(f"scaling_{name.split()[0].lower()}", f"scaling 1->2 processes, {name}",
               f"2 procs: {1 / median(two):.2f} steps/s", f"1 proc: {1 / median(one):.2f} steps/s",
               f"efficiency {efficiency:.3f}; plan {plan_1.efficiency:.3f}, with 2-process compute "
               f"{median(one) / plan_2.step_s:.3f}", f"plan within {100 * SCALING_TOLERANCE:.0f}%", passed, note,
               {"step_s_1": one, "step_s_2": two, "step_s_2_no_comm": two_no_comm, "efficiency": efficiency,
                "plan": {"efficiency": plan_1.efficiency, "efficiency_no_overlap": plan_1.efficiency_no_overlap,
                         "step_s": plan_1.step_s, "step_no_overlap_s": plan_1.step_no_overlap_s,
                         "comm_s": plan_1.comm_s, "num_buckets": plan_1.num_buckets},
                "plan_2_process_compute": {"step_s": plan_2.step_s, "efficiency": median(one) / plan_2.step_s},
                "agreement": agreement, "measured_comm_s": measured_comm_s, "bytes_per_step": bytes_per_step,
                "buckets_per_step": buckets, "busbw_bytes_per_s": busbw, "latency_s": alpha,
                "grad_bytes": single["grad_bytes"], "backward_fraction": backward})


# --- sharding ------------------------------------------------------------------------------------

FSDP_TARGET = 0.97  # vs the hand-written FSDP2 loop; the non-finite guard is host-decided under fsdp (parallel.py)
ACCUM_STEPS = 4  # micro-steps of the fsdp accumulation row


def sharding(size: str, work: Path) -> Plan:
    """--strategy fsdp against a hand-written FSDP2 loop (interleaved), and against ddptrain's own ddp on the same
    model: memory each rank holds and steps/s (two Trainers alternating in the same processes). Then fsdp with
    accumulation x4, reducing on the last micro-step against --fsdp_reduce_every_micro_step: the gradients a
    rank holds at their peak, and steps/s."""
    block, rounds, warmup = {"full": (10, 16, 1), "quick": (10, 6, 1), "tiny": (2, 2, 1)}[size]
    mlp = net(MID_MLP, size)
    blocks = rounds + warmup
    steps = ["--max_steps", str(blocks * block + 1)]
    # The same global batch as the rows above (32 per rank) in 4 micro-steps of 8; fewer, shorter blocks: a
    # step is 4 forwards and backwards, each all-gathering the weights.
    accum_block, accum_blocks = {"full": (4, 9), "quick": (4, 5), "tiny": (2, 2)}[size]
    accum = [*mlp, "--strategy", "fsdp", "--batch_size", str(flag_value(mlp, "--batch_size") // ACCUM_STEPS),
             "--grad_accum_steps", str(ACCUM_STEPS), "--max_steps", str(accum_blocks * accum_block + 1)]
    launches = [
        Launch("overhead_fsdp", 2, [{"name": "overhead_fsdp", "mode": "interleave", "block_steps": block,
                                     "blocks": blocks, "settle_s": settle(size),
                                     "argv": [*mlp, "--strategy", "fsdp", *common_flags(work, "overhead_fsdp"),
                                              *steps]}]),
        Launch("fsdp_vs_ddp", 2, [{"name": "fsdp_vs_ddp", "mode": "pair", "block_steps": block, "blocks": blocks,
                                   "settle_s": settle(size),
                                   "argv": [*mlp, "--strategy", "fsdp", *common_flags(work, "pair_fsdp"), *steps],
                                   "argv_b": [*mlp, *common_flags(work, "pair_ddp"), *steps]}]),
        Launch("fsdp_accumulation", 2, [{"name": "fsdp_accumulation", "mode": "pair", "block_steps": accum_block,
                                         "blocks": accum_blocks, "settle_s": settle(size),
                                         "argv": [*accum, *common_flags(work, "accum_last")],
                                         "argv_b": [*accum, "--fsdp_reduce_every_micro_step",
                                                    *common_flags(work, "accum_every")]}]),
    ]

    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        [res] = results["overhead_fsdp"]
        ratios = paired_ratios(res["ours_s"], res["theirs_s"], warmup)
        ours, theirs = (median(res[k][warmup:]) / block for k in ("ours_s", "theirs_s"))
        ratio = median(ratios)
        note = (f"MLP of {res['grad_bytes'] / 4e6:.1f}M parameters, 2 units, on 2 ranks: ddptrain's fsdp "
                f"{1000 * (ours - theirs):+.2f} ms per step vs a hand-written fully_shard loop's {fmt_ms(theirs)}.")
        if ratio < FSDP_TARGET:
            note += (" MISS: under fsdp ddptrain also computes the global gradient norm over the shards (one more "
                     "all-reduce) and reads it on the host every step for the non-finite guard (the foreach "
                     "optimizer of sharded parameters has no on-device skip), besides the per-step control vote.")
        cpu, phases = cpu_by_side(res, warmup, block), cpu_by_side(res, warmup, block, "phase_cpu_s")
        note = " ".join(filter(None, [note, cpu_note(cpu), phase_note(phases)]))
        rows = [Row("overhead_fsdp", "overhead, --strategy fsdp", f"{1 / ours:.2f} steps/s",
                    f"{1 / theirs:.2f} steps/s (raw FSDP2)", f"{ratio:.3f} ({spread(ratios)})", f">= {FSDP_TARGET}",
                    ratio >= FSDP_TARGET, note,
                    {"ratios": ratios, "ddptrain_step_s": ours, "raw_step_s": theirs, "block_steps": block,
                     "cpu_ms_per_step": cpu, "phase_cpu_ms_per_step": phases})]
        [pair] = results["fsdp_vs_ddp"]
        fsdp_s, ddp_s = (median(pair[k][warmup:]) / block for k in ("a_s", "b_s"))
        held = {side: sum(pair[f"{side}_memory"].values()) for side in ("a", "b")}
        share = held["a"] / held["b"]
        world = pair["world_size"]
        target = 1 / world + 0.01
        rows.append(Row("fsdp_vs_ddp", "fsdp vs ddp: state per rank", f"{held['a'] / 2**20:.1f} MiB/rank, "
                        f"{1 / fsdp_s:.2f} steps/s", f"{held['b'] / 2**20:.1f} MiB/rank, {1 / ddp_s:.2f} steps/s (ddp)",
                        f"{share:.3f} of ddp's memory, {ddp_s / fsdp_s:.3f} of its speed", f"<= {target:.2f} memory",
                        share <= target,
                        f"parameters + gradients + optimizer state held by rank 0 after the steps, at world size "
                        f"{world}; fsdp also all-gathers the weights twice per step (forward, backward) where ddp "
                        "all-reduces gradients once: 1.5x the bytes."
                        + ("" if share <= target else " MISS: rank 0 holds more than its 1/N: dim-0 shards round "
                           "up, which only tiny tensors (a few rows) make visible."),
                        {"fsdp_memory": pair["a_memory"], "ddp_memory": pair["b_memory"], "fsdp_step_s": fsdp_s,
                         "ddp_step_s": ddp_s, "a_s": pair["a_s"], "b_s": pair["b_s"]}))
        rows.append(_accumulation_row(results["fsdp_accumulation"][0], warmup, accum_block))
        return rows

    return Plan(launches, finish)


def _accumulation_row(pair: dict[str, Any], warmup: int, block: int) -> Row:
    """fsdp with accumulation: --fsdp_reduce_every_micro_step (B) against reducing on the last micro-step (A)."""
    last_s, every_s = (median(pair[k][warmup:]) / block for k in ("a_s", "b_s"))
    speed = paired_ratios(pair["b_s"], pair["a_s"], warmup)  # the flag's steps/s over the default's, per pair
    last, every = pair["a_peak_grad_bytes"], pair["b_peak_grad_bytes"]
    share, world = every / last, pair["world_size"]
    target = 1 / world + 0.01
    return Row("fsdp_accumulation", f"fsdp, accumulation x{ACCUM_STEPS}: --fsdp_reduce_every_micro_step",
               f"{every / 2**20:.1f} MiB of gradients/rank at peak, {1 / every_s:.2f} steps/s",
               f"{last / 2**20:.1f} MiB/rank, {1 / last_s:.2f} steps/s (reduce on the last micro-step)",
               f"{share:.3f} of the peak gradients, {median(speed):.3f} of the speed ({spread(speed)})",
               f"<= {target:.2f} gradients",
               share <= target,
               f"rank 0's gradients at their fullest in the first step (the memory line's peak_grad_bytes), at world "
               f"size {world}: reducing on the last micro-step only, FSDP2 holds the whole model's unsharded fp32 "
               f"gradients until then; the flag reduce-scatters on each of the {ACCUM_STEPS} micro-steps instead "
               f"({ACCUM_STEPS}x the reduce-scatters) and keeps the shard."
               + ("" if share <= target else " MISS: rank 0 held more than its 1/N of the gradients between "
                  "micro-steps: the flag did not reach FSDP, or dim-0 shards of tiny tensors round up."),
               {"peak_grad_bytes_last": last, "peak_grad_bytes_every": every, "last_step_s": last_s,
                "every_step_s": every_s, "speed_ratios": speed, "a_s": pair["a_s"], "b_s": pair["b_s"],
                "block_steps": block})


# --- activation checkpointing ------------------------------------------------------------------------

RECOMPUTE_TARGET = 0.5  # at most this share of the activations kept for backward; the time is reported


def recompute(size: str, work: Path) -> Plan:
    """--activation_checkpointing on the GPT of the LM rows, ddp on 2 ranks: the bytes autograd keeps for
    backward per micro-batch (saved-tensor hooks) and steps/s, against the same Trainer without it
    (two Trainers alternating in the same processes)."""
    block, blocks = {"full": (5, 9), "quick": (5, 5), "tiny": (2, 2)}[size]
    flags = [*lm_flags(size, work), "--max_steps", str(blocks * block + 2)]
    launches = [Launch("recompute", 2, [{"name": "recompute", "mode": "pair", "block_steps": block,
                                         "blocks": blocks, "settle_s": settle(size), "activations": True,
                                         "argv": [*flags, *common_flags(work, "keep")],
                                         "argv_b": [*flags, "--activation_checkpointing",
                                                    *common_flags(work, "recompute")]}])]

    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        [pair] = results["recompute"]
        kept, recomputed = pair["a_activation_bytes"], pair["b_activation_bytes"]
        share = recomputed / kept
        speed = paired_ratios(pair["b_s"], pair["a_s"], 1)
        keep_s, recompute_s = (median(pair[k][1:]) / block for k in ("a_s", "b_s"))
        return [Row("recompute", "--activation_checkpointing (GPT)",
                    f"{recomputed / 2**20:.2f} MiB kept for backward, {1 / recompute_s:.2f} steps/s",
                    f"{kept / 2**20:.2f} MiB, {1 / keep_s:.2f} steps/s (without)",
                    f"{share:.3f} of the activations, {median(speed):.3f} of the speed ({spread(speed)})",
                    f"<= {RECOMPUTE_TARGET} activations", share <= RECOMPUTE_TARGET,
                    f"{lm_note(flags, pair | {'grad_bytes': 0, 'global_batch_size': 2 * flag_value(flags, '--batch_size')})} "
                    "Bytes of the tensors autograd keeps across one micro-batch's forward on rank 0 (each storage "
                    "once, parameters excluded); with the flag each block keeps only its input and recomputes its "
                    "forward in backward: about one more forward per step.",
                    {"kept_bytes": kept, "recomputed_bytes": recomputed, "speed_ratios": speed,
                     "a_s": pair["a_s"], "b_s": pair["b_s"], "block_steps": block})]

    return Plan(launches, finish)


SECTIONS = {"overhead": overhead, "small_steps": small_steps, "accumulation": accumulation, "checkpoint": checkpoint, "data": data,
            "startup": startup, "scaling": scaling, "sharding": sharding, "recompute": recompute}

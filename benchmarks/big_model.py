"""Section big_model: each worker's peak resident memory when a model that is big for the machine trains under
--strategy fsdp, final save included, against the model's fp32 bytes (DESIGN.md, "Big models").

A transformers Llama (issue 36's: hidden 1024, 8 layers, vocabulary 32000: 168M parameters, 642 MiB in fp32)
is written with save_pretrained, then `ddptrain train --model hf:DIR --strategy fsdp`, 2 steps of SGD without
momentum, runs under torchrun with 4 processes, each recording its peak RSS at exit (benchmarks/peak_rss.py).
The same run with a tiny Llama gives what a worker holds anyway (torch, the interpreter, buffers); the figure
is the difference over the model's fp32 bytes, per rank. Fully sharded parameters and gradients at 4 ranks are
0.5x; the target is 1.0x (no rank ever holds the whole model). The same job fine-tuning LoRA adapters
(`--lora_rank 8`: the frozen base read into the shards, the adapters' init replayed) has the same target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, BenchError, Plan, Row, bench_env, run_logged

TARGET = 1.0
SIZES = {  # (LlamaConfig arguments, processes)
    "full": (dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  vocab_size=32000), 4),
    "quick": (dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   vocab_size=32000), 4),
    # The harness's check (tests/test_bench.py) on 1 rank: the section's code path is the same, and each process
    # of its 4 launches pays torch's and transformers' imports.
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=2000), 1),
}
BASELINE = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=256)


def write_llama(directory: Path, config: dict[str, int]) -> int:
    """A seeded Llama saved with save_pretrained into `directory`; its fp32 bytes."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=False))
    model.save_pretrained(directory)
    return sum(p.numel() * 4 for p in model.parameters())


def peaks(work: Path, name: str, model_dir: Path, nproc: int, tokens: Path, extra: tuple[str, ...] = ()) -> list[float]:
    """Each rank's peak RSS in MiB over a 2-step fsdp run of `model_dir` (with flags `extra`), final save included."""
    out = work / f"{name}-rss"
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(REPO / "benchmarks" / "peak_rss.py"), str(out), "train", "--model", f"hf:{model_dir}",
            "--strategy", "fsdp", "--task", "language_model", "--dataset", "tokens", "--data_dir", str(tokens),
            "--seq_len", "64", "--batch_size", "1", "--max_steps", "2", "--momentum", "0", "--weight_decay", "0",
            "--num_workers", "0", "--save_every", "0", "--no-progress", "--no-auto_resume",
            "--run_dir", str(work / name), *extra]
    run_logged(argv, work / f"{name}.log", bench_env(threads=1), timeout_s=900)
    found = [json.loads((out / f"rank-{rank}.json").read_text())["peak_rss_mb"] for rank in range(nproc)]
    if len(found) != nproc:
        raise BenchError(f"{name}: {len(found)} of {nproc} ranks reported their peak")
    return found


def big_model(size: str, work: Path) -> Plan:
    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        from benchmarks.sections import write_token_files

        config, nproc = SIZES[size]
        tokens = write_token_files(work / "big_model_tokens", 4096)
        model_bytes = write_llama(work / "llama_big", config)
        write_llama(work / "llama_base", BASELINE)
        rows = []
        for name, label, extra in (("big_model", "", ()), ("big_model_lora", " + LoRA r8", ("--lora_rank", "8"))):
            base = peaks(work, f"{name}_base", work / "llama_base", nproc, tokens, extra)
            big = peaks(work, name, work / "llama_big", nproc, tokens, extra)
            rows.append(peak_row(name, label, nproc, model_bytes, base, big))
        return rows

    return Plan([], finish)


def peak_row(name: str, label: str, nproc: int, model_bytes: int, base: list[float], big: list[float]) -> Row:
    ratios = [(b - a) * 2**20 / model_bytes for a, b in zip(base, big)]
    worst = max(ratios)
    per_rank = ", ".join(f"rank {r} {b - a:.0f} MiB ({x:.2f}x)" for r, (a, b, x) in enumerate(zip(base, big, ratios)))
    note = (f"Llama of {model_bytes / 4e6:.1f}M parameters ({model_bytes / 2**20:.0f} MiB fp32) from "
            f"save_pretrained, --strategy fsdp{label} on {nproc} ranks, 2 steps of SGD, final save included: peak "
            f"RSS above a tiny Llama's run: {per_rank}.")
    if worst > TARGET:
        note += " MISS: some rank held more than the whole model's fp32 bytes at its peak."
    return Row(name, f"big model{label}, fsdp x{nproc}: peak RSS / model", f"{worst:.2f}x of the model",
               "-", f"{worst:.2f}", f"<= {TARGET}", worst <= TARGET, note,
               {"model_bytes": model_bytes, "base_mb": base, "big_mb": big, "ratios": ratios})

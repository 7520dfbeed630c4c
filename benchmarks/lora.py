"""Section lora: LoRA fine-tuning against full fine-tuning of the same model — steps per second and each
worker's peak resident memory, the same job either way.

A transformers Llama written with save_pretrained (full size: hidden 512, 4 layers, vocabulary 8000, 17M
parameters) trains `--task language_model` on byte tokens for the same steps, 2 processes under ddp with AdamW,
once with every weight (`full`) and once with `--lora_rank 8` (`lora`). Steps per second are the median of the
train lines' samples per second after the first (compile-free CPU: the first holds the start-up), over the
global batch. The peak is ru_maxrss of each worker (benchmarks/peak_rss.py); what LoRA saves is the gradients
and AdamW's two moments of the frozen weights, so the figure to read is full minus lora against the model's
fp32 bytes. Informational rows (no target): the issue asks for the figures, not a bar.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.big_model import write_llama
from benchmarks.common import REPO, Plan, Row, bench_env, ranks_cmd, run_logged

SIZES = {  # (LlamaConfig arguments, steps, processes)
    "full": (dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                  vocab_size=8000), 12, 2),
    "quick": (dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                   vocab_size=8000), 8, 2),
    "tiny": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  vocab_size=300), 4, 1),  # the harness's check (tests/e2e/test_bench.py): 1 process's imports
}
BATCH, SEQ_LEN = 4, 128


def run(work: Path, name: str, model_dir: Path, tokens: Path, steps: int, nproc: int,
        extra: list[str]) -> dict[str, Any]:
    """Each rank's peak RSS (MiB) and the run's steady steps per second."""
    out = work / f"{name}-rss"
    out.mkdir(parents=True, exist_ok=True)
    run_dir = work / name
    argv = [*ranks_cmd(nproc, REPO / "benchmarks" / "peak_rss.py"), str(out), "train", "--model", f"hf:{model_dir}",
            "--task", "language_model", "--dataset", "tokens", "--data_dir", str(tokens), "--seq_len", str(SEQ_LEN),
            "--batch_size", str(BATCH), "--max_steps", str(steps), "--optimizer", "adamw", "--lr", "1e-4",
            "--log_interval", "1", "--num_workers", "0", "--save_every", "0", "--no-progress", "--no-auto_resume",
            "--run_dir", str(run_dir), *extra]
    run_logged(argv, work / f"{name}.log", bench_env(threads=1), timeout_s=900)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_sec"] for r in lines if r.get("split") == "train" and r["step"] > 1]
    return {"peak_mb": [json.loads((out / f"rank-{r}.json").read_text())["peak_rss_mb"] for r in range(nproc)],
            "steps_per_s": statistics.median(rates) / (BATCH * nproc)}


def lora(size: str, work: Path) -> Plan:
    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        from benchmarks.sections import write_token_files

        config, steps, nproc = SIZES[size]
        tokens = write_token_files(work / "lora_tokens", 1 << 16)
        model_bytes = write_llama(work / "lora_llama", {**config, "vocab_size": max(config["vocab_size"], 256)})
        full = run(work, "lora_full", work / "lora_llama", tokens, steps, nproc, [])
        adapted = run(work, "lora_r8", work / "lora_llama", tokens, steps, nproc, ["--lora_rank", "8"])
        speed = adapted["steps_per_s"] / full["steps_per_s"]
        saved_mb = max(full["peak_mb"]) - max(adapted["peak_mb"])
        note = (f"Llama of {model_bytes / 4e6:.1f}M parameters ({model_bytes / 2**20:.0f} MiB fp32), ddp x{nproc}, "
                f"AdamW, batch {BATCH} x {SEQ_LEN} tokens per rank: full {full['steps_per_s']:.2f} steps/s, peak "
                f"{max(full['peak_mb']):.0f} MiB; --lora_rank 8 {adapted['steps_per_s']:.2f} steps/s, peak "
                f"{max(adapted['peak_mb']):.0f} MiB ({saved_mb:.0f} MiB less, "
                f"{saved_mb * 2**20 / model_bytes:.2f}x the model).")
        data = {"model_bytes": model_bytes, "full": full, "lora": adapted}
        return [Row("lora", "LoRA r8 vs full fine-tuning: steps/s", f"{adapted['steps_per_s']:.2f}/s",
                    f"{full['steps_per_s']:.2f}/s", f"{speed:.2f}", "-", None, note, data),
                Row("lora_memory", "LoRA r8 vs full fine-tuning: peak RSS", f"{max(adapted['peak_mb']):.0f} MiB",
                    f"{max(full['peak_mb']):.0f} MiB", f"{max(adapted['peak_mb']) / max(full['peak_mb']):.2f}", "-",
                    None, note, data)]

    return Plan([], finish)

"""Section packing: one epoch of the same chat records, padded to each batch's longest row and packed into bins of
--seq_len (`--packing`): trained tokens per second, the same tokens either way.

The records are chats whose answer reverses the question's words (questions of pydoc words, their lengths drawn
so that most turns are short and a few long: full size, median ~40 tokens, longest ~260), formatted with a BPE
tokenizer's chat template (trained here on CPython's pydoc text), the loss on the assistant's turns. A
transformers Llama (hidden 128, 2 layers) trains one epoch of them at --seq_len 256, 8 rows (padded) or 8 bins
(packed) per rank, 2 processes under ddp. The figure is the median of the train lines' train_tokens_per_sec after the
first line (which holds the start-up); a padded and a packed epoch train the same tokens, so the ratio is also
the padded epoch's time over the packed one's. Target (issue 55): packed at least 1.5x padded.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks.big_model import write_llama
from benchmarks.common import Plan, Row, bench_env, python, run_logged

SIZES = {  # (records, Llama arguments, processes: 0 trains in the command's own process)
    "full": (2000, dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4), 2),
    "quick": (800, dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4), 2),
    "tiny": (64, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2), 0),
}
SEQ_LEN, BATCH, TARGET = 256, 8, 1.5
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def write_tokenizer(directory: Path, vocab_size: int) -> int:
    """A byte-level BPE tokenizer with BOS, EOS, pad and a chat template, trained on pydoc's text; its vocabulary
    size."""
    import tokenizers
    import transformers
    from pydoc_data.topics import topics

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([topics[key] for key in sorted(topics)], trainer)
    bpe.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                         chat_template=TEMPLATE).save_pretrained(directory)
    return bpe.get_vocab_size()


def write_chats(path: Path, count: int) -> None:
    """`count` chat records: a question of pydoc words and its words reversed, most short, a few long."""
    from pydoc_data.topics import topics

    words = " ".join(topics[key] for key in sorted(topics)).split()
    draw = random.Random(0)
    with open(path, "w") as fh:
        for _ in range(count):
            length = max(1, min(60, round(draw.lognormvariate(2.0, 0.7))))  # words: median ~7, p90 ~18
            start = draw.randrange(len(words) - length)
            question = " ".join(words[start:start + length])
            fh.write(json.dumps({"messages": [{"role": "user", "content": question},
                                              {"role": "assistant", "content": " ".join(reversed(question.split()))}]})
                     + "\n")


def epoch(work: Path, name: str, model_dir: Path, data: Path, tokenizer: Path, nproc: int,
          extra: list[str]) -> dict[str, Any]:
    """One epoch of the records: the median tokens per second after the first train line, the median padding
    share, the steps."""
    run_dir = work / name
    argv = [python(), "-m", "ddptrain", "train", "--model", f"hf:{model_dir}", "--task", "language_model",
            "--dataset", f"hf:{data}", "--tokenizer", str(tokenizer), "--seq_len", str(SEQ_LEN), "--batch_size",
            str(BATCH), "--epochs", "1", "--optimizer", "adamw", "--lr", "1e-3", "--log_interval", "1",
            "--eval_size", "0", "--num_workers", "0", "--save_every", "0", "--no-progress", "--no-auto_resume",
            "--nproc", str(nproc), "--run_dir", str(run_dir), *extra]
    seconds = run_logged(argv, work / f"{name}.log", bench_env(), timeout_s=1800)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r.get("split") == "train"]
    steady = train[1:] or train
    return {"tokens_per_sec": statistics.median(r["train_tokens_per_sec"] for r in steady), "steps": len(train),
            "pad_fraction": statistics.median(r.get("pad_fraction", 0.0) for r in train),
            "token_skew": statistics.median(r["token_skew"] for r in train), "wall_s": seconds}


def packing(size: str, work: Path) -> Plan:
    def finish(results: dict[str, list[dict[str, Any]]]) -> list[Row]:
        count, config, nproc = SIZES[size]
        tokenizer, data = work / "packing_tokenizer", work / "packing_chats.jsonl"
        vocab = write_tokenizer(tokenizer, 1024 if count > 100 else 300)
        write_chats(data, count)
        write_llama(work / "packing_llama", {**config, "vocab_size": vocab, "num_key_value_heads": 2})
        padded = epoch(work, "padded", work / "packing_llama", data, tokenizer, nproc, [])
        packed = epoch(work, "packed", work / "packing_llama", data, tokenizer, nproc, ["--packing"])
        speed = packed["tokens_per_sec"] / padded["tokens_per_sec"]
        passed = speed >= TARGET
        note = (f"{count} chat records (question, reversed answer) on a Llama (hidden {config['hidden_size']}, "
                f"{config['num_hidden_layers']} layers), ddp x{max(nproc, 1)}, --seq_len {SEQ_LEN}, {BATCH} rows or bins per "
                f"rank: padded {padded['tokens_per_sec']:.0f} tokens/s over {padded['steps']} steps "
                f"({100 * padded['pad_fraction']:.0f} % of the positions padding), packed "
                f"{packed['tokens_per_sec']:.0f} tokens/s over {packed['steps']} steps (token skew "
                f"{packed['token_skew']:.2f}); whole runs {padded['wall_s']:.0f} s and {packed['wall_s']:.0f} s"
                + ("" if passed else f". MISS: {speed:.2f}x, under the {TARGET}x target"))
        return [Row("packing", "--packing vs padded: trained tokens/s, one epoch", f"{packed['tokens_per_sec']:.0f}/s",
                    f"{padded['tokens_per_sec']:.0f}/s", f"{speed:.2f}", f">= {TARGET}", passed, note,
                    {"padded": padded, "packed": packed})]

    return Plan([], finish)

"""Fine-tune a small causal language model on prompt/response pairs with `ddptrain.fit`, on 2 CPU processes.

What a transformers user brings, end to end, with nothing downloaded:

1. a byte-level BPE tokenizer, trained here on the English text that ships with CPython (pydoc's topics);
2. prompt/response records (the response repeats the prompt's words in reverse order), tokenized into
   `input_ids` and `labels` whose prompt positions are -100, so only the response is learnt;
3. a GPT-2 built from a config (`GPT2LMHeadModel`), trained by `ddptrain.fit(..., nproc=2)` with the built-in
   `language_model` task: variable-length items are padded by ddptrain's collate, and the loss is divided by
   the tokens of the whole step, so 2 processes learn what 1 would;
4. the trained model reloaded from RUN_DIR/hf with `AutoModelForCausalLM.from_pretrained`, and asked to
   generate a response.

    python examples/finetune_hf.py                  # ~1 minute on 2 CPU cores
    python examples/finetune_hf.py --epochs 1 --records 64 --run_dir runs/finetune-small
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import Dataset

import ddptrain

PROMPT, ANSWER = "reverse: ", " =>"


def train_tokenizer(directory: Path):
    """A 512-token byte-level BPE on pydoc's text, saved as transformers saves tokenizers."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([topics[key] for key in sorted(topics)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<pad>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def pairs(count: int) -> list[tuple[str, str]]:
    """(prompt, response): three to five words of pydoc's text, and the same words in reverse order."""
    from pydoc_data.topics import topics

    words = [w for w in " ".join(topics[key] for key in sorted(topics)).split() if w.isalpha()][:400]
    out = []
    for i in range(count):
        chosen = [words[(7 * i + 3 * j) % len(words)] for j in range(3 + i % 3)]
        out.append((PROMPT + " ".join(chosen) + ANSWER, " " + " ".join(reversed(chosen))))
    return out


class PromptResponse(Dataset):
    """Tokenized pairs: `input_ids` = prompt + response + end-of-text; `labels` the same with the prompt -100."""

    uses_global_rng = False  # items are fixed tensors: ddptrain need not seed the RNGs per sample

    def __init__(self, records: list[tuple[str, str]], tokenizer):
        self.items = []
        for prompt, response in records:
            p = tokenizer(prompt)["input_ids"]
            r = tokenizer(response)["input_ids"] + [tokenizer.eos_token_id]
            self.items.append({"input_ids": torch.tensor(p + r), "labels": torch.tensor([-100] * len(p) + r)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def make_model(cfg: ddptrain.TrainConfig) -> torch.nn.Module:
    """A 2-layer GPT-2, built after ddptrain seeded torch: the same initial weights in every process."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=1))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", default="runs/finetune-hf")
    parser.add_argument("--records", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)

    run_dir = Path(args.run_dir)
    tokenizer = train_tokenizer(run_dir / "tokenizer")
    records = pairs(args.records + 64)
    train_data, eval_data = PromptResponse(records[64:], tokenizer), PromptResponse(records[:64], tokenizer)

    summary = ddptrain.fit(
        model=make_model, train_data=train_data, eval_data=eval_data, task="language_model",
        config=ddptrain.TrainConfig(nproc=args.nproc, run_dir=str(run_dir), epochs=args.epochs, batch_size=16,
                                    optimizer="adamw", lr=3e-3, weight_decay=0.01, warmup_steps=10,
                                    lr_schedule="linear", num_workers=0, pad_token_id=tokenizer.pad_token_id,
                                    save_every=0, log_interval=10, progress=False))

    # The run wrote the save_pretrained layout of the trained model to RUN_DIR/hf: transformers loads it.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf").eval()
    prompt = records[0][0]
    inputs = tokenizer(prompt, return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id)
    answer = tokenizer.decode(generated[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"eval loss {summary['eval_loss']:.3f} after {summary['step']} steps")
    print(f"{prompt!r} -> {answer!r} (expected {records[0][1]!r})")
    return {**summary, "answer": answer, "expected": records[0][1]}


if __name__ == "__main__":
    main()

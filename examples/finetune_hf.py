"""Fine-tune a Llama with LoRA adapters on chat records with `ddptrain.fit`, on 2 CPU processes, and chat with it.

What a transformers user brings, end to end, with nothing downloaded:

1. a base model as the Hub would serve it: a byte-level BPE tokenizer with BOS/EOS and a chat template (trained
   here on the English text that ships with CPython, pydoc's topics) and a small Llama built from a config,
   both written with `save_pretrained` into one directory (RUN_DIR/base);
2. chat records in JSON lines, `{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}`: the user
   names three words, the assistant says them back. ddptrain formats each record with the tokenizer's own
   chat template and puts the loss on the assistant's turn only (`train_on="assistant"`);
3. `ddptrain.fit(..., nproc=2)` with `lora_rank`: the base stays frozen, 2 processes train the adapters, and
   the run leaves them in PEFT's layout in RUN_DIR/adapter (the example saves the tokenizer beside them);
4. the base model and the adapter loaded back with peft's `PeftModel.from_pretrained`, the held-out questions
   put through `apply_chat_template(..., add_generation_prompt=True)`, and the answers generated and checked.

    python examples/finetune_hf.py                  # 31 of 32 held-out answers right; 50-80 s on 2 busy CPU cores
    python examples/finetune_hf.py --lr 0           # the untrained adapters: the base model's answers, none right
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import ddptrain

# Each turn after its role's marker and a space (as Llama 2's "[/INST] " is), ended by </s>; a reply is asked for
# with the assistant's marker.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS_PER_QUESTION = 3


def pydoc_texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def build_tokenizer(directory: Path):
    """A 512-token byte-level BPE trained on pydoc's text that, as a Llama's does, puts BOS before what it
    encodes, and carries its chat template: saved with save_pretrained, as a model on the Hub ships it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(pydoc_texts(), trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(directory)
    return tokenizer


def build_base_model(directory: Path, tokenizer) -> None:
    """A 2-layer Llama from a config, saved with its (random) weights: the frozen base the adapters learn on."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # initializer_range=0.1, not Llama's 0.02: the frozen output layer must allow confident predictions, as a
    # pretrained one's does (at 0.02 no logit can exceed about 1.3, and the loss cannot fall far below log(512)).
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         initializer_range=0.1, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)


def vocabulary(tokenizer, size: int = 24) -> list[str]:
    """The first `size` distinct words of pydoc's text that the tokenizer spells as one token (after a space, as
    the chat template puts them): every answer is then three tokens and </s>."""
    chosen: list[str] = []
    for word in " ".join(pydoc_texts()).split():
        if word.isalpha() and word.islower() and len(word) > 2 and word not in chosen \
                and len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1:
            chosen.append(word)
            if len(chosen) == size:
                return chosen
    raise RuntimeError("pydoc's text has too few one-token words")


def chat(words: list[str], answer: bool = True) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": "repeat: " + " ".join(words)}]
    if answer:
        messages.append({"role": "assistant", "content": " ".join(words)})
    return messages


def write_chats(path: Path, questions: list[list[str]]) -> None:
    path.write_text("".join(json.dumps({"messages": chat(words)}) + "\n" for words in questions))


def questions(words: list[str], count: int, seed: int) -> list[list[str]]:
    """`count` distinct questions: ordered choices of three different words."""
    rng, seen = random.Random(seed), set()
    while len(seen) < count:
        seen.add(tuple(rng.sample(words, WORDS_PER_QUESTION)))
    return [list(q) for q in sorted(seen)]


def answer_questions(base_dir: Path, adapter_dir: Path, held_out: list[list[str]]) -> list[str]:
    """Greedy answers of the base model with the adapter, each question formatted by the chat template."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    answers = []
    with torch.no_grad():
        for words in held_out:
            inputs = tokenizer.apply_chat_template(chat(words, answer=False), add_generation_prompt=True,
                                                   return_dict=True, return_tensors="pt")
            generated = model.generate(**inputs, max_new_tokens=8, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            reply = generated[0, inputs["input_ids"].shape[1]:]
            answers.append(tokenizer.decode(reply, skip_special_tokens=True).strip())
    return answers


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", default="runs/finetune-hf")
    parser.add_argument("--records", type=int, default=1024, help="training conversations")
    parser.add_argument("--held_out", type=int, default=32, help="questions kept out of training, answered at the end")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=5e-3, help="peak learning rate of the adapters")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)

    run_dir = Path(args.run_dir)
    base_dir, data_dir = run_dir / "base", run_dir / "data"
    tokenizer = build_tokenizer(base_dir)
    build_base_model(base_dir, tokenizer)

    # Held-out questions are word orders no training conversation asks.
    data_dir.mkdir(parents=True, exist_ok=True)
    every = questions(vocabulary(tokenizer), args.records + args.held_out, seed=0)
    random.Random(1).shuffle(every)
    held_out, train = every[:args.held_out], every[args.held_out:]
    write_chats(data_dir / "train.jsonl", train)
    write_chats(data_dir / "eval.jsonl", held_out)

    summary = ddptrain.fit(config=ddptrain.TrainConfig(
        task="language_model", model=f"hf:{base_dir}", tokenizer=str(base_dir),
        dataset=f"hf:{data_dir / 'train.jsonl'}", eval_data=str(data_dir / "eval.jsonl"), seq_len=32,
        lora_rank=16, lora_alpha=32, nproc=args.nproc, run_dir=str(run_dir), auto_resume=False,
        epochs=args.epochs, batch_size=16, optimizer="adamw", lr=args.lr, weight_decay=0.0, warmup_steps=10,
        base_batch_size=32, lr_schedule="linear", num_workers=0, save_every=0, log_interval=20, progress=False))

    # RUN_DIR/adapter is PEFT's layout; with the tokenizer beside it, it is all a user needs with the base model.
    tokenizer.save_pretrained(run_dir / "adapter")
    answers = answer_questions(base_dir, run_dir / "adapter", held_out)
    expected = [" ".join(words) for words in held_out]
    correct = sum(a == e for a, e in zip(answers, expected))
    for words, answer, want in list(zip(held_out, answers, expected))[:4]:
        print(f"user: repeat: {' '.join(words)}\nassistant: {answer}" + ("" if answer == want else f"  (want: {want})"))
    print(f"eval loss {summary['eval']['loss']:.3f} after {summary['step']} steps")
    print(f"held-out answers right: {correct}/{len(held_out)}")
    return {**summary, "answers": answers, "expected": expected, "accuracy": correct / len(held_out)}


if __name__ == "__main__":
    main()

"""--packing: variable-length rows placed into bins of --seq_len, each document trained as if it were alone. The
bins' plan, a packed row's shape, and the loss of the same weights over the same rows, packed and padded: equal
for text, prompt/response and chat rows, on a transformers Llama and the built-in gpt (in this process); the
training runs (2 processes = 1, a kill, another world size) on real processes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import (assert_bitwise_equal, assert_close_weights, assert_restarted, assert_trained, initial_weights,
                     train, weights)
from test_chat import conversation, tokenizer_dir, words  # noqa: F401  (tokenizer_dir: the fixture)
from test_resume import step_samples

from ddptrain.data.packing import IGNORE, PackedRows, pack, plan_bins

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")


def best_fit_decreasing(lengths: list[int], capacity: int, order: list[int]) -> list[list[int]]:
    """The textbook algorithm, in O(rows x bins): each row of `order` into the open bin with the least room that
    holds it (the first such bin), else a new one."""
    bins, rooms = [], []
    for row in order:
        fits = [(room, i) for i, room in enumerate(rooms) if room >= lengths[row]]
        if fits:
            _, i = min(fits)
            bins[i].append(row)
            rooms[i] -= lengths[row]
        else:
            bins.append([row])
            rooms.append(capacity - lengths[row])
    return bins


def test_the_bins_are_best_fit_decreasing_and_the_same_for_the_same_seed():
    draw = random.Random(0)
    lengths = [draw.choice([draw.randint(1, 12), draw.randint(1, 60)]) for _ in range(500)]
    bins = plan_bins(lengths, 64, seed=3)
    assert sorted(row for b in bins for row in b) == list(range(500))
    assert all(sum(lengths[row] for row in b) <= 64 for b in bins)
    order = [row for b in bins for row in b]  # (the plan's own order of equal lengths)
    longest_first = sorted(range(500), key=lambda row: (-lengths[row], order.index(row)))
    assert bins == best_fit_decreasing(lengths, 64, longest_first)
    assert plan_bins(lengths, 64, seed=3) == bins
    other = plan_bins(lengths, 64, seed=4)
    assert other != bins and [[lengths[r] for r in b] for b in other] == [[lengths[r] for r in b] for b in bins]
    assert sum(lengths) / (64 * len(bins)) > 0.97  # filled to near --seq_len: ranks get the same work


def test_a_packed_row_restarts_positions_and_learns_no_documents_first_token():
    rows = [{"input_ids": torch.arange(10, 10 + n), "labels": torch.arange(10, 10 + n)} for n in (3, 4, 2)]
    rows[1]["labels"][:2] = IGNORE  # a masked prompt
    packed = PackedRows(rows, [[0, 1, 2]], seq_len=12, pad_id=7)
    item = packed[0]
    assert item["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]
    assert item["input_ids"].tolist() == [10, 11, 12, 10, 11, 12, 13, 10, 11, 7, 7, 7]
    assert item["labels"].tolist() == [IGNORE, 11, 12, IGNORE, IGNORE, 12, 13, IGNORE, 11, IGNORE, IGNORE, IGNORE]
    assert packed.pad_token_id == 7 and rows[1]["labels"][0] == IGNORE and rows[0]["labels"][0] == 10  # unchanged


# --- the same loss, packed and padded ---------------------------------------------------------------------------
SEQ_LEN = 96


def records(tokenizer_dir: Path, tmp: Path, kind: str) -> torch.utils.data.Dataset:
    """Tokenized hf: records of one kind, as a run reads them (ddptrain's tokenizing and cache)."""
    from ddptrain.config import TrainConfig
    from ddptrain.models import hf

    data = tmp / f"{kind}.jsonl"
    flags: dict[str, str] = {}
    lines = []
    for i in range(24):
        text = " ".join(words(2 + (i * 7) % 10, i * 11))
        if kind == "text":
            lines.append({"text": text})
        elif kind == "prompt-response":
            lines.append({"q": text, "a": " ".join(reversed(text.split()))})
            flags = {"prompt_field": "q", "response_field": "a"}
        else:
            lines.append({"messages": conversation(i)[1:3]})  # a question and its answer
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = TrainConfig(task="language_model", model="gpt", dataset=f"hf:{data}", tokenizer=str(tokenizer_dir),
                      seq_len=SEQ_LEN, **flags)
    train, _ = hf.build_datasets(cfg.section("data"), tmp)
    return train


def models() -> dict[str, torch.nn.Module]:
    """A Llama and a gpt whose attention is sharp (queries and keys scaled up from their init): a random model's
    is near uniform, and a leak across documents would then change the loss by little more than rounding."""
    from ddptrain.models import GPT

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, use_cache=False))
    built = {"llama": llama, "gpt": GPT(320, SEQ_LEN, 32, 2, 2)}
    with torch.no_grad():
        for model in built.values():
            for name, param in model.named_parameters():
                if any(part in name for part in ("q_proj", "k_proj", "qkv")):
                    param.mul_(8)
    return built


def summed_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
    from ddptrain.loop.tasks import LanguageModel

    task, total, count = LanguageModel(), 0.0, 0
    with torch.no_grad():
        for batch in batches:
            loss, _ = task.loss(model, batch)
            total, count = total + loss.total.double().item(), count + int(loss.count)
    return total, count


@pytest.mark.parametrize("kind", ["text", "prompt-response", "chat"])
def test_packed_and_padded_give_the_same_loss_over_the_same_tokens(tokenizer_dir, tmp_path, kind):  # noqa: F811
    """The eval of the same weights over the same rows, packed into bins and padded into batches of 4: the same
    summed loss (1e-5) over the same number of tokens, for a transformers Llama (sdpa, no attention_mask: its mask
    is block-diagonal from the position ids) and the built-in gpt. And the check can fail: packed rows without
    their position ids (the documents attend to each other), or with positions that do not restart, give another
    loss."""
    from ddptrain.data.batch import collate

    rows = records(tokenizer_dir, tmp_path, kind)
    packed = pack(rows, SEQ_LEN, seed=0, pad_id=2, what="test")
    assert len(packed) < len(rows) * 2 / 3  # several documents a bin
    padded_batches = [collate([rows[i] for i in range(start, min(start + 4, len(rows)))], pad_id=2)
                      for start in range(0, len(rows), 4)]
    packed_batches = [collate([packed[i] for i in range(start, min(start + 4, len(packed)))])
                      for start in range(0, len(packed), 4)]
    assert all("attention_mask" not in batch for batch in packed_batches)
    for name, model in models().items():
        model.eval()
        padded, tokens = summed_loss(model, padded_batches)
        together, packed_tokens = summed_loss(model, packed_batches)
        assert packed_tokens == tokens > 100, (name, packed_tokens, tokens)
        assert together == pytest.approx(padded, rel=1e-5), name
        leaking, _ = summed_loss(model, [{k: v for k, v in b.items() if k != "position_ids"} for b in packed_batches])
        counted_on = summed_loss(model, [{**b, "position_ids": torch.arange(SEQ_LEN).expand(len(b["input_ids"]), -1)}
                                         for b in packed_batches])[0]
        for wrong in (leaking, counted_on):  # the equality above goes red (measured: 5e-5 to 8e-4 apart)
            assert wrong != pytest.approx(padded, rel=1e-5), (name, wrong, padded)


def test_plan_shows_the_tokens_of_a_micro_batch_padded_and_packed(tokenizer_dir, tmp_path):  # noqa: F811
    """`ddptrain plan` with the training flags of a language model on hf: records: the positions, tokens and
    padding of a rank's micro-batch either way, from the records' own lengths. In this process."""
    from ddptrain.config import TrainConfig
    from ddptrain.tools.plan import render_tokens

    rows = records(tokenizer_dir, tmp_path, "chat")
    lengths = rows.row_lengths()
    cfg = TrainConfig(task="language_model", model="gpt", dataset=f"hf:{tmp_path / 'chat.jsonl'}",
                      tokenizer=str(tokenizer_dir), seq_len=SEQ_LEN, batch_size=4, run_dir=str(tmp_path / "run"))
    table = {line.split()[0]: line.split() for line in render_tokens(cfg).splitlines()
             if line.strip().startswith(("padded", "--packing"))}
    padded, packed = table["padded"], table["--packing"]
    assert packed[3] == str(4 * SEQ_LEN) and int(packed[-1]) == len(plan_bins(lengths, SEQ_LEN, cfg.seed))
    assert int(padded[-1]) == len(lengths) and float(packed[5]) < float(padded[5])  # padding, %
    assert render_tokens(TrainConfig()) is None  # images: no token rows


def test_a_model_that_cannot_keep_documents_apart_is_refused_in_one_line(tmp_path):
    """A model whose forward takes no position_ids would train the documents of a bin as one text: exit 2 before
    training (in this process), as a transformers attention that ignores them is. --packing outside
    --task language_model is refused too."""
    from types import SimpleNamespace

    from ddptrain.api import train_worker
    from ddptrain.config import resolve_config
    from ddptrain.data.packing import check_model
    from ddptrain.errors import UsageError

    cfg = resolve_config([*PACKED, "--model", "lm_plugins:bigram_model", "--run_dir", str(tmp_path / "run"),
                          "--num_workers", "0", "--no-progress", "--max_steps", "1"])
    with pytest.raises(UsageError, match=r"--packing: --model lm_plugins:bigram_model takes no position_ids, so the "
                                         r"documents of a packed row would attend to each other"):
        train_worker(cfg)
    for name, model in models().items():
        check_model(model, name)
        model.config = SimpleNamespace(_attn_implementation="my_kernel")
        with pytest.raises(UsageError, match="attends with 'my_kernel', which does not keep"):
            check_model(model, name)
    with pytest.raises(UsageError, match="--packing places token rows for --task language_model, not --task "
                                         "classification"):
        resolve_config(["--packing"])
    with pytest.raises(UsageError, match="--dataset pydoc is one text with no document ends"):
        resolve_config(["--packing", "--task", "language_model", "--model", "gpt", "--dataset", "pydoc"])


def test_token_windows_keep_their_documents_apart(tokenizer_dir, tmp_path):  # noqa: F811
    """--dataset tokens with --packing: prepare-text records the end-of-text token it wrote after each file, and
    each window becomes a packed row (in this process). The gpt's and the Llama's loss over a batch of windows is
    the sum of each document piece's loss computed alone, over the same targets as the unpacked windows less the
    token after each end; positions that do not restart, or no position ids, give another loss. Token files
    without an end token are refused with --packing in one line."""
    from ddptrain.config import TrainConfig
    from ddptrain.data import text
    from ddptrain.data.batch import collate
    from ddptrain.errors import UsageError

    files = []
    for i in range(6):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(" ".join(words(5 + 9 * i, 40 * i)))
    assert text.main([str(tmp_path / "tokens"), *map(str, files), "--tokenizer", str(tokenizer_dir),
                      "--eval_fraction", "0"]) == 0
    end = json.loads((tmp_path / "tokens" / "meta.json").read_text())["end_of_document"]
    assert end == transformers.AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    data = dict(task="language_model", model="gpt", dataset="tokens", data_dir=str(tmp_path / "tokens"),
                vocab_size=320, seq_len=SEQ_LEN)
    windows, _ = text.build(TrainConfig(**data, packing=True).section("data"))
    plain, _ = text.build(TrainConfig(**data).section("data"))
    assert len(windows) == len(plain) >= 2
    batch = collate([windows[i] for i in range(len(windows))])
    whole = torch.stack([plain[i] for i in range(len(plain))])
    assert torch.equal(batch["input_ids"], whole[:, :-1])
    ends = batch["input_ids"] == end
    assert ends.sum() >= 3 and torch.equal(batch["labels"] == IGNORE, torch.nn.functional.pad(ends, (1, 0)))
    assert (batch["position_ids"][:, 1:][ends[:, :-1]] == 0).all() and (batch["position_ids"] == 0).sum() == \
        len(whole) + ends[:, :-1].sum()

    for name, model in models().items():
        model.eval()
        apart, counted = summed_loss(model, [batch])
        assert counted == whole[:, 1:].numel() - ends.sum()
        alone = 0.0
        for row in range(len(whole)):
            starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [SEQ_LEN]
            for start, stop in zip(starts, starts[1:]):
                piece = {"input_ids": batch["input_ids"][row:row + 1, start:stop],
                         "labels": batch["labels"][row:row + 1, start:stop + 1]}
                alone += summed_loss(model, [piece])[0]
        assert apart == pytest.approx(alone, rel=1e-5), name
        for wrong in ({k: v for k, v in batch.items() if k != "position_ids"},
                      {**batch, "position_ids": torch.arange(SEQ_LEN).expand(len(whole), -1)}):
            assert summed_loss(model, [wrong])[0] != pytest.approx(alone, rel=1e-5), name

    assert text.main([str(tmp_path / "bytes"), *map(str, files)]) == 0
    with pytest.raises(UsageError, match="--packing: .*meta.json records no end_of_document token"):
        text.check(TrainConfig(**{**data, "data_dir": str(tmp_path / "bytes")}, packing=True).section("data"))


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flash_attention_2"])
def test_on_cuda_packed_and_padded_agree_for_each_attention_kernel(tokenizer_dir, tmp_path, attention):  # noqa: F811
    """On a GPU, the Llama with transformers' CUDA kernels: sdpa in float32 (its block-diagonal mask from the
    position ids; 1e-5) and FlashAttention 2 in bf16 (the varlen path, from cu_seq_lens; bf16's rounding, 2e-2),
    where the flash_attn package is installed. benchmarks/gpu.sh runs the sdpa case."""
    if attention == "flash_attention_2":
        pytest.importorskip("flash_attn")
    from ddptrain.data.batch import collate, to_device

    rows = records(tokenizer_dir, tmp_path, "chat")
    packed = pack(rows, SEQ_LEN, seed=0, pad_id=2, what="test")
    dtype = torch.float32 if attention == "sdpa" else torch.bfloat16
    model = models()["llama"].to("cuda", dtype).eval()
    model.config._attn_implementation = attention
    device = torch.device("cuda")
    padded, tokens = summed_loss(model, [to_device(collate([rows[i] for i in range(s, min(s + 4, len(rows)))], 2),
                                                   device) for s in range(0, len(rows), 4)])
    together, packed_tokens = summed_loss(model, [to_device(collate([packed[i] for i in range(s, min(s + 4,
                                                                                                   len(packed)))]),
                                                            device) for s in range(0, len(packed), 4)])
    assert packed_tokens == tokens
    assert together == pytest.approx(padded, rel=1e-5 if attention == "sdpa" else 2e-2)


# --- training runs -----------------------------------------------------------------------------------------------
# The built-in gpt on a plug-in's rows of their own lengths (masked prompts, tests/lm_plugins.py), packed.
PACKED = ["--task", "language_model", "--model", "gpt", "--dataset", "lm_plugins:masked_lm", "--vocab_size", "64",
          "--seq_len", "24", "--width", "32", "--num_layers", "2", "--num_heads", "2", "--dataset_size", "192",
          "--eval_size", "24", "--packing", "--lr", "0.1", "--weight_decay", "0", "--save_every_steps", "2",
          "--keep_last", "0", "--record_sample_ids"]


def test_packed_training_on_1_2_and_3_processes_learns_the_same_and_a_killed_run_ends_bitwise(tmp_path):
    """The bins are the samples of the global order: 2 processes learn what 1 learns from the same global batch of
    12 bins (1e-5); a worker killed at step 5 restarts from step 4 and ends bitwise; step 4 resumed on 3 processes
    reads the same bins at every step and ends where 2 processes end (1e-5)."""
    two, one, killed, three = (tmp_path / name for name in ("two", "one", "killed", "three"))
    train(two, *PACKED, "--batch_size", "6", nproc=2)
    assert "--packing: 192 training rows" in (two / "logs" / "rank-0.log").read_text()
    train(one, *PACKED, "--batch_size", "12")
    final = weights(two / "model.safetensors")
    assert_trained(final, initial_weights(*PACKED))
    assert_close_weights(final, weights(one / "model.safetensors"), rel=1e-5)
    proc = train(killed, *PACKED, "--batch_size", "6", "--max_restarts", "1", nproc=2,
                 env={"DDPTRAIN_FAULT": "rank=1,step=5,kind=sigkill"})
    assert_restarted(proc, killed, from_step=4)
    assert_bitwise_equal(final, weights(killed / "model.safetensors"))
    train(three, *PACKED, "--batch_size", "4", "--resume_from", str(killed / "checkpoints" / "step-4"), nproc=3)
    resumed, straight = step_samples(three), step_samples(two)
    assert resumed and resumed == {step: ids for step, ids in straight.items() if step > 4}
    assert_close_weights(final, weights(three / "model.safetensors"), rel=1e-5)

"""LoRA adapters through peft (--lora_rank): a Llama with weights on disk (built here from a config), padded LM
batches; 2 processes must train the adapters 1 process trains, a killed run must end bitwise, checkpoints hold
the adapters only, and RUN_DIR/adapter/ must load with peft's own PeftModel.from_pretrained and
AutoPeftModelForCausalLM. Every adapter kind and option peft offers through the flags (embeddings, DoRA,
rsLoRA, modules_to_save, all-linear, the inits) is saved as peft's save_pretrained saves it and merged as its
merge_and_unload merges it, into RUN_DIR/hf/ and by `export --merge`. A classifier's head (a Llama's score, a
built-in's output layer) trains in full beside the adapters and is saved with them, under ddp and fsdp."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file
from helpers import assert_bitwise_equal, assert_close_weights, assert_restarted, cli_in_process, last_committed, \
    metrics, one_line_error, run_cli, train, weights

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 64
LM = ["--task", "language_model", "--dataset", "lm_plugins:masked_lm", "--vocab_size", str(VOCAB), "--seq_len", "24",
      "--dataset_size", "128", "--eval_size", "24", "--epochs", "1", "--lr", "0.3", "--weight_decay", "0",
      "--momentum", "0", "--save_every", "0"]
LORA = ["--lora_rank", "4", "--lora_alpha", "8"]
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # square: hidden x hidden


def llama(directory: Path, seed: int = 0, width: int = 32, **config: Any) -> Path:
    """A 2-layer Llama saved with its weights (save_pretrained), as a fine-tuner's base model is; `config`: more
    of its LlamaConfig."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                      max_position_embeddings=32, **config)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def whole(base, tmp_path_factory) -> Path:
    """1 process, the whole global batch of 32 sequences each step."""
    run_dir = tmp_path_factory.mktemp("whole")
    train(run_dir, "--model", f"hf:{base}", *LM, *LORA, "--batch_size", "32", timeout=300)
    return run_dir


def finetune(**flags: Any) -> Any:
    """The [finetune] section of --lora_rank 4 --lora_alpha 8 and `flags`."""
    from ddptrain.config import TrainConfig

    return TrainConfig(lora_rank=4, lora_alpha=8.0, **flags).section("finetune")


def trained_model(base: Path, run_dir: Path, **flags: Any) -> torch.nn.Module:
    """The base with the run's adapters, as the run ended (its model.safetensors holds what trained); `flags`:
    the run's [finetune] flags beside LORA."""
    from ddptrain.models import lora

    model = lora.apply(transformers.LlamaForCausalLM.from_pretrained(base), finetune(**flags), f"hf:{base}")
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    missing, unexpected = model.load_state_dict(weights(run_dir / "model.safetensors"), strict=False)
    assert not unexpected and not trained & set(missing)
    return model.eval()


def test_lora_on_two_processes_trains_the_adapters_one_process_trains_and_loads_in_peft(base, whole, tmp_path):
    train(tmp_path, "--model", f"hf:{base}", *LM, *LORA, "--batch_size", "8", "--grad_accum_steps", "2", nproc=2,
          timeout=300)
    final = weights(whole / "model.safetensors")
    assert final and all(".lora_A." in k or ".lora_B." in k for k in final), sorted(final)[:4]
    assert_close_weights(final, weights(tmp_path / "model.safetensors"), rel=1e-5)
    assert any(v.abs().max() > 0 for k, v in final.items() if ".lora_B." in k), "B starts at zero: it trained"
    # peft's own loader gives the trained model's logits.
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = trained_model(base, tmp_path)(ids).logits
        loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base),
                                                tmp_path / "adapter").eval()
        assert torch.equal(loaded(ids).logits, ours)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                                                      "q_proj", "up_proj", "v_proj"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_holds_the_adapters_only_and_a_killed_lora_run_ends_bitwise(tmp_path, strategy):
    """Rank 8 on a Llama of width 256 (1.3M parameters): a checkpoint, trainer state and all, is at most 10 % of
    the model's weights on disk. With dropout in the adapters, killed and restarted, the run ends bitwise."""
    base = llama(tmp_path / "wide", width=256)
    job = ["--model", f"hf:{base}", *LM, "--lora_rank", "8", "--lora_dropout", "0.1", "--batch_size", "8",
           "--save_every_steps", "2", "--keep_last", "0", "--strategy", strategy]
    train(tmp_path / "straight", *job, nproc=2, timeout=300)
    proc = train(tmp_path / "killed", *job, "--max_restarts", "1", nproc=2, timeout=400,
                 env={"DDPTRAIN_FAULT": "rank=1,step=5,kind=sigkill"})
    assert_restarted(proc, tmp_path / "killed", from_step=4)
    assert_bitwise_equal(weights(tmp_path / "straight" / "model.safetensors"),
                         weights(tmp_path / "killed" / "model.safetensors"))
    checkpoint = last_committed(tmp_path / "killed")
    held = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    model_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    assert held <= 0.1 * model_bytes, (held, model_bytes)


def test_a_lora_checkpoint_refuses_a_base_whose_weights_were_reordered(tmp_path):
    """The base the run trained on, its first q_proj transposed in place (the same values: the same sum and sum of
    squares, which were all a checkpoint recorded before issue 54 item 6): a resume is one line, exit 2, and
    `export --merge` refuses it (a UsageError: exit 2 too)."""
    from ddptrain.errors import UsageError
    from ddptrain.tools import export

    mine = llama(tmp_path / "llama")
    job = ["--model", f"hf:{mine}", *LM, *LORA, "--batch_size", "8", "--save_every_steps", "2"]
    train(tmp_path / "run", *job, "--max_steps", "2")
    stored = weights(mine / "model.safetensors")
    stored[Q_PROJ] = stored[Q_PROJ].t().contiguous()
    save_file(stored, str(mine / "model.safetensors"), metadata={"format": "pt"})
    proc = run_cli(["train", "--run_dir", str(tmp_path / "run"), *job, "--max_steps", "4", "--accept_config_change",
                    "--num_workers", "0", "--no-progress"])
    line = one_line_error(proc)  # no transformers loading bar before it
    assert "other frozen weights" in line and "--model" in line
    with pytest.raises(UsageError, match="fingerprint differs"):
        export.main([str(last_committed(tmp_path / "run")), "--hf", str(tmp_path / "merged"), "--merge"])


def test_lora_flags_without_a_rank_are_a_one_line_error_before_any_process(base, tmp_path):
    line = one_line_error(cli_in_process(["train", "--run_dir", str(tmp_path), "--model", f"hf:{base}", *LM,
                                          "--lora_targets", "q_proj"]))
    assert "--lora_rank" in line


def test_unknown_lora_targets_are_a_one_line_error(base, tmp_path):
    # Found where the adapters are applied, by the training process.
    line = one_line_error(run_cli(["train", "--run_dir", str(tmp_path), "--model", f"hf:{base}", *LM, *LORA,
                                   "--lora_targets", "q_proj,qkv", "--num_workers", "0", "--no-progress"]))
    assert "--lora_targets" in line and "qkv" in line and "q_proj" in line


# peft's adapter kinds and options, as [finetune] flags: an embedding's adapters (lora_embedding_A/B), DoRA's
# magnitudes, a module trained in full (modules_to_save), rsLoRA's scale, all-linear, the inits.
ADAPTER_KINDS = {
    "embedding": {"lora_targets": "embed_tokens"},
    "dora, rslora, modules_to_save": {"lora_targets": "q_proj,v_proj,embed_tokens", "lora_modules_to_save": "lm_head",
                                      "lora_dora": True, "lora_rslora": True},
    "all-linear, gaussian": {"lora_targets": "all-linear", "lora_init": "gaussian"},
    "orthogonal": {"lora_init": "orthogonal"},
}


def moved(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every tensor that trains moved off its init (B and an embedding's A start at zero)."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


@pytest.mark.parametrize("kind", sorted(ADAPTER_KINDS))
def test_every_adapter_kind_is_saved_loaded_and_merged_as_peft_does_it(kind, base, tmp_path, monkeypatch):
    """Issue 56 items 2, 3, 10, 13. `--lora_targets embed_tokens` wrote an adapter file of 0 tensors (peft names an
    embedding's adapters lora_embedding_A/B), `export --merge` was a KeyError, and adapter_config.json said
    task_type null (AutoPeftModelForCausalLM: "Cannot infer the auto class"). Now, for each kind: the adapter
    file holds the tensors and names PeftModel.save_pretrained writes for the same config, bitwise;
    AutoPeftModelForCausalLM loads it (the base found by its absolute path: --model names it relative here) to
    the trained model's logits; the merge equals peft's merge_and_unload (1e-6) and leaves the model as it was."""
    from ddptrain.models import lora

    monkeypatch.chdir(base.parent)
    flags = ADAPTER_KINDS[kind]
    model = moved(lora.apply(transformers.LlamaForCausalLM.from_pretrained(base), finetune(**flags), f"hf:{base.name}"))
    lora.save_adapter(model, model.state_dict(), tmp_path / "ours")
    ours = weights(tmp_path / "ours" / "adapter_model.safetensors")
    config = lora.lora_config(finetune(**flags), f"hf:{base}", transformers.LlamaForCausalLM.from_pretrained(base))
    theirs = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(base), config)
    assert not peft.set_peft_model_state_dict(theirs, ours).unexpected_keys
    theirs.save_pretrained(tmp_path / "theirs")
    assert_bitwise_equal(ours, weights(tmp_path / "theirs" / "adapter_model.safetensors"))
    trained = [name for name, param in model.named_parameters() if param.requires_grad]
    assert len(trained) <= len(ours) and (kind != "embedding" or any("lora_embedding_B" in k for k in ours)), ours
    saved_config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert saved_config["task_type"] == "CAUSAL_LM" and saved_config["base_model_name_or_path"] == str(base)

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "ours").eval()(ids).logits, logits)
        merged = lora.merged(model)
        expected = theirs.merge_and_unload().state_dict()
        assert merged.keys() == expected.keys()
        assert max((merged[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6
        assert torch.equal(model(ids).logits, logits), "merging changed the adapted model"


def test_an_adapter_that_would_lack_a_trained_tensor_is_an_error_and_no_file(base, tmp_path):
    """A tensor that trains and that PEFT's layout has no place for, or one the state handed over lacks: the
    adapter is not written and the run fails loudly (it ended 0 with an empty adapter file before)."""
    from ddptrain.errors import TrainingError
    from ddptrain.models import lora

    model = lora.apply(transformers.LlamaForCausalLM.from_pretrained(base), finetune(), f"hf:{base}")
    state = model.state_dict()
    with pytest.raises(TrainingError, match="lora_B"):
        lora.save_adapter(model, {k: v for k, v in state.items() if ".lora_B." not in k}, tmp_path)
    model.model.norm.weight.requires_grad_(True)
    with pytest.raises(TrainingError, match="model.norm.weight"):
        lora.save_adapter(model, state, tmp_path)
    assert not (tmp_path / "adapter_model.safetensors").exists()


def test_all_linear_leaves_out_the_output_head_and_a_classifier_adapter_names_its_task(base):
    """`--lora_targets all-linear` (refused before, issue 56 item 10) adapts every linear layer but the output
    head, as peft does: a Llama's projections, not lm_head; a classifier's, not its score head (SEQ_CLS, the task
    type its adapter_config.json names); the built-in gpt's and mlp's, not their output layer."""
    from ddptrain.models import lora

    classifier = transformers.LlamaForSequenceClassification.from_pretrained(base, num_labels=3)
    lora.apply(classifier, finetune(lora_targets="all-linear"), f"hf:{base}")
    assert classifier.lora_config.task_type == "SEQ_CLS"
    assert {name.rsplit(".", 1)[-1] for name in adapted(classifier)} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    causal = lora.apply(transformers.LlamaForCausalLM.from_pretrained(base), finetune(lora_targets="all-linear"),
                        f"hf:{base}")
    assert "lm_head" not in adapted(causal) and len(adapted(causal)) == 14
    for model in BUILT_IN:
        assert adapted(adapted_built_in(model, lora_targets="all-linear")[0]) == BUILT_IN[model][2]


def classifier(base: Path, seed: int = 0) -> torch.nn.Module:
    """The base as a 3-class sequence classifier (`--task classification --num_classes 3`): its `score` head is
    not in the base's files, drawn fresh after `seed`. Padding id 0, so that it classifies a batch."""
    torch.manual_seed(seed)
    return transformers.LlamaForSequenceClassification.from_pretrained(base, num_labels=3, pad_token_id=0)


def test_a_classifiers_head_trains_in_full_and_is_saved_and_loaded_as_peft_does_it(base, tmp_path):
    """--lora_rank on a classifier: its head (score), which the base lacks and which starts from a random init,
    was frozen there (only the adapters trained) and left out of RUN_DIR/adapter, so that the adapter loaded in
    another process gave another, random, head. Now it trains in full, as peft's SEQ_CLS modules_to_save: it
    requires grad and moves in a step; the adapter holds it under the key peft's save_pretrained writes for a
    modules_to_save copy (the same tensors and names as peft's for the same config, bitwise), its config lists
    it; and PeftModel / AutoPeftModelForSequenceClassification load it onto a base whose head was drawn from
    another seed to the trained model's logits. A head is trained in full, never adapted: `--lora_targets
    score` is one line."""
    from ddptrain.errors import UsageError
    from ddptrain.models import lora

    model = lora.apply(classifier(base), finetune(), f"hf:{base}")
    trains = {name for name, param in model.named_parameters() if param.requires_grad}
    assert "score.weight" in trains and all(".lora_" in name for name in trains - {"score.weight"}), sorted(trains)
    assert not any(".lora_" in name for name in trains if name.startswith("score"))
    init = model.score.weight.detach().clone()
    ids = torch.randint(1, VOCAB, (4, 12), generator=torch.Generator().manual_seed(6))
    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=0.5)
    torch.nn.functional.cross_entropy(model(ids).logits, torch.tensor([0, 1, 2, 1])).backward()
    optimizer.step()
    assert not torch.equal(model.score.weight, init), "the head trained"

    lora.save_adapter(model, model.state_dict(), tmp_path / "ours")
    ours = weights(tmp_path / "ours" / "adapter_model.safetensors")
    assert torch.equal(ours[lora_key("score.weight")], model.score.weight)
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "score" in config["modules_to_save"]
    theirs = peft.get_peft_model(classifier(base), lora.lora_config(finetune(), f"hf:{base}", classifier(base)))
    assert not peft.set_peft_model_state_dict(theirs, ours).unexpected_keys
    theirs.save_pretrained(tmp_path / "theirs")
    assert_bitwise_equal(ours, weights(tmp_path / "theirs" / "adapter_model.safetensors"))
    with torch.no_grad():
        logits = model.eval()(ids).logits
        loaded = peft.PeftModel.from_pretrained(classifier(base, seed=1), tmp_path / "ours").eval()
        assert torch.equal(loaded(ids).logits, logits)
        torch.manual_seed(2)
        auto = peft.AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "ours", num_labels=3,
                                                                           pad_token_id=0).eval()
        assert torch.equal(auto(ids).logits, logits)
        assert torch.equal(lora.merged(model)["score.weight"], model.score.weight), "merged: the trained head"
    with pytest.raises(UsageError, match=r"--lora_targets score: names the classifier's head \(score\)"):
        lora.apply(classifier(base), finetune(lora_targets="q_proj,score"), f"hf:{base}")


def labelled_words(directory: Path) -> tuple[Path, Path]:
    """(a word-level tokenizer of VOCAB ids, <pad> 0; JSON lines of texts of its words and a label in 0..2, the
    first word's number mod 3)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", unk_token="<unk>",
                                         eos_token="<unk>").save_pretrained(directory / "tokenizer")
    generator = torch.Generator().manual_seed(7)
    records = []
    for _ in range(64):
        numbers = torch.randint(0, VOCAB - 2, (int(torch.randint(3, 9, (), generator=generator)),), generator=generator)
        records.append({"text": " ".join(f"w{n}" for n in numbers.tolist()), "label": int(numbers[0]) % 3})
    (directory / "train.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return directory / "tokenizer", directory / "train.jsonl"


def test_a_classifiers_lora_run_under_fsdp_trains_its_head_and_peft_loads_it(tmp_path):
    """`--task classification --model hf:DIR --lora_rank 4` from the command line, under fsdp on 2 processes: the
    model built on the meta device, each rank filling its shards, the head among them (it trains in place: a
    peft copy of it could not be filled shard by shard). The head trains (off the init the run's seed draws),
    model.safetensors and RUN_DIR/adapter hold it, and PeftModel.from_pretrained onto a base whose head was
    drawn from another seed gives the trained model's logits."""
    from ddptrain.models import lora

    base = llama(tmp_path / "llama", pad_token_id=0)
    tokenizer, records = labelled_words(tmp_path)
    train(tmp_path / "run", "--model", f"hf:{base}", "--task", "classification", "--num_classes", "3", "--dataset",
          f"hf:{records}", "--tokenizer", str(tokenizer), "--seq_len", "12", *LORA, "--batch_size", "8",
          "--max_steps", "3", "--strategy", "fsdp", nproc=2, timeout=300)
    assert "built on the meta device" in (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    trained = weights(tmp_path / "run" / "model.safetensors")
    adapter = weights(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    assert torch.equal(adapter[lora_key("score.weight")], trained["score.weight"])
    init = classifier(base, seed=42).score.weight  # --seed 42's, as the whole build draws it (and, at --lr 0, fsdp)
    assert not torch.equal(trained["score.weight"], init), "the head trained"
    ids = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        model = lora.apply(classifier(base), finetune(), f"hf:{base}")
        missing, unexpected = model.load_state_dict(trained, strict=False)
        assert not unexpected and "score.weight" not in missing
        loaded = peft.PeftModel.from_pretrained(classifier(base, seed=1), tmp_path / "run" / "adapter").eval()
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


@pytest.mark.parametrize("flags, message", [
    ({"lora_rank": 0, "lora_dora": True}, "--lora_dora configures LoRA adapters, which are off; set --lora_rank"),
    ({"lora_init": "pissa"}, "--lora_init pissa rewrites the base weights"),
    ({"lora_init": "eva"}, "--lora_init eva: not one of true, gaussian, orthogonal, false"),
    ({"lora_rank": 3, "lora_init": "orthogonal"}, "--lora_init orthogonal needs an even --lora_rank"),
    ({"lora_dora": True, "strategy": "fsdp"}, "--lora_dora works with --strategy ddp only"),
    ({"lora_modules_to_save": "lm_head", "strategy": "fsdp"}, "--lora_modules_to_save works with --strategy ddp"),
    ({"lora_targets": "all-linear,q_proj"}, "all-linear stands alone"),
])
def test_peft_options_ddptrain_cannot_honour_are_refused_naming_the_flag(flags, message):
    from ddptrain.config import TrainConfig
    from ddptrain.errors import UsageError

    with pytest.raises(UsageError, match=message):
        TrainConfig(**{"lora_rank": 4, **flags}).validate()


def test_an_embedding_adapter_on_the_meta_device_and_a_layer_named_twice_are_usage_errors(base):
    """fsdp builds the model on the meta device and replays its in-place init per shard; peft draws an embedding
    adapter's init with torch.randn, which no replay repeats: refused there (ddp trains it). A layer both adapted
    and trained in full is refused before peft sees it."""
    from ddptrain.errors import UsageError
    from ddptrain.models import lora

    config = transformers.AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        on_meta = transformers.LlamaForCausalLM(config)
    with pytest.raises(UsageError, match="embedding model.embed_tokens works with --strategy ddp only"):
        lora.apply(on_meta, finetune(lora_targets="q_proj,embed_tokens"), f"hf:{base}")
    with pytest.raises(UsageError, match="both name lm_head"):
        lora.apply(transformers.LlamaForCausalLM(config),
                   finetune(lora_targets="lm_head", lora_modules_to_save="lm_head"), f"hf:{base}")


def test_a_lora_run_of_peft_options_saves_what_trained_and_writes_the_merged_model_in_hf(base, tmp_path):
    """From the command line: an embedding's adapters, DoRA, rsLoRA and lm_head trained in full (issue 56 items 2,
    4, 13), 1 process, 2 steps. RUN_DIR/adapter loads with AutoPeftModelForCausalLM to the trained model's
    logits; RUN_DIR/hf/ is the merged model (from_pretrained), the one `export --hf --merge` writes, bitwise."""
    flags = {"lora_targets": "q_proj,embed_tokens", "lora_modules_to_save": "lm_head", "lora_dora": True,
             "lora_rslora": True}
    argv = ["--lora_targets", "q_proj,embed_tokens", "--lora_modules_to_save", "lm_head", "--lora_dora",
            "--lora_rslora"]
    train(tmp_path / "run", "--model", f"hf:{base}", *LM, *LORA, *argv, "--batch_size", "8", "--max_steps", "2")
    adapter = weights(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    for key in ("model.embed_tokens.lora_embedding_B", "lm_head.weight",
                "model.layers.0.self_attn.q_proj.lora_magnitude_vector"):
        assert lora_key(key) in adapter, sorted(adapter)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = trained_model(base, tmp_path / "run", **flags)(ids).logits
        loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "run" / "adapter").eval()
        assert torch.equal(loaded(ids).logits, expected)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").eval()
        assert torch.allclose(merged(ids).logits, expected, rtol=1e-4, atol=1e-5)
    done = run_cli(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "merged"), "--merge"])
    assert done.returncode == 0, done.stderr
    assert_bitwise_equal(weights(tmp_path / "run" / "hf" / "model.safetensors"),
                         weights(tmp_path / "merged" / "model.safetensors"))


def lora_key(name: str) -> str:
    return "base_model.model." + name


def test_export_merge_writes_the_base_with_the_adapters_merged_for_from_pretrained(base, whole, tmp_path):
    """`ddptrain export --hf OUT --merge`: a save_pretrained directory whose plain Llama gives the trained model's
    logits (up to the merge's rounding); without --merge, --hf is one line naming it. The run's own RUN_DIR/hf/
    is that merged model (issue 56 item 4: it held a config.json alone, which from_pretrained refused)."""
    checkpoint = last_committed(whole)
    line = one_line_error(run_cli(["export", str(checkpoint), "--hf", str(tmp_path / "nomerge")]))
    assert "--merge" in line
    done = run_cli(["export", str(checkpoint), "--hf", str(tmp_path / "merged"), "--merge"])
    assert done.returncode == 0, done.stderr
    assert_bitwise_equal(weights(whole / "hf" / "model.safetensors"),
                         weights(tmp_path / "merged" / "model.safetensors"))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert not any(".lora_" in name for name in merged.state_dict())
        expected = trained_model(base, whole)(ids).logits
        assert torch.allclose(merged(ids).logits, expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(transformers.LlamaForCausalLM.from_pretrained(base).eval()(ids).logits, expected,
                                  rtol=1e-4, atol=1e-5), "the adapters changed the model"


def test_lora_under_fsdp_trains_what_one_process_trains_and_resumes_on_another_world_size(base, whole, tmp_path):
    """FSDP2 over a frozen base built on the meta device: 2 processes equal 1 (1e-5); the sharded checkpoint holds the adapters only (no
    frozen tensor in its index), and a 1-process ddp run continues it from step 2 (the fingerprint of the frozen
    weights summed over the shards matches the whole tensors')."""
    job = ["--model", f"hf:{base}", *LM, *LORA, "--save_every_steps", "2", "--keep_last", "0"]
    train(tmp_path / "two", *job, "--batch_size", "8", "--grad_accum_steps", "2", "--strategy", "fsdp", nproc=2,
          timeout=300)
    # The base read into each rank's shards, the adapters' init replayed: no rank built the whole model.
    log = (tmp_path / "two" / "logs" / "rank-0.log").read_text()
    assert "fsdp: built on the meta device, each rank's shards filled from" in log
    # No rank holds the whole base to merge into: no hf/ (a config.json alone before), and the log says why.
    assert not (tmp_path / "two" / "hf").exists() and "hf/ not written" in log and "--merge" in log
    assert_close_weights(weights(whole / "model.safetensors"), weights(tmp_path / "two" / "model.safetensors"),
                         rel=1e-5)
    step_2 = tmp_path / "two" / "checkpoints" / "step-2"
    from torch.distributed.checkpoint import FileSystemReader

    held = FileSystemReader(str(step_2 / "shards")).read_metadata().state_dict_metadata
    assert any(".lora_A." in k for k in held) and not any(".base_layer." in k for k in held), sorted(held)[:5]
    proc = train(tmp_path / "one", *job, "--batch_size", "32", "--resume_from", str(step_2), timeout=300)
    assert proc.returncode == 0
    assert "resuming from" in (tmp_path / "one" / "logs" / "rank-0.log").read_text()
    assert_close_weights(weights(whole / "model.safetensors"), weights(tmp_path / "one" / "model.safetensors"),
                         rel=1e-5)


def test_lora_on_a_bf16_base_under_fsdp_learns_and_peft_loads_its_adapter(base, tmp_path):
    """--param_dtype bf16 with --lora_rank (issue 37 item 1): the frozen base and the adapters are held in bf16, the
    adapters learn and are saved in bf16, and RUN_DIR/adapter loads onto the base read in bf16."""
    train(tmp_path, "--model", f"hf:{base}", *LM, *LORA, "--batch_size", "8", "--max_steps", "6", "--strategy", "fsdp",
          "--param_dtype", "bf16", nproc=2, timeout=300)
    losses = [row["loss"] for row in metrics(tmp_path, "train")]
    assert losses[-1] < losses[0], losses
    adapter = weights(tmp_path / "model.safetensors")
    assert {t.dtype for t in adapter.values()} == {torch.bfloat16}
    loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
                                            str(tmp_path / "adapter"))
    assert loaded(input_ids=torch.arange(8)[None]).logits.dtype == torch.bfloat16


def test_the_adapters_of_an_fsdp_run_are_gathered_without_its_frozen_base(tmp_path):
    """At the end of an fsdp run only the adapters come together on rank 0 (model.safetensors, RUN_DIR/adapter),
    a tensor at a time: the frozen base stays in its shards. A deep, narrow Llama (48 blocks of 2.5 MiB, 120
    MiB in all). Gathering the whole model first raised rank 0's peak by about the base's size between its last
    step and the end of the run."""
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=48,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                      max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "deep")
    base_mib = sum(t.numel() * t.element_size() for t in weights(tmp_path / "deep" / "model.safetensors").values())
    base_mib /= 2**20
    train(tmp_path / "run", "--model", f"hf:{tmp_path / 'deep'}", *LM, *LORA, "--batch_size", "2", "--max_steps",
          "2", "--strategy", "fsdp", "--callbacks", "callback_plugins:RecordPeak", nproc=2, timeout=300)
    peaks = json.loads((tmp_path / "run" / "peak-rank-0.json").read_text())
    grew = peaks["end"] - peaks["step"]
    # Measured: 8 MiB; gathering the whole model first: 52 MiB (training's own peak hides the rest of it).
    assert grew < base_mib / 4, f"writing the final weights raised rank 0's peak {grew:.0f} MiB (base {base_mib:.0f})"
    adapters = weights(tmp_path / "run" / "model.safetensors")
    assert adapters and all(".lora_" in name for name in adapters)


# The built-in models, in this process, each as --model builds it: its settings, an input, its linear layers.
BUILT_IN = {
    "gpt": ({"task": "language_model", "vocab_size": VOCAB, "seq_len": 12, "width": 16, "num_layers": 3,
             "num_heads": 2}, lambda: torch.randint(0, VOCAB, (2, 12)),
            {f"blocks.{block}.{layer}" for block in range(3) for layer in ("qkv", "proj", "mlp.0", "mlp.2")}),
    "mlp": ({"in_channels": 1, "image_size": 4, "width": 8}, lambda: torch.randn(2, 1, 4, 4), {"net.1"}),
}
# What each trains in full beside the adapters: a classifier's output layer, its head (gpt's is its embedding's).
BUILT_IN_HEADS = {"gpt": set(), "mlp": {"net.3.weight", "net.3.bias"}}


def adapted_built_in(model: str, lora_targets: str = "") -> tuple[torch.nn.Module, Callable[[], torch.nn.Module]]:
    """(--model `model` with LoRA adapters, a function building the same model without them)."""
    from ddptrain.config import TrainConfig
    from ddptrain.models import build_model, lora

    cfg = TrainConfig(model=model, lora_rank=4, lora_alpha=8.0, lora_targets=lora_targets, **BUILT_IN[model][0])

    def plain() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model(cfg.section("data"))

    return lora.apply(plain(), cfg.section("finetune"), model), plain


def adapted(module: torch.nn.Module) -> set[str]:
    """The layers peft injected adapters into, each asserted a linear layer."""
    layers = {name: sub.base_layer for name, sub in module.named_modules() if hasattr(sub, "base_layer")}
    assert all(type(layer) is torch.nn.Linear for layer in layers.values()), layers
    return set(layers)


@pytest.mark.parametrize("model", sorted(BUILT_IN))
def test_the_default_targets_of_a_built_in_model_are_its_linear_layers_and_load_in_peft(model, tmp_path):
    """gpt's were `0` and `2` (of mlp.0 and mlp.2), which peft matched to whole blocks too (issue 54 item 7: exit 1
    inside peft). Now every linear layer inside the blocks (mlp, which has none: all but the output layer) is
    adapted, and nothing else; mlp's output layer, a classifier's head as fresh as a transformers classifier's,
    trains in full (it stayed frozen at its random init before); the model runs, and its adapter in PEFT's layout
    (as RUN_DIR/adapter, the head under modules_to_save) loads onto the plain model with peft's
    PeftModel.from_pretrained to the same outputs."""
    from ddptrain.models import lora

    _, inputs, layers = BUILT_IN[model]
    module, plain = adapted_built_in(model)
    assert adapted(module) == layers
    trains = {name for name, param in module.named_parameters() if param.requires_grad and ".lora_" not in name}
    assert trains == BUILT_IN_HEADS[model]
    module = moved(module)  # B starts at zero, the head at the plain model's init: they would change nothing yet
    lora.save_adapter(module, module.state_dict(), tmp_path)
    loaded = peft.PeftModel.from_pretrained(plain(), tmp_path)
    x = inputs()
    with torch.no_grad():
        out = module.eval()(x)
        assert torch.equal(loaded.eval()(x), out)
        assert not torch.allclose(plain().eval()(x), out), "the adapters change the outputs"


def test_the_built_in_mini_resnet_has_no_default_target_and_dotted_targets_name_layers():
    """mini_resnet's only linear layer is its output layer, its head (trained in full beside what --lora_targets
    adapts): --lora_rank alone is one line naming --lora_targets.
    A target names the layers whose dotted name ends with it, as peft matches it: `mlp.2` (refused before as no
    layer's last name)."""
    from ddptrain.config import TrainConfig
    from ddptrain.errors import UsageError
    from ddptrain.models import build_model, lora

    cfg = TrainConfig(model="mini_resnet", width=4, lora_rank=4)
    with pytest.raises(UsageError, match="--lora_targets"):
        lora.apply(build_model(cfg.section("data")), cfg.section("finetune"), "mini_resnet")
    assert lora.heads(build_model(cfg.section("data"))) == ["head"]  # trained in full beside what it adapts
    module, _ = adapted_built_in("gpt", lora_targets="mlp.2,qkv")
    assert adapted(module) == {f"blocks.{block}.{layer}" for block in range(3) for layer in ("qkv", "mlp.2")}


def test_lora_on_the_built_in_gpt_trains_from_the_command_line(tmp_path):
    """`--model gpt --lora_rank 4`: 2 steps, exit 0 (1, inside peft, before issue 54 item 7); the adapters of its
    linear layers are what model.safetensors holds."""
    train(tmp_path, "--model", "gpt", "--width", "16", "--num_layers", "2", "--num_heads", "2", *LM, *LORA,
          "--batch_size", "8", "--max_steps", "2")
    assert sorted(json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]) == [
        "mlp.0", "mlp.2", "proj", "qkv"]
    adapters = weights(tmp_path / "model.safetensors")
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters), sorted(adapters)[:4]


# The fingerprint of a frozen base, in this process: `fingerprint` reads a module's state_dict() alone.
def holding(state: dict[str, torch.Tensor]) -> Any:
    return SimpleNamespace(state_dict=lambda: state)


def sharded_fingerprint(state: dict[str, torch.Tensor], mesh_shape: tuple[int, ...], placements: list) -> list:
    """The fingerprint of `state` sharded as FSDP2 shards it (torch.chunk of dim 0 over the mesh's last dim; hsdp:
    replicated over the first) on a mesh of `mesh_shape`: each rank's in turn, on a fake process group in this
    process, added as ModelState.fingerprint adds the ranks'."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ddptrain.models import lora

    world, total = math.prod(mesh_shape), None
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
            index, parts = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
            shards = {}
            for name, whole in state.items():
                chunks = torch.chunk(whole, parts)
                local = chunks[index] if index < len(chunks) else whole[:0]
                shards[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=whole.shape,
                                                  stride=whole.stride())
            mine = lora.fingerprint(holding(shards), list(state))
        finally:
            dist.destroy_process_group()
        total = mine if total is None else [[a + b for a, b in zip(x, y)] for x, y in zip(total, mine)]
    return total


@pytest.fixture
def frozen() -> dict[str, torch.Tensor]:
    """A frozen base: a square q_proj, rows that split unevenly over 3 and 6 ranks (3/3/1; 2/2/2/1/0/0; 2/2/0), a
    norm's weight, in float32 and bf16."""
    torch.manual_seed(0)
    return {"q_proj": torch.randn(8, 8) * 0.02, "rows": torch.randn(7, 3), "down": torch.randn(4, 6).bfloat16(),
            "norm": torch.rand(5) + 0.5}


def test_the_fingerprint_of_a_frozen_base_sees_the_order_of_its_values_and_not_its_layout(frozen):
    """A q_proj transposed or two of its rows swapped, or a norm reversed, keep each tensor's sum and sum of
    squares: a resume or a merge accepted them (issue 54 item 6). The positional sums refuse them; and the sums
    the ranks of fsdp (3 ranks, 6 ranks: uneven and empty shards) or hsdp (2 x 3: one replica's shards) add are
    still the whole tensors'."""
    from torch.distributed.tensor import Replicate, Shard

    from ddptrain.models import lora

    names = list(frozen)
    whole = lora.fingerprint(holding(frozen), names)
    swapped = frozen["q_proj"].clone()
    swapped[[1, 5]] = swapped[[5, 1]]
    for changed in ({"q_proj": frozen["q_proj"].t()}, {"q_proj": swapped}, {"norm": frozen["norm"].flip(0)},
                    {"q_proj": frozen["q_proj"] * 1.001}):
        assert not lora.same_weights(whole, lora.fingerprint(holding({**frozen, **changed}), names)), changed
    for mesh_shape, placements in (((3,), [Shard(0)]), ((6,), [Shard(0)]), ((2, 3), [Replicate(), Shard(0)])):
        assert lora.same_weights(whole, sharded_fingerprint(frozen, mesh_shape, placements)), mesh_shape


def test_a_fingerprint_from_before_the_positional_sums_is_compared_on_its_sums(frozen):
    """A checkpoint written before issue 54 item 6 records [sum, sum of squares] per tensor alone: it resumes and
    merges on the same base, and is refused on other values, as before (a reordered base passes it still)."""
    from ddptrain.models import lora

    names = list(frozen)
    old = lora.fingerprint(holding(frozen), names)[:len(names)]
    assert lora.same_weights(old, lora.fingerprint(holding(frozen), names))
    assert not lora.same_weights(old, lora.fingerprint(holding({**frozen, "norm": frozen["norm"] * 2}), names))

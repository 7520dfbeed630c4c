"""Big models under --strategy fsdp: no rank ever holds the whole model. The model is built on the meta device,
sharded, and each rank fills its own shards (the seeded init replayed a tensor at a time, or its rows read
from a save_pretrained directory); the final weights leave streamed a tensor at a time, RUN_DIR/hf/ in HF's
sharded layout. Real processes, gloo on CPU, tiny models (the memory it saves is measured by `make bench`,
section big_model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import REPO, TINY, assert_bitwise_equal, assert_close_weights, run_cli, run_python, train, weights

transformers = pytest.importorskip("transformers")

VOCAB = 64
LM = ["--task", "language_model", "--dataset", "lm_plugins:masked_lm", "--vocab_size", str(VOCAB), "--seq_len", "24",
      "--dataset_size", "128", "--eval_size", "24", "--lr", "0.1", "--weight_decay", "0", "--momentum", "0",
      "--save_every", "0", "--batch_size", "8"]
STEPS_50 = ["--epochs", "7", "--max_steps", "50"]  # 8 steps of 2 x 8 sequences per epoch
FSDP = ["--strategy", "fsdp"]
BUILT_ON_META = "built on the meta device"


def llama_config() -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, bos_token_id=VOCAB - 1,
                                    eos_token_id=VOCAB - 1)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A Llama and a GPT-2 (tied embeddings) as a config alone and with weights; the Llama's weights in
    HF's sharded layout (several files and an index)."""
    root = tmp_path_factory.mktemp("models")
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                   bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    llama_config().save_pretrained(root / "llama_config")
    gpt2.save_pretrained(root / "gpt2_config")
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(root / "llama_index", max_shard_size="20KB")
    assert (root / "llama_index" / "model.safetensors.index.json").is_file()
    torch.manual_seed(2)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2_weights")
    return root


def test_fsdp_builds_on_meta_and_each_rank_fills_its_shards_with_the_whole_builds_values_bitwise(models, tmp_path):
    """Built-ins and transformers models, from a seeded init or from weights (one file, or several and an
    index; tied; a classification head the file lacks; with LoRA's adapters): gathered, every tensor equals the
    whole build's."""
    report_path = tmp_path / "report.json"
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       str(REPO / "tests" / "worker_meta_init.py"), str(report_path), str(models)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    save = report.pop("save")
    assert len(report) == 11
    for case, found in report.items():
        assert found == {"meta": True, "differ": []}, case
    assert save["files"] == ["config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                             "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    assert save["equal"], "from_pretrained of the streamed save is the model"


@pytest.fixture(scope="module")
def llama_ddp(models, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("llama_ddp")
    train(run_dir, "--model", f"hf:{models / 'llama_index'}", *LM, *STEPS_50, nproc=2, timeout=400)
    return run_dir


@pytest.fixture(scope="module")
def llama_fsdp(models, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("llama_fsdp")
    train(run_dir, "--model", f"hf:{models / 'llama_index'}", *LM, *STEPS_50, *FSDP, nproc=2, timeout=400)
    return run_dir


def test_a_llama_loaded_from_weights_on_fsdp_trains_what_ddp_trains(llama_ddp, llama_fsdp):
    assert BUILT_ON_META in (llama_fsdp / "logs" / "rank-0.log").read_text()
    assert_close_weights(weights(llama_ddp / "model.safetensors"), weights(llama_fsdp / "model.safetensors"),
                         rel=1e-5)


def test_the_flops_of_a_transformers_model_built_on_meta_are_counted(llama_fsdp):
    """Its FLOPs are counted on fake tensors (a meta tensor has no value for transformers' mask checks to test,
    which made MFU unavailable with a warning on every such run)."""
    log_text = (llama_fsdp / "logs" / "rank-0.log").read_text()
    assert BUILT_ON_META in log_text
    assert "FLOP count unavailable" not in log_text
    counted = [line for line in log_text.splitlines() if "training FLOPs per sample" in line]
    assert counted and float(counted[0].split(", ")[-1].split()[0]) > 0, counted


def test_ddp_and_fsdp_count_the_same_flops_for_the_same_model(llama_ddp, llama_fsdp):
    """ddp counts the model built whole on the CPU, fsdp the one built on the meta device: torch's counter skipped
    the CPU's fused attention kernel, so ddp's count lacked attention and MFU differed (12 % for a 44M Llama)."""
    def counted(run_dir: Path) -> str:
        lines = (run_dir / "logs" / "rank-0.log").read_text().splitlines()
        return next(line for line in lines if "training FLOPs per sample" in line).split(", ")[-1]

    assert counted(llama_ddp) == counted(llama_fsdp)


def test_a_built_in_model_on_meta_does_not_import_transformers_and_an_unrecorded_transformers_build_is_whole():
    """Importing transformers costs each rank of an fsdp run seconds of CPU: a built-in model is built on the meta
    device without it. A transformers model built without its post_init recorded could not be replayed as the
    whole build: it is built whole instead (meta.build gives None)."""
    code = ("import sys, torch\n"
            "from ddptrain.config import TrainConfig\n"
            "from ddptrain.models import instantiate, meta\n"
            "cfg = TrainConfig(model='gpt', vocab_size=64, seq_len=8, width=16, num_layers=1, num_heads=2)\n"
            "module = instantiate(cfg.section('data'), cfg.section('finetune'), None, torch.device('cpu'), seed=0,\n"
            "                     sharded=True, channels_last=False)\n"
            "print(all(p.is_meta for p in module.parameters()), 'transformers' in sys.modules)\n"
            "import transformers\n"
            "config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
            "                                  num_attention_heads=2, vocab_size=64)\n"
            "print(meta.build(lambda: transformers.LlamaForCausalLM(config)) is None,\n"
            "      meta.build(lambda: transformers.LlamaForCausalLM(config), transformers=True) is None)\n")
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False", "True", "False"], proc.stdout


def test_a_built_in_gpt_on_fsdp_trains_what_ddp_trains(tmp_path):
    gpt = ["--model", "gpt", "--width", "32", "--num_layers", "2", "--num_heads", "2", *LM, *STEPS_50]
    train(tmp_path / "ddp", *gpt, nproc=2, timeout=400)
    train(tmp_path / "fsdp", *gpt, *FSDP, nproc=2, timeout=400)
    assert BUILT_ON_META in (tmp_path / "fsdp" / "logs" / "rank-0.log").read_text()
    assert_close_weights(weights(tmp_path / "ddp" / "model.safetensors"),
                         weights(tmp_path / "fsdp" / "model.safetensors"), rel=1e-5)


@pytest.mark.slow  # inductor compiles the blocks on the CPU: ~35 s of each run
def test_compile_under_fsdp_compiles_each_block_and_trains_what_eager_trains(tmp_path):
    """--compile under fsdp: each block compiled in place before fully_shard (whole-model compile over FSDP2's
    units is the slow way), parameter names unchanged; 20 steps end within 1e-4 of the eager run (inductor's
    fused kernels round differently)."""
    gpt = ["--model", "gpt", "--width", "32", "--num_layers", "2", "--num_heads", "2", *LM, "--max_steps", "20", *FSDP]
    train(tmp_path / "eager", *gpt, nproc=2, timeout=400)
    train(tmp_path / "compiled", *gpt, "--compile", nproc=2, timeout=600)
    log_text = (tmp_path / "compiled" / "logs" / "rank-0.log").read_text()
    assert "fsdp: --compile per block: 2 blocks compiled, each before it was sharded" in log_text
    eager, compiled = weights(tmp_path / "eager" / "model.safetensors"), weights(tmp_path / "compiled" / "model.safetensors")
    assert eager.keys() == compiled.keys()
    assert_close_weights(eager, compiled, rel=1e-4)


def first_call_settled() -> None:
    """See tests/models/test_hf.py: a process's first multi-threaded tanh may differ by 1e-5; compare later calls."""
    torch.tanh(torch.linspace(-3, 3, 8192))


def test_the_streamed_final_save_loads_with_from_pretrained_and_export_consolidates_it(llama_fsdp, tmp_path):
    first_call_settled()
    hf_dir = llama_fsdp / "hf"
    assert (hf_dir / "model.safetensors.index.json").is_file() and not (hf_dir / "model.safetensors").exists()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    trained = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(hf_dir)).eval()
    trained.load_state_dict(weights(llama_fsdp / "model.safetensors"))
    expected = trained(input_ids=tokens).logits
    out = tmp_path / "whole"
    proc = run_cli(["export", str(hf_dir), str(tmp_path / "whole.safetensors"), "--hf", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert_bitwise_equal(weights(tmp_path / "whole.safetensors"), weights(out / "model.safetensors"))
    for directory in (hf_dir, out):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        assert_bitwise_equal(loaded.state_dict(), trained.state_dict())
        torch.testing.assert_close(loaded(input_ids=tokens).logits, expected, rtol=0, atol=0)


def test_a_killed_fsdp_run_of_a_model_built_on_meta_restarts_and_ends_bitwise(models, tmp_path):
    job = ["--model", f"hf:{models / 'llama_index'}", *LM, "--epochs", "2", *FSDP, "--save_every_steps", "2",
           "--keep_last", "0"]
    train(tmp_path / "straight", *job, nproc=2, timeout=400)
    train(tmp_path / "killed", *job, "--max_restarts", "1", nproc=2, timeout=400,
          env={"DDPTRAIN_FAULT": "rank=1,step=5,kind=sigkill"})
    assert "resuming from" in (tmp_path / "killed" / "logs" / "rank-0.log").read_text()
    assert_bitwise_equal(weights(tmp_path / "straight" / "model.safetensors"),
                         weights(tmp_path / "killed" / "model.safetensors"))


def test_a_sharded_checkpoint_of_two_ranks_resumes_on_one(models, tmp_path):
    """World size 2 -> 1 with the same global batch: the resumed run ends where the 2-rank run ends."""
    job = ["--model", f"hf:{models / 'llama_index'}", *LM, "--epochs", "1", *FSDP, "--save_every_steps", "4",
           "--keep_last", "0"]
    train(tmp_path / "two", *job, nproc=2, timeout=400)
    step_4 = tmp_path / "two" / "checkpoints" / "step-4"
    assert (step_4 / "manifest.json").is_file()
    train(tmp_path / "one", *job, "--batch_size", "16", "--resume_from", str(step_4), "--accept_config_change",
          nproc=1, timeout=400)
    assert "resuming from" in (tmp_path / "one" / "logs" / "rank-0.log").read_text()
    assert_close_weights(weights(tmp_path / "two" / "model.safetensors"),
                         weights(tmp_path / "one" / "model.safetensors"), rel=1e-5)


# A 12.6M-parameter MLP (50 MiB of fp32 weights, as much again of SGD momentum) on 3x32x32 inputs.
WIDE = ["--model", "mlp", "--width", "4096", "--image_size", "32", "--batch_size", "4", "--dataset_size", "64",
        "--eval_size", "0", "--save_every", "0", "--momentum", "0.9"]
WIDE_MIB = (3 * 32 * 32 * 4096 + 4096 + 4096 * 10 + 10) * 4 / 2**20


def peak_mib(run_dir: Path) -> float:
    """The most any rank held when training started (callback_plugins.RecordPeak), in MiB."""
    return max(json.loads(path.read_text())["start"] for path in run_dir.glob("peak-rank-*.json"))


def _weights_dir(root: Path, change) -> Path:
    """A save_pretrained-like directory of a tiny Llama's config and weights, `change`d (state dict -> state dict)."""
    from safetensors.torch import save_file

    root.mkdir()
    llama_config().save_pretrained(root)
    torch.manual_seed(3)
    state = {k: v.contiguous() for k, v in transformers.LlamaForCausalLM(llama_config()).state_dict().items()}
    save_file(change(state), str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
EMBED = "model.embed_tokens.weight"


def _cut_short(root: Path) -> None:
    path = root / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4096])


@pytest.mark.parametrize("change, damage, said", [
    # One column where the model has 32: broadcast into every column before, exit 0.
    (lambda s: {**s, Q_PROJ: s[Q_PROJ][:, :1].contiguous()}, None,
     f"model.safetensors: {Q_PROJ} has shape [32, 1], the model's {Q_PROJ} [32, 32]"),
    # A resized vocabulary (80 rows, the config says 64): each rank read its rows of the first 64, exit 0.
    (lambda s: {**s, EMBED: torch.cat([s[EMBED], s[EMBED][:16]])}, None,
     f"model.safetensors: {EMBED} has shape [80, 32], the model's {EMBED} [64, 32]"),
    # Integers where the model's weights are floats: cast and copied before.
    (lambda s: {**s, Q_PROJ: torch.ones(32, 32, dtype=torch.int64)}, None,
     f"model.safetensors: {Q_PROJ} holds I64 values, the model's {Q_PROJ} is torch.float32"),
    # Cut short (a copy that did not finish): "incomplete metadata" before, naming no file.
    (lambda s: s, _cut_short, "model.safetensors: cannot read it as safetensors (Error while deserializing header: "
                              "incomplete metadata"),
], ids=["one-column", "resized-vocabulary", "integers", "cut-short"])
def test_fsdp_refuses_weights_of_another_shape_or_a_damaged_file_before_copying_any(tmp_path, change, damage, said):
    """Each rank copies only its rows of each stored tensor into its shard: a tensor of another shape broadcast or
    was cut without a word (ddp's from_pretrained refuses it). Every stored tensor's shape and dtype is checked
    against the model's first; the run ends as bad input, naming the tensor, both shapes and the file. In this
    process (a world of one: its shard is the whole tensor, and the copy broadcast all the same)."""
    from ddptrain.api import train_worker
    from ddptrain.config import resolve_config
    from ddptrain.errors import UsageError

    weights_dir = _weights_dir(tmp_path / "weights", change)
    if damage is not None:
        damage(weights_dir)
    cfg = resolve_config(["--model", f"hf:{weights_dir}", *LM, "--max_steps", "1", *FSDP, "--run_dir",
                          str(tmp_path / "run"), "--num_workers", "0", "--no-progress"])
    with pytest.raises(UsageError) as refused:
        train_worker(cfg)
    assert said in str(refused.value) and str(weights_dir) in str(refused.value), refused.value
    assert "\n" not in str(refused.value)


def test_a_full_checkpoint_resumes_under_fsdp_with_each_rank_reading_its_own_rows(tmp_path):
    """Issue 36 item 2: a ddp (full) checkpoint resumed by 2 fsdp ranks. Each rank reads of model.safetensors and
    optimizer.pt only the rows its shards hold, so when training starts a rank has held about its half of the
    weights and momentum more than the same job started fresh; reading the files whole cost every rank ~4x the
    model (each file's bytes and their tensors at once). The resumed run trains on to the weights of one that
    never stopped."""
    job = [*WIDE, "--max_steps", "2", "--strategy", "fsdp", "--batch_size", "2",  # the global batch stays 4
           "--callbacks", "callback_plugins:RecordPeak"]
    train(tmp_path / "ddp", *WIDE, "--max_steps", "1", "--save_every_steps", "1", timeout=400)
    step_1 = tmp_path / "ddp" / "checkpoints" / "step-1"
    train(tmp_path / "fresh", *job, nproc=2, timeout=400)
    train(tmp_path / "resumed", *job, "--resume_from", str(step_1), nproc=2, timeout=400)
    assert "resuming from" in (tmp_path / "resumed" / "logs" / "rank-0.log").read_text()
    extra = peak_mib(tmp_path / "resumed") - peak_mib(tmp_path / "fresh")  # the most a rank held, each run
    # Measured: 0 MiB (the rows fit under what starting up held anyway); reading whole files: 103 MiB.
    assert extra < WIDE_MIB, f"resuming cost a rank {extra:.0f} MiB more, the whole model is {WIDE_MIB:.0f} MiB"
    train(tmp_path / "straight", *WIDE, "--max_steps", "2", timeout=400)
    assert_close_weights(weights(tmp_path / "straight" / "model.safetensors"),
                         weights(tmp_path / "resumed" / "model.safetensors"), rel=1e-5)


def test_plan_shards_the_llama_as_the_run_did(models, llama_fsdp):
    """`ddptrain plan`'s memory model against a real 2-process run of the same flags: the same units, and each
    rank's parameters + gradients + optimizer state as the run's memory line reports them (MiB, 2 decimals)."""
    import re

    from ddptrain.config import resolve_config
    from ddptrain.tools import memplan

    cfg = resolve_config([*TINY, "--model", f"hf:{models / 'llama_index'}", *LM, *FSDP])  # the run's flags
    shape = memplan.model_shape(cfg)
    log_text = (llama_fsdp / "logs" / "rank-0.log").read_text()
    split = sum(1 for unit in shape.units if unit.vocabulary)  # the embedding and head: no FSDP units
    assert split == 2 and f": {len(shape.units) - split} units, {split} split by vocabulary rows" in log_text
    assert "freed blocks of >= 1048576 bytes go back to the system" in log_text  # parallel/hostmem.py
    assert "outlived their destruction" not in log_text  # nothing kept the model (and its groups) alive
    logged = re.search(r"optimizer state ([\d.]+) / ([\d.]+) MiB per rank", log_text)
    predicted = memplan.footprint(shape, cfg, 2).held / 2**20
    assert logged and all(abs(float(v) - predicted) <= 0.01 + 0.02 * predicted for v in logged.groups()), \
        (logged, predicted)


def test_freed_blocks_go_back_to_the_system_once_the_threshold_is_fixed():
    """glibc serves a block from the heap, where a freed one stays resident, once its moving mmap threshold has
    risen above the block's size (as the first freed large tensor makes it); `hostmem.return_freed_blocks`
    (called by fsdp/hsdp workers on CPU) fixes the threshold at 1 MiB, so each such block is a mapping of its
    own, unmapped when freed. glibc's own count of mapped bytes (mallinfo2) while 32 blocks of 4 MiB live, and
    after. (That the workers of an fsdp run call it: the test above.)"""
    script = """
import ctypes, sys, torch
from ddptrain.parallel import hostmem

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2

def mapped_mib():
    return mallinfo2().hblkhd / 2**20

bump = torch.ones(4 << 20)  # 16 MiB, mapped; freeing it raises the moving threshold above 4 MiB
del bump
if sys.argv[1] == "fixed":
    assert hostmem.return_freed_blocks()
before = mapped_mib()
blocks = [torch.ones(1 << 20) for _ in range(32)]
during = mapped_mib()
del blocks
print(during - before, mapped_mib() - before)
"""
    mapped = {}
    for mode in ("moving", "fixed"):
        proc = run_python(["-c", script, mode], fresh=True)
        assert proc.returncode == 0, proc.stderr
        mapped[mode] = [float(v) for v in proc.stdout.split()[-2:]]
    assert mapped["moving"][0] < 4, mapped  # from the heap
    assert mapped["fixed"][0] >= 128 and mapped["fixed"][1] < 1, mapped  # mapped, and unmapped when freed
    kept = run_python(["-c", "from ddptrain.parallel import hostmem; print(hostmem.return_freed_blocks())"],
                      env={"MALLOC_MMAP_THRESHOLD_": "65536"}, fresh=True)
    assert kept.stdout.split()[-1] == "False", kept.stderr  # the user's own threshold stands


# --- the vocabulary split (parallel/vocab.py) ------------------------------------------------------------

def test_the_embedding_and_head_split_by_vocabulary_rows_compute_what_the_whole_matrices_compute(tmp_path):
    """3 ranks, a 10-row vocabulary (4, 4, 2 rows), batches of different lengths, a padding id, tied and not:
    each rank's embedding output is the whole matrix's bitwise, its logits equal, and its rows' gradient the
    data-parallel average of every rank's batch (summed in another order: within 1e-6); the streamed save
    writes each rank's rows in turn, whole."""
    report_path = tmp_path / "vocab.json"
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                       str(REPO / "tests" / "worker_vocab.py"), str(report_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    for case, split in (("untied", 2), ("tied", 1)):
        ranks = report[case]
        assert [r["embed_rows"] for r in ranks] == [[0, 4], [4, 8], [8, 10]], case
        for rank, found in enumerate(ranks):
            assert found["split"] == split and found["tied"] == (case == "tied"), (case, rank)
            assert found["embedding_bitwise"] and found["logits"] < 1e-6, (case, rank, found)
            assert found["eval_logits"] == 0 and found["eval_embedding"] == 0, (case, rank, found)
            assert found["embed_grad"] < 1e-6 and found["head_grad"] < 1e-6, (case, rank, found)
            assert found["embed_grad_is_shard"] and found["head_grad_is_shard"], (case, rank)
            assert "a token id outside the embedding's 10 rows" in found["out_of_range"], found["out_of_range"]
        assert ranks[0]["saved_equal"], case


def test_the_record_of_a_transformers_build_on_meta_does_not_keep_the_model_alive():
    """models/meta.py keeps each build's record while the model lives: a record holding the model itself kept
    every fsdp run's transformers model, and with it the process groups, alive past the run's teardown."""
    import gc
    import weakref

    from ddptrain.models import meta

    model = meta.build(lambda: transformers.LlamaForCausalLM(llama_config()), transformers=True)
    assert model is not None and meta.stored_names(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None

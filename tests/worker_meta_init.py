"""Builds models as `--strategy fsdp` does (on the meta device, sharded, each rank filling its own shards) and
compares every tensor, gathered, with the model built whole on the CPU as `--strategy ddp` does (LoRA's
adapters and frozen base included).

Run under torchrun with 2 processes (gloo):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/worker_meta_init.py OUT.json DIR

DIR holds the models' directories (tests/models/test_big_models.py writes them). Rank 0 writes OUT.json: per case,
whether the fsdp build was on the meta device and the names of the tensors that differ; and, for the streamed
save, the files it wrote and whether from_pretrained loads them as the trained model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ddptrain.checkpoints import shards
from ddptrain.config import TrainConfig
from ddptrain.models import hf, instantiate
from ddptrain.parallel import materialize
from ddptrain.parallel.strategies import fsdp_blocks


def built(cfg: TrainConfig) -> torch.nn.Module:
    """The module a run of `cfg` builds (the Trainer's call): on the meta device where fsdp can fill it."""
    return instantiate(cfg.section("data"), cfg.section("finetune"), None, torch.device("cpu"), seed=cfg.seed,
                       sharded=cfg.strategy != "ddp", channels_last=cfg.channels_last)


def sharded(flags: dict, mesh) -> tuple[torch.nn.Module, bool]:
    cfg = TrainConfig(**flags, strategy="fsdp")
    module = built(cfg)
    on_meta = materialize.is_meta(module)
    for block in fsdp_blocks(module, ""):
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    if on_meta:
        source = hf.pretrained_dir(cfg.section("data")) if hf.is_hf(cfg.model) else None
        materialize.materialize(module, torch.device("cpu"), cfg.seed, source)
    return module, on_meta


def differences(module: torch.nn.Module, flags: dict) -> list[str]:
    whole = built(TrainConfig(**flags, strategy="ddp"))
    expected = whole.state_dict()
    differ = []
    for name, tensor in module.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if not torch.equal(full, expected[name]):
            differ.append(name)
    return differ


def main() -> None:
    out, models = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    lm = {"task": "language_model"}
    cases = {
        "mlp": {"model": "mlp", "image_size": 8, "width": 32},
        "mini_resnet": {"model": "mini_resnet", "width": 8, "norm": "group"},
        "gpt": {"model": "gpt", "vocab_size": 64, "seq_len": 16, "width": 32, "num_layers": 2, "num_heads": 2},
        "llama_config": {"model": f"hf:{models / 'llama_config'}", **lm},
        "gpt2_config": {"model": f"hf:{models / 'gpt2_config'}", **lm},
        "llama_index": {"model": f"hf:{models / 'llama_index'}", **lm},
        "gpt2_weights": {"model": f"hf:{models / 'gpt2_weights'}", **lm},
        "gpt2_classifier": {"model": f"hf:{models / 'gpt2_weights'}", "task": "classification", "num_classes": 3},
    }
    lora = {"lora_rank": 4, "lora_alpha": 8.0}  # the base built or read, then the adapters' seeded init
    for case in ("mlp", "llama_config", "llama_index"):
        cases[f"{case}_lora"] = {**cases[case], **lora}
    report = {}
    for case, flags in cases.items():
        module, on_meta = sharded(flags, mesh)
        report[case] = {"meta": on_meta, "differ": differences(module, flags)}

    # The streamed save in HF's sharded layout, files of at most 40 kB (several files for this Llama).
    module, _ = sharded(cases["llama_index"], mesh)
    shards.HF_SHARD_BYTES = 40_000
    saved = models / "saved"
    saved.mkdir(exist_ok=True)
    shards.write_streamed(module, saved / "model.safetensors", {"step": "0"}, dist.get_rank() == 0, saved / "hf")
    dist.barrier()
    if dist.get_rank() == 0:
        import transformers

        (saved / "hf" / "config.json").write_bytes((models / "llama_index" / "config.json").read_bytes())
        loaded = transformers.AutoModelForCausalLM.from_pretrained(saved / "hf")
        whole = built(TrainConfig(**cases["llama_index"], strategy="ddp"))
        report["save"] = {
            "files": sorted(p.name for p in (saved / "hf").iterdir()),
            "equal": all(torch.equal(t, whole.state_dict()[n]) for n, t in loaded.state_dict().items()),
        }
        out.write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

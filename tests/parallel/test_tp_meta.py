"""--strategy fsdp --tp N builds the model on the meta device (issue 58, item 4): the tensor-parallel plan is applied
to the empty model, FSDP2 shards it over mesh["dp"], and each rank fills only its part (its tp split's FSDP
chunk) of every tensor, from the seeded init or from its rows and columns of the safetensors files. No rank
holds the whole model, and the values are those of the whole build, bitwise.

Run as a worker too, under torchrun with 4 processes (gloo), by the first test:

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/parallel/test_tp_meta.py OUT.json DIR

It builds each case both ways (whole then split, as under --tp before; on the meta device then filled) on a
(dp 2, tp 2) mesh, and rank 0 writes per case whether the second was on the meta device and which parameters'
local parts differ on any rank; and, before transformers is imported, how much building and filling a wider GPT
raised each rank's peak resident memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, bos_token_id=63, eos_token_id=63)
GPT = {"model": "gpt", "vocab_size": 64, "seq_len": 16, "width": 32, "num_layers": 2, "num_heads": 2}
WIDE_GPT = {**GPT, "width": 512, "num_layers": 8, "num_heads": 8}  # 96 MiB of fp32 weights, 4 MiB its largest matrix


def _resident_mib() -> float:
    """This process's resident memory now."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    """The most this process has held (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _split(flags: dict, mesh) -> tuple[torch.nn.Module, bool]:
    """The module of `flags` as `ShardedParallel` makes it under --tp 2: built (on meta if `flags` say fsdp),
    split by its plan over mesh["tp"], each block then the root sharded over mesh["dp"], then filled."""
    from torch.distributed.fsdp import fully_shard

    from ddptrain.config import TrainConfig
    from ddptrain.models import hf, instantiate
    from ddptrain.parallel import materialize, tensor
    from ddptrain.parallel.strategies import fsdp_blocks

    cfg = TrainConfig(**flags)
    module = instantiate(cfg.section("data"), cfg.section("finetune"), None, torch.device("cpu"), seed=cfg.seed,
                         sharded=cfg.strategy != "ddp", channels_last=False)
    tensor.parallelize(module, mesh["tp"], tensor.plan_for(module, 2))
    for block in fsdp_blocks(module, ""):
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    on_meta = materialize.is_meta(module)
    if on_meta:
        source = hf.pretrained_dir(cfg.section("data")) if hf.is_hf(cfg.model) else None
        materialize.materialize(module, torch.device("cpu"), cfg.seed, source)
    return module, on_meta


def _growth(mesh) -> dict:
    """How much building and filling WIDE_GPT raised each rank's peak resident memory, and the model's size."""
    import torch.distributed as dist

    before = _resident_mib()
    filled, _ = _split({**WIDE_GPT, "strategy": "fsdp"}, mesh)
    grew = [0.0] * dist.get_world_size()
    dist.all_gather_object(grew, _peak_mib() - before)  # at most the growth: the peak so far may lie above `before`
    return {"model_mib": sum(p.numel() * 4 for p in filled.parameters()) / 2**20, "grew_mib": grew}


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ddptrain.parallel import hostmem

    out, models = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    lm = {"task": "language_model"}
    cases = {"gpt": GPT, "llama_config": {"model": f"hf:{models / 'llama_config'}", **lm},
             "llama_weights": {"model": f"hf:{models / 'llama'}", **lm}}
    hostmem.return_freed_blocks()  # as ShardedParallel on CPU: a freed tensor of a MiB or more is unmapped
    report = {}
    for case, flags in cases.items():
        if case == "llama_config":  # after the gpt's imports and first collectives, before transformers' import
            report["wide_gpt"] = _growth(mesh)
        whole, _ = _split({**flags, "strategy": "ddp"}, mesh)  # built whole on every rank, as before
        filled, on_meta = _split({**flags, "strategy": "fsdp"}, mesh)
        want = dict(whole.named_parameters())
        differ = [name for name, param in filled.named_parameters()
                  if not torch.equal(param.to_local(), want[name].to_local())]
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, {"meta": on_meta, "differ": differ})
        differ = sorted({name for each in found for name in each["differ"]})
        report[case] = {"meta": all(each["meta"] for each in found), "differ": differ}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _llama(root: Path) -> Path:
    """A tiny Llama (4 query heads, 2 key/value heads): its config alone in root/llama_config, with seeded
    weights in root/llama."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**LLAMA)
    config.save_pretrained(root / "llama_config")
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama")
    return root / "llama"


@pytest.mark.slow
def test_under_tp_each_rank_fills_its_part_with_what_the_whole_build_splits_to_bitwise(tmp_path):
    """GPT from the seed (its fused qkv in strides of q, k and v; rowwise columns), a Llama from the seed
    (transformers' post_init replayed) and from its weights (each rank reading its rows or columns): every rank's
    local part of every parameter equals, bitwise, that of the model built whole and then split."""
    from helpers import REPO, run_python

    _llama(tmp_path)
    report_path = tmp_path / "report.json"
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                       str(REPO / "tests" / "parallel" / "test_tp_meta.py"), str(report_path), str(tmp_path)],
                      timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    wide = report.pop("wide_gpt")
    # Each rank holds a quarter of the blocks and half of the rest, plus one whole tensor at a time while it fills;
    # built whole first (as before), every rank held all of it. Measured: 28 MiB of 96 per rank; whole: 101 MiB.
    assert max(wide["grew_mib"]) < wide["model_mib"] / 2, wide
    assert report == {case: {"meta": True, "differ": []} for case in ("gpt", "llama_config", "llama_weights")}


if __name__ == "__main__":
    main()

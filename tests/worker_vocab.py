"""Splits a tiny language model's embedding and head by vocabulary rows (parallel/vocab.py) and compares what
each rank computes with the whole matrices computing every rank's batch on one process.

Run under torchrun with 3 processes (gloo), so the 10-row vocabulary splits 4, 4, 2:

    python -m torch.distributed.run --standalone --nproc-per-node 3 tests/worker_vocab.py OUT.json

Rank r's batch has 2 x (3 + r) tokens (ranks of different lengths are padded), some of them the padding id.
Rank 0 writes OUT.json: per case, the largest difference of each rank's embedding output, logits, and weight
gradient rows from the whole model's (the gradient of the mean over ranks of each rank's loss, as data
parallelism averages), whether the split weight is one matrix (tied), and whether the streamed save of the
split model (rows of 4, 4, 2 and of 1, 1, 0) holds every tensor whole.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ddptrain.checkpoints import shards
from ddptrain.parallel import materialize, vocab

VOCAB, WIDTH, PAD = 10, 6, 2


class Tiny(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=PAD)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vectors = self.embed(ids)
        return vectors, self.head(torch.tanh(self.mix(vectors)))


def batch(rank: int) -> torch.Tensor:
    ids = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB, (2, 3 + rank), generator=ids)


def loss(logits: torch.Tensor, rank: int) -> torch.Tensor:
    target = torch.Generator().manual_seed(200 + rank)
    return (logits * torch.randn(logits.shape, generator=target)).sum()


def case(tied: bool, mesh, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    whole = Tiny(tied)
    torch.manual_seed(0)
    split = Tiny(tied)
    ids = batch(rank)
    # The whole model: every rank's batch, the mean of their losses (data parallelism's average).
    outputs = [whole(batch(r)) for r in range(world)]
    (sum(loss(logits, r) for r, (_, logits) in enumerate(outputs)) / world).backward()
    kept = vocab.shard(split, mesh, torch.device("cpu"), None)
    vectors, logits = split(ids)
    loss(logits, rank).backward()
    with torch.no_grad():
        eval_vectors, eval_logits = split(ids)
        try:  # every rank: the check comes before the first collective
            split(torch.full_like(ids, VOCAB))
            out_of_range = "no error"
        except RuntimeError as exc:
            out_of_range = str(exc)
    found = {"split": len(kept), "tied": split.embed.weight is split.head.weight,
             "embedding": (vectors - outputs[rank][0]).abs().max().item(),
             "embedding_bitwise": torch.equal(vectors, outputs[rank][0]),
             "logits": (logits - outputs[rank][1]).abs().max().item(),
             "eval_logits": (eval_logits - logits).abs().max().item(),
             "eval_embedding": (eval_vectors - vectors).abs().max().item(), "out_of_range": out_of_range}
    # The streamed save (checkpoints/shards.py) writes each rank's rows in turn, uneven ones and a rank with none.
    split.odd = nn.Parameter(distribute_tensor(torch.arange(6.0).view(2, 3), mesh, [Shard(0)]))
    saved = Path(sys.argv[1]).with_name(f"{'tied' if tied else 'untied'}.safetensors")
    shards.write_streamed(split, saved, {}, rank == 0)
    whole_split = {name: materialize.whole_on_cpu(t) for name, t in split.state_dict().items()}
    if rank == 0:
        found["saved_equal"] = sorted(whole_split) == sorted(load_file(saved)) and all(
            torch.equal(t, whole_split[n]) for n, t in load_file(saved).items())
    for name in ("embed", "head"):
        param = getattr(split, name).weight
        rows = materialize.shard_rows(param)
        expected = getattr(whole, name).weight.grad[rows]
        found[f"{name}_grad"] = (param.grad.to_local() - expected).abs().max().item()
        found[f"{name}_grad_is_shard"] = param.grad.placements == param.placements
        found[f"{name}_rows"] = [rows.start, rows.stop]
    return found


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    report = {}
    for tied in (False, True):
        found = case(tied, mesh, rank, world)
        gathered = [None] * world
        dist.all_gather_object(gathered, found)
        report["tied" if tied else "untied"] = gathered
    if rank == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(report, fh)
    # As ddptrain's teardown (parallel/distributed.py): nothing may hold a group into interpreter finalization,
    # and torch's DTensor caches keep the mesh (ShardedParallel.release).
    gc.collect()
    mesh._pg_registry.clear()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

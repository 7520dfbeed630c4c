"""Tensor parallel's maths, in this process: N ranks simulated by torch's LocalTensorMode on a fake process group
(each op runs once per rank on that rank's values; collectives combine them), so a split layer is checked against
the whole layer without starting a process.

What this covers: colwise then rowwise layers (an MLP) against the whole module, with their gradients, and the
gradient norm taken over two meshes. The rest is checked by real processes (test_tensor_parallel.py), because
LocalTensorMode on torch 2.13 simulates it wrongly where gloo computes it right (probed): attention over views of
a chunked tensor (rank 1's values), distributing a plain tensor in strides (the fused qkv: every rank got rank 0's
slice), and the list form of `all_gather` that `tensor.whole` uses.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

local_tensor = pytest.importorskip("torch.distributed._local_tensor")


@contextlib.contextmanager
def ranks(world: int):
    """`world` ranks in this process: a fake process group under LocalTensorMode."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with local_tensor.LocalTensorMode(world):
            yield
    finally:
        dist.destroy_process_group()


def per_rank(value) -> list[torch.Tensor]:
    """Each rank's value of a LocalTensor (or of a DTensor's local part); a plain tensor is every rank's."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, local_tensor.LocalTensor):
        return [value._local_tensors[r] for r in sorted(value._local_tensors)]
    return [value]


def test_a_colwise_then_rowwise_mlp_on_a_2x2_mesh_computes_and_learns_what_the_whole_one_does():
    """dp 2 x tp 2: the MLP split over tp, a norm left whole. The output, the input's gradient, every parameter's
    gradient (gathered) and the gradient norm over both meshes equal the whole module's, on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ddptrain.parallel import tensor

    torch.manual_seed(0)
    whole = nn.Sequential(nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)))
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = whole(x)
    out.square().sum().backward()
    expected_norm = torch.nn.utils.get_total_norm([p.grad for p in whole.parameters()])
    with ranks(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        split = copy.deepcopy(whole)
        split.zero_grad()
        tensor.parallelize(split, mesh["tp"], {"1.0": tensor.STYLES["colwise"](), "1.2": tensor.STYLES["rowwise"]()})
        x2 = x.detach().clone().requires_grad_()
        got = split(x2)
        got.square().sum().backward()
        for value in per_rank(got):
            torch.testing.assert_close(value, out.detach(), rtol=0, atol=1e-5)
        for value in per_rank(x2.grad):
            torch.testing.assert_close(value, x.grad, rtol=0, atol=1e-5)
        params = dict(split.named_parameters())
        assert sum(isinstance(p, DTensor) for p in params.values()) == 4  # the MLP's weights and biases
        for name, p in whole.named_parameters():
            grad = params[name].grad
            for value in per_rank(grad.full_tensor() if isinstance(grad, DTensor) else grad):
                torch.testing.assert_close(value, p.grad, rtol=0, atol=1e-5, msg=name)
        groups = tensor.by_mesh(list(split.parameters()))
        assert len(groups) == 2  # the norm's plain tensors, the MLP's on the tp mesh
        for value in per_rank(tensor.grad_norm(groups)):
            torch.testing.assert_close(value, expected_norm, rtol=1e-6, atol=0)

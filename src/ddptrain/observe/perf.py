"""Throughput, FLOPs, MFU and memory: measured cheaply enough to stay on by default."""

from __future__ import annotations

import contextlib
import logging
import resource
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map
from torch.utils.data import IterableDataset
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from ddptrain.data.batch import to_device
from ddptrain.models import eval_mode

log = logging.getLogger("ddptrain")

# Dense bf16/fp16 tensor-core peaks in TFLOP/s per device (vendor datasheets, SXM parts where both exist).
PEAK_TFLOPS = {
    "B200": 2250.0, "H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "L40S": 362.0,
    "A100": 312.0, "A800": 312.0, "A10": 125.0, "L4": 121.0, "V100": 125.0, "T4": 65.0,
}


def known_peak_tflops(device: torch.device) -> float:
    """Peak TFLOP/s of the detected GPU from the table, or 0.0 when unknown (then no MFU is reported)."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100" must not match inside "GH200"
        if key in name.split() or f" {key}" in f" {name}":
            return PEAK_TFLOPS[key]
    return 0.0


def _attention_on_cpu() -> dict[Any, Any]:
    """torch's FlopCounterMode counts the fused attention kernels of CUDA (flash, efficient, cuDNN) but not CPU's
    (`_scaled_dot_product_flash_attention_for_cpu`), which it skips as free: a model built whole on the CPU was
    counted without its attention, one built on the meta device (fsdp: the math path's matmuls) with it, 7-9 %
    apart for a small Llama or gpt. The same formula as the CUDA kernels' (attention's two matmuls)."""
    cpu_kernel = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    count = getattr(flop_counter, "sdpa_flop_count", None)
    if cpu_kernel is None or count is None or cpu_kernel in getattr(flop_counter, "flop_registry", {}):
        return {}
    return {cpu_kernel: lambda query, key, value, *args, out_shape=None, **kwargs: count(query, key, value)}


def train_flops(model: nn.Module, forward: Callable[[], Any]) -> float:
    """FLOPs of `forward()` (a forward pass of `model`, say over one sample), counted by torch's
    FlopCounterMode, times 3 for forward + backward.

    The backward pass costs about twice the forward (grads w.r.t. inputs and weights), the usual
    convention of MFU accounting. Runs in eval mode under no_grad; state is unchanged.
    """
    counting = FlopCounterMode(display=False, custom_mapping=_attention_on_cpu())
    with eval_mode(model), torch.no_grad(), counting as counter:
        forward()
    return 3.0 * counter.get_total_flops()


def train_flops_per_sample(model: nn.Module, sample: torch.Tensor) -> float:
    """`train_flops` of the model on the first sample of a batch tensor."""
    return train_flops(model, lambda: model(sample[:1]))


def mfu(samples_per_sec_per_device: float, flops_per_sample: float, peak_tflops: float) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak; None without a peak."""
    if peak_tflops <= 0 or flops_per_sample <= 0:
        return None
    return samples_per_sec_per_device * flops_per_sample / (peak_tflops * 1e12)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA allocator peak on GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@contextlib.contextmanager
def values_unknown(device: torch.device) -> Iterator[Callable[[Any], Any]]:
    """For a model on the meta device, torch's FakeTensorMode, and what makes a batch's tensors fake: a forward
    over meta tensors fails where the model tests a value (transformers' mask checks call `.item()`), and
    transformers skips those tests on fake tensors, as when tracing. Elsewhere, nothing."""
    if device.type != "meta":
        yield lambda value: value
        return
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        yield lambda value: fake.from_tensor(value) if isinstance(value, torch.Tensor) else value


def task_flops_per_sample(module: nn.Module, task: Any, dataset: Any, device: torch.device,
                          collate: Callable[[list[tuple[int, Any]]], tuple[list[int], Any]]) -> float:
    """`train_flops` of the task's forward on the dataset's first sample, made a batch by the training loader's
    own `collate` (a user's collate_fn included); 0.0 (no MFU) if that fails.

    A stream (IterableDataset) is not counted: reading its first element would start it outside the reader
    that shards it, so such a run reports no MFU, and says why at debug level only (it is no fault of the run).
    """
    if isinstance(dataset, IterableDataset):
        log.info("model: %.3g parameters", sum(p.numel() for p in module.parameters()))
        log.debug("no FLOP count for a stream (IterableDataset): no MFU will be reported")
        return 0.0
    try:
        _, batch = collate([(0, dataset[0])])
        batch = to_device(batch, device)
        with values_unknown(device) as as_fake:
            batch = tree_map(as_fake, batch)
            flops = train_flops(module, lambda: task.loss(module, batch))
        log.info("model: %.3g parameters, %.3g training FLOPs per sample",
                 sum(p.numel() for p in module.parameters()), flops)
        return flops
    except Exception as exc:  # an exotic plug-in model: MFU is a nicety
        log.warning("FLOP count unavailable (%s: %s); no MFU will be reported", type(exc).__name__, exc)
        return 0.0

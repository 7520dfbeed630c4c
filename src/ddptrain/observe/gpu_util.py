"""GPU utilisation over a log window, from NVML's own sample buffer (`pip install 'ddptrain[gpu]'`).

NVML samples each GPU's utilisation (the share of time a kernel was running) several times a second and keeps
the samples; reading the ones newer than the last read, once per log step, covers the whole window without a
thread of our own and costs one driver call per log step. CUDA only: on CPU nothing is read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

log = logging.getLogger("ddptrain")

LOW_UTILISATION_PCT = 80.0  # a window's mean below this gets a warning naming the dominant phase

# The step-time breakdown of a train line, as the warning names each phase, and what usually helps.
PHASES = {
    "data_wait": ("waiting for data", "raise --num_workers or move the data to faster storage"),
    "fwd_bwd": ("forward/backward", "small kernels leave the GPU idle between launches: a larger --batch_size, "
                                    "--use_amp or --compile"),
    "optimizer": ("the optimizer step", "many small parameters: fewer, larger tensors, or a fused optimizer"),
    "other": ("host work outside the timed phases", "look for host syncs, logging or checkpoints in the loop "
                                                    "(--enable_profiling shows them)"),
}


def utilisation_warning(samples: Sequence[float], breakdown: Mapping[str, float],
                        threshold_pct: float = LOW_UTILISATION_PCT) -> str | None:
    """The warning for one log window, or None when its mean utilisation is >= threshold_pct or unknown.

    `samples`: utilisation readings of the window in percent. `breakdown`: seconds per step of each phase in
    PHASES (`other` = step time minus the rest); the warning names the largest.
    """
    if not samples:
        return None
    mean = sum(samples) / len(samples)
    if mean >= threshold_pct:
        return None
    phase = max(PHASES, key=lambda name: breakdown.get(name, 0.0))
    step_s = sum(max(breakdown.get(name, 0.0), 0.0) for name in PHASES)
    share = 100 * breakdown.get(phase, 0.0) / step_s if step_s > 0 else 0.0
    what, fix = PHASES[phase]
    return (f"GPU utilisation {mean:.0f}% over this log window (below {threshold_pct:.0f}%): most of the step "
            f"is {what} ({share:.0f}% of step time); {fix}")


def step_breakdown(step_s: float, data_wait_s: float, fwd_bwd_s: float, optimizer_s: float) -> dict[str, float]:
    """Seconds per step by phase; `other` is what the timed phases leave of the step time."""
    return {"data_wait": data_wait_s, "fwd_bwd": fwd_bwd_s, "optimizer": optimizer_s,
            "other": max(step_s - data_wait_s - fwd_bwd_s - optimizer_s, 0.0)}


class GpuUtilisation:
    """NVML's utilisation samples of this process's CUDA device; `enabled` is False on CPU or without pynvml."""

    def __init__(self, device: torch.device):
        self._pynvml = None
        if device.type != "cuda":
            return
        try:
            import pynvml
        except ImportError:
            log.debug("no GPU utilisation in the train metrics: pip install 'ddptrain[gpu]' (nvidia-ml-py)")
            return
        try:
            pynvml.nvmlInit()  # a container can have CUDA but not the driver's NVML library
            # By UUID: NVML numbers all GPUs, CUDA only the visible ones (CUDA_VISIBLE_DEVICES).
            uuid = torch.cuda.get_device_properties(device).uuid
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError as exc:
            log.warning("no GPU utilisation in the train metrics: NVML failed (%s)", exc)
            return
        self._pynvml = pynvml
        self._last_us = 0
        self._use_buffer = True
        self.read()  # the samples from before the run are not the first window's

    @property
    def enabled(self) -> bool:
        return self._pynvml is not None

    def read(self) -> list[float]:
        """Utilisation (percent) of each sample NVML took since the previous read; [] when disabled.

        Never raises: it runs on each rank just before a collective, so an NVML failure on one rank (a lost
        GPU, a driver reset) turns the sampling off there, with a warning, instead of failing that rank alone.
        """
        if self._pynvml is None:
            return []
        try:
            return self._read()
        except self._pynvml.NVMLError as exc:
            log.warning("GPU utilisation: NVML failed (%s); no more samples from this rank", exc)
            self._pynvml = None
            return []

    def _read(self) -> list[float]:
        nvml = self._pynvml
        if self._use_buffer:
            try:
                kind, samples = nvml.nvmlDeviceGetSamples(self._handle, nvml.NVML_GPU_UTILIZATION_SAMPLES,
                                                          self._last_us)
            except nvml.NVMLError_NotFound:  # no sample since the last read
                return []
            except nvml.NVMLError_NotSupported:
                self._use_buffer = False  # this GPU keeps no buffer: its current reading, once per window
            else:
                fields = {nvml.NVML_VALUE_TYPE_DOUBLE: "dVal", nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
                          nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
                          nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal"}
                fresh = [s for s in samples if s.timeStamp > self._last_us]
                if fresh:
                    self._last_us = max(s.timeStamp for s in fresh)
                return [float(getattr(s.sampleValue, fields[kind])) for s in fresh]
        return [float(nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)]

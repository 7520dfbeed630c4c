"""Host memory of a sharded run on CPU: large freed blocks go back to the system at once.

glibc's malloc serves a request of at least its mmap threshold with a mapping of its own, unmapped at free. The
threshold starts at 128 KiB and, each time such a block is freed, rises to that block's size (up to 32 MiB): from
then on tensors of a few MiB come from the heap, and a freed one stays resident until the heap's top is freed
too. Under fsdp that is most of them: every block's gathered parameters, gradients and communication buffers are
allocated and freed once per unit per step, so the heap grows to hold what the units needed at different times.
Measured (docs/performance.md, "Big models"): issue 36's Llama at 4 ranks peaked at 1.74-1.88x the model's
fp32 bytes per rank with the moving threshold and at 1.20-1.21x with a fixed 1 MiB one, every gathered tensor
then being returned as it is freed. The price is a fresh mapping (and its page faults) per large allocation,
within the noise of a CPU step (docs/performance.md, "Costs the code is shaped by").

A threshold the user set (MALLOC_MMAP_THRESHOLD_) is theirs and kept. Not glibc (macOS, musl): nothing to do.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
THRESHOLD_BYTES = 1 << 20
USER_SETTING = "MALLOC_MMAP_THRESHOLD_"


def return_freed_blocks(threshold: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process; whether it was set."""
    if USER_SETTING in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))

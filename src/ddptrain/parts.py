"""`Parts`: what a user's own code supplies to a run in place of what the config names. Light: no torch."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Parts:
    """What a user's own code supplies in place of what the config names (`ddptrain.fit`'s arguments).

    Every part is built or called in each training process: under `nproc > 0` they must pickle (the
    `mp.spawn` rule). `optimizer` is fn(params) -> torch.optim.Optimizer, called with the model's trainable
    parameters once it is wrapped (under fsdp: its sharded parameters); `scheduler` is fn(optimizer) ->
    an LR scheduler, stepped once per optimizer step; both keep their state in checkpoints. `collate_fn`
    turns a list of items into a batch (default: ddptrain's, which pads token sequences). `callbacks` are
    called at the loop's events, before those --callbacks names (see ddptrain.loop.callbacks).
    """

    model: Any = None
    datasets: tuple[Any, Any] | None = None
    task: Any = None
    collate_fn: Any = None
    optimizer: Any = None
    scheduler: Any = None
    callbacks: Any = None

"""A dataset that holds a job at a chosen point until the test lets it go: a job that runs exactly as long as
the test needs a running job, without timing games.

GATE_ENV is "GATE,TRIGGER,RESTART": in incarnation RESTART (TORCHELASTIC_RESTART_COUNT, 0 without an
elastic launcher), once the file TRIGGER exists (always, if empty), reading a training sample waits while the
file GATE exists; the process touches GATE.waiting-<pid> when it first waits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ddptrain.data.pipeline import SyntheticImages

GATE_ENV = "LOCK_TEST_GATE"


class GatedImages(SyntheticImages):
    def __init__(self, *args, gate: Path, trigger: Path | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.trigger, self.waited = gate, trigger, False

    def __getitem__(self, index: int):
        while self.gate.exists() and (self.trigger is None or self.trigger.exists()):
            if not self.waited:
                self.waited = True
                Path(f"{self.gate}.waiting-{os.getpid()}").touch()
            time.sleep(0.05)
        return super().__getitem__(index)


def gated_synthetic(cfg):
    gate, trigger, restart = os.environ[GATE_ENV].split(",")
    shape = dict(num_classes=cfg.num_classes, channels=cfg.in_channels, image_size=cfg.image_size, seed=cfg.seed)
    eval_set = SyntheticImages(cfg.eval_size, offset=cfg.dataset_size, **shape)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != restart:
        return SyntheticImages(cfg.dataset_size, **shape), eval_set
    return GatedImages(cfg.dataset_size, gate=Path(gate), trigger=Path(trigger) if trigger else None,
                       **shape), eval_set

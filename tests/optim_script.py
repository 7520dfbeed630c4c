"""`ddptrain.fit` with the user's own optimizer and LR scheduler (tests/test_optim.py), as a script:

    python tests/optim_script.py RUN_DIR [--fail-at STEP]

RMSprop (no ddptrain default has it) and StepLR halving the lr every 2 steps; 6 steps, a checkpoint every 2.
"""

from __future__ import annotations

import functools
import sys

import torch

import ddptrain
from ddptrain.data.pipeline import SyntheticImages


def main(run_dir: str, fail_at: int | None) -> None:
    data = SyntheticImages(192, num_classes=4, channels=1, image_size=8, seed=3)
    config = ddptrain.TrainConfig(model="mlp", num_classes=4, in_channels=1, image_size=8, width=16, batch_size=16,
                                  max_steps=6, save_every=0, save_every_steps=2, keep_last=0, log_interval=1,
                                  num_workers=0, progress=False, run_dir=run_dir, resume_from="",
                                  inject_fault=f"rank=0,step={fail_at},kind=raise" if fail_at else "")
    ddptrain.fit(train_data=data, config=config,
                 optimizer=functools.partial(torch.optim.RMSprop, lr=0.02, alpha=0.9),
                 scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[3]) if sys.argv[2:3] == ["--fail-at"] else None)

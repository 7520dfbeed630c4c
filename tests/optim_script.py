"""`ddptrain.fit` with the user's own optimizer and LR scheduler (tests/loop/test_optim.py), as a script:

    python tests/optim_script.py RUN_DIR [--fail-at STEP] [--counting]

RMSprop (no ddptrain default has it) and StepLR halving the lr every 2 steps; 6 steps, a checkpoint every 2.
`--counting`: CountingSGD instead, whose state per parameter is a Python int.
"""

from __future__ import annotations

import functools
import sys

import torch

import ddptrain
from ddptrain.data.pipeline import SyntheticImages


class CountingSGD(torch.optim.SGD):
    """Plain SGD whose steps ramp up over the first 4 updates of each parameter, counted in its state as a Python
    int (as many hand-written optimizers keep `step`): a count lost on resume changes the weights."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                updates = state.get("updates", 0)
                p.add_(p.grad, alpha=-group["lr"] * min(1.0, (updates + 1) / 4))
                state["updates"] = updates + 1


def main(run_dir: str, fail_at: int | None, counting: bool) -> None:
    data = SyntheticImages(192, num_classes=4, channels=1, image_size=8, seed=3)
    config = ddptrain.TrainConfig(model="mlp", num_classes=4, in_channels=1, image_size=8, width=16, batch_size=16,
                                  max_steps=6, save_every=0, save_every_steps=2, keep_last=0, log_interval=1,
                                  num_workers=0, progress=False, run_dir=run_dir, resume_from="",
                                  inject_fault=f"rank=0,step={fail_at},kind=raise" if fail_at else "")
    optimizer = (functools.partial(CountingSGD, lr=0.05) if counting
                 else functools.partial(torch.optim.RMSprop, lr=0.02, alpha=0.9))
    ddptrain.fit(train_data=data, config=config, optimizer=optimizer,
                 scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5))


if __name__ == "__main__":
    args = sys.argv[2:]
    main(sys.argv[1], int(args[args.index("--fail-at") + 1]) if "--fail-at" in args else None, "--counting" in args)

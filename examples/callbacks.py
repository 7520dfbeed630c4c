"""A callback with state (docs/callbacks.md): the float64 sum of the weights at every step boundary, saved in
checkpoints, and a stop once it passes a bound.

    ddptrain train --config configs/quickstart.toml --callbacks examples.callbacks:WeightWatcher
"""

from __future__ import annotations

import torch

import ddptrain


class WeightWatcher(ddptrain.Callback):
    """Sums the weights at each step boundary (each rank its own replica: the same numbers under ddp) and asks
    to stop once the running sum passes `bound`; the sum survives restarts through state_dict."""

    def __init__(self, bound: float = 1e9):
        self.bound, self.total = bound, torch.zeros((), dtype=torch.float64)

    def on_step_end(self, run):
        self.total += sum(p.detach().double().sum() for p in run.model.parameters())
        if self.total.abs() > self.bound:
            run.request_stop(f"the weights' running sum passed {self.bound:g}")

    def on_train_end(self, run, summary):
        if run.is_main:
            print(f"weight watcher: running sum {self.total.item():.6g} after {summary['step']} steps")

    def state_dict(self):
        return {"total": self.total}

    def load_state_dict(self, state):
        self.total = state["total"]

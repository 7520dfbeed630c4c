"""Train from your own script with ddptrain's Python API: your model, your data, your loss.

    python examples/python_api.py                                # 2 local processes (nproc=2 below)
    torchrun --standalone --nproc-per-node 2 examples/python_api.py   # the same job under torchrun

A regression problem: predict a noisy linear function of 8 inputs. The task object says what a step
computes; its metrics are (sum, count) pairs, so the distributed eval is exact.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddptrain


def make_data(num_samples: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 8, generator=gen)
    w = torch.linspace(-1, 1, 8)
    return TensorDataset(x, x @ w + 0.05 * torch.randn(num_samples, generator=gen))


class SmoothL1:
    """A task of your own: smooth-L1 loss, with the mean absolute error as an eval metric."""

    def loss(self, model, batch):
        inputs, targets = batch
        predictions = model(inputs).squeeze(1)
        count = torch.full((), float(len(targets)), dtype=torch.float64, device=targets.device)
        loss = F.smooth_l1_loss(predictions, targets)
        return loss, {"loss": (loss.detach().double() * count, count),
                      "mae": ((predictions - targets).abs().sum().detach(), count)}


def make_model(cfg: ddptrain.TrainConfig) -> nn.Module:
    """Built by ddptrain after seeding with cfg.seed: the same start on every rank and every launch."""
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def main() -> None:
    config = ddptrain.TrainConfig(epochs=5, batch_size=32, lr=0.05, num_workers=0, nproc=2, log_interval=20,
                                  run_dir="runs/python_api", auto_resume=False, progress=False)
    summary = ddptrain.fit(model=make_model, train_data=make_data(2048, seed=0), eval_data=make_data(512, seed=1),
                           task=SmoothL1(), config=config)
    if summary is not None:  # None on the other ranks under torchrun
        print(f"python_api: eval mae {summary['eval']['mae']:.4f} after {summary['step']} steps")


if __name__ == "__main__":
    main()

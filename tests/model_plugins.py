"""Model plug-ins with shapes the built-ins lack (importable: tests/ is on PYTHONPATH in helpers.cli_env)."""

from __future__ import annotations

from torch import nn


class TiedMLP(nn.Module):
    """Two hidden layers sharing one weight matrix, as tied input and output embeddings of a language model
    share theirs: its state_dict names one tensor twice."""

    def __init__(self, in_features: int, hidden: int, num_classes: int):
        super().__init__()
        self.embed = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden))
        self.first = nn.Linear(hidden, hidden)
        self.second = nn.Linear(hidden, hidden, bias=False)
        self.second.weight = self.first.weight
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = self.embed(x).relu()
        return self.head(self.second(self.first(x).relu()).relu())


def tied_mlp(cfg):
    return TiedMLP(cfg.in_channels * cfg.image_size ** 2, cfg.width, cfg.num_classes)


def one_matrix(cfg):
    """A model of one tensor: with --momentum 0 a checkpoint of 2 ddp ranks has nothing for the second to write."""
    return nn.Sequential(nn.Flatten(), nn.Linear(cfg.in_channels * cfg.image_size ** 2, cfg.num_classes, bias=False))


def first_linear(model: nn.Module) -> list[nn.Module]:
    """--fsdp_blocks model_plugins:first_linear: the built-in MLP's first layer as its one FSDP unit."""
    return [model.net[1]]

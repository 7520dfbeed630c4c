"""ddptrain: take a one-GPU training job to many processes and machines on PyTorch's DDP engine."""

__version__ = "0.1.0"

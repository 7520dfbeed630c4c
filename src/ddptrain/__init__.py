"""ddptrain: take a one-GPU training job to many processes and machines on PyTorch's DDP engine."""

__version__ = "0.1.0"

from ddptrain.api import fit  # noqa: E402  (light: torch is imported when training starts)
from ddptrain.config import TrainConfig  # noqa: E402

__all__ = ["TrainConfig", "fit", "__version__"]

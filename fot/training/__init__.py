"""fot.training: Hydra configs, the training loop, optimizer/schedule, parallelism,
checkpoints and metrics. Entry point: ``train.py`` (or :func:`train` with a composed config)."""

from fot.training.config import TrainConfig, register_configs
from fot.training.signals import TrainingStopped
from fot.training.trainer import TrainingDivergedError, TrainingOutOfMemoryError, train

__all__ = [
    "TrainConfig",
    "TrainingDivergedError",
    "TrainingOutOfMemoryError",
    "TrainingStopped",
    "register_configs",
    "train",
]

"""deepmetric.train: the training loop, schedules, optimisers, DDP and the experiment trackers.

Quick use::

    from deepmetric.run.config_io import load_config
    from deepmetric.train import train
    result = train(load_config("recipes/demo_glyphs.yaml", ["train.epochs=2", "train.out_dir=runs/glyphs_short"]))
    print(result.metrics)

The config, the run directory, checkpoints and loading a trained model back are the run's
(:mod:`deepmetric.run`).  See docs/training.md.
"""
from .loop import NonFiniteLossError, TrainResult, train
from .module import TrainingModule
from .schedules import LrSchedule, TemperatureSchedule

__all__ = ["train", "TrainResult", "TrainingModule", "NonFiniteLossError", "LrSchedule", "TemperatureSchedule"]

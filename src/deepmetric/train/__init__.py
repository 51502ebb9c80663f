"""deepmetric.train: typed configs, the training loop, schedules, checkpoints and DDP.

Quick use::

    from deepmetric.train import load_config, train
    result = train(load_config("recipes/demo_glyphs.yaml", ["train.epochs=2", "train.out_dir=runs/glyphs_short"]))
    print(result.metrics)

See docs/training.md.
"""
from .checkpoint import load_checkpoint, save_checkpoint
from .config import (Config, ConfigError, DataConfig, EvalConfig, LossTermConfig, ModelConfig,
                     OptimConfig, ScheduleConfig, TrainConfig, config_from_dict, config_to_dict,
                     load_config, save_config)
from .embed import compute_embeddings, embed_checkpoint, evaluate_model, load_model_from_checkpoint
from .loop import NonFiniteLossError, TrainingModule, TrainResult, train
from .schedules import LrSchedule, TemperatureSchedule

__all__ = [
    "Config", "ConfigError", "DataConfig", "EvalConfig", "LossTermConfig", "ModelConfig",
    "OptimConfig", "ScheduleConfig", "TrainConfig", "config_from_dict", "config_to_dict",
    "load_config", "save_config", "train", "TrainResult", "TrainingModule", "NonFiniteLossError",
    "LrSchedule", "TemperatureSchedule", "save_checkpoint", "load_checkpoint",
    "compute_embeddings", "evaluate_model", "embed_checkpoint", "load_model_from_checkpoint",
]

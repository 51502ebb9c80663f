"""The objects of one run in training, shared by its steps (set-up, epochs, evaluations, the
end): the data, model, loss terms, optimiser and schedules, the counters (``TrainState``) and
the run directory's log."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepmetric.run import rundir as R
from deepmetric.run.checkpoint import save_checkpoint
from deepmetric.run.config import Config
from deepmetric.run.rundir import RunLog

from .module import TrainingModule
from .schedules import TemperatureSchedule, get_alpha, has_alpha
from .state import Trainables, TrainState, checkpoint_dict

__all__ = ["TrainingRun", "current_alphas"]


def current_alphas(temperature: TemperatureSchedule, losses: nn.ModuleList) -> list[float]:
    """The temperatures now in force (for the logs): scheduled ones, else the losses' own."""
    return temperature.alphas() or [get_alpha(l) for l in losses if has_alpha(l)]


@dataclass
class TrainingRun:
    """What the steps of :func:`~deepmetric.train.loop.train` share, built once by
    :func:`~deepmetric.train.setup.set_up`."""

    cfg: Config
    dist_info: Any
    out_dir: Path
    train_ds: Any
    sampler: Any
    batches_per_epoch: int
    total_epochs: int
    total_iters: int
    eval_sets: dict
    select_key: str | None          # the validation metric that selects best.pt (None: no validation)
    model: nn.Module
    losses: nn.ModuleList
    module: TrainingModule
    step_module: nn.Module          # the module or its DDP wrapper
    objs: Trainables
    model_args: dict
    config_dict: dict
    warnings: list[str]
    state: TrainState = field(default_factory=TrainState)
    log: RunLog = field(default_factory=lambda: RunLog(None))
    evaluate: Any = None            # an Evaluator
    last_ckpt: Path | None = None   # the last good checkpoint (named in errors)
    baselines: dict = field(default_factory=dict)
    reevaluate: bool = False        # a finished run resumed without its final evaluation
    on_validation: Any = None       # callback(epoch, val_metrics) after each validation
    resume_ckpt: dict | None = None  # the --resume checkpoint, loaded (and checked) first
    pretrained_state: dict | None = None  # the model before the first step (CPU, rank 0; eval.wise_ft, a
                                          # teacher): checkpoints' start_model
    wise_ft: dict | None = None     # eval.wise_ft: metrics.json's "wise_ft" section
    t_start: float = 0.0
    wall_before: float = 0.0

    @property
    def device(self) -> torch.device:
        return self.dist_info.device

    @property
    def main(self) -> bool:
        return self.dist_info.is_main

    @property
    def has_val(self) -> bool:
        return self.select_key is not None

    @property
    def finished(self) -> bool:
        return self.state.iteration >= self.total_iters or self.state.stopped_early

    def alphas(self) -> list[float]:
        return current_alphas(self.objs.temperature, self.losses)

    def save(self, name: str) -> Path:
        """Write checkpoint ``name`` (``last.pt`` / ``best.pt``) of the run so far (rank 0)."""
        self.state.wall_time_s = self.wall_before + time.perf_counter() - self.t_start
        extra = {"start_model": self.pretrained_state} if self.pretrained_state is not None else None
        path = save_checkpoint(checkpoint_dict(self.state, self.objs, model_args=self.model_args,
                                               config=self.config_dict, extra=extra), self.out_dir / name)
        if name == R.LAST:
            self.log.checkpointed()  # trackers take the records a resume keeps
        return path


"""What a checkpoint holds to continue training: the run's counters (``TrainState``), the
objects whose state is saved beside them (``Trainables``), writing them into a checkpoint dict
(``checkpoint_dict``) and reading them back (``restore``), and Ctrl-C handling.

The file format, the atomic save and the RNG state are the run's
(:mod:`deepmetric.run.checkpoint`); this module is about a run in training.
"""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from deepmetric.run.checkpoint import get_rng_state, set_rng_state, state_dict_mismatch, to_safe
from deepmetric.run.config_io import config_diff

from .schedules import LrSchedule, TemperatureSchedule, get_alpha, has_alpha, set_alpha

__all__ = ["TrainState", "Trainables", "checkpoint_dict", "restore", "CheckpointMismatchError",
           "GracefulInterrupt"]


@dataclass
class TrainState:
    """The counters of a run: saved with ``asdict`` as top-level checkpoint keys."""

    epoch: int = 0                 # epochs completed
    batch_in_epoch: int = 0        # batches done in the current, unfinished epoch
    iteration: int = 0             # optimisation steps done
    epoch_loss_sum: float = 0.0    # running sum and count of this epoch's losses (the
    epoch_loss_n: int = 0          # train_loss monitor of auto_plateau)
    best: dict = field(default_factory=dict)     # {"metric", "value", "epoch", "test"}: the
                                                 # best validation value and that epoch's test metrics
    metrics: dict = field(default_factory=dict)  # the last test evaluation
    val_metrics: dict = field(default_factory=dict)  # the last validation evaluation
    stopped_early: bool = False    # early stopping ended the run
    wall_time_s: float = 0.0       # wall time of the run so far (all sessions)
    train_seconds: float = 0.0     # time spent in training epochs (evaluation excluded)
    train_images: int = 0          # images trained on (all ranks)


@dataclass
class Trainables:
    """The objects whose state a checkpoint holds beside ``TrainState``."""

    model: nn.Module
    losses: nn.ModuleList
    optimizer: torch.optim.Optimizer
    scaler: Any                    # torch.amp.GradScaler
    lr_schedule: LrSchedule
    temperature: TemperatureSchedule
    sampler: Any                   # a deepmetric batch sampler


def checkpoint_dict(state: TrainState, objs: Trainables, *, model_args: dict, config: dict,
                    extra: dict | None = None) -> dict:
    """Everything needed to continue the run exactly (see the module docstring); ``extra``:
    further entries (``start_model``)."""
    mid_epoch = state.batch_in_epoch > 0
    return {
        **(extra or {}),
        **asdict(state),
        "model": objs.model.state_dict(),
        "loss": [loss.state_dict() for loss in objs.losses],
        "alphas": [get_alpha(loss) if has_alpha(loss) else None for loss in objs.losses],
        "optimizer": objs.optimizer.state_dict(),
        "grad_scaler": objs.scaler.state_dict() if objs.scaler.is_enabled() else None,
        "schedules": {"lr": objs.lr_schedule.state_dict(),
                      "temperature": to_safe(objs.temperature.state_dict())},
        "sampler": to_safe(objs.sampler.state_dict(batches_done=state.batch_in_epoch)) if mid_epoch else None,
        "rng": [get_rng_state()],
        "model_args": dict(model_args),
        "config": config,
    }


class CheckpointMismatchError(ValueError):
    """The checkpoint was written for another model or config (one-paragraph message)."""


def _mismatch_message(path, what: str, detail: str, diff: list, limit: int = 8) -> str:
    changed = ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in diff[:limit])
    if len(diff) > limit:
        changed += f", ... ({len(diff)} keys in all)"
    keys = (f"Config keys that differ (checkpoint -> now): {changed}." if diff
            else "The configs are identical, so the code that builds the model has changed.")
    return (f"cannot resume from {path}: it was written for a different model or config. {keys} "
            f"The {what} do not fit: {detail}. Resume with the config the checkpoint was trained "
            f"with (it is stored in the checkpoint and in its run directory's config.yaml), or "
            f"start a new run.")


def restore(ckpt: dict, objs: Trainables, *, rank: int = 0, config: dict | None = None,
            path: str | os.PathLike = "the checkpoint") -> TrainState:
    """Load a ``checkpoint_dict`` (as returned by ``load_checkpoint``) into ``objs`` and the
    RNGs of this rank; returns the saved ``TrainState``.

    When the model or loss states do not fit, raises ``CheckpointMismatchError`` naming the
    config keys that differ from ``config`` (the current run's) in one paragraph."""
    if "optimizer" not in ckpt:  # wise.pt: weights for embed / index / export, no training state
        raise ValueError(f"cannot resume from {path}: it holds model weights only (e.g. wise.pt, the WiSE-FT "
                         f"mixture), not a training state; resume from last.pt")
    diff = config_diff(ckpt["config"], config) if config is not None else []
    detail = state_dict_mismatch(ckpt["model"], objs.model)
    if detail:
        raise CheckpointMismatchError(_mismatch_message(path, "model weights", detail, diff))
    if len(ckpt["loss"]) != len(objs.losses):
        raise CheckpointMismatchError(_mismatch_message(
            path, "loss terms", f"{len(ckpt['loss'])} in the checkpoint, {len(objs.losses)} now", diff))
    for i, (loss, loss_state) in enumerate(zip(objs.losses, ckpt["loss"])):
        detail = state_dict_mismatch(loss_state, loss)
        if detail:
            raise CheckpointMismatchError(_mismatch_message(path, f"states of loss term {i}", detail, diff))
    state = TrainState(**{f.name: ckpt[f.name] for f in fields(TrainState) if f.name in ckpt})
    objs.model.load_state_dict(ckpt["model"])
    for loss, loss_state in zip(objs.losses, ckpt["loss"]):
        loss.load_state_dict(loss_state)
    for loss, alpha in zip(objs.losses, ckpt.get("alphas", [])):
        if alpha is not None and has_alpha(loss):
            set_alpha(loss, alpha)
    try:
        objs.optimizer.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError) as exc:  # other parameter groups (optim.param_groups, new_layers)
        raise CheckpointMismatchError(_mismatch_message(path, "optimiser parameter groups",
                                                        str(exc)[:200], diff)) from None
    if ckpt.get("grad_scaler"):
        objs.scaler.load_state_dict(ckpt["grad_scaler"])
    objs.lr_schedule.load_state_dict(ckpt["schedules"]["lr"])
    objs.temperature.load_state_dict(ckpt["schedules"]["temperature"])
    if ckpt.get("sampler") is not None and state.batch_in_epoch > 0:
        objs.sampler.load_state_dict(ckpt["sampler"])
    rng = ckpt["rng"]
    if isinstance(rng, dict):
        set_rng_state(rng)
    elif rank < len(rng):
        set_rng_state(rng[rank])
    return state


class GracefulInterrupt:
    """Context manager: the first SIGINT only sets ``.requested`` (the loop finishes the
    current step, saves a checkpoint and stops); a second SIGINT interrupts at once."""

    def __init__(self, quiet: bool = False) -> None:
        self.requested = False
        self.quiet = quiet  # the caller says what happens next (deepmetric tune: rerun the command)
        self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if not self.quiet:
            print("\n[deepmetric] interrupt received: finishing this step, saving a checkpoint "
                  "(press Ctrl-C again to abort immediately)", flush=True)

    def __enter__(self) -> "GracefulInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


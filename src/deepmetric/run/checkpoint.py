"""Atomic, ``weights_only``-loadable checkpoints, RNG state capture and Ctrl-C handling.

A checkpoint is a plain dict of tensors and Python primitives (no pickled classes), so it
loads with ``torch.load(path, weights_only=True)``.  ``checkpoint_dict`` writes it and
``restore`` reads it back, key by key in the same order::

    {"format": "deepmetric-checkpoint", "version": 2,
     **asdict(TrainState):  "epoch", "batch_in_epoch", "iteration", "epoch_loss_sum",
                            "epoch_loss_n", "best", "metrics", "val_metrics",
                            "stopped_early", "wall_time_s", "train_seconds", "train_images",
     "model": state_dict, "loss": [state_dict per term], "alphas": [float|None per term],
     "optimizer": state_dict, "grad_scaler": state_dict|None,
     "schedules": {"lr": ..., "temperature": ...}, "sampler": state_dict|None,
     "rng": [{"python": [...], "numpy": {...}, "torch": ByteTensor, "cuda": [ByteTensor]}],
     "model_args": {"num_classes", "embedding_dim", "world_size"} (what rebuilds the model),
     "config": resolved config dict,
     "start_model": state_dict (only for runs that keep the model as it started: WiSE-FT, a
                    pretrained-features teacher)}

Self-contained: ``model`` holds every weight of the model, so loading a checkpoint (embed,
index, export, serve, report, resume) builds the model without ``model.options.pretrained``
and never reads that file (or the hub) again; a resumed run that needs the model as it started
takes it from ``start_model``.  Checkpoints written before (no ``start_model``) load the same
way; only resuming such a WiSE-FT / teacher run reads the pretrained file again.

Version 1 files (``"epoch_loss": [sum, n]`` and ``"meta"`` instead of ``"model_args"``) are
upgraded in memory by ``load_checkpoint``.

Writes go to a temporary file in the same directory, are fsync'ed and then ``os.replace``d
over the target, so a crash (even SIGKILL) during saving leaves the previous file intact.
The file gets the user's normal mode (0644 under the default umask 022), not the 0600 of
the temporary file.
"""
from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .schedules import LrSchedule, TemperatureSchedule, get_alpha, has_alpha, set_alpha

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "TrainState",
    "Trainables",
    "checkpoint_dict",
    "restore",
    "CheckpointMismatchError",
    "save_checkpoint",
    "load_checkpoint",
    "get_rng_state",
    "set_rng_state",
    "to_safe",
    "GracefulInterrupt",
]

CHECKPOINT_FORMAT = "deepmetric-checkpoint"
CHECKPOINT_VERSION = 2


def to_safe(obj: Any) -> Any:
    """Convert numpy arrays/scalars (not allowed by ``weights_only``) to tensors/primitives."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: to_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_safe(v) for v in obj)
    return obj


def save_checkpoint(state: dict, path: str | os.PathLike) -> Path:
    """Atomically write ``state`` to ``path`` (temp file + fsync + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = dict(state)
    state.setdefault("format", CHECKPOINT_FORMAT)
    state.setdefault("version", CHECKPOINT_VERSION)
    # the PID in the name lets the next start of the run remove what a killed save left
    # (rundir.remove_stale_temporaries) without touching a live writer's file
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; use the user's normal mode
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    # Make the rename itself durable.
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # not supported on every platform / file system
        pass
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load a deepmetric checkpoint with ``weights_only=True``.

    Raises FileNotFoundError for a missing file and ValueError naming the file when it is
    corrupt, truncated or not a deepmetric checkpoint.
    """
    path = Path(path)
    if path.is_dir():
        hint = (f"; did you mean {path / 'last.pt'}?" if (path / "last.pt").is_file()
                else " (it holds no last.pt)")
        raise IsADirectoryError(f"checkpoint {path} is a run directory, not a checkpoint file{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for damaged files
        raise ValueError(f"checkpoint {path} is corrupt or unreadable ({_load_failure(exc)})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {path} is not a deepmetric checkpoint (no 'format' marker)")
    version = int(state.get("version", 1))
    if version > CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint {path} has format version {version}; this deepmetric reads "
                         f"versions 1 to {CHECKPOINT_VERSION} (upgrade deepmetric)")
    for key in ("model", "config"):
        if key not in state:
            raise ValueError(f"checkpoint {path} is incomplete: missing '{key}'")
    if version == 1:
        state = _upgrade_v1(state)
    return state


def _load_failure(exc: Exception) -> str:
    """torch.load's reason in one line, without its advice to retry with weights_only=False
    (which would run any code a tampered file holds)."""
    from deepmetric.models.pretrained import weights_only_reason

    reason = weights_only_reason(exc)
    if reason.startswith("it holds Python objects"):
        reason += "; deepmetric checkpoints never do, and they are only loaded with weights_only=True"
    return reason


def _upgrade_v1(state: dict) -> dict:
    """Version 1 -> 2: ``epoch_loss: [sum, n]`` became two counters, ``meta`` ``model_args``."""
    state = dict(state)
    if "epoch_loss" in state:
        total, n = state.pop("epoch_loss")
        state["epoch_loss_sum"], state["epoch_loss_n"] = float(total), int(n)
    if "meta" in state:
        state["model_args"] = state.pop("meta")
    config = state["config"]
    if isinstance(config, dict) and (config.get("data") or {}).get("val_classes") is None:
        # version 1 chose best.pt on the test split; without a validation split nothing is chosen
        state["config"] = {**config, "eval": {**(config.get("eval") or {}), "best_metric": None}}
        state["best"] = {}
    state.setdefault("batch_in_epoch", 0)
    state["version"] = CHECKPOINT_VERSION
    return state


# --------------------------------------------------------------------------- training state
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


def _shape(v) -> list | None:
    return list(v.shape) if isinstance(v, torch.Tensor) else None


def state_dict_mismatch(saved: dict, module: nn.Module, limit: int = 3) -> str:
    """A short description of how ``saved`` does not fit ``module`` ('' when it fits)."""
    own = module.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [f"{k} {_shape(saved[k])} -> {_shape(own[k])}" for k in own
              if k in saved and _shape(saved[k]) != _shape(own[k])]
    parts = []
    for what, items in (("missing in the checkpoint", missing), ("not in the model", unexpected),
                        ("with another shape (checkpoint -> now)", shapes)):
        if items:
            more = f", ... ({len(items)} in all)" if len(items) > limit else ""
            parts.append(f"{len(items)} tensor(s) {what}: {', '.join(items[:limit])}{more}")
    return "; ".join(parts)


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
    from .config import config_diff

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


# --------------------------------------------------------------------------- RNG
def get_rng_state() -> dict:
    """All random states that training consumes, as tensors and primitives."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": {
            "kind": np_state[0],
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": [s for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["key"].numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]),
         float(n["cached_gaussian"]))
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([c.cpu() for c in cuda])


# --------------------------------------------------------------------------- Ctrl-C
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

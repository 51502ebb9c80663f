"""Atomic, ``weights_only``-loadable checkpoints and RNG state capture.

A checkpoint is a plain dict of tensors and Python primitives (no pickled classes), so it
loads with ``torch.load(path, weights_only=True)``.  :func:`deepmetric.train.state.checkpoint_dict`
writes it and :func:`deepmetric.train.state.restore` reads it back, key by key in the same order::

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

import contextlib
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from deepmetric.registry import suggest

from . import rundir

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "save_checkpoint",
    "load_checkpoint",
    "state_dict_mismatch",
    "get_rng_state",
    "set_rng_state",
    "rng_preserved",
    "to_safe",
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
        last = path / rundir.LAST
        hint = suggest(str(last)) if last.is_file() else f" (it holds no {rundir.LAST})"
        raise IsADirectoryError(f"checkpoint {path} is a run directory, not a checkpoint file{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for damaged files
        from deepmetric.evaluate.io import describe_file

        what = describe_file(path)  # a config or an image given as the checkpoint: say so
        if what is not None and what.startswith(("a PNG", "a JPEG", "a text")):
            raise ValueError(f"checkpoint {path} is {what.split(';')[0]}, not a checkpoint (last.pt / best.pt of "
                             "'deepmetric train')") from None
        if path.stat().st_size == 0:  # torch's reason would be a bare "EOFError: "
            raise ValueError(f"checkpoint {path} is empty (0 bytes): a save that never completed, or not the "
                             "checkpoint (last.pt / best.pt of 'deepmetric train')") from None
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
        if not isinstance(state[key], dict):  # an edited file: torch's own error would not name it
            raise ValueError(f"checkpoint {path}: '{key}' is of type {type(state[key]).__name__}, expected a "
                             f"mapping ({'parameter name -> tensor' if key == 'model' else 'the training config'}); "
                             "the file was edited or damaged")
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


# --------------------------------------------------------------------------- fitting a module
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


@contextlib.contextmanager
def rng_preserved():
    """Run a block without changing the Python / NumPy / torch random streams (checks and
    baselines must not change what training does)."""
    saved = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)

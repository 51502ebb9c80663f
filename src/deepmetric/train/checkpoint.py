"""Atomic, ``weights_only``-loadable checkpoints, RNG state capture and Ctrl-C handling.

A checkpoint is a plain dict of tensors and Python primitives (no pickled classes), so it
loads with ``torch.load(path, weights_only=True)``::

    {"format": "deepmetric-checkpoint", "version": 1,
     "model": state_dict, "loss": [state_dict per term], "alphas": [float|None per term],
     "optimizer": state_dict, "grad_scaler": state_dict|None,
     "schedules": {"lr": ..., "temperature": ...}, "sampler": state_dict|None,
     "rng": {"python": [...], "numpy": {...}, "torch": ByteTensor, "cuda": [ByteTensor]},
     "epoch": epochs completed, "batch_in_epoch": batches done in the current epoch,
     "iteration": optimisation steps done, "best": {...}, "config": resolved config dict}

Writes go to a temporary file in the same directory, are fsync'ed and then ``os.replace``d
over the target, so a crash (even SIGKILL) during saving leaves the previous file intact.
"""
from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CHECKPOINT_FORMAT",
    "save_checkpoint",
    "load_checkpoint",
    "get_rng_state",
    "set_rng_state",
    "to_safe",
    "GracefulInterrupt",
]

CHECKPOINT_FORMAT = "deepmetric-checkpoint"


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
    state.setdefault("version", 1)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
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


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load a deepmetric checkpoint with ``weights_only=True``.

    Raises FileNotFoundError for a missing file and ValueError naming the file when it is
    corrupt, truncated or not a deepmetric checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for damaged files
        raise ValueError(
            f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {path} is not a deepmetric checkpoint (no 'format' marker)")
    for key in ("model", "config"):
        if key not in state:
            raise ValueError(f"checkpoint {path} is incomplete: missing '{key}'")
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

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
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

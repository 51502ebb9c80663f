"""Where and in what precision a run's model runs: ``resolve_device`` (auto / cpu / cuda /
cuda:i, for the config's ``train.device`` and the commands' ``--device``) and mixed precision,
decided once: ``autocast_context(device, amp)`` for amp in none / bf16 / fp16.  A leaf module
(imports only torch) shared by the loop, embedding and the commands that load a model back."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["resolve_device", "check_amp", "autocast_context"]


def resolve_device(pref: str = "auto", local_rank: int = 0, *, name: str = "device") -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` (this process's GPU,
    ``local_rank``) or ``cuda:i``; ``name`` (a flag or config key) is named in the errors."""
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    if pref.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {pref!r} requested but CUDA is not available on this machine "
                             f"(torch.cuda.is_available() is False); use {name} cpu or auto")
        if pref == "cuda":
            return torch.device("cuda", local_rank)
    try:
        return torch.device(pref)
    except RuntimeError:
        raise ValueError(f"{name} {pref!r}: expected auto, cpu, cuda or cuda:INDEX") from None


def check_amp(device: torch.device, amp: str) -> None:
    """fp16 needs a gradient scaler, hence CUDA; bf16 and none work everywhere."""
    if amp == "fp16" and device.type != "cuda":
        raise ValueError("config key 'train.amp': fp16 needs a CUDA device (it needs a gradient "
                         "scaler); use amp=bf16 on CPU")


def autocast_context(device: torch.device, amp: str):
    """``torch.autocast`` for ``amp`` in none / bf16 / fp16 (fp16 only on CUDA)."""
    if amp == "none":
        return contextlib.nullcontext()
    check_amp(device, amp)
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)

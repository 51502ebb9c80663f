"""Mixed precision, decided once: ``autocast_context(device, amp)`` for amp in none / bf16 /
fp16.  A leaf module (imports only torch) shared by the builders, the loop and embedding."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["check_amp", "autocast_context"]


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

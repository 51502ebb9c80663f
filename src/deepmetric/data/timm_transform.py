"""The ``timm`` transform: a timm model's own preprocessing (its ``pretrained_cfg``), as timm's
``transforms_imagenet_eval`` / ``transforms_imagenet_train`` build it, on torchvision v2
(:func:`deepmetric.data.build_transform`; the trainer fills the options a recipe leaves out from
the model, ``deepmetric.run.builders.resolve_model_preprocessing``)."""
from __future__ import annotations

import math

import torch
from torchvision.transforms import v2

from .transforms import IMAGENET_MEAN, IMAGENET_STD, register_transform

__all__ = ["RGBImage"]

_INTERPOLATIONS = {"bicubic": v2.InterpolationMode.BICUBIC, "bilinear": v2.InterpolationMode.BILINEAR,
                   "nearest": v2.InterpolationMode.NEAREST}


def _size_pair(size, key: str) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    if isinstance(size, (list, tuple)) and len(size) in (2, 3) and all(isinstance(v, int) for v in size):
        return int(size[-2]), int(size[-1])  # timm's (C, H, W) or (H, W)
    raise ValueError(f"timm transform: {key} must be an int or [H, W] (or timm's [C, H, W]), got {size!r}")


@register_transform("timm")
def _timm(train, input_size=224, interpolation: str = "bicubic", crop_pct: float = 0.875, crop_mode: str = "center",
          mean=IMAGENET_MEAN, std=IMAGENET_STD, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip: float = 0.5,
          color_jitter: float = 0.0):
    """A timm model's preprocessing (its ``pretrained_cfg``: ``input_size``, ``interpolation``,
    ``crop_pct``, ``crop_mode``, ``mean``, ``std``), as timm's ``transforms_imagenet_eval``
    builds it for a square input: resize the shorter side to ``floor(size / crop_pct)``, centre
    crop ``size`` (``crop_mode: squash``: resize to the square, aspect not kept, then crop);
    training: a random resized crop (``scale``, ``ratio``) and a flip with probability
    ``hflip`` (timm's ``transforms_imagenet_train`` without its colour jitter unless
    ``color_jitter`` > 0).  Resizing runs on the PIL image when given one, as timm does."""
    h, w = _size_pair(input_size, "input_size")
    if interpolation not in _INTERPOLATIONS:
        raise ValueError(f"timm transform: interpolation must be one of {sorted(_INTERPOLATIONS)}, got {interpolation!r}")
    if not isinstance(crop_pct, (int, float)) or not 0.0 < crop_pct <= 1.0:
        raise ValueError(f"timm transform: crop_pct must be in (0, 1], got {crop_pct!r}")
    if crop_mode not in ("center", "squash"):
        raise ValueError(f"timm transform: crop_mode must be 'center' or 'squash', got {crop_mode!r}")
    interp = _INTERPOLATIONS[interpolation]
    steps = [RGBImage()]
    if train:
        steps.append(v2.RandomResizedCrop((h, w), scale=tuple(scale), ratio=tuple(ratio), interpolation=interp,
                                          antialias=True))
        if hflip > 0:
            steps.append(v2.RandomHorizontalFlip(hflip))
        if color_jitter:
            steps.append(v2.ColorJitter(color_jitter, color_jitter, color_jitter))
    else:
        scaled = (math.floor(h / crop_pct), math.floor(w / crop_pct))
        if crop_mode == "squash" or h != w:
            steps.append(v2.Resize(scaled, interpolation=interp, antialias=True))
        else:
            steps.append(v2.Resize(scaled[0], interpolation=interp, antialias=True))
        steps.append(v2.CenterCrop((h, w)))
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"timm transform: mean and std need 3 values (std > 0), got {mean}, {std}")
    steps.append(v2.Normalize([float(m) for m in mean], [float(s) for s in std]))
    return v2.Compose(steps)


class RGBImage(torch.nn.Module):
    """A PIL image to RGB (kept a PIL image, so that resizing uses PIL as timm's does); a tensor
    with one channel repeated to three."""

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            x = x.as_subclass(torch.Tensor) if x.dim() == 3 else x
            return x.expand(3, *x.shape[-2:]).clone() if x.dim() == 3 and x.shape[0] == 1 else x
        return x.convert("RGB") if getattr(x, "mode", "RGB") != "RGB" else x

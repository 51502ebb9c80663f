"""Image transforms of the three papers, built on torchvision.transforms.v2.

``build_transform(name, train, **opts)`` returns a ``v2.Compose`` that takes a PIL image or an
image tensor (``uint8 [C, H, W]``) and returns a normalised ``float32 [C, H, W]`` tensor:

* ``"resize_crop"`` - heated-up softmax / ALMN: resize to ``resize x resize`` (aspect ratio not
  kept, default 256), random ``crop`` (224; ALMN uses 227) + horizontal flip for training,
  centre crop for test. ImageNet normalisation by default.
* ``"short_side"`` - two-head ranking paper: training resizes the short side to a random size in
  ``[min_size, max_size]`` (350-512, aspect kept), random 224 crop, flip; test resizes the short
  side to ``test_size`` (350) and takes the centre 224 crop.
* ``"glyph"`` - glyph benchmark: training applies a small random affine jitter, a random
  stroke-thickness change (grey-scale dilation = 3x3 max-pool, erosion = -max-pool(-x)), a
  random Gaussian blur and Gaussian noise; test only converts and normalises.
* ``"mnist"`` - Fashion-MNIST and small grayscale images of your own: training applies a small
  random translation (and optional flip); ``size=28`` first resizes every image to 28 x 28.

Normalisations (``normalize=``): ``"imagenet"`` (mean 0.485/0.456/0.406, std 0.229/0.224/0.225;
their channel averages 0.449 / 0.226 for one-channel images), ``"minus_one_one"`` (x * 2 - 1)
and ``"none"``. Grayscale pipelines take ``channels=3`` to repeat the channel for ImageNet backbones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

__all__ = ["build_transform", "list_transforms", "StrokeWidth", "RepeatChannels", "normalization"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class StrokeWidth(torch.nn.Module):
    """Randomly thicken (dilation) or thin (erosion) bright strokes on a dark background.

    Grey-scale morphology with a ``(2 r + 1)`` square: dilation is a stride-1 max-pool,
    erosion is ``-maxpool(-x)``. With probability ``p`` one of the two is applied with a radius
    drawn from ``1..max_radius``. Expects a float tensor ``[..., H, W]``.
    """

    def __init__(self, p: float = 0.5, max_radius: int = 1):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"StrokeWidth: p must be in [0, 1], got {p}")
        if max_radius < 1:
            raise ValueError(f"StrokeWidth: max_radius must be >= 1, got {max_radius}")
        self.p, self.max_radius = p, int(max_radius)

    @staticmethod
    def morph(x: torch.Tensor, radius: int) -> torch.Tensor:
        """Dilation for radius > 0, erosion for radius < 0 (same shape as x)."""
        if radius == 0:
            return x
        k = 2 * abs(radius) + 1
        shape = x.shape
        y = x.reshape(-1, 1, *shape[-2:])
        y = F.max_pool2d(y if radius > 0 else -y, k, stride=1, padding=abs(radius))
        return (y if radius > 0 else -y).reshape(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand(()) >= self.p:
            return x
        radius = int(torch.randint(1, self.max_radius + 1, ()))
        sign = 1 if torch.rand(()) < 0.5 else -1
        return self.morph(torch.as_tensor(x), sign * radius)


class RepeatChannels(torch.nn.Module):
    """Repeat a one-channel image to ``channels`` channels (grayscale -> RGB backbones)."""

    def __init__(self, channels: int = 3):
        super().__init__()
        self.channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-3] == self.channels:
            return x
        if x.shape[-3] != 1:
            raise ValueError(f"RepeatChannels: expected 1 or {self.channels} channels, got {x.shape[-3]}")
        return x.expand(*x.shape[:-3], self.channels, *x.shape[-2:]).clone()


class _Clamp01(torch.nn.Module):
    def forward(self, x):
        return x.clamp(0.0, 1.0)


def normalization(name: str | None, channels: int = 3):
    """A Normalize transform (or None) for "imagenet", "minus_one_one" or "none"/None."""
    if name in (None, "none"):
        return None
    if name == "imagenet":
        if channels == 3:
            return v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        return v2.Normalize([sum(IMAGENET_MEAN) / 3] * channels, [sum(IMAGENET_STD) / 3] * channels)
    if name == "minus_one_one":
        return v2.Normalize([0.5] * channels, [0.5] * channels)
    raise ValueError(f"normalize must be 'imagenet', 'minus_one_one' or 'none', got {name!r}")


def _finish(steps, normalize, channels):
    norm = normalization(normalize, channels)
    if norm is not None:
        steps.append(norm)
    return v2.Compose(steps)


def _resize_crop(train, resize=256, crop=224, flip=True, normalize="imagenet"):
    if crop > resize:
        raise ValueError(f"resize_crop: crop={crop} larger than resize={resize}")
    steps = [v2.ToImage(), v2.RGB(), v2.Resize((resize, resize), antialias=True)]
    if train:
        steps.append(v2.RandomCrop(crop))
        if flip:
            steps.append(v2.RandomHorizontalFlip())
    else:
        steps.append(v2.CenterCrop(crop))
    steps.append(v2.ToDtype(torch.float32, scale=True))
    return _finish(steps, normalize, 3)


def _short_side(train, min_size=350, max_size=512, crop=224, test_size=350, flip=True, normalize="imagenet"):
    if not crop <= min_size <= max_size:
        raise ValueError(f"short_side: need crop <= min_size <= max_size, got {crop}, {min_size}, {max_size}")
    steps = [v2.ToImage(), v2.RGB()]
    if train:
        # RandomResize draws the short side uniformly from [min_size, max_size + 1).
        steps += [v2.RandomResize(min_size, max_size + 1, antialias=True), v2.RandomCrop(crop)]
        if flip:
            steps.append(v2.RandomHorizontalFlip())
    else:
        if test_size < crop:
            raise ValueError(f"short_side: test_size={test_size} smaller than crop={crop}")
        steps += [v2.Resize(test_size, antialias=True), v2.CenterCrop(crop)]
    steps.append(v2.ToDtype(torch.float32, scale=True))
    return _finish(steps, normalize, 3)


def _glyph(train, degrees=6.0, translate=0.06, scale=(0.9, 1.1), shear=6.0, stroke_p=0.5,
           max_radius=1, blur_p=0.3, blur_sigma=(0.1, 0.8), noise_sigma=0.05, channels=1,
           normalize="minus_one_one"):
    steps = [v2.ToImage(), v2.Grayscale(1), v2.ToDtype(torch.float32, scale=True)]
    if train:
        steps.append(v2.RandomAffine(degrees=degrees, translate=(translate, translate), scale=scale,
                                     shear=shear, interpolation=v2.InterpolationMode.BILINEAR, fill=0.0))
        if stroke_p > 0:
            steps.append(StrokeWidth(stroke_p, max_radius))
        if blur_p > 0:
            steps.append(v2.RandomApply([v2.GaussianBlur(3, sigma=blur_sigma)], p=blur_p))
        if noise_sigma > 0:
            steps += [v2.GaussianNoise(0.0, noise_sigma, clip=False), _Clamp01()]
    if channels != 1:
        steps.append(RepeatChannels(channels))
    return _finish(steps, normalize, channels)


def _mnist(train, translate=0.08, flip=False, channels=1, normalize="minus_one_one", size=None):
    steps = [v2.ToImage(), v2.Grayscale(1)]
    if size is not None:  # your own small images: one size for every image (aspect not kept)
        steps.append(v2.Resize((int(size), int(size)), antialias=True))
    steps.append(v2.ToDtype(torch.float32, scale=True))
    if train:
        if translate > 0:
            steps.append(v2.RandomAffine(degrees=0.0, translate=(translate, translate), fill=0.0))
        if flip:
            steps.append(v2.RandomHorizontalFlip())
    if channels != 1:
        steps.append(RepeatChannels(channels))
    return _finish(steps, normalize, channels)


_BUILDERS = {"resize_crop": _resize_crop, "short_side": _short_side, "glyph": _glyph, "mnist": _mnist}


def list_transforms() -> list[str]:
    return sorted(_BUILDERS)


def build_transform(name: str, train: bool, **opts) -> v2.Compose:
    """Build a named transform pipeline (see module docstring for names and options)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown transform {name!r}; choose one of {list_transforms()}")
    if not isinstance(train, bool):
        raise TypeError(f"build_transform: train must be a bool, got {train!r}")
    import inspect

    allowed = set(inspect.signature(_BUILDERS[name]).parameters) - {"train"}
    unknown = set(opts) - allowed
    if unknown:
        raise TypeError(f"build_transform({name!r}): unknown option(s) {sorted(unknown)}; "
                        f"allowed: {sorted(allowed)}")
    return _BUILDERS[name](train, **opts)

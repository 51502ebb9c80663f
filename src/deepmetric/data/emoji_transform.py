"""The ``emoji`` transform (:func:`deepmetric.data.build_transform`) and its style augmentation:
a random background colour, a full hue rotation, posterize and a same-size random resized crop
(the options and their defaults: the module docstring of :mod:`deepmetric.data.transforms`)."""
from __future__ import annotations

import torch
from torchvision.transforms import v2

from .transforms import _Clamp01, _finish, register_transform

__all__ = ["RandomBackground", "RandomHueRotation", "RandomPosterize", "RandomResizedCropSameSize",
           "white_background_mask"]


def white_background_mask(x: torch.Tensor, tolerance: float = 0.06) -> torch.Tensor:
    """``bool [H, W]``: the background of an image drawn on white, ``float [C, H, W]`` in [0, 1].

    A pixel is background when every channel is at least ``1 - tolerance`` *and* it is
    connected (4-neighbourhood) to the image border through such pixels
    (``scipy.ndimage.label``), so white parts enclosed by the drawing (eyes, teeth, a white
    flag's field inside its outline) stay drawing."""
    import numpy as np
    from scipy import ndimage

    near_white = (x >= 1.0 - tolerance).all(dim=0).numpy()
    components, _ = ndimage.label(near_white)
    border = np.unique(np.concatenate([components[0], components[-1], components[:, 0], components[:, -1]]))
    return torch.from_numpy(np.isin(components, border[border > 0]))


class RandomBackground(torch.nn.Module):
    """With probability ``p``, replace the white background of an image by one colour drawn
    uniformly from the RGB cube (:func:`white_background_mask` finds the background).

    The emoji cache holds RGB composited on white, not the alpha channel, so this is an
    approximation of compositing the artwork on another colour: anti-aliased outline pixels
    that blend the drawing with white (lighter than the drawing, darker than ``1 - tolerance``)
    keep their white share, a light fringe; white drawing parts that touch the border or the
    background (through a gap in the outline) change colour too.  Expects ``float [3, H, W]``."""

    def __init__(self, p: float = 0.5, tolerance: float = 0.06):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomBackground: p must be in [0, 1], got {p}")
        if not 0.0 <= tolerance < 1.0:
            raise ValueError(f"RandomBackground: tolerance must be in [0, 1), got {tolerance}")
        self.p, self.tolerance = float(p), float(tolerance)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand(()) >= self.p:
            return x
        colour = torch.rand(x.shape[-3], dtype=x.dtype)
        return torch.where(white_background_mask(x, self.tolerance), colour[:, None, None], x)


class RandomHueRotation(torch.nn.Module):
    """With probability ``p``, rotate the hue of every pixel by one angle drawn uniformly
    from [-180, 180) degrees (``v2.functional.adjust_hue`` with ``hue_factor = angle / 360``);
    saturation and value stay.  ``ColorJitter(hue=h)`` is the small version, at most
    ``h x 360`` degrees."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomHueRotation: p must be in [0, 1], got {p}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand(()) >= self.p:
            return x
        return v2.functional.adjust_hue(x, float(torch.empty(()).uniform_(-0.5, 0.5)))


class RandomPosterize(torch.nn.Module):
    """With probability ``p``, keep the ``bits`` high bits of each 8-bit channel value
    (``v2.functional.posterize`` on ``round(255 x)``, back to [0, 1]).  torchvision's own
    ``RandomPosterize`` takes uint8 images only, and its float version quantises to ``2**bits``
    levels of [0, 1] instead of masking the 8-bit values."""

    def __init__(self, bits: int = 4, p: float = 0.5):
        super().__init__()
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ValueError(f"RandomPosterize: bits must be an int in 1..8, got {bits!r}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomPosterize: p must be in [0, 1], got {p}")
        self.bits, self.p = bits, float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand(()) >= self.p:
            return x
        q = x.mul(255.0).round_().clamp_(0, 255).to(torch.uint8)
        return v2.functional.posterize(q, self.bits).to(x.dtype).div_(255.0)


class RandomResizedCropSameSize(torch.nn.Module):
    """``v2.RandomResizedCrop`` back to the input's own size (a box of ``scale`` x the area and
    aspect ratio in ``ratio``, resized with antialiasing), for pipelines whose size is the
    dataset's."""

    def __init__(self, scale=(0.6, 1.0), ratio=(3 / 4, 4 / 3)):
        super().__init__()
        scale, ratio = tuple(float(v) for v in scale), tuple(float(v) for v in ratio)
        if len(scale) != 2 or not 0.0 < scale[0] <= scale[1] <= 1.0:
            raise ValueError(f"random resized crop: scale must be (min, max) with 0 < min <= max <= 1, got {scale}")
        if len(ratio) != 2 or not 0.0 < ratio[0] <= ratio[1]:
            raise ValueError(f"random resized crop: ratio must be (min, max) with 0 < min <= max, got {ratio}")
        self.scale, self.ratio = scale, ratio
        self._crops: dict[tuple, torch.nn.Module] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = tuple(x.shape[-2:])
        if size not in self._crops:
            self._crops[size] = v2.RandomResizedCrop(size, scale=self.scale, ratio=self.ratio, antialias=True)
        return self._crops[size](x)


def _style_steps(*, hue_rotate_p, grayscale_p, posterize_bits, posterize_p, blur_p, blur_sigma, blur_kernel):
    """The emoji transform's style augmentation after the colour jitter (all off by default)."""
    steps = []
    if hue_rotate_p > 0:
        steps.append(RandomHueRotation(hue_rotate_p))
    if grayscale_p > 0:
        steps.append(v2.RandomGrayscale(grayscale_p))
    if posterize_p > 0:
        steps.append(RandomPosterize(posterize_bits, posterize_p))
    if blur_p > 0:
        steps.append(v2.RandomApply([v2.GaussianBlur(blur_kernel, sigma=tuple(blur_sigma))], p=blur_p))
    return steps


@register_transform("emoji")
def _emoji(train, size: int | None = None, degrees: float = 8.0, translate: float = 0.06, scale=(0.85, 1.1),
           brightness: float = 0.15, contrast: float = 0.15, saturation: float = 0.15, flip: bool = False,
           normalize: str | dict = "imagenet", mean=None, std=None, hue: float = 0.0, hue_rotate_p: float = 0.0,
           grayscale_p: float = 0.0, posterize_bits: int = 4, posterize_p: float = 0.0, blur_p: float = 0.0,
           blur_sigma=(0.1, 1.0), blur_kernel: int = 5, crop_scale=None, crop_ratio=(3 / 4, 4 / 3),
           background_p: float = 0.0, background_tolerance: float = 0.06):
    for key, p in (("hue_rotate_p", hue_rotate_p), ("grayscale_p", grayscale_p), ("posterize_p", posterize_p),
                   ("blur_p", blur_p), ("background_p", background_p)):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"emoji transform: {key} is a probability in [0, 1], got {p!r}")
    if not isinstance(hue, (int, float)) or not 0.0 <= hue <= 0.5:
        raise ValueError(f"emoji transform: hue (the colour jitter's largest hue shift, a fraction of the "
                         f"colour circle) must be in [0, 0.5], got {hue!r}")
    if isinstance(posterize_bits, bool) or not isinstance(posterize_bits, int) or not 1 <= posterize_bits <= 8:
        raise ValueError(f"emoji transform: posterize_bits must be an int in 1..8, got {posterize_bits!r}")
    if not isinstance(background_tolerance, (int, float)) or not 0.0 <= background_tolerance < 1.0:
        raise ValueError(f"emoji transform: background_tolerance must be in [0, 1), got {background_tolerance!r}")
    steps = [v2.ToImage(), v2.RGB(), v2.ToDtype(torch.float32, scale=True)]
    if size is not None:
        steps.append(v2.Resize((size, size), antialias=True))
    if train:
        if crop_scale is not None:
            steps.append(RandomResizedCropSameSize(crop_scale, crop_ratio))
        steps.append(v2.RandomAffine(degrees=degrees, translate=(translate, translate), scale=scale,
                                     interpolation=v2.InterpolationMode.BILINEAR, fill=1.0))
        if background_p > 0:  # after the affine: its white fill is background too
            steps.append(RandomBackground(background_p, background_tolerance))
        if brightness or contrast or saturation or hue:
            steps += [v2.ColorJitter(brightness=brightness, contrast=contrast, saturation=saturation, hue=hue),
                      _Clamp01()]
        steps += _style_steps(hue_rotate_p=hue_rotate_p, grayscale_p=grayscale_p, posterize_bits=posterize_bits,
                              posterize_p=posterize_p, blur_p=blur_p, blur_sigma=blur_sigma, blur_kernel=blur_kernel)
        if flip:
            steps.append(v2.RandomHorizontalFlip())
    if (mean is None) != (std is None):
        raise ValueError("emoji transform: give both mean and std (per-channel), or neither")
    if mean is not None:
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"emoji transform: mean and std need 3 values (std > 0), got {mean}, {std}")
        steps.append(v2.Normalize(list(mean), list(std)))
        return v2.Compose(steps)
    return _finish(steps, normalize, 3)

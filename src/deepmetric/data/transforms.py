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
* ``"emoji"`` - emoji benchmark (RGB on white): optional resize to ``size``; training applies a
  small random affine (rotation, translation, scale; the uncovered border is filled white) and
  a mild brightness / contrast / saturation jitter. No hue jitter (colour names classes: red vs
  orange heart, coloured squares) and no flip by default (a mirror image is another class:
  left / right arrows and pointing hands, ``flip=True`` to allow it). ``mean``/``std`` override
  ``normalize`` (e.g. the statistics a backbone was trained with).  Style augmentation, every
  part off by default: a random resized crop (``crop_scale``), a random background colour
  (``background_p``, :class:`RandomBackground`: the white background found in the RGB image,
  an approximation since the cache keeps no alpha), a hue jitter (``hue``), a full hue
  rotation (``hue_rotate_p``), grayscale (``grayscale_p``), posterize (``posterize_p``,
  ``posterize_bits``) and a Gaussian blur (``blur_p``, ``blur_sigma``, ``blur_kernel``).
  Built in :mod:`deepmetric.data.emoji_transform`.

* ``"timm"`` - a timm model's own preprocessing (its ``pretrained_cfg``: input size,
  interpolation, crop fraction, mean, std), filled in from ``model.name: timm/...`` by the
  trainer for every option the recipe leaves out; training: random resized crop and flip.

* ``"sod"`` - video events (two-head paper, Sec. 4.2): takes the *list of frames* of a window
  (PIL images, uint8 arrays or a uint8 tensor ``[T, H, W]`` / ``[T, 3, H, W]``) and returns the
  stack of differences ``float32 [T - 1, H, W]`` (see :class:`StackOfDifferences`). Options
  ``size`` (resize every frame first), ``crop`` (random crop, the same for every frame, when
  training; centre crop for test), ``scale`` (default 1/255: values in [-1, 1]; ``1.0`` keeps the
  paper's integer range [-255, 255]). No flip: a mirrored left turn is a right turn.

``build_transform("glyph", train=True, batched=True)`` draws the same augmentations per image
but applies them to whole batches (:class:`GlyphBatchAugment`: one ``grid_sample``, one
max-pool, one grouped convolution), about 10x cheaper than per-image torchvision calls on
32x32 glyphs.  It returns a :class:`BatchedTransform`: the dataset's per-image part only
converts to ``float32 [1, H, W]``; ``make_loader`` finds its ``batch_transform`` and applies it
to each collated batch (in the loader workers when there are any).

Normalisations (``normalize=``): ``"imagenet"`` (mean 0.485/0.456/0.406, std 0.229/0.224/0.225;
their channel averages 0.449 / 0.226 for one-channel images), ``"minus_one_one"`` (x * 2 - 1)
and ``"none"``, or any mapping with ``mean`` and ``std`` such as a backbone's ``pretrained_cfg``
(``build_transform(..., normalize=model.pretrained_cfg)``; the EfficientNet-Lite weights expect
mean = std = 0.5, i.e. ``"minus_one_one"``). Grayscale pipelines take ``channels=3`` to repeat
the channel for ImageNet backbones.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from deepmetric.options import option_hints
from deepmetric.registry import Registry

__all__ = ["TRANSFORMS", "build_transform", "list_transforms", "register_transform", "transform_options",
           "transform_option_hints",
           "StrokeWidth", "RepeatChannels", "normalization", "StackOfDifferences", "to_grayscale_uint8",
           "GlyphBatchAugment", "BatchedTransform", "affine_inverse_matrices"]

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


def normalization(name, channels: int = 3):
    """A Normalize transform (or None) for "imagenet", "minus_one_one" or "none"/None, or for a
    mapping with ``mean`` and ``std`` -- e.g. a backbone's ``pretrained_cfg``."""
    if isinstance(name, Mapping):
        if "mean" not in name or "std" not in name:
            raise ValueError(f"normalize mapping needs 'mean' and 'std' keys, got keys {sorted(name)}")
        mean, std = [float(m) for m in name["mean"]], [float(s) for s in name["std"]]
        if len(mean) != channels or len(std) != channels:
            raise ValueError(f"normalize mean {mean} / std {std} do not have {channels} channel(s)")
        return v2.Normalize(mean, std)
    if name in (None, "none"):
        return None
    if name == "imagenet":
        if channels == 3:
            return v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        return v2.Normalize([sum(IMAGENET_MEAN) / 3] * channels, [sum(IMAGENET_STD) / 3] * channels)
    if name == "minus_one_one":
        return v2.Normalize([0.5] * channels, [0.5] * channels)
    raise ValueError(
        f"normalize must be 'imagenet', 'minus_one_one', 'none' or a {{'mean', 'std'}} mapping, got {name!r}"
    )


#: name -> builder(train, **options); builders register with @register_transform where defined
TRANSFORMS = Registry("transform", unknown="unknown {kind} {name!r}; choose one of {names}")


def register_transform(name: str):
    """Decorator registering ``builder(train: bool, **options)`` as transform ``name``
    (:func:`build_transform`; a config's ``data.transform``); its keyword parameters are the
    transform's options.  A second transform of the same name is an error."""
    return TRANSFORMS.register(name)


def _finish(steps, normalize, channels):
    norm = normalization(normalize, channels)
    if norm is not None:
        steps.append(norm)
    return v2.Compose(steps)


@register_transform("resize_crop")
def _resize_crop(train, resize: int = 256, crop: int = 224, flip: bool = True, normalize: str | dict = "imagenet"):
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


@register_transform("short_side")
def _short_side(train, min_size: int = 350, max_size: int = 512, crop: int = 224, test_size: int = 350,
                flip: bool = True, normalize: str | dict = "imagenet"):
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


def affine_inverse_matrices(angle: torch.Tensor, tx: torch.Tensor, ty: torch.Tensor, scale: torch.Tensor,
                            shear_x: torch.Tensor, shear_y: torch.Tensor) -> torch.Tensor:
    """[B, 2, 3] inverse affine matrices about the image centre, in pixels: torchvision's
    ``_get_inverse_affine_matrix`` (``M = T C R S SHy SHx C^-1``, inverted) for a batch.
    Angles and shears in degrees."""
    rot, sx, sy = torch.deg2rad(angle), torch.deg2rad(shear_x), torch.deg2rad(shear_y)
    a = torch.cos(rot - sy) / torch.cos(sy)
    b = -torch.cos(rot - sy) * torch.tan(sx) / torch.cos(sy) - torch.sin(rot)
    c = torch.sin(rot - sy) / torch.cos(sy)
    d = -torch.sin(rot - sy) * torch.tan(sx) / torch.cos(sy) + torch.cos(rot)
    m0, m1, m3, m4 = d / scale, -b / scale, -c / scale, a / scale
    m2 = m0 * -tx + m1 * -ty
    m5 = m3 * -tx + m4 * -ty
    return torch.stack([torch.stack([m0, m1, m2], 1), torch.stack([m3, m4, m5], 1)], 1)


def _affine_batch(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Bilinear warp of ``x [B, C, H, W]`` by per-image inverse matrices ``theta [B, 2, 3]``
    with fill 0, exactly as torchvision's ``affine`` on tensors (same pixel-centre grid, and
    its fill mask: the warped image times the warped all-ones image)."""
    n, ch, h, w = x.shape
    xs = torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, w, dtype=x.dtype)
    ys = torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, h, dtype=x.dtype)
    base = torch.stack([xs.expand(h, w), ys.unsqueeze(1).expand(h, w), torch.ones(h, w, dtype=x.dtype)], -1)
    scaled = theta.to(x.dtype).transpose(1, 2) / torch.tensor([0.5 * w, 0.5 * h], dtype=x.dtype)
    grid = base.reshape(1, h * w, 3).expand(n, -1, -1).bmm(scaled).reshape(n, h, w, 2)
    both = torch.cat([x, torch.ones(n, 1, h, w, dtype=x.dtype)], 1)
    out = F.grid_sample(both, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out[:, :ch] * out[:, ch:]


class GlyphBatchAugment(torch.nn.Module):
    """The ``glyph`` training augmentation for a batch ``float [B, 1, H, W]`` in [0, 1], with
    independent random parameters per image drawn as torchvision does: affine (angle
    ``U(-degrees, degrees)``, translation ``round(U(-t W, t W))`` pixels, scale ``U(scale)``,
    x-shear ``U(-shear, shear)``; bilinear, fill 0), then with probability ``stroke_p`` a
    dilation or erosion of radius ``1..max_radius`` (:class:`StrokeWidth`), with probability
    ``blur_p`` a 3x3 Gaussian blur of ``sigma ~ U(blur_sigma)`` (torchvision's kernel,
    reflect padding), then ``N(0, noise_sigma^2)`` noise and clamping to [0, 1]."""

    def __init__(self, degrees=6.0, translate=0.06, scale=(0.9, 1.1), shear=6.0, stroke_p=0.5, max_radius=1,
                 blur_p=0.3, blur_sigma=(0.1, 0.8), noise_sigma=0.05):
        super().__init__()
        if max_radius < 1:
            raise ValueError(f"GlyphBatchAugment: max_radius must be >= 1, got {max_radius}")
        for name, p in (("stroke_p", stroke_p), ("blur_p", blur_p)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"GlyphBatchAugment: {name} must be in [0, 1], got {p}")
        self.degrees, self.translate, self.scale, self.shear = float(degrees), float(translate), tuple(scale), float(shear)
        self.stroke_p, self.max_radius = float(stroke_p), int(max_radius)
        self.blur_p, self.blur_sigma, self.noise_sigma = float(blur_p), tuple(blur_sigma), float(noise_sigma)

    @staticmethod
    def _uniform(n: int, lo: float, hi: float) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float64).uniform_(lo, hi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or not x.dtype.is_floating_point:
            raise ValueError(f"GlyphBatchAugment: expected a float batch [B, C, H, W], got {x.dtype} {tuple(x.shape)}")
        n, _, h, w = x.shape
        u = self._uniform
        tx = torch.round(u(n, -self.translate * w, self.translate * w))
        ty = torch.round(u(n, -self.translate * h, self.translate * h))
        theta = affine_inverse_matrices(u(n, -self.degrees, self.degrees), tx, ty, u(n, *self.scale),
                                        u(n, -self.shear, self.shear), torch.zeros(n, dtype=torch.float64))
        x = _affine_batch(x, theta)
        if self.stroke_p > 0:
            apply = torch.rand(n) < self.stroke_p
            radius = torch.randint(1, self.max_radius + 1, (n,))
            sign = torch.where(torch.rand(n) < 0.5, 1, -1)
            out = x.clone()
            for r in range(1, self.max_radius + 1):
                for s in (1, -1):
                    sel = apply & (radius == r) & (sign == s)
                    if sel.any():
                        out[sel] = StrokeWidth.morph(x[sel], s * r)
            x = out
        if self.blur_p > 0:
            apply = torch.rand(n) < self.blur_p
            sigma = u(n, *self.blur_sigma).to(x.dtype)
            lim = 1.0 / math.sqrt(2.0)  # torchvision's 3-tap kernel positions: linspace(-lim, lim, 3)
            pos = torch.tensor([-lim, 0.0, lim], dtype=x.dtype)
            k1 = torch.softmax(-(pos / sigma[:, None]) ** 2, dim=1)
            k1 = torch.where(apply[:, None], k1, torch.tensor([0.0, 1.0, 0.0], dtype=x.dtype))
            c = x.shape[1]
            k2 = (k1[:, :, None] * k1[:, None, :]).repeat_interleave(c, 0).unsqueeze(1)  # [B*C, 1, 3, 3]
            y = F.pad(x.reshape(1, n * c, h, w), (1, 1, 1, 1), mode="reflect")
            x = F.conv2d(y, k2, groups=n * c).reshape(n, c, h, w)
        if self.noise_sigma > 0:
            x = (x + self.noise_sigma * torch.randn_like(x)).clamp_(0.0, 1.0)
        return x


class _ToImageTensor(torch.nn.Module):
    """A ``[C, H, W]`` tensor as it is (no copy); anything else (PIL, ndarray) through ``v2.ToImage``."""

    def __init__(self):
        super().__init__()
        self.to_image = v2.ToImage()

    def forward(self, x):
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            return x.as_subclass(torch.Tensor)
        return self.to_image(x).as_subclass(torch.Tensor)


class _GrayscaleBatch(torch.nn.Module):
    """``[B, C, H, W]`` -> one channel (ITU-R 601-2 luma for RGB, as ``v2.Grayscale``)."""

    def forward(self, x):
        return x if x.shape[-3] == 1 else v2.functional.rgb_to_grayscale(x, num_output_channels=1)


class BatchedTransform(torch.nn.Module):
    """A per-image transform (``forward``) plus a ``batch_transform`` that ``make_loader``
    applies to every collated batch of images."""

    def __init__(self, per_image, batch_transform):
        super().__init__()
        self.per_image = per_image
        self.batch_transform = batch_transform

    def forward(self, x):
        return self.per_image(x)


@register_transform("glyph")
def _glyph(train, degrees: float = 6.0, translate: float = 0.06, scale=(0.9, 1.1), shear: float = 6.0,
           stroke_p: float = 0.5, max_radius: int = 1, blur_p: float = 0.3, blur_sigma=(0.1, 0.8),
           noise_sigma: float = 0.05, channels: int = 1, normalize: str | dict = "minus_one_one", batched: bool = False):
    steps = [v2.ToImage(), v2.Grayscale(1), v2.ToDtype(torch.float32, scale=True)]
    if train and batched:
        # per image only what collation needs (uint8 tensors pass through); the rest per batch
        batch = [_GrayscaleBatch(), v2.ToDtype(torch.float32, scale=True),
                 GlyphBatchAugment(degrees, translate, scale, shear, stroke_p, max_radius, blur_p, blur_sigma,
                                   noise_sigma)]
        if channels != 1:
            batch.append(RepeatChannels(channels))
        return BatchedTransform(_ToImageTensor(), _finish(batch, normalize, channels))
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


@register_transform("mnist")
def _mnist(train, translate: float = 0.08, flip: bool = False, channels: int = 1, normalize: str | dict = "minus_one_one",
           size: int | None = None):
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


def to_grayscale_uint8(frame):
    """One frame -> uint8 ``[H, W]`` luma, with PIL's ITU-R 601-2 conversion
    ``L = (19595 R + 38470 G + 7471 B + 2**15) >> 16`` (i.e. 0.299 R + 0.587 G + 0.114 B,
    rounded).  Accepts a PIL image, a uint8 array ``[H, W]`` / ``[H, W, 3]`` or a uint8 tensor
    ``[H, W]`` / ``[3, H, W]`` / ``[1, H, W]``."""
    import numpy as np
    from PIL import Image

    if isinstance(frame, Image.Image):
        return np.asarray(frame.convert("L"), dtype=np.uint8)
    if isinstance(frame, torch.Tensor):
        t = frame.detach().cpu()
        if t.dim() == 3 and t.shape[0] in (1, 3):
            t = t.permute(1, 2, 0)
        frame = t.numpy()
    a = np.asarray(frame)
    if a.dtype != np.uint8:
        raise TypeError(f"sod: frames must be uint8 (0..255), got dtype {a.dtype}")
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim == 2:
        return a
    if a.ndim == 3 and a.shape[2] == 3:
        return np.asarray(Image.fromarray(a, "RGB").convert("L"), dtype=np.uint8)
    raise ValueError(f"sod: a frame must be [H, W], [H, W, 3] or [3, H, W], got shape {a.shape}")


class StackOfDifferences(torch.nn.Module):
    """Stack of differences (Fernando et al.; two-head paper Sec. 4.2, Fig. 8).

    ``T`` frames -> grayscale ``g_0 .. g_{T-1}`` (uint8, :func:`to_grayscale_uint8`) ->
    ``SOD_c = scale * (g_{c+1} - g_c)`` for ``c = 0 .. T - 2``: six frames give five channels.
    The integer differences lie in [-255, 255] (the paper feeds that range to a randomly
    initialised ResNet-50); ``scale`` (default 1/255) maps them to [-1, 1].

    Args:
        size: resize every grayscale frame to ``size`` (int: square, or (H, W)) first, bilinear.
        crop: crop size (int or (H, W)) taken at the same place in every frame: random when
            ``train``, centred otherwise.
        train: random (True) or centre (False) crop.
        scale: multiplier of the integer differences.
    """

    def __init__(self, size=None, crop=None, train: bool = False, scale: float = 1 / 255):
        super().__init__()
        self.size = (size, size) if isinstance(size, int) else (tuple(size) if size is not None else None)
        self.crop = (crop, crop) if isinstance(crop, int) else (tuple(crop) if crop is not None else None)
        self.train_mode = bool(train)
        self.scale = float(scale)
        if self.scale <= 0:
            raise ValueError(f"sod: scale must be positive, got {scale}")

    def forward(self, frames) -> torch.Tensor:
        import numpy as np
        from PIL import Image

        if isinstance(frames, torch.Tensor) and frames.dim() in (3, 4):
            frames = list(frames)
        frames = list(frames)
        if len(frames) < 2:
            raise ValueError(f"sod: needs at least two frames, got {len(frames)}")
        gray = [to_grayscale_uint8(f) for f in frames]
        if any(g.shape != gray[0].shape for g in gray):
            raise ValueError(f"sod: frames differ in size: {sorted({g.shape for g in gray})}")
        if self.size is not None:
            h, w = self.size
            gray = [np.asarray(Image.fromarray(g).resize((w, h), Image.BILINEAR)) for g in gray]
        g = torch.from_numpy(np.stack(gray).astype(np.int16))
        if self.crop is not None:
            ch, cw = self.crop
            H, W = g.shape[-2:]
            if ch > H or cw > W:
                raise ValueError(f"sod: crop {self.crop} is larger than the frames ({H}, {W})")
            if self.train_mode:
                top = int(torch.randint(0, H - ch + 1, ()))
                left = int(torch.randint(0, W - cw + 1, ()))
            else:
                top, left = (H - ch) // 2, (W - cw) // 2
            g = g[:, top:top + ch, left:left + cw]
        return (g[1:] - g[:-1]).to(torch.float32) * self.scale

    def extra_repr(self) -> str:
        return f"size={self.size}, crop={self.crop}, train={self.train_mode}, scale={self.scale:g}"


@register_transform("sod")
def _sod(train, size=None, crop=None, scale: float = 1 / 255):
    return StackOfDifferences(size=size, crop=crop, train=train, scale=scale)


def list_transforms() -> list[str]:
    """The names :func:`build_transform` accepts, sorted."""
    return TRANSFORMS.names()


def transform_options(name: str) -> set[str]:
    """The options (``data.transform_options``) transform ``name`` accepts: its builder's
    keyword parameters besides ``train``.  An unknown name raises as :func:`build_transform`."""
    return TRANSFORMS.options(name, skip=("train",))


def transform_option_hints(name: str) -> dict:
    """The type hints of transform ``name``'s options (its builder's), for the config's value
    check; an option without a hint (a pair such as ``scale``) is not in it."""
    return option_hints(TRANSFORMS.get(name))


def build_transform(name: str, train: bool, **opts) -> v2.Compose:
    """Build a named transform pipeline (see module docstring for names and options)."""
    builder = TRANSFORMS.get(name)
    if not isinstance(train, bool):
        raise TypeError(f"build_transform: train must be a bool, got {train!r}")
    allowed = transform_options(name)
    unknown = set(opts) - allowed
    if unknown:
        raise TypeError(f"build_transform({name!r}): unknown option(s) {sorted(unknown)}; "
                        f"allowed: {sorted(allowed)}")
    return builder(train, **opts)

"""Tiny synthetic data and model for tests and smoke runs of the training loop.

``GaussianClusters`` is a zero-shot benchmark of Gaussian blobs: every class has a random
unit-norm centre in ``dim`` dimensions and its samples are ``centre + noise * N(0, I)``.
The train and test splits use disjoint classes (drawn from one seeded generator), so a
model must learn a metric, not memorise classes.  It follows the dataset contract
(``ds[i] -> (tensor, int)``, ``labels``, ``num_classes``, ``class_names``).

Its model, ``SyntheticMLP``, is :class:`deepmetric.models.synthetic.SyntheticMLP` (re-exported
here).  Both are reachable from a config as ``data.name: synthetic`` and
``model.name: synthetic_mlp``: each registers in its registry like the other datasets and
models.
"""
from __future__ import annotations

import numpy as np
import torch
from .contract import MetricDatasetBase

from deepmetric.models.synthetic import SyntheticMLP
from deepmetric.registry import signature_options

from .registry import register_dataset

__all__ = ["GaussianClusters", "build_synthetic_dataset", "SyntheticMLP", "write_digit_folder", "DIGIT_NAMES"]


class GaussianClusters(MetricDatasetBase):
    """Gaussian clusters; ``split`` "train" / "test" (disjoint classes), or for In-shop-like
    tests "query" / "gallery" (the test classes, samples alternately assigned).

    ``augment`` > 0 adds fresh ``augment * N(0, I)`` noise (torch's global random stream) to
    the training split's samples at every access: a stand-in for random image augmentation
    in tests of seeding and resume."""

    def __init__(self, split: str = "train", *, num_classes: int = 8, per_class: int = 16,
                 dim: int = 16, noise: float = 0.3, seed: int = 0, transform=None, augment: float = 0.0):
        if split not in ("train", "test", "query", "gallery"):
            raise ValueError(f"synthetic: split must be train, test, query or gallery, got {split!r}")
        for name, v in (("num_classes", num_classes), ("per_class", per_class), ("dim", dim)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"synthetic: {name} must be a positive int, got {v!r}")
        g = np.random.default_rng(seed)
        centres = g.standard_normal((2 * num_classes, dim))
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
        first = 0 if split == "train" else num_classes
        labels = np.repeat(np.arange(num_classes), per_class)
        # A per-split stream so the train split does not change when test options do.
        g_split = np.random.default_rng([seed, 0 if split == "train" else 1])
        x = centres[first + labels] + noise * g_split.standard_normal((labels.size, dim))
        if split in ("query", "gallery"):
            keep = (np.arange(labels.size) % 2) == (0 if split == "query" else 1)
            x, labels = x[keep], labels[keep]
        self.x = torch.from_numpy(x.astype(np.float32))
        self.labels = labels.astype(np.int64)
        self.num_classes = int(num_classes)
        self.class_names = None
        self.transform = transform
        self.augment = float(augment) if split == "train" else 0.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment > 0:
            x = x + self.augment * torch.randn(x.shape)
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.labels[i])


@register_dataset("synthetic", options=signature_options(GaussianClusters, skip=("split", "transform")),
                  hints_from=(GaussianClusters,))
def build_synthetic_dataset(split: str = "train", transform=None, root=None, **options) -> GaussianClusters:
    """``GaussianClusters(split, transform=transform, **options)``, registered as dataset
    ``synthetic``; ``root`` is not used (the data is generated)."""
    return GaussianClusters(split, transform=transform, **options)


DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def write_digit_folder(root, per_class: int = 50, size: int = 28, seed: int = 0, noise: float = 12.0):
    """Write a small "handwritten digits" folder: ``root/<zero..nine>/<i>.png``, ``size`` x
    ``size`` grayscale PNGs of the digit drawn with Pillow's built-in font at a random size,
    position, stroke width and rotation, plus Gaussian pixel noise.  The class folders are named
    by the digit's English name, so ``class_split: half`` trains on eight, five, four, nine,
    one (the first half of the sorted names).  Returns the root as a ``Path``.

    For trying the own-data workflow (``recipes/own_folder_small_grey.yaml``) without any download."""
    from pathlib import Path

    from PIL import Image, ImageDraw, ImageFont

    root = Path(root)
    g = np.random.default_rng(seed)
    for digit, name in enumerate(DIGIT_NAMES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            big = 4 * size  # draw large, then rotate and shrink (smooth strokes)
            canvas = Image.new("L", (big, big), 0)
            font = ImageFont.load_default(size=float(g.uniform(0.55, 0.8) * big))
            draw = ImageDraw.Draw(canvas)
            stroke = int(g.integers(0, 3)) * big // 56
            box = draw.textbbox((0, 0), str(digit), font=font, stroke_width=stroke)
            w, h = box[2] - box[0], box[3] - box[1]
            x = (big - w) / 2 - box[0] + g.uniform(-0.12, 0.12) * big
            y = (big - h) / 2 - box[1] + g.uniform(-0.12, 0.12) * big
            draw.text((x, y), str(digit), fill=255, font=font, stroke_width=stroke, stroke_fill=255)
            canvas = canvas.rotate(float(g.uniform(-15, 15)), resample=Image.BILINEAR)
            small = np.asarray(canvas.resize((size, size), Image.LANCZOS), dtype=np.float32)
            small = np.clip(small + g.normal(0.0, noise, small.shape), 0, 255).astype(np.uint8)
            Image.fromarray(small, mode="L").save(root / name / f"{i:04d}.png")
    return root

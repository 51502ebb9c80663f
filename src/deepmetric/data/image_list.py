"""Image lists (paths + labels) and the torch Dataset that reads them.

Every file-based dataset in deepmetric (the standard benchmarks, ``folder`` and ``csv``)
is first parsed into an :class:`ImageList` - plain paths, int64 labels remapped to
0..C-1 within the split, and the original class ids - and then wrapped in an
:class:`ImageListDataset` that reads images lazily with :func:`deepmetric.data.decode.decode_image`
(EXIF orientation, 16-bit / float scaled to 8 bits, transparency onto white, decoded size
checked against ``max_decode_mb`` before decoding).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from .contract import MetricDatasetBase
from torchvision.transforms.v2 import functional as TF

from .decode import (DEFAULT_MAX_DECODE_MB, FORMATS, ImageDecodeError, check_decoded_size, decode_image,
                     decode_limit)

__all__ = ["ImageList", "ImageListDataset", "remap_labels", "IMAGE_EXTENSIONS"]

# Extensions PIL opens that image datasets use; matched case-insensitively.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")

_VERIFY_MODES = ("exists", "open", "none")


def remap_labels(class_ids: Sequence, order: Sequence | None = None) -> tuple[np.ndarray, list]:
    """Map arbitrary class ids to 0..C-1.

    ``order`` fixes the id -> label assignment (label i is ``order[i]``); without it the
    sorted unique ids are used, so labels follow the original ids' order. Returns
    ``(labels int64, ids_in_label_order)``.
    """
    ids = list(class_ids)
    if order is None:
        order = sorted(set(ids))
    lookup = {c: i for i, c in enumerate(order)}
    missing = [c for c in set(ids) if c not in lookup]
    if missing:
        raise ValueError(f"class ids {sorted(missing)[:10]} are not in the given class order")
    labels = np.fromiter((lookup[c] for c in ids), dtype=np.int64, count=len(ids))
    return labels, list(order)


@dataclass
class ImageList:
    """A parsed split: what a loader read, before any image is opened.

    Attributes:
        paths: absolute (or root-joined) image paths.
        labels: int64 array, 0..C-1 within the split (or a shared mapping, e.g. In-shop
            query and gallery).
        class_ids: original class id of each label: ``class_ids[label]`` (length C).
        class_names: optional human-readable name per label (length C).
        hint: extra advice appended to missing-image errors.
        origins: optional per-image description of where the entry came from (for
            example ``"data.csv:17"``), used in error messages.
        name, split, root: for messages and ``repr``.
    """

    paths: list[str]
    labels: np.ndarray
    class_ids: list = field(default_factory=list)
    class_names: list[str] | None = None
    origins: list[str] | None = None
    name: str = "images"
    split: str = ""
    root: str | None = None
    hint: str = ""

    def __post_init__(self):
        self.labels = np.asarray(self.labels, dtype=np.int64).reshape(-1)
        if len(self.paths) != len(self.labels):
            raise ValueError(f"{self.name}: {len(self.paths)} paths but {len(self.labels)} labels")
        if not self.class_ids:
            self.class_ids = list(range(int(self.labels.max()) + 1 if len(self.labels) else 0))
        if len(self.labels) and (self.labels.min() < 0 or self.labels.max() >= len(self.class_ids)):
            raise ValueError(f"{self.name}: labels must lie in 0..{len(self.class_ids) - 1}")
        if self.class_names is not None and len(self.class_names) != len(self.class_ids):
            raise ValueError(f"{self.name}: {len(self.class_names)} class names for {len(self.class_ids)} classes")
        if self.origins is not None and len(self.origins) != len(self.paths):
            raise ValueError(f"{self.name}: origins must have one entry per path")

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def num_classes(self) -> int:
        return len(self.class_ids)

    @property
    def original_labels(self) -> np.ndarray:
        """The original class id of every image (``class_ids[labels]``)."""
        return np.asarray(self.class_ids, dtype=object)[self.labels] if len(self.labels) else np.array([])

    def subset(self, keep: np.ndarray) -> "ImageList":
        """Same class mapping, only the images where ``keep`` is True."""
        keep = np.asarray(keep, dtype=bool)
        idx = np.flatnonzero(keep)
        return ImageList(
            paths=[self.paths[i] for i in idx],
            labels=self.labels[idx],
            class_ids=list(self.class_ids),
            class_names=None if self.class_names is None else list(self.class_names),
            origins=None if self.origins is None else [self.origins[i] for i in idx],
            name=self.name,
            split=self.split,
            root=self.root,
            hint=self.hint,
        )


def _describe(image_list: ImageList, i: int) -> str:
    where = f" (listed at {image_list.origins[i]})" if image_list.origins is not None else ""
    return f"{image_list.paths[i]}{where}"


def _readable(path: str, max_bytes: int | None = None) -> bool:
    """The header opens, its structure verifies and its decoded size is within ``max_bytes``."""
    try:
        with Image.open(path, formats=FORMATS) as im:
            check_decoded_size(im, path, max_bytes)
            im.verify()
        return True
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError, Image.DecompressionBombError):
        return False


class ImageListDataset(MetricDatasetBase):
    """A torch Dataset over an :class:`ImageList`: ``ds[i] -> (image, label)``.

    Images are read with :func:`deepmetric.data.decode.decode_image` into 8-bit RGB
    (``mode="RGB"``, or ``"L"`` for grayscale): EXIF orientation applied, 16-bit and float
    images scaled, transparent pixels made white; then ``transform`` is applied. Without a transform the image is returned as
    a float tensor in [0, 1], shape [C, H, W].

    Args:
        image_list: the parsed split.
        transform: callable applied to the PIL image (for example a torchvision v2 pipeline).
        skip_missing: drop images that fail the ``verify`` check instead of raising; the
            dropped paths are in ``ds.skipped`` and their number in ``ds.num_skipped``.
            Labels keep the split's mapping (``num_classes`` does not shrink), so query and
            gallery sets stay aligned; a warning names classes left without images.
        verify: ``"exists"`` (default) checks every file exists when the dataset is built;
            ``"open"`` also opens each image header with PIL (slow on large sets, catches
            truncated/corrupt files, and images over ``max_decode_mb``); ``"none"`` checks
            nothing up front.
        max_decode_mb: largest decoded image (width x height x bands x bytes per band) in
            MiB, checked from the header before decoding (default
            :data:`~deepmetric.data.decode.DEFAULT_MAX_DECODE_MB`).

    Attributes: ``labels`` (int64 ndarray), ``num_classes``, ``class_names``, ``class_ids``
    (original id per label), ``paths``, ``skipped``, ``num_skipped``.
    """

    def __init__(
        self,
        image_list: ImageList,
        transform: Callable | None = None,
        *,
        skip_missing: bool = False,
        verify: str = "exists",
        mode: str = "RGB",
        max_decode_mb: float = DEFAULT_MAX_DECODE_MB,
    ):
        if verify not in _VERIFY_MODES:
            raise ValueError(f"verify must be one of {_VERIFY_MODES}, got {verify!r}")
        if mode not in ("RGB", "L"):
            raise ValueError(f"mode must be 'RGB' or 'L', got {mode!r}")
        self.transform = transform
        self.mode = mode
        self.max_decode_bytes = decode_limit(None, max_decode_mb)
        self.skipped: list[str] = []
        if verify != "none":
            bad = []
            for i, p in enumerate(image_list.paths):
                ok = os.path.isfile(p) and (verify != "open" or _readable(p, self.max_decode_bytes))
                if not ok:
                    bad.append(i)
            if bad and not skip_missing:
                what = "missing" if verify == "exists" else "missing or unreadable"
                shown = "\n  ".join(_describe(image_list, i) for i in bad[:10])
                more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
                raise FileNotFoundError(
                    f"{image_list.name} ({image_list.split or 'all'}): {len(bad)} of {len(image_list)} "
                    f"images are {what}{' under root ' + repr(image_list.root) if image_list.root else ''}:\n"
                    f"  {shown}{more}\n"
                    + (image_list.hint or "Check that the image archive was fully extracted next to the "
                       "annotation files.")
                    + " Pass skip_missing=True to skip and count them (in a YAML config: "
                    "data.options.skip_missing: true" + ("" if verify == "open" else
                                                         ", with data.options.verify: open for unreadable files")
                    + ")."
                )
            if bad:
                self.skipped = [image_list.paths[i] for i in bad]
                what = "missing" if verify == "exists" else "missing or unreadable"
                shown = ", ".join(_describe(image_list, i) for i in bad[:5])
                more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
                warnings.warn(
                    f"{image_list.name} ({image_list.split or 'all'}): skip_missing dropped {len(bad)} of "
                    f"{len(image_list)} images ({what}): {shown}{more}",
                    stacklevel=2,
                )
                keep = np.ones(len(image_list), dtype=bool)
                keep[bad] = False
                before = set(np.unique(image_list.labels).tolist())
                image_list = image_list.subset(keep)
                gone = sorted(before - set(np.unique(image_list.labels).tolist()))
                if gone:
                    names = [str(image_list.class_ids[g]) for g in gone[:10]]
                    warnings.warn(
                        f"{image_list.name} ({image_list.split}): after skipping {len(bad)} images, "
                        f"{len(gone)} classes have no image left (original ids {names}); "
                        "their labels stay reserved.",
                        stacklevel=2,
                    )
        self.image_list = image_list
        self.paths = image_list.paths
        self.labels = image_list.labels
        self.class_ids = image_list.class_ids
        self.class_names = image_list.class_names
        self.num_classes = image_list.num_classes
        self.root = image_list.root
        self.split = image_list.split
        self.name = image_list.name

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self.paths)

    def load_image(self, i: int) -> Image.Image:
        """Image ``i`` as an 8-bit PIL image in ``self.mode`` (:func:`decode_image`); errors
        name the path."""
        path = self.paths[i]
        try:
            return decode_image(path, mode=self.mode, max_bytes=self.max_decode_bytes)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.name}: image not found: {_describe(self.image_list, i)}"
            ) from None
        except (OSError, ImageDecodeError) as e:
            reason = e.reason if isinstance(e, ImageDecodeError) else e
            raise OSError(
                f"{self.name}: cannot read image {_describe(self.image_list, i)}: {reason}. "
                "Build the dataset with verify='open', skip_missing=True to drop unreadable files "
                "(in a YAML config: data.options.verify: open and data.options.skip_missing: true)."
            ) from e

    def __getitem__(self, i: int):
        img = self.load_image(i)
        if self.transform is not None:
            img = self.transform(img)
        else:
            img = TF.to_dtype(TF.to_image(img), torch.float32, scale=True)
        return img, int(self.labels[i])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, split={self.split!r}, images={len(self)}, "
            f"classes={self.num_classes}, skipped={self.num_skipped}, root={self.root!r})"
        )

"""Warnings about how a run reads its image files, from a few sampled files (headers, and for
the colour check small decoded copies), before the first step:

* :func:`size_warnings`: images enlarged more than :data:`MAX_ENLARGEMENT` times (per side) by
  the transform, or inputs under 64 px fed to an ImageNet architecture;
* :func:`grey_colour_warning`: colour images read as grayscale (``data.options.mode: L``).

Only file-based datasets (``dataset.paths``) are inspected; arrays (the built-in benchmarks)
are what their loaders made them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["MAX_ENLARGEMENT", "SAMPLED_FILES", "sample_paths", "native_size", "size_warnings",
           "patch_grid_warning", "is_colour_image", "grey_colour_warning"]

#: Per-side enlargement (network input side / the image's longer side) above which a run warns:
#: more computation for no new detail, and blur the network was not trained on.
MAX_ENLARGEMENT = 2.0
#: Files sampled (evenly spread over the dataset) for these checks.
SAMPLED_FILES = 8
#: A pixel is coloured when its channels differ by more than this many 8-bit levels (JPEG noise on
#: a grey image stays within a few levels); an image is colour when over 1 % of its pixels are.
CHROMA_LEVELS = 24
COLOUR_PIXEL_FRACTION = 0.01


def sample_paths(dataset, n: int = SAMPLED_FILES) -> list:
    """Up to ``n`` image paths of a file-based dataset, evenly spread (first and last included)."""
    paths = dataset.paths
    if not paths:
        return []
    idx = np.unique(np.linspace(0, len(paths) - 1, num=min(n, len(paths))).round().astype(int))
    return [paths[i] for i in idx]


def native_size(dataset) -> tuple[int, int] | None:
    """(width, height) of the typical image of a file-based dataset: the median of the sampled
    files' headers (None when none can be read)."""
    from PIL import Image

    sizes = []
    for p in sample_paths(dataset):
        try:
            with Image.open(p) as im:
                sizes.append(im.size)
        except OSError:
            continue
    if not sizes:
        return None
    sizes.sort(key=lambda s: max(s))
    return sizes[len(sizes) // 2]


def size_warnings(cfg, dataset, sample_shape: tuple[int, ...]) -> list[str]:
    """Warnings about image size vs architecture: images that the transform enlarges more than
    :data:`MAX_ENLARGEMENT` times per side (the input's shorter side against the image's longer
    side, so a lower bound of the real factor), and inputs under 64 px fed to an ImageNet
    architecture."""
    if len(sample_shape) != 3:
        return []
    out = []
    h, w = sample_shape[-2:]
    native = native_size(dataset)
    if native is not None:
        nw, nh = native
        factor = min(h, w) / max(nw, nh, 1)
        if factor > MAX_ENLARGEMENT:
            small = ("a small model at native size is faster (recipes/own_folder_small_grey.yaml)"
                     if max(nw, nh) <= 64 else "larger images would give the network the detail it expects")
            out.append(
                f"images are {nw}x{nh} px but data.transform '{cfg.data.transform}' enlarges them to "
                f"{w}x{h} ({factor:.1f}x per side): about {(h * w) // max(nw * nh, 1)}x the computation with "
                f"no new detail; {small}, or lower data.transform_options (e.g. the resize / crop size)"
            )
    from deepmetric import models as M

    name = M.model_backbone(cfg.model.name, cfg.model.options)
    if name in M.list_backbones() and M.get_backbone_spec(name).default_in_chans == 3 and min(h, w) < 64:
        out.append(
            f"model '{name}' is an ImageNet architecture made for about 224x224 inputs; on {w}x{h} "
            "inputs its last feature map is tiny (it downsamples 32x). Use model.name: glyph_resnet "
            "(or lenet) for small images, or enlarge them"
        )
    return out


def patch_grid_warning(cfg, model, sample_shape: tuple[int, ...]) -> str | None:
    """A warning when the input's height or width is not a multiple of a vision transformer's
    patch (timm's ``PatchEmbed``): its strided convolution covers only whole patches, so the
    last rows / columns of every image never reach the network (timm builds the model and runs
    it without a word).  A warning, not an error: runs trained so keep loading."""
    if len(sample_shape) != 3:
        return None
    patch = next((m.patch_size for m in model.modules()
                  if type(m).__name__.endswith("PatchEmbed") and getattr(m, "patch_size", None)), None)
    if patch is None:
        return None
    ph, pw = (patch, patch) if isinstance(patch, int) else tuple(patch)[:2]
    h, w = sample_shape[-2:]
    if h % ph == 0 and w % pw == 0:
        return None
    lower, upper = f"{h // ph * ph}x{w // pw * pw}", f"{-(-h // ph) * ph}x{-(-w // pw) * pw}"
    return (f"model '{cfg.model.name}' cuts its {h}x{w} inputs into {ph}x{pw} patches: it sees only {lower}, the "
            f"last {h % ph} pixel row(s) and {w % pw} column(s) of every image never reach it; make the input "
            f"{lower} or {upper} (data.transform_options, and model.options.img_size if set)")


def is_colour_image(path: Any, side: int = 64) -> bool | None:
    """Whether the image file holds colour (not only grey levels), judged on a copy of at most
    ``side`` px; None when it cannot be read.  Files stored as RGB with equal channels are grey."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            if im.mode in ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"):
                return False
            im.draft("RGB", (side, side))  # JPEG: decode at a reduced size
            rgb = im.convert("RGB")
            rgb.thumbnail((side, side))
            a = np.asarray(rgb, dtype=np.int16)
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    spread = a.max(axis=2) - a.min(axis=2)
    return bool(np.mean(spread > CHROMA_LEVELS) > COLOUR_PIXEL_FRACTION)


def grey_colour_warning(cfg, dataset) -> str | None:
    """A warning when a file-based dataset reads its images as grayscale (``mode`` L) but
    sampled files hold colour: the colour is dropped without a word otherwise."""
    if dataset.mode != "L":
        return None
    paths = sample_paths(dataset)
    colour = [p for p in paths if is_colour_image(p)]
    if not colour:
        return None
    return (f"data.options.mode is 'L': images are read as grayscale, but {len(colour)} of {len(paths)} sampled "
            f"images are colour (e.g. {colour[0]}), and their colour is lost. For colour photos use "
            "recipes/own_folder.yaml (an ImageNet network on colour input), or set data.options.mode: RGB "
            "with a 3-channel transform and model")

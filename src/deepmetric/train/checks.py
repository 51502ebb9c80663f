"""Checks of a built run before the first training step: the images, the model's input and
the class count (the config's own checks, values and option names, are
:mod:`deepmetric.run.config_checks`).

Everything here that can fail does so *before* training, with a message in the terms of the
YAML config (``config key 'model.options.in_chans'``, ``data.options.skip_missing: true``):

* :func:`check_out_dir_outside_data`: the run directory is not inside a ``folder`` dataset's root
  (its figures would become a class);
* :func:`check_images_readable`: every image of a file-based split opens (PIL reads the header
  and ``verify()`` checks the file structure; nothing is decoded);
* :func:`check_model_input`: the transform's channels against the model's first convolution,
  then one dry forward pass of two training images;
* :func:`~deepmetric.train.image_warnings.size_warnings`: images enlarged more than 2x by the
  transform, or small inputs fed to an ImageNet architecture;
  :func:`~deepmetric.train.image_warnings.grey_colour_warning`: colour files read as grayscale;
  :func:`~deepmetric.train.image_warnings.patch_grid_warning`: a ViT's input not a multiple of
  its patch (the last pixel rows and columns never reach it);
  :func:`few_classes_warning`.

:func:`check_run` runs them all, as the loop does.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from deepmetric.run.checkpoint import rng_preserved
from deepmetric.run.config import Config
from deepmetric.run.evaluation import split_names

from .image_warnings import grey_colour_warning, patch_grid_warning, size_warnings

__all__ = ["FEW_CLASSES", "check_out_dir_outside_data", "check_images_readable", "check_model_input",
           "check_loss_inputs", "few_classes_warning", "short_input_warnings", "check_run"]

#: Fewer training classes than this triggers :func:`few_classes_warning`.
FEW_CLASSES = 20


# --------------------------------------------------------------------------- images
def check_out_dir_outside_data(cfg: Config) -> None:
    """ValueError when ``train.out_dir`` lies inside the root of a ``folder`` dataset: every
    sub-folder of the root is a class, so the run directory became one (empty at the first
    start: "'runs' (empty)"; with the report's figures in it, a class of PNGs in the test split
    and in an index of the folder).  A csv or a benchmark reads only the files it lists."""
    if cfg.data.name != "folder" or not cfg.data.root:
        return
    root, out = Path(cfg.data.root).expanduser().resolve(), Path(cfg.train.out_dir).expanduser().resolve()
    if out == root or root in out.parents:
        inside = out.relative_to(root).parts
        what = f"a class folder '{inside[0]}'" if inside else "the data folder itself"
        raise ValueError(f"config key 'train.out_dir' ({cfg.train.out_dir}) is inside data.root ({cfg.data.root}): "
                         f"the folder dataset reads every sub-folder of its root as a class, so the run (its "
                         f"checkpoints and the report's figures) would be {what}; put the run outside the data folder")


def _header_problem(path: str) -> str | None:
    """None when PIL can open ``path`` and verify its structure, else the reason (one line)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.verify()
    except FileNotFoundError:
        return "file not found"
    except UnidentifiedImageError:
        return "not an image PIL can identify"
    except (OSError, SyntaxError, ValueError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def check_images_readable(dataset, split: str, *, show: int = 10) -> tuple[int, float]:
    """Open the header of every image of a file-based ``dataset`` (one with ``paths``); raise
    ``OSError`` listing the unreadable files.  Returns ``(images checked, seconds)``;
    in-memory datasets (glyphs, Fashion-MNIST, synthetic) check nothing."""
    from deepmetric.data import with_dataset_defaults

    paths = with_dataset_defaults(dataset).paths  # any dataset (torch's own have no paths)
    if not paths:
        return 0, 0.0
    t0 = time.perf_counter()
    bad = []
    for p in paths:
        why = _header_problem(p)
        if why is not None:
            bad.append((p, why))
    if bad:
        shown = "\n  ".join(f"{p}: {why}" for p, why in bad[:show])
        more = f"\n  ... and {len(bad) - show} more" if len(bad) > show else ""
        raise OSError(
            f"data split '{split}': {len(bad)} of {len(paths)} images cannot be read:\n  {shown}{more}\n"
            "Fix or delete these files, or drop them with data.options.skip_missing: true and "
            "data.options.verify: open (training has not started)."
        )
    return len(paths), time.perf_counter() - t0


# --------------------------------------------------------------------------- model input
def _first_conv(model: nn.Module) -> tuple[str, nn.Module] | None:
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.Conv1d, nn.Conv3d)):
            return name, mod
    return None


def _channel_hint(cfg: Config, want: int) -> str:
    from deepmetric.data import transform_options

    d = cfg.data
    if d.transform is not None and "channels" in transform_options(d.transform):  # glyph, mnist
        return f"data.transform_options.channels: {want}"
    if d.transform in ("resize_crop", "short_side"):
        return f"a transform with {want} channel(s) (resize_crop and short_side always give 3)"
    if d.transform is None and want in (1, 3):
        return f"data.options.mode: {'L' if want == 1 else 'RGB'}"
    return f"a transform that gives {want} channel(s)"


def check_model_input(model: nn.Module, dataset, cfg: Config) -> tuple[int, ...]:
    """Compare the channels of one transformed training sample with the model's first
    convolution, then run the model on two samples (eval mode, no gradients).  Raises a
    ``ValueError`` in config terms; returns the sample shape.  RNG states are not touched
    beyond what the caller saves (the training transform is random)."""
    from deepmetric.data import batch_transform_of

    xs = torch.stack([torch.as_tensor(dataset[i][0]) for i in range(min(2, len(dataset)))])
    # a batched augmentation (data.transform_options.batched) finishes the images per batch,
    # as the loader's collate does: the model sees them only after it
    batch_transform = batch_transform_of(dataset.transform)
    if batch_transform is not None:
        xs = batch_transform(xs)
    x0 = xs[0]
    shape = tuple(x0.shape)
    m = cfg.model
    conv = _first_conv(model)
    if conv is not None and x0.dim() == 3 and isinstance(conv[1], nn.Conv2d):
        cname, c = conv
        if c.in_channels != x0.shape[0]:
            have, want = x0.shape[0], c.in_channels
            what = f"data.transform '{cfg.data.transform}'" if cfg.data.transform else "the dataset"
            raise ValueError(
                f"model '{m.name}' takes {want}-channel images (its first convolution '{cname}' has "
                f"in_channels={want}) but {what} gives {have}-channel images of shape {list(shape)}. "
                f"Set model.options.in_chans: {have}, or use {_channel_hint(cfg, want)}."
            )
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(xs)
    except Exception as exc:  # noqa: BLE001 - any failure here is reported in config terms
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"model '{m.name}' cannot process the training images (a test forward pass on {len(xs)} "
            f"images of shape {list(shape)} failed: {first}). Check model.options and data.transform "
            "(size, channels)."
        ) from None
    finally:
        model.train(was)
    if not isinstance(out, dict) or "embedding" not in out:
        raise ValueError(f"model '{m.name}' must return a dict with an 'embedding' entry, "
                         f"got {type(out).__name__}")
    check_loss_inputs(cfg, sorted(out))
    return shape


def check_loss_inputs(cfg: Config, outputs: list[str]) -> None:
    """Every loss term's ``input`` is among the model's ``outputs``, and a projection head
    (``model.options.projection``) is read by some term: unread, it would never train (and
    DDP refuses parameters without a gradient)."""
    for i, term in enumerate(cfg.loss):
        if term.input not in outputs:
            hint = (" (add model.options.projection: {dim: ..., norm: l2})" if term.input == "projection" else
                    " (a loss reading logits needs a model with a classifier)" if term.input == "logits" else "")
            raise ValueError(f"config key 'loss.{i}.input': the model '{cfg.model.name}' has no output "
                             f"'{term.input}'; it returns {', '.join(outputs)}{hint}")
    if "projection" in outputs and not any(t.input == "projection" for t in cfg.loss):
        raise ValueError("config key 'model.options.projection': no loss term reads the projection "
                         "(set loss.N.input: projection on the term that should train through it)")


#: Losses whose logits are plain inner products, with no temperature: on inputs about 1 long
#: their softmax is nearly flat and they barely train (ALMN, Eq. 8: x_g . c against x_j . c).
NO_TEMPERATURE_LOSSES = ("almn",)


def short_input_warnings(cfg: Config, model: nn.Module) -> list[str]:
    """A warning per loss term of :data:`NO_TEMPERATURE_LOSSES` that reads an input the model
    normalises to about unit length (norm ``l2``, or ``bn`` with ``bn_divide_sqrt_k``).

    On the emoji (2026-11-24) ALMN's loss stayed at log 61 = 4.111 (uniform over a 16 x 4 batch's
    61 candidates) for 2 epochs on such a
    projection and trained on the same projection without the 1 / sqrt(dim) (about 11 long)."""
    from deepmetric.models import EmbeddingHead

    # the EmbeddingHead that normalises each input a loss term can read (None: not normalised here)
    heads = {"embedding": model.head, "projection": None if model.projection is None else model.projection.out}
    warns = []
    for i, term in enumerate(cfg.loss):
        if term.name not in NO_TEMPERATURE_LOSSES:
            continue
        head = heads.get(term.input)
        norm = head.norm if isinstance(head, EmbeddingHead) else None
        short = norm == "l2" or (norm == "bn" and head.bn_divide_sqrt_k)
        if not short:
            continue
        how = "l2-normalised" if norm == "l2" else "BN^ / sqrt(k)"
        fix = ("model.options.projection: {dim: ..., norm: bn, bn_divide_sqrt_k: false}" if term.input == "projection"
               else "model.options.norm: none (its paper's unnormalised embedding), or norm: bn with "
                    "bn_divide_sqrt_k: false")
        warns.append(f"loss.{i} ({term.name}) reads '{term.input}', which is {how}, about 1 long: its logits "
                     f"are inner products without a temperature, so its softmax stays nearly flat and the loss "
                     f"can sit at the log of its candidate count (log 61 for a 16 x 4 batch) without training; give it a longer input ({fix})")
    return warns


def few_classes_warning(num_classes: int, threshold: int = FEW_CLASSES) -> str | None:
    """A warning when the training split has fewer than ``threshold`` classes."""
    if num_classes >= threshold:
        return None
    return (f"only {num_classes} training classes: an embedding learnt from so few classes "
            "generalises poorly to unseen (test) classes; check that training beats the "
            "baselines, and add classes if you can")


# --------------------------------------------------------------------------- as the loop uses them
def check_run(cfg: Config, model: nn.Module, train_set, eval_sets: dict[str, Any]) -> tuple[tuple[int, ...], list[str]]:
    """Checks of the built run, before the first step: image headers of every split, the
    model on two training images, sizes and class count.  Returns ``(input shape, warnings)``;
    the random streams are left as they were."""
    check_images_readable(train_set, cfg.data.train_split)
    for name, ds in split_names(cfg, eval_sets):
        check_images_readable(ds, name)
    for group, sets in (eval_sets.items() if eval_sets and all(isinstance(v, dict) for v in eval_sets.values())
                        else [("test", eval_sets)]):
        labels = np.concatenate([np.asarray(ds.labels).reshape(-1) for ds in sets.values()]) if sets else []
        n = len(np.unique(labels))
        if sets and n < 2:
            how = ("give data.val_classes at least 2 classes" if group == "val" else
                   "the test split needs at least 2 classes (check data.options and eval.split)")
            raise ValueError(f"data split '{group}' has {n} class(es): retrieval and clustering metrics need "
                             f"at least 2 classes; {how} (training has not started)")
    with rng_preserved():
        shape = check_model_input(model, train_set, cfg)
    warns = size_warnings(cfg, train_set, shape) + short_input_warnings(cfg, model)
    for extra in (grey_colour_warning(cfg, train_set), patch_grid_warning(cfg, model, shape)):
        if extra is not None:
            warns.append(extra)
    n = train_set.num_classes
    if n is None:
        n = len(np.unique(np.asarray(train_set.labels)))
    # zero-shot only: in a classification protocol the test classes are the training classes
    same_classes = cfg.eval.classification or cfg.data.options.get("protocol") == "classification"
    w = None if same_classes else few_classes_warning(int(n))
    if w is not None:
        warns.append(w)
    return shape, warns



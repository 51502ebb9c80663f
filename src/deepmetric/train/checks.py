"""Checks that run before the first training step, and the baselines a run is compared with.

Everything here that can fail does so *before* training, with a message in the terms of the
YAML config (``config key 'eval.best_metric'``, ``data.options.skip_missing: true``):

* :func:`check_config_options`: unknown keys inside the free-form ``options`` mappings of
  ``data``, ``data.transform_options``, ``model`` and ``loss.i``, with the closest valid name
  (``unknown option 'alpah' (did you mean 'alpha'?)``);
* :func:`check_metric_names`: ``eval.best_metric`` and ``schedule.temperature.monitor``
  against :func:`expected_metrics`, the metric names the evaluation will produce;
* :func:`check_images_readable`: every image of a file-based split opens (PIL reads the header
  and ``verify()`` checks the file structure; nothing is decoded);
* :func:`check_model_input`: the transform's channels against the model's first convolution,
  then one dry forward pass of two training images;
* :func:`size_warnings` (from :mod:`.image_warnings`): images enlarged more than 2x by the
  transform, or small inputs fed to an ImageNet architecture; :func:`grey_colour_warning`:
  colour files read as grayscale; :func:`few_classes_warning`.

Baselines: :func:`raw_pixel_baseline` evaluates the flattened, l2-normalised pixels of the
evaluation images (images up to 64 x 64) with :func:`deepmetric.evaluate.evaluate`, the
nearest-neighbour retrieval that needs no training at all.
"""
from __future__ import annotations

import contextlib
import difflib
import time
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from ..models import pooling_note
from .config import Config, ConfigError
from .image_warnings import grey_colour_warning, native_size, size_warnings

__all__ = [
    "FEW_CLASSES",
    "RAW_PIXEL_MAX_SIDE",
    "expected_metrics",
    "check_metric_names",
    "check_config_options",
    "unknown_option_error",
    "check_images_readable",
    "check_model_input",
    "check_loss_inputs",
    "size_warnings",
    "native_size",
    "grey_colour_warning",
    "few_classes_warning",
    "short_input_warnings",
    "pixel_rows",
    "backbone_features_baseline",
    "raw_pixel_baseline",
    "rng_preserved",
    "check_config",
    "check_run",
    "compute_baselines",
    "emoji_pixel_baseline",
]

#: Fewer training classes than this triggers :func:`few_classes_warning`.
FEW_CLASSES = 20
#: Images with sides up to this many pixels are small (``size_warnings``).  The raw-pixel
#: baseline has no side limit of its own any more: it is bounded by its cost (below).
RAW_PIXEL_MAX_SIDE = 64
#: Raw-pixel baseline limits, measured with ``bench/raw_pixel_cost.py`` (bench/RESULTS.md,
#: "Raw-pixel baseline"): the exact search and k-means on the emoji test split (5,635 images)
#: at 64 / 96 / 128 px.  Time: the estimated seconds (multiply-adds of the k-NN pass,
#: queries x gallery x pixels, plus those of k-means for NMI / F1, samples x classes x pixels
#: x its 20 iterations, at the rate below) must stay within this; when only the retrieval
#: metrics fit, NMI and F1 are left out.
RAW_PIXEL_MAX_SECONDS = 300.0
#: Multiply-adds per second assumed by the estimate: what one thread of the 2-core development
#: machine gave under load (about 2e10 for both the k-NN pass and k-means).
RAW_PIXEL_MACS_PER_SECOND = 2e10
#: The same time bound in multiply-adds (``raw_pixel_baseline(max_work=...)``).
RAW_PIXEL_MAX_WORK = RAW_PIXEL_MAX_SECONDS * RAW_PIXEL_MACS_PER_SECOND
#: Memory: the estimated peak must stay within this many bytes (NMI and F1 are left out when
#: only the search fits).
RAW_PIXEL_MAX_BYTES = 8 * 2**30
#: Peak memory in copies of the float32 pixel rows, measured above with some margin: the
#: search (the rows, the evaluator's normalised copy, its query and gallery copies: 4.0-4.1)
#: and k-means (further copies of the rows and of the centroids: 8.9-9.1).
RAW_PIXEL_SEARCH_COPIES = 5
RAW_PIXEL_KMEANS_COPIES = 10


# --------------------------------------------------------------------------- option names
def unknown_option_error(path: str, key: str, accepted: Iterable[str], owner: str) -> ConfigError:
    """``config key 'loss.0.options.alpah': unknown option 'alpah' for loss 'heated_softmax'
    (did you mean 'alpha'?)`` -- or the list of accepted options when nothing is close."""
    accepted = sorted(set(accepted))
    close = difflib.get_close_matches(str(key), accepted, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else f"; accepted: {', '.join(accepted) or 'none'}"
    return ConfigError(f"config key '{path}.{key}': unknown option '{key}' for {owner}{hint}")


def _check_options(path: str, given: Iterable[str], accepted: set[str] | None, owner: str) -> None:
    """Every key of ``given`` must be in ``accepted`` (None: the registry cannot tell, the
    builder checks them itself)."""
    if accepted is None:
        return
    for key in given:
        if key not in accepted:
            raise unknown_option_error(path, key, accepted, owner)


def _unknown_name_error(key: str, what: str, name, names: list[str]) -> ConfigError:
    """``config key 'loss.0.name': unknown loss 'tripet' (did you mean 'triplet'?); available: ...``"""
    close = difflib.get_close_matches(str(name), names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"config key '{key}': unknown {what} '{name}'{hint}; available: {', '.join(names)}")


def check_config_options(cfg: Config) -> None:
    """Unknown keys inside ``data.options``, ``data.transform_options``, ``model.options`` and
    ``loss.i.options`` raise a :class:`ConfigError` naming the full key and the closest valid
    option, before anything is built.  The accepted options come from the registries
    (:func:`~deepmetric.data.dataset_options`, :func:`~deepmetric.data.transform_options`,
    :func:`~deepmetric.models.model_options`, :func:`~deepmetric.losses.loss_options`)."""
    from deepmetric.data import dataset_options, list_transforms, transform_options
    from deepmetric.losses import list_losses, loss_options
    from deepmetric.models import model_options

    d = cfg.data
    try:
        accepted = dataset_options(d.name)
    except (ValueError, TypeError):
        accepted = None  # build_dataset names the unknown dataset itself
    _check_options("data.options", d.options, accepted, f"dataset '{d.name}'")
    if d.transform is not None:
        try:
            accepted = transform_options(d.transform)
        except ValueError:
            raise _unknown_name_error("data.transform", "transform", d.transform, list_transforms()) from None
        _check_options("data.transform_options", d.transform_options, accepted, f"transform '{d.transform}'")

    m = cfg.model
    try:
        accepted = model_options(m.name, m.options)
    except ValueError:
        accepted = None  # create_model names the unknown model itself
    _check_options("model.options", m.options, accepted, f"model '{m.name}'")

    for i, term in enumerate(cfg.loss):
        try:
            accepted = loss_options(term.name)
        except ValueError:
            raise _unknown_name_error(f"loss.{i}.name", "loss", term.name, list_losses()) from None
        _check_options(f"loss.{i}.options", term.options, accepted, f"loss '{term.name}'")


# --------------------------------------------------------------------------- metric names
def expected_metrics(cfg: Config) -> list[str]:
    """The metric names one evaluation with ``cfg.eval`` produces (``recall@K`` for each K,
    ``map@r``, ``r_precision``, ``nmi``, ``f1``, ``top1`` / ``mean_per_class`` with
    ``eval.classification``, ``cross_domain_<retrieval metric>`` with ``eval.cross_domain``), as
    :func:`deepmetric.train.embed.evaluate_model` and :func:`~deepmetric.train.embed.cross_domain_metrics`
    compute them."""
    from deepmetric.evaluate import check_metric_names as check_evaluate_metrics
    from deepmetric.evaluate import metric_keys

    e = cfg.eval
    try:
        wanted = () if e.metrics == [] else check_evaluate_metrics(e.metrics)
    except ValueError as exc:
        raise ConfigError(f"config key 'eval.metrics': {exc}") from None
    names = metric_keys(wanted, e.ks)
    if e.classification:
        names += ["top1", "mean_per_class"]
    if e.cross_domain:
        from .embed import cross_domain_metric_names

        names += [f"cross_domain_{m}" for m in cross_domain_metric_names(cfg)]
    return names


def check_metric_names(cfg: Config) -> list[str]:
    """``eval.best_metric`` (and an evaluation metric as ``schedule.temperature.monitor``) must
    be among :func:`expected_metrics`; returns those names."""
    names = expected_metrics(cfg)

    def fail(key: str, value: str) -> ConfigError:
        close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return ConfigError(f"config key '{key}': '{value}' is not a metric this run computes{hint}; "
                           f"the evaluation gives {', '.join(names)} (see eval.ks, eval.metrics, "
                           "eval.classification)")

    best = cfg.eval.best_metric
    if best is None and cfg.data.has_validation:
        best = "recall@1"  # the default selection metric with a validation split
    if best is not None and best not in names:
        raise fail("eval.best_metric", best)
    t = cfg.schedule.temperature
    if t.monitor != "train_loss" and t.name == "auto_plateau" and t.monitor not in names:
        raise fail("schedule.temperature.monitor", t.monitor)
    return names


# --------------------------------------------------------------------------- images
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
    paths = getattr(dataset, "paths", None)
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
    xs = torch.stack([torch.as_tensor(dataset[i][0]) for i in range(min(2, len(dataset)))])
    # a batched augmentation (data.transform_options.batched) finishes the images per batch,
    # as the loader's collate does: the model sees them only after it
    batch_transform = getattr(getattr(dataset, "transform", None), "batch_transform", None)
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

    On the emoji (2026-11-24) ALMN's loss stayed at log(batch) = 4.111 for 468 steps on such a
    projection and trained on the same projection without the 1 / sqrt(dim) (about 11 long)."""
    # the EmbeddingHead that normalises each input a loss term can read (None: not normalised here)
    heads = {"embedding": getattr(model, "head", None),
             "projection": getattr(getattr(model, "projection", None), "out", None)}
    warns = []
    for i, term in enumerate(cfg.loss):
        if term.name not in NO_TEMPERATURE_LOSSES:
            continue
        head = heads.get(term.input)
        norm = getattr(head, "norm", None)
        short = norm == "l2" or (norm == "bn" and getattr(head, "bn_divide_sqrt_k", False))
        if not short:
            continue
        how = "l2-normalised" if norm == "l2" else "BN^ / sqrt(k)"
        fix = ("model.options.projection: {dim: ..., norm: bn, bn_divide_sqrt_k: false}" if term.input == "projection"
               else "model.options.norm: none (its paper's unnormalised embedding), or norm: bn with "
                    "bn_divide_sqrt_k: false")
        warns.append(f"loss.{i} ({term.name}) reads '{term.input}', which is {how}, about 1 long: its logits "
                     f"are inner products without a temperature, so its softmax stays nearly flat and the loss "
                     f"can sit at log(batch size) without training; give it a longer input ({fix})")
    return warns


def few_classes_warning(num_classes: int, threshold: int = FEW_CLASSES) -> str | None:
    """A warning when the training split has fewer than ``threshold`` classes."""
    if num_classes >= threshold:
        return None
    return (f"only {num_classes} training classes: an embedding learnt from so few classes "
            "generalises poorly to unseen (test) classes; check that training beats the "
            "baselines, and add classes if you can")


# --------------------------------------------------------------------------- raw pixels
def pixel_rows(dataset, max_side: int | None = None) -> tuple[np.ndarray | None, str]:
    """Float32 [N, D] pixel rows of every image of ``dataset``, or (None, why not): images of
    different sizes, sides over ``max_side`` (None: any size), samples that are not images.

    File-based datasets use the images as stored (values in [0, 1], in the dataset's mode);
    in-memory datasets use their samples with the test transform.  The rows are written into
    one preallocated array (no second copy while reading)."""
    n = len(dataset)
    if n == 0:
        return None, "empty split"
    if hasattr(dataset, "load_image"):
        from torchvision.transforms.v2 import functional as TF

        first = dataset.load_image(0)
        size = first.size
        if max_side is not None and max(size) > max_side:
            return None, f"images are {size[0]}x{size[1]} px (baseline only up to {max_side}x{max_side})"
        rows = None
        for i in range(n):
            im = first if i == 0 else dataset.load_image(i)
            if im.size != size:
                return None, f"image sizes differ ({size[0]}x{size[1]} and {im.size[0]}x{im.size[1]})"
            row = TF.to_dtype(TF.to_image(im), torch.float32, scale=True).reshape(-1)
            if rows is None:
                rows = np.empty((n, row.numel()), np.float32)
            rows[i] = row.numpy()
        return rows, f"{size[0]}x{size[1]}x{len(first.getbands())}"
    x0 = torch.as_tensor(dataset[0][0])
    if x0.dim() != 3:
        return None, "samples are not images"
    if max_side is not None and max(x0.shape[-2:]) > max_side:
        return None, f"images are {x0.shape[-1]}x{x0.shape[-2]} px (baseline only up to {max_side}x{max_side})"
    rows = np.empty((n, x0.numel()), np.float32)
    for i in range(n):
        rows[i] = (x0 if i == 0 else torch.as_tensor(dataset[i][0])).reshape(-1).float().numpy()
    return rows, f"{x0.shape[-1]}x{x0.shape[-2]}x{x0.shape[0]}"


def _format_bytes(b: float) -> str:
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def _format_seconds(work: float) -> str:
    """Multiply-adds as the seconds they take at ``RAW_PIXEL_MACS_PER_SECOND``."""
    s = work / RAW_PIXEL_MACS_PER_SECOND
    return f"{s:.0f} s" if s >= 10 else f"{s:.2g} s"


def raw_pixel_baseline(eval_sets: dict[str, Any], cfg: Config, *,
                       max_side: int | None = None,
                       max_work: float = RAW_PIXEL_MAX_WORK,
                       max_bytes: float = RAW_PIXEL_MAX_BYTES,
                       device: torch.device | str | None = None) -> tuple[dict[str, float] | None, str]:
    """Evaluate raw pixels as embeddings: every image flattened and l2-normalised (cosine
    nearest neighbours), with the metrics of ``cfg.eval``.  ``eval_sets`` is ``{"query": ds}``
    or ``{"query": ds, "gallery": ds}``.

    Returns ``(metrics, description)``; metrics is None (and the description says why) when the
    images differ in size, are larger than ``max_side`` x ``max_side`` (None: no limit), or,
    decided before any image is read, when the estimated peak memory
    (``RAW_PIXEL_SEARCH_COPIES`` x the float32 rows) exceeds ``max_bytes`` or the exact k-NN
    search exceeds ``max_work`` multiply-adds (``RAW_PIXEL_MAX_SECONDS`` at
    ``RAW_PIXEL_MACS_PER_SECOND``).  When the search fits but k-means (NMI, F1) would not
    (its time added to the search's, or ``RAW_PIXEL_KMEANS_COPIES`` x the rows), those two
    are left out and the description says so.  Retrieval and clustering
    metrics are evaluated in two calls (the same values as one): the evaluator's copies of the
    rows for the search are freed before k-means makes its own.  ``device`` (the training
    device): the search runs where :func:`~deepmetric.train.embed.eval_search_device` says (a
    CUDA run: on its GPU when the rows fit in its free memory; None: on the CPU); the limits
    above stay those of the CPU."""
    from deepmetric.evaluate import CLUSTERING_METRICS, DEFAULT_METRICS, evaluate
    from deepmetric.evaluate.clustering import KMEANS_NITER

    from .embed import dataset_query_gallery_masks, eval_search_device, place_for_search

    keys = [k for k in ("query", "gallery") if k in eval_sets]
    n = sum(len(eval_sets[k]) for k in keys)
    first = eval_sets[keys[0]]
    if n == 0:
        return None, "empty split"
    labels = np.concatenate([np.asarray(eval_sets[k].labels, dtype=np.int64) for k in keys])
    # a split that marks its own queries and gallery (glyphs cross_family) is searched like the
    # trained embedding: its queries against its gallery
    masks = dataset_query_gallery_masks(first) if len(keys) == 1 else {}
    if len(keys) == 2:
        is_query = np.r_[np.ones(len(eval_sets["query"]), bool), np.zeros(len(eval_sets["gallery"]), bool)]
        masks = {"is_query": is_query, "is_gallery": ~is_query}
    if masks:
        pairs = float(masks["is_query"].sum()) * float(masks["is_gallery"].sum())
        evaluated = masks["is_query"] | masks["is_gallery"]
    else:
        pairs = float(n) * n
        evaluated = np.ones(n, bool)
    if hasattr(first, "load_image"):
        im = first.load_image(0)
        d = im.size[0] * im.size[1] * len(im.getbands())
    else:
        d = int(torch.as_tensor(first[0][0]).numel())
    # the limits, decided before any image is read
    e = cfg.eval
    rows_bytes = 4.0 * n * d
    peak = RAW_PIXEL_SEARCH_COPIES * rows_bytes
    if peak > max_bytes:
        return None, (f"{n} images x {d} pixels: an exact search needs about {_format_bytes(peak)} of memory, "
                      f"more than the {_format_bytes(max_bytes)} allowed (RAW_PIXEL_MAX_BYTES)")
    search_work = pairs * d
    if search_work > max_work:
        return None, (f"{n} images x {d} pixels: an exact search would take about "
                      f"{_format_seconds(search_work)} here, more than the {_format_seconds(max_work)} "
                      f"allowed (RAW_PIXEL_MAX_SECONDS)")
    wanted = list(e.metrics) if e.metrics is not None else list(DEFAULT_METRICS)  # None: the default set
    clustering = [m for m in wanted if m in CLUSTERING_METRICS]
    retrieval = [m for m in wanted if m not in CLUSTERING_METRICS]
    kmeans_work = (float(evaluated.sum()) * len(np.unique(labels[evaluated])) * d * KMEANS_NITER
                   * e.kmeans_restarts) if clustering else 0.0
    left_out = ""
    if clustering and search_work + kmeans_work > max_work:
        left_out = (f"; {' and '.join(clustering)} left out: k-means would add about "
                    f"{_format_seconds(kmeans_work)}")
    elif clustering and RAW_PIXEL_KMEANS_COPIES * rows_bytes > max_bytes:
        left_out = (f"; {' and '.join(clustering)} left out: k-means would need about "
                    f"{_format_bytes(RAW_PIXEL_KMEANS_COPIES * rows_bytes)} of memory")
    if left_out:
        if not retrieval:
            return None, f"{n} images x {d} pixels{left_out}"
        clustering = []

    parts = []
    desc = ""
    for key in keys:
        x, desc_or_why = pixel_rows(eval_sets[key], max_side)
        if x is None:
            return None, desc_or_why
        parts.append(x)
        desc = desc_or_why
    x = parts[0] if len(parts) == 1 else np.concatenate(parts)
    del parts
    metrics: dict[str, float] = {}
    if retrieval:
        where = eval_search_device(cfg, device, nbytes=x.nbytes) if device is not None else torch.device("cpu")
        metrics.update(evaluate(place_for_search(x, where), labels, ks=tuple(e.ks), metrics=retrieval,
                                seed=cfg.train.seed, **masks))
    if clustering:  # k-means runs on the CPU
        metrics.update(evaluate(x, labels, ks=tuple(e.ks), metrics=clustering, seed=cfg.train.seed,
                                kmeans_restarts=e.kmeans_restarts, **masks))
    return {k: float(v) for k, v in metrics.items()}, f"raw pixels ({desc} = {d}-d{left_out})"


def backbone_features_baseline(cfg: Config, dataset, *, num_classes: int | None = None,
                               device: torch.device | str = "cpu") -> tuple[dict[str, float], str, dict]:
    """Evaluate the backbone's pooled features before any training (``output="features"``,
    e.g. EfficientNet-Lite0's 1,280 ImageNet features): what the (pretrained) network gives
    without metric learning.  Evaluated like the trained embedding: the metrics of
    ``cfg.eval``, the split's own query/gallery masks, the network on ``device`` and the
    search where :func:`~deepmetric.train.embed.eval_search_device` says.  Returns
    ``(metrics, description, features)``, features as
    :func:`~deepmetric.train.embed.compute_embeddings` returns them (numpy)."""
    from deepmetric.evaluate import evaluate

    from .builders import build_model, seed_everything
    from .embed import compute_embeddings, dataset_query_gallery_masks, eval_search_device, place_for_search

    seed_everything(cfg.train.seed)
    device = torch.device(device)
    model = build_model(cfg, num_classes=num_classes or 2).to(device)  # the classifier, if any, is not used
    with torch.no_grad():
        f = compute_embeddings(model, dataset, batch_size=cfg.eval.batch_size, output="features", device=device,
                               as_tensor=True)
    x = f["embeddings"]
    where = eval_search_device(cfg, device, nbytes=4 * x.numel())
    m = evaluate(place_for_search(x, where), f["labels"], ks=tuple(cfg.eval.ks), metrics=cfg.eval.metrics,
                 seed=cfg.train.seed, kmeans_restarts=cfg.eval.kmeans_restarts, **dataset_query_gallery_masks(dataset))
    f["embeddings"] = x.cpu().numpy()
    weights = cfg.model.options.get("pretrained") or "untrained"
    desc = (f"{cfg.model.name} {weights} features ({f['embeddings'].shape[1]}-d"
            f"{pooling_note(cfg.model.options.get('pool', 'avg'))})")
    return {k: float(v) for k, v in m.items()}, desc, f


# --------------------------------------------------------------------------- as the loop uses them
@contextlib.contextmanager
def rng_preserved():
    """Run a block without changing the Python / NumPy / torch random streams (checks and
    baselines must not change what training does)."""
    from .checkpoint import get_rng_state, set_rng_state

    saved = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


def check_config(cfg: Config) -> None:
    """Everything checkable from the config alone (before data or model are built)."""
    check_config_options(cfg)
    check_metric_names(cfg)


def split_names(cfg: Config, eval_sets: dict[str, Any]) -> list[tuple[str, Any]]:
    """``[(split name, dataset)]`` of the evaluation splits: ``eval_sets`` is ``{"val": {"query":
    ds}, "test": {"query": ds[, "gallery": ds]}}`` (or one such inner mapping)."""
    if eval_sets and all(isinstance(v, dict) for v in eval_sets.values()):
        groups = list(eval_sets.items())
    else:
        groups = [("test", eval_sets)]
    out = []
    for group, sets in groups:
        for key, ds in sets.items():
            if group == "test":
                name = cfg.eval.split if key == "query" else (cfg.eval.gallery_split or key)
            else:
                name = group if key == "query" else f"{group} {key}"
            out.append((name, ds))
    return out


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
    grey = grey_colour_warning(cfg, train_set)
    if grey is not None:
        warns.append(grey)
    n = getattr(train_set, "num_classes", None)
    if n is None:
        n = len(np.unique(np.asarray(train_set.labels)))
    # zero-shot only: in a classification protocol the test classes are the training classes
    same_classes = cfg.eval.classification or cfg.data.options.get("protocol") == "classification"
    w = None if same_classes else few_classes_warning(int(n))
    if w is not None:
        warns.append(w)
    return shape, warns


def compute_baselines(model: nn.Module, losses, eval_sets: dict[str, Any], cfg: Config, *,
                      device: torch.device, at_start: dict[str, float] | None = None) -> dict[str, dict]:
    """``{"epoch0": {"label", "metrics"}, "raw_pixels": {"label", "metrics"} or {"label",
    "skipped"}}``: the network before training (``at_start`` when already evaluated) and raw
    pixels, evaluated like the trained model."""
    from .embed import evaluate_model

    out: dict[str, dict] = {}
    pre = cfg.model.options.get("pretrained")
    label = f"epoch 0 ({'pretrained' if pre else 'untrained'} network)"
    with rng_preserved():
        if at_start is None:
            at_start, _ = evaluate_model(model, eval_sets, cfg, device=device, losses=losses)
        out["epoch0"] = {"label": label, "metrics": dict(at_start)}
        metrics, desc = raw_pixel_baseline(eval_sets, cfg, device=device)
    if metrics is not None:
        out["raw_pixels"] = {"label": desc, "metrics": metrics}
    else:
        out["raw_pixels"] = {"label": "raw pixels", "skipped": desc}
    return out


def emoji_pixel_baseline(split: str = "test", root=None, *, size: int = 64, vendors=None,
                         ks=(1, 2, 4, 8)) -> dict:
    """Raw-pixel baseline of the emoji benchmark (``deepmetric emoji pixels``): cosine similarity
    of the flattened RGB images in [0, 1].

    Returns ``{"all_vs_all": evaluate(...) (every image a query against all others),
    "cross_vendor": evaluate_cross_domain(...) (each vendor's images against the other vendors'),
    "classes", "images", "vendors"}`` with Recall@K and MAP@R.
    """
    from deepmetric.data.emoji import build_emoji_dataset
    from deepmetric.evaluate import evaluate, evaluate_cross_domain

    ds = build_emoji_dataset(split, root=root, size=size, vendors=vendors)
    x = ds.images.reshape(len(ds), -1).astype(np.float32) / 255.0
    return {"all_vs_all": evaluate(x, ds.labels, ks=ks, metrics=("recall", "map@r")),
            "cross_vendor": evaluate_cross_domain(x, ds.labels, ds.vendor_ids, domain_names=ds.vendors, ks=ks,
                                                  metrics=("recall", "map@r")),
            "classes": ds.num_classes, "images": len(ds), "vendors": ds.vendors}

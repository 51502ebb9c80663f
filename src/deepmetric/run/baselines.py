"""The baselines a run is compared with, evaluated like the trained model (the metrics of
``cfg.eval``, the split's own query / gallery masks, the search where ``eval.device`` says):

* ``epoch0``: the network before training (:func:`compute_baselines`);
* raw pixels (:func:`raw_pixel_baseline`): the flattened, l2-normalised pixels of the
  evaluation images, the nearest-neighbour retrieval that needs no training at all, bounded by
  its estimated cost (below);
* the backbone's pooled (ImageNet) features before any training
  (:func:`backbone_features_baseline`);
* the emoji benchmark's raw-pixel baseline (:func:`emoji_pixel_baseline`, ``deepmetric emoji
  pixels``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ..models import pooling_note
from .builders import build_model, seed_everything
from .checkpoint import rng_preserved
from .config import Config
from .embed import compute_embeddings, dataset_query_gallery_masks
from .evaluation import eval_search_device, evaluate_model, place_for_search

__all__ = ["RAW_PIXEL_MAX_SIDE", "RAW_PIXEL_MAX_SECONDS", "RAW_PIXEL_MACS_PER_SECOND", "RAW_PIXEL_MAX_WORK",
           "RAW_PIXEL_MAX_BYTES", "pixel_rows", "raw_pixel_baseline", "backbone_features_baseline",
           "compute_baselines", "emoji_pixel_baseline"]

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


def pixel_rows(dataset, max_side: int | None = None) -> tuple[np.ndarray | None, str]:
    """Float32 [N, D] pixel rows of every image of ``dataset``, or (None, why not): images of
    different sizes, sides over ``max_side`` (None: any size), samples that are not images.

    File-based datasets use the images as stored (values in [0, 1], in the dataset's mode);
    in-memory datasets use their samples with the test transform.  The rows are written into
    one preallocated array (no second copy while reading)."""
    n = len(dataset)
    if n == 0:
        return None, "empty split"
    if dataset.load_image is not None:
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
    device): the search runs where :func:`~deepmetric.run.evaluation.eval_search_device` says (a
    CUDA run: on its GPU when the rows fit in its free memory; None: on the CPU); the limits
    above stay those of the CPU.  A split from elsewhere (torch's ``Subset``) is given the
    dataset contract's defaults (:func:`~deepmetric.data.contract.with_dataset_defaults`)."""
    from deepmetric.data import with_dataset_defaults
    from deepmetric.evaluate import evaluate

    eval_sets = {k: with_dataset_defaults(ds) for k, ds in eval_sets.items()}
    keys = [k for k in ("query", "gallery") if k in eval_sets]
    layout = _raw_pixel_layout(eval_sets, keys)
    if layout is None:
        return None, "empty split"
    labels, masks, d = layout["labels"], layout["masks"], layout["d"]
    plan = _raw_pixel_plan(layout, cfg, max_work=max_work, max_bytes=max_bytes)
    if "skip" in plan:
        return None, plan["skip"]
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
    e = cfg.eval
    metrics: dict[str, float] = {}
    if plan["retrieval"]:
        where = eval_search_device(cfg, device, nbytes=x.nbytes) if device is not None else torch.device("cpu")
        metrics.update(evaluate(place_for_search(x, where), labels, ks=tuple(e.ks), metrics=plan["retrieval"],
                                seed=cfg.train.seed, **masks))
    if plan["clustering"]:  # k-means runs on the CPU
        metrics.update(evaluate(x, labels, ks=tuple(e.ks), metrics=plan["clustering"], seed=cfg.train.seed,
                                kmeans_restarts=e.kmeans_restarts, **masks))
    return {k: float(v) for k, v in metrics.items()}, f"raw pixels ({desc} = {d}-d{plan['left_out']})"


def _raw_pixel_layout(eval_sets: dict[str, Any], keys: list[str]) -> dict | None:
    """What the raw-pixel baseline's cost depends on, read before any image: ``n`` images of
    ``d`` pixels, the labels, the query / gallery masks, the query x gallery ``pairs`` searched
    and the ``evaluated`` images; None for an empty split."""
    n = sum(len(eval_sets[k]) for k in keys)
    first = eval_sets[keys[0]]
    if n == 0:
        return None
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
    if first.load_image is not None:
        im = first.load_image(0)
        d = im.size[0] * im.size[1] * len(im.getbands())
    else:
        d = int(torch.as_tensor(first[0][0]).numel())
    return {"n": n, "d": d, "labels": labels, "masks": masks, "pairs": pairs, "evaluated": evaluated}


def _raw_pixel_plan(layout: dict, cfg: Config, *, max_work: float, max_bytes: float) -> dict:
    """The limits, decided before any image is read: ``{"skip": why}`` when even the search
    does not fit, else the ``retrieval`` and ``clustering`` metrics to evaluate and what was
    ``left_out`` (k-means, when only the search fits)."""
    from deepmetric.evaluate import CLUSTERING_METRICS, DEFAULT_METRICS
    from deepmetric.evaluate.clustering import KMEANS_NITER

    n, d, labels, evaluated = layout["n"], layout["d"], layout["labels"], layout["evaluated"]
    e = cfg.eval
    rows_bytes = 4.0 * n * d
    peak = RAW_PIXEL_SEARCH_COPIES * rows_bytes
    if peak > max_bytes:
        return {"skip": (f"{n} images x {d} pixels: an exact search needs about {_format_bytes(peak)} of memory, "
                         f"more than the {_format_bytes(max_bytes)} allowed (RAW_PIXEL_MAX_BYTES)")}
    search_work = layout["pairs"] * d
    if search_work > max_work:
        return {"skip": (f"{n} images x {d} pixels: an exact search would take about "
                         f"{_format_seconds(search_work)} here, more than the {_format_seconds(max_work)} "
                         f"allowed (RAW_PIXEL_MAX_SECONDS)")}
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
            return {"skip": f"{n} images x {d} pixels{left_out}"}
        clustering = []
    return {"retrieval": retrieval, "clustering": clustering, "left_out": left_out}


def backbone_features_baseline(cfg: Config, dataset, *, num_classes: int | None = None,
                               device: torch.device | str = "cpu") -> tuple[dict[str, float], str, dict]:
    """Evaluate the backbone's pooled features before any training (``output="features"``,
    e.g. EfficientNet-Lite0's 1,280 ImageNet features): what the (pretrained) network gives
    without metric learning.  Evaluated like the trained embedding: the metrics of
    ``cfg.eval``, the split's own query/gallery masks, the network on ``device`` and the
    search where :func:`~deepmetric.run.evaluation.eval_search_device` says.  Returns
    ``(metrics, description, features)``, features as
    :func:`~deepmetric.run.embed.compute_embeddings` returns them (numpy)."""
    from deepmetric.evaluate import evaluate

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


def compute_baselines(model: nn.Module, losses, eval_sets: dict[str, Any], cfg: Config, *,
                      device: torch.device, at_start: dict[str, float] | None = None) -> dict[str, dict]:
    """``{"epoch0": {"label", "metrics"}, "raw_pixels": {"label", "metrics"} or {"label",
    "skipped"}}``: the network before training (``at_start`` when already evaluated) and raw
    pixels, evaluated like the trained model."""
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


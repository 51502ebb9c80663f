"""Numbers behind the report's plots, computed from plain arrays (no matplotlib here).

Each function reproduces the quantity of one figure or statistic of the three papers (the
heated-up paper's Fig. 1, the gradient norm against alpha, is in
:mod:`deepmetric.report.gradient_norm`):

* :func:`pair_cosine_histograms` - heated-up paper, Fig. 4 (Appendix C): normalised
  histograms of the cosine similarity of same-class and different-class pairs; exact for
  small sets, an unbiased random sample of pairs otherwise (memory stays O(chunk x N)).
* :func:`embedding_2d` - heated-up paper, Fig. 2: the 2-d coordinates to scatter.
* :func:`recall_curve` - Recall@K for a range of K (REFERENCE.md section 5).
* :func:`retrieval_examples` - random and worst queries with their top-k neighbours, right
  and wrong marked (ALMN paper Fig. 8, two-head paper Fig. 9);
  :func:`per_class_recall` - Recall@1 of each query class (best and worst classes).
* :func:`misclassified_neighbours` - two-head paper, Sec. 4.3 / Fig. 10: for misclassified
  test images the nearest training image, and the share whose neighbour carries the
  predicted label (79.34% on Flowers-102 in the paper).
* :func:`read_training_log` - the training loop's JSON-lines log, tolerant of missing keys.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from deepmetric.run.evaluation import place_for_search

__all__ = [
    "read_training_log",
    "TrainingLog",
    "pair_cosine_histograms",
    "embedding_2d",
    "recall_curve",
    "retrieval_examples",
    "per_class_recall",
    "misclassified_neighbours",
]


# --------------------------------------------------------------------------- input checks
def _as_2d_float(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-d array (N x d), got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} must not be empty, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.number):
        raise TypeError(f"{name} must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float64 if arr.dtype == np.float64 else np.float32, copy=False)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return arr


def _as_labels(y: Any, n: int, name: str = "labels") -> np.ndarray:
    arr = np.asarray(y.detach().cpu() if isinstance(y, torch.Tensor) else y)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-d array, got shape {arr.shape}")
    if arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} entries but there are {n} embeddings")
    if not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _l2n(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


# --------------------------------------------------------------------------- training log
class TrainingLog:
    """The records of one ``log.jsonl``: ``steps`` and ``evals`` as lists of dicts.

    :meth:`column` returns one key as a float array with NaN where a record lacks it, so
    plots cope with logs written by older / newer versions of the training loop.
    """

    def __init__(self, steps: list[dict], evals: list[dict], other: list[dict] | None = None):
        self.steps = steps
        self.evals = evals
        self.other = other or []

    def column(self, kind: str, key: str) -> np.ndarray:
        records = self.steps if kind == "step" else self.evals
        out = np.full(len(records), np.nan)
        for i, rec in enumerate(records):
            v = rec.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[i] = float(v)
        return out

    def has(self, kind: str, key: str) -> bool:
        return bool(np.isfinite(self.column(kind, key)).any())

    def metric_keys(self) -> list[str]:
        """Numeric keys of the evaluation records other than the bookkeeping ones."""
        skip = {"type", "epoch", "step", "time", "wall_time", "elapsed", "rank", "split",
                "eval_seconds", "alpha", "lr", "images_per_s"}
        keys: list[str] = []
        for rec in self.evals:
            for k, v in rec.items():
                if k in skip or k in keys:
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    keys.append(k)
        return keys

    def splits(self) -> list:
        """The ``split`` values of the evaluation records in order of appearance (``None``
        for records written before evaluations were tagged ``"val"`` / ``"test"``)."""
        out: list = []
        for rec in self.evals:
            s = rec.get("split")
            if s not in out:
                out.append(s)
        return out

    def baselines(self) -> list[dict]:
        """The ``{"type": "baseline", ...}`` records (epoch-0 / raw-pixel reference metrics)."""
        return [r for r in self.other if r.get("type") == "baseline"]

    def heat_up_steps(self) -> list[float]:
        """Steps of the ``{"type": "heat_up"}`` events (temperature schedule changes)."""
        return [float(r["step"]) for r in self.other
                if r.get("type") == "heat_up" and isinstance(r.get("step"), (int, float))]

    def x_axis(self, kind: str) -> tuple[np.ndarray, str]:
        """Best available x values: the global step, else the epoch, else the record index."""
        n = len(self.steps if kind == "step" else self.evals)
        for key in ("step", "epoch"):
            col = self.column(kind, key)
            if n and np.isfinite(col).all():
                return col, key
        return np.arange(n, dtype=float), "record"


def read_training_log(path: str | Path) -> TrainingLog:
    """Read the training loop's JSON-lines log (``RUN_DIR/log.jsonl``) through
    :func:`deepmetric.run.rundir.read_log` (strict: a truncated last line, a run killed while
    writing, is skipped with a warning; any other malformed line is an error naming the file
    and line number).

    ``{"type": "step", ...}`` per optimisation step and ``{"type": "eval", ...}`` per
    evaluation; records without ``type`` (older logs) are classified by their keys (a ``loss``
    -> step; any ``recall@``/``nmi`` key -> eval).
    """
    from deepmetric.run.rundir import read_log as read_records

    steps: list[dict] = []
    evals: list[dict] = []
    other: list[dict] = []
    try:
        records = read_records(path, strict=True)
    except UnicodeDecodeError as exc:  # a binary file: name it (the codec's message names no file)
        raise ValueError(f"{path}: not a text file of JSON lines ({exc.reason} at byte {exc.start})") from None
    for rec in records:
        kind = rec.get("type")
        if kind is None:
            if any(k.startswith(("recall@", "nmi", "map@r", "f1", "top1")) for k in rec):
                kind = "eval"
            elif "loss" in rec:
                kind = "step"
        if kind == "step":
            steps.append(rec)
        elif kind == "eval":
            evals.append(rec)
        else:
            other.append(rec)
    return TrainingLog(steps, evals, other)


# --------------------------------------------------------------------------- Fig. 4
def pair_cosine_histograms(
    embeddings: Any,
    labels: Any,
    *,
    bins: int = 100,
    value_range: tuple[float, float] = (-1.0, 1.0),
    max_pairs: int = 2_000_000,
    seed: int = 0,
    chunk_size: int | None = None,
) -> dict[str, Any]:
    """Histograms of the cosine similarity of same-class and different-class pairs
    (heated-up paper, Fig. 4 / Appendix C).

    If the set has at most ``max_pairs`` unordered pairs ``{i, j}, i != j``, every pair is
    counted exactly, in row chunks so memory stays ``O(chunk_size x N)``. Otherwise the
    same-class pairs are still all counted when there are at most ``max_pairs`` of them
    (SOP, In-shop: a few per class), else ``max_pairs`` of them are drawn uniformly at
    random (with replacement); ``max_pairs`` different-class pairs are drawn uniformly at
    random. Each population is handled on its own, so the *normalised* histograms are
    unbiased even when same-class pairs are rare (SOP: ~1 in 10^4 pairs).

    Returns ``{"edges", "same", "diff", "same_density", "diff_density", "exact",
    "same_exact", "diff_exact", "n_same_pairs", "n_diff_pairs", "n_same_counted",
    "n_diff_counted"}``; counts are int64
    arrays of length ``bins``; ``n_*_pairs`` are the population sizes.
    """
    x = _l2n(_as_2d_float(embeddings, "embeddings").astype(np.float32))
    y = _as_labels(labels, x.shape[0])
    n = x.shape[0]
    if n < 2:
        raise ValueError("need at least 2 embeddings to form a pair")
    if int(bins) < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if int(max_pairs) < 1:
        raise ValueError(f"max_pairs must be >= 1, got {max_pairs}")
    lo, hi = float(value_range[0]), float(value_range[1])
    if not lo < hi:
        raise ValueError(f"value_range must be (low, high) with low < high, got {value_range}")
    edges = np.linspace(lo, hi, int(bins) + 1)
    _, counts = np.unique(y, return_counts=True)
    n_same = int((counts.astype(np.int64) * (counts - 1) // 2).sum())
    n_total = n * (n - 1) // 2
    n_diff = n_total - n_same

    same = np.zeros(int(bins), dtype=np.int64)
    diff = np.zeros(int(bins), dtype=np.int64)
    exact = n_total <= max_pairs
    if exact:
        same, diff = _hist_every_pair(x, y, edges, lo, hi, chunk_size)
        same_exact = diff_exact = True
    else:
        rng = np.random.default_rng(seed)
        same_exact, diff_exact = n_same <= max_pairs, False
        if n_same and same_exact:  # rare pairs (SOP, In-shop): count every one of them
            i, j = _all_same_pairs(y)
            same = _hist_pairs(x, i, j, edges, lo, hi)
        elif n_same:
            i, j = _sample_same_pairs(y, int(max_pairs), rng)
            same = _hist_pairs(x, i, j, edges, lo, hi)
        if n_diff:
            i, j = _sample_diff_pairs(y, int(max_pairs), rng)
            diff = _hist_pairs(x, i, j, edges, lo, hi)
    width = np.diff(edges)

    def density(c: np.ndarray) -> np.ndarray:
        tot = c.sum()
        return c / (tot * width) if tot else np.zeros_like(width)

    return {
        "edges": edges, "same": same, "diff": diff,
        "same_density": density(same), "diff_density": density(diff),
        "exact": exact, "same_exact": same_exact, "diff_exact": diff_exact,
        "n_same_pairs": n_same, "n_diff_pairs": n_diff,
        "n_same_counted": int(same.sum()), "n_diff_counted": int(diff.sum()),
    }


def _hist_every_pair(x: np.ndarray, y: np.ndarray, edges: np.ndarray, lo: float, hi: float,
                     chunk_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Same- and different-class histograms of every unordered pair, in row chunks (memory
    ``O(chunk_size x N)``)."""
    n = x.shape[0]
    same = np.zeros(len(edges) - 1, dtype=np.int64)
    diff = np.zeros(len(edges) - 1, dtype=np.int64)
    cs = chunk_size or max(1, min(n, 8_000_000 // max(n, 1)))
    for s in range(0, n, cs):
        e = min(n, s + cs)
        sims = np.clip(x[s:e] @ x.T, lo, hi)  # clip: rounding may give 1.0000001
        cols = np.arange(n)
        upper = cols[None, :] > np.arange(s, e)[:, None]
        is_same = y[s:e, None] == y[None, :]
        same += np.histogram(sims[upper & is_same], bins=edges)[0]
        diff += np.histogram(sims[upper & ~is_same], bins=edges)[0]
    return same, diff


def _hist_pairs(x: np.ndarray, i: np.ndarray, j: np.ndarray, edges: np.ndarray,
                lo: float, hi: float, chunk: int = 1 << 18) -> np.ndarray:
    out = np.zeros(len(edges) - 1, dtype=np.int64)
    for s in range(0, len(i), chunk):
        sims = np.einsum("ij,ij->i", x[i[s:s + chunk]], x[j[s:s + chunk]])
        out += np.histogram(np.clip(sims, lo, hi), bins=edges)[0]
    return out


def _all_same_pairs(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every same-class unordered pair {i, j}, i != j."""
    order = np.argsort(y, kind="stable")
    _, starts, counts = np.unique(y[order], return_index=True, return_counts=True)
    ii: list[np.ndarray] = []
    jj: list[np.ndarray] = []
    for c in np.unique(counts[counts > 1]):  # one triu per class size, not per class
        a, b = np.triu_indices(int(c), 1)
        st = starts[counts == c]
        ii.append(order[(st[:, None] + a[None]).ravel()])
        jj.append(order[(st[:, None] + b[None]).ravel()])
    if not ii:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(ii), np.concatenate(jj)


def _sample_same_pairs(y: np.ndarray, k: int, rng: np.random.Generator):
    """k pairs drawn uniformly from all same-class unordered pairs."""
    order = np.argsort(y, kind="stable")
    classes, starts, counts = np.unique(y[order], return_index=True, return_counts=True)
    w = counts.astype(np.float64) * (counts - 1) / 2
    cls = rng.choice(len(classes), size=k, p=w / w.sum())
    c = counts[cls]
    a = rng.integers(0, c)
    b = rng.integers(0, c - 1)
    b = b + (b >= a)
    return order[starts[cls] + a], order[starts[cls] + b]


def _sample_diff_pairs(y: np.ndarray, k: int, rng: np.random.Generator):
    """k pairs drawn uniformly from all different-class pairs (rejection sampling)."""
    n = len(y)
    got_i: list[np.ndarray] = []
    got_j: list[np.ndarray] = []
    have = 0
    for _ in range(10_000):
        m = max(1024, int(1.5 * (k - have)))
        i = rng.integers(0, n, size=m)
        j = rng.integers(0, n, size=m)
        keep = y[i] != y[j]
        got_i.append(i[keep])
        got_j.append(j[keep])
        have += int(keep.sum())
        if have >= k:
            break
    return np.concatenate(got_i)[:k], np.concatenate(got_j)[:k]


# --------------------------------------------------------------------------- Fig. 2
def embedding_2d(embeddings: Any, *, normalize: bool = False, seed: int = 0,
                 ) -> tuple[np.ndarray, str]:
    """2-d coordinates for the scatter of Fig. 2 and a description of how they were made.

    2-d embeddings (the paper's LeNet bottleneck) are returned as they are (or
    l2-normalised onto the unit circle, Fig. 2(b)); higher-dimensional ones are projected
    on their first two principal components (scikit-learn PCA) after optional
    normalisation.
    """
    x = _as_2d_float(embeddings, "embeddings").astype(np.float64)
    if normalize:
        x = _l2n(x)
    if x.shape[1] == 2:
        return x, "l2-normalised embedding" if normalize else "embedding"
    if x.shape[1] == 1 or x.shape[0] < 2:
        raise ValueError(f"cannot draw a 2-d scatter of embeddings with shape {x.shape}")
    from sklearn.decomposition import PCA

    pca = PCA(n_components=2, random_state=seed)
    xy = pca.fit_transform(x)
    ev = pca.explained_variance_ratio_.sum()
    what = "l2-normalised " if normalize else ""
    return xy, f"PCA of {what}{x.shape[1]}-d embedding ({100 * ev:.0f}% variance)"


# --------------------------------------------------------------------------- retrieval
def recall_curve(embeddings: Any, labels: Any, ks: Iterable[int] = (1, 2, 4, 8, 16, 32), *,
                 is_query: Any = None, is_gallery: Any = None, device: Any = None,
                 postprocess: Any = None) -> dict[int, float]:
    """Recall@K for every K in ``ks`` via :func:`deepmetric.evaluate.evaluate` (cosine,
    query excluded by index; In-shop style query/gallery masks are passed through), searched
    on ``device`` (None: the CPU), after the ``postprocess`` steps (the run's ``search.postprocess``)."""
    from deepmetric.evaluate import evaluate

    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive integers, got {ks}")
    x = _as_2d_float(embeddings, "embeddings")
    y = _as_labels(labels, x.shape[0])
    res = evaluate(place_for_search(x, device), y, is_query=is_query, is_gallery=is_gallery, ks=tuple(ks),
                   metrics=["recall"], postprocess=postprocess)
    return {k: float(res[f"recall@{k}"]) for k in ks}


def _query_gallery(x: np.ndarray, is_query: Any, is_gallery: Any) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[0]
    q = np.ones(n, bool) if is_query is None else np.asarray(is_query, dtype=bool).reshape(-1)
    g = np.ones(n, bool) if is_gallery is None else np.asarray(is_gallery, dtype=bool).reshape(-1)
    if q.shape[0] != n or g.shape[0] != n:
        raise ValueError(f"is_query / is_gallery must have one entry per embedding ({n})")
    if not q.any() or not g.any():
        raise ValueError("is_query / is_gallery select no query or no gallery sample")
    return np.flatnonzero(q), np.flatnonzero(g)


def _neighbours(x: np.ndarray, q_idx: np.ndarray, g_idx: np.ndarray, k: int, device: Any = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Top-k gallery rows (indices into ``x``) of each query row, exact cosine, the query
    itself excluded by index when it is also in the gallery (REFERENCE.md section 5);
    searched on ``device`` (None: the CPU)."""
    from deepmetric.evaluate import knn

    xn = _l2n(x.astype(np.float32))
    q, g = place_for_search(xn[q_idx], device), place_for_search(xn[g_idx], device)
    same = q_idx.shape == g_idx.shape and np.array_equal(q_idx, g_idx)
    if same:
        sims, idx = knn(q, None, k)
    else:
        sims, idx = knn(q, g, k, exclude_self=False)
        if np.intersect1d(q_idx, g_idx).size:  # overlapping sets: drop the query itself
            sims, idx = knn(q, g, k + 1, exclude_self=False)
            pos = np.where(idx >= 0, g_idx[np.maximum(idx, 0)], -1)
            keep = pos != q_idx[:, None]
            order = np.argsort(~keep, axis=1, kind="stable")[:, :k]
            sims = np.take_along_axis(sims, order, 1)
            idx = np.take_along_axis(idx, order, 1)
    pos = np.where(idx >= 0, g_idx[np.maximum(idx, 0)], -1)
    return np.asarray(sims, dtype=np.float32), pos.astype(np.int64)


def retrieval_examples(embeddings: Any, labels: Any, *, k: int = 8, n_random: int = 8,
                       n_worst: int = 8, seed: int = 0, is_query: Any = None,
                       is_gallery: Any = None, device: Any = None) -> dict[str, Any]:
    """Queries with their ``k`` nearest neighbours for the retrieval grids of the report
    (ALMN paper Fig. 8: queries and their top retrievals; two-head paper Fig. 9: failure
    cases).

    Every query is ranked against the gallery by exact cosine similarity (itself excluded
    by index, ties by the smaller index - the ranking Recall@K uses). ``random`` holds
    ``n_random`` queries drawn uniformly without replacement (``seed``); ``worst`` the
    ``n_worst`` queries with the fewest same-class neighbours among their top ``k``, ties
    broken by the similarity of the first neighbour, highest first (the most confident
    mistakes).

    Returns ``{"k", "random": query rows, "worst": query rows, "neighbours": {q: (k,) rows},
    "similarity": {q: (k,)}, "correct": {q: (k,) bool}, "n_correct": {q: int}}``; rows index
    ``embeddings``; a missing neighbour (gallery smaller than ``k``) is -1. ``device``: where
    the search runs (None: the CPU).
    """
    x = _as_2d_float(embeddings, "embeddings")
    y = _as_labels(labels, x.shape[0])
    if int(k) < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    q_idx, g_idx = _query_gallery(x, is_query, is_gallery)
    sims, nb = _neighbours(x, q_idx, g_idx, int(k), device)
    correct = (nb >= 0) & (y[np.maximum(nb, 0)] == y[q_idx][:, None])
    n_correct = correct.sum(axis=1)
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(q_idx), size=min(int(n_random), len(q_idx)), replace=False)
    order = np.lexsort((-sims[:, 0], n_correct))  # fewest correct, then most confident
    worst = order[: min(int(n_worst), len(q_idx))]
    chosen = np.union1d(pick, worst)
    return {
        "k": int(k),
        "random": q_idx[pick].tolist(),
        "worst": q_idx[worst].tolist(),
        "neighbours": {int(q_idx[i]): nb[i] for i in chosen},
        "similarity": {int(q_idx[i]): sims[i] for i in chosen},
        "correct": {int(q_idx[i]): correct[i] for i in chosen},
        "n_correct": {int(q_idx[i]): int(n_correct[i]) for i in chosen},
    }


def per_class_recall(embeddings: Any, labels: Any, *, k: int = 1, is_query: Any = None,
                     is_gallery: Any = None, device: Any = None) -> dict[str, np.ndarray]:
    """Recall@k of each query class: the share of its queries with a same-class sample
    among their ``k`` nearest gallery neighbours (same ranking as :func:`recall_curve`;
    the mean over queries, not over classes, is the usual Recall@k).

    Returns ``{"classes", "recall", "n_queries"}`` sorted by class id.
    """
    x = _as_2d_float(embeddings, "embeddings")
    y = _as_labels(labels, x.shape[0])
    q_idx, g_idx = _query_gallery(x, is_query, is_gallery)
    _, nb = _neighbours(x, q_idx, g_idx, int(k), device)
    hit = ((nb >= 0) & (y[np.maximum(nb, 0)] == y[q_idx][:, None])).any(axis=1)
    classes, inv, counts = np.unique(y[q_idx], return_inverse=True, return_counts=True)
    hits = np.bincount(inv, weights=hit.astype(float), minlength=len(classes))
    return {"classes": classes, "recall": hits / counts, "n_queries": counts}


def misclassified_neighbours(
    train_embeddings: Any,
    train_labels: Any,
    test_embeddings: Any,
    test_labels: Any,
    test_predictions: Any,
    *,
    device: Any = None,
) -> dict[str, Any]:
    """Two-head paper, Sec. 4.3 / Fig. 10: explain misclassifications by the nearest
    training image in the embedding space (cosine).

    ``test_predictions`` are class ids, or logits (N, C) whose arg-max is taken. Labels of
    train and test must use the same class ids (classification protocol). ``device``: where
    the nearest-neighbour search runs (None: the CPU).

    Returns ``{"misclassified": test indices, "neighbour": nearest-train indices,
    "neighbour_label", "predicted", "true", "n_test", "n_misclassified",
    "share_neighbour_is_predicted", "share_neighbour_is_true"}`` (shares are NaN when
    nothing is misclassified). The paper reports 79.34% for the first share on
    Flowers-102.
    """
    xtr = _as_2d_float(train_embeddings, "train_embeddings")
    ytr = _as_labels(train_labels, xtr.shape[0], "train_labels")
    xte = _as_2d_float(test_embeddings, "test_embeddings")
    yte = _as_labels(test_labels, xte.shape[0], "test_labels")
    if xtr.shape[1] != xte.shape[1]:
        raise ValueError(f"train embeddings have {xtr.shape[1]} dims, test embeddings {xte.shape[1]}")
    pred = np.asarray(test_predictions.detach().cpu() if isinstance(test_predictions, torch.Tensor)
                      else test_predictions)
    if pred.ndim == 2:
        if pred.shape[0] != xte.shape[0]:
            raise ValueError(f"test logits have {pred.shape[0]} rows but there are {xte.shape[0]} test embeddings")
        pred = pred.argmax(axis=1)
    pred = _as_labels(pred, xte.shape[0], "test_predictions")
    wrong = np.flatnonzero(pred != yte)
    nb = _nearest(xtr, xte[wrong], device) if wrong.size else np.zeros(0, dtype=np.int64)
    nb_label = ytr[nb]
    n_wrong = int(wrong.size)
    return {
        "misclassified": wrong, "neighbour": nb, "neighbour_label": nb_label,
        "predicted": pred[wrong], "true": yte[wrong],
        "n_test": int(xte.shape[0]), "n_misclassified": n_wrong,
        "share_neighbour_is_predicted": float(np.mean(nb_label == pred[wrong])) if n_wrong else math.nan,
        "share_neighbour_is_true": float(np.mean(nb_label == yte[wrong])) if n_wrong else math.nan,
    }


def _nearest(reference: np.ndarray, queries: np.ndarray, device: Any = None) -> np.ndarray:
    """Index of the nearest reference (cosine) for each query, searched on ``device``."""
    ref = _l2n(reference.astype(np.float32))
    q = _l2n(queries.astype(np.float32))
    from deepmetric.evaluate import knn

    _, idx = knn(place_for_search(q, device), place_for_search(ref, device), 1)  # exact, chunked (torch / faiss)
    return np.asarray(idx)[:, 0].astype(np.int64)

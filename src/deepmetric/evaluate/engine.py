"""``evaluate``: all retrieval and clustering metrics of one embedding set in one call.

One exact k-NN pass (k = max(max K, largest R)) feeds Recall@K, MAP@R and R-Precision; one
seeded k-means feeds NMI and F1. See docs/evaluation.md for definitions and conventions.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import numpy as np
import torch

from deepmetric.evaluate._checks import check_embeddings, to_mask, to_numpy_labels
from deepmetric.evaluate.clustering import kmeans
from deepmetric.evaluate.knn import (
    APPROXIMATE_BACKENDS,
    first_positive_rank,
    iter_knn,
    resolve_backend,
)
from deepmetric.evaluate.metrics import (CLUSTERING_METRICS, METRICS, RETRIEVAL_METRICS, check_metric_names,
                                         clustering_metric_values, neighbour_metric_values)
from deepmetric.evaluate.retrieval import RetrievalAccumulator

RECALL_LIST_CAP = 32  # longest k-NN list kept for Recall@K alone (see evaluate)


def _check_ks(ks) -> tuple[int, ...]:
    ks = [ks] if isinstance(ks, (int, np.integer)) else list(ks)
    if not ks:
        raise ValueError("ks is empty: give at least one K for Recall@K")
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"every K must be a positive integer, got {k!r}")
    return tuple(sorted({int(k) for k in ks}))


def _rows(x, idx: np.ndarray):
    if isinstance(x, torch.Tensor):
        return x[torch.as_tensor(idx, device=x.device)]
    return np.ascontiguousarray(x[idx])


def evaluate(embeddings, labels, *, is_query=None, is_gallery=None,
             ks: Iterable[int] = (1, 2, 4, 8), metrics: Iterable[str] | None = None,
             seed: int = 0, chunk_size: int | None = None, backend: str = "auto",
             memory_mb: float | None = None, nmi_average: str = "arithmetic",
             progress: bool = False, kmeans_restarts: int = 1, postprocess=None,
             fit_sets: dict | None = None) -> dict[str, float]:
    """Retrieval and clustering metrics of ``embeddings`` (l2-normalised first).

    Args:
        embeddings: (N, d) float numpy array or torch tensor (a CUDA tensor is searched on its GPU).
        labels: (N,) integer class labels.
        is_query, is_gallery: optional boolean (N,) masks (In-shop style). Default: every
            sample is both, i.e. each query is ranked against all the *other* samples (excluded
            by index). Any sample in both sets is excluded from its own neighbours.
        ks: K values for Recall@K (and mAP@K).
        metrics: names of :func:`list_metrics`; default :data:`DEFAULT_METRICS` (recall, map@r,
            r_precision, nmi, f1); also mrr, map@k, recall_class_avg, map@r_class_avg, ami.
        seed: k-means seed (NMI / F1 / AMI are reproducible for a seed).
        chunk_size: queries per k-NN chunk (default: from ``memory_mb``).
        backend: ``auto`` (faiss on CPU, torch on CUDA), ``torch``, ``faiss`` (exact) or
            ``faiss-hnsw`` / ``faiss-ivf`` (APPROXIMATE: retrieval keys get an ``_approx`` suffix).
        memory_mb: bound on the k-NN working memory per chunk (default 256 MiB).
        nmi_average: ``"arithmetic"`` (default, as scikit-learn) or ``"geometric"``.
        progress: show a tqdm bar over the queries of the k-NN pass (large sets).
        kmeans_restarts: k-means initialisations for NMI / F1, the lowest-inertia one kept
            (:func:`~deepmetric.evaluate.clustering.kmeans` ``restarts``; 1 = one, as
            pytorch-metric-learning).
        postprocess: post-processing steps (:func:`deepmetric.evaluate.postprocess.check_steps`)
            applied before the search: the gallery rows are whitened (fitted on the gallery, or
            on ``fit_sets["train"]``) and DBA-augmented, the query rows whitened and
            alpha-expanded against that gallery, each query's candidates k-reciprocal re-ranked.
            Clustering metrics then use the processed vectors (gallery side where a row is both).

    Returns:
        dict with ``recall@K`` for each K, ``map@r``, ``r_precision``, ``nmi``, ``f1`` (each in
        [0, 1], as requested; :func:`metric_keys` names them) and, only when some queries have
        no same-label reference in the gallery, ``queries_without_positive`` (a count; those
        queries are excluded from the retrieval averages). Clustering metrics use the union of
        query and gallery samples.
    """
    metrics = check_metric_names(metrics)
    ks = _check_ks(ks)
    x = check_embeddings(embeddings)
    n = x.shape[0]
    y = to_numpy_labels(labels, n=n)
    qm, gm = to_mask(is_query, n, "is_query"), to_mask(is_gallery, n, "is_gallery")
    backend = resolve_backend(backend, x)
    evaluated = qm | gm
    n_classes = len(np.unique(y[evaluated]))
    if n_classes < 2:
        raise ValueError("the evaluated set has a single class: metrics are meaningless; "
                         "need at least 2 classes")
    from deepmetric.evaluate.postprocess import Postprocessor

    post = postprocess if isinstance(postprocess, Postprocessor) else Postprocessor(
        postprocess, backend=backend, memory_mb=memory_mb, where="postprocess")
    q_idx, g_idx = np.flatnonzero(qm), np.flatnonzero(gm)
    gpos = np.full(n, -1, np.int64)
    gpos[g_idx] = np.arange(len(g_idx))
    qx, gx = _rows(x, q_idx), _rows(x, g_idx)
    if post:
        gx = post.fit(gx, fit_sets=fit_sets)
        qx = post.transform_queries(qx, gx, gpos[q_idx])
    out: dict[str, float] = {}
    if any(m in RETRIEVAL_METRICS for m in metrics):
        out.update(_retrieval(qx, gx, y[q_idx], y[g_idx], gpos[q_idx], metrics, ks, backend, post,
                              chunk_size=chunk_size, memory_mb=memory_mb, progress=progress))
    if any(m in CLUSTERING_METRICS for m in metrics):
        ev = np.flatnonzero(evaluated)
        if post:  # the processed vectors: gallery side for rows that are both
            xe = np.zeros((n, gx.shape[1]), np.float32)
            xe[q_idx], xe[g_idx] = _numpy(qx), _numpy(gx)
            xe = xe[ev]
        else:
            xe = _numpy(_rows(x, ev))
        clusters = kmeans(xe, n_classes, seed=seed, restarts=kmeans_restarts)
        out.update(clustering_metric_values(y[ev], clusters, metrics, nmi_average=nmi_average))
    return out


def _numpy(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


def _retrieval(qx, gx, q_labels, g_labels, self_pos, metrics, ks, backend, post, *, chunk_size,
               memory_mb, progress) -> dict[str, float]:
    """The retrieval metrics of one streamed k-NN pass (optionally re-ranked by ``post``)."""
    classes, counts = np.unique(g_labels, return_counts=True)
    where = np.clip(np.searchsorted(classes, q_labels), 0, len(classes) - 1)
    r = np.where(classes[where] == q_labels, counts[where], 0) - (self_pos >= 0)
    approximate = backend in APPROXIMATE_BACKENDS
    reads = set().union(*(METRICS.info(m)["reads"] for m in metrics if m in RETRIEVAL_METRICS))
    want_rank, want_map, want_map_k = "rank" in reads, "map" in reads, "map_k" in reads
    # One k-NN pass serves every metric. MAP@R / R-Precision need the first R neighbours,
    # mAP@K the first K; Recall@K and MRR only need the rank of the first positive, so for large
    # K (e.g. 1000) the list stops at RECALL_LIST_CAP and the few queries whose first positive
    # lies deeper get their exact rank from a counting pass (knn.first_positive_rank) instead of
    # a 1000-long top-k for everybody. Approximate backends search the full max(K). A
    # k-reciprocal re-ranking re-orders the first `candidates` of the list (never changing that
    # set), so a rank beyond the list is the same before and after it.
    k_recall = max(ks) if (approximate or max(ks) <= RECALL_LIST_CAP) else RECALL_LIST_CAP
    k = max(k_recall if want_rank else 1, int(r.max()) if want_map else 1, max(ks) if want_map_k else 1,
            post.list_length, 1)
    acc = RetrievalAccumulator(ks, want_map=want_map, want_rank=want_rank, want_map_k=want_map_k,
                               gallery_size=len(g_labels))
    exact_rank = any(METRICS.info(m)["exact_rank"] for m in metrics if m in RETRIEVAL_METRICS)
    need_rank_fn = want_rank and (exact_rank or max(ks) > k)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(q_labels), desc="k-NN", unit="query", unit_scale=True)
    for a, sims, idx in iter_knn(qx, gx, k, self_pos=self_pos, backend=backend,
                                 chunk_size=chunk_size, memory_mb=memory_mb):
        sl = slice(a, a + len(idx))
        if post.list_length:
            _, idx = post.rerank(_rows(qx, np.arange(sl.start, sl.stop)), gx, sims, idx, self_pos[sl])

        def rank_fn(rows, a=a):
            rows = rows + a
            return first_positive_rank(_rows(qx, rows), gx, q_labels[rows], g_labels,
                                       self_pos[rows], memory_mb=memory_mb)

        acc.update(idx, q_labels[sl], g_labels, r[sl], rank_fn=rank_fn if need_rank_fn else None)
        if bar is not None:
            bar.update(len(idx))
    if bar is not None:
        bar.close()
    out = neighbour_metric_values(acc.per_query(), metrics, ks, "_approx" if approximate else "")
    if acc.n_no_positive:
        n = acc.n_no_positive
        warnings.warn(f"{n} {'query has' if n == 1 else 'queries have'} no same-label reference in the gallery; "
                      f"{'it is' if n == 1 else 'they are'} excluded from the retrieval metrics", stacklevel=3)
        out["queries_without_positive"] = acc.n_no_positive
    return out


def _subset(embeddings, labels, metrics, **kw):
    return evaluate(embeddings, labels, metrics=metrics, **kw)


def recall_at_k(embeddings, labels, ks: Iterable[int] = (1, 2, 4, 8), **kw) -> dict[str, float]:
    """``{"recall@K": ...}`` for each K (same keywords as :func:`evaluate`)."""
    return {k: v for k, v in _subset(embeddings, labels, ["recall"], ks=ks, **kw).items()
            if k.startswith("recall@")}


def map_at_r(embeddings, labels, **kw) -> float:
    """MAP@R (Musgrave et al. 2020), same keywords as :func:`evaluate`."""
    res = _subset(embeddings, labels, ["map@r"], **kw)
    return next(v for k, v in res.items() if k.startswith("map@r"))


def r_precision(embeddings, labels, **kw) -> float:
    """R-Precision (Musgrave et al. 2020), same keywords as :func:`evaluate`."""
    res = _subset(embeddings, labels, ["r_precision"], **kw)
    return next(v for k, v in res.items() if k.startswith("r_precision"))

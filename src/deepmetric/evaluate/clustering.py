"""Clustering metrics: k-means, NMI and pairwise F1, all from a sparse contingency table.

- k-means: ``faiss.Kmeans`` (Lloyd, 20 iterations as pytorch-metric-learning, seeded, so the
  same seed gives the same assignment) on the l2-normalised embeddings with K = number of
  classes in the evaluated set. faiss was chosen over scikit-learn for speed at SOP size.
- NMI (Strehl & Ghosh 2002; as scikit-learn's ``normalized_mutual_info_score``):
  NMI = I(Y; C) / mean(H(Y), H(C)), arithmetic mean by default, ``average="geometric"``
  gives I / sqrt(H(Y) H(C)) as in older metric-learning code.
- Pairwise F1 (Manning et al., Introduction to IR, 16.3): over all unordered pairs, a pair is
  predicted positive when both points share a cluster and truly positive when they share a
  class; TP = sum_ij C(n_ij, 2), TP+FP = sum_j C(b_j, 2), TP+FN = sum_i C(a_i, 2), with n_ij
  the contingency table and a, b its margins. No list of N^2 pairs is built.
"""
from __future__ import annotations

import faiss
import numpy as np

from deepmetric.evaluate._checks import check_embeddings, to_numpy_labels

KMEANS_NITER = 20


def kmeans(embeddings, n_clusters: int, *, seed: int = 0, niter: int = KMEANS_NITER) -> np.ndarray:
    """Cluster l2-normalised ``embeddings`` into ``n_clusters``; returns int64 cluster ids."""
    x = check_embeddings(embeddings)
    x = x if isinstance(x, np.ndarray) else x.cpu().numpy()
    n = x.shape[0]
    n_clusters = int(n_clusters)
    if not 1 <= n_clusters <= n:
        raise ValueError(f"n_clusters must be between 1 and the number of samples ({n}), got {n_clusters}")
    if n_clusters == n:
        return np.arange(n, dtype=np.int64)
    km = faiss.Kmeans(x.shape[1], n_clusters, niter=int(niter), seed=int(seed),
                      min_points_per_centroid=1, verbose=False)
    km.train(x)
    _, assign = km.index.search(x, 1)
    return assign[:, 0].astype(np.int64)


def contingency(labels: np.ndarray, clusters: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-zero cells n_ij and the margins a_i (class sizes) and b_j (cluster sizes)."""
    _, li = np.unique(labels, return_inverse=True)
    _, ci = np.unique(clusters, return_inverse=True)
    pair = li.astype(np.int64) * (int(ci.max()) + 1) + ci
    _, cells = np.unique(pair, return_counts=True)
    return cells, np.bincount(li), np.bincount(ci)


def _entropy(counts: np.ndarray, n: int) -> float:
    p = counts[counts > 0] / n
    return float(-(p * np.log(p)).sum())


def _check_pair(labels, clusters):
    y = to_numpy_labels(labels, name="labels")
    c = to_numpy_labels(clusters, n=len(y), name="clusters")
    return y, c


def nmi_from_clusters(labels, clusters, *, average: str = "arithmetic") -> float:
    """NMI between two labelings of the same samples (equals scikit-learn's value)."""
    if average not in ("arithmetic", "geometric"):
        raise ValueError(f"average must be 'arithmetic' or 'geometric', got {average!r}")
    y, c = _check_pair(labels, clusters)
    n = len(y)
    li = np.unique(y, return_inverse=True)[1]
    ci = np.unique(c, return_inverse=True)[1]
    pair = li.astype(np.int64) * (int(ci.max()) + 1) + ci
    cells_id, cells = np.unique(pair, return_counts=True)
    a, b = np.bincount(li), np.bincount(ci)
    hy, hc = _entropy(a, n), _entropy(b, n)
    if hy == 0.0 and hc == 0.0:  # both trivial: identical partitions (scikit-learn convention)
        return 1.0
    ai = a[cells_id // (int(ci.max()) + 1)]
    bj = b[cells_id % (int(ci.max()) + 1)]
    mi = float((cells / n * (np.log(cells * n) - np.log(ai.astype(np.float64) * bj))).sum())
    denom = (hy + hc) / 2 if average == "arithmetic" else np.sqrt(hy * hc)
    if denom <= 0:
        return 0.0
    return float(min(max(mi / denom, 0.0), 1.0))


def pairwise_f1_from_clusters(labels, clusters) -> float:
    """Pairwise F1 of a clustering against the classes (0 when no pair is predicted or true)."""
    y, c = _check_pair(labels, clusters)
    cells, a, b = contingency(y, c)

    def pairs(v):
        v = v.astype(np.float64)
        return float((v * (v - 1) / 2).sum())

    tp, pred_pos, true_pos = pairs(cells), pairs(b), pairs(a)
    if tp == 0:
        return 0.0
    precision, recall = tp / pred_pos, tp / true_pos
    return 2 * precision * recall / (precision + recall)


def _clusters_for(embeddings, labels, clusters, seed):
    y = to_numpy_labels(labels, n=None if embeddings is None else len(embeddings))
    if clusters is None:
        if embeddings is None:
            raise ValueError("pass embeddings (to run k-means) or clusters")
        n_classes = len(np.unique(y))
        if n_classes < 2:
            raise ValueError("clustering metrics need at least 2 classes in the labels, got 1")
        clusters = kmeans(embeddings, n_classes, seed=seed)
    return y, clusters


def nmi(embeddings, labels, *, clusters=None, seed: int = 0, average: str = "arithmetic") -> float:
    """NMI of k-means clusters (K = number of classes, seeded) vs labels; or of given ``clusters``."""
    y, c = _clusters_for(embeddings, labels, clusters, seed)
    return nmi_from_clusters(y, c, average=average)


def pairwise_f1(embeddings, labels, *, clusters=None, seed: int = 0) -> float:
    """Pairwise clustering F1 of k-means clusters (K = number of classes) vs labels."""
    y, c = _clusters_for(embeddings, labels, clusters, seed)
    return pairwise_f1_from_clusters(y, c)

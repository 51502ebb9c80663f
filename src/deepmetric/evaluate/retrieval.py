"""Retrieval metrics from one streamed k-NN pass: Recall@K, MAP@R, R-Precision, MRR, mAP@K
and their per-class averages.

Definitions (REFERENCE.md section 5):
- Recall@K: 1 for a query when any of its K nearest references shares its label, else 0.
- R-Precision and MAP@R (Musgrave, Belongie & Lim, "A Metric Learning Reality Check",
  ECCV 2020, section 3.2): R = number of references with the query's label (the query itself
  excluded); R-Precision = r / R with r the relevant items among the first R neighbours;
  MAP@R = (1/R) * sum_{i=1..R} P(i) * rel(i), P(i) the precision at i.
- MRR (mean reciprocal rank, Voorhees, TREC-8 QA 1999): the mean of 1 / rank of the first
  relevant reference (rank 1-based, over the whole ranking).
- mAP@K: AP@K = (1/R) sum_{i=1..K} P(i) rel(i), the average precision of the ranking cut after
  K (trec_eval's AP of a K-long run; pytorch-metric-learning's ``mean_average_precision`` with
  k = K). A perfect ranking scores min(K, R) / R. (Other texts divide by min(K, R); that
  variant is not computed.)
- Per-class averages (``*_class_avg``, pytorch-metric-learning's ``avg_of_avgs``): the
  per-query scores are averaged within each query class, then over the classes (every class
  counts the same, whatever its number of queries).
Queries with R = 0 (no positive reference) are excluded from these averages and counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RetrievalAccumulator:
    """Collects per-query scores chunk by chunk (a few numbers per query: never an N x k array).

    ``ks``: K of Recall@K (and of mAP@K with ``want_map_k``); ``want_rank``: keep the first
    positive's rank (Recall@K, MRR); ``want_map``: MAP@R / R-Precision (the first R neighbours).
    ``gallery_size``: the number of gallery rows; a K of mAP@K above it is read from a list
    that already holds the whole gallery.
    """

    ks: tuple[int, ...]
    want_map: bool = True
    want_rank: bool | None = None
    want_map_k: bool = False
    gallery_size: int | None = None
    n_no_positive: int = 0
    parts: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.want_rank is None:
            self.want_rank = bool(self.ks)

    def _keep(self, name: str, values: np.ndarray) -> None:
        self.parts.setdefault(name, []).append(np.asarray(values))

    def update(self, knn_idx: np.ndarray, q_labels: np.ndarray, g_labels: np.ndarray,
               r: np.ndarray, rank_fn=None) -> None:
        """``knn_idx`` (c, k) gallery indices (-1 padding), ``r`` (c,) positives per query.

        The 0-based rank of the first positive is read from the k-NN list when the positive is
        inside it; otherwise ``rank_fn(rows)`` (an exact counting pass over those rows) supplies
        it (without one: the list's length, enough for Recall@K with K up to it, not for MRR).
        """
        valid = r > 0
        self.n_no_positive += int((~valid).sum())
        if not valid.any():
            return
        rows = np.flatnonzero(valid)
        knn_idx, q_labels, r = knn_idx[valid], q_labels[valid], r[valid]
        self._keep("labels", q_labels)
        match = (knn_idx >= 0) & (g_labels[np.maximum(knn_idx, 0)] == q_labels[:, None])
        if self.want_rank:
            found = match.any(axis=1)
            rank = np.where(found, match.argmax(axis=1), np.iinfo(np.int64).max)
            if not found.all():
                if rank_fn is not None:
                    rank[~found] = rank_fn(rows[~found])
                elif self.ks and max(self.ks) > match.shape[1]:
                    raise RuntimeError("internal error: k-NN list shorter than max K")
                else:  # beyond the list: enough for Recall@K with K <= its length
                    rank[~found] = match.shape[1]
            self._keep("rank", rank)
        cum = np.cumsum(match, axis=1)
        prec = cum / np.arange(1, match.shape[1] + 1)[None, :]
        if self.want_map_k:
            for k in self.ks:
                # a K past the gallery (mAP@100 on 40 images): the list holds every reference,
                # so the sum up to K is the sum over the whole list
                if match.shape[1] < min(k, self.gallery_size if self.gallery_size is not None else k):
                    raise RuntimeError("internal error: k-NN list shorter than K of mAP@K")
                self._keep(f"ap@{k}", (prec[:, :k] * match[:, :k]).sum(axis=1) / r)
        if self.want_map:
            width = int(r.max())
            if width > match.shape[1]:
                raise RuntimeError("internal error: k-NN list shorter than R")
            within = np.arange(width)[None, :] < r[:, None]  # only the first R neighbours count
            rel = match[:, :width] & within
            self._keep("ap_r", (prec[:, :width] * rel).sum(axis=1) / r)
            self._keep("rp", rel.sum(axis=1) / r)

    def per_query(self) -> dict[str, np.ndarray]:
        """The kept per-query arrays (``labels``, ``rank``, ``ap_r``, ``rp``, ``ap@K``), which the
        registered metrics (:mod:`deepmetric.evaluate.metrics`) turn into values."""
        return {k: np.concatenate(v) for k, v in self.parts.items()}

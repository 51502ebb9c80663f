"""Retrieval metrics from one streamed k-NN pass: Recall@K, MAP@R and R-Precision.

Definitions (REFERENCE.md section 5):
- Recall@K: 1 for a query when any of its K nearest references shares its label, else 0.
- R-Precision and MAP@R (Musgrave, Belongie & Lim, "A Metric Learning Reality Check",
  ECCV 2020, section 3.2): R = number of references with the query's label (the query itself
  excluded); R-Precision = r / R with r the relevant items among the first R neighbours;
  MAP@R = (1/R) * sum_{i=1..R} P(i) * rel(i), P(i) the precision at i.
Queries with R = 0 (no positive reference) are excluded from these averages and counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RetrievalAccumulator:
    """Sums per-query retrieval scores chunk by chunk (so no N x k array is ever kept)."""

    ks: tuple[int, ...]
    want_map: bool = True
    hits: dict = field(default_factory=dict)
    ap_sum: float = 0.0
    rp_sum: float = 0.0
    n_valid: int = 0
    n_no_positive: int = 0

    def update(self, knn_idx: np.ndarray, q_labels: np.ndarray, g_labels: np.ndarray,
               r: np.ndarray, rank_fn=None) -> None:
        """``knn_idx`` (c, k) gallery indices (-1 padding), ``r`` (c,) positives per query.

        Recall@K is ``rank < K`` with ``rank`` the 0-based position of the first positive. It
        is read from the k-NN list when the positive is inside it; otherwise, if some K exceeds
        the list length, ``rank_fn(rows)`` (an exact counting pass over those rows) supplies it.
        """
        valid = r > 0
        self.n_no_positive += int((~valid).sum())
        if not valid.any():
            return
        rows = np.flatnonzero(valid)
        knn_idx, q_labels, r = knn_idx[valid], q_labels[valid], r[valid]
        self.n_valid += int(valid.sum())
        match = (knn_idx >= 0) & (g_labels[np.maximum(knn_idx, 0)] == q_labels[:, None])
        if self.ks:
            found = match.any(axis=1)
            rank = np.where(found, match.argmax(axis=1), np.iinfo(np.int64).max)
            if max(self.ks) > match.shape[1] and not found.all():
                if rank_fn is None:
                    raise RuntimeError("internal error: k-NN list shorter than max K")
                rank[~found] = rank_fn(rows[~found])
            for k in self.ks:
                self.hits[k] = self.hits.get(k, 0) + int((rank < k).sum())
        if self.want_map:
            width = int(r.max())
            if width > match.shape[1]:
                raise RuntimeError("internal error: k-NN list shorter than R")
            m = match[:, :width]
            within = np.arange(width)[None, :] < r[:, None]  # only the first R neighbours count
            rel = m & within
            cum = np.cumsum(rel, axis=1)
            prec = cum / np.arange(1, width + 1)[None, :]
            self.ap_sum += float(((prec * rel).sum(axis=1) / r).sum())
            self.rp_sum += float((rel.sum(axis=1) / r).sum())

    def result(self, suffix: str = "") -> dict[str, float]:
        if self.n_valid == 0:
            raise ValueError("no query has a positive (same-label) reference in the gallery; "
                             "retrieval metrics are undefined")
        out = {f"recall@{k}{suffix}": self.hits.get(k, 0) / self.n_valid for k in self.ks}
        if self.want_map:
            out[f"map@r{suffix}"] = self.ap_sum / self.n_valid
            out[f"r_precision{suffix}"] = self.rp_sum / self.n_valid
        return out

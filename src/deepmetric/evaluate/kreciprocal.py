"""k-reciprocal re-ranking (Zhong, Zheng, Cao & Li, "Re-ranking Person Re-identification with
k-reciprocal Encoding", CVPR 2017), over each query's top candidates, bounded in memory.

Definitions (paper section 3; ``d(x, y) = 1 - cos(x, y)`` of l2-normalised vectors):

- N(x, k): x and its k nearest gallery items. y (in the gallery) holds x in N(y, k) when
  cos(x, y) >= the k-th largest cosine of y to the other gallery items (ties count as in).
- R(x, k) = {y in N(x, k) : x in N(y, k)} (eq. 4), x itself included.
- R*(x) = R(x, k1) united with every R(q, k1/2), q in R(x, k1), for which
  |R(x, k1) ∩ R(q, k1/2)| >= 2/3 |R(q, k1/2)| (eq. 6; k1/2 rounded up).
- V_x,y = exp(-d(x, y)) for y in R*(x), else 0 (eq. 7), rows scaled to sum 1 (as the authors'
  released code does).
- Local query expansion (eq. 11): V_x <- mean of V_y over x and its k2 - 1 nearest gallery items.
- Jaccard distance (eq. 10): d_J(p, g) = 1 - sum_j min(V_p,j, V_g,j) / sum_j max(V_p,j, V_g,j);
  the rows sum to 1, so the denominator is 2 - the numerator.
- Final distance (eq. 12): d*(p, g) = (1 - lambda) d_J(p, g) + lambda d(p, g).

Only the first ``candidates`` of each query's exact ranking are re-ordered by d* (ties by the
original order, d* compared to 6 decimals); the rest keep their order, so the set of the top ``candidates`` never changes.

The graph lives in the gallery alone (:class:`KReciprocalGraph`, built once from one k-NN pass
of the gallery against itself): a query that is a gallery row (``self_pos``, leave-one-out
evaluation) is that row's node; any other query is one extra node, R(p, k1) and R*(p) computed
against the gallery's lists, and never a neighbour of another query -- so a query's answer does
not depend on the other queries (as a search server needs). V and its expansion are sparse
(scipy CSR, about ng x |R*| x k2 entries); no ng x ng dense matrix is ever formed, and the
candidates are scored in blocks of ``memory_mb``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from deepmetric.evaluate._checks import check_embeddings
from deepmetric.evaluate.knn import _budget, iter_knn

__all__ = ["KReciprocalGraph", "rerank"]


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _take(x, rows: np.ndarray):
    """Rows of a numpy array or a tensor (on its device)."""
    return x[torch.as_tensor(rows, device=x.device)] if isinstance(x, torch.Tensor) else x[rows]


def _dots(a, b, rows: np.ndarray, cols: np.ndarray, memory_mb) -> np.ndarray:
    """cos(a[rows], b[cols]) pair by pair, in blocks (tensors on their device, numpy with numpy)."""
    out = np.empty(len(rows), np.float32)
    step = max(1, _budget(memory_mb) // (8 * a.shape[1]))
    for s in range(0, len(rows), step):
        r, c = rows[s:s + step], cols[s:s + step]
        if isinstance(a, torch.Tensor):
            out[s:s + step] = (_take(a, r) * _take(b, c)).sum(1).cpu().numpy()
        else:
            out[s:s + step] = np.einsum("nd,nd->n", a[r], b[c])
    return out


def _reciprocal(top_sim: np.ndarray, top_idx: np.ndarray, kth: np.ndarray) -> np.ndarray:
    """x in N(y, k) for each listed neighbour y of x: cos(x, y) >= y's k-th cosine."""
    return (top_idx >= 0) & (top_sim >= kth[np.maximum(top_idx, 0)])


@dataclass
class KReciprocalGraph:
    """The gallery's k-reciprocal encoding: neighbour lists, R(g, k1/2), V and its local expansion."""

    k1: int
    k2: int
    nbr: np.ndarray  # (ng, k1) nearest other gallery rows, -1 padding
    sim: np.ndarray  # (ng, k1) their cosines, -inf padding
    half_sets: np.ndarray  # (ng, half + 1): R(g, ceil(k1/2)) as ids, g first, -1 padding
    v: sp.csr_matrix  # (ng, ng) eq. 7 rows (sum 1)
    vqe: sp.csr_matrix  # (ng, ng) after local query expansion (eq. 11)

    @property
    def half(self) -> int:
        return (self.k1 + 1) // 2

    @classmethod
    def build(cls, gallery, k1: int = 20, k2: int = 6, *, backend: str = "auto",
              memory_mb: float | None = None) -> "KReciprocalGraph":
        g = check_embeddings(gallery, "gallery")
        ng = g.shape[0]
        sims, idx = _lists(g, g, k1, np.arange(ng), backend, memory_mb)
        half = (k1 + 1) // 2
        kth_half = sims[:, half - 1]
        mh = _reciprocal(sims[:, :half], idx[:, :half], kth_half)
        half_sets = np.concatenate([np.arange(ng)[:, None], np.where(mh, idx[:, :half], -1)], axis=1)
        graph = cls(k1, k2, idx, sims, half_sets, sp.csr_matrix((ng, ng), dtype=np.float32), None)
        graph.v = graph.v_rows(g, g, sims, idx, np.arange(ng), memory_mb)
        graph.vqe = graph.expand(graph.v, idx)
        return graph

    def v_rows(self, x, gallery, top_sim, top_idx, self_ids: np.ndarray, memory_mb=None) -> sp.csr_matrix:
        """Eq. 7 rows of the nodes ``x`` (queries or gallery rows) from their top-k1 lists;
        ``self_ids[b]`` is x_b's gallery row, or -1 for a query outside the gallery (its own
        weight exp(0) = 1 counts in the row's sum but is not stored: no gallery item is it)."""
        k1, ng = self.k1, self.nbr.shape[0]
        per_row = k1 * (self.half + 1) * (k1 + 1) * 2 + 64 * k1 * (self.half + 1)
        step = max(1, _budget(memory_mb) // per_row)
        kth1 = self.sim[:, k1 - 1]
        parts = []
        for a in range(0, len(self_ids), step):
            ts, ti = top_sim[a:a + step, :k1], top_idx[a:a + step, :k1]
            me = np.where(self_ids[a:a + step] >= 0, self_ids[a:a + step], -2)
            m1 = _reciprocal(ts, ti, kth1)
            r_full = np.concatenate([me[:, None], np.where(m1, ti, -1)], axis=1)  # R(x, k1)
            cand = np.where(m1[..., None], self.half_sets[np.maximum(ti, 0)], -1)  # R(q, k1/2)
            inter = ((cand[..., :, None] == r_full[:, None, None, :]) & (cand[..., None] >= 0)).sum((-1, -2))
            size = (cand >= 0).sum(-1)
            accept = m1 & (3 * inter >= 2 * size)  # eq. 6
            rows = np.concatenate([np.repeat(np.arange(len(me)), k1 + 1),
                                   np.repeat(np.arange(len(me)), k1 * (self.half + 1))])
            cols = np.concatenate([r_full.ravel(), np.where(accept[..., None], cand, -1).ravel()])
            keep = cols >= 0
            key = np.unique(rows[keep] * ng + cols[keep])
            rows, cols = key // ng, key % ng
            w = np.exp(-(1.0 - _dots(x, gallery, rows + a, cols, memory_mb))).astype(np.float64)
            total = np.bincount(rows, weights=w, minlength=len(me)) + (me < 0)  # + the query's own exp(0)
            parts.append(sp.csr_matrix(((w / total[rows]).astype(np.float32), (rows, cols)), shape=(len(me), ng)))
        return sp.vstack(parts, format="csr") if parts else sp.csr_matrix((0, ng), dtype=np.float32)

    def expand(self, v_own: sp.csr_matrix, top_idx: np.ndarray) -> sp.csr_matrix:
        """Eq. 11: (V_x + sum of V_y over x's k2 - 1 nearest gallery rows y) / k2."""
        m = self.k2 - 1
        if m <= 0:
            return v_own.tocsr()
        ti = top_idx[:, :m]
        rows, cols = np.nonzero(ti >= 0)
        s = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, ti[rows, cols])),
                          shape=(len(ti), self.nbr.shape[0]))
        return ((v_own + s @ self.v) / np.float32(self.k2)).tocsr()


def _lists(query, gallery, k: int, self_pos: np.ndarray, backend: str, memory_mb):
    """Top-``k`` (cosines, ids) of each query, padded to ``k`` columns with (-inf, -1): a k1
    past the gallery's size (k1 = 20 on 10 images) leaves every list short, which the graph
    reads as padding (as Zhong et al.'s code slices a shorter ranking)."""
    parts = list(iter_knn(query, gallery, k, self_pos=self_pos, backend=backend, memory_mb=memory_mb))
    sims, idx = np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])
    short = k - idx.shape[1]
    if short > 0:
        sims = np.pad(sims, ((0, 0), (0, short)), constant_values=-np.inf)
        idx = np.pad(idx, ((0, 0), (0, short)), constant_values=-1)
    return sims, idx


def _query_rows(graph: KReciprocalGraph, query, gallery, sims, idx, self_pos, memory_mb) -> sp.csr_matrix:
    """Expanded V rows (eq. 11) of a block of queries: the graph's own row for gallery queries."""
    inside = self_pos >= 0
    parts, order = [], []
    if inside.any():
        parts.append(graph.vqe[self_pos[inside]])
        order.append(np.flatnonzero(inside))
    if (~inside).any():
        ext = np.flatnonzero(~inside)
        need = max(graph.k1, graph.k2 - 1)
        ts, ti = sims[ext], idx[ext]
        qrows = _take(query, ext)
        if ti.shape[1] < need:  # the candidate list is shorter than the graph needs
            ts, ti = _lists(qrows, gallery, need, np.full(len(ext), -1), "auto", memory_mb)
        v = graph.v_rows(qrows, gallery, ts, ti, np.full(len(ext), -1), memory_mb)
        parts.append(graph.expand(v, ti))
        order.append(ext)
    perm = np.argsort(np.concatenate(order), kind="stable")
    return sp.vstack(parts, format="csr")[perm]


def rerank(graph: KReciprocalGraph, query, gallery, sims: np.ndarray, idx: np.ndarray, *,
           self_pos=None, lam: float = 0.3, candidates: int = 100,
           memory_mb: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Re-order the first ``candidates`` columns of each query's exact ranking (``sims``, ``idx``:
    (nq, width) cosines and gallery rows, -1 padding) by d* (eq. 12); returns ``(sims, idx)``
    in the new order (``sims`` stay the neighbours' cosines). ``self_pos[i]``: query i's gallery
    row (leave-one-out), or -1."""
    sims, idx = np.array(sims, np.float32), np.array(idx, np.int64)
    nq = len(idx)
    self_pos = np.full(nq, -1, np.int64) if self_pos is None else np.asarray(self_pos, np.int64)
    c = min(int(candidates), idx.shape[1])
    nnz_row = max(1.0, graph.vqe.nnz / max(1, graph.vqe.shape[0]))
    step = max(1, int(_budget(memory_mb) // (c * nnz_row * 24 + 1)))
    for a in range(0, nq, step):
        b = slice(a, min(nq, a + step))
        vq = _query_rows(graph, _take(query, np.arange(b.start, b.stop)), gallery, sims[b], idx[b], self_pos[b], memory_mb)
        ci = idx[b, :c]
        valid = ci >= 0
        rows = np.repeat(np.arange(len(ci)), c)
        num = np.asarray(vq[rows].minimum(graph.vqe[np.maximum(ci, 0).ravel()]).sum(axis=1)).ravel()
        d_j = 1.0 - num / (2.0 - num)
        d_star = (1.0 - lam) * d_j.reshape(ci.shape) + lam * (1.0 - sims[b, :c].astype(np.float64))
        d_star = np.where(valid, np.round(d_star, 6), np.inf)  # float noise never decides a tie
        pos = np.broadcast_to(np.arange(c), ci.shape)
        order = np.lexsort((pos, d_star), axis=-1)
        idx[b, :c] = np.take_along_axis(ci, order, 1)
        sims[b, :c] = np.take_along_axis(sims[b, :c], order, 1)
    return sims, idx

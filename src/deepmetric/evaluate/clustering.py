"""Clustering metrics: k-means, NMI and pairwise F1, all from a sparse contingency table.

- k-means: Lloyd's algorithm (at most 20 iterations as pytorch-metric-learning's
  faiss.Kmeans, seeded, so the same seed gives the same assignment) on the l2-normalised
  embeddings with K = number of classes in the evaluated set. It stops early at a fixed point
  and skips provably unchanged samples with Hamerly's bounds; neither changes the result
  (see ``kmeans``). Nearest-centroid searches use faiss (exact), faster here than
  scikit-learn at SOP size.
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
_SPLIT_EPS = 1.0 / 1024  # relative perturbation when an empty cluster takes half of a big one (as faiss)
_MOVED_GRID = (0, 16, 64, 256, 1024, 4096)  # candidate numbers of centroids bounded exactly
_ROW_BLOCK = 65536  # rows per block for float64 work on point subsets (bounds memory at 1M points)


def _sq_error_bound(d: int, max_norm_x: float, max_norm_c: float) -> float:
    """Bound on the float32 rounding error of a squared distance computed as
    ||x||^2 + ||c||^2 - 2 x.c (faiss' BLAS path): gamma_d (||x|| + ||c||)^2 with a safety
    factor 2 (inner-product bound, Higham, Accuracy and Stability of Numerical Algorithms,
    2nd ed., section 3.1)."""
    u = 2.0 ** -24
    return 2.0 * (d + 4) * u * (max_norm_x + max_norm_c) ** 2


def _nearest_two(x32: np.ndarray, c32: np.ndarray):
    """Nearest and second-nearest centroid of every row (faiss exact L2 search, k=2)."""
    dist, idx = faiss.knn(x32, c32, 2)
    return dist.astype(np.float64), idx.astype(np.int64)


def _centroids(x: np.ndarray, assign: np.ndarray, k: int, previous: np.ndarray):
    """Means of the clusters (float64 sums, deterministic order) and the indices of the
    empty clusters, which are re-seeded by splitting the largest cluster (see kmeans)."""
    order = np.argsort(assign, kind="stable")
    counts = np.bincount(assign, minlength=k)
    present = np.flatnonzero(counts)
    starts = np.concatenate(([0], np.cumsum(counts[present])[:-1]))
    c = previous.copy()
    sums = np.add.reduceat(x[order], starts, axis=0, dtype=np.float64)  # float64 sums, no f64 copy
    c[present] = sums / counts[present, None]
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        sign = np.where(np.arange(x.shape[1]) % 2 == 0, 1.0, -1.0)
        size = counts.astype(np.float64)
        for j in empty:  # ascending index order; always the currently largest cluster (lowest id)
            big = int(np.argmax(size))
            c[j] = c[big] * (1 + sign * _SPLIT_EPS)
            c[big] = c[big] * (1 - sign * _SPLIT_EPS)
            size[j] = np.floor(size[big] / 2)
            size[big] -= size[j]
    return c, empty


def _exact_dist(x: np.ndarray, c: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """||x[rows] - c[cols]|| in float64, in blocks (upper bounds tightened exactly)."""
    out = np.empty(len(rows))
    for a in range(0, len(rows), _ROW_BLOCK):
        r, q = rows[a:a + _ROW_BLOCK], cols[a:a + _ROW_BLOCK]
        out[a:a + _ROW_BLOCK] = np.linalg.norm(x[r].astype(np.float64) - c[q], axis=1)
    return out


def _shift_lower_bounds(x, c32, assign, upper, lower, shift, tol):
    """New lower bounds on every sample's distance to the centroids other than its own.

    Hamerly's update is ``lower - max(shift)``; one large shift (a re-seeded empty cluster, or
    the big moves of early iterations) then destroys every bound. Here the ``m`` centroids
    that moved most are measured exactly (one faiss search of all samples against those ``m``,
    cost m / K of a full assignment) and only the others' largest shift is subtracted:
    lower' = min(lower - max_{j not in M} shift_j, min_{j in M, j != own} ||x - c_j||).
    ``m`` is picked from a small grid to minimise (m / K) + (estimated fraction of samples
    left to search), the estimate counting samples whose bounds would still overlap.
    """
    k = len(shift)
    order = np.argsort(-shift, kind="stable")
    best_m, best_cost = 0, np.inf
    for m in _MOVED_GRID:
        if m > k - 1:
            break
        left = np.count_nonzero(upper > lower - shift[order[m]])
        cost = m / k + left / len(upper)
        if cost < best_cost:
            best_m, best_cost = m, cost
    new = lower - shift[order[best_m]]
    if best_m:
        moved = order[:best_m]
        kk = min(2, best_m)
        dist, idx = faiss.knn(x, c32[moved], kk)
        own = moved[idx[:, 0]] == assign
        near = dist[:, 0].astype(np.float64)
        if kk == 2:
            near = np.where(own, dist[:, 1], near)
        else:
            near = np.where(own, np.inf, near)
        np.minimum(new, np.sqrt(np.maximum(near - tol, 0.0)), out=new)
    return new, best_m


def kmeans(embeddings, n_clusters: int, *, seed: int = 0, niter: int = KMEANS_NITER,
           accelerate: bool = True, return_info: bool = False, restarts: int = 1):
    """Lloyd's k-means of the l2-normalised ``embeddings`` into ``n_clusters``; int64 cluster ids.

    Definition (what NMI / F1 are computed from), as faiss.Kmeans used by
    pytorch-metric-learning: initial centroids = ``n_clusters`` distinct samples drawn with
    ``numpy.random.default_rng(seed)``; then ``niter`` times: assign every sample to its
    nearest centroid (squared Euclidean), replace each centroid by the mean of its samples;
    the result is the assignment to the final centroids. An empty cluster takes over half of
    the currently largest cluster (lowest id on ties): both centroids are that cluster's
    centroid scaled by (1 +- 1/1024) alternately per dimension (faiss' rule, made
    deterministic by picking the largest instead of a random cluster).

    Two speed-ups leave this result unchanged:
    - early stop: when an assignment equals the previous one and no cluster was empty, the
      centroids are a fixed point, so all remaining iterations would be no-ops;
    - ``accelerate`` (Hamerly 2010, "Making k-means even faster", SDM, Alg. 2-3: the upper /
      lower bound part, with the lower bound kept exact for the centroids that moved most,
      see ``_shift_lower_bounds``): each sample keeps an upper bound on the distance to its
      centroid and a lower bound on the distance to every other centroid, moved by the
      centroid shifts (triangle inequality); only samples whose bounds overlap are searched
      again. Bounds include a float32 rounding margin, so a skipped sample's centroid is
      provably still its nearest.
    Assignments are exact nearest-centroid searches (faiss); samples tied to within float32
    rounding may go either way, as in any implementation.

    Args:
        niter: maximum number of Lloyd iterations (20, as pytorch-metric-learning).
        accelerate: use the bounds (True) or search every sample in every iteration (False).
        return_info: also return a dict ``iterations`` (centroid updates run before the fixed
            point or ``niter``), ``converged``, ``searched`` (samples searched per assignment),
            ``exact_moved`` (centroids whose distances were measured to renew the bounds),
            ``inertia`` (sum of squared distances to the final centroids) and ``restart``.
        restarts: run k-means this many times from different initial centroids (restart 0
            draws them with ``default_rng(seed)``, restart r > 0 with ``default_rng([seed,
            r])``) and keep the assignment of lowest inertia, as faiss' ``nredo`` and
            scikit-learn's ``n_init``.  With few clusters (10 classes) one initialisation
            leaves NMI and F1 varying by several points between seeds of the same
            embedding; the default 1 is pytorch-metric-learning's setting.
    """
    if isinstance(restarts, bool) or not isinstance(restarts, (int, np.integer)) or restarts < 1:
        raise ValueError(f"restarts must be an integer >= 1, got {restarts!r}")
    x = check_embeddings(embeddings)  # checked and converted once for every restart
    x = x if isinstance(x, np.ndarray) else x.cpu().numpy()
    n = x.shape[0]
    n_clusters = int(n_clusters)
    if not 1 <= n_clusters <= n:
        raise ValueError(f"n_clusters must be between 1 and the number of samples ({n}), got {n_clusters}")
    if int(niter) < 0:
        raise ValueError(f"niter must be >= 0, got {niter}")
    best = None
    for r in range(int(restarts)):
        assign, info = _kmeans_once(x, n_clusters, seed if r == 0 else [seed, r], niter, accelerate)
        info["restart"] = r
        if best is None or info["inertia"] < best[1]["inertia"]:
            best = (assign, info)
    return best if return_info else best[0]


def _kmeans_once(x: np.ndarray, n_clusters: int, seed, niter, accelerate):
    """One k-means run of :func:`kmeans` (its definition) on the checked embeddings ``x``;
    returns (assignment, info)."""
    n, d = x.shape
    info = {"iterations": 0, "converged": True, "searched": [], "exact_moved": []}
    if n_clusters in (1, n):  # trivial partitions: one cluster, or every sample alone
        out = np.zeros(n, np.int64) if n_clusters == 1 else np.arange(n, dtype=np.int64)
        info["inertia"] = _inertia(x, x.mean(0, keepdims=True).astype(np.float64), out) if n_clusters == 1 else 0.0
        return out, info
    k = n_clusters
    x = np.ascontiguousarray(x, dtype=np.float32)
    max_nx = float(np.linalg.norm(x, axis=1).max()) * (1 + 1e-5)  # no float64 copy of x
    rng = np.random.default_rng(seed)
    c = x[rng.permutation(n)[:k]].astype(np.float64)

    assign = np.zeros(n, np.int64)
    upper = np.full(n, np.inf)  # >= distance to own centroid
    lower = np.zeros(n)  # <= distance to every other centroid
    prev_c, prev_assign, prev_empty = None, None, True
    converged = False
    for it in range(int(niter) + 1):  # niter (assign, update) rounds + the final assignment
        c32 = c.astype(np.float32)
        tol = _sq_error_bound(d, max_nx, float(np.sqrt((c ** 2).sum(1).max())))
        if prev_c is not None and accelerate:
            shift = np.linalg.norm(c - prev_c, axis=1) * (1 + 1e-12)
            upper += shift[assign]
            lower, m = _shift_lower_bounds(x, c32, assign, upper, lower, shift, tol)
            info["exact_moved"].append(m)
            cand = np.flatnonzero(upper > lower)
            if len(cand):  # tighten the upper bound to the exact distance, test again
                upper[cand] = _exact_dist(x, c, cand, assign[cand]) * (1 + 1e-12)
                cand = cand[upper[cand] > lower[cand]]
        else:
            cand = np.arange(n)
        info["searched"].append(int(len(cand)))
        if len(cand):
            dist, idx = _nearest_two(x[cand], c32)
            assign[cand] = idx[:, 0]
            upper[cand] = np.sqrt(dist[:, 0] + tol)
            lower[cand] = np.sqrt(np.maximum(dist[:, 1] - tol, 0.0))
        if prev_assign is not None and not prev_empty and np.array_equal(assign, prev_assign):
            converged = True  # centroids = means of this same assignment: a fixed point
            break
        if it == int(niter):
            break
        prev_c, prev_assign = c, assign.copy()
        c, empty = _centroids(x, assign, k, c)
        prev_empty = len(empty) > 0
        info["iterations"] = it + 1
    info["converged"] = converged
    info["inertia"] = _inertia(x, c, assign)
    return assign, info


def _inertia(x: np.ndarray, c: np.ndarray, assign: np.ndarray) -> float:
    """Sum of squared distances of the samples to their centroids (float64, in blocks)."""
    total = 0.0
    for a in range(0, len(x), _ROW_BLOCK):
        d = x[a:a + _ROW_BLOCK].astype(np.float64) - c[assign[a:a + _ROW_BLOCK]]
        total += float((d * d).sum())
    return total


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

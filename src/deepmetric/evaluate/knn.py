"""Exact, chunked k-nearest-neighbour search by cosine similarity (on l2-normalised vectors).

Ranking by Euclidean distance of unit vectors equals ranking by inner product (REFERENCE.md
section 5), so every backend ranks by inner product. Results are deterministic: neighbours are
ordered by similarity (descending), ties by gallery index (ascending), including ties at the
k-th position (a tied boundary row is recomputed exactly). A query that is also in the gallery
is excluded by *index* (never by dropping the first column: duplicates exist).

Memory is bounded: nothing of size N x N is materialised. The ``torch`` backend tiles the
similarity matrix into (chunk of queries) x (block of gallery) tiles that fit ``memory_mb``
and merges running top-k lists; the ``faiss`` backend uses ``faiss.knn`` (brute force, BLAS
tiles of 4096 x 1024 inside faiss) over query chunks. ``faiss-hnsw`` / ``faiss-ivf`` are
APPROXIMATE and their metrics are reported under keys ending in ``_approx``.
"""
from __future__ import annotations

import math
from typing import Iterator

import faiss
import numpy as np
import torch

from deepmetric.evaluate._checks import check_embeddings

BACKENDS = ("auto", "torch", "faiss", "faiss-hnsw", "faiss-ivf")
APPROXIMATE_BACKENDS = ("faiss-hnsw", "faiss-ivf")
DEFAULT_MEMORY_MB = 256.0


def resolve_backend(backend: str, x) -> str:
    """``auto`` -> ``faiss`` for CPU data (measured faster here, see bench/RESULTS.md),
    ``torch`` for CUDA tensors (search stays on the GPU)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    on_gpu = isinstance(x, torch.Tensor) and x.device.type != "cpu"
    if backend == "auto":
        return "torch" if on_gpu else "faiss"
    if backend.startswith("faiss") and on_gpu:
        raise ValueError(f"backend {backend!r} runs on the CPU; pass CPU embeddings or use 'torch'")
    return backend


#: what a command's search-device flag takes (``cuda:i`` names one GPU)
SEARCH_DEVICES = ("auto", "cpu", "cuda")
#: ``auto`` keeps a search on the GPU only when this many copies of the embeddings fit in its free
#: memory (the input, its l2-normalised copy, the query and gallery rows), plus the tile budget
SEARCH_COPIES = 4


def _cuda_free_bytes(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def choose_search_device(request: str = "auto", *, default=None, backend: str = "auto",
                         nbytes: int = 0, memory_mb: float | None = None, flag: str = "--device",
                         backend_flag: str = "--backend", cuda_available: bool | None = None,
                         free_bytes=None) -> torch.device:
    """Where an exact k-NN search runs: the CPU (faiss) or a GPU (the torch backend).

    ``request`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:i`` (the value of ``flag``, named in
    errors). ``auto`` is ``default`` when given (e.g. the device the embeddings were computed
    on), else the GPU when CUDA is available; it falls back to the CPU when ``backend`` only
    runs there (the faiss backends) or when ``SEARCH_COPIES x nbytes`` (the embeddings' size)
    plus the tile budget do not fit in the GPU's free memory. ``cpu`` always gives the CPU. An
    explicit ``cuda`` without CUDA, or with a faiss backend, is a ``ValueError`` naming the flags.
    ``cuda_available`` / ``free_bytes`` (a function of the device) replace the queries of torch
    (tests decide without a GPU)."""
    if not isinstance(request, str) or request.split(":")[0] not in SEARCH_DEVICES or (
            ":" in request and (request.split(":")[0] != "cuda" or not request.split(":", 1)[1].isdigit())):
        raise ValueError(f"{flag} {request!r}: expected auto, cpu, cuda or cuda:INDEX")
    if backend not in BACKENDS:
        raise ValueError(f"{backend_flag} {backend!r}: expected one of {', '.join(BACKENDS)}")
    cpu = torch.device("cpu")
    if request == "cpu":
        return cpu
    available = torch.cuda.is_available() if cuda_available is None else bool(cuda_available)
    cpu_backend = backend.startswith("faiss")
    if request.startswith("cuda"):
        if not available:
            raise ValueError(f"{flag} {request}: CUDA is not available on this machine "
                             f"(torch.cuda.is_available() is False); use {flag} cpu or auto")
        if cpu_backend:
            raise ValueError(f"{backend_flag} {backend} searches on the CPU, but {flag} {request} asks for the "
                             f"GPU; use {backend_flag} torch (or auto) on the GPU, or {flag} cpu")
        return torch.device(request)
    # auto
    dev = torch.device(default) if default is not None else (torch.device("cuda") if available else cpu)
    if dev.type != "cuda" or cpu_backend:  # searches run on the CPU or on a CUDA device
        return cpu
    if nbytes:
        free = (free_bytes or _cuda_free_bytes)(dev)
        if SEARCH_COPIES * int(nbytes) + _budget(memory_mb) > free:
            return cpu
    return dev


def _budget(memory_mb: float | None) -> int:
    mb = DEFAULT_MEMORY_MB if memory_mb is None else float(memory_mb)
    if not mb > 0:
        raise ValueError(f"memory_mb must be > 0, got {memory_mb}")
    return int(mb * 2**20)


def _as_np(x) -> np.ndarray:
    # np.asarray: a memory-mapped gallery (np.memmap) as a plain ndarray view, no copy; faiss's
    # torch wrappers (faiss.contrib.torch_utils, imported by pytorch-metric-learning) take any
    # array whose type is not exactly np.ndarray for a torch tensor
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _as_torch(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)


def _drop_self(sims: np.ndarray, idx: np.ndarray, self_pos: np.ndarray, width: int):
    """Remove each row's own gallery index (if present) keeping order; return ``width`` columns."""
    is_self = (idx == self_pos[:, None]) & (self_pos[:, None] >= 0)
    has = is_self.any(axis=1)
    if has.any():
        # shift the columns after the self entry one to the left (at most one self per row)
        p = np.where(has, is_self.argmax(axis=1), idx.shape[1])
        cols = np.arange(idx.shape[1])[None, :]
        cols = np.minimum(cols + (cols >= p[:, None]), idx.shape[1] - 1)
        sims, idx = np.take_along_axis(sims, cols, 1), np.take_along_axis(idx, cols, 1)
        sims[has, -1], idx[has, -1] = -np.inf, -1
    sims, idx = sims[:, :width], idx[:, :width]
    if sims.shape[1] < width:  # fewer candidates than asked: pad
        pad = width - sims.shape[1]
        sims = np.concatenate([sims, np.full((len(sims), pad), -np.inf, np.float32)], axis=1)
        idx = np.concatenate([idx, np.full((len(idx), pad), -1, np.int64)], axis=1)
    return sims, idx


def _sort_rows(sims: np.ndarray, idx: np.ndarray):
    """Order rows (already sorted by similarity, as faiss / torch.topk return them) so that
    equal similarities come by ascending gallery index; padding (-1) goes last."""
    pad = idx < 0
    sims = np.where(pad, -np.inf, sims).astype(np.float32)
    tied = np.flatnonzero(((sims[:, 1:] == sims[:, :-1]) & ~pad[:, 1:]).any(axis=1))
    if tied.size:
        s, i = sims[tied], idx[tied]
        key_idx = np.where(i < 0, np.iinfo(np.int64).max, i)
        order = np.lexsort((key_idx, -s), axis=-1)
        sims[tied], idx[tied] = np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)
    return sims, idx


def _exact_rows(query, gallery, rows: np.ndarray, self_pos: np.ndarray, k: int, budget: int):
    """Recompute the top-k of the given query rows from full similarity rows (exact ties)."""
    g = _as_torch(gallery)
    ng = g.shape[0]
    out_s = np.full((len(rows), k), -np.inf, np.float32)
    out_i = np.full((len(rows), k), -1, np.int64)
    step = max(1, budget // (ng * 4 * 2))
    for a in range(0, len(rows), step):
        r = rows[a:a + step]
        s = (_as_torch(query)[torch.as_tensor(r, device=g.device)] @ g.T).cpu().numpy()
        for j, row in enumerate(s):
            sp = self_pos[r[j]]
            if sp >= 0:
                row[sp] = -np.inf
            kk = min(k, ng)
            thr = np.partition(row, ng - kk)[ng - kk]  # k-th largest value
            cand = np.flatnonzero(row >= thr)
            cand = cand[np.lexsort((cand, -row[cand]))][:k]
            out_s[a + j, :len(cand)] = row[cand]
            out_i[a + j, :len(cand)] = cand
    out_i[~np.isfinite(out_s)] = -1
    return out_s, out_i


def _fix_boundary_ties(query, gallery, start: int, sims, idx, self_pos, k: int, budget: int):
    """Rows whose k-th and (k+1)-th similarities tie could hold the 'wrong' tied neighbour:
    recompute those rows exactly so that ties are always broken by the smaller index."""
    if sims.shape[1] <= k:
        return sims, idx
    tied = np.flatnonzero((sims[:, k - 1] == sims[:, k]) & np.isfinite(sims[:, k]))
    sims, idx = sims[:, :k].copy(), idx[:, :k].copy()
    if tied.size:
        s, i = _exact_rows(query, gallery, start + tied, self_pos, k, budget)
        sims[tied], idx[tied] = s, i
    return sims, idx


def _torch_chunk(q: torch.Tensor, g: torch.Tensor, sp: np.ndarray, ks: int, block: int):
    """Top-``ks`` of one query chunk over gallery blocks with running merge (self gets -inf)."""
    best_v = torch.empty((q.shape[0], 0), dtype=torch.float32, device=q.device)
    best_i = torch.empty((q.shape[0], 0), dtype=torch.int64, device=q.device)
    sp_t = torch.as_tensor(sp, device=q.device)
    rows = torch.arange(q.shape[0], device=q.device)
    for g0 in range(0, g.shape[0], block):
        s = q @ g[g0:g0 + block].T
        inside = (sp_t >= g0) & (sp_t < g0 + s.shape[1])
        if bool(inside.any()):
            s[rows[inside], sp_t[inside] - g0] = -torch.inf
        v, i = torch.topk(s, min(ks, s.shape[1]), dim=1)
        best_v = torch.cat([best_v, v], dim=1)
        best_i = torch.cat([best_i, i + g0], dim=1)
        if best_v.shape[1] > ks:
            best_v, j = torch.topk(best_v, ks, dim=1)
            best_i = torch.gather(best_i, 1, j)
    sims, idx = best_v.cpu().numpy(), best_i.cpu().numpy()
    idx[~np.isfinite(sims)] = -1
    return sims, idx


def _approx_index(gallery: np.ndarray, backend: str, k: int):
    d, ng = gallery.shape[1], gallery.shape[0]
    if backend == "faiss-hnsw":
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = max(128, 2 * k)
    else:
        nlist = int(min(max(1, 4 * math.sqrt(ng)), max(1, ng // 39)))
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = 1234
        index.train(gallery)
        index.nprobe = min(nlist, 32)
    index.add(gallery)
    return index


def build_approximate_index(gallery: np.ndarray, backend: str, k: int = 10):
    """The faiss index the approximate backends search (``faiss-hnsw``: HNSW, 32 links;
    ``faiss-ivf``: IVF-Flat, about 4 sqrt(N) lists, 32 probed), filled with ``gallery``
    (already l2-normalised, float32, C-contiguous). Used by ``deepmetric.search`` to keep it."""
    if backend not in APPROXIMATE_BACKENDS:
        raise ValueError(f"backend {backend!r} is not approximate; expected one of {APPROXIMATE_BACKENDS}")
    return _approx_index(np.ascontiguousarray(gallery, dtype=np.float32), backend, k)


def search_approximate_index(index, query: np.ndarray, k: int):
    """``(sims, idx)`` of a kept approximate index, ordered and padded as :func:`knn` does."""
    sims, idx = index.search(np.ascontiguousarray(query, dtype=np.float32), int(k))
    sims, idx = sims.astype(np.float32), idx.astype(np.int64)
    idx[idx >= index.ntotal] = -1
    return _sort_rows(sims, idx)


def iter_knn(query, gallery, k: int, *, self_pos: np.ndarray | None = None,
             backend: str = "auto", chunk_size: int | None = None,
             memory_mb: float | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(start, sims, idx)`` for consecutive chunks of already-normalised queries.

    ``sims``/``idx`` are (chunk, k) float32 / int64 arrays (padding: -inf / -1 when a query has
    fewer than k candidates). ``self_pos[i]`` is the gallery row of query i to exclude (or -1).
    """
    backend = resolve_backend(backend, query)
    nq, ng = query.shape[0], gallery.shape[0]
    if self_pos is None:
        self_pos = np.full(nq, -1, np.int64)
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    budget = _budget(memory_mb)
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    has_self = bool((self_pos >= 0).any())
    kk = min(k, ng)

    if backend == "torch":
        q_t, g_t = _as_torch(query), _as_torch(gallery)
        ks = min(kk + 1, ng)
        cq = int(chunk_size) if chunk_size else max(1, min(nq, 2048, budget // (4 * 3 * max(ks, 1024))))
        block = max(ks, budget // (cq * 4 * 3))
        for a in range(0, nq, cq):
            sp = self_pos[a:a + cq]
            sims, idx = _torch_chunk(q_t[a:a + cq], g_t, sp, ks, block)
            sims, idx = _sort_rows(*_drop_self(sims, idx, sp, kk + 1))
            yield a, *_fix_boundary_ties(query, gallery, a, sims, idx, self_pos, kk, budget)
        return

    q_np, g_np = _as_np(query), _as_np(gallery)
    ks = min(kk + 1 + int(has_self), ng)
    # faiss bounds its own working memory (4096 x 1024 BLAS tiles); the chunk bounds our outputs.
    cq = int(chunk_size) if chunk_size else max(1, min(nq, 16384, budget // (ks * 12 * 4)))
    index = None if backend == "faiss" else _approx_index(g_np, backend, ks)
    for a in range(0, nq, cq):
        sp = self_pos[a:a + cq]
        if index is None:
            sims, idx = faiss.knn(q_np[a:a + cq], g_np, ks, metric=faiss.METRIC_INNER_PRODUCT)
        else:
            sims, idx = index.search(q_np[a:a + cq], ks)
        sims, idx = sims.astype(np.float32), idx.astype(np.int64)
        idx[idx >= ng] = -1
        if index is None:
            sims, idx = _sort_rows(*_drop_self(sims, idx, sp, kk + 1))
            yield a, *_fix_boundary_ties(q_np, g_np, a, sims, idx, self_pos, kk, budget)
        else:
            yield a, *_sort_rows(*_drop_self(sims, idx, sp, kk))


def knn(query, gallery=None, k: int = 1, *, exclude_self: bool | None = None,
        backend: str = "auto", chunk_size: int | None = None, memory_mb: float | None = None):
    """k nearest gallery neighbours of each query by cosine similarity (inputs are l2-normalised).

    Args:
        query: (Nq, d) float array or tensor.
        gallery: (Ng, d) references; ``None`` means the queries themselves.
        k: neighbours per query (capped at the number of candidates; missing ones are padded
            with similarity -inf and index -1).
        exclude_self: exclude query i's own row i from its neighbours (by index). Default: True
            exactly when ``gallery`` is None.
        backend: ``auto`` | ``torch`` | ``faiss`` (exact) | ``faiss-hnsw`` | ``faiss-ivf`` (approximate).
        chunk_size: queries per chunk; default derived from ``memory_mb`` (default 256 MiB).

    Returns:
        ``(sims, idx)``: (Nq, k) float32 cosine similarities, descending, and int64 gallery
        indices; ties are broken by the smaller index.
    """
    q = check_embeddings(query, "query")
    g = q if gallery is None else check_embeddings(gallery, "gallery")
    if q.shape[1] != g.shape[1]:
        raise ValueError(f"query has dimension {q.shape[1]} but gallery has {g.shape[1]}")
    if exclude_self is None:
        exclude_self = gallery is None
    if exclude_self and q.shape[0] != g.shape[0]:
        raise ValueError("exclude_self needs query and gallery of the same length")
    self_pos = np.arange(q.shape[0]) if exclude_self else np.full(q.shape[0], -1, np.int64)
    parts = list(iter_knn(q, g, k, self_pos=self_pos, backend=backend,
                          chunk_size=chunk_size, memory_mb=memory_mb))
    sims = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, k), np.float32)
    idx = np.concatenate([p[2] for p in parts]) if parts else np.zeros((0, k), np.int64)
    return sims, idx


def first_positive_rank(query, gallery, q_labels: np.ndarray, g_labels: np.ndarray,
                        self_pos: np.ndarray, memory_mb: float | None = None) -> np.ndarray:
    """0-based rank of each query's first same-label reference in its exact ranking
    (similarity descending, ties by smaller index, self excluded by index): the number of
    references ranked before it. Recall@K of the query is ``rank < K``. Computed by counting,
    without sorting, in chunks of ``memory_mb``. Queries without a positive get ``ng``."""
    on_torch = isinstance(query, torch.Tensor)
    xp = torch if on_torch else np
    dev = query.device if on_torch else None

    def arr(a):
        return torch.as_tensor(a, device=dev) if on_torch else np.asarray(a)

    ng = gallery.shape[0]
    gl, ar = arr(g_labels), arr(np.arange(ng))
    step = max(1, _budget(memory_mb) // (ng * 12))
    out = np.empty(query.shape[0], np.int64)
    for a in range(0, query.shape[0], step):
        s = query[a:a + step] @ gallery.T
        sp = self_pos[a:a + step]
        rows, cols = arr(np.flatnonzero(sp >= 0)), arr(sp[sp >= 0])
        s[rows, cols] = -np.inf
        pos = gl[None, :] == arr(q_labels[a:a + step])[:, None]
        pos[rows, cols] = False
        best = xp.amax(xp.where(pos, s, -np.inf), 1)[:, None]
        first = pos & (s == best)
        jbest = (first.to(torch.uint8) if on_torch else first).argmax(1)[:, None]
        rank = (s > best).sum(1) + ((s == best) & (ar[None, :] < jbest)).sum(1)
        rank = rank.cpu().numpy() if on_torch else rank
        out[a:a + step] = np.where(pos.any(1).cpu().numpy() if on_torch else pos.any(1), rank, ng)
    return out

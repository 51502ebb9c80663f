"""Compressed index (``--approximate ivfpq``): faiss OPQ + IVF + PQ codes in memory, re-ranked by
exact inner product against float16 copies of the vectors kept on disk.

The search is the two-stage scheme of Jégou et al., "Searching in one billion vectors: re-rank
with source coding" (ICASSP 2011): the product-quantised index (Jégou, Douze, Schmid, "Product
quantization for nearest neighbor search", TPAMI 2011; OPQ rotation: Ge et al., CVPR 2013)
returns ``k * k_factor`` candidates from ``nprobe`` inverted lists, and those candidates alone
are read from ``vectors.f16.npy`` (memory-mapped, so only their pages are read) and ranked by
their exact cosine. faiss's own ``IndexRefine`` does the same with the vectors in memory; this
keeps them on disk so that resident memory is the codes and the coarse quantiser.

Resident memory of a loaded index (bytes; N vectors of dimension d, M PQ bytes, nlist lists,
d' = d or the reduced dimension)::

    N * (M + 8)              codes + int64 ids in the inverted lists
    + nlist * d' * 4         coarse quantiser (IVF centroids)
    + d * d' * 4 + 256 * d' * 4   OPQ / PCA matrix, PQ centroids
    + N * 8                  labels (metadata.arrow is memory-mapped, read per row shown)

plus the candidate rows' pages of ``vectors.f16.npy`` (``N * d * 2`` bytes on disk): they stay
mapped (a page fault per candidate row would cost more than the re-ranking) until they pass
1 GiB, then are dropped (``madvise(MADV_DONTNEED)``; they stay in the page cache).

:func:`plan_ivfpq` chooses ``nlist``, ``M`` and the refinement depth for a memory budget;
:func:`build_ivfpq` trains on a seeded sample and adds the vectors in chunks (never all of
them in float32 at once); :func:`measure_recall` compares with a chunked exact scan.
"""
from __future__ import annotations

import math
import mmap
import os
import time
from pathlib import Path

import numpy as np

__all__ = ["plan_ivfpq", "build_ivfpq", "RefinedIndex", "exact_top_k_chunked", "measure_recall",
           "write_f16_vectors", "resident_bytes", "VECTORS_FILE", "CHUNK_ROWS"]

VECTORS_FILE = "vectors.f16.npy"
CHUNK_ROWS = 65536
_M_CHOICES = (64, 48, 32, 24, 16, 12, 8, 4)  # PQ bytes per vector (8-bit codes)
# training effort (faiss defaults: 50 OPQ iterations, 256 points per PQ centroid, 25 k-means
# iterations): lowered so that a 2-core machine trains a 10 M index in minutes; the recall
# recorded in the manifest is measured with these settings
_OPQ_ITERATIONS, _PQ_POINTS_PER_CENTROID, _IVF_ITERATIONS = 12, 64, 12
_KEEP: list = []  # ProductQuantizers handed to OPQ by raw pointer
_K_FACTOR = {64: 4, 48: 6, 32: 8, 24: 12, 16: 16, 12: 24, 8: 32, 4: 64}  # candidates per result


def _nlist_for(n: int) -> int:
    """A power of two near sqrt(N) (faiss wiki "Guidelines to choose an index": 4 sqrt(N) to
    16 sqrt(N) lists for IVF-Flat; PQ codes scan fast, so fewer, larger lists), with at least
    39 training points per list."""
    if n < 2 * 39:
        return 1
    nl = 2 ** max(0, round(math.log2(math.sqrt(n))))
    while nl > 1 and nl * 39 > n:
        nl //= 2
    return int(nl)


def resident_bytes(n: int, d: int, m: int, nlist: int, d_reduced: int | None = None) -> int:
    """Resident bytes of a loaded ivfpq index (the formula in the module docstring)."""
    dr = d_reduced or d
    return int(n * (m + 8) + nlist * dr * 4 + d * dr * 4 + 256 * dr * 4 + n * 8)


def _gb_rounded_up(gb: float, digits: int = 3) -> str:
    """``gb`` to ``digits`` significant figures, rounded up and never in exponent notation: a
    need of a few kB reads 0.0000573, not 0.00 (as ``:.2f`` gave), and the value shown is itself
    a budget that fits."""
    if gb <= 0:
        return "0"
    decimals = digits - 1 - math.floor(math.log10(gb))
    return f"{math.ceil(gb * 10 ** decimals) / 10 ** decimals:.{max(0, decimals)}f}"


def plan_ivfpq(n: int, d: int, *, memory_gb: float | None = None, reduce_dim: int | None = None) -> dict:
    """``nlist``, PQ bytes ``m``, ``nprobe``, refinement ``k_factor`` and the faiss factory string
    for ``n`` vectors of dimension ``d``. Without a budget: the largest ``m`` <= d'/8 (at most 64);
    with ``memory_gb``: the largest ``m`` whose :func:`resident_bytes` fit (smaller codes get a
    deeper refinement). ValueError when even 4 bytes per vector do not fit."""
    dr = int(reduce_dim) if reduce_dim else d
    if reduce_dim is not None and not 1 <= dr <= d:
        raise ValueError(f"--reduce-dim {reduce_dim} must be between 1 and the dimension {d}")
    if n < 2 * d:  # faiss's OPQ training corrupts memory (segfault, abort) on fewer points; measured
        raise ValueError(f"--approximate ivfpq needs at least 2 x d = {2 * d} vectors to train its rotation and "
                         f"codes, got {n}; search so few exactly (the default) "
                         "or with --approximate hnsw")
    nlist = _nlist_for(n)
    fits = [m for m in _M_CHOICES if dr % m == 0 and m <= max(4, dr // 8)] or [m for m in (4, 2, 1) if dr % m == 0]
    if memory_gb is not None:
        budget = float(memory_gb) * 2 ** 30
        ok = [m for m in fits if resident_bytes(n, d, m, nlist, dr) <= budget]
        if not ok:
            need = resident_bytes(n, d, fits[-1], nlist, dr) / 2 ** 30
            raise ValueError(f"--memory-budget {memory_gb} GB is too small for {n} vectors of dimension {d}: "
                             f"the smallest codes ({fits[-1]} bytes per vector) need {_gb_rounded_up(need)} GB "
                             "resident")
        fits = ok
    m = fits[0]
    nbits = 8 if n >= 39 * 256 else max(1, min(8, int(math.log2(max(2, n // 39)))))
    pre = f"PCAR{dr}," if reduce_dim else ""
    factory = f"{pre}OPQ{m},IVF{nlist},PQ{m}" + (f"x{nbits}" if nbits != 8 else "")
    return {"factory": factory, "nlist": nlist, "m": m, "nbits": nbits, "nprobe": min(nlist, max(1, nlist // 64) * 4),
            "k_factor": _K_FACTOR.get(m, 64), "d_reduced": dr,
            "resident_bytes": resident_bytes(n, d, m, nlist, dr)}


def _sample_rows(n: int, size: int, seed: int) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(n, size=min(n, size), replace=False))


def _read_rows(vectors, rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(vectors[rows], dtype=np.float32))


def _untrained(plan: dict, d: int):
    import faiss

    index = faiss.index_factory(d, plan["factory"], faiss.METRIC_INNER_PRODUCT)
    # OPQ trains its rotation with a PQ of its own (8 bits unless told): give it ours, so that small
    # galleries do not get 256 centroids from fewer points (faiss warns, and the codes are worse)
    for i in range(index.chain.size()):
        vt = faiss.downcast_VectorTransform(index.chain.at(i))
        if isinstance(vt, faiss.OPQMatrix):
            vt.pq = faiss.ProductQuantizer(vt.d_out, plan["m"], plan["nbits"])
            vt.pq.cp.max_points_per_centroid = _PQ_POINTS_PER_CENTROID
            vt.niter, vt.max_train_points = _OPQ_ITERATIONS, _PQ_POINTS_PER_CENTROID * 2 ** plan["nbits"]
            _KEEP.append(vt.pq)  # the C++ side holds a raw pointer
    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
    ivf.cp.seed = 1234
    ivf.cp.niter = _IVF_ITERATIONS
    ivf.pq.cp.max_points_per_centroid = _PQ_POINTS_PER_CENTROID
    ivf.nprobe = plan["nprobe"]
    return index


def build_ivfpq(vectors, plan: dict, *, train_size: int | None = None, seed: int = 0,
                chunk_rows: int = CHUNK_ROWS):
    """Train the index of ``plan`` on a seeded sample of the rows of ``vectors`` (an array or a
    ``np.memmap``, l2-normalised), then add every row in chunks of ``chunk_rows`` (float32 only
    per chunk). Returns ``(faiss index, train_rows, seconds)``."""
    n, d = vectors.shape
    t = time.perf_counter()
    index = _untrained(plan, d)
    size = train_size or max(256 * 39, 64 * plan["nlist"])
    held = held_out_rows(n, np.zeros(0, np.int64), min(1000, n // 10))  # recall queries: never trained on
    pool = np.setdiff1d(_sample_rows(n, size + held.size, seed), held)
    train_rows = np.sort(np.random.default_rng(seed).choice(pool, size=min(size, pool.size), replace=False))
    index.train(_read_rows(vectors, train_rows))
    for a in range(0, n, chunk_rows):
        index.add(np.ascontiguousarray(np.asarray(vectors[a:a + chunk_rows], dtype=np.float32)))
    return index, train_rows, time.perf_counter() - t


def write_f16_vectors(path: str | Path, chunks, n: int, d: int) -> Path:
    """Write ``n`` x ``d`` float16 rows from an iterable of float32 chunks to a ``.npy`` file
    (``np.lib.format.open_memmap``: nothing is held in memory beyond one chunk)."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, d))
    at = 0
    for c in chunks:
        out[at:at + len(c)] = c
        at += len(c)
    if at != n:
        raise ValueError(f"{path}: wrote {at} rows, expected {n}")
    out.flush()
    del out
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return Path(path)


def _file_backed_bytes() -> int | None:
    """Resident file-backed and shared bytes of this process (``/proc/self/statm``), or None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[2]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return None


class _MappedRows:
    """Rows of a float16 ``.npy`` file: :meth:`gather` reads the re-ranked candidates with
    ``pread`` (never through the mapping); the read-only ``mmap`` (``array``) serves the bulk
    readers (export, ``--add``, the recall check), and :meth:`release`, called after each
    search, drops the pages they touched once they exceed ``budget`` bytes (they stay in the
    page cache, out of this process's resident set)."""

    budget = 2 ** 30

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                     else np.lib.format.read_array_header_2_0(f))
            offset = f.tell()
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.fd = os.dup(f.fileno())  # the same file as the mapping, even if the folder is replaced
        if fortran or len(shape) != 2:
            raise ValueError(f"{path}: expected a C-ordered 2-d array, got shape {shape}")
        self.array = np.frombuffer(self.map, dtype=dtype, count=shape[0] * shape[1], offset=offset).reshape(shape)
        self.offset, self.row_bytes = offset, shape[1] * np.dtype(dtype).itemsize
        if hasattr(mmap, "MADV_RANDOM"):
            self.map.madvise(mmap.MADV_RANDOM)  # candidates are scattered: no read-ahead
        self.baseline = _file_backed_bytes()

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """``array[rows]`` read with ``os.pread`` (one call per distinct row), not through the
        mapping: a page fault on the mapping maps a whole large folio of the page cache into this
        process, and at 10 M vectors one search of 100 queries (16,000 candidate rows) grew the
        resident set by 2.1 GiB that way (bench/RESULTS.md section 13)."""
        uniq, inverse = np.unique(np.asarray(rows, dtype=np.int64), return_inverse=True)
        out = np.empty((len(uniq), self.array.shape[1]), self.array.dtype)
        views, n = [memoryview(r).cast("B") for r in out], self.row_bytes
        for view, row in zip(views, uniq.tolist()):
            if os.preadv(self.fd, [view], self.offset + row * n) != n:
                raise OSError(f"short read of row {row} from the index's float16 vectors")
        return out[inverse.reshape(-1)]

    def release(self) -> None:
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        now = _file_backed_bytes()
        if now is None or self.baseline is None or now - self.baseline > self.budget:
            self.map.madvise(mmap.MADV_DONTNEED)
            self.baseline = _file_backed_bytes()  # without this file's pages (libraries may have grown)


class RefinedIndex:
    """A trained OPQ/IVF/PQ faiss index plus the float16 vectors it re-ranks with.

    ``vectors``: an ``[N, d]`` float16 array, or the path of ``vectors.f16.npy`` (memory-mapped).
    :meth:`search` returns ``(sims, idx)`` like :func:`deepmetric.evaluate.knn.knn`: exact
    cosines of the re-ranked candidates, descending, ties by the smaller row, -1 / -inf padding.
    """

    def __init__(self, faiss_index, vectors, *, k_factor: int, nprobe: int | None = None):
        import faiss

        self.index = faiss_index
        self.mapped = _MappedRows(Path(vectors)) if isinstance(vectors, (str, Path)) else None
        self.vectors = self.mapped.array if self.mapped is not None else vectors
        self.k_factor = int(k_factor)
        if nprobe is not None:
            faiss.extract_index_ivf(faiss_index).nprobe = int(nprobe)

    @property
    def nprobe(self) -> int:
        import faiss

        return int(faiss.extract_index_ivf(self.index).nprobe)

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def candidates(self, q: np.ndarray, k: int) -> np.ndarray:
        kk = min(self.ntotal, max(k, k * self.k_factor))
        return self.index.search(np.ascontiguousarray(q, dtype=np.float32), kk)[1]

    def search(self, q: np.ndarray, k: int, *, block: int = 256):
        q = np.ascontiguousarray(q, dtype=np.float32)
        parts = [self._search_block(q[a:a + block], k) for a in range(0, q.shape[0], block)]
        if self.mapped is not None:
            self.mapped.release()
        if not parts:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _search_block(self, q: np.ndarray, k: int):
        cand = self.candidates(q, k)
        valid = cand >= 0
        nq, c = cand.shape
        # only the candidates' rows are read (from the page cache / disk when on disk)
        rows = np.where(valid, cand, 0).ravel()
        vecs = (self.mapped.gather(rows) if self.mapped is not None else self.vectors[rows])
        vecs = vecs.reshape(nq, c, -1).astype(np.float32)
        sims = np.where(valid, np.matmul(vecs, q[:, :, None])[..., 0], -np.inf).astype(np.float32)
        if c > k:  # the k best, then sorted: descending cosine, ties by the smaller row
            part = np.argpartition(-sims, k - 1, axis=1)[:, :k]
            sims, cand = np.take_along_axis(sims, part, 1), np.take_along_axis(cand, part, 1)
        order = np.lexsort((np.where(np.isfinite(sims), cand, np.iinfo(np.int64).max), -sims), axis=1)[:, :k]
        out_s = np.take_along_axis(sims, order, 1)
        out_i = np.take_along_axis(cand, order, 1).astype(np.int64)
        out_i[~np.isfinite(out_s)] = -1
        return out_s, out_i


def exact_top_k_chunked(vectors, q: np.ndarray, k: int, *, chunk_rows: int = 262144):
    """Exact top-``k`` inner products of ``q`` over the rows of ``vectors`` (array or memmap, any
    float dtype) scanned in chunks of ``chunk_rows`` converted to float32: memory is one chunk
    plus the ``[Nq, k]`` heaps. ``(sims, idx)``, descending, ties by the smaller row."""
    import faiss

    q = np.ascontiguousarray(q, dtype=np.float32)
    n = vectors.shape[0]
    k = min(k, n)
    best_s = np.full((q.shape[0], 0), -np.inf, np.float32)
    best_i = np.zeros((q.shape[0], 0), np.int64)
    for a in range(0, n, chunk_rows):
        block = np.ascontiguousarray(np.asarray(vectors[a:a + chunk_rows], dtype=np.float32))
        s, i = faiss.knn(q, block, min(k, block.shape[0]), metric=faiss.METRIC_INNER_PRODUCT)
        s = np.concatenate([best_s, s], 1)
        i = np.concatenate([best_i, i + a], 1)
        order = np.lexsort((i, -s), axis=1)[:, :k]
        best_s, best_i = np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)
    return best_s, best_i


def _without(rows: np.ndarray, own: np.ndarray, k: int) -> list[set]:
    return [set(r[(r >= 0) & (r != o)][:k].tolist()) for r, o in zip(rows, own)]


def measure_recall(search, vectors, query_rows: np.ndarray, *, k: int = 10, exact=None) -> dict:
    """Mean share of the exact top-``k`` (:func:`exact_top_k_chunked`, or ``exact``) that
    ``search(q, k)`` returns for the rows ``query_rows`` of ``vectors`` used as queries. Each
    query's own row is left out of both lists (top ``k + 1`` less itself), so that finding
    itself does not flatter the recall: it estimates the recall of queries not in the index."""
    q = _read_rows(vectors, query_rows)
    if exact is None:
        exact = exact_top_k_chunked(vectors, q, k + 1)[1]
    got = search(q, k + 1)[1]
    want, have = _without(exact, query_rows, k), _without(got, query_rows, k)
    hits = [len(a & e) / max(1, len(e)) for a, e in zip(have, want)]
    return {"recall": float(np.mean(hits)), "exact": exact}


def held_out_rows(n: int, train_rows: np.ndarray, count: int = 1000, seed: int = 1) -> np.ndarray:
    """Up to ``count`` rows not used to train the quantisers (seeded), as recall queries."""
    mask = np.ones(n, bool)
    mask[train_rows] = False
    free = np.flatnonzero(mask)
    if free.size == 0:
        free = np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(free, size=min(count, free.size), replace=False))


def tune_refined(refined: RefinedIndex, vectors, rows: np.ndarray, *, target: float = 0.95, k: int = 10,
                 max_factor: int = 64) -> dict:
    """Search wider until recall@``k`` on ``rows`` reaches ``target``: alternately double
    ``nprobe`` (up to nlist) and the refinement depth ``k_factor`` (up to ``max_factor``); the
    exact neighbours are computed once. Returns the recall reached and the settings."""
    import faiss

    ivf = faiss.extract_index_ivf(refined.index)
    r = measure_recall(refined.search, vectors, rows, k=k)
    step = 0
    while r["recall"] < target:
        can_probe, can_refine = ivf.nprobe < ivf.nlist, refined.k_factor < max_factor
        if not (can_probe or can_refine):
            break
        if can_probe and (step % 2 == 0 or not can_refine):
            ivf.nprobe = min(ivf.nlist, ivf.nprobe * 2)
        else:
            refined.k_factor = min(max_factor, refined.k_factor * 2)
        step += 1
        r = measure_recall(refined.search, vectors, rows, k=k, exact=r["exact"])
    return {"recall@10_vs_exact": round(r["recall"], 4), "recall_queries": int(len(rows)),
            "nprobe": int(ivf.nprobe), "k_factor": int(refined.k_factor)}


def build_refined(vectors: np.ndarray, *, memory_gb: float | None = None, reduce_dim: int | None = None,
                  target_recall: float = 0.95, seed: int = 0) -> tuple[RefinedIndex, dict]:
    """Plan (:func:`plan_ivfpq`), train and fill an ivfpq index over the float16 ``vectors``
    (l2-normalised) and tune its search on held-out rows (:func:`tune_refined`). Returns the
    :class:`RefinedIndex` and the manifest's ``approximate`` record.

    ``reduce_dim``: a PCA (faiss ``PCAR``, stored in ``index.faiss``) to that many dimensions
    before OPQ; the re-ranking still uses the full vectors. This is the hook for another
    reduction (a learned whitening): any faiss ``VectorTransform`` prefix of the factory string."""
    n, d = vectors.shape
    plan = plan_ivfpq(n, d, memory_gb=memory_gb, reduce_dim=reduce_dim)
    index, train_rows, build_s = build_ivfpq(vectors, plan, seed=seed)
    refined = RefinedIndex(index, vectors, k_factor=plan["k_factor"])
    t = time.perf_counter()
    tuned = tune_refined(refined, vectors, held_out_rows(n, train_rows), target=target_recall)
    record = {"kind": "ivfpq", "factory": plan["factory"], "nlist": plan["nlist"], "pq_bytes": plan["m"],
              "pq_bits": plan["nbits"], "reduce_dim": reduce_dim, "memory_budget_gb": memory_gb,
              "resident_bytes_estimate": plan["resident_bytes"], "train_rows": int(len(train_rows)),
              "build_s": round(build_s, 3), "tune_s": round(time.perf_counter() - t, 3),
              "recall_on": "held-out rows (not in the training sample) as queries, each one's own row left out",
              "target_recall": target_recall, **tuned}
    return refined, record


def add_refined(refined: RefinedIndex, added: np.ndarray, all_vectors: np.ndarray, record: dict) -> None:
    """Encode ``added`` (float16 rows) into the trained index, re-rank against ``all_vectors``
    from now on, and re-measure the recall on a seeded sample of all rows."""
    refined.index.add(np.ascontiguousarray(added, dtype=np.float32))
    refined.vectors, refined.mapped = all_vectors, None
    rows = np.sort(np.random.default_rng(1).choice(len(all_vectors), size=min(1000, len(all_vectors)),
                                                   replace=False))
    record["recall@10_vs_exact"] = round(measure_recall(refined.search, all_vectors, rows)["recall"], 4)
    record["recall_queries"] = int(len(rows))
    record["recall_on"] = "a sample of all rows as queries, each one's own row left out (after --add)"

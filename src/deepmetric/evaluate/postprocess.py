"""Retrieval post-processing of a fixed embedding: learned whitening, database-side augmentation,
alpha-query expansion and k-reciprocal re-ranking (docs/search.md, "Post-processing").

Pure functions over [N, d] arrays (numpy on the CPU, torch tensors on their device); every
neighbour search goes through the memory-bounded k-NN of :mod:`deepmetric.evaluate.knn`, so the
same code runs on the CPU (faiss) and on a GPU (torch). Inputs are l2-normalised first.

- :func:`fit_whitening` / :func:`apply_whitening`: PCA whitening (Radenovic, Tolias & Chum,
  "Fine-tuning CNN image retrieval with no human annotation", TPAMI 2018, section 3.3 eq. 6 -- here
  the unsupervised PCA form of Jegou & Chum, ECCV 2012): x -> P^T (x - mu) / ||.||, P = U_D
  (Lambda_D + eps)^-1/2 from the eigen-decomposition of the fit set's covariance, with shrinkage
  s: the covariance becomes (1 - s) C + s (tr C / d) I (s = 0 full whitening, s = 1 a PCA rotation).
- :func:`dba`: database-side augmentation (Arandjelovic & Zisserman, "Three things everyone should
  know to improve object retrieval", CVPR 2012, section 4; the alpha-weighted form of Radenovic et
  al. 2018 section 3.4): g_i <- || sum_{j in N_k(i)} max(g_i^T g_j, 0)^alpha g_j ||, N_k(i) the k
  nearest gallery items of i, i itself included (weight 1).
- :func:`aqe`: alpha-query expansion (Radenovic et al. 2018, section 3.4 eq. 7): q <- || q + sum_{j
  in N_k(q)} max(q^T g_j, 0)^alpha g_j ||, N_k(q) the k nearest gallery items (the query's own
  gallery row excluded by index).
- k-reciprocal re-ranking: :mod:`deepmetric.evaluate.kreciprocal`.

:class:`Postprocessor` runs a list of steps (``search.postprocess`` in a config, ``--postprocess``
on the command line) in the fixed order whiten -> dba -> aqe -> kreciprocal: the gallery side
(whitening fitted, DBA) once, the query side (whitening applied, AQE) per query, and the
re-ranking of each query's candidate list.
"""
from __future__ import annotations

import numpy as np
import torch

from deepmetric.evaluate._checks import check_embeddings
from deepmetric.evaluate.knn import _budget, iter_knn
from deepmetric.evaluate.kreciprocal import KReciprocalGraph, rerank

__all__ = ["STEPS", "parse_step", "parse_steps", "check_steps", "format_steps", "fit_whitening",
           "apply_whitening", "dba", "aqe", "Postprocessor"]

#: step name -> {key: (type, default)}; the fixed order of the steps is the order of this dict
STEPS: dict[str, dict[str, tuple[type, object]]] = {
    "whiten": {"dim": (int, None), "shrinkage": (float, 0.0), "fit": (str, "gallery")},
    "dba": {"k": (int, 3), "alpha": (float, 3.0)},
    "aqe": {"k": (int, 2), "alpha": (float, 3.0)},
    "kreciprocal": {"k1": (int, 20), "k2": (int, 6), "lambda": (float, 0.3), "candidates": (int, 100)},
}
WHITEN_FITS = ("gallery", "train")
EIG_FLOOR = 1e-6  # eigenvalues below this share of the largest are directions the fit set does not span


# --------------------------------------------------------------------------- the steps' spelling
def _value(text: str, tp: type, where: str):
    if tp is str:
        return text
    try:
        return tp(text) if tp is float else int(text)
    except ValueError:
        raise ValueError(f"{where}: expected {tp.__name__}, got {text!r}") from None


def parse_step(text: str) -> dict:
    """``"whiten:dim=256,fit=gallery"`` -> ``{"name": "whiten", "dim": 256, "fit": "gallery"}``
    (checked by :func:`check_steps`)."""
    name, _, rest = str(text).partition(":")
    step: dict = {"name": name.strip()}
    spec = STEPS.get(step["name"], {})
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, val = part.partition("=")
        if not eq:
            raise ValueError(f"post-processing step {text!r}: {part!r} is not KEY=VALUE")
        key = key.strip()
        if key in step:  # 'whiten:dim=4,dim=6' would keep the last one silently
            raise ValueError(f"--postprocess {text!r}: {key} is given twice")
        tp = spec.get(key, (str, None))[0]
        where = f"--postprocess {text!r} ({step['name']}): {key}"
        step[key] = None if val.strip().lower() in ("none", "null") else _value(val.strip(), tp, where)
    return _check_step(step, f"--postprocess {text!r}")


def parse_steps(texts) -> list[dict]:
    """:func:`parse_step` of each text, then the whole list checked."""
    return check_steps([parse_step(t) for t in texts or []], where="--postprocess")


def _check_step(step, where: str) -> dict:
    if not isinstance(step, dict) or "name" not in step:
        raise ValueError(f"{where}: expected a mapping with 'name' (one of {', '.join(STEPS)}), got {step!r}")
    name = step["name"]
    if name not in STEPS:
        raise ValueError(f"{where}: unknown post-processing step {name!r}; choose from {', '.join(STEPS)}")
    spec = STEPS[name]
    bad = [k for k in step if k != "name" and k not in spec]
    if bad:
        raise ValueError(f"{where} ({name}): unknown key(s) {', '.join(map(repr, bad))}; "
                         f"{name} takes {', '.join(spec)}")
    out = {"name": name}
    for key, (tp, default) in spec.items():
        v = step.get(key, default)
        if v is not None and tp is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if v is not None and (isinstance(v, bool) or not isinstance(v, tp)):
            raise ValueError(f"{where} ({name}): {key} must be {tp.__name__}, got {v!r}")
        out[key] = v
    positive = [k for k in ("dim", "k", "k1", "k2", "candidates") if k in out and out[k] is not None]
    for k in positive:
        if out[k] < 1:
            raise ValueError(f"{where} ({name}): {k} must be >= 1, got {out[k]}")
    for k, lo, hi in (("shrinkage", 0, 1), ("lambda", 0, 1), ("alpha", 0, 100)):
        if k in out and not lo <= out[k] <= hi:
            raise ValueError(f"{where} ({name}): {k} must be in [{lo}, {hi}], got {out[k]}")
    if name == "whiten" and out["fit"] not in WHITEN_FITS:
        raise ValueError(f"{where} (whiten): fit must be one of {', '.join(WHITEN_FITS)}, got {out['fit']!r}")
    return out


def check_steps(steps, where: str = "search.postprocess") -> list[dict]:
    """Validated steps with their defaults filled in; an unknown step or key, a bad value, a
    repeated step or an order other than whiten, dba, aqe, kreciprocal is a ``ValueError``
    naming it (``where`` prefixes the message: the config key or the flag)."""
    if steps is None:
        return []
    if not isinstance(steps, (list, tuple)):
        raise ValueError(f"{where}: expected a list of steps such as [{{name: whiten, dim: 256}}], got {steps!r}")
    out = [_check_step(s, f"{where}.{i}") for i, s in enumerate(steps)]
    names = [s["name"] for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: each step may appear once, got {', '.join(names)}")
    order = list(STEPS)
    if names != sorted(names, key=order.index):
        raise ValueError(f"{where}: steps run in the order {' -> '.join(order)}; got {' -> '.join(names)}")
    return out


def format_steps(steps) -> str:
    """The command-line spelling of checked steps (``whiten:dim=256,... dba:k=3,...``)."""
    parts = []
    for s in steps or []:
        kv = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items() if k != "name")
        parts.append(f"{s['name']}:{kv}" if kv else s["name"])
    return " ".join(parts) or "none"


# --------------------------------------------------------------------------- whitening
def _torch(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))


def _like(t: torch.Tensor, ref):
    """``t`` as the type of ``ref`` (numpy for numpy input, a tensor on its device otherwise)."""
    return t if isinstance(ref, torch.Tensor) else np.ascontiguousarray(t.cpu().numpy())


def _l2n(t: torch.Tensor) -> torch.Tensor:
    return t / torch.linalg.vector_norm(t, dim=1, keepdim=True).clamp_min(1e-12)


def fit_whitening(x, dim: int | None = None, shrinkage: float = 0.0, *,
                  memory_mb: float | None = None) -> dict[str, np.ndarray]:
    """PCA whitening of the (l2-normalised) rows of ``x``: ``{"mean": [d], "projection": [d, D]}``
    float32 (module docstring; ``D = dim``, default d). The covariance is summed in row chunks of
    ``memory_mb`` (float64); eigenvalues are floored at ``EIG_FLOOR`` x the largest."""
    xt = _torch(check_embeddings(x, "whitening fit set"))
    n, d = xt.shape
    given = dim
    dim = d if dim is None else int(dim)
    if not 1 <= dim <= d:
        raise ValueError(f"whiten: dim must be in [1, {d}] (the embedding size), got {dim}")
    if dim > n - 1:
        # n centred rows span at most n - 1 directions: the others have eigenvalue 0 and would be
        # scaled up from rounding noise (recall fell to 0 on a 6-row gallery with dim 8), so such a
        # whitening is refused rather than returned (postprocess_choice skips these options too)
        what = f"dim={dim}" if given is not None else f"dim (default: the embedding size, {d})"
        fix = f"give dim <= {n - 1}, or fit on more embeddings" if n > 1 else "fit on more embeddings"
        raise ValueError(f"whiten: {what} is more than a fit set of {n} row(s) spans ({n - 1} directions "
                         f"after centring); {fix}")
    step = max(1, _budget(memory_mb) // (8 * d))
    mean = torch.zeros(d, dtype=torch.float64, device=xt.device)
    for a in range(0, n, step):
        mean += xt[a:a + step].double().sum(0)
    mean /= n
    if n <= d and dim <= n and n * d * 8 <= _budget(memory_mb):
        # fewer rows than dimensions (a small gallery): the n x n Gram matrix of the centred rows
        # has the covariance's non-zero eigenvalues (times n); its eigenvectors u give the
        # covariance's as Xc^T u (normalised). O(n^2 d) instead of the d x d problem's O(d^3).
        xc = xt.double() - mean
        lam, u = torch.linalg.eigh(xc @ xc.T)  # ascending
        lam, u = lam.flip(0) / n, u.flip(1)
        vec = xc.T @ u
        vec = vec / torch.linalg.vector_norm(vec, dim=0, keepdim=True).clamp_min(1e-12)
    else:
        cov = torch.zeros((d, d), dtype=torch.float64, device=xt.device)
        for a in range(0, n, step):
            c = xt[a:a + step] - mean.float()
            cov += (c.T @ c).double()  # float32 products, float64 sums
        lam, vec = torch.linalg.eigh(cov / n)  # ascending
        lam, vec = lam.flip(0), vec.flip(1)
    lam = lam.clamp_min(0)
    if not float(lam[0]) > 0:  # every fit row the same vector: no direction to scale by
        raise ValueError(f"whiten: the {n} rows of the fit set are all the same direction (zero covariance); "
                         "fit the whitening on embeddings that differ")
    lam = (1 - shrinkage) * lam + shrinkage * lam.sum() / d  # tr(C) / d
    lam = lam.clamp_min(EIG_FLOOR * float(lam[0]))
    proj = vec[:, :dim] / lam[:dim].sqrt()
    return {"mean": mean.float().cpu().numpy(), "projection": proj.float().cpu().numpy()}


def apply_whitening(x, params: dict):
    """``|| (x - mean) @ projection ||`` of the l2-normalised rows of ``x`` (same type / device)."""
    xt = _torch(check_embeddings(x))
    mean = torch.as_tensor(params["mean"], device=xt.device)
    proj = torch.as_tensor(params["projection"], device=xt.device)
    if xt.shape[1] != proj.shape[0]:
        raise ValueError(f"whiten: the embeddings have dimension {xt.shape[1]} but the whitening was "
                         f"fitted on dimension {proj.shape[0]}")
    return _like(_l2n((xt - mean) @ proj), x)


# --------------------------------------------------------------------------- DBA and alpha-QE
def _expand(query, gallery, k: int, alpha: float, self_pos: np.ndarray, *, backend: str = "auto",
            memory_mb: float | None = None):
    """|| q + sum over the k nearest gallery rows g_j of max(q^T g_j, 0)^alpha g_j || per query row
    (numpy rows gathered with numpy: a memory-mapped gallery is only read where needed)."""
    on_torch = isinstance(query, torch.Tensor)
    out = query.clone() if on_torch else np.array(query, dtype=np.float32)
    chunk = max(1, _budget(memory_mb) // (4 * max(k, 1) * query.shape[1] * 2))
    for a, sims, idx in iter_knn(query, gallery, k, self_pos=self_pos, backend=backend,
                                 chunk_size=chunk, memory_mb=memory_mb):
        w = np.where(idx >= 0, np.maximum(sims, 0) ** alpha, 0).astype(np.float32)
        rows = np.maximum(idx, 0)
        if on_torch:
            nb = gallery[torch.as_tensor(rows, device=gallery.device)]
            out[a:a + len(idx)] += (torch.as_tensor(w, device=nb.device)[..., None] * nb).sum(1)
        else:
            out[a:a + len(idx)] += np.einsum("ck,ckd->cd", w, gallery[rows])
    if on_torch:
        return _l2n(out)
    return np.ascontiguousarray(out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12), dtype=np.float32)


def dba(gallery, k: int = 3, alpha: float = 3.0, *, backend: str = "auto", memory_mb: float | None = None):
    """Database-side augmentation (module docstring): each gallery row replaced by the
    sim^alpha-weighted sum of itself and its ``k - 1`` nearest other gallery rows, l2-normalised.
    ``k = 1`` returns the input."""
    g = check_embeddings(gallery, "gallery")
    if k <= 1:
        return g
    return _expand(g, g, k - 1, alpha, np.arange(g.shape[0]), backend=backend, memory_mb=memory_mb)


def aqe(query, gallery, k: int = 2, alpha: float = 3.0, *, self_pos=None, backend: str = "auto",
        memory_mb: float | None = None):
    """Alpha-query expansion (module docstring): each query plus its ``k`` nearest gallery rows
    weighted by sim^alpha, l2-normalised. ``self_pos[i]``: query i's own gallery row (excluded
    from its neighbours), -1 for none."""
    q, g = check_embeddings(query, "query"), check_embeddings(gallery, "gallery")
    sp = np.full(q.shape[0], -1, np.int64) if self_pos is None else np.asarray(self_pos, np.int64)
    return _expand(q, g, k, alpha, sp, backend=backend, memory_mb=memory_mb)


# --------------------------------------------------------------------------- the pipeline
class Postprocessor:
    """Checked steps (:func:`check_steps`) and what they fitted on a gallery.

    ``fit(gallery, fit_sets={"train": X})`` runs the gallery side (whitening fitted on the
    gallery or on ``fit_sets[fit]``, then DBA) and returns the processed gallery;
    ``transform_queries(q, gallery, self_pos)`` runs the query side (whitening, AQE against the
    processed gallery); ``rerank(q, gallery, sims, idx, self_pos)`` re-orders candidate lists
    with k-reciprocal re-ranking (identity without that step). ``state()`` / ``from_state``
    keep the fitted arrays (an index stores them in ``postprocess.npz``).
    """

    def __init__(self, steps=None, *, backend: str = "auto", memory_mb: float | None = None,
                 where: str = "search.postprocess"):
        self.steps = check_steps(steps, where)
        self.backend, self.memory_mb = backend, memory_mb
        self.whitening: dict | None = None
        self.graph: KReciprocalGraph | None = None

    def __bool__(self) -> bool:
        return bool(self.steps)

    def step(self, name: str) -> dict | None:
        return next((s for s in self.steps if s["name"] == name), None)

    @property
    def list_length(self) -> int:
        """The shortest candidate list the re-ranking needs (0 without it)."""
        s = self.step("kreciprocal")
        return max(s["candidates"], s["k1"], s["k2"]) if s else 0

    def fit(self, gallery, *, fit_sets: dict | None = None):
        g = check_embeddings(gallery, "gallery")
        w = self.step("whiten")
        if w is not None:
            if w["fit"] == "gallery":
                src = g
            elif (fit_sets or {}).get(w["fit"]) is not None:
                src = fit_sets[w["fit"]]
            else:
                raise ValueError(f"whiten: fit={w['fit']} needs the {w['fit']} embeddings, which were not given "
                                 "('deepmetric evaluate ... --fit-embeddings TRAIN.npz'); or use fit=gallery "
                                 "(no labels: the gallery being searched)")
            self.whitening = fit_whitening(src, w["dim"], w["shrinkage"], memory_mb=self.memory_mb)
            g = apply_whitening(g, self.whitening)
        d = self.step("dba")
        if d is not None:
            g = dba(g, d["k"], d["alpha"], backend=self.backend, memory_mb=self.memory_mb)
        self.graph = None
        return g

    def transform_queries(self, query, gallery, self_pos=None):
        q = check_embeddings(query, "query")
        if self.whitening is not None:
            q = apply_whitening(q, self.whitening)
        a = self.step("aqe")
        if a is not None:  # the gallery is this object's fit output: already l2-normalised
            sp = np.full(q.shape[0], -1, np.int64) if self_pos is None else np.asarray(self_pos, np.int64)
            q = _expand(q, gallery, a["k"], a["alpha"], sp, backend=self.backend, memory_mb=self.memory_mb)
        return q

    def add_gallery_rows(self, x):
        """New gallery rows processed with the stored fit (whitening); DBA would change the old
        rows' neighbours, so an index with DBA is refused. The re-ranking graph is rebuilt."""
        if self.step("dba") is not None:
            raise ValueError("this index was built with post-processing step dba, whose augmented rows depend on "
                             "the whole gallery: rebuild it with 'deepmetric index ... --overwrite' instead of --add")
        self.graph = None
        return apply_whitening(x, self.whitening) if self.whitening is not None else check_embeddings(x)

    def rerank(self, query, gallery, sims: np.ndarray, idx: np.ndarray, self_pos=None):
        s = self.step("kreciprocal")
        if s is None:
            return sims, idx
        if self.graph is None:
            self.graph = KReciprocalGraph.build(gallery, s["k1"], s["k2"], backend=self.backend,
                                                memory_mb=self.memory_mb)
        return rerank(self.graph, query, gallery, sims, idx, self_pos=self_pos, lam=s["lambda"],
                      candidates=s["candidates"], memory_mb=self.memory_mb)

    def state(self) -> dict[str, np.ndarray]:
        """The fitted arrays (``whiten_mean``, ``whiten_projection``) to store beside the steps."""
        if self.whitening is None:
            return {}
        return {"whiten_mean": self.whitening["mean"], "whiten_projection": self.whitening["projection"]}

    @classmethod
    def from_state(cls, steps, arrays: dict, **kw) -> "Postprocessor":
        p = cls(steps, **kw)
        if p.step("whiten") is not None:
            if "whiten_mean" not in arrays or "whiten_projection" not in arrays:
                raise ValueError("post-processing: the steps include whiten but its fitted arrays "
                                 "(whiten_mean, whiten_projection) are missing")
            p.whitening = {"mean": np.asarray(arrays["whiten_mean"], np.float32),
                           "projection": np.asarray(arrays["whiten_projection"], np.float32)}
        return p

"""Choosing the post-processing of an embedding on a validation split (never on test).

:func:`choose_postprocess` walks the steps in their fixed order (whiten, dba, aqe, kreciprocal)
and, for each, keeps the option of :data:`DEFAULT_SPACE` (or the given space) that raises the
validation metric most over the steps kept so far, or none when no option raises it: a greedy
coordinate search of 1 + sum of the options' counts evaluations (10 by default, 11 with k-reciprocal; seconds on a
few thousand validation images) instead of the full grid's product (64). The metric is that
of :func:`deepmetric.evaluate.evaluate`, or, with ``domains``, the mean over domains of the
cross-domain metric (:func:`deepmetric.evaluate.evaluate_cross_domain`: each domain's images
searched among the others', the whitening fitted on that gallery).
"""
from __future__ import annotations

import time
import warnings

import numpy as np

from deepmetric.evaluate.cross_domain import evaluate_cross_domain
from deepmetric.evaluate.engine import evaluate
from deepmetric.evaluate.postprocess import STEPS, check_steps, format_steps

__all__ = ["DEFAULT_SPACE", "choose_postprocess"]

#: options tried per step (the step left out is always a candidate); whitening dimensions at or
#: above the embedding's or the fit set's size are skipped; k-reciprocal is tried only when asked
DEFAULT_SPACE: dict[str, list[dict]] = {
    "whiten": [{"dim": 512}, {"dim": 256}, {"dim": 128}],
    "dba": [{"k": 2, "alpha": 3.0}, {"k": 3, "alpha": 3.0}, {"k": 5, "alpha": 3.0}],
    "aqe": [{"k": 1, "alpha": 3.0}, {"k": 2, "alpha": 3.0}, {"k": 3, "alpha": 3.0}],
    "kreciprocal": [{"k1": 20, "k2": 6, "lambda": 0.3}],
}


def _space(space, dim: int, kreciprocal: bool, fit_rows: int) -> dict[str, list[dict]]:
    default = space is None
    space = {k: list(v or []) for k, v in (DEFAULT_SPACE if default else space).items()}
    bad = [k for k in space if k not in STEPS]
    if bad:
        raise ValueError(f"post-processing space: unknown step(s) {bad}; choose from {', '.join(STEPS)}")
    if default and not kreciprocal:
        space.pop("kreciprocal")
    # a whitening to as many dimensions as the fit set has rows (or more) would scale up directions
    # it does not span: such options are skipped, as are those at or above the embedding's size
    space["whiten"] = [o for o in space.get("whiten", []) if o.get("dim") is None or o["dim"] < min(dim, fit_rows)]
    for name, options in space.items():  # every option checked before the first evaluation
        for o in options:
            check_steps([{"name": name, **o}], where="post-processing space")
    return space


def choose_postprocess(embeddings, labels, *, domains=None, metric: str = "map@r", ks=(1,), space=None,
                       kreciprocal: bool = False, **evaluate_kw) -> dict:
    """The validation-chosen post-processing of ``embeddings`` (module docstring).

    Args:
        embeddings, labels: the validation split's (N, d) embeddings and (N,) labels.
        domains: (N,) domain ids: score the cross-domain mean of ``metric`` instead.
        metric: a key of the evaluation (``map@r``, ``recall@1``, ...; with ``ks`` covering K).
        space: ``{step: [options]}`` (default :data:`DEFAULT_SPACE`, whose k-reciprocal option is
            tried only with ``kreciprocal=True``: each such trial builds a k-reciprocal graph).

    Returns:
        ``{"steps": chosen steps, "metric", "value", "baseline" (no post-processing), "trials":
        [{"steps", "value", "seconds"}], "seconds"}`` -- validation numbers only.
    """
    x = np.asarray(embeddings, np.float32)
    if domains is not None:  # the whitening of each domain is fitted on the other domains' rows
        _, per_domain = np.unique(np.asarray(domains), return_counts=True)
        fit_rows = len(x) - int(per_domain.max())
    else:
        fit_rows = len(x)
    space = _space(space, x.shape[1], kreciprocal, fit_rows)
    base_metric = metric.removeprefix("cross_domain_")
    need = [base_metric.split("@")[0] if base_metric.startswith("recall@") else base_metric]

    def score(steps) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # queries without positive: counted in the result
            if domains is not None:
                res = evaluate_cross_domain(x, labels, domains, ks=ks, metrics=need, postprocess=steps,
                                            **evaluate_kw)["mean"]
            else:
                res = evaluate(x, labels, ks=ks, metrics=need, postprocess=steps, **evaluate_kw)
        if base_metric not in res:
            raise ValueError(f"post-processing choice: metric {metric!r} is not among {sorted(res)}")
        return float(res[base_metric])

    t_all = time.perf_counter()
    trials = []

    def run(steps):
        t = time.perf_counter()
        v = score(steps)
        trials.append({"steps": steps, "spelled": format_steps(steps), "value": v,
                       "seconds": round(time.perf_counter() - t, 2)})
        return v

    kept: list[dict] = []
    best = baseline = run([])
    for name in STEPS:
        choice = None
        for option in space.get(name, []):
            cand = check_steps(kept + [{"name": name, **option}])
            v = run(cand)
            if v > best + 1e-12:
                best, choice = v, cand
        if choice is not None:
            kept = choice
    return {"steps": kept, "spelled": format_steps(kept), "metric": metric, "value": best,
            "baseline": baseline, "trials": trials, "seconds": round(time.perf_counter() - t_all, 2)}

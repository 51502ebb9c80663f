"""Cross-domain retrieval: the queries of one domain against a gallery of the other domains.

For each domain d (a vendor of the emoji benchmark, a typeface, a camera, ...), the queries
are the samples of d and the gallery is every sample of another domain, so a query is never
answered by a picture from its own domain. Each domain's metrics are those of
:func:`deepmetric.evaluate.evaluate` with ``is_query = (domain == d)`` and
``is_gallery = (domain != d)``; ``"mean"`` averages each metric over the domains (every domain
counts the same, whatever its number of queries). Queries whose class has no image in the
other domains are left out of their domain's averages and counted in
``queries_without_positive``.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

from deepmetric.evaluate._checks import check_embeddings, to_numpy_labels
from deepmetric.evaluate.engine import _check_ks, evaluate
from deepmetric.evaluate.metrics import CLUSTERING_METRICS, check_metric_names

__all__ = ["evaluate_cross_domain"]


def evaluate_cross_domain(embeddings, labels, domains, *, domain_names: Sequence[str] | None = None,
                          ks=(1, 2, 4, 8), metrics=("recall", "map@r", "r_precision"),
                          **evaluate_kw) -> dict[str, dict[str, float]]:
    """Metrics per domain (queries of that domain, gallery of the others) and their mean.

    Args:
        embeddings: (N, d) float array or tensor; labels: (N,) integer classes.
        domains: (N,) integer domain ids (e.g. ``EmojiDataset.vendor_ids``).
        domain_names: names for the ids 0..D-1 (default ``"0"``, ``"1"``, ...); a domain with no
            sample is skipped.
        ks, metrics, **evaluate_kw: passed to :func:`deepmetric.evaluate.evaluate` (clustering
            metrics are not meaningful here and are refused).

    Returns:
        ``{name: {"recall@1": ..., "map@r": ..., "queries": n, "queries_without_positive": m},
        ..., "mean": {metric: average over the domains}}``.
    """
    metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
    fixed = sorted({"is_query", "is_gallery"} & set(evaluate_kw))
    if fixed:
        raise ValueError(f"evaluate_cross_domain: {', '.join(fixed)} cannot be given; each domain's queries "
                         "and gallery come from domains")
    if any(m in CLUSTERING_METRICS for m in metrics):
        raise ValueError("evaluate_cross_domain: nmi/f1 are clustering metrics of one set, not "
                         "query-vs-gallery metrics; use evaluate() for them")
    check_metric_names(metrics)  # the selection's errors before any domain's (which would name the domain)
    _check_ks(ks)
    x = check_embeddings(embeddings)
    n = x.shape[0]
    y = to_numpy_labels(labels, n=n)
    dom = np.asarray(domains)
    if dom.shape != (n,) or not np.issubdtype(dom.dtype, np.integer):
        raise ValueError(f"domains must be ({n},) integers (one domain id per embedding), got {dom.dtype} {dom.shape}")
    present = np.unique(dom)
    if len(present) < 2:
        raise ValueError(f"evaluate_cross_domain needs at least 2 domains, got {present.tolist()}")
    if domain_names is not None:
        domain_names = list(domain_names)
        if present.min() < 0 or present.max() >= len(domain_names):
            raise ValueError(f"domain ids {present.tolist()} do not index domain_names ({len(domain_names)} names)")
        # the result is keyed by name: a repeated name, or one called "mean", would silently replace
        # another domain's metrics (and change the mean)
        used = [str(domain_names[d]) for d in present]
        clash = sorted({n for n in used if used.count(n) > 1 or n == "mean"})
        if clash:
            raise ValueError(f"domain_names: {', '.join(map(repr, clash))} would name two entries of the result "
                             f"(each domain needs its own name, and 'mean' is the average's)")
    out: dict[str, dict[str, float]] = {}
    for d in present:
        name = domain_names[d] if domain_names is not None else str(int(d))
        q = dom == d
        with warnings.catch_warnings():  # queries without positive are reported in the result
            warnings.simplefilter("ignore", UserWarning)
            try:
                res = evaluate(x, y, is_query=q, is_gallery=~q, ks=ks, metrics=metrics, **evaluate_kw)
            except ValueError as exc:  # e.g. no query of this domain has its class in another one
                raise ValueError(f"domain {name!r} (its {int(q.sum())} queries against the other domains): "
                                 f"{exc}") from None
        res["queries"] = int(q.sum())
        res.setdefault("queries_without_positive", 0)
        out[name] = res
    keys = [k for k in next(iter(out.values())) if k not in ("queries", "queries_without_positive")]
    out["mean"] = {k: float(np.mean([r[k] for r in out.values()])) for k in keys}
    return out

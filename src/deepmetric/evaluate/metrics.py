"""The metrics, one registered function each: what it needs and which result keys it gives.

A metric declares what it ``needs``: ``"neighbours"`` (each query's ranked gallery: one k-NN
pass of :func:`~deepmetric.evaluate.evaluate` serves them all, and ``reads`` names the
per-query arrays of :class:`~deepmetric.evaluate.retrieval.RetrievalAccumulator` it is computed
from), ``"clustering"`` (one k-means of the whole set) or ``"classes"`` (a classifier's logits,
:func:`~deepmetric.evaluate.classification_accuracy`); and its ``keys`` (``{k}`` stands for each
K of ``ks``).  The names a selection produces are read here (:func:`metric_keys`,
:func:`evaluation_keys`), never derived a second time.  Definitions: the docstring of
:mod:`deepmetric.evaluate.retrieval` and docs/evaluation.md.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from sklearn.metrics import adjusted_mutual_info_score

from deepmetric.evaluate.classification import classification_accuracy
from deepmetric.evaluate.clustering import nmi_from_clusters, pairwise_f1_from_clusters
from deepmetric.registry import Registry

__all__ = ["METRICS", "register_metric", "list_metrics", "metric_keys", "check_metric_names", "evaluation_keys",
           "cross_domain_selection", "neighbour_metric_values", "clustering_metric_values", "RETRIEVAL_METRICS",
           "CLUSTERING_METRICS", "DEFAULT_METRICS"]

#: name -> its function; info: ``needs``, ``keys``, ``reads``, ``exact_rank``, ``default``
METRICS = Registry("metric")


def register_metric(name: str, *, needs: str, keys: tuple[str, ...] | None = None, reads: Iterable[str] = (),
                    exact_rank: bool = False, default: bool = False):
    """Decorator registering a metric function under ``name``.

    ``needs="neighbours"``: ``fn(per_query, ks) -> {key: value}`` from the accumulator's
    per-query arrays (``reads``: ``"rank"`` the first positive's rank, ``"map"`` the first R
    neighbours' AP / precision, ``"map_k"`` AP@K; ``exact_rank``: the rank must be exact beyond
    the k-NN list); ``needs="clustering"``: ``fn(labels, clusters, **options) -> float``.
    ``keys`` default to ``(name,)``; ``default``: computed when no metric is named."""
    if needs not in ("neighbours", "clustering", "classes"):
        raise ValueError(f"metric {name!r}: needs must be 'neighbours', 'clustering' or 'classes', got {needs!r}")
    return METRICS.register(name, needs=needs, keys=tuple(keys or (name,)), reads=frozenset(reads),
                            exact_rank=exact_rank, default=default)


def _class_mean(per_query: dict, values: np.ndarray) -> float:
    """Mean within each query class, then over the classes (every class counts the same)."""
    _, inv = np.unique(per_query["labels"], return_inverse=True)
    return float(np.mean(np.bincount(inv, weights=values) / np.bincount(inv)))


@register_metric("recall", needs="neighbours", keys=("recall@{k}",), reads=("rank",), default=True)
def _recall(per_query, ks):
    return {f"recall@{k}": float(np.mean(per_query["rank"] < k)) for k in ks}


@register_metric("map@r", needs="neighbours", reads=("map",), default=True)
def _map_r(per_query, ks):
    return {"map@r": float(np.mean(per_query["ap_r"]))}


@register_metric("r_precision", needs="neighbours", reads=("map",), default=True)
def _r_precision(per_query, ks):
    return {"r_precision": float(np.mean(per_query["rp"]))}


@register_metric("mrr", needs="neighbours", reads=("rank",), exact_rank=True)
def _mrr(per_query, ks):
    return {"mrr": float(np.mean(1.0 / (per_query["rank"] + 1)))}


@register_metric("map@k", needs="neighbours", keys=("map@{k}",), reads=("map_k",))
def _map_k(per_query, ks):
    return {f"map@{k}": float(np.mean(per_query[f"ap@{k}"])) for k in ks}


@register_metric("recall_class_avg", needs="neighbours", keys=("recall@{k}_class_avg",), reads=("rank",),
                 exact_rank=True)
def _recall_class_avg(per_query, ks):
    return {f"recall@{k}_class_avg": _class_mean(per_query, (per_query["rank"] < k).astype(float)) for k in ks}


@register_metric("map@r_class_avg", needs="neighbours", reads=("map",))
def _map_r_class_avg(per_query, ks):
    return {"map@r_class_avg": _class_mean(per_query, per_query["ap_r"])}


@register_metric("nmi", needs="clustering", default=True)
def _nmi(labels, clusters, *, nmi_average="arithmetic"):
    return nmi_from_clusters(labels, clusters, average=nmi_average)


@register_metric("f1", needs="clustering", default=True)
def _f1(labels, clusters, **_):
    return pairwise_f1_from_clusters(labels, clusters)


@register_metric("ami", needs="clustering")
def _ami(labels, clusters, **_):
    return float(adjusted_mutual_info_score(labels, clusters))


register_metric("classification", needs="classes", keys=("top1", "mean_per_class"))(classification_accuracy)


def _needing(needs: str) -> tuple[str, ...]:
    return tuple(n for n in METRICS if METRICS.info(n)["needs"] == needs)


#: metrics read from each query's ranked neighbours (one k-NN pass) ...
RETRIEVAL_METRICS = _needing("neighbours")
#: ... and metrics of a k-means clustering of the whole set
CLUSTERING_METRICS = _needing("clustering")
#: what ``metrics=None`` computes (the others are asked for by name)
DEFAULT_METRICS = tuple(n for n in METRICS if METRICS.info(n)["default"])


def list_metrics() -> list[str]:
    """The metric names :func:`~deepmetric.evaluate.evaluate` takes in ``metrics`` (``recall``
    gives one ``recall@K`` per K, ``map@k`` one ``map@K`` per K, ``recall_class_avg`` one
    ``recall@K_class_avg`` per K), in the order it reports them."""
    return [n for n in METRICS if METRICS.info(n)["needs"] in ("neighbours", "clustering")]


def metric_keys(metrics, ks) -> list[str]:
    """The result keys :func:`~deepmetric.evaluate.evaluate` gives for ``metrics`` (checked
    names) and ``ks``, in its order."""
    ks = sorted({int(k) for k in ks})
    out = []
    for name in METRICS:
        if name in metrics:
            out += [key.format(k=k) for key in METRICS.info(name)["keys"] for k in (ks if "{k}" in key else [None])]
    return out


def check_metric_names(metrics) -> tuple[str, ...]:
    """``metrics`` (None: :data:`DEFAULT_METRICS`, a name, or names) as a tuple of
    :func:`list_metrics` names; an unknown name or an empty list raises ``ValueError`` listing
    the choices."""
    if metrics is None:
        return DEFAULT_METRICS
    if isinstance(metrics, str):
        metrics = [metrics]
    metrics = tuple(metrics)
    names = list_metrics()
    bad = [m for m in metrics if m not in names]
    if bad or not metrics:
        raise ValueError(f"unknown metric(s) {bad or metrics}; choose from {', '.join(names)}")
    return metrics


def cross_domain_selection(metrics) -> tuple[str, ...]:
    """The metrics of a selection (a config's ``eval.metrics``: None or [] for the default)
    that have a cross-domain form, the retrieval ones; recall and map@r when it has none."""
    wanted = tuple(m for m in (metrics or ()) if m in RETRIEVAL_METRICS)
    return wanted or ("recall", "map@r")


def evaluation_keys(metrics, ks, *, classification: bool = False, cross_domain: bool = False) -> list[str]:
    """Every metric name one evaluation of a run produces: :func:`metric_keys` of ``metrics``
    (None: the default ones, []: none; an unknown name raises as :func:`check_metric_names`),
    then ``top1`` / ``mean_per_class`` (``classification``), then ``cross_domain_<key>`` of
    :func:`cross_domain_selection` (``cross_domain``)."""
    names = metric_keys(() if metrics == [] else check_metric_names(metrics), ks)
    if classification:
        names += metric_keys(("classification",), ks)
    if cross_domain:
        names += [f"cross_domain_{key}" for key in metric_keys(cross_domain_selection(metrics), ks)]
    return names


def neighbour_metric_values(per_query: dict, metrics, ks, suffix: str = "") -> dict[str, float]:
    """The neighbour metrics of ``metrics`` from the accumulator's per-query arrays, each key
    with ``suffix`` (``_approx``)."""
    if not len(per_query.get("labels", [])):
        raise ValueError("no query has a positive (same-label) reference in the gallery; "
                         "retrieval metrics are undefined")
    out = {}
    for name in RETRIEVAL_METRICS:
        if name in metrics:
            out.update({f"{key}{suffix}": value for key, value in METRICS.get(name)(per_query, ks).items()})
    return out


def clustering_metric_values(labels, clusters, metrics, **options) -> dict[str, float]:
    """The clustering metrics of ``metrics`` of one clustering (``options``: ``nmi_average``)."""
    return {name: METRICS.get(name)(labels, clusters, **options) for name in CLUSTERING_METRICS if name in metrics}

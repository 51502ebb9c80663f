"""deepmetric.evaluate: fast, memory-bounded retrieval, clustering and classification metrics.

See docs/evaluation.md. Public API::

    evaluate(embeddings, labels, *, is_query=None, is_gallery=None, ks=(1, 2, 4, 8),
             metrics=None, seed=0, chunk_size=None, backend="auto") -> dict
    recall_at_k, map_at_r, r_precision, nmi, pairwise_f1, knn, kmeans, classification_accuracy
    list_metrics() -> the metric names; check_metric_names(metrics) validates a selection;
    metric_keys(metrics, ks) -> the result keys of a selection; evaluation_keys(metrics, ks,
    classification=, cross_domain=) -> every metric name a run's evaluation gives (the
    registered metrics, deepmetric.evaluate.metrics, declare their keys)
    postprocess: whitening, DBA, alpha-QE, k-reciprocal re-ranking (deepmetric.evaluate.postprocess)
    check_embeddings(x) -> validated, l2-normalised (N, d) float32 embeddings
    evaluate_cross_domain(embeddings, labels, domains, domain_names=None, ...) -> {domain: metrics, "mean": ...}
    choose_search_device(request, default=None, backend="auto", nbytes=0) -> where a search runs
"""
from deepmetric.evaluate._checks import check_embeddings
from deepmetric.evaluate.classification import (TRAIN_NEIGHBOUR_KEYS, classification_accuracy,
                                                format_per_class_table, misclassified_neighbour_agreement,
                                                per_class_accuracy)
from deepmetric.evaluate.clustering import (
    kmeans,
    nmi,
    nmi_from_clusters,
    pairwise_f1,
    pairwise_f1_from_clusters,
)
from deepmetric.evaluate.engine import evaluate, map_at_r, r_precision, recall_at_k
from deepmetric.evaluate.metrics import (CLUSTERING_METRICS, DEFAULT_METRICS, METRICS, RETRIEVAL_METRICS,
                                         check_metric_names, cross_domain_selection, evaluation_keys, list_metrics,
                                         metric_keys, register_metric)
from deepmetric.evaluate.cross_domain import evaluate_cross_domain
from deepmetric.evaluate.knn import BACKENDS, SEARCH_DEVICES, choose_search_device, knn

__all__ = [
    "BACKENDS",
    "SEARCH_DEVICES",
    "choose_search_device",
    "METRICS",
    "DEFAULT_METRICS",
    "metric_keys",
    "evaluation_keys",
    "cross_domain_selection",
    "register_metric",
    "RETRIEVAL_METRICS",
    "CLUSTERING_METRICS",
    "check_embeddings",
    "check_metric_names",
    "classification_accuracy",
    "per_class_accuracy",
    "format_per_class_table",
    "misclassified_neighbour_agreement",
    "TRAIN_NEIGHBOUR_KEYS",
    "evaluate",
    "evaluate_cross_domain",
    "kmeans",
    "knn",
    "list_metrics",
    "map_at_r",
    "nmi",
    "nmi_from_clusters",
    "pairwise_f1",
    "pairwise_f1_from_clusters",
    "r_precision",
    "recall_at_k",
]

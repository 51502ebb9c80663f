"""deepmetric.report: figures and Markdown reports of training runs and embeddings.

* :mod:`~deepmetric.report.diagnostics` - the numbers behind each figure, from plain
  arrays (heated-up Fig. 1, 2, 4; Recall@K; the two-head paper's nearest-training-image
  analysis; the training log reader).
* :mod:`~deepmetric.report.plots` - matplotlib (Agg) figures written to PNG files.
* :mod:`~deepmetric.report.run_report` - ``make_report(run_dir, embeddings)``, used by
  ``deepmetric report RUN_DIR [--embeddings EMB.npz]``.
"""
from .diagnostics import (
    TrainingLog,
    closed_form_gradient_norm,
    embedding_2d,
    gradient_norm_vs_alpha,
    misclassified_neighbours,
    pair_cosine_histograms,
    read_log,
    recall_curve,
    select_paper_samples,
    synthetic_paper_samples,
)
from .run_report import load_embeddings_npz, make_report

__all__ = [
    "TrainingLog",
    "closed_form_gradient_norm",
    "embedding_2d",
    "gradient_norm_vs_alpha",
    "misclassified_neighbours",
    "pair_cosine_histograms",
    "read_log",
    "recall_curve",
    "select_paper_samples",
    "synthetic_paper_samples",
    "load_embeddings_npz",
    "make_report",
]

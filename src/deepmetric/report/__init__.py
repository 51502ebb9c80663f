"""deepmetric.report: an HTML page, figures and Markdown reports of training runs and embeddings.

* :mod:`~deepmetric.report.diagnostics` - the numbers behind each figure, from plain
  arrays (heated-up Fig. 2, 4; Recall@K; the two-head paper's nearest-training-image
  analysis; the training log reader); :mod:`~deepmetric.report.gradient_norm` - heated-up
  Fig. 1 (the gradient norm against alpha).
* :mod:`~deepmetric.report.plots` - matplotlib (Agg) figures written to PNG files.
* :mod:`~deepmetric.report.run_report` - ``make_report(run_dir, embeddings)``, used by
  ``deepmetric report RUN_DIR [--embeddings EMB.npz]``: ``report.html`` (one
  self-contained page, built with :mod:`~deepmetric.report.page`), the PNGs and
  ``report.md``, written section by section by :mod:`~deepmetric.report.run_sections` (the
  configuration, metrics.json and the training log) and
  :mod:`~deepmetric.report.embedding_sections` (Recall@K, histograms, embedding, retrieval
  grids, classification); :mod:`~deepmetric.report.run_inputs` reads the run (metrics.json,
  checkpoint embeddings, the dataset images behind the retrieval grids).
"""
from .diagnostics import (
    TrainingLog,
    embedding_2d,
    misclassified_neighbours,
    pair_cosine_histograms,
    per_class_recall,
    read_training_log,
    recall_curve,
    retrieval_examples,
)
from .gradient_norm import closed_form_gradient_norm, gradient_norm_vs_alpha, select_paper_samples, synthetic_paper_samples
from .run_report import load_embeddings_npz, make_report

__all__ = [
    "TrainingLog",
    "closed_form_gradient_norm",
    "embedding_2d",
    "gradient_norm_vs_alpha",
    "misclassified_neighbours",
    "pair_cosine_histograms",
    "per_class_recall",
    "read_training_log",
    "recall_curve",
    "retrieval_examples",
    "select_paper_samples",
    "synthetic_paper_samples",
    "load_embeddings_npz",
    "make_report",
]

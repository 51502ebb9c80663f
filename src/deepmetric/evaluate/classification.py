"""Classification accuracy: top-1 (micro) and mean per-class (macro) accuracy, the per-class
accuracy table (two-head paper, Tables 3-4) and its Markdown formatter, and how the embedding
explains the classifier's mistakes (:func:`misclassified_neighbour_agreement`)."""
from __future__ import annotations

import numpy as np
import torch

from deepmetric.evaluate._checks import to_numpy_labels


__all__ = ["classification_accuracy", "per_class_accuracy", "format_per_class_table",
           "misclassified_neighbour_agreement", "TRAIN_NEIGHBOUR_KEYS"]

#: the keys :func:`misclassified_neighbour_agreement` returns (a run's ``eval.train_neighbours``
#: adds them to its final test metrics; a study's ``metrics`` columns are checked against them)
TRAIN_NEIGHBOUR_KEYS = ("misclassified_nn_agrees", "misclassified", "train_1nn_top1")


def _predictions(logits_or_preds) -> np.ndarray:
    x = logits_or_preds
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.ndim == 2:
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"2-D input must be float logits, got dtype {x.dtype}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"logits are empty (shape {x.shape})")
        if not np.isfinite(x).all():
            raise ValueError("logits contain NaN or infinite values")
        return x.argmax(axis=1)
    if x.ndim == 1:
        return to_numpy_labels(x, name="predictions")
    raise ValueError(f"expected (N, C) logits or (N,) predictions, got shape {x.shape}")


def per_class_accuracy(logits_or_preds, labels, *, num_classes: int | None = None,
                       class_names=None) -> dict:
    """Accuracy of every class with its counts (two-head paper, Table 4).

    Args:
        logits_or_preds: (N, C) float scores (argmax = prediction) or (N,) predicted labels.
        labels: (N,) true labels in 0..num_classes-1.
        num_classes: number of classes (default: from ``class_names``, the logits' width, or
            the largest label + 1); classes without test samples get accuracy NaN and do not
            enter the macro average.
        class_names: optional name per class.

    Returns ``{"classes": [{"label", "name", "count", "correct", "accuracy"}, ...],
    "micro": correct / N, "macro": mean accuracy over classes with count > 0, "count": N}``.
    """
    preds = _predictions(logits_or_preds)
    y = to_numpy_labels(labels, n=len(preds))
    if num_classes is None:
        if class_names is not None:
            num_classes = len(class_names)
        elif np.asarray(logits_or_preds).ndim == 2:
            num_classes = int(np.asarray(logits_or_preds).shape[1])
        else:
            num_classes = int(max(y.max(), preds.max())) + 1
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f"{len(class_names)} class names for {num_classes} classes")
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"labels must lie in 0..{num_classes - 1}, got {y.min()}..{y.max()}")
    count = np.bincount(y, minlength=num_classes)
    correct = np.bincount(y, weights=(preds == y), minlength=num_classes).astype(np.int64)
    rows = []
    for c in range(num_classes):
        rows.append({"label": c, "name": str(class_names[c]) if class_names is not None else str(c),
                     "count": int(count[c]), "correct": int(correct[c]),
                     "accuracy": float(correct[c] / count[c]) if count[c] else float("nan")})
    present = count > 0
    return {"classes": rows, "micro": float(correct.sum() / len(y)),
            "macro": float((correct[present] / count[present]).mean()), "count": int(len(y))}


def format_per_class_table(results: dict, *, percent: bool = True, digits: int = 2) -> str:
    """Markdown table of per-class accuracies, one column per method (paper Table 4 layout).

    ``results`` maps a column title to a :func:`per_class_accuracy` result (all over the same
    test set).  Rows: every class (name and test count), then macro and micro accuracy.
    """
    if not results:
        raise ValueError("format_per_class_table: no results")
    cols = list(results)
    first = results[cols[0]]["classes"]
    for c in cols[1:]:
        other = results[c]["classes"]
        if [(r["name"], r["count"]) for r in other] != [(r["name"], r["count"]) for r in first]:
            raise ValueError(f"format_per_class_table: column {c!r} covers other classes / counts than {cols[0]!r}")
    f = 100.0 if percent else 1.0

    def cell(v):
        return "n/a" if v != v else f"{v * f:.{digits}f}"

    lines = ["| class | test count | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for i, r in enumerate(first):
        lines.append(f"| {r['name']} | {r['count']} | " + " | ".join(cell(results[c]["classes"][i]["accuracy"]) for c in cols) + " |")
    total = results[cols[0]]["count"]
    lines.append("| **macro accuracy** | | " + " | ".join(cell(results[c]["macro"]) for c in cols) + " |")
    lines.append(f"| **micro accuracy** | {total} | " + " | ".join(cell(results[c]["micro"]) for c in cols) + " |")
    return "\n".join(lines)


def classification_accuracy(logits_or_preds, labels) -> dict[str, float]:
    """Top-1 and mean per-class accuracy.

    Args:
        logits_or_preds: (N, C) float scores/logits (argmax is the prediction) or (N,) integer
            predicted labels.
        labels: (N,) integer true labels.

    Returns:
        ``{"top1": mean over samples of [pred == label], "mean_per_class": mean over the
        classes present in ``labels`` of that class's accuracy}``.
    """
    preds = _predictions(logits_or_preds)
    y = to_numpy_labels(labels, n=len(preds))
    correct = preds == y
    classes, inv = np.unique(y, return_inverse=True)
    per_class = np.bincount(inv, weights=correct) / np.bincount(inv)
    return {"top1": float(correct.mean()), "mean_per_class": float(per_class.mean())}


def misclassified_neighbour_agreement(logits_or_preds, labels, test_embeddings, train_embeddings,
                                      train_labels, **knn_kw) -> dict[str, float]:
    """How the embedding explains the classifier's mistakes (two-head paper, Sec. 5, Fig. 10:
    "79.34 % of misclassified predictions, from Flowers-102 test split, match the label of their
    nearest training neighbor").

    Every test image is matched to its nearest *training* image by cosine similarity of the
    embeddings (:func:`deepmetric.evaluate.knn`).  Returns

    * ``misclassified_nn_agrees``: among the misclassified test images (prediction != label),
      the share whose nearest training image carries the *predicted* label (NaN when the
      classifier makes no mistake);
    * ``misclassified``: their number;
    * ``train_1nn_top1``: the accuracy of that nearest-training-image classifier on all test
      images (the embedding used as a 1-NN classifier, next to the softmax's ``top1``).
    """
    from deepmetric.evaluate.knn import knn

    preds = _predictions(logits_or_preds)
    y = to_numpy_labels(labels, n=len(preds))
    train_y = to_numpy_labels(train_labels, name="train_labels")
    if len(train_y) != len(train_embeddings):
        raise ValueError(f"{len(train_y)} training labels for {len(train_embeddings)} training embeddings")
    if len(test_embeddings) != len(y):
        raise ValueError(f"{len(test_embeddings)} test embeddings for {len(y)} labels")
    _, idx = knn(test_embeddings, train_embeddings, k=1, **knn_kw)
    nn_label = train_y[idx[:, 0]]
    wrong = preds != y
    n_wrong = int(wrong.sum())
    return {"misclassified_nn_agrees": float((nn_label[wrong] == preds[wrong]).mean()) if n_wrong else float("nan"),
            "misclassified": float(n_wrong),
            "train_1nn_top1": float((nn_label == y).mean())}

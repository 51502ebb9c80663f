"""Classification accuracy: top-1 (micro) and mean per-class (macro) accuracy."""
from __future__ import annotations

import numpy as np
import torch

from deepmetric.evaluate._checks import to_numpy_labels


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
        preds = x.argmax(axis=1)
    elif x.ndim == 1:
        preds = to_numpy_labels(x, name="predictions")
    else:
        raise ValueError(f"expected (N, C) logits or (N,) predictions, got shape {x.shape}")
    y = to_numpy_labels(labels, n=len(preds))
    correct = preds == y
    classes, inv = np.unique(y, return_inverse=True)
    per_class = np.bincount(inv, weights=correct) / np.bincount(inv)
    return {"top1": float(correct.mean()), "mean_per_class": float(per_class.mean())}

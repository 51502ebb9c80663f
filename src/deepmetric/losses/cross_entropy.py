"""Plain softmax cross-entropy on a model's own logits (two-head paper Eq. 1)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .distances import upcast, no_autocast
from .registry import register_loss

__all__ = ["CrossEntropyLoss"]


@register_loss("cross_entropy")
class CrossEntropyLoss(nn.Module):
    """Softmax cross-entropy, two-head paper Eq. 1 (mean over the batch instead of the sum).

    Called ``loss(logits, labels)`` with the logits of a model's classification head
    ([B, C]) - it owns no parameters. Computed in float32 even under autocast.

    Args:
        label_smoothing: as in ``torch.nn.functional.cross_entropy`` (default 0.0).
        weight: optional per-class weights, a sequence or tensor of length C (default None).
    """

    def __init__(self, label_smoothing: float = 0.0, weight=None) -> None:
        super().__init__()
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"CrossEntropyLoss: label_smoothing must lie in [0, 1), got {label_smoothing}")
        self.label_smoothing = float(label_smoothing)
        if weight is not None:
            weight = torch.as_tensor(weight, dtype=torch.float32)
            if weight.dim() != 1:
                raise ValueError(f"CrossEntropyLoss: weight must be 1-d, got shape {tuple(weight.shape)}")
        self.register_buffer("weight", weight)

    def extra_repr(self) -> str:
        return f"label_smoothing={self.label_smoothing}"

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
            raise TypeError("CrossEntropyLoss: logits and labels must be torch.Tensors")
        if logits.dim() != 2 or labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
            raise ValueError(
                f"CrossEntropyLoss: expected logits [B, C] and labels [B], got {tuple(logits.shape)} "
                f"and {tuple(labels.shape)}"
            )
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise TypeError(f"CrossEntropyLoss: labels must be integers, got dtype {labels.dtype}")
        c = logits.shape[1]
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= c):
            raise ValueError(
                f"CrossEntropyLoss: labels must lie in [0, {c}) for {c} logits, got range "
                f"[{int(labels.min())}, {int(labels.max())}]"
            )
        if self.weight is not None and self.weight.shape[0] != c:
            raise ValueError(f"CrossEntropyLoss: weight has {self.weight.shape[0]} entries, logits have {c} classes")
        if labels.numel() == 0:
            return logits.float().sum() * 0.0
        with no_autocast(logits.device):
            x = upcast(logits)
            weight = None if self.weight is None else self.weight.to(x.dtype)
            return F.cross_entropy(x, labels, weight=weight, label_smoothing=self.label_smoothing)

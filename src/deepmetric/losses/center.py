"""Centre loss (Wen et al. 2016), the two-head paper's baseline regulariser."""
from __future__ import annotations

import torch
import torch.nn as nn

from .distances import upcast, check_embeddings_labels, no_autocast
from .registry import register_loss

__all__ = ["CenterLoss"]


@register_loss("center")
class CenterLoss(nn.Module):
    """Centre loss, two-head paper Eq. 2 / Wen et al. ECCV 2016 Eq. 2 and Eq. 4.

    ``L_cen = 1/2 sum_i ||x_i - c_{y_i}||^2`` divided by the batch size (``reduction="mean"``,
    as in Wen et al.'s Caffe layer, which divides by the batch size M) or not
    (``reduction="sum"``, the paper equation literally). The two-head paper weights it by
    lambda = 0.003 in the total loss; that weight belongs to the training config.

    The centres are a buffer (saved in ``state_dict``, never trained by gradient), drawn
    from N(0, 1) at construction. After the loss is computed, and only when
    ``self.training`` is True, they move by Wen et al.'s update (Eq. 4 / Algorithm 1):

    ``delta_c_j = sum_{i: y_i = j} (c_j - x_i) / (1 + n_j)``,  ``c_j <- c_j - rate * delta_c_j``

    where n_j is the number of samples of class j in the batch; classes absent from the
    batch do not move. Under ``torch.distributed`` the sums and counts are all-reduced
    (``sync_distributed=True``) so every rank applies the same global-batch update.

    Args:
        num_classes: number of classes C (labels must lie in [0, C)).
        embedding_dim: embedding size d.
        rate: centre learning rate alpha (default 0.5, as in the two-head paper).
        reduction: ``"mean"`` (default) or ``"sum"`` over the batch.
        sync_distributed: all-reduce centre updates across ranks when a process group is
            initialised (default True).
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        rate: float = 0.5,
        reduction: str = "mean",
        sync_distributed: bool = True,
    ) -> None:
        super().__init__()
        if int(num_classes) < 1 or int(embedding_dim) < 1:
            raise ValueError(
                f"CenterLoss: num_classes and embedding_dim must be >= 1, got {num_classes}, {embedding_dim}"
            )
        if reduction not in ("mean", "sum"):
            raise ValueError(f"CenterLoss: reduction must be 'mean' or 'sum', got {reduction!r}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"CenterLoss: rate must lie in [0, 1], got {rate}")
        self.num_classes = int(num_classes)
        self.embedding_dim = int(embedding_dim)
        self.rate = float(rate)
        self.reduction = reduction
        self.sync_distributed = bool(sync_distributed)
        self.register_buffer("centers", torch.randn(self.num_classes, self.embedding_dim))

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}, "
            f"rate={self.rate}, reduction={self.reduction!r}"
        )

    def _check(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        check_embeddings_labels(embeddings, labels, "CenterLoss")
        if embeddings.shape[1] != self.embedding_dim:
            raise ValueError(
                f"CenterLoss: embeddings have dim {embeddings.shape[1]}, expected embedding_dim="
                f"{self.embedding_dim}"
            )
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(
                f"CenterLoss: labels must lie in [0, {self.num_classes}), got range "
                f"[{int(labels.min())}, {int(labels.max())}]"
            )

    @torch.no_grad()
    def update_centers(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Apply Wen et al.'s centre update for one batch (called by forward in training)."""
        x = embeddings.detach().to(self.centers.dtype)
        diff = self.centers[labels] - x  # c_{y_i} - x_i
        delta = torch.zeros_like(self.centers).index_add_(0, labels, diff)
        counts = torch.bincount(labels, minlength=self.num_classes).to(self.centers.dtype)
        if (
            self.sync_distributed
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        ):
            torch.distributed.all_reduce(delta)
            torch.distributed.all_reduce(counts)
        self.centers.sub_(self.rate * delta / (1.0 + counts).unsqueeze(1))

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._check(embeddings, labels)
        with no_autocast(embeddings.device):
            x = upcast(embeddings)
            c = self.centers[labels].to(x.dtype)  # advanced indexing copies: safe to update after
            per_sample = 0.5 * (x - c).pow(2).sum(dim=1)
            loss = per_sample.sum() if self.reduction == "sum" else per_sample.mean()
            if self.training:
                self.update_centers(embeddings, labels)
            if labels.numel() == 0:
                return embeddings.float().sum() * 0.0
            return loss

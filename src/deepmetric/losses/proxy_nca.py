"""ProxyNCA (Movshovitz-Attias et al., "No Fuss Distance Metric Learning using Proxies", ICCV 2017)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .distances import (
    upcast,
    check_embeddings_labels,
    l2_normalize,
    no_autocast,
    pairwise_squared_euclidean,
    zero_loss,
)
from .registry import register_loss

__all__ = ["ProxyNCALoss"]


@register_loss("proxy_nca")
class ProxyNCALoss(nn.Module):
    """ProxyNCA loss, Movshovitz-Attias et al. 2017 Eq. 9 (static proxy assignment, one proxy per class).

    ``L(x, y) = -log( exp(-d(x, p_y)) / sum_{z != y} exp(-d(x, p_z)) )``

    with ``d`` the squared Euclidean distance between ``scale_x * x / ||x||`` and
    ``scale_p * p / ||p||`` (the paper fixes the norms of embeddings and proxies, N_x and
    N_p); mean over the batch. ``exclude_positive=False`` puts the positive proxy into the
    denominator as well (plain softmax cross-entropy over ``-d``, the form used by
    pytorch-metric-learning's ProxyNCALoss and ProxyNCA++).

    The proxies are a trainable parameter [C, d] (initialised N(0, 1)), part of this module's
    ``state_dict``: give the loss's parameters to the optimiser.

    Args:
        num_classes: C, one proxy per class (labels in [0, C)).
        embedding_dim: embedding size d.
        scale_x: norm N_x the embeddings are scaled to (default 1.0).
        scale_p: norm N_p the proxies are scaled to (default 1.0); ProxyNCA re-implementations
            often use scale_x = scale_p = 3.
        exclude_positive: paper form, positive proxy not in the denominator (default True).
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        scale_x: float = 1.0,
        scale_p: float = 1.0,
        exclude_positive: bool = True,
    ) -> None:
        super().__init__()
        if int(num_classes) < 1 or int(embedding_dim) < 1:
            raise ValueError(
                f"ProxyNCALoss: num_classes and embedding_dim must be >= 1, got {num_classes}, {embedding_dim}"
            )
        if scale_x <= 0 or scale_p <= 0:
            raise ValueError(f"ProxyNCALoss: scale_x and scale_p must be > 0, got {scale_x}, {scale_p}")
        self.num_classes = int(num_classes)
        self.embedding_dim = int(embedding_dim)
        self.scale_x = float(scale_x)
        self.scale_p = float(scale_p)
        self.exclude_positive = bool(exclude_positive)
        self.proxies = nn.Parameter(torch.randn(self.num_classes, self.embedding_dim))

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}, scale_x={self.scale_x}, "
            f"scale_p={self.scale_p}, exclude_positive={self.exclude_positive}"
        )

    def _distances(self, embeddings: torch.Tensor) -> torch.Tensor:
        x = self.scale_x * l2_normalize(upcast(embeddings))
        p = self.scale_p * l2_normalize(self.proxies.to(upcast(embeddings).dtype))
        return pairwise_squared_euclidean(x, p)

    def logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Class scores ``-d(x, p_c)`` [B, C]; argmax is the nearest proxy."""
        if embeddings.dim() != 2 or embeddings.shape[1] != self.embedding_dim:
            raise ValueError(
                f"ProxyNCALoss.logits: expected embeddings [B, {self.embedding_dim}], got {tuple(embeddings.shape)}"
            )
        with no_autocast(embeddings.device):
            return -self._distances(embeddings)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_embeddings_labels(embeddings, labels, "ProxyNCALoss")
        if embeddings.shape[1] != self.embedding_dim:
            raise ValueError(
                f"ProxyNCALoss: embeddings have dim {embeddings.shape[1]}, expected embedding_dim={self.embedding_dim}"
            )
        if labels.numel() == 0:
            return zero_loss(embeddings, self.proxies)
        if int(labels.min()) < 0 or int(labels.max()) >= self.num_classes:
            raise ValueError(
                f"ProxyNCALoss: labels must lie in [0, {self.num_classes}), got range "
                f"[{int(labels.min())}, {int(labels.max())}]"
            )
        if self.exclude_positive and self.num_classes < 2:
            # no negative proxy exists: the loss is undefined, give a graph-connected zero
            return zero_loss(embeddings, self.proxies)
        with no_autocast(embeddings.device):
            x = l2_normalize(upcast(embeddings))
            p = l2_normalize(self.proxies.to(x.dtype))
            # with fixed norms, -d(x, p_z) = 2 sx sp cos(x, p_z) - (sx^2 + sp^2): the constant
            # cancels between numerator and denominator, so the loss only needs the cosines
            logits = (2.0 * self.scale_x * self.scale_p) * (x @ p.t())
            if not self.exclude_positive:
                return F.cross_entropy(logits, labels)
            pos_logit = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
            # -inf at the positive class removes it from the denominator (C >= 2 here, so
            # every row keeps a finite entry and logsumexp's gradient stays finite)
            neg_logits = logits.scatter(1, labels.unsqueeze(1), float("-inf"))
            return (torch.logsumexp(neg_logits, dim=1) - pos_logit).mean()

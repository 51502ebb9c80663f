"""Numerically safe pairwise distances and label masks shared by the losses.

Every loss in :mod:`deepmetric.losses` computes its internals in (at least) float32 with
autocast switched off (:func:`upcast`, :func:`no_autocast`): bf16 squared distances computed through
``||a||^2 + ||b||^2 - 2 a.b`` lose all precision for nearby points and can go negative.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = [
    "upcast",
    "upcast_normalized",
    "check_embeddings_labels",
    "l2_normalize",
    "pairwise_squared_euclidean",
    "pairwise_euclidean",
    "safe_sqrt",
    "gram",
    "label_masks",
    "masked_logsumexp",
    "no_autocast",
    "zero_loss",
]

_EPS = 1e-12


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Cast half / bfloat16 tensors to float32; float32 and float64 pass unchanged."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def upcast_normalized(x: torch.Tensor, normalize: bool) -> torch.Tensor:
    """:func:`upcast`, then l2-normalised when the loss is set to ``normalize`` (the pair losses'
    option: distances between unit vectors)."""
    x = upcast(x)
    return l2_normalize(x) if normalize else x


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Context that disables autocast on ``device`` so matmuls stay in float32."""
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except RuntimeError:  # a device type autocast does not know: nothing to disable
        return contextlib.nullcontext()


def check_embeddings_labels(embeddings, labels, name: str = "loss") -> None:
    """Validate the ``loss(embeddings, labels)`` calling convention with clear errors."""
    if not isinstance(embeddings, torch.Tensor):
        raise TypeError(f"{name}: embeddings must be a torch.Tensor, got {type(embeddings).__name__}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name}: labels must be a torch.Tensor, got {type(labels).__name__}")
    if embeddings.dim() != 2:
        raise ValueError(
            f"{name}: embeddings must have shape [batch, dim], got shape {tuple(embeddings.shape)}"
        )
    if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(
            f"{name}: labels must have shape [{embeddings.shape[0]}] to match embeddings "
            f"{tuple(embeddings.shape)}, got shape {tuple(labels.shape)}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise TypeError(f"{name}: labels must be an integer tensor, got dtype {labels.dtype}")
    if not embeddings.dtype.is_floating_point:
        raise TypeError(f"{name}: embeddings must be floating point, got dtype {embeddings.dtype}")


def l2_normalize(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """l2-normalise rows; a zero vector stays zero (finite gradient) instead of NaN."""
    return F.normalize(x, p=2.0, dim=dim, eps=_EPS)


class _Gram(torch.autograd.Function):
    """``x @ x.T`` whose backward is one matmul, ``(G + G^T) @ x``, instead of autograd's two.

    The backward is written with differentiable ops, so double backward still works.
    """

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x @ x.t()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return (grad + grad.t()) @ x


def gram(x: torch.Tensor) -> torch.Tensor:
    """``x @ x.T`` (with the one-matmul backward of :class:`_Gram` when a gradient is needed)."""
    return _Gram.apply(x) if x.requires_grad else x @ x.t()


def pairwise_squared_euclidean(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """Squared Euclidean distances ``D[i, j] = ||x_i - y_j||^2`` as a matrix.

    Uses the Gram expansion (one matmul), clamps the result at 0 (rounding can make it
    slightly negative) and, when ``y`` is None, sets the diagonal to exactly 0.
    """
    self_dist = y is None
    if y is None:
        y = x
    xx = (x * x).sum(dim=1, keepdim=True)
    yy = xx.t() if self_dist else (y * y).sum(dim=1).unsqueeze(0)
    if self_dist:
        d = (xx + yy - 2.0 * gram(x)).clamp_min(0.0)
    else:
        d = torch.addmm(xx + yy, x, y.t(), beta=1.0, alpha=-2.0).clamp_min(0.0)
    if self_dist:
        # exact zeros on the diagonal; multiplying keeps the graph simple and differentiable
        n = x.shape[0]
        d = d * (1.0 - torch.eye(n, device=x.device, dtype=d.dtype))
    return d


def safe_sqrt(x: torch.Tensor, eps: float = _EPS) -> torch.Tensor:
    """sqrt with value 0 and gradient 0 (not inf/NaN) where ``x <= eps``."""
    positive = x > eps
    return torch.where(positive, torch.sqrt(x.clamp_min(eps)), torch.zeros_like(x))


def pairwise_euclidean(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """Euclidean distances (safe sqrt of :func:`pairwise_squared_euclidean`)."""
    return safe_sqrt(pairwise_squared_euclidean(x, y))


def label_masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return boolean ``(positive, negative)`` masks for a batch.

    ``positive[i, j]``: same label and ``i != j``; ``negative[i, j]``: different label.
    """
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    eye = torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
    return same & ~eye, ~same


def masked_logsumexp(x: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log(sum_{mask} exp(x))`` along ``dim``; rows with an empty mask give -inf.

    Masked entries are replaced by -inf *before* the exponential (never multiplied by 0
    after it), so neither overflow nor NaN gradients can leak in from excluded entries.
    The gradient of an all-masked row is 0, provided callers drop those rows' -inf values
    with ``torch.where`` (they do).
    """
    x = torch.where(mask, x, torch.full_like(x, float("-inf")))
    m = x.amax(dim=dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(x - m).sum(dim=dim, keepdim=True)
    # log(0) only for empty rows; clamp keeps the backward of log finite there
    out = torch.log(s.clamp_min(torch.finfo(s.dtype).tiny)) + m
    out = torch.where(s > 0, out, torch.full_like(out, float("-inf")))
    return out.squeeze(dim)


def zero_loss(*tensors: torch.Tensor) -> torch.Tensor:
    """A float32 scalar 0 that is still connected to the graph of ``tensors``.

    Returned when a batch holds no valid pair/triplet, so ``loss.backward()`` works and
    gives zero (finite) gradients instead of failing or producing NaN.
    """
    total = None
    for t in tensors:
        if t is not None and t.requires_grad:
            term = t.float().sum() * 0.0
            total = term if total is None else total + term
    if total is None:
        device = tensors[0].device if tensors else None
        total = torch.zeros((), dtype=torch.float32, device=device)
    return total

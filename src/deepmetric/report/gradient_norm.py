"""The numbers behind the heated-up paper's Fig. 1, from plain arrays or a trained loss:
:func:`gradient_norm_vs_alpha` gives ``||d loss / d f_hat||`` as a function of the temperature
parameter alpha (Eq. 1-3 with l2-normalised features and class weights), by autograd through
:class:`deepmetric.losses.HeatedSoftmaxLoss`, and :func:`closed_form_gradient_norm` the same
from Eq. 3; :func:`select_paper_samples` picks the "incorrect", "boundary" and "centroid"
samples (Sec. 3.2) from a trained classifier, :func:`synthetic_paper_samples` builds textbook
ones when no trained model is at hand."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from deepmetric.losses.temperature import get_alpha, set_alpha

from .diagnostics import _as_2d_float, _as_labels, _l2n

__all__ = ["gradient_norm_vs_alpha", "closed_form_gradient_norm", "select_paper_samples", "synthetic_paper_samples"]


def closed_form_gradient_norm(f_hat: np.ndarray, w_hat: np.ndarray, label: int, alpha: float,
                              bias: np.ndarray | None = None) -> float:
    """``||alpha * sum_m (p_m - q_m) w_hat_m||`` (heated-up paper Eq. 3 on normalised
    ``f_hat`` (k,) and ``w_hat`` (C, k), ``p = softmax(alpha * (w_hat f_hat + b))``, Eq. 1)."""
    z = alpha * (w_hat @ f_hat + (0.0 if bias is None else bias))
    p = np.exp(z - z.max())
    p /= p.sum()
    q = np.zeros_like(p)
    q[label] = 1.0
    return float(np.linalg.norm(alpha * (p - q) @ w_hat))


def _classifier_from_loss(loss: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Class weights (C, k) and bias of a classifier-type loss (e.g. HeatedSoftmaxLoss)."""
    weight = None
    for name in ("weight", "weights", "W", "proxies"):
        t = getattr(loss, name, None)
        if isinstance(t, torch.Tensor) and t.ndim == 2:
            weight = t
            break
    if weight is None:
        raise TypeError(f"{type(loss).__name__} exposes no 2-d 'weight' tensor (class weights)")
    bias = getattr(loss, "bias", None)
    return weight, bias if isinstance(bias, torch.Tensor) else None


def gradient_norm_vs_alpha(
    embeddings: Any,
    labels: Any,
    alphas: Sequence[float],
    *,
    weights: Any = None,
    bias: Any = None,
    loss: torch.nn.Module | None = None,
    normalize_weights: bool = True,
    alpha_scales_bias: bool = True,
) -> np.ndarray:
    """Gradient norm of the softmax cross-entropy w.r.t. the l2-normalised embedding,
    for every sample and every alpha (heated-up paper, Fig. 1 and Eq. 1-3).

    Returns an array (N, len(alphas)) of ``||d l / d f_hat||_2``, computed by autograd
    through :class:`deepmetric.losses.HeatedSoftmaxLoss`, so the figure diagnoses exactly
    what training optimises:

    * ``loss``: a trained classifier-type loss exposing ``.logits(embeddings)`` and a
      settable ``.alpha`` (e.g. the run's ``HeatedSoftmaxLoss``); its alpha and train/eval
      mode are restored afterwards;
    * otherwise ``weights`` (C, k) and optional ``bias`` (C,) build one (float64) with
      ``normalize_weights`` (paper: True) and ``alpha_scales_bias`` (paper Eq. 1: the
      bias is inside the tempered logit, ``alpha * (<f_hat, w_hat> + b)``).

    The embeddings are l2-normalised first (the figure is drawn for f_hat). Properties 1-2
    of the paper: the norm vanishes as alpha -> 0, and as alpha -> inf for correctly
    classified samples, while it grows without bound for incorrect ones.
    """
    x = _as_2d_float(embeddings, "embeddings")
    y = _as_labels(labels, x.shape[0])
    alphas_arr = np.asarray(list(alphas), dtype=np.float64)
    if alphas_arr.ndim != 1 or alphas_arr.size == 0:
        raise ValueError("alphas must be a non-empty 1-d sequence of numbers")
    if not np.all(np.isfinite(alphas_arr)) or np.any(alphas_arr < 0):
        raise ValueError(f"alphas must be finite and >= 0, got {alphas_arr.tolist()}")
    if loss is None:
        loss = _loss_from_weights(weights, bias, x.shape[1], normalize_weights, alpha_scales_bias)
    if not hasattr(loss, "logits") or not hasattr(loss, "alpha"):
        raise TypeError(f"loss {type(loss).__name__} must expose .logits(embeddings) and .alpha")
    n_cls = getattr(loss, "num_classes", None)
    if n_cls is not None and (int(y.max()) >= n_cls or int(y.min()) < 0):
        raise ValueError(f"labels must lie in [0, {n_cls - 1}] (one class weight per class)")
    f_hat = torch.as_tensor(_l2n(x.astype(np.float64)))
    yt = torch.as_tensor(y)
    out = np.empty((x.shape[0], alphas_arr.size))
    old_alpha, was_training = get_alpha(loss), loss.training  # a float: a learnable alpha is changed in place
    param = next(iter(loss.parameters()), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    loss.eval()
    try:
        for j, a in enumerate(alphas_arr):
            set_alpha(loss, float(a))
            f = f_hat.to(device=device, dtype=dtype).clone().requires_grad_(True)
            logits = loss.logits(f)
            # summed CE: each sample's loss depends only on its own row, so row i of the
            # gradient is exactly d l_i / d f_hat_i
            ce = F.cross_entropy(logits.double(), yt.to(device), reduction="sum")
            (g,) = torch.autograd.grad(ce, f)
            out[:, j] = g.double().norm(dim=1).cpu().numpy()
    finally:
        if old_alpha is not None:
            set_alpha(loss, old_alpha)
        loss.train(was_training)
    return out


def _loss_from_weights(weights: Any, bias: Any, dim: int, normalize_weights: bool,
                       alpha_scales_bias: bool) -> torch.nn.Module:
    from deepmetric.losses import HeatedSoftmaxLoss

    if weights is None:
        raise ValueError("give either loss= (a classifier-type loss) or weights= (C x k)")
    w = _as_2d_float(weights, "weights").astype(np.float64)
    if w.shape[1] != dim:
        if w.shape[0] == dim:
            raise ValueError(f"weights must be (C, k) = (classes, {dim}); got {w.shape} "
                             f"- pass weights.T if you hold them as (k, C)")
        raise ValueError(f"weights have {w.shape[1]} dims but embeddings have {dim}")
    loss = HeatedSoftmaxLoss(w.shape[0], dim, 1.0, normalize_weights=normalize_weights,
                             bias=bias is not None, alpha_scales_bias=alpha_scales_bias).double()
    with torch.no_grad():
        loss.weight.copy_(torch.as_tensor(w))
        if bias is not None:
            b = np.asarray(bias, dtype=np.float64).reshape(-1)
            if b.shape[0] != w.shape[0]:
                raise ValueError(f"bias has {b.shape[0]} entries but there are {w.shape[0]} classes")
            loss.bias.copy_(torch.as_tensor(b))
    return loss


def _cosine_logits(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    z = _l2n(x.astype(np.float64)) @ _l2n(w.astype(np.float64)).T
    return z if bias is None else z + np.asarray(bias, dtype=np.float64)


def select_paper_samples(embeddings: Any, labels: Any, weights: Any,
                         bias: Any = None) -> dict[str, int | None]:
    """Pick one "incorrect", "boundary" and "centroid" sample (heated-up paper, Sec. 3.2).

    With cosine logits ``z_m = <f_hat, w_hat_m>``, the margin of a sample is
    ``z_y - max_{m != y} z_m``: *incorrect* samples have margin <= 0 (the one with the
    median margin among them is returned), *boundary* is the correct sample with the
    smallest positive margin, *centroid* the correct sample with the largest margin.
    A type with no member maps to ``None``.
    """
    x = _as_2d_float(embeddings, "embeddings")
    y = _as_labels(labels, x.shape[0])
    w = _as_2d_float(weights, "weights")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"weights have {w.shape[1]} dims but embeddings have {x.shape[1]}")
    if w.shape[0] < 2:
        raise ValueError("need at least 2 classes (weight rows) to define a margin")
    if int(y.max()) >= w.shape[0] or int(y.min()) < 0:
        raise ValueError(f"labels must lie in [0, {w.shape[0] - 1}]")
    z = _cosine_logits(x, w, None if bias is None else np.asarray(bias))
    rows = np.arange(len(y))
    zy = z[rows, y]
    z_other = z.copy()
    z_other[rows, y] = -np.inf
    margin = zy - z_other.max(axis=1)
    out: dict[str, int | None] = {"incorrect": None, "boundary": None, "centroid": None}
    wrong = np.flatnonzero(margin <= 0)
    if wrong.size:
        order = wrong[np.argsort(margin[wrong], kind="stable")]
        out["incorrect"] = int(order[(order.size - 1) // 2])
    right = np.flatnonzero(margin > 0)
    if right.size:
        out["boundary"] = int(right[np.argmin(margin[right])])
        out["centroid"] = int(right[np.argmax(margin[right])])
    return out


def synthetic_paper_samples(num_classes: int = 10, dim: int = 64, seed: int = 0,
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Textbook samples for Fig. 1 without a trained model.

    Returns ``(weights (C, k), embeddings (3, k), labels (3,))`` with class-0 samples in the
    order incorrect, boundary, centroid: the centroid sample is ``w_hat_0`` itself, the
    boundary one lies just on class 0's side of the bisector of ``w_hat_0`` and
    ``w_hat_1``, the incorrect one just on class 1's side.
    """
    if num_classes < 2 or dim < 2:
        raise ValueError("synthetic_paper_samples needs num_classes >= 2 and dim >= 2")
    rng = np.random.default_rng(seed)
    w = _l2n(rng.standard_normal((num_classes, dim)))
    w0, w1 = w[0], w[1]
    centroid = w0
    boundary = _l2n((0.6 * w0 + 0.4 * w1)[None])[0]
    incorrect = _l2n((0.4 * w0 + 0.6 * w1)[None])[0]
    x = np.stack([incorrect, boundary, centroid])
    return w, x, np.zeros(3, dtype=np.int64)

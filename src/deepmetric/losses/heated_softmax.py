"""Heated-up softmax embedding loss (Zhang et al., "Heated-Up Softmax Embedding", 2018).

Softmax cross-entropy with a temperature ``alpha = 1/T`` on l2-normalised class weights
(``papers/heated-up-softmax-embedding.txt``, Eq. 1-4), plus the "SM" baseline (plain
softmax: unnormalised weights and features, alpha = 1).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepmetric.options import int_option

from .registry import register_loss

__all__ = ["HeatedSoftmaxLoss", "variance_scaling_"]


def variance_scaling_(weight: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
    """Fan-in variance scaling with a truncated normal, as TensorFlow's
    ``tf.contrib.layers.variance_scaling_initializer(factor, mode="FAN_IN", uniform=False)``
    (the initialiser of the official heated-up code, REFERENCE.md section 1).

    ``weight`` is (out, in) as in ``nn.Linear`` so fan-in is ``weight.shape[1]``;
    std = sqrt(1.3 * factor / fan_in), truncated at two standard deviations (TF's 1.3
    compensates the variance lost by the truncation).
    """
    fan_in = weight.shape[1]
    std = math.sqrt(1.3 * factor / fan_in)
    with torch.no_grad():
        return nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2 * std, b=2 * std)


def _check_alpha(value: Any) -> float:
    try:
        a = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
    except (TypeError, ValueError):
        raise TypeError(f"alpha must be a real number, got {value!r}") from None
    if not math.isfinite(a) or a < 0:
        raise ValueError(f"alpha must be finite and >= 0, got {a}")
    return a


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64, else float32 (half / bf16 inputs, e.g. under
    autocast, are computed in float32)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64
                                for t in tensors) else torch.float32


def check_class_batch(embeddings: Any, labels: Any, embedding_dim: int, num_classes: int,
                      who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``(embeddings [B, k], labels [B] in [0, num_classes))`` of a classification loss with
    clear errors (the pair losses check theirs with :func:`.distances.check_embeddings_labels`)."""
    if not isinstance(embeddings, torch.Tensor):
        raise TypeError(f"{who}: embeddings must be a torch.Tensor, got {type(embeddings).__name__}")
    if embeddings.ndim != 2 or embeddings.shape[1] != embedding_dim:
        raise ValueError(f"{who}: embeddings must have shape [batch, {embedding_dim}], "
                         f"got {tuple(embeddings.shape)}")
    if not embeddings.is_floating_point():
        raise TypeError(f"{who}: embeddings must be floating point, got {embeddings.dtype}")
    if not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(np.asarray(labels))
    if labels.ndim != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(f"{who}: labels must have shape [{embeddings.shape[0]}] (one per "
                         f"embedding), got {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"{who}: labels must be an integer tensor, got {labels.dtype}")
    labels = labels.to(device=embeddings.device, dtype=torch.long)
    if labels.numel() > 0:
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"{who}: labels must lie in [0, {num_classes - 1}] "
                             f"(num_classes={num_classes}), got values in [{lo}, {hi}]")
    return embeddings, labels


@register_loss("heated_softmax")
class HeatedSoftmaxLoss(nn.Module):
    r"""Softmax cross-entropy with temperature on normalised class weights (heated-up
    softmax embedding, Zhang et al. 2018, ``papers/heated-up-softmax-embedding.txt``).

    For an embedding ``f`` (already normalised by the model's head: none / l2 / bn) and
    class weights ``w_m`` (rows of :attr:`weight`, l2-normalised to ``w_hat_m``):

    * logits ``z_m = <f, w_hat_m> + b_m`` and ``p(m|x) = softmax(alpha * z)_m`` (Eq. 1,
      ``alpha = 1/T``), so the logits returned by :meth:`logits` are ``alpha * z``;
    * loss = mean over the batch of the cross-entropy ``l = -log p(y|x)`` (Eq. 2);
    * its gradients are ``dl/df = alpha * sum_m (p_m - q_m) w_hat_m`` (Eq. 3) and
      ``dl/dw_hat_m = alpha (p_m - q_m) f`` (Eq. 4); the tests check autograd against both,
      and Properties 1-3 (Eq. 6-10).

    Heating-up (Sec. 3.4): train at alpha = 16, then multiply alpha by 1/4 and the learning
    rate by 1/10; schedules call :meth:`scale_alpha` (or set :attr:`alpha`).

    Options (defaults in brackets):

    * ``num_classes``, ``embedding_dim``: shape of the classifier ``weight`` (C, k).
    * ``alpha`` [16.0]: the inverse temperature (>= 0).
    * ``learnable_alpha`` [False]: alpha is an ``nn.Parameter`` trained with the rest
      (NormFace, paper Table 5); heating then multiplies the *learned* value.
    * ``freeze_heated_alpha`` [True]: with ``learnable_alpha``, the first heating event
      (:meth:`scale_alpha`) also freezes alpha at the heated value for the rest of training
      (paper Appendix E: "the alpha values are reduced to 1/4 of the final alpha values";
      see :meth:`freeze_alpha`).  False keeps training the heated alpha.
    * ``normalize_weights`` [True]: l2-normalise every class weight (False = Table 6
      "BN w/o WN" and the SM baseline).
    * ``normalize_features`` [False]: l2-normalise the embeddings here (the model's head
      normally does it; set True when it does not).
    * ``bias`` [True]: trainable per-class bias, initialised to 0.
    * ``alpha_scales_bias`` [True]: the paper's Eq. 1 puts the bias inside the tempered
      logit, ``alpha * (<f, w_hat> + b)``; False reproduces the official TensorFlow code,
      ``alpha * <f, w_hat> + b``.  Identical at initialisation (b = 0).
    * ``init_factor`` [2.0]: factor of the fan-in variance-scaling truncated-normal
      initialisation of ``weight`` (:func:`variance_scaling_`, TF default).
    * ``eps`` [1e-12]: floor of the norms in the normalisations (zero vectors stay finite).

    Paper vs official code:

    * BN features: the paper divides the batch-normalised embedding by ``sqrt(k)``
      (Eq. 13); the official code leaves the embedding at norm ~sqrt(k) and folds the factor
      into the temperature (``alpha / sqrt(k)``).  This loss applies ``alpha`` to whatever
      the head outputs, so a head that does *not* divide by sqrt(k) needs
      ``alpha=16 / sqrt(k)`` to match.
    * Bias inside / outside alpha: see ``alpha_scales_bias``.
    * SOP: the authors set ``W`` to the l2-normalised per-class mean of the training
      embeddings before training (:meth:`init_from_class_means`).

    The SM baseline (paper Sec. 4-5, "SM"): :meth:`sm` (alpha = 1, unnormalised weights and
    features).  All internals are computed in float32 with autocast disabled, so the loss
    is safe under ``torch.autocast`` (e.g. bf16 on CPU).
    """

    def __init__(self, num_classes: int, embedding_dim: int, alpha: float = 16.0, *,
                 learnable_alpha: bool = False, normalize_weights: bool = True,
                 normalize_features: bool = False, bias: bool = True,
                 alpha_scales_bias: bool = True, init_factor: float = 2.0,
                 freeze_heated_alpha: bool = True, eps: float = 1e-12) -> None:
        super().__init__()
        self.num_classes = int_option("num_classes", num_classes)
        self.embedding_dim = int_option("embedding_dim", embedding_dim)
        a = _check_alpha(alpha)
        if not (isinstance(init_factor, (int, float)) and init_factor > 0):
            raise ValueError(f"init_factor must be a positive number, got {init_factor!r}")
        self.learnable_alpha = bool(learnable_alpha)
        self.normalize_weights = bool(normalize_weights)
        self.normalize_features = bool(normalize_features)
        self.alpha_scales_bias = bool(alpha_scales_bias)
        self.freeze_heated_alpha = bool(freeze_heated_alpha)
        self.init_factor = float(init_factor)
        self.eps = float(eps)

        self.weight = nn.Parameter(torch.empty(self.num_classes, self.embedding_dim))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_classes))
        else:
            self.register_parameter("bias", None)
        # alpha lives in the state dict in both modes, so a resumed run keeps a heated alpha.
        if self.learnable_alpha:
            self._alpha = nn.Parameter(torch.tensor(a, dtype=torch.float32))
        else:
            self.register_buffer("_alpha", torch.tensor(a, dtype=torch.float32))
        # A frozen learnable alpha (after heating up): the value in force lives in this buffer,
        # the flag in ``alpha_frozen``; both are checkpointed, so a resumed run stays frozen.
        self.register_buffer("alpha_frozen", torch.tensor(False))
        self.register_buffer("_frozen_alpha", torch.tensor(a, dtype=torch.float32))
        self._register_load_state_dict_pre_hook(self._fill_missing_freeze_state)
        self.reset_parameters()

    @staticmethod
    def _fill_missing_freeze_state(state_dict, prefix, *args, **kwargs) -> None:
        """Checkpoints written before alpha freezing existed load as "not frozen"."""
        if prefix + "_alpha" in state_dict:
            state_dict.setdefault(prefix + "alpha_frozen", torch.tensor(False))
            state_dict.setdefault(prefix + "_frozen_alpha", state_dict[prefix + "_alpha"].detach().clone())

    # ------------------------------------------------------------------ construction
    @classmethod
    def sm(cls, num_classes: int, embedding_dim: int, **kwargs: Any) -> "HeatedSoftmaxLoss":
        """The paper's "SM" baseline: an off-the-shelf softmax classifier (unnormalised
        weights and features, alpha = 1, fixed, with bias).  Other options pass through."""
        opts = dict(alpha=1.0, learnable_alpha=False, normalize_weights=False,
                    normalize_features=False)
        opts.update(kwargs)
        return cls(num_classes, embedding_dim, **opts)

    def reset_parameters(self) -> None:
        """Weight: fan-in variance scaling, truncated normal; bias: zeros."""
        variance_scaling_(self.weight, self.init_factor)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    # ------------------------------------------------------------------ temperature
    @property
    def is_alpha_frozen(self) -> bool:
        return bool(self.alpha_frozen)

    @property
    def alpha(self) -> float:
        """Current inverse temperature (the learned value when ``learnable_alpha``, the
        frozen value once :meth:`freeze_alpha` ran)."""
        if self.is_alpha_frozen:
            return float(self._frozen_alpha)
        return float(self._alpha.detach())

    @alpha.setter
    def alpha(self, value: float) -> None:
        a = _check_alpha(value)
        with torch.no_grad():
            self._alpha.fill_(a)
            self._frozen_alpha.fill_(a)

    def freeze_alpha(self) -> None:
        """Stop training a learnable alpha: from now on the logits use the current value,
        held in a buffer, and no gradient reaches it.  The ``nn.Parameter`` stays registered
        (the optimiser and DistributedDataParallel still know it) but no longer takes part:
        outside distributed training it gets no gradient (``grad`` None, so SGD / Adam skip it,
        momentum included); under DDP it gets an exact zero gradient so every rank reduces the
        same parameters.  Whatever an optimiser does to it afterwards has no effect on the
        loss.  A fixed alpha needs no freezing (no-op)."""
        if not self.learnable_alpha or self.is_alpha_frozen:
            return
        with torch.no_grad():
            self._frozen_alpha.fill_(float(self._alpha.detach()))
            self.alpha_frozen.fill_(True)
        self._alpha.grad = None

    def scale_alpha(self, factor: float) -> None:
        """Multiply alpha (fixed or learned) by ``factor``; heating-up uses 1/4.  A learnable
        alpha is then frozen at the heated value when ``freeze_heated_alpha``."""
        f = _check_alpha(factor)
        self.alpha = self.alpha * f
        if self.learnable_alpha and self.freeze_heated_alpha:
            self.freeze_alpha()

    def _alpha_in_use(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.is_alpha_frozen:
            return self._alpha.to(dtype)
        a = self._frozen_alpha.to(dtype)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            a = a + 0.0 * self._alpha.to(dtype)  # DDP expects a gradient for every parameter
        return a

    # ------------------------------------------------------------------ classifier
    def class_weights(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The class weights as used in the logits: (C, k), l2-normalised rows if
        ``normalize_weights``."""
        w = self.weight.to(dtype or compute_dtype(self.weight))
        return F.normalize(w, dim=1, eps=self.eps) if self.normalize_weights else w

    def _features(self, embeddings: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        f = embeddings.to(dtype)
        return F.normalize(f, dim=1, eps=self.eps) if self.normalize_features else f

    def logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Tempered logits ``alpha * z`` (Eq. 1), [B, C] in float32 (float64 when the
        embeddings or the parameters are float64)."""
        if not isinstance(embeddings, torch.Tensor):
            raise TypeError(f"HeatedSoftmaxLoss.logits: embeddings must be a torch.Tensor, "
                            f"got {type(embeddings).__name__}")
        if embeddings.ndim != 2 or embeddings.shape[1] != self.embedding_dim:
            raise ValueError(f"HeatedSoftmaxLoss.logits: embeddings must have shape "
                             f"[batch, {self.embedding_dim}], got {tuple(embeddings.shape)}")
        with torch.autocast(embeddings.device.type, enabled=False):
            dt = compute_dtype(embeddings, self.weight)
            f = self._features(embeddings, dt)
            z = f @ self.class_weights(dt).t()
            alpha = self._alpha_in_use(dt)
            if self.bias is None:
                return alpha * z
            if self.alpha_scales_bias:
                return alpha * (z + self.bias.to(dt))
            return alpha * z + self.bias.to(dt)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean softmax cross-entropy of the tempered logits (Eq. 1-2)."""
        embeddings, labels = check_class_batch(
            embeddings, labels, self.embedding_dim, self.num_classes, "HeatedSoftmaxLoss")
        if embeddings.shape[0] == 0:
            raise ValueError("HeatedSoftmaxLoss: empty batch")
        logits = self.logits(embeddings)
        with torch.autocast(embeddings.device.type, enabled=False):
            return F.cross_entropy(logits, labels)

    @torch.no_grad()
    def init_from_class_means(self, embeddings: Any, labels: Any) -> torch.Tensor:
        """Set ``weight[c]`` to the l2-normalised mean of the embeddings of class ``c``
        (the authors' initialisation for Stanford Online Products).

        ``embeddings`` [N, k] and ``labels`` [N] may be tensors or numpy arrays (e.g. the
        output of an embedding pass over the training set).  When ``normalize_features`` the
        embeddings are l2-normalised first, as in the loss.  Classes without any sample keep
        their weights.  Returns the bool mask [C] of the classes that were set.
        """
        if isinstance(embeddings, np.ndarray):
            embeddings = torch.from_numpy(embeddings)
        embeddings, labels = check_class_batch(
            embeddings, labels, self.embedding_dim, self.num_classes,
            "HeatedSoftmaxLoss.init_from_class_means")
        f = self._features(embeddings.to(self.weight.device), torch.float64)
        labels = labels.to(self.weight.device)
        sums = torch.zeros(self.num_classes, self.embedding_dim, dtype=torch.float64,
                           device=self.weight.device).index_add_(0, labels, f)
        counts = torch.bincount(labels, minlength=self.num_classes)
        seen = counts > 0
        means = sums[seen] / counts[seen].unsqueeze(1)
        self.weight[seen] = F.normalize(means, dim=1, eps=self.eps).to(self.weight.dtype)
        return seen

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}, "
                f"alpha={self.alpha:g}, learnable_alpha={self.learnable_alpha}"
                f"{' (frozen)' if self.is_alpha_frozen else ''}, "
                f"normalize_weights={self.normalize_weights}, "
                f"normalize_features={self.normalize_features}, bias={self.bias is not None}, "
                f"alpha_scales_bias={self.alpha_scales_bias}")

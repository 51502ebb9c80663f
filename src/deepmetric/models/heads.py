"""Embedding heads: linear projection to k dims followed by a feature normalisation.

Heated-up softmax embedding (Zhang et al., 2018): the normalisations of Sec. 3.3 (BN: Eq. 13), the
models of Sec. 5.2:

* ``"none"``  -- the plain bottleneck feature f (SM baseline);
* ``"l2"``    -- f / ||f||_2 (LN);
* ``"bn"``    -- BN^(f) / sqrt(k) (BN), where BN^ is batch normalisation *without* the learned
  scale (gamma fixed at 1) but with the learned shift beta.

The projection is the paper's "linear (1x1 conv) layer to k dims, no activation": on globally
pooled features a 1x1 convolution is exactly a ``nn.Linear``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from deepmetric.options import bool_option, float_option

__all__ = ["NORMS", "HEAD_INITS", "ShiftOnlyBatchNorm1d", "EmbeddingHead", "ProjectionHead", "check_norm",
           "pca_directions"]

NORMS = ("none", "l2", "bn")
#: ``head_init`` values: the projection initialised from the PCA of the backbone's pooled
#: features (:meth:`EmbeddingHead.init_from_pca`), or whitened PCA.
HEAD_INITS = ("pca", "pca_whiten")

# Official heated-up code (TensorFlow slim batch_norm): decay 0.95 -> PyTorch momentum 0.05,
# epsilon 1e-3.  PyTorch's own defaults are momentum 0.1, eps 1e-5.
BN_MOMENTUM = 0.05
BN_EPS = 1e-3


def check_norm(norm: str) -> str:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    return norm


def _world_size(group) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class ShiftOnlyBatchNorm1d(nn.BatchNorm1d):
    """Batch norm over [B, k] with a learned shift ``bias`` and NO learned scale.

    y = (x - mean) / sqrt(var + eps) + bias, with batch statistics in training mode
    (biased variance, as ``nn.BatchNorm1d``) and running statistics in eval mode.  The
    running statistics follow PyTorch's convention
    ``running = (1 - momentum) * running + momentum * batch`` (TensorFlow ``decay`` is
    ``1 - momentum``).  Heated-up paper footnote 2: "batch normalization always refers to
    batch normalization without learned scale".
    """

    def __init__(self, num_features: int, eps: float = BN_EPS, momentum: float = BN_MOMENTUM):
        # bn_momentum: PyTorch's convention, = 1 - TensorFlow's decay
        momentum = float_option("bn_momentum", momentum, 0.0, 1.0, low_open=True, high_open=False)
        eps = float_option("bn_eps", eps, 0.0, math.inf, low_open=True)
        # affine=False: no weight at all (rather than a frozen weight) so that no optimiser,
        # weight decay or checkpoint can ever touch a scale.
        super().__init__(num_features, eps=eps, momentum=momentum, affine=False)
        self.bias = nn.Parameter(torch.zeros(num_features))
        # Multi-process training: set by deepmetric.train.distributed.convert_sync_batchnorm
        # (nn.SyncBatchNorm's own conversion would replace this module by an affine-less
        # SyncBatchNorm and silently drop the learned shift).
        self.sync = False
        self.process_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.sync and _world_size(self.process_group) > 1:
            return self._synchronised_forward(x)
        # Normalise with no affine part, then add the shift. Passing (weight, bias) = (None,
        # bias) to F.batch_norm is what nn.BatchNorm1d.forward would do, and it is right on the
        # CPU, but on CUDA its backward returns an empty gradient for the bias ("invalid
        # gradient at index 2 - got [0] but expected shape compatible with [k]", seen with
        # torch 2.11 on an H100, bench/RESULTS.md), so no BN-head model could train on a GPU.
        self._check_input_dim(x)
        if not self.training and torch.onnx.is_in_onnx_export():
            # the eval-mode batch norm written out: ONNX's batch_norm needs a channel count its
            # shape inference loses in a ViT trunk (a token model's pooled features)
            return (x - self.running_mean) * torch.rsqrt(self.running_var + self.eps) + self.bias
        if self.training:
            self.num_batches_tracked.add_(1)  # kept as nn.BatchNorm1d keeps it (unused: momentum is set)
        y = F.batch_norm(x, self.running_mean, self.running_var, None, None, self.training,
                         self.momentum, self.eps)
        return y + self.bias

    def _synchronised_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Training-mode forward with the batch statistics of every rank's batch together (as
        nn.SyncBatchNorm: the gradient flows back to each rank's inputs through the statistics).
        Two passes (mean, then the mean squared deviation), each one autograd-aware all_reduce
        of a k-vector, in float32."""
        from torch.distributed.nn.functional import all_reduce

        self._check_input_dim(x)
        group = {} if self.process_group is None else {"group": self.process_group}
        x = x.float()
        k = x.shape[1]
        sums = all_reduce(torch.cat([x.sum(0), x.new_full((1,), x.shape[0])]), **group)
        n = sums[k]
        mean = sums[:k] / n
        var = all_reduce(((x - mean) ** 2).sum(0), **group) / n  # biased, as F.batch_norm
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            self.running_mean.mul_(1 - self.momentum).add_(mean, alpha=self.momentum)
            self.running_var.mul_(1 - self.momentum).add_(var * n / (n - 1), alpha=self.momentum)
        return (x - mean) / torch.sqrt(var + self.eps) + self.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + ", learned shift only (no scale)"


class EmbeddingHead(nn.Module):
    """[B, in_features] -> dropout -> Linear -> normalisation -> [B, k].

    Args:
        in_features: size of the pooled (or flattened) backbone features.
        embedding_dim: k; 0 = no linear layer: the embedding is the backbone's pooled features
            themselves, normalised by ``norm`` (k = ``in_features``), so what is indexed keeps
            everything the backbone learnt (a projection head on top can carry the loss).
        norm: ``"none"`` | ``"l2"`` | ``"bn"`` (see module docstring).
        dropout: dropout probability on the *input* of the projection.  This is where
            GoogLeNet's own dropout sits (pool5 -> dropout -> classifier), which ALMN keeps
            with ratio 0.2 when it swaps the classifier for a 512-d embedding layer.
        bn_momentum, bn_eps: batch-norm options for ``norm="bn"``; defaults are the official
            heated-up code's values (momentum 0.05 = 1 - decay 0.95, eps 1e-3).
        bn_divide_sqrt_k: paper Eq. 13 divides BN^(f) by sqrt(k) (default True).  The
            official code instead folds 1/sqrt(k) into the softmax scale alpha; set False to
            reproduce that and multiply alpha by ``head.alpha_factor`` (= 1/sqrt(k)) in the
            loss.  Both give identical logits alpha * <f_hat, w_hat>; with the class bias inside
            alpha (the loss's ``alpha_scales_bias``, its default) the bias term is scaled by the
            changed alpha as well, so only a zero or ``alpha_scales_bias=False`` bias keeps them equal.
        init: ``"default"`` (PyTorch Linear init) or ``"xavier"`` (Xavier-uniform weight,
            zero bias -- the two-head paper's embedding layer).
        bias: whether the projection has a bias.
    """

    def __init__(
        self,
        in_features: int,
        embedding_dim: int,
        norm: str = "bn",
        dropout: float = 0.0,
        bn_momentum: float = BN_MOMENTUM,
        bn_eps: float = BN_EPS,
        bn_divide_sqrt_k: bool = True,
        init: str = "default",
        bias: bool = True,
    ):
        super().__init__()
        if not isinstance(embedding_dim, int) or isinstance(embedding_dim, bool) or embedding_dim < 0:
            raise ValueError(f"embedding_dim must be a positive int (or 0: no linear layer), got {embedding_dim!r}")
        if not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        dropout = float_option("dropout", dropout, 0.0, 1.0)
        bias = bool_option("bias", bias)
        bn_divide_sqrt_k = bool_option("bn_divide_sqrt_k", bn_divide_sqrt_k)
        if init not in ("default", "xavier"):
            raise ValueError(f"init must be 'default' or 'xavier', got {init!r}")
        self.norm = check_norm(norm)
        linear = embedding_dim > 0
        embedding_dim = embedding_dim if linear else in_features
        self.embedding_dim = embedding_dim
        self.in_features = in_features
        self.bn_divide_sqrt_k = bool(bn_divide_sqrt_k)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.proj = nn.Linear(in_features, embedding_dim, bias=bias) if linear else nn.Identity()
        if init == "xavier" and linear:
            nn.init.xavier_uniform_(self.proj.weight)
            if self.proj.bias is not None:
                nn.init.zeros_(self.proj.bias)
        self.bn = ShiftOnlyBatchNorm1d(embedding_dim, eps=bn_eps, momentum=bn_momentum) if norm == "bn" else None

    @property
    def alpha_factor(self) -> float:
        """Factor the loss should apply to alpha: 1/sqrt(k) when BN's division is folded into alpha."""
        if self.norm == "bn" and not self.bn_divide_sqrt_k:
            return 1.0 / math.sqrt(self.embedding_dim)
        return 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"EmbeddingHead expects features of shape [B, {self.in_features}], got {tuple(x.shape)}"
            )
        f = self.proj(self.dropout(x))
        # Normalise (and return) in float32: under autocast f may be fp16/bf16, where the norm
        # and batch statistics lose precision, and the running buffers are float32 anyway.
        if self.norm == "l2":
            return F.normalize(f.float(), p=2.0, dim=1)
        if self.norm == "bn":
            f = self.bn(f.float())
            if self.bn_divide_sqrt_k:
                f = f / math.sqrt(self.embedding_dim)
            return f
        return f.float()

    @torch.no_grad()
    def init_from_pca(self, features: torch.Tensor, whiten: bool = False) -> dict[str, torch.Tensor]:
        """Set the projection to the PCA of ``features`` [N, in_features] (e.g. the pretrained
        backbone's pooled features of the training images).

        With mean mu, the top-k principal directions v_1..v_k (unit rows of W) and their
        variances lambda_1..lambda_k (denominator N - 1, as scikit-learn's PCA):

        * ``whiten=False``: W = [v_1..v_k]^T, an orthogonal projection onto the top-k subspace,
          so distances between centred features are kept as well as any rank-k map can
          (Eckart-Young); ``whiten=True``: row i divided by sqrt(lambda_i), unit variance per
          dimension (scikit-learn's ``PCA(whiten=True)``);
        * bias = -W mu, so the projection of the training features has mean 0.

        Dropout before the projection is not part of the map (it is off in eval mode).  With the
        BN head (``norm="bn"``) its running statistics are set to the projection's statistics
        (mean 0, variance lambda_i or 1), so that eval mode at step 0 normalises as training
        mode will: BN standardises each dimension, so the BN head's output is whitened PCA
        either way.  Each direction's sign makes its largest-magnitude entry positive
        (deterministic).  Returns ``{"mean", "components", "variances"}`` (float64).
        """
        n, c = features.shape if features.dim() == 2 else (0, 0)
        if features.dim() != 2 or c != self.in_features:
            raise ValueError(f"init_from_pca: expected features [N, {self.in_features}], got "
                             f"{tuple(features.shape)}")
        k = self.embedding_dim
        if k > min(n - 1, c):
            raise ValueError(f"init_from_pca: a {k}-d embedding needs at least {k} principal directions, but "
                             f"{n} features of {c} dims give at most {max(min(n - 1, c), 0)}; use a smaller "
                             f"embedding_dim or more training images")
        if self.proj.bias is None:
            raise ValueError("init_from_pca: the projection has no bias (bias=False), so it cannot be centred")
        mean, components, variances = pca_directions(features, k)
        weight = components / variances.clamp_min(1e-12).sqrt()[:, None] if whiten else components
        self.proj.weight.copy_(weight.to(self.proj.weight.dtype))
        self.proj.bias.copy_((-(weight @ mean)).to(self.proj.bias.dtype))
        if self.bn is not None:
            self.bn.running_mean.zero_()
            self.bn.running_var.copy_(torch.ones_like(variances) if whiten else variances)
        return {"mean": mean, "components": components, "variances": variances}

    def extra_repr(self) -> str:
        return f"norm={self.norm!r}, bn_divide_sqrt_k={self.bn_divide_sqrt_k}"


def pca_directions(features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean [C], components [k, C], variances [k])`` of the rows of ``features`` [N, C]:
    the top-k right singular vectors of the centred matrix (float64 SVD), variances
    S^2 / (N - 1), each component's largest-magnitude entry made positive."""
    x = features.detach().to(torch.float64)
    mean = x.mean(0)
    _, s, vh = torch.linalg.svd(x - mean, full_matrices=False)
    components = vh[:k]
    signs = torch.sign(components.gather(1, components.abs().argmax(1, keepdim=True)))
    components = components * torch.where(signs == 0, torch.ones_like(signs), signs)
    return mean, components, s[:k] ** 2 / max(x.shape[0] - 1, 1)


class ProjectionHead(nn.Module):
    """SimCLR's projection head g (Chen et al., ICML 2020, Sec. 2.1): [B, k] -> [B, dim].

    ``hidden=None``: a linear map then the normalisation; ``hidden=h``: z = W2 ReLU(W1 e)
    (the paper's one-hidden-layer MLP), then the normalisation.  The normalisation is an
    :class:`EmbeddingHead`'s (``"none"``, ``"l2"``, or the BN head's BN^ / sqrt(dim)), so a
    heated softmax reads a projection as it reads an embedding.  The loss terms that read the
    projection (``loss.N.input: projection``) train the network through it, while the
    embedding before it is what retrieval indexes: SimCLR found the representation before
    the projection head transfers better than its output.
    """

    def __init__(self, in_features: int, dim: int, norm: str = "l2", hidden: int | None = None,
                 bn_momentum: float = BN_MOMENTUM, bn_eps: float = BN_EPS, bn_divide_sqrt_k: bool = True):
        super().__init__()
        if hidden is not None and (not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1):
            raise ValueError(f"projection hidden must be a positive int or None, got {hidden!r}")
        self.in_features, self.dim, self.hidden = in_features, dim, hidden
        self.mlp = (nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(inplace=True))
                    if hidden is not None else nn.Identity())
        self.out = EmbeddingHead(hidden or in_features, dim, norm=norm, bn_momentum=bn_momentum, bn_eps=bn_eps,
                                 bn_divide_sqrt_k=bn_divide_sqrt_k)

    @property
    def norm(self) -> str:
        return self.out.norm

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(e))

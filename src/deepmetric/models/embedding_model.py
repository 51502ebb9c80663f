"""Backbone + global pooling + :class:`EmbeddingHead` (heated-up softmax, ALMN, baselines).

Heated-up softmax embedding (Zhang et al., 2018), Sec. 5.1: GoogLeNet, global average pool,
a linear layer to k = 64 dims, then the feature normalisation (none / l2 / bn, Eq. 13).
ALMN (Sec. 4.2): GoogLeNet, 512-d embedding, dropout 0.2, no normalisation layer.
"""
from __future__ import annotations

import torch
from torch import nn

from .heads import HEAD_INITS, EmbeddingHead, ProjectionHead
from deepmetric.options import int_option

__all__ = ["EmbeddingModel", "global_pool", "pool_features", "TOKEN_POOLS", "pooling_note", "POOLS", "GEM_P", "FREEZE_BN", "batchnorm_layers", "check_freeze_bn",
           "freeze_batchnorm_parameters", "build_projection"]

POOLS = ("avg", "max", "gem")
#: poolings of a token backbone (timm ViTs): the class token, or avg / max / GeM over the patch tokens
TOKEN_POOLS = ("cls",) + POOLS
#: GeM's exponent (Radenović et al., TPAMI 2019, "Fine-tuning CNN Image Retrieval with No Human
#: Annotation", Eq. 3): 3 is the paper's starting value and its usual fixed choice; p = 1 is the
#: average, p -> infinity the maximum.
GEM_P = 3.0
_GEM_EPS = 1e-6
#: ``freeze_bn`` values: False (BN layers train as usual), ``"stats"`` (True means the same: the
#: backbone's BN layers stay in eval mode, running statistics frozen, affine weight and bias
#: still trained) and ``"all"`` (statistics and affine parameters frozen).
FREEZE_BN = (False, True, "stats", "all")
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def check_freeze_bn(value) -> str | None:
    """None (off), ``"stats"`` or ``"all"`` from a ``freeze_bn`` option."""
    if value is False or value is None:
        return None
    if value is True or value == "stats":
        return "stats"
    if value == "all":
        return "all"
    raise ValueError(f"freeze_bn must be false, true (= 'stats': running statistics frozen) or 'all' "
                     f"(statistics and affine parameters frozen), got {value!r}")


def batchnorm_layers(module: nn.Module) -> list[nn.Module]:
    """The batch-norm layers inside ``module`` (timm's BatchNormAct2d is a BatchNorm2d)."""
    return [m for m in module.modules() if isinstance(m, _BATCHNORMS)]


def freeze_batchnorm_parameters(module: nn.Module) -> None:
    """``freeze_bn: all``: the affine weight and bias of every BN layer in ``module`` stop
    training (``requires_grad=False``: the optimiser skips them)."""
    for bn in batchnorm_layers(module):
        for p in bn.parameters(recurse=False):
            p.requires_grad_(False)


def build_projection(in_features: int, projection, **bn_options) -> ProjectionHead | None:
    """The ``projection`` option: None, or ``{"dim": int, "norm": "none"|"l2"|"bn" (default
    "l2"), "hidden": int (optional), "bn_divide_sqrt_k": bool (optional)}`` ->
    :class:`ProjectionHead`.

    ``bn_divide_sqrt_k`` (default: the embedding head's, True) applies to ``norm: bn``: False
    keeps BN^'s unit variance per dimension, so the projection is about sqrt(dim) long instead
    of about 1.  ALMN, whose logits are plain inner products without a temperature, needs that
    length (its paper feeds it raw, long GoogLeNet embeddings); N-pair, the other such loss,
    diverged on it in the emoji checks and trains on ``l2`` (bench/studies/README.md)."""
    if projection is None:
        return None
    if not isinstance(projection, dict):
        raise ValueError(f"projection must be a mapping {{dim, norm, hidden, bn_divide_sqrt_k}}, got {projection!r}")
    unknown = sorted(set(projection) - {"dim", "norm", "hidden", "bn_divide_sqrt_k"})
    if unknown:
        raise ValueError(f"projection: unknown key(s) {unknown}; expected dim, norm, hidden, bn_divide_sqrt_k")
    dim = projection.get("dim")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"projection needs 'dim', a positive int, got {dim!r}")
    norm = projection.get("norm", "l2")
    if "bn_divide_sqrt_k" in projection:
        divide = projection["bn_divide_sqrt_k"]
        if not isinstance(divide, bool):
            raise ValueError(f"projection: 'bn_divide_sqrt_k' must be true or false, got {divide!r}")
        if norm != "bn":
            raise ValueError(f"projection: 'bn_divide_sqrt_k' applies to norm 'bn' only, got norm {norm!r}")
        bn_options = {**bn_options, "bn_divide_sqrt_k": divide}
    return ProjectionHead(in_features, dim, norm=norm, hidden=projection.get("hidden"), **bn_options)


def global_pool(fmap: torch.Tensor, pool: str) -> torch.Tensor:
    """[B, C, H, W] -> [B, C] by global average, max or generalised-mean (GeM) pooling.

    ``"gem"``: f_c = (mean_{h,w} max(x_chw, eps)^p)^(1/p) with p = :data:`GEM_P` (Radenović et
    al., Eq. 3), computed in float32 (x^3 of a half-precision map loses digits).  The clamp
    keeps the root real for maps that are not post-ReLU; the networks here end in a ReLU /
    ReLU6, so it changes nothing but exact zeros."""
    if pool == "avg":
        return fmap.mean(dim=(2, 3))
    if pool == "max":
        return fmap.amax(dim=(2, 3))
    if pool == "gem":
        return fmap.float().clamp_min(_GEM_EPS).pow(GEM_P).mean(dim=(2, 3)).pow(1.0 / GEM_P)
    raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")


def pool_features(x: torch.Tensor, pool: str, num_prefix_tokens: int = 0) -> torch.Tensor:
    """Pooled features [B, C] of a conv map [B, C, H, W] (:func:`global_pool`) or of tokens
    [B, N, C] whose first ``num_prefix_tokens`` are class / register tokens (a timm ViT's
    ``forward_features``, final norm applied): ``"cls"`` the first (class) token, as DINO and
    Hyp-ViT embed; ``"avg"`` / ``"max"`` / ``"gem"`` over the patch tokens only.  GeM clamps at
    eps as for maps: token features are signed, so GeM keeps only their positive part."""
    if x.dim() == 4:
        if pool == "cls":
            raise ValueError("pool 'cls' needs a token backbone (a timm ViT); this backbone gives a conv map")
        return global_pool(x, pool)
    if x.dim() != 3:
        raise ValueError(f"features must be a map [B, C, H, W] or tokens [B, N, C], got shape {tuple(x.shape)}")
    if pool == "cls":
        if num_prefix_tokens < 1:
            raise ValueError("pool 'cls': this token backbone has no class token; use avg, max or gem")
        return x[:, 0]
    patches = x[:, num_prefix_tokens:]
    if pool == "avg":
        return patches.mean(dim=1)
    if pool == "max":
        return patches.amax(dim=1)
    if pool == "gem":
        return patches.float().clamp_min(_GEM_EPS).pow(GEM_P).mean(dim=1).pow(1.0 / GEM_P)
    raise ValueError(f"pool must be one of {TOKEN_POOLS}, got {pool!r}")


def pooling_note(pool: str) -> str:
    """``", <pool> pooling"`` for a pooling other than the average (every paper's), else ``""``:
    what run banners and baseline labels append, so that a non-average pooling is never silent."""
    return "" if pool == "avg" else f", {pool} pooling"


class EmbeddingModel(nn.Module):
    """forward(x) -> {"embedding": [B, k], "features": [B, C]} (+ "logits" with num_classes,
    + "projection" with a projection head).

    timm's model contract, which ``forward`` is written in:

    * ``forward_features(x)`` -> the backbone's conv map [B, C, H, W] (before pooling);
    * ``forward_head(fmap)`` -> global pool -> :class:`EmbeddingHead` -> ``"embedding"`` [B, k];
    * ``forward_head(fmap, pre_logits=True)`` -> the pooled features ``"features"`` [B, C]
      (``num_features`` = C).

    Args:
        backbone: module returning a conv map [B, C, H, W], with ``num_features`` = C.
        embedding_dim, norm, dropout, **head_options: see :class:`EmbeddingHead`.
        num_classes: if given, a plain linear classifier on the embedding adds ``"logits"``
            (softmax baseline trained with plain cross-entropy on the model's own logits).
            The heated-up / NormFace classifier with its temperature lives in the loss instead.
        pool: ``"avg"`` (all three papers), ``"max"`` or ``"gem"`` (generalised mean, p = 3:
            :func:`global_pool`); token backbones also ``"cls"`` (:func:`pool_features`).
        projection: None, or ``{dim, norm, hidden, bn_divide_sqrt_k}``: a SimCLR projection head on the embedding
            adds ``"projection"`` to ``forward``'s dict (what ``loss.N.input: projection``
            reads); ``forward_head`` still gives the embedding (index, search and export read
            the projection instead when the run's ``eval.embedding`` is ``projection``:
            ``deepmetric.run.embed.load_search_network``).
        freeze_bn: False, True / ``"stats"`` (the backbone's batch norms stay in eval mode:
            running statistics frozen, affine parameters trained) or ``"all"`` (affine
            parameters frozen too).  The embedding head's BN is not the backbone's and trains.
        head_init: None, ``"pca"`` or ``"pca_whiten"``: recorded for the trainer, which sets
            the projection from the PCA of the training images' pooled features before the
            first step (:meth:`EmbeddingHead.init_from_pca`); the model itself starts random.
    """

    def __init__(
        self,
        backbone: nn.Module,
        embedding_dim: int = 64,
        norm: str = "bn",
        dropout: float = 0.0,
        num_classes: int | None = None,
        pool: str = "avg",
        projection: dict | None = None,
        freeze_bn=False,
        head_init: str | None = None,
        **head_options,
    ):
        super().__init__()
        tokens = getattr(backbone, "output", "map") == "tokens"
        if pool not in (TOKEN_POOLS if tokens else POOLS):
            raise ValueError(f"pool must be one of {TOKEN_POOLS if tokens else POOLS}"
                             f"{'' if tokens else ' (cls: token backbones only)'}, got {pool!r}")
        self.num_prefix_tokens = int(getattr(backbone, "num_prefix_tokens", 0) or 0)
        if pool == "cls" and self.num_prefix_tokens < 1:
            raise ValueError("pool 'cls': this token backbone has no class token; use avg, max or gem")
        # checked, not int()-converted: 2.5, True or "8" would silently become 2, 1 or 8
        embedding_dim = int_option("embedding_dim", embedding_dim, minimum=0,
                                   expected="a positive int (or 0: no linear layer)")
        if head_init is not None and head_init not in HEAD_INITS:
            raise ValueError(f"head_init must be None or one of {HEAD_INITS}, got {head_init!r}")
        if head_init is not None and embedding_dim == 0:
            raise ValueError("head_init initialises the head's linear layer; embedding_dim 0 has none")
        if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 2):
            raise ValueError(f"num_classes must be None or an int >= 2, got {num_classes!r}")
        self.backbone = backbone
        self.pool = pool
        self.num_features = int(backbone.num_features)
        self.head = EmbeddingHead(self.num_features, embedding_dim, norm=norm, dropout=dropout, **head_options)
        self.embedding_dim = self.head.embedding_dim  # embedding_dim 0: the pooled features' size
        self.classifier = nn.Linear(self.embedding_dim, num_classes) if num_classes is not None else None
        self.num_classes = num_classes
        bn_options = {k: head_options[k] for k in ("bn_momentum", "bn_eps", "bn_divide_sqrt_k") if k in head_options}
        # registered only when asked for: models without it keep their state-dict keys
        self.projection = build_projection(self.embedding_dim, projection, **bn_options)
        self.projection_dim = None if self.projection is None else self.projection.dim
        self.freeze_bn = check_freeze_bn(freeze_bn)
        if self.freeze_bn == "all":
            freeze_batchnorm_parameters(self.backbone)
        self.head_init = head_init

    def train(self, mode: bool = True):
        super().train(mode)
        if self.freeze_bn is not None:  # the backbone's BN layers use (and keep) their running statistics
            for bn in batchnorm_layers(self.backbone):
                bn.eval()
        return self

    @property
    def norm(self) -> str:
        return self.head.norm

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's last conv map [B, num_features, H, W] (tokens [B, N, num_features]
        for a token backbone)."""
        return self.backbone(x)

    def forward_head(self, fmap: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Embedding [B, k] of a conv map; ``pre_logits=True``: the pooled features [B, C]."""
        features = pool_features(fmap, self.pool, self.num_prefix_tokens)
        return features if pre_logits else self.head(features)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.forward_head(self.forward_features(x), pre_logits=True)
        # self.head(features) is forward_head(fmap) without pooling the map a second time
        out = {"embedding": self.head(features), "features": features}
        if self.classifier is not None:
            out["logits"] = self.classifier(out["embedding"])
        if self.projection is not None:
            out["projection"] = self.projection(out["embedding"])
        return out

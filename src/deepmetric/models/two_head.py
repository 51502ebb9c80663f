"""Two-head network (Taha et al., "Boosting standard classification architectures through a
ranking regularizer", Sec. 3, Fig. 6, Eq. 8-9).

Given the last convolutional map h of a standard network and x = pool(h):

* Eq. 8: Logits    = W_logits * flatten(x)  -- the usual classification head, re-initialised
  for the new number of classes;
* Eq. 9: Embedding = W_emb * flatten(h)     -- a second FC on the *un-pooled* map (pooling
  would discard the spatial layout), Xavier-initialised with zero bias, to 256 dims, then
  l2-normalised ("normalized to the unit-circle"; distances are squared Euclidean).

One forward gives both, so at inference a single pass classifies and embeds.
"""
from __future__ import annotations

import numbers

import torch
from torch import nn
from torch.func import functional_call

from .embedding_model import POOLS, batchnorm_layers, check_freeze_bn, freeze_batchnorm_parameters, global_pool
from .heads import EmbeddingHead
from deepmetric.options import bool_option, float_option, int_option

__all__ = ["TwoHeadModel", "feature_map_shape"]


def feature_map_shape(backbone: nn.Module, input_size: int | tuple[int, int], in_chans: int = 3) -> tuple[int, int, int]:
    """(C, H, W) of ``backbone``'s output for one ``in_chans x input_size`` image.

    Computed by a dry run on the ``meta`` device: shapes propagate but no arithmetic is done
    and the real parameters / running statistics are untouched.
    """
    if isinstance(input_size, numbers.Integral) and not isinstance(input_size, bool):
        input_size = (input_size, input_size)
    if not isinstance(input_size, (list, tuple)) or len(input_size) != 2:
        raise ValueError(f"input_size must be a positive int or [H, W], got {input_size!r}")
    h, w = (int_option("input_size", v) for v in input_size)
    tensors = {n: t.to("meta") for n, t in backbone.named_parameters()}
    tensors.update({n: t.to("meta") for n, t in backbone.named_buffers()})
    # Batch of 2 in eval mode: BN layers would refuse a 1x1 map with batch 1 in training mode.
    x = torch.empty(2, in_chans, h, w, device="meta")
    was_training = backbone.training
    backbone.eval()
    with torch.no_grad():
        try:
            out = functional_call(backbone, tensors, (x,))
        except (RuntimeError, ValueError) as exc:
            raise ValueError(
                f"backbone cannot process {in_chans}x{h}x{w} inputs (input_size too small?): {exc}"
            ) from exc
        finally:
            backbone.train(was_training)
    if out.dim() != 4:
        raise ValueError(f"backbone must return [B, C, H, W], got shape {tuple(out.shape)}")
    return tuple(int(s) for s in out.shape[1:])  # type: ignore[return-value]


class TwoHeadModel(nn.Module):
    """Backbone with a classification head and an embedding head (two-head paper, Eq. 8-9).

    forward(x) -> {"logits": [B, num_classes], "embedding": [B, k], "features": [B, C]}.

    timm's model contract, mapped onto the two heads (``forward`` is written in it):

    * ``forward_features(x)`` -> the last conv map h [B, C, H, W], checked against
      ``feature_shape``;
    * ``forward_head(h)`` -> the embedding: ``W_emb * flatten(h)`` then the normalisation
      (Eq. 9); for the single-head baseline (``embedding_head=False``) the pooled features;
    * ``forward_head(h, pre_logits=True)`` -> the pooled features x = pool(h) [B, C], what the
      classifier reads (Eq. 8) and ``"features"`` holds (``num_features`` = C).

    ``forward_head`` gives what retrieval, search and export use, so the embedding; the logits
    (``classifier(dropout(x))``) exist only in ``forward``'s dict.

    Args:
        backbone: module returning [B, C, H, W] with ``num_features`` = C.
        num_classes: number of classes of the new classifier.
        embedding_dim: k (paper: 256).
        input_size: training / inference image size (int or (H, W)); it fixes the size of the
            flattened map C*H*W, hence of W_emb.  Inputs of another size raise ``ValueError``.
        in_chans: input channels (for the dry run that measures the map).
        norm: embedding normalisation, ``"l2"`` per the paper (``"none"`` / ``"bn"`` allowed).
        dropout: dropout before each head's FC (0 in the paper).
        pool: pooling for the classification head (``"avg"`` as in all three backbones).
        feature_shape: (C, H, W) of the map, to skip the dry run.
        embedding_head: False builds the paper's single-head "Softmax" baseline: no embedding
            head (no untrained W_emb is trained or evaluated); ``"embedding"`` is then the
            pooled pre-logit features ``x`` (C dims), the representation softmax trains, and
            ``embedding_dim`` / ``norm`` / head options are ignored.
        freeze_bn: as :class:`~deepmetric.models.embedding_model.EmbeddingModel`'s: False,
            True / ``"stats"`` or ``"all"`` (the backbone's batch norms only).
    """

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int,
        embedding_dim: int = 256,
        input_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        norm: str = "l2",
        dropout: float = 0.0,
        pool: str = "avg",
        feature_shape: tuple[int, int, int] | None = None,
        embedding_head: bool = True,
        freeze_bn=False,
        **head_options,
    ):
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"two_head needs num_classes (an int >= 2), got {num_classes!r}")
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        self.backbone = backbone
        self.pool = pool
        self.num_classes = num_classes
        embedding_dim = int_option("embedding_dim", embedding_dim, minimum=0,
                                   expected="a positive int (or 0: no linear layer)")
        embedding_head = bool_option("embedding_head", embedding_head)
        self.num_features = int(backbone.num_features)
        if feature_shape is None:
            feature_shape = feature_map_shape(backbone, input_size, in_chans)
        self.feature_shape = tuple(int(s) for s in feature_shape)
        if len(self.feature_shape) != 3 or self.feature_shape[0] != self.num_features:
            raise ValueError(
                f"feature_shape must be (C, H, W) with C = backbone.num_features = {self.num_features}, "
                f"got {self.feature_shape}"
            )
        c, h, w = self.feature_shape
        self.input_size = input_size
        # Eq. 8: new classifier on the pooled features (PyTorch's default Linear init).
        dropout = float_option("dropout", dropout, 0.0, 1.0)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.classifier = nn.Linear(c, num_classes)
        # Eq. 9: FC on flatten(h) -> k, Xavier-uniform weight and zero bias, then l2.
        self.embedding_head: EmbeddingHead | None = None
        if embedding_head:
            self.embedding_head = EmbeddingHead(
                c * h * w, embedding_dim, norm=norm, dropout=dropout, init="xavier", **head_options
            )
            # the head's size: embedding_dim 0 (no linear layer) embeds the flattened map, C*H*W
            self.embedding_dim = self.embedding_head.embedding_dim
        else:  # single-head softmax baseline: the pooled features are the embedding
            self.embedding_dim = c
        self.freeze_bn = check_freeze_bn(freeze_bn)
        if self.freeze_bn == "all":
            freeze_batchnorm_parameters(self.backbone)
        # the model contract's parts this model has none of (models/contract.py): its embedding
        # head reads the flattened map, not the pooled features, so it is no ``head``
        self.head = self.projection = self.projection_dim = self.head_init = None

    def train(self, mode: bool = True):
        super().train(mode)
        if self.freeze_bn is not None:  # the backbone's BN layers keep their running statistics
            for bn in batchnorm_layers(self.backbone):
                bn.eval()
        return self

    @property
    def norm(self) -> str:
        return "none" if self.embedding_head is None else self.embedding_head.norm

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's last conv map h [B, C, H, W] (= ``feature_shape`` per sample)."""
        fmap = self.backbone(x)
        if tuple(fmap.shape[1:]) != self.feature_shape:
            raise ValueError(
                f"two_head model was built for a {self.feature_shape} feature map "
                f"(input_size={self.input_size}); input {tuple(x.shape)} gave {tuple(fmap.shape[1:])}. "
                "Resize / crop inputs to the input_size the model was created with."
            )
        return fmap

    def forward_head(self, fmap: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Embedding of a conv map h (Eq. 9); ``pre_logits=True``: the pooled features pool(h)."""
        if pre_logits or self.embedding_head is None:
            return global_pool(fmap, self.pool)
        # flatten() follows the logical C, H, W order, also for channels_last maps.
        return self.embedding_head(fmap.flatten(1))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        fmap = self.forward_features(x)
        features = self.forward_head(fmap, pre_logits=True)
        # The classifier's dropout draws its mask before the embedding head's (the order of
        # the original single expression), so training runs keep their random stream.
        logits = self.classifier(self.dropout(features))
        embedding = features if self.embedding_head is None else self.forward_head(fmap)
        return {"logits": logits, "embedding": embedding, "features": features}

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted class [B], embedding [B, k]) from one forward in eval mode.

        The module's train/eval mode is restored afterwards.
        """
        was_training = self.training
        self.eval()
        try:
            out = self.forward(x)
        finally:
            self.train(was_training)
        return out["logits"].argmax(dim=1), out["embedding"]

"""A pytorch-metric-learning loss as a deepmetric loss term (baselines for studies).

``{name: pml, options: {loss: ProxyAnchorLoss}}`` builds
``pytorch_metric_learning.losses.ProxyAnchorLoss`` with its documented defaults; further
options are passed to its constructor (``{loss: MultiSimilarityLoss, alpha: 2, beta: 50}``).
``num_classes`` and ``embedding_dim`` are filled in by the training loop and passed on as
PML's ``num_classes`` / ``embedding_size`` to the losses that take them (the proxy and
classifier losses: NormalizedSoftmaxLoss, ProxyAnchorLoss, ProxyNCALoss, SoftTripleLoss,
ArcFaceLoss, ...).  The PML loss is a sub-module, so its parameters (proxies, class
weights) are in this module's ``parameters()`` and ``state_dict()``: the optimiser trains
them with the loss learning rate (``optim.loss_lr_mult``) and checkpoints keep them.

pytorch-metric-learning is an optional dependency (``pip install deepmetric[bench]`` or
``[dev]``, pinned to 2.9.0); only this loss needs it.
"""
from __future__ import annotations

import difflib
import inspect

import torch
from torch import nn

from .distances import check_embeddings_labels
from .registry import register_loss

__all__ = ["PMLLoss", "pml_loss_names"]


def _pml_losses():
    try:
        from pytorch_metric_learning import losses
    except ImportError as exc:  # pragma: no cover - the dev/bench extras install it
        raise ImportError(
            "loss 'pml' needs pytorch-metric-learning, an optional dependency: "
            "pip install 'pytorch-metric-learning==2.9.0' (or deepmetric[bench])") from exc
    return losses


def pml_loss_names() -> list[str]:
    """The loss classes of ``pytorch_metric_learning.losses``."""
    losses = _pml_losses()
    base = losses.BaseMetricLossFunction
    return sorted(n for n in dir(losses)
                  if isinstance(getattr(losses, n), type) and issubclass(getattr(losses, n), base)
                  and n != "BaseMetricLossFunction")


@register_loss("pml")
class PMLLoss(nn.Module):
    """``pytorch_metric_learning.losses.<loss>(**options)`` called as ``loss(embeddings, labels)``.

    Args:
        loss: the PML class name, e.g. ``"NormalizedSoftmaxLoss"``, ``"ProxyAnchorLoss"``,
            ``"MultiSimilarityLoss"``.
        num_classes, embedding_dim: passed as ``num_classes`` / ``embedding_size`` when the
            PML class takes them (required then).
        **options: other constructor arguments (plain values; distances/reducers keep their
            PML defaults).
    """

    def __init__(self, loss: str, num_classes: int | None = None, embedding_dim: int | None = None, **options):
        super().__init__()
        losses = _pml_losses()
        names = pml_loss_names()
        if loss not in names:
            close = difflib.get_close_matches(str(loss), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; available: {', '.join(names)}"
            raise ValueError(f"pml: unknown pytorch-metric-learning loss {loss!r}{hint}")
        cls = getattr(losses, loss)
        params = inspect.signature(cls.__init__).parameters
        kwargs = dict(options)
        for ours, theirs, value in (("num_classes", "num_classes", num_classes),
                                    ("embedding_dim", "embedding_size", embedding_dim)):
            if theirs in params and theirs not in kwargs:
                if value is None:
                    raise ValueError(f"pml: {loss} needs {ours} (set loss options.{theirs} or let the "
                                     f"training loop fill it in)")
                kwargs[theirs] = int(value)
        try:
            self.loss = cls(**kwargs)
        except TypeError as exc:
            raise TypeError(f"pml: bad options {sorted(options)} for {loss}: {exc}") from None
        self.name = loss

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_embeddings_labels(embeddings, labels)
        return self.loss(embeddings, labels)

    def extra_repr(self) -> str:
        return self.name

"""A pytorch-metric-learning loss as a deepmetric loss term (baselines for studies).

``{name: pml, options: {loss: ProxyAnchorLoss}}`` builds
``pytorch_metric_learning.losses.ProxyAnchorLoss`` with its documented defaults; further
options are passed to its constructor (``{loss: MultiSimilarityLoss, alpha: 2, beta: 50}``).
``num_classes`` and ``embedding_dim`` are filled in by the training loop and passed on as
PML's ``num_classes`` / ``embedding_size`` to the losses that take them (the proxy and
classifier losses: NormalizedSoftmaxLoss, ProxyAnchorLoss, ProxyNCALoss, SoftTripleLoss,
ArcFaceLoss, CosFaceLoss, SubCenterArcFaceLoss, P2SGradLoss, ...), including through the
``**kwargs`` these classes hand on to their base classes.  The PML loss is a sub-module, so its parameters (proxies, class
weights) are in this module's ``parameters()`` and ``state_dict()``: the optimiser trains
them with the loss learning rate (``optim.loss_lr_mult``) and checkpoints keep them.

pytorch-metric-learning is an optional dependency (``pip install deepmetric[bench]`` or
``[dev]``, pinned to 2.9.0); only this loss needs it.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from deepmetric.errors import MissingPackageError
from deepmetric.registry import did_you_mean

from .distances import check_embeddings_labels
from .registry import register_loss

__all__ = ["PMLLoss", "constructor_parameters", "pml_loss_names"]


def _pml_losses():
    try:
        from pytorch_metric_learning import losses
    except ImportError as exc:  # pragma: no cover - the dev/bench extras install it
        raise MissingPackageError(
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


#: our size arguments -> the constructor parameters PML uses for them
_SIZE_NAMES = {"num_classes": ("num_classes",),
               "embedding_dim": ("embedding_size", "descriptors_dim")}   # P2SGradLoss: descriptors_dim


def constructor_parameters(cls: type) -> set[str]:
    """The named constructor parameters of ``cls``, collected over its MRO.

    PML losses are cooperative: an ``__init__`` that takes ``**kwargs`` hands them on to the
    next ``__init__`` in the MRO (``CosFaceLoss(*args, margin, scale, **kwargs)`` reaches
    ``LargeMarginSoftmaxLoss(num_classes, embedding_size, ...)``), so its own names and
    those further along are all accepted.  The walk stops at the first ``__init__`` without
    ``**kwargs``: nothing it does not name gets past it.
    """
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):  # a builtin without a signature (object)
            break
        names.update(n for i, (n, p) in enumerate(params.items())
                     if i > 0 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return names


@register_loss("pml")
class PMLLoss(nn.Module):
    """``pytorch_metric_learning.losses.<loss>(**options)`` called as ``loss(embeddings, labels)``.

    Args:
        loss: the PML class name, e.g. ``"NormalizedSoftmaxLoss"``, ``"ProxyAnchorLoss"``,
            ``"MultiSimilarityLoss"``.
        num_classes, embedding_dim: passed as ``num_classes`` / ``embedding_size`` (P2SGradLoss:
            ``descriptors_dim``) when the PML class or a base class its ``**kwargs`` reach takes
            them (required then; :func:`constructor_parameters`).
        **options: other constructor arguments (plain values; distances/reducers keep their
            PML defaults).
    """

    def __init__(self, loss: str, num_classes: int | None = None, embedding_dim: int | None = None, **options):
        super().__init__()
        losses = _pml_losses()
        names = pml_loss_names()
        if loss not in names:
            hint = did_you_mean(loss, names) or f"; available: {', '.join(names)}"
            raise ValueError(f"pml: unknown pytorch-metric-learning loss {loss!r}{hint}")
        cls = getattr(losses, loss)
        params = constructor_parameters(cls)
        kwargs = dict(options)
        for ours, value in (("num_classes", num_classes), ("embedding_dim", embedding_dim)):
            for theirs in _SIZE_NAMES[ours]:
                if theirs in params and theirs not in kwargs:
                    if value is None:
                        raise ValueError(f"pml: {loss} needs {ours} (set loss options.{theirs} or let "
                                         f"the training loop fill it in)")
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

"""What a run is built from: dataset splits, the batch sampler, the model and the loss terms.

Shared by the training loop, ``deepmetric embed`` (rebuilding a checkpoint's model), the
demo and other commands, so every one of them builds exactly what training built.  This
module imports only the config, ``deepmetric.data``, ``deepmetric.models`` and
``deepmetric.losses``; ``loop``, ``embed`` and ``demo`` import it, never the reverse.

* ``build_dataset(cfg, split, *, train)``: one split of ``cfg.data`` with the train (augmenting)
  or test transform;
* ``build_sampler(cfg, labels, rank, world)``: random or m x n class-balanced batches,
  sharded over ranks;
* ``build_model(cfg, num_classes)``: ``create_model(cfg.model.name, **cfg.model.options)``;
* ``build_losses(cfg, num_classes, embedding_dim)``: one module per loss term;
* ``embedding_dim_of(model, dataset)`` and ``seed_everything(seed)``.
"""
from __future__ import annotations

import inspect
import random
from typing import Callable

import numpy as np
import torch
from torch import nn

from .config import Config

__all__ = ["seed_everything", "build_dataset", "build_sampler", "build_model", "build_losses",
           "embedding_dim_of"]


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _call_filling(fn: Callable, name: str, options: dict, auto: dict, target: Callable | None = None):
    """``fn(name, **options, **auto)`` where ``auto`` holds values the loop knows
    (``num_classes``, ``embedding_dim``): each is passed only when ``target`` (the class or
    function that receives the keywords) accepts it and the user did not set it."""
    extra = {k: v for k, v in auto.items() if v is not None and k not in options}
    if target is not None and extra:
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):
            params = None
        if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            extra = {k: v for k, v in extra.items() if k in params}
    return fn(name, **extra, **options)


def build_dataset(cfg: Config, split: str, *, train: bool):
    """Split ``split`` of ``cfg.data`` with the train (``train=True``) or test transform."""
    d = cfg.data
    if d.name == "synthetic":
        from deepmetric.data.synthetic import build_synthetic_dataset

        return build_synthetic_dataset(split, **d.options)
    from deepmetric.data import build_dataset as build_named_dataset
    from deepmetric.data import build_transform

    transform = None
    if d.transform is not None:
        transform = build_transform(d.transform, train=train, **d.transform_options)
    return build_named_dataset(d.name, root=d.root, split=split, transform=transform, **d.options)


def build_sampler(cfg: Config, labels: np.ndarray, rank: int = 0, world: int = 1):
    """``train.sampler``: ``class_balanced`` (m classes x n images) or ``random`` batches of
    ``batch_size`` (last incomplete batch dropped), this rank's shard of each epoch."""
    from deepmetric.data import ClassBalancedBatchSampler, RandomBatchSampler

    t = cfg.train
    if t.sampler == "class_balanced":
        return ClassBalancedBatchSampler(labels, t.m, t.n, seed=t.seed, rank=rank, world_size=world)
    return RandomBatchSampler(len(labels), t.batch_size, seed=t.seed, rank=rank, world_size=world,
                              drop_last=True)


def build_model(cfg: Config, num_classes: int | None = None) -> nn.Module:
    """``create_model(cfg.model.name, **cfg.model.options)``.  ``num_classes`` is passed only
    when the model needs a classifier: the two-head model, or a loss term reading ``logits``."""
    m = cfg.model
    needs_classifier = m.name == "two_head" or any(t.input == "logits" for t in cfg.loss)
    if not needs_classifier:
        num_classes = None
    if m.name == "synthetic_mlp":
        from deepmetric.data.synthetic import SyntheticMLP

        def factory(name, **kw):
            return SyntheticMLP(**kw)
        target = SyntheticMLP
    else:  # create_model accepts num_classes for every model: nothing to filter
        from deepmetric.models import create_model as factory

        target = None
    return _call_filling(factory, m.name, dict(m.options), {"num_classes": num_classes}, target)


def build_losses(cfg: Config, num_classes: int | None = None, embedding_dim: int | None = None) -> nn.ModuleList:
    """One loss module per ``cfg.loss`` term; ``num_classes`` / ``embedding_dim`` are passed
    to the losses that accept them (classifier losses) unless the options set them."""
    from deepmetric.losses import build_loss, loss_class

    terms = []
    for i, term in enumerate(cfg.loss):
        try:
            cls = loss_class(term.name)
        except ValueError as exc:
            raise ValueError(f"config key 'loss.{i}.name': {exc}") from None
        terms.append(_call_filling(build_loss, term.name, dict(term.options),
                                   {"num_classes": num_classes, "embedding_dim": embedding_dim}, cls))
    return nn.ModuleList(terms)


def embedding_dim_of(model: nn.Module, dataset) -> int:
    """The model's embedding size: ``model.embedding_dim`` or one probe forward pass."""
    k = getattr(model, "embedding_dim", None)
    if isinstance(k, int):
        return k
    x = torch.stack([torch.as_tensor(dataset[i][0]) for i in range(min(2, len(dataset)))])
    was = model.training
    model.eval()
    with torch.no_grad():
        k = int(model(x)["embedding"].shape[1])
    model.train(was)
    return k

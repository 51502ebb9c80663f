"""The dataset contract: what the rest of deepmetric reads from a dataset.

:class:`MetricDataset` writes it down as a ``typing.Protocol``; :class:`MetricDatasetBase` is the
base class of every dataset of :mod:`deepmetric.data`, holding the defaults of its optional part
(``None``: "this dataset has none"), so the training loop, the evaluation, the index and the
report read each attribute plainly.  A dataset from elsewhere (a builder registered by a user,
torch's ``TensorDataset``) gets the defaults it lacks from :func:`with_dataset_defaults` where it
enters a run (``deepmetric.run.builders``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from torch.utils.data import Dataset

__all__ = ["MetricDataset", "MetricDatasetBase", "DATASET_DEFAULTS", "with_dataset_defaults", "batch_transform_of"]


@runtime_checkable
class MetricDataset(Protocol):
    """A dataset as deepmetric reads it: ``ds[i] -> (input, label)`` and the attributes below.

    Every dataset has:

    * ``labels``: the class of every sample, int64, 0..C-1 (samplers, validation classes,
      evaluation, summaries);
    * ``num_classes``: C (the loss terms' classifier size, the run summary, the few-classes
      warning; None only on a dataset from elsewhere that does not give it: the classes of
      ``labels`` are counted then);
    * ``transform``: what ``ds[i]`` applies to the stored image; its ``batch_transform``, when it
      has one, finishes a batch in the loader's collate (``train.batches``, ``train.checks``).

    Optional (``None`` when the dataset has none):

    * ``class_names`` (C names) and ``class_ids`` (the original id of each label, image lists):
      summaries, validation classes by name, the names an index and an embeddings file store;
    * ``paths``: one image file per sample (file-based datasets): header checks, size and colour
      warnings, the paths an index stores; ``load_image(i)`` the stored image itself, ``mode``
      the decoding mode (``"RGB"`` / ``"L"``): the baselines' raw pixels, thumbnails, warnings;
    * ``images``: the samples as one in-memory uint8 array (glyphs, emoji, Fashion-MNIST): the
      raw-pixel baseline, thumbnails, the images an index writes;
    * ``is_query`` / ``is_gallery``: boolean masks, one entry per sample, when the split is
      searched query against gallery (the glyphs' ``cross_family`` test): evaluation, embed;
    * ``domain_ids`` / ``domain_names`` (or the emoji benchmark's ``vendor_ids`` / ``vendors``):
      each sample's domain, for ``eval.cross_domain``;
    * ``families``: each sample's typeface family (glyphs), for ``data.val_query_families``.
    """

    labels: np.ndarray
    num_classes: int
    transform: Callable | None
    class_names: Sequence[str] | None
    class_ids: Sequence[Any] | None
    paths: Sequence[str] | None
    load_image: Callable[[int], Any] | None
    mode: str | None
    images: np.ndarray | None
    is_query: np.ndarray | None
    is_gallery: np.ndarray | None
    domain_ids: np.ndarray | None
    domain_names: Sequence[str] | None
    vendor_ids: np.ndarray | None
    vendors: Sequence[str] | None
    families: np.ndarray | None

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> tuple[Any, int]: ...


class MetricDatasetBase(Dataset):
    """Base class of the datasets of :mod:`deepmetric.data`: the optional attributes of
    :class:`MetricDataset` at their defaults (a subclass sets those it has)."""

    transform = None
    class_names = None
    class_ids = None
    paths = None
    load_image = None
    mode = None
    images = None
    is_query = None
    is_gallery = None
    domain_ids = None
    domain_names = None
    vendor_ids = None
    vendors = None
    families = None


#: every attribute of :class:`MetricDataset` and what a dataset that lacks it reads as: the
#: optional ones as on :class:`MetricDatasetBase`; ``labels`` / ``num_classes`` None ("not
#: given": readers refuse the dataset, or count the classes in ``labels``)
DATASET_DEFAULTS: dict[str, Any] = {name: getattr(MetricDatasetBase, name, None)
                                    for name in MetricDataset.__annotations__}


def with_dataset_defaults(dataset):
    """``dataset`` with every attribute of :class:`MetricDataset` it lacks set to its default
    (:data:`DATASET_DEFAULTS`; in place, on the instance; returns it).  The datasets of
    :mod:`deepmetric.data` have them all already; this is for datasets from elsewhere, where
    they enter a run."""
    for name, default in DATASET_DEFAULTS.items():
        if not hasattr(dataset, name):
            setattr(dataset, name, default)
    return dataset


def batch_transform_of(transform) -> Callable | None:
    """The part of a dataset's ``transform`` that finishes a whole batch in the loader's collate
    (a batched augmentation's ``batch_transform``), or None: any other transform (torchvision's,
    a function) works on one sample at a time."""
    return getattr(transform, "batch_transform", None)

"""Which images and classes each split of the emoji benchmark holds (:mod:`deepmetric.data.emoji`).

Two kinds of split:

* **zero-shot** (protocols ``zero_shot`` and ``cross_vendor``): the emoji in ``sort_order``, the
  first half are training classes, the second half test classes; every vendor's image of a class
  goes with its class (:func:`zero_shot_selection`).
* **closed-set by vendor** (protocol ``closed_set_vendor``, :func:`closed_set_selection`): every
  class is in every split and the *vendors* are split instead, as in the two-head paper's
  fine-grained classification (Taha et al., 2020) but with an unseen drawing style at test time:
  ``train`` is the images of every vendor but ``test_vendor`` (and ``val_vendor`` when one is
  given), ``val`` the ``val_vendor``'s images, ``test`` the ``test_vendor``'s images.  A class
  the held-out vendor does not draw is not in its split, and a ``val`` / ``test`` image whose
  class has no training image is left out (a classifier cannot be asked for a class it never
  saw).  Labels are the same in every split (0..C-1 in ``sort_order`` over every class), so
  the classifier trained on ``train`` is scored directly on ``val`` and ``test``.

Both return ``(classes, selected)``: the class indices (into the emoji of ``emoji.json``) that
get the labels 0..C-1, and the boolean mask of the images in the split.
"""
from __future__ import annotations

import numpy as np

__all__ = ["CLOSED_SET_PROTOCOL", "check_closed_set_vendors", "check_protocol_options", "closed_set_selection",
           "zero_shot_selection"]

CLOSED_SET_PROTOCOL = "closed_set_vendor"


def _kept_classes(class_index: np.ndarray, n_all: int, min_vendors: int) -> np.ndarray:
    """The classes drawn by at least ``min_vendors`` of the selected vendors."""
    return np.flatnonzero(np.bincount(class_index, minlength=n_all) >= min_vendors)


def zero_shot_selection(class_index: np.ndarray, n_all: int, split: str, *, min_vendors: int = 1,
                        max_classes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The zero-shot halves: ``train`` the first ``n_all // 2`` emoji, ``test`` the rest, ``all``
    every emoji; then the ``min_vendors`` filter and the first ``max_classes`` classes."""
    n_train = n_all // 2
    classes = _kept_classes(class_index, n_all, min_vendors)
    if split == "train":
        classes = classes[classes < n_train]
    elif split == "test":
        classes = classes[classes >= n_train]
    if max_classes is not None:
        classes = classes[:max_classes]
    return classes, np.isin(class_index, classes)


def check_closed_set_vendors(vendors, test_vendor, val_vendor) -> tuple[str, ...]:
    """The training vendors of a closed-set split; raises ``ValueError`` naming the option when
    ``test_vendor`` / ``val_vendor`` are not among ``vendors``, equal, or leave no training vendor."""
    vendors = list(vendors)
    if test_vendor not in vendors:
        raise ValueError(f"emoji: protocol {CLOSED_SET_PROTOCOL!r} needs option test_vendor, one of the selected "
                         f"vendors {', '.join(vendors)}; got {test_vendor!r}")
    if val_vendor is not None and (val_vendor not in vendors or val_vendor == test_vendor):
        raise ValueError(f"emoji: option val_vendor must be null or a selected vendor other than test_vendor "
                         f"{test_vendor!r} (one of {', '.join(v for v in vendors if v != test_vendor)}); "
                         f"got {val_vendor!r}")
    train = tuple(v for v in vendors if v not in (test_vendor, val_vendor))
    if not train:
        raise ValueError(f"emoji: test_vendor {test_vendor!r} and val_vendor {val_vendor!r} leave no training "
                         f"vendor among {', '.join(vendors)}")
    return train


def check_protocol_options(protocol: str, split: str, vendors, test_vendor, val_vendor) -> None:
    """``test_vendor`` / ``val_vendor`` and the ``val`` split belong to the closed-set protocol
    (checked there by :func:`check_closed_set_vendors`); the zero-shot protocols refuse them."""
    if protocol == CLOSED_SET_PROTOCOL:
        check_closed_set_vendors(vendors, test_vendor, val_vendor)
    elif test_vendor is not None or val_vendor is not None or split == "val":
        raise ValueError(f"emoji: split 'val' and the options test_vendor / val_vendor need protocol "
                         f"{CLOSED_SET_PROTOCOL!r} (got protocol {protocol!r}, split {split!r}, "
                         f"test_vendor {test_vendor!r}, val_vendor {val_vendor!r})")


def closed_set_selection(class_index: np.ndarray, vendor_index: np.ndarray, vendors, n_all: int, split: str, *,
                         test_vendor: str, val_vendor: str | None = None, min_vendors: int = 1,
                         max_classes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The closed-set vendor split (module docstring): every class (drawn by ``min_vendors``,
    the first ``max_classes``) in every split; the images of ``split``'s vendors."""
    vendors = list(vendors)
    train_vendors = check_closed_set_vendors(vendors, test_vendor, val_vendor)
    if split == "val" and val_vendor is None:
        raise ValueError("emoji: split 'val' of protocol 'closed_set_vendor' needs option val_vendor "
                         "(the vendor whose images validate)")
    classes = _kept_classes(class_index, n_all, min_vendors)
    if max_classes is not None:
        classes = classes[:max_classes]
    in_classes = np.isin(class_index, classes)
    vendor_of = np.asarray(vendors)[vendor_index]
    is_train = in_classes & np.isin(vendor_of, train_vendors)
    if split == "train":
        return classes, is_train
    if split == "all":
        return classes, in_classes
    held = {"val": val_vendor, "test": test_vendor}[split]
    trained = np.unique(class_index[is_train])  # a held-out image of a class never trained on is left out
    return classes, in_classes & (vendor_of == held) & np.isin(class_index, trained)

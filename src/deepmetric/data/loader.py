"""DataLoader set-up that keeps the CPU cores busy: worker processes, pinned memory when a GPU
exists, persistent workers, and reproducible per-worker random streams."""
from __future__ import annotations

import os
import random
import re
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .contract import batch_transform_of

__all__ = ["make_loader", "default_num_workers", "seed_worker", "worker_error_message", "BatchTransformCollate"]


def default_num_workers(cap: int = 2) -> int:
    """min(cap, usable cores): two workers saturate a laptop's decoding without starving the
    main process; pass num_workers explicitly on bigger machines."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(0, min(cap, cores))


def seed_worker(worker_id: int) -> None:
    """Seed numpy and random in a worker from torch's per-worker seed.

    DataLoader already gives each worker torch seed ``base_seed + worker_id`` (base_seed comes from
    the loader's generator); numpy and ``random`` would otherwise be copies of the parent's state
    in every forked worker, i.e. identical "random" augmentations across workers.
    """
    s = torch.initial_seed() % 2**32
    np.random.seed(s)
    random.seed(s)


class BatchTransformCollate:
    """``default_collate``, then ``batch_transform`` on the stacked images (batched
    augmentation, e.g. ``build_transform("glyph", train=True, batched=True)``)."""

    def __init__(self, batch_transform: Callable):
        self.batch_transform = batch_transform

    def __call__(self, samples):
        from torch.utils.data import default_collate

        x, *rest = default_collate(samples)
        return (self.batch_transform(x), *rest)


def make_loader(dataset: Dataset, batch_sampler=None, batch_size: int | None = None, shuffle: bool = False,
                num_workers: int | None = None, pin_memory: bool | None = None,
                persistent_workers: bool | None = None, seed: int = 0, drop_last: bool = False,
                collate_fn: Callable | None = None, prefetch_factor: int | None = None) -> DataLoader:
    """Build a DataLoader for training (with a batch sampler) or evaluation (``batch_size``).

    Args:
        dataset: any map-style dataset.
        batch_sampler: e.g. ``ClassBalancedBatchSampler`` / ``RandomBatchSampler``; excludes
            ``batch_size``, ``shuffle`` and ``drop_last``.
        batch_size: plain batching when no batch sampler is given (``shuffle`` / ``drop_last`` apply).
        num_workers: default ``min(2, cores)``; 0 loads in the main process.
        pin_memory: default ``torch.cuda.is_available()`` (page-locked memory speeds host->GPU copies).
        persistent_workers: default True when ``num_workers > 0`` (no worker restart each epoch;
            the batch sampler runs in the main process, so ``set_epoch`` still takes effect).
        seed: seeds the loader's generator, hence the per-worker torch seeds (augmentations) and
            the shuffle order of ``shuffle=True``.
        collate_fn: default ``default_collate``; when the dataset's ``transform`` has a
            ``batch_transform`` (a batched augmentation) and no ``collate_fn`` is given, each
            collated batch goes through it (:class:`BatchTransformCollate`).
    """
    if batch_sampler is not None:
        if batch_size is not None or shuffle or drop_last:
            raise ValueError("make_loader: give either batch_sampler or batch_size/shuffle/drop_last, not both")
    elif batch_size is None:
        raise ValueError("make_loader: give batch_sampler or batch_size")
    elif not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"make_loader: batch_size must be a positive int, got {batch_size!r}")
    if num_workers is None:
        num_workers = default_num_workers()
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"make_loader: num_workers must be an int >= 0, got {num_workers!r}")
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    batch_transform = batch_transform_of(getattr(dataset, "transform", None))  # any dataset: its own transform
    if collate_fn is None and batch_transform is not None:
        collate_fn = BatchTransformCollate(batch_transform)
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    kwargs = dict(num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn,
                  worker_init_fn=seed_worker if num_workers > 0 else None, generator=generator,
                  persistent_workers=bool(persistent_workers and num_workers > 0))
    if num_workers > 0 and prefetch_factor is not None:
        kwargs["prefetch_factor"] = prefetch_factor
    if batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=batch_sampler, **kwargs)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, **kwargs)


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: ")


def worker_error_message(exc: BaseException) -> str | None:
    """The message of the exception raised inside a DataLoader worker, without torch's wrapper.

    PyTorch re-raises a worker's exception in the main process with the whole worker traceback
    in the message (``Caught OSError in DataLoader worker process 0. Original Traceback ...``).
    This returns only what the worker's exception said (for example ``folder: cannot read
    image <path>: <reason>``), or None when ``exc`` did not come from a worker.
    """
    text = str(exc)
    if "in DataLoader worker process" not in text:
        return None
    lines = text.splitlines()
    heads = [i for i, l in enumerate(lines) if l.startswith(("Traceback (most recent call last)",
                                                             "Original Traceback (most recent call last)"))]
    if not heads:
        return None
    i = heads[-1] + 1
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
        i += 1  # the frames ("  File ...", source lines, carets) are indented
    body = "\n".join(lines[i:]).strip()
    m = _EXCEPTION_LINE.match(body)
    if m:
        body = body[m.end():]
    return body or None

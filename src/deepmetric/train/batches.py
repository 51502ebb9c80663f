"""Training batches whose random augmentation does not depend on where the run started.

A DataLoader worker draws augmentations from its own random stream, so after a resume in
the middle of an epoch (the sampler skips the batches already trained on) a worker would
apply to batch ``b`` the randomness that batch ``b - skipped`` got in the uninterrupted
run.  Here every sample is instead seeded from its *position*: ``(run seed, rank, epoch,
batch index in the epoch, index in the batch)`` seeds torch, NumPy and ``random`` right
before ``dataset[i]`` is loaded.  The augmentation of a batch is then the same whatever the
number of workers, whichever worker loads it, and whether the run was resumed.  In the main
process (``num_workers=0``) the global random states are restored after each sample, so
the training randomness (dropout, ...) is untouched.

Workers ignore SIGINT: Ctrl-C reaches the whole process group, and only the main process
should react (finish the step, save, stop).
"""
from __future__ import annotations

import contextlib
import random
import signal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

__all__ = ["PositionSeededDataset", "PositionSeededBatchTransform", "PositionedBatchSampler", "make_train_loader",
           "sample_seed"]


def sample_seed(run_seed: int, rank: int, epoch: int, batch: int, position: int) -> int:
    """A 64-bit seed that is a function of the sample's position only."""
    words = np.random.SeedSequence([run_seed % 2**63, rank, epoch, batch, position]).generate_state(2)
    return (int(words[0]) << 32) | int(words[1])


@contextlib.contextmanager
def _restored_rng():
    torch_state, np_state, py_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        np.random.set_state(np_state)
        random.setstate(py_state)


def _seed_all(seed: int) -> None:
    # the CPU generator only: torch.manual_seed also seeds every accelerator backend, which
    # costs ~0.2-4 ms per call (lazy-init bookkeeping with a stack trace), per sample
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


#: the "position" that seeds a whole batch's augmentation (batched transforms)
BATCH_POSITION = 2**31


def _seeded_call(seed: int, fn, *args):
    """``fn(*args)`` with the random streams seeded by ``seed``; in the main process the
    global states are restored afterwards (a worker's random state is its own)."""
    if get_worker_info() is not None:
        _seed_all(seed)
        return fn(*args)
    with _restored_rng():
        _seed_all(seed)
        return fn(*args)


class PositionSeededDataset(Dataset):
    """``dataset`` indexed by ``(epoch, batch, position, index)`` keys (from
    ``PositionedBatchSampler``): seeds the random streams from the position, then returns
    ``dataset[index]``.  With ``batch_seeds`` each sample also carries the seed of its
    batch's augmentation (``sample_seed(..., batch, BATCH_POSITION)``, below 2**63 so it
    collates into an int64 tensor) for :class:`PositionSeededBatchTransform`."""

    def __init__(self, dataset: Dataset, run_seed: int, rank: int = 0, batch_seeds: bool = False):
        self.dataset, self.run_seed, self.rank = dataset, int(run_seed), int(rank)
        self.batch_seeds = bool(batch_seeds)

    def __len__(self) -> int:
        return len(self.dataset)

    def _load(self, keys):
        out, batch_seeds = [], {}
        for epoch, batch, position, index in keys:
            _seed_all(sample_seed(self.run_seed, self.rank, epoch, batch, position))
            sample = self.dataset[index]
            if self.batch_seeds:  # one seed per batch (the keys of a fetch share it)
                if (epoch, batch) not in batch_seeds:
                    batch_seeds[epoch, batch] = sample_seed(self.run_seed, self.rank, epoch, batch,
                                                            BATCH_POSITION) % 2**63
                sample = (*sample, batch_seeds[epoch, batch])
            out.append(sample)
        return out

    def __getitem__(self, key):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys):
        """A whole batch (the DataLoader's fetcher calls this when it exists): in the main
        process the global random states are saved and restored once per batch, not per sample
        (NumPy's get/set_state alone costs ~0.15 ms)."""
        if get_worker_info() is not None:  # a worker's random state is its own
            return self._load(keys)
        with _restored_rng():
            return self._load(keys)


class PositionSeededBatchTransform:
    """Collate for a dataset whose transform has a ``batch_transform`` (batched augmentation,
    ``data.transform_options.batched``): ``default_collate``, then the batch transform under
    the batch's own seed, so a batch is augmented the same whatever the workers and resumes."""

    def __init__(self, batch_transform):
        self.batch_transform = batch_transform

    def __call__(self, samples):
        from torch.utils.data import default_collate

        x, y, seeds = default_collate(samples)
        return _seeded_call(int(seeds[0]), self.batch_transform, x), y


class PositionedBatchSampler(Sampler):
    """Wraps a batch sampler whose iteration starts at batch ``start`` of ``epoch`` (a
    resumed epoch) and yields ``(epoch, batch, position, index)`` keys."""

    def __init__(self, batch_sampler, epoch: int, start: int = 0):
        self.batch_sampler, self.epoch, self.start = batch_sampler, int(epoch), int(start)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.start, 0)

    def __iter__(self):
        for j, batch in enumerate(self.batch_sampler):
            b = self.start + j
            yield [(self.epoch, b, pos, int(i)) for pos, i in enumerate(batch)]


def _ignore_sigint(worker_id: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def make_train_loader(dataset: Dataset, batch_sampler, *, epoch: int, start: int, run_seed: int,
                      rank: int = 0, num_workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """The loader of one training epoch (or of its remainder from batch ``start``).  Its own
    generator keeps the loader from drawing its base seed from torch's global stream.  A
    batched augmentation (the dataset transform's ``batch_transform``) runs in the collate,
    in the workers when there are any."""
    from deepmetric.data import batch_transform_of

    batch_transform = batch_transform_of(dataset.transform)
    return DataLoader(PositionSeededDataset(dataset, run_seed, rank, batch_seeds=batch_transform is not None),
                      batch_sampler=PositionedBatchSampler(batch_sampler, epoch, start),
                      collate_fn=None if batch_transform is None else PositionSeededBatchTransform(batch_transform),
                      num_workers=num_workers, pin_memory=pin_memory,
                      worker_init_fn=_ignore_sigint if num_workers > 0 else None,
                      generator=torch.Generator().manual_seed(sample_seed(run_seed, rank, epoch, start, 0)))

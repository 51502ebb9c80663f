"""Batch samplers: class-balanced "m classes x n samples" batches and plain random batches.

Both are *batch samplers* (pass them as ``DataLoader(batch_sampler=...)``): iterating yields
lists of dataset indices. They are deterministic functions of ``(seed, epoch)``, shard across
distributed ranks (every rank builds the same global batch list and takes every
``world_size``-th batch, so ranks get different batches and the same number of them), and can
resume in the middle of an epoch from ``state_dict()``.

Resuming: ``state_dict(batches_done=k)`` records the epoch and the number of batches of that
epoch already *consumed* by the training loop. Pass ``batches_done`` explicitly when a
DataLoader with workers is used: the loader prefetches indices, so the sampler's own count of
yielded batches runs ahead of what was trained on. After ``load_state_dict`` the next iteration
of that epoch skips the first ``batches_done`` batches; later epochs are whole.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

__all__ = ["ClassBalancedBatchSampler", "RandomBatchSampler", "CLASS_SAMPLING"]


def _check_dist(rank, world_size):
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


class _ShardedBatchSampler(Sampler):
    """Shared epoch / rank / resume logic; subclasses implement ``_global_batches(rng)``."""

    def __init__(self, seed: int, rank: int, world_size: int):
        _check_dist(rank, world_size)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.epoch = 0
        self._skip = 0      # batches of self.epoch to skip on the next iteration (resume)
        self._yielded = 0   # batches of self.epoch yielded so far by this object

    # -- subclass hook ---------------------------------------------------------------------
    def _global_batches(self, rng: np.random.Generator) -> list[list[int]]:
        raise NotImplementedError

    def _num_global_batches(self) -> int:
        raise NotImplementedError

    # -- epoch / sharding --------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose batches the next iteration yields (call before every epoch)."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self._skip = 0
            self._yielded = 0
        self.epoch = epoch

    def batches_for_epoch(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's full batch list of an epoch (no resume offset)."""
        epoch = self.epoch if epoch is None else int(epoch)
        rng = np.random.default_rng([self.seed, epoch])
        batches = self._global_batches(rng)
        # Pad to a multiple of world_size by wrapping around (as DistributedSampler does),
        # so every rank gets the same number of batches.
        total = -(-len(batches) // self.world_size) * self.world_size
        batches = batches + batches[: total - len(batches)]
        return batches[self.rank::self.world_size]

    def __len__(self) -> int:
        return -(-self._num_global_batches() // self.world_size)

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches_for_epoch()
        start = self._skip
        self._skip = 0
        self._yielded = start
        for b in batches[start:]:
            self._yielded += 1
            yield b

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self, batches_done: int | None = None) -> dict:
        done = self._yielded if batches_done is None else int(batches_done)
        if not 0 <= done <= len(self):
            raise ValueError(f"batches_done must be in [0, {len(self)}], got {done}")
        return {"epoch": self.epoch, "batches_done": done, "seed": self.seed,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("epoch", "batches_done"):
            if key not in state:
                raise KeyError(f"sampler state_dict lacks {key!r} (got keys {sorted(state)})")
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state was saved with seed={state['seed']}, this sampler has seed={self.seed}")
        if "world_size" in state and int(state["world_size"]) != self.world_size:
            raise ValueError(f"sampler state was saved with world_size={state['world_size']}, "
                             f"this sampler has world_size={self.world_size}; batches would not line up")
        self.epoch = int(state["epoch"])
        done = int(state["batches_done"])
        if not 0 <= done <= len(self):
            raise ValueError(f"batches_done={done} outside [0, {len(self)}]")
        # A finished epoch (done == len) stays finished: its next iteration yields nothing,
        # and set_epoch(epoch + 1) starts the following one whole.
        self._skip = done
        self._yielded = done


CLASS_SAMPLING = ("uniform", "proportional")


class ClassBalancedBatchSampler(_ShardedBatchSampler):
    """Batches of exactly ``m`` distinct classes x ``n`` samples each (P x K sampling).

    Two-head paper (P x K, K = 4, batch 32; a class with fewer than K images is padded by
    repetition) and ALMN (m x n = 26 x 5, "the classes and samples are all randomly
    selected"). Both papers pick the classes of a batch uniformly at random, whatever their
    sizes; ``class_sampling`` chooses:

    ``"uniform"`` (default, the papers): every batch draws ``m`` distinct classes uniformly at
    random (each class equally likely, independently of its size). Within a class the images
    come from a per-epoch shuffled stream, so a class yields all its images before any repeats
    (n distinct images per batch when the class has >= n; a smaller class repeats its images).
    An epoch is ``ceil(num_images / (m n))`` batches (about one pass worth of images), but
    large classes are not fully covered and small ones repeat: class frequencies are uniform.

    ``"proportional"`` (full coverage): every image appears at least once per epoch, so a
    class appears in proportion to its size. One epoch:

    1. every class's indices are shuffled and cut into chunks of ``n``; the last, short chunk
       is completed with other images of the same class (drawn without replacement when the
       class is large enough, else by repeating the class's images), so every image of the
       dataset appears at least once per epoch;
    2. chunks are packed into batches of ``m`` different classes, always taking the classes
       with the most chunks left (random tie-break). This greedy order uses the fewest
       batches, ``max(ceil(total_chunks / m), max_chunks_per_class)``, and the count does not
       depend on the seed, so every epoch and every rank has the same length;
    3. a batch that runs out of classes with chunks left is filled with ``n`` random images of
       other classes (extra samples; never a class twice in a batch);
    4. the batch order is shuffled.

    Args:
        labels: integer class label per dataset index.
        m: classes per batch (needs at least ``m`` classes); n: samples per class.
        class_sampling: "uniform" (default) or "proportional" (see above).
    """

    def __init__(self, labels: Sequence[int], m: int, n: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, class_sampling: str = "uniform"):
        if class_sampling not in CLASS_SAMPLING:
            raise ValueError(f"class_sampling must be one of {CLASS_SAMPLING}, got {class_sampling!r}")
        labels = np.asarray(labels)
        if labels.ndim != 1 or len(labels) == 0:
            raise ValueError(f"labels must be a non-empty 1-d sequence, got shape {labels.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise TypeError(f"labels must be integers, got dtype {labels.dtype}")
        for name, v in (("m", m), ("n", n)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        super().__init__(seed, rank, world_size)
        classes, inverse = np.unique(labels, return_inverse=True)
        if len(classes) < m:
            raise ValueError(f"m={m} classes per batch but the labels hold only {len(classes)} classes")
        self.labels = labels
        self.class_sampling = class_sampling
        self.m, self.n = int(m), int(n)
        order = np.argsort(inverse, kind="stable")
        bounds = np.cumsum(np.bincount(inverse))[:-1]
        self._class_indices = np.split(order, bounds)  # index arrays, one per class
        self._chunks_per_class = np.array([-(-len(ix) // self.n) for ix in self._class_indices])
        if class_sampling == "uniform":
            self._n_global = max(1, -(-len(labels) // (self.m * self.n)))
        else:
            self._n_global = self._count_batches(self._chunks_per_class.copy())

    @property
    def batch_size(self) -> int:
        return self.m * self.n

    def state_dict(self, batches_done: int | None = None) -> dict:
        return {**super().state_dict(batches_done), "class_sampling": self.class_sampling}

    def load_state_dict(self, state: dict) -> None:
        mode = state.get("class_sampling", "proportional")  # states saved before the option existed
        if {"epoch", "batches_done"} <= set(state) and mode != self.class_sampling:
            raise ValueError(f"sampler state was saved with class_sampling={mode!r}, this sampler has "
                             f"class_sampling={self.class_sampling!r}; batches would not line up")
        super().load_state_dict(state)

    def _count_batches(self, left: np.ndarray) -> int:
        # Same greedy as _global_batches, on counts only: take one chunk from the m largest.
        batches = 0
        left = np.sort(left)[::-1].copy()
        total = int(left.sum())
        while total > 0:
            k = min(self.m, int((left > 0).sum()))
            left[:k] -= 1
            total -= k
            batches += 1
            left = np.sort(left)[::-1]  # re-sorting keeps the m largest in front
        return batches

    def _num_global_batches(self) -> int:
        return self._n_global

    def _global_batches(self, rng: np.random.Generator) -> list[list[int]]:
        if self.class_sampling == "uniform":
            return self._uniform_batches(rng)
        return self._proportional_batches(rng)

    def _uniform_batches(self, rng: np.random.Generator) -> list[list[int]]:
        n, m = self.n, self.m
        num_classes = len(self._class_indices)
        streams: dict[int, tuple[np.ndarray, int]] = {}  # class -> (shuffled indices, position)

        def take(c: int) -> np.ndarray:
            ix = self._class_indices[c]
            if len(ix) < n:  # a small class: all its images, repeated in turn
                return np.resize(rng.permutation(ix), n)
            perm, pos = streams.get(c) or (rng.permutation(ix), 0)
            if pos + n <= len(perm):
                streams[c] = (perm, pos + n)
                return perm[pos:pos + n]
            # the stream runs out: its last images, then a fresh shuffle that puts them last,
            # so the n images of this batch stay distinct
            rest = perm[pos:]
            fresh = rng.permutation(ix)
            used = np.isin(fresh, rest)
            fresh = np.concatenate([fresh[~used], fresh[used]])
            k = n - len(rest)
            streams[c] = (fresh, k)
            return np.concatenate([rest, fresh[:k]])

        batches = []
        for _ in range(self._n_global):
            chosen = rng.choice(num_classes, m, replace=False)
            batches.append(np.concatenate([take(int(c)) for c in chosen]).tolist())
        return batches

    def _proportional_batches(self, rng: np.random.Generator) -> list[list[int]]:
        n, m = self.n, self.m
        chunks: list[list[np.ndarray]] = []
        for ix in self._class_indices:
            perm = rng.permutation(ix)
            cls_chunks = [perm[i:i + n] for i in range(0, len(perm), n)]
            last = cls_chunks[-1]
            if len(last) < n:
                if len(perm) >= n:  # complete with distinct other images of the class
                    others = perm[: len(perm) - len(last)]
                    fill = rng.choice(others, n - len(last), replace=False)
                else:  # the class is smaller than n: repeat its images
                    fill = np.resize(perm, n - len(last)) if len(perm) else perm
                cls_chunks[-1] = np.concatenate([last, fill])
            chunks.append(cls_chunks)
        left = self._chunks_per_class.copy()
        num_classes = len(left)
        batches = []
        while left.sum() > 0:
            # m classes with the most chunks left; random tie-break by a jitter in [0, 1).
            priority = left + rng.random(num_classes)
            priority[left == 0] = -1.0
            k = min(m, int((left > 0).sum()))
            chosen = np.argpartition(-priority, k - 1)[:k] if k < num_classes else np.argsort(-priority)[:k]
            batch = []
            for c in chosen:
                left[c] -= 1
                batch.append(chunks[c][left[c]])
            if k < m:  # fill with random extra classes not already in the batch
                others = np.setdiff1d(np.arange(num_classes), chosen)
                for c in rng.choice(others, m - k, replace=False):
                    ix = self._class_indices[c]
                    # n distinct images, or all of a small class repeated in turn
                    batch.append(rng.choice(ix, n, replace=False) if len(ix) >= n
                                 else np.resize(rng.permutation(ix), n))
            batches.append(np.concatenate(batch).tolist())
        assert len(batches) == self._n_global
        order = rng.permutation(len(batches))
        return [batches[i] for i in order]


class RandomBatchSampler(_ShardedBatchSampler):
    """Plain random batches: a fresh permutation of all indices each epoch, cut into batches.

    Heated-up softmax paper: batch 32 drawn at random, no class balancing.

    Args:
        num_samples: dataset size (an int, or anything with ``len()``, e.g. the dataset).
        batch_size: indices per batch.
        drop_last: drop the final short batch (default True: every batch has ``batch_size``);
            with False, the final batch is shorter and the epoch covers every index exactly once.
    """

    def __init__(self, num_samples, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, drop_last: bool = True):
        if not isinstance(num_samples, (int, np.integer)):
            num_samples = len(num_samples)
        if num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if drop_last and batch_size > num_samples:
            raise ValueError(f"batch_size={batch_size} > num_samples={num_samples} with drop_last=True "
                             f"gives no batch at all (in a YAML config: train.batch_size of at most {num_samples}, "
                             "the training images)")
        super().__init__(seed, rank, world_size)
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)

    def _num_global_batches(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def _global_batches(self, rng: np.random.Generator) -> list[list[int]]:
        perm = rng.permutation(self.num_samples)
        b = self.batch_size
        return [perm[i:i + b].tolist() for i in range(0, self._num_global_batches() * b, b)]

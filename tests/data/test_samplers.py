"""Batch samplers (m classes x n samples, plain random) and make_loader.

References are written plainly here: counting with collections.Counter, set unions for
coverage, and the closed form max(ceil(total_chunks / m), max_chunks_per_class) for the number
of class-balanced batches.
"""
import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from deepmetric.data.loader import make_loader
from deepmetric.data.samplers import ClassBalancedBatchSampler, RandomBatchSampler


def _label_sets(rng):
    """Balanced, imbalanced, with classes smaller than n, and single-image classes."""
    yield np.repeat(np.arange(12), 10)
    yield np.repeat(np.arange(20), rng.integers(1, 15, 20))
    yield rng.permutation(np.repeat(np.arange(9), [1, 1, 2, 3, 4, 7, 30, 5, 2]))
    # labels need not be 0..C-1
    yield np.repeat(np.array([5, 17, 3, 40, 41, 99]), [4, 9, 1, 6, 3, 2])


def _expected_batches(labels, m, n):
    chunks = [math.ceil(c / n) for c in Counter(labels.tolist()).values()]
    return max(math.ceil(sum(chunks) / m), max(chunks))


def _check_composition(batch, labels, m, n):
    assert len(batch) == m * n
    counts = Counter(labels[batch].tolist())
    assert len(counts) == m, counts
    assert set(counts.values()) == {n}, counts


@pytest.mark.parametrize("m,n", [(2, 2), (4, 4), (3, 5), (6, 1)])
def test_class_balanced_composition_coverage_length(rng, m, n):
    for labels in _label_sets(rng):
        class_sizes = Counter(labels.tolist())
        for seed in range(8):
            s = ClassBalancedBatchSampler(labels, m, n, seed=seed, class_sampling="proportional")
            for epoch in (0, 3):
                s.set_epoch(epoch)
                batches = list(s)
                assert len(batches) == len(s) == _expected_batches(labels, m, n)
                for b in batches:
                    _check_composition(b, labels, m, n)
                    # padding by repetition only for classes smaller than n
                    for c in Counter(labels[b].tolist()):
                        idx = [i for i in b if labels[i] == c]
                        distinct = len(set(idx))
                        assert distinct == min(class_sizes[c], n), (c, idx)
                seen = set(i for b in batches for i in b)
                assert seen == set(range(len(labels)))  # every image at least once


def test_small_class_padding_repeats_its_images():
    labels = np.array([0, 0, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3])  # class 1 has one image, class 0 two
    s = ClassBalancedBatchSampler(labels, 2, 4, seed=1)
    for b in s:
        by_class = {}
        for i in b:
            by_class.setdefault(int(labels[i]), []).append(i)
        if 1 in by_class:
            assert by_class[1] == [2, 2, 2, 2]
        if 0 in by_class:
            assert sorted(by_class[0]) == [0, 0, 1, 1]


@pytest.mark.parametrize("mode", ["uniform", "proportional"])
def test_class_balanced_determinism_and_epochs(rng, mode):
    labels = np.repeat(np.arange(15), rng.integers(2, 9, 15))
    a = ClassBalancedBatchSampler(labels, 4, 3, seed=7, class_sampling=mode)
    b = ClassBalancedBatchSampler(labels, 4, 3, seed=7, class_sampling=mode)
    assert list(a) == list(b)
    a.set_epoch(1)
    b.set_epoch(1)
    e1 = list(a)
    assert e1 == list(b)
    a.set_epoch(0)
    assert list(a) != e1  # a new epoch reshuffles
    c = ClassBalancedBatchSampler(labels, 4, 3, seed=8, class_sampling=mode)
    assert list(c) != list(b.batches_for_epoch(0))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_class_balanced_rank_sharding(rng, world_size):
    for labels in _label_sets(rng):
        for seed in range(4):
            full = ClassBalancedBatchSampler(labels, 3, 2, seed=seed, class_sampling="proportional")
            global_batches = full.batches_for_epoch(2)
            ranks = [ClassBalancedBatchSampler(labels, 3, 2, seed=seed, rank=r, world_size=world_size,
                                               class_sampling="proportional")
                     for r in range(world_size)]
            per_rank = []
            for s in ranks:
                s.set_epoch(2)
                per_rank.append(list(s))
            lengths = {len(p) for p in per_rank}
            assert lengths == {math.ceil(len(global_batches) / world_size)} == {len(ranks[0])}
            # each global batch goes to exactly one rank; wrap-around padding only repeats
            # the first few global batches so that all ranks have the same length
            positions = [(r, k) for r in range(world_size) for k in range(len(per_rank[r]))]
            for r, k in positions:
                g = k * world_size + r
                expect = global_batches[g % len(global_batches)]
                assert per_rank[r][k] == expect
            union = set(i for p in per_rank for b in p for i in b)
            assert union == set(range(len(labels)))
            for p in per_rank:
                for b in p:
                    _check_composition(b, labels, 3, 2)


def test_ranks_get_different_batches():
    labels = np.repeat(np.arange(32), 8)  # 64 chunks of 4 -> 16 global batches of 4 classes
    s0 = ClassBalancedBatchSampler(labels, 4, 4, seed=0, rank=0, world_size=2, class_sampling="proportional")
    s1 = ClassBalancedBatchSampler(labels, 4, 4, seed=0, rank=1, world_size=2, class_sampling="proportional")
    b0, b1 = list(s0), list(s1)
    assert len(b0) == len(b1) == 8
    assert not set(map(tuple, b0)) & set(map(tuple, b1))
    assert not set(i for b in b0 for i in b) >= set(range(len(labels)))  # a rank sees only its share


@pytest.mark.parametrize("mode", ["uniform", "proportional"])
def test_class_balanced_resume_mid_epoch(rng, mode):
    labels = np.repeat(np.arange(10), rng.integers(3, 12, 10))
    for seed in range(5):
        for world_size, rank in ((1, 0), (2, 1)):
            s = ClassBalancedBatchSampler(labels, 3, 3, seed=seed, rank=rank, world_size=world_size,
                                          class_sampling=mode)
            s.set_epoch(4)
            full = list(s)
            it = iter(s)
            k = int(rng.integers(0, len(full)))
            consumed = [next(it) for _ in range(k)]
            assert consumed == full[:k]
            state = s.state_dict()
            assert state["epoch"] == 4 and state["batches_done"] == k and state["class_sampling"] == mode
            t = ClassBalancedBatchSampler(labels, 3, 3, seed=seed, rank=rank, world_size=world_size,
                                          class_sampling=mode)
            t.load_state_dict(state)
            t.set_epoch(4)  # a training loop calls set_epoch with the resumed epoch: keeps the offset
            assert list(t) == full[k:]
            t.set_epoch(5)
            s.set_epoch(5)
            assert list(t) == list(s)  # later epochs are whole


def test_uniform_class_sampling_frequencies_vs_proportional():
    """Both papers pick a batch's classes uniformly at random. With class sizes 5..100 the
    uniform mode's class counts pass a chi-square test of uniformity, the proportional mode's
    follow the class sizes (fixed seeds, so the outcome is deterministic)."""
    from scipy.stats import chisquare, pearsonr

    sizes = np.arange(5, 101, 5)                                   # 20 classes, 5..100 images
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(20), sizes))
    counts = {}
    for mode in ("uniform", "proportional"):
        s = ClassBalancedBatchSampler(labels, 4, 2, seed=3, class_sampling=mode)
        c = Counter()
        for epoch in range(8):
            s.set_epoch(epoch)
            for b in s:
                _check_composition(b, labels, 4, 2)
                c.update(set(labels[b].tolist()))                 # batches containing each class
        counts[mode] = np.array([c[k] for k in range(20)])
    uni, prop = counts["uniform"], counts["proportional"]
    assert chisquare(uni).pvalue > 0.01                            # consistent with uniform
    assert chisquare(prop).pvalue < 1e-12                          # far from uniform
    assert pearsonr(prop, sizes).statistic > 0.95                  # proportional to class size
    assert abs(pearsonr(uni, sizes).statistic) < 0.5
    # uniform: one epoch is ceil(N / (m n)) batches; inside a class, no image repeats before
    # the class's images are used up, and a batch never holds the same image twice
    s = ClassBalancedBatchSampler(labels, 4, 2, seed=3)
    assert len(s) == math.ceil(len(labels) / 8)
    per_class = {}
    for b in s:
        assert len(set(b)) == len(b)
        for i in b:
            per_class.setdefault(int(labels[i]), []).append(i)
    for k, seq in per_class.items():
        first = seq[: sizes[k]]
        assert len(set(first)) == len(first), k
    with pytest.raises(ValueError, match="class_sampling"):
        ClassBalancedBatchSampler(labels, 4, 2, class_sampling="weighted")
    # a state saved in one mode does not load into the other
    st = ClassBalancedBatchSampler(labels, 4, 2, seed=3).state_dict(batches_done=1)
    with pytest.raises(ValueError, match="class_sampling"):
        ClassBalancedBatchSampler(labels, 4, 2, seed=3, class_sampling="proportional").load_state_dict(st)


def test_state_dict_batches_done_and_errors():
    labels = np.repeat(np.arange(6), 4)
    s = ClassBalancedBatchSampler(labels, 2, 2, seed=3)
    full = list(s)
    st = s.state_dict(batches_done=2)  # what the loop consumed, not what the loader prefetched
    t = ClassBalancedBatchSampler(labels, 2, 2, seed=3)
    t.load_state_dict(st)
    assert list(t) == full[2:]
    t.load_state_dict(s.state_dict(batches_done=len(s)))
    assert list(t) == []  # a finished epoch stays finished until set_epoch(next)
    with pytest.raises(ValueError, match="seed"):
        ClassBalancedBatchSampler(labels, 2, 2, seed=4).load_state_dict(st)
    with pytest.raises(ValueError, match="world_size"):
        ClassBalancedBatchSampler(labels, 2, 2, seed=3, world_size=2).load_state_dict(st)
    with pytest.raises(KeyError, match="batches_done"):
        t.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="batches_done"):
        s.state_dict(batches_done=len(s) + 1)


def test_class_balanced_bad_input():
    with pytest.raises(ValueError, match="only 3 classes"):
        ClassBalancedBatchSampler([0, 1, 2, 2], 4, 2)
    with pytest.raises(ValueError, match="rank"):
        ClassBalancedBatchSampler([0, 1, 2], 2, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        ClassBalancedBatchSampler([0, 1, 2], 2, 2, world_size=0)
    with pytest.raises(ValueError, match="n must"):
        ClassBalancedBatchSampler([0, 1, 2], 2, 0)
    with pytest.raises(TypeError, match="integers"):
        ClassBalancedBatchSampler([0.5, 1.0], 1, 1)
    with pytest.raises(ValueError, match="non-empty"):
        ClassBalancedBatchSampler([], 1, 1)


@pytest.mark.parametrize("drop_last", [True, False])
def test_random_batch_sampler(drop_last):
    N, B = 103, 10
    for seed in range(6):
        s = RandomBatchSampler(N, B, seed=seed, drop_last=drop_last)
        batches = list(s)
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat))  # no index twice in an epoch
        if drop_last:
            assert len(batches) == len(s) == N // B
            assert all(len(b) == B for b in batches)
        else:
            assert len(batches) == len(s) == math.ceil(N / B)
            assert sorted(flat) == list(range(N))
        assert batches == list(RandomBatchSampler(N, B, seed=seed, drop_last=drop_last))
        s.set_epoch(1)
        assert list(s) != batches


@pytest.mark.parametrize("world_size", [2, 3])
def test_random_batch_sampler_sharding_and_resume(world_size):
    N, B = 95, 8
    global_batches = RandomBatchSampler(N, B, seed=2).batches_for_epoch(0)
    per_rank = [list(RandomBatchSampler(N, B, seed=2, rank=r, world_size=world_size)) for r in range(world_size)]
    assert len({len(p) for p in per_rank}) == 1
    for r, p in enumerate(per_rank):
        for k, b in enumerate(p):
            assert b == global_batches[(k * world_size + r) % len(global_batches)]
    s = RandomBatchSampler(N, B, seed=2, rank=1, world_size=world_size)
    it = iter(s)
    next(it)
    t = RandomBatchSampler(N, B, seed=2, rank=1, world_size=world_size)
    t.load_state_dict(s.state_dict())
    assert list(t) == per_rank[1][1:]
    with pytest.raises(ValueError, match="no batch"):
        RandomBatchSampler(5, 8)


class _IndexDataset(Dataset):
    """Returns (random augmentation draw, index): exposes worker RNG seeding."""

    def __init__(self, n):
        self.labels = np.arange(n) % 5

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return torch.rand(()), int(self.labels[i]), i


def test_make_loader_with_batch_sampler_and_workers():
    ds = _IndexDataset(40)
    sampler = ClassBalancedBatchSampler(ds.labels, 2, 4, seed=0)
    expected = sampler.batches_for_epoch(0)

    def run(seed):
        loader = make_loader(ds, batch_sampler=sampler, num_workers=2, seed=seed)
        assert loader.persistent_workers and loader.num_workers == 2
        assert loader.pin_memory == torch.cuda.is_available()
        out = [(r, y, i) for r, y, i in loader]
        return out

    a, b, c = run(0), run(0), run(1)
    assert [i.tolist() for _, _, i in a] == expected
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))  # same seed, same augmentation draws
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))
    draws = torch.cat([r for r, _, _ in a])
    assert len(torch.unique(draws)) == len(draws)  # workers do not repeat each other's streams


def test_make_loader_plain_batches_and_errors():
    ds = _IndexDataset(10)
    loader = make_loader(ds, batch_size=4, num_workers=0)
    assert [i.tolist() for _, _, i in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert not loader.persistent_workers
    with pytest.raises(ValueError, match="either batch_sampler"):
        make_loader(ds, batch_sampler=RandomBatchSampler(10, 2), batch_size=4)
    with pytest.raises(ValueError, match="batch_sampler or batch_size"):
        make_loader(ds)
    with pytest.raises(ValueError, match="num_workers"):
        make_loader(ds, batch_size=2, num_workers=-1)

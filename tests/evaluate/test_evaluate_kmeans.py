"""deepmetric.evaluate.kmeans vs a plain Lloyd reference written here (full distance matrix).

The reference is the documented definition: init = rows rng.permutation(n)[:K] of the
l2-normalised data (numpy default_rng(seed)); niter rounds of (nearest centroid, ties to the
lower id; mean of each cluster; each empty cluster, in id order, takes half of the currently
largest cluster: both get that centroid times 1 +- 1/1024 alternating per dimension); result =
assignment to the final centroids. It always runs all niter rounds: no early stop, no bounds.
"""
import numpy as np
import pytest
import torch
from sklearn.metrics import normalized_mutual_info_score

from deepmetric.evaluate import evaluate, kmeans


def ref_lloyd(x, k, seed, niter):
    x = x.astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    n, d = x.shape
    c = x[np.random.default_rng(seed).permutation(n)[:k]].copy()
    sign = np.array([1.0 if j % 2 == 0 else -1.0 for j in range(d)])
    n_empty = 0

    def nearest(c):
        dist = ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)  # n x k, fine for test sizes
        return dist.argmin(1)

    for _ in range(niter):
        a = nearest(c)
        size = np.bincount(a, minlength=k).astype(float)
        new = c.copy()
        for j in range(k):
            if size[j] > 0:
                new[j] = x[a == j].mean(0)
        for j in range(k):
            if size[j] == 0:
                n_empty += 1
                big = int(np.argmax(size))
                new[j] = new[big] * (1 + sign / 1024)
                new[big] = new[big] * (1 - sign / 1024)
                size[j] = np.floor(size[big] / 2)
                size[big] -= size[j]
        c = new
    return nearest(c), n_empty


def blobs(rng, n, k, d, noise):
    y = rng.integers(0, k, n)
    return (rng.standard_normal((k, d))[y] + noise * rng.standard_normal((n, d))).astype(np.float32), y


@pytest.mark.parametrize("seed,noise", [(0, 0.4), (1, 0.8), (2, 1.2)])
def test_early_stopped_kmeans_equals_full_niter_reference(rng, seed, noise):
    x, _ = blobs(rng, 500, 60, 12, noise)
    niter = 40
    want, _ = ref_lloyd(x, 60, seed, niter)
    got, info = kmeans(x, 60, seed=seed, niter=niter, return_info=True)
    # the reference ran all 40 rounds; ours stopped at the fixed point, long before
    assert info["converged"] and info["iterations"] < niter
    np.testing.assert_array_equal(got, want)
    plain, pinfo = kmeans(x, 60, seed=seed, niter=niter, accelerate=False, return_info=True)
    np.testing.assert_array_equal(plain, want)
    assert pinfo["iterations"] == info["iterations"]
    # the bounds really skipped work, and the exact-moved-centroid path was used
    assert sum(info["searched"]) < sum(pinfo["searched"]) == 500 * len(pinfo["searched"])
    assert max(info["exact_moved"]) > 0


def test_kmeans_stops_at_niter_when_not_converged(rng):
    x, _ = blobs(rng, 400, 40, 8, 1.5)
    for niter in (0, 1, 2, 3):
        got, info = kmeans(x, 40, seed=5, niter=niter, return_info=True)
        np.testing.assert_array_equal(got, ref_lloyd(x, 40, 5, niter)[0])
        assert info["iterations"] <= niter
    assert not kmeans(x, 40, seed=5, niter=2, return_info=True)[1]["converged"]


def test_empty_clusters_split_deterministically(rng):
    # 300 rows drawn from 100 distinct vectors: duplicate initial centroids -> empty clusters
    base = rng.standard_normal((100, 8)).astype(np.float32)
    x = base[rng.integers(0, 100, 300)]
    for seed in range(3):
        want, n_empty = ref_lloyd(x, 30, seed, 30)
        assert n_empty > 0  # the rule is really exercised
        for accelerate in (True, False):
            got = kmeans(x, 30, seed=seed, niter=30, accelerate=accelerate)
            np.testing.assert_array_equal(got, want)


def test_kmeans_reproducible_and_seeded(rng):
    x, y = blobs(rng, 300, 25, 10, 1.0)
    a = kmeans(x, 25, seed=3)
    np.testing.assert_array_equal(a, kmeans(torch.from_numpy(x), 25, seed=3))
    assert not np.array_equal(a, kmeans(x, 25, seed=4))
    res = evaluate(x, y, metrics=["nmi"], seed=3)
    assert res["nmi"] == pytest.approx(normalized_mutual_info_score(y, a), abs=1e-12)


def test_kmeans_trivial_and_bad_arguments(rng):
    x = rng.standard_normal((10, 3))
    np.testing.assert_array_equal(kmeans(x, 1), np.zeros(10))
    np.testing.assert_array_equal(kmeans(x, 10), np.arange(10))
    with pytest.raises(ValueError, match="niter"):
        kmeans(x, 3, niter=-1)
    with pytest.raises(ValueError, match="n_clusters"):
        kmeans(x, 0)


def _ref_inertia(x, assign):
    x = x.astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return sum(((x[assign == j] - x[assign == j].mean(0)) ** 2).sum() for j in np.unique(assign))


def test_restarts_keep_the_lowest_inertia_initialisation(rng):
    # few clusters, overlapping: the initialisation matters (as for NMI on 10 classes)
    x, y = blobs(rng, 600, 10, 6, 1.3)
    restarts = 6
    # 100 rounds: every restart reaches its fixed point, where the final centroids are the
    # means of the final assignment (what _ref_inertia measures)
    refs = [ref_lloyd(x, 10, 7 if r == 0 else [7, r], 100)[0] for r in range(restarts)]
    inertias = [_ref_inertia(x, a) for a in refs]
    assert len({round(v, 6) for v in inertias}) > 1  # the restarts really differ
    got, info = kmeans(x, 10, seed=7, restarts=restarts, niter=100, return_info=True)
    assert info["converged"]
    best = int(np.argmin(inertias))
    assert info["restart"] == best
    np.testing.assert_array_equal(got, refs[best])
    # the reported inertia is the sum of squared distances to the final centroids (means)
    assert info["inertia"] == pytest.approx(inertias[best], rel=1e-5)
    # restarts=1 is the plain k-means of the seed, and evaluate passes the option through
    np.testing.assert_array_equal(kmeans(x, 10, seed=7, restarts=1, niter=100), refs[0])
    res = evaluate(x, y, metrics=["nmi"], seed=7, kmeans_restarts=restarts)  # niter 20
    twenty = kmeans(x, 10, seed=7, restarts=restarts)
    assert res["nmi"] == pytest.approx(normalized_mutual_info_score(y, twenty), abs=1e-12)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="restarts must be an integer >= 1"):
            kmeans(x, 10, restarts=bad)

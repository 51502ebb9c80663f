"""deepmetric.evaluate vs independent brute-force references (full similarity matrix)."""
import itertools
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import normalized_mutual_info_score

from deepmetric.evaluate import (
    classification_accuracy,
    evaluate,
    kmeans,
    knn,
    map_at_r,
    nmi,
    nmi_from_clusters,
    pairwise_f1_from_clusters,
    r_precision,
    recall_at_k,
)

EXACT = ["faiss", "torch"]


# ----------------------------------------------------------------- plain references
def ref_rankings(x, labels, is_query=None, is_gallery=None):
    """For each query: (label, list of gallery labels sorted by (-cos, index), self removed)."""
    n = len(x)
    is_query = np.ones(n, bool) if is_query is None else is_query
    is_gallery = np.ones(n, bool) if is_gallery is None else is_gallery
    xn = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    sim = xn @ xn.T  # full N x N: fine for tiny test data
    out = []
    for q in np.flatnonzero(is_query):
        cand = [j for j in np.flatnonzero(is_gallery) if j != q]
        cand.sort(key=lambda j: (-sim[q, j], j))
        out.append((labels[q], [labels[j] for j in cand], cand))
    return out


def ref_metrics(x, labels, ks, **masks):
    rec = {k: [] for k in ks}
    aps, rps = [], []
    for lab, ranked, _ in ref_rankings(x, labels, **masks):
        rel = [int(l == lab) for l in ranked]
        R = sum(rel)
        if R == 0:
            continue
        for k in ks:
            rec[k].append(float(any(rel[:k])))
        hits, ap = 0, 0.0
        for i in range(R):
            if rel[i]:
                hits += 1
                ap += hits / (i + 1)
        aps.append(ap / R)
        rps.append(sum(rel[:R]) / R)
    out = {f"recall@{k}": float(np.mean(v)) for k, v in rec.items()}
    out["map@r"] = float(np.mean(aps))
    out["r_precision"] = float(np.mean(rps))
    return out


def tie_data(rng, n=60, d=8, n_classes=6):
    """Vectors with 4 entries of +-1 (or a single 1): all cosines are exact in float32, so many
    distances tie exactly; some rows are exact duplicates of others."""
    x = np.zeros((n, d), np.float32)
    for i in range(n):
        if rng.random() < 0.2:
            x[i, rng.integers(d)] = 1.0
        else:
            pos = rng.choice(d, 4, replace=False)
            x[i, pos] = rng.choice([-1.0, 1.0], 4)
    dup = rng.choice(n, n // 4, replace=False)
    x[dup[: len(dup) // 2]] = x[dup[len(dup) // 2 : 2 * (len(dup) // 2)]]
    return x, rng.integers(0, n_classes, n)


def gauss_data(rng, n=80, d=6, n_classes=8):
    y = rng.integers(0, n_classes, n)
    x = (rng.standard_normal((n_classes, d))[y] + 0.8 * rng.standard_normal((n, d))).astype(np.float32)
    x[5] = x[17]  # exact duplicates with (possibly) different labels
    x[30] = x[31]
    x[40] = 4 * x[41]  # same direction, different norm (power of 2: exactly equal once normalised)
    return x, y


def assert_metrics_close(got, want):
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-9), k


# ----------------------------------------------------------------- retrieval
@pytest.mark.parametrize("backend", EXACT)
@pytest.mark.parametrize("maker", [tie_data, gauss_data])
def test_all_vs_all_matches_bruteforce(rng, backend, maker):
    x, y = maker(rng)
    ks = (1, 2, 4, 8, 16, 1000)
    got = evaluate(x, y, ks=ks, metrics=["recall", "map@r", "r_precision"], backend=backend)
    assert_metrics_close(got, ref_metrics(x, y, ks))


@pytest.mark.parametrize("backend", EXACT)
def test_query_gallery_mode_matches_bruteforce(rng, backend):
    x, y = gauss_data(rng, n=90)
    is_q = rng.random(90) < 0.5
    is_g = ~is_q
    is_g[np.flatnonzero(is_q)[:5]] = True  # a few samples are both: excluded by index
    y = y.copy()
    y[np.flatnonzero(is_q & ~is_g)[-3:]] = 99  # a class with queries but no gallery sample
    with pytest.warns(UserWarning, match="no same-label"):
        # some queries may lack positives; the reference skips them the same way
        got = evaluate(x, y, is_query=is_q, is_gallery=is_g, ks=(1, 3, 5),
                       metrics=["recall", "map@r", "r_precision"], backend=backend)
    assert_metrics_close(got, ref_metrics(x, y, (1, 3, 5), is_query=is_q, is_gallery=is_g))
    n_missing = sum(1 for lab, ranked, _ in ref_rankings(x, y, is_q, is_g) if lab not in ranked)
    assert got["queries_without_positive"] == n_missing > 0


@pytest.mark.parametrize("backend", EXACT)
def test_knn_order_and_ties_match_bruteforce(rng, backend):
    x, y = tie_data(rng, n=50)
    sims, idx = knn(x, k=12, backend=backend)
    for q, (_, _, cand) in enumerate(ref_rankings(x, y)):
        assert list(idx[q]) == cand[:12]
        assert q not in idx[q]
    assert np.all(np.diff(sims, axis=1) <= 0)


def test_knn_self_excluded_by_index_not_first_column():
    x = np.array([[1, 0], [1, 0], [1, 0], [0, 1]], np.float32)  # rows 0-2 identical
    for backend in EXACT:
        _, idx = knn(x, k=2, backend=backend)
        assert idx.tolist() == [[1, 2], [0, 2], [0, 1], [0, 1]]
        _, idx = knn(x, x, k=2, backend=backend)  # gallery given: no exclusion
        assert idx.tolist() == [[0, 1], [0, 1], [0, 1], [3, 0]]


@pytest.mark.parametrize("backend", EXACT)
def test_chunked_equals_single_chunk(rng, backend):
    x, y = tie_data(rng, n=70)
    one = evaluate(x, y, ks=(1, 2, 4, 8), backend=backend, chunk_size=10_000)
    for kw in ({"chunk_size": 1}, {"chunk_size": 7}, {"memory_mb": 0.001}):
        # same neighbours; only the float summation of per-query scores is grouped differently
        assert evaluate(x, y, ks=(1, 2, 4, 8), backend=backend, **kw) == pytest.approx(one, abs=1e-12)
    s1, i1 = knn(x, k=9, backend=backend, chunk_size=3, memory_mb=0.0005)
    s2, i2 = knn(x, k=9, backend=backend)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(s1, s2)


def test_faiss_and_torch_backends_agree(rng):
    x, y = gauss_data(rng, n=120)
    a = evaluate(x, y, ks=(1, 2, 4, 8, 32), backend="faiss")
    b = evaluate(x, y, ks=(1, 2, 4, 8, 32), backend="torch")
    assert a == pytest.approx(b, abs=1e-12)
    np.testing.assert_array_equal(knn(x, k=10, backend="faiss")[1], knn(x, k=10, backend="torch")[1])


def test_hand_worked_map_at_r():
    # one query at angle 0; gallery at 10 (A), 20 (B), 30 (A), 40 (A), 90 (B) degrees.
    # ranking A B A A B; R = 3 -> relevances in the first R: 1 0 1
    # MAP@R = (1/3)(1/1 + 2/3) = 5/9, R-Precision = 2/3, Recall@1 = 1.
    ang = np.deg2rad([0, 10, 20, 30, 40, 90])
    x = np.stack([np.cos(ang), np.sin(ang)], 1)
    y = np.array([0, 0, 1, 0, 0, 1])
    q = np.array([1, 0, 0, 0, 0, 0], bool)
    g = ~q
    kw = dict(is_query=q, is_gallery=g)
    assert map_at_r(x, y, **kw) == pytest.approx(5 / 9)
    assert r_precision(x, y, **kw) == pytest.approx(2 / 3)
    assert recall_at_k(x, y, ks=(1, 2), **kw) == {"recall@1": 1.0, "recall@2": 1.0}


def test_hand_worked_recall_all_vs_all():
    # 1-D points: 0 (a), 1 (b), 3 (a), 4 (b) embedded on a circle (small angles keep the order)
    ang = np.deg2rad([0, 1, 3, 4])
    x = np.stack([np.cos(ang), np.sin(ang)], 1)
    y = np.array([0, 1, 0, 1])
    # nearest (excluding self): 0->1 (b, miss), 1->0 (a, miss; tie 0/3? no: |1-0|=1 < 2), 3->4 (b, miss), 4->3 (miss)
    # 2nd nearest: 0->3 (hit), 1->3 (dist 2, miss; 4 is 3 away), 3->1 (miss), 4->1 (hit)
    res = recall_at_k(x, y, ks=(1, 2, 3))
    assert res == {"recall@1": 0.0, "recall@2": 0.5, "recall@3": 1.0}


def test_no_positive_query_all_missing_is_error():
    x = np.eye(4, dtype=np.float32)
    y = np.array([0, 1, 2, 3])
    with pytest.raises(ValueError, match="no query has a positive"):
        evaluate(x, y, metrics=["recall"])


def test_approximate_backend_is_labelled(rng):
    x, y = gauss_data(rng, n=100)
    exact = evaluate(x, y, metrics=["recall", "map@r"], backend="faiss")
    approx = evaluate(x, y, metrics=["recall", "map@r"], backend="faiss-hnsw")
    assert set(approx) == {k + "_approx" for k in exact}
    # HNSW on 100 points with a large efSearch is effectively exact
    assert approx["recall@1_approx"] == pytest.approx(exact["recall@1"], abs=0.02)
    ivf = evaluate(x, y, metrics=["recall"], backend="faiss-ivf")
    assert set(ivf) == {"recall@1_approx", "recall@2_approx", "recall@4_approx", "recall@8_approx"}


# ----------------------------------------------------------------- clustering
def test_nmi_matches_sklearn(rng):
    for _ in range(5):
        y = rng.integers(0, 7, 200)
        c = rng.integers(0, 9, 200)
        c[:100] = y[:100] + 20  # partial agreement
        for avg in ("arithmetic", "geometric"):
            assert nmi_from_clusters(y, c, average=avg) == pytest.approx(
                normalized_mutual_info_score(y, c, average_method=avg), abs=1e-12)
    assert nmi_from_clusters(y, y * 3 + 1) == pytest.approx(1.0)


def ref_pairwise_f1(y, c):
    tp = fp = fn = 0
    for i, j in itertools.combinations(range(len(y)), 2):
        same_c, same_y = c[i] == c[j], y[i] == y[j]
        tp += same_c and same_y
        fp += same_c and not same_y
        fn += same_y and not same_c
    p, r = tp / (tp + fp), tp / (tp + fn)
    return 2 * p * r / (p + r)


def test_pairwise_f1_matches_pair_loop(rng):
    for _ in range(3):
        y = rng.integers(0, 5, 70)
        c = np.where(rng.random(70) < 0.6, y, rng.integers(0, 6, 70))
        assert pairwise_f1_from_clusters(y, c) == pytest.approx(ref_pairwise_f1(y, c), abs=1e-12)
    # hand-worked: y = a a b b, c = 1 1 1 2: TP 1 (0,1), predicted pairs 3, true pairs 2
    # P = 1/3, R = 1/2, F1 = 2 * (1/6) / (5/6) = 0.4
    assert pairwise_f1_from_clusters([0, 0, 1, 1], [1, 1, 1, 2]) == pytest.approx(0.4)


def test_evaluate_nmi_f1_use_seeded_kmeans_with_k_classes(rng):
    x, y = gauss_data(rng, n=150)
    res = evaluate(x, y, metrics=["nmi", "f1"], seed=3)
    c = kmeans(x, len(np.unique(y)), seed=3)
    assert len(np.unique(c)) <= len(np.unique(y))
    np.testing.assert_array_equal(c, kmeans(x, len(np.unique(y)), seed=3))  # reproducible
    assert res["nmi"] == pytest.approx(normalized_mutual_info_score(y, c), abs=1e-12)
    assert res["f1"] == pytest.approx(ref_pairwise_f1(y, c), abs=1e-12)
    assert res == evaluate(x, y, metrics=["nmi", "f1"], seed=3)
    geo = evaluate(x, y, metrics=["nmi"], seed=3, nmi_average="geometric")["nmi"]
    assert geo == pytest.approx(normalized_mutual_info_score(y, c, average_method="geometric"))
    assert nmi(x, y, seed=3) == pytest.approx(res["nmi"])


def test_well_separated_clusters_give_perfect_scores(rng):
    centres = np.eye(5, dtype=np.float32) * 10
    y = np.repeat(np.arange(5), 6)
    x = centres[y] + 0.01 * rng.standard_normal((30, 5)).astype(np.float32)
    res = evaluate(x, y, ks=(1, 5))
    assert all(v == pytest.approx(1.0) for v in res.values()), res


# ----------------------------------------------------------------- classification
def test_classification_accuracy_logits_and_preds(rng):
    y = rng.integers(0, 4, 50)
    logits = rng.standard_normal((50, 4))
    preds = logits.argmax(1)
    top1 = sum(p == t for p, t in zip(preds, y)) / 50
    per = [np.mean([preds[i] == c for i in range(50) if y[i] == c]) for c in sorted(set(y))]
    want = {"top1": top1, "mean_per_class": float(np.mean(per))}
    for inp in (logits, preds):
        got = classification_accuracy(inp, y)
        assert got == pytest.approx(want)
    # hand-worked: class 0 has 3 samples (all right), class 1 has 1 (wrong): micro 3/4, macro 1/2
    assert classification_accuracy([0, 0, 0, 0], [0, 0, 0, 1]) == {"top1": 0.75, "mean_per_class": 0.5}
    assert not math.isnan(classification_accuracy(np.eye(3), [0, 1, 2])["top1"])


@pytest.mark.filterwarnings("ignore:.*no same-label")
@pytest.mark.parametrize("backend", EXACT)
def test_large_k_recall_via_first_positive_rank(rng, backend):
    # many classes + heavy noise: first positives are often deeper than the 32-long list,
    # so Recall@K for K > 32 comes from the exact counting pass
    y = rng.integers(0, 100, 300)
    x = (rng.standard_normal((100, 6))[y] + 3.0 * rng.standard_normal((300, 6))).astype(np.float32)
    x[10] = x[11]
    ks = (1, 33, 50, 100, 200)
    want = ref_metrics(x, y, ks)
    assert 0.2 < want["recall@50"] < 0.95  # the deep path is really exercised
    for kw in ({}, {"memory_mb": 0.001, "chunk_size": 13}):
        got = evaluate(x, y, ks=ks, metrics=["recall"], backend=backend, **kw)
        assert_metrics_close(got, {k: v for k, v in want.items() if k.startswith("recall")})


def test_first_positive_rank_matches_bruteforce_with_ties(rng):
    from deepmetric.evaluate._checks import check_embeddings
    from deepmetric.evaluate.knn import first_positive_rank

    x, y = tie_data(rng, n=80)
    xn = check_embeddings(x)
    want = []
    for lab, ranked, _ in ref_rankings(x, y):
        want.append(ranked.index(lab) if lab in ranked else 80)
    got = first_positive_rank(xn, xn, y, y, np.arange(80), memory_mb=0.001)
    np.testing.assert_array_equal(got, want)
    got_t = first_positive_rank(torch.from_numpy(xn), torch.from_numpy(xn), y, y, np.arange(80))
    np.testing.assert_array_equal(got_t, want)


def test_progress_bar_does_not_change_results(rng, capsys):
    x, y = gauss_data(rng, n=120)
    want = evaluate(x, y, metrics=["recall", "map@r"])
    got = evaluate(x, y, metrics=["recall", "map@r"], progress=True, chunk_size=50)
    assert got == pytest.approx(want, abs=1e-12)  # chunking only reorders the sums
    assert "120/120" in capsys.readouterr().err

"""deepmetric.search.postprocess (whitening, DBA, alpha-QE, k-reciprocal re-ranking) against
brute-force numpy references written here from the papers' definitions."""
import numpy as np
import pytest
import torch

from deepmetric.search.postprocess import (KReciprocalGraph, Postprocessor, apply_whitening, aqe, check_steps,
                                           dba, fit_whitening, parse_step, parse_steps, rerank)


def unit(x):
    x = np.asarray(x, np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def clustered(rng, n, d=8, classes=5, noise=0.6):
    centres = rng.normal(size=(classes, d))
    y = rng.integers(0, classes, n)
    return unit(centres[y] + noise * rng.normal(size=(n, d))).astype(np.float32), y


def ranked(sims_row, exclude=-1):
    """Gallery rows by (-cos, index), ``exclude`` left out (the reference's own ordering)."""
    order = [j for j in range(len(sims_row)) if j != exclude]
    return sorted(order, key=lambda j: (-sims_row[j], j))


# ----------------------------------------------------------------- whitening
def ref_whiten(fit, x, dim, shrink):
    fit = unit(fit)
    mu = fit.mean(0)
    _, s, vt = np.linalg.svd(fit - mu, full_matrices=False)
    lam = np.zeros(fit.shape[1])
    lam[: len(s)] = s ** 2 / len(fit)
    vecs = np.zeros((fit.shape[1], fit.shape[1]))
    vecs[:, : len(s)] = vt.T
    lam = (1 - shrink) * lam + shrink * lam.mean()
    lam = np.maximum(lam, 1e-6 * lam[0])
    z = (unit(x) - mu) @ (vecs[:, :dim] / np.sqrt(lam[:dim]))
    return unit(z)


@pytest.mark.parametrize("dim,shrink", [(8, 0.0), (5, 0.0), (4, 0.5), (8, 1.0)])
def test_whitening_matches_svd_reference(rng, dim, shrink):
    fit, _ = clustered(rng, 200)
    x, _ = clustered(rng, 30)
    got = apply_whitening(x, fit_whitening(fit, dim, shrink))
    ref = ref_whiten(fit, x, dim, shrink)
    assert got.shape == (30, dim)
    # eigenvector signs are arbitrary: compare the cosines between rows (sign-invariant)
    np.testing.assert_allclose(got @ got.T, ref @ ref.T, atol=2e-4)


def test_whitened_fit_set_has_identity_covariance(rng):
    fit, _ = clustered(rng, 500, d=6)
    p = fit_whitening(fit)
    z = (fit - p["mean"]) @ p["projection"]  # before the final l2 normalisation
    np.testing.assert_allclose(np.cov(z.T, bias=True), np.eye(6), atol=1e-3)


def test_whitening_dim_checked(rng):
    fit, _ = clustered(rng, 50)
    with pytest.raises(ValueError, match="dim must be in"):
        fit_whitening(fit, 9)


# ----------------------------------------------------------------- DBA and alpha-QE
def ref_expand(q, g, k, alpha, self_pos):
    q, g = unit(q), unit(g)
    out = []
    for i in range(len(q)):
        s = g @ q[i]
        acc = q[i].copy()
        for j in ranked(s, self_pos[i])[:k]:
            acc += max(s[j], 0.0) ** alpha * g[j]
        out.append(acc / np.linalg.norm(acc))
    return np.array(out)


@pytest.mark.parametrize("k,alpha", [(1, 3.0), (3, 3.0), (5, 0.0), (4, 1.0)])
def test_dba_matches_reference(rng, k, alpha):
    g, _ = clustered(rng, 40)
    ref = ref_expand(g, g, k - 1, alpha, np.arange(40)) if k > 1 else unit(g)
    np.testing.assert_allclose(dba(g, k, alpha), ref, atol=1e-5)


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_aqe_matches_reference_with_self_excluded(rng, backend):
    g, _ = clustered(rng, 40)
    q, _ = clustered(rng, 12)
    q[:4] = g[[3, 7, 11, 20]]  # queries that are gallery rows: their own row is not a neighbour
    self_pos = np.array([3, 7, 11, 20] + [-1] * 8)
    got = aqe(q, g, 2, 3.0, self_pos=self_pos, backend=backend, memory_mb=0.01)
    np.testing.assert_allclose(got, ref_expand(q, g, 2, 3.0, self_pos), atol=1e-5)


def test_aqe_takes_torch_tensors(rng):
    g, _ = clustered(rng, 30)
    q, _ = clustered(rng, 5)
    got = aqe(torch.from_numpy(q), torch.from_numpy(g), 3, 2.0)  # CPU tensors come back as numpy (check_embeddings)
    np.testing.assert_allclose(np.asarray(got), ref_expand(q, g, 3, 2.0, -np.ones(5, int)), atol=1e-5)


# ----------------------------------------------------------------- k-reciprocal
def ref_kreciprocal(q, g, self_pos, k1, k2, lam, cands):
    """Zhong et al. 2017 eqs. 4-12 with dense matrices and Python sets (tiny data only)."""
    q, g = unit(q), unit(g)
    ng, half = len(g), (k1 + 1) // 2
    sgg = g @ g.T

    def kth(y, k):  # y's k-th largest cosine to the other gallery items
        others = np.sort(np.delete(sgg[y], y))[::-1]
        return others[k - 1] if len(others) >= k else -np.inf

    def node_sims(node):
        return sgg[node] if node != "q" else None

    def r_set(sims, me, excl, k):  # R(x, k): me plus the reciprocal ones of its top-k
        return {me} | {y for y in ranked(sims, excl)[:k] if sims[y] >= kth(y, k)}

    def v_of(sims, me, excl):
        rk = r_set(sims, me, excl, k1)
        star = set(rk)
        for y in rk - {me}:
            ry = r_set(sgg[y], y, y, half)
            if len(rk & ry) >= 2 / 3 * len(ry):
                star |= ry
        w = {y: np.exp(-(1 - (1.0 if y == me else sims[y]))) for y in star}
        tot = sum(w.values())
        return {y: v / tot for y, v in w.items()}

    v_gal = [v_of(sgg[i], i, i) for i in range(ng)]

    def qe(v_self, sims, excl):
        rows = [v_self] + [v_gal[y] for y in ranked(sims, excl)[: k2 - 1]]
        out = {}
        for r in rows:
            for y, v in r.items():
                out[y] = out.get(y, 0.0) + v / k2
        return out

    vqe_gal = [qe(v_gal[i], sgg[i], i) for i in range(ng)]
    res = []
    for i in range(len(q)):
        s = g @ q[i]
        cand = ranked(s, self_pos[i])
        if self_pos[i] >= 0:
            vp = vqe_gal[self_pos[i]]
        else:
            vp = qe(v_of(s, "q", -1), s, -1)
        scored = []
        for pos, y in enumerate(cand[:cands]):
            keys = set(vp) | set(vqe_gal[y])
            mn = sum(min(vp.get(j, 0), vqe_gal[y].get(j, 0)) for j in keys)
            mx = sum(max(vp.get(j, 0), vqe_gal[y].get(j, 0)) for j in keys)
            scored.append((round((1 - lam) * (1 - mn / mx) + lam * (1 - s[y]), 6), pos, y))
        res.append([y for _, _, y in sorted(scored)] + cand[cands:])
    return res


@pytest.mark.parametrize("k1,k2,lam,cands", [(6, 3, 0.3, 15), (4, 1, 0.0, 10), (8, 4, 0.8, 30)])
def test_kreciprocal_matches_dense_reference(rng, k1, k2, lam, cands):
    g, _ = clustered(rng, 45, classes=4)
    q, _ = clustered(rng, 14, classes=4)
    q[:5] = g[[0, 9, 17, 30, 44]]
    self_pos = np.array([0, 9, 17, 30, 44] + [-1] * 9)
    width = 40
    sims = np.zeros((14, width), np.float32)
    idx = np.zeros((14, width), np.int64)
    for i in range(14):
        s = g @ q[i]
        order = ranked(s, self_pos[i])[:width]
        idx[i], sims[i] = order, s[order]
    graph = KReciprocalGraph.build(g, k1, k2, memory_mb=0.05)
    _, got = rerank(graph, q, g, sims, idx, self_pos=self_pos, lam=lam, candidates=cands, memory_mb=0.05)
    ref = ref_kreciprocal(q, g, self_pos, k1, k2, lam, cands)
    assert got.tolist() == [r[:width] for r in ref]


def test_kreciprocal_with_k1_past_the_gallery_matches_the_reference(rng):
    """k1 = 20 (the default) on a gallery of 12 was an IndexError in evaluate, and an index built
    so answered every search with one: each list is as long as the gallery allows, as the
    reference's slicing (and Zhong et al.'s code) has it."""
    g, _ = clustered(rng, 12, classes=3)
    q, _ = clustered(rng, 6, classes=3)
    q[:2] = g[[0, 7]]
    self_pos = np.array([0, 7, -1, -1, -1, -1])
    sims = np.zeros((6, 12), np.float32)
    idx = np.full((6, 12), -1, np.int64)
    for i in range(6):
        order = ranked(g @ q[i], self_pos[i])
        idx[i, :len(order)], sims[i, :len(order)] = order, (g @ q[i])[order]
    for k1 in (20, 1000):
        graph = KReciprocalGraph.build(g, k1, 3)
        _, got = rerank(graph, q, g, sims, idx, self_pos=self_pos, lam=0.3, candidates=12)
        ref = ref_kreciprocal(q, g, self_pos, k1, 3, 0.3, 12)
        assert [[y for y in row if y >= 0] for row in got.tolist()] == ref


def test_kreciprocal_graph_is_sparse_and_rows_sum_to_one(rng):
    g, _ = clustered(rng, 300, classes=10)
    graph = KReciprocalGraph.build(g, 10, 4)
    assert graph.vqe.nnz < 300 * 300 / 3
    np.testing.assert_allclose(np.asarray(graph.v.sum(1)).ravel(), 1, atol=1e-5)
    np.testing.assert_allclose(np.asarray(graph.vqe.sum(1)).ravel(), 1, atol=1e-5)


# ----------------------------------------------------------------- steps
def test_parse_step_fills_defaults_and_types():
    assert parse_step("whiten:dim=256,fit=gallery") == {"name": "whiten", "dim": 256, "shrinkage": 0.0,
                                                         "fit": "gallery"}
    assert parse_step("dba:k=3,alpha=3") == {"name": "dba", "k": 3, "alpha": 3.0}
    assert parse_step("kreciprocal")["k1"] == 20


@pytest.mark.parametrize("bad,match", [
    ("whitenn:dim=3", "unknown post-processing step 'whitenn'"),
    ("dba:kk=3", "unknown key.*'kk'.*dba takes k, alpha"),
    ("dba:k=three", "expected int"),
    ("aqe:k=0", "k must be >= 1"),
    ("whiten:fit=test", "fit must be one of gallery, train"),
    ("kreciprocal:lambda=2", r"lambda must be in \[0, 1\]"),
    ("dba:k", "not KEY=VALUE"),
])
def test_bad_steps_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_step(bad)


def test_order_and_repeats_are_checked():
    with pytest.raises(ValueError, match="order whiten -> dba -> aqe -> kreciprocal"):
        parse_steps(["aqe:k=2", "dba:k=3"])
    with pytest.raises(ValueError, match="once"):
        check_steps([{"name": "dba"}, {"name": "dba"}])
    with pytest.raises(ValueError, match=r"search.postprocess.0 \(dba\): k must be int"):
        check_steps([{"name": "dba", "k": "3"}])


def test_postprocessor_state_round_trip(rng):
    g, _ = clustered(rng, 60)
    q, _ = clustered(rng, 7)
    p = Postprocessor(parse_steps(["whiten:dim=5", "dba:k=3,alpha=3", "aqe:k=2,alpha=3"]))
    gp = p.fit(g)
    qp = p.transform_queries(q, gp)
    again = Postprocessor.from_state(p.steps, p.state())
    np.testing.assert_allclose(again.transform_queries(q, gp), qp, atol=1e-6)
    with pytest.raises(ValueError, match="fit=train needs the train embeddings.*--fit-embeddings"):
        Postprocessor([{"name": "whiten", "fit": "train"}]).fit(g)


@pytest.mark.parametrize("shrink", [0.0, 0.5])
def test_whitening_with_fewer_rows_than_dimensions(rng, shrink):
    """The SVD path (n <= d) gives the covariance path's whitening (the reference)."""
    fit = unit(rng.normal(size=(20, 40))).astype(np.float32)
    x = unit(rng.normal(size=(6, 40))).astype(np.float32)
    got = apply_whitening(x, fit_whitening(fit, 10, shrink))
    ref = ref_whiten(fit, x, 10, shrink)
    np.testing.assert_allclose(got @ got.T, ref @ ref.T, atol=2e-4)


def test_torch_tensor_paths_equal_numpy_paths(rng):
    """The code a GPU runs (tensor inputs), exercised here on CPU tensors."""
    from deepmetric.evaluate.postprocess import _expand

    g, _ = clustered(rng, 50)
    q, _ = clustered(rng, 8)
    sp = np.full(8, -1)
    a = _expand(torch.from_numpy(q), torch.from_numpy(g), 3, 2.0, sp, backend="torch")
    np.testing.assert_allclose(a.numpy(), _expand(q, g, 3, 2.0, sp), atol=1e-6)
    graph = KReciprocalGraph.build(g, 6, 3)
    width = 20
    sims = np.zeros((8, width), np.float32)
    idx = np.zeros((8, width), np.int64)
    for i in range(8):
        s = g @ q[i]
        idx[i] = ranked(s)[:width]
        sims[i] = s[idx[i]]
    _, want = rerank(graph, q, g, sims, idx, candidates=15)
    _, got = rerank(graph, torch.from_numpy(q), torch.from_numpy(g), sims, idx, candidates=15)
    assert got.tolist() == want.tolist()

"""Second hostile trial of ``deepmetric evaluate``, its post-processing and cross-domain
evaluation: the defects it found, each checked against an independent computation (a
brute-force ranking written here, scikit-learn), and the one-line errors of bad input."""
import json

import numpy as np
import pytest
from sklearn.metrics import normalized_mutual_info_score

from deepmetric.cli import main
from deepmetric.evaluate import evaluate, evaluate_cross_domain, kmeans, nmi_from_clusters
from deepmetric.evaluate.postprocess import fit_whitening, parse_step


def clustered(rng, n=40, d=8, classes=4):
    y = np.arange(n) % classes
    x = rng.normal(size=(classes, d))[y] + 0.5 * rng.normal(size=(n, d))
    return x.astype(np.float32), y


def brute(x, y, ks):
    """Recall@K, MAP@R, MRR and mAP@K by sorting every other sample (float64 cosines rounded to
    1e-9, so that BLAS rounding never decides a tie; ties by the smaller index, as documented)."""
    x = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    rec, ap_r, rr, ap_k = {k: [] for k in ks}, [], [], {k: [] for k in ks}
    for i in range(len(y)):
        cand = np.array([j for j in range(len(y)) if j != i])
        s = np.round(x[cand] @ x[i], 9)
        rel = y[cand][np.lexsort((cand, -s))] == y[i]
        r = int(rel.sum())
        if r == 0:
            continue
        prec = np.cumsum(rel) / np.arange(1, len(rel) + 1)
        for k in ks:
            rec[k].append(rel[:k].any())
            ap_k[k].append((prec[:k] * rel[:k]).sum() / r)
        ap_r.append((prec[:r] * rel[:r]).sum() / r)
        rr.append(1 / (np.argmax(rel) + 1))
    out = {f"recall@{k}": np.mean(v) for k, v in rec.items()}
    out.update({f"map@{k}": np.mean(v) for k, v in ap_k.items()})
    out.update({"map@r": np.mean(ap_r), "mrr": np.mean(rr)})
    return out


# --------------------------------------------------------------------------- metric values
def test_hand_made_example_has_the_known_answers():
    """Seven points on a circle (degrees), labels 0 0 1 1 1 2 2. Worked by hand: every query but
    #2 (20 deg, label 1) finds all its positives first (query 1's tie between 0 and 2, both 10 deg
    away, goes to the smaller index, 0, a positive); #2's ranking is 1, 0, 3, 4: R = 2 positives
    at ranks 3 and 4 -> Recall@1 0, AP@R 0, reciprocal rank 1/3."""
    deg = np.radians([0, 10, 20, 90, 100, 180, 185])
    x = np.c_[np.cos(deg), np.sin(deg)].astype(np.float32)
    y = np.array([0, 0, 1, 1, 1, 2, 2])
    got = evaluate(x, y, ks=(1, 4), metrics=["recall", "map@r", "r_precision", "mrr"])
    assert got["recall@1"] == pytest.approx(6 / 7)
    assert got["recall@4"] == pytest.approx(1.0)
    assert got["map@r"] == pytest.approx(6 / 7)
    assert got["r_precision"] == pytest.approx(6 / 7)
    assert got["mrr"] == pytest.approx((6 + 1 / 3) / 7)


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_exact_duplicates_are_ranked_by_index(rng, backend):
    """Many rows are exact copies (ties everywhere): the metrics equal the brute-force ranking
    with the documented tie rule, also when the k-NN runs in small chunks."""
    base = rng.normal(size=(30, 16)).astype(np.float32)
    x = base[rng.integers(0, 30, 400)]
    y = rng.integers(0, 5, 400)
    got = evaluate(x, y, ks=(1, 2, 5), metrics=["recall", "map@r", "mrr", "map@k"], backend=backend,
                   chunk_size=37, memory_mb=1)
    want = brute(x, y, (1, 2, 5))
    assert got == pytest.approx({k: want[k] for k in got}, abs=1e-9)


def test_nmi_equals_scikit_learn_for_the_same_clusters(rng):
    x, y = clustered(rng, 300, 16, 5)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    clusters = kmeans(unit, 5, seed=0)
    want = normalized_mutual_info_score(y, clusters)
    assert nmi_from_clusters(y, clusters) == pytest.approx(want, abs=1e-12)
    assert evaluate(x, y, metrics=["nmi"])["nmi"] == pytest.approx(want, abs=1e-12)  # the same seeded k-means
    geo = normalized_mutual_info_score(y, clusters, average_method="geometric")
    assert nmi_from_clusters(y, clusters, average="geometric") == pytest.approx(geo, abs=1e-12)


def test_map_at_k_past_the_gallery_is_the_whole_ranking(rng):
    """mAP@K with K above the number of references was a RuntimeError ('internal error: k-NN
    list shorter than K of mAP@K') and, from the command line, a traceback."""
    x, y = clustered(rng, 30, 6, 3)
    got = evaluate(x, y, ks=(1, 5, 29, 1000), metrics=["map@k", "recall"])
    want = brute(x, y, (1, 5, 29, 1000))
    assert got == pytest.approx({k: want[k] for k in got}, abs=1e-9)
    assert got["map@1000"] == pytest.approx(got["map@29"])  # 29 references: the whole ranking


@pytest.mark.parametrize("scale,dtype", [(1e30, np.float32), (1e200, np.float64), (1e-300, np.float64),
                                         (1e-30, np.float32)])
def test_extreme_but_finite_values_are_normalised(rng, scale, dtype):
    """A finite float64 row of 1e200s was refused as 'NaN or infinite', one of 1e-300s as
    'all-zero', and a float32 row of 1e30s had an infinite norm: all are ordinary directions."""
    x, y = clustered(rng)
    big = x.astype(dtype) * dtype(scale)
    assert np.isfinite(big).all() and (np.abs(big).max(axis=1) > 0).all()
    got = evaluate(big, y, metrics=["recall", "map@r", "mrr"])
    want = brute(x, y, (1, 2, 4, 8))
    assert got == pytest.approx({k: want[k] for k in got}, abs=1e-9)


# --------------------------------------------------------------------------- post-processing
def test_whitening_wider_than_the_fit_set_spans_is_refused(rng):
    """6 centred rows span 5 directions: whitening to 6 or 8 scaled up rounding noise (Recall@1 of
    a clustered gallery fell to 0); the default dim (the embedding size) is bound the same way."""
    x = rng.normal(size=(6, 8)).astype(np.float32)
    for dim in (6, 8):
        with pytest.raises(ValueError, match=rf"dim={dim} is more than a fit set of 6 row\(s\) spans "
                                             r"\(5 directions.*dim <= 5"):
            fit_whitening(x, dim)
    with pytest.raises(ValueError, match=r"dim \(default: the embedding size, 8\)"):
        fit_whitening(x)
    assert fit_whitening(x, 5)["projection"].shape == (8, 5)  # as many as it spans: fitted
    with pytest.raises(ValueError, match="all the same direction"):
        fit_whitening(np.tile(x[:1], (30, 1)), 4)


def test_postprocess_step_spelling_errors_name_the_flag():
    with pytest.raises(ValueError, match=r"--postprocess 'whiten:dim=4,dim=6': dim is given twice"):
        parse_step("whiten:dim=4,dim=6")
    with pytest.raises(ValueError, match=r"--postprocess 'whiten:dim=abc' \(whiten\): dim: expected int"):
        parse_step("whiten:dim=abc")


# --------------------------------------------------------------------------- cross-domain
def test_cross_domain_refuses_names_that_would_overwrite_a_result(rng):
    """A repeated domain name (or one called 'mean') replaced another domain's metrics and
    changed the mean without a word."""
    x, y = clustered(rng, 60, 8, 5)
    dom = np.arange(60) % 3
    for names in (["a", "a", "b"], ["mean", "b", "c"]):
        with pytest.raises(ValueError, match="would name two entries"):
            evaluate_cross_domain(x, y, dom, domain_names=names)
    ok = evaluate_cross_domain(x, y, dom, domain_names=["a", "b", "c"], ks=(1,), metrics=["recall"])
    assert ok["mean"]["recall@1"] == pytest.approx(np.mean([ok[n]["recall@1"] for n in "abc"]))


def test_cross_domain_errors_name_the_domain(rng):
    x, y = clustered(rng, 60, 8, 5)
    dom = np.arange(60) % 3
    y = y.copy()
    y[dom == 1] = 100 + np.arange(20)  # domain 1's classes exist nowhere else
    with pytest.raises(ValueError, match=r"domain 'b' \(its 20 queries against the other domains\): no query "
                                         "has a positive"):
        evaluate_cross_domain(x, y, dom, domain_names=["a", "b", "c"])
    with pytest.raises(ValueError, match="is_query cannot be given"):
        evaluate_cross_domain(x, y, dom, is_query=np.ones(60, bool))


# --------------------------------------------------------------------------- the command
def one_line_error(capsys, argv, *, expect: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert expect in err, err
    return err


@pytest.fixture
def npz(tmp_path, rng):
    x, y = clustered(rng)
    path = tmp_path / "emb.npz"
    np.savez(path, embeddings=x, labels=y)
    return path


@pytest.mark.parametrize("flags,expect", [
    (["--k", "4", "0"], "--k 0: every K must be a whole number >= 1"),
    (["--seed", "-1"], "--seed -1: expected a whole number >= 0"),
    (["--chunk-size", "0"], "--chunk-size 0: expected a whole number >= 1"),
    (["--kmeans-restarts", "0"], "--kmeans-restarts 0: expected a whole number >= 1"),
    (["--metrics", "mAP"], "--metrics: unknown metric(s) ['mAP']"),
])
def test_bad_flags_are_named_before_the_file_is_read(tmp_path, capsys, flags, expect):
    """They were reported as errors of the .npz ('emb.npz: expected non-negative integer'),
    after loading it; a file that does not exist shows they are checked first."""
    err = one_line_error(capsys, ["evaluate", str(tmp_path / "absent.npz"), "--device", "cpu", *flags],
                         expect=expect)
    assert "absent.npz" not in err


def test_object_array_names_file_and_key(tmp_path, capsys):
    path = tmp_path / "obj.npz"
    np.savez(path, embeddings=np.array([[1, "a"]] * 4, dtype=object), labels=np.arange(4))
    one_line_error(capsys, ["evaluate", str(path), "--device", "cpu"],
                   expect=f"{path}: array 'embeddings' cannot be read (Object arrays cannot be loaded")


def test_failed_evaluation_leaves_no_output_folder(tmp_path, capsys, rng):
    one = tmp_path / "one.npz"
    np.savez(one, embeddings=rng.normal(size=(10, 4)).astype(np.float32), labels=np.zeros(10, int))
    out = tmp_path / "new" / "deeper" / "m.json"
    one_line_error(capsys, ["evaluate", str(one), "--device", "cpu", "--out", str(out)], expect="single class")
    assert not (tmp_path / "new").exists()


def test_fit_embeddings_are_checked_as_their_own_file(npz, tmp_path, capsys, rng):
    x = np.load(npz)["embeddings"]
    nan = tmp_path / "nan.npz"
    np.savez(nan, embeddings=np.full((30, 8), np.nan, np.float32), labels=np.arange(30))
    err = one_line_error(capsys, ["evaluate", str(npz), "--device", "cpu", "--postprocess", "whiten:fit=train,dim=4",
                                  "--fit-embeddings", str(nan)], expect=f"{nan}: 'embeddings' contain NaN")
    assert f"{npz}:" not in err  # it was blamed on the evaluated file
    narrow = tmp_path / "narrow.npz"
    np.savez(narrow, embeddings=rng.normal(size=(30, 5)).astype(np.float32))
    one_line_error(capsys, ["evaluate", str(npz), "--device", "cpu", "--postprocess", "whiten:fit=train,dim=4",
                            "--fit-embeddings", str(narrow)], expect="'embeddings' have 5 columns but the evaluated")
    # a fit set needs no labels; the result is the library's with that fit set
    fit = rng.normal(size=(50, 8)).astype(np.float32)
    unlabelled = tmp_path / "fit.npz"
    np.savez(unlabelled, embeddings=fit)
    out = tmp_path / "m.json"
    assert main(["evaluate", str(npz), "--device", "cpu", "--metrics", "recall", "map@r", "--postprocess",
                 "whiten:fit=train,dim=4", "--fit-embeddings", str(unlabelled), "--out", str(out)]) == 0
    want = evaluate(x, np.load(npz)["labels"], metrics=["recall", "map@r"],
                    postprocess=[{"name": "whiten", "dim": 4, "fit": "train"}], fit_sets={"train": fit})
    assert json.loads(out.read_text()) == pytest.approx(want)
    # given without the step that reads it, it was ignored without a word
    capsys.readouterr()
    one_line_error(capsys, ["evaluate", str(npz), "--device", "cpu", "--fit-embeddings", str(unlabelled)],
                   expect="only the step whiten:fit=train reads it")


def test_whitening_wider_than_the_gallery_from_the_command_line(tmp_path, capsys, rng):
    small = tmp_path / "small.npz"
    np.savez(small, embeddings=rng.normal(size=(6, 8)).astype(np.float32), labels=np.array([0, 0, 1, 1, 2, 2]))
    one_line_error(capsys, ["evaluate", str(small), "--device", "cpu", "--postprocess", "whiten:dim=8"],
                   expect=f"{small}: whiten: dim=8 is more than a fit set of 6 row(s) spans")


def test_warnings_are_one_line_notes(tmp_path, capsys, rng):
    """'1 query has no same-label reference' came as Python's 'file.py:79: UserWarning' plus
    the source line of the call."""
    path = tmp_path / "lonely.npz"
    np.savez(path, embeddings=rng.normal(size=(5, 4)).astype(np.float32), labels=np.array([0, 0, 1, 1, 2]))
    assert main(["evaluate", str(path), "--device", "cpu", "--metrics", "recall"]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"deepmetric evaluate: note: {path}: 1 query has no same-label reference "
                                    "in the gallery; it is excluded from the retrieval metrics")
    assert "queries_without_positive  1" in captured.out

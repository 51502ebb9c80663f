"""deepmetric.report: the numbers behind every figure against plain independent
computations (closed forms, brute-force loops), files written, tolerant log reading."""
import json
import math

import numpy as np
import pytest
import yaml

from deepmetric.cli import main
from deepmetric.report import (
    embedding_2d,
    gradient_norm_vs_alpha,
    make_report,
    misclassified_neighbours,
    pair_cosine_histograms,
    read_training_log as read_log,
    select_paper_samples,
    synthetic_paper_samples,
)
from deepmetric.report import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path):
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 2000


def _normalise(a):
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def _eq3_grad_norm(f, W, y, alpha, b=None, bias_inside=True):
    """Heated-up Eq. 3 on normalised f (k,) and W (C, k), written out term by term;
    p from Eq. 1 with the bias inside (alpha * (w.f + b)) or outside the temperature."""
    f, W = _normalise(f), _normalise(W)
    z = np.array([alpha * W[m] @ f for m in range(len(W))])
    if b is not None:
        z = z + (alpha * b if bias_inside else b)
    e = np.exp(z - z.max())
    p = e / e.sum()
    g = np.zeros_like(f)
    for m in range(len(W)):
        g += alpha * (p[m] - (1.0 if m == y else 0.0)) * W[m]
    return np.linalg.norm(g)


# --------------------------------------------------------------------------- Fig. 1
def test_grad_norm_curve_equals_eq3_closed_form(rng):
    W = rng.standard_normal((7, 5))
    f = rng.standard_normal((6, 5)) * 3.0  # not normalised: the function normalises
    y = rng.integers(0, 7, 6)
    b = rng.standard_normal(7) * 0.1
    alphas = [0.0, 0.5, 1, 4, 16, 64]
    for inside in (True, False):
        got = gradient_norm_vs_alpha(f, y, alphas, weights=W, bias=b, alpha_scales_bias=inside)
        want = np.array([[_eq3_grad_norm(f[i], W, y[i], a, b, inside) for a in alphas] for i in range(6)])
        assert got.shape == (6, len(alphas))
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
        assert np.all(got[:, 0] == 0)  # alpha = 0: no gradient at all


def test_grad_norm_paper_properties_on_synthetic_samples():
    W, x, y = synthetic_paper_samples(num_classes=10, dim=32, seed=1)
    kinds = select_paper_samples(x, y, W)
    assert kinds == {"incorrect": 0, "boundary": 1, "centroid": 2}
    alphas = np.geomspace(1e-3, 1e3, 40)
    g = gradient_norm_vs_alpha(x, y, alphas, weights=W)
    # Property 1: vanishes as alpha -> 0 for every sample
    assert np.all(g[:, 0] < 1e-2)
    # Property 2: correct samples -> 0, incorrect -> infinity as alpha grows
    assert g[1, -1] < 1e-6 and g[2, -1] < 1e-6
    assert g[0, -1] > 100 and np.all(np.diff(g[0, -10:]) > 0)
    # the boundary sample's peak sits at a larger alpha than the centroid's (Fig. 1 b-c)
    assert alphas[np.argmax(g[1])] > alphas[np.argmax(g[2])]


def test_grad_norm_through_trained_heated_softmax_loss(rng):
    import torch
    from deepmetric.losses import HeatedSoftmaxLoss

    loss = HeatedSoftmaxLoss(num_classes=5, embedding_dim=6, alpha=16.0)
    with torch.no_grad():
        loss.bias.copy_(torch.as_tensor(rng.standard_normal(5) * 0.2))
    loss.train()
    W = loss.weight.detach().double().numpy()
    bias = loss.bias.detach().double().numpy()
    f = rng.standard_normal((4, 6))
    y = np.array([0, 1, 2, 4])
    alphas = [0.5, 4.0, 16.0]
    got = gradient_norm_vs_alpha(f, y, alphas, loss=loss)
    want = np.array([[_eq3_grad_norm(f[i], W, y[i], a, bias) for a in alphas] for i in range(4)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # the loss computes in float32
    assert loss.alpha == 16.0 and loss.training  # state restored


def test_gradient_norm_vs_alpha_restores_a_learnable_alpha(rng):
    """A learnable alpha is a Parameter changed in place during the sweep: the value before
    the sweep (not the last alpha of the sweep) must be put back."""
    from deepmetric.losses import HeatedSoftmaxLoss

    loss = HeatedSoftmaxLoss(num_classes=3, embedding_dim=4, alpha=7.5, learnable_alpha=True)
    got = gradient_norm_vs_alpha(rng.standard_normal((3, 4)), [0, 1, 2], [1.0, 32.0], loss=loss)
    assert got.shape == (3, 2) and float(loss.alpha) == 7.5


def test_select_paper_samples_against_bruteforce_margins(rng):
    W = rng.standard_normal((4, 3))
    x = rng.standard_normal((50, 3))
    y = rng.integers(0, 4, 50)
    Wn, xn = _normalise(W), _normalise(x)
    margins = []
    for i in range(50):
        z = [xn[i] @ Wn[m] for m in range(4)]
        margins.append(z[y[i]] - max(z[m] for m in range(4) if m != y[i]))
    margins = np.array(margins)
    got = select_paper_samples(x, y, W)
    assert margins[got["boundary"]] == min(m for m in margins if m > 0)
    assert margins[got["centroid"]] == max(margins)
    assert margins[got["incorrect"]] <= 0
    wrong = sorted(m for m in margins if m <= 0)
    assert margins[got["incorrect"]] == wrong[(len(wrong) - 1) // 2]


def test_grad_norm_rejects_bad_input(rng):
    with pytest.raises(ValueError, match="weights"):
        gradient_norm_vs_alpha(rng.standard_normal((2, 3)), [0, 1], [1.0], weights=rng.standard_normal((3, 2)))
    with pytest.raises(ValueError, match="labels"):
        gradient_norm_vs_alpha(rng.standard_normal((2, 3)), [0, 5], [1.0], weights=rng.standard_normal((2, 3)))
    with pytest.raises(ValueError, match="either loss"):
        gradient_norm_vs_alpha(rng.standard_normal((2, 3)), [0, 1], [1.0])


# --------------------------------------------------------------------------- Fig. 4
def _bruteforce_hist(x, y, edges):
    xn = _normalise(x.astype(np.float32))
    same, diff = [], []
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            (same if y[i] == y[j] else diff).append(min(1.0, max(-1.0, float(xn[i] @ xn[j]))))
    return np.histogram(same, bins=edges)[0], np.histogram(diff, bins=edges)[0]


@pytest.mark.parametrize("chunk", [None, 7])
def test_pair_histograms_exact_equal_bruteforce(rng, chunk):
    x = rng.standard_normal((70, 4))
    y = rng.integers(0, 6, 70)
    h = pair_cosine_histograms(x, y, bins=20, chunk_size=chunk)
    s, d = _bruteforce_hist(x, y, h["edges"])
    assert h["exact"]
    np.testing.assert_array_equal(h["same"], s)
    np.testing.assert_array_equal(h["diff"], d)
    assert h["n_same_pairs"] + h["n_diff_pairs"] == 70 * 69 // 2
    width = np.diff(h["edges"])
    assert np.isclose((h["same_density"] * width).sum(), 1) and np.isclose((h["diff_density"] * width).sum(), 1)


def test_pair_histograms_sampled_keeps_all_rare_same_pairs(rng):
    # SOP-like: many classes, few images each -> same-class pairs are rare but all counted
    y = np.repeat(np.arange(100), 3)
    x = rng.standard_normal((300, 8)) + 2.0 * rng.standard_normal((100, 8))[y]
    h = pair_cosine_histograms(x, y, bins=25, max_pairs=5000, seed=3)
    s, d = _bruteforce_hist(x, y, h["edges"])
    assert not h["exact"] and h["same_exact"] and not h["diff_exact"]
    np.testing.assert_array_equal(h["same"], s)
    assert h["n_diff_counted"] == 5000
    # the sampled different-class histogram estimates the exact one: compare means
    mids = (h["edges"][:-1] + h["edges"][1:]) / 2
    assert abs(mids @ h["diff"] / h["diff"].sum() - mids @ d / d.sum()) < 0.02


def test_pair_histograms_sampled_same_pairs(rng):
    y = rng.integers(0, 3, 400)
    x = rng.standard_normal((400, 5)) + np.eye(5)[y] * 1.5
    h = pair_cosine_histograms(x, y, bins=20, max_pairs=4000, seed=0)
    s, d = _bruteforce_hist(x, y, h["edges"])
    assert not h["same_exact"] and h["n_same_counted"] == 4000 and h["n_diff_counted"] == 4000
    mids = (h["edges"][:-1] + h["edges"][1:]) / 2
    assert abs(mids @ h["same"] / 4000 - mids @ s / s.sum()) < 0.03
    assert abs(mids @ h["diff"] / 4000 - mids @ d / d.sum()) < 0.03


def test_pair_histograms_single_class_and_bad_input(rng):
    h = pair_cosine_histograms(rng.standard_normal((5, 3)), np.zeros(5, int), bins=4)
    assert h["same"].sum() == 10 and h["diff"].sum() == 0 and np.all(h["diff_density"] == 0)
    with pytest.raises(ValueError, match="2 embeddings"):
        pair_cosine_histograms(rng.standard_normal((1, 3)), [0])
    with pytest.raises(ValueError, match="3 embeddings"):
        pair_cosine_histograms(rng.standard_normal((3, 3)), [0, 1])
    with pytest.raises(ValueError, match="NaN"):
        pair_cosine_histograms(np.full((3, 2), np.nan), [0, 1, 1])


# --------------------------------------------------------------------------- Fig. 2
def test_embedding_2d_passthrough_normalise_and_pca(rng):
    x2 = rng.standard_normal((30, 2)) * 5
    xy, _ = embedding_2d(x2)
    np.testing.assert_array_equal(xy, x2)
    xy, _ = embedding_2d(x2, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(xy, axis=1), 1.0)
    x = rng.standard_normal((40, 6)) * np.array([5, 3, 1, 0.5, 0.2, 0.1])
    xy, what = embedding_2d(x)
    xc = x - x.mean(0)
    _, _, vt = np.linalg.svd(xc, full_matrices=False)
    ref = xc @ vt[:2].T
    for c in range(2):  # principal axes are defined up to sign
        assert np.allclose(xy[:, c], ref[:, c], atol=1e-8) or np.allclose(xy[:, c], -ref[:, c], atol=1e-8)
    assert "PCA" in what


# --------------------------------------------------------------------------- two-head Sec. 4.3
def test_misclassified_neighbours_against_bruteforce(rng):
    xtr = rng.standard_normal((40, 6))
    ytr = rng.integers(0, 5, 40)
    xte = rng.standard_normal((25, 6))
    yte = rng.integers(0, 5, 25)
    logits = rng.standard_normal((25, 5))
    pred = logits.argmax(1)
    res = misclassified_neighbours(xtr, ytr, xte, yte, logits)
    wrong = [i for i in range(25) if pred[i] != yte[i]]
    nn = []
    for i in wrong:
        cos = [xte[i] @ xtr[j] / np.linalg.norm(xte[i]) / np.linalg.norm(xtr[j]) for j in range(40)]
        nn.append(int(np.argmax(cos)))
    assert res["misclassified"].tolist() == wrong
    assert res["neighbour"].tolist() == nn
    assert res["n_misclassified"] == len(wrong)
    assert res["share_neighbour_is_predicted"] == pytest.approx(np.mean([ytr[j] == pred[i] for i, j in zip(wrong, nn)]))
    assert res["share_neighbour_is_true"] == pytest.approx(np.mean([ytr[j] == yte[i] for i, j in zip(wrong, nn)]))
    none = misclassified_neighbours(xtr, ytr, xte, yte, yte)
    assert none["n_misclassified"] == 0 and math.isnan(none["share_neighbour_is_predicted"])


# --------------------------------------------------------------------------- recall curve
def test_recall_curve_against_bruteforce(rng):
    from deepmetric.report import recall_curve

    x = rng.standard_normal((60, 4))
    y = rng.integers(0, 6, 60)
    got = recall_curve(x, y, ks=(1, 2, 4, 8))
    xn = _normalise(x)
    sims = xn @ xn.T
    np.fill_diagonal(sims, -np.inf)  # the query itself is excluded by index
    order = np.argsort(-sims, axis=1, kind="stable")
    for k in (1, 2, 4, 8):
        want = np.mean([np.any(y[order[i, :k]] == y[i]) for i in range(60)])
        assert got[k] == pytest.approx(want)


# --------------------------------------------------------------------------- log reader
def _write_log(path, records, tail=""):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n" + tail)


def test_read_log_tolerates_missing_keys_and_truncated_tail(tmp_path):
    p = tmp_path / "log.jsonl"
    _write_log(p, [
        {"type": "step", "step": 1, "epoch": 0, "loss": 2.0, "lr": 0.1},
        {"type": "step", "step": 2, "epoch": 0, "loss": 1.5},          # no lr / alpha
        {"step": 3, "epoch": 1, "loss": 1.0, "alpha": 4.0},           # no type: a step
        {"type": "eval", "epoch": 1, "recall@1": 0.5},                 # no nmi, no step
        {"epoch": 2, "recall@1": 0.6, "nmi": 0.4},                    # no type: an eval
        {"type": "checkpoint", "path": "last.pt"},
    ], tail='{"type": "step", "st')
    with pytest.warns(UserWarning, match="truncated"):
        log = read_log(p)
    assert len(log.steps) == 3 and len(log.evals) == 2 and len(log.other) == 1
    np.testing.assert_array_equal(log.column("step", "loss"), [2.0, 1.5, 1.0])
    lr = log.column("step", "lr")
    assert lr[0] == 0.1 and np.isnan(lr[1:]).all()
    assert np.isnan(log.column("eval", "nmi")[0]) and log.column("eval", "nmi")[1] == 0.4
    assert log.metric_keys() == ["recall@1", "nmi"]
    out = plots.plot_training_curves(log, tmp_path / "curves.png")
    assert _is_png(out)


def test_read_log_errors_name_file_and_line(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_text('{"type": "step", "loss": 1}\nnot json\n{"type": "step", "loss": 2}\n')
    with pytest.raises(ValueError, match=r"log.jsonl:2"):
        read_log(p)
    with pytest.raises(FileNotFoundError, match="nope"):
        read_log(tmp_path / "nope.jsonl")


def test_training_curves_on_empty_log(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_text("")
    assert _is_png(plots.plot_training_curves(p, tmp_path / "c.png"))


# --------------------------------------------------------------------------- run report + CLI
def _fake_run(tmp_path, rng, with_log=True):
    run = tmp_path / "run1"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "name": "toy", "description": "toy run", "data": {"name": "synthetic", "options": {"num_classes": 4}},
        "loss": [{"name": "heated_softmax", "weight": 1.0, "options": {"alpha": 16}}],
        "train": {"epochs": 2, "batch_size": 8, "sampler": "random"},
    }))
    if with_log:
        recs = [{"type": "step", "step": s, "epoch": s // 5, "loss": 3 - 0.1 * s, "lr": 0.01,
                 "alpha": 16.0 if s < 7 else 4.0} for s in range(10)]
        recs += [{"type": "eval", "epoch": 0, "step": 5, "eval_seconds": 0.5, "recall@1": 0.3, "nmi": 0.2},
                 {"type": "heat_up", "epoch": 1, "step": 7, "alpha": [4.0], "lr_factor": 0.1},
                 {"type": "eval", "epoch": 1, "step": 10, "recall@1": 0.4, "nmi": 0.25, "alpha": 4.0}]
        _write_log(run / "log.jsonl", recs)
    C, d = 4, 3
    centres = rng.standard_normal((C, d)) * 2
    ytr = np.repeat(np.arange(C), 10)
    yte = np.repeat(np.arange(C), 6)
    xtr = centres[ytr] + rng.standard_normal((40, d))
    xte = centres[yte] + rng.standard_normal((24, d))
    logits = xte @ centres.T + rng.standard_normal((24, C))
    np.savez(run / "emb.npz", embeddings=xte, labels=yte, train_embeddings=xtr, train_labels=ytr,
             class_weights=centres, logits=logits)
    return run, dict(xtr=xtr, ytr=ytr, xte=xte, yte=yte, logits=logits)


def test_make_report_writes_figures_and_numbers(tmp_path, rng):
    run, d = _fake_run(tmp_path, rng)
    report = make_report(run, run / "emb.npz", max_pairs=10_000)
    assert report == run / "report" / "report.md"
    text = report.read_text()
    for name in ("training_curves.png", "cosine_histograms.png", "embedding_2d.png", "grad_norm_alpha.png",
                 "recall_at_k.png"):
        assert _is_png(run / "report" / name), name
        assert f"({name})" in text
    assert "R@1" in text
    # classification numbers equal a direct computation
    acc = np.mean(d["logits"].argmax(1) == d["yte"])
    assert f"top-1 accuracy {100 * acc:.2f} %" in text
    res = misclassified_neighbours(d["xtr"], d["ytr"], d["xte"], d["yte"], d["logits"])
    assert f"{res['n_misclassified']} of 24 test images misclassified" in text
    assert "| epoch | recall@1 | nmi |" in text  # bookkeeping keys are not metrics
    assert "| 1 | 40.00* | 25.00* |" in text  # best evaluation row marked
    assert "alpha: start 16, end 4" in text
    assert "> toy run" in text


def test_make_report_without_log_or_embeddings(tmp_path, rng):
    run, _ = _fake_run(tmp_path, rng, with_log=False)
    report = make_report(run)
    assert "no `log.jsonl`" in report.read_text()
    with pytest.raises(FileNotFoundError, match="run directory"):
        make_report(tmp_path / "missing")


def test_make_report_rejects_bad_npz(tmp_path, rng):
    run, _ = _fake_run(tmp_path, rng, with_log=False)
    np.savez(run / "bad.npz", embeddings=np.zeros((3, 2)))
    with pytest.raises(ValueError, match="missing array 'labels'"):
        make_report(run, run / "bad.npz")
    np.savez(run / "bad2.npz", embeddings=np.zeros((3, 2)), labels=np.zeros(4, int))
    with pytest.raises(ValueError, match="'labels' has 4 rows"):
        make_report(run, run / "bad2.npz")


def test_cli_report(tmp_path, rng, capsys):
    run, _ = _fake_run(tmp_path, rng)
    assert main(["report", str(run), "--out", str(tmp_path / "o")]) == 0
    assert "report written to" in capsys.readouterr().out
    assert (tmp_path / "o" / "report.md").is_file() and _is_png(tmp_path / "o" / "training_curves.png")
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "run directory not found" in capsys.readouterr().err


def test_report_of_a_real_training_run(tmp_path):
    """The report reads what the training loop and `deepmetric embed` actually write."""
    from deepmetric.run.config_io import load_config
    from deepmetric.run.embed import embed_checkpoint
    from deepmetric.train import train

    cfg = load_config(None, [
        "data.name=synthetic", "data.options={num_classes: 6, per_class: 8, dim: 12}",
        "model.name=synthetic_mlp", "model.options={in_dim: 12, embedding_dim: 8}",
        "loss.0.name=heated_softmax", "loss.0.options={alpha: 16.0, normalize_features: true}",
        "schedule.temperature={name: heat_up, at: 2}", "train.epochs=3", "train.batch_size=12",
        "train.progress=false", "train.device=cpu", f"train.out_dir={tmp_path / 'run'}",
        "eval.metrics=[recall]", "eval.every=3",
    ])
    train(cfg)
    emb = embed_checkpoint(tmp_path / "run" / "last.pt", tmp_path / "run" / "embeddings.npz", device="cpu")
    report = make_report(tmp_path / "run")  # picks up RUN_DIR/embeddings.npz by itself
    text = report.read_text()
    log = read_log(tmp_path / "run" / "log.jsonl")
    assert len(log.steps) == 3 * (48 // 12) and log.heat_up_steps()
    assert "alpha: start 16, end 4" in text and "| heated_softmax" not in text
    assert "1.0 x heated_softmax" in text and "recall@1" in text
    with np.load(emb) as z:
        assert f"`embeddings.npz`: {z['embeddings'].shape[0]} x 8" in text
    for name in ("training_curves.png", "recall_at_k.png", "cosine_histograms.png", "embedding_2d.png"):
        assert _is_png(tmp_path / "run" / "report" / name), name


# --------------------------------------------------------------------------- retrieval grids
def test_retrieval_examples_against_bruteforce(rng):
    from deepmetric.report import per_class_recall, retrieval_examples

    x = rng.standard_normal((50, 5))
    y = rng.integers(0, 5, 50)
    ex = retrieval_examples(x, y, k=8, n_random=6, n_worst=7, seed=1)
    xn = _normalise(x)
    sims = xn @ xn.T
    np.fill_diagonal(sims, -np.inf)
    order = np.argsort(-sims, axis=1, kind="stable")[:, :8]
    n_correct = (y[order] == y[:, None]).sum(1)
    assert len(ex["random"]) == 6 and len(set(ex["random"])) == 6 and len(ex["worst"]) == 7
    for q in ex["random"] + ex["worst"]:
        assert ex["neighbours"][q].tolist() == order[q].tolist()
        np.testing.assert_allclose(ex["similarity"][q], sims[q, order[q]], rtol=1e-5)
        assert ex["correct"][q].tolist() == (y[order[q]] == y[q]).tolist()
        assert ex["n_correct"][q] == n_correct[q]
    # worst: fewest correct, ties by the most confident (highest) first similarity
    want = sorted(range(50), key=lambda i: (n_correct[i], -sims[i, order[i, 0]]))[:7]
    assert ex["worst"] == want
    # per-class Recall@1 = mean over each class's queries of "top-1 shares the label"
    pcr = per_class_recall(x, y)
    for c, r, n in zip(pcr["classes"], pcr["recall"], pcr["n_queries"]):
        qs = np.flatnonzero(y == c)
        assert n == len(qs) and r == pytest.approx(np.mean(y[order[qs, 0]] == c))


def test_retrieval_examples_query_gallery(rng):
    from deepmetric.report import retrieval_examples

    x = rng.standard_normal((30, 4))
    y = rng.integers(0, 3, 30)
    is_q = np.arange(30) < 10
    ex = retrieval_examples(x, y, k=5, n_random=10, n_worst=0, is_query=is_q, is_gallery=~is_q)
    xn = _normalise(x)
    for q in ex["random"]:
        assert q < 10
        want = 10 + np.argsort(-(xn[10:] @ xn[q]), kind="stable")[:5]
        assert ex["neighbours"][q].tolist() == want.tolist()


# --------------------------------------------------------------------------- val / test / baselines
def _split_run(tmp_path):
    run = tmp_path / "split_run"
    run.mkdir()
    recs = [{"type": "step", "step": s, "epoch": s / 4, "loss": 2 - 0.1 * s, "lr": 0.1} for s in range(8)]
    recs += [{"type": "baseline", "name": "raw pixels", "split": "test", "recall@1": 0.21, "nmi": 0.11},
             {"type": "eval", "epoch": 1, "split": "val", "recall@1": 0.40, "nmi": 0.30},
             {"type": "eval", "epoch": 1, "split": "test", "recall@1": 0.35, "nmi": 0.20},
             {"type": "eval", "epoch": 2, "split": "val", "recall@1": 0.38, "nmi": 0.32},
             {"type": "eval", "epoch": 2, "split": "test", "recall@1": 0.45, "nmi": 0.25}]
    _write_log(run / "log.jsonl", recs)
    (run / "metrics.json").write_text(json.dumps({
        "final": {"val": {"recall@1": 0.38, "nmi": 0.32}, "test": {"recall@1": 0.45, "nmi": 0.25}},
        "selected": {"epoch": 1, "metric": "recall@1", "split": "val", "val": {"recall@1": 0.40},
                     "test": {"recall@1": 0.35}},
        "baselines": {"raw_pixels": {"test": {"recall@1": 0.21}}, "epoch_0": {"recall@1": 0.12}},
        "best": {"metric": "recall@1", "value": 0.40, "epoch": 1}}))
    return run


def test_report_marks_validation_test_and_baselines(tmp_path):
    run = _split_run(tmp_path)
    text = make_report(run).read_text()
    # best per split: val at epoch 1 (40 > 38), test at epoch 2 (45 > 35) - never mixed
    assert "| epoch 1 | val | 40.00* | 30.00 |" in text
    assert "| epoch 2 | val | 38.00 | 32.00* |" in text
    assert "| epoch 1 | test | 35.00 | 20.00 |" in text
    assert "| epoch 2 | test | 45.00* | 25.00* |" in text
    assert "| baseline: raw pixels | test | 21.00 | 11.00 |" in text
    # metrics.json: final and selected rows per split, baselines of either nesting
    assert "| final | val | 38.00 | 32.00 |" in text and "| final | test | 45.00 | 25.00 |" in text
    assert "| selected (epoch 1, metric recall@1) | val | 40.00 |" in text
    assert "| baseline: raw_pixels | test | 21.00 |" in text and "| baseline: epoch_0 |  | 12.00 |" in text
    html = (run / "report" / "report.html").read_text()
    assert html.count('<span class="badge val">val</span>') == 2 + 1 + 1  # log x2, final, selected
    assert '<tr class="baseline" data-split="test">' in html
    # the curves draw val dashed and test solid, labelled by split
    from deepmetric.report import read_training_log as read_log
    import matplotlib.pyplot as plt

    captured = {}
    orig = plots._save

    def grab(fig, out):
        captured["labels"] = [(ln.get_label(), ln.get_linestyle()) for ax in fig.axes for ln in ax.get_lines()]
        return orig(fig, out)

    plots._save = grab
    try:
        plots.plot_training_curves(read_log(run / "log.jsonl"), tmp_path / "c.png")
    finally:
        plots._save = orig
    labels = dict(captured["labels"])
    assert labels["recall@1 (val)"] == "--" and labels["recall@1 (test)"] == "-"
    assert labels["recall@1: raw pixels (test)"] == ":"
    plt.close("all")


def test_report_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a training run.*cat.jpg"):
        make_report(tmp_path / "photos")
    assert not (tmp_path / "photos" / "report").exists()  # nothing written
    assert main(["report", str(tmp_path / "photos")]) == 2
    assert "is not a training run" in capsys.readouterr().err


def test_embedding_plot_names_classes_and_stays_readable(tmp_path, rng):
    captured = {}
    orig = plots._save

    def grab(fig, out):
        ax = fig.axes[0]
        leg = ax.get_legend()
        captured["legend"] = [t.get_text() for t in leg.get_texts()] if leg else None
        captured["notes"] = [t.get_text() for t in ax.texts]
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        captured["boxes"] = [t.get_bbox_patch().get_window_extent(r) for t in ax.texts]
        return orig(fig, out)

    plots._save = grab
    try:
        y = np.repeat(np.arange(5), 4)
        plots.plot_embedding_2d(rng.standard_normal((20, 6)), y, tmp_path / "a.png",
                                class_names=["cat", "dog", "owl", "eel", "yak"])
        assert captured["legend"] == ["cat", "dog", "owl", "eel", "yak"]
        y = np.repeat(np.arange(300), 3)
        plots.plot_embedding_2d(rng.standard_normal((900, 6)), y, tmp_path / "b.png",
                                class_names=[f"c{i}" for i in range(300)], max_annotations=40)
        assert captured["legend"] is None and 10 <= len(captured["notes"]) <= 40
        assert all(t.startswith("c") for t in captured["notes"])
        boxes = captured["boxes"]  # the class names written on the plot do not overlap
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), "class-name labels overlap"
    finally:
        plots._save = orig


def test_cosine_histogram_ticks_do_not_overlap(tmp_path, rng):
    captured = {}
    orig = plots._save

    def grab(fig, out):
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(r) for ax in fig.axes for t in ax.get_xticklabels() if t.get_text()]
        captured["boxes"] = boxes
        return orig(fig, out)

    h = pair_cosine_histograms(rng.standard_normal((40, 4)), rng.integers(0, 4, 40))
    plots._save = grab
    try:
        plots.plot_cosine_histograms({"train": h, "test": h}, tmp_path / "h.png")
    finally:
        plots._save = orig
    boxes = captured["boxes"]
    assert len(boxes) == 10
    for a, b in zip(boxes, boxes[1:]):
        if abs(a.y0 - b.y0) < 1 and b.x0 > a.x0:  # neighbours on one axis
            assert b.x0 >= a.x1, "tick labels overlap"


def test_report_embeds_with_the_checkpoint_when_no_npz(tmp_path):
    """Without an .npz the report embeds the test split with last.pt itself; its Recall@K
    equals deepmetric.evaluate on embeddings computed independently from the checkpoint."""
    import re

    from deepmetric.evaluate import evaluate
    from deepmetric.run.config_io import load_config
    from deepmetric.run.embed import embed_checkpoint
    from deepmetric.train import train

    cfg = load_config(None, [
        "data.name=synthetic", "data.options={num_classes: 5, per_class: 6, dim: 10}",
        "model.name=synthetic_mlp", "model.options={in_dim: 10, embedding_dim: 6}",
        "loss.0.name=triplet", "train.epochs=1", "train.batch_size=10", "train.progress=false",
        "train.device=cpu", f"train.out_dir={tmp_path / 'run'}", "eval.metrics=[recall]",
    ])
    train(cfg)
    run = tmp_path / "run"
    (run / "best.pt").unlink(missing_ok=True)
    assert main(["report", str(run), "--device", "cpu", "--queries", "3", "--top-k", "4"]) == 0
    html = (run / "report" / "report.html").read_text()
    emb = embed_checkpoint(run / "last.pt", tmp_path / "e.npz", device="cpu")
    with np.load(emb) as z:
        want = evaluate(z["embeddings"], z["labels"], ks=(1, 2), metrics=["recall"])
    row = re.search(r'<table class="metrics" id="recall-table">.*?</table>', html, re.S).group(0)
    assert f"<td>{100 * want['recall@1']:.2f}</td><td>{100 * want['recall@2']:.2f}</td>" in row
    # synthetic vectors have no images: tiles say so; 3 + 3 rows of 4 neighbours
    assert html.count('class="row"') == 6 and html.count('class="noimg"') == 6 * 5
    # --no-embed: log and metrics only
    assert main(["report", str(run), "--no-embed", "--out", str(tmp_path / "o")]) == 0
    assert 'id="grid-random"' not in (tmp_path / "o" / "report.html").read_text()


def test_report_html_escapes_class_names(tmp_path, rng):
    run, _ = _fake_run(tmp_path, rng, with_log=False)
    with np.load(run / "emb.npz") as z:
        data = dict(z)
    data["class_names"] = np.array(["<script>alert(1)</script>", "a&b", "c", "d"])
    np.savez(run / "named.npz", **data)
    make_report(run, run / "named.npz", max_pairs=10_000)
    html = (run / "report" / "report.html").read_text()
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "a&amp;b" in html


def test_report_without_the_dataset_still_reports_the_log(tmp_path, rng):
    """A run whose data is not on this machine: the page says why there are no grids."""
    import torch  # noqa: F401
    from deepmetric.run.config_io import load_config
    from deepmetric.train import train

    cfg = load_config(None, [
        "data.name=synthetic", "data.options={num_classes: 4, per_class: 5, dim: 6}",
        "model.name=synthetic_mlp", "model.options={in_dim: 6, embedding_dim: 4}",
        "loss.0.name=triplet", "train.epochs=1", "train.batch_size=10", "train.progress=false",
        "train.device=cpu", f"train.out_dir={tmp_path / 'run'}", "eval.metrics=[recall]",
    ])
    train(cfg)
    run = tmp_path / "run"
    text = (run / "config.yaml").read_text().replace("dim: 6", "dim: 7")  # a different dataset
    (run / "config.yaml").write_text(text)
    assert not (run / "best.pt").exists()  # no validation classes: nothing is selected
    state = torch.load(run / "last.pt", weights_only=True)  # its stored config names the data too
    state["config"]["data"]["options"]["dim"] = 7
    torch.save(state, run / "last.pt")
    with pytest.warns(UserWarning, match="embedding with last.pt failed"):
        md = make_report(run)
    assert "embedding with last.pt failed" in md.read_text()
    assert "embedding with last.pt failed" in (run / "report" / "report.html").read_text()
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        make_report(run, checkpoint=run / "nope.pt")
    # a split asked for (report --split bogus) is the error, not a page without embeddings
    before = (run / "report" / "report.html").read_bytes()
    state["config"]["data"]["options"]["dim"] = 6
    torch.save(state, run / "last.pt")
    with pytest.raises(ValueError, match=r"synthetic: split must be train, test, query or gallery, got 'bogus'"):
        make_report(run, split="bogus")
    assert (run / "report" / "report.html").read_bytes() == before  # the last page is kept


def test_report_of_a_query_gallery_run(tmp_path):
    """In-shop style runs (eval.gallery_split): queries ranked against the gallery only."""
    import re

    from deepmetric.run.config_io import load_config
    from deepmetric.train import train

    cfg = load_config(None, [
        "data.name=synthetic", "data.options={num_classes: 4, per_class: 6, dim: 6}",
        "model.name=synthetic_mlp", "model.options={in_dim: 6, embedding_dim: 4}",
        "loss.0.name=triplet", "train.epochs=1", "train.batch_size=8", "train.progress=false",
        "train.device=cpu", f"train.out_dir={tmp_path / 'run'}", "eval.metrics=[recall]",
        "eval.split=query", "eval.gallery_split=gallery",
    ])
    train(cfg)
    make_report(tmp_path / "run", n_queries=4, top_k=5)
    html = (tmp_path / "run" / "report" / "report.html").read_text()
    n_query = 4 * 6 // 2
    rows = re.findall(r'<div class="row" data-query="(\d+)"', html)
    assert len(rows) == 8 and all(int(q) < n_query for q in rows)
    tiles = [int(r) for r in re.findall(r'<figure class="tile (?:hit|miss)" data-row="(\d+)"', html)]
    assert len(tiles) == 8 * 5 and all(r >= n_query for r in tiles)


def test_recall_table_lists_logged_test_baselines(tmp_path, rng):
    import re

    run = _split_run(tmp_path)
    np.savez(run / "emb.npz", embeddings=rng.standard_normal((30, 4)), labels=np.repeat(np.arange(5), 6))
    make_report(run, run / "emb.npz")
    html = (run / "report" / "report.html").read_text()
    table = re.search(r'<table class="metrics" id="recall-table">.*?</table>', html, re.S).group(0)
    # the log's raw-pixel baseline (test) and metrics.json's test baselines; not the val one
    assert re.search(r"<th>baseline: raw pixels</th><td></td><td>21.00</td>", table)
    assert re.search(r"<th>baseline: raw_pixels</th><td></td><td>21.00</td>", table)
    assert "epoch_0" in table  # split not given: shown
    assert table.count('class="baseline"') == 3

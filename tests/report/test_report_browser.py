"""report.html in headless Chromium, from two tiny real training runs on a folder of images.

Zero-shot run (class_split half) and classifier run (split file, shared classes): the
report embeds the test split with last.pt by itself (no validation classes: no best.pt); the page must load without console
errors, every <img> must decode, and the retrieval grids / misclassified pairs must agree
with a brute-force cosine ranking of embeddings computed here independently.
"""
import re

import numpy as np
import pytest
from PIL import Image, ImageDraw

from browser import broken_images, open_page, requires_chromium
from deepmetric.report import make_report, misclassified_neighbours

pytestmark = requires_chromium

CLASSES = ["red disc", "green disc", "blue disc", "orange disc",
           "red bar", "green bar", "blue bar", "orange bar"]
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "orange": (240, 150, 20)}
PER_CLASS = 6


def _make_images(root, rng):
    for name in CLASSES:
        colour, shape = name.split()
        d = root / name.replace(" ", "_")
        d.mkdir(parents=True)
        for j in range(PER_CLASS):
            im = Image.new("RGB", (24, 24), (235, 235, 235))
            dr = ImageDraw.Draw(im)
            ox, oy = rng.integers(-3, 4, 2)
            if shape == "disc":
                dr.ellipse([5 + ox, 5 + oy, 18 + ox, 18 + oy], fill=COLOURS[colour])
            else:
                dr.rectangle([3 + ox, 9 + oy, 20 + ox, 14 + oy], fill=COLOURS[colour])
            a = np.asarray(im, dtype=np.int16) + rng.integers(-12, 13, (24, 24, 3))
            Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(d / f"{j}.png")


def _train(tmp, out, data_overrides, extra=()):
    from deepmetric.run.config_io import load_config
    from deepmetric.train import train

    cfg = load_config(None, [
        "data.name=folder", f"data.root={tmp / 'images'}", *data_overrides,
        "model.name=glyph_resnet",
        "model.options={in_chans: 3, embedding_dim: 16, widths: [8, 16], depths: [1, 1]}",
        "loss.0.name=heated_softmax", "loss.0.options={alpha: 16.0}",
        "train.epochs=2", "train.batch_size=8", "train.progress=false", "train.device=cpu",
        f"train.out_dir={out}", "eval.metrics=[recall]", "eval.every=1", *extra,
    ])
    train(cfg)
    return out


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser_runs")
    _make_images(tmp / "images", np.random.default_rng(0))
    return tmp


@pytest.fixture(scope="module")
def zero_shot_run(image_folder):
    tmp = image_folder
    return tmp, _train(tmp, tmp / "zero_shot", ["data.options={class_split: half}"])


@pytest.fixture(scope="module")
def classifier_run(image_folder):
    tmp = image_folder
    lines = [f"{'train' if j < 4 else 'test'} {c.replace(' ', '_')}/{j}.png"
             for c in CLASSES for j in range(PER_CLASS)]
    (tmp / "split.txt").write_text("\n".join(lines) + "\n")
    return tmp, _train(tmp, tmp / "classifier", [f"data.options={{split_file: {tmp / 'split.txt'}}}"],
                       ["eval.classification=true"])


def _embed(run, split):
    from deepmetric.run.embed import load_model_from_checkpoint
    from deepmetric.run.embed import compute_embeddings
    from deepmetric.run.builders import build_split as build_dataset_split

    model, losses, cfg, _ = load_model_from_checkpoint(run / "last.pt")
    r = compute_embeddings(model, build_dataset_split(cfg, split, train=False), with_logits=True,
                           loss_with_logits=losses[0])
    return r


def _grid(page, grid_id):
    return page.eval_on_selector_all(f"#{grid_id} .row", """rows => rows.map(r => ({
        query: +r.dataset.query, label: +r.dataset.label, correct: +r.dataset.correct,
        tiles: [...r.querySelectorAll('figure.hit, figure.miss')].map(t => ({
            row: +t.dataset.row, label: +t.dataset.label, hit: t.classList.contains('hit'),
            img: !!t.querySelector('img'), caption: t.querySelector('figcaption').innerText}))}))""")


def test_report_page_of_a_zero_shot_run(zero_shot_run):
    tmp, run = zero_shot_run
    make_report(run, max_pairs=10_000)  # embeds the test split with last.pt itself
    page_path = run / "report" / "report.html"
    assert page_path.is_file()
    ref = _embed(run, "test")
    x = ref["embeddings"] / np.linalg.norm(ref["embeddings"], axis=1, keepdims=True)
    y = ref["labels"]
    sims = x @ x.T
    np.fill_diagonal(sims, -np.inf)
    order = np.argsort(-sims, axis=1, kind="stable")[:, :8]
    n_correct = (y[order] == y[:, None]).sum(1)
    test_names = sorted(c.replace(" ", "_") for c in CLASSES)[len(CLASSES) // 2:]

    with open_page(page_path.as_uri()) as (page, errors):
        assert page.title() == f"Run report: {run.name}"
        imgs = page.eval_on_selector_all("img", "e => e.length")
        assert imgs > 40
        assert broken_images(page) == []
        for sid in ("summary", "metrics", "training", "recall", "cosine", "embedding", "grids",
                    "worst", "classes", "config"):
            assert page.locator(f"section#{sid}").count() == 1, sid
        random_rows, worst_rows = _grid(page, "grid-random"), _grid(page, "grid-worst")
        for rows in (random_rows, worst_rows):
            assert len(rows) == 8
            for r in rows:
                assert len(r["tiles"]) == 8 and all(t["img"] for t in r["tiles"])
                # the neighbours are the brute-force top-8 in order (equal up to float32
                # rounding: near-identical images of one class may swap places), right/wrong
                # marked by label
                q = r["query"]
                rows_shown = [t["row"] for t in r["tiles"]]
                assert q not in rows_shown and len(set(rows_shown)) == 8
                np.testing.assert_allclose(sims[q, rows_shown], sims[q, order[q]], atol=1e-4)
                for t in r["tiles"]:
                    assert t["label"] == y[t["row"]]
                    assert t["hit"] == (t["label"] == r["label"])
                    assert test_names[t["label"]] in t["caption"]
                assert r["correct"] == sum(t["hit"] for t in r["tiles"])
        assert len({r["query"] for r in random_rows}) == 8
        # worst queries: fewest correct first, none of the other queries does worse (the
        # count of a query can move by one where float32 near-ties straddle rank 8)
        worst_counts = [r["correct"] for r in worst_rows]
        assert worst_counts == sorted(worst_counts)
        assert worst_counts[0] <= min(r["correct"] for r in random_rows)
        assert abs(worst_counts[0] - n_correct.min()) <= 1
        # class names, not numbers, in the per-class table
        best = page.inner_text("#best-classes")
        assert any(n in best for n in test_names)
        page.screenshot(path=str(tmp / "zero_shot_report.png"), full_page=True)
    assert errors == []


def test_report_page_of_a_classifier_run(classifier_run):
    tmp, run = classifier_run
    make_report(run, max_pairs=10_000)
    te, tr = _embed(run, "test"), _embed(run, "train")
    res = misclassified_neighbours(tr["embeddings"], tr["labels"], te["embeddings"], te["labels"],
                                   te["logits"])
    with open_page((run / "report" / "report.html").as_uri()) as (page, errors):
        assert broken_images(page) == []
        assert page.locator("section#classification").count() == 1
        text = page.inner_text("section#classification")
        acc = np.mean(te["logits"].argmax(1) == te["labels"])
        assert f"top-1 accuracy {100 * acc:.2f} %" in text
        if res["n_misclassified"]:
            share = f"{100 * res['share_neighbour_is_predicted']:.2f} %"
            assert f"{res['n_misclassified']} of {len(te['labels'])} test images misclassified" in text
            assert share in text
            pairs = page.eval_on_selector_all("#misclassified .pair", """ps => ps.map(p => ({
                test: +p.dataset.test, nbPred: +p.dataset.neighbourIsPredicted,
                imgs: p.querySelectorAll('img').length}))""")
            assert len(pairs) == min(16, res["n_misclassified"])
            for p, t, nb_pred in zip(pairs, res["misclassified"], res["neighbour_label"] == res["predicted"]):
                assert p["test"] == t and p["nbPred"] == int(nb_pred) and p["imgs"] == 2
        page.screenshot(path=str(tmp / "classifier_report.png"), full_page=True)
    assert errors == []
    assert re.search(r"Classification", (run / "report" / "report.md").read_text())

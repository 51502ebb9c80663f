"""deepmetric index / search and the Index API on a tiny real checkpoint (coloured shapes):
files and provenance, agreement with brute force and with ``deepmetric embed``, approximate
indexes' stored recall, incremental --add, and the errors users hit."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from deepmetric import cli
from deepmetric.search import Index
from search_data import SHAPES, make_shapes_folder, shapes_setup


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return shapes_setup(tmp_path_factory)


def _queries(shapes):
    return sorted(Path(shapes["queries"]).glob("*/*.png"))


def test_index_files_provenance_and_new_queries_find_their_class(shapes):
    d = shapes["index_dir"]
    manifest = json.loads((d / "manifest.json").read_text())
    ckpt = shapes["checkpoint"]
    assert manifest["checkpoint"]["sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    assert manifest["checkpoint"]["config"]["model"]["name"] == "glyph_resnet"
    assert (manifest["kind"], manifest["count"], manifest["dim"]) == ("exact", 32, 16)
    import pyarrow as pa
    names = pa.ipc.open_file(pa.memory_map(str(d / "class_names.arrow"))).read_all()
    assert names.column("name").to_pylist() == sorted(SHAPES)
    index = Index.load(d)
    # labels, class names and paths agree: every image sits in its class's folder
    for p, lab in zip(index.paths, index.labels):
        assert Path(p).is_file() and Path(p).parent.name == index.class_names[lab]
    emb = np.load(d / "embeddings.npy", allow_pickle=False)
    assert np.allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-5)
    import faiss
    flat = faiss.read_index(str(d / "index.faiss"))
    assert flat.ntotal == 32 and flat.d == 16
    # unseen images: all 5 neighbours are of the query's class
    queries = _queries(shapes)
    sims, idx = index.search([str(q) for q in queries], k=5)
    for q, row in zip(queries, index.neighbours(sims, idx)):
        assert [r["class_name"] for r in row] == [q.parent.name] * 5, (q, row)
        assert [r["rank"] for r in row] == [1, 2, 3, 4, 5]
        assert all(a["cosine"] >= b["cosine"] for a, b in zip(row, row[1:]))
    # an indexed image finds itself first with cosine 1 (same preprocessing for index and query)
    s, i = index.search(index.paths[3], k=1)
    assert i[0, 0] == 3 and s[0, 0] == pytest.approx(1.0, abs=1e-5)


def test_index_embeddings_equal_embed_command_with_paths_and_class_names(shapes, tmp_path):
    npz = tmp_path / "e.npz"
    assert cli.main(["embed", str(shapes["checkpoint"]), "--split", "all", "--out", str(npz)]) == 0
    z = np.load(npz, allow_pickle=False)
    index = Index.load(shapes["index_dir"])
    e = z["embeddings"] / np.linalg.norm(z["embeddings"], axis=1, keepdims=True)
    assert np.abs(e - index.embeddings).max() < 1e-5
    assert list(z["paths"]) == index.paths
    assert list(z["class_names"]) == sorted(SHAPES)
    assert list(z["class_names"][z["labels"]]) == [Path(p).parent.name for p in z["paths"]]


def test_exact_search_equals_brute_force_and_caps_k(rng):
    g = rng.normal(size=(500, 12)).astype(np.float32)
    q = rng.normal(size=(40, 12)).astype(np.float32)
    index = Index.from_embeddings(g, rng.integers(0, 5, 500))
    sims, idx = index.search(q, k=7)
    gn = g / np.linalg.norm(g, axis=1, keepdims=True)
    s = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ gn.T
    ref = np.argsort(-s, axis=1, kind="stable")[:, :7]
    assert np.array_equal(idx, ref)
    assert np.allclose(sims, np.take_along_axis(s, ref, 1), atol=1e-5)
    small = Index.from_embeddings(g[:3])
    s3, i3 = small.search(torch.from_numpy(q[0]), k=5)  # a 1-d tensor query works too
    assert i3.shape == (1, 3) and sorted(i3[0]) == [0, 1, 2]  # k is capped at the index size


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_index_stores_its_measured_recall(kind, rng, tmp_path):
    centres = rng.normal(size=(20, 16))
    g = (centres[rng.integers(0, 20, 3000)] + 0.3 * rng.normal(size=(3000, 16))).astype(np.float32)
    index = Index.from_embeddings(g, approximate=kind)
    index.save(tmp_path / "ix")
    manifest = json.loads((tmp_path / "ix" / "manifest.json").read_text())
    stored = manifest["approximate"]["recall@10_vs_exact"]
    # independent recall: numpy brute force vs the saved faiss index, same 1000 seeded rows
    import faiss
    fi = faiss.read_index(str(tmp_path / "ix" / "index.faiss"))
    rows = np.sort(np.random.default_rng(0).choice(3000, size=1000, replace=False))
    gn = index.embeddings
    exact = np.argsort(-(gn[rows] @ gn.T), axis=1)[:, :10]
    _, approx = fi.search(gn[rows], 10)
    recall = np.mean([len(set(a) & set(e)) / 10 for a, e in zip(approx, exact)])
    assert stored == pytest.approx(recall, abs=1e-3) and 0.5 < stored <= 1.0
    loaded = Index.load(tmp_path / "ix")
    assert loaded.kind == kind
    s, i = loaded.search(gn[:5], k=3)
    assert list(i[:, 0]) == [0, 1, 2, 3, 4] and np.allclose(s[:, 0], 1, atol=1e-5)


def test_add_skips_indexed_images_and_merges_class_names(shapes, tmp_path, capsys):
    part = make_shapes_folder(tmp_path / "part", classes=["red_disc", "yellow_cross"])
    out = tmp_path / "ix"
    ckpt = str(shapes["checkpoint"])
    assert cli.main(["index", ckpt, "--data", "folder", "--root", str(part), "--out", str(out),
                     "--no-progress"]) == 0
    first = Index.load(out)
    assert first.class_names == ["red_disc", "yellow_cross"] and len(first) == 16
    more = make_shapes_folder(tmp_path / "part", classes=["blue_square"], seed=3)  # same folder, new class
    assert cli.main(["index", ckpt, "--data", "folder", "--root", str(more), "--out", str(out), "--add",
                     "--no-progress"]) == 0
    ix = Index.load(out)
    assert len(ix) == 24 and ix.class_names == ["red_disc", "yellow_cross", "blue_square"]
    assert ix.paths[:16] == first.paths and len(set(ix.paths)) == 24
    for p, lab in zip(ix.paths, ix.labels):
        assert Path(p).parent.name == ix.class_names[lab]
    assert json.loads((out / "manifest.json").read_text())["skipped_already_indexed"] == 16
    assert "skipped 16 image(s) whose path is already in the index" in capsys.readouterr().out.splitlines()
    assert cli.main(["index", ckpt, "--data", "folder", "--root", str(more), "--out", str(out), "--add",
                     "--no-progress"]) == 0  # nothing new: a no-op
    assert "skipped 24 image(s) whose path is already in the index" in capsys.readouterr().out.splitlines()
    assert len(Index.load(out)) == 24
    # the added rows are what a fresh build embeds
    fresh = Index.build(ckpt, data="folder", root=str(more), progress=False)
    order = [fresh.paths.index(p) for p in ix.paths]
    assert np.abs(fresh.embeddings[order] - ix.embeddings).max() < 1e-5


def test_search_cli_table_json_and_html(shapes, tmp_path, capsys):
    q = [str(p) for p in _queries(shapes)[:2]]
    html = tmp_path / "r.html"
    assert cli.main(["search", str(shapes["index_dir"]), *q, "--k", "3", "--json", "--html", str(html)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["k"] == 3 and [x["query"] for x in out["queries"]] == q
    assert [r["class_name"] for r in out["queries"][0]["neighbours"]] == [Path(q[0]).parent.name] * 3
    page = html.read_text()
    assert page.count('<img src="data:image/png;base64,') == 2 * 4
    assert cli.main(["search", str(shapes["index_dir"]), q[0], "--k", "2"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0] == f"query: {q[0]}" and "rank" in text[1] and len(text) == 4
    assert text[2].split()[:3] == ["1", text[2].split()[1], Path(q[0]).parent.name]


def test_search_json_k_is_the_neighbours_given_as_serve_says(shapes, capsys):
    """--k 100 on the 32-image index: 'k' said 100 (the k asked); it is the neighbours given, the
    index's size, for the answer and each query, as serve's answer (routes.py) gives it."""
    q = [str(p) for p in _queries(shapes)[:2]]
    capsys.readouterr()
    assert cli.main(["search", str(shapes["index_dir"]), *q, "--k", "100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["k"] == 32 and [a["k"] for a in out["queries"]] == [32, 32]
    assert all(len(a["neighbours"]) == 32 for a in out["queries"])
    index = Index.load(shapes["index_dir"])
    sims, idx = index.search(q, k=32)
    assert [r["id"] for r in out["queries"][1]["neighbours"]] == list(idx[1])
    assert sorted(r["id"] for r in out["queries"][0]["neighbours"]) == list(range(32))


def test_errors_name_the_problem(shapes, tmp_path, capsys):
    d = str(shapes["index_dir"])
    assert cli.main(["search", d, str(tmp_path / "nope.png")]) == 2
    err = capsys.readouterr().err
    assert "image not found" in err and "nope.png" in err
    txt = tmp_path / "notes.png"
    txt.write_text("not an image")
    assert cli.main(["search", d, str(txt)]) == 2
    err = capsys.readouterr().err
    assert "notes.png" in err and "not an image" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["index", str(shapes["checkpoint"]), "--data", "folder", "--root", str(empty),
                     "--out", str(tmp_path / "ix"), "--no-progress"]) == 2
    assert "has no class folders and no images" in capsys.readouterr().err
    assert cli.main(["search", str(tmp_path / "missing_index"), str(txt)]) == 2
    assert "does not exist" in capsys.readouterr().err
    index = Index.load(d)
    with pytest.raises(ValueError, match="dimension 8 but the index has 16"):
        index.search(np.ones((2, 8), np.float32), k=3)


def test_add_with_another_checkpoint_is_refused(shapes, tmp_path, capsys):
    other = tmp_path / "other.pt"  # the same weights, but another file (another SHA-256)
    torch.save({**torch.load(shapes["checkpoint"], weights_only=True), "iteration": -1}, other)
    assert cli.main(["index", str(other), "--data", "folder", "--root", str(shapes["queries"]),
                     "--out", str(shapes["index_dir"]), "--add", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "was built with checkpoint" in err and str(shapes["checkpoint"]) in err and "other" in err
    # searching with a checkpoint file that is not the index's is refused too
    index = Index.load(shapes["index_dir"])
    with pytest.raises(ValueError, match="is not the one that built this index"):
        index.model(other)


def test_glyph_checkpoint_index_writes_png_copies_and_finds_them(tmp_path):
    """The demo's kind of checkpoint: an in-memory benchmark (glyphs) gets PNG copies in
    INDEX_DIR/images, and searching one of them finds it first; larger queries are resized to the glyph size."""
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.train.loop import train

    cache = tmp_path / "cache"
    raw = {"data": {"name": "glyphs", "root": str(cache), "options": {"max_classes": 4, "max_faces": 3, "size": 32},
                    "transform": "glyph"},
           "model": {"name": "glyph_resnet", "options": {"embedding_dim": 8, "widths": [8, 16], "depths": [1, 1]}},
           "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
           "optim": {"name": "sgd", "lr": 0.05},
           "train": {"epochs": 1, "batch_size": 8, "seed": 0, "out_dir": str(tmp_path / "run"), "progress": False},
           "eval": {"every": 0}}
    train(config_from_dict(raw))
    out = tmp_path / "ix"
    assert cli.main(["index", str(tmp_path / "run" / "last.pt"), "--out", str(out), "--no-progress"]) == 0
    index = Index.load(out)
    from deepmetric.data import build_dataset
    test = build_dataset("glyphs", root=cache, split="test", max_classes=4, max_faces=3, size=32)
    assert len(index) == len(test) and index.class_names == list(test.chars)
    assert index.meta["data"]["split"] == "test"
    for i in (0, len(index) - 1):
        p = Path(index.paths[i])
        assert p.parent == out.resolve() / "images" and np.array_equal(np.asarray(Image.open(p)), test.images[i])
    s, i = index.search(index.paths[5], k=2)
    assert i[0, 0] == 5 and s[0, 0] == pytest.approx(1.0, abs=1e-5)
    big = tmp_path / "big.png"
    Image.open(index.paths[5]).resize((96, 96), Image.NEAREST).save(big)  # resized back to 32 x 32
    e_big = index.embed(str(big))
    e_small = index.embed(Image.open(big).resize((32, 32), Image.BILINEAR))
    assert np.abs(e_big - e_small).max() < 1e-6 and float(e_big[0] @ index.embeddings[5]) > 0.9


@pytest.mark.parametrize("command", ["index", "search", "export", "serve"])
def test_help_has_a_runnable_example(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"example:\n  deepmetric {command} " in out


def test_data_option_sets_the_data_options_of_the_images_to_index(shapes, tmp_path, capsys, monkeypatch):
    """A folder with an empty class folder was refused with advice in YAML terms
    (data.options.allow_empty_classes: true) that the index command had no way to take; the
    checkpoint's own data.options were the only ones.  --data-option KEY=VALUE sets them."""
    part = make_shapes_folder(tmp_path / "part", classes=["red_disc", "yellow_cross"])
    (part / "empty_class").mkdir()
    ckpt = str(shapes["checkpoint"])
    base = ["index", ckpt, "--data", "folder", "--root", str(part), "--no-progress"]
    assert cli.main([*base, "--out", str(tmp_path / "a")]) == 2
    assert "allow_empty_classes" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    monkeypatch.chdir(tmp_path)  # a relative --root is recorded as the absolute folder it named
    assert cli.main(["index", ckpt, "--data", "folder", "--root", "part", "--no-progress", "--out", "b",
                     "--data-option", "allow_empty_classes=true"]) == 0
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["data"]["options"]["allow_empty_classes"] is True and manifest["data"]["root"] == str(part)
    ix = Index.load(tmp_path / "b")
    assert len(ix) == 16 and ix.class_names == ["red_disc", "yellow_cross"]
    for bad, said in ((["--data-option", "allow_empty_classes"], "--data-option 'allow_empty_classes': expected "
                                                                   "KEY=VALUE"),
                      (["--data-option", "x=[1"], "--data-option 'x=[1': the value is not valid YAML"),
                      (["--data-option", "alow_empty_classes=true"], "alow_empty_classes")):
        assert cli.main([*base, "--out", str(tmp_path / "c"), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and said in err, err
        assert not (tmp_path / "c").exists()
    emb = tmp_path / "e.npz"
    np.savez(emb, embeddings=np.eye(3, dtype=np.float32))
    assert cli.main(["index", "--embeddings", str(emb), "--out", str(tmp_path / "d"), "--data-option", "a=1"]) == 2
    assert "--data-option applies to images embedded with a CHECKPOINT" in capsys.readouterr().err


def test_a_linked_image_keeps_its_own_path_and_a_linked_root_is_one_root(shapes, tmp_path):
    """A symbolic link in one class folder to another class's image was stored under its
    target's path: the index held that path twice (with two labels) and search showed a
    red_disc hit in the green_square folder.  The link's own path is stored now; a root given
    through a link (or as ../) is still the same root, so --add skips what is indexed."""
    part = make_shapes_folder(tmp_path / "part", per_class=2, classes=["red_disc", "yellow_cross"])
    link = part / "red_disc" / "link_to_cross.png"
    link.symlink_to(part / "yellow_cross" / "yellow_cross_00.png")
    ckpt = str(shapes["checkpoint"])
    out = tmp_path / "ix"
    assert cli.main(["index", ckpt, "--data", "folder", "--root", str(part), "--out", str(out), "--no-progress"]) == 0
    ix = Index.load(out)
    assert len(ix) == 5 and len(set(ix.paths)) == 5
    row = ix.paths.index(str(link))
    assert ix.class_names[ix.labels[row]] == "red_disc"
    target = ix.paths.index(str(part / "yellow_cross" / "yellow_cross_00.png"))
    assert np.allclose(ix.embeddings[row], ix.embeddings[target])  # the same pixels
    (tmp_path / "via_link").symlink_to(part)
    for root in (tmp_path / "via_link", part / "red_disc" / ".." / ".."  / "part"):
        assert cli.main(["index", ckpt, "--data", "folder", "--root", str(root), "--out", str(out), "--add",
                         "--no-progress"]) == 0
        assert len(Index.load(out)) == 5, root


def test_an_index_of_vectors_searched_with_an_image_says_to_give_the_checkpoint(shapes, tmp_path, capsys):
    """'search it with embeddings, not images' named nothing the command line can do; the
    --checkpoint of the model that made the vectors works, and the message now says so."""
    src = Index.load(shapes["index_dir"])
    emb = tmp_path / "v.npz"
    np.savez(emb, embeddings=src.embeddings, labels=src.labels, class_names=np.array(src.class_names))
    out = tmp_path / "vix"
    assert cli.main(["index", "--embeddings", str(emb), "--out", str(out)]) == 0
    query = str(_queries(shapes)[0])
    capsys.readouterr()
    assert cli.main(["search", str(out), query, "--k", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no checkpoint (built from embeddings)" in err and "--checkpoint FILE" in err, err
    assert cli.main(["search", str(out), query, "--k", "2", "--checkpoint", str(shapes["checkpoint"])]) == 0


def test_photos_without_classes_in_one_sub_folder_are_indexed_and_counted_in_the_singular(shapes, tmp_path, capsys):
    """docs/search.md: photos without classes go in one sub-folder; the line said '1 images,
    1 classes'."""
    photos = make_shapes_folder(tmp_path / "photos", per_class=1, classes=["red_disc"])
    (photos / "red_disc").rename(photos / "all")
    out = tmp_path / "ix"
    assert cli.main(["index", str(shapes["checkpoint"]), "--data", "folder", "--root", str(photos), "--out", str(out),
                     "--no-progress"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("indexed 1 image of folder (split all) -> ") and line.endswith(": 1 image, 1 class, d=16, "
                                                                                          "exact"), line
    assert Index.load(out).class_names == ["all"]

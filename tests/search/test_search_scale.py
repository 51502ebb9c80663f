"""Indexes past one machine's memory: the compressed ivfpq kind (OPQ + IVF + PQ re-ranked with
float16 vectors on disk), ``index --embeddings``, Arrow metadata (and old JSON indexes), and
``index export`` to parquet and Qdrant (embedded). References are numpy brute force."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from deepmetric import cli
from deepmetric.search import Index


def clustered(n, d=16, clusters=20, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d))
    lab = rng.integers(0, clusters, n)
    x = centres[lab] + 0.3 * rng.standard_normal((n, d))
    return x.astype(np.float32), lab


def brute(g, q, k):
    gn = g / np.linalg.norm(g, axis=1, keepdims=True)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    s = qn @ gn.T
    return np.argsort(-s, axis=1, kind="stable")[:, :k]


@pytest.fixture(scope="module")
def pq_index(tmp_path_factory):
    x, lab = clustered(1500)
    index = Index.from_embeddings(x, lab, approximate="ivfpq")
    d = tmp_path_factory.mktemp("pq") / "ix"
    index.save(d)
    return x, lab, index, d


def test_ivfpq_reranks_with_exact_float16_cosines_and_records_recall(pq_index):
    x, _, index, d = pq_index
    a = json.loads((d / "manifest.json").read_text())["approximate"]
    assert a["factory"].startswith("OPQ") and ",IVF" in a["factory"] and ",PQ" in a["factory"]
    assert a["recall@10_vs_exact"] >= 0.95 and a["recall_queries"] == 150
    assert sorted(os.listdir(d)) == ["class_names.arrow", "index.faiss", "manifest.json", "metadata.arrow",
                                     "vectors.f16.npy"]
    q = x[:60] + 0.05
    sims, idx = index.search(q, k=10)
    # the returned cosines are exact dot products with the stored float16 rows, in order
    f16 = np.load(d / "vectors.f16.npy").astype(np.float32)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    assert np.allclose(sims, np.einsum("qkd,qd->qk", f16[idx], qn), atol=1e-5)
    assert (np.diff(sims, axis=1) <= 1e-7).all()
    ref = brute(x, q, 10)
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(idx, ref)]) >= 0.9
    loaded = Index.load(d, verify_hashes=True)  # vectors memory-mapped, metadata from Arrow
    s2, i2 = loaded.search(q, k=10)
    assert np.array_equal(i2, idx) and np.allclose(s2, sims)
    assert loaded.refined.mapped is not None and loaded.neighbours(s2, i2)[0][0]["class_name"] == \
        str(loaded.labels[i2[0, 0]])


def test_ivfpq_add_and_memory_budget(pq_index, tmp_path):
    x, lab, _, d = pq_index
    index = Index.load(d)
    index.add(-x[:20], lab[:20])
    s, i = index.search(-x[:5], k=1)
    assert list(i[:, 0]) == [1500, 1501, 1502, 1503, 1504] and np.allclose(s[:, 0], 1, atol=2e-3)
    from deepmetric.search.compressed import plan_ivfpq, resident_bytes

    big = plan_ivfpq(10_000_000, 256, memory_gb=0.4)  # 32 bytes a vector (+ 16 of ids and labels) need 0.45 GiB
    assert resident_bytes(10_000_000, 256, big["m"], big["nlist"]) <= 0.4 * 2 ** 30 and big["m"] == 16
    assert plan_ivfpq(10_000_000, 512)["m"] == 64 and big["k_factor"] > 4
    with pytest.raises(ValueError, match="--memory-budget 0.1 GB is too small for 10000000 vectors"):
        plan_ivfpq(10_000_000, 256, memory_gb=0.1)


@pytest.mark.parametrize("kind", ["exact", "hnsw", "ivfpq"])
def test_index_from_embeddings_file_every_kind(kind, tmp_path, capsys):
    x, lab = clustered(1200, seed=1)
    names = np.array([f"class_{i:02d}" for i in range(20)])
    npz = tmp_path / "e.npz"
    np.savez(npz, embeddings=x, labels=names[lab], paths=np.array([f"img/{i}.jpg" for i in range(1200)]))
    out = tmp_path / "ix"
    argv = ["index", "--embeddings", str(npz), "--out", str(out)] + ([] if kind == "exact" else ["--approximate", kind])
    assert cli.main(argv) == 0
    assert f"1200 vectors, 20 classes, d=16, {kind}" in capsys.readouterr().out
    index = Index.load(out)
    assert index.class_names == sorted(names)
    assert list(index.paths[:2]) == [os.path.abspath("img/0.jpg"), os.path.abspath("img/1.jpg")]
    assert [index.class_names[i] for i in index.labels[:50]] == list(names[lab[:50]])
    sims, idx = index.search(x[:30], k=5)
    hit = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(idx, brute(x, x[:30], 5))])
    assert hit == 1.0 if kind == "exact" else hit >= 0.9


def test_embeddings_errors(tmp_path, capsys):
    np.savez(tmp_path / "bad.npz", vectors=np.zeros((3, 4)))
    assert cli.main(["index", "--embeddings", str(tmp_path / "bad.npz"), "--out", str(tmp_path / "o")]) == 2
    assert "has no array 'embeddings' (it has vectors)" in capsys.readouterr().err
    assert cli.main(["index", "--out", str(tmp_path / "o")]) == 2
    assert "give either CHECKPOINT" in capsys.readouterr().err
    np.savez(tmp_path / "ok.npz", embeddings=np.eye(4))
    assert cli.main(["index", "--embeddings", str(tmp_path / "ok.npz"), "--out", str(tmp_path / "o"),
                     "--memory-budget", "1"]) == 2
    assert "apply to --approximate ivfpq" in capsys.readouterr().err
    # 0 was taken for "not given" and silently ignored (a negative was refused)
    assert cli.main(["index", "--embeddings", str(tmp_path / "ok.npz"), "--out", str(tmp_path / "o"),
                     "--approximate", "ivfpq", "--reduce-dim", "0"]) == 2
    assert "--reduce-dim must be a whole number >= 1" in capsys.readouterr().err
    for budget in ("0", "nan"):
        with pytest.raises(SystemExit):
            cli.main(["index", "--embeddings", str(tmp_path / "ok.npz"), "--out", str(tmp_path / "o"),
                      "--approximate", "ivfpq", "--memory-budget", budget])
        assert f"expected a finite number > 0, got '{budget}'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("key, arrays, needle", [
    # arrays of Python objects: numpy's "Object arrays cannot be loaded when allow_pickle=False"
    # named neither the file nor the array
    ("paths", {"paths": np.array(["a", "b", "c", "d"], dtype=object)},
     "array 'paths' holds Python objects (dtype object)"),
    ("labels", {"labels": np.array(["x", "x", "y", "y"], dtype=object)},
     "array 'labels' holds Python objects (dtype object)"),
    ("embeddings", {"embeddings": np.eye(4).astype(object)}, "array 'embeddings' holds Python objects"),
    # a 1-d array was indexed as one vector, a 0-d one ended in a traceback (IndexError)
    ("embeddings", {"embeddings": np.ones(8, np.float32)}, "array 'embeddings' has shape (8,), expected (N, d)"),
    ("embeddings", {"embeddings": np.float32(3)}, "array 'embeddings' has shape (), expected (N, d)"),
    ("embeddings", {"embeddings": np.ones((2, 2, 2), np.float32)},
     "array 'embeddings' has shape (2, 2, 2), expected (N, d)"),
    ("paths", {"paths": np.array(["a", "b", "c"])}, "array 'paths' has shape (3,), expected (4,)"),
    ("labels", {"labels": np.ones(4)}, "array 'labels' must be integers or strings, got dtype float64"),
])
def test_embeddings_npz_errors_name_the_file_and_the_array(tmp_path, capsys, key, arrays, needle):
    npz = tmp_path / "e.npz"
    np.savez(npz, **{"embeddings": np.eye(4, dtype=np.float32), **arrays})
    out = tmp_path / "o"
    capsys.readouterr()
    assert cli.main(["index", "--embeddings", str(npz), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deepmetric index: error: --embeddings {npz}: {needle}") and err.count("\n") == 1, err
    assert not out.exists()


def test_a_tiny_memory_budget_is_refused_with_a_need_that_fits(tmp_path, capsys):
    """--memory-budget 1e-9: the message said the smallest codes 'need 0.00 GB', a need the
    budget seemed to meet; it shows the budget given and a need that is itself a budget that fits."""
    import re

    from deepmetric.search.compressed import plan_ivfpq, resident_bytes

    x, _ = clustered(400, seed=4)
    npz = tmp_path / "e.npz"
    np.savez(npz, embeddings=x)
    capsys.readouterr()
    assert cli.main(["index", "--embeddings", str(npz), "--out", str(tmp_path / "o"), "--approximate", "ivfpq",
                     "--memory-budget", "1e-9"]) == 2
    err = capsys.readouterr().err
    assert "0.00 GB" not in err and err.count("\n") == 1 and not (tmp_path / "o").exists()
    need = re.fullmatch(r"deepmetric index: error: --memory-budget 1e-09 GB is too small for 400 vectors of "
                        r"dimension 16: the smallest codes \(4 bytes per vector\) need ([0-9.]+) GB resident\n", err)
    assert need, err
    gb = float(need.group(1))
    plan = plan_ivfpq(400, 16, memory_gb=gb)  # the need shown fits ...
    exact = resident_bytes(400, 16, plan["m"], plan["nlist"]) / 2 ** 30
    assert plan["m"] == 4 and exact <= gb < exact * 1.01  # ... and is the need to 3 significant figures


def test_adding_vectors_skips_paths_already_indexed_as_adding_images_does(tmp_path, capsys):
    """``index --embeddings FILE --add`` appended rows whose path the index held already (each
    query then met the same image twice); an --add of images skips and counts them."""
    x, _ = clustered(8, seed=5)
    names = np.array(["a", "a", "b", "b", "b", "c", "c", "c"])
    first, second = tmp_path / "first.npz", tmp_path / "second.npz"
    np.savez(first, embeddings=x[:4], labels=names[:4], paths=np.array([f"/p/{i}.png" for i in range(4)]))
    # rows 2 and 3 again, with vectors that differ (a re-embedded folder): the indexed rows are kept
    again = np.r_[x[2:4] + 1.0, x[4:]]
    np.savez(second, embeddings=again, labels=names[2:], paths=np.array([f"/p/{i}.png" for i in range(2, 8)]))
    out = tmp_path / "ix"
    assert cli.main(["index", "--embeddings", str(first), "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["index", "--embeddings", str(second), "--out", str(out), "--add"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "skipped 2 vector(s) whose path is already in the index"
    ix = Index.load(out, verify_hashes=True)
    assert ix.paths == [f"/p/{i}.png" for i in range(8)]
    assert [ix.class_names[i] for i in ix.labels] == list(names)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    assert np.allclose(ix.embeddings, unit, atol=1e-6)  # rows 2, 3 are the first file's
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped_already_indexed"] == 2 and manifest["added"][-1]["images"] == 4
    # nothing new: the index keeps its rows; rows without a path are always added
    assert cli.main(["index", "--embeddings", str(second), "--out", str(out), "--add"]) == 0
    assert "skipped 6 vector(s)" in capsys.readouterr().out and len(Index.load(out)) == 8
    bare = tmp_path / "bare.npz"
    np.savez(bare, embeddings=x[:2])
    assert cli.main(["index", "--embeddings", str(bare), "--out", str(out), "--add"]) == 0
    assert "skipped" not in capsys.readouterr().out and Index.load(out).paths[8:] == ["", ""]


def _as_version_2(d: Path) -> None:
    """Rewrite a version-3 folder in the layout of version 2 (JSON metadata, labels.npy)."""
    import pyarrow as pa

    from deepmetric.search.store import file_entries

    t = pa.ipc.open_file(pa.memory_map(str(d / "metadata.arrow"))).read_all()
    names = pa.ipc.open_file(pa.memory_map(str(d / "class_names.arrow"))).read_all()
    (d / "paths.json").write_text(json.dumps(t.column("path").to_pylist()))
    (d / "class_names.json").write_text(json.dumps(names.column("name").to_pylist()))
    np.save(d / "labels.npy", t.column("label").to_numpy())
    (d / "metadata.arrow").unlink()
    (d / "class_names.arrow").unlink()
    m = json.loads((d / "manifest.json").read_text())
    m["version"], m["files"] = 2, file_entries(d)
    (d / "manifest.json").write_text(json.dumps(m))


def test_json_index_still_loads_and_migrates(tmp_path, capsys):
    x, lab = clustered(300, seed=2)
    d = tmp_path / "ix"
    Index.from_embeddings(x, lab, [f"/p/{i}.png" for i in range(300)], [f"c{i}" for i in range(20)]).save(d)
    want = Index.load(d).search(x[:10], k=5)
    _as_version_2(d)
    old = Index.load(d, verify_hashes=True)
    assert isinstance(old.paths, list) and old.paths[7] == "/p/7.png"
    assert np.array_equal(old.search(x[:10], k=5)[1], want[1])
    assert cli.main(["index", "migrate", str(d)]) == 0
    assert "rewrote" in capsys.readouterr().out
    assert (d / "metadata.arrow").is_file() and not (d / "paths.json").exists()
    new = Index.load(d, verify_hashes=True)
    assert json.loads((d / "manifest.json").read_text())["version"] == 3
    assert new.paths[7] == "/p/7.png" and new.class_names == [f"c{i}" for i in range(20)]
    assert np.array_equal(new.search(x[:10], k=5)[1], want[1]) and np.array_equal(new.labels, lab)


def test_export_parquet_round_trips(tmp_path):
    x, lab = clustered(400, seed=3)
    d = tmp_path / "ix"
    index = Index.from_embeddings(x, lab, [f"/p/{i}.png" for i in range(400)], [f"c{i}" for i in range(20)])
    index.save(d)
    pq_file = tmp_path / "out" / "ix.parquet"
    assert cli.main(["index", "export", str(d), "--to", f"parquet:{pq_file}"]) == 0
    import pyarrow.parquet as pq

    meta = json.loads(pq.read_schema(pq_file).metadata[b"deepmetric"])
    assert (meta["kind"], meta["count"], meta["dim"]) == ("exact", 400, 16)
    assert cli.main(["index", "--embeddings", str(pq_file), "--out", str(tmp_path / "back")]) == 0
    back = Index.load(tmp_path / "back")
    assert np.abs(back.embeddings - index.embeddings).max() < 1e-6  # re-normalised: float32 rounding
    assert np.array_equal(back.labels, index.labels)
    assert np.array_equal(back.search(x[:20], k=5)[1], index.search(x[:20], k=5)[1])
    assert list(back.paths) == list(index.paths) and back.class_names == index.class_names
    # a parquet export is read back whatever its name (out.pq was taken for an .npz), and
    # replaces an earlier export; a file there that is not parquet is kept, and refused
    assert cli.main(["index", "export", str(d), "--to", f"parquet:{tmp_path / 'out.pq'}"]) == 0
    assert cli.main(["index", "export", str(d), "--to", f"parquet:{tmp_path / 'out.pq'}"]) == 0
    assert cli.main(["index", "--embeddings", str(tmp_path / "out.pq"), "--out", str(tmp_path / "back2")]) == 0
    assert np.array_equal(Index.load(tmp_path / "back2").labels, index.labels)
    victim = tmp_path / "keep.npz"
    np.savez(victim, embeddings=x)
    before = victim.read_bytes()
    assert cli.main(["index", "export", str(d), "--to", f"parquet:{victim}"]) == 2
    assert victim.read_bytes() == before


def test_export_of_a_whitened_index_carries_what_queries_need(tmp_path, capsys):
    """The exported vectors of a whitened index are whitened: the manifest carries the fit, and
    queries whitened by hand with it (numpy) and ranked by plain cosine over the exported
    vectors give Index.search's top-10; steps no engine applies are named."""
    import pyarrow.parquet as pq

    x, lab = clustered(500, seed=6)
    np.save(tmp_path / "x.npy", x)
    d = tmp_path / "ix"
    assert cli.main(["index", "--embeddings", str(tmp_path / "x.npy"), "--out", str(d),
                     "--postprocess", "whiten:dim=8"]) == 0
    out = tmp_path / "ix.parquet"
    capsys.readouterr()
    assert cli.main(["index", "export", str(d), "--to", f"parquet:{out}"]) == 0
    assert "queries must be whitened" in capsys.readouterr().err
    post = json.loads(pq.read_schema(out).metadata[b"deepmetric"])["postprocess"]
    assert post["not_applied"] == [] and len(post["whiten_projection"]) == 16
    mean, proj = np.asarray(post["whiten_mean"], np.float32), np.asarray(post["whiten_projection"], np.float32)
    vectors = np.stack(pq.read_table(out).column("vector").to_numpy(zero_copy_only=False))
    assert vectors.shape == (500, 8)
    q = clustered(50, seed=7)[0]
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    qw = (qn - mean) @ proj
    assert np.array_equal(brute(vectors, qw, 10), Index.load(d).search(q, k=10)[1])
    # alpha-QE needs the gallery: the export says it is not applied
    assert cli.main(["index", "--embeddings", str(tmp_path / "x.npy"), "--out", str(tmp_path / "ix2"),
                     "--postprocess", "aqe:k=2"]) == 0
    capsys.readouterr()
    assert cli.main(["index", "export", str(tmp_path / "ix2"), "--to", f"parquet:{tmp_path / 'b.parquet'}"]) == 0
    assert "aqe cannot be applied" in capsys.readouterr().err
    meta = json.loads(pq.read_schema(tmp_path / "b.parquet").metadata[b"deepmetric"])
    assert meta["postprocess"]["not_applied"] == ["aqe"] and "whiten_mean" not in meta["postprocess"]


def test_export_qdrant_embedded_gives_the_same_top10(tmp_path):
    pytest.importorskip("qdrant_client")
    from qdrant_client import QdrantClient

    x, lab = clustered(600, seed=4)
    d = tmp_path / "ix"
    index = Index.from_embeddings(x, lab, [f"/p/{i}.png" for i in range(600)])
    index.save(d)
    where = tmp_path / "qdrant"
    assert cli.main(["index", "export", str(d), "--to", f"qdrant:{where}"]) == 0
    q = clustered(100, seed=5)[0]
    _, want = Index.load(d).search(q, k=10)
    client = QdrantClient(path=str(where))
    try:
        for qi, w in zip(q, want):
            hits = client.query_points("deepmetric", query=qi.tolist(), limit=10, with_payload=True).points
            assert [h.id for h in hits] == list(w)
        assert hits[0].payload == {"path": f"/p/{w[0]}.png", "label": int(lab[w[0]]), "class_name": str(lab[w[0]])}
    finally:
        client.close()
    assert json.loads((where / "deepmetric_manifest.json").read_text())["count"] == 600


def test_serve_answers_from_an_ivfpq_index_of_images(tmp_path_factory):
    pytest.importorskip("starlette")
    from search_data import shapes_setup
    from serving import multipart, request, serve_in_thread

    from deepmetric.search.serve import create_app

    shapes = shapes_setup(tmp_path_factory)
    out = tmp_path_factory.mktemp("pqshapes") / "ix"
    Index.build(shapes["checkpoint"], out=out, approximate="ivfpq", progress=False, device="cpu")
    index = Index.load(out, verify_hashes=True)
    assert index.kind == "ivfpq" and index.refined.mapped is not None
    q = sorted(Path(shapes["queries"]).glob("red_disc/*.png"))[0]
    with serve_in_thread(create_app(index, default_k=4)) as url:
        body, headers = multipart({"k": "4"}, {"image": (q.name, q.read_bytes())})
        status, _, data = request(url, "POST", "/search", body, headers)
    assert status == 200, data
    got = json.loads(data)["neighbours"]
    sims, idx = index.search(str(q), k=4)
    assert [n["id"] for n in got] == list(idx[0]) and [n["class_name"] for n in got] == ["red_disc"] * 4


@pytest.mark.parametrize("kind", ["exact", "ivfpq"])
def test_index_from_npy_file_read_in_chunks(kind, tmp_path):
    from deepmetric.search.interchange import NpyRows

    x, _ = clustered(1000, seed=6)
    np.save(tmp_path / "e.npy", x)
    rows = NpyRows(tmp_path / "e.npy")
    assert rows.shape == (1000, 16) and np.array_equal(rows[10:20], x[10:20]) and rows[990:2000].shape == (10, 16)
    argv = ["index", "--embeddings", str(tmp_path / "e.npy"), "--out", str(tmp_path / "ix")]
    assert cli.main(argv + ([] if kind == "exact" else ["--approximate", kind])) == 0
    index = Index.load(tmp_path / "ix")
    assert np.abs(np.asarray(index.embeddings, np.float32) - x / np.linalg.norm(x, axis=1, keepdims=True)).max() < 1e-3
    assert cli.main(["index", "--embeddings", str(tmp_path / "e.npy"), "--out", str(tmp_path / "ix"), "--add"]) == 0
    assert len(Index.load(tmp_path / "ix")) == 2000


def test_ivfpq_refuses_a_gallery_too_small_to_train_on(tmp_path):
    """faiss's OPQ training crashed the process (segfault, heap corruption) on fewer than about
    d points (measured: d=8 with 2-6 vectors, d=32 with 33, d=128 with 140; never from 2 d on):
    refused below 2 d, before faiss is called, and nothing is written."""
    from deepmetric.search.compressed import plan_ivfpq

    x = np.random.default_rng(0).standard_normal((15, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"ivfpq needs at least 2 x d = 16 vectors .* got 15"):
        Index.from_embeddings(x, np.arange(15) % 3, approximate="ivfpq")
    np.savez(tmp_path / "e.npz", embeddings=x, labels=np.arange(15) % 3)
    assert cli.main(["index", "--embeddings", str(tmp_path / "e.npz"), "--out", str(tmp_path / "idx"),
                     "--approximate", "ivfpq"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.npz"]
    assert plan_ivfpq(16, 8)["nlist"] == 1  # from 2 d on it plans (and builds: the tests above)


def test_ivfpq_with_pca_reduction_keeps_full_vectors_for_reranking():
    x, lab = clustered(1500, seed=8)
    index = Index.from_embeddings(x, lab, approximate="ivfpq", options={"reduce_dim": 8})
    a = index.meta["approximate"]
    assert a["factory"].startswith("PCAR8,OPQ") and a["reduce_dim"] == 8 and index.dim == 16
    sims, idx = index.search(x[:40], k=10)
    assert np.mean([len(set(p) & set(b)) / 10 for p, b in zip(idx, brute(x, x[:40], 10))]) >= 0.9
    with pytest.raises(ValueError, match="--reduce-dim 32 must be between 1 and the dimension 16"):
        Index.from_embeddings(x, lab, approximate="ivfpq", options={"reduce_dim": 32})


def test_ivfpq_refuses_post_processing_with_a_clear_error(tmp_path, capsys):
    x, lab = clustered(300, seed=9)
    with pytest.raises(ValueError, match="ivfpq takes no --postprocess"):
        Index.from_embeddings(x, lab, approximate="ivfpq", postprocess=[{"name": "whiten", "dim": 8}])
    np.savez(tmp_path / "e.npz", embeddings=x, labels=lab)
    argv = ["index", "--embeddings", str(tmp_path / "e.npz"), "--out", str(tmp_path / "ix"), "--approximate",
            "ivfpq", "--postprocess", "whiten:dim=8"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "ivfpq takes no --postprocess" in err and "Traceback" not in err and not (tmp_path / "ix").exists()
    assert cli.main(argv[:-1] + ["none"]) == 0  # no steps: built
    # the other kinds keep their post-processing in format 3
    index = Index.from_embeddings(x, lab, approximate="hnsw", postprocess=[{"name": "whiten", "dim": 8}])
    index.save(tmp_path / "hnsw")
    back = Index.load(tmp_path / "hnsw", verify_hashes=True)
    assert back.postprocessor is not None and back.dim == 8 and back.query_dim == 16
    assert np.array_equal(back.search(x[:5], k=5)[1], index.search(x[:5], k=5)[1])


def test_ivfpq_vectors_file_is_checked_like_every_listed_file(pq_index, tmp_path):
    import hashlib
    import shutil

    from deepmetric.search.index import IndexFilesError

    d = tmp_path / "ix"
    shutil.copytree(pq_index[3], d)
    vec = np.load(d / "vectors.f16.npy")
    vec[5, 3] = np.nan
    np.save(d / "vectors.f16.npy", vec)
    with pytest.raises(IndexFilesError, match=r"vectors\.f16\.npy: SHA-256 differs"):
        Index.load(d, verify_hashes=True)
    m = json.loads((d / "manifest.json").read_text())  # re-blessed, as a buggy tool would
    data = (d / "vectors.f16.npy").read_bytes()
    m["files"]["vectors.f16.npy"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"vectors\.f16\.npy: row 5 holds NaN or infinite values"):
        Index.load(d, verify_hashes=True)


def test_refinement_reads_candidate_rows_from_the_file_not_the_mapping(tmp_path):
    """The re-ranking gathers candidate rows with pread (a fault on the mapping maps whole large
    folios into the process: 2.1 GiB for one search at 10 M): same rows, any order, repeats, and
    the same answer as an exact search of the float16 vectors."""
    import faiss

    from deepmetric.search.compressed import RefinedIndex

    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    np.save(tmp_path / "v.npy", x.astype(np.float16))
    flat = faiss.IndexFlatIP(16)
    flat.add(x)
    refined = RefinedIndex(flat, tmp_path / "v.npy", k_factor=4)
    rows = np.array([7, 3, 499, 3, 0, 7])
    np.testing.assert_array_equal(refined.mapped.gather(rows), x.astype(np.float16)[rows])
    q = x[:20] + 0.01 * rng.standard_normal((20, 16)).astype(np.float32)
    sims, idx = refined.search(q, 5)
    exact = q @ x.astype(np.float16).astype(np.float32).T
    np.testing.assert_array_equal(idx, np.argsort(-exact, axis=1, kind="stable")[:, :5])
    np.testing.assert_allclose(sims, np.take_along_axis(exact, idx, 1), rtol=1e-6)


def test_an_index_of_precomputed_vectors_embeds_uploads_with_the_given_checkpoint(tmp_path):
    """``serve INDEX --checkpoint F`` on an ``--embeddings`` index (no preprocessing recorded) embeds
    with F's own test preprocessing: the same vectors as ``deepmetric embed`` gave (it failed with a
    bare KeyError 'preprocessing' before)."""
    old = Path(__file__).parents[1] / "fixtures" / "checkpoint_before_run_layer"
    then = np.load(old / "embeddings.npz")
    np.savez(tmp_path / "v.npz", embeddings=then["embeddings"].astype(np.float32))
    assert cli.main(["index", "--embeddings", str(tmp_path / "v.npz"), "--out", str(tmp_path / "idx")]) == 0
    index = Index.load(tmp_path / "idx")
    index.model(old / "last.pt")
    got = index.embed([str(old / "images" / p) for p in then["paths"]])
    want = then["embeddings"] / np.linalg.norm(then["embeddings"], axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, atol=1e-5)

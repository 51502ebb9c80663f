"""An index with post-processing: stored processed vectors and fitted whitening (hash-checked),
search / the CLI / serve answer with the processed ranking (against numpy references)."""
import hashlib
import http.client
import json
import uuid
from pathlib import Path

import numpy as np
import pytest

from deepmetric import cli
from deepmetric.search import Index
from deepmetric.search.store import IndexFilesError
from search_data import shapes_setup
from test_postprocess import ref_expand, ref_kreciprocal, ref_whiten

STEPS = [{"name": "whiten", "dim": 5}, {"name": "dba", "k": 3, "alpha": 3.0}, {"name": "aqe", "k": 2, "alpha": 3.0}]


def clustered(rng, n, d=8, classes=4):
    y = rng.integers(0, classes, n)
    x = rng.normal(size=(classes, d))[y] + 0.7 * rng.normal(size=(n, d))
    return x.astype(np.float32), y


def ref_search(gal, qry, k, dim=5, k_dba=3, k_qe=2, alpha=3.0):
    """Whitening fitted on the gallery, DBA, alpha-QE, exact ranking: all in numpy."""
    g = ref_whiten(gal, gal, dim, 0.0)
    q = ref_whiten(gal, qry, dim, 0.0)
    g = ref_expand(g, g, k_dba - 1, alpha, np.arange(len(g)))
    q = ref_expand(q, g, k_qe, alpha, -np.ones(len(q), int))
    s = q @ g.T
    return np.array([sorted(range(len(g)), key=lambda j: (-row[j], j))[:k] for row in s]), g


def test_index_from_embeddings_with_postprocess_matches_numpy(rng, tmp_path):
    gal, y = clustered(rng, 60)
    qry, _ = clustered(rng, 9)
    index = Index.from_embeddings(gal, y, postprocess=STEPS)
    want, g = ref_search(gal, qry, 6)
    assert (index.dim, index.query_dim) == (5, 8)
    # eigenvector signs are arbitrary: the stored gallery agrees up to them (its Gram matrix)
    np.testing.assert_allclose(index.embeddings @ index.embeddings.T, g @ g.T, atol=1e-4)
    _, idx = index.search(qry, 6)
    assert idx.tolist() == want.tolist()
    index.save(tmp_path / "ix")
    manifest = json.loads((tmp_path / "ix" / "manifest.json").read_text())
    assert manifest["dim"] == 5 and manifest["postprocess"]["query_dim"] == 8
    assert [s["name"] for s in manifest["postprocess"]["steps"]] == ["whiten", "dba", "aqe"]
    raw = (tmp_path / "ix" / "postprocess.npz").read_bytes()
    assert manifest["files"]["postprocess.npz"]["sha256"] == hashlib.sha256(raw).hexdigest()
    loaded = Index.load(tmp_path / "ix", verify_hashes=True)
    assert loaded.search(qry, 6)[1].tolist() == want.tolist()
    assert Index.load(tmp_path / "ix", mmap=True).search(qry, 6)[1].tolist() == want.tolist()
    # a changed fit is caught like any other index file
    with np.load(tmp_path / "ix" / "postprocess.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["whiten_mean"] = arrays["whiten_mean"] + 1e-3
    with open(tmp_path / "ix" / "postprocess.npz", "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(IndexFilesError, match="postprocess.npz"):
        Index.load(tmp_path / "ix", verify_hashes=True)


def test_add_whitens_new_rows_and_refuses_dba(rng):
    gal, y = clustered(rng, 40)
    extra, ye = clustered(rng, 5)
    index = Index.from_embeddings(gal, y, postprocess=[{"name": "whiten", "dim": 6}])
    index.add(extra, ye)
    np.testing.assert_allclose(index.embeddings[-5:] @ index.embeddings[-5:].T,
                               ref_whiten(gal, extra, 6, 0.0) @ ref_whiten(gal, extra, 6, 0.0).T, atol=1e-4)
    with pytest.raises(ValueError, match="dim"):
        index.add(np.ones((1, 6), np.float32))  # already-reduced rows: the model makes 8-d ones
    dba_index = Index.from_embeddings(gal, y, postprocess=[{"name": "dba", "k": 3}])
    with pytest.raises(ValueError, match="built with post-processing step dba.*--overwrite"):
        dba_index.add(extra, ye)


def test_index_with_kreciprocal_matches_dense_reference(rng):
    gal, y = clustered(rng, 45)
    qry, _ = clustered(rng, 6)
    index = Index.from_embeddings(gal, y, postprocess=[{"name": "kreciprocal", "k1": 6, "k2": 3, "lambda": 0.3,
                                                         "candidates": 15}])
    _, idx = index.search(qry, 10)
    ref = ref_kreciprocal(qry, gal, -np.ones(6, int), 6, 3, 0.3, 15)
    assert idx.tolist() == [r[:10] for r in ref]


def test_index_cli_postprocess_search_and_serve(tmp_path_factory, tmp_path, capsys):
    shapes = shapes_setup(tmp_path_factory)
    out = tmp_path / "pp_index"
    steps = ["whiten:dim=8,fit=gallery", "dba:k=3,alpha=3", "aqe:k=2,alpha=3"]
    assert cli.main(["index", str(shapes["checkpoint"]), "--out", str(out), "--no-progress",
                     "--postprocess", *steps]) == 0
    assert "post-processing: whiten:dim=8" in capsys.readouterr().out
    plain = Index.load(shapes["index_dir"])  # the same images without post-processing
    index = Index.load(out)
    queries = sorted(Path(shapes["queries"]).glob("*/*.png"))[:4]
    want, _ = ref_search(plain.embeddings, plain.embed([str(q) for q in queries]), 5, dim=8)
    sims, idx = index.search([str(q) for q in queries], 5)
    assert idx.tolist() == want.tolist()
    assert cli.main(["search", str(out), str(queries[0]), "--k", "5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["queries"][0]["neighbours"]
    assert [n["id"] for n in got] == want[0].tolist()
    pytest.importorskip("starlette")
    from serving import serve_in_thread

    from deepmetric.search.serve import create_app

    with serve_in_thread(create_app(index, default_k=5)) as url:
        host, port = url.removeprefix("http://").split(":")
        boundary = uuid.uuid4().hex
        body = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="q.png"\r\n'
                f'Content-Type: application/octet-stream\r\n\r\n').encode() + queries[1].read_bytes() + \
            f"\r\n--{boundary}--\r\n".encode()
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/search", body=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        r = conn.getresponse()
        data = json.loads(r.read())
        conn.close()
    assert r.status == 200 and [n["id"] for n in data["neighbours"]] == want[1].tolist()
    assert cli.main(["index", str(shapes["checkpoint"]), "--out", str(tmp_path / "bad"), "--no-progress",
                     "--postprocess", "whiten:dims=8"]) == 2
    assert "unknown key(s) 'dims'; whiten takes dim, shrinkage, fit" in capsys.readouterr().err

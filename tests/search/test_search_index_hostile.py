"""Hostile index folders (issue 32, items 6-8): one flipped byte in any file the manifest lists
makes ``search``, ``serve`` and ``index --add`` refuse, naming the file (``--add`` must never
bless it with fresh hashes); ``--overwrite`` through a symlinked ``--out`` replaces the folder
the link points to; NaN rows, labels without a class name and manifests or path lists that
point outside the folder are refused before anything outside it is touched; a full disk during
``--add`` is one clear line and the old index stays byte-identical; ``--split all`` indexes a
one-class folder with a checkpoint trained with ``class_split: half``."""
import errno
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from deepmetric import cli
from deepmetric.search import Index
from deepmetric.search import store
from deepmetric.search.index import IndexFilesError
from deepmetric.search.metadata import read_metadata, write_metadata
from search_data import make_shapes_folder, shapes_setup, tiny_config


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return shapes_setup(tmp_path_factory)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _index(ckpt, root, out, *extra):
    return cli.main(["index", str(ckpt), "--data", "folder", "--root", str(root), "--out", str(out),
                     "--no-progress", *extra])


def _query(shapes) -> str:
    return str(sorted(Path(shapes["queries"]).glob("red_disc/*.png"))[0])


@pytest.fixture(scope="module")
def owned(shapes, tmp_path_factory):
    """An index that owns image files (images/): built from embeddings, with the PNGs below it."""
    d = tmp_path_factory.mktemp("owned")
    src = make_shapes_folder(d / "src", per_class=2)
    ix = Index.load(shapes["index_dir"])
    imgs = sorted(src.rglob("*.png"))[:3]
    staging = d / "staging"  # the images an index owns are carried from its folder into the new one
    (staging / "images").mkdir(parents=True)
    for j, p in enumerate(imgs):
        shutil.copy(p, staging / "images" / f"{j:06d}.png")
    new = Index.from_embeddings(ix.embeddings[:3], ix.labels[:3], [str(staging / "images" / f"{j:06d}.png")
                                for j in range(3)], ix.class_names, meta=dict(ix.meta))
    new.directory = staging
    new.save(d / "ix")
    return d / "ix"


def _flip_one_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # same size: only the SHA-256 can tell
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("which", ["embeddings.npy", "metadata.arrow", "class_names.arrow",
                                   "index.faiss", "images/000001.png"])
def test_one_flipped_byte_in_any_listed_file_is_refused_everywhere(shapes, owned, tmp_path, capsys, which):
    ix = tmp_path / "ix"
    shutil.copytree(owned, ix)
    listed = json.loads((ix / "manifest.json").read_text())["files"]
    assert which in listed  # the check is generic over the manifest's list
    _flip_one_byte(ix / which)
    before = snapshot(ix)
    capsys.readouterr()
    commands = {
        "search": ["search", str(ix), _query(shapes), "--k", "3", "--checkpoint", str(shapes["checkpoint"])],
        "index --add": ["index", str(shapes["checkpoint"]), "--data", "folder", "--root",
                        str(make_shapes_folder(tmp_path / "more", classes=["blue_square"], per_class=1)),
                        "--out", str(ix), "--add", "--no-progress"],
        "serve": ["serve", str(ix), "--port", "1"],  # refused before binding (port 1 would fail later)
    }
    for name, argv in commands.items():
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err
        assert f"{which}: SHA-256 differs from the manifest's" in err and "--overwrite" in err, (name, err)
        assert "Traceback" not in err and err.count("\n") == 1, (name, err)
    assert snapshot(ix) == before  # --add did not rewrite the manifest over the damage
    with pytest.raises(IndexFilesError, match=which.replace(".", r"\.")):
        Index.load(ix, verify_hashes=True)


def test_search_and_add_still_work_on_an_intact_index(shapes, owned, tmp_path, capsys):
    ix = tmp_path / "ix"
    shutil.copytree(owned, ix)
    assert cli.main(["search", str(ix), _query(shapes), "--k", "2", "--json",
                     "--checkpoint", str(shapes["checkpoint"])]) == 0
    assert len(json.loads(capsys.readouterr().out)["queries"][0]["neighbours"]) == 2
    more = make_shapes_folder(tmp_path / "more", classes=["blue_square"], per_class=2)
    assert _index(shapes["checkpoint"], more, ix, "--add") == 0
    assert len(Index.load(ix, verify_hashes=True)) == 5


def test_overwrite_through_a_symlinked_out_replaces_the_linked_folder(shapes, tmp_path, capsys):
    real = tmp_path / "indexes" / "v1"
    real.parent.mkdir()
    shutil.copytree(shapes["index_dir"], real)
    link = tmp_path / "ix_link"
    link.symlink_to(real, target_is_directory=True)
    few = make_shapes_folder(tmp_path / "few", classes=["blue_square"], per_class=3)
    assert _index(shapes["checkpoint"], few, link, "--overwrite") == 0, capsys.readouterr().err
    assert link.is_symlink() and link.resolve() == real.resolve()  # the link is kept, its folder replaced
    assert len(Index.load(real, verify_hashes=True)) == 3 and len(Index.load(link)) == 3
    leftovers = [p.name for d in (tmp_path, real.parent) for p in d.iterdir() if ".tmp" in p.name]
    assert leftovers == []
    # --add through the link works the same way
    more = make_shapes_folder(tmp_path / "more", classes=["red_disc"], per_class=2)
    assert _index(shapes["checkpoint"], more, link, "--add") == 0
    assert link.is_symlink() and len(Index.load(real, verify_hashes=True)) == 5


def test_an_old_swap_s_leftover_link_is_removed(shapes, tmp_path):
    real = tmp_path / "real"
    shutil.copytree(shapes["index_dir"], real)
    stale = tmp_path / f".real.tmp-{2 ** 22 + 12345}-abcd"  # a PID that does not exist
    stale.symlink_to(real, target_is_directory=True)
    Index.load(real).save(real)
    assert not os.path.lexists(stale) and len(Index.load(real)) == 32


def _rewrite(ix: Path, name: str, data: bytes) -> None:
    """Replace a file and re-bless the manifest (as a buggy tool or a hostile user would)."""
    (ix / name).write_bytes(data)
    m = json.loads((ix / "manifest.json").read_text())
    m["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ix / "manifest.json").write_text(json.dumps(m))


def _npy(arr) -> bytes:
    f = io.BytesIO()
    np.save(f, arr)
    return f.getvalue()


def _rewrite_metadata(ix: Path, tmp: Path, *, row: int, path: str | None = None, label: int | None = None) -> None:
    """Change one row of metadata.arrow (format 3) and re-bless the manifest."""
    got = read_metadata(ix)
    root = str(ix.resolve()) + os.sep  # stored relative only when inside the folder, as the writer does
    paths = [p[len(root):] if p.startswith(root) else p for p in got[0]]
    labels = np.array(got[1])
    if path is not None:
        paths[row] = path
    if label is not None:
        labels[row] = label
    tmp.mkdir()
    write_metadata(tmp, paths, labels, got[2])
    _rewrite(ix, "metadata.arrow", (tmp / "metadata.arrow").read_bytes())


def test_a_nan_row_and_a_label_without_a_name_are_clear_errors(shapes, tmp_path, capsys):
    ix = tmp_path / "ix"
    shutil.copytree(shapes["index_dir"], ix)
    emb = np.load(ix / "embeddings.npy")
    emb[5, 3] = np.nan
    _rewrite(ix, "embeddings.npy", _npy(emb))
    for mmap in (False, True):
        with pytest.raises(ValueError, match=r"embeddings\.npy: row 5 holds NaN or infinite values"):
            Index.load(ix, mmap=mmap)
    assert cli.main(["search", str(ix), _query(shapes), "--k", "4"]) == 2
    assert "row 5 holds NaN" in capsys.readouterr().err
    shutil.rmtree(ix)
    shutil.copytree(shapes["index_dir"], ix)
    _rewrite_metadata(ix, tmp_path / "meta", row=7, label=4)  # four classes: 0..3
    assert cli.main(["search", str(ix), _query(shapes), "--k", "4"]) == 2
    err = capsys.readouterr().err
    assert "metadata.arrow: row 7 has label 4, but class_names.arrow names 4 classes (labels 0..3)" in err
    assert "Traceback" not in err


def test_negative_or_huge_labels_are_refused_before_anything_is_written(tmp_path, capsys):
    """A negative label made an index ('0 classes') that export and --add could not read back; a
    label of 3e12 without class names made the index name 3e12 classes (the kernel killed it)."""
    x = np.random.default_rng(0).standard_normal((40, 8)).astype(np.float32)
    cases = {"negative": (np.arange(40) % 4 - 10, "label -10 is negative"),
             "huge": ((np.arange(40) % 4) * 10**12, "label 3000000000000 without class_names")}
    for name, (labels, said) in cases.items():
        np.savez(tmp_path / f"{name}.npz", embeddings=x, labels=labels)
        assert cli.main(["index", "--embeddings", str(tmp_path / f"{name}.npz"), "--out", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert said in err and "numpy.unique(labels, return_inverse=True)" in err and err.count("\n") == 1
        assert not (tmp_path / name).exists()
    # large labels with their class names are fine: the names list is given, not made
    names = [f"c{i}" for i in range(10**6 + 1)]
    index = Index.from_embeddings(x[:2], np.array([0, 10**6]), class_names=names)
    assert index.class_names[10**6] == "c1000000"


@pytest.mark.parametrize("listed", ["../../../../etc/hostname", "/etc/hostname", "images/../../outside.txt"])
def test_a_manifest_listing_files_outside_is_refused_before_touching_them(shapes, tmp_path, monkeypatch, listed):
    ix = tmp_path / "deep" / "er" / "ix"
    shutil.copytree(shapes["index_dir"], ix)
    m = json.loads((ix / "manifest.json").read_text())
    m["files"][listed] = {"bytes": 7, "sha256": "0" * 64}
    (ix / "manifest.json").write_text(json.dumps(m))
    touched = []
    real_lstat, real_stat = os.lstat, os.stat

    def spy(fn):
        def wrapped(p, *a, **kw):
            if "dir_fd" not in kw and not str(Path(os.fspath(p)).absolute()).startswith(str(ix)):
                touched.append(str(p))
            return fn(p, *a, **kw)
        return wrapped

    monkeypatch.setattr(os, "lstat", spy(real_lstat))
    monkeypatch.setattr(os, "stat", spy(real_stat))
    with pytest.raises(IndexFilesError, match=rf"manifest\.json: 'files' lists '{listed}', which is not a file inside"):
        Index.load(ix, verify_hashes=True)
    monkeypatch.undo()
    assert not [t for t in touched if "hostname" in t or "outside" in t]


def test_relative_image_paths_and_links_leaving_the_folder_are_refused(shapes, tmp_path):
    ix = tmp_path / "ix"
    shutil.copytree(shapes["index_dir"], ix)
    _rewrite_metadata(ix, tmp_path / "meta", row=0, path="../../secret.png")
    for mmap in (False, True):
        with pytest.raises(IndexFilesError, match=r"metadata\.arrow: entry 0 \('\.\./\.\./secret\.png'\) leaves the "
                                                  "index folder"):
            Index.load(ix, mmap=mmap)
    shutil.rmtree(ix)
    shutil.copytree(shapes["index_dir"], ix)
    (tmp_path / "elsewhere.arrow").write_bytes((ix / "class_names.arrow").read_bytes())
    (ix / "class_names.arrow").unlink()
    (ix / "class_names.arrow").symlink_to(tmp_path / "elsewhere.arrow")
    with pytest.raises(IndexFilesError, match=r"class_names\.arrow: is a symbolic link"):
        Index.load(ix)


def test_disk_full_during_add_is_one_line_and_the_old_index_is_intact(shapes, tmp_path, capsys, monkeypatch):
    ix = tmp_path / "ix"
    shutil.copytree(shapes["index_dir"], ix)
    before = snapshot(ix)
    more = make_shapes_folder(tmp_path / "more", classes=["blue_square"], per_class=2)
    real = store.write_file

    def full(path, data):
        if Path(path).name == "index.faiss":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(store, "write_file", full)
    import deepmetric.search.index as index_module

    monkeypatch.setattr(index_module, "write_file", full)
    capsys.readouterr()
    assert _index(shapes["checkpoint"], more, ix, "--add") == 2
    err = capsys.readouterr().err
    assert f"no space left on the device while writing the index {ix.resolve()}" in err
    assert "the index there is unchanged" in err and "Traceback" not in err and err.count("\n") == 1
    assert snapshot(ix) == before and [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_split_all_indexes_one_class_with_a_class_split_checkpoint(tmp_path, capsys):
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.train.loop import train

    folder = make_shapes_folder(tmp_path / "four", per_class=4)
    raw = tiny_config(folder, tmp_path / "run", epochs=1)
    raw["data"]["options"] = {"class_split": "half"}
    raw["train"]["batch_size"] = 8
    raw["eval"] = {"every": 0, "split": "test"}
    train(config_from_dict(raw))
    one = make_shapes_folder(tmp_path / "one", classes=["red_disc"], per_class=3)
    assert _index(tmp_path / "run" / "last.pt", one, tmp_path / "ix", "--split", "all") == 0, \
        capsys.readouterr().err
    index = Index.load(tmp_path / "ix")
    assert len(index) == 3 and index.class_names == ["red_disc"]


def test_a_checkpoint_that_embeds_nan_indexes_nothing_and_names_the_image(shapes, tmp_path, capsys):
    import torch

    state = torch.load(shapes["checkpoint"], weights_only=True)
    name = next(k for k, v in state["model"].items() if v.is_floating_point() and v.ndim > 1)
    state["model"][name].view(-1)[0] = float("nan")
    bad = tmp_path / "diverged.pt"
    torch.save(state, bad)
    few = make_shapes_folder(tmp_path / "few", classes=["red_disc"], per_class=2)
    capsys.readouterr()
    assert _index(bad, few, tmp_path / "ix") == 2
    err = capsys.readouterr().err
    first = few / "red_disc" / "red_disc_00.png"
    assert err == (f"deepmetric index: error: checkpoint {bad} embeds 2 of 2 image(s) as NaN / inf, the first "
                   f"{first}; nothing was indexed (a diverged run? index with an earlier checkpoint, best.pt)\n")
    assert not (tmp_path / "ix").exists()
    # embed refuses the same checkpoint with the same check (one function, run.embed's), not a twin
    npz = tmp_path / "e.npz"
    assert cli.main(["embed", str(bad), "--data", "folder", "--root", str(few), "--split", "all",
                     "--out", str(npz)]) == 2
    assert capsys.readouterr().err == (
        f"deepmetric embed: error: checkpoint {bad} embeds 2 of 2 image(s) as NaN / inf, the first {first}; "
        f"nothing was written to {npz} (a diverged run? embed with an earlier checkpoint, best.pt)\n")
    assert not npz.exists()


def test_the_torchrun_branch_refuses_nan_embeddings_as_one_process_does(shapes, tmp_path):
    """Rank 0 of a torchrun index read its shards back and indexed them without the NaN check of
    the one-process branch.  A stand-in shard plan embeds every row in this process (the real
    plan's ``run`` contract: rank 0 gets all rows back, in order)."""
    import torch

    from deepmetric.search.build import embed_dataset_for_index

    class InProcessShards:
        def run(self, rows, paths, embed, *, progress=False):
            return embed(list(rows))

        def summary(self):
            return {}

    state = torch.load(shapes["checkpoint"], weights_only=True)
    name = next(k for k, v in state["model"].items() if v.is_floating_point() and v.ndim > 1)
    few = make_shapes_folder(tmp_path / "few", classes=["red_disc"], per_class=2)
    good = embed_dataset_for_index(shapes["checkpoint"], data="folder", root=str(few), split="all",
                                   device="cpu", progress=False, shards=InProcessShards())
    assert good["embeddings"].shape[0] == 2 and np.isfinite(good["embeddings"]).all()
    state["model"][name].view(-1)[0] = float("nan")
    bad = tmp_path / "diverged.pt"
    torch.save(state, bad)
    first = (few / "red_disc" / "red_disc_00.png").resolve()
    with pytest.raises(ValueError, match=rf"embeds 2 of 2 image\(s\) as NaN / inf, the first {first}; nothing was "
                                         r"indexed"):
        embed_dataset_for_index(bad, data="folder", root=str(few), split="all", device="cpu", progress=False,
                                shards=InProcessShards())


def test_a_query_that_embeds_as_nan_is_refused(shapes, monkeypatch):
    index = Index.load(shapes["index_dir"])
    good = index.embeddings[:2].copy()
    good[1, 0] = np.nan
    monkeypatch.setattr(index, "embed", lambda images: good)
    with pytest.raises(ValueError, match=r"query image b\.png embeds as NaN / inf"):
        index.search(["a.png", "b.png"], k=4)
    sims, idx = index.search(good[:1], k=4)  # embeddings: checked as before, a finite row gets k rows
    assert idx.shape == (1, 4) and (idx >= 0).all()


def test_add_migrate_and_export_refuse_a_flipped_byte(tmp_path, capsys):
    """`index --embeddings FILE --add` (vectors a user already has), `index migrate` and `index
    export` check the index's SHA-256s like the checkpoint path: a flipped byte that still parses
    is never blessed with fresh hashes nor copied out."""
    import numpy as np

    from deepmetric import cli

    rng = np.random.default_rng(0)
    emb = tmp_path / "emb.npz"
    np.savez(emb, embeddings=rng.normal(size=(40, 8)).astype(np.float32), labels=np.arange(40) % 4)
    more = tmp_path / "more.npz"
    np.savez(more, embeddings=rng.normal(size=(10, 8)).astype(np.float32), labels=np.arange(10) % 4)
    out = tmp_path / "ix"
    assert cli.main(["index", "--embeddings", str(emb), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    name = "embeddings.npy"
    assert name in manifest["files"]
    raw = bytearray((out / name).read_bytes())
    raw[-1] ^= 0x01  # the last float's lowest bit: the file still parses, only its hash tells
    (out / name).write_bytes(bytes(raw))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    for cmd in (["index", "--embeddings", str(more), "--out", str(out), "--add"],
                ["index", "migrate", str(out)],
                ["index", "export", str(out), "--to", f"parquet:{tmp_path / 'x.parquet'}"]):
        assert cli.main(cmd) == 2, cmd
        err = capsys.readouterr().err
        assert name in err and "SHA-256" in err and "Traceback" not in err, (cmd, err)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert not (tmp_path / "x.parquet").exists()


def test_vectors_from_a_file_are_not_added_to_an_index_of_a_checkpoint(shapes, tmp_path, capsys):
    """They were added (exit 0) and answered searches as images of the index's classes, while
    the manifest still credited the checkpoint: refused, the index unchanged."""
    ix = tmp_path / "ix"
    shutil.copytree(shapes["index_dir"], ix)
    before = _tree_bytes(ix)
    dim = Index.load(ix).dim
    np.savez(tmp_path / "v.npz", embeddings=np.random.default_rng(0).standard_normal((3, dim)).astype(np.float32),
             labels=np.array([0, 1, 2]))
    assert cli.main(["index", "--embeddings", str(tmp_path / "v.npz"), "--out", str(ix), "--add"]) == 2
    err = capsys.readouterr().err
    assert "holds images embedded by the checkpoint" in err and "Traceback" not in err
    assert _tree_bytes(ix) == before


def _tree_bytes(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}


def _parquet(file, n=6, d=4, **columns):
    """A parquet file with the export's columns, as another tool writes it (pandas-style plain
    lists unless ``vector`` is given)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, d)).astype(np.float32)
    table = {"path": pa.array([f"img{i}.png" for i in range(n)]), "label": pa.array([i % 3 for i in range(n)]),
             "class_name": pa.array([f"c{i % 3}" for i in range(n)]), "vector": pa.array([list(v) for v in vectors])}
    table.update(columns)
    pq.write_table(pa.table(table), file)
    return vectors


def test_parquet_from_another_tool_is_read_or_refused_naming_the_column(tmp_path, capsys):
    """A parquet file not written by 'index export' (the hostile trial): plain list vectors and
    string labels are read; float labels (truncated before), null labels / paths, a column of
    strings for vectors and ragged vectors (tracebacks before) are refused naming the file, the
    column and the row, and nothing is written."""
    pa = pytest.importorskip("pyarrow")
    plain = tmp_path / "plain.parquet"
    vectors = _parquet(plain, label=pa.array(["dog", "cat", "dog", "ant", "cat", "ant"]))
    assert cli.main(["index", "--embeddings", str(plain), "--out", str(tmp_path / "ok")]) == 0
    index = Index.load(tmp_path / "ok")
    ref = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    assert np.abs(np.asarray(index.embeddings) - ref).max() < 1e-6
    assert index.class_names == ["ant", "cat", "dog"] and list(index.labels) == [2, 1, 2, 0, 1, 0]
    cases = {
        "float_labels": ({"label": pa.array([0.5, 1.0, 0.0, 1.0, 2.0, 2.0])},
                         "column 'label' holds double; expected integers (class numbers) or strings"),
        "null_label": ({"label": pa.array([0, 1, None, 1, 2, 2])}, "column 'label' is empty (null) in 1 row(s), "
                       "the first row 2"),
        "null_path": ({"path": pa.array(["a", "b", "c", "d", None, None])}, "column 'path' is empty (null) in 2 "
                      "row(s), the first row 4"),
        "string_vectors": ({"vector": pa.array(["x"] * 6)}, "column 'vector' holds string; expected a list of "
                           "numbers per row"),
        "ragged": ({"vector": pa.array([[1.0, 2.0]] * 3 + [[1.0, 2.0, 3.0]] * 3)}, "column 'vector': row 3 has 3 "
                   "numbers, row 0 has 2; every vector must have the same length"),
        "nan": ({"vector": pa.array([[1.0, 2.0]] * 5 + [[float("nan"), 2.0]])}, "column 'vector': 1 row(s) hold "
                "NaN or infinite values, the first row 5"),
    }
    capsys.readouterr()
    for name, (columns, said) in cases.items():
        f = tmp_path / f"{name}.parquet"
        _parquet(f, **columns)
        assert cli.main(["index", "--embeddings", str(f), "--out", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert f"--embeddings {f}: {said}" in err and err.count("\n") == 1, (name, err)
        assert not (tmp_path / name).exists()


def test_npz_vectors_that_are_not_finite_numbers_are_refused_naming_the_file(tmp_path, capsys):
    x = np.ones((5, 3), np.float32)
    x[3, 1] = np.inf
    cases = {"inf": (x, "array 'embeddings': 1 row(s) hold NaN or infinite values, the first row 3"),
             "text": (np.array([["a", "b"]]), "array 'embeddings' holds <U1; expected numbers (float32)")}
    for name, (emb, said) in cases.items():
        np.savez(tmp_path / f"{name}.npz", embeddings=emb)
        assert cli.main(["index", "--embeddings", str(tmp_path / f"{name}.npz"), "--out", str(tmp_path / name)]) == 2
        assert f"--embeddings {tmp_path / f'{name}.npz'}: {said}" in capsys.readouterr().err
        assert not (tmp_path / name).exists()

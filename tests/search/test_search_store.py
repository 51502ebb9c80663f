"""Index folders as transactions: a failing ``index --add`` (a file name that is not UTF-8, an
unreadable image, a crash while writing) leaves the old index byte-identical, searchable and
without temporary leftovers; ``--out EXISTING`` needs --add or --overwrite; the manifest lists
every file's size and SHA-256 (checked against hashlib here) and ``load`` checks them; old
indexes without them load with a warning; images the index owns are carried as hard links."""
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deepmetric import cli
from deepmetric.search import Index
from deepmetric.search.index import IndexFilesError
from deepmetric.search.store import IndexBusyError
from search_data import make_shapes_folder, shapes_setup


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return shapes_setup(tmp_path_factory)


def snapshot(folder: Path) -> dict:
    """Every file below ``folder``: relative path -> (bytes, SHA-256)."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp" in p.name)


def _index(ckpt, root, out, *extra):
    return cli.main(["index", str(ckpt), "--data", "folder", "--root", str(root), "--out", str(out),
                     "--no-progress", *extra])


@pytest.fixture
def built(shapes, tmp_path):
    """A 16-image index of two classes in tmp_path/ix, its snapshot, and a query."""
    part = make_shapes_folder(tmp_path / "part", classes=["red_disc", "yellow_cross"])
    out = tmp_path / "ix"
    assert _index(shapes["checkpoint"], part, out) == 0
    query = sorted(Path(shapes["queries"]).glob("red_disc/*.png"))[0]
    return out, snapshot(out), query, part


def _still_the_old_index(out, before, query):
    assert snapshot(out) == before
    assert leftovers(out.parent) == []
    index = Index.load(out, verify_hashes=True)
    sims, idx = index.search(str(query), k=3)
    assert len(index) == 16 and [r["class_name"] for r in index.neighbours(sims, idx)[0]] == ["red_disc"] * 3


def test_manifest_lists_every_file_with_its_sha256(built):
    out, before, _, _ = built
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 3
    listed = manifest["files"]
    assert sorted(listed) == sorted(k for k in before if k != "manifest.json")
    for rel, entry in listed.items():
        assert (entry["bytes"], entry["sha256"]) == before[rel]


def test_add_with_a_file_name_that_is_not_utf8_changes_nothing(shapes, built, tmp_path, capsys):
    out, before, query, _ = built
    more = make_shapes_folder(tmp_path / "more", classes=["blue_square"])
    bad = os.fsencode(more / "blue_square") + b"/caf\xe9.png"  # Latin-1 bytes, not UTF-8
    with open(bad, "wb") as f:
        f.write((more / "blue_square" / "blue_square_00.png").read_bytes())
    capsys.readouterr()
    assert _index(shapes["checkpoint"], more, out, "--add") == 2
    err = capsys.readouterr().err
    assert "is not valid UTF-8" in err and "caf\\xe9.png" in err and str(more / "blue_square") in err
    _still_the_old_index(out, before, query)


def test_add_with_an_unreadable_image_changes_nothing(shapes, built, tmp_path, capsys):
    out, before, query, _ = built
    more = make_shapes_folder(tmp_path / "more", classes=["blue_square"])
    cut = more / "blue_square" / "blue_square_05.png"
    cut.write_bytes(cut.read_bytes()[:-50])
    assert _index(shapes["checkpoint"], more, out, "--add") == 2
    err = capsys.readouterr().err
    assert str(cut) in err and "truncated" in err
    _still_the_old_index(out, before, query)


def test_a_crash_while_writing_changes_nothing(shapes, built, tmp_path, monkeypatch):
    out, before, query, _ = built
    more = make_shapes_folder(tmp_path / "more", classes=["blue_square"])
    import deepmetric.search.index as index_module

    def broken(path, data):
        Path(path).write_bytes(b"half")
        if Path(path).name == "index.faiss":
            raise KeyboardInterrupt  # Ctrl-C in the middle of the write

    monkeypatch.setattr(index_module, "write_file", broken)
    with pytest.raises(KeyboardInterrupt):
        Index.build(shapes["checkpoint"], data="folder", root=str(more), out=out, add=True, progress=False)
    monkeypatch.undo()
    _still_the_old_index(out, before, query)


def test_out_existing_needs_add_or_overwrite(shapes, built, tmp_path, capsys):
    out, before, query, _ = built
    few = make_shapes_folder(tmp_path / "few", classes=["blue_square"], per_class=3)
    capsys.readouterr()
    assert _index(shapes["checkpoint"], few, out) == 2
    err = capsys.readouterr().err
    assert f"--out {out} already holds an index (16 images)" in err and "--add" in err and "--overwrite" in err
    _still_the_old_index(out, before, query)
    assert _index(shapes["checkpoint"], few, out, "--overwrite") == 0
    assert len(Index.load(out)) == 3 and leftovers(out.parent) == []
    # a folder that is not an index is never replaced, even with --overwrite
    mine = tmp_path / "my_photos"
    mine.mkdir()
    (mine / "holiday.jpg").write_bytes(b"precious")
    for extra in ([], ["--overwrite"]):
        assert _index(shapes["checkpoint"], few, mine, *extra) == 2
        assert "not empty and not a deepmetric index" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["holiday.jpg"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _index(shapes["checkpoint"], few, empty) == 0 and len(Index.load(empty)) == 3


def test_load_checks_sizes_always_and_hashes_on_request(built):
    out, _, _, _ = built
    p = out / "metadata.arrow"
    data = p.read_bytes()
    assert b"red_disc_00" in data
    p.write_bytes(data.replace(b"red_disc_00", b"red_disc_99"))  # same size, other content
    Index.load(out)  # sizes agree
    with pytest.raises(IndexFilesError, match=r"metadata\.arrow: SHA-256 differs from the manifest's"):
        Index.load(out, verify_hashes=True)
    p.write_bytes(data + b" ")
    with pytest.raises(IndexFilesError, match=r"metadata\.arrow: \d+ bytes, the manifest says \d+.*--overwrite"):
        Index.load(out)
    p.unlink()
    with pytest.raises(FileNotFoundError, match="missing metadata.arrow"):
        Index.load(out)


def test_old_index_without_file_list_loads_with_a_warning_and_add_upgrades_it(shapes, built, tmp_path):
    out = built[0]
    m = json.loads((out / "manifest.json").read_text())
    del m["files"]
    # a current manifest without its file list was edited: refused, not loaded unchecked
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"manifest.json: index version 3 but no 'files'.*--overwrite"):
        Index.load(out, verify_hashes=True)
    m["version"] = 1
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match=r"older deepmetric \(version 1\).*--overwrite"):
        index = Index.load(out)
    assert len(index) == 16
    more = make_shapes_folder(tmp_path / "more", classes=["blue_square"], per_class=2)
    with pytest.warns(UserWarning, match="older deepmetric"):
        assert _index(shapes["checkpoint"], more, out, "--add") == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["version"] == 3 and len(m["files"]) == 4 and len(Index.load(out)) == 18


def test_owned_images_are_carried_as_hard_links(tmp_path, rng):
    """Images inside an index folder (PNG copies of in-memory benchmarks) move with it: a
    re-save carries them into the new folder as links to the same files."""
    a = tmp_path / "a"
    (a / "images").mkdir(parents=True)
    paths = []
    for i in range(3):
        p = a / "images" / f"{i:06d}.png"
        Image.new("L", (4, 4), i * 60).save(p)
        paths.append(str(p))
    index = Index.from_embeddings(rng.normal(size=(3, 5)), [0, 1, 1], paths, ["x", "y"])
    index.directory = a  # as if loaded from a
    b = tmp_path / "b"
    index.save(b)
    import pyarrow as pa
    table = pa.ipc.open_file(pa.memory_map(str(b / "metadata.arrow"))).read_all()
    assert table.column("path").to_pylist() == [f"images/{i:06d}.png" for i in range(3)]
    assert os.path.samefile(b / "images" / "000001.png", a / "images" / "000001.png")
    loaded = Index.load(b, verify_hashes=True)
    assert loaded.paths == [str(b.resolve() / "images" / f"{i:06d}.png") for i in range(3)]
    shutil.rmtree(a)
    loaded.add(rng.normal(size=(1, 5)), [0], [""], ["z"])
    loaded.save(b)  # onto itself: the images survive the swap
    again = Index.load(b, verify_hashes=True)
    assert len(again) == 4 and np.asarray(Image.open(again.paths[2])).max() == 120
    assert leftovers(tmp_path) == []


def test_migrating_an_old_index_that_lost_an_image_names_the_image_and_changes_nothing(tmp_path, rng, capsys):
    """A version-1 index lists no files, so an image gone from its images/ is only met when
    ``index migrate`` carries it into the new folder: that said a bare '[Errno 2] ...'."""
    a = tmp_path / "a"
    (a / "images").mkdir(parents=True)
    paths = []
    for i in range(3):
        paths.append(a / "images" / f"{i:06d}.png")
        Image.new("L", (4, 4), i * 60).save(paths[-1])
    index = Index.from_embeddings(rng.normal(size=(3, 5)), [0, 1, 1], [str(p) for p in paths], ["x", "y"])
    index.directory = a  # as if loaded from a: the images are the index's own
    d = tmp_path / "ix"
    index.save(d)
    shutil.rmtree(a)
    m = json.loads((d / "manifest.json").read_text())
    del m["files"]
    m["version"] = 1
    (d / "manifest.json").write_text(json.dumps(m))
    gone = d / "images" / "000001.png"
    kept = gone.read_bytes()
    gone.unlink()
    before = snapshot(d)
    capsys.readouterr()
    assert cli.main(["index", "migrate", str(d)]) == 2
    err = capsys.readouterr().err
    assert err == (f"deepmetric index migrate: error: image {gone.resolve()} of the index is missing: an index keeps "
                   "the images inside its folder and carries each one along when it is rewritten, so each must be "
                   "there; restore it, or rebuild the index with 'deepmetric index ... --overwrite' (the index was "
                   "not changed)\n")
    assert snapshot(d) == before and leftovers(tmp_path) == []
    gone.write_bytes(kept)  # restored, as the message says: migrated, every file listed
    assert cli.main(["index", "migrate", str(d)]) == 0
    listed = json.loads((d / "manifest.json").read_text())["files"]
    assert listed["images/000001.png"]["sha256"] == hashlib.sha256(kept).hexdigest()
    assert Index.load(d, verify_hashes=True).paths[1] == str(gone.resolve())


def test_stale_temporary_folders_of_killed_writers_are_removed(tmp_path, rng):
    dead = subprocess.Popen(["true"])  # a process id that no longer runs
    dead.wait()
    stale = tmp_path / f".ix.tmp-{dead.pid}-0badc0de"
    stale.mkdir()
    (stale / "embeddings.npy").write_bytes(b"half written")
    Index.from_embeddings(rng.normal(size=(4, 3))).save(tmp_path / "ix")
    assert leftovers(tmp_path) == [] and len(Index.load(tmp_path / "ix")) == 4


def test_one_writer_at_a_time(tmp_path, rng):
    import fcntl

    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(IndexBusyError, match="another process is writing an index in"):
            Index.from_embeddings(rng.normal(size=(4, 3))).save(tmp_path / "ix")
    finally:
        os.close(fd)
    assert not (tmp_path / "ix").exists() and leftovers(tmp_path) == []

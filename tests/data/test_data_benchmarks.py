"""Benchmark loaders on miniature trees written in the exact official formats.

Each builder writes the same text files / MATLAB structs as the official archive (the .mat
files with scipy.io.savemat, shaped as the real ones: Cars196 'annotations' is a 1 x N
struct array, Stanford Dogs 'file_list' an N x 1 cell, Flowers102 'labels' 1 x N) and tiny
real JPEGs, then the tests compare what the loaders return with expectations computed
plainly from what was written.
"""
import copy
import uuid

import numpy as np
import pytest
import scipy.io as sio
import torch
from PIL import Image

from deepmetric.data import ImageListDataset, build_dataset, list_datasets
from deepmetric.data import benchmarks as B


def _jpg(path, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 255, size=(6, 5, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, format="JPEG")


# ----------------------------------------------------------------------------- builders
def make_cub(root, n_classes=4, nabirds=False):
    """CUB_200_2011 layout; class c has c+1 images; every second image is a training image.
    With nabirds=True: UUID image ids and non-contiguous class ids, as in nabirds/."""
    root.mkdir(parents=True)
    class_ids = [295, 817, 1000, 1010, 1011, 1012][:n_classes] if nabirds else list(range(1, n_classes + 1))
    images, labels, split, classes, truth = [], [], [], [], []
    k = 0
    for j, c in enumerate(class_ids):
        folder = f"{c:04d}" if nabirds else f"{c:03d}.Bird_{c}"
        classes.append(f"{c} {'Oak Titmouse' if nabirds else folder}_{c}")
        for i in range(j + 2):
            k += 1
            iid = str(uuid.UUID(int=k)) if nabirds else str(k)
            rel = f"{folder}/{iid.replace('-', '')}.jpg" if nabirds else f"{folder}/Bird_{c}_{i:04d}.jpg"
            images.append(f"{iid} {rel}")
            labels.append(f"{iid} {c}")
            is_train = k % 2
            split.append(f"{iid} {is_train}")
            truth.append((str(root / "images" / rel), c, bool(is_train)))
            _jpg(root / "images" / rel, k)
    for fname, lines in (("images.txt", images), ("image_class_labels.txt", labels),
                         ("train_test_split.txt", split), ("classes.txt", classes)):
        (root / fname).write_text("\n".join(lines) + "\n")
    return truth


def make_cars(root, n_classes=4):
    root.mkdir(parents=True)
    dt = [(f, "O") for f in ("relative_im_path", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test")]
    recs, truth = [], []
    k = 0
    for c in range(1, n_classes + 1):
        for _ in range(c + 1):
            k += 1
            rel = f"car_ims/{k:06d}.jpg"
            test = (k + c) % 2
            one = lambda v: np.array([[v]], dtype=np.uint8)  # noqa: E731
            recs.append((rel, one(1), one(2), one(5), one(4), one(c), one(test)))
            truth.append((str(root / rel), c, bool(test)))
            _jpg(root / rel, k)
    ann = np.zeros((1, len(recs)), dtype=dt)
    for i, r in enumerate(recs):
        ann[0, i] = r
    names = np.empty((1, n_classes), dtype=object)
    for c in range(n_classes):
        names[0, c] = f"Make{c + 1} Model Sedan 2012"
    sio.savemat(root / "cars_annos.mat", {"annotations": ann, "class_names": names})
    return truth


def make_sop(root):
    root.mkdir(parents=True)
    truth = {"train": [], "test": []}
    k = 0
    for split, cls in (("train", [1, 2, 3]), ("test", [4, 5, 6, 7])):
        lines = ["image_id class_id super_class_id path"]
        for c in cls:
            for i in range(2 if c % 2 else 3):
                k += 1
                rel = f"bicycle_final/{111085122870 + c}_{i}.JPG"
                lines.append(f"{k} {c} 1 {rel}")
                truth[split].append((str(root / rel), c))
                _jpg(root / rel, k)
        (root / f"Ebay_{split}.txt").write_text("\n".join(lines) + "\n")
    (root / "Ebay_info.txt").write_text("image_id class_id super_class_id path\n")
    return truth


def make_inshop(root, official=True):
    """official=True: Eval/list_eval_partition.txt + Img/img/...; else both at root."""
    root.mkdir(parents=True)
    rows, truth = [], []
    k = 0
    plan = [(1, "train", 2), (2, "train", 3), (3, "train", 1),
            (4, "query", 1), (4, "gallery", 2), (5, "query", 2), (5, "gallery", 1), (7, "query", 1),
            (6, "gallery", 2)]  # item 7 only in query, item 6 only in gallery
    for item, status, n in plan:
        for i in range(n):
            k += 1
            name = f"img/WOMEN/Dresses/id_{item:08d}/{k:02d}_{i + 1}_front.jpg"
            rows.append(f"{name} id_{item:08d} {status}")
            base = root / "Img" if official else root
            truth.append((str(base / name), f"id_{item:08d}", status))
            _jpg(base / name, k)
    text = f"{len(rows)}\nimage_name item_id evaluation_status\n" + "\n".join(rows) + "\n"
    part = root / "Eval" / "list_eval_partition.txt" if official else root / "list_eval_partition.txt"
    part.parent.mkdir(exist_ok=True)
    part.write_text(text)
    return truth


def make_flowers(root):
    root.mkdir(parents=True)
    labels = np.array([1, 3, 2, 4, 4, 1, 2, 3, 3, 1, 4, 2, 1, 2], dtype=np.float64)  # 14 images, 4 classes
    for j in range(1, len(labels) + 1):
        _jpg(root / "jpg" / f"image_{j:05d}.jpg", j)
    sio.savemat(root / "imagelabels.mat", {"labels": labels[None, :]})
    trn, val, tst = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13, 14]
    sio.savemat(root / "setid.mat", {k: np.array([v], dtype=np.uint16)
                                     for k, v in (("trnid", trn), ("valid", val), ("tstid", tst))})
    return labels.astype(int), {"train": trn, "val": val, "test": tst}


AIRCRAFT_VARIANTS = ["707-320", "A300B4", "Cessna 172", "F/A-18"]


def make_aircraft(root):
    data = root / "data"
    data.mkdir(parents=True)
    (data / "variants.txt").write_text("\n".join(AIRCRAFT_VARIANTS) + "\n")
    truth = {"train": [], "val": [], "test": []}
    k = 1000000
    for s in ("train", "val", "test"):
        lines = []
        for v in AIRCRAFT_VARIANTS:
            for _ in range(2 if s == "train" else 1):
                k += 1
                lines.append(f"{k:07d} {v}")
                truth[s].append((str(data / "images" / f"{k:07d}.jpg"), v))
                _jpg(data / "images" / f"{k:07d}.jpg", k)
        (data / f"images_variant_{s}.txt").write_text("\n".join(lines) + "\n")
    return truth


DOG_BREEDS = ["n02085620-Chihuahua", "n02085782-Japanese_spaniel", "n02085936-Maltese_dog"]


def make_dogs(root):
    root.mkdir(parents=True)
    truth = {}
    k = 0
    for split, n in (("train", 2), ("test", 1)):
        files, labs = [], []
        for c, breed in enumerate(DOG_BREEDS, start=1):
            for _ in range(n + (c == 2)):
                k += 1
                rel = f"{breed}/{breed.split('-')[0]}_{k}.jpg"
                files.append(rel)
                labs.append(c)
                _jpg(root / "Images" / rel, k)
        fl = np.empty((len(files), 1), dtype=object)
        al = np.empty((len(files), 1), dtype=object)
        for i, f in enumerate(files):
            fl[i, 0] = f
            al[i, 0] = f[:-4]
        sio.savemat(root / f"{split}_list.mat",
                    {"file_list": fl, "annotation_list": al, "labels": np.array(labs, dtype=np.float64)[:, None]})
        truth[split] = [(str(root / "Images" / f), c) for f, c in zip(files, labs)]
    return truth


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench")
    t = {}
    t["cub"] = (base / "CUB_200_2011", make_cub(base / "CUB_200_2011"))
    t["nabirds"] = (base / "nabirds", make_cub(base / "nabirds", nabirds=True))
    t["cars196"] = (base / "cars", make_cars(base / "cars"))
    t["sop"] = (base / "Stanford_Online_Products", make_sop(base / "Stanford_Online_Products"))
    t["inshop"] = (base / "inshop", make_inshop(base / "inshop"))
    t["flowers102"] = (base / "flowers", make_flowers(base / "flowers"))
    t["aircraft"] = (base / "fgvc-aircraft-2013b", make_aircraft(base / "fgvc-aircraft-2013b"))
    t["dogs"] = (base / "dogs", make_dogs(base / "dogs"))
    return t


def _rank(values):
    """Independent remapping: position of each value among the sorted unique values."""
    u = sorted(set(values))
    return [u.index(v) for v in values]


def _check(ds, expected):
    """expected: list of (path, original class id) in file order."""
    assert ds.paths == [p for p, _ in expected]
    assert ds.labels.dtype == np.int64
    assert ds.labels.tolist() == _rank([c for _, c in expected])
    assert ds.num_classes == len({c for _, c in expected})
    assert [ds.class_ids[l] for l in ds.labels] == [c for _, c in expected]


# ----------------------------------------------------------------------------- loaders
@pytest.mark.parametrize("name", ["cub", "nabirds"])
def test_cub_like_classification(trees, name):
    root, truth = trees[name]
    for split, flag in (("train", True), ("test", False)):
        ds = build_dataset(name, root, split=split, protocol="classification")
        _check(ds, [(p, c) for p, c, t in truth if t == flag])
    assert ds.class_names[0].endswith("_" + str(ds.class_ids[0]))  # from classes.txt


def test_cub_zero_shot(trees):
    root, truth = trees["cub"]
    ids = sorted({c for _, c, _ in truth})
    first = set(ids[: len(ids) // 2])  # classes 1-100 of 200 on the real data
    tr = build_dataset("cub", root, split="train")
    te = build_dataset("cub", root, split="test")
    _check(tr, [(p, c) for p, c, _ in truth if c in first])
    _check(te, [(p, c) for p, c, _ in truth if c not in first])
    assert len(tr) + len(te) == len(truth)


def test_cars196_both_protocols(trees):
    root, truth = trees["cars196"]
    for split, flag in (("train", False), ("test", True)):
        ds = build_dataset("cars196", root, split=split, protocol="classification")
        _check(ds, [(p, c) for p, c, t in truth if t == flag])
    tr = build_dataset("cars196", root, split="train")
    te = build_dataset("cars196", root, split="test")
    _check(tr, [(p, c) for p, c, _ in truth if c <= 2])
    _check(te, [(p, c) for p, c, _ in truth if c > 2])
    assert te.class_names == ["Make3 Model Sedan 2012", "Make4 Model Sedan 2012"]


def test_sop(trees):
    root, truth = trees["sop"]
    for split in ("train", "test"):
        _check(build_dataset("sop", root, split=split), truth[split])


def test_inshop_query_gallery_share_mapping(trees):
    root, truth = trees["inshop"]
    tr = build_dataset("inshop", root, split="train")
    _check(tr, [(p, i) for p, i, s in truth if s == "train"])
    q = build_dataset("inshop", root, split="query")
    g = build_dataset("inshop", root, split="gallery")
    union = sorted({i for _, i, s in truth if s != "train"})
    for ds, s in ((q, "query"), (g, "gallery")):
        exp = [(p, i) for p, i, st in truth if st == s]
        assert ds.paths == [p for p, _ in exp]
        assert ds.labels.tolist() == [union.index(i) for _, i in exp]
        assert ds.num_classes == len(union)
    # same item -> same label across query and gallery
    assert q.labels[0] == g.labels[0] and q.class_ids[q.labels[0]] == "id_00000004"


def test_inshop_flat_layout(tmp_path):
    truth = make_inshop(tmp_path / "flat", official=False)
    ds = build_dataset("inshop", tmp_path / "flat", split="gallery")
    assert ds.paths == [p for p, _, s in truth if s == "gallery"]


def test_flowers102(trees):
    root, (labels, sets) = trees["flowers102"]
    path = lambda j: str(root / "jpg" / f"image_{j:05d}.jpg")  # noqa: E731
    for split, ids in sets.items():
        ds = build_dataset("flowers102", root, split=split, protocol="classification")
        _check(ds, [(path(j), labels[j - 1]) for j in ids])
    tr = build_dataset("flowers102", root, split="train")
    te = build_dataset("flowers102", root, split="test")
    _check(tr, [(path(j), c) for j, c in enumerate(labels, 1) if c <= 2])
    _check(te, [(path(j), c) for j, c in enumerate(labels, 1) if c > 2])


def test_aircraft(trees):
    root, truth = trees["aircraft"]
    vid = {v: i + 1 for i, v in enumerate(AIRCRAFT_VARIANTS)}
    for split in ("train", "val", "test"):
        ds = build_dataset("aircraft", root, split=split, protocol="classification")
        _check(ds, [(p, vid[v]) for p, v in truth[split]])
        assert ds.class_names == AIRCRAFT_VARIANTS  # names with spaces and '/' survive
    tv = build_dataset("aircraft", root, split="trainval", protocol="classification")
    assert len(tv) == len(truth["train"]) + len(truth["val"])
    allrows = truth["train"] + truth["val"] + truth["test"]
    tr = build_dataset("aircraft", root, split="train")
    _check(tr, [(p, vid[v]) for p, v in allrows if vid[v] <= 2])
    assert tr.class_names == AIRCRAFT_VARIANTS[:2]
    # pointing at data/ works too
    assert build_dataset("aircraft", root / "data", split="test").paths == build_dataset("aircraft", root, split="test").paths


def test_dogs(trees):
    root, truth = trees["dogs"]
    for split in ("train", "test"):
        ds = build_dataset("dogs", root, split=split)
        _check(ds, truth[split])
    assert ds.class_names == ["Chihuahua", "Japanese_spaniel", "Maltese_dog"]


def test_every_zero_shot_split_is_class_disjoint(trees):
    for name, (root, _) in trees.items():
        protocols = B.BENCHMARKS[name][1]
        if "zero_shot" not in protocols:
            continue
        splits = protocols["zero_shot"]
        sets = {}
        for s in splits:
            ds = build_dataset(name, root, split=s)
            sets[s] = {ds.class_ids[lab] for lab in np.unique(ds.labels)}
        assert sets["train"], name
        for s in splits[1:]:
            assert sets[s] and not (sets["train"] & sets[s]), (name, s)


def test_dataset_items_are_tensors(trees):
    root, truth = trees["cub"]
    ds = build_dataset("cub", root, split="test")
    x, y = ds[1]
    assert isinstance(x, torch.Tensor) and x.shape == (3, 6, 5) and x.dtype == torch.float32
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert y == int(ds.labels[1])
    ds2 = build_dataset("cub", root, split="test", transform=lambda im: torch.tensor(im.size))
    assert ds2[0][0].tolist() == [5, 6]


def test_labels_match_original_ids(trees):
    root, truth = trees["nabirds"]
    ds = build_dataset("nabirds", root, split="train")
    orig = ds.image_list.original_labels
    assert sorted(set(orig.tolist())) == [c for c in (295, 817, 1000, 1010) if any(
        c == cc and t for _, cc, t in truth)]


# ----------------------------------------------------------------------------- counts
def test_official_count_constants_are_consistent():
    # REFERENCE.md section 4 values, written out plainly
    ref = {
        "cub": (11788, {"zero_shot": (5864, 5924), "classification": (5994, 5794)}),
        "cars196": (16185, {"zero_shot": (8054, 8131), "classification": (8144, 8041)}),
        "sop": (120053, {"zero_shot": (59551, 60502)}),
        "dogs": (20580, {"classification": (12000, 8580)}),
        "nabirds": (48562, {"classification": (23929, 24633)}),
    }
    for name, (total, prot) in ref.items():
        assert B.OFFICIAL_COUNTS[name]["total"] == total
        for p, (a, b) in prot.items():
            assert (B.OFFICIAL_COUNTS[name][p]["train"][0], B.OFFICIAL_COUNTS[name][p]["test"][0]) == (a, b)
            assert a + b == total
    ins = B.OFFICIAL_COUNTS["inshop"]["zero_shot"]
    assert (ins["train"], ins["query"], ins["gallery"]) == ((25882, 3997), (14218, 3985), (12612, 3985))
    assert sum(v[0] for v in ins.values()) == B.OFFICIAL_COUNTS["inshop"]["total"]
    fl = B.OFFICIAL_COUNTS["flowers102"]["classification"]
    assert [fl[s][0] for s in ("train", "val", "test")] == [1020, 1020, 6149]
    ac = B.OFFICIAL_COUNTS["aircraft"]["classification"]
    assert [ac[s][0] for s in ("train", "val", "test")] == [3334, 3333, 3333]


def _patch_counts(monkeypatch, name, total, table):
    counts = copy.deepcopy(B.OFFICIAL_COUNTS)
    counts[name] = {"total": total, "classes": None, **table}
    monkeypatch.setattr(B, "OFFICIAL_COUNTS", counts)


def test_counts_checked_when_tree_has_official_size(trees, monkeypatch):
    root, truth = trees["cub"]
    n = len(truth)
    first = {1, 2}
    n_tr = sum(c in first for _, c, _ in truth)
    n_ctr = sum(t for *_, t in truth)
    good = {"zero_shot": {"train": (n_tr, 2), "test": (n - n_tr, 2)},
            "classification": {"train": (n_ctr, 4), "test": (n - n_ctr, 4)}}
    _patch_counts(monkeypatch, "cub", n, good)
    for prot, splits in good.items():
        for s in splits:
            assert len(B.load_cub(root, s, prot, check_counts=True)) == good[prot][s][0]
    bad = copy.deepcopy(good)
    bad["zero_shot"]["train"] = (n_tr + 1, 2)
    _patch_counts(monkeypatch, "cub", n, bad)
    with pytest.raises(ValueError, match=r"official split has .* images of 2 classes"):
        B.load_cub(root, "train")  # auto mode: total matches, so split sizes are checked
    B.load_cub(root, "train", check_counts=False)  # explicitly off
    _patch_counts(monkeypatch, "cub", n + 5, bad)
    B.load_cub(root, "train")  # auto mode, not the full dataset: only consistency
    with pytest.raises(ValueError, match=rf"full official dataset of {n + 5:,} images.*lists {n}"):
        B.load_cub(root, "train", check_counts=True)


def test_counts_checked_inshop_and_flowers(trees, monkeypatch):
    root, truth = trees["inshop"]
    _patch_counts(monkeypatch, "inshop", len(truth), {"zero_shot": {
        "train": (6, 3), "query": (4, 3), "gallery": (5, 2)}})
    assert len(B.load_inshop(root, "query", check_counts=True)) == 4
    with pytest.raises(ValueError, match="gallery"):
        B.load_inshop(root, "gallery", check_counts=True)  # gallery has 5 images of 3 items, not 2
    root, (labels, _) = trees["flowers102"]
    _patch_counts(monkeypatch, "flowers102", len(labels), {"zero_shot": {"train": (None, 2), "test": (None, 3)}})
    B.load_flowers102(root, "train")
    with pytest.raises(ValueError, match="unpublished number of images of 3 classes"):
        B.load_flowers102(root, "test")


# ----------------------------------------------------------------------------- layout errors
def test_error_no_root():
    with pytest.raises(ValueError, match=r"cub: no root given(.|\n)*images.txt"):
        build_dataset("cub")


def test_error_root_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"root '.*nowhere' does not exist(.|\n)*Ebay_train.txt"):
        build_dataset("sop", tmp_path / "nowhere")


def test_error_unextracted_archive(tmp_path):
    tgz = tmp_path / "CUB_200_2011.tgz"
    tgz.write_bytes(b"\x1f\x8b")
    with pytest.raises(FileNotFoundError, match=r"archive that has not been extracted(.|\n)*tar -xf"):
        build_dataset("cub", tgz)
    with pytest.raises(FileNotFoundError, match=r"archive\(s\) not yet extracted: CUB_200_2011.tgz"):
        build_dataset("cub", tmp_path)


def test_error_parent_folder_suggests_subfolder(trees):
    for name, marker in (("cub", "images.txt"), ("aircraft", "data/variants.txt"), ("cars196", "cars_annos.mat"),
                         ("inshop", "Eval/list_eval_partition.txt"), ("dogs", "train_list.mat")):
        root, _ = trees[name]
        with pytest.raises(FileNotFoundError) as e:
            build_dataset(name, root.parent)
        msg = str(e.value)
        assert f"expected '{root.parent / marker}'" in msg
        assert f"Pass root='{root}' (in a YAML config: data.root: {root})" in msg
        assert "A correct root looks like" in msg


def test_error_images_folder_missing(tmp_path):
    make_cub(tmp_path / "c")
    (tmp_path / "c" / "images").rename(tmp_path / "c" / "imgs")
    with pytest.raises(FileNotFoundError, match=r"expected '.*c/images'"):
        build_dataset("cub", tmp_path / "c")


def test_error_inconsistent_cub_files(tmp_path):
    make_cub(tmp_path / "c")
    f = tmp_path / "c" / "image_class_labels.txt"
    f.write_text("\n".join(f.read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(ValueError, match=r"image_class_labels.txt' does not match .*images.txt.*1 image ids without"):
        build_dataset("cub", tmp_path / "c")
    f.write_text("1 x\n")
    with pytest.raises(ValueError, match=r"image_class_labels.txt:1: class id must be an integer, got 'x'"):
        build_dataset("cub", tmp_path / "c")
    (tmp_path / "c" / "train_test_split.txt").write_text("1 2\n")
    f.write_text("1 1\n")
    with pytest.raises(ValueError, match=r"train_test_split.txt:1: is_training_image must be 0 or 1"):
        build_dataset("cub", tmp_path / "c")


def test_error_cars_mat(tmp_path):
    r = tmp_path / "cars"
    r.mkdir()
    dt = [("bbox_x1", "O"), ("class", "O"), ("fname", "O")]
    a = np.zeros((1, 1), dtype=dt)
    a[0, 0] = (np.array([[1]]), np.array([[1]]), "00001.jpg")
    sio.savemat(r / "cars_annos.mat", {"annotations": a})
    with pytest.raises(ValueError, match=r"fields \['bbox_x1', 'class', 'fname'\].*devkit file"):
        build_dataset("cars196", r)
    sio.savemat(r / "cars_annos.mat", {"something": np.zeros(3)})
    with pytest.raises(ValueError, match=r"no variable\(s\) \['annotations'\]; it holds \['something'\]"):
        build_dataset("cars196", r)
    (r / "cars_annos.mat").unlink()
    (r / "devkit").mkdir()
    with pytest.raises(FileNotFoundError, match="devkit layout"):
        build_dataset("cars196", r)


def test_error_cars_images_not_extracted(tmp_path):
    make_cars(tmp_path / "cars")
    import shutil

    shutil.rmtree(tmp_path / "cars" / "car_ims")
    (tmp_path / "cars" / "car_ims.tgz").write_bytes(b"\x1f\x8b")
    with pytest.raises(FileNotFoundError, match=r"car_ims'(.|\n)*not yet extracted: car_ims.tgz"):
        build_dataset("cars196", tmp_path / "cars")


def test_error_sop(tmp_path):
    make_sop(tmp_path / "s")
    f = tmp_path / "s" / "Ebay_test.txt"
    lines = f.read_text().splitlines()
    f.write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(ValueError, match=r"line 1 must be the header 'image_id class_id super_class_id path'"):
        build_dataset("sop", tmp_path / "s", split="test")
    f.write_text("\n".join([lines[0], "99 1 1 bicycle_final/x.JPG"]) + "\n")
    with pytest.raises(ValueError, match=r"share class ids \[1\]"):
        build_dataset("sop", tmp_path / "s")
    f.write_text("\n".join([lines[0], "99 7 1"]) + "\n")
    with pytest.raises(ValueError, match=r"Ebay_test.txt:2: expected 4 fields, got 3"):
        build_dataset("sop", tmp_path / "s")


def test_error_inshop(tmp_path):
    make_inshop(tmp_path / "i")
    f = tmp_path / "i" / "Eval" / "list_eval_partition.txt"
    text = f.read_text().splitlines()
    f.write_text("\n".join(["3"] + text[1:]) + "\n")
    with pytest.raises(ValueError, match=r"list_eval_partition.txt:1 declares 3 images but 15 entries follow"):
        build_dataset("inshop", tmp_path / "i")
    f.write_text("\n".join(text[:2] + [text[2].replace(" train", " val")] + text[3:]) + "\n")
    with pytest.raises(ValueError, match=r":3: evaluation_status must be train, query or gallery, got 'val'"):
        build_dataset("inshop", tmp_path / "i")
    f.write_text("\n".join(text) + "\n")
    import shutil

    shutil.rmtree(tmp_path / "i" / "Img" / "img")
    (tmp_path / "i" / "Img" / "img.zip").write_bytes(b"PK")
    with pytest.raises(FileNotFoundError, match=r"image folder 'img/' not found(.|\n)*Extract .*img.zip"):
        build_dataset("inshop", tmp_path / "i")


def test_error_flowers_setid(tmp_path):
    make_flowers(tmp_path / "f")
    sio.savemat(tmp_path / "f" / "setid.mat", {"trnid": np.array([[1, 2]]), "valid": np.array([[2]]),
                                               "tstid": np.array([[3]])})
    with pytest.raises(ValueError, match=r"image 2 is in both trnid and valid"):
        build_dataset("flowers102", tmp_path / "f", protocol="classification")
    sio.savemat(tmp_path / "f" / "setid.mat", {"trnid": np.array([[1, 99]]), "valid": np.array([[2]]),
                                               "tstid": np.array([[3]])})
    with pytest.raises(ValueError, match=r"trnid has image indices \[99\] outside 1..14"):
        build_dataset("flowers102", tmp_path / "f")


def test_error_aircraft_unknown_variant(tmp_path):
    make_aircraft(tmp_path / "a")
    f = tmp_path / "a" / "data" / "images_variant_val.txt"
    f.write_text(f.read_text() + "1234567 Boeing 999\n")
    with pytest.raises(ValueError, match=r"images_variant_val.txt:5: variant 'Boeing 999' is not listed"):
        build_dataset("aircraft", tmp_path / "a")


def test_error_dogs_mat(tmp_path):
    make_dogs(tmp_path / "d")
    sio.savemat(tmp_path / "d" / "test_list.mat", {"file_list": np.zeros((2, 1))})
    with pytest.raises(ValueError, match=r"test_list.mat' has no variable\(s\) \['labels'\]"):
        build_dataset("dogs", tmp_path / "d", split="test")


def test_error_bad_split_and_protocol(trees):
    root, _ = trees["cub"]
    with pytest.raises(ValueError, match=r"cub \(zero_shot\): split must be one of \['train', 'test'\], got 'val'"):
        build_dataset("cub", root, split="val")
    with pytest.raises(ValueError, match=r"sop: protocol must be one of \['zero_shot'\]"):
        build_dataset("sop", root, protocol="classification")
    with pytest.raises(ValueError, match=r"inshop \(zero_shot\): split must be one of \['train', 'query', 'gallery'\]"):
        build_dataset("inshop", root, split="test")


# ----------------------------------------------------------------------------- images
def test_missing_and_unreadable_images(tmp_path):
    truth = make_cub(tmp_path / "c")
    missing = [[p for p, c, _ in truth if c == k][0] for k in (1, 2)]  # one of each train class
    for p in missing:
        __import__("os").remove(p)
    with pytest.raises(FileNotFoundError) as e:
        build_dataset("cub", tmp_path / "c", split="train")
    msg = str(e.value)
    assert "2 of 5 images are missing" in msg and all(p in msg for p in missing)
    ds = build_dataset("cub", tmp_path / "c", split="train", skip_missing=True)
    assert ds.num_skipped == 2 and ds.skipped == missing and len(ds) == 3
    assert ds.num_classes == 2 and set(ds.paths).isdisjoint(missing)

    corrupt = [p for p, c, _ in truth if c == 4][0]
    with open(corrupt, "wb") as f:
        f.write(b"not a jpeg")
    ds = build_dataset("cub", tmp_path / "c", split="test")  # exists-check passes
    i = ds.paths.index(corrupt)
    with pytest.raises(OSError, match=rf"cannot read image {corrupt}"):
        ds[i]
    with pytest.raises(FileNotFoundError, match=r"missing or unreadable(.|\n)*" + corrupt):
        build_dataset("cub", tmp_path / "c", split="test", verify="open")
    ds = build_dataset("cub", tmp_path / "c", split="test", verify="open", skip_missing=True)
    assert ds.skipped == [corrupt] and corrupt not in ds.paths
    ds[0]


def test_skipping_a_whole_class_warns_and_keeps_mapping(tmp_path):
    truth = make_cub(tmp_path / "c")
    for p, c, _ in truth:
        if c == 1:
            __import__("os").remove(p)
    with pytest.warns(UserWarning, match="1 classes have no image left"):
        ds = build_dataset("cub", tmp_path / "c", split="train", skip_missing=True)
    assert ds.num_classes == 2 and set(ds.labels.tolist()) == {1}


# ----------------------------------------------------------------------------- registry
def test_registry_names_aliases_and_options(trees):
    assert list_datasets() == ["aircraft", "cars196", "csv", "cub", "dogs", "emoji", "events", "fashion-mnist",
                               "flowers102", "folder", "glyphs", "hdd", "inshop", "nabirds", "sop", "synthetic",
                               "synthetic-events"]
    root, _ = trees["cub"]
    assert build_dataset("CUB_200_2011", root).paths == build_dataset("cub", root).paths
    assert isinstance(build_dataset("cub200", root, split="test"), ImageListDataset)
    with pytest.raises(ValueError, match=r"unknown dataset 'cars197'.*Did you mean 'cars196'"):
        build_dataset("cars197", root)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['class_split'\]; accepted: protocol"):
        build_dataset("cub", root, class_split="half")


def test_registry_dispatches_to_the_registered_builder(monkeypatch):
    # build_dataset hands split, transform, root and the options to the builder registered
    # under the name the argument means (case, '_' and aliases normalised)
    from deepmetric.data.registry import DATASETS

    calls = []

    def fake_builder(name):
        def build(**kw):
            calls.append((name, kw))
            return name
        return build

    for name in ("glyphs", "fashion-mnist"):
        fake = fake_builder(name)
        monkeypatch.setitem(DATASETS._entries, name, fake)
    assert build_dataset("glyphs", split="test", size=16) == "glyphs"
    assert build_dataset("Fashion_MNIST", root="/x", split="train") == "fashion-mnist"
    assert build_dataset("fashionmnist") == "fashion-mnist"
    assert calls == [
        ("glyphs", {"split": "test", "transform": None, "root": None, "size": 16}),
        ("fashion-mnist", {"split": "train", "transform": None, "root": "/x"}),
        ("fashion-mnist", {"split": "train", "transform": None, "root": None}),
    ]

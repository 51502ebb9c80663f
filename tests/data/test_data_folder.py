"""User data: ImageFolder-style trees and CSV files, their splits and their error messages."""
import os

import numpy as np
import pytest
import torch
from PIL import Image

from deepmetric.data import build_dataset, load_folder

CLASSES = ["ant", "bee", "cat", "dog", "eel", "fox"]


def _img(path, fmt="PNG"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((4, 7, 3), 100, dtype=np.uint8)).save(path, format=fmt)


def make_folder(root, classes=CLASSES):
    """class k gets k+1 images; the last class keeps one image in a nested sub-folder."""
    truth = []
    for k, c in enumerate(classes):
        for i in range(k + 1):
            p = root / c / f"{i:02d}.png"
            _img(p)
            truth.append((str(p), c))
    nested = root / classes[-1] / "sub" / "zz.jpg"
    _img(nested, "JPEG")
    truth.append((str(nested), classes[-1]))
    return truth


@pytest.fixture
def tree(tmp_path):
    return tmp_path / "data", make_folder(tmp_path / "data")


def _check(ds, expected, names):
    """expected: (path, class) pairs in order; names: class names in label order."""
    assert sorted(ds.paths) == sorted(p for p, _ in expected)
    by_path = dict(expected)
    assert list(ds.class_names) == names and ds.num_classes == len(names)
    assert [names[lab] for lab in ds.labels] == [by_path[p] for p in ds.paths]
    assert ds.labels.dtype == np.int64


# ----------------------------------------------------------------------------- folder
def test_folder_whole_tree(tree):
    root, truth = tree
    ds = build_dataset("folder", root)  # split="train" without a split = everything
    _check(ds, truth, CLASSES)
    assert build_dataset("folder", root, split="all").paths == ds.paths
    x, y = ds[0]
    assert isinstance(x, torch.Tensor) and x.shape == (3, 4, 7) and y == 0


def test_folder_half_split(tree):
    root, truth = tree
    tr = build_dataset("folder", root, split="train", class_split="half")
    te = build_dataset("folder", root, split="test", class_split="half")
    _check(tr, [t for t in truth if t[1] in CLASSES[:3]], CLASSES[:3])
    _check(te, [t for t in truth if t[1] in CLASSES[3:]], CLASSES[3:])
    assert set(tr.class_names).isdisjoint(te.class_names)
    assert len(build_dataset("folder", root, split="all", class_split="half")) == len(truth)


def test_folder_fraction_split_is_seeded(tree):
    root, truth = tree
    splits = {}
    for seed in range(6):
        tr = load_folder(root, "train", class_split=0.34, seed=seed)
        te = load_folder(root, "test", class_split=0.34, seed=seed)
        assert len(tr.class_ids) == 2 and len(te.class_ids) == 4  # round(0.34 * 6) = 2
        assert set(tr.class_ids).isdisjoint(te.class_ids)
        assert len(tr) + len(te) == len(truth)
        assert tr.paths == load_folder(root, "train", class_split=0.34, seed=seed).paths
        splits[seed] = tuple(tr.class_ids)
    assert len(set(splits.values())) > 1  # the seed matters


def test_folder_split_file(tree, tmp_path):
    root, truth = tree
    f = tmp_path / "splits.txt"
    f.write_text(
        "# split, then class or image\n"
        "train ant\ntrain bee\n"
        "query dog/00.png\ngallery dog/01.png\ngallery dog/02.png\nquery eel/00.png\n"
        "gallery fox\n"
    )
    with pytest.warns(UserWarning, match=r"\d+ images .* not named in split_file"):
        tr = build_dataset("folder", root, split="train", split_file=f)
    _check(tr, [t for t in truth if t[1] in ("ant", "bee")], ["ant", "bee"])
    with pytest.warns(UserWarning):
        q = build_dataset("folder", root, split="query", split_file=f)
    with pytest.warns(UserWarning):
        g = build_dataset("folder", root, split="gallery", split_file=f)
    shared = ["dog", "eel", "fox"]  # query and gallery share one mapping
    assert q.class_names == g.class_names == shared
    assert [shared[lab] for lab in q.labels] == ["dog", "eel"]
    assert sorted(shared[lab] for lab in g.labels) == ["dog", "dog"] + ["fox"] * 7


# ----------------------------------------------------------------------------- folder errors
def test_folder_error_root(tmp_path):
    with pytest.raises(ValueError, match=r"folder: no root given(.|\n)*one folder per class"):
        build_dataset("folder")
    with pytest.raises(FileNotFoundError, match=r"folder: root '.*missing' does not exist"):
        build_dataset("folder", tmp_path / "missing")
    (tmp_path / "list.csv").write_text("path,label\n")
    with pytest.raises(ValueError, match=r"is a file list; read it with the csv dataset: --data csv on the "
                                         r"command line, data.name: csv in a config, build_dataset\('csv', root=\.\.\.\) "
                                         r"in Python\.$"):
        build_dataset("folder", tmp_path / "list.csv")


def test_folder_error_images_in_root(tmp_path):
    _img(tmp_path / "a.png")
    _img(tmp_path / "b.png")
    with pytest.raises(ValueError, match=r"found 2 images directly in .* but no class folders"):
        build_dataset("folder", tmp_path)
    (tmp_path / "b.png").unlink()
    with pytest.raises(ValueError, match=r"found 1 image directly in .* but no class folders"):  # "1 images"
        build_dataset("folder", tmp_path)


def test_one_loose_image_beside_class_folders_is_said_in_the_singular(tree):
    root, _ = tree
    _img(root / "loose.png")
    with pytest.warns(UserWarning, match=r"folder: 1 image directly in .* \(e\.g\. loose\.png\) is ignored: only"):
        build_dataset("folder", root)
    _img(root / "loose2.png")
    with pytest.warns(UserWarning, match=r"folder: 2 images directly in .* \(e\.g\. loose\.png\) are ignored: only"):
        build_dataset("folder", root)


def test_folder_error_empty_class(tree):
    root, truth = tree
    (root / "gnu").mkdir()
    (root / "hen").mkdir()
    (root / "hen" / "notes.txt").write_text("x")
    with pytest.raises(ValueError) as e:
        build_dataset("folder", root)
    msg = str(e.value)
    assert "2 class folder(s)" in msg and "'gnu' (empty)" in msg and "'hen' (holds only ['notes.txt'])" in msg
    assert "allow_empty_classes=True" in msg
    with pytest.warns(UserWarning, match="ignoring 2 class folder"):
        ds = build_dataset("folder", root, allow_empty_classes=True)
    assert ds.class_names == CLASSES


def test_folder_error_no_images(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.heic").write_bytes(b"1")
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match=r"no images found under .*Accepted extensions: .jpg(.|\n)*\.heic"):
        build_dataset("folder", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no class folders and no images \(contents: empty\)"):
        build_dataset("folder", tmp_path / "empty")


def test_folder_error_split_options(tree, tmp_path):
    root, _ = tree
    with pytest.raises(ValueError, match=r"split='test' asked for, but no split is defined(.|\n)*class_split: half"):
        build_dataset("folder", root, split="test")
    with pytest.raises(ValueError, match=r"class_split must be 'half', a fraction in \(0, 1\) or lists of class names .*got 'third'"):
        build_dataset("folder", root, class_split="third")
    with pytest.raises(ValueError, match=r"strictly between 0 and 1, got 1.5"):
        build_dataset("folder", root, class_split=1.5)
    with pytest.raises(ValueError, match=r"leaves 0 train and 6 test classes"):
        build_dataset("folder", root, class_split=0.01)
    with pytest.raises(ValueError, match=r"split 'val' is empty or unknown; this folder's splits are \['test', 'train'\]"):
        build_dataset("folder", root, split="val", class_split="half")
    with pytest.raises(ValueError, match="either class_split or split_file"):
        build_dataset("folder", root, class_split="half", split_file="x")
    one = tmp_path / "one"
    _img(one / "only" / "a.png")
    with pytest.raises(ValueError, match=r"needs at least 2 classes, .* has 1: \['only'\]"):
        build_dataset("folder", one, class_split="half")


def test_folder_class_split_half_takes_the_first_half_of_sorted_names(tmp_path):
    """The documented order: Python's string sort ("10" < "2", upper case first); an odd count
    gives the extra class to test."""
    names = ["zero", "one", "two", "10", "2", "Zed", "ant"]
    for c in names:
        _img(tmp_path / c / "a.png")
    tr = build_dataset("folder", tmp_path, split="train", class_split="half")
    te = build_dataset("folder", tmp_path, split="test", class_split="half")
    assert tr.class_names == ["10", "2", "Zed"]
    assert te.class_names == ["ant", "one", "two", "zero"]


def test_folder_class_split_explicit_lists(tree):
    root, _ = tree
    split = {"train": ["fox", "ant"], "val": ["bee"], "test": ["dog", "cat"]}
    with pytest.warns(UserWarning, match=r"1 class folder\(s\) .* in no class_split list and are left out: \['eel'\]"):
        tr = build_dataset("folder", root, split="train", class_split=split)
    assert tr.class_names == ["ant", "fox"]
    assert len(tr) == 1 + 7  # ant: 1 image, fox: 6 + the nested one
    with pytest.warns(UserWarning):
        te = build_dataset("folder", root, split="test", class_split=split)
        va = build_dataset("folder", root, split="val", class_split=split)
    assert te.class_names == ["cat", "dog"] and len(te) == 3 + 4
    assert va.class_names == ["bee"] and len(va) == 2
    with pytest.raises(ValueError, match=r"class_split.test names 'dgo', which is not a class folder .*did you mean 'dog'"):
        build_dataset("folder", root, split="train", class_split={"train": ["ant"], "test": ["dgo"]})
    with pytest.raises(ValueError, match=r"class 'ant' is listed in class_split.train and class_split.test"):
        build_dataset("folder", root, split="train", class_split={"train": ["ant"], "test": ["ant"]})
    with pytest.raises(ValueError, match=r"unknown split 'tset'"):
        build_dataset("folder", root, split="train", class_split={"train": ["ant"], "tset": ["bee"]})
    with pytest.raises(ValueError, match=r"class_split.train must be a list of class folder names"):
        build_dataset("folder", root, split="train", class_split={"train": "ant", "test": ["bee"]})


def test_folder_root_that_is_the_parent_of_the_dataset(tmp_path):
    for c in ("cat", "dog", "owl"):
        _img(tmp_path / "parent" / "digits" / c / "a.png")
    with pytest.raises(ValueError, match=r"looks like the parent of the dataset folder: its only sub-folder "
                                         r"'digits' holds 3 image folders \(cat, dog, owl\).*Pass root='.*digits'"
                                         r" \(in a YAML config: data.root: .*digits\)"):
        build_dataset("folder", tmp_path / "parent", split="all")
    assert build_dataset("folder", tmp_path / "parent" / "digits", split="all").num_classes == 3


def test_empty_class_error_speaks_yaml(tmp_path):
    _img(tmp_path / "a" / "x.png")
    _img(tmp_path / "b" / "x.png")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"data.options.allow_empty_classes: true"):
        build_dataset("folder", tmp_path, split="all")


def test_folder_error_split_file(tree, tmp_path):
    root, _ = tree
    f = tmp_path / "s.txt"
    with pytest.raises(FileNotFoundError, match=r"split_file '.*s.txt' not found(.|\n)*'train cat'"):
        build_dataset("folder", root, split_file=f)
    f.write_text("train ant\ntrainn bee\n")
    with pytest.raises(ValueError, match=r"s.txt:2: unknown split 'trainn'; allowed: train, val, test, query, gallery"):
        build_dataset("folder", root, split_file=f)
    f.write_text("train ant\ntest zebra\n")
    with pytest.raises(ValueError, match=r"s.txt:2: 'zebra' is neither a class folder nor an image"):
        build_dataset("folder", root, split_file=f)
    f.write_text("train ant\n\ntest ant/00.png\n")
    with pytest.raises(ValueError, match=r"s.txt:3: 'ant/00.png' is put in 'test' but line 1 already put it in 'train'"):
        build_dataset("folder", root, split_file=f)
    f.write_text("train\n")
    with pytest.raises(ValueError, match=r"s.txt:1: expected '<split> <class name or relative image path>'"):
        build_dataset("folder", root, split_file=f)


# ----------------------------------------------------------------------------- csv
def _write_csv(path, rows, header="path,label,split"):
    path.write_text("\n".join([header] + rows) + "\n")
    return path


@pytest.fixture
def csv_tree(tmp_path):
    for i in range(6):
        _img(tmp_path / "imgs" / f"{i}.png")
    return tmp_path


def test_csv_integer_labels_and_splits(csv_tree):
    f = _write_csv(csv_tree / "d.csv", ["imgs/0.png,7,train", "imgs/1.png,3,train", "imgs/2.png,7,Train",
                                        "imgs/3.png,10,test", "imgs/4.png,12,test"])
    tr = build_dataset("csv", f, split="train")
    assert tr.paths == [str(csv_tree / "imgs" / f"{i}.png") for i in (0, 1, 2)]
    assert tr.labels.tolist() == [1, 0, 1] and tr.class_ids == [3, 7] and tr.class_names is None
    te = build_dataset("csv", f, split="test")
    assert te.labels.tolist() == [0, 1] and te.class_ids == [10, 12]
    al = build_dataset("csv", f, split="all")
    assert al.labels.tolist() == [1, 0, 1, 2, 3]
    assert al[3][1] == 2


def test_csv_name_labels_label_map_query_gallery(csv_tree):
    f = _write_csv(csv_tree / "d.csv", ["imgs/0.png,cat,query", "imgs/1.png,dog,gallery",
                                        "imgs/2.png,cat,gallery", "imgs/3.png,bird,train"])
    q = build_dataset("csv", f, split="query")
    g = build_dataset("csv", f, split="gallery")
    assert q.class_names == g.class_names == ["cat", "dog"]
    assert q.labels.tolist() == [0] and g.labels.tolist() == [1, 0]
    m = build_dataset("csv", f, split="gallery", label_map={"cat": 5, "dog": 2, "bird": 9})
    assert m.class_ids == [2, 5] and m.class_names == ["dog", "cat"] and m.labels.tolist() == [0, 1]


def test_csv_without_split_column_and_image_root(csv_tree):
    (csv_tree / "meta").mkdir()
    f = _write_csv(csv_tree / "meta" / "d.csv", ["0.png,a", "1.png,b", f"{csv_tree / 'imgs' / '2.png'},a"],
                   header="comment,path,label")
    with pytest.raises(ValueError, match=r"expected 3 columns"):
        build_dataset("csv", f)
    f = _write_csv(csv_tree / "meta" / "d.csv", ["0.png,a,x", "1.png,b,y", f"{csv_tree / 'imgs' / '2.png'},a,z"],
                   header="path,label,comment")
    ds = build_dataset("csv", f, image_root=csv_tree / "imgs")  # split "train" = whole file
    assert ds.paths == [str(csv_tree / "imgs" / f"{i}.png") for i in range(3)]
    assert ds.class_names == ["a", "b"] and ds.labels.tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match=r"split='test' asked for, but the file has no 'split' column"):
        build_dataset("csv", f, split="test", image_root=csv_tree / "imgs")


def test_csv_missing_images_reported_with_line_numbers(csv_tree):
    f = _write_csv(csv_tree / "d.csv", ["imgs/0.png,1,train", "imgs/nope.png,1,train", "imgs/2.png,2,train",
                                        "imgs/gone.jpg,2,train"])
    with pytest.raises(FileNotFoundError) as e:
        build_dataset("csv", f)
    msg = str(e.value)
    assert "2 of 4 images are missing" in msg
    assert f"{csv_tree / 'imgs' / 'nope.png'} (listed at d.csv:3)" in msg
    assert f"{csv_tree / 'imgs' / 'gone.jpg'} (listed at d.csv:5)" in msg
    assert "resolved against" in msg and "skip_missing=True" in msg
    assert "data.options.skip_missing: true" in msg
    with pytest.warns(UserWarning) as rec:
        ds = build_dataset("csv", f, skip_missing=True)
    assert ds.num_skipped == 2 and len(ds) == 2 and ds.labels.tolist() == [0, 1]
    # the files dropped by skip_missing are counted and named
    msg = next(str(w.message) for w in rec if "skip_missing dropped" in str(w.message))
    assert "skip_missing dropped 2 of 4 images (missing)" in msg
    assert f"{csv_tree / 'imgs' / 'nope.png'} (listed at d.csv:3)" in msg and "gone.jpg" in msg


# ----------------------------------------------------------------------------- csv errors
def test_csv_error_file(tmp_path):
    with pytest.raises(ValueError, match=r"csv: no file given(.|\n)*path,label,split"):
        build_dataset("csv")
    with pytest.raises(FileNotFoundError, match=r"csv: file '.*x.csv' does not exist"):
        build_dataset("csv", tmp_path / "x.csv")
    _write_csv(tmp_path / "labels.csv", ["a.png,1,train"])
    with pytest.raises(IsADirectoryError, match=r"is a folder, not a CSV file. It contains \['labels.csv'\]; give one "
                                                r"of them as the root \(--root, data.root or root=\)"):
        build_dataset("csv", tmp_path)
    (tmp_path / "e.csv").write_text("\n\n")
    with pytest.raises(ValueError, match=r"e.csv' is empty"):
        build_dataset("csv", tmp_path / "e.csv")
    _write_csv(tmp_path / "h.csv", [])
    with pytest.raises(ValueError, match=r"has a header but no rows"):
        build_dataset("csv", tmp_path / "h.csv")


def test_csv_error_header(tmp_path):
    f = _write_csv(tmp_path / "d.csv", ["a.png,1"], header="file,label")
    with pytest.raises(ValueError, match=r"d.csv:1: missing column\(s\) \['path'\]; the header has \['file', 'label'\]"):
        build_dataset("csv", f)
    f = _write_csv(tmp_path / "d.csv", ["b.png,2"], header="a.png,1")
    with pytest.raises(ValueError, match=r"d.csv:1: the first line must be a header .* looks like data: 'a.png,1'"):
        build_dataset("csv", f)
    f = _write_csv(tmp_path / "d.csv", ["b.png;2"], header="path;label")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['path', 'label'\].*delimiter ','"):
        build_dataset("csv", f)


def test_csv_error_rows(tmp_path):
    f = _write_csv(tmp_path / "d.csv", ["a.png,1,train", "b.png,2,validation"])
    with pytest.raises(ValueError, match=r"d.csv:3: unknown split value 'validation'; allowed: train, val, test"):
        build_dataset("csv", f)
    f = _write_csv(tmp_path / "d.csv", ["a.png,1,train", "b.png,,train"])
    with pytest.raises(ValueError, match=r"d.csv:3: empty label for 'b.png'"):
        build_dataset("csv", f)
    f = _write_csv(tmp_path / "d.csv", ["a.png,1,train", "b.png,2,train", "c.png,cat,train"])
    with pytest.raises(ValueError, match=r"d.csv:4: label 'cat' is a name while most labels are integers"):
        build_dataset("csv", f)
    f = _write_csv(tmp_path / "d.csv", ["a.png,cat,train", "b.png,dog,train", "c.png,3,train"])
    with pytest.raises(ValueError, match=r"d.csv:4: label '3' is integer while most labels are names"):
        build_dataset("csv", f)
    f = _write_csv(tmp_path / "d.csv", ["a.png,cat,train", "b.png,dgo,train"])
    with pytest.raises(ValueError, match=r"d.csv:3: label 'dgo' is not in label_map"):
        build_dataset("csv", f, label_map={"cat": 0, "dog": 1})
    with pytest.raises(TypeError, match=r"label_map\['cat'\] must be an int, got '0'"):
        build_dataset("csv", f, label_map={"cat": "0", "dgo": 1})
    f = _write_csv(tmp_path / "d.csv", ["a.png,1,train", "b.png,2,test"])
    with pytest.raises(ValueError, match=r"no rows with split 'val'; the file has test \(1\), train \(1\)"):
        build_dataset("csv", f, split="val")
    f = _write_csv(tmp_path / "d.csv", [",1,train"])
    with pytest.raises(ValueError, match=r"d.csv:2: empty path"):
        build_dataset("csv", f)


def test_unreadable_image_named_by_path(csv_tree):
    bad = csv_tree / "imgs" / "bad.png"
    bad.write_bytes(b"\x89PNG broken")
    f = _write_csv(csv_tree / "d.csv", ["imgs/0.png,1", "imgs/bad.png,2"], header="path,label")
    ds = build_dataset("csv", f)
    with pytest.raises(OSError, match=rf"cannot read image {bad} \(listed at d.csv:3\)"):
        ds[1]
    with pytest.warns(UserWarning, match=r"1 classes have no image left \(original ids \['2'\]\)"):
        ds = build_dataset("csv", f, verify="open", skip_missing=True)
    assert ds.skipped == [str(bad)] and ds.num_skipped == 1
    assert os.path.exists(ds.paths[0])

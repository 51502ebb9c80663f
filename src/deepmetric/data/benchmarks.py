"""Standard deep-metric-learning benchmarks, read exactly as their official archives unpack.

Each ``load_<name>(root, split, protocol, check_counts)`` parses the official annotation
files under ``root`` into an :class:`~deepmetric.data.image_list.ImageList` (no image is
opened). :func:`deepmetric.data.build_dataset` wraps the result in an
:class:`~deepmetric.data.image_list.ImageListDataset`.

Protocols (see ``docs/data.md`` and REFERENCE.md section 4):

* ``zero_shot`` - train and test classes are disjoint. CUB-200-2011 (classes 1-100 /
  101-200), Cars196 (1-98 / 99-196), Flowers102 (1-51 / 52-102) and FGVC-Aircraft (first 50
  / last 50 variants of ``variants.txt``) use *all* images of their classes, split at the
  first half of the sorted class ids (the same rule yields exactly those ranges on the real
  data); Stanford Online Products uses ``Ebay_train.txt`` / ``Ebay_test.txt``; In-shop uses
  ``list_eval_partition.txt`` (train / query / gallery; query and gallery share one label
  mapping).
* ``classification`` - the official train / (val) / test image splits with all classes:
  CUB (``train_test_split.txt``), Cars196 (``test`` flag of ``cars_annos.mat``), Flowers102
  (``setid.mat``: train/val/test), FGVC-Aircraft (variant level, train/val/test/trainval),
  Stanford Dogs (``train_list.mat`` / ``test_list.mat``), NABirds (``train_test_split.txt``).

Labels are remapped to 0..C-1 within each split in the order of the original class ids;
the original ids are kept in ``ImageList.class_ids``.

``check_counts``: ``None`` (default) checks that the files agree with each other and, when
the annotation files list exactly the full official number of images, that every split has
the official size (:data:`OFFICIAL_COUNTS`); ``True`` additionally requires the full official
dataset; ``False`` checks only consistency.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from .benchmark_files import LAYOUTS, as_int, extract_hint, id_map, read_rows, resolve_root
from .image_list import ImageList, remap_labels

__all__ = [
    "OFFICIAL_COUNTS",
    "BENCHMARKS",
    "load_benchmark",
    "load_cub",
    "load_cars196",
    "load_sop",
    "load_inshop",
    "load_flowers102",
    "load_aircraft",
    "load_dogs",
    "load_nabirds",
]

# Official sizes. Per split: (images, classes); None where no official figure exists.
OFFICIAL_COUNTS: dict[str, dict] = {
    "cub": {
        "total": 11_788, "classes": 200,
        "zero_shot": {"train": (5_864, 100), "test": (5_924, 100)},
        "classification": {"train": (5_994, 200), "test": (5_794, 200)},
    },
    "cars196": {
        "total": 16_185, "classes": 196,
        "zero_shot": {"train": (8_054, 98), "test": (8_131, 98)},
        "classification": {"train": (8_144, 196), "test": (8_041, 196)},
    },
    "sop": {
        "total": 120_053, "classes": 22_634,
        "zero_shot": {"train": (59_551, 11_318), "test": (60_502, 11_316)},
    },
    "inshop": {
        "total": 52_712, "classes": 7_982,
        "zero_shot": {"train": (25_882, 3_997), "query": (14_218, 3_985), "gallery": (12_612, 3_985)},
    },
    "flowers102": {
        "total": 8_189, "classes": 102,
        "zero_shot": {"train": (None, 51), "test": (None, 51)},
        "classification": {"train": (1_020, 102), "val": (1_020, 102), "test": (6_149, 102)},
    },
    "aircraft": {
        "total": 10_000, "classes": 100,
        "zero_shot": {"train": (5_000, 50), "test": (5_000, 50)},
        "classification": {
            "train": (3_334, 100), "val": (3_333, 100), "test": (3_333, 100), "trainval": (6_667, 100),
        },
    },
    "dogs": {
        "total": 20_580, "classes": 120,
        "classification": {"train": (12_000, 120), "test": (8_580, 120)},
    },
    "nabirds": {
        "total": 48_562, "classes": 555,
        "classification": {"train": (23_929, 555), "test": (24_633, 555)},
    },
}

def _check_counts(name, check_counts, total, protocol, split, image_list: ImageList, source: str):
    """Compare with OFFICIAL_COUNTS (see module docstring for the three modes)."""
    if check_counts is False:
        return
    official = OFFICIAL_COUNTS[name]
    if total != official["total"]:
        if check_counts:
            raise ValueError(
                f"{name}: check_counts=True expects the full official dataset of {official['total']:,} "
                f"images, but {source} lists {total:,}. Pass check_counts=False to load a subset "
                f"(in a YAML config: data.options.check_counts: false)."
            )
        return
    n_img, n_cls = official[protocol][split]
    got_img, got_cls = len(image_list), len(np.unique(image_list.labels))
    if (n_img is not None and got_img != n_img) or (n_cls is not None and got_cls != n_cls):
        raise ValueError(
            f"{name} ({protocol}, {split}): read {got_img:,} images of {got_cls:,} classes from root "
            f"'{image_list.root}', but the official split has "
            f"{'an unpublished number of' if n_img is None else format(n_img, ',')} images of {n_cls:,} classes. The annotation files look modified; re-extract the official archive "
            "or pass check_counts=False (in a YAML config: data.options.check_counts: false)."
        )


def _first_half(ids) -> set:
    """First half of the sorted class ids: the zero-shot training classes (REFERENCE.md s.4)."""
    s = sorted(set(ids))
    return set(s[: len(s) // 2])


def _build(name, root, split, paths, cids, names_of: dict | None, order=None, origins=None) -> ImageList:
    labels, ids = remap_labels(cids, order)
    class_names = None if names_of is None else [str(names_of.get(c, c)) for c in ids]
    return ImageList(
        paths=paths, labels=labels, class_ids=ids, class_names=class_names, origins=origins,
        name=name, split=split, root=str(root),
    )


def _zero_shot_select(split: str, cids: list, train_classes: set) -> np.ndarray:
    in_train = np.fromiter((c in train_classes for c in cids), dtype=bool, count=len(cids))
    return in_train if split == "train" else ~in_train


# ----------------------------------------------------------------------------- CUB / NABirds
def _load_cub_like(name, root, split, protocol, check_counts):
    """CUB-200-2011 and NABirds share the file format (NABirds ids are UUID strings)."""
    r = resolve_root(
        name, root,
        ["images.txt", "image_class_labels.txt", "train_test_split.txt", "images"],
    )
    f_img, f_lab, f_split = r / "images.txt", r / "image_class_labels.txt", r / "train_test_split.txt"
    images = id_map(read_rows(f_img, 2, name), f_img, name)
    labels_rows = read_rows(f_lab, 2, name)
    labels = {k: as_int(v, f_lab, no, name, "class id") for no, (k, v) in labels_rows}
    split_rows = read_rows(f_split, 2, name)
    is_train = {}
    for no, (k, v) in split_rows:
        if v not in ("0", "1"):
            raise ValueError(f"{name}: {f_split}:{no}: is_training_image must be 0 or 1, got {v!r}")
        is_train[k] = v == "1"
    for f, d in ((f_lab, labels), (f_split, is_train)):
        missing = [k for k in images if k not in d]
        extra = [k for k in d if k not in images]
        if missing or extra:
            raise ValueError(
                f"{name}: '{f}' does not match '{f_img}': {len(missing)} image ids without an entry "
                f"(e.g. {missing[:3]}) and {len(extra)} unknown ids (e.g. {extra[:3]}). "
                "The files must come from the same archive."
            )
    names_of = None
    f_cls = r / "classes.txt"
    if f_cls.exists():
        names_of = {}
        for no, (k, v) in read_rows(f_cls, 2, name):
            names_of[as_int(k, f_cls, no, name, "class id")] = v
    keys = list(images)
    cids = [labels[k] for k in keys]
    if protocol == "zero_shot":
        keep = _zero_shot_select(split, cids, _first_half(cids))
    else:
        want = split == "train"
        keep = np.fromiter((is_train[k] == want for k in keys), dtype=bool, count=len(keys))
    idx = np.flatnonzero(keep)
    img_dir = r / "images"
    il = _build(
        name, r, split, [str(img_dir / images[keys[i]]) for i in idx], [cids[i] for i in idx], names_of,
        origins=[f"images.txt id {keys[i]}" for i in idx],
    )
    _check_counts(name, check_counts, len(keys), protocol, split, il, f"'{f_img}'")
    return il


def load_cub(root, split="train", protocol="zero_shot", check_counts=None) -> ImageList:
    """CUB-200-2011 (Wah et al. 2011) from ``CUB_200_2011/``.

    zero_shot: classes 1-100 train (5,864 images), 101-200 test (5,924);
    classification: ``train_test_split.txt`` (5,994 / 5,794).
    """
    return _load_cub_like("cub", root, *_check_split("cub", split, protocol), check_counts)


def load_nabirds(root, split="train", protocol="classification", check_counts=None) -> ImageList:
    """NABirds (Van Horn et al. 2015) from ``nabirds/``: 555 leaf classes,
    ``train_test_split.txt`` gives 23,929 train / 24,633 test images."""
    return _load_cub_like("nabirds", root, *_check_split("nabirds", split, protocol), check_counts)


# ----------------------------------------------------------------------------- .mat helpers
def _loadmat(path: Path, name: str, keys: list[str]) -> dict:
    import scipy.io

    try:
        mat = scipy.io.loadmat(str(path))
    except Exception as e:  # scipy raises several types for broken files
        raise ValueError(f"{name}: cannot read MATLAB file '{path}': {e}") from e
    missing = [k for k in keys if k not in mat]
    if missing:
        found = sorted(k for k in mat if not k.startswith("__"))
        raise ValueError(f"{name}: '{path}' has no variable(s) {missing}; it holds {found}. Is it the official file?")
    return mat


def _unwrap(x):
    """MATLAB cells/structs load as nested 1x1 object arrays: peel them to a Python scalar."""
    while isinstance(x, np.ndarray):
        if x.size != 1:
            if x.dtype.kind in "US":
                return "".join(x.ravel().tolist())
            raise ValueError(f"expected a scalar, got array of shape {x.shape}")
        x = x.reshape(-1)[0]
    if isinstance(x, np.generic):
        x = x.item()
    return x


def _int_vector(mat, key, path, name) -> np.ndarray:
    v = np.asarray(mat[key]).reshape(-1)
    try:
        out = v.astype(np.int64)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: '{path}' variable {key!r} must hold integers") from None
    if not np.array_equal(out, v.astype(np.float64)):
        raise ValueError(f"{name}: '{path}' variable {key!r} must hold integers")
    return out


# ----------------------------------------------------------------------------- Cars196
def load_cars196(root, split="train", protocol="zero_shot", check_counts=None) -> ImageList:
    """Cars196 (Krause et al. 2013) from ``cars_annos.mat`` + ``car_ims/``.

    ``annotations`` is a 1 x 16,185 struct array with fields relative_im_path, bbox_x1,
    bbox_y1, bbox_x2, bbox_y2, class, test; ``class_names`` a 1 x 196 cell.
    zero_shot: classes 1-98 train (8,054), 99-196 test (8,131); classification: ``test``
    flag (8,144 / 8,041).
    """
    split, protocol = _check_split("cars196", split, protocol)
    name = "cars196"
    try:
        r = resolve_root(name, root, ["cars_annos.mat"])
    except FileNotFoundError as e:
        p = Path(os.fspath(root)).expanduser() if root else None
        if p is not None and p.is_dir() and ((p / "devkit").is_dir() or (p / "cars_train").is_dir()):
            raise FileNotFoundError(
                f"{e}\nThis folder looks like the classification devkit layout (devkit/, cars_train/, "
                "cars_test/); deepmetric reads the 'all images' release: cars_annos.mat with car_ims/."
            ) from None
        raise
    f = r / "cars_annos.mat"
    mat = _loadmat(f, name, ["annotations"])
    ann = mat["annotations"]
    fields = ann.dtype.names or ()
    need = ("relative_im_path", "class", "test")
    if any(k not in fields for k in need):
        hint = " (this is a devkit file with 'fname'; use cars_annos.mat)" if "fname" in fields else ""
        raise ValueError(f"{name}: '{f}' annotations have fields {list(fields)}, expected {list(need)}{hint}")
    recs = ann.reshape(-1)
    paths, cids, test = [], [], []
    for i, rec in enumerate(recs):
        try:
            paths.append(str(_unwrap(rec["relative_im_path"])))
            cids.append(int(_unwrap(rec["class"])))
            test.append(int(_unwrap(rec["test"])))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name}: '{f}' annotation {i + 1} is malformed: {e}") from None
    if not (r / "car_ims").is_dir() and paths and paths[0].startswith("car_ims/"):
        resolve_root(name, r, ["car_ims"])  # raises the layout error (mentions car_ims.tgz if present)
    names_of = None
    if "class_names" in mat:
        cn = np.asarray(mat["class_names"]).reshape(-1)
        names_of = {i + 1: str(_unwrap(c)) for i, c in enumerate(cn)}
    if protocol == "zero_shot":
        keep = _zero_shot_select(split, cids, _first_half(cids))
    else:
        keep = np.array(test, dtype=np.int64) == (1 if split == "test" else 0)
    idx = np.flatnonzero(keep)
    il = _build(
        name, r, split, [str(r / paths[i]) for i in idx], [cids[i] for i in idx], names_of,
        origins=[f"cars_annos.mat annotation {i + 1}" for i in idx],
    )
    _check_counts(name, check_counts, len(recs), protocol, split, il, f"'{f}'")
    return il


# ----------------------------------------------------------------------------- SOP
_SOP_HEADER = ["image_id", "class_id", "super_class_id", "path"]


def _read_sop(path: Path, name: str):
    with open(path, encoding="utf-8") as fh:
        header = fh.readline().split()
    if header != _SOP_HEADER:
        raise ValueError(
            f"{name}: '{path}' line 1 must be the header {' '.join(_SOP_HEADER)!r}, got {' '.join(header)!r}"
        )
    rows = read_rows(path, 4, name, skip=1)
    return [(no, as_int(c, path, no, name, "class_id"), p) for no, (_, c, _s, p) in rows]


def load_sop(root, split="train", protocol="zero_shot", check_counts=None) -> ImageList:
    """Stanford Online Products (Oh Song et al. 2016): ``Ebay_train.txt`` (59,551 images,
    11,318 classes) and ``Ebay_test.txt`` (60,502 images, 11,316 classes)."""
    split, protocol = _check_split("sop", split, protocol)
    name = "sop"
    r = resolve_root(name, root, ["Ebay_train.txt", "Ebay_test.txt"])
    tr, te = _read_sop(r / "Ebay_train.txt", name), _read_sop(r / "Ebay_test.txt", name)
    shared = {c for _, c, _ in tr} & {c for _, c, _ in te}
    if shared:
        raise ValueError(
            f"{name}: Ebay_train.txt and Ebay_test.txt share class ids {sorted(shared)[:5]} under '{r}'; "
            "the official zero-shot split has disjoint classes"
        )
    rows = tr if split == "train" else te
    fname = "Ebay_train.txt" if split == "train" else "Ebay_test.txt"
    il = _build(
        name, r, split, [str(r / p) for _, _, p in rows], [c for _, c, _ in rows], None,
        origins=[f"{fname}:{no}" for no, _, _ in rows],
    )
    _check_counts(name, check_counts, len(tr) + len(te), protocol, split, il, "Ebay_train.txt + Ebay_test.txt")
    return il


# ----------------------------------------------------------------------------- In-shop
_INSHOP_HEADER = ["image_name", "item_id", "evaluation_status"]


def load_inshop(root, split="train", protocol="zero_shot", check_counts=None) -> ImageList:
    """In-shop Clothes Retrieval (Liu et al. 2016) from ``list_eval_partition.txt``.

    Line 1: number of images; line 2: header; then ``image_name item_id evaluation_status``.
    train: 25,882 images / 3,997 items; query 14,218 and gallery 12,612 images of the same
    3,985 items, labelled with one shared mapping (sorted item ids of query + gallery).
    Image names start with ``img/``; they are looked up under ``root`` or ``root/Img``.
    """
    split, protocol = _check_split("inshop", split, protocol)
    name = "inshop"
    r = resolve_root(name, root, [("Eval/list_eval_partition.txt", "list_eval_partition.txt")])
    f = r / "Eval" / "list_eval_partition.txt"
    if not f.exists():
        f = r / "list_eval_partition.txt"
    with open(f, encoding="utf-8") as fh:
        first, second = fh.readline().strip(), fh.readline().split()
    try:
        declared = int(first)
    except ValueError:
        raise ValueError(f"{name}: {f}:1 must be the number of images, got {first!r}") from None
    if second != _INSHOP_HEADER:
        raise ValueError(f"{name}: {f}:2 must be the header {' '.join(_INSHOP_HEADER)!r}, got {' '.join(second)!r}")
    rows = read_rows(f, 3, name, skip=2)
    if len(rows) != declared:
        raise ValueError(f"{name}: {f}:1 declares {declared} images but {len(rows)} entries follow")
    for no, (_, _, status) in rows:
        if status not in ("train", "query", "gallery"):
            raise ValueError(f"{name}: {f}:{no}: evaluation_status must be train, query or gallery, got {status!r}")
    base = None
    first_img = rows[0][1][0]
    top = first_img.split("/", 1)[0]  # 'img'
    for cand in (r, r / "Img"):
        if (cand / top).is_dir():
            base = cand
            break
    if base is None:
        zips = [p for p in (r / "Img" / "img.zip", r / "img.zip") if p.exists()]
        hint = f" Extract {zips[0]} first ({extract_hint(zips[0])})." if zips else ""
        raise FileNotFoundError(
            f"{name}: image folder '{top}/' not found under '{r}' or '{r / 'Img'}' "
            f"(the names in {f.name} start with '{top}/').{hint}\nA correct root looks like:\n{LAYOUTS[name]}"
        )
    train_items = {i for _, (_, i, s) in rows if s == "train"}
    test_items = {i for _, (_, i, s) in rows if s != "train"}
    if train_items & test_items:
        raise ValueError(f"{name}: '{f}' has items in both train and query/gallery, e.g. {sorted(train_items & test_items)[:3]}")
    sel = [(no, p, i) for no, (p, i, s) in rows if s == split]
    # query and gallery share one mapping: the sorted item ids of both sets together
    order = sorted(train_items) if split == "train" else sorted(test_items)
    il = _build(
        name, r, split, [str(base / p) for _, p, _ in sel], [i for _, _, i in sel], {i: i for i in order},
        order=order, origins=[f"{f.name}:{no}" for no, _, _ in sel],
    )
    _check_counts(name, check_counts, len(rows), protocol, split, il, f"'{f}'")
    return il


# ----------------------------------------------------------------------------- Flowers102
def load_flowers102(root, split="train", protocol="zero_shot", check_counts=None) -> ImageList:
    """Oxford Flowers102 (Nilsback & Zisserman 2008): ``imagelabels.mat`` ('labels', 1..102),
    ``setid.mat`` ('trnid', 'valid', 'tstid', 1-based), ``jpg/image_%05d.jpg``.

    zero_shot (ALMN): classes 1-51 train, 52-102 test, all images; classification: the
    setid.mat split 1,020 / 1,020 / 6,149.
    """
    split, protocol = _check_split("flowers102", split, protocol)
    name = "flowers102"
    r = resolve_root(name, root, ["imagelabels.mat", "setid.mat", "jpg"])
    f_lab, f_set = r / "imagelabels.mat", r / "setid.mat"
    labels = _int_vector(_loadmat(f_lab, name, ["labels"]), "labels", f_lab, name)
    setid = _loadmat(f_set, name, ["trnid", "valid", "tstid"])
    n = len(labels)
    ids = {k: _int_vector(setid, k, f_set, name) for k in ("trnid", "valid", "tstid")}
    seen: dict[int, str] = {}
    for k, v in ids.items():
        bad = v[(v < 1) | (v > n)]
        if bad.size:
            raise ValueError(f"{name}: '{f_set}' {k} has image indices {bad[:5].tolist()} outside 1..{n} ({f_lab.name} has {n} labels)")
        for j in v.tolist():
            if j in seen:
                raise ValueError(f"{name}: '{f_set}' image {j} is in both {seen[j]} and {k}")
            seen[j] = k
    if protocol == "zero_shot":
        all_idx = np.arange(1, n + 1)
        keep = _zero_shot_select(split, labels.tolist(), _first_half(labels.tolist()))
        chosen = all_idx[keep]
    else:
        chosen = ids[{"train": "trnid", "val": "valid", "test": "tstid"}[split]]
    il = _build(
        name, r, split, [str(r / "jpg" / f"image_{j:05d}.jpg") for j in chosen.tolist()],
        [int(labels[j - 1]) for j in chosen.tolist()], None,
        origins=[f"imagelabels.mat index {j}" for j in chosen.tolist()],
    )
    _check_counts(name, check_counts, n, protocol, split, il, f"'{f_lab}'")
    return il


# ----------------------------------------------------------------------------- FGVC-Aircraft
def load_aircraft(root, split="train", protocol="zero_shot", check_counts=None) -> ImageList:
    """FGVC-Aircraft (Maji et al. 2013) at variant level from ``fgvc-aircraft-2013b/data/``.

    ``images_variant_{train,val,test}.txt`` lines are ``<image_id> <variant>`` (the variant
    may contain spaces); class ids are the 1-based line numbers in ``variants.txt``.
    zero_shot (ALMN): first 50 variants train, last 50 test, all 10,000 images;
    classification: train 3,334 / val 3,333 / test 3,333 (and trainval).
    """
    split, protocol = _check_split("aircraft", split, protocol)
    name = "aircraft"
    root_p = Path(os.fspath(root)).expanduser() if root else root
    if root_p and (root_p / "images_variant_train.txt").exists() and not (root_p / "data").is_dir():
        r = resolve_root(name, root_p, ["variants.txt", "images_variant_train.txt",
                                         "images_variant_val.txt", "images_variant_test.txt", "images"])
        d = r
    else:
        r = resolve_root(name, root, ["data/variants.txt", "data/images_variant_train.txt",
                                       "data/images_variant_val.txt", "data/images_variant_test.txt", "data/images"])
        d = r / "data"
    f_var = d / "variants.txt"
    with open(f_var, encoding="utf-8") as fh:
        variants = [ln.strip() for ln in fh if ln.strip()]
    if len(set(variants)) != len(variants):
        raise ValueError(f"{name}: '{f_var}' lists a variant twice")
    vid = {v: i + 1 for i, v in enumerate(variants)}
    per = {}
    for s in ("train", "val", "test"):
        fp = d / f"images_variant_{s}.txt"
        rows = []
        for no, (img, var) in read_rows(fp, 2, name):
            if var not in vid:
                raise ValueError(f"{name}: {fp}:{no}: variant {var!r} is not listed in '{f_var}'")
            rows.append((f"{fp.name}:{no}", img, vid[var]))
        per[s] = rows
    if protocol == "zero_shot":
        allrows = per["train"] + per["val"] + per["test"]
        train_cls = set(range(1, len(variants) // 2 + 1))
        keep = _zero_shot_select(split, [c for _, _, c in allrows], train_cls)
        sel = [row for row, k in zip(allrows, keep) if k]
    else:
        sel = per["train"] + per["val"] if split == "trainval" else per[split]
    il = _build(
        name, r, split, [str(d / "images" / f"{img}.jpg") for _, img, _ in sel], [c for _, _, c in sel],
        {i + 1: v for i, v in enumerate(variants)}, origins=[o for o, _, _ in sel],
    )
    total = sum(len(v) for v in per.values())
    _check_counts(name, check_counts, total, protocol, split, il, "images_variant_{train,val,test}.txt")
    return il


# ----------------------------------------------------------------------------- Stanford Dogs
def _read_dogs_list(path: Path, name: str):
    mat = _loadmat(path, name, ["file_list", "labels"])
    files = [str(_unwrap(x)) for x in np.asarray(mat["file_list"]).reshape(-1)]
    labels = _int_vector(mat, "labels", path, name)
    if len(files) != len(labels):
        raise ValueError(f"{name}: '{path}' has {len(files)} files but {len(labels)} labels")
    return files, labels


def load_dogs(root, split="train", protocol="classification", check_counts=None) -> ImageList:
    """Stanford Dogs (Khosla et al. 2011): ``train_list.mat`` / ``test_list.mat``
    ('file_list' cells like 'n02085620-Chihuahua/n02085620_10074.jpg', 'labels' 1..120)
    with images under ``Images/``: 12,000 train / 8,580 test."""
    split, protocol = _check_split("dogs", split, protocol)
    name = "dogs"
    r = resolve_root(name, root, ["train_list.mat", "test_list.mat", "Images"])
    tr = _read_dogs_list(r / "train_list.mat", name)
    te = _read_dogs_list(r / "test_list.mat", name)
    files, labels = tr if split == "train" else te
    names_of = {}
    for fl, lab in (tr, te):
        for p, c in zip(fl, lab.tolist()):
            folder = p.split("/", 1)[0]
            names_of.setdefault(c, folder.split("-", 1)[1] if "-" in folder else folder)
    fname = f"{split}_list.mat"
    il = _build(
        name, r, split, [str(r / "Images" / p) for p in files], labels.tolist(), names_of,
        origins=[f"{fname} entry {i + 1}" for i in range(len(files))],
    )
    _check_counts(name, check_counts, len(tr[0]) + len(te[0]), protocol, split, il, "train_list.mat + test_list.mat")
    return il


# ----------------------------------------------------------------------------- dispatch
BENCHMARKS: dict[str, tuple[Callable, dict[str, tuple[str, ...]], str]] = {
    # name: (loader, {protocol: splits}, default protocol)
    "cub": (load_cub, {"zero_shot": ("train", "test"), "classification": ("train", "test")}, "zero_shot"),
    "cars196": (load_cars196, {"zero_shot": ("train", "test"), "classification": ("train", "test")}, "zero_shot"),
    "sop": (load_sop, {"zero_shot": ("train", "test")}, "zero_shot"),
    "inshop": (load_inshop, {"zero_shot": ("train", "query", "gallery")}, "zero_shot"),
    "flowers102": (load_flowers102, {"zero_shot": ("train", "test"), "classification": ("train", "val", "test")}, "zero_shot"),
    "aircraft": (load_aircraft, {"zero_shot": ("train", "test"), "classification": ("train", "val", "test", "trainval")}, "zero_shot"),
    "dogs": (load_dogs, {"classification": ("train", "test")}, "classification"),
    "nabirds": (load_nabirds, {"classification": ("train", "test")}, "classification"),
}


def _check_split(name: str, split, protocol) -> tuple[str, str]:
    _, protocols, default = BENCHMARKS[name]
    protocol = default if protocol is None else str(protocol).replace("-", "_").lower()
    if protocol not in protocols:
        raise ValueError(f"{name}: protocol must be one of {sorted(protocols)}, got {protocol!r}")
    if split not in protocols[protocol]:
        raise ValueError(f"{name} ({protocol}): split must be one of {list(protocols[protocol])}, got {split!r}")
    return split, protocol


def load_benchmark(name: str, root, split: str = "train", protocol: str | None = None,
                   check_counts: bool | None = None) -> ImageList:
    """Dispatch to ``load_<name>``; ``protocol=None`` means the dataset's default."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    loader, _, default = BENCHMARKS[name]
    return loader(root, split=split, protocol=protocol or default, check_counts=check_counts)

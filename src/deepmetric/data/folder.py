"""Your own data: an ImageFolder-style tree (``folder``) or a CSV file (``csv``).

These are how users bring their own images, so every error says what was found, where,
and what to do instead.

``folder``: ``root/<class_name>/<image>`` (images may sit in sub-folders of a class
folder). Splits:

* no split option: the whole tree is one set (``split="all"`` or ``"train"``);
* ``class_split="half"``: the first half of the class folder names, sorted as Python sorts
  strings (by code point: ``"10" < "2"``, ``"Zebra" < "ant"``), is ``train``, the rest
  ``test`` (the zero-shot convention of CUB/Cars, REFERENCE.md section 4); with an odd count
  the extra class goes to ``test``;
* ``class_split=0.7`` (a fraction in (0, 1)): that share of classes, drawn with ``seed``,
  is ``train``; the rest ``test``;
* ``class_split={"train": [...], "test": [...]}`` (optionally ``"val"``, ``"query"``,
  ``"gallery"``): explicit class-name lists; classes may not appear twice, every name must
  be a class folder, and classes listed nowhere are left out (with a warning);
* ``split_file="splits.txt"``: one ``<split> <class name or relative image path>`` per
  line (``#`` comments allowed); splits are train, val, test, query, gallery.

``split="all"`` is every image of every class, whatever ``class_split`` says (so a folder of
one class can be indexed with a checkpoint trained with ``class_split: half``).

``csv``: a header row with ``path`` and ``label`` columns and optionally ``split`` (extra
columns are ignored). Paths are relative to the CSV's folder (or ``image_root``) unless
absolute. Labels are all integers (used as class ids) or all names (sorted); a
``label_map`` dict maps names to ids explicitly.

In both, labels are remapped to 0..C-1 within the split; ``query`` and ``gallery`` share
one mapping.
"""
from __future__ import annotations

import csv as _csv
import os
import re
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

from deepmetric.wording import counted
from deepmetric.registry import did_you_mean

from .image_list import IMAGE_EXTENSIONS, ImageList, remap_labels

__all__ = ["load_folder", "load_csv", "SPLIT_NAMES"]

SPLIT_NAMES = ("train", "val", "test", "query", "gallery")
_FOLDER_LAYOUT = (
    "root/\n"
    "  class_a/ img001.jpg img002.png ...\n"
    "  class_b/ ...\n"
    "(one folder per class; the folder name is the class name)"
)
_CSV_LAYOUT = (
    "path,label,split\n"
    "images/cat_01.jpg,cat,train\n"
    "images/dog_07.jpg,dog,test\n"
    "(header required; 'split' optional; paths relative to the CSV's folder; labels all integers or all names)"
)


def _is_image(p: Path, exts) -> bool:
    return p.suffix.lower() in exts


def _mapping_order(split: str, per_split_classes: dict[str, set]) -> list | None:
    """query/gallery share one mapping (sorted union); other splits map their own classes."""
    if split in ("query", "gallery"):
        return sorted(per_split_classes.get("query", set()) | per_split_classes.get("gallery", set()))
    return None


def _no_split_error(kind: str, where: str, split: str) -> ValueError:
    return ValueError(
        f"{kind} '{where}': split={split!r} asked for, but no split is defined. Either use split='all' "
        "(or 'train') for the whole set, or define one (in a YAML config under data.options): "
        "class_split: half (first half of the sorted class names = train, rest = test), "
        "class_split: 0.7 with seed: 0 (a random 70% of the classes = train), "
        "class_split: {train: [a, b], test: [c, d]} (explicit class names), or "
        "split_file: splits.txt (lines '<split> <class name or relative image path>')."
    )


# ----------------------------------------------------------------------------- folder
def _scan_classes(root: Path, exts, allow_empty: bool) -> dict[str, list[Path]]:
    if not root.is_dir():
        raise NotADirectoryError(f"folder: root '{root}' is not a folder")
    subdirs = sorted(e for e in root.iterdir() if e.is_dir() and not e.name.startswith("."))
    loose = sorted(e for e in root.iterdir() if e.is_file() and _is_image(e, exts))
    if not subdirs:
        if loose:
            raise ValueError(
                f"folder: found {counted(len(loose), 'image')} directly in '{root}' (e.g. {loose[0].name}) but no class "
                f"folders. Put the images of each class into their own sub-folder:\n{_FOLDER_LAYOUT}"
            )
        others = sorted(e.name for e in root.iterdir())[:5]
        raise ValueError(
            f"folder: '{root}' has no class folders and no images (contents: {others or 'empty'}). "
            f"Expected:\n{_FOLDER_LAYOUT}"
        )
    if loose:
        warnings.warn(
            f"folder: {counted(len(loose), 'image')} directly in '{root}' (e.g. {loose[0].name}) "
            f"{'is' if len(loose) == 1 else 'are'} ignored: "
            "only images inside class folders are used",
            stacklevel=3,
        )
    _check_not_parent(root, subdirs, exts)
    classes: dict[str, list[Path]] = {}
    empty: list[tuple[str, list[str]]] = []
    for d in subdirs:
        files = []
        other = []
        for dirpath, dirnames, filenames in os.walk(d):
            dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
            for fn in sorted(filenames):
                if fn.startswith("."):
                    continue
                (files if _is_image(Path(fn), exts) else other).append(Path(dirpath) / fn)
        if files:
            classes[d.name] = files
        else:
            empty.append((d.name, [p.name for p in other[:3]]))
    if not classes:
        seen = Counter(Path(n).suffix.lower() or "(none)" for _, ns in empty for n in ns)
        raise ValueError(
            f"folder: no images found under '{root}' ({len(subdirs)} class folders, all without images). "
            f"Accepted extensions: {' '.join(exts)}"
            + (f"; found files with extensions {sorted(seen)}" if seen else "")
            + f". Expected:\n{_FOLDER_LAYOUT}"
        )
    if empty:
        desc = "; ".join(f"'{n}'" + (f" (holds only {o})" if o else " (empty)") for n, o in empty[:10])
        more = f" and {len(empty) - 10} more" if len(empty) > 10 else ""
        if not allow_empty:
            raise ValueError(
                f"folder: {len(empty)} class folder(s) under '{root}' contain no images: {desc}{more}. "
                f"Accepted extensions: {' '.join(exts)}. Remove or fill these folders, or ignore them "
                "with allow_empty_classes=True (in a YAML config: data.options.allow_empty_classes: true)."
            )
        warnings.warn(f"folder: ignoring {len(empty)} class folder(s) without images: {desc}{more}", stacklevel=3)
    return classes


def _image_subfolders(d: Path, exts) -> list[Path]:
    """Sub-folders of ``d`` that directly hold images (hidden ones skipped)."""
    out = []
    for e in sorted(d.iterdir()):
        if e.is_dir() and not e.name.startswith("."):
            try:
                if any(f.is_file() and _is_image(f, exts) for f in e.iterdir()):
                    out.append(e)
            except OSError:
                continue
    return out


def _check_not_parent(root: Path, subdirs: list[Path], exts) -> None:
    """A root with one sub-folder that itself holds several image folders is the *parent* of
    the dataset folder (``root/digits/<class>/...``): say so instead of training on one class."""
    if len(subdirs) != 1:
        return
    only = subdirs[0]
    if any(f.is_file() and _is_image(f, exts) for f in only.iterdir()):
        return
    inner = _image_subfolders(only, exts)
    if len(inner) >= 2:
        names = ", ".join(p.name for p in inner[:5]) + (", ..." if len(inner) > 5 else "")
        raise ValueError(
            f"folder: root '{root}' looks like the parent of the dataset folder: its only sub-folder "
            f"'{only.name}' holds {len(inner)} image folders ({names}), which would make one single "
            f"class. Pass root='{only}' (in a YAML config: data.root: {only})."
        )


def _read_split_file(path: Path, root: Path, classes: dict[str, list[Path]]) -> dict[Path, str]:
    if not path.is_file():
        raise FileNotFoundError(
            f"folder: split_file '{path}' not found. It should list '<split> <class name or relative image path>' "
            "per line, e.g. 'train cat' or 'test dog/img_07.jpg'."
        )
    assign: dict[Path, str] = {}
    origin: dict[Path, int] = {}
    image_set = {p for ps in classes.values() for p in ps}
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(maxsplit=1)
            if len(parts) != 2:
                raise ValueError(
                    f"folder: {path}:{no}: expected '<split> <class name or relative image path>', got {line!r}"
                )
            split, entry = parts[0].lower(), parts[1].strip().rstrip("/")
            if split not in SPLIT_NAMES:
                raise ValueError(
                    f"folder: {path}:{no}: unknown split {parts[0]!r}; allowed: {', '.join(SPLIT_NAMES)} "
                    "(the split comes first on each line)"
                )
            if entry in classes:
                targets = classes[entry]
            else:
                p = root / entry
                if p in image_set:
                    targets = [p]
                elif p.is_dir():
                    raise ValueError(f"folder: {path}:{no}: '{entry}' is a folder but not a class folder with images")
                else:
                    raise ValueError(
                        f"folder: {path}:{no}: '{entry}' is neither a class folder nor an image under '{root}' "
                        f"(classes are e.g. {sorted(classes)[:5]})"
                    )
            for t in targets:
                if t in assign and assign[t] != split:
                    raise ValueError(
                        f"folder: {path}:{no}: '{t.relative_to(root)}' is put in {split!r} but line "
                        f"{origin[t]} already put it in {assign[t]!r}"
                    )
                assign[t] = split
                origin[t] = no
    if not assign:
        raise ValueError(f"folder: split_file '{path}' assigns nothing (no non-comment lines)")
    left = len(image_set) - len(assign)
    if left:
        warnings.warn(f"folder: {left} images under '{root}' are not named in split_file '{path}' and are left out", stacklevel=3)
    return assign


def _explicit_class_split(class_split: dict, names: list[str], root: Path) -> dict[str, str]:
    """``{"train": [names], "test": [names], ...}`` -> class name -> split, checked."""
    assign: dict[str, str] = {}
    known = set(names)
    for split, listed in class_split.items():
        where = f"class_split.{split}"
        if split not in SPLIT_NAMES:
            raise ValueError(f"folder: class_split has an unknown split {split!r}; allowed: {', '.join(SPLIT_NAMES)}")
        if isinstance(listed, str) or not isinstance(listed, (list, tuple)):
            raise ValueError(f"folder: {where} must be a list of class folder names, got {listed!r}")
        for c in listed:
            c = str(c)
            if c not in known:
                hint = did_you_mean(c, names) or f"; the classes are {names[:20]}"
                raise ValueError(f"folder: {where} names '{c}', which is not a class folder with images "
                                 f"under '{root}'{hint}")
            if c in assign:
                raise ValueError(f"folder: class '{c}' is listed in class_split.{assign[c]} and {where}; "
                                 "train and test classes must be disjoint")
            assign[c] = split
    if not assign:
        raise ValueError("folder: class_split lists no classes; give e.g. {train: [a, b], test: [c, d]}")
    left = [c for c in names if c not in assign]
    if left:
        warnings.warn(f"folder: {len(left)} class folder(s) under '{root}' are in no class_split list and "
                      f"are left out: {left[:10]}{' ...' if len(left) > 10 else ''}", stacklevel=4)
    return assign


def _existing_path(value, *, no_value: str, what: str, expected: str) -> Path:
    """``value`` (a folder's or a file's path, ``~`` expanded) when it exists; else the error
    ``no_value`` (nothing given) or ``"<what> '<path>' does not exist. <expected>"``."""
    if value is None or str(value) == "":
        raise ValueError(no_value)
    path = Path(os.fspath(value)).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{what} '{path}' does not exist. {expected}")
    return path


def _class_split_assignment(class_split, names: list[str], r: Path, seed: int) -> dict[str, str]:
    """Class name -> "train" / "test" (or an explicit list's split) under ``class_split``: 'half',
    a fraction of the classes drawn with ``seed``, or lists of class names."""
    if len(names) < 2:
        raise ValueError(f"folder: class_split needs at least 2 classes, '{r}' has {len(names)}: {names}")
    if isinstance(class_split, dict):
        return _explicit_class_split(class_split, names, r)
    if isinstance(class_split, str):
        if class_split != "half":
            raise ValueError(f"folder: class_split must be 'half', a fraction in (0, 1) or lists of class names "
                             f"({{train: [...], test: [...]}}), got {class_split!r}")
        train_names = set(names[: len(names) // 2])
    else:
        try:
            frac = float(class_split)
        except (TypeError, ValueError):
            raise ValueError(f"folder: class_split must be 'half', a fraction in (0, 1) or lists of class names "
                             f"({{train: [...], test: [...]}}), got {class_split!r}") from None
        if not 0.0 < frac < 1.0:
            raise ValueError(f"folder: class_split fraction must lie strictly between 0 and 1, got {frac}")
        n_train = int(round(frac * len(names)))
        if n_train < 1 or n_train > len(names) - 1:
            raise ValueError(
                f"folder: class_split={frac} of {len(names)} classes leaves {n_train} train and "
                f"{len(names) - n_train} test classes; both need at least one"
            )
        perm = np.random.default_rng(seed).permutation(len(names))
        train_names = {names[i] for i in perm[:n_train]}
    return {c: ("train" if c in train_names else "test") for c in names}


#: how to choose a dataset, in the words of each caller: the command line, a YAML config, Python
#: (the message cannot know which one it reaches)
_USE_DATASET = {name: f"--data {name} on the command line, data.name: {name} in a config, "
                      f"build_dataset('{name}', root=...) in Python" for name in ("folder", "csv")}


def load_folder(root, split: str = "all", *, class_split=None, split_file=None, seed: int = 0,
                extensions=IMAGE_EXTENSIONS, allow_empty_classes: bool = False) -> ImageList:
    """Read ``root/<class>/<image>``; see the module docstring for the split options."""
    r = _existing_path(root, no_value="folder: no root given. Pass root=<folder with one sub-folder per class>:\n"
                       + _FOLDER_LAYOUT, what="folder: root", expected="Expected:\n" + _FOLDER_LAYOUT)
    if r.is_file():
        if r.suffix.lower() in (".csv", ".tsv", ".txt"):
            raise ValueError(f"folder: root '{r}' is a file list; read it with the csv dataset: {_USE_DATASET['csv']}.")
        raise NotADirectoryError(f"folder: root '{r}' is a file; pass the folder that holds one sub-folder per class")
    if class_split is not None and split_file is not None:
        raise ValueError("folder: pass either class_split or split_file, not both")
    if split == "all":
        class_split = None  # every image of every class: a class split (e.g. a checkpoint's) has no say
    exts = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions)
    classes = _scan_classes(r, exts, allow_empty_classes)
    names = sorted(classes)

    if class_split is None and split_file is None:
        if split not in ("all", "train"):
            raise _no_split_error("folder", str(r), split)
        assign_class = {c: "all" for c in names}
        per_image = None
    elif split_file is not None:
        assign = _read_split_file(Path(os.fspath(split_file)).expanduser(), r, classes)
        per_image = assign
        assign_class = None
    else:
        assign_class = _class_split_assignment(class_split, names, r, seed)
        per_image = None

    items: list[tuple[Path, str, str]] = []  # (path, class, split)
    for c in names:
        for p in classes[c]:
            s = per_image.get(p) if per_image is not None else assign_class.get(c)
            if s is not None:
                items.append((p, c, s))
    available = sorted({s for _, _, s in items})
    if split == "all":
        sel = items
    elif per_image is None and assign_class and available == ["all"]:
        sel = items  # no split defined, "train" means everything
    else:
        if split not in available:
            raise ValueError(
                f"folder '{r}': split {split!r} is empty or unknown; this folder's splits are {available} "
                "(plus 'all')"
            )
        sel = [it for it in items if it[2] == split]
    per_split = {}
    for _, c, s in items:
        per_split.setdefault(s, set()).add(c)
    order = _mapping_order(split, per_split)
    paths = [str(p) for p, _, _ in sel]
    cids = [c for _, c, _ in sel]
    labels, ids = remap_labels(cids, order)
    return ImageList(paths=paths, labels=labels, class_ids=ids, class_names=list(ids),
                     name="folder", split=split, root=str(r))


# ----------------------------------------------------------------------------- csv
_INT_RE = re.compile(r"^[+-]?\d+$")


def _read_csv(f: Path, delimiter: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """The header (lower-case column names, checked for 'path' and 'label') and the non-blank
    rows with their line numbers."""
    with open(f, encoding="utf-8-sig", newline="") as fh:
        reader = _csv.reader(fh, delimiter=delimiter)
        header = None
        rows: list[tuple[int, list[str]]] = []
        for row in reader:
            if not row or all(not c.strip() for c in row):
                continue
            if header is None:
                header = [c.strip().lower() for c in row]
                header_line = reader.line_num
                continue
            rows.append((reader.line_num, [c.strip() for c in row]))
    if header is None:
        raise ValueError(f"csv: '{f}' is empty. Expected:\n{_CSV_LAYOUT}")
    missing = [c for c in ("path", "label") if c not in header]
    if missing:
        looks_data = len(header) >= 2 and (Path(header[0]).suffix in IMAGE_EXTENSIONS or _INT_RE.match(header[1]))
        if looks_data:
            raise ValueError(
                f"csv: {f}:{header_line}: the first line must be a header naming the columns 'path' and 'label' "
                f"(optionally 'split'), but it looks like data: {','.join(header)!r}. Add the header line:\n{_CSV_LAYOUT}"
            )
        d = delimiter if delimiter != "\t" else "\\t"
        raise ValueError(
            f"csv: {f}:{header_line}: missing column(s) {missing}; the header has {header} "
            f"(delimiter {d!r}). Expected:\n{_CSV_LAYOUT}"
        )
    return header, rows


def _csv_entries(f: Path, header: list[str], rows) -> list[tuple[int, str, str, str]]:
    """(line, path, label, split) of every row, each checked."""
    ip, il_, isp = header.index("path"), header.index("label"), header.index("split") if "split" in header else None
    entries = []  # (line, path, label_str, split)
    for no, row in rows:
        need = max(ip, il_, isp if isp is not None else 0) + 1
        if len(row) < need:
            raise ValueError(f"csv: {f}:{no}: expected {len(header)} columns {header}, got {len(row)}: {row}")
        p, lab = row[ip], row[il_]
        if not p:
            raise ValueError(f"csv: {f}:{no}: empty path")
        if not lab:
            raise ValueError(f"csv: {f}:{no}: empty label for '{p}'")
        s = "all"
        if isp is not None:
            s = row[isp].lower()
            if s not in SPLIT_NAMES:
                raise ValueError(
                    f"csv: {f}:{no}: unknown split value {row[isp]!r}; allowed: {', '.join(SPLIT_NAMES)}"
                )
        entries.append((no, p, lab, s))
    if not entries:
        raise ValueError(f"csv: '{f}' has a header but no rows")
    return entries


def _csv_class_ids(f: Path, entries, label_map: dict | None) -> tuple[list, dict | None]:
    """Each entry's class id and the id -> name map (None: integer labels) from an explicit
    ``label_map``, all-integer labels or all-name labels."""
    if label_map is not None:
        if not isinstance(label_map, dict):
            raise TypeError(f"csv: label_map must be a dict name -> int, got {type(label_map).__name__}")
        cid = []
        for no, _, lab, _ in entries:
            if lab not in label_map:
                raise ValueError(
                    f"csv: {f}:{no}: label {lab!r} is not in label_map (which has e.g. {sorted(label_map)[:5]})"
                )
            v = label_map[lab]
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"csv: label_map[{lab!r}] must be an int, got {v!r}")
            cid.append(int(v))
        names_of = {}
        for k, v in label_map.items():
            names_of.setdefault(int(v), str(k))
    else:
        is_int = [bool(_INT_RE.match(lab)) for _, _, lab, _ in entries]
        n_int = sum(is_int)
        if 0 < n_int < len(entries):
            minority = False if n_int * 2 >= len(entries) else True
            no, _, lab, _ = next(e for e, k in zip(entries, is_int) if k == minority)
            kind = "integer" if minority else "a name"
            raise ValueError(
                f"csv: {f}:{no}: label {lab!r} is {kind} while most labels are "
                f"{'names' if minority else 'integers'}; use all-integer labels or all-name labels, "
                "or pass label_map={'name': id, ...}"
            )
        if n_int:
            cid = [int(lab) for _, _, lab, _ in entries]
            names_of = None
        else:
            cid = [lab for _, _, lab, _ in entries]
            names_of = {}
    return cid, names_of


def _csv_rows_of_split(f: Path, split: str, entries) -> list[int]:
    """The indices of the entries in ``split``."""
    available = sorted({s for *_, s in entries})
    if split == "all" or (available == ["all"] and split == "train"):
        idx = list(range(len(entries)))
    elif available == ["all"]:
        raise ValueError(
            f"csv '{f}': split={split!r} asked for, but the file has no 'split' column. Add a column "
            "'split' (train/val/test/query/gallery) or use split='all'."
        )
    elif split not in available:
        counts = Counter(s for *_, s in entries)
        raise ValueError(
            f"csv '{f}': no rows with split {split!r}; the file has "
            + ", ".join(f"{k} ({v})" for k, v in sorted(counts.items()))
        )
    else:
        idx = [i for i, e in enumerate(entries) if e[3] == split]
    return idx


def load_csv(path, split: str = "all", *, image_root=None, label_map: dict | None = None,
             delimiter: str = ",") -> ImageList:
    """Read a ``path,label[,split]`` CSV; see the module docstring."""
    f = _existing_path(path, no_value="csv: no file given. Pass root=<path to the .csv>, a file like:\n" + _CSV_LAYOUT,
                       what="csv: file", expected="Expected a file like:\n" + _CSV_LAYOUT)
    if f.is_dir():
        found = sorted(p.name for p in f.glob("*.csv"))
        hint = (f" It contains {found[:5]}; give one of them as the root (--root, data.root or root=), e.g. "
                f"'{f / found[0]}'." if found
                else f" For a folder with one sub-folder per class use the folder dataset: {_USE_DATASET['folder']}.")
        raise IsADirectoryError(f"csv: '{f}' is a folder, not a CSV file.{hint}")
    base = Path(os.fspath(image_root)).expanduser() if image_root is not None else f.parent
    header, rows = _read_csv(f, delimiter)
    entries = _csv_entries(f, header, rows)
    cid, names_of = _csv_class_ids(f, entries, label_map)
    idx = _csv_rows_of_split(f, split, entries)
    per_split: dict[str, set] = {}
    for e, c in zip(entries, cid):
        per_split.setdefault(e[3], set()).add(c)
    order = _mapping_order(split, per_split)
    labels, ids = remap_labels([cid[i] for i in idx], order)
    class_names = None
    if names_of is not None:
        class_names = [names_of.get(c, str(c)) if names_of else str(c) for c in ids]
    paths = [str(base / entries[i][1]) for i in idx]
    return ImageList(
        paths=paths, labels=labels, class_ids=ids, class_names=class_names,
        origins=[f"{f.name}:{entries[i][0]}" for i in idx], name="csv", split=split, root=str(base),
        hint=f"Relative paths are resolved against '{base}' (the CSV's folder unless image_root is given).",
    )

"""Finding and reading the official annotation files of the benchmarks of
:mod:`deepmetric.data.benchmarks`: the layout each root must have (shown in every layout
error), the search for a root one level off or still archived, and the row readers."""
from __future__ import annotations

import os
from pathlib import Path


# What a correct root looks like, shown in every layout error.
LAYOUTS: dict[str, str] = {
    "cub": (
        "CUB_200_2011/            <- root (from CUB_200_2011.tgz)\n"
        "  images.txt             '<image_id> <class_folder>/<file>.jpg'\n"
        "  image_class_labels.txt '<image_id> <class_id>'\n"
        "  train_test_split.txt   '<image_id> <is_training_image>'\n"
        "  classes.txt            '<class_id> <class_name>'\n"
        "  images/<class_folder>/<file>.jpg"
    ),
    "cars196": (
        "cars196/                 <- root\n"
        "  cars_annos.mat         struct 'annotations' (relative_im_path, bbox_*, class, test), 'class_names'\n"
        "  car_ims/000001.jpg ... (from car_ims.tgz)"
    ),
    "sop": (
        "Stanford_Online_Products/   <- root (from Stanford_Online_Products.zip)\n"
        "  Ebay_train.txt            header 'image_id class_id super_class_id path'\n"
        "  Ebay_test.txt             same header\n"
        "  bicycle_final/ cabinet_final/ ... (image folders named in 'path')"
    ),
    "inshop": (
        "In-shop Clothes Retrieval Benchmark/   <- root\n"
        "  Eval/list_eval_partition.txt   (or list_eval_partition.txt next to img/)\n"
        "      line 1: number of images; line 2: 'image_name item_id evaluation_status'\n"
        "  Img/img/WOMEN/... and Img/img/MEN/...   (from Img/img.zip; or img/ directly under root)"
    ),
    "flowers102": (
        "flowers102/              <- root\n"
        "  imagelabels.mat        'labels' (1 x 8189, values 1..102)\n"
        "  setid.mat              'trnid', 'valid', 'tstid' (1-based image indices)\n"
        "  jpg/image_00001.jpg ... (from 102flowers.tgz)"
    ),
    "aircraft": (
        "fgvc-aircraft-2013b/     <- root (from fgvc-aircraft-2013b.tar.gz)\n"
        "  data/variants.txt      one variant name per line (class order)\n"
        "  data/images_variant_{train,val,test}.txt   '<image_id> <variant name>'\n"
        "  data/images/<image_id>.jpg"
    ),
    "dogs": (
        "stanford_dogs/           <- root\n"
        "  train_list.mat, test_list.mat  (from lists.tar: 'file_list', 'labels')\n"
        "  Images/n02085620-Chihuahua/n02085620_10074.jpg ... (from images.tar)"
    ),
    "nabirds": (
        "nabirds/                 <- root (from nabirds.tar.gz)\n"
        "  images.txt             '<image_uuid> <class_folder>/<file>.jpg'\n"
        "  image_class_labels.txt '<image_uuid> <class_id>'\n"
        "  train_test_split.txt   '<image_uuid> <is_training_image>'\n"
        "  classes.txt            '<class_id> <class_name>'\n"
        "  images/<class_folder>/<file>.jpg"
    ),
}

_ARCHIVE_SUFFIXES = (".tgz", ".tar", ".tar.gz", ".gz", ".zip", ".tar.bz2", ".tbz", ".tar.xz", ".7z", ".rar")


def _is_archive(p: Path) -> bool:
    return p.name.lower().endswith(_ARCHIVE_SUFFIXES)


def extract_hint(p: Path) -> str:
    n = p.name.lower()
    if n.endswith(".zip"):
        return f"unzip '{p}' -d '{p.parent}'"
    return f"tar -xf '{p}' -C '{p.parent}'"


def _find_below(root: Path, relname: str, depth: int = 3) -> list[Path]:
    """Folders up to ``depth`` levels below ``root`` that contain ``relname``."""
    found = []
    frontier = [root]
    for _ in range(depth):
        nxt = []
        for d in frontier:
            try:
                subs = sorted(e for e in d.iterdir() if e.is_dir())
            except OSError:
                continue
            for s in subs:
                if (s / relname).exists():
                    found.append(s)
                nxt.append(s)
        frontier = nxt[:200]  # keep the search cheap on huge trees
        if found:
            break
    return found


def resolve_root(name: str, root, required: list[str | tuple[str, ...]]) -> Path:
    """Check ``root`` and the required entries (a tuple lists alternatives); friendly errors."""
    layout = LAYOUTS[name]
    if root is None or str(root) == "":
        raise ValueError(
            f"{name}: no root given. Pass root=<folder of the extracted dataset>; it should look like:\n{layout}"
        )
    p = Path(os.fspath(root)).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{name}: root '{p}' does not exist. A correct root looks like:\n{layout}")
    if p.is_file():
        if _is_archive(p):
            raise FileNotFoundError(
                f"{name}: root '{p}' is an archive that has not been extracted. Extract it first "
                f"({extract_hint(p)}) and pass the extracted folder, which should look like:\n{layout}"
            )
        raise NotADirectoryError(f"{name}: root '{p}' is a file, not a folder. A correct root looks like:\n{layout}")
    for entry in required:
        alts = entry if isinstance(entry, tuple) else (entry,)
        if any((p / a).exists() for a in alts):
            continue
        want = alts[0]
        msg = f"{name}: expected '{p / want}' but it does not exist (root='{p}')."
        if len(alts) > 1:
            msg += " Also looked for: " + ", ".join(f"'{p / a}'" for a in alts[1:]) + "."
        below = []
        for a in alts:
            below += _find_below(p, a)
        archives = sorted(e for e in p.iterdir() if e.is_file() and _is_archive(e))
        if below:
            msg += (
                f"\nRoot looks like a parent folder: '{want}' is in '{below[0]}'. "
                f"Pass root='{below[0]}' (in a YAML config: data.root: {below[0]})."
            )
        elif archives:
            msg += (
                "\nThe folder holds archive(s) not yet extracted: "
                + ", ".join(e.name for e in archives[:5])
                + f". Extract them (e.g. {extract_hint(archives[0])})."
            )
        msg += f"\nA correct root looks like:\n{layout}"
        raise FileNotFoundError(msg)
    return p


def read_rows(path: Path, ncols: int, name: str, skip: int = 0) -> list[tuple[int, list[str]]]:
    """Whitespace-separated rows; the last column keeps inner spaces. Returns (line_no, fields)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, start=1):
            if no <= skip:
                continue
            line = line.strip()
            if not line:
                continue
            parts = line.split(maxsplit=ncols - 1)
            if len(parts) != ncols:
                raise ValueError(
                    f"{name}: {path}:{no}: expected {ncols} fields, got {len(parts)}: {line!r}"
                )
            rows.append((no, parts))
    if not rows:
        raise ValueError(f"{name}: '{path}' contains no entries")
    return rows


def as_int(value: str, path: Path, no: int, name: str, what: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: {path}:{no}: {what} must be an integer, got {value!r}") from None


def id_map(rows, path: Path, name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for no, (key, value) in rows:
        if key in out:
            raise ValueError(f"{name}: {path}:{no}: image id {key!r} is listed twice")
        out[key] = value
    return out

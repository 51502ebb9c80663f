"""Glyphs: a many-class zero-shot benchmark rendered offline from installed CJK typefaces.

Classes are the 3,755 GB2312 level-1 hanzi (rows 16-55 of GB 2312-1980, in GB2312 order, i.e.
ordered by pinyin). Each class holds one image per installed CJK font *face* that maps the
character in its cmap (every face of a .ttc collection counts: weights, regional variants JP /
KR / SC / TC / HK, mono variants). Faces whose complete rendering stack is pixel-identical to
an earlier face's (for example "Noto Sans Mono CJK SC" vs "Noto Sans CJK SC", whose hanzi are the
same outlines) are dropped. Then, by default (``dedup="exact"``), every image that is
pixel-identical to an earlier image of the same class (faces in the fixed order of
``find_cjk_faces``) is dropped: the regional variants of one Noto weight (JP / KR / SC / TC / HK)
draw most characters identically: without this, 59 % of the images are exact copies of another
image of their class, which makes retrieval trivial. Classes therefore hold different numbers
of images (22-78 for the full benchmark); ``face_ids`` tells which face drew each image.
``dedup="near"`` also drops images whose mean absolute difference to a kept image of the class
is below ``near_threshold`` grey levels; ``dedup="none"`` keeps every face's image.

Zero-shot protocol: the first half of the characters in GB2312 order (1,878) are training
classes, the second half (1,877) test classes; the two splits share no class.

Cross-family protocol (``protocol="cross_family"``): faces group into typeface families
(:data:`FACE_FAMILIES`, :func:`face_family`). Training uses the training characters drawn by
the training families only; the test characters drawn by the held-out families
(``test_families``, default :data:`CROSS_FAMILY_TEST_FAMILIES`) are the queries, the same
characters drawn by the training families the gallery. A query therefore never finds an image
of its own typeface family in the gallery (no "next weight of the same design" shortcut), and
the network never saw the held-out families' style in training. Splits: ``train``, ``query``,
``gallery`` and ``test`` (= query + gallery, with boolean ``is_query`` / ``is_gallery``
attributes that the evaluation uses).

Rendering (deterministic for a given font file, Pillow and FreeType version, all part of the
cache key): the glyph is drawn white-on-black with FreeType at ``oversample`` times the target
resolution, its ink bounding box is centred in a ``size x size`` canvas with ``margin`` pixels of
border, and the canvas is reduced by box-averaging (``Image.reduce``), which anti-aliases
exactly. ``fit="em"`` (default) renders every glyph at the same em size (the em square fills the
inner box), so stroke weight and relative size stay those of the typeface; ``fit="box"``
scales every glyph so its bounding box's longer side fills the inner box.

The result is cached as a compressed ``.npz`` under ``root`` (default ``$DEEPMETRIC_CACHE`` or
``~/.cache/deepmetric``) ``/glyphs/``, keyed by a hash of the font files (path, size,
modification time), the characters, all rendering parameters and the library versions; the
write is atomic (temporary file + ``os.replace``), so the second build only loads the file.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .fashion_mnist import ArrayImageDataset
from .registry import register_dataset

__all__ = [
    "GlyphDataset",
    "FontFace",
    "build_glyph_dataset",
    "gb2312_level1_chars",
    "find_cjk_faces",
    "render_glyph",
    "glyph_cache_dir",
    "CJK_FONT_PATTERNS",
    "FACE_FAMILIES",
    "CROSS_FAMILY_TEST_FAMILIES",
    "PROTOCOLS",
    "face_family",
]

_FORMAT_VERSION = 2
DEDUP_MODES = ("exact", "near", "none")
PROTOCOLS = ("zero_shot", "cross_family")

# Typeface families: (family, face-name prefixes). A face belongs to the first family one of
# whose prefixes equals its name or starts it followed by a space (weights, regional and mono
# variants of one design are one family).
FACE_FAMILIES = (
    ("Noto Sans CJK", ("Noto Sans CJK", "Noto Sans Mono CJK")),
    ("Noto Serif CJK", ("Noto Serif CJK",)),
    ("AR PL UKai", ("AR PL UKai",)),
    ("AR PL UMing", ("AR PL UMing",)),
    ("WenQuanYi Zen Hei", ("WenQuanYi Zen Hei",)),
    ("WenQuanYi Micro Hei", ("WenQuanYi Micro Hei",)),
    ("LXGW WenKai", ("LXGW WenKai",)),
    ("BabelStone Han", ("BabelStone Han",)),
)
# Held out by default in the cross-family protocol (chosen from raw-pixel baselines, see
# docs/offline-data.md).
CROSS_FAMILY_TEST_FAMILIES = ("AR PL UKai", "LXGW WenKai")


def face_family(name: str) -> str:
    """The typeface family of a face name (:data:`FACE_FAMILIES`); a face of no listed family
    (your own fonts) is its own family, named by its full name."""
    for family, prefixes in FACE_FAMILIES:
        if any(name == p or name.startswith(p + " ") for p in prefixes):
            return family
    return name

# Font files of the Debian packages fonts-noto-cjk, fonts-noto-cjk-extra, fonts-arphic-ukai,
# fonts-arphic-uming, fonts-wqy-zenhei, fonts-wqy-microhei, fonts-lxgw-wenkai and
# fonts-babelstone-han (other distributions use the same upstream file names). A fixed list
# (rather than "any font with hanzi") keeps the benchmark the same on every machine that
# installs these packages.
CJK_FONT_PATTERNS = [
    "NotoSansCJK*.tt[cf]", "NotoSerifCJK*.tt[cf]", "NotoSansCJK*.otf", "NotoSerifCJK*.otf",
    "NotoSansCJK*.otc", "NotoSerifCJK*.otc",
    "ukai.ttc", "uming.ttc",
    "wqy-zenhei.ttc", "wqy-microhei.ttc",
    "LXGWWenKai*.ttf",
    "BabelStoneHan*.ttf",
]
DEFAULT_FONT_DIRS = ["/usr/share/fonts", "/usr/local/share/fonts", "~/.local/share/fonts", "~/.fonts"]
_FONT_EXTS = (".ttf", ".ttc", ".otf", ".otc")


def gb2312_level1_chars() -> str:
    """The 3,755 GB2312 level-1 hanzi in GB2312 order, derived from Python's gb2312 codec.

    Level 1 is rows 16-55 (EUC-CN lead bytes 0xB0-0xD7), 94 cells per row (trail 0xA1-0xFE)
    except row 55, whose last five cells (0xD7FA-0xD7FE) are unassigned: 39 * 94 + 89 = 3755.
    """
    chars = []
    for lead in range(0xB0, 0xD8):
        last = 0xF9 if lead == 0xD7 else 0xFE
        for trail in range(0xA1, last + 1):
            chars.append(bytes([lead, trail]).decode("gb2312"))
    s = "".join(chars)
    assert len(s) == 3755 and len(set(s)) == 3755, len(s)
    return s


@dataclass(frozen=True)
class FontFace:
    path: str   # font file
    index: int  # face index inside a .ttc/.otc collection (0 for .ttf/.otf)
    name: str   # full name from the font's name table (id 4)

    @property
    def key(self) -> str:
        return f"{self.path}#{self.index}"


def _faces_in_file(path: str) -> list[FontFace]:
    from fontTools.ttLib import TTCollection, TTFont

    if path.lower().endswith((".ttc", ".otc")):
        fonts = TTCollection(path, lazy=True).fonts
    else:
        fonts = [TTFont(path, lazy=True)]
    faces = []
    for i, f in enumerate(fonts):
        name = f["name"].getDebugName(4) or f"{Path(path).stem}#{i}"
        faces.append(FontFace(path, i, name))
    return faces


def find_cjk_faces(fonts: Iterable[str] | str | None = None) -> list[FontFace]:
    """Every face of the CJK font files, sorted by (file name, face index).

    ``fonts``: None (search ``DEFAULT_FONT_DIRS`` for ``CJK_FONT_PATTERNS``), or font files
    and/or directories (directories are searched for ``CJK_FONT_PATTERNS``); a file may carry
    ``#i`` to select one face of a collection.
    """
    if isinstance(fonts, (str, os.PathLike)):
        fonts = [fonts]
    specs: list[tuple[str, int | None]] = []
    if fonts is None:
        dirs, files = DEFAULT_FONT_DIRS, []
    else:
        dirs, files = [], []
        for item in fonts:
            item = str(item)
            path, _, idx = item.partition("#")
            p = Path(path).expanduser()
            if p.is_dir():
                dirs.append(str(p))
            elif p.is_file():
                if not path.lower().endswith(_FONT_EXTS):
                    raise ValueError(f"glyphs: {path} is not a font file (expected one of {_FONT_EXTS})")
                files.append((str(p.resolve()), int(idx) if idx else None))
            else:
                raise FileNotFoundError(f"glyphs: font file or directory not found: {path}")
    for d in dirs:
        d = os.path.expanduser(d)
        for pat in CJK_FONT_PATTERNS:
            for f in glob.glob(os.path.join(d, "**", pat), recursive=True):
                files.append((str(Path(f).resolve()), None))
    specs = sorted(set(files), key=lambda s: (Path(s[0]).name, s[0], -1 if s[1] is None else s[1]))
    faces: list[FontFace] = []
    seen = set()
    for path, idx in specs:
        try:
            file_faces = _faces_in_file(path)
        except Exception as e:  # noqa: BLE001 - report which file is broken
            raise ValueError(f"glyphs: cannot read font file {path}: {e}") from e
        if idx is not None:
            if not 0 <= idx < len(file_faces):
                raise ValueError(f"glyphs: {path} holds {len(file_faces)} face(s), index {idx} requested")
            file_faces = [file_faces[idx]]
        for face in file_faces:
            if face.key not in seen:
                seen.add(face.key)
                faces.append(face)
    return faces


def glyph_cache_dir(root=None) -> Path:
    base = root or os.environ.get("DEEPMETRIC_CACHE") or os.path.join("~", ".cache", "deepmetric")
    return Path(base).expanduser() / "glyphs"


def _load_font(face: FontFace, px: int):
    from PIL import ImageFont

    return ImageFont.truetype(face.path, size=px, index=face.index, layout_engine=ImageFont.Layout.BASIC)


def render_glyph(font, ch: str, size: int = 32, margin: int = 2, oversample: int = 4,
                 fit: str = "em") -> np.ndarray | None:
    """Render one character with a Pillow FreeType font loaded at ``(size - 2 margin) * oversample`` px.

    Returns a ``uint8 [size, size]`` array (ink 255 on background 0) or None if the glyph has
    no ink. The ink bounding box is centred (to 1/oversample pixel) and the high-resolution
    canvas is box-averaged down by ``oversample``.
    """
    from PIL import Image, ImageDraw

    inner = (size - 2 * margin) * oversample
    big = size * oversample
    canvas = Image.new("L", (3 * inner, 3 * inner), 0)  # generous room for overhanging glyphs
    ImageDraw.Draw(canvas).text((inner, inner), ch, font=font, fill=255)
    bbox = canvas.getbbox()
    if bbox is None:
        return None
    glyph = canvas.crop(bbox)
    w, h = glyph.size
    if fit == "box" or max(w, h) > inner:
        scale = inner / max(w, h)
        w, h = max(1, round(w * scale)), max(1, round(h * scale))
        glyph = glyph.resize((w, h), Image.Resampling.LANCZOS)
    out = Image.new("L", (big, big), 0)
    out.paste(glyph, ((big - w) // 2, (big - h) // 2))
    return np.asarray(out.reduce(oversample), dtype=np.uint8)


def _face_cmap(face: FontFace) -> set[int]:
    from fontTools.ttLib import TTFont

    return set(TTFont(face.path, fontNumber=face.index, lazy=True).getBestCmap() or {})


def _render_face(args) -> tuple[np.ndarray, np.ndarray]:
    """Worker: render every character a face maps; returns (present bool[n], images uint8[n, s, s])."""
    face, chars, size, margin, oversample, fit = args
    cmap = _face_cmap(face)
    font = _load_font(face, (size - 2 * margin) * oversample)
    present = np.zeros(len(chars), dtype=bool)
    images = np.zeros((len(chars), size, size), dtype=np.uint8)
    for i, ch in enumerate(chars):
        if ord(ch) not in cmap:  # otherwise FreeType silently draws .notdef (a box)
            continue
        img = render_glyph(font, ch, size, margin, oversample, fit)
        if img is not None:
            present[i] = True
            images[i] = img
    return present, images


def _cache_key(faces: Sequence[FontFace], chars: str, params: dict) -> str:
    from PIL import __version__ as pil_version
    from PIL import features

    files = []
    for f in faces:
        st = os.stat(f.path)
        files.append([f.path, f.index, st.st_size, st.st_mtime_ns])
    blob = json.dumps({
        "format": _FORMAT_VERSION, "faces": files, "chars": hashlib.sha256(chars.encode()).hexdigest(),
        "params": params, "pillow": pil_version, "freetype": features.version("freetype2"),
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _dedup_within_classes(images: np.ndarray, char_idx: np.ndarray, mode: str,
                          near_threshold: float) -> np.ndarray:
    """Boolean keep-mask over class-major ``images``: within each class, drop an image that is
    pixel-identical to (``mode="exact"``), or whose mean absolute difference in grey levels is
    below ``near_threshold`` to (``mode="near"``), an image kept earlier in the class. The order
    inside a class is the face order, so the first face's image always survives."""
    keep = np.ones(len(images), dtype=bool)
    if mode == "none" or len(images) == 0:
        return keep
    starts = np.flatnonzero(np.r_[True, char_idx[1:] != char_idx[:-1], True])
    flat = images.reshape(len(images), -1)
    for s, e in zip(starts[:-1], starts[1:]):
        seen = set()
        for i in range(s, e):  # exact: hash the raw bytes (cheap, exact equality)
            b = flat[i].tobytes()
            if b in seen:
                keep[i] = False
            seen.add(b)
        if mode == "near" and near_threshold > 0:
            idx = s + np.flatnonzero(keep[s:e])
            x = flat[idx].astype(np.int16)
            kept: list[int] = []
            for j in range(len(idx)):
                if kept:
                    d = np.abs(x[kept] - x[j]).mean(axis=1)
                    if d.min() < near_threshold:
                        keep[idx[j]] = False
                        continue
                kept.append(j)
    return keep


def _render_all(faces, chars, params, num_workers, verbose) -> dict:
    """Render, drop pixel-identical faces and duplicate images within a class (``params["dedup"]``),
    and return the arrays stored in the cache file."""
    tasks = [(f, chars, params["size"], params["margin"], params["oversample"], params["fit"]) for f in faces]
    if num_workers is None:
        # Spawning workers costs ~2 s of imports; only worth it for real builds.
        num_workers = min(2, os.cpu_count() or 1) if len(faces) * len(chars) > 20000 else 0
    if num_workers > 1:
        import multiprocessing as mp

        ex = ProcessPoolExecutor(max_workers=num_workers, mp_context=mp.get_context("spawn"))
        results = ex.map(_render_face, tasks)
    else:
        ex = None
        results = map(_render_face, tasks)
    if verbose:
        from tqdm import tqdm

        results = tqdm(results, total=len(tasks), desc="rendering glyph faces", unit="face")
    kept_faces, dropped, seen = [], [], {}
    imgs, char_idx, face_idx = [], [], []
    try:
        for face, (present, images) in zip(faces, results):
            if not present.any():
                dropped.append((face, "maps none of the characters"))
                continue
            digest = hashlib.sha256(present.tobytes() + images.tobytes()).hexdigest()
            if digest in seen:
                dropped.append((face, f"pixel-identical to {seen[digest].name}"))
                continue
            seen[digest] = face
            idx = np.flatnonzero(present)
            imgs.append(images[idx])
            char_idx.append(idx.astype(np.int32))
            face_idx.append(np.full(len(idx), len(kept_faces), dtype=np.int16))
            kept_faces.append(face)
    finally:
        if ex is not None:
            ex.shutdown()
    if not kept_faces:
        raise RuntimeError("glyphs: no font face renders any of the characters")
    char_idx = np.concatenate(char_idx)
    face_idx = np.concatenate(face_idx)
    order = np.lexsort((face_idx, char_idx))  # class-major: all faces of char 0, then char 1, ...
    images, char_idx, face_idx = np.concatenate(imgs)[order], char_idx[order], face_idx[order]
    keep = _dedup_within_classes(images, char_idx, params["dedup"], params["near_threshold"])
    return {
        "images": images[keep],
        "char_index": char_idx[keep],
        "face_index": face_idx[keep],
        "images_before_dedup": np.array(len(keep)),
        "chars": np.array(list(chars)),
        "face_names": np.array([f.name for f in kept_faces]),
        "face_paths": np.array([f.path for f in kept_faces]),
        "face_indices": np.array([f.index for f in kept_faces], dtype=np.int32),
        "dropped_names": np.array([f.name for f, _ in dropped], dtype=str),
        "dropped_reasons": np.array([r for _, r in dropped], dtype=str),
    }


def cached_npz(path: Path, build: Callable[[], dict]) -> tuple[dict, bool]:
    """``(arrays, from_cache)``: the arrays of the ``.npz`` cache at ``path``, or ``build()``'s
    (timed as ``build_seconds``) written there atomically; a damaged cache file is rebuilt."""
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}, True
        except Exception:  # noqa: BLE001 - a damaged cache file is rebuilt, not fatal
            pass
    t0 = time.perf_counter()
    data = build()
    data["build_seconds"] = np.array(time.perf_counter() - t0)
    atomic_savez(path, data)
    return data, False


def atomic_savez(path: Path, arrays: dict) -> None:
    """Write a compressed ``.npz`` atomically (temporary file in the same folder, then
    ``os.replace``): a killed build never leaves a half-written cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class GlyphDataset(ArrayImageDataset):
    """One split of the glyph benchmark (see module docstring).

    Extra attributes: ``chars`` (the split's characters, = ``class_names``), ``face_ids``
    (per-image index into ``faces``), ``faces`` (names of the faces kept), ``dropped_faces``
    (``(name, reason)`` pairs), ``cache_path``, ``from_cache`` (whether this build loaded the cache),
    ``dedup`` (the mode used) and ``images_before_dedup`` (both splits, before within-class dedup),
    ``protocol``, ``families`` (per-image family name, a numpy array) and, for ``protocol="cross_family"``,
    ``train_families`` / ``test_families`` and (split ``test``) the boolean masks ``is_query``
    (held-out families) and ``is_gallery`` (training families).
    """


@register_dataset("glyphs")
def build_glyph_dataset(split: str = "train", transform: Callable | None = None, root=None, *,
                        size: int = 32, margin: int = 2, oversample: int = 4, fit: str = "em",
                        fonts: Iterable[str] | str | None = None, max_classes: int | None = None,
                        max_train_classes: int | None = None,
                        max_faces: int | None = None, num_workers: int | None = None,
                        dedup: str = "exact", near_threshold: float = 2.0,
                        protocol: str = "zero_shot", test_families: Iterable[str] | None = None,
                        verbose: bool = False) -> GlyphDataset:
    """Build (or load from cache) one split of the glyph benchmark.

    Args:
        split: "train" (first half of the GB2312 level-1 characters) or "test" (second half);
            ``protocol="cross_family"`` adds "query" (test characters, held-out families) and
            "gallery" (test characters, training families); its "test" is both, marked by
            ``is_query`` / ``is_gallery``.
        transform: applied to the ``uint8`` tensor ``[1, size, size]`` (see ``build_transform("glyph")``).
        root: cache directory (default ``$DEEPMETRIC_CACHE`` or ``~/.cache/deepmetric``).
        size: output side in pixels; margin: empty border in output pixels;
        oversample: rendering resolution factor before box-filter downsampling;
        fit: "em" (same em size for every glyph) or "box" (bounding box fills the inner square).
        fonts: font files / directories (default: the CJK packages' files, see ``find_cjk_faces``).
        max_classes: keep only the first ``max_classes`` characters of each split (small demos/tests).
        max_train_classes: if given, the number of training characters instead (the test split
            keeps ``max_classes``; e.g. train on 300 characters, test on all 1,877).
        max_faces: use only the first ``max_faces`` faces (before duplicate removal).
        num_workers: rendering processes (default 2 for a full build, 0 for small subsets).
        dedup: "exact" (default: drop an image pixel-identical to an earlier one of its class),
            "near" (also drop one whose mean absolute difference to a kept one of its class is
            below ``near_threshold`` grey levels out of 255) or "none".
        protocol: "zero_shot" (every face in both splits) or "cross_family" (see the module
            docstring).
        test_families: the held-out families of ``protocol="cross_family"`` (names of
            :data:`FACE_FAMILIES`, or the full name of a face of no listed family); default
            :data:`CROSS_FAMILY_TEST_FAMILIES`.
    """
    test_families = _checked_options(split, protocol, test_families, fit=fit, size=size, oversample=oversample,
                                     margin=margin, dedup=dedup, near_threshold=near_threshold,
                                     limits={"max_classes": max_classes, "max_train_classes": max_train_classes,
                                             "max_faces": max_faces})
    train_chars, test_chars = _split_chars(max_classes, max_train_classes)
    chars = train_chars + test_chars
    faces = _faces(fonts, max_faces)
    params = {"size": size, "margin": margin, "oversample": oversample, "fit": fit, "dedup": dedup,
              "near_threshold": float(near_threshold) if dedup == "near" else None}
    path = glyph_cache_dir(root) / f"glyphs-{size}px-{_cache_key(faces, chars, params)}.npz"
    data, from_cache = cached_npz(path, lambda: _render_all(faces, chars, params, num_workers, verbose))

    ds = _split_dataset(data, split, protocol, test_families, train_chars, test_chars, transform)
    ds.cache_path = path
    ds.from_cache = from_cache
    ds.dedup = dedup
    return ds


def _checked_options(split: str, protocol: str, test_families, *, fit: str, size: int, oversample: int,
                     margin: int, dedup: str, near_threshold, limits: dict) -> list[str] | None:
    """Refuse a bad option of :func:`build_glyph_dataset` before any rendering; returns the
    held-out families (the default ones for ``protocol="cross_family"``, None otherwise)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"glyphs: protocol must be one of {PROTOCOLS}, got {protocol!r}")
    splits = ("train", "test") if protocol == "zero_shot" else ("train", "test", "query", "gallery")
    if split not in splits:
        raise ValueError(f"glyphs: split must be one of {splits} for protocol={protocol!r}, got {split!r}")
    if test_families is not None and protocol != "cross_family":
        raise ValueError("glyphs: test_families is an option of protocol='cross_family' only")
    if protocol == "cross_family":
        if test_families is None:
            test_families = CROSS_FAMILY_TEST_FAMILIES
        if isinstance(test_families, str):
            test_families = [test_families]
        test_families = list(test_families)
        if not test_families or not all(isinstance(f, str) for f in test_families):
            raise ValueError(f"glyphs: test_families must be a non-empty list of family names, got {test_families!r}")
    if fit not in ("em", "box"):
        raise ValueError(f"glyphs: fit must be 'em' or 'box', got {fit!r}")
    for name, v, lo in (("size", size, 4), ("oversample", oversample, 1), ("margin", margin, 0)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"glyphs: {name} must be an int >= {lo}, got {v!r}")
    if size - 2 * margin < 2:
        raise ValueError(f"glyphs: margin={margin} leaves no room in size={size}")
    if dedup not in DEDUP_MODES:
        raise ValueError(f"glyphs: dedup must be one of {DEDUP_MODES}, got {dedup!r}")
    if isinstance(near_threshold, bool) or not isinstance(near_threshold, (int, float)) or not 0 <= near_threshold <= 255:
        raise ValueError(f"glyphs: near_threshold must be a number in [0, 255] (grey levels), got {near_threshold!r}")
    for name, v in limits.items():
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"glyphs: {name} must be a positive int or None, got {v!r}")
    return test_families


def _split_chars(max_classes: int | None, max_train_classes: int | None) -> tuple[str, str]:
    """The training and test characters: the first and second half of GB2312 level 1."""
    all_chars = gb2312_level1_chars()
    n_train = (len(all_chars) + 1) // 2  # 1878 train, 1877 test
    train_chars, test_chars = all_chars[:n_train], all_chars[n_train:]
    if max_classes is not None:
        train_chars, test_chars = train_chars[:max_classes], test_chars[:max_classes]
    if max_train_classes is not None:
        train_chars = all_chars[:min(max_train_classes, n_train)]
    return train_chars, test_chars


def _faces(fonts, max_faces: int | None) -> list:
    """The CJK font faces rendered (the first ``max_faces`` when given)."""
    faces = find_cjk_faces(fonts)
    if not faces:
        raise FileNotFoundError(
            "glyphs: no CJK font found (searched " + ", ".join(DEFAULT_FONT_DIRS if fonts is None else map(str, fonts))
            + " for " + ", ".join(CJK_FONT_PATTERNS) + "); install e.g. apt-get install fonts-noto-cjk "
            "fonts-noto-cjk-extra fonts-arphic-ukai fonts-arphic-uming fonts-wqy-zenhei fonts-wqy-microhei "
            "fonts-lxgw-wenkai fonts-babelstone-han")
    if max_faces is not None:
        faces = faces[:max_faces]
    return faces


def _split_dataset(data, split: str, protocol: str, test_families, train_chars, test_chars,
                   transform) -> GlyphDataset:
    """One split of the rendered arrays ``data``, with its families, faces and build record."""
    n_tr = len(train_chars)
    cidx = data["char_index"]
    face_names = [str(n) for n in data["face_names"]]
    face_fams = np.array([face_family(n) for n in face_names])
    image_fams = face_fams[data["face_index"].astype(np.int64)] if len(face_fams) else np.array([], str)
    sel = cidx < n_tr if split == "train" else cidx >= n_tr
    held_out = None
    if protocol == "cross_family":
        present = sorted(set(face_fams.tolist()))
        unknown = [f for f in test_families if f not in present]
        if unknown:
            raise ValueError(f"glyphs: test_families {unknown} have no face among the fonts used; "
                             f"families present: {present}")
        train_fams = [f for f in present if f not in test_families]
        if not train_fams:
            raise ValueError(f"glyphs: test_families {test_families} hold out every family present "
                             f"({present}); nothing is left to train on")
        held_out = np.isin(image_fams, test_families)
        if split in ("train", "gallery"):
            sel &= ~held_out
        elif split == "query":
            sel &= held_out
    labels = cidx[sel].astype(np.int64) - (0 if split == "train" else n_tr)
    split_chars = list(train_chars if split == "train" else test_chars)
    ds = GlyphDataset(data["images"][sel], labels, transform=transform, class_names=split_chars,
                      num_classes=len(split_chars))
    ds.protocol = protocol
    ds.families = image_fams[sel]
    if protocol == "cross_family":
        ds.train_families = train_fams
        ds.test_families = list(test_families)
        if split == "test":
            ds.is_query = held_out[sel].copy()
            ds.is_gallery = ~ds.is_query
    ds.chars = split_chars
    ds.face_ids = data["face_index"][sel].astype(np.int64)
    ds.faces = face_names
    ds.dropped_faces = list(zip(map(str, data["dropped_names"]), map(str, data["dropped_reasons"])))
    ds.build_seconds = float(data["build_seconds"])
    ds.images_before_dedup = int(data["images_before_dedup"])
    return ds

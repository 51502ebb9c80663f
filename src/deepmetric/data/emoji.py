"""Emoji: a cross-vendor zero-shot benchmark built offline from npm artwork packages.

Like Stanford Online Products, it has many classes with few images each: one class per base
emoji of ``emoji.json`` (1,911 in emoji-datasource 16.0.0; skin-tone variants are not classes),
identified by its code-point sequence (``unified``, e.g. ``"1F600"``), and one image per vendor
that draws it. Vendors and the npm packages they come from (pinned, see ``PACKAGES``):

=========  ==================================  ===========================================
vendor     package                             files used
=========  ==================================  ===========================================
apple      emoji-datasource-apple@16.0.0       ``emoji.json``, ``img/apple/64/<image>``
google     emoji-datasource-google@16.0.0      ``emoji.json``, ``img/google/64/<image>``
twitter    emoji-datasource-twitter@16.0.0     ``emoji.json``, ``img/twitter/64/<image>``
facebook   emoji-datasource-facebook@16.0.0    ``emoji.json``, ``img/facebook/64/<image>``
emojione   emojione-assets@4.5.0               ``png/64/<codepoints>.png``
openmoji   openmoji@17.0.0                     ``color/svg/<CODEPOINTS>.svg``
=========  ==================================  ===========================================

The four emoji-datasource packages ship the same ``emoji.json`` (the class list: ``unified``,
``image``, ``name``, ``sort_order``, ``category``, ``has_img_<vendor>``, ``skin_variations``);
a datasource vendor draws an emoji when ``has_img_<vendor>`` is true. emojione and openmoji
name their files by code points (lower-case without ``FE0F`` for emojione, upper-case with it
for openmoji); an emoji is drawn by them when a file with its code points exists, compared
case-insensitively and ignoring the variation selector ``FE0F`` and the zero-width joiner
``200D`` (emojione's names omit both).

Images: the 64-px PNGs (openmoji's SVG rasterised at 64 x 64 with resvg, system fonts off, so
the output is deterministic for a resvg version), converted to RGBA, composited on white,
resized to ``size`` (Lanczos; every vendor goes through the same 64 px so resolution is not a
vendor cue) and stored as RGB ``uint8 [N, size, size, 3]``. Each sample knows its vendor
(``vendor_ids`` indexes ``vendors``).

Protocols: ``zero_shot``: the emoji in ``sort_order``, the first half (``n // 2``: 955 of 1,911)
are training classes, the second half (956) test classes (the CUB convention; no class is shared);
``cross_vendor``: the same classes, evaluated with the queries of one vendor against a gallery of
the other vendors' images, per vendor and averaged (:func:`deepmetric.evaluate.evaluate_cross_domain`
with the vendors as domains); ``split="all"`` gives every class. ``closed_set_vendor``
(classification): every class in every split, the vendors split (:mod:`deepmetric.data.emoji_splits`).

Packages are installed by ``install.sh`` (``deepmetric emoji install``: ``npm
pack`` of the pinned versions, sha512 checked against ``PACKAGES``, only the files used are
extracted) into ``<root>/emoji/packages/<name>@<version>/`` with the package's own layout;
``root`` defaults to ``$DEEPMETRIC_CACHE`` or ``~/.cache/deepmetric``. Nothing is fetched at run
time. The built arrays are cached as a compressed ``.npz`` in ``<root>/emoji/``, keyed by the
package versions (and tarball hashes), the vendors, ``size``, the format version and the Pillow
and resvg versions; the write is atomic (temporary file + ``os.replace``).
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from .contract import MetricDatasetBase

from .files import file_digest
from .glyphs import cached_npz  # one atomic .npz cache for both benchmarks
from .emoji_splits import CLOSED_SET_PROTOCOL, check_protocol_options, closed_set_selection, zero_shot_selection
from .registry import register_dataset

__all__ = [
    "EmojiDataset",
    "EmojiPackage",
    "PACKAGES",
    "VENDORS",
    "DATASOURCE_VENDORS",
    "VENDOR_PACKAGE",
    "build_emoji_dataset",
    "emoji_cache_dir",
    "emoji_counts",
    "emoji_packages_dir",
    "install_emoji_packages",
    "load_emoji_index",
    "rasterize_svg",
]

_FORMAT_VERSION = 1
SOURCE_SIZE = 64  # every vendor's image is read (or rasterised) at 64 x 64
PROTOCOLS = ("zero_shot", "cross_vendor", CLOSED_SET_PROTOCOL)
SPLITS = ("train", "val", "test", "all")  # "val": closed_set_vendor
MARKER = ".deepmetric-install.json"


@dataclass(frozen=True)
class EmojiPackage:
    name: str
    version: str
    integrity: str  # npm's sha512 of the tarball ("sha512-<base64>")
    members: tuple[str, ...]  # paths inside the package extracted (a trailing "/" = a folder)

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"


def _datasource(vendor: str, integrity: str) -> EmojiPackage:
    return EmojiPackage(f"emoji-datasource-{vendor}", "16.0.0", integrity,
                        ("package.json", "emoji.json", f"img/{vendor}/64/"))


PACKAGES: dict[str, EmojiPackage] = {p.name: p for p in (
    _datasource("apple", "sha512-dVYjsK0FnCry9F+PBtnivhG2K0xdwlmqYaSgiUtztUdAGPYiHYhZcVKvNBqC791g2qyEcFNTBO6utg4eQ3uLTw=="),
    _datasource("google", "sha512-ZRexfzs7MVoLnmzZmNsO4TKhnAJp5D++Vm6PpUpH/jEQQlemp3l88CjZ+DoZ2faM9R4QxZkOPJCoT8DlPhfQ3A=="),
    _datasource("twitter", "sha512-7F+uCuHH+7Qnrc15P5tnbvKkg9E6tlzi4MnT2uW1RlN4pLYTza6cP/dstIfSDMtpjFLWuZewWg8jBbuL2eyELQ=="),
    _datasource("facebook", "sha512-b9ZxJdB7nMWGckH1vyCjPSosaa6MJYuojPPFiQ0LmDIZS8vlG454XKcmTFKrXIMAA72O4MRJMYFhvWI8pjyciQ=="),
    EmojiPackage("emojione-assets", "4.5.0",
                 "sha512-S7Fp6M+T4hiK9ULGGGhnVMMVIqMRj+22Bd0+KgOBu+eV85B7AUX39ML3anMXKp/OEBQXDQuH+yCwy3Fl6dpoAQ==",
                 ("package.json", "png/64/")),
    EmojiPackage("openmoji", "17.0.0",
                 "sha512-EBnYrNGdcdw+OSXmENeNE1yBNRu6tOraTmoOyUbJkTmvT/+XETp8RZLSJFzD3lrPc5N9CzsyPnRTk0Vp4UaI9w==",
                 ("package.json", "color/svg/")),
)}
DATASOURCE_VENDORS = ("apple", "google", "twitter", "facebook")
VENDORS = DATASOURCE_VENDORS + ("emojione", "openmoji")
VENDOR_PACKAGE = {**{v: f"emoji-datasource-{v}" for v in DATASOURCE_VENDORS},
                  "emojione": "emojione-assets", "openmoji": "openmoji"}


# --------------------------------------------------------------------------- locations
def _cache_root(root=None) -> Path:
    base = root or os.environ.get("DEEPMETRIC_CACHE") or os.path.join("~", ".cache", "deepmetric")
    return Path(base).expanduser() / "emoji"


def emoji_cache_dir(root=None) -> Path:
    """Where the built ``.npz`` arrays live: ``<root>/emoji`` (root: ``$DEEPMETRIC_CACHE`` or ``~/.cache/deepmetric``)."""
    return _cache_root(root)


def emoji_packages_dir(root=None) -> Path:
    """Where the extracted npm packages live: ``<root>/emoji/packages/<name>@<version>/``."""
    return _cache_root(root) / "packages"


def _package_dir(pkg: EmojiPackage, root=None) -> Path:
    return emoji_packages_dir(root) / pkg.spec


def _install_hint(pkg: EmojiPackage, root, force: bool = False) -> str:
    cmd = "bash install.sh  (or: deepmetric emoji install"
    if root is not None:
        cmd += f" --root {root}"
    if force:
        cmd += " --force"
    return f"install it with: {cmd} --packages {pkg.name})"


def _check_package(pkg: EmojiPackage, root) -> Path:
    """The package's folder, after checking it is extracted at the pinned version."""
    d = _package_dir(pkg, root)
    meta = d / "package.json"
    if not meta.is_file():
        others = sorted(p.name for p in emoji_packages_dir(root).glob(f"{pkg.name}@*")) \
            if emoji_packages_dir(root).is_dir() else []
        found = f" (found {', '.join(others)}, not the pinned version)" if others else ""
        raise FileNotFoundError(f"emoji: npm package {pkg.spec} is not extracted: {meta} is missing{found}; "
                                + _install_hint(pkg, root))
    try:
        version = json.loads(meta.read_text(encoding="utf-8")).get("version")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"emoji: cannot read {meta} ({e}); " + _install_hint(pkg, root, force=True)) from e
    if version != pkg.version:
        raise ValueError(f"emoji: {meta} says version {version!r}, expected {pkg.version!r} "
                         f"(package {pkg.name}); " + _install_hint(pkg, root, force=True))
    return d


# --------------------------------------------------------------------------- installation
def _sha512_integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(file_digest(path, "sha512").digest()).decode()


def _wanted(member: str, members: Sequence[str]) -> bool:
    return any(member.startswith(m) if m.endswith("/") else member == m for m in members)


def _extract(tgz: Path, pkg: EmojiPackage, dest: Path) -> int:
    """Extract the regular files of ``pkg.members`` from an npm tarball (``package/...``) into ``dest``."""
    n = 0
    with tarfile.open(tgz, "r:gz") as tar:
        for m in tar:
            if not m.isfile():
                continue
            parts = m.name.split("/")
            if len(parts) < 2 or parts[0] != "package" or any(p in ("", ".", "..") for p in parts[1:]):
                continue
            rel = "/".join(parts[1:])
            if not _wanted(rel, pkg.members):
                continue
            out = dest.joinpath(*parts[1:])
            out.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            n += 1
    return n


def _is_installed(pkg: EmojiPackage, root) -> bool:
    marker = _package_dir(pkg, root) / MARKER
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info.get("version") == pkg.version and info.get("integrity") == pkg.integrity


def _npm_pack(pkg: EmojiPackage, dest: Path, npm: str) -> Path:
    exe = shutil.which(npm)
    if exe is None:
        raise FileNotFoundError(f"emoji: '{npm}' not found; install Node.js and npm (apt-get install nodejs npm) "
                                f"to fetch {pkg.spec}, or pass --from DIR with {pkg.name}-{pkg.version}.tgz")
    cmd = [exe, "pack", "--silent", "--pack-destination", str(dest), pkg.spec]
    res = subprocess.run(cmd, capture_output=True, text=True)
    tgz = dest / f"{pkg.name}-{pkg.version}.tgz"
    if res.returncode != 0 or not tgz.is_file():
        raise OSError(f"emoji: `{' '.join(cmd)}` failed (exit {res.returncode}): {res.stderr.strip()[-2000:]}")
    return tgz


def install_emoji_packages(root=None, *, packages: Iterable[str] | None = None, tarball_dir=None,
                           npm: str = "npm", force: bool = False, verbose: bool = True) -> list[Path]:
    """Fetch the pinned npm packages and extract only the files used (idempotent).

    For each package (default all of ``PACKAGES``): skip it when ``<name>@<version>/`` holds a
    marker with the pinned version and tarball hash (unless ``force``); otherwise take
    ``<tarball_dir>/<name>-<version>.tgz`` if given (one missing from it: npm), else ``npm pack
    <name>@<version>``, check its sha512 against the pinned ``integrity``, extract ``members``
    into a temporary folder, write the marker and rename the folder into place (a partial
    extraction is never seen). Returns the package folders.
    """
    names = list(PACKAGES) if packages is None else list(packages)
    unknown = [n for n in names if n not in PACKAGES]
    if unknown:
        raise ValueError(f"emoji: unknown package(s) {unknown}; known: {', '.join(PACKAGES)}")
    if tarball_dir is not None and not Path(tarball_dir).is_dir():  # a typo, not a reason to go to npm
        pkg = PACKAGES[names[0]] if names else next(iter(PACKAGES.values()))
        raise FileNotFoundError(f"emoji: --from {tarball_dir}: no such folder (expected <name>-<version>.tgz "
                                f"tarballs, e.g. {pkg.name}-{pkg.version}.tgz)")
    base = emoji_packages_dir(root)
    base.mkdir(parents=True, exist_ok=True)
    out = []
    for name in names:
        pkg = PACKAGES[name]
        final = _package_dir(pkg, root)
        out.append(final)
        if not force and _is_installed(pkg, root):
            if verbose:
                print(f"emoji: {pkg.spec} already extracted in {final}")
            continue
        with tempfile.TemporaryDirectory(dir=base, prefix=f".{pkg.name}.") as tmp:
            tmp = Path(tmp)
            tgz = Path(tarball_dir) / f"{pkg.name}-{pkg.version}.tgz" if tarball_dir else None
            if tgz is None or not tgz.is_file():
                if tarball_dir and verbose:
                    print(f"emoji: {tgz} not found, using npm")
                if verbose:
                    print(f"emoji: npm pack {pkg.spec}")
                tgz = _npm_pack(pkg, tmp, npm)
            got = _sha512_integrity(tgz)
            if got != pkg.integrity:
                raise ValueError(f"emoji: {tgz} has {got}, expected the pinned {pkg.integrity} of {pkg.spec}")
            staging = tmp / "extract"
            staging.mkdir()
            n = _extract(tgz, pkg, staging)
            if not (staging / "package.json").is_file():
                raise ValueError(f"emoji: {tgz} has no package/package.json: not an npm package tarball")
            (staging / MARKER).write_text(json.dumps(
                {"name": pkg.name, "version": pkg.version, "integrity": pkg.integrity,
                 "members": list(pkg.members), "files": n}, indent=1), encoding="utf-8")
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
        if verbose:
            print(f"emoji: extracted {n} files of {pkg.spec} into {final}")
    return out


# --------------------------------------------------------------------------- reading
def _code_key(codes: str) -> str:
    """Code-point sequence key: lower case, '-'-separated, without the variation selector FE0F
    and the zero-width joiner 200D (emojione's file names omit both; no two base emoji of
    emoji.json 16.0 share a key)."""
    return "-".join(p for p in codes.lower().replace("_", "-").split("-") if p and p not in ("fe0f", "200d"))


def load_emoji_index(path) -> list[dict]:
    """The base emoji of an ``emoji.json``, sorted by ``sort_order``, checked for the fields used."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"emoji: cannot read {path} ({e})") from e
    if not isinstance(data, list) or not data:
        raise ValueError(f"emoji: {path} must hold a non-empty JSON list of emoji records")
    for i, e in enumerate(data):
        missing = [k for k in ("unified", "image", "sort_order", "category") if not isinstance(e, dict) or k not in e]
        if missing:
            raise ValueError(f"emoji: {path}: record {i} lacks {missing} (expected emoji-datasource's emoji.json)")
    keys = [e["unified"].upper() for e in data]
    if len(set(keys)) != len(keys):
        raise ValueError(f"emoji: {path}: duplicate 'unified' code sequences")
    return sorted(data, key=lambda e: (e["sort_order"], e["unified"]))


def _composite_white(img) -> np.ndarray:
    """RGBA (any PIL mode) composited on white -> RGB uint8, at SOURCE_SIZE x SOURCE_SIZE."""
    from PIL import Image

    rgba = img.convert("RGBA")
    if rgba.size != (SOURCE_SIZE, SOURCE_SIZE):
        rgba = rgba.resize((SOURCE_SIZE, SOURCE_SIZE), Image.Resampling.LANCZOS)
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"), dtype=np.uint8)


def _read_png(path: Path) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
            return _composite_white(im)
    except Exception as e:  # noqa: BLE001 - name the broken file
        raise ValueError(f"emoji: cannot decode image {path}: {e}") from e


def rasterize_svg(path, size: int = SOURCE_SIZE):
    """Rasterise an SVG file to an RGBA PIL image ``size x size`` with resvg (no system fonts)."""
    import resvg_py
    from PIL import Image

    try:
        png = resvg_py.svg_to_bytes(svg_path=str(path), width=size, height=size, skip_system_fonts=True)
        im = Image.open(io.BytesIO(bytes(png)))
        im.load()
        return im
    except Exception as e:  # noqa: BLE001 - name the broken file
        raise ValueError(f"emoji: cannot rasterise SVG {path}: {e}") from e


def _vendor_files(vendor: str, pkg_dir: Path, entries: list[dict]) -> list[Path | None]:
    """Per emoji of ``entries``, the vendor's image file (or None when the vendor does not draw it)."""
    if vendor in DATASOURCE_VENDORS:
        img_dir = pkg_dir / "img" / vendor / "64"
        files = []
        for e in entries:
            if not e.get(f"has_img_{vendor}", False):
                files.append(None)
                continue
            f = img_dir / e["image"]
            if not f.is_file():
                raise FileNotFoundError(f"emoji: {f} is missing although emoji.json says has_img_{vendor} "
                                        f"for {e['unified']}; the extraction is incomplete: reinstall with "
                                        f"deepmetric emoji install --force --packages {pkg_dir.name.split('@')[0]}")
            files.append(f)
        return files
    sub, ext = {"emojione": ("png/64", ".png"), "openmoji": ("color/svg", ".svg")}[vendor]
    folder = pkg_dir / sub
    if not folder.is_dir():
        raise FileNotFoundError(f"emoji: {folder} is missing in {pkg_dir.name}; reinstall with "
                                f"deepmetric emoji install --force --packages {pkg_dir.name.split('@')[0]}")
    by_key: dict[str, Path] = {}
    for f in sorted(folder.iterdir()):  # sorted: "2764" comes before "2764-fe0f", first one wins
        if f.is_file() and f.suffix.lower() == ext:
            by_key.setdefault(_code_key(f.stem), f)
    return [by_key.get(_code_key(e["unified"])) for e in entries]


def _parse_vendors(vendors) -> tuple[str, ...]:
    if vendors is None:
        return VENDORS
    if isinstance(vendors, str):
        vendors = [v.strip() for v in vendors.split(",") if v.strip()]
    vendors = tuple(vendors)
    bad = [v for v in vendors if v not in VENDORS]
    if bad or not vendors:
        raise ValueError(f"emoji: unknown vendor(s) {bad or vendors}; choose from {', '.join(VENDORS)}")
    if len(set(vendors)) != len(vendors):
        raise ValueError(f"emoji: vendors listed twice: {vendors}")
    return tuple(v for v in VENDORS if v in vendors)  # canonical order (part of the cache key)


def _index_package(vendors: tuple[str, ...]) -> EmojiPackage:
    """The datasource package whose emoji.json lists the classes: the first selected datasource
    vendor's, else emoji-datasource-google (every datasource package ships the same file)."""
    for v in vendors:
        if v in DATASOURCE_VENDORS:
            return PACKAGES[VENDOR_PACKAGE[v]]
    return PACKAGES["emoji-datasource-google"]


def _library_versions(vendors) -> dict:
    from PIL import __version__ as pil_version

    out = {"pillow": pil_version}
    if "openmoji" in vendors:
        import resvg_py

        out["resvg_py"] = resvg_py.__version__
        out["resvg"] = getattr(resvg_py, "__resvg_version__", None)
    return out


def _marker_integrity(d: Path):
    try:
        return json.loads((d / MARKER).read_text(encoding="utf-8")).get("integrity")
    except (OSError, ValueError):
        return None


def _build_arrays(entries, vendors, dirs, size, verbose) -> dict:
    from PIL import Image

    images, class_idx, vendor_idx = [], [], []
    files = {v: _vendor_files(v, dirs[v], entries) for v in vendors}
    it = range(len(entries))
    if verbose:
        from tqdm import tqdm

        it = tqdm(it, desc="reading emoji", unit="emoji")
    for i in it:
        for vi, v in enumerate(vendors):
            f = files[v][i]
            if f is None:
                continue
            if v == "openmoji":
                rgb = _composite_white(rasterize_svg(f, SOURCE_SIZE))
            else:
                rgb = _read_png(f)
            if size != SOURCE_SIZE:
                rgb = np.asarray(Image.fromarray(rgb).resize((size, size), Image.Resampling.LANCZOS))
            images.append(rgb)
            class_idx.append(i)
            vendor_idx.append(vi)
    return {
        "images": np.stack(images) if images else np.zeros((0, size, size, 3), np.uint8),
        "class_index": np.asarray(class_idx, dtype=np.int32),
        "vendor_index": np.asarray(vendor_idx, dtype=np.int8),
        "unified": np.array([e["unified"].upper() for e in entries]),
        "names": np.array([str(e.get("name") or e.get("short_name") or e["unified"]) for e in entries]),
        "categories": np.array([str(e["category"]) for e in entries]),
        "sort_order": np.array([int(e["sort_order"]) for e in entries], dtype=np.int64),
        "vendors": np.array(vendors),
    }


# --------------------------------------------------------------------------- dataset
class EmojiDataset(MetricDatasetBase):
    """One split of the emoji benchmark; ``ds[i] -> (image, label)``.

    The transform receives a ``uint8`` tensor ``[3, size, size]`` (RGB on white); without a
    transform the image is ``float32`` in [0, 1]. Attributes: ``images`` (``uint8 [N, size,
    size, 3]``), ``labels`` (int64, 0..C-1 in ``sort_order``), ``num_classes``,
    ``class_names`` (= ``unified``, the code-point sequences, e.g. ``"1F600"``), ``names``
    (Unicode names), ``categories`` (per class), ``vendor_ids`` (int64 [N], index into
    ``vendors``), ``vendors`` (vendor names), ``protocol``, ``split``, ``cache_path``,
    ``from_cache``, ``build_seconds``, ``packages`` (the ``name@version`` used).
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, vendor_ids: np.ndarray, *,
                 transform: Callable | None = None, class_names: Sequence[str], vendors: Sequence[str]):
        images = np.asarray(images)
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise ValueError(f"images must be a uint8 array [N, H, W, 3], got {images.dtype} {images.shape}")
        self.images = np.ascontiguousarray(images)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.vendor_ids = np.asarray(vendor_ids, dtype=np.int64)
        if self.labels.shape != (len(images),) or self.vendor_ids.shape != (len(images),):
            raise ValueError("labels and vendor_ids need one entry per image")
        self.transform = transform
        self.class_names = list(class_names)
        self.num_classes = len(self.class_names)
        self.vendors = list(vendors)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        img = torch.from_numpy(self.images[i]).permute(2, 0, 1)  # [3, H, W] uint8 view
        img = img.float().div_(255.0) if self.transform is None else self.transform(img.contiguous())
        return img, int(self.labels[i])

    def vendor_of(self, i: int) -> str:
        """The vendor name of sample ``i``."""
        return self.vendors[int(self.vendor_ids[i])]

    def counts(self) -> dict:
        """Images per vendor, per category (images and classes) and the images-per-class histogram."""
        per_class = np.bincount(self.labels, minlength=self.num_classes)
        cats = np.asarray(self.categories)
        out = {
            "classes": self.num_classes, "images": len(self),
            "per_vendor": {v: int((self.vendor_ids == k).sum()) for k, v in enumerate(self.vendors)},
            "images_per_class": {int(k): int((per_class == k).sum()) for k in np.unique(per_class)},
            "classes_per_category": {}, "images_per_category": {},
        }
        for c in sorted(set(cats)):
            out["classes_per_category"][c] = int((cats == c).sum())
            out["images_per_category"][c] = int(per_class[cats == c].sum())
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(split={getattr(self, 'split', '?')}, n={len(self)}, "
                f"num_classes={self.num_classes}, vendors={self.vendors}, size={self.images.shape[1]})")


@register_dataset("emoji")
def build_emoji_dataset(split: str = "train", transform: Callable | None = None, root=None, *,
                        protocol: str = "zero_shot", size: int = 64, vendors: Iterable[str] | str | None = None,
                        min_vendors: int = 1, max_classes: int | None = None,
                        test_vendor: str | None = None, val_vendor: str | None = None,
                        verbose: bool = False) -> EmojiDataset:
    """Build (or load from cache) one split of the emoji benchmark (see the module docstring).

    Args:
        split: "train" (first half of the emoji in ``sort_order``), "test" (second half) or "all";
            protocol ``closed_set_vendor``: "train", "val", "test" or "all" (split by vendor).
        transform: applied to the ``uint8`` tensor ``[3, size, size]`` (see ``build_transform("emoji")``).
        root: deepmetric cache root holding ``emoji/packages/`` (default ``$DEEPMETRIC_CACHE`` or
            ``~/.cache/deepmetric``); the built arrays are cached in ``<root>/emoji/``.
        protocol: "zero_shot" or "cross_vendor" (same classes and images; the name records how
            the test split is evaluated, see :func:`deepmetric.evaluate.evaluate_cross_domain`).
        size: image side in pixels, 32-128 (the 64-px sources are resized with Lanczos).
        vendors: names from ``VENDORS`` (list or comma-separated string); default all six.
        min_vendors: keep only the classes drawn by at least this many of the selected vendors
            (the split into halves is made before, on all emoji, so it never depends on vendors).
        max_classes: keep only the first this many classes of the split (in ``sort_order``), for
            quick runs; None keeps all.
        test_vendor, val_vendor: ``closed_set_vendor`` only: the vendor of the ``test`` split
            (required) and of the ``val`` split (optional); neither is in ``train``.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"emoji: protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if split not in SPLITS:
        raise ValueError(f"emoji: split must be one of {SPLITS}, got {split!r}")
    if isinstance(size, bool) or not isinstance(size, int) or not 32 <= size <= 128:
        raise ValueError(f"emoji: size must be an int in 32..128, got {size!r}")
    vendors = _parse_vendors(vendors)
    check_protocol_options(protocol, split, vendors, test_vendor, val_vendor)
    if isinstance(min_vendors, bool) or not isinstance(min_vendors, int) or not 1 <= min_vendors <= len(vendors):
        raise ValueError(f"emoji: min_vendors must be an int in 1..{len(vendors)} (the number of vendors), got {min_vendors!r}")
    if max_classes is not None and (isinstance(max_classes, bool) or not isinstance(max_classes, int) or max_classes < 1):
        raise ValueError(f"emoji: max_classes must be a positive int or null, got {max_classes!r}")

    index_pkg = _index_package(vendors)
    pkgs = {index_pkg.name: index_pkg, **{VENDOR_PACKAGE[v]: PACKAGES[VENDOR_PACKAGE[v]] for v in vendors}}
    dirs_by_pkg = {name: _check_package(p, root) for name, p in pkgs.items()}
    dirs = {v: dirs_by_pkg[VENDOR_PACKAGE[v]] for v in vendors}
    index_path = dirs_by_pkg[index_pkg.name] / "emoji.json"

    key_blob = json.dumps({
        "format": _FORMAT_VERSION, "size": size, "vendors": vendors,
        "packages": {n: [p.version, _marker_integrity(dirs_by_pkg[n])] for n, p in sorted(pkgs.items())},
        "index": index_pkg.spec, "libs": _library_versions(vendors),
    }, sort_keys=True)
    key = hashlib.sha256(key_blob.encode()).hexdigest()[:20]
    path = emoji_cache_dir(root) / f"emoji-{size}px-{len(vendors)}v-{key}.npz"
    data, from_cache = cached_npz(path, lambda: _build_arrays(load_emoji_index(index_path), vendors, dirs,
                                                              size, verbose))

    n_all = len(data["unified"])
    cidx = data["class_index"].astype(np.int64)
    if protocol == CLOSED_SET_PROTOCOL:
        classes, sel = closed_set_selection(cidx, data["vendor_index"].astype(np.int64), vendors, n_all, split,
                                            test_vendor=test_vendor, val_vendor=val_vendor, min_vendors=min_vendors,
                                            max_classes=max_classes)
    else:
        classes, sel = zero_shot_selection(cidx, n_all, split, min_vendors=min_vendors, max_classes=max_classes)
    remap = np.full(n_all, -1, np.int64)
    remap[classes] = np.arange(len(classes))
    ds = EmojiDataset(data["images"][sel], remap[cidx[sel]], data["vendor_index"][sel],
                      transform=transform, class_names=[str(u) for u in data["unified"][classes]],
                      vendors=[str(v) for v in data["vendors"]])
    ds.unified = ds.class_names
    ds.names = [str(n) for n in data["names"][classes]]
    ds.categories = [str(c) for c in data["categories"][classes]]
    ds.sort_order = data["sort_order"][classes]
    ds.protocol, ds.split, ds.test_vendor, ds.val_vendor = protocol, split, test_vendor, val_vendor
    ds.cache_path, ds.from_cache, ds.build_seconds = path, from_cache, float(data["build_seconds"])
    ds.packages = [p.spec for p in pkgs.values()]
    return ds


# --------------------------------------------------------------------------- summaries
def emoji_counts(root=None, *, size: int = 64, vendors=None, verbose: bool = False) -> dict:
    """``EmojiDataset.counts()`` of the train, test and all splits (builds the cache if needed)."""
    return {split: build_emoji_dataset(split, root=root, size=size, vendors=vendors,
                                       verbose=verbose and split == "train").counts()
            for split in ("train", "test", "all")}

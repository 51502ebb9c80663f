"""One image decoder for every place deepmetric reads an image: training datasets (folder,
CSV, benchmarks), ``embed``, ``index``, ``search``, ``serve`` (uploads and thumbnails) and
frame folders of video events.

:func:`decode_image` turns a file or the bytes of an upload into an 8-bit ``RGB`` or ``L``
PIL image, the same way everywhere:

1. the header is read and **the memory the whole decode takes is checked before anything is
   decoded** (:func:`decode_memory`: the file's pixels as Pillow stores them plus every
   intermediate of the steps below at their peak - a 64 KB palette PNG with a transparent
   entry claiming 8192 x 8192 pixels takes 13 x its 64 MiB of indices, a 16-bit grey one 9 x
   its 16-bit pixels) against ``max_bytes`` (see :func:`decode_limit`), and the ratio of the
   long to the short side against ``max_aspect`` (long thin images blow up when the short side
   is resized to the model's input); only the formats in :data:`FORMATS` are opened (no EPS,
   PDF, ...: Pillow's other plugins are never reached);
2. the first frame is decoded in full (a truncated file fails here, not later);
3. the EXIF orientation is applied (:func:`PIL.ImageOps.exif_transpose`): a phone photo
   stored sideways with ``Orientation = 6`` is used upright;
4. high bit depths are **scaled** to 8 bits, never clipped: 16-bit (``I;16*``) divided by
   257 (65535 -> 255); 32-bit integer (``I``) the same when its values lie in 0..65535 (16-bit
   samples, as 16-bit files are widened), else stretched from its minimum..maximum; float
   (``F``) times 255 when its values lie in [0, 1], else stretched from its minimum..maximum;
5. transparency (an alpha band, or a palette / grey / RGB ``transparency`` entry) is
   composited onto **white** (:data:`BACKGROUND`), as the emoji benchmark draws its images;
6. the result is converted to ``mode`` (``"RGB"`` or ``"L"``; ``None``: ``L`` for grey
   sources, ``RGB`` for the rest). CMYK, YCbCr and other colour modes use Pillow's conversion.

Every error is an :class:`ImageDecodeError` (a ``ValueError``) whose message starts with the
file's name; size limits raise its subclass :class:`ImageSizeError` (``deepmetric serve``
answers it with 413, other decode errors with 400). A missing file raises
``FileNotFoundError`` naming it.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageMode, ImageOps, UnidentifiedImageError

__all__ = ["decode_image", "prepare_image", "decode_limit", "decoded_bytes", "decode_memory", "check_decoded_size",
           "ImageDecodeError", "ImageSizeError", "BACKGROUND", "DEFAULT_MAX_DECODE_MB",
           "MIN_DECODE_MB", "BYTES_PER_INPUT_PIXEL", "MAX_ASPECT", "FORMATS"]

#: colour transparent pixels are composited onto, everywhere
BACKGROUND = (255, 255, 255)
#: the cap on the decoded size of one image, in MiB (``--max-decode-mb``,
#: ``data.options.max_decode_mb``); training datasets, which do not know the model, use it alone
DEFAULT_MAX_DECODE_MB = 512.0
#: the smallest limit :func:`decode_limit` derives, in MiB, however small the model's input
MIN_DECODE_MB = 64.0
#: decoded bytes allowed per pixel of the model's input (4096 = 32 x the input side, 4 bytes)
BYTES_PER_INPUT_PIXEL = 4096
#: largest ratio of the long side to the short side
MAX_ASPECT = 100.0

_ORIENTATION = 0x0112  # the EXIF Orientation tag
_GREY_MODES = ("1", "L", "LA", "La", "I", "F", "I;16", "I;16L", "I;16B", "I;16N")
_BLOCK = 1 << 18  # values per row block of the 8-bit scaling (its int64 / float64 temporaries: 2 MiB)
#: the image formats decoded (Pillow's format names); anything else is "not an image", so no
#: other plugin (EPS, which calls Ghostscript, PDF, ...) is ever reached from a file or upload
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM")  # JPEG opens MPO (camera) files too


class ImageDecodeError(ValueError):
    """An image that cannot be decoded; ``str(exc)`` is ``"<name>: <reason>"``."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name, self.reason = str(name), reason


class ImageSizeError(ImageDecodeError):
    """An image whose decoded size or shape is over a limit (``limit_bytes`` /
    ``max_aspect`` say which)."""

    def __init__(self, name: str, reason: str, *, limit_bytes: int | None = None,
                 max_aspect: float | None = None):
        super().__init__(name, reason)
        self.limit_bytes, self.max_aspect = limit_bytes, max_aspect


def decode_limit(input_pixels: int | None = None, cap_mb: float | None = None) -> int:
    """The largest decoded image, in bytes, for a model whose input has ``input_pixels``
    pixels (height x width): ``BYTES_PER_INPUT_PIXEL`` per input pixel, at least
    ``MIN_DECODE_MB``, at most ``cap_mb`` (default :data:`DEFAULT_MAX_DECODE_MB`). For a
    224 x 224 input: 196 MiB (a 6000 x 4000 16-bit RGB photo is 137 MiB); for 32 x 32 glyphs:
    64 MiB. Without ``input_pixels``: the cap."""
    cap = DEFAULT_MAX_DECODE_MB if cap_mb is None else float(cap_mb)
    if not cap > 0:
        raise ValueError(f"max_decode_mb must be > 0, got {cap_mb}")
    cap_bytes = int(cap * 2**20)
    if input_pixels is None:
        return cap_bytes
    derived = max(int(MIN_DECODE_MB * 2**20), BYTES_PER_INPUT_PIXEL * int(input_pixels))
    return min(cap_bytes, derived)


def _bytes_per_pixel(mode: str) -> int:
    """Bands x bytes per band of a PIL mode (``1`` counts as one byte: Pillow keeps a byte per
    pixel)."""
    m = ImageMode.getmode(mode)
    return len(m.bands) * max(1, int(m.typestr[2:]) // (8 if m.typestr[1] == "b" else 1))


def decoded_bytes(im: Image.Image) -> int:
    """``width x height x bands x bytes per band`` of ``im``'s current frame, from its header."""
    w, h = im.size
    return int(w) * int(h) * _bytes_per_pixel(im.mode)


def _stored(mode: str) -> int:
    """Bytes per pixel Pillow allocates for ``mode``: one for ``1`` / ``L`` / ``P``, two for
    16-bit grey, four for the rest (``RGB`` is stored as four bytes, ``LA`` too)."""
    return 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4


def _orientation(im: Image.Image) -> int:
    """The EXIF orientation, without decoding: ``getexif()`` of a PNG not yet loaded would
    decode the pixels to look for an eXIf chunk after them (decode_image checks again after
    loading)."""
    try:
        if getattr(im, "tile", None):  # not decoded yet
            if "exif" in im.info:
                exif = Image.Exif()
                exif.load(im.info["exif"])
                return int(exif.get(_ORIENTATION, 1))
            tags = getattr(im, "tag_v2", None)  # TIFF
            return int(tags.get(_ORIENTATION, 1)) if tags is not None else 1
        return int(im.getexif().get(_ORIENTATION, 1))
    except Exception:  # an unreadable EXIF block is ignored by prepare_image too
        return 1


def decode_memory(im: Image.Image, mode: str | None = "RGB") -> int:
    """Peak bytes :func:`decode_image` allocates for ``im`` (opened, not yet decoded) with
    target ``mode``, from its header: the file's pixels as Pillow stores them (kept to the
    end), the decoder's own buffers (progressive JPEG coefficients, WebP's RGBA frame), then
    each step of :func:`prepare_image` with what is alive at its peak: the EXIF rotation (a
    second copy), the 8-bit scaling of ``I;16`` / ``I`` / ``F`` (the numpy copy of the
    pixels, ``tobytes``' joined copy, the 8-bit result and its image, the alpha of a grey
    ``transparency``), compositing onto white (RGBA of the image, the background and the
    result: 12 bytes a pixel) and the final conversion. Measured against the resident set of
    real decodes in tests/data/test_data_decode.py."""
    w, h = im.size
    n = int(w) * int(h)
    base = n * _stored(im.mode)
    fmt = (im.format or "").upper()
    extra = 0
    if fmt in ("JPEG", "MPO") and (im.info.get("progressive") or im.info.get("progression")):
        from PIL.JpegImagePlugin import get_sampling

        bands = len(im.getbands())  # samples per pixel: 3 at 4:4:4, 2 at 4:2:2, 1.5 at 4:2:0
        samples = {0: 3.0, 1: 2.0, 2: 1.5}.get(get_sampling(im), bands) if bands == 3 else bands
        extra = int(n * samples * 2)  # libjpeg keeps every DCT coefficient (16 bits) until the end
    elif fmt == "WEBP":
        extra = 16 * n  # libwebp's RGBA frame, its lossless transforms and the copy into Pillow
    peak = base + extra
    live, cur, cur_mode, has_alpha = base, 0, im.mode, _has_alpha(im)
    target = mode or ("L" if im.mode in _GREY_MODES else "RGB")
    if _orientation(im) in range(2, 9):
        cur = base
        live += cur
        peak = max(peak, live)
    if cur_mode in ("I", "F") or cur_mode.startswith("I;16"):
        item = 2 if cur_mode.startswith("I;16") else 4
        peak = max(peak, live + 2 * n * item)  # tobytes() joins its chunks: two copies at once
        grey_t = isinstance(im.info.get("transparency"), (int, float))
        # the numpy pixels, the 8-bit array and its image (+ a bool mask, the alpha and LA)
        peak = max(peak, live + n * item + 2 * n + (6 * n if grey_t else 0) + 5 * _BLOCK * 8)
        live -= cur
        cur, cur_mode, has_alpha = (4 * n, "LA", True) if grey_t else (2 * n, "L", False)
        live += cur
    if has_alpha:
        peak = max(peak, live + 12 * n)  # RGBA of the image, the white background, the result
        live += 4 * n - cur
        cur, cur_mode = 4 * n, "RGBA"
    if cur_mode != target:
        via_rgb = 4 * n if target == "L" and cur_mode not in ("1", "L", "P", "RGB", "RGBA", "RGBX", "LA") else 0
        peak = max(peak, live + via_rgb + _stored(target) * n)  # CMYK / YCbCr -> L go through RGB
    return peak


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_decoded_size(im: Image.Image, name: str, max_bytes: int | None = None,
                       max_aspect: float | None = MAX_ASPECT, mode: str | None = "RGB") -> None:
    """Raise :class:`ImageSizeError` naming ``name`` and the limit when decoding ``im`` (not
    yet decoded) into ``mode`` would take more than ``max_bytes`` of memory at its peak
    (:func:`decode_memory`; default limit: the cap) or its sides lie further apart than
    ``max_aspect``."""
    limit = decode_limit() if max_bytes is None else int(max_bytes)
    w, h = im.size
    if w < 1 or h < 1:
        raise ImageDecodeError(name, f"image of {w} x {h} pixels has no pixels")
    need = decode_memory(im, mode)
    if need > limit:
        what = im.mode + (", transparency" if "transparency" in im.info else "")
        raise ImageSizeError(
            name, f"image of {w} x {h} pixels ({what}) takes {_mib(need)} to decode, more than the limit "
                  f"of {_mib(limit)} ({limit:,} bytes)", limit_bytes=limit)
    if max_aspect is not None and max(w, h) > max_aspect * min(w, h):
        raise ImageSizeError(
            name, f"image of {w} x {h} pixels is too long and thin: its sides differ more than the "
                  f"limit of {max_aspect:g} : 1", max_aspect=max_aspect)


def _stretch(a: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """``lo``..``hi`` of a float array -> 0..255 (``hi <= lo``: 0)."""
    if hi <= lo:
        return np.zeros(a.shape, np.uint8)
    return np.round((a - lo) * (255.0 / (hi - lo))).astype(np.uint8)


def _by_rows(a: np.ndarray, fn) -> np.ndarray:
    """``fn`` applied to blocks of rows of ``a`` (about ``_BLOCK`` values each) into one uint8
    array: the wide temporaries (int64, float64) stay a few MiB whatever the image's size."""
    out = np.empty(a.shape, np.uint8)
    r = 0
    for block in _row_blocks(a):
        out[r:r + len(block)] = fn(block)
        r += len(block)
    return out


def _row_blocks(a: np.ndarray) -> list:
    step = max(1, _BLOCK // max(1, a.shape[1] if a.ndim > 1 else 1))
    return [a[r:r + step] for r in range(0, a.shape[0], step)]


def _finite(block: np.ndarray) -> np.ndarray:
    return np.nan_to_num(block.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)


def _to_8bit(im: Image.Image) -> Image.Image:
    """``I;16*`` / ``I`` / ``F`` -> ``L`` (or ``LA`` when a grey value is marked transparent),
    scaled as the module docstring says; other modes unchanged. Row block by row block."""
    if im.mode not in ("I", "F") and not im.mode.startswith("I;16"):
        return im
    a = np.asarray(im)
    if im.mode == "F":
        lo = min(float(_finite(b).min()) for b in _row_blocks(a))
        hi = max(float(_finite(b).max()) for b in _row_blocks(a))
        if lo >= 0 and hi <= 1:
            out = _by_rows(a, lambda b: np.round(_finite(b) * 255.0).astype(np.uint8))
        else:
            out = _by_rows(a, lambda b: _stretch(_finite(b), lo, hi))
    else:
        lo, hi = int(a.min()), int(a.max())
        if lo >= 0 and hi <= 65535:
            out = _by_rows(a, lambda b: ((b.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8))  # round(x / 257)
        else:
            out = _by_rows(a, lambda b: _stretch(b.astype(np.float64), float(lo), float(hi)))
    grey = Image.fromarray(out, "L")
    t = im.info.get("transparency")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        alpha = Image.fromarray(_by_rows(a, lambda b: np.where(b == t, 0, 255).astype(np.uint8)), "L")
        grey = Image.merge("LA", (grey, alpha))
    return grey


def _has_alpha(im: Image.Image) -> bool:
    return im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info


def prepare_image(im: Image.Image, mode: str | None = "RGB", name: str = "image", *,
                  copy: bool = True) -> Image.Image:
    """Steps 3-6 of :func:`decode_image` on a decoded PIL image: EXIF orientation, 8 bits,
    transparency onto white, ``mode``. ``im`` is not changed; with ``copy=False`` an image
    that needs no change is returned as it is (idempotent: a prepared image needs none)."""
    if mode not in ("RGB", "L", None):
        raise ValueError(f"mode must be 'RGB', 'L' or None, got {mode!r}")
    target = mode or ("L" if im.mode in _GREY_MODES else "RGB")
    original = im
    try:
        try:
            if im.getexif().get(_ORIENTATION, 1) in range(2, 9):  # 1: stored upright
                im = ImageOps.exif_transpose(im)
        except (SyntaxError, ValueError, TypeError, KeyError, OSError, IndexError):
            pass  # an unreadable EXIF block: keep the pixels as stored
        im = _to_8bit(im)
        if _has_alpha(im):
            rgba = im.convert("RGBA")
            im = Image.alpha_composite(Image.new("RGBA", rgba.size, BACKGROUND + (255,)), rgba)
            del rgba  # before the conversion below (decode_memory counts on it)
        if im.mode != target:
            im = im.convert(target)
        if im is original and copy:  # a file's image dies when the file is closed
            im = im.copy()
    except Exception as exc:  # Pillow raises many types for modes it cannot convert
        raise ImageDecodeError(name, f"cannot convert a {original.mode} image to {target} ({exc})") from None
    return im


def _open(source) -> Image.Image:
    """``Image.open`` of the :data:`FORMATS`, header only, without Pillow's own pixel limit: a
    header over twice ``Image.MAX_IMAGE_PIXELS`` (a PNG claiming 30000 x 30000 pixels) raised
    Pillow's ``DecompressionBombError`` before :func:`check_decoded_size` could answer with the
    memory it takes and the limit. Nothing is decoded here, and the caller checks the memory from
    this header before decoding, so the guarantee is deepmetric's limit, whatever Pillow's global
    is (which is left as it is: other threads and libraries keep it)."""
    try:
        return Image.open(source, formats=FORMATS)
    except Image.DecompressionBombError:
        pass
    own = not hasattr(source, "read")  # a path: the file is opened here, and closed with the image
    fp = open(source, "rb") if own else source
    try:
        fp.seek(0)
        prefix = fp.read(16)
        for fmt in FORMATS:  # Image.open's own order and test (its plugins are registered by now)
            factory, accept = Image.OPEN[fmt]
            result = not accept or accept(prefix)
            if result and not isinstance(result, str):  # a str: Pillow's "support not installed"
                fp.seek(0)
                im = factory(fp, os.fspath(source) if own else "")
                im._exclusive_fp = own
                return im
    except BaseException:
        if own:
            fp.close()
        raise
    if own:
        fp.close()
    raise UnidentifiedImageError(f"cannot identify image file {source!r}")  # unreachable: Pillow knew its format


def decode_image(source, *, name: str | None = None, mode: str | None = "RGB",
                 max_bytes: int | None = None, max_aspect: float | None = MAX_ASPECT) -> Image.Image:
    """Decode an image file (path) or upload (``bytes``) into an 8-bit ``mode`` PIL image, as
    the module docstring says. ``name`` names the image in errors (default: the path, or
    ``"upload"``); ``max_bytes``: the decoded-size limit (default: the
    :data:`DEFAULT_MAX_DECODE_MB` cap; :func:`decode_limit` derives one from the model)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        label = name or "upload"
        data = bytes(source)
        if not data:
            raise ImageDecodeError(label, "empty file, expected an image (PNG, JPEG, ...)")
        opened = io.BytesIO(data)
    else:
        p = Path(os.fspath(source)).expanduser()
        label = name or str(p)
        if p.is_dir():
            raise IsADirectoryError(f"{label}: is a folder, expected an image file")
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"image not found: {label}") from None
        except OSError as exc:
            raise ImageDecodeError(label, f"cannot read the file ({exc.strerror or exc})") from None
        if size == 0:
            raise ImageDecodeError(label, "empty file, expected an image (PNG, JPEG, ...)")
        opened = p
    try:
        with _open(opened) as im:
            check_decoded_size(im, label, max_bytes, max_aspect, mode)
            im.load()
            check_decoded_size(im, label, max_bytes, max_aspect, mode)  # EXIF / tRNS read after the pixels
            # no copy: the decoded pixels outlive the file (closing it closes only the file)
            return prepare_image(im, mode, label, copy=False)
    except ImageDecodeError:
        raise
    except UnidentifiedImageError:
        raise ImageDecodeError(label, "not an image (the file is not in a format deepmetric reads: PNG, JPEG, "
                                      "WebP, GIF, BMP, TIFF, PPM)") from None
    except Image.DecompressionBombError as exc:
        raise ImageSizeError(label, f"image over Pillow's decompression-bomb limit ({exc})",
                             limit_bytes=max_bytes) from None
    except FileNotFoundError:
        raise FileNotFoundError(f"image not found: {label}") from None
    except MemoryError:
        raise ImageSizeError(label, "out of memory while decoding the image", limit_bytes=max_bytes) from None
    except Exception as exc:  # OSError (truncated), SyntaxError, struct.error, ... from the plugins
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageDecodeError(label, f"not an image that can be decoded ({reason})") from None

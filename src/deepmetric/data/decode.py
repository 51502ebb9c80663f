"""One image decoder for every place deepmetric reads an image: training datasets (folder,
CSV, benchmarks), ``embed``, ``index``, ``search``, ``serve`` (uploads and thumbnails) and
frame folders of video events.

:func:`decode_image` turns a file or the bytes of an upload into an 8-bit ``RGB`` or ``L``
PIL image, the same way everywhere:

1. the header is read and the **decoded size is checked before anything is decoded**:
   ``width x height x bands x bytes per band`` of the file's mode (a 155 KB PNG can claim
   1 x 40,000,000 pixels) against ``max_bytes`` (see :func:`decode_limit`), and the ratio of
   the long to the short side against ``max_aspect`` (long thin images blow up when the short
   side is resized to the model's input);
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

__all__ = ["decode_image", "prepare_image", "decode_limit", "decoded_bytes", "check_decoded_size",
           "ImageDecodeError", "ImageSizeError", "BACKGROUND", "DEFAULT_MAX_DECODE_MB",
           "MIN_DECODE_MB", "BYTES_PER_INPUT_PIXEL", "MAX_ASPECT"]

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


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_decoded_size(im: Image.Image, name: str, max_bytes: int | None = None,
                       max_aspect: float | None = MAX_ASPECT) -> None:
    """Raise :class:`ImageSizeError` naming ``name`` and the limit when the header of ``im``
    (not yet decoded) claims more than ``max_bytes`` decoded bytes (default: the cap) or
    sides further apart than ``max_aspect``."""
    limit = decode_limit() if max_bytes is None else int(max_bytes)
    w, h = im.size
    if w < 1 or h < 1:
        raise ImageDecodeError(name, f"image of {w} x {h} pixels has no pixels")
    need = decoded_bytes(im)
    if need > limit:
        raise ImageSizeError(
            name, f"image of {w} x {h} pixels ({im.mode}) decodes to {_mib(need)}, more than the limit "
                  f"of {_mib(limit)} ({limit:,} bytes)", limit_bytes=limit)
    if max_aspect is not None and max(w, h) > max_aspect * min(w, h):
        raise ImageSizeError(
            name, f"image of {w} x {h} pixels is too long and thin: its sides differ more than the "
                  f"limit of {max_aspect:g} : 1", max_aspect=max_aspect)


def _stretch(a: np.ndarray) -> np.ndarray:
    """Minimum..maximum of a float array -> 0..255 (a constant image -> 0)."""
    lo, hi = float(a.min()), float(a.max())
    if hi <= lo:
        return np.zeros(a.shape, np.uint8)
    return np.round((a - lo) * (255.0 / (hi - lo))).astype(np.uint8)


def _to_8bit(im: Image.Image) -> Image.Image:
    """``I;16*`` / ``I`` / ``F`` -> ``L`` (or ``LA`` when a grey value is marked transparent),
    scaled as the module docstring says; other modes unchanged."""
    if im.mode not in ("I", "F") and not im.mode.startswith("I;16"):
        return im
    a = np.asarray(im)
    if im.mode == "F":
        f = np.nan_to_num(a.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        out = (np.round(f * 255.0).astype(np.uint8) if f.size and f.min() >= 0 and f.max() <= 1
               else _stretch(f))
    else:
        x = a.astype(np.int64)
        if x.size and x.min() >= 0 and x.max() <= 65535:
            out = ((x * 255 + 32767) // 65535).astype(np.uint8)  # round(x / 257)
        else:
            out = _stretch(x.astype(np.float64))
    grey = Image.fromarray(out, "L")
    t = im.info.get("transparency")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        alpha = Image.fromarray(np.where(a == t, 0, 255).astype(np.uint8), "L")
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
        if im.mode != target:
            im = im.convert(target)
        if im is original and copy:  # a file's image dies when the file is closed
            im = im.copy()
    except Exception as exc:  # Pillow raises many types for modes it cannot convert
        raise ImageDecodeError(name, f"cannot convert a {original.mode} image to {target} ({exc})") from None
    return im


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
        with Image.open(opened) as im:
            check_decoded_size(im, label, max_bytes, max_aspect)
            im.load()
            return prepare_image(im, mode, label)
    except ImageDecodeError:
        raise
    except UnidentifiedImageError:
        raise ImageDecodeError(label, "not an image (the file is not in a format Pillow reads: PNG, JPEG, "
                                      "WebP, BMP, GIF, TIFF, ...)") from None
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

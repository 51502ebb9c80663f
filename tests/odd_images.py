"""A corpus of odd images built in the tests, for the decoder and the server: every PIL mode
that files carry (1-bit, palette with transparency, LA, 16-bit, 32-bit int, float, CMYK), the
eight EXIF orientations, an animated GIF, truncated and empty files, and long thin
"decompression bombs" written chunk by chunk (a 1 x 40,000,000 PNG is 40 KB on disk).
"""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

W, H = 48, 32  # not square, so a rotation changes the size


def upright_rgb(w: int = W, h: int = H) -> np.ndarray:
    """An asymmetric RGB picture [h, w, 3] uint8: horizontal and vertical ramps, a block in the
    top-left corner (every flip or rotation of it is another array)."""
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x + 2 * y) % 256], axis=-1).astype(np.uint8)
    a[2:8, 3:15] = (250, 250, 20)
    return a


def png_bytes(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


# EXIF orientation (TIFF / EXIF 2.3 tag 274): where the stored image's row 0 and column 0 lie
# in the picture as it should be seen. ``stored_for(o, upright)`` builds the stored pixels from
# that table with index arithmetic, independently of Pillow's transposes.
def stored_for(orientation: int, up: np.ndarray) -> np.ndarray:
    h, w = up.shape[:2]
    if orientation in (1, 2, 3, 4):
        r, c = np.mgrid[0:h, 0:w]          # stored [r, c], same size as the picture
        src = {1: (r, c), 2: (r, w - 1 - c), 3: (h - 1 - r, w - 1 - c), 4: (h - 1 - r, c)}[orientation]
    else:
        r, c = np.mgrid[0:w, 0:h]          # stored is the picture's transpose in size
        # 5: row 0 = left side, column 0 = top;   6: row 0 = right side, column 0 = top
        # 7: row 0 = right side, column 0 = bottom; 8: row 0 = left side, column 0 = bottom
        src = {5: (c, r), 6: (c, w - 1 - r), 7: (h - 1 - c, w - 1 - r), 8: (h - 1 - c, r)}[orientation]
    return up[src[0], src[1]]


def exif_image(orientation: int, up: np.ndarray, fmt: str = "PNG") -> bytes:
    im = Image.fromarray(stored_for(orientation, up), "RGB")
    exif = Image.Exif()
    exif[274] = orientation
    return png_bytes(im, fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def long_thin_png(width: int, height: int, colour_type: int = 0) -> bytes:
    """A valid 8-bit PNG of ``width`` x ``height`` zeros (colour type 0: grey, 2: RGB), built
    row by row with a streaming compressor, so a 1 x 40,000,000 image costs kilobytes."""
    channels = {0: 1, 2: 3}[colour_type]
    ihdr = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    comp = zlib.compressobj(9)
    total = (1 + width * channels) * height  # a filter byte (0) and the samples per row: all zeros
    block = b"\x00" * min(total, 1 << 22)
    parts = []
    for a in range(0, total, len(block)):
        parts.append(comp.compress(block[:min(len(block), total - a)]))
    parts.append(comp.flush())
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", b"".join(parts))
            + _chunk(b"IEND", b""))


def small_bomb_png(side: int, kind: str) -> bytes:
    """A ``side`` x ``side`` PNG of zeros that is small on disk and under a header-only size
    check but costly to decode (issue 32): ``"palette"`` (colour type 3 with a transparent
    palette entry: 1 byte a pixel in the header, 13 at the decode's peak) or ``"grey16"``
    (16-bit grey, widened on its way to 8 bits)."""
    depth, colour, channels_bytes = {"palette": (8, 3, 1), "grey16": (16, 0, 2)}[kind]
    ihdr = struct.pack(">IIBBBBB", side, side, depth, colour, 0, 0, 0)
    comp = zlib.compressobj(6)
    row = b"\x00" * (1 + side * channels_bytes)
    rows = max(1, (1 << 22) // len(row))
    parts = [comp.compress(row * min(rows, side - a)) for a in range(0, side, rows)]
    parts.append(comp.flush())
    extra = (_chunk(b"PLTE", bytes(range(256)) * 3) + _chunk(b"tRNS", b"\x00" + b"\xff" * 255)
             if kind == "palette" else b"")
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + extra + _chunk(b"IDAT", b"".join(parts))
            + _chunk(b"IEND", b""))


def corpus() -> dict[str, tuple[bytes, np.ndarray | None, str]]:
    """name -> (file bytes, expected decoded RGB array or None, note)."""
    up = upright_rgb()
    grey = np.asarray(Image.fromarray(up).convert("L"))
    out: dict = {}
    out["rgb.png"] = (png_bytes(Image.fromarray(up)), up, "plain 8-bit RGB")
    bw = np.where(grey >= 128, 255, 0).astype(np.uint8)
    out["1bit.png"] = (png_bytes(Image.fromarray(bw).convert("1")), np.repeat(bw[..., None], 3, 2), "1-bit")
    # palette: index 0 transparent (shown white), the others opaque colours
    idx = (np.arange(W)[None, :] // 12 + np.zeros((H, 1), int)).astype(np.uint8)  # 4 stripes
    pal = Image.fromarray(idx, "P")
    colours = [(10, 20, 30), (200, 0, 0), (0, 200, 0), (0, 0, 200)]
    pal.putpalette([v for c in colours for v in c] + [0] * (768 - 12))
    want = np.array(colours, np.uint8)[idx]
    want[idx == 0] = 255
    out["palette_transparent.png"] = (png_bytes(pal, transparency=0), want, "P with transparency index 0")
    # LA: grey with a horizontal alpha ramp, composited onto white
    alpha = np.tile(np.linspace(0, 255, W).round().astype(np.uint8), (H, 1))
    la = Image.merge("LA", (Image.fromarray(grey), Image.fromarray(alpha)))
    comp = np.round((grey.astype(np.float64) * alpha + 255.0 * (255 - alpha)) / 255).astype(np.uint8)
    out["la.png"] = (png_bytes(la), np.repeat(comp[..., None], 3, 2), "grey + alpha onto white")
    g16 = grey.astype(np.uint16) * 257  # the same picture in 16 bits (v * 257 is v / 255 of 65535)
    out["grey16.png"] = (png_bytes(Image.fromarray(g16)), np.repeat(grey[..., None], 3, 2), "I;16 PNG")
    out["int32.tif"] = (png_bytes(Image.fromarray(g16.astype(np.int32)), "TIFF"),
                        np.repeat(grey[..., None], 3, 2), "32-bit int holding 16-bit samples")
    out["float01.tif"] = (png_bytes(Image.fromarray(grey.astype(np.float32) / 255), "TIFF"),
                          np.repeat(grey[..., None], 3, 2), "float in [0, 1]")
    cmyk = Image.fromarray(up).convert("CMYK")
    out["cmyk.tif"] = (png_bytes(cmyk, "TIFF"), np.asarray(cmyk.convert("RGB")), "CMYK")
    frames = [Image.new("RGB", (W, H), (200, 30, 30)), Image.new("RGB", (W, H), (30, 30, 200))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    out["animated.gif"] = (buf.getvalue(), np.full((H, W, 3), (200, 30, 30), np.uint8), "first frame")
    for o in range(1, 9):
        out[f"exif{o}.png"] = (exif_image(o, up), up, f"EXIF orientation {o}")
    return out

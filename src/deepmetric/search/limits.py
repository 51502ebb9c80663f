"""The request limits of ``deepmetric serve``: its defaults and the checks on them, what a request
may ask for (``k``, a thumbnail's size), the upload bound's message, and the counted resources a
request takes: search and thumbnail slots, and the thumbnail cache bounded in bytes.

Connection limits (header timeout, open connections) are in :mod:`deepmetric.search.connections`;
the decode limit is the model's (:meth:`Preprocessing.decode_limit`, capped by ``max_decode_mb``).
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict

__all__ = ["DEFAULT_MAX_UPLOAD_MB", "DEFAULT_WORKERS", "DEFAULT_MAX_IN_FLIGHT", "DEFAULT_TIMEOUT_S", "MAX_K",
           "THUMB_IN_FLIGHT", "THUMB_CACHE_BYTES", "check_options", "too_large_message", "read_k",
           "read_thumb_size", "Slots", "ThumbnailCache"]

DEFAULT_MAX_UPLOAD_MB = 10.0
DEFAULT_WORKERS = 2
DEFAULT_MAX_IN_FLIGHT = 8
DEFAULT_TIMEOUT_S = 30.0
MAX_K = 100
THUMB_IN_FLIGHT = 64  # thumbnails of indexed images: a page shows up to 100 of them
#: bytes of thumbnail PNGs kept in memory (least recently used out first)
THUMB_CACHE_BYTES = 32 * 2**20


def check_options(count: int, *, max_upload_mb: float, workers: int, max_in_flight: int, timeout_s: float,
                  default_k: int) -> None:
    """Refuse (ValueError) a server's limits that cannot work over an index of ``count`` images."""
    if not max_upload_mb > 0:
        raise ValueError(f"max_upload_mb must be > 0, got {max_upload_mb}")
    for name, v in (("workers", workers), ("max_in_flight", max_in_flight)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not 1 <= int(default_k) <= min(MAX_K, count):
        raise ValueError(f"--k {default_k}: the default number of neighbours must lie in 1..{min(MAX_K, count)} "
                         f"(the index holds {count} images; searches take at most {MAX_K})")


def too_large_message(limit: int) -> str:
    """The answer to an upload over ``limit`` bytes (413)."""
    return f"upload larger than the limit of {limit} bytes ({limit / 2**20:.1f} MiB)"


def read_k(raw: str) -> int:
    """The number of neighbours a search asks for; ValueError (an answer 400) naming the range
    1..MAX_K when it is an integer outside it (``-1``, ``0``, ``100000``) or not an integer."""
    if not re.fullmatch(r"[+-]?[0-9]+", raw):  # ASCII digits only: int("²") fails
        raise ValueError(f"k must be an integer in 1..{MAX_K}, got {raw[:20]!r}")
    if len(raw) > 6 or not 1 <= int(raw) <= MAX_K:  # however many digits: never int() of a huge string
        raise ValueError(f"k must lie in 1..{MAX_K}, got {raw[:20]}")
    return int(raw)


def read_thumb_size(raw: str) -> int:
    """A thumbnail's side in pixels; ValueError (an answer 400) outside 16..512."""
    if not re.fullmatch(r"[0-9]{1,3}", raw) or not 16 <= int(raw) <= 512:
        raise ValueError("size must be an integer in 16..512")
    return int(raw)


class Slots:
    """A count of accepted requests with a cap; released from any thread."""

    def __init__(self, cap: int):
        self.cap, self.used = int(cap), 0
        self._lock = threading.Lock()

    def try_acquire(self) -> bool:
        with self._lock:
            if self.used >= self.cap:
                return False
            self.used += 1
            return True

    def release(self, *_):
        with self._lock:
            self.used -= 1


class ThumbnailCache(OrderedDict):
    """Thumbnail PNGs by ``(generation, row, size)``, least recently used first, at most
    :data:`THUMB_CACHE_BYTES` bytes in all (``bytes``: what it holds now)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def recall(self, key) -> bytes | None:
        """The cached PNG (now the most recently used), or None."""
        png = self.get(key)
        if png is not None:
            self.move_to_end(key)
        return png

    def keep(self, key, png: bytes) -> None:
        """Cache ``png`` (unless it alone is over the bound), then drop the least recently used
        until the cache is within its bound."""
        if key not in self and len(png) <= THUMB_CACHE_BYTES:
            self[key] = png
            self.bytes += len(png)
        while self.bytes > THUMB_CACHE_BYTES:
            self.bytes -= len(self.popitem(last=False)[1])

    def keep_generation(self, generation: int) -> None:
        """Drop the thumbnails of every index but the one loaded as ``generation``."""
        for key in [key for key in self if key[0] != generation]:
            self.bytes -= len(self.pop(key))

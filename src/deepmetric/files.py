"""What a file's first bytes say it is (bottom layer: imports nothing), for the messages that name a
file given in the wrong place: a config saved as weights, a note given as embeddings."""
from __future__ import annotations

__all__ = ["HEAD_BYTES", "text_start"]

HEAD_BYTES = 512  # enough to tell text from a binary format; every caller reads this many


def text_start(head: bytes) -> str | None:
    """The first line of ``head`` (a file's first :data:`HEAD_BYTES` bytes, or the whole of a shorter
    file) when it reads as text, stripped ("" for a file of blanks); None for binary data: a NUL
    byte, or bytes that are not UTF-8. A character cut by the end of a full ``head`` is not
    counted against it; in a shorter file (the whole file was read) it is."""
    if b"\x00" in head:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.reason != "unexpected end of data" or len(head) < HEAD_BYTES:  # not a cut character
            return None
        text = head[:err.start].decode("utf-8")
    return text.strip().splitlines()[0] if text.strip() else ""

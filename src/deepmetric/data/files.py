"""Reading whole files: the one streaming hash of a file (install integrity of the emoji packages,
checkpoints compared by content, the SHA-256s of an index's files)."""
from __future__ import annotations

import hashlib
import os

__all__ = ["file_digest"]


def file_digest(path: str | os.PathLike, algorithm: str = "sha256"):
    """The ``hashlib`` object of ``path``'s bytes, read in 1 MiB blocks (never the whole file in
    memory): ``.hexdigest()`` / ``.digest()`` as the caller needs."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h

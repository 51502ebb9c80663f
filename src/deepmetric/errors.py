"""Errors every layer may raise and the CLI turns into one line (bottom layer: imports nothing)."""
from __future__ import annotations

__all__ = ["MissingPackageError"]


class MissingPackageError(ImportError):
    """An optional package a feature needs is not installed; the message names the feature and
    its ``pip install`` command.  ``deepmetric`` prints it as one line (exit 2); any other
    ImportError is a bug of ours and keeps its traceback."""

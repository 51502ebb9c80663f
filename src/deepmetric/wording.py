"""Words every layer's messages share (bottom layer: imports nothing): a count with its noun."""
from __future__ import annotations

__all__ = ["counted"]


def counted(n: int, one: str, many: str | None = None) -> str:
    """``1 image``, ``3 images`` (``many``: the plural when it is not ``one + 's'``: ``classes``)."""
    return f"{n} {one if n == 1 else (many or one + 's')}"

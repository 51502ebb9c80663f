"""Checks of option values (bottom layer: every package may import it), so that a wrong value
in ``model.options`` or a loss's keyword is one ``ValueError`` naming the option, the value and
what was expected (and never a silent ``int(2.5) == 2`` / ``bool("false") is True``, nor torch's
or Python's error about some operand deep inside a constructor); and the type hints of a
constructor's options (:func:`option_hints`), against which ``run.config_checks`` checks the
options of a config's losses, dataset and transform."""
from __future__ import annotations

import numbers
import typing
from collections.abc import Callable
from typing import Any

__all__ = ["int_option", "float_option", "bool_option", "option_hints"]


def int_option(name: str, value, minimum: int = 1, expected: str | None = None) -> int:
    """``value`` as an int >= ``minimum``: an int (numpy integers too), never a bool, a float
    or a string of digits.  ``expected`` words the allowed values in the error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        expected = expected or ("a positive int" if minimum == 1 else f"an int >= {minimum}")
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def float_option(name: str, value, low: float, high: float, *, low_open: bool = False,
                 high_open: bool = True) -> float:
    """``value`` as a float in the interval from ``low`` to ``high`` (open at the ends said)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        v = float(value)
        ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


def bool_option(name: str, value) -> bool:
    """``value`` if it is true or false: a string such as ``"false"`` would otherwise count as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def option_hints(fn: Callable) -> dict[str, Any]:
    """The type hints of ``fn``'s parameters (a class: its constructor's), ``return`` left out;
    ``{}`` when they do not resolve (nothing to check a value against)."""
    try:
        hints = typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
    except Exception:  # noqa: BLE001 - any failure to evaluate a hint means: no hints
        return {}
    hints.pop("return", None)
    return hints

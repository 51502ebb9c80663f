"""From YAML values to the typed schema: every key of a mapping checked against the fields of
its dataclass (an unknown key names the closest valid one) and every value against its type
hint (``int``, ``float`` from a numeric string, ``Literal`` choices, ``list[...]``, unions with
null), each error a ``ConfigError`` naming the full config key."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from deepmetric.registry import did_you_mean

from .config import ConfigError, config_to_dict

__all__ = ["build_dataclass", "describe_value", "convert_value", "convertible"]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(arg)}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def describe_value(value: Any) -> str:
    """``type repr`` of a config value for a message, the repr cut at 60 characters."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def convert_value(value: Any, tp: Any, path: str) -> Any:
    """``value`` checked against the type hint ``tp`` (:func:`convertible`) as a config key's value is:
    the typed value, or a ``ConfigError`` naming ``path``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"config key '{path}': expected {_type_name(tp)}, got null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert_value(value, arg, path)
            except ConfigError as exc:
                errors.append(exc)
        # A single non-null alternative: its own message is the most precise.
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"config key '{path}': expected {_type_name(tp)}, got {describe_value(value)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            hint = did_you_mean(value, [str(a) for a in allowed])
            raise ConfigError(
                f"config key '{path}': expected {_type_name(tp)}, got {value!r}{hint}"
            )
        return value
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{path}': expected {_type_name(tp)}, got {describe_value(value)}")
        return [convert_value(v, arg, f"{path}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{path}': expected a mapping, got {describe_value(value)}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{path}': expected bool (true/false), got {describe_value(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"config key '{path}': expected int, got {describe_value(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads '1e-3' (no dot) as a string; accept numeric strings.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"config key '{path}': expected float, got {describe_value(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{path}': expected str, got {describe_value(value)}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at '{path}'")  # programming error


def convertible(tp: Any) -> bool:
    """Whether :func:`convert_value` can check the type hint ``tp`` (the config's own types:
    bool, int, float, str, ``Literal``, lists and unions of them, null); a hint such as a tensor
    or a ``Sequence`` cannot be."""
    if tp in (bool, int, float, str, type(None), Any):
        return True
    origin = typing.get_origin(tp)
    if origin is Literal:
        return True
    if origin in (Union, types.UnionType, list):
        return all(convertible(a) for a in typing.get_args(tp))
    return False


def build_dataclass(cls: type, value: Any, path: str) -> Any:
    """The dataclass ``cls`` from the mapping ``value`` at config key ``path`` ("" at the top):
    an unknown key names the closest valid one, every value is checked against its type hint."""
    if value is None:
        value = {}
    if dataclasses.is_dataclass(value) and isinstance(value, cls):
        value = config_to_dict(value)
    if not isinstance(value, dict):
        where = f"config key '{path}'" if path else "config"
        raise ConfigError(f"{where}: expected a mapping, got {describe_value(value)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, val in value.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            hint = (did_you_mean(key, names, prefix=f"{path}." if path else "", cutoff=0.5)
                    or f"; valid keys{' of ' + repr(path) if path else ''}: {', '.join(names)}")
            raise ConfigError(f"unknown config key '{full}'{hint}")
        kwargs[key] = convert_value(val, hints[key], full)
    return cls(**kwargs)


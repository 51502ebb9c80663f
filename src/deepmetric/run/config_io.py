"""Reading, writing and overriding configs: ``load_config(path, overrides)`` (the YAML file,
then ``key.sub=value`` overrides, then validation), ``config_from_dict`` for a mapping already
read (a checkpoint's, a study's), ``save_config``, and the flat ``dotted.key`` view used by the
trackers and by ``config_diff``.  :func:`read_yaml_mapping` is the one YAML file reader of
deepmetric (recipes, study files, tune spaces)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from .config import Config, ConfigError, LossTermConfig, config_to_dict
from .config_checks import check_values
from .config_types import build_dataclass

__all__ = ["config_from_dict", "config_diff", "flatten_config", "apply_overrides", "parse_override", "load_config",
           "read_yaml_mapping", "save_config"]


def config_from_dict(raw: dict | None) -> Config:
    """Validate a plain mapping (as read from YAML) into a ``Config``."""
    raw = dict(raw or {})
    if isinstance(raw.get("loss"), dict):  # one term may be written without the list
        raw["loss"] = [raw["loss"]]
    cfg = build_dataclass(Config, raw, "")
    check_values(cfg)
    return cfg


def _flatten(value: Any, prefix: str, out: dict) -> dict:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):  # loss terms, parameter groups
            _flatten(v, f"{prefix}.{i}", out)
    else:
        out[prefix] = value
    return out


def flatten_config(cfg: Any) -> dict[str, Any]:
    """The configuration (``Config`` or plain dict) as ``{"dotted.key": value}``: mappings and
    lists of mappings (loss terms, parameter groups) are opened up, other lists stay values
    (``eval.ks``).  Trackers log these as hyperparameters."""
    return _flatten(config_to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg, "", {})


def config_diff(old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """The keys whose values differ between two configs (``Config`` or plain dicts), as
    ``(dotted.key, old value, new value)`` sorted by key; a key missing on one side has
    the value ``"<absent>"`` there."""
    a = _flatten(config_to_dict(old) if dataclasses.is_dataclass(old) else old, "", {})
    b = _flatten(config_to_dict(new) if dataclasses.is_dataclass(new) else new, "", {})
    missing = "<absent>"
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing)]


# --------------------------------------------------------------------------- overrides
def parse_override(text: str, flag: str = "override", example: str = "optim.lr=0.001") -> tuple[list[str], Any]:
    """``KEY=VALUE`` as the key's dotted parts and the value read as YAML (``true``, ``3``, ``[1, 2]``);
    a ``ConfigError`` naming ``flag`` and the text otherwise (``--set``, ``--data-option``)."""
    if "=" not in text:
        raise ConfigError(f"{flag} {text!r}: expected KEY=VALUE, e.g. {example}")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"{flag} {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:  # PyYAML's own text spans several lines (context, a caret): one line here
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        mark = getattr(exc, "problem_mark", None)
        at = "" if mark is None else (f" at character {mark.column + 1} of the value" if mark.column < len(raw)
                                      else " at the end of the value")
        raise ConfigError(f"{flag} {text!r}: the value is not valid YAML ({problem}{at})") from None
    return key.split("."), value


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...] | None) -> dict:
    """Apply ``a.b.c=value`` overrides to a raw config mapping (in place) and return it.

    Integer path parts index lists (``loss.0.weight=2``).  Unknown keys are created here and
    then rejected, with a suggestion, by validation.
    """
    for text in overrides or ():
        parts, value = parse_override(text)
        node: Any = raw
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                node = node[_list_index(node, part, where, text)]
                continue
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(parts[:depth])}' is not a mapping")
            if node.get(part) is None:
                node[part] = [] if part == "loss" else {}
                if part == "loss":
                    node[part] = [dict(config_to_dict(LossTermConfig()))]
            node = node[part]
        last = parts[-1]
        if isinstance(node, list):
            node[_list_index(node, last, text, text)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"override {text!r}: '{'.'.join(parts[:-1])}' is not a mapping")
    return raw


def _list_index(node: list, part: str, where: str, text: str) -> int:
    try:
        i = int(part)
    except ValueError:
        raise ConfigError(f"override {text!r}: '{where}' indexes a list; use an integer") from None
    if not -len(node) <= i < len(node):
        raise ConfigError(f"override {text!r}: index {i} out of range (list has {len(node)} items)")
    return i


# --------------------------------------------------------------------------- files
def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict:
    """A YAML file whose top level is a mapping (an empty file reads as ``{}``); a missing file
    is a ``FileNotFoundError`` and bad YAML or another top level a ``ConfigError``, each naming
    the file (the recipes, study files and tune spaces are all read here)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {p}: invalid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {p}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or start from defaults when ``path`` is None), apply overrides,
    validate, and return the ``Config``."""
    raw: dict = {}
    if path is not None:
        raw = read_yaml_mapping(path)
    apply_overrides(raw, overrides)
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        if path is not None:
            raise ConfigError(f"{path}: {exc}") from None
        raise


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved configuration as YAML (keys in dataclass order)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None))
    return p


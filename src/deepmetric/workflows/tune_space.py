"""The space file of ``deepmetric tune`` (its format: :mod:`deepmetric.workflows.tune`):
the parameters, their ranges and the objective, read and checked before any trial."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepmetric.run.config import ConfigError

from deepmetric.run.config_io import read_yaml_mapping


PRUNERS = ("median", "successive_halving", "none")
SAMPLERS = ("tpe", "random")
_SPACE_KEYS = ("objective", "params", "pruner", "sampler", "overrides")


class TuneError(ValueError):
    """A tune cannot start: the recipe, the space or the directory is not usable as given."""


# --------------------------------------------------------------------------- the space file
@dataclass
class ParamSpec:
    """One searched parameter: ``name`` (the Optuna parameter), the config ``keys`` it sets."""

    name: str
    keys: list[str]
    type: str                       # float | int | categorical
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Any] = field(default_factory=list)

    def suggest(self, trial) -> Any:
        if self.type == "float":
            return trial.suggest_float(self.name, self.low, self.high, log=self.log, step=self.step)
        if self.type == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log,
                                     step=int(self.step or 1))
        # Optuna's categorical choices must be None / bool / int / float / str: list choices
        # (several keys at once) are searched by their text and mapped back.
        labels = [self._label(c) for c in self.choices]
        return self.choices[labels.index(trial.suggest_categorical(self.name, labels))]

    def _label(self, choice: Any) -> Any:
        return "x".join(str(c) for c in choice) if isinstance(choice, list) else choice

    def value_of(self, params: dict) -> Any:
        """The config value(s) of a finished trial's Optuna ``params``."""
        v = params[self.name]
        if self.type == "categorical":
            labels = [self._label(c) for c in self.choices]
            return self.choices[labels.index(v)] if v in labels else v
        return v

    def overrides(self, value: Any) -> list[str]:
        values = value if len(self.keys) > 1 else [value]
        return [f"{k}={json.dumps(v)}" for k, v in zip(self.keys, values)]

    def examples(self) -> list[Any]:
        """Values that span the range (both ends, every choice): each is validated up front."""
        if self.type == "categorical":
            return list(self.choices)
        return [int(self.low), int(self.high)] if self.type == "int" else [self.low, self.high]


@dataclass
class SearchSpace:
    metric: str
    direction: str
    params: list[ParamSpec]
    pruner: dict
    sampler: dict
    overrides: list[str]
    raw: dict

    def overrides_of(self, values: dict[str, Any]) -> list[str]:
        return [o for p in self.params for o in p.overrides(values[p.name])]


def _space_error(path, msg: str) -> TuneError:
    return TuneError(f"{path}: {msg}")


def _number(value: Any, where: str, path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        except (TypeError, ValueError):
            raise _space_error(path, f"{where}: expected a number, got {value!r}") from None
    if not math.isfinite(value):
        raise _space_error(path, f"{where}: expected a finite number, got {value!r}")
    return float(value)


_PLAIN = (str, int, float, bool, type(None))


def _check_choice(c: Any, where: str, path) -> None:
    """A choice is a plain YAML value (text, number, true/false, null) or, for a parameter that
    sets several keys or a list-valued key, a list of them (lists may nest); a mapping is not
    (Optuna stores choices by value, and a mapping has no stable one)."""
    def plain(v) -> bool:
        return isinstance(v, _PLAIN) or (isinstance(v, list) and all(plain(x) for x in v))

    if not plain(c):
        raise _space_error(path, f"{where}.choices: {c!r} is not a plain value (text, number, true/false or "
                                 "null) or a list of them (a mapping is not); to set several config keys at once list them "
                                 "under 'keys' and give each choice as a list of their values")
    if isinstance(c, float) and not math.isfinite(c):
        raise _space_error(path, f"{where}.choices: {c!r} is not a finite number")


def _param(name: str, spec: Any, path) -> ParamSpec:
    where = f"params.{name}"
    if not isinstance(spec, dict):
        raise _space_error(path, f"{where}: expected a mapping like {{type: float, low: 1.0e-4, high: 0.1}}, "
                                 f"got {spec!r}")
    allowed = {"type", "low", "high", "log", "step", "choices", "keys"}
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise _space_error(path, f"{where}: unknown field(s) {unknown}; a parameter has {sorted(allowed)}")
    kind = spec.get("type")
    if kind not in ("float", "int", "categorical"):
        raise _space_error(path, f"{where}.type: expected float, int or categorical, got {kind!r}")
    keys = spec.get("keys", [name])
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise _space_error(path, f"{where}.keys: expected a list of config keys, got {keys!r}")
    log = spec.get("log", False)
    if not isinstance(log, bool):  # bool("false") is True: a quoted false would tune on a log scale
        raise _space_error(path, f"{where}.log: expected true or false, got {log!r}")
    p = ParamSpec(name=name, keys=keys, type=kind, log=log)
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise _space_error(path, f"{where}.choices: a categorical parameter needs a non-empty list")
        for c in choices:
            _check_choice(c, where, path)
            if len(keys) > 1 and not (isinstance(c, list) and len(c) == len(keys)):
                raise _space_error(path, f"{where}.choices: each choice sets {len(keys)} keys {keys}, so it "
                                         f"must be a list of {len(keys)} values, got {c!r}")
        p.choices = choices
        return p
    if len(keys) > 1:
        raise _space_error(path, f"{where}: only a categorical parameter can set several keys")
    for end in ("low", "high"):
        if end not in spec:
            raise _space_error(path, f"{where}: a {kind} parameter needs 'low' and 'high'")
    p.low, p.high = _number(spec["low"], f"{where}.low", path), _number(spec["high"], f"{where}.high", path)
    if not p.low < p.high:
        raise _space_error(path, f"{where}: needs low < high, got low={p.low}, high={p.high}")
    if p.log and p.low <= 0:
        raise _space_error(path, f"{where}: a log scale needs low > 0, got {p.low}")
    if spec.get("step") is not None:
        p.step = _number(spec["step"], f"{where}.step", path)
        if p.step <= 0 or (kind == "int" and p.step != int(p.step)):
            raise _space_error(path, f"{where}.step: expected a {'whole number' if kind == 'int' else 'number'} "
                                     f"> 0, got {spec['step']!r}")
        if p.log:
            raise _space_error(path, f"{where}: give 'step' or 'log: true', not both (Optuna refuses both)")
    if kind == "int" and (p.low != int(p.low) or p.high != int(p.high)):
        raise _space_error(path, f"{where}: an int parameter needs whole-number bounds, got {p.low}, {p.high}")
    return p


def load_space(path: str | os.PathLike) -> SearchSpace:
    """Read and check a space file; a mistake is a :class:`TuneError` naming the file and key."""
    path = Path(path)
    try:
        raw = read_yaml_mapping(path, "space file")
    except (FileNotFoundError, ConfigError) as exc:
        raise TuneError(f"{exc} (a space file is a mapping with 'objective' and 'params')") from None
    unknown = sorted(set(raw) - set(_SPACE_KEYS))
    if unknown:
        raise _space_error(path, f"unknown key(s) {unknown}; a space file has {', '.join(_SPACE_KEYS)}")
    obj = raw.get("objective")
    if not isinstance(obj, dict) or not isinstance(obj.get("metric"), str):
        raise _space_error(path, "objective: expected {metric: <validation metric>, direction: maximize}")
    direction = obj.get("direction", "maximize")
    if direction not in ("maximize", "minimize"):
        raise _space_error(path, f"objective.direction: expected maximize or minimize, got {direction!r}")
    params = raw.get("params")
    if not isinstance(params, dict) or not params:
        raise _space_error(path, "params: expected a mapping NAME -> {type, ...} with at least one parameter")
    specs = [_param(str(n), s, path) for n, s in params.items()]
    seen: dict[str, str] = {}
    for p in specs:
        for k in p.keys:
            if k in seen:
                raise _space_error(path, f"params.{p.name}: config key {k!r} is also set by params.{seen[k]}")
            seen[k] = p.name
    pruner = _engine_part(raw, "pruner", "median", PRUNERS, path)
    sampler = _engine_part(raw, "sampler", "tpe", SAMPLERS, path)
    overrides = raw.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise _space_error(path, f"overrides: expected a list of KEY=VALUE strings, got {overrides!r}")
    return SearchSpace(metric=obj["metric"], direction=direction, params=specs, pruner=pruner, sampler=sampler,
                       overrides=list(overrides), raw=raw)


def _engine_part(raw: dict, key: str, default: str, names: tuple, path) -> dict:
    """The space's ``pruner`` / ``sampler``: ``{name, options...}`` (a bare name is accepted),
    its options checked by building it now: a typo found after tune.json was written locked the
    folder to the mistaken space."""
    part = raw.get(key) or {"name": default}
    if isinstance(part, str):
        part = {"name": part}
    if not isinstance(part, dict):
        raise _space_error(path, f"{key}: expected a mapping {{name: ..., options...}}, got {part!r}")
    part = dict(part)
    name = part.get("name", default)
    if name not in names:
        raise _space_error(path, f"{key}.name: expected one of {', '.join(names)}, got {name!r}")
    options = {k: v for k, v in part.items() if k != "name"}
    seed = options.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _space_error(path, f"{key}.seed: expected a whole number, got {seed!r}")
    try:
        engine_class(name)(**options)
    except (TypeError, ValueError) as exc:
        raise _space_error(path, f"{key}: {name} does not take these options ({exc})") from None
    return part


def engine_class(name: str):
    """The Optuna class of a pruner (``PRUNERS``) or sampler (``SAMPLERS``) name: the one table
    the space's check and the study it opens both read."""
    from .engine import optuna_module

    optuna = optuna_module()
    return {"median": optuna.pruners.MedianPruner, "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
            "none": optuna.pruners.NopPruner, "tpe": optuna.samplers.TPESampler,
            "random": optuna.samplers.RandomSampler}[name]


def format_value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


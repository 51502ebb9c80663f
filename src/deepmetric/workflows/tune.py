"""``deepmetric tune``: hyper-parameter search on validation classes, with Optuna.

::

    deepmetric tune RECIPE.yaml --space SPACE.yaml --trials N [--workers K] [--storage URL]
                    [--study-name NAME] [--out DIR] [KEY=VALUE ...]

A trial is one training run of ``RECIPE`` (plus the ``KEY=VALUE`` overrides and the space's
own ``overrides``) with the trial's values of the space's parameters.  The objective is a
*validation* metric (the recipe must carve validation classes, ``data.val_classes`` or
``data.val_folds``): at every validation evaluation the trial reports it, so the pruner can stop
a hopeless trial after its first evaluation, and the trial's value is the best value it reached
(the model ``best.pt`` keeps).  A trial never evaluates the test split (``eval.test: false``): no
test metric exists to reach the sampler, the pruner, the storage or any output (the writers also
drop any ``test``-named key they are given), so nothing can be chosen, even by a person reading
the tables, on the test split.  Evaluate the chosen recipe on test afterwards
(``deepmetric train OUT/best.yaml``).

The space file (YAML)::

    objective: {metric: recall@1, direction: maximize}    # a validation metric
    params:
      optim.lr: {type: float, low: 1.0e-4, high: 0.1, log: true}
      loss.0.options.alpha: {type: categorical, choices: [8.0, 16.0, 32.0]}
      schedule.temperature.at: {type: int, low: 2, high: 5}
      batch: {type: categorical, keys: [train.m, train.n], choices: [[16, 4], [32, 2]]}
    pruner: {name: median}          # median | successive_halving | none, with Optuna's options
    sampler: {name: tpe, seed: 0}   # tpe | random
    overrides: [eval.every=1]       # applied to every trial (before the parameters)

A parameter is named by the config key it sets, or is any name with ``keys``: the list of config
keys one categorical choice sets together (``m x n`` above).

Storage: an SQLite file in the tune directory by default (``OUT/tune.db``; nothing to start).
``--storage postgresql://...`` lets the same command on several machines share one study.  The
trials run with Optuna's heartbeat: a trial whose process died (kill -9, a lost machine) is
marked failed once its heartbeat is stale and retried with the same parameters, resuming its
checkpoint; a trial interrupted by Ctrl-C is stored as failed with the user attribute
``interrupted`` (the tables say *interrupted*), queued again at once with its values, and the
command stops with one line: rerun it to continue (the retry resumes the trial's checkpoint).  The command stops
when exactly ``N`` trials have finished or been pruned: rerunning the same command after a kill
continues the study to ``N``, and a finished study only rewrites the outputs.  With ``--count
completed`` it stops when ``N`` trials have *completed* (pruned and failed ones do not count), or
when ``--max-trials`` (default 3 N) have finished or been pruned, whichever comes first: tunes of
several losses then each get the same number of complete trials, and the cap is reported.

Outputs in ``OUT`` (rewritten at the end of every command): ``best.yaml`` (the best trial's
configuration as a runnable recipe), ``trials.csv`` / ``trials.md`` (every trial: state,
parameters, validation value, wall time, the epoch a pruned trial stopped at; no test metric),
``optimization_history.png`` and ``param_importances.png``
(Optuna's plots), ``report.html`` (all of it on one page) and ``tune.json`` (the set-up, used to
refuse a rerun with another recipe or space).  Each trial trains in ``OUT/trials/trial_NNNN``.
"""
from __future__ import annotations

import copy
import csv
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from deepmetric.search.store import file_sha256
from deepmetric.train import rundir
from deepmetric.train.config import ConfigError, apply_overrides, config_from_dict, read_yaml_mapping
from deepmetric.registry import did_you_mean

from .engine import (HEARTBEAT_S, display_storage, fail_stale_trials, optuna_module, rdb_storage, run_workers,
                     sqlite_url)

__all__ = ["ParamSpec", "SearchSpace", "TuneSetup", "load_space", "prepare_tune", "run_tune", "run_worker",
           "write_outputs", "open_study", "trial_rows", "default_storage"]

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
    p = ParamSpec(name=name, keys=keys, type=kind, log=bool(spec.get("log", False)))
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
    pruner = dict(raw.get("pruner") or {"name": "median"})
    if pruner.get("name", "median") not in PRUNERS:
        raise _space_error(path, f"pruner.name: expected one of {', '.join(PRUNERS)}, got {pruner.get('name')!r}")
    sampler = dict(raw.get("sampler") or {"name": "tpe"})
    if sampler.get("name", "tpe") not in SAMPLERS:
        raise _space_error(path, f"sampler.name: expected one of {', '.join(SAMPLERS)}, got {sampler.get('name')!r}")
    overrides = raw.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise _space_error(path, f"overrides: expected a list of KEY=VALUE strings, got {overrides!r}")
    return SearchSpace(metric=obj["metric"], direction=direction, params=specs, pruner=pruner, sampler=sampler,
                       overrides=list(overrides), raw=raw)


# --------------------------------------------------------------------------- the set-up
@dataclass
class TuneSetup:
    """Everything a worker needs: the recipe mapping with the overrides applied, the space,
    the target number of finished trials, the storage and the output folder."""

    recipe: Path
    base: dict                      # recipe + CLI overrides + space overrides (validated)
    space: SearchSpace
    space_path: Path
    trials: int
    out: Path
    storage: str
    study_name: str
    cli_overrides: list[str]
    count: str = "finished"         # what --trials counts: finished | completed (pruned ones not)
    max_trials: int | None = None   # count completed: at most this many finished or pruned

    def reached(self, c: dict[str, int]) -> bool:
        """Whether the study's counts (:func:`_counts`) meet the budget."""
        if self.count == "completed":
            return c["complete"] >= self.trials or c["done"] >= self.cap
        return c["done"] >= self.trials

    @property
    def cap(self) -> int:
        return self.max_trials if self.max_trials is not None else 3 * self.trials

    def budget_text(self) -> str:
        if self.count == "completed":
            return f"{self.trials} completed trials (pruned and failed not counted; at most {self.cap} in all)"
        return f"{self.trials} trials finished or pruned"

    def trial_config(self, values: dict[str, Any], run_dir: Path, *, threads: int | None = None):
        """The validated Config of one trial."""
        raw = copy.deepcopy(self.base)
        apply_overrides(raw, self.space.overrides_of(values))
        t = raw.setdefault("train", {})
        t["out_dir"] = str(run_dir)
        t["progress"] = False
        if threads is not None and t.get("num_threads") is None:
            t["num_threads"] = threads
        e = raw.setdefault("eval", {})
        if self.space.direction == "maximize":
            e["best_metric"] = self.space.metric  # best.pt = the model the objective scores
        e["test"] = False                         # the test split out of sight: never evaluated
        e["test_selected"] = False
        e["baselines"] = False                    # test-split numbers too
        return config_from_dict(raw)


def default_storage(out: Path) -> str:
    return sqlite_url(out / "tune.db")


def _validation_metrics(cfg) -> list[str]:
    from deepmetric.train.preflight import expected_metrics

    return expected_metrics(cfg)


def prepare_tune(recipe: str | os.PathLike, space_path: str | os.PathLike, *, trials: int,
                 out: str | os.PathLike | None = None, storage: str | None = None,
                 study_name: str | None = None, overrides: Sequence[str] = (), count: str = "finished",
                 max_trials: int | None = None) -> TuneSetup:
    """Check everything that can be checked before the first trial: the recipe has validation
    classes, the objective is a metric its validation computes, every parameter names a valid
    config key and both ends of its range (every choice) give a valid config."""
    recipe = Path(recipe)
    space = load_space(space_path)
    if not isinstance(trials, int) or trials < 1:
        raise TuneError(f"--trials: expected a positive number of trials, got {trials!r}")
    if count not in ("finished", "completed"):
        raise TuneError(f"--count: expected finished or completed, got {count!r}")
    if max_trials is not None and (count != "completed" or max_trials < trials):
        raise TuneError(f"--max-trials {max_trials}: needs --count completed and at least --trials ({trials})")
    if not recipe.is_file():
        raise TuneError(f"recipe not found: {recipe}")
    try:
        raw = yaml.safe_load(recipe.read_text()) or {}
        if not isinstance(raw, dict):
            raise TuneError(f"{recipe}: top level must be a mapping (a training recipe)")
        apply_overrides(raw, list(overrides) + space.overrides)
    except (ConfigError, yaml.YAMLError) as exc:
        raise TuneError(f"{recipe}: {exc}") from None
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    if data.get("val_classes") is None and data.get("val_folds") is None:  # DataConfig.has_validation
        raise TuneError(f"{recipe} has no validation classes: tuning chooses on validation, never on the test "
                        f"split; add data.val_classes (e.g. data.val_classes=0.2) to the recipe or the command")
    name = study_name or f"{recipe.stem}__{Path(space_path).stem}"
    out = Path(out) if out is not None else Path("runs") / "tune" / name
    setup = TuneSetup(recipe=recipe, base=raw, space=space, space_path=Path(space_path), trials=trials,
                      out=out, storage=storage or default_storage(out), study_name=name,
                      cli_overrides=list(overrides), count=count, max_trials=max_trials)
    try:  # the recipe as a trial sees it (the parameters may set required keys, e.g. m x n)
        cfg = setup.trial_config({p.name: p.examples()[0] for p in space.params}, out / "check")
    except ConfigError as exc:
        culprit = next((p for p in space.params if any(f"'{k}'" in str(exc) for k in p.keys)), None)
        if culprit is not None:
            raise TuneError(f"{space_path}: params.{culprit.name}: {exc}") from None
        raise TuneError(f"{recipe}: {exc}") from None
    names = _validation_metrics(cfg)
    if space.metric not in names:
        raise TuneError(f"{space_path}: objective.metric {space.metric!r} is not a metric this recipe's "
                        f"validation computes{did_you_mean(space.metric, names)}; "
                        f"it gives {', '.join(names)} (see eval.metrics, eval.ks, eval.cross_domain)")
    for p in space.params:
        for v in p.examples():
            values = {q.name: (v if q is p else q.examples()[0]) for q in space.params}
            try:
                setup.trial_config(values, out / "check")
            except ConfigError as exc:
                raise TuneError(f"{space_path}: params.{p.name} = {v!r}: {exc}") from None
    return setup


def _setup_record(setup: TuneSetup) -> dict:
    return {"recipe": str(setup.recipe), "recipe_sha256": file_sha256(setup.recipe), "space": setup.space.raw,
            "overrides": setup.cli_overrides, "trials": setup.trials, "count": setup.count,
            "max_trials": setup.cap if setup.count == "completed" else None, "study_name": setup.study_name,
            "storage": display_storage(setup.storage)}


def _same_recipe(old: dict, setup: TuneSetup) -> bool:
    """The recipe is the same file content, however its path is written (relative to another
    working directory, absolute, through a link); a record without a hash (older tunes): the
    same path, or one that resolves to the same file from here."""
    if old.get("recipe_sha256"):
        return old["recipe_sha256"] == file_sha256(setup.recipe)
    before = old.get("recipe")
    return before == str(setup.recipe) or (before is not None and Path(before).resolve() == setup.recipe.resolve())


def _check_same_tune(setup: TuneSetup) -> None:
    """A tune directory belongs to one recipe and space: a rerun with others would mix trials."""
    path = setup.out / "tune.json"
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    new = _setup_record(setup)
    changed = ([] if _same_recipe(old, setup) else ["recipe"]) + \
        [k for k in ("space", "overrides", "study_name") if old.get(k) != new.get(k)]
    if changed:
        raise TuneError(f"{setup.out} holds a tune with another {', '.join(changed)} (see {path}); continue it "
                        f"with the same command, or choose another --out")


# --------------------------------------------------------------------------- the Optuna study
def _optuna():
    try:
        return optuna_module()
    except ImportError as exc:  # pragma: no cover - optuna is in the tune extra
        raise TuneError(str(exc)) from None


def make_sampler(space: SearchSpace):
    """The space's sampler.  With a ``seed``, trial number ``n`` draws from a generator seeded
    by the seed and ``n`` (:func:`_seeded_per_trial`).

    One generator seeded once per process would draw again, after a rerun of a stopped tune,
    the values its first run drew (seen: the fair emoji ProxyAnchor tune, rerun after a stop at
    7 trials, repeated trials 0, 1 and 2 exactly), and two workers seeded alike would draw the
    same values.  Trial numbers are unique in the storage, so per-number seeds avoid both, on
    any number of workers and machines, and the same seed offers the same candidates to trial
    ``n`` of every tune with the same ranges, stopped or not."""
    optuna = _optuna()
    name = space.sampler.get("name", "tpe")
    opts = {k: v for k, v in space.sampler.items() if k != "name"}

    def build(seed):
        cls = optuna.samplers.TPESampler if name == "tpe" else optuna.samplers.RandomSampler
        return cls(**{**opts, "seed": seed})

    if opts.get("seed") is None:
        return build(None)
    return _seeded_per_trial(build, int(opts["seed"]))


def _seeded_per_trial(build: Callable[[int], Any], seed: int):
    """A sampler that, before each trial, makes ``build(crc32("seed:number"))`` and lets it
    sample that trial.  Optuna's samplers keep no state between trials but their generator (TPE
    reads the finished trials from the storage), so this draws as one sampler would."""
    import zlib

    optuna = _optuna()

    class SeededPerTrial(optuna.samplers.BaseSampler):
        def __init__(self) -> None:
            self.inner = build(seed)

        def before_trial(self, study, trial) -> None:
            self.inner = build(zlib.crc32(f"{seed}:{trial.number}".encode()))
            self.inner.before_trial(study, trial)

        def infer_relative_search_space(self, study, trial):
            return self.inner.infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return self.inner.sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, param_name, param_distribution):
            return self.inner.sample_independent(study, trial, param_name, param_distribution)

        def after_trial(self, study, trial, state, values) -> None:
            self.inner.after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:
            self.inner.reseed_rng()

    return SeededPerTrial()


def open_study(setup: TuneSetup, *, create: bool = True):
    """The study in ``setup.storage`` (created on first use), with the heartbeat that fails and
    retries the trials of dead processes."""
    optuna = _optuna()
    storage = rdb_storage(setup.storage, retry_stale=True)
    sp = setup.space
    sampler = make_sampler(sp)
    pname = sp.pruner.get("name", "median")
    popts = {k: v for k, v in sp.pruner.items() if k != "name"}
    if pname == "median":
        popts.setdefault("n_startup_trials", 2)   # compare from the 3rd trial on ...
        popts.setdefault("n_warmup_steps", 0)     # ... at every evaluation, the first included
        pruner = optuna.pruners.MedianPruner(**popts)
    elif pname == "successive_halving":
        pruner = optuna.pruners.SuccessiveHalvingPruner(**popts)
    else:
        pruner = optuna.pruners.NopPruner()
    if create:
        return optuna.create_study(storage=storage, study_name=setup.study_name, direction=sp.direction,
                                   sampler=sampler, pruner=pruner, load_if_exists=True)
    return optuna.load_study(storage=storage, study_name=setup.study_name, sampler=sampler, pruner=pruner)


def _origin(trial, study=None) -> int:
    """The number of the trial a retried trial repeats (itself when it is no retry): the run
    directory, and so the checkpoint it resumes, belong to the original.  ``trial``: a frozen
    trial, or a live one with its ``study``."""
    optuna = _optuna()
    if study is not None:  # the retry mark is a system attribute of the stored (frozen) trial
        trial = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    n = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)
    if n is None:
        n = trial.user_attrs.get("retry_of")
    return int(n) if n is not None else trial.number


class _Surplus(Exception):
    """Another worker already holds the last trial slot: this trial does not run."""


class _Interrupted(Exception):
    """Ctrl-C during a trial: it is stored as failed with the user attribute ``interrupted``
    (shown as *interrupted*), its values queued again, and the worker stops."""


class _QuietTrials(logging.Filter):
    """Drops Optuna's "Trial N failed ... because of the following error" warnings (with their
    traceback) of the trials in ``numbers``: an interrupted or surplus trial is no failure."""

    def __init__(self) -> None:
        super().__init__()
        self.numbers: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not any(msg.startswith(f"Trial {n} failed") for n in self.numbers)


_QUIET = _QuietTrials()
logging.getLogger("optuna.study._optimize").addFilter(_QUIET)  # the logger of Optuna's _run_trial


def _counts(study) -> dict[str, int]:
    from optuna.trial import TrialState

    out = {s: 0 for s in ("done", "complete", "running", "waiting")}
    for t in study.get_trials(deepcopy=False):
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            out["done"] += 1
            out["complete"] += t.state == TrialState.COMPLETE
        elif t.state == TrialState.RUNNING:
            out["running"] += 1
        elif t.state == TrialState.WAITING:
            out["waiting"] += 1
    return out


def _repeats_a_retry(study, trial) -> bool:
    """Whether an earlier live or finished trial already retries the failed trial this one
    retries.  Two workers that find the same stale trial at once can both fail it and queue it
    (SQLite gives no row lock; seen once in CI: a killed trial run twice after the rerun)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    me = next(t for t in trials if t.number == trial.number)
    history = me.system_attrs.get("retry_history") or []
    if not history:
        return False
    live = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return any(t.number < trial.number and t.state in live and (t.system_attrs.get("retry_history") or [])[-1:]
               == history[-1:] for t in trials)


def _holds_a_slot(study, trial, setup: TuneSetup) -> bool:
    """Trial numbers are given out in order by the storage: a trial runs when fewer than
    ``--trials`` trials that are finished, pruned, running or waiting come before it
    (``--count completed``: fewer than ``--trials`` complete, running or waiting ones, and fewer
    than ``--max-trials`` of them all)."""
    from optuna.trial import TrialState

    live = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
    before = [t for t in study.get_trials(deepcopy=False) if t.state in live and t.number < trial.number]
    if setup.count == "completed":
        return (sum(t.state != TrialState.PRUNED for t in before) < setup.trials and len(before) < setup.cap)
    return len(before) < setup.trials


def _objective(setup: TuneSetup, study, *, threads: int | None, log: Callable[[str], None],
               stop: dict[str, bool]):
    """Optuna's objective: one trial.  A Ctrl-C anywhere in it (the run checkpoints when it
    arrives during training) queues the trial's values again, marks the trial ``interrupted``,
    sets ``stop["interrupted"]`` and raises :class:`_Interrupted` (caught by ``optimize``)."""

    def objective(trial) -> float:
        try:
            return _run_trial(setup, study, trial, threads=threads, log=log)
        except KeyboardInterrupt:
            _QUIET.numbers.add(trial.number)
            stop["interrupted"] = True
            trial.set_user_attr("interrupted", True)
            if trial.params:  # values drawn: the retry resumes this trial's folder with them
                study.enqueue_trial(trial.params, user_attrs={"retry_of": _origin(trial, study)},
                                    skip_if_exists=False)
            raise _Interrupted() from None
        except _Surplus:
            _QUIET.numbers.add(trial.number)
            raise

    return objective


def _run_trial(setup: TuneSetup, study, trial, *, threads: int | None, log: Callable[[str], None]) -> float:
    optuna = _optuna()
    from deepmetric.train.loop import NonFiniteLossError, train

    if not _holds_a_slot(study, trial, setup) or _repeats_a_retry(study, trial):
        trial.set_user_attr("surplus", True)
        raise _Surplus()
    values = {p.name: p.suggest(trial) for p in setup.space.params}
    origin = _origin(trial, study)
    run_dir = setup.out / "trials" / f"trial_{origin:04d}"
    cfg = setup.trial_config(values, run_dir, threads=threads)
    resume = run_dir / rundir.LAST if (run_dir / rundir.LAST).is_file() and origin != trial.number else None
    if resume is None and run_dir.is_dir():
        rundir.remove_run_files(run_dir)  # a retried trial without a checkpoint starts again
    trial.set_user_attr("run_dir", str(run_dir))
    shown = ", ".join(f"{k}={_fmt_value(v)}" for k, v in values.items())
    log(f"trial {trial.number}{f' (retry of {origin})' if origin != trial.number else ''}: {shown}")
    sign = 1.0 if setup.space.direction == "maximize" else -1.0
    best = {"value": None}
    reported: set[int] = set()

    def report(epoch: int, val_metrics: dict) -> None:
        if resume is not None:  # a resumed run: its evaluations before the checkpoint first
            replay_log(before=epoch)
        value = float(val_metrics[setup.space.metric])
        reported.add(epoch)
        if best["value"] is None or sign * value > sign * best["value"]:
            best["value"] = value
        trial.report(value, step=epoch)
        if trial.should_prune():
            trial.set_user_attr("pruned_at_epoch", epoch)
            raise optuna.TrialPruned(f"validation {setup.space.metric}={value:.4f} at epoch {epoch}")

    def replay_log(before: float = float("inf")) -> None:
        # A retried trial resumes its original's checkpoint; the validations that run made
        # before it are in its log (truncated to the checkpoint by the resume) and count here,
        # or a run killed after its last evaluation would resume with nothing to report.
        for rec in rundir.read_log(run_dir, type="eval"):
            epoch = rec.get("epoch")
            if rec.get("split") == "val" and epoch is not None and epoch < before and epoch not in reported \
                    and setup.space.metric in rec:
                report(int(epoch), rec)

    t0 = time.perf_counter()
    try:
        result = train(cfg, resume=resume, overwrite=resume is None, on_validation=report, quiet_interrupt=True)
    except NonFiniteLossError as exc:  # a diverged trial is hopeless: pruned, not an error
        trial.set_user_attr("stopped", f"non-finite loss: {str(exc).split(';')[0]}")
        raise optuna.TrialPruned(str(exc)) from None
    finally:
        trial.set_user_attr("train_seconds", round(time.perf_counter() - t0, 1))
    if result.interrupted:  # Ctrl-C: checkpointed; the objective queues the values again
        raise KeyboardInterrupt
    if resume is not None:
        replay_log()
    value = best["value"]
    if value is None:
        raise RuntimeError(f"trial {trial.number}: the run evaluated no validation split")
    trial.set_user_attr("best_epoch", (result.selected or {}).get("epoch"))
    trial.set_user_attr("epochs", result.epochs_completed)
    return value


def _fmt_value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def run_worker(setup: TuneSetup, *, threads: int | None = None, log: Callable[[str], None] | None = None) -> None:
    """Run trials until the budget is met (``setup.trials`` finished or pruned, or completed
    with ``count: completed``), counting every worker of the study, on any machine."""
    _optuna()  # a clear error when Optuna is missing, before the storage is opened
    log = log or (lambda msg: print(f"[tune {setup.study_name}] {msg}", flush=True))
    study = open_study(setup)
    _QUIET.numbers.clear()  # trial numbers of this study only (a process may run several)
    stop = {"interrupted": False}
    objective = _objective(setup, study, threads=threads, log=log, stop=stop)
    while True:
        fail_stale_trials(study)  # a dead worker's trial: failed, queued again
        c = _counts(study)
        if setup.reached(c):
            return
        ahead = {**c, "done": c["done"] + c["running"], "complete": c["complete"] + c["running"]}
        if setup.reached(ahead) and not c["waiting"]:
            time.sleep(HEARTBEAT_S / 2)  # the last slots are running elsewhere (or were, until stale)
            continue
        study.optimize(objective, n_trials=1, catch=(_Surplus, _Interrupted), callbacks=[_log_finished(log)])
        if stop["interrupted"]:
            raise KeyboardInterrupt


def _log_finished(log: Callable[[str], None]):
    def callback(study, trial) -> None:
        state = trial.state.name.lower()
        if trial.user_attrs.get("surplus") or trial.user_attrs.get("interrupted"):
            return  # an interrupted trial: the command's one message says what to do
        value = f" validation {trial.value:.4f}" if trial.value is not None else ""
        at = f" at epoch {trial.user_attrs['pruned_at_epoch']}" if "pruned_at_epoch" in trial.user_attrs else ""
        log(f"trial {trial.number} {state}{at}{value}")
    return callback


# --------------------------------------------------------------------------- workers
def _worker_command(setup: TuneSetup) -> list[str]:
    """The command of one worker process of ``--workers K`` (the same tune, ``--worker``)."""
    # the overrides right after the recipe: argparse gives a positional list only the words
    # next to the first positional (after the options they would be "unrecognized arguments")
    cmd = [sys.executable, "-m", "deepmetric.cli", "tune", str(setup.recipe), *setup.cli_overrides,
           "--space", str(setup.space_path), "--trials", str(setup.trials), "--out", str(setup.out),
           "--storage", setup.storage, "--study-name", setup.study_name, "--worker", "--count", setup.count]
    if setup.max_trials is not None:
        cmd += ["--max-trials", str(setup.max_trials)]
    return cmd


def run_tune(setup: TuneSetup, *, workers: int = 1, log: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Run the study to ``setup.trials`` finished trials with ``workers`` processes on this
    machine, then write the outputs.  Returns their paths."""
    log = log or (lambda msg: print(f"[tune {setup.study_name}] {msg}", flush=True))
    setup.out.mkdir(parents=True, exist_ok=True)
    _check_same_tune(setup)
    rundir.write_text_atomic(setup.out / "tune.json", json.dumps(_setup_record(setup), indent=1) + "\n")
    study = open_study(setup)
    c = _counts(study)
    log(f"{setup.budget_text()} wanted: {c['done']} finished or pruned ({c['complete']} complete), "
        f"{c['running']} running, "
        f"{c['waiting']} queued; storage {display_storage(setup.storage)}; objective validation "
        f"{setup.space.metric} ({setup.space.direction})")
    try:
        if workers <= 1:
            run_worker(setup, threads=None, log=log)
        else:
            seen: set[int] = set()

            def poll() -> None:
                seen.update(_report_progress(study, seen, log))

            codes = run_workers(_worker_command(setup), workers, setup.out / "workers", poll=poll, log=log)
            bad = [c for c in codes if c != 0]
            if bad:
                log(f"{len(bad)} worker(s) ended with an error (exit codes {bad}); see {setup.out / 'workers'}")
    except KeyboardInterrupt:  # the tables show the interrupted trial; a second Ctrl-C skips this
        write_outputs(setup)
        raise
    return write_outputs(setup)


def _report_progress(study, seen: set[int], log: Callable[[str], None]) -> set[int]:
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
        if t.number in seen or t.user_attrs.get("surplus"):
            continue
        seen.add(t.number)
        params = ", ".join(f"{k}={_fmt_value(v)}" for k, v in t.params.items())
        value = f" validation {t.value:.4f}" if t.value is not None else ""
        log(f"trial {t.number} {_state_name(t)}{value} ({params})")
    return seen


# --------------------------------------------------------------------------- outputs
def _state_name(t) -> str:
    """The trial's state as the tables show it: Optuna's, except that a trial stopped by Ctrl-C
    (stored as failed, its values queued again) is *interrupted*."""
    if t.state.name == "FAIL" and t.user_attrs.get("interrupted"):
        return "interrupted"
    return t.state.name.lower()


def trial_rows(setup: TuneSetup, study) -> list[dict]:
    """One row per trial (surplus trials, which never ran, left out)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("surplus"):
            continue
        row: dict[str, Any] = {"trial": t.number, "state": _state_name(t)}
        if t.user_attrs.get("retry_of") is not None or _origin(t) != t.number:
            row["retry_of"] = _origin(t)
        for p in setup.space.params:
            if p.name in t.params:
                row[p.name] = p.value_of(t.params)
        row[f"val/{setup.space.metric}"] = t.value
        if t.intermediate_values:
            last = max(t.intermediate_values)
            row["last_epoch"] = last
        row["pruned_at_epoch"] = t.user_attrs.get("pruned_at_epoch")
        if t.datetime_start is not None and t.datetime_complete is not None:
            row["wall_time_s"] = round((t.datetime_complete - t.datetime_start).total_seconds(), 1)
        row["run_dir"] = t.user_attrs.get("run_dir")
        if t.user_attrs.get("note"):  # set by hand on a repaired study (bench/studies/README.md, the fair emoji tunes)
            row["note"] = t.user_attrs["note"]
        rows.append(without_test_metrics(row))
    return rows


def without_test_metrics(row: dict) -> dict:
    """``row`` without any key that names a test metric (``test/...``, ``test_...``, ``test``):
    trials never evaluate the test split, and a storage written by an older version (which
    recorded the final test metrics) must not bring them into the outputs either."""
    return {k: v for k, v in row.items() if not str(k).lower().startswith("test")}


def _best_trial(setup: TuneSetup, study):
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if not done:
        return None
    sign = 1.0 if setup.space.direction == "maximize" else -1.0
    return max(done, key=lambda t: (sign * t.value, -t.number))


#: Overrides that only shorten or quieten the trials (``train.epochs=3``, ``train.progress=false``):
#: best.yaml takes the recipe's own values back and says so in its header.
SHORT_RUN_KEYS = ("train.epochs", "train.iterations", "train.progress", "eval.every")


def _undo_short_run_settings(setup: TuneSetup, raw: dict) -> list[str]:
    """Put the recipe's own values of :data:`SHORT_RUN_KEYS` back into ``raw`` where the tune's
    command or space overrode them; returns a note per key (``train.epochs=3 (recipe: 30)``)."""
    original = yaml.safe_load(setup.recipe.read_text()) or {}
    notes = []
    for text in [*setup.cli_overrides, *setup.space.overrides]:
        key = text.partition("=")[0].strip()
        if key not in SHORT_RUN_KEYS or any(n.startswith(f"{key}=") for n in notes):
            continue
        section, name = key.split(".")
        own = (original.get(section) or {}).get(name) if isinstance(original.get(section), dict) else None
        target = raw.setdefault(section, {})
        if own is None:
            target.pop(name, None)
        else:
            target[name] = own
        notes.append(f"{text} (recipe: {'default' if own is None else own})")
    return notes


def _best_recipe(setup: TuneSetup, best) -> str:
    """The recipe with the CLI and space overrides and the best values applied (validated),
    except the short-run settings (:data:`SHORT_RUN_KEYS`), which go back to the recipe's."""
    values = {p.name: p.value_of(best.params) for p in setup.space.params}
    raw = copy.deepcopy(setup.base)
    undone = _undo_short_run_settings(setup, raw)
    apply_overrides(raw, setup.space.overrides_of(values))
    raw.setdefault("train", {})["out_dir"] = str(Path("runs") / f"{setup.study_name}_best")
    raw["name"] = f"{raw.get('name') or setup.recipe.stem}_tuned"
    cfg = config_from_dict(copy.deepcopy(raw))  # runnable: validated as `deepmetric train` will
    del cfg
    head = [f"# {setup.recipe} tuned by `deepmetric tune` ({setup.space_path}, {setup.trials} trials,",
            f"# study {setup.study_name!r}): trial {best.number}, validation {setup.space.metric} = {best.value:.4f}",
            "# (chosen on validation classes; the test split was not used). Values: "
            + ", ".join(f"{k} = {_fmt_value(v)}" for k, v in values.items())]
    if undone:
        head += ["# The trials were short runs: these overrides of the tune's command / space are NOT in this file",
                 "# (the recipe's own values are): " + ", ".join(undone) + ".",
                 "# The values above were chosen under them; add them to the command to train as the trials did."]
    head.append(f"#   deepmetric train {setup.out / 'best.yaml'}")
    return "\n".join(head) + "\n" + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None)


def _fmt_cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _plots(study, out: Path) -> tuple[dict[str, Path], list[str]]:
    """Optuna's optimisation-history and parameter-importance plots (matplotlib backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import warnings

    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    paths, notes = {}, []
    if not any(t.state.name == "COMPLETE" for t in study.get_trials(deepcopy=False)):
        return paths, ["plots: not drawn (no trial has finished yet)"]  # Optuna would only warn
    for name, fn in (("optimization_history", ovm.plot_optimization_history),
                     ("param_importances", ovm.plot_param_importances)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the matplotlib backend is marked experimental
                ax = fn(study)
            fig = ax.figure if hasattr(ax, "figure") else ax[0].figure
            fig.set_size_inches(7, 4.2)
            fig.tight_layout()
            path = out / f"{name}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths[name] = path
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # e.g. fewer than 2 finished trials
            notes.append(f"{name}: not drawn ({exc})")
    return paths, notes


def write_outputs(setup: TuneSetup) -> dict[str, Path]:
    """(Re)write best.yaml, trials.csv / trials.md, the plots and report.html."""
    study = open_study(setup, create=False)
    out = setup.out
    rows = trial_rows(setup, study)
    paths: dict[str, Path] = {}
    columns = list(dict.fromkeys(k for r in rows for k in r)) or ["trial", "state"]
    tmp = out / ".trials.csv.tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    os.replace(tmp, out / "trials.csv")
    paths["csv"] = out / "trials.csv"
    best = _best_trial(setup, study)
    if best is not None:
        rundir.write_text_atomic(out / "best.yaml", _best_recipe(setup, best))
        paths["best"] = out / "best.yaml"
        values = {p.name: p.value_of(best.params) for p in setup.space.params}
        record = {"trial": best.number, "value": best.value, "metric": setup.space.metric,
                  "overrides": setup.space.overrides_of(values)}  # a study's `from_tune: DIR` reads these
        rundir.write_text_atomic(out / "best_overrides.json", json.dumps(record, indent=1) + "\n")
        paths["best_overrides"] = out / "best_overrides.json"
    plots, notes = _plots(study, out)
    paths.update(plots)
    md = _trials_markdown(setup, rows, best, notes)
    rundir.write_text_atomic(out / "trials.md", md)
    paths["md"] = out / "trials.md"
    from deepmetric.report.tune_report import write_tune_report

    paths["report"] = write_tune_report(out / "report.html", title=f"Tune {setup.study_name}",
                                        summary=_summary_pairs(setup, rows, best), rows=rows, plots=plots,
                                        notes=notes)
    return paths


def _summary_pairs(setup: TuneSetup, rows: list[dict], best) -> list[tuple[str, Any]]:
    states: dict[str, int] = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1
    pairs = [("recipe", str(setup.recipe)), ("space", str(setup.space_path)),
             ("objective", f"validation {setup.space.metric} ({setup.space.direction})"),
             ("budget", setup.budget_text()),
             ("trials", ", ".join(f"{n} {s}" for s, n in states.items()) or "none yet"),
             ("pruner", setup.space.pruner.get("name", "median")), ("sampler", setup.space.sampler.get("name", "tpe")),
             ("storage", display_storage(setup.storage))]
    if best is not None:
        pairs += [("best trial", f"{best.number}: validation {setup.space.metric} = {best.value:.4f}"),
                  ("best values", ", ".join(f"{p.name} = {_fmt_value(p.value_of(best.params))}"
                                            for p in setup.space.params)),
                  ("best recipe", str(setup.out / "best.yaml"))]
    return pairs


def _trials_markdown(setup: TuneSetup, rows: list[dict], best, notes: list[str]) -> str:
    metric = f"val/{setup.space.metric}"
    params = [p.name for p in setup.space.params]
    cols = ["trial", "state", *params, metric, "pruned_at_epoch", "wall_time_s"]
    lines = [f"# Tune {setup.study_name}", ""]
    lines += [f"- {k}: {v}" for k, v in _summary_pairs(setup, rows, best)]
    lines += ["", "The objective is the validation metric (the best value of the trial, the model best.pt "
              "keeps). The trials never evaluated the test split: no test metric exists to choose on.", "",
              "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt_cell(r.get(c)) for c in cols) + " |")
    lines += [""] + [f"Note: {n}" for n in notes]
    return "\n".join(lines).rstrip() + "\n"

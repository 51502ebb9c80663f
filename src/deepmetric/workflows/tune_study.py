"""A tune's set-up (recipe, space, budget, storage) and its Optuna study: the sampler, the
storage it is opened in, and which trial a retried trial repeats."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from deepmetric.run.config_io import apply_overrides, config_from_dict

from .engine import optuna_module, rdb_storage, sqlite_url
from .tune_space import SearchSpace, TuneError, engine_class


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
        """Whether the study's counts (``tune._counts``) meet the budget."""
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


# --------------------------------------------------------------------------- the Optuna study
def tune_optuna():
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
    name = space.sampler.get("name", "tpe")
    opts = {k: v for k, v in space.sampler.items() if k != "name"}

    def build(seed):
        return engine_class(name)(**{**opts, "seed": seed})

    if opts.get("seed") is None:
        return build(None)
    return _seeded_per_trial(build, int(opts["seed"]))


def _seeded_per_trial(build: Callable[[int], Any], seed: int):
    """A sampler that, before each trial, makes ``build(crc32("seed:number"))`` and lets it
    sample that trial.  Optuna's samplers keep no state between trials but their generator (TPE
    reads the finished trials from the storage), so this draws as one sampler would."""
    import zlib

    optuna = tune_optuna()

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
    optuna = tune_optuna()
    storage = rdb_storage(setup.storage, retry_stale=True)
    sp = setup.space
    sampler = make_sampler(sp)
    pname = sp.pruner.get("name", "median")
    popts = {k: v for k, v in sp.pruner.items() if k != "name"}
    if pname == "median":
        popts.setdefault("n_startup_trials", 2)   # compare from the 3rd trial on ...
        popts.setdefault("n_warmup_steps", 0)     # ... at every evaluation, the first included
    pruner = engine_class(pname)(**popts)  # options the class refuses were refused when the space loaded
    if create:
        return optuna.create_study(storage=storage, study_name=setup.study_name, direction=sp.direction,
                                   sampler=sampler, pruner=pruner, load_if_exists=True)
    return optuna.load_study(storage=storage, study_name=setup.study_name, sampler=sampler, pruner=pruner)


def trial_origin(trial, study=None) -> int:
    """The number of the trial a retried trial repeats (itself when it is no retry): the run
    directory, and so the checkpoint it resumes, belong to the original.  ``trial``: a frozen
    trial, or a live one with its ``study``.

    Two marks, read in this order: ``retry_of`` (a user attribute: set, already traced back to
    the original, when a Ctrl-C queues a trial again; Optuna copies user attributes into its own
    retries) and Optuna's heartbeat retry (``failed_trial``: the first trial of a chain of
    heartbeat retries, which may itself be a Ctrl-C retry).  Reading the heartbeat mark first made
    the heartbeat retry of a Ctrl-C retry start over in a folder of its own."""
    optuna = tune_optuna()
    if study is not None:  # the retry marks are attributes of the stored (frozen) trial
        trial = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    n = trial.user_attrs.get("retry_of")
    if n is None:
        n = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)
    return int(n) if n is not None else trial.number


def trial_state_name(t) -> str:
    """The trial's state as the tables show it: Optuna's, except that a trial stopped by Ctrl-C
    (stored as failed, its values queued again) is *interrupted*."""
    if t.state.name == "FAIL" and t.user_attrs.get("interrupted"):
        return "interrupted"
    return t.state.name.lower()

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

To stop without losing the running trials' work (a machine that must be handed back, a session
that ends: a stop at any other moment loses the current epoch of each, and a fresh clone loses
their checkpoints altogether), create ``OUT/DRAIN`` (``touch OUT/DRAIN``): every worker finishes
the trial it runs and starts no other; the command then writes the outputs and exits 0 with the
study unfinished.  The next command removes the file and continues.

Outputs in ``OUT`` (rewritten at the end of every command): ``best.yaml`` (the best trial's
configuration as a runnable recipe), ``trials.csv`` / ``trials.md`` (every trial: state,
parameters, validation value, wall time, the epoch a pruned trial stopped at; no test metric),
``optimization_history.png`` and ``param_importances.png``
(Optuna's plots), ``report.html`` (all of it on one page) and ``tune.json`` (the set-up, used to
refuse a rerun with another recipe or space).  Each trial trains in ``OUT/trials/trial_NNNN``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import yaml

from deepmetric.search.store import file_sha256
from deepmetric.run import rundir
from deepmetric.run.config import ConfigError
from deepmetric.run.config_checks import check_config_options
from deepmetric.run.config_io import apply_overrides, read_yaml_mapping
from deepmetric.registry import SUGGESTION_OPENING, did_you_mean

from .engine import DRAIN, HEARTBEAT_S, clear_drain, display_storage, draining, fail_stale_trials, run_workers
from .tune_outputs import write_outputs
from .tune_space import TuneError, format_value, load_space
from .tune_study import TuneSetup, default_storage, open_study, trial_origin, trial_state_name, tune_optuna

__all__ = ["prepare_tune", "report_tune", "run_tune", "run_worker"]


def _validation_metrics(cfg) -> list[str]:
    from deepmetric.run.evaluation import expected_metrics

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
        raw = read_yaml_mapping(recipe, "recipe")
        if not isinstance(raw, dict):
            raise TuneError(f"{recipe}: top level must be a mapping (a training recipe)")
    except (ConfigError, yaml.YAMLError) as exc:
        raise TuneError(f"{recipe}: {exc}") from None
    # each source named in its own errors (a space file's bad override was blamed on the recipe)
    for given, source in ((list(overrides), "the command line"), (space.overrides, f"{space_path}: overrides")):
        try:
            apply_overrides(raw, given)
        except ConfigError as exc:
            raise TuneError(f"{source}: {exc}") from None
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
        # the option names too (train checks them only when a trial starts: a misspelt loss option
        # failed trial 0 with Optuna's traceback, after tune.json and the storage were written)
        check_config_options(cfg)
    except ConfigError as exc:
        raise TuneError(_source_of(setup, exc)) from None
    names = _validation_metrics(cfg)
    if space.metric not in names:
        raise TuneError(f"{space_path}: objective.metric {space.metric!r} is not a metric this recipe's "
                        f"validation computes{did_you_mean(space.metric, names)}; "
                        f"it gives {', '.join(names)} (see eval.metrics, eval.ks, eval.cross_domain)")
    for p in space.params:
        for v in p.examples():
            values = {q.name: (v if q is p else q.examples()[0]) for q in space.params}
            try:
                check_config_options(setup.trial_config(values, out / "check"))
            except ConfigError as exc:
                raise TuneError(f"{space_path}: params.{p.name} = {v!r}: {exc}") from None
    return setup


def _source_of(setup: TuneSetup, exc: ConfigError) -> str:
    """``exc`` (a trial's config refused) prefixed with where the value it names came from: the
    last of the recipe, the command line's overrides, the space's overrides and its parameters
    (applied in that order) that sets a key the message names (or a key above it: ``loss=[...]``
    sets ``loss.0.options.alpha``).  A key only named in a suggestion (registry.suggest's
    closest name) is not the culprit."""
    before_suggestion = re.split(f"(?i){SUGGESTION_OPENING}", str(exc))[0]
    named = set(re.findall(r"'([A-Za-z_][\w.]*)'", before_suggestion))

    def sets(key: str) -> bool:
        return any(n == key or n.startswith(key + ".") for n in named)

    space = setup.space_path
    culprit = next((p for p in setup.space.params if any(sets(k) for k in p.keys)), None)
    if culprit is not None:
        return f"{space}: params.{culprit.name}: {exc}"
    for given, source in ((setup.space.overrides, f"{space}: overrides: "),
                          (setup.cli_overrides, "the command line: override ")):
        override = next((o for o in reversed(given) if sets(o.split("=", 1)[0].strip())), None)
        if override is not None:
            return f"{source}{override!r}: {exc}"
    return f"{setup.recipe}: {exc}"


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
                study.enqueue_trial(trial.params, user_attrs={"retry_of": trial_origin(trial, study)},
                                    skip_if_exists=False)
            raise _Interrupted() from None
        except _Surplus:
            _QUIET.numbers.add(trial.number)
            raise

    return objective


def _run_trial(setup: TuneSetup, study, trial, *, threads: int | None, log: Callable[[str], None]) -> float:
    optuna = tune_optuna()
    from deepmetric.train.loop import NonFiniteLossError, train

    if not _holds_a_slot(study, trial, setup) or _repeats_a_retry(study, trial):
        trial.set_user_attr("surplus", True)
        raise _Surplus()
    values = {p.name: p.suggest(trial) for p in setup.space.params}
    origin = trial_origin(trial, study)
    run_dir = setup.out / "trials" / f"trial_{origin:04d}"
    cfg = setup.trial_config(values, run_dir, threads=threads)
    resume = run_dir / rundir.LAST if (run_dir / rundir.LAST).is_file() and origin != trial.number else None
    if resume is None and run_dir.is_dir():
        rundir.remove_run_files(run_dir)  # a retried trial without a checkpoint starts again
    trial.set_user_attr("run_dir", str(run_dir))
    shown = ", ".join(f"{k}={format_value(v)}" for k, v in values.items())
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


def run_worker(setup: TuneSetup, *, threads: int | None = None, log: Callable[[str], None] | None = None) -> None:
    """Run trials until the budget is met (``setup.trials`` finished or pruned, or completed
    with ``count: completed``), counting every worker of the study, on any machine, or until
    ``OUT/DRAIN`` exists (checked between trials)."""
    tune_optuna()  # a clear error when Optuna is missing, before the storage is opened
    log = log or (lambda msg: print(f"[tune {setup.study_name}] {msg}", flush=True))
    study = open_study(setup)
    _QUIET.numbers.clear()  # trial numbers of this study only (a process may run several)
    stop = {"interrupted": False}
    objective = _objective(setup, study, threads=threads, log=log, stop=stop)
    while True:
        if draining(setup.out):
            return
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


def report_tune(setup: TuneSetup) -> dict[str, Path]:
    """``--report-only``: rewrite the outputs of the tune in ``setup.out`` from its storage, after
    the checks a rerun gets (a space whose objective or parameters differ would relabel the
    trials and choose best.yaml by another rule); a folder without a tune is refused, not given
    an empty study."""
    if not (setup.out / "tune.json").is_file():
        raise TuneError(f"--report-only: {setup.out} holds no tune (no tune.json); run the tune first "
                        "(the same command without --report-only)")
    _check_same_tune(setup)
    return write_outputs(setup)


def run_tune(setup: TuneSetup, *, workers: int = 1, log: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Run the study to ``setup.trials`` finished trials with ``workers`` processes on this
    machine, then write the outputs.  Returns their paths."""
    log = log or (lambda msg: print(f"[tune {setup.study_name}] {msg}", flush=True))
    _check_same_tune(setup)
    # the storage first: a URL that does not open leaves the folder as it was (no tune.json of a
    # tune that never ran, an older one not overwritten, the drain mark kept)
    study = open_study(setup)
    setup.out.mkdir(parents=True, exist_ok=True)
    clear_drain(setup.out, log)  # left by the drain that stopped the last command: this one continues
    rundir.write_text_atomic(setup.out / "tune.json", json.dumps(_setup_record(setup), indent=1) + "\n")
    log(_start_line(setup, _counts(study)))
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
    if draining(setup.out):
        c = _counts(open_study(setup))
        log(f"drained ({setup.out / DRAIN}): the running trials finished, no other started; {c['complete']} "
            f"complete, {c['done']} finished or pruned; rerun the same command to continue")
    return write_outputs(setup)


def _start_line(setup: TuneSetup, c: dict[str, int]) -> str:
    """The command's first line: the budget and the study's counts; when the storage already
    meets the budget, that no trial runs (a rerun with a smaller --trials printed the smaller
    budget as if it were the study's)."""
    tail = (f"{c['running']} running, {c['waiting']} queued; storage {display_storage(setup.storage)}; "
            f"objective validation {setup.space.metric} ({setup.space.direction})")
    if not setup.reached(c):
        return f"{setup.budget_text()} wanted: {c['done']} finished or pruned ({c['complete']} complete), {tail}"
    if setup.count == "completed" and c["complete"] >= setup.trials:
        held, have = f"{c['complete']} completed trials ({c['done']} finished or pruned)", c["complete"]
        asked, want = f"the {setup.trials} asked (--trials {setup.trials} --count completed)", setup.trials
    else:  # finished or pruned trials: the budget, or with --count completed the cap on all trials
        held, have = f"{c['done']} finished or pruned trials ({c['complete']} complete)", c["done"]
        if setup.count == "completed":
            cap = f"--max-trials {setup.cap}" if setup.max_trials is not None else f"3 x --trials {setup.trials}"
            asked, want = f"the cap of {setup.cap} ({cap})", setup.cap
        else:
            asked, want = f"the {setup.trials} asked (--trials {setup.trials})", setup.trials
    return (f"the storage already holds {held}, {'more than' if have > want else 'as many as'} {asked}: "
            f"no trial runs, the outputs are rewritten from the storage; {tail}")


def _report_progress(study, seen: set[int], log: Callable[[str], None]) -> set[int]:
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
        if t.number in seen or t.user_attrs.get("surplus"):
            continue
        seen.add(t.number)
        params = ", ".join(f"{k}={format_value(v)}" for k, v in t.params.items())
        value = f" validation {t.value:.4f}" if t.value is not None else ""
        log(f"trial {t.number} {trial_state_name(t)}{value} ({params})")
    return seen


# --------------------------------------------------------------------------- outputs

"""Studies: many training runs (benchmarks x variants x seeds) and their statistics.

``deepmetric study STUDY.yaml`` trains every run of a study in order, skipping runs that
already finished, so a killed study resumes where it stopped; after every run it rewrites
the study's results (see docs/study.md)::

    name: emoji_losses
    base: ../recipes/demo_glyphs.yaml     # a config file (relative to this file, else to
                                          # the working directory) or an inline mapping
    overrides: [train.epochs=4]           # applied to every run
    benchmarks:                           # optional; each: a config path, an inline config,
      glyphs: {base: ..., overrides: []}  #   or {base, overrides}; default: just `base`
    variants:                             # name -> overrides (strings "key=value" or
      HBN: []                             #   one-key mappings {key: value})
      BN:  [schedule.temperature.name=none]
    seeds: [0, 1, 2]
    out_dir: runs/studies/emoji_losses    # relative to the working directory
    workers: 1                            # runs at once on this machine (worker processes)
    metrics: [final/recall@1, final/nmi]  # optional: the columns of the summary tables
    compare: [[HBN, BN]]                  # paired differences A - B (same seed)

A run's config is: the base (or benchmark) config, then ``overrides``, the benchmark's
overrides, the variant's overrides, and finally ``train.seed = seed`` and
``train.out_dir = OUT/[benchmark/]variant/seed<k>``.  Every run is validated before the
first one starts.

A run is *finished* when its ``metrics.json`` exists (``train`` writes it last), here or on a
machine sharing the study's storage; a run directory holding ``last.pt`` but no
``metrics.json`` (a killed run) resumes from that checkpoint.

The runs are trials of an Optuna storage, as a tune's (:mod:`deepmetric.workflows.engine`):
``OUT/study.db`` (SQLite) by default, or ``--storage postgresql://...`` so the same command on
several machines shares the work.  ``--workers K`` starts K worker processes on this machine;
each takes the next unfinished run, marks it running (with a heartbeat), trains or resumes it
and stores its results row.  A run whose worker died is free again once its heartbeat is stale.

Results, rewritten after every finished run, in ``OUT``:

* ``results.json`` / ``results.csv``: one row per finished run: benchmark, variant, seed,
  ``final/<metric>`` (test metrics of the final model), ``selected/<metric>`` (test metrics
  of the model selected on validation classes, when the run selects one),
  ``wall_time_s`` and ``images_per_s``;
* ``summary.md``: per benchmark and variant the mean +- sample standard deviation and the
  95 % Student-t confidence interval of every metric, the per-run table, and for every
  ``compare`` pair the mean paired difference (same benchmark and seed) with its t interval;
* ``summary.png`` (one panel per summary metric: mean with 95 % CI error bars per variant).

The runner's own files of a run (the resolved ``config.yaml`` it trains, ``attempts.json``
with the wall time of each attempt, ``error.txt`` of a failed attempt) are in
``OUT/.study/<run key>/``, so run directories hold only what ``train`` writes; the workers'
output is in ``OUT/.study/workers/``.

``touch OUT/DRAIN`` stops a study without losing work: every worker finishes the run it trains
and starts no other (a Ctrl-C stops each after its current step, checkpointed); the next
command removes the file and continues.

A variant can take its settings from a finished tune: ``VARIANT: [..., {from_tune: DIR}]``
applies the best trial's values of the tune in ``DIR`` (``DIR/best_overrides.json``, written
by ``deepmetric tune``) where it stands; a later override that replaces a whole mapping or list
holding a tuned key (``loss=[...]`` after a tuned ``loss.0.options.margin``) is refused.

Statistics (``mean_ci``): for values ``x_1..x_n``, ``mean = sum x_i / n``, ``sd`` with
``n - 1`` in the denominator, and ``mean +- t_{0.975, n-1} sd / sqrt(n)``.  Paired
differences use ``d_i = a_i - b_i`` over the seeds both variants finished.
"""
from __future__ import annotations

import copy
import csv
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence


from deepmetric.report.study_tables import (metric_columns, paired_differences, plot_summary,
                                            summarize, summary_markdown)
from deepmetric.run import rundir
from deepmetric.run.config_io import config_from_dict, save_config
from deepmetric.run.rundir import write_text_atomic

from .engine import (DRAIN, HEARTBEAT_S, Heartbeat, clear_drain, display_storage, draining, fail_stale_trials,
                     optuna_module, rdb_storage, run_workers, sqlite_url)
from .study_file import Study, StudyRun

__all__ = ["run_study", "collect_rows", "write_results", "run_row", "select_runs"]

# The runner's own files of a run live in OUT/.study/<run key>/, never in the run directory
# (train refuses to start a new run in a directory holding foreign files).
RUN_CONFIG = "config.yaml"         # the resolved config of a run, written before it starts
RUN_RECORD = "attempts.json"       # wall time of each attempt
RUN_ERROR = "error.txt"            # the exception of a failed in-process run


# --------------------------------------------------------------------------- one run's row
def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def run_row(run: StudyRun) -> dict | None:
    """The results row of a finished run (None when ``metrics.json`` is missing).

    Reads ``metrics.json`` defensively: ``final.test`` (else ``metrics``) gives the
    ``final/*`` columns, ``selected.test`` the ``selected/*`` columns (plus
    ``selected/epoch``).  ``wall_time_s``: the run's own, else the study runner's timing of
    its attempts.  ``images_per_s``: the run's ``train_images_per_s``, else the median
    per-step throughput of ``log.jsonl``, else steps x batch / wall time.
    """
    summary = rundir.read_metrics(run.out_dir, strict=False)
    if summary is None:
        return None
    row: dict[str, Any] = {"benchmark": run.benchmark or "", "variant": run.variant, "seed": run.seed}
    final = summary.get("final")
    final_test = final.get("test") if isinstance(final, dict) else None
    if not isinstance(final_test, dict):
        final_test = summary.get("metrics") if isinstance(summary.get("metrics"), dict) else {}
    for k, v in final_test.items():
        if _num(v) is not None:
            row[f"final/{k}"] = float(v)
    selected = summary.get("selected")
    if isinstance(selected, dict):
        if _num(selected.get("epoch")) is not None:
            row["selected/epoch"] = float(selected["epoch"])
        sel_test = selected.get("test")
        if isinstance(sel_test, dict):
            for k, v in sel_test.items():
                if _num(v) is not None:
                    row[f"selected/{k}"] = float(v)
    record = _read_json(run.record_dir / RUN_RECORD) or {}
    wall = _num(summary.get("wall_time_s"))
    if wall is None:
        wall = _num(record.get("wall_time_s"))
    row["wall_time_s"] = wall
    ips = _num(summary.get("train_images_per_s"))
    if ips is None:
        ips = rundir.median_images_per_s(rundir.read_log(run.out_dir, type="step"))
    if ips is None and wall and _num(summary.get("steps")) is not None:
        t = run.raw.get("train", {})
        batch = (t.get("m") or 0) * (t.get("n") or 0) if t.get("sampler") == "class_balanced" else t.get("batch_size", 32)
        ips = float(summary["steps"]) * batch * int(t.get("grad_accum", 1)) / wall
    row["images_per_s"] = ips
    wise = summary.get("wise_ft")
    if isinstance(wise, dict) and isinstance(wise.get("test"), dict):  # eval.wise_ft: the mixture chosen on val
        row["wise/alpha"] = _num(wise.get("alpha"))
        for k, v in wise["test"].items():
            if _num(v) is not None:
                row[f"wise/{k}"] = float(v)
    for k in ("epochs", "steps"):
        if _num(summary.get(k)) is not None:
            row[k] = int(summary[k])
    return row


def collect_rows(study: Study) -> list[dict]:
    """Rows of all finished runs, in study order: the run's own ``metrics.json`` where this
    machine has it, else the row its worker stored (a run finished on another machine)."""
    rows = []
    for run in study.runs:
        row = run_row(run)
        if row is None and run.stored_row is not None:
            row = dict(run.stored_row)
        if row is not None:
            rows.append(row)
    return rows


def write_results(study: Study, rows: list[dict] | None = None, *, plot: bool = True,
                  storage: str | None = None) -> dict[str, Path]:
    """(Re)write ``results.json``, ``results.csv``, ``summary.md`` and ``summary.png``; with
    ``storage``, the runs finished by the workers sharing it count too."""
    if storage is not None:
        sync_finished(study, open_trials(study, storage).get_trials(deepcopy=False))
    rows = collect_rows(study) if rows is None else rows
    out = study.out_dir
    out.mkdir(parents=True, exist_ok=True)
    metrics = metric_columns(rows, study.metrics)
    groups = summarize(rows, metrics, study.confidence)
    pairs = [p for a, b in study.compare for p in paired_differences(rows, a, b, metrics, study.confidence)]
    columns = list(dict.fromkeys(k for r in rows for k in r))
    paths = {"json": out / "results.json", "csv": out / "results.csv", "md": out / "summary.md"}
    payload = {"name": study.name, "runs_total": len(study.runs), "runs_finished": len(rows),
               "confidence": study.confidence, "metrics": metrics, "rows": rows,
               "summary": groups, "compare": pairs}
    write_text_atomic(paths["json"], json.dumps(payload, indent=1, allow_nan=True, default=float) + "\n")
    tmp = out / ".results.csv.tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns or ["benchmark", "variant", "seed"])
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    os.replace(tmp, paths["csv"])
    png = plot_summary(groups, metrics, out / "summary.png", study.confidence) if plot else None
    if png is not None:
        paths["png"] = png
    write_text_atomic(paths["md"], summary_markdown(study, rows, metrics, groups, pairs, png))
    return paths


# --------------------------------------------------------------------------- running
def _prepare_run(run: StudyRun, *, threads: int | None, progress: bool) -> tuple[Any, Path | None]:
    """The run's validated Config (threads/progress filled in) and the checkpoint to resume
    from (a killed run's ``last.pt``); the config is written to the run's study folder.  A
    partial run without ``last.pt`` starts again: the files ``train`` wrote are removed
    (anything else in the directory stays, and ``train`` then refuses it)."""
    raw = copy.deepcopy(run.raw)
    t = raw.setdefault("train", {})
    if threads is not None and t.get("num_threads") is None:
        t["num_threads"] = threads
    t["progress"] = bool(progress and t.get("progress", True))
    cfg = config_from_dict(raw)
    run.record_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run.record_dir / RUN_CONFIG)
    last = run.out_dir / rundir.LAST
    if last.is_file():
        return cfg, last
    if run.out_dir.is_dir():
        rundir.remove_run_files(run.out_dir)
    return cfg, None


def _attempts(run: StudyRun) -> list[dict]:
    """The run's recorded attempts (``.study/<run>/attempts.json``), oldest first."""
    return (_read_json(run.record_dir / RUN_RECORD) or {}).get("attempts", [])


def failed_since(runs: list[StudyRun], attempts_before: dict[str, int]) -> list[str]:
    """The keys of the unfinished ``runs`` whose last attempt after the first
    ``attempts_before[key]`` ones failed (what a worker process recorded and went on from)."""
    failed = []
    for run in runs:
        new = _attempts(run)[attempts_before.get(run.key, 0):]
        if not run.finished and new and str(new[-1].get("status", "")).startswith("failed"):
            failed.append(run.key)
    return failed


def _record_attempt(run: StudyRun, seconds: float, resumed_from: Path | None, status: str) -> None:
    path = run.record_dir / RUN_RECORD
    record = _read_json(path) or {"attempts": []}
    record["attempts"].append({"wall_time_s": round(seconds, 3), "resumed": resumed_from is not None,
                               "status": status, "ended": time.strftime("%Y-%m-%dT%H:%M:%S")})
    record["wall_time_s"] = round(sum(a["wall_time_s"] for a in record["attempts"]), 3)
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")


def _train_run(run: StudyRun, *, threads: int | None, progress: bool) -> str:
    """Train (or resume) one run in this process: ``finished``, ``interrupted`` or ``failed (...)``
    (the exception is written to the run's study folder: one broken run must not stop a study)."""
    from deepmetric.train.loop import NonFiniteLossError, train

    cfg, resume = _prepare_run(run, threads=threads, progress=progress)
    t0 = time.perf_counter()
    status = "failed"
    try:
        result = train(cfg, resume=resume)
        status = "interrupted" if result.interrupted else "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as exc:  # noqa: BLE001 - recorded, the study goes on
        import traceback

        (run.record_dir / RUN_ERROR).write_text(
            f"{type(exc).__name__}: {exc}\n\n" + ("" if isinstance(exc, NonFiniteLossError)
                                                 else traceback.format_exc()))
        status = f"failed ({type(exc).__name__}: {exc})"
    finally:
        _record_attempt(run, time.perf_counter() - t0, resume, status)
    return status


def default_storage(study: Study) -> str:
    return sqlite_url(study.out_dir / "study.db")


def open_trials(study: Study, storage: str | None = None):
    """The Optuna study that holds this study's runs as trials (created on first use): one
    trial per attempt, ``user_attrs["run"]`` its run key, ``user_attrs["row"]`` its results row
    once finished."""
    optuna = optuna_module()
    return optuna.create_study(storage=rdb_storage(storage or default_storage(study), retry_stale=False),
                               study_name=f"study:{study.name}", load_if_exists=True)


def _trial_states(trials) -> dict[str, str]:
    """run key -> "finished" | "running" of the trials that hold it (failed attempts do not)."""
    from optuna.trial import TrialState

    out: dict[str, str] = {}
    for t in trials:
        key = t.user_attrs.get("run")
        if key is None or t.user_attrs.get("duplicate"):
            continue
        if t.state == TrialState.COMPLETE:
            out[key] = "finished"
        elif t.state == TrialState.RUNNING and out.get(key) != "finished":
            out[key] = "running"
    return out


def sync_finished(study: Study, trials) -> None:
    """Mark the runs finished on any machine (a COMPLETE trial) as finished here too."""
    from optuna.trial import TrialState

    done = {t.user_attrs.get("run") for t in trials if t.state == TrialState.COMPLETE}
    rows = {t.user_attrs.get("run"): t.user_attrs.get("row") for t in trials if t.state == TrialState.COMPLETE}
    for run in study.runs:
        run.done_elsewhere = run.key in done
        run.stored_row = rows.get(run.key)


def _claim(ostudy, key: str):
    """A new trial for run ``key``, or None when another worker claimed the run first (the
    storage numbers trials in order: the first live trial of a run owns it)."""
    from optuna.trial import TrialState

    import warnings

    with warnings.catch_warnings():  # ask/tell with the heartbeat: this module records it (Heartbeat)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        trial = ostudy.ask()
    trial.set_user_attr("run", key)
    trial.set_user_attr("machine", socket.gethostname())
    for t in ostudy.get_trials(deepcopy=False):
        if (t.user_attrs.get("run") == key and t.number < trial.number and not t.user_attrs.get("duplicate")
                and t.state in (TrialState.COMPLETE, TrialState.RUNNING)):
            trial.set_user_attr("duplicate", True)
            ostudy.tell(trial, state=TrialState.FAIL)
            return None
    return trial


def run_worker(study: Study, *, storage: str | None = None, only: Sequence[str] | None = None,
               threads: int | None = None, progress: bool = False,
               log: Callable[[str], None] | None = None, on_finished: Callable[[], None] | None = None) -> dict:
    """Train the study's unfinished runs (those under ``only``), one at a time, until every run
    is finished here or on another machine sharing the storage.  A run finished before the
    storage existed (its ``metrics.json``) is recorded as finished without training."""
    optuna_module()  # a clear error when Optuna is missing
    from optuna.trial import TrialState

    log = log or (lambda msg: print(f"[study {study.name}] {msg}", flush=True))
    ostudy = open_trials(study, storage)
    mine = [r for r in study.runs if not only or any(_under(r.key, p) for p in only)]
    finished, failed, interrupted = [], [], False
    tried: set[str] = set()
    while True:
        if draining(study.out_dir):
            log(f"drained ({study.out_dir / DRAIN}): no other run starts here")
            break
        fail_stale_trials(ostudy)  # a dead worker's run is free again (it resumes)
        trials = ostudy.get_trials(deepcopy=False)
        states = _trial_states(trials)
        todo = [r for r in mine if states.get(r.key) is None and r.key not in tried]
        if not todo:
            if any(states.get(r.key) == "running" for r in mine if r.key not in tried):
                time.sleep(HEARTBEAT_S / 2)  # runs of other workers: wait for them (or their staleness)
                continue
            break
        run = todo[0]
        trial = _claim(ostudy, run.key)
        if trial is None:
            continue
        tried.add(run.key)
        if (run.out_dir / rundir.METRICS).is_file():  # finished before (no storage then, or lost)
            row = run_row(run)
            trial.set_user_attr("row", row)
            ostudy.tell(trial, state=TrialState.COMPLETE, values=0.0)
            continue
        log(f"{run.key}: {'resuming' if (run.out_dir / rundir.LAST).is_file() else 'training'}")
        with Heartbeat(ostudy._storage, trial._trial_id):
            status = _train_run(run, threads=threads, progress=progress)
        if status == "finished" and run.finished:
            trial.set_user_attr("row", run_row(run))
            ostudy.tell(trial, state=TrialState.COMPLETE, values=0.0)
            finished.append(run.key)
        else:
            trial.set_user_attr("status", status)
            ostudy.tell(trial, state=TrialState.FAIL)
            if status == "interrupted":
                interrupted = True
                log(f"{run.key}: interrupted (rerun the study to resume it)")
                break
            failed.append(run.key)
        # counted over the runs asked for (``only``), not the whole grid: a seeds phase that trains
        # 59 of a 75-run grid said "[k/75 finished]" and never reached its end
        done = sum(_trial_states(ostudy.get_trials(deepcopy=False)).get(r.key) == "finished" for r in mine)
        log(f"{run.key}: {status}  [{done}/{len(mine)} finished]")
        if on_finished is not None:
            on_finished()
    return {"finished": finished, "failed": failed, "interrupted": interrupted}


def _under(key: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/")  # 'HBN/seed0/', as a shell's completion writes it
    return key == prefix or key.startswith(prefix + "/")


def select_runs(study: Study, only: Sequence[str] | None) -> list:
    """The study's runs under one of the keys ``only`` (all without), by whole path parts; a
    key that matches no run is a ValueError (a typo must not silently shrink the study)."""
    unmatched = [p for p in only or () if not any(_under(r.key, p) for r in study.runs)]
    if unmatched:
        raise ValueError(f"--only {unmatched} matches no run (keys match by whole path parts); "
                         f"runs are e.g. {', '.join(r.key for r in study.runs[:3])}")
    return [r for r in study.runs if not only or any(_under(r.key, p) for p in only)]


def _git_commit(paths: list[Path], message: str, log: Callable[[str], None]) -> None:
    """Commit only the study's result files (``git commit --only``), best effort."""
    files = [str(p.resolve()) for p in paths if p.is_file()]
    if not files:
        return
    cwd = Path(files[0]).parent  # git runs in the repository that holds the study directory
    try:
        subprocess.run(["git", "add", "-f", "--", *files], check=True, capture_output=True, cwd=cwd)
        r = subprocess.run(["git", "commit", "-q", "-m", message, "--only", "--", *files],
                           capture_output=True, text=True, cwd=cwd)
        if r.returncode != 0 and "nothing" not in (r.stdout + r.stderr):
            log(f"git commit failed: {(r.stderr or r.stdout).strip()}")
    except (OSError, subprocess.CalledProcessError) as exc:
        log(f"git commit failed: {exc}")


def _worker_command(study: Study, storage: str, only, overrides: Sequence[str]) -> list[str]:
    if study.path is None:
        raise ValueError("deepmetric study: --workers K > 1 needs the study's file (workers load it)")
    cmd = [sys.executable, "-m", "deepmetric.cli", "study", str(study.path), "--out", str(study.out_dir),
           "--storage", storage, "--worker"]
    if only:
        cmd += ["--only", *only]
    if overrides:
        cmd += ["--set", *overrides]
    return cmd


def run_study(study: Study, *, workers: int | None = None, progress: bool = False,
              commit: bool = False, only: Sequence[str] | None = None, storage: str | None = None,
              overrides: Sequence[str] = (), log: Callable[[str], None] | None = None) -> dict:
    """Train every unfinished run of ``study`` and keep its results up to date.

    The runs are trials of an Optuna storage (``storage``; default ``OUT/study.db``, SQLite):
    ``workers`` processes on this machine (default: the study's ``workers``; each with
    ``cores // workers`` torch threads) and the same command on other machines sharing the
    storage take the unfinished runs one by one; a run whose worker died is taken up again and
    resumes from its ``last.pt`` (on the machine that has it).  ``only`` keeps the runs under one
    of the given keys, by whole path parts (``HBN`` or ``HBN/seed0``); a key that matches no run
    is an error.  ``commit`` commits the result files with git after every finished run.
    Returns ``{"finished", "skipped", "failed", "interrupted", "paths"}``."""
    log = log or (lambda msg: print(f"[study {study.name}] {msg}", flush=True))
    workers = workers or study.workers
    storage = storage or default_storage(study)
    runs = select_runs(study, only)
    ostudy = open_trials(study, storage)  # first: a storage that does not open keeps the drain mark
    clear_drain(study.out_dir, log)  # left by the drain that stopped the last command
    sync_finished(study, ostudy.get_trials(deepcopy=False))
    skipped = [r.key for r in runs if r.finished]
    paths = write_results(study, storage=storage)
    log(f"{len(runs)} runs: {len(skipped)} already finished, {len(runs) - len(skipped)} to train"
        f"; storage {display_storage(storage)}" + (f" ({workers} workers)" if workers > 1 else ""))

    def results_changed(message: str) -> None:
        nonlocal paths
        paths.update(write_results(study, storage=storage))
        if commit:
            _git_commit(list(paths.values()), message, log)

    if workers <= 1:
        result = run_worker(study, storage=storage, only=only, progress=progress, log=log,
                            on_finished=lambda: results_changed(f"study {study.name}: a run finished"))
    else:
        seen = {r.key for r in runs if r.finished}

        def poll() -> None:
            sync_finished(study, open_trials(study, storage).get_trials(deepcopy=False))
            new = [r.key for r in runs if r.finished and r.key not in seen]
            if new:
                seen.update(new)
                for key in new:
                    log(f"{key}: finished  [{sum(r.finished for r in runs)}/{len(runs)} finished]")  # of those asked for
                results_changed(f"study {study.name}: {', '.join(new)} finished")

        attempts_before = {r.key: len(_attempts(r)) for r in runs}  # to tell this command's failures
        codes = run_workers(_worker_command(study, storage, only, overrides), workers,
                            study.out_dir / ".study" / "workers", poll=poll, log=log)
        # a worker records a failed run in the run's attempts and goes on (exit 0): read them back,
        # so that a study whose runs failed ends with exit 1 whatever the number of workers
        result = {"finished": [k for k in seen if k not in skipped], "interrupted": False,
                  "failed": failed_since(runs, attempts_before)
                  + [f"worker exit code {c}" for c in codes if c != 0]}
    sync_finished(study, open_trials(study, storage).get_trials(deepcopy=False))
    paths.update(write_results(study, storage=storage))
    failed = result["failed"]
    if failed:
        log(f"failed runs (see {study.out_dir / '.study'}/<run>/{RUN_ERROR}): {', '.join(failed)}")
    return {"finished": result["finished"], "skipped": skipped, "failed": failed,
            "interrupted": result["interrupted"], "paths": paths}

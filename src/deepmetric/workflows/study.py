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
    workers: 1                            # parallel runs (each a subprocess when > 1)
    metrics: [final/recall@1, final/nmi]  # optional: the columns of the summary tables
    compare: [[HBN, BN]]                  # paired differences A - B (same seed)

A run's config is: the base (or benchmark) config, then ``overrides``, the benchmark's
overrides, the variant's overrides, and finally ``train.seed = seed`` and
``train.out_dir = OUT/[benchmark/]variant/seed<k>``.  Every run is validated before the
first one starts.

A run is *finished* when its ``metrics.json`` exists (``train`` writes it last); a run
directory holding ``last.pt`` but no ``metrics.json`` (a killed run) resumes from that
checkpoint.  Results, rewritten after every run, in ``OUT``:

* ``results.json`` / ``results.csv``: one row per finished run: benchmark, variant, seed,
  ``final/<metric>`` (test metrics of the final model), ``selected/<metric>`` (test metrics
  of the model selected on validation classes, when the run selects one),
  ``wall_time_s`` and ``images_per_s``;
* ``summary.md``: per benchmark and variant the mean +- sample standard deviation and the
  95 % Student-t confidence interval of every metric, the per-run table, and for every
  ``compare`` pair the mean paired difference (same benchmark and seed) with its t interval;
* ``summary.png`` (one panel per summary metric: mean with 95 % CI error bars per variant).

The runner's own files of a run (the resolved ``config.yaml`` it trains, ``attempts.json``
with the wall time of each attempt, ``train_output.txt`` of subprocess runs) are in
``OUT/.study/<run key>/``, so run directories hold only what ``train`` writes.

Statistics (``mean_ci``): for values ``x_1..x_n``, ``mean = sum x_i / n``, ``sd`` with
``n - 1`` in the denominator, and ``mean +- t_{0.975, n-1} sd / sqrt(n)``.  Paired
differences use ``d_i = a_i - b_i`` over the seeds both variants finished.
"""
from __future__ import annotations

import copy
import csv
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from deepmetric.report.study_tables import (metric_columns, paired_differences, plot_summary,
                                            summarize, summary_markdown)
from deepmetric.train import rundir
from deepmetric.train.config import ConfigError, apply_overrides, config_from_dict, save_config
from deepmetric.train.rundir import write_text_atomic

__all__ = ["StudyRun", "Study", "load_study", "run_study", "collect_rows", "write_results", "run_row"]

_STUDY_KEYS = ("name", "description", "base", "overrides", "benchmarks", "variants", "seeds",
               "out_dir", "workers", "metrics", "compare", "confidence")
# The runner's own files of a run live in OUT/.study/<run key>/, never in the run directory
# (train refuses to start a new run in a directory holding foreign files).
RUN_CONFIG = "config.yaml"         # the resolved config of a run, written before it starts
RUN_RECORD = "attempts.json"       # wall time of each attempt
RUN_OUTPUT = "train_output.txt"    # stdout/stderr of a run trained in a subprocess
RUN_ERROR = "error.txt"            # the exception of a failed in-process run


# --------------------------------------------------------------------------- the study file
@dataclass
class StudyRun:
    """One training run of a study."""

    key: str                 # "[benchmark/]variant/seed<k>", also its directory under out_dir
    benchmark: str | None
    variant: str
    seed: int
    out_dir: Path
    raw: dict                # the run's config mapping (validated)

    study_dir: Path | None = None   # OUT/.study/<key>: the runner's files of this run

    @property
    def finished(self) -> bool:
        return (self.out_dir / rundir.METRICS).is_file()

    @property
    def record_dir(self) -> Path:
        return self.study_dir if self.study_dir is not None else self.out_dir


@dataclass
class Study:
    name: str
    path: Path | None
    out_dir: Path
    runs: list[StudyRun]
    variants: list[str]
    benchmarks: list[str | None]
    seeds: list[int]
    workers: int = 1
    metrics: list[str] | None = None
    compare: list[tuple[str, str]] = field(default_factory=list)
    confidence: float = 0.95
    description: str = ""


def _err(where: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: {msg}")


def _read_yaml(path: Path, where: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{where}: config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise _err(where, f"{path}: invalid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise _err(where, f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def _resolve_config(value: Any, study_dir: Path, where: str) -> dict:
    """A config given as a path (relative to the study file, else to the working directory)
    or an inline mapping -> a fresh raw mapping."""
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if isinstance(value, str):
        p = Path(value)
        if not p.is_absolute() and (study_dir / p).is_file():
            p = study_dir / p
        return _read_yaml(p, where)
    raise _err(where, f"expected a config file path or a mapping, got {type(value).__name__} {value!r}")


def _override_strings(items: Any, where: str) -> list[str]:
    """Overrides as ``key=value`` strings; a one-key mapping ``{key: value}`` is accepted too
    (its value is passed on as JSON, which the override parser reads as YAML)."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise _err(where, f"expected a list of overrides, got {type(items).__name__} {items!r}")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if "=" not in item:
                raise _err(f"{where}.{i}", f"expected KEY=VALUE, got {item!r}")
            out.append(item)
        elif isinstance(item, dict) and item:
            out.extend(f"{k}={json.dumps(v)}" for k, v in item.items())
        else:
            raise _err(f"{where}.{i}", f"expected 'key=value' or {{key: value}}, got {item!r}")
    return out


def load_study(path: str | os.PathLike | None = None, *, raw: dict | None = None,
               out_dir: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Study:
    """Read and validate a study file (or an already-read mapping ``raw``, relative paths then
    resolved against the working directory).  Every run's config is built and validated here,
    so a mistake in the last variant is reported before the first run starts.  ``overrides``
    (``key=value``) apply to every run after the variant's (smoke tests: ``train.epochs=1``)."""
    study_path = Path(path) if path is not None else None
    where = str(study_path) if study_path is not None else "study"
    if raw is None:
        if study_path is None:
            raise ValueError("load_study: give a path or raw")
        raw = _read_yaml(study_path, "study")
    study_dir = study_path.parent if study_path is not None else Path(".")
    unknown = sorted(set(raw) - set(_STUDY_KEYS))
    if unknown:
        import difflib

        hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(k, _STUDY_KEYS, 1))
                             else "") for k in unknown]
        raise _err(where, f"unknown study key(s) {', '.join(hints)}; valid keys: {', '.join(_STUDY_KEYS)}")
    name = str(raw.get("name") or (study_path.stem if study_path else "study"))

    variants = raw.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise _err(where, "'variants' must be a mapping NAME -> list of overrides (at least one)")
    for v in variants:
        if not isinstance(v, str) or not v or "/" in v:
            raise _err(where, f"variant name {v!r}: expected a non-empty string without '/'")
    seeds = raw.get("seeds", [0])
    if isinstance(seeds, int):
        seeds = [seeds]
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds)):
        raise _err(where, f"'seeds': expected a list of distinct ints, got {seeds!r}")

    common = _override_strings(raw.get("overrides"), f"{where}: overrides")
    benchmarks_raw = raw.get("benchmarks")
    benches: dict[str | None, tuple[dict, list[str]]] = {}
    if benchmarks_raw is None:
        if raw.get("base") is None:
            raise _err(where, "give 'base' (a config path or mapping) or 'benchmarks'")
        benches[None] = (_resolve_config(raw["base"], study_dir, f"{where}: base"), [])
    else:
        if not isinstance(benchmarks_raw, dict) or not benchmarks_raw:
            raise _err(where, "'benchmarks' must be a mapping NAME -> config (path, mapping or {base, overrides})")
        for b, spec in benchmarks_raw.items():
            bw = f"{where}: benchmarks.{b}"
            if not isinstance(b, str) or not b or "/" in b:
                raise _err(where, f"benchmark name {b!r}: expected a non-empty string without '/'")
            extra: list[str] = []
            if isinstance(spec, dict) and "base" in spec:
                bad = sorted(set(spec) - {"base", "overrides"})
                if bad:
                    raise _err(bw, f"unknown key(s) {bad}; a benchmark is a path, a config mapping or {{base, overrides}}")
                extra = _override_strings(spec.get("overrides"), f"{bw}.overrides")
                spec = spec["base"]
            elif spec is None:
                if raw.get("base") is None:
                    raise _err(bw, "no config and no study 'base' to fall back on")
                spec = raw["base"]
            benches[b] = (_resolve_config(spec, study_dir, bw), extra)

    out = Path(out_dir if out_dir is not None else raw.get("out_dir") or f"runs/studies/{name}")
    workers = raw.get("workers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise _err(where, f"'workers': expected an int >= 1, got {workers!r}")
    confidence = raw.get("confidence", 0.95)
    if not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise _err(where, f"'confidence': expected a number in (0, 1), got {confidence!r}")
    metrics = raw.get("metrics")
    if metrics is not None and (not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics)):
        raise _err(where, f"'metrics': expected a list of column names, got {metrics!r}")
    compare = []
    for i, pair in enumerate(raw.get("compare") or []):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _err(where, f"compare.{i}: expected a pair [A, B] of variant names, got {pair!r}")
        for v in pair:
            if v not in variants:
                raise _err(where, f"compare.{i}: unknown variant {v!r}; variants: {', '.join(variants)}")
        compare.append((pair[0], pair[1]))

    runs = []
    for b, (base_raw, b_over) in benches.items():
        for v, v_items in variants.items():
            v_over = _override_strings(v_items, f"{where}: variants.{v}")
            for s in seeds:
                key = "/".join(p for p in (b, v, f"seed{s}") if p is not None)
                run_dir = out / key
                cfg_raw = copy.deepcopy(base_raw)
                try:
                    apply_overrides(cfg_raw, common + b_over + v_over + list(overrides))
                    apply_overrides(cfg_raw, [f"train.seed={s}", f"train.out_dir={json.dumps(str(run_dir))}"])
                    config_from_dict(copy.deepcopy(cfg_raw))  # validate now
                except ConfigError as exc:
                    raise _err(where, f"run {key}: {exc}") from None
                runs.append(StudyRun(key, b, v, int(s), run_dir, cfg_raw, out / ".study" / key))
    return Study(name=name, path=study_path, out_dir=out, runs=runs, variants=list(variants),
                 benchmarks=list(benches), seeds=[int(s) for s in seeds], workers=workers,
                 metrics=metrics, compare=compare, confidence=float(confidence),
                 description=str(raw.get("description") or ""))


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
    for k in ("epochs", "steps"):
        if _num(summary.get(k)) is not None:
            row[k] = int(summary[k])
    return row


def collect_rows(study: Study) -> list[dict]:
    """Rows of all finished runs, in study order."""
    return [r for r in (run_row(run) for run in study.runs) if r is not None]


def write_results(study: Study, rows: list[dict] | None = None, *, plot: bool = True) -> dict[str, Path]:
    """(Re)write ``results.json``, ``results.csv``, ``summary.md`` and ``summary.png``."""
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
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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


def _record_attempt(run: StudyRun, seconds: float, resumed_from: Path | None, status: str) -> None:
    path = run.record_dir / RUN_RECORD
    record = _read_json(path) or {"attempts": []}
    record["attempts"].append({"wall_time_s": round(seconds, 3), "resumed": resumed_from is not None,
                               "status": status, "ended": time.strftime("%Y-%m-%dT%H:%M:%S")})
    record["wall_time_s"] = round(sum(a["wall_time_s"] for a in record["attempts"]), 3)
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")


def _run_in_process(run: StudyRun, progress: bool) -> str:
    from deepmetric.train.loop import NonFiniteLossError, train

    cfg, resume = _prepare_run(run, threads=None, progress=progress)
    t0 = time.perf_counter()
    status = "failed"
    try:
        result = train(cfg, resume=resume)
        status = "interrupted" if result.interrupted else "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as exc:  # one broken run must not stop a study of hours: record, go on
        import traceback

        (run.record_dir / RUN_ERROR).write_text(
            f"{type(exc).__name__}: {exc}\n\n" + ("" if isinstance(exc, NonFiniteLossError)
                                                 else traceback.format_exc()))
        status = f"failed ({type(exc).__name__}: {exc})"
    finally:
        _record_attempt(run, time.perf_counter() - t0, resume, status)
    return status


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGTERM when the study process dies (even by SIGKILL), so a
    killed study leaves no orphan training behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _run_subprocess(run: StudyRun, threads: int, progress: bool) -> str:
    cfg, resume = _prepare_run(run, threads=threads, progress=progress)
    cmd = [sys.executable, "-m", "deepmetric.cli", "train", str(run.record_dir / RUN_CONFIG)]
    if resume is not None:
        cmd += ["--resume", str(resume)]
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.train.num_threads or threads),
               MKL_NUM_THREADS=str(cfg.train.num_threads or threads))
    t0 = time.perf_counter()
    with open(run.record_dir / RUN_OUTPUT, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                             preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    status = {0: "finished", 130: "interrupted"}.get(rc, f"failed (exit code {rc})")
    _record_attempt(run, time.perf_counter() - t0, resume, status)
    return status


class _StudyLock:
    """An exclusive ``fcntl`` lock on ``OUT/.study.lock``: two processes never run the same
    study directory at once (the lock goes away with the process, even when killed)."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / ".study.lock"
        self.f = None

    def __enter__(self):
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.seek(0)
            holder = self.f.read().strip()
            self.f.close()
            raise OSError(f"study directory {self.path.parent} is in use by another "
                               f"'deepmetric study' process (pid {holder or '?'})") from None
        self.f.truncate(0)
        self.f.write(str(os.getpid()))
        self.f.flush()
        return self

    def __exit__(self, *exc):
        self.f.close()


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


def run_study(study: Study, *, workers: int | None = None, progress: bool = False,
              commit: bool = False, only: Sequence[str] | None = None,
              log: Callable[[str], None] | None = None) -> dict:
    """Train every unfinished run of ``study`` and keep its results up to date.

    ``workers`` (default: the study's) runs in parallel: 1 trains in this process, N > 1
    starts each run as ``python -m deepmetric.cli train`` in a subprocess with
    ``train.num_threads = max(1, cores // N)`` (unless the config sets it).  ``only`` keeps
    the runs under one of the given keys, by whole path parts (``HBN`` or ``HBN/seed0``);
    a key that matches no run is an error.  ``commit`` commits the result files with git after every run.
    Returns ``{"finished", "skipped", "failed", "interrupted", "paths"}``.
    """
    log = log or (lambda msg: print(f"[study {study.name}] {msg}", flush=True))
    workers = workers or study.workers
    def under(key: str, p: str) -> bool:
        return key == p or key.startswith(p.rstrip("/") + "/")

    runs = [r for r in study.runs if not only or any(under(r.key, p) for p in only)]
    unmatched = [p for p in only or () if not any(under(r.key, p) for r in study.runs)]
    if unmatched:  # a typo must not silently shrink the study to the other keys
        raise ValueError(f"--only {unmatched} matches no run (keys match by whole path parts); "
                         f"runs are e.g. {', '.join(r.key for r in study.runs[:3])}")
    todo = [r for r in runs if not r.finished]
    skipped = [r.key for r in runs if r.finished]
    failed: list[str] = []
    finished: list[str] = []
    interrupted = False
    threads = max(1, _cores() // workers)
    with _StudyLock(study.out_dir):
        paths = write_results(study)
        log(f"{len(runs)} runs: {len(skipped)} already finished, {len(todo)} to train"
            + (f" ({workers} workers x {threads} threads)" if workers > 1 else ""))

        def done(run: StudyRun, status: str) -> None:
            nonlocal paths
            (finished if status == "finished" and run.finished else failed).append(run.key)
            paths.update(write_results(study))
            log(f"{run.key}: {status}  [{sum(r.finished for r in study.runs)}/{len(study.runs)} finished]")
            if commit:
                _git_commit(list(paths.values()), f"study {study.name}: {run.key} {status}", log)

        if workers == 1:
            for run in todo:
                log(f"{run.key}: {'resuming' if (run.out_dir / rundir.LAST).is_file() else 'training'}")
                try:
                    status = _run_in_process(run, progress)
                except KeyboardInterrupt:
                    interrupted = True
                    break
                if status == "interrupted":
                    interrupted = True
                    log(f"{run.key}: interrupted (rerun the study to resume it)")
                    break
                done(run, status)
        else:
            pool = ThreadPoolExecutor(max_workers=workers)
            pending = {}
            queue = list(todo)
            try:
                while queue or pending:
                    while queue and len(pending) < workers:
                        run = queue.pop(0)
                        log(f"{run.key}: {'resuming' if (run.out_dir / rundir.LAST).is_file() else 'training'}")
                        pending[pool.submit(_run_subprocess, run, threads, progress)] = run
                    ready, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                    for fut in ready:
                        run = pending.pop(fut)
                        status = fut.result()
                        if status == "interrupted":
                            interrupted = True
                            queue.clear()
                            log(f"{run.key}: interrupted (rerun the study to resume it)")
                        else:
                            done(run, status)
            except KeyboardInterrupt:  # the children got the SIGINT too and checkpoint
                interrupted = True
                queue.clear()
                wait(list(pending))
            finally:
                pool.shutdown(wait=True)
        paths.update(write_results(study))
    if failed:
        log(f"failed runs (see {study.out_dir / '.study'}/<run>/{RUN_OUTPUT} or {RUN_ERROR}): {', '.join(failed)}")
    return {"finished": finished, "skipped": skipped, "failed": failed, "interrupted": interrupted,
            "paths": paths}

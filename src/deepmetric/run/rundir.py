"""The run directory: the files ``deepmetric train`` writes, and the one module that reads and
writes them (``log.jsonl`` is parsed nowhere else).

A run directory (``train.out_dir``) holds:

* ``config.yaml`` (:data:`CONFIG`): the resolved config, every default filled in;
* ``log.jsonl`` (:data:`LOG`): one JSON object per line, appended as the run goes:
  ``{"type": "step"}`` per optimisation step, ``{"type": "eval", "split": "val"|"test"}`` per
  evaluation, ``{"type": "heat_up"}`` per temperature event, ``{"type": "early_stop"}``,
  ``{"type": "baseline"}`` per baseline;
* ``last.pt`` / ``best.pt`` (:data:`LAST`, :data:`BEST`): checkpoints (``best.pt`` only with a
  validation split), written atomically by :mod:`deepmetric.run.checkpoint`;
* ``wise.pt`` (:data:`WISE`): with ``eval.wise_ft``, the WiSE-FT mixture chosen on validation
  (weights only: embed / index / export load it like ``last.pt``; it does not resume);
* ``metrics.json`` (:data:`METRICS`): the run's summary, written last (a run is finished when
  it exists);
* with ``train.loggers`` (:mod:`deepmetric.train.tracking`): ``tensorboard/`` (event files),
  ``tracking.json`` (which MLflow run mirrors this one) and, with the default MLflow store,
  ``mlflow.db`` and ``mlartifacts/``.

Only rank 0 writes.  On resume the records a killed run wrote after its last checkpoint are
dropped (:func:`truncate_log`), so the log always matches the checkpoint it continues from.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Callable, Iterable

from deepmetric.data.files import file_digest

__all__ = [
    "CONFIG", "LOG", "LAST", "BEST", "WISE", "METRICS", "TRACKING", "TENSORBOARD", "MLFLOW_DB", "MLFLOW_ARTIFACTS",
    "RUN_FILES", "RUN_DIRS", "CONFIG_NAMES",
    "RunDirectoryError", "prepare_run_dir", "folders_removed_on_failure", "remove_run_files", "remove_stale_temporaries", "looks_like_run_dir",
    "RunLog", "read_log", "rewrite_log", "truncate_log", "drop_eval_records",
    "final_evaluation_saved", "baselines_from_log", "median_images_per_s",
    "read_metrics", "write_metrics", "write_text_atomic",
]

CONFIG = "config.yaml"
LOG = "log.jsonl"
LAST = "last.pt"
BEST = "best.pt"
WISE = "wise.pt"
METRICS = "metrics.json"
TRACKING = "tracking.json"
TENSORBOARD = "tensorboard"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"
#: what a run writes into its directory (``--overwrite`` removes these and nothing else)
RUN_FILES = (CONFIG, LOG, LAST, BEST, WISE, METRICS, TRACKING, MLFLOW_DB)
#: the folders a run writes (the trackers'), removed with the files
RUN_DIRS = (TENSORBOARD, MLFLOW_ARTIFACTS)
#: config file names a run directory may carry (older tools wrote the other two)
CONFIG_NAMES = (CONFIG, "config.yml", "resolved_config.yaml")


# --------------------------------------------------------------------------- the directory
class RunDirectoryError(ValueError):
    """A new run was pointed at a directory that already holds files."""


def remove_run_files(out_dir: Path, keep_checkpoint: bool = False) -> None:
    """Remove what a run wrote into ``out_dir`` (and temporary files a killed checkpoint save
    left behind); anything else in the directory stays."""
    for name in RUN_FILES:
        if not (keep_checkpoint and name == LAST):
            (out_dir / name).unlink(missing_ok=True)
        for tmp in out_dir.glob(f".{name}.*.tmp"):  # checkpoint.save_checkpoint, write_text_atomic
            tmp.unlink(missing_ok=True)
    for suffix in ("-journal", "-wal", "-shm"):  # SQLite's: a stale one would be replayed into a new store
        (out_dir / f"{MLFLOW_DB}{suffix}").unlink(missing_ok=True)
    for name in RUN_DIRS:
        if (out_dir / name).is_dir():
            shutil.rmtree(out_dir / name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


#: an untagged temporary file (written by an older deepmetric) older than this is stale
STALE_UNTAGGED_S = 600


def remove_stale_temporaries(out_dir: Path) -> list[str]:
    """Remove the ``.NAME.PID.*.tmp`` files (:func:`write_text_atomic`,
    ``checkpoint.save_checkpoint``) whose writing process is gone: what a run killed while
    saving leaves behind. A file of a live process is kept; one without a PID (an older
    deepmetric) only when it is older than :data:`STALE_UNTAGGED_S`. Returns the names removed."""
    removed = []
    for name in RUN_FILES:
        for tmp in out_dir.glob(f".{name}.*.tmp"):
            tag = tmp.name[len(name) + 2:-len(".tmp")].split(".")[0]
            if tag.isdigit():
                stale = int(tag) != os.getpid() and not _pid_alive(int(tag))
            else:
                try:
                    stale = time.time() - tmp.stat().st_mtime > STALE_UNTAGGED_S
                except FileNotFoundError:
                    continue
            if stale:
                tmp.unlink(missing_ok=True)
                removed.append(tmp.name)
    return removed


def _same_run(out_dir: Path, resume) -> bool:
    """Whether the ``resume`` checkpoint is this directory's own: it lies in ``out_dir``, or it
    is a byte-identical copy of ``out_dir/last.pt``."""
    ckpt = Path(resume)
    try:
        if ckpt.resolve().parent == out_dir.resolve():
            return True
        own = out_dir / LAST
        if own.is_file() and ckpt.is_file() and own.stat().st_size == ckpt.stat().st_size:
            return file_digest(own).digest() == file_digest(ckpt).digest()
    except OSError:
        return False
    return False


@contextmanager
def folders_removed_on_failure(folder: Path | None):
    """Around a command that makes ``folder`` (with its parents) before its work: when the work
    fails, each folder that did not exist before is removed again, deepest first, while it is
    still empty, so that a failed command leaves nothing behind (``None``: nothing to do)."""
    new = []
    here = Path(folder).absolute() if folder is not None else None
    while here is not None and not here.exists() and here != here.parent:
        new.append(here)
        here = here.parent
    try:
        yield
    except BaseException:
        for made in new:
            if made.is_dir() and not any(made.iterdir()):
                with suppress(OSError):  # another process (a torchrun rank) may remove it first
                    made.rmdir()
        raise


def prepare_run_dir(out_dir: Path, *, resume, overwrite: bool) -> bool:
    """Create ``out_dir``.  A new run refuses a non-empty directory (the report would mix
    runs) unless ``overwrite`` or ``resume`` of this directory's own checkpoint; a ``resume``
    of another run's checkpoint into a non-empty directory needs ``overwrite`` too (it would
    replace this run's ``last.pt`` and splice the logs).  Temporary files of a killed save are
    removed first (:func:`remove_stale_temporaries`).  Returns whether the previous run's files
    are to go: the caller removes them (:func:`remove_run_files`) once the new run has passed
    every check, so a run that fails while it is being built loses nothing."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirectoryError(f"config key 'train.out_dir': {out_dir} is a file, not a directory")
    if resume is not None and not Path(resume).is_file():  # before it could be taken for another run's
        raise FileNotFoundError(f"--resume {resume}: no such file" if not Path(resume).exists()
                                else f"--resume {resume}: not a file (a checkpoint such as {out_dir / LAST})")
    if out_dir.is_dir():
        remove_stale_temporaries(out_dir)
    existing = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if existing and resume is not None and not _same_run(out_dir, resume):
        if not overwrite:
            shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
            raise RunDirectoryError(
                f"--resume {resume} is another run's checkpoint, but train.out_dir {out_dir} already holds "
                f"a run ({shown}); continuing there would replace its last.pt and splice the two logs. "
                f"Choose an empty train.out_dir=..., resume that run's own checkpoint "
                f"({out_dir / LAST}), or add --overwrite to replace it")
        clear = True
    elif existing and resume is None:
        if not overwrite:
            shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
            hint = f" --resume {out_dir / LAST}" if (out_dir / LAST).is_file() else ""
            raise RunDirectoryError(
                f"run directory {out_dir} is not empty ({shown}); a new run would mix its log and "
                f"checkpoints with the old ones. Continue the old run with{hint or ' --resume CHECKPOINT'}, "
                f"replace it with --overwrite (train(cfg, overwrite=True)), or choose another "
                f"train.out_dir=...")
        clear = True
    else:
        clear = False
    out_dir.mkdir(parents=True, exist_ok=True)
    return clear


def looks_like_run_dir(path: Path) -> bool:
    """Whether ``path`` holds at least one file a training run writes."""
    return any((path / n).is_file() for n in (*RUN_FILES, *CONFIG_NAMES))


# --------------------------------------------------------------------------- log.jsonl
class RunLog:
    """Append-only JSON-lines log of a run (``path=None``: a no-op, for ranks other than 0).

    Every record is flushed as it is written, so a killed run loses at most its last line.
    ``sinks`` (the experiment trackers of :mod:`deepmetric.train.tracking`) get every record
    too, :meth:`checkpointed` after each ``last.pt`` and :meth:`finish` at the end of the run;
    leaving the ``with`` block on an exception hands it to them (``abort``)."""

    def __init__(self, path: Path | None, sinks: Iterable = ()):
        self.f = open(path, "a", encoding="utf-8") if path is not None else None
        self.sinks = list(sinks)

    def write(self, record: dict) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record, default=float) + "\n")
            self.f.flush()
        for sink in self.sinks:
            sink.write(record)

    def checkpointed(self) -> None:
        """``last.pt`` was written: the records so far will survive a resume."""
        for sink in self.sinks:
            sink.checkpointed()

    def finish(self, run_dir: Path, *, interrupted: bool) -> None:
        """The run ended (``metrics.json`` written unless ``interrupted``): the sinks close."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.finish(run_dir, interrupted=interrupted)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        sinks, self.sinks = self.sinks, []
        for sink in sinks if exc is not None else ():
            sink.abort(exc)


def _log_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path / LOG if path.is_dir() else path


def read_log(path: str | os.PathLike, *, type: str | None = None, strict: bool = False) -> list[dict]:
    """The records of a run's ``log.jsonl`` (``path``: the file or its run directory), in order;
    ``type`` keeps only the records of that type (``"step"``, ``"eval"``, ...).

    A truncated last line (a run killed while writing it) is skipped.  Other malformed lines are
    skipped too, unless ``strict``: then they raise a ``ValueError`` naming the file and line,
    and the skipped last line is reported as a warning.  A missing file is an empty log unless
    ``strict`` (``FileNotFoundError``)."""
    path = _log_path(path)
    if not path.is_file():
        if strict:
            raise FileNotFoundError(f"training log not found: {path}")
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if strict and i != last:
                raise ValueError(f"{path}:{i + 1}: not valid JSON ({exc.msg}): {line[:80]!r}") from None
            if strict:
                warnings.warn(f"{path}:{i + 1}: skipping truncated last line ({exc.msg})")
            continue
        if not isinstance(rec, dict):
            if strict:
                raise ValueError(f"{path}:{i + 1}: expected a JSON object, got {rec.__class__.__name__}")
            continue
        if type is None or rec.get("type") == type:
            out.append(rec)
    return out


def rewrite_log(path: str | os.PathLike, drop: Callable[[dict], bool]) -> None:
    """Rewrite the log without the records for which ``drop(record)`` is true and without
    unreadable lines (a truncated last line of a killed run); atomic."""
    path = _log_path(path)
    if not path.is_file():
        return
    keep = [json.dumps(rec, default=float) for rec in read_log(path) if not drop(rec)]
    write_text_atomic(path, "".join(line + "\n" for line in keep))


def truncate_log(run_dir: str | os.PathLike, iteration: int, epoch: int, heat_ups: int | None = None) -> None:
    """On resume, drop the records a killed run wrote after its last checkpoint: steps after
    ``iteration``; evaluations and an early stop after ``epoch`` (the early stop is decided
    again when that epoch is trained again); heat-ups beyond the checkpoint's ``heat_ups``
    events (a heat-up at the start of an epoch comes after the checkpoint of the epoch before,
    with the same epoch number, and fires again on resume), by epoch when not given."""
    def drop(rec: dict) -> bool:
        kind = rec.get("type")
        if kind == "step":
            return rec.get("step", 0) > iteration
        if kind == "heat_up" and heat_ups is not None and isinstance(rec.get("event"), int):
            return rec["event"] > heat_ups
        return kind in ("eval", "heat_up", "early_stop") and rec.get("epoch", 0) > epoch

    rewrite_log(run_dir, drop)


def drop_eval_records(run_dir: str | os.PathLike, epoch: int) -> None:
    """Remove a partial evaluation's records of ``epoch`` (it is about to be redone)."""
    rewrite_log(run_dir, lambda rec: rec.get("type") == "eval" and rec.get("epoch") == epoch)


def final_evaluation_saved(records: list[dict], epoch: int, splits: Iterable[str], test_metrics: dict) -> bool:
    """Whether epoch ``epoch`` was evaluated on every split and the checkpoint's test metrics
    are that evaluation's (not an earlier one's); a run without a test split (``eval.split:
    null``) passes its validation metrics, compared with the ``val`` record."""
    splits = list(splits)
    at = {r.get("split"): r for r in records if r.get("type") == "eval" and r.get("epoch") == epoch}
    if not splits or not set(splits) <= set(at):
        return False
    if "test" not in splits:  # eval.test false: validation alone is the final evaluation
        return True
    if not test_metrics:
        return False
    return all(at["test" if "test" in splits else splits[0]].get(k) == v for k, v in test_metrics.items())


def baselines_from_log(records: list[dict]) -> dict[str, dict]:
    """The ``{"type": "baseline"}`` records of a run, as ``compute_baselines`` returns them:
    ``{name: {"label", "metrics"}}`` or ``{name: {"label", "skipped"}}``."""
    out = {}
    for rec in records:
        if rec.get("type") == "baseline":
            rest = {k: v for k, v in rec.items()
                    if k not in ("type", "name", "label", "split", "epoch", "step", "skipped")}
            out[rec["name"]] = ({"label": rec.get("label"), "skipped": rec["skipped"]} if "skipped" in rec
                                else {"label": rec.get("label"), "metrics": rest})
    return out


def median_images_per_s(records: list[dict]) -> float | None:
    """Median ``images_per_s`` of the training steps (evaluation time excluded), None without."""
    values = sorted(float(r["images_per_s"]) for r in records
                    if r.get("type") == "step" and isinstance(r.get("images_per_s"), (int, float))
                    and not isinstance(r.get("images_per_s"), bool))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


# --------------------------------------------------------------------------- metrics.json
def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: a reader never
    sees half a file, and a crash leaves the previous version."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:  # the error names the file asked for, not the hidden temporary
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise OSError(f"{path}: cannot write there ({exc.strerror or exc})") from None


def write_metrics(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write the run summary ``metrics.json`` (atomically; it marks the run finished)."""
    path = Path(run_dir) / METRICS
    write_text_atomic(path, json.dumps(summary, indent=2, default=float))
    return path


def read_metrics(run_dir: str | os.PathLike, *, strict: bool = True) -> dict | None:
    """``RUN_DIR/metrics.json`` as a dict, None when it is missing.  An unreadable file is a
    ``ValueError`` naming it (``strict``) or None."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        if not strict:
            return None
        where = f", line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise ValueError(f"{path}: not valid JSON ({msg}{where})") from None
    if not isinstance(data, dict):
        if not strict:
            return None
        raise ValueError(f"{path}: expected a JSON object, got {data.__class__.__name__}")
    return data

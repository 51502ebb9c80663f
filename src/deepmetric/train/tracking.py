"""Experiment trackers: TensorBoard and MLflow see what ``log.jsonl`` records (docs/tracking.md).

``train.loggers: [tensorboard, mlflow]`` adds trackers to the run's :class:`~deepmetric.train.
rundir.RunLog`: every record written to ``log.jsonl`` is also given to each tracker, which turns
it into scalars against the optimisation step (:func:`record_scalars`):

* ``{"type": "step"}``: its numbers under their log names (``loss``, ``loss/<i>_<name>``, ``lr``,
  ``alpha``, ``images_per_s``, ``epoch``);
* ``{"type": "eval"}``: the metrics prefixed by the split (``val/recall@1``, ``test/map@r``,
  ``test/eval_seconds``);
* ``{"type": "baseline"}``: ``baseline/<name>/<metric>`` at step 0.

The resolved config is logged as hyperparameters (flattened keys, ``optim.lr``), and the summary
of ``metrics.json`` as the final metrics (:func:`final_scalars`).  MLflow also stores
``last.pt``, ``best.pt``, ``metrics.json``, ``config.yaml``, ``log.jsonl`` and ``report/`` (when
it exists) as artifacts.  ``log.jsonl`` stays the source of truth: the trackers are views of it.

Resume.  On resume ``log.jsonl`` loses what a killed run wrote after its last checkpoint
(:func:`~deepmetric.run.rundir.truncate_log`), and the trackers follow it:

* TensorBoard gets its event files rewritten from the kept log (new file first, then the old
  files are removed), so the ``tensorboard/`` folder holds exactly ``log.jsonl``'s points;
* MLflow receives a run's points only when ``last.pt`` is written (and when a run ends or
  fails), so a killed run has sent nothing past its last checkpoint and the same MLflow run
  goes on.  Every batch carries the metric ``sync/log_records`` (how many ``log.jsonl`` records
  MLflow holds), committed with the points: a run killed while sending gets the missing
  records on resume, none twice.  A run that failed (an exception) sent its last points past
  the checkpoint; resumed, it gets a new MLflow run with the kept log replayed, and the old
  one is deleted (``mlflow gc`` removes it for good, ``mlflow runs restore`` brings it back).

Only rank 0 tracks.  The libraries are imported only when their logger is enabled; a missing
one is an error naming the extra to install, before anything is built
(:func:`check_loggers`).  A tracker that fails during training prints one warning and stops;
training and ``log.jsonl`` go on.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import math
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deepmetric.errors import MissingPackageError
from deepmetric.run import rundir as R
from deepmetric.run.config import Config
from deepmetric.run.config_io import flatten_config

__all__ = ["LOGGERS", "SYNC_METRIC", "TRACKING_EXTRA", "MlflowTracker", "TensorBoardTracker", "check_loggers",
           "ensure_mlflow_experiment", "final_scalars", "hyperparameters", "log_report", "mlflow_key",
           "mlflow_tracking_uri", "open_trackers", "read_tracking", "record_scalars"]

#: logger name -> (module to import, package to install)
LOGGERS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow-skinny")}
TRACKING_EXTRA = "pip install 'deepmetric[tracking]'"
#: the MLflow metric that counts the log.jsonl records a run holds (committed with the points)
SYNC_METRIC = "sync/log_records"
_EVAL_META = ("step", "epoch", "alpha")  # an eval's alpha repeats the step records' alpha
_MLFLOW_BATCH = 1000                      # MLflow's limit of metrics per log_batch
_MLFLOW_PARAMS_BATCH = 100                # and of params / tags
_MLFLOW_PARAM_LENGTH = 6000               # the longest param value MLflow keeps


def check_loggers(loggers: Iterable[str]) -> None:
    """Fail before anything is built when a logger's library is missing."""
    for name in loggers:
        module, package = LOGGERS[name]
        if importlib.util.find_spec(module) is None:
            raise MissingPackageError(f"config key 'train.loggers' names {name!r}, but the {package} package is not "
                              f"installed: {TRACKING_EXTRA} (or remove {name!r} from train.loggers)")


# --------------------------------------------------------------------------- what is logged
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def record_scalars(record: dict) -> tuple[int, dict[str, float]]:
    """``(step, {tag: value})``: the scalars a ``log.jsonl`` record becomes (see the module
    docstring); records without scalars (heat-ups, early stops, skipped baselines) give ``{}``."""
    kind, step = record.get("type"), int(record.get("step", 0))
    numbers = {k: float(v) for k, v in record.items() if _number(v)}
    if kind == "step":
        return step, {k: v for k, v in numbers.items() if k != "step"}
    if kind == "eval":
        split = record.get("split", "test")
        return step, {f"{split}/{k}": v for k, v in numbers.items() if k not in _EVAL_META}
    if kind == "baseline" and "skipped" not in record:
        return step, {f"baseline/{record.get('name')}/{k}": v for k, v in numbers.items()
                      if k not in ("step", "epoch")}
    return step, {}


def final_scalars(summary: dict) -> tuple[int, dict[str, float]]:
    """``(last step, {tag: value})`` from ``metrics.json``: ``final/<split>/<metric>`` (the last
    evaluation), ``best/val/<metric>``, ``best/epoch`` and ``best/test/<metric>`` (the checkpoint
    ``best.pt`` holds), ``train_images_per_s`` and ``wall_time_s``."""
    out: dict[str, float] = {}
    for split, metrics in (summary.get("final") or {}).items():
        out.update({f"final/{split}/{k}": float(v) for k, v in (metrics or {}).items() if _number(v)})
    selected = summary.get("selected") or {}
    if _number(selected.get("value")):
        out[f"best/val/{selected.get('metric')}"] = float(selected["value"])
    if _number(selected.get("epoch")):
        out["best/epoch"] = float(selected["epoch"])
    out.update({f"best/test/{k}": float(v) for k, v in (selected.get("test") or {}).items() if _number(v)})
    for key in ("train_images_per_s", "wall_time_s"):
        if _number(summary.get(key)):
            out[key] = float(summary[key])
    return int(summary.get("steps") or 0), out


def hyperparameters(cfg: Config) -> dict[str, str | int | float | bool]:
    """The resolved config, flattened (``optim.lr``, ``loss.0.options.alpha``); values other than
    strings, numbers and bools (lists, null, empty mappings) as JSON text."""
    return {k: v if isinstance(v, (str, int, float, bool)) else json.dumps(v)
            for k, v in flatten_config(cfg).items()}


def mlflow_key(tag: str) -> str:
    """An MLflow metric / param name for ``tag``: MLflow allows letters, digits and ``_-. /:``,
    so ``@`` becomes ``_at_`` (``val/recall@1`` -> ``val/recall_at_1``) and any other character ``_``."""
    return re.sub(r"[^\w.\- /:]", "_", tag.replace("@", "_at_"))


def _warn(message: str) -> None:
    print(f"[deepmetric] warning: {message}", flush=True)


class _Tracker:
    """What :class:`~deepmetric.run.rundir.RunLog` calls.  A failure during training prints
    one warning and switches the tracker off (``log.jsonl`` has every record anyway)."""

    name = "tracker"

    def __init__(self):
        self.failed = False

    def _guard(self, what: str, fn, *args) -> None:
        if self.failed:
            return
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - a tracker must not stop the training
            self.failed = True
            _warn(f"{self.name} stopped ({what} failed: {type(exc).__name__}: {exc}); training goes on, "
                  f"log.jsonl has every record")
            with contextlib.suppress(Exception):
                self._stop()

    def write(self, record: dict) -> None:
        self._guard("logging a record", self._write, record)

    def checkpointed(self) -> None:
        self._guard("sending the points up to the checkpoint", self._checkpointed)

    def finish(self, run_dir: Path, *, interrupted: bool) -> None:
        self._guard("closing the run", self._finish, Path(run_dir), interrupted)

    def abort(self, exc: BaseException) -> None:
        self._guard("closing the failed run", self._abort, exc)

    def _write(self, record: dict) -> None: ...
    def _stop(self) -> None: ...  # after a failure: release what can be released
    def _checkpointed(self) -> None: ...
    def _finish(self, run_dir: Path, interrupted: bool) -> None: ...
    def _abort(self, exc: BaseException) -> None: ...


# --------------------------------------------------------------------------- TensorBoard
class TensorBoardTracker(_Tracker):
    """Event files in ``OUT/tensorboard`` (``tensorboard --logdir OUT`` or a folder of runs).

    Scalars are stored as float32 (TensorBoard's scalar format); the config is one hparams
    session (the HParams dashboard), the final metrics are scalars at the last step.  On resume
    the folder is rewritten from the kept ``log.jsonl`` (``records``): the points a killed run
    wrote after its last checkpoint disappear, with every TensorBoard data loader.  The
    rewritten points carry the wall time of the resume."""

    name = "TensorBoard"

    def __init__(self, cfg: Config, out_dir: Path, records: list[dict]):
        super().__init__()
        from tensorboard.plugins.hparams import summary_v2
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(out_dir) / R.TENSORBOARD
        old = sorted(self.logdir.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(str(self.logdir), flush_secs=30)
        self.writer.file_writer.add_summary(summary_v2.hparams_pb(hyperparameters(cfg), start_time_secs=time.time()))
        for record in records:
            self._write(record)
        self.writer.flush()
        for path in old:  # the new file holds the kept log: the old ones may go
            path.unlink(missing_ok=True)

    def _write(self, record: dict) -> None:
        step, scalars = record_scalars(record)
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def _checkpointed(self) -> None:
        self.writer.flush()

    def _finish(self, run_dir: Path, interrupted: bool) -> None:
        summary = None if interrupted else R.read_metrics(run_dir, strict=False)
        if summary:
            step, scalars = final_scalars(summary)
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
        self.writer.close()

    def _abort(self, exc: BaseException) -> None:
        self.writer.close()

    def _stop(self) -> None:
        self.writer.close()


# --------------------------------------------------------------------------- MLflow
def mlflow_tracking_uri(cfg: Config) -> str:
    """``train.tracking.mlflow_uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///OUT/mlflow.db``
    (absolute): a SQLite file in the run directory, MLflow's local store without a server (its
    older ``./mlruns`` file store is frozen and refused by default since MLflow 3.7)."""
    uri = cfg.train.tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{(Path(cfg.train.out_dir) / R.MLFLOW_DB).resolve()}"


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other stores and in-memory ones)."""
    if not uri.startswith("sqlite:///") or uri[len("sqlite:///"):] in ("", ":memory:"):
        return None
    return Path(uri[len("sqlite:///"):].split("?", 1)[0])


@contextlib.contextmanager
def _store_lock(uri: str):
    """Serialise creating a SQLite store and its experiments across processes (tune workers on
    one machine): two processes creating the tables at once fail."""
    path = _sqlite_path(uri)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _import_mlflow():
    try:
        import mlflow  # noqa: F401
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise MissingPackageError(f"train.loggers names 'mlflow', but MLflow cannot be imported ({exc}): "
                          f"{TRACKING_EXTRA}") from exc
    return MlflowClient


def ensure_mlflow_experiment(tracking_uri: str, name: str) -> str:
    """The id of MLflow experiment ``name`` in the store ``tracking_uri``, created if missing (a
    SQLite store's tables too).  With a local SQLite store the experiment's artifacts go to
    ``mlartifacts/`` beside the database file (MLflow's default would be ``./mlruns`` in the
    current directory).  Every MLflow tracker calls it, under a lock on the store's folder."""
    MlflowClient = _import_mlflow()
    with _store_lock(tracking_uri):
        client = MlflowClient(tracking_uri=tracking_uri)
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            db = _sqlite_path(tracking_uri)
            root = (db.resolve().parent / R.MLFLOW_ARTIFACTS).as_uri() if db is not None else None
            return client.create_experiment(name, artifact_location=root)
    if experiment.lifecycle_stage != "active":
        raise ValueError(f"MLflow experiment {name!r} in {tracking_uri} is deleted: restore it (mlflow "
                         f"experiments restore --experiment-id {experiment.experiment_id}) or choose "
                         f"another train.tracking.experiment")
    return experiment.experiment_id


def read_tracking(run_dir: str | os.PathLike) -> dict:
    """``RUN_DIR/tracking.json`` (``{"mlflow": {"tracking_uri", "experiment_id", "run_id"}}``),
    ``{}`` when missing or unreadable."""
    path = Path(run_dir) / R.TRACKING
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class MlflowTracker(_Tracker):
    """One MLflow run per training run (``tracking.json`` in the run directory names it).

    Points wait in memory until ``last.pt`` is written (:meth:`checkpointed`), then go in
    batches with :data:`SYNC_METRIC`; see the module docstring for resume."""

    name = "MLflow"

    def __init__(self, cfg: Config, out_dir: Path, records: list[dict], resumed: bool):
        super().__init__()
        from mlflow.entities import Metric, Param, RunTag

        MlflowClient = _import_mlflow()
        self.Metric, self.Param, self.RunTag = Metric, Param, RunTag
        self.out_dir = Path(out_dir)
        tc = cfg.train.tracking
        self.uri = mlflow_tracking_uri(cfg)
        experiment = tc.experiment or cfg.name
        self.experiment_id = ensure_mlflow_experiment(self.uri, experiment)
        self.client = MlflowClient(tracking_uri=self.uri)
        params = {mlflow_key(k): (v if isinstance(v, str) else json.dumps(v))[:_MLFLOW_PARAM_LENGTH]
                  for k, v in hyperparameters(cfg).items()}
        tags = {mlflow_key(str(k)): str(v) for k, v in tc.tags.items()}
        tags["deepmetric.out_dir"] = str(self.out_dir.resolve())

        run, sent = self._previous_run(records) if resumed else (None, 0)
        if run is None:
            run = self.client.create_run(self.experiment_id, run_name=tc.run_name or self.out_dir.resolve().name,
                                         tags=tags)
            self._log_params(run.info.run_id, params, {})
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
            if "deepmetric.error" in run.data.tags:  # failed at a checkpoint, continued now
                self.client.delete_tag(run.info.run_id, "deepmetric.error")
            self._log_params(run.info.run_id, params, run.data.params)
        self.run_id, self.start_time = run.info.run_id, run.info.start_time
        self.experiment_id = run.info.experiment_id  # a continued run stays where it was
        R.write_text_atomic(self.out_dir / R.TRACKING, json.dumps(
            {"mlflow": {"tracking_uri": self.uri, "experiment_id": self.experiment_id, "run_id": self.run_id}},
            indent=2) + "\n")
        self.pending: list[tuple[list, int]] = []  # (points of one record, records held after it)
        self.records = sent
        for record in records[sent:]:              # what MLflow lacks of the kept log
            self._write(record)
        self._send()

    def _previous_run(self, records: list[dict]):
        """The MLflow run a resumed run continues and how many records it holds; ``(None, 0)``
        when there is none, and after deleting it when it holds more than the kept log."""
        from mlflow.exceptions import MlflowException

        info = read_tracking(self.out_dir).get("mlflow") or {}
        if info.get("tracking_uri") != self.uri or not info.get("run_id"):
            return None, 0
        try:
            run = self.client.get_run(info["run_id"])
        except MlflowException:
            return None, 0
        if run.info.lifecycle_stage != "active":
            return None, 0
        sent = int(run.data.metrics.get(SYNC_METRIC, 0))
        if sent > len(records):
            print(f"[deepmetric] MLflow run {run.info.run_id} holds {sent - len(records)} record(s) written after "
                  f"the checkpoint (the run failed); it is deleted and a new run gets the kept log", flush=True)
            self.client.delete_run(run.info.run_id)
            return None, 0
        return run, sent

    def _log_params(self, run_id: str, params: dict[str, str], existing: dict[str, str]) -> None:
        """Params are immutable in MLflow: a resumed run logs the missing ones and records a
        changed value as the tag ``resumed_with.<key>``."""
        new = [self.Param(k, v) for k, v in params.items() if k not in existing]
        changed = [self.RunTag(f"resumed_with.{k}", v) for k, v in params.items()
                   if k in existing and existing[k] != v]
        for i in range(0, len(new), _MLFLOW_PARAMS_BATCH):
            self.client.log_batch(run_id, params=new[i:i + _MLFLOW_PARAMS_BATCH])
        for i in range(0, len(changed), _MLFLOW_PARAMS_BATCH):
            self.client.log_batch(run_id, tags=changed[i:i + _MLFLOW_PARAMS_BATCH])

    def _write(self, record: dict) -> None:
        step, scalars = record_scalars(record)
        now = int(time.time() * 1000)
        self.records += 1
        self.pending.append(([self.Metric(mlflow_key(k), v, now, step) for k, v in scalars.items()], self.records))

    def _send(self) -> None:
        """Send the waiting points: batches of whole records, each with the count of records
        MLflow then holds (one commit in MLflow's SQL store)."""
        batch: list = []
        held = None
        for points, count in self.pending:
            if batch and len(batch) + len(points) >= _MLFLOW_BATCH:
                self._log_points(batch, held)
                batch = []
            for i in range(0, len(points), _MLFLOW_BATCH - 1):  # (a record of > 999 numbers)
                batch.extend(points[i:i + _MLFLOW_BATCH - 1])
                if len(batch) >= _MLFLOW_BATCH - 1:
                    self._log_points(batch, held)
                    batch = []
            held = count
        if held is not None:
            self._log_points(batch, held)
        self.pending = []

    def _log_points(self, points: list, held: int | None) -> None:
        if held is not None:
            points = points + [self.Metric(SYNC_METRIC, float(held), int(time.time() * 1000), held)]
        if points:
            self.client.log_batch(self.run_id, metrics=points)

    def _checkpointed(self) -> None:
        self._send()

    def _finish(self, run_dir: Path, interrupted: bool) -> None:
        self._send()
        summary = None if interrupted else R.read_metrics(run_dir, strict=False)
        if summary:
            step, scalars = final_scalars(summary)
            # the run's start time as timestamp: logged again (a finished run resumed), the
            # same points are merged by MLflow instead of repeated
            points = [self.Metric(mlflow_key(k), v, self.start_time, step) for k, v in scalars.items()
                      if math.isfinite(v)]
            for i in range(0, len(points), _MLFLOW_BATCH):
                self.client.log_batch(self.run_id, metrics=points[i:i + _MLFLOW_BATCH])
            for name in (R.LAST, R.BEST, R.METRICS, R.CONFIG, R.LOG):
                if (run_dir / name).is_file():
                    self.client.log_artifact(self.run_id, str(run_dir / name))
            if (run_dir / "report").is_dir():
                self.client.log_artifacts(self.run_id, str(run_dir / "report"), "report")
        self.client.set_terminated(self.run_id, "KILLED" if interrupted else "FINISHED")

    def _abort(self, exc: BaseException) -> None:
        self._send()  # what led to the failure (a pruned trial's last validation) is kept
        self.client.set_tag(self.run_id, "deepmetric.error", f"{type(exc).__name__}: {exc}"[:5000])
        self.client.set_terminated(self.run_id, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")


def log_report(run_dir: str | os.PathLike, report_dir: str | os.PathLike | None = None) -> str | None:
    """Store a run's report folder (default ``RUN_DIR/report``, written by ``deepmetric report``
    after training) in the run's MLflow run as ``report/``; returns the MLflow run id, None when
    the run has no MLflow run or no report."""
    info = read_tracking(run_dir).get("mlflow") or {}
    report = Path(report_dir) if report_dir is not None else Path(run_dir) / "report"
    if not info.get("run_id") or not report.is_dir():
        return None
    MlflowClient = _import_mlflow()
    MlflowClient(tracking_uri=info["tracking_uri"]).log_artifacts(info["run_id"], str(report), "report")
    return info["run_id"]


# --------------------------------------------------------------------------- opening
def open_trackers(cfg: Config, out_dir: Path, *, resumed: bool) -> list[_Tracker]:
    """The trackers of ``train.loggers`` for rank 0's :class:`~deepmetric.run.rundir.RunLog`,
    caught up with ``log.jsonl`` (a resumed run's kept records)."""
    if not cfg.train.loggers:
        return []
    records = R.read_log(out_dir) if resumed else []
    trackers: list[_Tracker] = []
    for name in cfg.train.loggers:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(cfg, out_dir, records))
        elif name == "mlflow":
            trackers.append(MlflowTracker(cfg, out_dir, records, resumed))
    where = ", ".join(f"TensorBoard {Path(out_dir) / R.TENSORBOARD}" if isinstance(t, TensorBoardTracker)
                      else f"MLflow run {t.run_id} in {t.uri}" for t in trackers)
    print(f"[deepmetric] tracking: {where}", flush=True)
    return trackers

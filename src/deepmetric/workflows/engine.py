"""The engine under ``deepmetric tune`` and ``deepmetric study``: trials in an Optuna storage.

A tune's trials are drawn by a sampler; a study's are the fixed runs of its grid (benchmarks x
variants x seeds).  Both keep them in the same kind of storage: an SQLite file in the output
folder by default (nothing to start), or a shared database (``postgresql://...``) so the same
command on several machines works through one set of trials.  What they share lives here:

* the storage, with Optuna's heartbeat: a running trial records a heartbeat every
  :data:`HEARTBEAT_S` seconds and is failed once none came for :data:`GRACE_S` (its process was
  killed, its machine lost), so a rerun of the command takes it up again;
* the worker processes of ``--workers K`` (each with ``cores / K`` torch threads, stopped when
  the parent dies) and the progress the parent prints while they run;
* the drain mark (``OUT/DRAIN``): every worker finishes its trial or run and starts no other, and
  the next command removes the mark and goes on.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from deepmetric.errors import MissingPackageError

__all__ = ["HEARTBEAT_S", "GRACE_S", "optuna_module", "sqlite_url", "display_storage", "rdb_storage",
           "fail_stale_trials", "Heartbeat", "cores", "run_workers", "DRAIN", "draining", "clear_drain"]

# DEEPMETRIC_TUNE_HEARTBEAT (seconds) shortens the heartbeat in tests
HEARTBEAT_S = int(os.environ.get("DEEPMETRIC_TUNE_HEARTBEAT", "10"))
GRACE_S = 4 * HEARTBEAT_S

#: a file in an output folder (``touch OUT/DRAIN``): its workers finish what they run, start nothing
DRAIN = "DRAIN"


def draining(folder: Path) -> bool:
    return (Path(folder) / DRAIN).is_file()


def clear_drain(folder: Path, log: Callable[[str], None]) -> None:
    """Remove the mark a drain left in ``folder``, at the start of the command that continues."""
    mark = Path(folder) / DRAIN
    if mark.is_file():
        mark.unlink()
        log(f"{mark} from the last drain removed: continuing")


def optuna_module():
    """``optuna``, or a clear error naming the extra to install."""
    try:
        import warnings

        import optuna
    except ImportError:  # pragma: no cover - optuna is in the tune extra, installed by install.sh
        raise MissingPackageError("deepmetric tune and deepmetric study need Optuna: pip install 'deepmetric[tune]' "
                          "(install.sh installs it)") from None
    # the heartbeat and its retry callback are marked experimental since Optuna 2.8
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{Path(path).resolve()}"


def display_storage(url: str) -> str:
    """The storage URL with any password masked (it is printed and written to files)."""
    if "://" in url and "@" in url.split("://", 1)[1]:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        if ":" in cred:
            return f"{scheme}://{cred.split(':', 1)[0]}:***@{host}"
    return url


def rdb_storage(url: str, *, retry_stale: bool):
    """An Optuna RDB storage with the heartbeat; ``retry_stale`` queues a failed stale trial
    again with the same parameters (a tune; a study's worker finds its unfinished run itself)."""
    optuna = optuna_module()
    if url.startswith("sqlite:///"):
        folder = Path(url[len("sqlite:///"):]).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # it was "[Errno 2] No such file or directory: '/x'", naming neither
            raise ValueError(f"storage {display_storage(url)}: its folder {folder} cannot be created "
                             f"({exc.strerror or exc}); give --storage or --out a folder you can write") from None
        engine_kwargs = {"connect_args": {"timeout": 60}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    callback = (optuna.storages.RetryHeartbeatStaleTrialCallback(inherit_intermediate_values=True)
                if retry_stale else None)
    import sqlalchemy.exc

    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_S,
                                              grace_period=GRACE_S, heartbeat_stale_trial_callback=callback)
        except (sqlalchemy.exc.NoSuchModuleError, sqlalchemy.exc.ArgumentError) as exc:
            raise _storage_error(url, exc, "is not a database URL SQLAlchemy can read") from None
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError, sqlalchemy.exc.OperationalError) as exc:
            # two processes creating the tables of a new database at once (optuna/optuna#1092):
            # PostgreSQL refuses the second CREATE TYPE / TABLE (IntegrityError, ProgrammingError),
            # SQLite says "table ... already exists" (OperationalError); the first has made
            # them, so try again.  Any other OperationalError (a wrong URL, a locked file after
            # the 60 s timeout) is the user's to see at once.
            race = not isinstance(exc, sqlalchemy.exc.OperationalError) or "already exists" in str(exc)
            if not race:
                raise _storage_error(url, exc, "cannot be opened") from None
            if attempt == 4:
                raise
            time.sleep(0.5 + attempt)


def _storage_error(url: str, exc: Exception, what: str) -> ValueError:
    """A storage URL that does not open, in one line (SQLAlchemy's errors are tracebacks with a
    link), its password masked."""
    reason = getattr(exc, "orig", None) or exc  # the driver's own message, without SQLAlchemy's footer
    lines = [line.strip() for line in str(reason).strip().splitlines() if line.strip()]
    return ValueError(f"--storage {display_storage(url)} {what} ({' '.join(lines)[:300] or type(exc).__name__}); "
                      "expected sqlite:///PATH/TO/FILE.db or postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE "
                      "of a running server")


def _now():
    from datetime import datetime

    return datetime.now()  # the clock Optuna's RDB storage writes datetime_start with


def _never_beat(study) -> set[int]:
    """Storage ids of the study's running trials with no heartbeat recorded at all."""
    import sqlalchemy.orm
    from optuna.storages._rdb import models  # Optuna keeps no public reader of the heartbeat table

    storage = getattr(study._storage, "_backend", study._storage)  # the RDB storage under Optuna's cache
    with sqlalchemy.orm.Session(storage.engine) as session:
        rows = (session.query(models.TrialModel.trial_id)
                .filter(models.TrialModel.study_id == study._study_id)
                .filter(models.TrialModel.state == models.TrialState.RUNNING)
                .filter(~models.TrialModel.heartbeats.any()).all())
    return {r[0] for r in rows}


def fail_stale_trials(study) -> list[int]:
    """``optuna.storages.fail_stale_trials``, and also the running trials that never recorded a
    heartbeat and started more than :data:`GRACE_S` seconds ago.

    Optuna skips a trial without a heartbeat (its storage only compares recorded ones), but a
    process killed between creating its trial and its heartbeat thread's first beat leaves
    exactly that: a trial RUNNING for ever, and every later worker waiting on it (a CI run of
    the kill -9 test hung so).  Such a trial is failed here and handed to the storage's stale
    callback (a tune queues its parameters again), as Optuna does with a stale one.  The age
    is measured against ``datetime_start``, which the creating machine's clock wrote.  Returns
    the storage ids failed here."""
    import copy
    from datetime import timedelta

    optuna = optuna_module()
    from optuna.trial import TrialState

    storage = study._storage
    failed = []
    if getattr(storage, "get_heartbeat_interval", lambda: None)() is not None:
        silent = _never_beat(study)
        oldest = _now() - timedelta(seconds=GRACE_S)
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t._trial_id in silent and t.datetime_start is not None and t.datetime_start < oldest:
                try:
                    if storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                        failed.append(t._trial_id)
                except optuna.exceptions.UpdateFinishedTrialError:  # another worker failed it first
                    pass
        callback = storage.get_heartbeat_stale_trial_callback()
        if callback is not None:
            for tid in failed:
                callback(study, copy.deepcopy(storage.get_trial(tid)))
    optuna.storages.fail_stale_trials(study)
    return failed


class Heartbeat:
    """Record a trial's heartbeat from a thread while it runs (``study.optimize`` does this by
    itself; a trial run with ask / tell needs it)."""

    def __init__(self, storage, trial_id: int, interval: float = HEARTBEAT_S):
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self._stop.is_set():
            self.storage.record_heartbeat(self.trial_id)
            self._stop.wait(self.interval)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the worker gets SIGTERM when its parent dies (even by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_workers(command: Sequence[str], workers: int, log_dir: Path, *, poll: Callable[[], None],
                log: Callable[[str], None], interval: float = 2.0) -> list[int]:
    """Start ``workers`` copies of ``command`` (each with ``cores // workers`` torch threads, its
    output in ``log_dir/worker_K.log``), call ``poll()`` every ``interval`` seconds until all
    have ended, and return their exit codes.  Ctrl-C is passed on to them (each checkpoints
    its run) and re-raised once they have stopped."""
    threads = max(1, cores() // max(workers, 1))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               DEEPMETRIC_WORKER_THREADS=str(threads))
    procs = []
    for k in range(workers):
        f = open(log_dir / f"worker_{k}.log", "a", encoding="utf-8")
        procs.append((subprocess.Popen(list(command), stdout=f, stderr=subprocess.STDOUT, env=env,
                                       preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None),
                       f))
    log(f"{workers} workers x {threads} thread(s); their output: {log_dir}/worker_K.log")
    try:
        while any(p.poll() is None for p, _ in procs):
            time.sleep(interval)
            poll()
    except KeyboardInterrupt:
        for p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p, _ in procs:
            p.wait()
        raise
    finally:
        for _, f in procs:
            f.close()
    poll()
    return [p.returncode for p, _ in procs]


def worker_threads() -> int | None:
    """The torch threads of a worker started by :func:`run_workers` (None outside one)."""
    value = os.environ.get("DEEPMETRIC_WORKER_THREADS")
    return int(value) if value else None

"""Protocol v2 of the emoji loss comparison (issue 30; the table, spaces, budgets and seeds are in
studies/protocol_v2.py), one resumable command.  Phases, in this order by default:

* ``tune``: each loss searches the same space shape on the cross-vendor validation emoji until
  it has ``--trials`` *completed* trials (TPE, 4 trials at a time as pre-registered, median
  pruning only in the second half); the
  trials never evaluate the test split, and the copy of each tune's outputs is checked to hold
  no test metric before it is written;
* ``seeds``: each loss at its tuned settings on seeds no tune used (``SEEDS``; ``CLAIM_SEEDS``
  for the seven losses of H1-H4), validation only (best.pt chosen on validation);
* ``control``: every loss at the winner's optimiser, lr, weight decay, multiplier and embedding
  (the winner: the best validation objective of all tunes), its own tuned option kept, seed 100,
  validation only (where those are a loss's own tuned settings, as for the winner, the run is its
  seeded run of seed 100, trained once; ``same_run`` in control.csv);
* ``almn_beta``: ALMN's beta in ``BETAS`` at almn_beta3's tuned settings, ``BETA_SEEDS``;
* ``almn_more``: once the sweep has finished, at its best beta (the best mean validation
  objective over its seeds): m x n 32 x 2 and 8 x 8, and Eq. 12's fixed margin (``ALMN_MORE``);
* ``glyphs``: the secondary glyph analysis (pre-registered "if compute allows"): HBN, BN, SM, LN
  and HLN at v1's glyph settings, 20 epochs, heating at 16, seeds 100-104, validation only;
* ``final``: once every loss of the table has finished its tune and seeded runs (``--cut``: the
  last losses of the table, left out for lack of compute, as pre-registered), and only once the
  pre-registration exists (committed, for the repository's copy): each seeded run's best.pt on
  the test split once (cross-vendor Recall@1 and MAP@R), then ``results.csv``,
  ``baselines.csv`` (raw pixels and the untouched network on the same test emoji, once),
  ``almn_beta.csv``, ``almn_more.csv``, ``glyphs.csv`` (once its runs have finished) and ``summary.md`` (the ranked table with both references; the
  pre-registered hypotheses H1-H6
  with paired 95 % CIs, Holm over the seven tests, and the decision rule's verdicts);
* ``exploratory`` (not in ``all``; optional, not pre-registered, PREREGISTRATION.md 2026-11-28,
  twelfth session, corrections 3): only after ``final``, the losses the control read as better at
  the winner's settings (above every one of their own seeded runs on validation) trained there on
  seeds 100-102 (100: the control's run), tested once: ``exploratory.csv`` and ``exploratory.md``
  (intervals, no verdict words; no verdict changes).

The file, top to bottom: set-up (``Protocol``, sanitising copies), tune (with ``--snapshot`` /
``--restore``), seeded runs (seeds, control, ALMN, glyphs), final (the one test step and its
guard), tables (CSV, Holm, the decision rule, ``summary.md``, ``verdicts.json``), progress, main.

Runs live in ``--runs`` (runs/protocol_v2); the committed copy (``--copy-to``,
bench/studies/protocol_v2) gets the tunes' outputs, control.csv and, from ``final`` only, the
results, every path in them relative to the repository.  A rerun resumes every phase.

    python bench/protocol_v2.py                                  # everything (tunes 4 trials at a time)
    python bench/protocol_v2.py --phase tune seeds --only HBN BN # some phases, some losses
    python bench/protocol_v2.py --device cuda --parallel 8       # on one GPU, 8 seeded runs at once
    python bench/protocol_v2.py --phase tune --lanes 2            # two losses' tunes at once (4 trials each)
    python bench/protocol_v2.py --summary                        # rewrite the copies, train nothing
    python bench/protocol_v2.py --snapshot                       # unfinished tunes -> partial_tunes/, to commit
    python bench/protocol_v2.py --restore                        # a fresh clone: the committed tunes -> runs/
    python bench/protocol_v2.py --progress                       # what has run, what is left (progress.md)
    python bench/protocol_v2.py --drain                          # stop a running study between trials, nothing lost
"""
from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
# worker processes (deepmetric tune / study --workers) import this checkout's package too
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])


def _load_script(name: str, path: Path):
    """A sibling script as a module (bench/ and studies/ are not packages), registered under
    ``name`` (a dataclass in it looks its module up there)."""
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules.setdefault(name, module)
    loader.loader.exec_module(module)
    return module


spec = _load_script("protocol_v2_table", ROOT / "studies" / "protocol_v2.py")


@functools.lru_cache(maxsize=1)
def two_head_script():
    """bench/two_head_accuracy.py (its epochs, variants, seeds and run folders' names), loaded once."""
    return _load_script("two_head_accuracy", ROOT / "bench" / "two_head_accuracy.py")

PHASES = ("tune", "seeds", "control", "almn_beta", "almn_more", "glyphs", "final")
#: not in ``all``: the optional exploratory runs after the final step (PREREGISTRATION.md, twelfth session)
EXTRA_PHASES = ("exploratory",)
TUNE_FILES = ("trials.md", "trials.csv", "best.yaml", "best_overrides.json", "tune.json", "report.html",
              "optimization_history.png", "param_importances.png")
RESULT_COLUMNS = ["loss", "seed", "completed_trials", "optimizer", "embedding", "epochs", "cross_domain_recall@1",
                  "cross_domain_map@r", "wall_time_s", "best_epoch", "val_objective", "val_flattened", "status"]
METRICS = ("cross_domain_recall@1", "cross_domain_map@r")
# a test metric, however written (test/recall@1, test_map@r, "test: recall@1=", a JSON record of
# the test split, a "test" mapping of values): never in a tune's copy
TEST_METRIC = re.compile(r'test[/_: ]+"?(cross_domain_)?(recall@|map@r|r_precision|nmi|f1)|"split"\s*:\s*"test"'
                         r'|"test"\s*:\s*\{\s*"[\w@]+"\s*:\s*-?[\d.]', re.I)
ABSOLUTE = re.compile(r"/(?:tmp|home|root|work|Users|mnt|var|opt|srv|scratch)/")


def trial_states(tune_dir: Path) -> list[str]:
    """The state of every trial of a tune (its ``trials.csv``: complete, pruned, ...)."""
    with open(tune_dir / "trials.csv", newline="") as f:
        return [r["state"] for r in csv.DictReader(f)]


class ProtocolError(RuntimeError):
    """The protocol cannot go on as asked (a missing tune, no pre-registration, a leak)."""


class Drained(Exception):
    """``--drain`` stopped the study between trials / runs: nothing lost, rerun to continue."""


#: runs/protocol_v2/DRAIN (``--drain``; deepmetric's drain mark): no tune, loss or run starts;
#: each running one finishes
from deepmetric.workflows.engine import DRAIN, clear_drain, draining  # noqa: E402
#: the study folders of the seeded phases (runs/protocol_v2/<kind>), which --drain drains too
STUDY_KINDS = ("seeds", "control", "almn_beta", "almn_more", "glyphs", "exploratory")


# --------------------------------------------------------------------------- set-up
class Protocol:
    def __init__(self, args):
        self.args = args
        self.runs = Path(args.runs).resolve()
        self.copy = Path(args.copy_to).resolve()
        self.recipe = Path(args.recipe).resolve()
        self.epochs = args.epochs
        self.trials = args.trials
        self.losses = args.only or list(spec.LOSSES)
        self.common = [f"train.epochs={self.epochs}"] + (["train.device=cuda"] if args.device == "cuda" else []) \
            + list(args.set or [])

    def tune_dir(self, loss: str) -> Path:
        return self.runs / "tune" / loss

    def tuned(self) -> list[str]:
        """The losses (of the whole table, in order) whose tune has finished (:meth:`finished`)."""
        return [n for n in spec.LOSSES if self.finished(n)]

    def finished(self, loss: str) -> bool:
        """Whether ``loss``'s tune has its ``trials`` completed trials, or has reached the cap of
        finished or pruned ones (``MAX_TRIALS_FACTOR`` x trials) and will run no more.  Not the
        mere presence of its outputs: an interrupted tune, or one whose workers all failed,
        writes them too."""
        d = self.tune_dir(loss)
        if not (d / "best_overrides.json").is_file() or not (d / "trials.csv").is_file():
            return False
        states = trial_states(d)
        complete = states.count("complete")
        return complete >= self.trials or complete + states.count("pruned") >= spec.MAX_TRIALS_FACTOR * self.trials

    def log(self, msg: str) -> None:
        print(f"[protocol_v2] {msg}", flush=True)


def sanitize(text: str, proto: Protocol) -> str:
    """Paths relative to the repository: the run folder and the checkout become relative (a
    recipe outside the checkout, as in the tests: its folder becomes ``RECIPE_DIR``)."""
    pairs = [(str(proto.runs), "runs/protocol_v2"), (str(ROOT) + "/", ""), (str(ROOT), ".")]
    if ROOT not in proto.recipe.parents:
        pairs.insert(1, (str(proto.recipe.parent), "RECIPE_DIR"))
    for absolute, rel in pairs:
        text = text.replace(absolute, rel)
    return text


def copy_text(src: Path, dest: Path, proto: Protocol) -> None:
    text = sanitize(src.read_text(encoding="utf-8"), proto)
    m = ABSOLUTE.search(text)
    if m:
        raise ProtocolError(f"{src}: an absolute path remains after sanitizing ({text[max(0, m.start() - 40):m.end() + 40]!r})")
    from deepmetric.run.rundir import write_text_atomic

    dest.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(dest, text)


def test_metric_leaks(folder: Path) -> list[str]:
    """Every text file under ``folder`` that holds a test metric."""
    leaks = []
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # the storage, checkpoints, images
            continue
        m = TEST_METRIC.search(text)
        if m:
            leaks.append(f"{path}: {m.group(0)!r}")
    return leaks


# --------------------------------------------------------------------------- tune (and its storage: snapshot, restore)
#: lanes (``--lanes``) share the generated space files and the git index
_SPACES_LOCK, _COMMIT_LOCK = threading.Lock(), threading.Lock()


def _tune_setup(proto: Protocol, loss: str, storage: str | None = None):
    from deepmetric.workflows.tune import prepare_tune

    with _SPACES_LOCK:
        spaces = spec.write_spaces(proto.runs / "spaces", proto.epochs)
    return prepare_tune(proto.recipe, spaces[loss], trials=proto.trials, out=proto.tune_dir(loss), storage=storage,
                        study_name=f"protocol_v2__{loss}", overrides=proto.common, count="completed",
                        max_trials=spec.MAX_TRIALS_FACTOR * proto.trials)


def run_tune_phase(proto: Protocol, loss: str) -> None:
    from deepmetric.workflows.tune import run_tune

    setup = _tune_setup(proto, loss)
    check_drain(proto)
    proto.log(f"tune {loss}: {setup.budget_text()}, {proto.args.tune_parallel} trials at a time")
    run_tune(setup, workers=proto.args.tune_parallel)
    if not proto.finished(loss):
        check_drain(proto)  # every worker failed (a missing cache, a crash): nothing to copy or seed
        raise ProtocolError(f"tune {loss} ended before its {proto.trials} completed trials (workers' logs: "
                            f"{proto.tune_dir(loss) / 'workers'}); rerun the same command to continue it")
    copy_tune(proto, loss)


def check_drain(proto: Protocol) -> None:
    if draining(proto.runs):
        raise Drained()


def drain(proto: Protocol) -> list[Path]:
    """``--drain``: every running trial and seeded run finishes, and nothing new starts (a stop
    with Ctrl-C loses the current epoch of each, and a fresh clone their checkpoints, which are
    not committed).  Writes ``DRAIN`` into the study's run folder, each unfinished tune's and
    each seeded phase's folder; returns them."""
    marks = [proto.runs / DRAIN]
    marks += [proto.tune_dir(n) / DRAIN for n in spec.LOSSES if proto.tune_dir(n).is_dir() and not proto.finished(n)]
    marks += [proto.runs / kind / DRAIN for kind in STUDY_KINDS if (proto.runs / kind).is_dir()]
    for mark in marks:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
    return marks


def copy_tune(proto: Protocol, loss: str) -> None:
    src = proto.tune_dir(loss)
    leaks = test_metric_leaks(src)
    if leaks:
        raise ProtocolError(f"tune {loss}: test metrics in its outputs, nothing copied: {leaks[:3]}")
    dest = proto.copy / "tunes" / loss
    for name in TUNE_FILES:
        if not (src / name).is_file():
            continue
        if name.endswith(".png"):
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / name, dest / name)
        else:
            copy_text(src / name, dest / name, proto)
    if (src / "tune.db").is_file():  # the whole record (every trial's curve), to continue or re-read it
        dest.mkdir(parents=True, exist_ok=True)
        os.replace(_storage_copy(proto, loss, src / "tune.db", dest / "tune.db"), dest / "tune.db")


def _storage_copy(proto: Protocol, loss: str, db: Path, dest: Path) -> Path:
    """A consistent copy of the live Optuna storage ``db`` (SQLite's backup: safe while the tune
    writes to it) at ``dest``, every run folder in it made relative to the repository."""
    import sqlite3

    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    live, snap = sqlite3.connect(db), sqlite3.connect(tmp)
    try:
        live.backup(snap)
        _replace_in_attributes(snap, [(str(proto.runs), "runs/protocol_v2"), (str(ROOT) + "/", "")])
    except sqlite3.Error as exc:
        tmp.unlink(missing_ok=True)
        raise ProtocolError(f"snapshot {loss}: {db} is not a readable Optuna storage ({exc}); "
                            f"the copy at {dest} is unchanged") from None
    finally:
        live.close()
        snap.close()
    return tmp


def _replace_in_attributes(db, pairs: list[tuple[str, str]]) -> None:
    """Rewrite the paths the trials and the study keep in their attributes (run folders)."""
    for table in ("trial_user_attributes", "study_user_attributes"):
        for old, new in pairs:
            db.execute(f"UPDATE {table} SET value_json = replace(value_json, ?, ?)", (old, new))
    db.commit()


def snapshot_tunes(proto: Protocol) -> list[str]:
    """Commit-ready copies of the unfinished tunes, safe while they run: each one's storage (a
    consistent SQLite backup) into ``COPY/partial_tunes/LOSS/`` with its run folders made
    relative, its ``trials.csv`` written from that storage (validation only, checked for test
    metrics and absolute paths like every copy) and ``tune.json``.  A copied storage continues the
    tune elsewhere (``--restore``; a trial running at the snapshot is failed there by its missed
    heartbeat and retried).  A finished tune's partial copy is removed (``tunes/LOSS`` holds its
    outputs and its storage).  Returns the losses copied."""
    from deepmetric.workflows.tune_outputs import trial_rows, write_trials_csv
    from deepmetric.workflows.tune_study import open_study

    copied = []
    for loss in spec.LOSSES:
        src, dest = proto.tune_dir(loss), proto.copy / "partial_tunes" / loss
        if proto.finished(loss):
            shutil.rmtree(dest, ignore_errors=True)
            continue
        if not (src / "tune.db").is_file():
            continue
        dest.mkdir(parents=True, exist_ok=True)
        tmp = _storage_copy(proto, loss, src / "tune.db", dest / "tune.db")
        setup = _tune_setup(proto, loss, storage=f"sqlite:///{tmp}")
        raw_csv = write_trials_csv(trial_rows(setup, open_study(setup, create=False)), dest / ".trials.raw.csv")
        copy_text(raw_csv, dest / "trials.csv", proto)  # paths made relative, absolute ones refused
        raw_csv.unlink()
        if (src / "tune.json").is_file():
            copy_text(src / "tune.json", dest / "tune.json", proto)
        os.replace(tmp, dest / "tune.db")
        for stale in ("trials.md", "best_overrides.json"):  # a tune's outputs: of a finished one in tunes/
            (dest / stale).unlink(missing_ok=True)
        leaks = test_metric_leaks(dest)
        if leaks:
            shutil.rmtree(dest)
            raise ProtocolError(f"snapshot {loss}: test metrics in its storage, nothing copied: {leaks[:3]}")
        copied.append(loss)
    return copied


def restore_tunes(proto: Protocol) -> list[str]:
    """Continue the study in another clone: every loss whose tune ``--runs`` does not hold yet
    gets the committed state, a finished tune's outputs (``COPY/tunes/LOSS``: what the seeded
    runs read, and its storage where one was kept) or an unfinished one's storage
    (``COPY/partial_tunes/LOSS/tune.db``), its run folders made absolute under ``--runs`` again.
    A tune already in ``--runs`` is never touched.  Returns the losses restored."""
    import sqlite3

    restored = []
    for loss in spec.LOSSES:
        dest = proto.tune_dir(loss)
        if (dest / "tune.db").is_file() or (dest / "best_overrides.json").is_file():
            continue
        done, partial = proto.copy / "tunes" / loss, proto.copy / "partial_tunes" / loss / "tune.db"
        if (done / "best_overrides.json").is_file():
            names = [n for n in TUNE_FILES + ("tune.db",) if (done / n).is_file()]
            sources = [done / n for n in names]
        elif partial.is_file():
            names, sources = ["tune.db"], [partial]
        else:
            continue
        dest.mkdir(parents=True, exist_ok=True)
        for name, source in zip(names, sources):
            tmp = dest / f".{name}.tmp"
            shutil.copy(source, tmp)
            if name == "tune.db":
                db = sqlite3.connect(tmp)
                try:
                    _replace_in_attributes(db, [('"runs/protocol_v2/', f'"{proto.runs}/')])
                except sqlite3.Error as exc:
                    tmp.unlink()
                    raise ProtocolError(f"restore {loss}: {source} is not a readable Optuna storage ({exc})") from None
                finally:
                    db.close()
            os.replace(tmp, dest / name)
        restored.append(loss)
    return restored


def tune_record(proto: Protocol, loss: str) -> dict:
    """From a finished tune: its trial counts, best value and best overrides split into the
    shared dimensions and the loss's own."""
    d = proto.tune_dir(loss)
    states = trial_states(d)
    best = json.loads((d / "best_overrides.json").read_text())
    shared, own = [], []
    for o in best["overrides"]:
        (shared if o.split("=", 1)[0] in spec.SHARED else own).append(o)
    return {"loss": loss, "completed": states.count("complete"), "pruned": states.count("pruned"),
            "trials": len(states), "value": float(best["value"]), "shared": shared, "own": own}


# --------------------------------------------------------------------------- seeded runs (studies)
def make_study(proto: Protocol, kind: str, variants: dict, seeds: list[int], *, base=None, common=None):
    """A deepmetric study in ``runs/<kind>``, written to a file (its worker processes load it):
    ``base`` the recipe (default the protocol's) or a config mapping, ``common`` the overrides of
    every run (default the protocol's)."""
    from deepmetric.workflows.study_file import load_study

    raw = {"name": f"protocol_v2_{kind}", "base": str(proto.recipe) if base is None else base,
           "overrides": proto.common if common is None else common,
           "variants": variants, "seeds": seeds, "out_dir": str(proto.runs / kind), "workers": proto.args.parallel}
    from deepmetric.run.rundir import write_text_atomic

    path = proto.runs / f"{kind}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    # atomic: a worker process of another call may be reading it
    write_text_atomic(path, "# bench/protocol_v2.py: generated, rewritten on every run\n"
                      + yaml.safe_dump(raw, sort_keys=False))
    return load_study(path, out_dir=proto.runs / kind)


def seeds_study(proto: Protocol):
    tuned = proto.tuned()
    variants = {n: spec.overrides(n, proto.epochs) + [{"from_tune": str(proto.tune_dir(n))}] for n in tuned}
    return make_study(proto, "seeds", variants, spec.CLAIM_SEEDS) if variants else None


def run_study_phase(proto: Protocol, study, only: list[str]) -> None:
    from deepmetric.workflows.study import run_study

    if study is None or not only:
        return
    if all(r.finished for r in study.runs if any(r.key == k or r.key.startswith(k + "/") for k in only)):
        return  # nothing to train here (metrics.json of each): no worker processes to start
    check_drain(proto)
    result = run_study(study, workers=proto.args.parallel, only=only)
    if result["interrupted"]:
        raise KeyboardInterrupt
    check_drain(proto)
    if result["failed"]:
        proto.log(f"{study.name}: failed runs {result['failed']} (rerun to retry)")


def run_seeds_phase(proto: Protocol, losses: list[str]) -> None:
    missing = [n for n in losses if n not in proto.tuned()]
    if missing:
        proto.log(f"seeds: no finished tune for {missing}: skipped (run --phase tune first)")
    study = seeds_study(proto)
    gone = {r.key for r in (study.runs if study is not None else []) if diverged(r)}
    if gone:  # rerunning resumes from the last checkpoint and diverges again: it has ended
        proto.log(f"seeds: diverged (a non-finite loss; tested from its best.pt, as pre-registered): {sorted(gone)}")
    only = [f"{n}/seed{s}" for n in losses if n not in missing for s in spec.seeds_of(n) if f"{n}/seed{s}" not in gone]
    run_study_phase(proto, study, only)


def recorded_choice(path: Path, record: dict, keys: tuple[str, ...]) -> dict | None:
    """Record, once, a choice that the runs beside ``path`` are made at: None when ``record`` is
    written now or agrees with the recorded one on ``keys``; else the recorded one (the caller
    refuses: a later, different choice must not silently change runs made at the first)."""
    from deepmetric.run.rundir import write_text_atomic

    if path.is_file():
        before = json.loads(path.read_text())
        return None if all(before[k] == record[k] for k in keys) else before
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    return None


def kept_losses(proto: Protocol, step: str) -> list[str]:
    """The table less the losses ``--cut`` names, which must be its last ones (the
    pre-registered rule: losses are cut from the end, never the protocol)."""
    table, cut = list(spec.LOSSES), list(proto.args.cut or [])
    if cut and sorted(cut, key=table.index) != table[len(table) - len(cut):]:
        raise ProtocolError(f"{step}: --cut {' '.join(cut)}: losses are cut from the end of the table only "
                            f"(pre-registered); its last {len(cut)} are {table[len(table) - len(cut):]}")
    return [n for n in table if n not in cut]


def cut_from(loss: str) -> list[str]:
    """The ``--cut`` that leaves ``loss`` out: it and every loss after it in the table."""
    table = list(spec.LOSSES)
    return table[table.index(loss):]


def winner(proto: Protocol) -> dict:
    """The loss with the best validation objective of all tunes (the whole table less ``--cut``;
    ``--only`` does not narrow it), once every one of them has finished.  It is recorded in
    runs/control/winner.json: a different winner later is an error, not a silent change of the
    control runs."""
    kept = kept_losses(proto, "control")
    unfinished = [n for n in kept if not proto.finished(n)]
    if unfinished:
        raise ProtocolError(f"control: the winner is the best validation objective of all tunes (pre-registered), "
                            f"and these have not finished theirs: {unfinished}. Finish them, or cut losses from the "
                            f"end of the table (--cut {' '.join(cut_from(unfinished[0]))})")
    records = [tune_record(proto, n) for n in kept]
    win = max(records, key=lambda r: r["value"])
    path = proto.runs / "control" / "winner.json"
    before = recorded_choice(path, win, ("loss", "shared"))
    if before is not None:
        raise ProtocolError(f"control: the winner is now {win['loss']} {win['shared']}, the control runs in "
                            f"{path.parent} are at {before['loss']} {before['shared']}; move that folder away "
                            "to run the control again")
    return win


def control_study(proto: Protocol):
    """Every tuned loss at the winner's shared settings, its own tuned option kept.  Where that is
    the loss's own tuned setting (the winner itself; a loss whose tune chose the winner's
    candidate), the run is the same training as its seeded run of that seed: the study holds that
    run in its place, trained once (``reuse_seeded_twins``)."""
    win = winner(proto)
    variants = {n: at_winner_settings(proto, n, win) for n in proto.tuned()}
    study = make_study(proto, "control", variants, [spec.SEEDS[0]])
    return reuse_seeded_twins(proto, study, lambda run: f"{run.variant}/seed{run.seed}"), win


def at_winner_settings(proto: Protocol, loss: str, win: dict) -> list:
    """``loss``'s overrides at the winner's shared settings, its own tuned option kept: the control's
    variant, and the exploratory phase's (whose seed-100 run is the control's: one definition)."""
    return spec.overrides(loss, proto.epochs) + tune_record(proto, loss)["own"] + win["shared"]


def reuse_seeded_twins(proto: Protocol, study, twin_key):
    """Put in place of each run of ``study`` that is the same training as a seeded run (resolved
    configs equal but for the folder; ``twin_key(run)`` names the seeded run to compare with) that
    seeded run, under the study's key: one training, not two (the seeds phase trains it)."""
    seeds = seeds_study(proto)
    return reuse_twins(study, {r.key: r for r in (seeds.runs if seeds is not None else [])}, twin_key)


def reuse_twins(study, others: dict, twin_key):
    """:func:`reuse_seeded_twins` with the runs to compare with given (``others``: key -> run)."""
    import dataclasses

    runs = []
    for run in study.runs:
        twin = others.get(twin_key(run))
        if twin is not None and same_training(run, twin):
            run = dataclasses.replace(twin, key=run.key, variant=run.variant)
        runs.append(run)
    study.runs = runs
    return study


def is_seeded_twin(study, run) -> bool:
    """A run of ``study`` that ``reuse_seeded_twins`` replaced by a seeded run (its folder is not
    under the study's): the seeds phase trains it, the study's own worker processes must not."""
    return study.out_dir not in run.out_dir.parents


def run_control_phase(proto: Protocol, losses: list[str]) -> None:
    study, win = control_study(proto)
    proto.log(f"control: the winner is {win['loss']} (validation {win['value']:.4f}): {win['shared']}")
    wanted = [r for r in study.runs if r.variant in losses and r.variant in proto.tuned()]
    # by key, and only the control's own runs: the worker processes reload runs/control.yaml, which
    # knows nothing of the seeded twins, and would train those a second time in control/
    own = [r.key for r in wanted if not is_seeded_twin(study, r)]
    twins = sorted(r.key for r in wanted if is_seeded_twin(study, r))
    if twins:
        proto.log(f"control: {', '.join(twins)}: at their own tuned settings, their seeded runs (the same "
                  "training), trained by the seeds phase")
    record_twins(proto, study)
    run_study_phase(proto, study, own)
    write_control(proto)


TWINS_FILE = "seeded_twins.json"  # runs/control/: the control keys that are seeded runs (for --progress)


def record_twins(proto: Protocol, study) -> None:
    from deepmetric.run.rundir import write_text_atomic

    twins = {r.key: str(r.out_dir.relative_to(proto.runs)) for r in study.runs if is_seeded_twin(study, r)}
    path = study.out_dir / TWINS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(twins, indent=1) + "\n")


def almn_study(proto: Protocol):
    """The beta sweep at almn_beta3's tuned settings.  A sweep run whose config is that of an
    almn_beta3 seeded run but for its folder (beta 3, the same seed) is the same training: the
    study holds that seeded run in its place (under the sweep's key), trained once, by the seeds
    phase."""
    if "almn_beta3" not in proto.tuned():
        return None
    base = spec.overrides("almn_beta3", proto.epochs) + [{"from_tune": str(proto.tune_dir("almn_beta3"))}]
    variants = {f"beta{b:g}": base + [f"loss.0.options.beta={b}"] for b in spec.BETAS}
    study = make_study(proto, "almn_beta", variants, spec.BETA_SEEDS)
    return reuse_seeded_twins(proto, study, lambda run: f"almn_beta3/seed{run.seed}")


def same_training(a, b) -> bool:
    """Two study runs whose resolved configs are the same but for their folders."""
    def without_folder(raw: dict) -> dict:
        return {**raw, "train": {k: v for k, v in raw["train"].items() if k != "out_dir"}}

    return without_folder(a.raw) == without_folder(b.raw)


def run_almn_phase(proto: Protocol) -> None:
    study = almn_study(proto)
    if study is None:
        proto.log("almn_beta: almn_beta3 has no finished tune: skipped")
        return
    own = [r.key for r in study.runs if not is_seeded_twin(study, r)]
    shared = sorted(r.key for r in study.runs if is_seeded_twin(study, r))
    if shared:
        proto.log(f"almn_beta: {', '.join(shared)}: almn_beta3's seeded runs (the same training), trained by the "
                  "seeds phase")
    run_study_phase(proto, study, own)


def best_beta(proto: Protocol) -> float | None:
    """The sweep's beta with the best mean validation objective over its seeds (each run's
    best.pt value), once every sweep run has finished; None before.  Chosen on validation only,
    recorded in runs/almn_more/best_beta.json: a later, different choice is an error."""
    study = almn_study(proto)
    if study is None or not study.runs or not all(ended(r) for r in study.runs):
        return None
    means = {}
    for variant in study.variants:
        values = [selected(r, spec.OBJECTIVE).get("value") for r in study.runs if r.variant == variant]
        if None in values:
            raise ProtocolError(f"almn_more: a run of the sweep's {variant} has no validation value (metrics.json "
                                f"'selected'); the best beta cannot be chosen")
        means[variant] = sum(values) / len(values)
    best = max(means, key=lambda v: (means[v], -float(v[len("beta"):])))  # a tie: the smaller beta
    record = {"beta": float(best[len("beta"):]), "variant": best, "val_means": means}
    path = proto.runs / "almn_more" / "best_beta.json"
    before = recorded_choice(path, record, ("beta",))
    if before is not None:
        raise ProtocolError(f"almn_more: the sweep's best beta is now {record['beta']:g}, the runs in "
                            f"{path.parent} are at {before['beta']:g}; move that folder away to run them again")
    return record["beta"]


def almn_more_study(proto: Protocol):
    """ALMN at the sweep's best beta: m x n 32 x 2 and 8 x 8, and Eq. 12's fixed margin
    (``spec.ALMN_MORE``), seeds ``BETA_SEEDS``; None until the sweep has finished."""
    beta = best_beta(proto)
    if beta is None:
        return None
    base = spec.overrides("almn_beta3", proto.epochs) + [{"from_tune": str(proto.tune_dir("almn_beta3"))},
                                                         f"loss.0.options.beta={beta:g}"]
    variants = {name: base + extra for name, extra in spec.ALMN_MORE.items()}
    return make_study(proto, "almn_more", variants, spec.BETA_SEEDS)


def run_almn_more_phase(proto: Protocol) -> None:
    study = almn_more_study(proto)
    if study is None:
        proto.log("almn_more: the beta sweep has not finished: skipped")
        return
    run_study_phase(proto, study, list(study.variants))


def glyph_study(proto: Protocol):
    """The secondary glyph analysis: the heated-up variants (``spec.GLYPH_VARIANTS``) on v1's glyph
    settings (the base of ``spec.GLYPH_STUDY``), ``spec.GLYPH_OVERRIDES`` (20 epochs, validation
    only), seeds ``CLAIM_SEEDS``.  Not tuned: v1's settings, as pre-registered."""
    raw = yaml.safe_load((ROOT / spec.GLYPH_STUDY).read_text())
    common = list(spec.GLYPH_OVERRIDES) + (["train.device=cuda"] if proto.args.device == "cuda" else [])
    variants = {n: list(o) for n, o in spec.GLYPH_VARIANTS.items()}
    return make_study(proto, "glyphs", variants, spec.CLAIM_SEEDS, base=raw["base"], common=common)


def run_glyph_phase(proto: Protocol) -> None:
    study = glyph_study(proto)
    run_study_phase(proto, study, list(study.variants))


# --------------------------------------------------------------------------- final (test, once)
def check_preregistration(proto: Protocol) -> None:
    """The test split is read only after the pre-registration exists (in the repository's copy:
    committed to git)."""
    check_preregistration_file(proto.copy / "PREREGISTRATION.md")


def check_preregistration_file(path: Path) -> None:
    """``path`` exists and, inside this repository, is committed without later edits (also the
    two-head study's final step, bench/two_head_accuracy.py, calls this)."""
    if not path.is_file():
        raise ProtocolError(f"final: {path} does not exist; the pre-registration comes before any test number")
    try:
        inside = path.resolve().relative_to(ROOT)
    except ValueError:
        return
    r = subprocess.run(["git", "log", "-1", "--format=%H", "--", str(inside)], cwd=ROOT, capture_output=True,
                       text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise ProtocolError(f"final: {inside} is not committed; commit the pre-registration before the first result")
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(inside)], cwd=ROOT).returncode != 0:
        raise ProtocolError(f"final: {inside} has changes not committed; the test numbers come after the committed "
                            "pre-registration (a correction is a new dated section, committed)")


def val_records(run_dir: Path, key: str) -> list[dict]:
    """A run's validation evaluations that carry ``key``, in the order they ran."""
    from deepmetric.run.rundir import read_log

    return [r for r in read_log(run_dir, type="eval") if r.get("split") == "val" and key in r]


def val_curve(run_dir: Path, key: str) -> list[float]:
    return [r[key] for r in val_records(run_dir, key)]


def flattened(curve: list[float], points: float = 0.5) -> bool:
    """No gain above ``points`` (percentage points) over the last two evaluations: the best of
    the last two is at most ``points`` above the best before them (False with fewer than 3)."""
    from deepmetric.report.study_tables import last_gain

    gain = last_gain(curve)
    return gain is not None and gain <= points / 100


def test_evaluation(run_dir: Path, device: str, cross_domain: bool = True) -> dict:
    """best.pt of a finished run on the test split (its own config: the indexed embedding; the
    cross-vendor metrics too with ``cross_domain``), once: the result is kept in ``final.json``
    next to the run, tied to best.pt's sha256; a best.pt trained again after it is refused."""
    cache = run_dir.parent / f"{run_dir.name}.final{'' if cross_domain else '_split_only'}.json"
    checkpoint = file_digest(run_dir / "best.pt")
    if cache.is_file():
        record = json.loads(cache.read_text())
        if record.get("checkpoint_sha256") == checkpoint:
            return record
        # test numbers of this run exist: a run trained again after them would be a second look
        raise ProtocolError(f"final: {cache} holds the test numbers of another best.pt of {run_dir} (the run was "
                            "trained again after its test evaluation); the test split is read once "
                            "(PREREGISTRATION.md): nothing was evaluated. Restore the tested best.pt (its sha256 is in "
                            "that file), or record the retraining in a dated section of PREREGISTRATION.md and "
                            "remove that file")
    from deepmetric.run.builders import build_test_sets
    from deepmetric.run.device import resolve_device
    from deepmetric.run.embed import load_model_from_checkpoint
    from deepmetric.run.evaluation import evaluate_split
    from deepmetric.run.rundir import write_text_atomic

    dev = resolve_device("cuda" if device == "cuda" else "cpu")
    model, losses, cfg, _ = load_model_from_checkpoint(run_dir / "best.pt", dev)
    cfg.eval.cross_domain = cross_domain
    metrics, _ = evaluate_split(model, build_test_sets(cfg), cfg, device=dev, losses=losses)
    record = {"metrics": {k: float(v) for k, v in metrics.items()}, "embedding": cfg.eval.embedding,
              "optimizer": cfg.optim.name, "checkpoint": "best.pt", "checkpoint_sha256": checkpoint}
    write_text_atomic(cache, json.dumps(record, indent=1) + "\n")
    return record


def file_digest(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def diverged(run) -> bool:
    """A run whose training loss became non-finite (the study recorded ``NonFiniteLossError``).
    Rerunning resumes from its last checkpoint and diverges again, so it has ended: the final step
    tests its best.pt (the best validation epoch before the divergence) and says so; one that
    diverged before its first evaluation has no model and no test number (PREREGISTRATION.md,
    2026-11-27, 5)."""
    return not run.finished and nonfinite_record(run.record_dir)


def nonfinite_record(record_dir: Path) -> bool:
    """The study runner's record of a run (``record_dir``) says its loss became non-finite."""
    path = record_dir / "error.txt"
    return path.is_file() and path.read_text(encoding="utf-8", errors="replace").startswith("NonFiniteLossError")


def ended(run) -> bool:
    return run.finished or diverged(run)


def evaluated(run) -> bool:
    """A run the final step can take: finished with its best.pt, or diverged (with or without one)."""
    return diverged(run) or (run.finished and (run.out_dir / "best.pt").is_file())


def selected(run, objective: str) -> dict:
    """best.pt's epoch and validation value: from metrics.json, or for a diverged run from its log
    (the best validation record before the divergence; {} when it had none)."""
    if run.finished:
        return json.loads((run.out_dir / "metrics.json").read_text()).get("selected") or {}
    best = max(val_records(run.out_dir, objective), key=lambda r: r[objective], default=None)
    return {} if best is None else {"epoch": best.get("epoch"), "value": best[objective]}


def run_row(proto: Protocol, run, metrics, objective: str, cross_domain: bool = True) -> tuple[dict | None, dict]:
    """An ended run's test record (:func:`test_evaluation`; None for a diverged run without a
    best.pt) and the columns every results table shares: seed, epochs, ``metrics`` on test, wall
    time, best.pt's epoch and validation value, whether the validation curve of ``objective``
    flattened, and its status (finished, or diverged after its last evaluation)."""
    has_model = (run.out_dir / "best.pt").is_file()
    test = test_evaluation(run.out_dir, proto.args.device, cross_domain=cross_domain) if has_model else None
    sel, curve = selected(run, objective), val_curve(run.out_dir, objective)
    if run.finished:
        summary = json.loads((run.out_dir / "metrics.json").read_text())
        epochs, wall, status = summary.get("epochs"), summary.get("wall_time_s"), "finished"
    else:  # diverged: the epochs it was given, the wall time of its attempts (the study's record)
        record = run.record_dir / "attempts.json"
        epochs = run.raw["train"]["epochs"]
        wall = json.loads(record.read_text()).get("wall_time_s") if record.is_file() else None
        status = f"diverged after {len(curve)} evaluation(s)" + ("" if has_model else ", no model: no test number")
    return test, {"seed": run.seed, "epochs": epochs,
                  **{m: (test["metrics"][m] if test is not None else None) for m in metrics},
                  "wall_time_s": wall, "best_epoch": sel.get("epoch"), "val_objective": sel.get("value"),
                  "val_flattened": flattened(curve), "status": status}


def result_row(proto: Protocol, run, loss: str, completed: int) -> dict:
    test, row = run_row(proto, run, METRICS, spec.OBJECTIVE)
    embedding = test["embedding"] if test is not None else run.raw["eval"]["embedding"]
    return {"loss": loss, "completed_trials": completed,
            "optimizer": test["optimizer"] if test is not None else run.raw["optim"]["name"],
            "embedding": spec.EMBEDDING_NAMES[embedding], **row}


def final_rows(proto: Protocol, study, groups: dict[str, tuple[str, list[int], int]]) -> list[dict]:
    """``groups``: variant -> (loss name in the table, its seeds, completed trials); a group is
    evaluated only when all its seeded runs have finished."""
    rows = []
    by_key = {r.key: r for r in study.runs}
    for variant, (loss, seeds, completed) in groups.items():
        runs = [by_key[f"{variant}/seed{s}"] for s in seeds]
        if not all(evaluated(r) for r in runs):
            proto.log(f"final: {variant}: {sum(ended(r) for r in runs)}/{len(runs)} seeded runs ended: not yet")
            continue
        rows += [result_row(proto, r, loss, completed) for r in runs]
    return rows


GLYPH_METRICS = ("recall@1", "map@r")  # cross-family: held-out-family queries against the training families
GLYPH_COLUMNS = ["variant", "seed", "epochs", *GLYPH_METRICS, "wall_time_s", "best_epoch", "val_objective",
                 "val_flattened", "status"]


def glyph_run_keys() -> list[str]:
    """The glyph analysis's run keys (variant/seedN), as its study names them."""
    return [f"{v}/seed{s}" for v in spec.GLYPH_VARIANTS for s in spec.CLAIM_SEEDS]


def glyph_rows(proto: Protocol) -> list[dict]:
    """The glyph analysis on its test split (best.pt once each), only once all its runs finished."""
    study = glyph_study(proto)
    if not all(evaluated(r) for r in study.runs):
        proto.log(f"final: glyphs: {sum(ended(r) for r in study.runs)}/{len(study.runs)} runs ended: not yet")
        return []
    return [{"variant": run.variant, **run_row(proto, run, GLYPH_METRICS, "recall@1", cross_domain=False)[1]}
            for run in study.runs]


BASELINE_COLUMNS = ["baseline", "cross_domain_recall@1", "cross_domain_map@r", "description"]


def baseline_rows(proto: Protocol) -> list[dict]:
    """The pre-registered reference rows of the ranked table, on the test emoji every loss is
    tested on, evaluated by the same code as the seeded runs (``cross_domain_metrics``): raw
    pixels (the flattened images in [0, 1], cosine: what needs no training, as ``deepmetric emoji
    pixels``) and the untouched network (the recipe's network before any training, its pooled
    features through the shift-only BN: for the ImageNet EfficientNet-Lite0, the ImageNet
    features every loss starts from).  Deterministic: computed once by the final step."""
    import numpy as np

    from deepmetric.run.builders import build_model, build_test_sets, seed_everything
    from deepmetric.run.config_io import load_config
    from deepmetric.run.device import resolve_device
    from deepmetric.run.evaluation import cross_domain_metrics, evaluate_split

    cfg = load_config(proto.recipe, proto.common + ["eval.embedding=embedding", "eval.cross_domain=true"])
    dev = resolve_device("cuda" if proto.args.device == "cuda" else "cpu")
    sets = build_test_sets(cfg)
    test = sets["query"]
    pixels = test.images.reshape(len(test), -1).astype(np.float32) / 255.0
    at_pixels = cross_domain_metrics({"embeddings": pixels, "labels": np.asarray(test.labels)}, test, cfg)
    seed_everything(spec.SEEDS[0])  # the projection head is random; the pooled features it leaves alone
    model = build_model(cfg, num_classes=test.num_classes).to(dev)
    at_start, _ = evaluate_split(model, sets, cfg, device=dev)
    weights = cfg.model.options.get("pretrained") or "untrained"
    return [{"baseline": "raw pixels", **{m: at_pixels[m] for m in METRICS},
             "description": f"flattened {pixels.shape[1]}-d images in [0, 1], cosine"},
            {"baseline": "untouched network", **{m: at_start[m] for m in METRICS},
             "description": f"{cfg.model.name} ({weights}) before training: pooled features"}]


def check_final_ready(proto: Protocol, study) -> list[str]:
    """The test split is read once, at the end (PREREGISTRATION.md): every loss of the table has
    finished its tune and all its seeded runs (and, with ALMN beta 3, the beta sweep and the runs
    at its best beta), except the losses ``--cut`` names, which must be the last ones of the table
    (the pre-registered rule: losses are cut from the end, never the protocol).  Returns the
    losses the final step evaluates.  ``study``: the seeded runs' (:func:`seeds_study`)."""
    table, kept = list(spec.LOSSES), kept_losses(proto, "final")
    done = {r.key for r in (study.runs if study is not None else []) if evaluated(r)}
    missing = [n for n in kept if not proto.finished(n) or any(f"{n}/seed{s}" not in done for s in spec.seeds_of(n))]
    if "almn_beta3" in kept and "almn_beta3" not in missing:
        for kind, build in (("almn_beta", almn_study), ("almn_more", almn_more_study)):
            extra = build(proto)
            if extra is None or not all(evaluated(r) for r in extra.runs):
                missing.append(f"{kind} (its phase)")
    if missing:
        in_table = [m for m in table if m in missing]
        suffix = cut_from(in_table[0]) if in_table else []  # from the first unfinished loss to the end
        raise ProtocolError(f"final: the test split is read once, at the end, and these have not finished their tune "
                            f"and seeded runs: {missing}. Finish them"
                            + (f", or cut losses from the end of the table (--cut {' '.join(suffix)})" if suffix else "")
                            + "; nothing was evaluated")
    return kept


def run_final_phase(proto: Protocol) -> None:
    from deepmetric.run.rundir import write_text_atomic

    check_preregistration(proto)
    if not (proto.copy / "two_head_accuracy.json").is_file():
        # H5a / H5b are in the Holm family: a final step without them would print verdicts for the
        # others that a later one rewrites (their adjusted p-values change)
        raise ProtocolError(f"final: {proto.copy / 'two_head_accuracy.json'} does not exist: the two-head study's "
                            "final step (bench/two_head_accuracy.py --phase all) copies it once every two-head run "
                            "has ended, and H5a / H5b belong to the family the verdicts are corrected over; "
                            "nothing was evaluated")
    study = seeds_study(proto)
    kept = check_final_ready(proto, study)
    cut = [n for n in spec.LOSSES if n not in kept]
    final = proto.runs / "final.json"
    recorded = final if final.is_file() else proto.copy / "final.json"  # a fresh clone has the committed copy
    first_cut = json.loads(recorded.read_text())["cut"] if recorded.is_file() else cut
    if first_cut != cut:  # test numbers exist: adding (or dropping) a loss now could change H6's pick after the fact
        raise ProtocolError(f"final: the first final step cut {first_cut} (recorded in {recorded}); test numbers "
                            "exist, so the cut stays as it was: run final with the same --cut")
    write_text_atomic(final, json.dumps({"cut": cut}) + "\n")  # the summary says so
    copy_text(final, proto.copy / "final.json", proto)  # for the commit, even if this step fails later
    if study is not None:
        groups = {n: (n, spec.seeds_of(n), tune_record(proto, n)["completed"]) for n in proto.tuned() if n in kept}
        rows = final_rows(proto, study, groups)
        write_csv(proto.runs / "results.csv", rows, RESULT_COLUMNS)
        if rows and not (proto.runs / "baselines.csv").is_file():
            write_csv(proto.runs / "baselines.csv", baseline_rows(proto), BASELINE_COLUMNS)
    almn = almn_study(proto) if "almn_beta3" in kept else None
    if almn is not None:
        completed = tune_record(proto, "almn_beta3")["completed"]
        groups = {v: (f"almn_sweep_{v}", spec.BETA_SEEDS, completed) for v in almn.variants}
        write_csv(proto.runs / "almn_beta.csv", final_rows(proto, almn, groups), RESULT_COLUMNS)
    more = almn_more_study(proto) if "almn_beta3" in kept else None
    if more is not None:
        completed = tune_record(proto, "almn_beta3")["completed"]
        groups = {v: (f"almn_{v}", spec.BETA_SEEDS, completed) for v in more.variants}
        write_csv(proto.runs / "almn_more.csv", final_rows(proto, more, groups), RESULT_COLUMNS)
    glyphs = glyph_rows(proto)
    if glyphs:
        write_csv(proto.runs / "glyphs.csv", glyphs, GLYPH_COLUMNS)
    write_summary(proto)
    copy_results(proto)


# --------------------------------------------------------------------------- exploratory (not pre-registered)
#: the optional analysis of PREREGISTRATION.md, 2026-11-28, twelfth session, corrections 3: chosen
#: after the control's validation numbers, so it runs only after the final step and has no verdict
EXPLORATORY = "exploratory"
EXPLORATORY_COLUMNS = ["loss", "seed", "settings", "epochs", *METRICS, "wall_time_s", "best_epoch", "val_objective",
                       "val_flattened", "status"]


def exploratory_losses(proto: Protocol) -> list[str]:
    """The losses whose control run lies above every one of their own seeded runs on validation
    (the control's reading rule, ``spec.control_beyond_own_runs``), in the table's order; recorded
    in runs/exploratory/losses.json at the first call: a later, different set is an error."""
    rows = read_csv(proto.runs / "control.csv")
    if not rows:
        raise ProtocolError(f"{EXPLORATORY}: {proto.runs / 'control.csv'} does not exist; the losses are those the "
                            "control showed doing better at the winner's settings: run --phase control first")
    above, _, _ = spec.control_beyond_own_runs(rows, {r["loss"]: own_seeded_values(proto, r["loss"]) for r in rows})
    final = proto.runs / "final.json"
    cut = json.loads(final.read_text())["cut"] if final.is_file() else []  # tested at their own settings: never
    record = {"losses": [n for n in spec.LOSSES if n in above and n not in cut]}
    path = proto.runs / EXPLORATORY / "losses.json"
    before = recorded_choice(path, record, ("losses",))
    if before is not None:
        raise ProtocolError(f"{EXPLORATORY}: the control now reads {record['losses']}, the runs in {path.parent} are "
                            f"of {before['losses']}; move that folder away to run them again")
    return record["losses"]


def exploratory_study(proto: Protocol):
    """Each of :func:`exploratory_losses` at the winner's shared settings, its own tuned option
    kept (the control's variant), on the ranked table's seeds ``SEEDS``; the seed-100 run is that
    loss's control run (the same training: trained once, by the control phase)."""
    losses = exploratory_losses(proto)
    control, win = control_study(proto)
    variants = {n: at_winner_settings(proto, n, win) for n in losses}
    study = make_study(proto, EXPLORATORY, variants, list(spec.SEEDS)) if variants else None
    if study is not None:
        reuse_twins(study, {r.key: r for r in control.runs}, lambda run: run.key)
        fresh = [r.key for r in study.runs if r.seed == spec.SEEDS[0] and not is_seeded_twin(study, r)]
        if fresh:  # defensive: the variants are the control's, so only a change to either could part them
            raise ProtocolError(f"{EXPLORATORY}: {', '.join(fresh)} would not be the same training as the control's "
                                "run of that seed (their resolved configs differ); seed 100 is that run, never "
                                "trained again: nothing was trained")
    return study, win


def run_exploratory_phase(proto: Protocol) -> None:
    """Train the exploratory runs (after the final step only), then test each best.pt once and
    write ``exploratory.csv`` and ``exploratory.md`` (copied, paths relative)."""
    if not (proto.runs / "verdicts.json").is_file() or not (proto.runs / "results.csv").is_file():  # final's last files
        raise ProtocolError(f"{EXPLORATORY}: not pre-registered, chosen after the control's validation numbers, so it "
                            "runs after the final step only (PREREGISTRATION.md, 2026-11-28, twelfth session, "
                            "corrections 3): run --phase final first")
    study, win = exploratory_study(proto)
    if study is None:
        proto.log(f"{EXPLORATORY}: no loss did better at the winner's settings than at its own: nothing to run")
        return
    twins = sorted(r.key for r in study.runs if is_seeded_twin(study, r))
    if twins:
        proto.log(f"{EXPLORATORY}: {', '.join(twins)}: the control's runs (the same training), trained by the "
                  "control phase")
    # by key, and only the phase's own runs: the worker processes reload runs/exploratory.yaml
    run_study_phase(proto, study, [r.key for r in study.runs if not is_seeded_twin(study, r)])
    if not all(evaluated(r) for r in study.runs):
        proto.log(f"{EXPLORATORY}: {sum(ended(r) for r in study.runs)}/{len(study.runs)} runs ended: not tested yet")
        return
    rows = [{"loss": run.variant, "settings": f"winner's ({win['loss']})",
             **run_row(proto, run, METRICS, spec.OBJECTIVE)[1]} for run in study.runs]
    write_csv(proto.runs / "exploratory.csv", rows, EXPLORATORY_COLUMNS)
    from deepmetric.run.rundir import write_text_atomic

    write_text_atomic(proto.runs / "exploratory.md", "\n".join(exploratory_markdown(proto)) + "\n")
    for name in ("exploratory.csv", "exploratory.md"):
        copy_text(proto.runs / name, proto.copy / name, proto)


def exploratory_markdown(proto: Protocol) -> list[str]:
    """The exploratory table: each loss at the winner's settings on test (mean, sd), beside itself
    at its own settings (results.csv, the same seeds) and beside the winner, paired by seed with
    95 % t intervals, and the reference rows; no verdict words."""
    from deepmetric.report.study_tables import mean_ci

    rows = read_csv(proto.runs / "exploratory.csv")
    results = [r for r in read_csv(proto.runs / "results.csv") if int(r["seed"]) in spec.SEEDS]
    win = json.loads((proto.runs / "control" / "winner.json").read_text())
    ref = win["loss"]
    later = [s for s in spec.SEEDS if s != spec.SEEDS[0]]
    lines = ["# Exploratory, not pre-registered: the losses whose control run did better on validation, trained "
             "at the winner's settings and tested", "",
             "Chosen after the control's validation numbers and run after the final step (PREREGISTRATION.md, "
             "2026-11-28, twelfth session, corrections 3). No verdict words, no correction for multiple comparisons, "
             "and no verdict of summary.md changes. Each loss below trained at the winner's settings ("
             f"{ref}'s: {', '.join(_setting_text(o) for o in win['shared'])}), its own tuned main option kept, on "
             f"seeds {', '.join(map(str, spec.SEEDS))} (seed {spec.SEEDS[0]} is its control run); test cross-vendor "
             "Recall@1 and MAP@R of best.pt (chosen on validation), points. 'Own' is the same loss at its own "
             f"tuned settings (results.csv, the same seeds); differences are paired by seed, with 95 % t intervals "
             f"(n = the seeds both have). Seed {spec.SEEDS[0]}'s run is the one whose validation number put the loss "
             "in this table (it lay above every one of the loss's own runs), so a difference that includes it leans "
             f"towards the winner's settings; the column on seeds {'-'.join(map(str, later))} alone leaves it out "
             f"(two seeds: a wide interval).", "",
             f"| loss | seeds | R@1 at the winner's settings (sd) | R@1 at its own settings | winner's - own | "
             f"winner's - own, seeds {'-'.join(map(str, later))} | this loss at the winner's settings - {ref} | "
             f"MAP@R at the winner's settings | winner's - own | this loss - {ref} | flattened |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    tag = " @ winner's settings"
    pool = [{**r, "loss": r["loss"] + tag} for r in rows] + results

    def cell(a: str, b: str, metric: str, seeds=None) -> str:
        t = paired([r for r in pool if seeds is None or int(r["seed"]) in seeds], a, b, metric)
        return "-" if t["n"] == 0 else f"{interval_cell(t)} (n={t['n']})"

    for loss in dict.fromkeys(r["loss"] for r in rows):
        mine = [r for r in rows if r["loss"] == loss]
        own = [r for r in results if r["loss"] == loss]
        values = tested(mine, METRICS[0])
        r1, mp, own_r1 = mean_ci(values), mean_ci(tested(mine, METRICS[1])), mean_ci(tested(own, METRICS[0]))
        flat = sum(r["val_flattened"] == "True" for r in mine)
        lines.append(f"| {loss} | {len(values)} | {100 * r1['mean']:.2f} ({100 * r1['std']:.2f}) | "
                     f"{100 * own_r1['mean']:.2f} | {cell(loss + tag, loss, METRICS[0])} | "
                     f"{cell(loss + tag, loss, METRICS[0], later)} | "
                     f"{cell(loss + tag, ref, METRICS[0])} | {100 * mp['mean']:.2f} | {cell(loss + tag, loss, METRICS[1])} | "
                     f"{cell(loss + tag, ref, METRICS[1])} | {flat}/{len(mine)} |")
    mine = [r for r in results if r["loss"] == ref]
    if mine:
        r1, mp = mean_ci(tested(mine, METRICS[0])), mean_ci(tested(mine, METRICS[1]))
        lines.append(f"| {ref} (the winner; its own settings are the winner's) | {len(tested(mine, METRICS[0]))} | "
                     f"{100 * r1['mean']:.2f} ({100 * r1['std']:.2f}) | {100 * r1['mean']:.2f} | - | - | - | "
                     f"{100 * mp['mean']:.2f} | - | - | - |")
    lines += ["", "Reference rows on the same test emoji (baselines.csv; no training, no seeds):", "",
              "| reference | R@1 | MAP@R |", "|---|---|---|"]
    lines += [f"| {b['baseline']} ({b['description']}) | {100 * float(b[METRICS[0]]):.2f} | "
              f"{100 * float(b[METRICS[1]]):.2f} |" for b in read_csv(proto.runs / "baselines.csv")]
    return lines


# --------------------------------------------------------------------------- tables
def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    from deepmetric.run.rundir import write_text_atomic

    import io

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")  # quotes a cell with a comma (a description)
    writer.writerow(columns)
    for r in rows:
        writer.writerow(["" if r.get(c) is None else (f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c]))
                         for c in columns])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, out.getvalue())


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def selected_val(run_dir: Path) -> dict:
    """A finished run's validation metrics at the epoch best.pt was chosen on (both of METRICS;
    empty when none was chosen)."""
    chosen = json.loads((run_dir / "metrics.json").read_text()).get("selected") or {}
    at = [r for r in val_records(run_dir, spec.OBJECTIVE) if r.get("epoch") == chosen.get("epoch")]
    return {m: at[-1].get(m) for m in METRICS} if at else {}


def write_control(proto: Protocol) -> None:
    """control.csv: every loss at the winner's settings beside its own (seed 100), validation
    Recall@1 and MAP@R at the epoch each run's best.pt was chosen on; ``same_run`` where the
    winner's settings are the loss's own (one training, its seeded run: ``control_study``)."""
    study, win = control_study(proto)
    seeds = seeds_study(proto)
    own = {r.variant: r for r in (seeds.runs if seeds is not None else []) if r.seed == spec.SEEDS[0]}
    rows = []
    for run in study.runs:
        if not run.finished:
            continue
        at_win = selected_val(run.out_dir)
        mine = own.get(run.variant)
        at_own = selected_val(mine.out_dir) if mine is not None and mine.finished else {}
        rows.append({"loss": run.variant, "seed": run.seed, "winner": win["loss"],
                     "tune_best_val": tune_record(proto, run.variant)["value"],
                     "val_at_own_settings": at_own.get(METRICS[0]), "val_at_winner_settings": at_win.get(METRICS[0]),
                     "val_map_at_own_settings": at_own.get(METRICS[1]),
                     "val_map_at_winner_settings": at_win.get(METRICS[1]),
                     "same_run": mine is not None and run.out_dir == mine.out_dir})
    cols = ["loss", "seed", "winner", "tune_best_val", "val_at_own_settings", "val_at_winner_settings",
            "val_map_at_own_settings", "val_map_at_winner_settings", "same_run"]
    write_csv(proto.runs / "control.csv", rows, cols)
    copy_text(proto.runs / "control.csv", proto.copy / "control.csv", proto)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment (Holm 1979): the i-th smallest of m p-values becomes
    max over j <= i of min(1, (m - j + 1) p_(j))."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    out, running = [float("nan")] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        out[i] = running
    return out


def paired(rows: list[dict], a: str, b: str, metric: str, key: str = "loss") -> dict:
    """Paired difference A - B over the seeds both have (``seeds``): mean, 95 % t interval,
    two-sided paired t-test p-value (NaN with fewer than 2 seeds; with no spread at all, as
    scipy's t statistic is then infinite or undefined: 0 when every difference is the same
    non-zero value, 1 when they are all 0)."""
    from scipy import stats

    from deepmetric.report.study_tables import mean_ci, paired_values

    seeds, diffs = paired_values(rows, a, b, metric, key)
    ci = mean_ci(diffs)
    if len(diffs) < 2:
        p = float("nan")
    elif ci["std"] > 0:
        p = float(stats.ttest_1samp(diffs, 0.0).pvalue)
    else:
        p = 0.0 if diffs[0] != 0 else 1.0
    return {"a": a, "b": b, "n": len(seeds), "seeds": seeds, **ci, "p": p}


def verdict(test: dict, holm_p: float) -> str:
    """The pre-registered decision rule on the primary metric (fractions; points = x 100)."""
    if test["n"] < 2 or not math.isfinite(test["mean"]):
        return "not resolved"
    if holm_p < spec.ALPHA:
        return "holds" if test["mean"] > 0 else "reversed"
    if math.isfinite(test["ci_high"]) and test["ci_high"] < spec.MIN_GAIN_POINTS / 100:
        return "does not hold"
    return "not resolved"


def best_by_tune(proto: Protocol, group: list[str], rows: list[dict]) -> str | None:
    """The loss of ``group`` with the best tuned validation objective (among those with results)."""
    have = {r["loss"] for r in rows}
    tuned = [n for n in group if n in have and proto.finished(n)]
    return max(tuned, key=lambda n: tune_record(proto, n)["value"]) if tuned else None


def hypothesis_tests(proto: Protocol, rows: list[dict], metric: str) -> list[tuple[str, dict | None]]:
    """H1-H4, H5a / H5b (two_head_accuracy.csv in the copy, its top-1 or macro accuracy) and H6:
    the whole pre-registered family, None for a test whose runs are not there yet."""
    have = {r["loss"] for r in rows}
    out = [(h, paired(rows, a, b, metric) if a in have and b in have else None) for h, a, b in spec.COMPARISONS]
    two = read_csv(proto.copy / "two_head_accuracy.csv")
    col = "top1" if metric == spec.OBJECTIVE else "macro_accuracy"
    # the two-head final step has run (its summary is copied) even when no run could be tested
    two_done = bool(two) or (proto.copy / "two_head_accuracy.json").is_file()
    out += [(h, paired(two, a, b, col, key="variant") if two_done else None) for h, a, b in spec.TWO_HEAD]
    ours, pml = best_by_tune(proto, spec.OURS, rows), best_by_tune(proto, spec.PML, rows)
    shared = [r for r in rows if int(r["seed"]) in spec.SEEDS]  # H6 is pre-registered on seeds 100-102
    out.append(("H6", paired(shared, ours, pml, metric) if ours and pml else None))
    return out


def family(proto: Protocol, rows: list[dict], metric: str) -> list[tuple[str, dict | None, float]]:
    """The family's tests on ``metric`` with their Holm-adjusted p-values (over all seven: a test
    not run yet counts as p = 1, so it never helps the others)."""
    tests = hypothesis_tests(proto, rows, metric)
    adjusted = holm([t["p"] if t is not None and math.isfinite(t["p"]) else 1.0 for _, t in tests])
    return [(h, t, adj) for (h, t), adj in zip(tests, adjusted)]


def verdict_records(proto: Protocol, rows: list[dict]) -> list[dict]:
    """One record per hypothesis for verdicts.json (bench/study_claims.py puts them in
    CLAIMS.md): the claim, its budget, the primary test with its Holm p and verdict, and the
    secondary metric's difference beside it (points; None where the runs are not there yet)."""
    def finite(x):  # JSON has no NaN: an undefined interval or p-value (under 2 seeds, no spread) is null
        return float(x) if x is not None and math.isfinite(x) else None

    def points(t):
        return None if t is None else {"a": t["a"], "b": t["b"], "n": t["n"], "mean": finite(100 * t["mean"]),
                                       "ci_low": finite(100 * t["ci_low"]), "ci_high": finite(100 * t["ci_high"])}

    primary, secondary = family(proto, rows, METRICS[0]), family(proto, rows, METRICS[1])
    pending = pending_tests(primary)
    out = []
    for (h, t, adj), (_, t2, _) in zip(primary, secondary):
        text, paper = spec.HYPOTHESES[h]
        metrics = ["test top-1 (twitter)", "macro accuracy"] if h.startswith("H5") else list(METRICS)
        out.append({"id": h, "claim": text, "paper": paper, "budget": comparison_budget(proto, h, t, rows),
                    "convergence": comparison_convergence(proto, h, t, rows),
                    "metric": metrics[0], "test": points(t), "p": None if t is None else finite(t["p"]),
                    "holm_p": None if t is None else finite(adj),
                    "verdict": "pending" if t is None else verdict(t, adj),
                    # a verdict read while tests of the family are missing (p = 1 in Holm) may still
                    # turn into "holds" / "reversed" when they arrive: it is provisional until then
                    "provisional": bool(pending) and t is not None, "pending_tests": pending,
                    "secondary_metric": metrics[1], "secondary": points(t2)})
    return out


def pending_tests(fam: list[tuple[str, dict | None, float]]) -> list[str]:
    """The tests of the family whose runs are not there yet."""
    return [h for h, t, _ in fam if t is None]


def comparison_budget(proto: Protocol, h: str, t: dict | None, rows: list[dict]) -> str:
    """What a hypothesis's verdict rests on (pre-registered: printed beside it): epochs, completed
    trials and the seeds paired; the two-head tests' own closed-set budget."""
    if h.startswith("H5"):
        two = two_head_script()
        return (f"emoji closed set, 1,911 classes, {two.EPOCHS} epochs, lr on a validation vendor, "
                f"seeds {seed_list(t)}" + two_head_divergences(proto, h))
    return budget_text(rows, t)


def two_head_divergences(proto: Protocol, h: str) -> str:
    """H5's diverged runs (PREREGISTRATION.md, 2026-11-28, eleventh session, later), from the two-head
    final step's summary: tested from an earlier checkpoint, without a model, or a variant whose
    every lr diverged; empty when none."""
    path = proto.copy / "two_head_accuracy.json"
    if not path.is_file():
        return ""
    summary = json.loads(path.read_text(encoding="utf-8"))
    variants = dict((x, (a, b)) for x, a, b in spec.TWO_HEAD)[h]
    notes = [(label, [n for n in summary.get(key, []) if n.split("/")[0] in variants])
             for key, label in (("diverged_tested_from_last_checkpoint", "diverged, tested from the last checkpoint"),
                                ("diverged_without_a_model", "diverged before any checkpoint, no test number"),
                                ("variants_every_lr_diverged", "every lr diverged, no runs"))]
    return "".join(f"; {label}: {', '.join(names)}" for label, names in notes if names)


def comparison_convergence(proto: Protocol, h: str, t: dict | None, rows: list[dict]) -> str:
    """Beside the budget (PREREGISTRATION.md, 2026-11-28): how far the compared runs converged
    (:func:`convergence_text`; H5: :func:`two_head_convergence`) and the candidates each tune drew
    before its 12th completed trial (:func:`draw_cells`)."""
    if t is None:
        return "-"
    if h.startswith("H5"):
        return two_head_convergence(proto, t)
    drawn = [f"{n} {len(tune_progress(proto, n)['draws'])}" for n in (t["a"], t["b"]) if proto.finished(n)]
    return convergence_text(rows, t) + ("; candidates drawn " + ", ".join(drawn) if drawn else "")


def heated(loss: str) -> bool:
    """A heated-up variant of the table (HBN, HLN): its alpha and lr drop at :func:`spec.heat_at`."""
    return any(o.startswith("schedule.temperature={name: heat_up") for o in spec.overrides(loss))


def convergence_text(rows: list[dict], t: dict) -> str:
    """Beside a verdict (issue 30 item 4): per loss compared, on the seeds paired, how many
    validation curves flattened (no gain above 0.5 points over the last two evaluations; under a
    cosine schedule that ends at lr 0 this is partly by construction); for a heated-up variant, how
    many of its best.pt were chosen at a heated epoch (at none, A - B measures no heating at all;
    a heating gain above 0.5 points also shows as a curve that did not flatten)."""
    parts = []
    for loss in (t["a"], t["b"]):
        mine = [r for r in rows if r["loss"] == loss and int(r["seed"]) in t["seeds"]]
        flat = sum(str(r.get("val_flattened")) == "True" for r in mine)
        text = f"{loss} flattened {flat}/{len(mine)}"
        if heated(loss):  # a run without a known best epoch (diverged before any evaluation) is not counted
            known = [r for r in mine if r.get("best_epoch") not in (None, "")]
            at = [r for r in known if int(float(r["best_epoch"])) > spec.heat_at(int(r["epochs"]))]
            unknown = len(mine) - len(known)
            text += f", best.pt at a heated epoch {len(at)}/{len(known)}" + (f", {unknown} unknown" if unknown else "")
        parts.append(text)
    return "; ".join(parts)


def two_head_convergence(proto: Protocol, t: dict) -> str:
    """H5's seeded runs have no validation vendor (they train on all five): their convergence is the
    lr run's at the chosen lr (seed 0, the same epochs and schedule, facebook held out), from the
    copied lr tables; and whether the chosen lr is an end of the grid (PREREGISTRATION.md,
    2026-11-28, fourteenth session: then the variant's own best lr may lie beyond it)."""
    chosen_path = proto.copy / "two_head_chosen_lr.json"
    lr_rows = read_csv(proto.copy / "two_head_lr_runs.csv")
    if not chosen_path.is_file() or not lr_rows:
        return "-"
    chosen = json.loads(chosen_path.read_text())
    parts = []
    for variant in (t["a"], t["b"]):
        entry = chosen.get(variant, {})
        lr, grid = entry.get("lr"), entry.get("grid") or []
        run = next((r for r in lr_rows if r["variant"] == variant and lr is not None
                    and math.isclose(float(r["lr"]), float(lr))), None)
        if run is None:
            parts.append(f"{variant} -")
            continue
        gain = "-" if run.get("last_gain_points") in (None, "") else f"{float(run['last_gain_points']):+.2f}"
        flat = {"True": "flattened", "False": "not flattened"}.get(str(run.get("flattened")), "-")
        edge = ("" if len(grid) < 2 else ", the grid's upper end" if math.isclose(float(lr), max(grid))
                else ", the grid's lower end" if math.isclose(float(lr), min(grid)) else "")
        parts.append(f"{variant} lr run at lr {float(lr):g}{edge}: {flat} (last gain {gain} points)")
    return "no validation in the seeded runs; " + "; ".join(parts)


def seed_list(t: dict | None) -> str:
    """The seeds a paired test used (``100-104``, or a list where some are missing)."""
    seeds = [] if t is None else t["seeds"]
    if not seeds:
        return "-"
    if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 1:
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def budget_text(rows: list[dict], t: dict | None) -> str:
    """The budget of one comparison (the pre-registration: epochs, completed trials, seeds), read
    from the rows of the two losses it compares."""
    mine = [r for r in rows if t is not None and r["loss"] in (t["a"], t["b"])]
    epochs = "/".join(sorted({str(r["epochs"]) for r in mine}, key=int)) or "-"
    completed = "/".join(sorted({str(r["completed_trials"]) for r in mine}, key=int)) or "-"
    return f"emoji 64 px, {epochs} epochs, {completed} completed tune trials per loss, seeds {seed_list(t)}"


def hypotheses_markdown(proto: Protocol, rows: list[dict]) -> list[str]:
    """The family's tables, one per metric; the primary one gives each verdict with its budget,
    marked provisional while tests of the family have no runs (see verdict_records)."""
    lines = []
    for metric in METRICS:
        fam = family(proto, rows, metric)
        tests, adjusted = [(h, t) for h, t, _ in fam], [adj for _, _, adj in fam]
        primary = metric == spec.OBJECTIVE
        pending = pending_tests(fam)
        lines += [f"### {metric}" + (" (primary: the decision rule)" if primary else " (secondary: no verdict)"), ""]
        if primary and pending:
            lines += [f"**Provisional**: {', '.join(pending)} have no runs yet and count as p = 1 in Holm's "
                      "correction; each verdict below is final only once every test of the family is in (a "
                      "missing p below 1 can only lower the others' adjusted p: a provisional *holds* stays).", ""]
        lines += ["| id | A - B | seeds | mean (points) | 95 % CI | p | Holm p |"
                  + (" budget | convergence; candidates drawn | verdict |" if primary else ""),
                  "|---|---|---|---|---|---|---|" + ("---|---|---|" if primary else "")]
        for (h, t), adj in zip(tests, adjusted):
            if t is None:
                lines.append(f"| {h} | not run yet | | | | | |" + (" | | |" if primary else ""))
                continue
            cells = (f"| {h} | {t['a']} - {t['b']} | {t['n']} | {100 * t['mean']:+.2f} | "
                     f"[{100 * t['ci_low']:+.2f}, {100 * t['ci_high']:+.2f}] | {t['p']:.4g} | {adj:.4g} |")
            mark = " (provisional)" if pending else ""
            lines.append(cells + (f" {comparison_budget(proto, h, t, rows)} | {comparison_convergence(proto, h, t, rows)} | "
                                  f"{verdict(t, adj)}{mark} |" if primary else ""))
        lines.append("")
    return lines


def has_value(row: dict, metric: str) -> bool:
    """Whether a results row holds a test value of ``metric`` (a diverged run without a model has none)."""
    return row.get(metric) not in ("", None)


def tested(rows: list[dict], metric: str) -> list[float]:
    """The test values of ``metric`` in ``rows``."""
    return [float(r[metric]) for r in rows if has_value(r, metric)]


def interval_cell(t: dict) -> str:
    """A difference (fractions) in points with its 95 % interval: ``+1.23 [-0.45, +2.91]``."""
    return f"{100 * t['mean']:+.2f} [{100 * t['ci_low']:+.2f}, {100 * t['ci_high']:+.2f}]"


def almn_markdown(proto: Protocol) -> list[str]:
    """ALMN's secondary analyses (reported with intervals, no verdict words): the beta sweep and,
    at its best beta (chosen on validation), m x n and Eq. 12's ablation; each variant's mean, sd
    and 95 % CI, and its difference to the best beta at 16 x 4, paired by seed."""
    from deepmetric.report.study_tables import mean_ci

    rows = read_csv(proto.runs / "almn_beta.csv") + read_csv(proto.runs / "almn_more.csv")
    if not rows:
        return []
    chosen = proto.runs / "almn_more" / "best_beta.json"
    beta = json.loads(chosen.read_text())["beta"] if chosen.is_file() else None
    ref = f"almn_sweep_beta{beta:g}" if beta is not None else None
    lines = ["## ALMN: the beta sweep, m x n and Eq. 12 (secondary: intervals, no verdict)", "",
             ("The sweep's best beta on validation: " + (f"{beta:g} (reference row: {ref}, batch 16 x 4)."
                                                          if ref else "not chosen yet (the sweep has not finished).")),
             "", "| variant | seeds | R@1 mean | sd | 95 % CI | R@1 vs reference | MAP@R mean | MAP@R vs reference |",
             "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["loss"] for r in rows):
        mine = [r for r in rows if r["loss"] == name]
        r1, mp = (mean_ci(tested(mine, m)) for m in METRICS)
        vs = []
        for metric in METRICS:
            t = paired(rows, name, ref, metric) if ref and name != ref else None
            vs.append("-" if t is None or t["n"] == 0 else f"{interval_cell(t)} (n={t['n']})")
        lines.append(f"| {name} | {len(tested(mine, METRICS[0]))} | {100 * r1['mean']:.2f} | {100 * r1['std']:.2f} | "
                     f"[{100 * r1['ci_low']:.2f}, {100 * r1['ci_high']:.2f}] | {vs[0]} | {100 * mp['mean']:.2f} | "
                     f"{vs[1]} |")
    return lines + [""]


def glyph_markdown(proto: Protocol) -> list[str]:
    """The glyph analysis (secondary: intervals, no verdict words): each variant's mean, sd and
    95 % CI, and the heated-up paper's comparisons paired by seed."""
    from deepmetric.report.study_tables import mean_ci

    rows = read_csv(proto.runs / "glyphs.csv")
    title = "## Heated-up on the glyph cross-family benchmark (secondary: intervals, no verdict)"
    if not rows:
        keys = glyph_run_keys()
        return [title, "", f"Not tested yet: {_finished_runs(proto.runs / 'glyphs', keys)} of {len(keys)} glyph runs "
                "have finished. The final step tests them once all have ended, and running it again then (the same "
                "--cut) adds this table (PREREGISTRATION.md, 2026-11-28, thirteenth session); if they cannot finish, "
                "this analysis has no result.", ""]
    lines = [title, "",
             f"v1's glyph settings ({spec.GLYPH_STUDY}'s base), {spec.GLYPH_EPOCHS} epochs, heating at epoch 16; "
             "held-out-family queries against the training families; points.", "",
             "| variant | seeds | R@1 mean | sd | 95 % CI | MAP@R mean | sd | flattened |", "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        r1, mp = (mean_ci(tested(mine, m)) for m in GLYPH_METRICS)
        flat = sum(r["val_flattened"] == "True" for r in mine)
        lines.append(f"| {name} | {len(tested(mine, GLYPH_METRICS[0]))} | {100 * r1['mean']:.2f} | "
                     f"{100 * r1['std']:.2f} | [{100 * r1['ci_low']:.2f}, {100 * r1['ci_high']:.2f}] | {100 * mp['mean']:.2f} | "
                     f"{100 * mp['std']:.2f} | {flat}/{len(mine)} |")
    lines += ["", "| A - B | seeds | R@1 (points) | MAP@R (points) |", "|---|---|---|---|"]
    for a, b in spec.GLYPH_COMPARISONS:
        tests = [paired(rows, a, b, metric, key="variant") for metric in GLYPH_METRICS]
        cells = ["-" if t["n"] == 0 else interval_cell(t) for t in tests]
        lines.append(f"| {a} - {b} | {tests[0]['n']} | {cells[0]} | {cells[1]} |")
    return lines + [""]


def write_summary(proto: Protocol) -> None:
    from deepmetric.report.study_tables import mean_ci
    from deepmetric.run.rundir import write_text_atomic

    rows = read_csv(proto.runs / "results.csv")
    epochs = ", ".join(sorted({r["epochs"] for r in rows}, key=int)) or "-"
    budget = ", ".join(sorted({r["completed_trials"] for r in rows}, key=int)) or "-"
    # the ranked table: every loss on the pre-registered 3 seeds (the paper claims' losses also
    # have 103-104, for H1-H4 only: ranking on 5 seeds beside 3 would compare unlike means)
    ranking_rows = [r for r in rows if int(r["seed"]) in spec.SEEDS]
    stats_by = {}
    for loss in dict.fromkeys(r["loss"] for r in ranking_rows):
        mine = [r for r in ranking_rows if r["loss"] == loss]
        stats_by[loss] = (*(mean_ci(tested(mine, m)) for m in METRICS), mine)
    ranked = sorted(stats_by, key=lambda n: -stats_by[n][0]["mean"])
    # the row every other is paired against is chosen without the test split: the best tuned
    # validation objective (ranking by test and then testing against the top would pick on test)
    ref = best_by_tune(proto, ranked, rows)
    ref_text = (f"Each loss is paired by seed against {ref}, the loss with the best tuned validation objective "
                "(chosen before the test split was read)." if ref else
                "No loss of the table has a finished tune: no reference row, no paired interval.")
    final = proto.runs / "final.json"
    cut = json.loads(final.read_text())["cut"] if final.is_file() else []
    lines = ["# Protocol v2: results (test split, evaluated once by the final step)", "",
             f"Zero-shot runs: epochs per run {epochs}; completed tune trials per loss: {budget}; seeds no tune used "
             f"(the tunes trained with seed {spec.TUNE_SEED}). Points of cross-vendor Recall@1 / MAP@R.", "",
             "Losses cut for lack of compute (the last ones of the table, as pre-registered): "
             + (", ".join(cut) if cut else "none") + ".", "",
             f"The ranked table: seeds {spec.SEEDS[0]}-{spec.SEEDS[-1]} for every loss (as pre-registered); "
             "the hypotheses below use the seeds each one lists.", "",
             ref_text, "",
             f"| rank | loss | runs | R@1 mean | sd | 95 % CI | vs {ref or 'reference'} (paired by seed) | "
             f"vs untouched network | MAP@R mean | sd | MAP@R vs {ref or 'reference'} | flattened (all its runs) | "
             "wall time per run (min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {b["baseline"]: b for b in read_csv(proto.runs / "baselines.csv")}
    untouched = base.get("untouched network")
    for i, loss in enumerate(ranked, 1):
        r1, mp, mine = stats_by[loss]
        vs = "-" if loss == ref or ref is None else interval_cell(paired(ranking_rows, loss, ref, spec.OBJECTIVE))
        vs_map = "-" if loss == ref or ref is None else interval_cell(paired(ranking_rows, loss, ref, METRICS[1]))
        b = float(untouched[spec.OBJECTIVE]) if untouched else None  # one deterministic value: the CI shifts
        vs_base = "-" if b is None else (f"{100 * (r1['mean'] - b):+.2f} [{100 * (r1['ci_low'] - b):+.2f}, "
                                         f"{100 * (r1['ci_high'] - b):+.2f}]")
        every = [r for r in rows if r["loss"] == loss]  # convergence and cost: all its seeded runs (3 or 5)
        n_diverged = sum(str(r.get("status", "")).startswith("diverged") for r in mine)  # of the runs counted
        runs_cell = f"{len(tested(mine, spec.OBJECTIVE))}" + (f" ({n_diverged} diverged)" if n_diverged else "")
        flat = sum(str(r["val_flattened"]) == "True" for r in every)
        walls = [float(r["wall_time_s"]) for r in every if r.get("wall_time_s") not in (None, "")]
        wall = f"{sum(walls) / len(walls) / 60:.1f}" if walls else "-"  # the machine: the study README says which
        lines.append(f"| {i} | {loss} | {runs_cell} | {100 * r1['mean']:.2f} | {100 * r1['std']:.2f} | "
                     f"[{100 * r1['ci_low']:.2f}, {100 * r1['ci_high']:.2f}] | {vs} | {vs_base} | "
                     f"{100 * mp['mean']:.2f} | {100 * mp['std']:.2f} | {vs_map} | {flat}/{len(every)} | {wall} |")
    for name, b in base.items():  # the references: no training (pixels), no metric learning (the network)
        lines.append(f"| - | {name} ({b['description']}) | 1 | {100 * float(b[spec.OBJECTIVE]):.2f} | - | - | - | - | "
                     f"{100 * float(b['cross_domain_map@r']):.2f} | - | - | - | - |")
    lines += ["", "## The pre-registered hypotheses (paired by seed, A - B; Holm over H1-H6, seven tests)", "",
              f"H6: the best of ours ({best_by_tune(proto, spec.OURS, rows)}) against the best "
              f"pytorch-metric-learning loss ({best_by_tune(proto, spec.PML, rows)}), each by its tune's "
              "validation objective.", ""]
    lines += hypotheses_markdown(proto, rows)
    lines += control_markdown(proto)
    lines += draws_markdown([tune_progress(proto, n) for n in spec.LOSSES])  # as progress.md: every finished tune
    lines += almn_markdown(proto)
    lines += glyph_markdown(proto)
    records = verdict_records(proto, rows)
    write_text_atomic(proto.runs / "verdicts.json", json.dumps(records, indent=1, allow_nan=False) + "\n")
    write_text_atomic(proto.runs / "summary.md", "\n".join(lines) + "\n")


def own_seeded_values(proto: Protocol, loss: str) -> list[float]:
    """Validation objective at best.pt of the loss's finished seeded runs (its own settings), as
    control.csv holds its values (write_csv: 6 significant digits), so both sides of the control's
    reading rule carry one rounding."""
    out = []
    for seed in spec.seeds_of(loss):
        run_dir = proto.runs / "seeds" / loss / f"seed{seed}"
        if (run_dir / "metrics.json").is_file():
            v = selected_val(run_dir).get(spec.OBJECTIVE)
            if v is not None:
                out.append(float(f"{v:.6g}"))
    return out


def control_markdown(proto: Protocol) -> list[str]:
    """The control (secondary, validation only, seed 100): each loss at its own tuned settings and
    at the winner's, from control.csv and control/winner.json, beside the range of its own seeded
    runs (validation, best.pt's epoch). One control run per loss, so a loss is said to do better
    at the winner's settings only when that run lies above every one of its own seeded runs:
    H6 and the ranked table compare the losses at their own settings, and this table is printed
    beside them (PREREGISTRATION.md, 2026-11-28, twelfth session)."""
    title = "## The control: every loss at the winner's settings (validation, seed 100; secondary, not tested)"
    rows = read_csv(proto.runs / "control.csv")
    path = proto.runs / "control" / "winner.json"
    if not rows or not path.is_file():
        return [title, "", "control.csv not written yet (the control phase writes it when its runs have ended).", ""]
    win = json.loads(path.read_text())
    settings = ", ".join(_setting_text(s) for s in win["shared"])

    def value(v):
        return None if v in ("", None) else float(v)

    own = {r["loss"]: own_seeded_values(proto, r["loss"]) for r in rows}  # each run's log read once
    above, below, within = spec.control_beyond_own_runs(rows, own)
    missing = [n for n in proto.tuned() if n not in {r["loss"] for r in rows}]
    lines = [title, "",
             f"The winner (the best tuned validation objective) is {win['loss']}: {settings}; each loss keeps its "
             "own tuned main option. Validation cross-vendor Recall@1 / MAP@R at each run's best.pt, points; one "
             f"control run per loss (seed {spec.SEEDS[0]}), beside the range of the loss's own seeded runs. "
             f"Of the {len(above) + len(below) + len(within)} losses whose settings differ from the winner's, the control run lies above "
             f"every seeded run at its own settings for {len(above)}"
             + (f" ({', '.join(above)}): their own tunes did not find settings as good as the winner's, so H6 and "
                "the ranked table, which compare each loss at its own settings, partly measure the tunes" if above
                else "")
             + f"; below every one for {len(below)}" + (f" ({', '.join(below)})" if below else "") + "; the others "
             "lie within the seeds' range." + (f" No control row (its run has not finished, or diverged): "
                                               f"{', '.join(missing)}." if missing else ""), "",
             "| loss | R@1 own settings (seed 100) | own settings, every seed (min-max) | R@1 winner's settings | "
             "winner's - own (seed 100) | MAP@R own | MAP@R winner's | winner's - own | the same training |",
             "|---|---|---|---|---|---|---|---|---|"]

    def pts(v):
        return "-" if value(v) is None else f"{100 * value(v):.2f}"

    def diff(a, b):
        return "-" if value(a) is None or value(b) is None else f"{100 * (value(a) - value(b)):+.2f}"

    for r in rows:
        seeded = own[r["loss"]]
        spread = "-" if not seeded else f"{100 * min(seeded):.2f}-{100 * max(seeded):.2f} ({len(seeded)})"
        same = "yes (its own settings are the winner's)" if r["same_run"] == "True" else "no"
        lines.append(f"| {r['loss']} | {pts(r['val_at_own_settings'])} | {spread} | {pts(r['val_at_winner_settings'])} | "
                     f"{diff(r['val_at_winner_settings'], r['val_at_own_settings'])} | "
                     f"{pts(r['val_map_at_own_settings'])} | {pts(r['val_map_at_winner_settings'])} | "
                     f"{diff(r['val_map_at_winner_settings'], r['val_map_at_own_settings'])} | {same} |")
    return lines + [""]


def _setting_text(override: str) -> str:
    """``optim.lr=0.0007295611181002858`` as ``optim.lr 0.00073`` (a fraction to 2 significant digits)."""
    key, _, value = override.partition("=")
    if key == "eval.embedding":  # "embedding": the backbone's pooled features (as results.csv names it)
        return f"{key} {spec.EMBEDDING_NAMES.get(value.strip(chr(34)), value)}"
    try:
        number = float(value)
        return f"{key} {number:g}" if number.is_integer() else f"{key} {number:.2g}"
    except ValueError:
        return f"{key} {value.strip(chr(34))}"


def copy_results(proto: Protocol) -> None:
    proto.copy.mkdir(parents=True, exist_ok=True)
    for name in ("results.csv", "baselines.csv", "almn_beta.csv", "almn_more.csv", "glyphs.csv", "summary.md",
                 "verdicts.json", "final.json"):
        if (proto.runs / name).is_file():
            copy_text(proto.runs / name, proto.copy / name, proto)


def commit(proto: Protocol, message: str) -> None:
    """Commit the copy (tunes, control, results) and nothing else."""
    subprocess.run(["git", "add", "-f", "--", str(proto.copy)], cwd=ROOT, check=False)
    subprocess.run(["git", "commit", "-q", "-m", message, "--", str(proto.copy)], cwd=ROOT, check=False)


# --------------------------------------------------------------------------- progress
def two_head_runs(proto: Protocol) -> Path:
    """bench/two_head_accuracy.py's default --out (runs/two_head_accuracy) beside this study's
    runs/protocol_v2, in the same clone: --progress run from another checkout with --runs finds it."""
    return proto.runs.parent / "two_head_accuracy"


def tune_progress(proto: Protocol, loss: str) -> dict:
    """A tune's trials by state and its best validation objective so far, read from its live
    storage (or, for a tune restored from its committed outputs alone, its ``trials.csv``)."""
    d = proto.tune_dir(loss)
    states, draws = [], []
    if (d / "tune.db").is_file():
        import optuna

        from deepmetric.workflows.tune_study import trial_origin, trial_state_name

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            study = optuna.load_study(study_name=f"protocol_v2__{loss}", storage=f"sqlite:///{d / 'tune.db'}")
        except Exception as exc:  # another study's storage, a damaged file: say which file
            raise ProtocolError(f"progress {loss}: {d / 'tune.db'} holds no readable study "
                                f"protocol_v2__{loss} ({exc})") from None
        trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]
        states = [trial_state_name(t) for t in trials]
        draws = [(trial_origin(t), s, t.value if s == "complete" else None)
                 for t, s in zip(trials, states) if s in ("complete", "pruned")]
    elif (d / "trials.csv").is_file():
        rows = read_csv(d / "trials.csv")
        states = [r["state"] for r in rows]
        draws = [(int(r.get("retry_of") or r["trial"]), r["state"],
                  float(r[f"val/{spec.OBJECTIVE}"]) if r["state"] == "complete" and r.get(f"val/{spec.OBJECTIVE}")
                  else None) for r in rows if r["state"] in ("complete", "pruned")]
    draws.sort(key=lambda d: d[0])  # the order the candidates were drawn: a retry at its first number
    values = [v for _, s, v in draws if s == "complete" and v is not None]
    if not values and (d / "best_overrides.json").is_file():  # a trials.csv without the objective's column
        values = [float(json.loads((d / "best_overrides.json").read_text())["value"])]
    complete = states.count("complete")
    state = ("finished" if proto.finished(loss) else
             "trials done, outputs not written yet" if complete >= proto.trials and "running" not in states else
             "under way" if states else "not started")
    return {"loss": loss, "state": state, "complete": complete, "pruned": states.count("pruned"),
            "stopped": sum(s in ("fail", "interrupted") for s in states), "running": states.count("running"),
            "best": max(values) if values else None, "draws": [(s, v) for _, s, v in draws]}


def draw_cells(tune: dict, common: int) -> tuple[int, int | None, float | None]:
    """Of a tune's candidates in the order it drew them (completed or pruned; a retried trial once,
    at its first number): how many, the position of the best completed one, and the best validation
    value among the first ``common`` candidates (the fewest any finished tune drew). 12 completed
    trials per loss, as pre-registered, let a loss whose candidates were pruned more often draw
    more of them (PREREGISTRATION.md, 2026-11-28)."""
    draws = tune["draws"]
    done = [(i, v) for i, (state, v) in enumerate(draws, 1) if state == "complete" and v is not None]
    best_at = max(done, key=lambda d: d[1])[0] if done else None
    early = [v for i, v in done if i <= common]
    return len(draws), best_at, (max(early) if early else None)


def draws_markdown(tunes: list[dict]) -> list[str]:
    """The candidates each finished tune drew, and its best validation value within the fewest
    candidates any finished tune drew: what the same number of *completed* trials gave each loss."""
    finished = [t for t in tunes if t["state"] == "finished" and t["draws"]]
    if not finished:
        return []
    common = min(len(t["draws"]) for t in finished)
    budget = max(t["complete"] for t in finished)
    lines = [f"## Candidates drawn (the same {budget} completed trials are not the same number of candidates)", "",
             "Pruned candidates do not count towards the completed trials, so a loss whose candidates were pruned "
             "more often drew more of them before its tune finished. Validation only; the seeded runs use each "
             f"tune's best, as pre-registered; the last column is what the first {common} candidates (the fewest any "
             "finished tune drew) would have given.", "",
             f"| loss | candidates drawn (completed + pruned) | the best one's position | best validation | "
             f"best within the first {common} |", "|---|---|---|---|---|"]
    for t in finished:
        drawn, best_at, early = draw_cells(t, common)
        best = "" if t["best"] is None else f"{t['best']:.4f}"
        lines.append(f"| {t['loss']} | {drawn} | {best_at or '-'} | {best} | "
                     f"{'-' if early is None else f'{early:.4f}'} |")
    return lines + [""]


def _finished_runs(folder: Path, keys: list[str]) -> int:
    return sum((folder / k / "metrics.json").is_file() for k in keys)


def _ended_two_head_runs(folder: Path, keys: list[str]) -> str:
    """Finished two-head runs, and those that diverged (they have ended too: its DIVERGED_FILE)."""
    finished = _finished_runs(folder, keys)
    mark = two_head_script().DIVERGED_FILE
    gone = sum(not (folder / k / "metrics.json").is_file() and (folder / k / mark).is_file() for k in keys)
    return f"{finished}" + (f" (+ {gone} diverged)" if gone else "")


def _finished_control_runs(proto: Protocol, keys: list[str]) -> int:
    """The control's finished runs, its seeded twins included (the list the control phase
    recorded: reading it writes nothing, where building the study would rewrite its files)."""
    path = proto.runs / "control" / TWINS_FILE
    twins = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return sum((proto.runs / twins[k] / "metrics.json").is_file() if k in twins
               else (proto.runs / "control" / k / "metrics.json").is_file() for k in keys)


def progress_markdown(proto: Protocol) -> str:
    """What has run and what is left, from the run folders (validation numbers only)."""
    import datetime

    tunes = [tune_progress(proto, n) for n in spec.LOSSES]
    lines = ["# Protocol v2: progress", "",
             f"Written by `python bench/protocol_v2.py --progress` (also by `--snapshot`) at "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC from the study's run folders. "
             "Validation numbers only: nothing of v2 is evaluated on the test split before `final`.", "",
             f"## Tunes ({proto.trials} completed trials each; at most {spec.MAX_TRIALS_FACTOR * proto.trials} "
             "finished or pruned)", "",
             f"| loss | state | completed | pruned | failed or interrupted (queued again) | running | "
             f"best validation {spec.OBJECTIVE} |", "|---|---|---|---|---|---|---|"]
    for t in tunes:
        best = "" if t["best"] is None else f"{t['best']:.4f}"
        lines.append(f"| {t['loss']} | {t['state']} | {t['complete']} | {t['pruned']} | {t['stopped']} | "
                     f"{t['running']} | {best} |")
    lines += [""] + draws_markdown(tunes)[:-1]
    open_tunes = [t for t in tunes if t["state"] != "finished"]
    more = sum(max(0, proto.trials - t["complete"]) for t in open_tunes)
    seed_keys = [f"{n}/seed{s}" for n in spec.LOSSES for s in spec.seeds_of(n)]
    control_keys = [f"{n}/seed{spec.SEEDS[0]}" for n in spec.LOSSES]
    # beta 3 at almn_beta3's settings is almn_beta3's seeded runs (almn_study): counted with them
    beta_keys = [f"beta{b:g}/seed{s}" for b in spec.BETAS if b != 3.0 for s in spec.BETA_SEEDS]
    more_keys = [f"{v}/seed{s}" for v in spec.ALMN_MORE for s in spec.BETA_SEEDS]
    glyph_keys = glyph_run_keys()
    results = read_csv(proto.runs / "results.csv")
    chosen = proto.runs / EXPLORATORY / "losses.json"  # written once the exploratory phase has started
    ex_keys = [f"{n}/seed{s}" for n in (json.loads(chosen.read_text())["losses"] if chosen.is_file() else [])
               for s in spec.SEEDS[1:]]
    two = two_head_script()  # its run folders' names
    two_lr = [f"lr/{v}/{two._lr_name(lr)}_seed{two.LR_SEED}" for v in two.VARIANTS for lr in two.LRS]
    two_seeds = [f"seeds/{v}/seed{s}" for v in two.VARIANTS for s in two.SEEDS]
    lines += ["", "## The other phases", "", "| part | finished | of |", "|---|---|---|",
              f"| seeded runs (seeds {spec.SEEDS[0]}-{spec.SEEDS[-1]}; to {spec.CLAIM_SEEDS[-1]} for the "
              f"{len(spec.CLAIM_LOSSES)} losses of H1-H4) | {_finished_runs(proto.runs / 'seeds', seed_keys)} | {len(seed_keys)} |",
              f"| control (every loss at the winner's settings, seed {spec.SEEDS[0]}) | "
              f"{_finished_control_runs(proto, control_keys)} | {len(control_keys)} |",
              f"| ALMN beta sweep (beta 3: almn_beta3's seeded runs) | "
              f"{_finished_runs(proto.runs / 'almn_beta', beta_keys)} | {len(beta_keys)} |",
              f"| ALMN at the best beta: m x n, Eq. 12 | {_finished_runs(proto.runs / 'almn_more', more_keys)} | "
              f"{len(more_keys)} |",
              f"| glyphs: heated-up variants, 20 epochs (secondary, if compute allows) | "
              f"{_finished_runs(proto.runs / 'glyphs', glyph_keys)} | {len(glyph_keys)} |",
              f"| final: seeded runs evaluated once on the test split (results.csv rows) | {len(results)} | "
              f"{len(seed_keys)} |",
              *([f"| exploratory (not pre-registered, after final): the losses the control read as better at the "
                 f"winner's settings, at those settings, seeds {spec.SEEDS[1]}-{spec.SEEDS[-1]} (seed {spec.SEEDS[0]}: the "
                 f"control's run) | {_finished_runs(proto.runs / EXPLORATORY, ex_keys)} | {len(ex_keys)} |"]
                if ex_keys else []),
              f"| two-head closed set, lr runs (bench/two_head_accuracy.py, runs/two_head_accuracy beside "
              f"{proto.runs.name}) | {_ended_two_head_runs(two_head_runs(proto), two_lr)} | {len(two_lr)} |",
              f"| two-head closed set, seeded runs | {_ended_two_head_runs(two_head_runs(proto), two_seeds)} | "
              f"{len(two_seeds)} |",
              ""] + seeded_convergence_markdown(proto) + control_markdown(proto) + [
              "## Left", "",
              (f"- Tunes: {len(open_tunes)} of {len(tunes)} not finished, at least {more} more completed trials "
               "(pruned and stopped trials come on top of them)." if open_tunes else
               f"- Tunes: all {len(tunes)} finished."),
              "- Then the phases above with fewer finished runs than planned, in the pre-registered order "
              "(seeds, control, ALMN beta sweep, ALMN m x n and Eq. 12, the two-head runs, final; the glyphs if compute "
              "allows, which may end after the first final step: PREREGISTRATION.md, 2026-11-28, thirteenth session).",
              ""]
    return "\n".join(lines)


def seeded_convergence_markdown(proto: Protocol) -> list[str]:
    """Item 4 of issue 30 while the study runs: for each loss's finished seeded runs, how many
    validation curves flattened (:func:`flattened`), the largest last gain, best.pt's epochs and
    the wall time per run. Validation logs only; the final step's tables say the same per run."""
    lines = ["## Seeded runs: convergence on validation", "",
             f"A curve has flattened when the best of its last two validation evaluations is at most 0.5 points "
             f"of {spec.OBJECTIVE} above the best before them (PREREGISTRATION.md). Finished runs only (a diverged "
             "run has ended too: counted beside them; the final tables give its curve).", "",
             "| loss | finished | flattened | largest last gain (points) | epochs | best.pt epoch | "
             "wall time per run (min) |", "|---|---|---|---|---|---|---|"]
    from deepmetric.report.study_tables import last_gain

    for loss in spec.LOSSES:
        dirs = [proto.runs / "seeds" / loss / f"seed{s}" for s in spec.seeds_of(loss)]
        done = [d for d in dirs if (d / "metrics.json").is_file()]
        # a diverged run has ended without metrics.json (the study's record says NonFiniteLossError)
        gone = sum(not (d / "metrics.json").is_file() and nonfinite_record(proto.runs / "seeds" / ".study" / loss / d.name)
                   for d in dirs)
        count = f"{len(done)}/{len(dirs)}" + (f" (+ {gone} diverged)" if gone else "")
        if not done:
            lines.append(f"| {loss} | {count} | - | - | - | - | - |")
            continue
        summaries = [json.loads((d / "metrics.json").read_text()) for d in done]
        curves = [val_curve(d, spec.OBJECTIVE) for d in done]
        gains = [g for g in (last_gain(c) for c in curves) if g is not None]
        best_epochs = sorted({(m.get("selected") or {}).get("epoch") for m in summaries} - {None})
        epochs = sorted({m.get("epochs") for m in summaries} - {None})
        walls = [m["wall_time_s"] / 60 for m in summaries if m.get("wall_time_s") is not None]
        lines.append(f"| {loss} | {count} | {sum(flattened(c) for c in curves)}/{len(done)} | "
                     f"{'-' if not gains else f'{100 * max(gains):+.2f}'} | {_span(epochs)} | {_span(best_epochs)} | "
                     f"{'-' if not walls else f'{min(walls):.1f}-{max(walls):.1f}'} |")
    return lines + [""]


def _span(values: list) -> str:
    return "-" if not values else (f"{values[0]}" if values[0] == values[-1] else f"{values[0]}-{values[-1]}")


def write_progress(proto: Protocol) -> str:
    from deepmetric.run.rundir import write_text_atomic

    text = progress_markdown(proto)
    proto.copy.mkdir(parents=True, exist_ok=True)
    write_text_atomic(proto.copy / "progress.md", text)
    return text


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", nargs="+", choices=("all",) + PHASES + EXTRA_PHASES, default=["all"],
                    help="'all' is every phase but exploratory (optional, not pre-registered, after final)")
    ap.add_argument("--only", nargs="+", default=None, help="these losses (default: the whole table, in order)")
    ap.add_argument("--epochs", type=int, default=spec.EPOCHS)
    ap.add_argument("--trials", type=int, default=spec.TRIALS, help="completed trials per loss")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--parallel", type=int, default=2,
                    help="seeded / control / sweep runs at once (worker processes; on a GPU: processes sharing it)")
    ap.add_argument("--tune-parallel", type=int, default=spec.TUNE_WORKERS,
                    help=f"trials at once in every tune (pre-registered: {spec.TUNE_WORKERS} on any machine; "
                         "another value only for tests)")
    ap.add_argument("--lanes", type=int, default=1,
                    help="losses tuned at once, each with its --tune-parallel trials (a GPU, or 2 CPU cores: no "
                         "core idles while one tune waits for its last trial); with more than one, the seeded "
                         "runs start after every tune")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "protocol_v2"))
    ap.add_argument("--copy-to", default=str(ROOT / "bench" / "studies" / "protocol_v2"))
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "protocol_v2.yaml"))
    ap.add_argument("--set", nargs="+", default=None, metavar="KEY=VALUE", help="overrides for every run")
    ap.add_argument("--summary", action="store_true", help="train and evaluate nothing: rewrite the copies")
    ap.add_argument("--snapshot", action="store_true",
                    help="train nothing: copy the unfinished tunes' storages (safe while they run) into "
                         "COPY/partial_tunes, paths relative, to commit")
    ap.add_argument("--restore", action="store_true",
                    help="train nothing: put the committed tunes (COPY/tunes, COPY/partial_tunes) into --runs "
                         "where it has none, to continue the study in a fresh clone")
    ap.add_argument("--drain", action="store_true",
                    help="train nothing: the running study's trials and seeded runs finish and nothing new starts "
                         "(no work lost, unlike Ctrl-C); it then exits 0, and the same command continues it")
    ap.add_argument("--progress", action="store_true",
                    help="train nothing: print what has run and what is left, and write COPY/progress.md")
    ap.add_argument("--cut", nargs="+", default=None, metavar="LOSS",
                    help="final: the losses left out for lack of compute, the last ones of the table (as "
                         "pre-registered); every other loss must have finished its tune and seeded runs")
    ap.add_argument("--commit", action="store_true", help="git-commit the copy after each phase")
    args = ap.parse_args(argv)
    unknown = [n for n in (args.only or []) + (args.cut or []) if n not in spec.LOSSES]
    if unknown:
        ap.error(f"unknown loss(es) {unknown}; the table has {list(spec.LOSSES)}")
    if min(args.parallel, args.tune_parallel, args.trials, args.epochs, args.lanes) < 1:
        ap.error("--parallel, --tune-parallel, --lanes, --trials and --epochs must be >= 1")
    return args


#: set when a lane fails or the command is interrupted: no lane starts another loss (a lane's
#: thread takes the next queued loss the moment its own ends, before the main thread could cancel it)
_LANES_STOP = threading.Event()


def _tune_lane(proto: Protocol, loss: str, phases: list[str]) -> None:
    if _LANES_STOP.is_set():
        return
    try:
        _tune_one(proto, loss, phases)
    except BaseException:
        _LANES_STOP.set()
        raise


def _tune_one(proto: Protocol, loss: str, phases: list[str]) -> None:
    check_drain(proto)  # draining: no lane starts another loss
    if proto.finished(loss):  # never tuned again: a tune restored from its outputs alone has no storage,
        proto.log(f"tune {loss}: finished already ({proto.tune_dir(loss)})")  # and would start over
    else:
        _run_and_commit_tune(proto, loss)
    if "seeds" in phases and proto.args.lanes == 1:  # the paper claims' losses first, each with its seeds
        run_seeds_phase(proto, [loss])  # (with lanes, after every tune: the seeded runs share one study)


def _run_and_commit_tune(proto: Protocol, loss: str) -> None:
    run_tune_phase(proto, loss)
    if proto.args.commit:
        with _COMMIT_LOCK:
            commit(proto, f"bench/studies/protocol_v2: {loss} tuned ({proto.trials} completed trials, validation)")


def run_tunes(proto: Protocol, phases: list[str]) -> None:
    """The tunes in table order, ``--lanes`` losses at once: each lane takes the next loss when
    its tune ends (each tune keeps its own pre-registered trials at a time).  A failing lane
    stops the others from starting another loss; the running ones finish."""
    _LANES_STOP.clear()
    if proto.args.lanes == 1:  # in this thread, where Ctrl-C reaches run_workers (it stops the trials)
        for loss in proto.losses:
            _tune_one(proto, loss, phases)
        return
    pool = ThreadPoolExecutor(max_workers=proto.args.lanes, thread_name_prefix="lane")
    futures = [pool.submit(_tune_lane, proto, loss, phases) for loss in proto.losses]
    try:
        for f in futures:
            f.result()
    except BaseException as exc:
        _LANES_STOP.set()
        pool.shutdown(wait=False, cancel_futures=True)  # no lane starts another loss
        if isinstance(exc, KeyboardInterrupt):  # only this thread sees Ctrl-C: pass it to the lanes' workers
            interrupt_children()
        raise
    finally:
        pool.shutdown(wait=True)


def interrupt_children() -> list[int]:
    """SIGINT to every child process of this one (Linux: ``/proc/self/task/*/children``): the
    lanes' tune workers, which checkpoint their trials and stop, as ``run_workers`` does for
    Ctrl-C in the main thread.  Returns their pids (none where /proc is missing)."""
    import signal

    pids = []
    for children in Path("/proc/self/task").glob("*/children"):
        try:
            pids += [int(p) for p in children.read_text().split()]
        except OSError:
            continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    return pids


def run(proto: Protocol, phases: list[str]) -> None:
    if "tune" in phases:
        run_tunes(proto, phases)
    if "seeds" in phases:
        run_seeds_phase(proto, proto.losses)
    if "control" in phases:
        run_control_phase(proto, proto.losses)
        if proto.args.commit:
            commit(proto, "bench/studies/protocol_v2: control (every loss at the winner's settings, validation)")
    if "almn_beta" in phases:
        run_almn_phase(proto)
    if "almn_more" in phases:
        run_almn_more_phase(proto)
    if "glyphs" in phases:
        run_glyph_phase(proto)
    if "final" in phases:
        run_final_phase(proto)
        if proto.args.commit:
            commit(proto, "bench/studies/protocol_v2: final test evaluation of the finished seeded runs")
    if "exploratory" in phases:
        run_exploratory_phase(proto)
        if proto.args.commit:
            commit(proto, "bench/studies/protocol_v2: the exploratory runs at the winner's settings (not pre-registered)")


def _stop_on_signals() -> dict:
    """SIGINT and SIGTERM stop the study cleanly (KeyboardInterrupt: the trials checkpoint and
    are queued again), even when it was started in the background by a script, whose ``&``
    leaves SIGINT ignored (POSIX) and Python would keep it so.  Returns the handlers replaced."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def main(argv=None) -> int:
    import signal

    args = parse_args(argv)
    trains = not (args.snapshot or args.summary or args.restore or args.progress or args.drain)
    previous = _stop_on_signals() if trains else {}
    try:
        return _main(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(args) -> int:
    proto = Protocol(args)
    try:
        if args.restore:
            proto.log(f"restore: {', '.join(restore_tunes(proto)) or 'nothing to restore'}")
            return 0
        if args.snapshot:
            proto.log(f"snapshot: {', '.join(snapshot_tunes(proto)) or 'no unfinished tune'}")
            write_progress(proto)
            return 0
        if args.progress:
            print(write_progress(proto))
            return 0
        if args.drain:
            marks = drain(proto)
            proto.log(f"drain: {len(marks)} folder(s) marked; the running trials and runs finish, then the study "
                      "stops (exit 0); the same command continues it")
            return 0
        if args.summary:
            for loss in proto.tuned():
                copy_tune(proto, loss)
            if (proto.runs / "control" / "winner.json").is_file():  # the control phase has started
                write_control(proto)
            if (proto.runs / "results.csv").is_file():
                write_summary(proto)
                copy_results(proto)
            return 0
        clear_drain(proto.runs, proto.log)  # left by the drain that stopped the last command
        run(proto, list(PHASES) if "all" in args.phase else list(args.phase))
    except (ProtocolError, ValueError) as exc:  # ValueError: TuneError, ConfigError (a changed set-up, a bad key)
        print(f"protocol_v2: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("protocol_v2: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except Drained:
        print("protocol_v2: drained (the running trials and runs finished, nothing else started); rerun the same "
              "command to continue", file=sys.stderr)
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The two-head paper's main claim on a closed-set fine-grained task (issue 30 item 5; hypotheses
H5a / H5b of bench/studies/protocol_v2/PREREGISTRATION.md): does the triplet head raise the
classifier's accuracy?  Softmax vs softmax + semi-hard triplet vs softmax + hard triplet
(recipes/two_head/emoji_closed_set_{softmax,semihard,hard}.yaml: EfficientNet-Lite0 ImageNet,
64 px, all 1,911 emoji classes, channels_last: 1.6x faster on the CPU, bench/RESULTS.md section
14), trained on five vendors and tested on the sixth (twitter).

Three phases, each resumable (a finished run, one with ``metrics.json``, is skipped; an
interrupted one continues from its ``last.pt``), in this order:

1. ``lr``: per variant, each lr of ``--lrs`` (default 0.003, 0.01, 0.03) at seed 0 (``--lr-seed``: a
   seed no final run uses, as pre-registered), trained on
   apple, google, emojione and openmoji and scored on the validation vendor facebook (top-1 of
   the classifier at the last epoch, the model the seeded runs hand to the test). The test vendor
   is not even loaded: the runs have no test split (``eval.split=null``). Writes ``lr/lr_runs.csv``
   (``variant, lr, seed, epochs, val_top1, val_macro_accuracy, best_epoch, best_val_top1,
   last_gain_points, flattened, wall_time_s, cpu_s, status``: the gain of validation top-1 of the last
   two evaluations over the best before them, and whether it is at most 0.5 points (issue 30
   item 4 and the pre-registration: the curve flattened),
   the training's CPU seconds), ``lr/curves.csv`` (validation top-1 per epoch) and
   ``lr/chosen_lr.json`` (per variant the lr of the highest last-epoch validation top-1; ties go
   to the smaller lr);
2. ``seeds``: per variant, seeds 100-104 at its chosen lr, trained on the five non-test vendors,
   no evaluation at all during training; ``seeds/runs.csv`` (no metric of any held-out image);
3. ``final``: the one step that looks at twitter, and only once every seeded run has finished and
   the pre-registration is committed (before that it evaluates nothing): each run's ``last.pt``
   classifies the test vendor's images; ``two_head_accuracy.csv`` (``variant, seed, top1,
   macro_accuracy``: macro = the mean over test classes of per-class accuracy) and
   ``summary.md`` / ``summary.json`` (per variant mean, sample sd and 95 % Student-t interval;
   per triplet variant the paired difference to softmax by seed with its 95 % interval); these and
   the lr phase's tables are copied into ``--copy-to``
   (bench/studies/protocol_v2, where protocol v2's H5a / H5b read two_head_accuracy.csv).  The
   committed folder only takes the pre-registered study: the three variants, seeds 100-104, 15
   epochs, the lr grid and lr seed above, no ``--set``; anything else is copied nowhere there.

The seeded runs have no validation vendor, so nothing chooses an epoch: the test scores each
run's last epoch (``last.pt``).  A run whose loss becomes non-finite has ended (``diverged.json`` in
its folder; rerunning would diverge again; PREREGISTRATION.md, 2026-11-28, eleventh session): a
diverged lr is never chosen (a variant whose every lr diverges has no seeded runs), a diverged
seeded run is tested from its last checkpoint before the divergence and named in the summary, one
that diverged before its first checkpoint has no test number; the tables' ``status`` column says
``finished`` or ``diverged``.  Twitter has one image of each of the 1,911 classes, so macro
accuracy equals top-1 on this split (both are reported, as pre-registered).  Ctrl-C or SIGTERM
checkpoints the running trainings and stops (exit 130); rerun the same command to resume.
``touch OUT/DRAIN`` lets the running trainings finish and starts no other (exit 0; nothing lost,
where a stop loses the current epoch); the next command removes the file and continues.  A run
folder that holds another lr, seed or number of epochs than the one asked for is an error.

    python bench/two_head_accuracy.py --phase all                      # CPU, one run at a time
    python bench/two_head_accuracy.py --phase all --device cuda --parallel 4
    python bench/two_head_accuracy.py --phase lr --epochs 5 --out runs/two_head_probe

``--parallel N`` runs N trainings at once as separate processes (``deepmetric train``; on one
GPU they share it); ``--parallel 1`` trains in this process.  ``--set KEY=VALUE`` adds a config
override to every run (the miniature test swaps the data root and the size with it).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

VARIANTS = ("softmax", "semihard", "hard")
BASELINE = "softmax"
LRS = (0.003, 0.01, 0.03)
SEEDS = (100, 101, 102, 103, 104)
LR_SEED = 0  # a seed no final run uses (PREREGISTRATION.md)
VAL_VENDOR = "facebook"
CSV_COLUMNS = ("variant", "seed", "top1", "macro_accuracy")
LR_COLUMNS = ("variant", "lr", "seed", "epochs", "val_top1", "val_macro_accuracy", "best_epoch", "best_val_top1",
              "last_gain_points", "flattened", "wall_time_s", "cpu_s", "status")
FLAT_POINTS = 0.5  # issue 30 item 4: flattened = no gain above 0.5 points over the last two evaluations
EPOCHS = 15  # pre-registered
# the lr phase: a validation vendor and no test split; the seeded runs: no evaluation at all
LR_OVERRIDES = (f"data.options.val_vendor={VAL_VENDOR}", "data.val_split=val", "eval.split=null", "eval.every=1",
                "eval.best_metric=top1")
SEED_OVERRIDES = ("data.options.val_vendor=null", "data.val_split=null", "eval.split=null")


def recipe(variant: str) -> Path:
    return ROOT / "recipes" / "two_head" / f"emoji_closed_set_{variant}.yaml"


class RunMismatch(ValueError):
    """A run folder that holds another training than the one asked for."""


class Drained(Exception):
    """``touch OUT/DRAIN`` (deepmetric's drain mark): the running trainings finished, no other started."""


class Diverged(Exception):
    """The training's loss became non-finite (``NonFiniteLossError``; ``deepmetric train`` exits 3)."""


DIVERGED_FILE = "diverged.json"  # per run: written when its loss became non-finite (it has ended)
CLI_NONFINITE_EXIT = 3  # deepmetric train's exit status for a non-finite loss (deepmetric.cli.train)


@dataclass
class Run:
    """One training: its variant, lr, seed, folder and config overrides."""

    variant: str
    lr: float
    seed: int
    out_dir: Path
    overrides: list[str]
    epochs: int

    @property
    def done(self) -> bool:
        return (self.out_dir / "metrics.json").is_file()

    @property
    def diverged(self) -> bool:
        """Its loss became non-finite: resuming from its last checkpoint would diverge again, so it
        has ended (PREREGISTRATION.md, 2026-11-28, eleventh session, the rule for two-head runs)."""
        return not self.done and (self.out_dir / DIVERGED_FILE).is_file()

    @property
    def ended(self) -> bool:
        return self.done or self.diverged

    def divergence(self) -> dict:
        return json.loads((self.out_dir / DIVERGED_FILE).read_text(encoding="utf-8"))

    def end_state(self) -> dict:
        """How an ended run ended, for the tables: its epochs (a diverged run's: those of its last
        checkpoint, None without one), wall time (None when diverged) and status."""
        if self.done:
            m = self.metrics()
            return {"epochs": m["epochs"], "wall_time_s": m["wall_time_s"], "status": "finished"}
        return {"epochs": self.divergence()["last_checkpoint_epochs"], "wall_time_s": None, "status": "diverged"}

    def check_identity(self) -> None:
        """Raise ``RunMismatch`` when the folder holds a run trained with another lr, seed or
        number of epochs (its ``config.yaml``, written when it started): the folder name carries
        no lr or epochs, so a changed grid or a probe with ``--epochs 5`` in the same ``--out``
        would otherwise count as finished, or be resumed with the new settings."""
        import yaml

        path = self.out_dir / "config.yaml"
        if not path.is_file():
            return
        try:
            cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            have = {"optim.lr": float(cfg["optim"]["lr"]), "train.seed": int(cfg["train"]["seed"]),
                    "train.epochs": int(cfg["train"]["epochs"])}
        except (yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
            raise RunMismatch(f"{path}: unreadable run config ({exc}); move the folder away to retrain it") from None
        want = {"optim.lr": float(self.lr), "train.seed": int(self.seed), "train.epochs": self.epochs}
        diff = {k: (have[k], want[k]) for k in want if have[k] != want[k]}
        if diff:
            raise RunMismatch(f"{path}: this folder's run was trained with "
                              + ", ".join(f"{k}={h:g}" for k, (h, _) in diff.items())
                              + ", this command asks for " + ", ".join(f"{k}={w:g}" for k, (_, w) in diff.items())
                              + "; use another --out, or move the folder away to retrain it")

    def metrics(self) -> dict:
        return json.loads((self.out_dir / "metrics.json").read_text(encoding="utf-8"))


def _lr_name(lr: float) -> str:
    return f"lr{lr:g}"


def make_run(args, phase: str, variant: str, lr: float, seed: int) -> Run:
    out = Path(args.out) / phase / variant / (f"{_lr_name(lr)}_seed{seed}" if phase == "lr" else f"seed{seed}")
    common = [f"optim.lr={lr}", f"train.seed={seed}", f"train.epochs={args.epochs}", f"train.out_dir={out}",
              "train.progress=false", f"train.device={args.device}"]
    if args.threads:
        common.append(f"train.num_threads={args.threads}")
    phase_keys = LR_OVERRIDES if phase == "lr" else SEED_OVERRIDES
    return Run(variant, lr, seed, out, common + list(phase_keys) + list(args.set), args.epochs)


# --------------------------------------------------------------------------- running trainings
CPU_FILE = "cpu_seconds.json"  # per run: CPU seconds (user + system) of its trainings, summed over resumes


def cpu_seconds(run: Run) -> float | None:
    path = run.out_dir / CPU_FILE
    return json.loads(path.read_text(encoding="utf-8"))["cpu_s"] if path.is_file() else None


def _add_cpu_seconds(run: Run, seconds: float) -> None:
    total = (cpu_seconds(run) or 0.0) + seconds
    write_text(run.out_dir / CPU_FILE, json.dumps({"cpu_s": round(total, 1)}) + "\n")


def _train_here(run: Run) -> None:
    import resource

    from deepmetric.run.config_io import load_config
    from deepmetric.train import NonFiniteLossError, train

    last = run.out_dir / "last.pt"
    cfg = load_config(str(recipe(run.variant)), run.overrides)
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        result = train(cfg, resume=str(last) if last.is_file() else None, overwrite=not last.is_file())
    except NonFiniteLossError as exc:
        raise Diverged(str(exc)) from None
    finally:
        after = resource.getrusage(resource.RUSAGE_SELF)
        _add_cpu_seconds(run, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    if result.interrupted:  # Ctrl-C / SIGTERM: last.pt is saved; stop the study, start no other run
        raise KeyboardInterrupt


def _train_command(run: Run) -> list[str]:
    last = run.out_dir / "last.pt"
    cmd = [sys.executable, "-m", "deepmetric.cli", "train", str(recipe(run.variant)), *run.overrides]
    return cmd + (["--resume", str(last)] if last.is_file() else ["--overwrite"])


def _train_subprocess(run: Run, log_dir: Path) -> None:
    cmd = _train_command(run)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{run.out_dir.parent.parent.name}_{run.variant}_{run.out_dir.name}.log"
    with open(log, "w", encoding="utf-8") as fh:
        with _CHILDREN_LOCK:
            if _STOP.is_set():
                return
            # its own session: a terminal's Ctrl-C reaches this process only, which passes one
            # SIGINT on (the training checkpoints and exits 130), also for a SIGTERM
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
            _CHILDREN.add(proc)
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # the child's own CPU time
        finally:
            with _CHILDREN_LOCK:
                _CHILDREN.discard(proc)
        proc.returncode = code = os.waitstatus_to_exitcode(status)
    _add_cpu_seconds(run, usage.ru_utime + usage.ru_stime)  # an interrupted part counts too: it is resumed
    if code == CLI_NONFINITE_EXIT:
        raise Diverged(f"non-finite loss (deepmetric train exit {code}); see {log}")
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[2:5])} ... failed (exit {code}); see {log}")


#: set by Ctrl-C / SIGTERM: no run starts after it; the live trainings (``_CHILDREN``, with
#: ``--parallel`` > 1) get one SIGINT each, checkpoint and exit
_STOP = threading.Event()
_CHILDREN: set = set()
_CHILDREN_LOCK = threading.Lock()


def _interrupt_children() -> None:
    with _CHILDREN_LOCK:
        _STOP.set()
        for proc in _CHILDREN:
            try:
                proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass


def record_divergence(run: Run, message: str) -> None:
    """``diverged.json``: the message and the last checkpoint the run has (its epoch), which the
    final step tests (None: it diverged before its first checkpoint, or that checkpoint's weights
    are not finite, so it has no model)."""
    last = run.out_dir / "last.pt"
    at = {"last_checkpoint_epochs": None, "last_checkpoint_batches_into_next": None}
    if last.is_file():
        import torch

        from deepmetric.run.checkpoint import load_checkpoint

        ckpt = load_checkpoint(last)  # epochs completed; a mid-epoch checkpoint (an interrupt) says how far
        # a finite loss with non-finite gradients on an epoch's last step saves non-finite weights,
        # and the next step's loss fails: such a checkpoint is no model either
        if all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point()):
            at = {"last_checkpoint_epochs": int(ckpt["epoch"]),
                  "last_checkpoint_batches_into_next": int(ckpt["batch_in_epoch"])}
        else:
            at["last_checkpoint_not_finite"] = True
    write_text(run.out_dir / DIVERGED_FILE, json.dumps({"message": message, **at}) + "\n")


def run_all(runs: list[Run], args) -> list[str]:
    """Train every run that has not ended (``--parallel`` at once); returns the error messages.
    A run whose loss becomes non-finite has ended (``diverged.json``; not an error: rerunning
    would diverge again).  Ctrl-C (or SIGTERM) checkpoints the running trainings and raises
    KeyboardInterrupt: no other run starts and nothing downstream reads a study that is not
    finished."""
    for run in runs:
        run.check_identity()
    todo = [r for r in runs if not r.ended]
    gone = [r for r in runs if r.diverged]
    print(f"[two_head_accuracy] {len(runs) - len(todo) - len(gone)} of {len(runs)} runs finished"
          + (f", {len(gone)} diverged" if gone else "") + f", {len(todo)} to train", flush=True)
    errors: list[str] = []

    from deepmetric.workflows.engine import draining

    def one(run: Run) -> None:
        if _STOP.is_set() or draining(args.out):
            return
        t0 = time.perf_counter()
        try:
            if args.parallel > 1:
                _train_subprocess(run, Path(args.out) / "logs")
            else:
                _train_here(run)
        except Diverged as exc:  # it has ended: the pre-registered rule, not a failure of ours
            record_divergence(run, str(exc))
            print(f"[two_head_accuracy] DIVERGED {run.out_dir}: {exc}", flush=True)
            return
        except Exception as exc:  # noqa: BLE001 - one failed run does not stop the others
            errors.append(f"{run.out_dir}: {exc}")
            print(f"[two_head_accuracy] FAILED {run.out_dir}: {exc}", flush=True)
            return
        if not _STOP.is_set():
            print(f"[two_head_accuracy] done {run.out_dir} in {time.perf_counter() - t0:.0f} s", flush=True)

    if args.parallel > 1:
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            futures = [pool.submit(one, run) for run in todo]
            try:
                for future in futures:
                    future.result()
            except KeyboardInterrupt:
                _interrupt_children()
                for future in futures:
                    future.cancel()
                raise  # leaving the pool waits for the running trainings to checkpoint and exit
        if _STOP.is_set():
            raise KeyboardInterrupt
    else:
        for run in todo:
            one(run)
    if draining(args.out) and not all(r.ended for r in runs):
        raise Drained()
    return errors


# --------------------------------------------------------------------------- writing
def write_csv(path: Path, rows: list[dict], columns) -> Path:
    """Atomic CSV write (deepmetric's ``write_text_atomic``: temporary file, then rename)."""
    import io

    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=list(columns), extrasaction="raise", lineterminator="\r\n")
    w.writeheader()
    w.writerows(rows)
    return write_text(path, out.getvalue())


def write_text(path: Path, text: str) -> Path:
    from deepmetric.run.rundir import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return path


def last_gain_points(top1: list[float]) -> float | None:
    """The gain of validation top-1 (points) over the last two evaluations, as pre-registered:
    the best of the last two minus the best of every evaluation before them; None with fewer
    than three evaluations."""
    from deepmetric.report.study_tables import last_gain

    gain = last_gain(top1)
    return None if gain is None else 100 * gain


def _val_curve(run: Run) -> list[dict]:
    """The validation records of a run's log, one per evaluated epoch."""
    out = []
    for line in (run.out_dir / "log.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec.get("type") == "eval" and rec.get("split") == "val":
            out.append({"variant": run.variant, "lr": run.lr, "epoch": rec["epoch"], "val_top1": rec["top1"],
                        "val_macro_accuracy": rec["mean_per_class"]})
    return out


# --------------------------------------------------------------------------- the phases
def phase_lr(args) -> int:
    runs = [make_run(args, "lr", v, lr, args.lr_seed) for v in args.variants for lr in args.lrs]
    errors = run_all(runs, args)
    rows, curves = [], []
    for run in runs:
        if run.diverged:  # never chosen (its validation row is empty); its curve up to the divergence
            curve = _val_curve(run) if (run.out_dir / "log.jsonl").is_file() else []
            best = max(curve, key=lambda c: c["val_top1"], default={})
            rows.append({"variant": run.variant, "lr": run.lr, "seed": run.seed, **run.end_state(), "val_top1": None,
                         "val_macro_accuracy": None, "best_epoch": best.get("epoch"),
                         "best_val_top1": best.get("val_top1"), "last_gain_points": None, "flattened": None,
                         "cpu_s": cpu_seconds(run)})
            curves += curve
            continue
        if not run.done:
            continue
        m = run.metrics()
        val, best, curve = m["final"]["val"], m.get("selected") or {}, _val_curve(run)
        gain = last_gain_points([c["val_top1"] for c in curve])
        rows.append({"variant": run.variant, "lr": run.lr, "seed": run.seed, "epochs": m["epochs"],
                     "val_top1": val["top1"], "val_macro_accuracy": val["mean_per_class"],
                     "best_epoch": best.get("epoch"), "best_val_top1": best.get("value"),
                     "last_gain_points": gain, "flattened": None if gain is None else gain <= FLAT_POINTS,
                     "wall_time_s": m["wall_time_s"], "cpu_s": cpu_seconds(run), "status": "finished"})
        curves += curve
    out = Path(args.out) / "lr"
    write_csv(out / "lr_runs.csv", rows, LR_COLUMNS)
    write_csv(out / "curves.csv", curves, ("variant", "lr", "epoch", "val_top1", "val_macro_accuracy"))
    chosen = {}
    for v in args.variants:
        mine = [r for r in rows if r["variant"] == v]
        usable = [r for r in mine if r["status"] == "finished"]  # an lr that diverged is never chosen
        if len(mine) == len(args.lrs) and not usable:
            print(f"[two_head_accuracy] lr phase: {v}: every lr of the grid diverged; no lr is chosen and {v} has "
                  "no seeded runs (PREREGISTRATION.md, 2026-11-28, eleventh session)", flush=True)
            chosen[v] = {"lr": None, "val_top1": None, "grid": list(args.lrs), "seed": args.lr_seed,
                         "epochs": args.epochs, "val_vendor": VAL_VENDOR, "diverged": [r["lr"] for r in mine]}
        elif len(mine) == len(args.lrs):  # every lr of the grid has ended
            best = max(usable, key=lambda r: (r["val_top1"], -r["lr"]))
            chosen[v] = {"lr": best["lr"], "val_top1": best["val_top1"], "grid": list(args.lrs),
                         "seed": args.lr_seed, "epochs": args.epochs, "val_vendor": VAL_VENDOR,
                         "diverged": [r["lr"] for r in mine if r["status"] == "diverged"]}
    write_text(out / "chosen_lr.json", json.dumps(chosen, indent=1) + "\n")
    print(f"[two_head_accuracy] lr phase: chosen on {VAL_VENDOR} top-1: "
          + ", ".join(f"{v} {c['lr']:g} ({100 * c['val_top1']:.2f})" if c["lr"] is not None else f"{v} none"
                      for v, c in chosen.items()), flush=True)
    return 1 if errors else 0


def chosen_lrs(args) -> dict[str, float | None]:
    """Each variant's chosen lr; None for a variant whose every lr diverged (it has no seeded runs)."""
    path = Path(args.out) / "lr" / "chosen_lr.json"
    chosen = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    missing = [v for v in args.variants if v not in chosen]
    if missing:
        raise SystemExit(f"two_head_accuracy: {path} has no chosen lr for {', '.join(missing)}: "
                         f"run --phase lr first (with the same --out and --variants)")
    return {v: None if chosen[v]["lr"] is None else float(chosen[v]["lr"]) for v in args.variants}


def seed_runs(args) -> list[Run]:
    lrs = chosen_lrs(args)
    return [make_run(args, "seeds", v, lrs[v], s) for v in args.variants if lrs[v] is not None for s in args.seeds]


def phase_seeds(args) -> int:
    runs = seed_runs(args)
    errors = run_all(runs, args)
    rows = [{"variant": r.variant, "seed": r.seed, "lr": r.lr, **r.end_state(), "cpu_s": cpu_seconds(r)}
            for r in runs if r.ended]
    write_csv(Path(args.out) / "seeds" / "runs.csv", rows,
              ("variant", "seed", "lr", "epochs", "wall_time_s", "cpu_s", "status"))
    return 1 if errors else 0


def test_accuracy(run_dir: Path, device: str) -> dict:
    """Top-1 and macro accuracy of the classifier of ``run_dir/last.pt`` on the test vendor."""
    import torch

    from deepmetric.evaluate import per_class_accuracy
    from deepmetric.run.builders import build_test_sets
    from deepmetric.run.embed import compute_embeddings, load_model_from_checkpoint

    dev = torch.device("cuda" if device == "cuda" else "cpu")
    model, _, cfg, _ = load_model_from_checkpoint(run_dir / "last.pt", dev)
    cfg.eval.split = "test"
    ds = build_test_sets(cfg)["query"]
    out = compute_embeddings(model, ds, with_logits=True, batch_size=cfg.eval.batch_size, device=dev,
                             amp=cfg.train.amp, num_workers=0)
    acc = per_class_accuracy(out["logits"], out["labels"], num_classes=ds.num_classes)
    return {"top1": acc["micro"], "macro_accuracy": acc["macro"], "test_images": acc["count"],
            "test_classes": sum(r["count"] > 0 for r in acc["classes"])}


def summarize(rows: list[dict], variants) -> dict:
    """Per variant ``mean_ci`` of top-1 and macro accuracy; per triplet variant the paired
    difference to softmax by seed (``paired_differences``)."""
    from deepmetric.report.study_tables import mean_ci, paired_differences

    metrics = ("top1", "macro_accuracy")
    tagged = [{**r, "benchmark": "emoji_closed_set"} for r in rows]
    per_variant = {v: {"seeds": [r["seed"] for r in rows if r["variant"] == v],
                       **{m: mean_ci([r[m] for r in rows if r["variant"] == v]) for m in metrics}}
                   for v in variants}
    paired = {}
    for v in variants:
        if v != BASELINE and BASELINE in variants:
            (d,) = paired_differences(tagged, v, BASELINE, metrics) or [{"seeds": [], "stats": {}}]
            paired[f"{v} - {BASELINE}"] = {"seeds": d["seeds"], **d["stats"]}
    return {"variants": per_variant, "paired": paired}


def _pct(st: dict) -> str:
    from deepmetric.report.study_tables import format_number

    f = {k: (100 * st[k] if isinstance(st.get(k), float) else None) for k in ("mean", "std", "ci_low", "ci_high")}
    return (f"{format_number(f['mean'], 2)} ± {format_number(f['std'], 2)} "
            f"[{format_number(f['ci_low'], 2)}, {format_number(f['ci_high'], 2)}]")


def summary_markdown(summary: dict, args, lrs: dict, runs: list[dict]) -> str:
    lines = ["# Two-head accuracy on the closed-set emoji task (test vendor twitter)", "",
             f"Softmax vs softmax + triplet (two-head paper), EfficientNet-Lite0 ImageNet, {args.epochs} epochs; "
             f"lr chosen per variant on {VAL_VENDOR} top-1 (seed {args.lr_seed}, grid {', '.join(f'{x:g}' for x in args.lrs)}); "
             "trained on the five other vendors, tested once at the end. Cells in percent: mean ± sample sd "
             "[95 % Student-t interval] over seeds; macro = mean over test classes of per-class accuracy.", "",
             "| variant | lr | seeds | epochs | wall time per run (s) | top-1 | macro accuracy |",
             "|---|---|---|---|---|---|---|"]
    for v, st in summary["variants"].items():
        mine = [r for r in runs if r["variant"] == v]
        epochs = sorted({r["epochs"] for r in mine})
        walls = [r["wall_time_s"] for r in mine if r["wall_time_s"] is not None]  # a diverged run has none
        wall = f"{sum(walls) / len(walls):.0f}" if walls else "-"
        lines.append(f"| {v} | {lrs[v]:g} | {len(st['seeds'])} | {', '.join(map(str, epochs))} | {wall} | "
                     f"{_pct(st['top1'])} | {_pct(st['macro_accuracy'])} |")
    lines += ["", "Paired differences by seed (points):", "", "| A − B | pairs | top-1 | macro accuracy |",
              "|---|---|---|---|"]
    for name, st in summary["paired"].items():
        lines.append(f"| {name} | {len(st['seeds'])} | {_pct(st['top1'])} | {_pct(st['macro_accuracy'])} |")
    notes = [("Diverged (a non-finite loss), tested from the last checkpoint before it (the epochs column "
              "counts its finished epochs)", summary.get("diverged_tested_from_last_checkpoint")),
             ("Diverged before the first checkpoint: no model, no test number", summary.get("diverged_without_a_model")),
             ("Every lr of the grid diverged: no seeded runs, no result", summary.get("variants_every_lr_diverged"))]
    said = [f"{text}: {', '.join(names)}." for text, names in notes if names]
    if said:
        lines += ["", *said]
    return "\n".join(lines) + "\n"


def phase_final(args) -> int:
    """The one step that evaluates the test vendor, once every seeded run has finished and the
    pre-registration is committed (PREREGISTRATION.md: test numbers come last); before that it
    evaluates nothing and says what is missing."""
    runs = seed_runs(args)
    for run in runs:
        run.check_identity()
    unfinished = [str(r.out_dir) for r in runs if not r.ended]
    if unfinished:
        print(f"[two_head_accuracy] final: {len(unfinished)} seeded run(s) not finished (run --phase seeds): "
              + ", ".join(unfinished) + "; the test vendor is read once, after the last of them: nothing evaluated",
              flush=True)
        return 1
    protocol = _protocol_v2()
    try:
        protocol.check_preregistration_file(PREREGISTRATION)
    except protocol.ProtocolError as exc:
        print(f"[two_head_accuracy] {exc}: nothing evaluated", flush=True)
        return 1
    rows, extra, no_model = [], [], []
    for r in runs:
        # a diverged run is tested from its last checkpoint before the divergence; one that diverged
        # before its first checkpoint has no model and no test number (PREREGISTRATION.md,
        # 2026-11-28, eleventh session)
        state = r.end_state()
        if state["epochs"] is None:
            no_model.append(f"{r.variant}/seed{r.seed}")
            continue
        acc = test_accuracy(r.out_dir, args.device)
        rows.append({"variant": r.variant, "seed": r.seed, "top1": acc["top1"],
                     "macro_accuracy": acc["macro_accuracy"]})
        extra.append({**rows[-1], "lr": r.lr, **state, "cpu_s": cpu_seconds(r), "test_images": acc["test_images"],
                      "test_classes": acc["test_classes"]})
    out = Path(args.out)
    write_csv(out / "two_head_accuracy.csv", rows, CSV_COLUMNS)
    lrs = chosen_lrs(args)
    summary = summarize(rows, [v for v in args.variants if lrs[v] is not None])
    summary["diverged_tested_from_last_checkpoint"] = [f"{e['variant']}/seed{e['seed']}" for e in extra
                                                       if e["status"] == "diverged"]
    summary["diverged_without_a_model"] = no_model
    summary["variants_every_lr_diverged"] = [v for v in args.variants if lrs[v] is None]
    write_text(out / "summary.json", json.dumps({**summary, "runs": extra, "epochs": args.epochs,
                                                 "lrs": lrs}, indent=1) + "\n")
    text = summary_markdown(summary, args, lrs, extra)
    write_text(out / "summary.md", text)
    print(text, flush=True)
    if args.copy_to:
        departures = departures_from_preregistration(args)
        if departures and Path(args.copy_to).resolve() == COMMITTED.resolve():
            print(f"[two_head_accuracy] final: not copied into {COMMITTED} (the committed study "
                  f"takes the pre-registered runs only): {'; '.join(departures)}", flush=True)
            return 1
        copy_results(out, Path(args.copy_to))
    return 0


def _protocol_v2():
    """bench/protocol_v2.py as a module (its pre-registration check; bench/ is not a package)."""
    import importlib.util

    if "protocol_v2_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("protocol_v2_bench", ROOT / "bench" / "protocol_v2.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["protocol_v2_bench"] = module
        spec.loader.exec_module(module)
    return sys.modules["protocol_v2_bench"]


COMMITTED = ROOT / "bench" / "studies" / "protocol_v2"
PREREGISTRATION = COMMITTED / "PREREGISTRATION.md"


def departures_from_preregistration(args) -> list[str]:
    """What this command changes of the pre-registered two-head study (empty: none)."""
    wanted = {"--variants": (list(VARIANTS), list(args.variants)), "--seeds": (list(SEEDS), list(args.seeds)),
              "--epochs": (EPOCHS, args.epochs), "--lrs": (list(LRS), list(args.lrs)),
              "--lr-seed": (LR_SEED, args.lr_seed), "--set": ([], list(args.set))}
    return [f"{flag} {have} (pre-registered: {want})" for flag, (want, have) in wanted.items() if have != want]


#: what the final step copies into the committed study folder (protocol v2 reads the CSV for
#: H5a / H5b): source under --out -> name there.  None of them holds a path.
COPIES = {"two_head_accuracy.csv": "two_head_accuracy.csv", "summary.md": "two_head_accuracy.md",
          "summary.json": "two_head_accuracy.json", "lr/lr_runs.csv": "two_head_lr_runs.csv",
          "lr/curves.csv": "two_head_lr_curves.csv", "lr/chosen_lr.json": "two_head_chosen_lr.json",
          "seeds/runs.csv": "two_head_seed_runs.csv"}


def copy_results(out: Path, dest: Path) -> None:
    """The finished study's tables into ``dest`` (bench/studies/protocol_v2: committed), only
    when every seeded run has finished: a partial two_head_accuracy.csv would enter the protocol's
    family of tests as if it were the result."""
    for src, name in COPIES.items():
        if (out / src).is_file():
            write_text(dest / name, (out / src).read_text(encoding="utf-8"))
    print(f"[two_head_accuracy] copied the results into {dest}", flush=True)


# --------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=("lr", "seeds", "final", "all"), default="all")
    p.add_argument("--out", default="runs/two_head_accuracy", help="output folder (default runs/two_head_accuracy)")
    p.add_argument("--copy-to", default=str(ROOT / "bench" / "studies" / "protocol_v2"),
                   help="where the final step copies its tables once every seeded run has finished (default "
                        "bench/studies/protocol_v2, committed, which takes the pre-registered settings only; "
                        "'' for nowhere)")
    p.add_argument("--epochs", type=int, default=EPOCHS, help=f"epochs of every run (default {EPOCHS}, pre-registered)")
    p.add_argument("--lrs", type=float, nargs="+", default=list(LRS), help="the lr grid (default 0.003 0.01 0.03)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds of the final runs (100-104)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="train.device of every run")
    p.add_argument("--parallel", type=int, default=1, help="trainings at once (separate processes when > 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="train.num_threads of every run (default: torch's; 1 on the CPU with --parallel > 1)")
    p.add_argument("--lr-seed", type=int, default=LR_SEED, help=f"seed of the lr runs (default {LR_SEED})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (repeatable)")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.parallel < 1:
        p.error("--epochs and --parallel must be >= 1")
    if args.lr_seed in args.seeds:
        p.error(f"--lr-seed {args.lr_seed} is one of the final runs' --seeds {args.seeds}: the lr is chosen "
                "on a seed no final run uses (pre-registered)")
    if args.threads is None and args.device == "cpu" and args.parallel > 1:
        args.threads = 1  # processes sharing the cores: spinning OpenMP threads slow each other down
    return args


def _sigterm_as_sigint(signum, frame) -> None:
    signal.raise_signal(signal.SIGINT)


def main(argv=None) -> int:
    args = parse_args(argv)
    from deepmetric.workflows.engine import DRAIN, clear_drain

    _STOP.clear()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # SIGINT even when a script's ``&`` left it ignored; SIGTERM as a SIGINT, which a training
        # in this process (--parallel 1) turns into "finish the step, save last.pt, stop"
        previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                    signal.SIGTERM: signal.signal(signal.SIGTERM, _sigterm_as_sigint)}
    try:
        clear_drain(args.out, lambda msg: print(f"[two_head_accuracy] {msg}", flush=True))
        rc = 0
        if args.phase in ("lr", "all"):
            rc |= phase_lr(args)
        if args.phase in ("seeds", "all") and rc == 0:
            rc |= phase_seeds(args)
        if args.phase in ("final", "all") and rc == 0:
            rc |= phase_final(args)
        return rc
    except RunMismatch as exc:
        print(f"two_head_accuracy: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("two_head_accuracy: interrupted (the running trainings saved last.pt); rerun the same command to "
              "resume", file=sys.stderr)
        return 130
    except Drained:
        print(f"two_head_accuracy: drained ({Path(args.out) / DRAIN}: the running trainings finished, no other "
              "started); rerun the same command to continue", file=sys.stderr)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())

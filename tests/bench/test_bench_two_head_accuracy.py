"""bench/two_head_accuracy.py in miniature on the CPU: the real recipes (EfficientNet-Lite0 two-head
model, ImageNet weights) on the miniature emoji tree (9 classes), 32 px, 1 epoch: the lr phase holds
no test metric anywhere, the seeded runs evaluate nothing, the final step's CSV matches an
independent evaluation of the checkpoints, the summary's paired differences match numpy, a second
call trains nothing, and ``--parallel 2`` trains in subprocesses."""
import csv
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("two_head_accuracy", ROOT / "bench" / "two_head_accuracy.py")
bench = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = bench  # its dataclass looks its module up
SPEC.loader.exec_module(bench)
VARIANTS = ("softmax", "semihard")  # hard runs the same code (its recipe: test_recipes.py); kept out for time


def _args(tree, out, *extra):
    sets = [f"data.root={tree}", "data.options.size=32", "model.options.input_size=32", "train.m=4",
            "train.n=2", "train.batch_size=8", "data.transform_options={normalize: minus_one_one}"]
    return ["--out", str(out), "--copy-to", str(Path(out).parent / "copy"), "--epochs", "1", "--lrs", "0.01", "0.1",
            "--seeds", "100", "101",
            "--variants", *VARIANTS, "--threads", "1", *[a for s in sets for a in ("--set", s)], *extra]


def _no_test_key(obj, where):
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert "test" not in str(k).lower() or k in ("test_vendor", "test_every", "test_selected"), (where, k)
            _no_test_key(v, where)
    elif isinstance(obj, list):
        for v in obj:
            _no_test_key(v, where)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from test_data_emoji import make_tree

    base = tmp_path_factory.mktemp("two_head_accuracy")
    make_tree(base / "tree")
    out = base / "out"
    assert bench.main(_args(base / "tree", out, "--phase", "lr")) == 0
    lr_files = {p: p.read_bytes() for p in (out / "lr").rglob("*") if p.is_file()}
    assert bench.main(_args(base / "tree", out, "--phase", "all")) == 0
    return base, out, lr_files


def test_lr_phase_holds_no_test_metric(study):
    base, out, lr_files = study
    with open(out / "lr" / "lr_runs.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["variant"], float(r["lr"])) for r in rows] == [(v, lr) for v in VARIANTS for lr in (0.01, 0.1)]
    assert not [c for c in rows[0] if "test" in c]
    chosen = json.loads((out / "lr" / "chosen_lr.json").read_text())
    for v in VARIANTS:  # the lr of the best validation top-1 (ties: the smaller lr)
        mine = [r for r in rows if r["variant"] == v]
        best = max(mine, key=lambda r: (float(r["val_top1"]), -float(r["lr"])))
        assert chosen[v]["lr"] == float(best["lr"])
    for run_dir in (out / "lr").glob("*/*"):  # every run: validation records only
        metrics = json.loads((run_dir / "metrics.json").read_text())
        _no_test_key(metrics, run_dir)
        assert set(metrics["final"]) == {"val"}
        splits = {json.loads(line).get("split") for line in (run_dir / "log.jsonl").read_text().splitlines()}
        assert splits <= {None, "val"}
    # the later phases did not change the lr phase's files (nor retrain its runs)
    assert {p: p.read_bytes() for p in (out / "lr").rglob("*") if p.is_file()} == lr_files


def test_final_csv_matches_an_independent_evaluation(study):
    import torch

    from deepmetric.evaluate import classification_accuracy
    from deepmetric.run.builders import build_split
    from deepmetric.run.embed import load_model_from_checkpoint

    base, out, _ = study
    with open(out / "two_head_accuracy.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["variant", "seed", "top1", "macro_accuracy"]
    assert [(r["variant"], int(r["seed"])) for r in rows] == [(v, s) for v in VARIANTS for s in (100, 101)]
    chosen = json.loads((out / "lr" / "chosen_lr.json").read_text())
    for r in rows:
        run = out / "seeds" / r["variant"] / f"seed{r['seed']}"
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["final"] == {} and metrics["metrics"] == {}  # nothing evaluated while training
        model, _, cfg, _ = load_model_from_checkpoint(run / "last.pt")
        assert cfg.optim.lr == chosen[r["variant"]]["lr"] and cfg.data.options["val_vendor"] is None
        assert "facebook" in {v for v in build_split(cfg, "train", train=False).vendors}
        test = build_split(cfg, "test", train=False)
        assert {test.vendors[v] for v in test.vendor_ids} == {"twitter"}
        x = torch.stack([test[i][0] for i in range(len(test))])
        with torch.no_grad():
            logits = model(x)["logits"]
        ref = classification_accuracy(logits, test.labels)
        assert float(r["top1"]) == pytest.approx(ref["top1"], abs=1e-9)
        assert float(r["macro_accuracy"]) == pytest.approx(ref["mean_per_class"], abs=1e-9)
    summary = json.loads((out / "summary.json").read_text())
    for v in ("semihard",):
        d = [float(a["top1"]) - float(b["top1"]) for a in rows if a["variant"] == v
             for b in rows if b["variant"] == "softmax" and b["seed"] == a["seed"]]
        st = summary["paired"][f"{v} - softmax"]["top1"]
        assert st["mean"] == pytest.approx(np.mean(d)) and st["n"] == 2
        half = 12.7062047 * np.std(d, ddof=1) / np.sqrt(2)  # t_{0.975, 1}; 0 when both seeds differ alike
        assert st["ci_high"] - st["mean"] == pytest.approx(half, rel=1e-6, abs=1e-12)
    assert "| softmax |" in (out / "summary.md").read_text()
    # every seeded run finished: the tables are in the committed study folder, where protocol v2 reads H5
    copy = base / "copy"
    assert (copy / "two_head_accuracy.csv").read_text() == (out / "two_head_accuracy.csv").read_text()
    assert sorted(p.name for p in copy.iterdir()) == sorted(bench.COPIES.values())
    assert str(base) not in "".join(p.read_text() for p in copy.iterdir())


def test_resume_trains_nothing_and_parallel_uses_subprocesses(study, capsys):
    import shutil

    base, out, _ = study
    capsys.readouterr()
    for phase in ("lr", "seeds"):
        assert bench.main(_args(base / "tree", out, "--phase", phase)) == 0
        assert "4 of 4 runs finished, 0 to train" in capsys.readouterr().out
    with open(out / "seeds" / "runs.csv") as fh:  # each run's CPU seconds, measured
        assert all(float(r["cpu_s"]) > 0 for r in csv.DictReader(fh))
    # one seeded run lost: --parallel 2 retrains just it, in a `deepmetric train` subprocess
    shutil.rmtree(out / "seeds" / "semihard" / "seed101")
    # a final step over unfinished runs evaluates nothing: the test vendor is read once, at the end
    committed = (base / "copy" / "two_head_accuracy.csv").read_text()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert bench.main(_args(base / "tree", out, "--phase", "final")) == 1
    said = capsys.readouterr().out
    assert "1 seeded run(s) not finished" in said and "nothing evaluated" in said and "top1" not in said
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # the old table untouched
    assert (base / "copy" / "two_head_accuracy.csv").read_text() == committed
    assert bench.main(_args(base / "tree", out, "--phase", "seeds", "--parallel", "2")) == 0
    assert "3 of 4 runs finished, 1 to train" in capsys.readouterr().out
    assert (out / "seeds" / "semihard" / "seed101" / "metrics.json").is_file()
    assert (out / "logs" / "seeds_semihard_seed101.log").is_file()
    assert bench.cpu_seconds(bench.make_run(bench.parse_args(_args(base / "tree", out)), "seeds", "semihard", 0.01,
                                            101)) > 0  # the child's CPU time (os.wait4)


def test_seeds_phase_needs_the_lr_phase(tmp_path):
    with pytest.raises(SystemExit, match="run --phase lr first"):
        bench.main(["--phase", "seeds", "--out", str(tmp_path)])


def test_flattened_is_the_gain_over_the_last_two_evaluations():
    assert bench.last_gain_points([0.1, 0.2]) is None
    assert bench.last_gain_points([0.10, 0.30, 0.303, 0.304]) == pytest.approx(0.4)   # flat: <= 0.5 points
    assert bench.last_gain_points([0.10, 0.30, 0.31, 0.30]) == pytest.approx(1.0)     # still rising
    assert bench.last_gain_points([0.5, 0.4, 0.3]) == pytest.approx(-10.0)
    # pre-registered: "gained no more than 0.5 points over the best before them", not over the one before
    assert bench.last_gain_points([0.50, 0.60, 0.55, 0.58, 0.59]) == pytest.approx(-1.0)


def test_a_folder_trained_with_other_settings_is_an_error(tmp_path, capsys):
    """The seeded runs' folders name no lr or epochs: a run of another lr / epochs / seed there is
    neither counted as finished nor resumed with the new settings."""
    run_dir = tmp_path / "lr" / "softmax" / "lr0.01_seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("optim: {lr: 0.01}\ntrain: {seed: 0, epochs: 5}\n")
    (run_dir / "metrics.json").write_text("{}")
    assert bench.main(["--phase", "lr", "--out", str(tmp_path), "--variants", "softmax", "--lrs", "0.01",
                       "--epochs", "15"]) == 2
    err = capsys.readouterr().err
    assert str(run_dir / "config.yaml") in err and "train.epochs=5" in err and "train.epochs=15" in err
    args = bench.parse_args(["--out", str(tmp_path), "--epochs", "5"])
    bench.make_run(args, "lr", "softmax", 0.01, 0).check_identity()  # the same settings: no error
    with pytest.raises(bench.RunMismatch, match="optim.lr=0.01"):
        bench.make_run(args, "lr", "softmax", 0.03, 0).__class__(
            "softmax", 0.03, 0, run_dir, [], 5).check_identity()


def test_only_the_preregistered_study_reaches_the_committed_folder(study, monkeypatch, capsys):
    base, out, _ = study
    assert bench.departures_from_preregistration(bench.parse_args([])) == []
    mini = bench.parse_args(_args(base / "tree", out))
    flags = {d.split()[0] for d in bench.departures_from_preregistration(mini)}
    assert flags == {"--variants", "--seeds", "--epochs", "--lrs", "--set"}
    committed = base / "committed"  # stands in for bench/studies/protocol_v2
    monkeypatch.setattr(bench, "COMMITTED", committed)
    args = _args(base / "tree", out, "--phase", "final")
    args[args.index("--copy-to") + 1] = str(committed)
    assert bench.main(args) == 1
    assert "not copied" in capsys.readouterr().out and not committed.exists()
    # no test number before the pre-registration exists (committed, unchanged)
    monkeypatch.setattr(bench, "PREREGISTRATION", base / "nowhere" / "PREREGISTRATION.md")
    table = (out / "two_head_accuracy.csv").read_bytes()
    assert bench.main(args) == 1
    said = capsys.readouterr().out
    assert "PREREGISTRATION.md does not exist" in said and "nothing evaluated" in said
    assert (out / "two_head_accuracy.csv").read_bytes() == table


def test_the_lr_seed_is_no_final_seed():
    with pytest.raises(SystemExit):
        bench.parse_args(["--lr-seed", "100"])


def test_an_interrupted_training_stops_the_study(tmp_path, monkeypatch, capsys):
    """--parallel 1: a training that returns interrupted (Ctrl-C; it saved last.pt) stops the
    study (exit 130) instead of starting the next run and going on to the final step."""
    import types

    import deepmetric.train

    started = []

    def fake_train(cfg, resume=None, overwrite=False):
        started.append(cfg.optim.lr)
        return types.SimpleNamespace(interrupted=True)

    monkeypatch.setattr(deepmetric.train, "train", fake_train)
    assert bench.main(["--phase", "all", "--out", str(tmp_path), "--variants", "softmax", "--lrs", "0.01", "0.03",
                       "--epochs", "1"]) == 130
    assert started == [0.01] and "rerun the same command" in capsys.readouterr().err
    assert not (tmp_path / "two_head_accuracy.csv").exists()


def test_sigterm_checkpoints_the_parallel_trainings_and_starts_no_other(tmp_path, monkeypatch, capsys):
    """--parallel 2: SIGTERM to the study passes one SIGINT to each running training (in its own
    session, so a terminal's Ctrl-C does not reach it twice), waits for them, starts no third run."""
    import os
    import signal
    import threading
    import time

    child = ("import signal, sys, time, pathlib; "
             "signal.signal(signal.SIGINT, lambda *a: (pathlib.Path(sys.argv[1], 'stopped').touch(), sys.exit(130))); "
             "pathlib.Path(sys.argv[1]).mkdir(parents=True, exist_ok=True); "
             "pathlib.Path(sys.argv[1], 'ready').touch(); time.sleep(60)")
    monkeypatch.setattr(bench, "_train_command", lambda run: [sys.executable, "-c", child, str(run.out_dir)])
    runs = [tmp_path / "lr" / "softmax" / f"lr{lr}_seed0" for lr in ("0.01", "0.03", "0.1")]

    def stop_when_ready():
        deadline = time.monotonic() + 30
        while sum((r / "ready").is_file() for r in runs) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_ready, daemon=True).start()
    t0 = time.monotonic()
    rc = bench.main(["--phase", "lr", "--out", str(tmp_path), "--variants", "softmax", "--lrs", "0.01", "0.03",
                     "0.1", "--epochs", "1", "--parallel", "2"])
    assert rc == 130 and time.monotonic() - t0 < 30
    assert [(r / "stopped").is_file() for r in runs] == [True, True, False]  # the third never started
    assert signal.getsignal(signal.SIGTERM) is not bench._sigterm_as_sigint  # the handlers are restored


def test_a_drain_lets_the_running_training_finish_and_starts_no_other(tmp_path, monkeypatch, capsys):
    import types

    import deepmetric.train
    from deepmetric.workflows.engine import DRAIN

    started = []

    def fake_train(cfg, resume=None, overwrite=False):
        started.append(cfg.optim.lr)
        if len(started) == 1:
            (tmp_path / DRAIN).touch()  # drained while the first one trains
        return types.SimpleNamespace(interrupted=False)

    monkeypatch.setattr(deepmetric.train, "train", fake_train)
    argv = ["--phase", "all", "--out", str(tmp_path), "--variants", "softmax", "--lrs", "0.01", "0.03", "--epochs", "1"]
    assert bench.main(argv) == 0
    assert started == [0.01] and "drained" in capsys.readouterr().err
    assert not (tmp_path / "lr" / "chosen_lr.json").exists()  # no phase went on
    # the next command removes the mark and continues (the fake writes no metrics.json: every lr trains again)
    assert bench.main([*argv[:1], "lr", *argv[2:]]) == 0 and not (tmp_path / DRAIN).exists()
    assert started == [0.01, 0.01, 0.03]


def test_an_lr_that_diverges_has_ended_and_is_never_chosen(tmp_path, capsys):
    """--parallel 2 (``deepmetric train`` exits 3 on a non-finite loss): lr 1e30 diverges at its
    second step, before any checkpoint; it is recorded (diverged.json), never chosen, its row in
    lr_runs.csv says so, and the next call does not train it again (PREREGISTRATION.md,
    2026-11-28, eleventh session)."""
    from test_data_emoji import make_tree

    make_tree(tmp_path / "tree")
    out = tmp_path / "out"
    argv = _args(tmp_path / "tree", out, "--phase", "lr", "--parallel", "2")
    argv[argv.index("--lrs") + 2] = "1e30"  # the grid: 0.01, 1e30
    argv[argv.index("--variants") + 1:argv.index("--variants") + 3] = ["softmax"]
    assert bench.main(argv) == 0
    gone = json.loads((out / "lr" / "softmax" / "lr1e+30_seed0" / bench.DIVERGED_FILE).read_text())
    assert "exit 3" in gone["message"] and gone["last_checkpoint_epochs"] is None
    with open(out / "lr" / "lr_runs.csv") as fh:
        rows = {float(r["lr"]): r for r in csv.DictReader(fh)}
    assert rows[1e30]["status"] == "diverged" and rows[1e30]["val_top1"] == ""
    assert rows[0.01]["status"] == "finished" and float(rows[0.01]["val_top1"]) >= 0
    chosen = json.loads((out / "lr" / "chosen_lr.json").read_text())["softmax"]
    assert chosen["lr"] == 0.01 and chosen["diverged"] == [1e30]
    capsys.readouterr()
    assert bench.main(argv) == 0
    assert "1 of 2 runs finished, 1 diverged, 0 to train" in capsys.readouterr().out


def test_a_seeded_run_that_diverges_is_tested_from_its_last_checkpoint(study, tmp_path, monkeypatch, capsys):
    """--parallel 1 (``NonFiniteLossError`` in this process): a seeded run that diverged after a
    checkpoint is tested from that last.pt and named in the summary; one that diverged before any
    checkpoint has no model and no test number; the paired difference uses the seeds both
    variants have."""
    import shutil

    import deepmetric.train
    from deepmetric.train.loop import NonFiniteLossError

    base, fixture_out, _ = study
    out = tmp_path / "out"
    shutil.copytree(fixture_out / "lr", out / "lr")  # the lr phase as the fixture left it
    real_train = deepmetric.train.train

    def fake_train(cfg, resume=None, overwrite=False):
        run_dir = Path(cfg.train.out_dir)
        if (run_dir.parent.name, run_dir.name) == ("semihard", "seed100"):
            raise NonFiniteLossError("non-finite loss (nan) at step 2; the last good checkpoint (none written yet)")
        result = real_train(cfg, resume=resume, overwrite=overwrite)
        if (run_dir.parent.name, run_dir.name) == ("softmax", "seed101"):  # diverges after its epoch-1 checkpoint
            (run_dir / "metrics.json").unlink()
            raise NonFiniteLossError("non-finite loss (inf) at step 7")
        return result

    monkeypatch.setattr(deepmetric.train, "train", fake_train)
    argv = _args(base / "tree", out, "--phase", "seeds")
    argv[argv.index("--copy-to") + 1] = str(tmp_path / "copy")
    assert bench.main(argv) == 0
    assert "DIVERGED" in capsys.readouterr().out
    with open(out / "seeds" / "runs.csv") as fh:
        status = {(r["variant"], r["seed"]): (r["status"], r["epochs"]) for r in csv.DictReader(fh)}
    assert status[("softmax", "101")] == ("diverged", "1") and status[("semihard", "100")] == ("diverged", "")
    assert status[("softmax", "100")] == ("finished", "1")
    monkeypatch.setattr(deepmetric.train, "train", real_train)
    argv[argv.index("--phase") + 1] = "final"
    assert bench.main(argv) == 0
    with open(out / "two_head_accuracy.csv") as fh:
        rows = {(r["variant"], int(r["seed"])): float(r["top1"]) for r in csv.DictReader(fh)}
    assert sorted(rows) == [("semihard", 101), ("softmax", 100), ("softmax", 101)]
    assert rows[("softmax", 101)] == bench.test_accuracy(out / "seeds" / "softmax" / "seed101", "cpu")["top1"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged_tested_from_last_checkpoint"] == ["softmax/seed101"]
    assert summary["diverged_without_a_model"] == ["semihard/seed100"]
    assert summary["paired"]["semihard - softmax"]["seeds"] == [101]
    text = (out / "summary.md").read_text()
    assert "softmax/seed101" in text and "no model, no test number: semihard/seed100" in text


def test_a_last_checkpoint_with_non_finite_weights_is_no_model(study, tmp_path):
    """A finite loss with non-finite gradients on an epoch's last step saves non-finite weights:
    the diverged run then has no model to test (its record says why)."""
    import shutil

    import torch

    from deepmetric.run.checkpoint import load_checkpoint, save_checkpoint

    _, out, _ = study
    run_dir = tmp_path / "seed100"
    shutil.copytree(out / "seeds" / "softmax" / "seed100", run_dir)
    (run_dir / "metrics.json").unlink()
    run = bench.Run("softmax", 0.01, 100, run_dir, [], 1)
    bench.record_divergence(run, "non-finite loss (nan) at step 7")
    assert run.diverged and run.divergence()["last_checkpoint_epochs"] == 1  # finite weights: a model
    ckpt = load_checkpoint(run_dir / "last.pt")
    name = next(k for k, v in ckpt["model"].items() if v.is_floating_point())
    ckpt["model"][name] = torch.full_like(ckpt["model"][name], float("nan"))
    save_checkpoint(ckpt, run_dir / "last.pt")
    bench.record_divergence(run, "non-finite loss (nan) at step 7")
    gone = run.divergence()
    assert gone["last_checkpoint_epochs"] is None and gone["last_checkpoint_not_finite"] is True

"""deepmetric tune: the space file, the refusals, a whole tune on synthetic data checked against
the trials' own logs, pruning, a kill -9 in the middle, and two workers sharing a study on a
real PostgreSQL server started by the test."""
import csv
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import free_port, synthetic_config

from deepmetric import cli
from deepmetric.run.config_io import load_config
from deepmetric.run.rundir import read_log
from deepmetric.workflows.tune import prepare_tune
from deepmetric.workflows.tune_space import TuneError, load_space
from deepmetric.workflows.tune_study import open_study

optuna = pytest.importorskip("optuna")
SRC = str(Path(__file__).resolve().parents[2] / "src")

SPACE = {
    "objective": {"metric": "recall@1", "direction": "maximize"},
    "params": {"optim.lr": {"type": "float", "low": 1.0e-4, "high": 0.1, "log": True},
               "loss.0.options.alpha": {"type": "categorical", "choices": [8.0, 16.0, 32.0]}},
    "pruner": {"name": "median"},
}


def _files(tmp_path, space=None, epochs=3, **data):
    raw = synthetic_config(classes=12, data={"val_classes": 0.3, **data}, train={"epochs": epochs})
    del raw["train"]["seed"]  # the recipe's own seed (0 by default): every trial the same
    recipe, sp = tmp_path / "recipe.yaml", tmp_path / "space.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    sp.write_text(yaml.safe_dump(space or SPACE, sort_keys=False))
    return recipe, sp


def _states(study):
    out = {}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


# --------------------------------------------------------------------------- the space file
@pytest.mark.parametrize("params, match", [
    ({"optim.lr": {"type": "flaot", "low": 0.1, "high": 1}}, "params.optim.lr.type: expected float, int or categorical"),
    ({"optim.lr": {"type": "float", "low": 0.1}}, "needs 'low' and 'high'"),
    ({"optim.lr": {"type": "float", "low": 1, "high": 0.1}}, "needs low < high"),
    ({"optim.lr": {"type": "float", "low": 0, "high": 0.1, "log": True}}, "log scale needs low > 0"),
    ({"optim.lr": {"type": "float", "low": 0.1, "high": 1, "lowe": 2}}, "unknown field"),
    ({"b": {"type": "categorical", "keys": ["train.m", "train.n"], "choices": [[16, 4], 32]}}, "list of 2 values"),
    ({"optim.lr": {"type": "categorical", "choices": []}}, "non-empty list"),
    # bool("false") is True: a quoted false tuned on a log scale
    ({"optim.lr": {"type": "float", "low": 0.1, "high": 1, "log": "false"}},
     r"params.optim.lr.log: expected true or false, got 'false'"),
])
def test_space_file_mistakes_name_the_file_and_key(tmp_path, params, match):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"objective": {"metric": "recall@1"}, "params": params}))
    with pytest.raises(TuneError, match=match) as exc:
        load_space(p)
    assert str(p) in str(exc.value)


@pytest.mark.parametrize("part, match", [
    ({"pruner": {"name": "median", "bogus": 3}}, r"pruner: median does not take these options \(.*'bogus'"),
    ({"pruner": {"name": "median", "n_startup_trials": -1}}, r"pruner: median does not take these options"),
    ({"sampler": {"name": "tpe", "seed": "abc"}}, r"sampler.seed: expected a whole number, got 'abc'"),
    ({"pruner": [1]}, r"pruner: expected a mapping"),
])
def test_pruner_and_sampler_options_are_checked_when_the_space_loads(tmp_path, part, match):
    """They failed after tune.json was written, which then refused the corrected space as
    'another space'; now the space file is refused first, naming the key."""
    recipe, sp = _files(tmp_path, space={**SPACE, **part})
    with pytest.raises(TuneError, match=match) as exc:
        load_space(sp)
    assert str(sp) in str(exc.value)
    assert cli.main(["tune", str(recipe), "--space", str(sp), "--trials", "1", "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_a_pruner_or_sampler_by_its_name_alone_loads(tmp_path):
    _, sp = _files(tmp_path, space={**SPACE, "pruner": "none", "sampler": "random"})
    space = load_space(sp)
    assert space.pruner == {"name": "none"} and space.sampler == {"name": "random"}


def test_the_issues_space_file_and_a_multi_key_parameter_load(tmp_path):
    recipe, sp = _files(tmp_path, space={**SPACE, "params": {
        **SPACE["params"], "batch": {"type": "categorical", "keys": ["train.m", "train.n"],
                                     "choices": [[4, 4], [8, 2]]}}, "overrides": ["train.sampler=class_balanced"]})
    setup = prepare_tune(recipe, sp, trials=3, out=tmp_path / "out")
    assert [p.name for p in setup.space.params] == ["optim.lr", "loss.0.options.alpha", "batch"]
    cfg = setup.trial_config({"optim.lr": 0.01, "loss.0.options.alpha": 32.0, "batch": [8, 2]}, tmp_path / "r")
    assert (cfg.optim.lr, cfg.loss[0].options["alpha"], cfg.train.m, cfg.train.n) == (0.01, 32.0, 8, 2)
    assert cfg.eval.best_metric == "recall@1" and not cfg.eval.test and not cfg.eval.test_selected and cfg.train.sampler == "class_balanced"


def test_a_parameter_that_names_no_config_key_is_refused_before_any_trial(tmp_path):
    recipe, sp = _files(tmp_path, space={**SPACE, "params": {"optim.lrr": {"type": "float", "low": 0.1, "high": 1}}})
    with pytest.raises(TuneError, match=r"params.optim.lrr.*did you mean 'optim.lr'"):
        prepare_tune(recipe, sp, trials=3, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tune_refuses_without_validation_classes_in_one_line(tmp_path, capsys):
    recipe, sp = _files(tmp_path)
    raw = yaml.safe_load(recipe.read_text())
    del raw["data"]["val_classes"]
    recipe.write_text(yaml.safe_dump(raw))
    assert cli.main(["tune", str(recipe), "--space", str(sp), "--trials", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no validation classes" in err and "data.val_classes" in err


def test_the_objective_must_be_a_metric_of_the_validation(tmp_path):
    recipe, sp = _files(tmp_path, space={**SPACE, "objective": {"metric": "recall@3"}})
    with pytest.raises(TuneError, match=r"'recall@3' is not a metric .*recall@1, recall@2, recall@4, recall@8"):
        prepare_tune(recipe, sp, trials=2, out=tmp_path / "out")


# --------------------------------------------------------------------------- a whole tune
def test_tune_end_to_end_objective_from_validation_only_and_best_recipe_trains(tmp_path, capsys):
    recipe, sp = _files(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["tune", str(recipe), "--space", str(sp), "--trials", "4", "--out", str(out)]) == 0
    for name in ("best.yaml", "trials.csv", "trials.md", "optimization_history.png", "param_importances.png",
                 "report.html", "tune.json", "tune.db"):
        assert (out / name).is_file(), name
    setup = prepare_tune(recipe, sp, trials=4, out=out)
    study = open_study(setup, create=False)
    trials = study.get_trials()
    assert sum(t.state.name in ("COMPLETE", "PRUNED") for t in trials) == 4
    for t in trials:
        log = read_log(t.user_attrs["run_dir"])
        val = [r for r in log if r["type"] == "eval" and r["split"] == "val"]
        # the pruner saw exactly the validation evaluations, the objective is their best
        assert {r["epoch"]: r["recall@1"] for r in val} == pytest.approx(t.intermediate_values)
        if t.state.name == "COMPLETE":
            assert t.value == pytest.approx(max(r["recall@1"] for r in val))
        # the test split out of sight: never evaluated, nothing recorded
        assert not [r for r in log if r.get("split") == "test"] and "test" not in t.user_attrs
    # best.yaml: the best trial's values, a runnable recipe
    best = max((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    cfg = load_config(out / "best.yaml", [f"train.out_dir={tmp_path / 'best_run'}", "train.epochs=1"])
    assert cfg.optim.lr == pytest.approx(best.params["optim.lr"])
    assert cfg.loss[0].options["alpha"] == best.params["loss.0.options.alpha"]
    assert cli.main(["train", str(out / "best.yaml"), f"train.out_dir={tmp_path / 'best_run'}", "train.epochs=1"]) == 0
    table = (out / "trials.md").read_text()
    assert f"| {best.number} | complete |" in table and "never evaluated the test split" in table
    html = (out / "report.html").read_text()
    assert "data:image/png;base64" in html and "Parameter importances" in html
    # a finished study: the same command trains nothing more
    capsys.readouterr()
    assert cli.main(["tune", str(recipe), "--space", str(sp), "--trials", "4", "--out", str(out)]) == 0
    assert "4 finished or pruned" in capsys.readouterr().out
    assert len(open_study(setup, create=False).get_trials()) == len(trials)
    # --report-only rewrites the same outputs from the storage
    before = {name: (out / name).read_bytes() for name in ("best.yaml", "trials.csv", "trials.md")}
    assert cli.main(["tune", str(recipe), "--space", str(sp), "--trials", "4", "--out", str(out), "--report-only"]) == 0
    assert {name: (out / name).read_bytes() for name in before} == before
    # ... and another space in the same directory is refused, by a rerun and by --report-only (it
    # relabelled the trials with the new objective and chose best.yaml by its direction)
    flipped = {**SPACE, "objective": {"metric": "recall@1", "direction": "minimize"}}
    for space in (flipped, {**SPACE, "params": {"optim.lr": SPACE["params"]["optim.lr"]}}):
        sp.write_text(yaml.safe_dump(space))
        for extra in ([], ["--report-only"]):
            capsys.readouterr()
            assert cli.main(["tune", str(recipe), "--space", str(sp), "--trials", "4", "--out", str(out), *extra]) == 2
            assert "holds a tune with another space" in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in before} == before
    # a folder without a tune: refused, no empty study made there
    assert cli.main(["tune", str(recipe), "--space", str(sp), "--trials", "4", "--out", str(tmp_path / "none"),
                     "--report-only"]) == 2
    assert "holds no tune (no tune.json)" in capsys.readouterr().err and not (tmp_path / "none" / "tune.db").exists()


# a test metric, however written: test/recall@1, test_map@r, "test: recall@1=...", a JSON record of
# the test split, or a "test" mapping of metric values (the user attribute older tunes stored)
TEST_METRIC = re.compile(r'test[/_: ]+"?(cross_domain_)?(recall@|map@r|r_precision|nmi|f1)|"split"\s*:\s*"test"'
                         r'|"test"\s*:\s*\{\s*"[\w@]+"\s*:\s*-?[\d.]', re.I)


def _test_metric_leaks(folder: Path) -> list[str]:
    """Every text file under ``folder`` holding a test metric (binary files are the storage
    and the checkpoints: the storage is read through Optuna by the caller)."""
    leaks = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        m = TEST_METRIC.search(text)
        if m:
            leaks.append(f"{path.relative_to(folder)}: {m.group(0)!r}")
    return leaks


def test_the_leak_check_finds_test_metrics_in_each_form_it_was_written(tmp_path):
    for i, text in enumerate(["a,test/recall@1\n1,0.5", '{"type": "eval", "split": "test", "epoch": 1}',
                              '{"test": {"cross_domain_recall@1": 0.4}}', "epoch 1 step 8 test: recall@1=0.4",
                              "| test_map@r |"]):
        (tmp_path / f"f{i}.txt").write_text(text)
    (tmp_path / "clean.yaml").write_text("eval: {test: false, test_every: 0, split: test}\nval/recall@1: 0.5\n")
    assert len(_test_metric_leaks(tmp_path)) == 5


def test_no_test_metric_reaches_a_tune_output_or_its_storage_and_completed_trials_are_counted(tmp_path):
    """Issue 30 item 2: a tune's trials never evaluate the test split, so no file of its folder
    (trials.csv / .md, tune.json, best files, plots' page, the trials' logs and metrics.json) and
    no attribute in the storage holds a test metric.  ``--count completed``: pruned trials do not
    count towards --trials, and --max-trials caps the total."""
    space = {"objective": {"metric": "recall@1"},
             "params": {"optim.lr": {"type": "categorical", "choices": [0.05, 1.0e-6]}},
             "pruner": {"name": "median", "n_startup_trials": 1}, "sampler": {"name": "random", "seed": 0}}
    recipe, sp = _files(tmp_path, space=space, epochs=2)
    from deepmetric.workflows.tune import run_tune

    for out, cap, lrs, want in ((tmp_path / "a", None, (0.05, 1.0e-6, 0.05), {"COMPLETE": 2, "PRUNED": 1}),
                                (tmp_path / "b", 3, (0.05, 1.0e-6, 1.0e-6, 0.05), {"COMPLETE": 1, "PRUNED": 2})):
        setup = prepare_tune(recipe, sp, trials=2, out=out, count="completed", max_trials=cap)
        study = open_study(setup)
        for lr in lrs:
            study.enqueue_trial({"optim.lr": lr})
        run_tune(setup)
        study = open_study(setup, create=False)
        assert {k: v for k, v in _states(study).items() if k != "WAITING"} == want, out
        assert _test_metric_leaks(out) == []
        for t in study.get_trials():
            assert not any(str(k).lower().startswith("test") for k in {**t.user_attrs, **t.system_attrs}), t.user_attrs
        with open(out / "trials.csv") as f:
            columns = next(csv.reader(f))
        assert "val/recall@1" in columns and not [c for c in columns if "test" in c.lower()]
        record = json.loads((out / "tune.json").read_text())
        assert record["count"] == "completed" and record["max_trials"] == (cap or 6)
    # ... and the check would have seen one: the same recipe trained with the test split on
    assert cli.main(["train", str(recipe), f"train.out_dir={tmp_path / 'plain'}", "train.epochs=1"]) == 0
    assert _test_metric_leaks(tmp_path / "plain")
    with pytest.raises(TuneError, match="--max-trials 1: needs --count completed"):
        prepare_tune(recipe, sp, trials=2, out=tmp_path / "c", max_trials=1)


def test_a_hopeless_trial_is_pruned_at_its_first_evaluation(tmp_path):
    """lr 1e-6 cannot move the embedding: the median pruner (after one finished trial) stops
    it at epoch 1; a diverged (NaN) trial is pruned, not an error."""
    space = {"objective": {"metric": "recall@1"},
             "params": {"optim.lr": {"type": "categorical", "choices": [0.05, 1.0e-6, 1.0e6]}},
             "pruner": {"name": "median", "n_startup_trials": 1},
             "sampler": {"name": "random", "seed": 0},
             "overrides": ["model.options.normalization=none"]}  # unbounded logits: lr 1e6 overflows
    recipe, sp = _files(tmp_path, space=space, epochs=4)
    setup = prepare_tune(recipe, sp, trials=3, out=tmp_path / "out")
    study = open_study(setup)
    for lr in (0.05, 1.0e-6, 1.0e6):
        study.enqueue_trial({"optim.lr": lr})
    from deepmetric.workflows.tune import run_tune

    run_tune(setup)
    by_lr = {t.params["optim.lr"]: t for t in open_study(setup, create=False).get_trials()}
    assert by_lr[0.05].state.name == "COMPLETE" and max(by_lr[0.05].intermediate_values) == 4
    assert by_lr[1.0e-6].state.name == "PRUNED" and list(by_lr[1.0e-6].intermediate_values) == [1]
    assert by_lr[1.0e-6].user_attrs["pruned_at_epoch"] == 1
    assert by_lr[1.0e6].state.name == "PRUNED" and "non-finite" in by_lr[1.0e6].user_attrs["stopped"]


def test_workers_with_a_seeded_sampler_draw_different_values(tmp_path):
    """Each worker process seeds its sampler: the same seed in every worker would make them draw
    the same values (seen: two glyph trials with identical parameters)."""
    space = {**SPACE, "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "none"}}
    recipe, sp = _files(tmp_path, space=space, epochs=1)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "deepmetric.cli", "tune", str(recipe), "--space", str(sp),
                        "--trials", "4", "--workers", "2", "--out", str(out)], env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    trials = open_study(prepare_tune(recipe, sp, trials=4, out=out), create=False).get_trials()
    lrs = [t.params["optim.lr"] for t in trials if t.state.name == "COMPLETE"]
    assert len(lrs) == 4 and len(set(lrs)) == 4, lrs


def test_a_rerun_of_a_seeded_tune_draws_new_values(tmp_path):
    """A tune stopped after some trials and run again must not draw the first run's values a
    second time (seen: the fair ProxyAnchor tune's rerun repeated trials 0, 1 and 2 exactly, a
    freshly seeded sampler starting its sequence again), and the draws stay reproducible."""
    from deepmetric.workflows.tune import run_tune

    space = {**SPACE, "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "none"}}
    recipe, sp = _files(tmp_path, space=space, epochs=1)

    def lrs(out, *trial_counts):
        for n in trial_counts:  # one command per count: the later ones continue the study
            run_tune(prepare_tune(recipe, sp, trials=n, out=out), log=lambda m: None)
        return [t.params["optim.lr"] for t in open_study(prepare_tune(recipe, sp, trials=4, out=out),
                                                         create=False).get_trials()]

    stopped = lrs(tmp_path / "a", 2, 4)
    assert len(stopped) == 4 and len(set(stopped)) == 4, stopped
    assert lrs(tmp_path / "b", 4) == stopped  # the same seed, the same draws, stopped or not


def test_a_retry_of_a_run_killed_after_its_last_evaluation_counts_the_logged_validations(tmp_path):
    """Seen on the glyph tune: a worker killed after the run's last epoch, before the trial was
    told; the retry resumed a checkpoint with no epoch left to train and failed with 'the run
    evaluated no validation split', again at every retry.  The validations in the run's log
    count: the retry completes with their best, each reported at its epoch."""
    from optuna.trial import TrialState

    from deepmetric.train.loop import train
    from deepmetric.workflows.tune import run_tune

    space = {**SPACE, "pruner": {"name": "none"}}
    recipe, sp = _files(tmp_path, space=space, epochs=2)
    setup = prepare_tune(recipe, sp, trials=1, out=tmp_path / "out")
    study = open_study(setup)
    params = {"optim.lr": 0.05, "loss.0.options.alpha": 16.0}
    study.enqueue_trial(params)
    first = study.ask()
    values = {p.name: p.suggest(first) for p in setup.space.params}
    run_dir = setup.out / "trials" / "trial_0000"
    train(setup.trial_config(values, run_dir, threads=1))  # the whole run, then the worker dies
    study.tell(first, state=TrialState.FAIL)
    study.enqueue_trial(params, user_attrs={"retry_of": 0}, skip_if_exists=False)
    run_tune(setup)
    trials = open_study(setup, create=False).get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    val = {r["epoch"]: r["recall@1"] for r in read_log(run_dir, type="eval") if r["split"] == "val"}
    assert sorted(val) == [1, 2]
    assert trials[1].intermediate_values == pytest.approx(val)
    assert trials[1].value == pytest.approx(max(val.values()))


# --------------------------------------------------------------------------- kill -9, resume
def _env(heartbeat="1"):
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                DEEPMETRIC_TUNE_HEARTBEAT=heartbeat, OMP_NUM_THREADS="1")


def test_kill_9_halfway_then_the_same_command_finishes_exactly_n_trials(tmp_path):
    # 12 epochs: on an idle machine a 6-epoch trial took 2 s and the whole tune could end
    # between two polls, before anything was cut
    recipe, sp = _files(tmp_path, epochs=12, options={"per_class": 40})
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "deepmetric.cli", "tune", str(recipe), "--space", str(sp), "--trials", "5",
           "--workers", "2", "--out", str(out)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    setup = prepare_tune(recipe, sp, trials=5, out=out)
    deadline = time.time() + 240
    try:  # kill the whole process group once trials are running and one finished (or two run)
        while time.time() < deadline:
            time.sleep(0.2)
            if (out / "tune.db").is_file():
                try:
                    s = _states(open_study(setup, create=False))
                except KeyError:  # the file exists, the study in it not yet
                    continue
                running, done = s.get("RUNNING", 0), s.get("COMPLETE", 0) + s.get("PRUNED", 0)
                if running >= 1 and (done >= 1 or running >= 2):
                    break
        else:
            pytest.fail("the tune did not get going within 240 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = {t.number: t.params for t in open_study(setup, create=False).get_trials() if t.state.name == "RUNNING"}
    assert killed  # trials were cut mid-way
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trials = open_study(setup, create=False).get_trials()
    states = _states(open_study(setup, create=False))
    assert states.get("COMPLETE", 0) + states.get("PRUNED", 0) == 5  # exactly 5, none counted twice
    assert "RUNNING" not in states and "WAITING" not in states
    for number, params in killed.items():  # each cut trial was failed and retried with its values
        assert trials[number].state.name == "FAIL"
        if not params:
            continue  # killed before it drew its values: its retry draws new ones
        # killed between its two draws (a window of some 20 ms): the retry keeps the one it
        # drew and draws the other
        retries = [t for t in trials
                   if t.number != number and t.params.items() >= params.items() and t.state.name != "FAIL"]
        assert len(retries) == 1, (number, params)
    dirs = {t.user_attrs["run_dir"] for t in trials if t.user_attrs.get("run_dir")}
    assert len(glob.glob(str(out / "trials" / "trial_*"))) == len(dirs)  # a retry resumes its original's folder


def test_a_failed_trial_queued_twice_runs_once(tmp_path):
    """Two workers failing the same stale trial at once can queue it twice (seen in CI after the
    kill -9 rerun); the second copy stands down and does not count."""
    from optuna.trial import TrialState

    from deepmetric.workflows.tune import run_tune

    space = {**SPACE, "pruner": {"name": "none"}}
    recipe, sp = _files(tmp_path, space=space, epochs=1)
    setup = prepare_tune(recipe, sp, trials=2, out=tmp_path / "out")
    study = open_study(setup)
    params = {"optim.lr": 0.05, "loss.0.options.alpha": 16.0}
    dists = {"optim.lr": optuna.distributions.FloatDistribution(1e-4, 0.1, log=True),
             "loss.0.options.alpha": optuna.distributions.CategoricalDistribution([8.0, 16.0, 32.0])}
    study.add_trial(optuna.create_trial(state=TrialState.FAIL, params=params, distributions=dists))
    for _ in range(2):  # what RetryHeartbeatStaleTrialCallback adds, twice
        study.add_trial(optuna.create_trial(state=TrialState.WAITING, params=params, distributions=dists,
                                            system_attrs={"failed_trial": 0, "retry_history": [0]}))
    run_tune(setup, log=lambda m: None)
    trials = open_study(setup, create=False).get_trials()
    assert [t.state.name for t in trials[:3]] == ["FAIL", "COMPLETE", "FAIL"]
    assert trials[2].user_attrs.get("surplus") and trials[3].state.name == "COMPLETE"
    assert trials[3].params != params and len(trials) == 4


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")
def test_a_trial_killed_before_its_first_heartbeat_is_failed_and_queued_again(tmp_path, monkeypatch):
    # Optuna's fail_stale_trials skips a running trial that never recorded a heartbeat; a worker
    # killed between creating its trial and the first beat left one RUNNING for ever and the
    # rerun of the kill -9 test above waiting on it until CI's timeout
    from deepmetric.workflows import engine

    recipe, sp = _files(tmp_path)
    study = open_study(prepare_tune(recipe, sp, trials=3, out=tmp_path / "out"))
    dist = optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)
    silent = study.ask({"optim.lr": dist})     # killed before its heartbeat thread ran
    beating = study.ask({"optim.lr": dist})    # alive: its heartbeat is recorded
    study._storage.record_heartbeat(beating._trial_id)
    monkeypatch.setattr(engine, "GRACE_S", 3600)
    optuna.storages.fail_stale_trials(study)
    assert engine.fail_stale_trials(study) == []  # younger than the grace period: left alone
    assert _states(study) == {"RUNNING": 2}
    monkeypatch.setattr(engine, "GRACE_S", 0)
    time.sleep(0.01)
    young = study.ask({"optim.lr": dist})  # as old as the check's clock says now: not failed
    start = [t for t in study.get_trials(deepcopy=False) if t.number == young.number][0].datetime_start
    monkeypatch.setattr(engine, "_now", lambda: start)
    assert engine.fail_stale_trials(study) == [silent._trial_id]
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert by_number[silent.number].state.name == "FAIL"
    assert by_number[beating.number].state.name == "RUNNING"  # its heartbeat is within Optuna's grace
    assert by_number[young.number].state.name == "RUNNING"
    retry = [t for t in by_number.values() if t.state.name == "WAITING"]
    assert len(retry) == 1 and retry[0].params == {"optim.lr": silent.params["optim.lr"]}
    assert optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(retry[0]) == silent.number
    assert engine.fail_stale_trials(study) == []  # failed once


def test_storage_creation_retries_only_the_table_creation_race(tmp_path, monkeypatch):
    """Two processes opening a new database at once: the second's CREATE TABLE fails ("table
    ... already exists" on SQLite, optuna/optuna#1092; seen when a poller opened the tune.db a
    starting tune was initialising). rdb_storage tries again; any other OperationalError is
    raised at once."""
    import sqlalchemy.exc

    from deepmetric.workflows import engine

    real = optuna.storages.RDBStorage
    calls = []

    def flaky(url, **kw):
        calls.append(url)
        if len(calls) == 1:
            raise sqlalchemy.exc.OperationalError("CREATE TABLE study_directions", {},
                                                  Exception("table study_directions already exists"))
        return real(url, **kw)

    monkeypatch.setattr(optuna.storages, "RDBStorage", flaky)
    monkeypatch.setattr(engine.time, "sleep", lambda s: None)
    url = f"sqlite:///{tmp_path / 'race.db'}"
    storage = engine.rdb_storage(url, retry_stale=False)
    assert len(calls) == 2 and isinstance(storage, real)

    calls.clear()

    def broken(url, **kw):
        calls.append(url)
        raise sqlalchemy.exc.OperationalError("connect", {}, Exception("unable to open database file"))

    monkeypatch.setattr(optuna.storages, "RDBStorage", broken)
    with pytest.raises(ValueError, match=r"^--storage sqlite:///.*race.db cannot be opened \(unable to open database "
                                         r"file\); expected sqlite:///"):
        engine.rdb_storage(url, retry_stale=False)
    assert len(calls) == 1


def test_a_storage_url_that_does_not_open_is_one_line(tmp_path, capsys):
    """SQLAlchemy's refusals (no such dialect, not a URL, no server) were tracebacks; each is
    one line naming --storage (password masked) and the two forms expected."""
    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump({"base": synthetic_config(tmp_path / "never"), "variants": {"A": []},
                                     "seeds": [0], "out_dir": str(tmp_path / "out")}))
    closed = free_port()  # nothing listens there
    cases = {"bogus://x": r"--storage bogus://x is not a database URL SQLAlchemy can read \(Can't load plugin",
             "notaurl": r"--storage notaurl is not a database URL SQLAlchemy can read \(Could not parse",
             f"postgresql://me:secret@127.0.0.1:{closed}/db": r"--storage postgresql://me:\*\*\*@127.0.0.1:\d+/db "
                                                             r"cannot be opened \(.*refused"}
    for url, said in cases.items():
        assert cli.main(["study", str(study), "--storage", url]) == 2
        err = capsys.readouterr().err
        assert re.search(said, err) and "secret" not in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "never").exists()


# --------------------------------------------------------------------------- PostgreSQL
def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    return Path(which).parent if which else None


@pytest.fixture
def postgres(tmp_path):
    """A PostgreSQL server of the Debian package on 127.0.0.1 (trust auth, a temporary data
    directory), stopped after the test.  As root the server runs as the 'postgres' user."""
    pytest.importorskip("psycopg")
    bindir = _pg_bin()
    if bindir is None:
        pytest.fail("PostgreSQL is not installed (install.sh installs the Debian package 'postgresql')")
    import tempfile

    # not under tmp_path: pytest's folders are private to this user, the server's user must enter
    root = Path(tempfile.mkdtemp(prefix="deepmetric-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root
        import pwd

        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data = root / "data"
    run = lambda *a: subprocess.run(as_user + [str(bindir / a[0]), *a[1:]], check=True,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    run("initdb", "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    run("pg_ctl", "-D", str(data), "-l", str(root / "log"), "-w", "-o",
        f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off", "start")
    try:
        run("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "tune")
        yield f"postgresql://postgres@127.0.0.1:{port}/tune"
    finally:
        subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def test_two_workers_share_one_study_on_postgresql(tmp_path, postgres):
    """Two 'machines' (two processes with their own output folders) run the same command on one
    PostgreSQL study: every trial finishes once, none is lost, exactly N are finished or pruned."""
    # trials of several seconds: with 1-second ones, a machine whose start the load delays can find
    # the 6 trials already taken ("both machines worked" fails; the likeliest cause of this test's
    # one failure, in a full run on 2 busy cores, whose output was not kept)
    recipe, sp = _files(tmp_path, epochs=8, options={"per_class": 30})
    cmds = [[sys.executable, "-m", "deepmetric.cli", "tune", str(recipe), "--space", str(sp), "--trials", "6",
             "--storage", postgres, "--study-name", "shared", "--out", str(tmp_path / f"machine{k}")]
            for k in (0, 1)]
    procs = [subprocess.Popen(c, env=_env("2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    setup = prepare_tune(recipe, sp, trials=6, out=tmp_path / "machine0", storage=postgres, study_name="shared")
    trials = open_study(setup, create=False).get_trials()
    ran = [t for t in trials if not t.user_attrs.get("surplus")]
    assert sum(t.state.name in ("COMPLETE", "PRUNED") for t in ran) == 6
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in ran)  # none lost or left running
    dirs = [t.user_attrs["run_dir"] for t in ran]
    assert len(set(dirs)) == len(dirs)  # each trial trained once, by one machine
    by_machine = {k: sum(f"machine{k}" in d for d in dirs) for k in (0, 1)}
    assert by_machine[0] >= 1 and by_machine[1] >= 1, by_machine  # both machines worked
    for k in (0, 1):
        assert (tmp_path / f"machine{k}" / "trials.md").is_file()
    assert json.loads((tmp_path / "machine0" / "tune.json").read_text())["storage"] == postgres


def test_the_same_recipe_by_another_path_continues_the_tune_and_a_changed_one_is_refused(tmp_path, monkeypatch):
    """Seen: a tune started as `tune recipes/x.yaml` was refused when bench/emoji_fair.py
    continued it with the absolute path. The recipe is compared by content, not by how its path
    is written; an edited recipe is still refused."""
    import json as _json

    from deepmetric.workflows.tune import _check_same_tune, _setup_record

    recipe, sp = _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    rel = prepare_tune(Path("recipe.yaml"), sp, trials=2, out=tmp_path / "out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tune.json").write_text(_json.dumps(_setup_record(rel)))
    _check_same_tune(prepare_tune(recipe.resolve(), sp, trials=2, out=tmp_path / "out"))  # accepted
    old = _json.loads((tmp_path / "out" / "tune.json").read_text())
    del old["recipe_sha256"]  # a record written before the hash: the path resolves to the same file
    (tmp_path / "out" / "tune.json").write_text(_json.dumps(old))
    _check_same_tune(prepare_tune(recipe.resolve(), sp, trials=2, out=tmp_path / "out"))
    (tmp_path / "out" / "tune.json").write_text(_json.dumps(_setup_record(rel)))
    recipe.write_text(recipe.read_text().replace("epochs: 3", "epochs: 4"))
    with pytest.raises(TuneError, match="another recipe"):
        _check_same_tune(prepare_tune(recipe.resolve(), sp, trials=2, out=tmp_path / "out"))


def test_the_heartbeat_retry_of_a_ctrl_c_retry_resumes_the_original_trials_folder():
    """A chain 0 (interrupted) -> 1 (queued again by Ctrl-C, ``retry_of`` 0) -> 2 (Optuna's
    heartbeat retry of 1, which copies 1's user attributes and marks ``failed_trial`` 1): all
    three are trial 0's run (its folder, its checkpoint).  Seen in protocol v2: such a trial
    started over from epoch 0 in a folder of its own."""
    import optuna
    from optuna.distributions import FloatDistribution

    from deepmetric.workflows.tune_study import trial_origin

    study = optuna.create_study()
    dist = {"x": FloatDistribution(0.0, 1.0)}

    def add(user_attrs=None, system_attrs=None):
        study.add_trial(optuna.create_trial(state=optuna.trial.TrialState.FAIL, params={"x": 0.5}, distributions=dist,
                                            user_attrs=user_attrs or {}, system_attrs=system_attrs or {}))
        return study.get_trials()[-1]

    first = add()
    ctrl_c = add(user_attrs={"retry_of": 0})
    heartbeat = add(user_attrs={"retry_of": 0}, system_attrs={"failed_trial": 1, "retry_history": [1]})
    plain_heartbeat = add(system_attrs={"failed_trial": 0, "retry_history": [0]})
    assert [trial_origin(t) for t in (first, ctrl_c, heartbeat, plain_heartbeat)] == [0, 0, 0, 0]
    assert trial_origin(heartbeat, study) == 0  # read from the storage, as a live trial is


def test_a_drain_finishes_the_running_trial_starts_no_other_and_the_next_command_continues(tmp_path):
    """``touch OUT/DRAIN`` while a trial runs: that trial completes (its work kept: a Ctrl-C would
    lose its current epoch, a fresh clone its checkpoint), no other starts, the command ends
    normally with the study unfinished; the next command removes the file and finishes it."""
    from deepmetric.workflows.tune import DRAIN, run_tune

    # no pruner: this test is about the drain; with the median pruner an unseeded sampler's third
    # trial was pruned now and then (CI saw {'COMPLETE': 2, 'PRUNED': 1})
    recipe, sp = _files(tmp_path, {**SPACE, "pruner": {"name": "none"}}, epochs=2)
    setup = prepare_tune(recipe, sp, trials=3, out=tmp_path / "out")
    said = []

    def log(msg):
        said.append(msg)
        if msg.startswith("trial 0:"):  # trial 0 has started: drain now
            (setup.out / DRAIN).touch()

    run_tune(setup, log=log)
    assert _states(open_study(setup, create=False)) == {"COMPLETE": 1}
    assert (setup.out / DRAIN).is_file() and any(m.startswith("drained") for m in said)
    with open(setup.out / "trials.csv") as fh:
        assert [r["state"] for r in csv.DictReader(fh)] == ["complete"]
    said.clear()
    run_tune(setup, log=said.append)
    assert _states(open_study(setup, create=False)) == {"COMPLETE": 3} and not (setup.out / DRAIN).exists()
    assert any("from the last drain removed" in m for m in said)

"""Ctrl-C in 'deepmetric tune' (issue 32, item 16): one message (rerun the same command), no
Optuna traceback, no train-level --resume hint; the trial is shown as interrupted, not failed,
and the rerun resumes it with the same values."""
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import synthetic_config

from deepmetric.run.rundir import read_log
from deepmetric.workflows.tune import prepare_tune
from deepmetric.workflows.tune_study import open_study

optuna = pytest.importorskip("optuna")
SRC = str(Path(__file__).resolve().parents[2] / "src")
SPACE = {"objective": {"metric": "recall@1", "direction": "maximize"},
         "params": {"optim.lr": {"type": "float", "low": 1.0e-3, "high": 0.1, "log": True}},
         "pruner": {"name": "none"}}


def _tune(tmp_path, trials=2):
    # 260 steps (about 3 s): the interrupt, sent after the first step, lands mid-trial
    raw = synthetic_config(classes=10, per_class=30, data={"val_classes": 0.3}, train={"epochs": 20},
                           eval={"every": 10, "metrics": ["recall"], "ks": [1], "baselines": False})
    recipe, space = tmp_path / "recipe.yaml", tmp_path / "space.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    space.write_text(yaml.safe_dump(SPACE))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "deepmetric.cli", "tune", str(recipe), "--space", str(space), "--trials",
           str(trials), "--out", str(out)]
    return recipe, space, out, cmd


def _env():
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _wait_for_steps(out: Path, proc, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the tune ended before it could be interrupted"
        run = out / "trials" / "trial_0000"
        if (run / "log.jsonl").is_file() and any(r["type"] == "step" for r in read_log(run)):
            return
        time.sleep(0.1)
    pytest.fail(f"no training step within {timeout} s")


def test_ctrl_c_says_one_thing_and_counts_the_trial_as_interrupted(tmp_path):
    recipe, space, out, cmd = _tune(tmp_path)
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        _wait_for_steps(out, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole group
        printed, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, printed
    assert printed.count("rerun the same command to continue") == 1, printed
    for noise in ("Traceback", "--resume", "failed", "KeyboardInterrupt", "trial 0 fail", "interrupt received"):
        assert noise not in printed, (noise, printed)
    setup = prepare_tune(recipe, space, trials=2, out=out)
    trials = open_study(setup, create=False).get_trials()
    first = trials[0]
    assert first.state.name == "FAIL" and first.user_attrs["interrupted"] is True
    queued = [t for t in trials if t.state.name == "WAITING"]
    assert len(queued) == 1 and queued[0].system_attrs["fixed_params"] == first.params  # the same values again
    assert (out / "trials" / "trial_0000" / "last.pt").is_file()  # checkpointed at the interrupt
    rows = list(csv.DictReader(open(out / "trials.csv")))
    assert rows[0]["state"] == "interrupted"
    assert "1 interrupted" in (out / "trials.md").read_text()

    # the same command again: the interrupted trial resumes from its checkpoint, 2 trials finish
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trials = open_study(setup, create=False).get_trials()
    assert sum(t.state.name == "COMPLETE" for t in trials) == 2
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == 0)
    assert retry.state.name == "COMPLETE" and retry.params == first.params
    assert retry.user_attrs["run_dir"] == first.user_attrs["run_dir"]
    states = [row["state"] for row in csv.DictReader(open(out / "trials.csv"))]
    assert states.count("interrupted") == 1 and "fail" not in states

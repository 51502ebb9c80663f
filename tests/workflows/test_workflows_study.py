"""``deepmetric study``: study files, statistics against closed forms and t tables, reading
metrics.json (old and new layouts), resume after a kill, parallel workers."""
import csv
import json
import re
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from deepmetric import cli
from deepmetric.run.config import ConfigError
from deepmetric.report.study_tables import mean_ci, paired_differences, paired_values, summarize
from deepmetric.workflows.study import collect_rows, run_row, run_study
from deepmetric.workflows.study_file import StudyRun, load_study
from conftest import synthetic_config
from deepmetric.run.rundir import read_log

SRC = str(Path(__file__).resolve().parents[2] / "src")

BASE = synthetic_config(train={"epochs": 2, "num_threads": 1},
                        eval={"metrics": ["recall", "nmi"], "ks": [1, 2]})


def _study(tmp_path, **extra):
    raw = {"name": "tiny", "base": BASE, "seeds": [0, 1],
           "variants": {"a16": [], "a4": ["loss.0.options.alpha=4"]},
           "out_dir": str(tmp_path / "out"), "compare": [["a16", "a4"]],
           "metrics": ["final/recall@1", "final/nmi", "wall_time_s"], **extra}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# --------------------------------------------------------------------------- statistics
def test_mean_ci_matches_hand_computation_and_t_table():
    xs = [0.61, 0.64, 0.58]
    st = mean_ci(xs)
    mean = (0.61 + 0.64 + 0.58) / 3
    sd = math.sqrt(((0.61 - mean) ** 2 + (0.64 - mean) ** 2 + (0.58 - mean) ** 2) / 2)
    t_2 = 4.302652729911275  # t_{0.975, 2} from a printed t table
    assert st["n"] == 3 and st["mean"] == pytest.approx(mean) and st["std"] == pytest.approx(sd)
    assert st["ci_low"] == pytest.approx(mean - t_2 * sd / math.sqrt(3), rel=1e-9)
    assert st["ci_high"] == pytest.approx(mean + t_2 * sd / math.sqrt(3), rel=1e-9)
    # Five values, 90 % interval: t_{0.95, 4} = 2.131847 (table); numpy's ddof=1 sd.
    ys = np.array([3.0, 1.0, 4.0, 1.0, 5.0])
    st = mean_ci(ys, confidence=0.90)
    half = 2.131846786326649 * ys.std(ddof=1) / math.sqrt(5)
    assert st["half_width"] == pytest.approx(half, rel=1e-9) and st["mean"] == pytest.approx(2.8)
    # scipy's own interval as a second reference
    from scipy import stats

    lo, hi = stats.t.interval(0.95, 4, loc=ys.mean(), scale=stats.sem(ys))
    assert (mean_ci(ys)["ci_low"], mean_ci(ys)["ci_high"]) == (pytest.approx(lo), pytest.approx(hi))
    one = mean_ci([0.5, None, float("nan")])
    assert one["n"] == 1 and one["mean"] == 0.5 and math.isnan(one["std"]) and math.isnan(one["ci_low"])
    assert mean_ci([])["n"] == 0


def test_summarize_and_paired_differences_use_matching_seeds():
    rows = [{"benchmark": "", "variant": "A", "seed": s, "m": v} for s, v in [(0, 0.70), (1, 0.74), (2, 0.69)]]
    rows += [{"benchmark": "", "variant": "B", "seed": s, "m": v} for s, v in [(0, 0.65), (2, 0.66), (5, 0.9)]]
    groups = summarize(rows, ["m"])
    assert [(g["variant"], g["n_runs"]) for g in groups] == [("A", 3), ("B", 3)]
    assert groups[0]["stats"]["m"]["mean"] == pytest.approx((0.70 + 0.74 + 0.69) / 3)
    (p,) = paired_differences(rows, "A", "B", ["m"])
    assert sorted(p["seeds"]) == [0, 2]             # seed 1 (A only) and 5 (B only) unpaired
    d = np.array([0.70 - 0.65, 0.69 - 0.66])
    st = p["stats"]["m"]
    assert st["mean"] == pytest.approx(d.mean())
    assert st["half_width"] == pytest.approx(12.706204736174704 * d.std(ddof=1) / math.sqrt(2))  # t_{.975,1}


def test_paired_values_pair_by_seed_and_leave_out_missing_values_as_scipy_ttest_rel_would():
    """The one pairing rule of every paired difference (the study summaries, CLAIMS.md,
    protocol v2's claims): rows read from a CSV (string seeds, "" for a diverged run's test
    value), a NaN and a None each leave their seed out; the interval on the differences is
    scipy's paired t interval on the seeds both have."""
    from scipy import stats

    a = {"0": "0.70", "1": "0.74", "2": "0.69", "3": "", "4": 0.80, "5": float("nan")}
    b = {"0": "0.65", "1": "0.73", "2": "0.66", "3": "0.60", "4": None, "5": 0.5, "6": 0.9}
    rows = [{"loss": "A", "seed": s, "m": v} for s, v in a.items()] + \
           [{"loss": "B", "seed": s, "m": v} for s, v in b.items()]
    seeds, diffs = paired_values(rows, "A", "B", "m", key="loss")
    assert seeds == [0, 1, 2]
    assert diffs == pytest.approx([0.05, 0.01, 0.03])
    res = stats.ttest_rel([0.70, 0.74, 0.69], [0.65, 0.73, 0.66])
    lo, hi = res.confidence_interval(0.95)
    st = mean_ci(diffs)
    assert (st["ci_low"], st["ci_high"]) == (pytest.approx(lo), pytest.approx(hi))
    assert paired_values(rows, "A", "C", "m", key="loss") == ([], [])
    assert paired_values(rows, "A", "B", "m") == ([], [])  # no row has a 'variant'


# --------------------------------------------------------------------------- the study file
def test_load_study_builds_validated_runs_in_order(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(BASE))
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "base": "base.yaml",  # relative to the study file
        "overrides": ["train.epochs=3"],
        "benchmarks": {"small": None, "big": {"base": "base.yaml", "overrides": ["data.options.per_class=20"]}},
        "variants": {"sm": [], "trip": [{"loss": [{"name": "triplet", "options": {"mining": "semihard"}}]}]},
        "seeds": [3, 4], "out_dir": str(tmp_path / "o")}, sort_keys=False))
    study = load_study(path)
    assert [r.key for r in study.runs] == [f"{b}/{v}/seed{s}" for b in ("small", "big") for v in ("sm", "trip")
                                           for s in (3, 4)]
    run = study.runs[-1]
    assert run.raw["train"]["seed"] == 4 and run.raw["train"]["epochs"] == 3
    assert run.raw["train"]["out_dir"] == str(tmp_path / "o" / "big" / "trip" / "seed4")
    assert run.raw["loss"] == [{"name": "triplet", "options": {"mining": "semihard"}}]
    assert run.raw["data"]["options"]["per_class"] == 20 and study.runs[0].raw["data"]["options"]["per_class"] == 16

    bad = dict(yaml.safe_load(path.read_text()), variants={"x": ["optim.lrr=1"]})
    with pytest.raises(ConfigError, match=r"run small/x/seed3: .*optim.lrr.*did you mean 'optim.lr'"):
        load_study(path, raw=bad)
    with pytest.raises(ConfigError, match="unknown study key.*'variant'.*did you mean 'variants'"):
        load_study(raw={"base": BASE, "variant": {}})
    with pytest.raises(ConfigError, match=r"compare.0: unknown variant 'C'"):
        load_study(raw={"base": BASE, "variants": {"A": []}, "compare": [["A", "C"]]})
    # a name is a folder of the study's runs: '..' put a run outside OUT (where another run's
    # files were resumed or counted); so would '.', a hidden name or a Windows separator
    for name in ("..", ".", ".hidden", "a/b", "a\\b", ""):
        with pytest.raises(ConfigError, match=rf"variant name {re.escape(repr(name))}: expected a non-empty name"):
            load_study(raw={"base": BASE, "variants": {name: []}, "out_dir": str(tmp_path / "o")})
        with pytest.raises(ConfigError, match=rf"benchmark name {re.escape(repr(name))}: expected"):
            load_study(raw={"benchmarks": {name: BASE}, "variants": {"A": []}, "out_dir": str(tmp_path / "o")})
    assert [r.key for r in load_study(raw={"base": BASE, "variants": {"a..b": []}}).runs] == ["a..b/seed0"]


# --------------------------------------------------------------------------- reading metrics.json
def _fake_run(tmp_path, summary, log_ips=None, record=None):
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.json").write_text(json.dumps(summary))
    if log_ips is not None:
        (d / "log.jsonl").write_text("".join(json.dumps({"type": "step", "step": i + 1, "images_per_s": v}) + "\n"
                                             for i, v in enumerate(log_ips)) + '{"type": "eval", "epoch": 1}\n')
    if record is not None:
        (d / "attempts.json").write_text(json.dumps(record))
    return StudyRun("v/seed0", None, "v", 0, d, {"train": {"batch_size": 8}})


def test_run_row_reads_the_new_metrics_layout(tmp_path):
    run = _fake_run(tmp_path, {
        "metrics": {"recall@1": 0.5}, "final": {"test": {"recall@1": 0.5, "nmi": 0.4}, "val": {"recall@1": 0.9}},
        "selected": {"epoch": 3, "metric": "recall@1", "value": 0.95, "test": {"recall@1": 0.55, "nmi": 0.45}},
        "wall_time_s": 12.5, "train_images_per_s": 321.0, "epochs": 4, "steps": 40})
    row = run_row(run)
    assert row == {"benchmark": "", "variant": "v", "seed": 0, "final/recall@1": 0.5, "final/nmi": 0.4,
                   "selected/epoch": 3.0, "selected/recall@1": 0.55, "selected/nmi": 0.45,
                   "wall_time_s": 12.5, "images_per_s": 321.0, "epochs": 4, "steps": 40}


def test_run_row_reads_the_old_layout_with_runner_timing_and_log_throughput(tmp_path):
    run = _fake_run(tmp_path, {"metrics": {"recall@1": 0.25}, "best": {"metric": "recall@1", "value": 0.3,
                                                                       "epoch": 1}, "epochs": 2, "steps": 10},
                    log_ips=[100.0, 400.0, 200.0, 300.0], record={"wall_time_s": 7.0})
    row = run_row(run)
    assert row["final/recall@1"] == 0.25 and not any(k.startswith("selected/") for k in row)  # test-set "best" ignored
    assert row["wall_time_s"] == 7.0 and row["images_per_s"] == 250.0    # median of the step records
    (run.out_dir / "log.jsonl").unlink()
    assert run_row(run)["images_per_s"] == pytest.approx(10 * 8 / 7.0)  # steps x batch / wall time


# --------------------------------------------------------------------------- running
def _env():
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.mark.slow
def test_study_runs_writes_results_and_resumes_after_kill(tmp_path):
    path = _study(tmp_path)
    study = load_study(path)
    first = study.runs[0]
    proc = subprocess.Popen([sys.executable, "-m", "deepmetric.cli", "study", str(path)], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300  # generous: a loaded CI machine
        record = first.record_dir / "attempts.json"  # written just after metrics.json
        while not record.is_file() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert first.finished and record.is_file()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    mtime = (first.out_dir / "metrics.json").stat().st_mtime_ns
    done_before = [r.key for r in study.runs if r.finished]
    assert 1 <= len(done_before) < len(study.runs)

    messages = []
    result = run_study(load_study(path), log=messages.append)
    assert result["skipped"] == done_before and not result["failed"]
    assert sorted(result["finished"] + done_before) == sorted(r.key for r in study.runs)
    assert (first.out_dir / "metrics.json").stat().st_mtime_ns == mtime            # not recomputed
    assert len(json.loads((first.record_dir / "attempts.json").read_text())["attempts"]) == 1

    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    assert [(r["variant"], r["seed"]) for r in rows] == [("a16", "0"), ("a16", "1"), ("a4", "0"), ("a4", "1")]
    for r, run in zip(rows, study.runs):
        m = json.loads((run.out_dir / "metrics.json").read_text())["metrics"]
        assert float(r["final/recall@1"]) == pytest.approx(m["recall@1"]) and float(r["wall_time_s"]) > 0
        assert float(r["final/recall@2"]) == pytest.approx(m["recall@2"])  # every metric in the CSV
        assert float(r["images_per_s"]) > 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    a16 = [float(r["final/nmi"]) for r in rows if r["variant"] == "a16"]
    assert res["summary"][0]["stats"]["final/nmi"]["mean"] == pytest.approx(np.mean(a16))
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "4 of 4 runs finished" in md and "| a16 − a4 | 2 |" in md
    assert (tmp_path / "out" / "summary.png").stat().st_size > 1000


def test_killed_run_resumes_from_last_checkpoint(tmp_path):
    path = _study(tmp_path, seeds=[0], variants={"a16": []}, compare=[])
    reference = run_study(load_study(path, out_dir=tmp_path / "ref"), log=lambda m: None)
    assert reference["finished"] == ["a16/seed0"]
    # A "killed" run: one epoch of the two trained, last.pt written, no metrics.json.
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.train.loop import train

    study = load_study(path)
    raw = json.loads(json.dumps(study.runs[0].raw))
    raw["train"]["epochs"] = 1
    train(config_from_dict(raw))
    (study.runs[0].out_dir / "metrics.json").unlink()
    run_study(study, log=lambda m: None)
    log = read_log(study.runs[0].out_dir)
    assert [r["step"] for r in log if r["type"] == "step"] == list(range(1, 13))  # epoch 1 not redone
    attempts = json.loads((study.runs[0].record_dir / "attempts.json").read_text())["attempts"]
    assert [a["resumed"] for a in attempts] == [True]
    got = json.loads((study.runs[0].out_dir / "metrics.json").read_text())["metrics"]
    want = json.loads((tmp_path / "ref" / "a16" / "seed0" / "metrics.json").read_text())["metrics"]
    assert got == pytest.approx(want)


def test_a_run_claimed_by_a_worker_killed_before_its_heartbeat_is_taken_up(tmp_path):
    # a worker killed between claiming a run (ask) and its heartbeat's first beat left the run
    # "running" for ever: every later worker waited on it (the tune's kill -9 test hung so in CI)
    from deepmetric.workflows.study import _claim, open_trials

    path = _study(tmp_path, seeds=[0], variants={"a16": []}, compare=[])
    study = load_study(path)
    assert _claim(open_trials(study), "a16/seed0") is not None  # RUNNING, no heartbeat, no process
    env = dict(_env(), DEEPMETRIC_TUNE_HEARTBEAT="1")  # grace 4 s
    r = subprocess.run([sys.executable, "-m", "deepmetric.cli", "study", str(path)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert study.runs[0].finished and "a16/seed0: training" in r.stdout


@pytest.mark.slow
def test_parallel_workers_give_the_same_rows(tmp_path):
    path = _study(tmp_path, variants={"a4": ["loss.0.options.alpha=4"]}, compare=[])
    serial = run_study(load_study(path, out_dir=tmp_path / "serial"), log=lambda m: None)
    assert len(serial["finished"]) == 2
    stale = tmp_path / "par" / "a4" / "seed1"  # a killed run's leftovers, no last.pt: starts again
    stale.mkdir(parents=True)
    (stale / "log.jsonl").write_text('{"type": "step", "step": 1, "loss": 9.0}\n')
    rc = cli.main(["study", str(path), "--out", str(tmp_path / "par"), "--workers", "2"])
    assert rc == 0
    steps = read_log(stale)
    assert [r["step"] for r in steps if r["type"] == "step"] == list(range(1, 13))
    a = collect_rows(load_study(path, out_dir=tmp_path / "serial"))
    b = collect_rows(load_study(path, out_dir=tmp_path / "par"))
    strip = lambda r: {k: v for k, v in r.items() if k not in ("wall_time_s", "images_per_s")}  # noqa: E731
    assert [strip(r) for r in a] == [pytest.approx(strip(r)) for r in b]
    logs = "".join(p.read_text() for p in (tmp_path / "par" / ".study" / "workers").glob("worker_*.log"))
    assert "a4/seed0: training" in logs and "a4/seed1: training" in logs  # two worker processes shared the runs


def test_cli_list_and_summary(tmp_path, capsys):
    path = _study(tmp_path)
    assert cli.main(["study", str(path), "--list"]) == 0
    out = capsys.readouterr().out
    assert "a16/seed0" in out and "a4/seed1" in out
    assert cli.main(["study", str(path), "--summary"]) == 0
    assert "0 of 4 runs finished" in (tmp_path / "out" / "summary.md").read_text()
    assert cli.main(["study", str(tmp_path / "missing.yaml")]) == 2


def test_only_matches_whole_key_parts_and_rejects_a_key_that_matches_nothing(tmp_path, capsys):
    """`--only a` must not select a16 / a4 (path parts, not string prefixes), and a typo among
    good keys is an error, not a silently smaller study (seen on a GPU run: `--only triplet`
    next to exact names trained nothing of triplet_semihard / triplet_hard)."""
    study = load_study(_study(tmp_path))
    with pytest.raises(ValueError, match=r"\['a'\] matches no run"):
        run_study(study, only=["a16/seed0", "a"], log=lambda m: None)
    assert not (tmp_path / "out" / "a16" / "seed0" / "metrics.json").exists()  # nothing trained
    # a trailing slash (a shell's completion) selects the same runs; --list takes --only and
    # refuses a key that matches nothing; --summary refuses it (its tables cover every run)
    from deepmetric.workflows.study import select_runs

    assert [r.key for r in select_runs(study, ["a16/"])] == [r.key for r in select_runs(study, ["a16"])] == \
        ["a16/seed0", "a16/seed1"]
    path = _study(tmp_path)
    assert cli.main(["study", str(path), "--list", "--only", "a4/seed1/"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["a4/seed1"]
    assert cli.main(["study", str(path), "--list", "--only", "zzz"]) == 2
    assert "['zzz'] matches no run" in capsys.readouterr().err
    assert cli.main(["study", str(path), "--summary", "--only", "a4"]) == 2
    assert "--only does not apply to --summary" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["emoji", "glyphs_cross_family", "fashion_mnist_two_head", "emoji_almn_margin",
                                  "emoji_proxy_lr", "emoji_proxy_anchor_adamw"])
def test_repository_study_files_are_valid(name):
    """Every run of the studies/ files validates, and names a dataset, transform, model and
    losses that exist (PML class names included)."""
    from deepmetric.data import list_datasets
    from deepmetric.data.transforms import list_transforms
    from deepmetric.losses import list_losses
    from deepmetric.models import list_models
    from deepmetric.run.config import DataConfig

    if "val_classes" not in DataConfig.__dataclass_fields__:
        pytest.skip("needs the validation split (data.val_classes) of the training package")
    study = load_study(Path(__file__).resolve().parents[2] / "studies" / f"{name}.yaml")
    assert len(study.runs) == len(study.variants) * len(study.seeds)
    for run in study.runs:
        raw = run.raw
        assert raw["data"]["name"] in list_datasets() and raw["data"]["transform"] in list_transforms()
        assert raw["model"]["name"] in list_models()
        for term in raw["loss"]:
            assert term["name"] in list_losses()
            if term["name"] == "pml":
                pml = pytest.importorskip("pytorch_metric_learning.losses")
                assert hasattr(pml, term["options"]["loss"])


def test_git_commit_of_results_commits_only_those_files(tmp_path):
    from deepmetric.workflows.study import _git_commit

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "other.txt").write_text("staged, not ours\n")
    git("add", "other.txt")
    out = tmp_path / "runs" / "s"
    out.mkdir(parents=True)
    (out / "summary.md").write_text("# s\n")
    (out / "results.csv").write_text("a\n")
    messages = []
    _git_commit([out / "summary.md", out / "results.csv", out / "missing.png"], "study s: 1/2", messages.append)
    assert not messages
    assert sorted(git("show", "--name-only", "--format=", "HEAD").split()) == ["runs/s/results.csv", "runs/s/summary.md"]
    assert "other.txt" in git("diff", "--cached", "--name-only")  # still staged, not committed


def test_summary_cell_over_fewer_runs_than_its_row_says_how_many():
    """A ``selected/`` test metric measured in 1 of 3 runs (``eval.test_every: 0``, best epoch not
    the last in two) must not read as the variant's mean over seeds."""
    from types import SimpleNamespace

    from deepmetric.report.study_tables import summarize, summary_markdown

    rows = [{"benchmark": "", "variant": "v", "seed": s, "final/recall@1": f} for s, f in enumerate((0.5, 0.6, 0.7))]
    rows[1]["selected/recall@1"] = 0.65
    groups = summarize(rows, ["final/recall@1", "selected/recall@1"])
    study = SimpleNamespace(name="s", description="", confidence=0.95, variants={"v": []}, seeds=[0, 1, 2],
                            benchmarks=[None], runs=[SimpleNamespace(finished=True)] * 3)
    md = summary_markdown(study, rows, ["final/recall@1", "selected/recall@1"], groups, [], None)
    line = next(ln for ln in md.splitlines() if ln.startswith("| v |"))
    final, selected = [c.strip() for c in line.split("|")[3:5]]
    # the complete column: mean 0.6, sample sd 0.1, t(0.975, 2) = 4.303 -> half-width 0.2484
    assert final == "0.6000 ± 0.1000 [0.3516, 0.8484]"
    assert selected == "0.6500 (1 of 3 runs)"
    assert "No finished run evaluated the test split" not in md
    # runs with eval.test: false have no test metric: the summary says so instead of empty columns alone
    untested = [{"benchmark": "", "variant": "v", "seed": s, "selected/epoch": 4.0, "wall_time_s": 9.0} for s in range(3)]
    md = summary_markdown(study, untested, ["final/recall@1"], summarize(untested, ["final/recall@1"]), [], None)
    assert "No finished run evaluated the test split (as with `eval.test: false`): the tables hold no test metric" in md


def test_from_tune_values_survive_the_variants_own_overrides(tmp_path):
    """A variant's ``from_tune`` gives the tune's best values; a later ``loss=[...]`` (a whole
    list) would silently drop the tuned ``loss.0.options.alpha`` (the defect of the fair emoji
    comparison's first seeded runs), so it is refused with the keys named; ``from_tune`` after
    it keeps them; a later override of the tuned key itself wins."""
    tune = tmp_path / "tune"
    tune.mkdir()
    (tune / "best_overrides.json").write_text(json.dumps(
        {"trial": 3, "value": 0.5, "metric": "recall@1",
         "overrides": ["optim.lr=0.0123", "loss.0.options.alpha=8.0"]}))
    whole = 'loss=[{"name": "heated_softmax", "options": {"alpha": 16.0}}]'
    path = _study(tmp_path, variants={"a": [{"from_tune": str(tune)}, whole]}, compare=[])
    with pytest.raises(ConfigError, match=r"variants\.a\.1: 'loss=\.\.\.' replaces loss\.0\.options\.alpha, "
                                          r"which the from_tune of item 0 set.*Put from_tune after"):
        load_study(path)
    path = _study(tmp_path, variants={"a": [whole, {"from_tune": str(tune)}],
                                      "b": [{"from_tune": str(tune)}, "optim.lr=0.5"]}, compare=[])
    runs = {r.key: r.raw for r in load_study(path).runs}
    assert runs["a/seed0"]["loss"][0]["options"]["alpha"] == 8.0 and runs["a/seed0"]["optim"]["lr"] == 0.0123
    assert runs["b/seed0"]["optim"]["lr"] == 0.5 and runs["b/seed0"]["loss"][0]["options"]["alpha"] == 8.0
    # a damaged best_overrides.json is named ('overrides' / 'Expecting value' before)
    for text, said in (('{"trial": 3}', "has no list 'overrides'"), ("not json", "is not JSON")):
        (tune / "best_overrides.json").write_text(text)
        with pytest.raises(ConfigError, match=rf"from_tune: .*best_overrides.json {said}.*--report-only"):
            load_study(path)


def test_a_drain_finishes_the_running_run_and_the_next_command_continues(tmp_path):
    """``touch OUT/DRAIN`` while a run trains: it finishes, no other starts; the next command
    removes the file and trains the rest."""
    from deepmetric.workflows.study import DRAIN

    path = _study(tmp_path, seeds=[0, 1], variants={"a16": []}, compare=[])
    study = load_study(path)
    said = []

    def log(msg):
        said.append(msg)
        if msg.startswith("a16/seed0: training"):
            (study.out_dir / DRAIN).touch()

    result = run_study(study, log=log)
    assert result["finished"] == ["a16/seed0"] and not result["failed"] and not result["interrupted"]
    assert not study.runs[1].finished and any(m.startswith("drained") for m in said)
    result = run_study(load_study(path), log=said.append)
    assert result["finished"] == ["a16/seed1"] and not (study.out_dir / DRAIN).exists()


def test_progress_counts_the_runs_asked_for_not_the_whole_grid(tmp_path):
    """With ``only``, "[k/N finished]" counts the selected runs (protocol v2's seeds phase trains 59
    of a 75-run grid and said "[59/75 finished]" at its end); a run finished outside the selection
    does not count."""
    path = _study(tmp_path)
    said = []
    run_study(load_study(path), only=["a4/seed1"], log=said.append)
    assert [m for m in said if "finished]" in m] == ["a4/seed1: finished  [1/1 finished]"]
    said.clear()
    result = run_study(load_study(path), only=["a16"], log=said.append)
    assert result["finished"] == ["a16/seed0", "a16/seed1"]
    assert [m for m in said if "finished]" in m] == ["a16/seed0: finished  [1/2 finished]",
                                                    "a16/seed1: finished  [2/2 finished]"]
    said.clear()  # worker processes: the parent's poll counts the same way
    run_study(load_study(path), only=["a4"], workers=2, log=said.append)
    assert [m for m in said if "finished]" in m] == ["a4/seed0: finished  [2/2 finished]"]


def test_a_storage_that_does_not_open_keeps_the_drain_mark(tmp_path):
    """The drain mark was removed before the storage opened: a --storage that does not open
    lost it (and the next good command would not know it had been drained)."""
    from deepmetric.workflows.study import DRAIN

    study = load_study(_study(tmp_path, seeds=[0], variants={"a16": []}, compare=[]))
    study.out_dir.mkdir(parents=True, exist_ok=True)
    (study.out_dir / DRAIN).touch()
    with pytest.raises(ValueError, match=r"--storage sqlite:///.* cannot be opened"):
        run_study(study, storage=f"sqlite:///{tmp_path}", log=lambda msg: None)  # a folder, not a database
    assert (study.out_dir / DRAIN).exists() and not study.runs[0].finished


# --------------------------------------------------------------------------- the metrics columns
def test_a_misspelt_metrics_column_is_refused_when_the_study_loads(tmp_path, capsys):
    """A typo in ``metrics`` ran the whole study, showed an empty '-' column and exited 0; now
    the file is refused before any run, in one line naming the file, the key, the bad value
    (with the closest column) and the columns its runs give."""
    path = _study(tmp_path, metrics=["final/recall@1", "final/recal@2", "wall_time_s"])
    assert cli.main(["study", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"deepmetric study: error: {path}: metrics: unknown column(s) 'final/recal@2' "
                          "(did you mean 'final/recall@2'?); the runs of this study give: "), err
    # BASE evaluates recall (ks 1, 2) and nmi, without validation classes: no selected/ column
    assert err.endswith("final/recall@1, final/recall@2, final/nmi, wall_time_s, images_per_s, epochs, steps"), err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written
    # a column only a validation split gives is refused without one, and accepted with one
    with pytest.raises(ConfigError, match=r"metrics: unknown column\(s\) 'selected/recall@1'"):
        load_study(_study(tmp_path, metrics=["selected/recall@1"]))
    study = load_study(_study(tmp_path, metrics=["selected/recall@1", "selected/epoch"],
                              overrides=["data.val_classes=2"]))
    assert study.metrics == ["selected/recall@1", "selected/epoch"]


@pytest.mark.parametrize("name", ["emoji_almn_margin", "fashion_mnist_two_head", "glyphs_cross_family"])
def test_the_known_columns_are_those_of_the_committed_results(name):
    """The columns a study's ``metrics`` is checked against are exactly the columns its real,
    finished runs wrote (bench/studies/NAME/results.csv: selected/ from validation classes,
    wise/ from WiSE-FT, cross-domain and the two-head classification with training
    neighbours)."""
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.workflows.study_file import result_columns

    root = Path(__file__).resolve().parents[2]
    study = load_study(root / "studies" / f"{name}.yaml")
    known = {c for run in study.runs for c in result_columns(config_from_dict(run.raw))}
    with open(root / "bench" / "studies" / name / "results.csv", newline="", encoding="utf-8") as f:
        written = set(next(csv.reader(f))) - {"benchmark", "variant", "seed"}
    assert known == written


def test_the_training_neighbour_keys_are_those_the_evaluation_returns():
    from deepmetric.evaluate import TRAIN_NEIGHBOUR_KEYS, misclassified_neighbour_agreement

    rng = np.random.default_rng(0)
    got = misclassified_neighbour_agreement(np.array([0, 1, 1]), np.array([0, 1, 0]), rng.normal(size=(3, 4)),
                                            rng.normal(size=(5, 4)), np.array([0, 1, 0, 1, 0]))
    assert set(got) == set(TRAIN_NEIGHBOUR_KEYS)


def test_failed_since_reads_the_attempts_of_this_command_only(tmp_path):
    """The runs whose attempts made after the count taken at the start ended in a failure, and
    that have not finished: an older failure, later resumed, is not this command's."""
    from deepmetric.workflows.study import RUN_RECORD, failed_since

    study = load_study(_study(tmp_path))
    a16_0, a16_1, a4_0, a4_1 = study.runs
    attempts = [(a16_0, ["failed (ValueError: x)"]),  # failed before this command: not counted
                (a16_1, ["failed (NonFiniteLossError: loss nan)"]),  # this command's failure
                (a4_0, ["interrupted", "failed (RuntimeError: y)"]),  # interrupted earlier, failed now
                (a4_1, ["finished"])]
    before = {a16_0.key: 1, a16_1.key: 0, a4_0.key: 1, a4_1.key: 0}
    for run, states in attempts:
        run.record_dir.mkdir(parents=True)
        (run.record_dir / RUN_RECORD).write_text(json.dumps({"attempts": [{"status": s} for s in states]}))
    assert failed_since(study.runs, before) == [a16_1.key, a4_0.key]
    assert failed_since(study.runs, {r.key: 5 for r in study.runs}) == []  # nothing new: nothing failed


@pytest.mark.slow
def test_a_failed_run_gives_exit_1_with_several_workers(tmp_path):
    """docs/study.md: the exit code is 1 when a run failed. A worker process records the failure
    and goes on (exit 0), so the parent reads the runs' attempts back."""
    path = _study(tmp_path, seeds=[0], variants={"ok": [], "bad": ["optim.lr=1e30"]}, compare=[])
    assert cli.main(["study", str(path), "--workers", "2"]) == 1
    study = load_study(path)
    ok, bad = study.runs
    assert ok.finished and not bad.finished
    assert (bad.record_dir / "error.txt").read_text().startswith("NonFiniteLossError")

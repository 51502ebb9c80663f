"""Protocol v2 (issue 30; studies/protocol_v2.py, bench/protocol_v2.py): every loss searches the
same space shape, every space is valid on the protocol's recipe, and the whole pipeline (tune,
seeds, control, final) runs in miniature on the CPU with two worker processes: the same number of
completed trials per loss, seeds no tune used, no test metric in any tune output or storage,
no absolute path in the committed copy, and results.csv with the protocol's columns."""
import csv
import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from test_data_emoji import make_tree

pytest.importorskip("optuna")
ROOT = Path(__file__).resolve().parents[2]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


v2 = _load("protocol_v2_spec", ROOT / "studies" / "protocol_v2.py")
bench = _load("protocol_v2_bench", ROOT / "bench" / "protocol_v2.py")


def test_every_loss_searches_the_same_space_shape_in_the_issues_order(tmp_path):
    from deepmetric.workflows.tune import prepare_tune

    assert list(v2.LOSSES) == ["HBN", "BN", "SM", "LN", "HLN", "almn_beta3", "almn_beta0", "npair",
                               "triplet_semihard", "pml_proxy_anchor", "pml_multi_similarity", "pml_arcface",
                               "pml_normalized_softmax", "proxy_nca", "contrastive"]
    spaces = v2.write_spaces(tmp_path / "spaces", epochs=10)
    first = v2.space("HBN", 10)
    for name in v2.LOSSES:
        s = v2.space(name, 10)
        assert {k: s["params"][k] for k in v2.SHARED} == v2.SHARED, name
        assert s["params"]["optim.name"]["choices"] == ["sgd", "adamw"]
        assert s["params"]["optim.new_layer_lr_mult"]["choices"] == [1.0, 10.0, 100.0]
        assert s["params"]["eval.embedding"]["choices"] == ["embedding", "projection"]
        assert s["sampler"] == first["sampler"] and s["pruner"] == first["pruner"] and s["objective"] == first["objective"]
        # the pruner acts only from the second half, never before epoch 2
        assert s["pruner"] == {"name": "median", "n_startup_trials": v2.PRUNER_STARTUP, "n_warmup_steps": 5}
        # every space is valid on the protocol's recipe (both ends of every range, every choice)
        setup = prepare_tune(ROOT / "recipes" / "protocol_v2.yaml", spaces[name], trials=2, out=tmp_path / name,
                             overrides=["model.options.pretrained=null"], count="completed")
        cfg = setup.trial_config({p.name: p.examples()[-1] for p in setup.space.params}, tmp_path / "r")
        assert not cfg.eval.test and cfg.optim.decay_exclude == ["bias", "norm", "loss"], name
    assert v2.space("SM", 3)["pruner"]["n_warmup_steps"] == 2  # never before epoch 2
    assert "at: 8" in " ".join(v2.overrides("HBN", 10)) and "at: 16" in " ".join(v2.overrides("HLN", 20))
    assert not set(v2.SEEDS + v2.CLAIM_SEEDS + v2.BETA_SEEDS) & {v2.TUNE_SEED}
    assert yaml.safe_load((ROOT / "recipes" / "protocol_v2.yaml").read_text())["train"]["epochs"] == v2.EPOCHS


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_ctrl_c_with_lanes_reaches_the_child_processes():
    """With --lanes the tunes run in threads, which never see Ctrl-C: the main thread passes it on
    to the child processes (the tune workers), which stop."""
    import subprocess
    import sys

    # like a tune worker, the child installs its own SIGINT handler (a process started from a
    # pytest-xdist worker may inherit SIGINT ignored) and says when it has; under load its start
    # can take seconds, and a signal before that would test nothing
    code = ("import signal, sys, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "print('ready', flush=True); time.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in bench.interrupt_children()
        assert child.wait(timeout=60) != 0  # ended by the SIGINT (KeyboardInterrupt), long before its 120 s
    finally:
        child.kill()
        child.wait()


def test_holm_and_the_flattening_rule():
    assert bench.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert bench.holm([0.5]) == [0.5]
    assert bench.flattened([0.30, 0.40, 0.402, 0.404]) and not bench.flattened([0.30, 0.40, 0.41, 0.40])
    assert not bench.flattened([0.3, 0.3])  # too few evaluations to say


def test_final_refuses_without_a_preregistration(tmp_path):
    args = bench.parse_args(["--runs", str(tmp_path / "runs"), "--copy-to", str(tmp_path / "copy")])
    with pytest.raises(bench.ProtocolError, match="PREREGISTRATION.md does not exist"):
        bench.check_preregistration(bench.Protocol(args))


def test_final_waits_for_the_two_head_results(tmp_path):
    """H5a / H5b are in the Holm family: the final step reads nothing before the two-head study's
    final step has copied its summary (verdicts printed without them would change later)."""
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "PREREGISTRATION.md").write_text("# the hypotheses\n")
    proto = bench.Protocol(bench.parse_args(["--runs", str(tmp_path / "runs"), "--copy-to", str(copy)]))
    with pytest.raises(bench.ProtocolError, match="two_head_accuracy.json does not exist"):
        bench.run_final_phase(proto)
    assert not (tmp_path / "runs" / "final.json").exists()


MINI_RECIPE = """
data:
  name: emoji
  root: {root}
  options: {{size: 32}}
  transform: emoji
  transform_options: {{normalize: minus_one_one}}
  val_classes: 3
  val_pick: last
model:
  name: glyph_resnet
  options: {{in_chans: 3, embedding_dim: 8, norm: bn, widths: [8], depths: [1], projection: {{dim: 4, norm: bn}}}}
loss:
  - {{name: heated_softmax, input: projection, options: {{alpha: 16.0}}}}
optim: {{name: sgd, lr: 0.01, momentum: 0.9, weight_decay: 0.0001, new_layer_lr_mult: 10.0,
        decay_exclude: [bias, norm, loss]}}
train: {{epochs: 1, batch_size: 4, seed: 0, num_threads: 1, progress: false}}
eval: {{every: 1, test: false, ks: [1, 2], metrics: [recall, map@r], cross_domain: true,
       best_metric: cross_domain_recall@1, baselines: false}}
"""


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*no same-label reference")
def test_the_whole_protocol_in_miniature_with_two_workers(tmp_path, monkeypatch):
    make_tree(tmp_path / "tree")
    (tmp_path / "recipe.yaml").write_text(MINI_RECIPE.format(root=tmp_path / "tree"))
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "PREREGISTRATION.md").write_text("# the hypotheses, before any result\n")
    (copy / "two_head_accuracy.json").write_text("{}")  # the two-head study's final step ran (no runs here)
    monkeypatch.setenv("DEEPMETRIC_TUNE_HEARTBEAT", "1")
    losses = ["BN", "pml_normalized_softmax"]  # a claim loss (5 seeds) and a user's pick (3)
    argv = ["--recipe", str(tmp_path / "recipe.yaml"), "--runs", str(tmp_path / "runs"), "--copy-to", str(copy),
            "--only", *losses, "--trials", "2", "--epochs", "1", "--parallel", "2", "--tune-parallel", "2", "--phase"]
    # the table in miniature: our two losses and one more at its end, never run (cut for compute)
    monkeypatch.setattr(bench.spec, "LOSSES", {n: bench.spec.LOSSES[n] for n in [*losses, "contrastive"]})
    assert bench.main(argv + ["tune", "--lanes", "2"]) == 0  # both tunes at once, then (another command) the rest
    # the test split is read once, at the end: not while a loss of the table is unfinished, and
    # only losses from the end of the table may be cut
    assert bench.main(argv + ["seeds", "control", "final"]) == 2
    assert bench.main(argv + ["final", "--cut", losses[1]]) == 2
    assert not list((tmp_path / "runs" / "seeds").glob("*/seed*.final.json"))
    # the control's winner is the best of all tunes: not before every loss (but those cut) has one
    assert bench.main(argv + ["control"]) == 2 and not (tmp_path / "runs" / "control" / "winner.json").exists()
    assert bench.main(argv + ["control", "final", "--cut", "contrastive"]) == 0
    # test numbers exist now: the cut stays as it was (another one could change H6's pick)
    assert bench.main(argv + ["final", "--cut", losses[1], "contrastive"]) == 2
    assert "cut for lack of compute (the last ones of the table, as pre-registered): contrastive." in \
        (copy / "summary.md").read_text()
    assert "Not tested yet: 0 of 25 glyph runs have finished." in (copy / "summary.md").read_text()
    runs = tmp_path / "runs"
    # --lanes 2: the second loss's tune started before the first's ended (its trials.md is written last)
    assert ((runs / "tune" / losses[1] / "tune.json").stat().st_mtime
            < (runs / "tune" / losses[0] / "trials.md").stat().st_mtime)

    # the same number of completed trials per loss; the tunes' trials trained with seed 0 only
    tune_seeds = set()
    for loss in losses:
        with open(runs / "tune" / loss / "trials.csv", newline="") as f:
            states = [r["state"] for r in csv.DictReader(f)]
        assert states.count("complete") == 2, (loss, states)
        for cfg in (runs / "tune" / loss / "trials").glob("*/config.yaml"):
            tune_seeds.add(yaml.safe_load(cfg.read_text())["train"]["seed"])
        # no test metric in any tune output, nor in the storage
        assert bench.test_metric_leaks(runs / "tune" / loss) == []
        assert bench.test_metric_leaks(copy / "tunes" / loss) == []
        import optuna

        study = optuna.load_study(study_name=f"protocol_v2__{loss}",
                                  storage=f"sqlite:///{runs / 'tune' / loss / 'tune.db'}")
        for t in study.get_trials():
            assert not [k for k in {**t.user_attrs, **t.system_attrs} if str(k).lower().startswith("test")]
        with open(copy / "tunes" / loss / "trials.csv", newline="") as f:
            assert not [c for c in next(csv.reader(f)) if "test" in c.lower()]
    assert tune_seeds == {0}

    # results.csv: the protocol's columns, seeds no tune used, every loss the same budget
    with open(copy / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames[:8] == ["loss", "seed", "completed_trials", "optimizer", "embedding", "epochs",
                                         "cross_domain_recall@1", "cross_domain_map@r"]
        rows = list(reader)
    seeds = {loss: sorted(int(r["seed"]) for r in rows if r["loss"] == loss) for loss in losses}
    assert seeds == {"BN": [100, 101, 102, 103, 104], "pml_normalized_softmax": [100, 101, 102]}
    assert not set(s for v in seeds.values() for s in v) & tune_seeds
    assert {r["completed_trials"] for r in rows} == {"2"} and {r["epochs"] for r in rows} == {"1"}
    assert all(0.0 <= float(r["cross_domain_recall@1"]) <= 1.0 for r in rows)
    assert {r["embedding"] for r in rows} <= {"pooled", "own"}
    # the reference rows on the same test emoji: raw pixels as `deepmetric emoji pixels` computes
    # them, and the untouched network; both in the summary's table
    with open(copy / "baselines.csv", newline="") as f:
        base = {r["baseline"]: r for r in csv.DictReader(f)}
    assert sorted(base) == ["raw pixels", "untouched network"]
    from deepmetric.run.baselines import emoji_pixel_baseline

    pixels = emoji_pixel_baseline("test", root=tmp_path / "tree", size=32)["cross_vendor"]["mean"]
    for metric in ("recall@1", "map@r"):
        assert float(base["raw pixels"][f"cross_domain_{metric}"]) == pytest.approx(pixels[metric], abs=1e-6)
    assert 0.0 <= float(base["untouched network"]["cross_domain_recall@1"]) <= 1.0
    summary = (copy / "summary.md").read_text()
    assert "| - | raw pixels (flattened" in summary and "| - | untouched network (" in summary
    # the seeded runs never saw the test split; the final step evaluated each best.pt once
    for run_dir in (runs / "seeds").glob("*/seed*"):
        if run_dir.is_dir():
            assert bench.test_metric_leaks(run_dir) == [], run_dir
            assert (run_dir.parent / f"{run_dir.name}.final.json").is_file()
    # without the cross-vendor search (the glyph analysis): the split's own metrics, the same as
    # those the cross-vendor evaluation computed beside its own, in a cache of its own
    one = next(p for p in (runs / "seeds").glob("*/seed100") if p.is_dir())
    within = bench.test_evaluation(one, "cpu", cross_domain=False)["metrics"]
    both = json.loads((one.parent / "seed100.final.json").read_text())["metrics"]
    assert not [k for k in within if k.startswith("cross_domain")] and within["recall@1"] == both["recall@1"]
    assert (one.parent / "seed100.final_split_only.json").is_file()
    # test numbers made from another best.pt (the run trained again after its test evaluation): the
    # test split is read once, so nothing is evaluated again and the record stays as it was
    cache = one.parent / "seed100.final.json"
    stale = json.loads(cache.read_text())
    cache.write_text(json.dumps({**stale, "checkpoint_sha256": "another", "metrics": {"recall@1": -1.0}}))
    with pytest.raises(bench.ProtocolError, match="the test split is read once"):
        bench.test_evaluation(one, "cpu")
    assert json.loads(cache.read_text())["checkpoint_sha256"] == "another"
    cache.write_text(json.dumps(stale))
    assert bench.test_evaluation(one, "cpu")["metrics"] == both
    # beside each verdict: how far its runs converged and how many candidates each tune drew; the
    # ranked table pairs against the best tuned validation objective, not against the top on test;
    # the first final step's cut is committed (a fresh clone keeps it)
    verdicts = {v["id"]: v for v in json.loads((copy / "verdicts.json").read_text())}
    assert verdicts["H6"]["convergence"].count("flattened") == 2 and "candidates drawn BN " in verdicts["H6"]["convergence"]
    assert "## Candidates drawn" in summary and "| BN | " in summary.split("## Candidates drawn")[1]
    ref = bench.best_by_tune(bench.Protocol(bench.parse_args(argv[:-1])), losses, rows)
    assert f"paired by seed against {ref}, the loss with the best tuned validation objective" in summary
    assert json.loads((copy / "final.json").read_text()) == {"cut": ["contrastive"]}
    # the control: both losses at the winner's settings, validation only
    with open(copy / "control.csv", newline="") as f:
        control = list(csv.DictReader(f))
    assert sorted(r["loss"] for r in control) == sorted(losses) and len({r["winner"] for r in control}) == 1
    # the winner at its own settings is its seeded run (one training, not two): no control folder of its own
    (win_row,) = [r for r in control if r["loss"] == r["winner"]]
    assert win_row["same_run"] == "True" and win_row["val_at_winner_settings"] == win_row["val_at_own_settings"]
    assert not (runs / "control" / win_row["loss"] / "seed100" / "metrics.json").exists()
    for r in control:  # at the winner's settings: the run's own selection, and MAP@R of that epoch from its log
        run_dir = runs / ("seeds" if r["same_run"] == "True" else "control") / r["loss"] / "seed100"
        chosen = json.loads((run_dir / "metrics.json").read_text())["selected"]
        at = [e for e in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())
              if e.get("type") == "eval" and e.get("split") == "val" and e.get("epoch") == chosen["epoch"]][-1]
        assert float(r["val_at_winner_settings"]) == pytest.approx(chosen["value"], rel=1e-5)
        assert float(r["val_map_at_winner_settings"]) == pytest.approx(at["cross_domain_map@r"], rel=1e-5)
    winner = json.loads((runs / "control" / "winner.json").read_text())
    for run_dir in [runs / ("seeds" if r["same_run"] == "True" else "control") / r["loss"] / "seed100" for r in control]:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert cfg["optim"]["name"] in winner["shared"][0] and cfg["eval"]["test"] is False
    # the committed copy: relative paths only, in the files and in each finished tune's storage
    import sqlite3

    for path in copy.rglob("*"):
        if path.is_file() and path.suffix not in (".png", ".db"):
            text = path.read_text()
            assert str(tmp_path) not in text and not re.search(bench.ABSOLUTE, text), path
    for loss in losses:
        db = sqlite3.connect(copy / "tunes" / loss / "tune.db")
        try:
            kept = [v for (v,) in db.execute("SELECT value_json FROM trial_user_attributes")]
            n_trials = db.execute("SELECT count(*) FROM trials").fetchone()[0]
        finally:
            db.close()
        assert kept and not [v for v in kept if str(tmp_path) in v or re.search(bench.ABSOLUTE, v)]
        with open(runs / "tune" / loss / "trials.csv", newline="") as f:
            assert n_trials >= len(list(csv.DictReader(f)))  # the whole record (surplus trials too)
    # --snapshot copies an unfinished tune's storage, relative and validation only; a finished
    # tune gets no partial copy (its outputs are in tunes/)
    (runs / "tune" / losses[0] / "best_overrides.json").rename(runs / "best_overrides.json")
    (copy / "partial_tunes" / losses[1]).mkdir(parents=True)
    assert bench.main(argv[:-1] + ["--snapshot"]) == 0
    assert not (copy / "partial_tunes" / losses[1]).exists()
    part = copy / "partial_tunes" / losses[0]
    with open(part / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["state"] for r in rows].count("complete") == 2 and not [c for c in rows[0] if "test" in c.lower()]
    assert all(r["run_dir"].startswith("runs/protocol_v2/tune/") for r in rows)
    db = sqlite3.connect(part / "tune.db")
    try:
        values = [v for (v,) in db.execute("SELECT value_json FROM trial_user_attributes")]
    finally:
        db.close()
    assert values and not [v for v in values if str(tmp_path) in v or re.search(bench.ABSOLUTE, v)]
    assert bench.test_metric_leaks(part) == [] and (part / "tune.json").is_file()
    good = (part / "tune.db").read_bytes()
    (runs / "tune" / losses[0] / "tune.db").rename(runs / "tune.db")  # a damaged storage: refused, copy kept
    (runs / "tune" / losses[0] / "tune.db").write_bytes(b"not a database" * 100)
    assert bench.main(argv[:-1] + ["--snapshot"]) == 2
    assert (part / "tune.db").read_bytes() == good
    (runs / "tune.db").replace(runs / "tune" / losses[0] / "tune.db")
    (runs / "best_overrides.json").rename(runs / "tune" / losses[0] / "best_overrides.json")

    # a rerun resumes: nothing left to train (no worker started), the test evaluated once
    worker_log = runs / "seeds" / ".study" / "workers" / "worker_0.log"
    before = {p: p.stat().st_mtime_ns for p in [*(runs / "seeds").glob("*/seed*.final.json"), worker_log]}
    assert bench.main(argv + ["seeds", "control", "final", "--cut", "contrastive"]) == 0
    assert {p: p.stat().st_mtime_ns for p in [*(runs / "seeds").glob("*/seed*.final.json"), worker_log]} == before

    # the optional exploratory runs (not pre-registered; PREREGISTRATION.md, twelfth session): after
    # the final step only, the losses the control read as better at the winner's settings (forced
    # here: the loss that is not the winner), at those settings on seeds 100-102, seed 100 being the
    # control's own run (not trained again; in this miniature the loss's tune chose the winner's
    # settings, so that run is its seeded run), each best.pt tested once, a table without verdict words
    (row,) = [r for r in control if r["loss"] != r["winner"]]
    other = row["loss"]
    at100 = runs / ("seeds" if row["same_run"] == "True" else "control") / other / "seed100"
    monkeypatch.setattr(bench.spec, "control_beyond_own_runs", lambda rows, own: ([other], [], []))
    assert bench.main(argv + ["exploratory", "--cut", "contrastive"]) == 0
    with open(copy / "exploratory.csv", newline="") as f:
        explored = list(csv.DictReader(f))
    assert [(r["loss"], r["seed"]) for r in explored] == [(other, "100"), (other, "101"), (other, "102")]
    assert not (runs / "exploratory" / other / "seed100").exists()  # the control's run
    ctl = json.loads((at100.parent / "seed100.final.json").read_text())["metrics"]
    assert float(explored[0]["cross_domain_recall@1"]) == pytest.approx(ctl["cross_domain_recall@1"], rel=1e-5)
    at_control = yaml.safe_load((at100 / "config.yaml").read_text())
    for seed in (101, 102):
        run_dir = runs / "exploratory" / other / f"seed{seed}"
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert cfg["optim"] == at_control["optim"] and cfg["eval"] == at_control["eval"]
        assert cfg["train"]["seed"] == seed and (run_dir.parent / f"seed{seed}.final.json").is_file()
    md = (copy / "exploratory.md").read_text()
    assert "not pre-registered" in md and f"| {other} | 3 | " in md and "| raw pixels (" in md, md
    assert "seeds 101-102 |" in md and "(n=2) |" in md, md  # the differences without the run that chose the loss
    tested_once = {p: p.stat().st_mtime_ns for p in (runs / "exploratory" / other).glob("seed*.final.json")}
    assert len(tested_once) == 2 and bench.main(argv + ["exploratory", "--cut", "contrastive"]) == 0
    assert {p: p.stat().st_mtime_ns for p in tested_once} == tested_once  # a rerun trains and tests nothing
    # the glyph runs may end after the first final step (PREREGISTRATION.md, thirteenth session): a
    # second final step with the same cut adds glyphs.csv and tests none of the seeded runs again
    # (a one-run stand-in for the 25 glyph runs, on this miniature's data)
    seeded_tests = {p: p.stat().st_mtime_ns for p in (runs / "seeds").glob("*/seed*.final.json")}
    with monkeypatch.context() as m:
        m.setattr(bench, "glyph_study", lambda proto: bench.make_study(proto, "glyphs", {"HBN": []}, [100]))
        assert bench.main(argv + ["glyphs", "final", "--cut", "contrastive"]) == 0
    assert {p: p.stat().st_mtime_ns for p in seeded_tests} == seeded_tests
    with open(copy / "glyphs.csv", newline="") as f:
        glyph_rows = list(csv.DictReader(f))
    assert [(r["variant"], r["seed"]) for r in glyph_rows] == [("HBN", "100")]
    assert 0.0 <= float(glyph_rows[0]["recall@1"]) <= 1.0
    second = (copy / "summary.md").read_text()
    assert "Not tested yet" not in second and "| HBN | 1 | " in second, second

    # a seed-100 run that is not the same training as the control's: refused, never trained again
    with monkeypatch.context() as m:
        m.setattr(bench, "same_training", lambda a, b: False)
        assert bench.main(argv + ["exploratory", "--cut", "contrastive"]) == 2
    assert not (runs / "exploratory" / other / "seed100").exists()
    assert not re.search(r"\b(holds|does not hold|not resolved|reversed)\b", md)
    assert "(seed 100: the control's run) | 2 | 2 |" in bench.progress_markdown(bench.Protocol(bench.parse_args(argv[:-1])))
    # the control read differently later (another cut, another rule): refused, the runs kept
    monkeypatch.setattr(bench.spec, "control_beyond_own_runs", lambda rows, own: ([], [], []))
    assert bench.main(argv + ["exploratory", "--cut", "contrastive"]) == 2
    assert (copy / "exploratory.csv").is_file()

    # --progress counts what ran; a fresh clone continues from the copy alone (--restore): both
    # tunes are finished there, with the storage each one had
    text = bench.progress_markdown(bench.Protocol(bench.parse_args(argv[:-1])))
    n_seeded = sum(len(v2.seeds_of(n)) for n in bench.spec.LOSSES)
    assert "| BN | finished | 2 |" in text and f"| 8 | {n_seeded} |" in text, text
    assert f"(results.csv rows) | 8 | {n_seeded} |" in text
    # the control's runs that are seeded runs (the winner's at its own settings) count as finished
    # (with the cut the control ran under: the winner is known)
    cut = bench.progress_markdown(bench.Protocol(bench.parse_args(argv[:-1] + ["--cut", "contrastive"])))
    assert "winner's settings, seed 100) | 2 | 3 |" in cut, cut
    fresh = ["--runs", str(tmp_path / "fresh"), "--copy-to", str(copy), "--trials", "2"]
    assert bench.main(fresh + ["--restore"]) == 0
    assert bench.Protocol(bench.parse_args(fresh)).tuned() == losses
    assert (tmp_path / "fresh" / "tune" / losses[1] / "tune.db").is_file()


def _fake_tune(runs, loss, value, overrides, complete=v2.TRIALS):
    """A tune's outputs: ``complete`` completed trials and one pruned (finished at the default)."""
    d = runs / "tune" / loss
    d.mkdir(parents=True, exist_ok=True)
    (d / "best_overrides.json").write_text(json.dumps({"trial": 0, "value": value, "overrides": overrides}))
    states = ["pruned"] + ["complete"] * complete
    (d / "trials.csv").write_text("trial,state\n" + "".join(f"{i},{s}\n" for i, s in enumerate(states)))


def test_a_tune_is_finished_by_its_completed_trials_not_by_its_outputs(tmp_path, monkeypatch):
    """An interrupted tune, or one whose workers all failed, writes best_overrides.json too: it is
    neither seeded nor copied, and the tune phase stops with an error; the cap of finished or
    pruned trials also ends a tune."""
    runs = tmp_path / "runs"
    args = bench.parse_args(["--runs", str(runs), "--copy-to", str(tmp_path / "copy"), "--only", "BN"])
    proto = bench.Protocol(args)
    _fake_tune(runs, "BN", 0.5, ["optim.lr=0.01"], complete=v2.TRIALS - 1)
    assert not proto.finished("BN") and proto.tuned() == []
    monkeypatch.setattr(bench, "_tune_setup", lambda proto, loss, storage=None: type("S", (), {
        "budget_text": lambda self: "12 completed"})())
    import deepmetric.workflows.tune as tune

    monkeypatch.setattr(tune, "run_tune", lambda setup, workers: None)  # every worker failed at once
    with pytest.raises(bench.ProtocolError, match="ended before its 12 completed trials"):
        bench.run_tune_phase(proto, "BN")
    assert not (tmp_path / "copy" / "tunes" / "BN").exists()
    _fake_tune(runs, "BN", 0.5, ["optim.lr=0.01"])
    assert proto.finished("BN") and proto.tuned() == ["BN"]
    d = runs / "tune" / "BN"  # at the cap: 36 finished or pruned, 5 of them complete
    (d / "trials.csv").write_text("trial,state\n" + "".join(f"{i},{'complete' if i < 5 else 'pruned'}\n"
                                                           for i in range(v2.MAX_TRIALS_FACTOR * v2.TRIALS)))
    assert proto.finished("BN")


def test_the_control_and_the_beta_sweep_take_the_tuned_values_they_should(tmp_path, monkeypatch):
    """control: every loss at the winner's shared values with its own option kept, the winner
    the best of every tune of the table (``--only`` does not narrow it); the sweep: beta 0-3 at
    almn_beta3's tuned values, seeds 100-104 (built and validated, not trained)."""
    runs = tmp_path / "runs"
    table = dict(bench.spec.LOSSES)
    monkeypatch.setattr(bench.spec, "LOSSES", {n: table[n] for n in ("BN", "almn_beta3", "npair")})
    _fake_tune(runs, "BN", 0.50, ['optim.name="sgd"', "optim.lr=0.02", "optim.weight_decay=0.0001",
                                  "optim.new_layer_lr_mult=10.0", 'eval.embedding="embedding"',
                                  "loss.0.options.alpha=32.0"])
    _fake_tune(runs, "almn_beta3", 0.60, ['optim.name="adamw"', "optim.lr=0.0003", "optim.weight_decay=0.01",
                                          "optim.new_layer_lr_mult=1.0", 'eval.embedding="projection"',
                                          "optim.loss_lr_mult=30.0"])
    common = ["--runs", str(runs), "--copy-to", str(tmp_path / "copy"), "--set", "model.options.pretrained=null"]
    with pytest.raises(bench.ProtocolError, match=r"have not finished theirs: \['npair'\].*--cut npair"):
        bench.control_study(bench.Protocol(bench.parse_args(common)))
    with pytest.raises(bench.ProtocolError, match="cut from the end of the table only"):
        bench.control_study(bench.Protocol(bench.parse_args(common + ["--cut", "BN"])))
    args = bench.parse_args(common + ["--only", "BN", "--cut", "npair"])  # --only BN: the winner is still ALMN's
    proto = bench.Protocol(args)
    assert bench.tune_record(proto, "BN")["completed"] == v2.TRIALS
    study, win = bench.control_study(proto)
    assert win["loss"] == "almn_beta3"
    by_variant = {r.variant: r.raw for r in study.runs}
    assert {r.seed for r in study.runs} == {100}
    bn = by_variant["BN"]
    assert (bn["optim"]["name"], bn["optim"]["lr"], bn["eval"]["embedding"]) == ("adamw", 0.0003, "projection")
    assert bn["loss"][0]["options"]["alpha"] == 32.0 and bn["loss"][0]["name"] == "heated_softmax"  # its own
    assert by_variant["almn_beta3"]["optim"]["loss_lr_mult"] == 30.0
    # the winner at the winner's settings is the same training as its seeded run: that run, trained once
    out_dirs = {r.variant: r.out_dir for r in study.runs}
    assert out_dirs == {"BN": runs / "control" / "BN" / "seed100", "almn_beta3": runs / "seeds" / "almn_beta3" / "seed100"}
    # the phase asks the workers (which reload runs/control.yaml, where the twin is a control run)
    # for the control's own runs only, and records the twin for --progress
    asked = []
    monkeypatch.setattr(bench, "run_study_phase", lambda proto, study, only: asked.append(list(only)))
    bench.run_control_phase(proto, ["BN", "almn_beta3"])
    assert asked == [["BN/seed100"]]
    assert json.loads((runs / "control" / bench.TWINS_FILE).read_text()) == {"almn_beta3/seed100": "seeds/almn_beta3/seed100"}
    (runs / "seeds" / "almn_beta3" / "seed100").mkdir(parents=True)
    (runs / "seeds" / "almn_beta3" / "seed100" / "metrics.json").write_text("{}")
    assert bench._finished_control_runs(proto, ["BN/seed100", "almn_beta3/seed100"]) == 1
    sweep = bench.almn_study(proto)
    assert sorted(sweep.variants) == ["beta0", "beta1", "beta2", "beta3"]
    assert sorted({r.seed for r in sweep.runs}) == [100, 101, 102, 103, 104]
    for r in sweep.runs:
        assert r.raw["loss"][0]["name"] == "almn" and r.raw["optim"]["lr"] == 0.0003
        assert r.raw["loss"][0]["options"]["beta"] == float(r.variant[len("beta"):])
        # beta 3 at almn_beta3's settings is the same training as its seeded run: that run, trained once
        owner = runs / ("seeds/almn_beta3" if r.variant == "beta3" else f"almn_beta/{r.variant}") / f"seed{r.seed}"
        assert r.out_dir == owner and r.key == f"{r.variant}/seed{r.seed}"
    # a later winner is refused, not silently applied to the control runs
    monkeypatch.setattr(bench.spec, "LOSSES", {n: table[n] for n in ("HBN", "BN", "almn_beta3")})
    _fake_tune(runs, "HBN", 0.70, ['optim.name="sgd"', "optim.lr=0.05", "optim.weight_decay=0.0001",
                                   "optim.new_layer_lr_mult=10.0", 'eval.embedding="embedding"',
                                   "loss.0.options.alpha=16.0"])
    args = bench.parse_args(common)
    with pytest.raises(bench.ProtocolError, match="the winner is now HBN"):
        bench.control_study(bench.Protocol(args))


def _finished_sweep(runs: Path, val: dict[float, list[float]]) -> None:
    """The beta sweep's runs as finished (metrics.json with best.pt's validation value); beta 3's
    are almn_beta3's seeded runs (the same training)."""
    for beta, values in val.items():
        for seed, value in zip(v2.BETA_SEEDS, values):
            d = (runs / "seeds" / "almn_beta3" if beta == 3.0 else runs / "almn_beta" / f"beta{beta:g}") / f"seed{seed}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "metrics.json").write_text(json.dumps({"selected": {"epoch": 9, "value": value}}))


@pytest.mark.filterwarnings("ignore:Precision loss occurred in moment calculation")
def test_almn_mxn_and_eq12_run_at_the_sweeps_best_beta_chosen_on_validation(tmp_path):
    """Once every sweep run has finished, the best beta is the one with the best mean validation
    value over its seeds (not the best single run); m x n 32 x 2 / 8 x 8 and Eq. 12's fixed margin
    run at it, seeds 100-104, with almn_beta3's tuned values; a later different choice is refused;
    the summary reports every variant against the best beta's 16 x 4 runs, paired by seed."""
    runs = tmp_path / "runs"
    _fake_tune(runs, "almn_beta3", 0.60, ['optim.name="adamw"', "optim.lr=0.0003", "optim.weight_decay=0.01",
                                          "optim.new_layer_lr_mult=1.0", 'eval.embedding="projection"'])
    args = bench.parse_args(["--runs", str(runs), "--copy-to", str(tmp_path / "copy"),
                             "--set", "model.options.pretrained=null"])
    proto = bench.Protocol(args)
    assert bench.almn_more_study(proto) is None  # no sweep run finished yet
    # beta 3 has the best single run (0.9) but beta 1 the best mean
    sweep = {0.0: [0.40] * 5, 1.0: [0.60, 0.61, 0.59, 0.60, 0.60], 2.0: [0.50] * 5, 3.0: [0.90, 0.30, 0.30, 0.30, 0.30]}
    _finished_sweep(runs, {b: v for b, v in sweep.items() if b != 3.0})
    assert bench.almn_more_study(proto) is None  # beta 3's runs are missing
    _finished_sweep(runs, sweep)
    more = bench.almn_more_study(proto)
    assert json.loads((runs / "almn_more" / "best_beta.json").read_text())["beta"] == 1.0
    assert sorted(more.variants) == sorted(v2.ALMN_MORE) and sorted({r.seed for r in more.runs}) == v2.BETA_SEEDS
    for r in more.runs:
        loss, train = r.raw["loss"][0], r.raw["train"]
        assert loss["name"] == "almn" and loss["options"]["beta"] == 1.0 and r.raw["optim"]["lr"] == 0.0003
        expected = {"m32_n2": (32, 2, "virtual"), "m8_n8": (8, 8, "virtual"), "eq12_fixed_margin": (16, 4, "fixed")}
        assert (train["m"], train["n"], loss["options"].get("margin_mode", "virtual")) == expected[r.variant]
    d = runs / "almn_beta" / "beta2" / "seed100"  # the sweep changed afterwards: refused
    (d / "metrics.json").write_text(json.dumps({"selected": {"value": 0.99}}))
    _finished_sweep(runs, {2.0: [0.99] * 5})
    with pytest.raises(bench.ProtocolError, match="best beta is now 2"):
        bench.almn_more_study(proto)

    def rows(name, base):
        return [{"loss": name, "seed": s, "completed_trials": 12, "optimizer": "adamw", "embedding": "own",
                 "epochs": 10, "cross_domain_recall@1": base + d, "cross_domain_map@r": base / 2}
                for s, d in zip(v2.BETA_SEEDS, [0.01, -0.01, 0.0, 0.02, -0.02])]
    bench.write_csv(runs / "almn_beta.csv", rows("almn_sweep_beta1", 0.50) + rows("almn_sweep_beta0", 0.45),
                    bench.RESULT_COLUMNS)
    bench.write_csv(runs / "almn_more.csv", rows("almn_m8_n8", 0.47), bench.RESULT_COLUMNS)
    text = "\n".join(bench.almn_markdown(proto))
    assert "best beta on validation: 1 (reference row: almn_sweep_beta1" in text
    table = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| almn")}
    assert "| -5.00 [-5.00, -5.00] (n=5) |" in table["almn_sweep_beta0"]
    assert "| -3.00 [-3.00, -3.00] (n=5) |" in table["almn_m8_n8"]
    assert table["almn_sweep_beta1"].split("|")[6].strip() == "-"


def records_h1_convergence(runs) -> str:
    return next(r for r in json.loads((runs / "verdicts.json").read_text()) if r["id"] == "H1")["convergence"]


@pytest.mark.filterwarnings("ignore:Precision loss occurred in moment calculation")
def test_the_summary_applies_the_preregistered_decision_rule(tmp_path):
    """H1-H6 with Holm over the family of seven (tests not run yet count as p = 1), verdicts on
    the primary metric: holds / reversed / does not hold (CI below +1 point) / not resolved."""
    runs = tmp_path / "runs"
    means = {"HBN": 0.60, "BN": 0.50, "SM": 0.50, "LN": 0.40, "HLN": 0.40, "almn_beta3": 0.30, "almn_beta0": 0.40,
             "pml_proxy_anchor": 0.45}
    jitter = {"HLN": [0.2, -0.2, 0.1, -0.1, 0.15]}  # a wide interval: not resolved
    rows = []
    for loss, m in means.items():
        for i, seed in enumerate([100, 101, 102, 103, 104]):
            v = m + jitter.get(loss, [0.001, -0.001, 0.0005, -0.0005, 0.0])[i]
            rows.append({"loss": loss, "seed": seed, "completed_trials": 12, "optimizer": "sgd", "embedding": "own",
                         "epochs": 10, "cross_domain_recall@1": v, "cross_domain_map@r": v / 2,
                         "val_flattened": True, "wall_time_s": 600.0 + 60 * i,
                         "best_epoch": 10 if i < 3 else 8})  # epochs 9-10 are HBN's and HLN's heated ones
    bench.write_csv(runs / "results.csv", rows, bench.RESULT_COLUMNS)
    rows[0]["best_epoch"] = ""  # HBN seed 100: a run without a known best epoch is not counted as unheated
    bench.write_csv(runs / "results.csv", rows, bench.RESULT_COLUMNS)
    for loss, value in (("HBN", 0.7), ("BN", 0.6), ("pml_proxy_anchor", 0.65)):
        _fake_tune(runs, loss, value, ["optim.lr=0.01"])
    args = bench.parse_args(["--runs", str(runs), "--copy-to", str(tmp_path / "copy")])
    proto = bench.Protocol(args)
    (runs / "control").mkdir(parents=True, exist_ok=True)  # the control (validation): beside H6 and the table
    (runs / "control" / "winner.json").write_text(json.dumps({"loss": "HBN", "shared": ["optim.lr=0.01"]}))
    (runs / "control.csv").write_text("loss,seed,winner,tune_best_val,val_at_own_settings,val_at_winner_settings,"
                                      "val_map_at_own_settings,val_map_at_winner_settings,same_run\n"
                                      "SM,100,HBN,0.5,0.45,0.5,0.2,0.25,False\n")
    bench.write_summary(proto)
    text = (runs / "summary.md").read_text()
    assert "is HBN: optim.lr 0.01;" in text and "| SM | 45.00 | " in text, text
    primary = text.split("### cross_domain_recall@1")[1].split("###")[0]
    got = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in primary.splitlines()
           if re.match(r"\| H\d", line)}
    # H5a / H5b have no runs here: every verdict is provisional (they count as p = 1 in Holm)
    assert "**Provisional**: H5a, H5b have no runs yet" in primary
    assert got == {"H1": "holds (provisional)", "H2": "does not hold (provisional)", "H3": "not resolved (provisional)",
                   "H4": "reversed (provisional)", "H5a": "", "H5b": "", "H6": "holds (provisional)"}, got
    got = {h: v.removesuffix(" (provisional)") for h, v in got.items()}
    # the budget beside each verdict (pre-registered), the 64 px of H1-H3 with it
    h1 = [line for line in primary.splitlines() if line.startswith("| H1 |")][0]
    assert ("| emoji 64 px, 10 epochs, 12 completed tune trials per loss, seeds 100-104 | HBN flattened 5/5, best.pt "
            "at a heated epoch 2/4, 1 unknown; BN flattened 5/5; candidates drawn HBN 13, BN 13 | holds (provisional) |") in h1
    assert records_h1_convergence(runs) == ("HBN flattened 5/5, best.pt at a heated epoch 2/4, 1 unknown; BN flattened "
                                            "5/5; candidates drawn HBN 13, BN 13")
    assert "| H5a | not run yet |" in primary and "best of ours (HBN)" in text and "(pml_proxy_anchor)" in text
    assert "| 1 | HBN | 3 | 60.02 |" in text  # the ranked table: seeds 100-102 for every loss (5 seeds: 60.00)
    second = [line for line in text.splitlines() if line.startswith("| 2 |")][0].split("|")
    assert float(second[11].split()[0]) == pytest.approx(float(second[7].split()[0]) / 2, abs=0.011)  # MAP@R = R@1 / 2 here
    hbn = [line for line in text.splitlines() if line.startswith("| 1 | HBN |")][0]
    assert hbn.endswith("| 5/5 | 12.0 |")  # flattened runs; mean wall time (600-840 s) in minutes
    secondary = text.split("### cross_domain_map@r")[1]
    assert not re.search(r"\| (holds|reversed|does not hold|not resolved) \|", secondary)  # MAP@R: no verdict
    assert re.search(r"\| H1 \| HBN - BN \| 5 \| \+5\.00 \|", secondary)
    # verdicts.json (what bench/study_claims.py puts in CLAIMS.md): the same verdicts, with budgets
    records = {r["id"]: r for r in json.loads((runs / "verdicts.json").read_text())}
    assert {h: r["verdict"] for h, r in records.items()} == {**got, "H5a": "pending", "H5b": "pending"}
    assert all(r["provisional"] == (r["test"] is not None) and r["pending_tests"] == ["H5a", "H5b"]
               for r in records.values())
    assert records["H1"]["test"]["mean"] == pytest.approx(10.0) and records["H1"]["secondary"]["mean"] == pytest.approx(5.0)
    assert "10 epochs, 12 completed tune trials" in records["H1"]["budget"] and records["H5a"]["test"] is None
    assert records["H1"]["budget"].endswith("seeds 100-104") and records["H6"]["budget"].endswith("seeds 100-102")
    assert records["H1"]["claim"].startswith("HBN > BN") and records["H1"]["holm_p"] >= records["H1"]["p"]
    # the two-head final step ran and nothing of softmax could be tested (every lr diverged): H5a /
    # H5b are no longer pending but have no pairs, and their budget says which runs diverged
    copy = tmp_path / "copy"
    copy.mkdir(exist_ok=True)
    bench.write_csv(copy / "two_head_accuracy.csv", [{"variant": "hard", "seed": 101, "top1": 0.5,
                                                      "macro_accuracy": 0.5}], ("variant", "seed", "top1", "macro_accuracy"))
    (copy / "two_head_accuracy.json").write_text(json.dumps({
        "diverged_tested_from_last_checkpoint": ["hard/seed101"], "diverged_without_a_model": [],
        "variants_every_lr_diverged": ["softmax"]}))
    bench.write_summary(proto)
    records = {r["id"]: r for r in json.loads((runs / "verdicts.json").read_text())}
    assert records["H5a"]["verdict"] == records["H5b"]["verdict"] == "not resolved"
    assert records["H5a"]["test"]["n"] == 0 and not records["H1"]["provisional"]
    assert records["H5a"]["budget"].endswith("; every lr diverged, no runs: softmax")
    assert records["H5b"]["budget"].endswith("; diverged, tested from the last checkpoint: hard/seed101; every lr "
                                             "diverged, no runs: softmax")


@pytest.mark.filterwarnings("ignore:Precision loss occurred in moment calculation")
def test_the_glyph_analysis_runs_v1s_glyph_settings_for_20_epochs_heating_at_16(tmp_path):
    """The secondary glyph analysis (pre-registered, if compute allows): HBN / BN / SM / LN / HLN on
    the base of the v1 glyph study, 20 epochs, heated at 16 (HBN, HLN) or never, test out of
    sight, seeds 100-104; the summary pairs HBN - BN, BN - SM and HLN - LN by seed."""
    runs = tmp_path / "runs"
    proto = bench.Protocol(bench.parse_args(["--runs", str(runs), "--copy-to", str(tmp_path / "copy")]))
    study = bench.glyph_study(proto)  # every run's config built and validated by the study loader
    assert sorted(study.variants) == ["BN", "HBN", "HLN", "LN", "SM"]
    assert sorted({r.seed for r in study.runs}) == v2.CLAIM_SEEDS
    for r in study.runs:
        cfg = r.raw
        assert cfg["data"]["name"] == "glyphs" and cfg["train"]["epochs"] == 20
        assert cfg["eval"]["test"] is False and cfg["eval"]["best_metric"] == "recall@1"
        assert cfg["eval"]["metrics"] == ["recall", "map@r"]
        temp = cfg["schedule"]["temperature"]
        heated = r.variant in ("HBN", "HLN")
        assert (temp["name"], temp.get("at")) == (("heat_up", 16) if heated else ("none", temp.get("at")))
        assert cfg["model"]["options"]["norm"] == {"HBN": "bn", "BN": "bn", "SM": "none", "LN": "l2", "HLN": "l2"}[r.variant]
    rows = [{"variant": v, "seed": s, "epochs": 20, "recall@1": base + d, "map@r": base / 2, "val_flattened": True}
            for v, base in (("HBN", 0.60), ("BN", 0.55)) for s, d in zip(v2.CLAIM_SEEDS, [0.01, -0.01, 0, 0.02, -0.02])]
    bench.write_csv(runs / "glyphs.csv", rows, bench.GLYPH_COLUMNS)
    text = "\n".join(bench.glyph_markdown(proto))
    assert "| HBN - BN | 5 | +5.00 [+5.00, +5.00] | +2.50 [+2.50, +2.50] |" in text, text
    assert "| BN - SM | 0 | - | - |" in text and "| HBN | 5 | 60.00 |" in text


def _partial_storage(path: Path, loss: str, run_root: str) -> None:
    """An Optuna storage as a tune leaves it: one completed, one pruned and one running trial,
    each with its run folder under ``run_root``."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=f"protocol_v2__{loss}", storage=f"sqlite:///{path}", direction="maximize")
    for i, state in enumerate([optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                               optuna.trial.TrialState.RUNNING]):
        trial = study.ask()
        trial.set_user_attr("run_dir", f"{run_root}/tune/{loss}/trials/trial_{i:04d}")
        if state == optuna.trial.TrialState.COMPLETE:
            study.tell(trial, 0.25)
        elif state == optuna.trial.TrialState.PRUNED:
            study.tell(trial, state=state)


def test_restore_puts_the_committed_tunes_back_and_progress_counts_them(tmp_path, monkeypatch):
    """A fresh clone continues the study from the committed copy alone: a finished tune's outputs
    (what the seeded runs read) and an unfinished one's storage come back into --runs with their
    run folders absolute there again; a tune already in --runs is left alone; --progress then
    counts each tune's trials by state and the other phases' finished runs."""
    copy, runs = tmp_path / "copy", tmp_path / "fresh" / "runs"
    _fake_tune(copy / "finished", "BN", 0.61, ["optim.lr=0.01"])  # -> copy/finished/tune/BN
    (copy / "tunes").mkdir(parents=True)
    (copy / "finished" / "tune" / "BN").rename(copy / "tunes" / "BN")
    (copy / "partial_tunes" / "HLN").mkdir(parents=True)
    _partial_storage(copy / "partial_tunes" / "HLN" / "tune.db", "HLN", "runs/protocol_v2")
    (runs / "tune" / "SM").mkdir(parents=True)  # already here (a running tune): untouched
    (runs / "tune" / "SM" / "tune.db").write_bytes(b"live")
    (copy / "partial_tunes" / "SM").mkdir()
    _partial_storage(copy / "partial_tunes" / "SM" / "tune.db", "SM", "runs/protocol_v2")
    argv = ["--runs", str(runs), "--copy-to", str(copy)]

    assert bench.main(argv + ["--restore"]) == 0
    proto = bench.Protocol(bench.parse_args(argv))
    assert proto.tuned() == ["BN"] and bench.tune_record(proto, "BN")["value"] == 0.61
    assert (runs / "tune" / "SM" / "tune.db").read_bytes() == b"live"
    import sqlite3

    db = sqlite3.connect(runs / "tune" / "HLN" / "tune.db")
    try:
        run_dirs = sorted(json.loads(v) for (v,) in db.execute("SELECT value_json FROM trial_user_attributes"))
    finally:
        db.close()
    assert run_dirs == [f"{runs}/tune/HLN/trials/trial_{i:04d}" for i in range(3)]
    assert bench.main(argv + ["--restore"]) == 0  # again: nothing changes
    # the tune phase never tunes a finished loss again (restored from its outputs alone, it has
    # no storage: a new tune would start over and replace them)
    monkeypatch.setattr(bench, "run_tune_phase", lambda proto, loss: pytest.fail(f"{loss} tuned again"))
    assert bench.main(argv + ["--phase", "tune", "--only", "BN"]) == 0
    assert not (runs / "tune" / "BN" / "tune.db").exists()
    assert sorted(p.name for p in (runs / "tune").iterdir()) == ["BN", "HLN", "SM"]

    (runs / "tune" / "SM" / "tune.db").unlink()  # progress reads every storage: a real one
    _partial_storage(runs / "tune" / "SM" / "tune.db", "SM", str(runs))
    seed_run = runs / "seeds" / "BN" / "seed100"
    seed_run.mkdir(parents=True)
    (seed_run / "metrics.json").write_text("{}")
    (runs / "seeds" / "BN" / "seed101").mkdir()  # not finished: no metrics.json
    text = bench.progress_markdown(proto)
    tunes, drawn = text.split("## Candidates drawn")
    other = drawn.split("## The other")[1].split("## Seeded runs: convergence")[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in tunes.splitlines() + other.splitlines()
            if line.startswith("| ")}
    assert rows["BN"].startswith(f"| BN | finished | {v2.TRIALS} | 1 | 0 | 0 | 0.6100 |")
    # the candidates a finished tune drew (completed + pruned); the unfinished ones are not listed
    assert f"| BN | {v2.TRIALS + 1} | - | 0.6100 | - |" in drawn and "| HLN |" not in drawn.split("## The other")[0]
    assert rows["HLN"].startswith("| HLN | under way | 1 | 1 | 0 | 1 | 0.2500 |")
    assert rows["LN"].startswith("| LN | not started | 0 | 0 | 0 | 0 |  |")
    n_seeded = sum(len(v2.seeds_of(n)) for n in v2.LOSSES)
    assert f"| 1 | {n_seeded} |" in [r for k, r in rows.items() if k.startswith("seeded runs")][0]
    assert f"at least {(len(v2.LOSSES) - 1) * v2.TRIALS - 2} more completed trials" in text
    assert bench.main(argv + ["--progress"]) == 0 and (copy / "progress.md").read_text().startswith("# Protocol v2")
    (runs / "tune" / "HLN" / "tune.db").write_bytes(b"not a database" * 100)
    assert bench.main(argv + ["--progress"]) == 2  # a damaged storage: an error naming it, no traceback


def test_a_failing_lane_starts_no_other_loss(tmp_path, monkeypatch):
    """With --lanes 2, when a lane's tune fails (its workers stopped), neither lane takes another
    loss: a lane's thread picks the next queued loss the moment its own ends, before the main
    thread could cancel it (what happened at a stop on 2026-11-27: two more tunes started)."""
    import threading
    import time

    started, lock = [], threading.Lock()

    def fake_tune(proto, loss):
        with lock:
            started.append(loss)
        time.sleep(0.3 if loss == "HBN" else 1.0)
        raise bench.ProtocolError(f"tune {loss} ended before its 12 completed trials")

    monkeypatch.setattr(bench, "run_tune_phase", fake_tune)
    argv = ["--runs", str(tmp_path / "runs"), "--copy-to", str(tmp_path / "copy"), "--phase", "tune", "--lanes", "2"]
    assert bench.main(argv) == 2
    time.sleep(1.5)  # a lane that went on would have started by now
    assert sorted(started) == ["BN", "HBN"], started


def test_the_ranked_table_uses_the_three_shared_seeds_and_budgets_name_what_they_compare(tmp_path):
    """A paper-claim loss has seeds 103-104 too: ranking it on 5 seeds beside others on 3 would
    let a loss rank below one it beats on every shared seed.  Budgets come from the two losses
    compared (completed trials sorted as numbers) and name the seeds actually paired."""
    runs = tmp_path / "runs"
    rows = []
    for loss, values, trials in (("BN", [0.60, 0.60, 0.60, 0.70, 0.70], 12), ("SM", [0.5] * 5, 9),
                                 ("pml_arcface", [0.62, 0.63, 0.62], 12)):
        for seed, v in zip([100, 101, 102, 103, 104], values):
            rows.append({"loss": loss, "seed": seed, "completed_trials": trials, "optimizer": "sgd",
                         "embedding": "own", "epochs": 10, "cross_domain_recall@1": v, "cross_domain_map@r": v,
                         "val_flattened": True, "wall_time_s": 60.0})
    bench.write_csv(runs / "results.csv", rows, bench.RESULT_COLUMNS)
    proto = bench.Protocol(bench.parse_args(["--runs", str(runs), "--copy-to", str(tmp_path / "copy")]))
    bench.write_summary(proto)
    ranked = [line.split("|")[2].strip() for line in (runs / "summary.md").read_text().splitlines()
              if re.match(r"\| \d+ \|", line)]
    assert ranked == ["pml_arcface", "BN", "SM"]
    bn_line = [line for line in (runs / "summary.md").read_text().splitlines() if line.startswith("| 2 | BN |")][0]
    assert "| 3 | 60.00 |" in bn_line and "| 5/5 |" in bn_line  # ranked on 3 seeds; convergence over all 5
    h2 = {r["id"]: r for r in json.loads((runs / "verdicts.json").read_text())}["H2"]
    assert h2["budget"] == "emoji 64 px, 10 epochs, 9/12 completed tune trials per loss, seeds 100-104"
    # BN - SM is +10 points on every seed (+20 on two): a real spread; constant differences have p = 0
    assert h2["test"]["n"] == 5 and h2["verdict"] == "holds"
    same = [{"loss": n, "seed": s, "m": v} for s in (1, 2, 3) for n, v in (("a", 0.6), ("b", 0.5))]
    assert bench.paired(same, "a", "b", "m")["p"] == 0.0
    assert bench.paired([{**r, "m": 0.5} for r in same], "a", "b", "m")["p"] == 1.0
    assert bench.seed_list({"seeds": [100, 101, 103]}) == "100, 101, 103"
    # no tune record: no reference row; with tunes, the reference is the best tuned validation
    # objective (BN), not the top row on test (ArcFace), and the top row gets its interval against it
    assert "No loss of the table has a finished tune: no reference row" in (runs / "summary.md").read_text()
    assert "| vs reference (paired by seed) |" in (runs / "summary.md").read_text()
    for loss, value in (("BN", 0.7), ("SM", 0.6), ("pml_arcface", 0.65)):
        _fake_tune(runs, loss, value, ["optim.lr=0.01"])
    bench.write_summary(proto)
    text = (runs / "summary.md").read_text()
    assert "paired by seed against BN, the loss with the best tuned validation objective" in text
    top = [line for line in text.splitlines() if line.startswith("| 1 | pml_arcface |")][0].split("|")
    assert top[7].strip() == "+2.33 [+0.90, +3.77]" and "| 2 | BN |" in text  # ArcFace - BN on seeds 100-102


def test_the_test_split_waits_for_a_committed_preregistration(tmp_path, monkeypatch):
    """final reads the test split only when the pre-registration is committed *as it is*: an edit
    not committed (a hypothesis changed after the fact) is refused."""
    import subprocess

    repo = tmp_path / "repo"
    copy = repo / "bench" / "studies" / "protocol_v2"
    copy.mkdir(parents=True)
    (copy / "PREREGISTRATION.md").write_text("# H1: A > B\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.setattr(bench, "ROOT", repo)
    proto = bench.Protocol(bench.parse_args(["--runs", str(tmp_path / "runs"), "--copy-to", str(copy)]))
    with pytest.raises(bench.ProtocolError, match="is not committed"):
        bench.check_preregistration(proto)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "pre-registration"], cwd=repo, check=True)
    bench.check_preregistration(proto)  # committed, unchanged: the final step may go on
    (copy / "PREREGISTRATION.md").write_text("# H1: B > A\n")
    with pytest.raises(bench.ProtocolError, match="changes not committed"):
        bench.check_preregistration(proto)


def test_a_diverged_seeded_run_has_ended_and_is_reported_as_such(tmp_path):
    """A seeded run whose loss became non-finite would diverge again on every rerun: it has ended
    (the final step does not wait for it forever), its row says so, and one without a model (it
    diverged before its first evaluation) has no test number: the statistics use the other seeds."""
    import types

    out, record = tmp_path / "seeds" / "SM" / "seed101", tmp_path / "seeds" / ".study" / "SM" / "seed101"
    out.mkdir(parents=True)
    record.mkdir(parents=True)
    run = types.SimpleNamespace(finished=False, out_dir=out, record_dir=record, seed=101, variant="SM",
                                raw={"train": {"epochs": 10}, "optim": {"name": "adamw"},
                                     "eval": {"embedding": "projection"}})
    assert not bench.diverged(run) and not bench.evaluated(run)  # a run not started, or interrupted
    (record / "error.txt").write_text("RuntimeError: out of memory\n")
    assert not bench.diverged(run)  # another failure is retried, not ended
    (record / "error.txt").write_text("NonFiniteLossError: non-finite loss at step 812\n")
    (record / "attempts.json").write_text(json.dumps({"wall_time_s": 95.5}))
    (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"type": "eval", "split": "val", "epoch": 1, "cross_domain_recall@1": 0.31},
        {"type": "eval", "split": "val", "epoch": 2, "cross_domain_recall@1": 0.35},
        {"type": "eval", "split": "val", "epoch": 3, "cross_domain_recall@1": 0.20})))
    assert bench.diverged(run) and bench.ended(run) and bench.evaluated(run)
    proto = bench.Protocol(bench.parse_args(["--runs", str(tmp_path), "--copy-to", str(tmp_path / "copy")]))
    row = bench.result_row(proto, run, "SM", 12)  # no best.pt here: no model, no test number
    assert row["cross_domain_recall@1"] is None and row["status"].startswith("diverged after 3 evaluation(s)")
    assert (row["best_epoch"], row["val_objective"], row["epochs"], row["wall_time_s"]) == (2, 0.35, 10, 95.5)
    assert (row["optimizer"], row["embedding"]) == ("adamw", v2.EMBEDDING_NAMES["projection"])

    rows = [{"loss": loss, "seed": seed, "completed_trials": 12, "optimizer": "sgd", "embedding": "own",
             "epochs": 10, "cross_domain_recall@1": v, "cross_domain_map@r": v, "val_flattened": True,
             "wall_time_s": 60.0, "status": "finished"}
            for loss, base in (("BN", 0.6), ("SM", 0.5)) for seed, v in zip(range(100, 105), [base] * 5)]
    rows[6] = {**row, "loss": "SM"}  # SM seed 101 diverged without a model
    bench.write_csv(tmp_path / "results.csv", rows, bench.RESULT_COLUMNS)
    bench.write_summary(proto)
    text = (tmp_path / "summary.md").read_text()
    assert re.search(r"\| 2 \| SM \| 2 \(1 diverged\) \| 50\.00 \|", text), text
    h2 = {r["id"]: r for r in json.loads((tmp_path / "verdicts.json").read_text())}["H2"]
    assert h2["test"]["n"] == 4 and h2["budget"].endswith("seeds 100, 102, 103, 104")


def test_drain_lets_the_running_tunes_finish_their_trials_and_starts_nothing_new(tmp_path, monkeypatch):
    """--drain (e.g. before a session ends: the trials' checkpoints are not committed, so a stop
    with Ctrl-C loses their work): the running tunes' workers finish their trials (their own
    DRAIN mark), no lane starts another loss, the command exits 0; the next one continues, and a
    --summary meanwhile does not lift the drain."""
    import threading
    import time

    import deepmetric.workflows.tune as tune

    started, drained, lock = [], [], threading.Lock()
    argv = ["--runs", str(tmp_path / "runs"), "--copy-to", str(tmp_path / "copy"), "--set",
            "model.options.pretrained=null"]

    def fake_run_tune(setup, workers=1):
        loss = setup.study_name.split("__")[1]
        setup.out.mkdir(parents=True, exist_ok=True)
        with lock:
            started.append(loss)
        if loss == "HBN" and not drained:
            drained.append(loss)
            time.sleep(0.3)
            assert bench.main(argv + ["--drain"]) == 0
            assert bench.main(argv + ["--summary"]) == 0
        while not (setup.out / tune.DRAIN).is_file() and time.monotonic() < deadline:  # a worker's trial
            time.sleep(0.05)

    monkeypatch.setattr(tune, "run_tune", fake_run_tune)
    deadline = time.monotonic() + 30
    assert bench.main(argv + ["--phase", "tune", "--lanes", "2"]) == 0
    time.sleep(0.5)  # a lane that went on would have started by now
    assert sorted(started) == ["BN", "HBN"], started
    runs = tmp_path / "runs"
    assert (runs / bench.DRAIN).is_file() and (runs / "tune" / "BN" / tune.DRAIN).is_file()
    # the same command continues: the study's mark is removed (the tunes remove their own)
    started.clear()
    deadline = time.monotonic() + 0.5
    assert bench.main(argv + ["--phase", "tune", "--only", "HBN"]) == 2  # (the fake tune never finishes)
    assert started == ["HBN"] and not (runs / bench.DRAIN).exists()


def test_candidates_drawn_and_the_two_head_convergence(tmp_path):
    """12 completed trials per loss are not the same number of candidates: the table counts each
    tune's completed and pruned ones in the order drawn (a retry once) and the best completed value
    among the first N, N the fewest any finished tune drew. H5's seeded runs have no validation:
    their convergence is the lr run's at the chosen lr."""
    tunes = [{"loss": "A", "state": "finished", "complete": 2, "best": 0.9,
              "draws": [("pruned", None), ("complete", 0.5), ("pruned", None), ("complete", 0.9)]},
             {"loss": "B", "state": "finished", "complete": 2, "best": 0.7,
              "draws": [("complete", 0.7), ("complete", 0.6), ("pruned", None)]},
             {"loss": "C", "state": "under way", "complete": 1, "best": 0.8, "draws": [("complete", 0.8)]}]
    assert bench.draw_cells(tunes[0], 3) == (4, 4, 0.5) and bench.draw_cells(tunes[1], 3) == (3, 1, 0.7)
    text = "\n".join(bench.draws_markdown(tunes))
    assert "best within the first 3 |" in text and "| A | 4 | 4 | 0.9000 | 0.5000 |" in text
    assert "| B | 3 | 1 | 0.7000 | 0.7000 |" in text and "| C |" not in text
    assert bench.draws_markdown([tunes[2]]) == []

    copy = tmp_path / "copy"
    copy.mkdir()
    proto = bench.Protocol(bench.parse_args(["--runs", str(tmp_path / "runs"), "--copy-to", str(copy)]))
    # from a tune's trials.csv: a retried trial (5, queued again as 7 after a stop) counts once, at its
    # first number; failed and interrupted trials are no candidates
    d = tmp_path / "runs" / "tune" / "BN"
    d.mkdir(parents=True)
    bench.write_csv(d / "trials.csv", [
        {"trial": 4, "state": "pruned", "val/cross_domain_recall@1": 0.1},
        {"trial": 5, "state": "interrupted"},
        {"trial": 6, "state": "complete", "val/cross_domain_recall@1": 0.4},
        {"trial": 7, "state": "complete", "val/cross_domain_recall@1": 0.6, "retry_of": 5},
        {"trial": 8, "state": "fail"}], ["trial", "state", "val/cross_domain_recall@1", "retry_of"])
    assert bench.tune_progress(proto, "BN")["draws"] == [("pruned", None), ("complete", 0.6), ("complete", 0.4)]
    pair = {"a": "semihard", "b": "softmax"}
    assert bench.two_head_convergence(proto, pair) == "-"  # the lr phase has not run
    (copy / "two_head_chosen_lr.json").write_text(json.dumps({"semihard": {"lr": 0.01}, "softmax": {"lr": 0.03}}))
    bench.write_csv(copy / "two_head_lr_runs.csv",
                    [{"variant": v, "lr": lr, "last_gain_points": g, "flattened": g <= 0.5}
                     for v, lr, g in (("semihard", 0.01, 0.2), ("semihard", 0.03, 3.0), ("softmax", 0.03, 1.5),
                                      ("softmax", 0.01, 0.1))], ["variant", "lr", "last_gain_points", "flattened"])
    assert bench.two_head_convergence(proto, pair) == (
        "no validation in the seeded runs; semihard lr run at lr 0.01: flattened (last gain +0.20 points); "
        "softmax lr run at lr 0.03: not flattened (last gain +1.50 points)")
    # a chosen lr at an end of its grid is named (its own best may lie beyond); inside it, nothing
    grid = [0.003, 0.01, 0.03]
    (copy / "two_head_chosen_lr.json").write_text(json.dumps({"semihard": {"lr": 0.01, "grid": grid},
                                                              "softmax": {"lr": 0.03, "grid": grid}}))
    assert bench.two_head_convergence(proto, pair) == (
        "no validation in the seeded runs; semihard lr run at lr 0.01: flattened (last gain +0.20 points); "
        "softmax lr run at lr 0.03, the grid's upper end: not flattened (last gain +1.50 points)")
    (copy / "two_head_chosen_lr.json").write_text(json.dumps({"semihard": {"lr": 0.03, "grid": grid},
                                                              "softmax": {"lr": 0.01, "grid": [0.01, 0.03]}}))
    assert bench.two_head_convergence(proto, pair) == (
        "no validation in the seeded runs; semihard lr run at lr 0.03, the grid's upper end: not flattened "
        "(last gain +3.00 points); softmax lr run at lr 0.01, the grid's lower end: flattened (last gain +0.10 points)")


def test_progress_finds_the_two_head_runs_beside_the_study_and_counts_diverged_ones(tmp_path, monkeypatch):
    """--progress from another checkout (--runs CLONE/runs/protocol_v2) counts the two-head runs of
    that clone (runs/two_head_accuracy), a diverged run as ended."""
    table = dict(bench.spec.LOSSES)
    monkeypatch.setattr(bench.spec, "LOSSES", {"BN": table["BN"]})
    runs = tmp_path / "clone" / "runs" / "protocol_v2"
    runs.mkdir(parents=True)
    two = tmp_path / "clone" / "runs" / "two_head_accuracy" / "lr"
    (two / "softmax" / "lr0.003_seed0").mkdir(parents=True)
    (two / "softmax" / "lr0.003_seed0" / "metrics.json").write_text("{}")
    (two / "softmax" / "lr0.03_seed0").mkdir(parents=True)
    (two / "softmax" / "lr0.03_seed0" / "diverged.json").write_text("{}")
    text = bench.progress_markdown(bench.Protocol(bench.parse_args(["--runs", str(runs), "--copy-to",
                                                                    str(tmp_path / "copy")])))
    assert "runs/two_head_accuracy beside protocol_v2) | 1 (+ 1 diverged) | 9 |" in text, text


def test_progress_reports_the_seeded_runs_convergence_from_their_validation_logs(tmp_path, monkeypatch):
    """Issue 30, item 4, while the study runs: per loss, how many finished seeded runs' validation
    curves flattened (the pre-registered 0.5-point rule), the largest last gain, best.pt's epochs
    and the wall time, read from the runs' own logs and metrics.json; unfinished runs are left out."""
    table = dict(bench.spec.LOSSES)
    monkeypatch.setattr(bench.spec, "LOSSES", {"BN": table["BN"], "SM": table["SM"]})
    runs = tmp_path / "runs"
    curves = {100: ([0.30, 0.40, 0.41, 0.42], 4, 60.0),  # last gain 0.42 - 0.40: 2 points, not flattened
              101: ([0.50, 0.60, 0.60, 0.59], 3, 120.0)}  # no gain: flattened
    for seed, (curve, best, wall) in curves.items():
        out = runs / "seeds" / "BN" / f"seed{seed}"
        out.mkdir(parents=True)
        (out / "log.jsonl").write_text("".join(
            json.dumps({"type": "eval", "split": "val", "epoch": e, v2.OBJECTIVE: v}) + "\n"
            for e, v in enumerate(curve, 1))  # a test evaluation after them is not part of the curve
            + json.dumps({"type": "eval", "split": "test", "epoch": 4, v2.OBJECTIVE: 0.99}) + "\n")
        (out / "metrics.json").write_text(json.dumps({"epochs": 4, "selected": {"epoch": best},
                                                      "wall_time_s": wall}))
    unfinished = runs / "seeds" / "BN" / "seed102"
    unfinished.mkdir(parents=True)
    (unfinished / "log.jsonl").write_text(json.dumps({"type": "eval", "split": "val", "epoch": 1,
                                                      v2.OBJECTIVE: 0.9}) + "\n")
    record = runs / "seeds" / ".study" / "BN" / "seed103"  # diverged: ended without metrics.json
    record.mkdir(parents=True)
    (record / "error.txt").write_text("NonFiniteLossError: non-finite loss at step 812\n")
    (runs / "seeds" / ".study" / "BN" / "seed104").mkdir(parents=True)  # another failure: retried, not ended
    (runs / "seeds" / ".study" / "BN" / "seed104" / "error.txt").write_text("RuntimeError: out of memory\n")
    proto = bench.Protocol(bench.parse_args(["--runs", str(runs), "--copy-to", str(tmp_path / "copy")]))
    text = bench.progress_markdown(proto)
    n_bn = len(v2.seeds_of("BN"))
    assert f"| BN | 2/{n_bn} (+ 1 diverged) | 1/2 | +2.00 | 4 | 3-4 | 1.0-2.0 |" in text, text
    assert f"| SM | 0/{len(v2.seeds_of('SM'))} | - | - | - | - | - |" in text, text


def test_the_control_table_says_which_losses_did_better_at_the_winners_settings(tmp_path, monkeypatch):
    """The control (validation, seed 100) printed in progress.md and the summary: each loss at its
    own settings and at the winner's, the difference, and which losses' own tunes fell short of the
    winner's settings (the loss that is the winner's own run is not counted)."""
    runs = tmp_path / "runs"
    (runs / "control").mkdir(parents=True)
    (runs / "control" / "winner.json").write_text(json.dumps(
        {"loss": "HBN", "value": 0.62, "own": ["loss.0.options.alpha=16.0"],
         "shared": ['optim.name="adamw"', "optim.lr=0.0007295611181002858", "optim.new_layer_lr_mult=100.0"]}))
    cols = ["loss", "seed", "winner", "tune_best_val", "val_at_own_settings", "val_at_winner_settings",
            "val_map_at_own_settings", "val_map_at_winner_settings", "same_run"]
    bench.write_csv(runs / "control.csv", [
        {"loss": "HBN", "seed": 100, "winner": "HBN", "tune_best_val": 0.62, "val_at_own_settings": 0.60,
         "val_at_winner_settings": 0.60, "val_map_at_own_settings": 0.3, "val_map_at_winner_settings": 0.3,
         "same_run": True},
        {"loss": "SM", "seed": 100, "winner": "HBN", "tune_best_val": 0.57, "val_at_own_settings": 0.5325,
         "val_at_winner_settings": 0.38, "val_map_at_own_settings": 0.29, "val_map_at_winner_settings": 0.18,
         "same_run": False},
        {"loss": "pml_arcface", "seed": 100, "winner": "HBN", "tune_best_val": 0.41, "val_at_own_settings": 0.41,
         "val_at_winner_settings": 0.55, "val_map_at_own_settings": 0.18, "val_map_at_winner_settings": 0.30,
         "same_run": False}], cols)
    # the losses' own seeded runs (validation at best.pt's epoch): the range a control run is read against
    own = {"HBN": [0.58, 0.60], "SM": [0.5325, 0.55], "pml_arcface": [0.40, 0.41], "LN": [0.50, 0.60]}
    for loss, values in own.items():
        for seed, v in zip(v2.SEEDS, values):
            out = runs / "seeds" / loss / f"seed{seed}"
            out.mkdir(parents=True)
            (out / "metrics.json").write_text(json.dumps({"selected": {"epoch": 2}}))
            (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
                {"type": "eval", "split": "val", "epoch": 1, v2.OBJECTIVE: v - 0.1},
                {"type": "eval", "split": "val", "epoch": 2, v2.OBJECTIVE: v, "cross_domain_map@r": v / 2},
                {"type": "eval", "split": "test", "epoch": 2, v2.OBJECTIVE: 0.99})))
    rows = (runs / "control.csv").read_text() + "LN,100,HBN,0.55,0.50,,0.25,,False\n"  # its control run: no value
    (runs / "control.csv").write_text(rows)
    proto = bench.Protocol(bench.parse_args(["--runs", str(runs), "--copy-to", str(tmp_path / "copy")]))
    text = "\n".join(bench.control_markdown(proto))
    assert "is HBN: optim.name adamw, optim.lr 0.00073, optim.new_layer_lr_mult 100;" in text, text
    # LN has no control value: not compared; ArcFace above every own seeded run, SM below every one
    assert ("Of the 2 losses whose settings differ from the winner's, the control run lies above every seeded run "
            "at its own settings for 1 (pml_arcface)") in text, text
    assert "below every one for 1 (SM); the others" in text, text
    assert "| SM | 53.25 | 53.25-55.00 (2) | 38.00 | -15.25 | 29.00 | 18.00 | -11.00 | no |" in text, text
    assert "| pml_arcface | 41.00 | 40.00-41.00 (2) | 55.00 | +14.00 | 18.00 | 30.00 | +12.00 | no |" in text, text
    assert "| LN | 50.00 | 50.00-60.00 (2) | - | - | 25.00 | - | - | no |" in text, text
    assert "| HBN | 60.00 | 58.00-60.00 (2) | 60.00 | +0.00 |" in text and "yes (its own settings are the winner's)" in text
    assert "99.00" not in text  # the test evaluations in the logs are never read
    assert "## The control" in bench.progress_markdown(proto)
    monkeypatch.setattr(bench.Protocol, "tuned", lambda self: ["HBN", "BN", "SM"])  # BN's control run: none
    assert "No control row (its run has not finished, or diverged): BN." in "\n".join(bench.control_markdown(proto))
    (runs / "control.csv").unlink()
    assert "control.csv not written yet" in "\n".join(bench.control_markdown(proto))


def test_the_exploratory_runs_wait_for_the_final_step_and_take_the_controls_reading(tmp_path):
    """The optional exploratory phase (not pre-registered, chosen after the control's validation
    numbers) is not part of 'all', runs only after the final step, and takes the losses whose
    control run lies above every one of their own seeded runs (the control's rule), recorded once."""
    runs = tmp_path / "runs"
    proto = bench.Protocol(bench.parse_args(["--runs", str(runs), "--copy-to", str(tmp_path / "copy")]))
    assert "exploratory" not in bench.PHASES and bench.parse_args(["--phase", "exploratory"]).phase == ["exploratory"]
    with pytest.raises(bench.ProtocolError, match="after the final step only"):
        bench.run_exploratory_phase(proto)
    runs.mkdir()
    (runs / "final.json").write_text('{"cut": ["contrastive"]}')  # a final step that started, not ended
    (runs / "results.csv").write_text("loss,seed\n")
    with pytest.raises(bench.ProtocolError, match="after the final step only"):
        bench.run_exploratory_phase(proto)
    with pytest.raises(bench.ProtocolError, match="run --phase control first"):
        bench.exploratory_losses(proto)
    own = {"HBN": [0.58, 0.60], "SM": [0.53, 0.55], "pml_arcface": [0.40, 0.41], "LN": [0.50, 0.60],
           "contrastive": [0.30, 0.31]}  # contrastive: cut by the final step, never tested at its own settings
    for loss, values in own.items():
        for seed, v in zip(v2.SEEDS, values):
            out = runs / "seeds" / loss / f"seed{seed}"
            out.mkdir(parents=True)
            (out / "metrics.json").write_text(json.dumps({"selected": {"epoch": 1}}))
            (out / "log.jsonl").write_text(json.dumps({"type": "eval", "split": "val", "epoch": 1,
                                                       v2.OBJECTIVE: v}) + "\n")
    cols = ["loss", "seed", "same_run", "val_at_winner_settings"]
    # HBN: the winner's own run (same_run), never counted even where its value tops its other runs
    control = [{"loss": "HBN", "seed": 100, "same_run": True, "val_at_winner_settings": 0.65},
               {"loss": "contrastive", "seed": 100, "same_run": False, "val_at_winner_settings": 0.50},
               {"loss": "pml_arcface", "seed": 100, "same_run": False, "val_at_winner_settings": 0.55},  # above
               {"loss": "SM", "seed": 100, "same_run": False, "val_at_winner_settings": 0.38},  # below
               {"loss": "LN", "seed": 100, "same_run": False, "val_at_winner_settings": 0.59}]  # within
    bench.write_csv(runs / "control.csv", control, cols)
    assert bench.exploratory_losses(proto) == ["pml_arcface"]
    assert json.loads((runs / "exploratory" / "losses.json").read_text()) == {"losses": ["pml_arcface"]}
    control[4]["val_at_winner_settings"] = 0.61  # LN above every own run now: not what the runs were made for
    bench.write_csv(runs / "control.csv", control, cols)
    with pytest.raises(bench.ProtocolError, match="move that folder away"):
        bench.exploratory_losses(proto)

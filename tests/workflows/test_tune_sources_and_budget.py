"""deepmetric tune: a bad override named with the file (or the command line) it came from, the
first line of a rerun whose storage already meets the budget, and a storage that does not open
leaving the tune folder as it was."""
import json
import re

import pytest
import yaml

from conftest import free_port
from test_workflows_tune import SPACE, _files, _states

from deepmetric import cli
from deepmetric.workflows.tune import _setup_record, prepare_tune, run_tune
from deepmetric.workflows.tune_space import TuneError
from deepmetric.workflows.tune_study import open_study

optuna = pytest.importorskip("optuna")


@pytest.mark.parametrize("override, said", [
    ("train.epochs=abc", "config key 'train.epochs': expected int, got str 'abc'"),
    ("optim.lrr=0.1", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
    # an option name is checked before the first trial too (trial 0 failed on it, with Optuna's
    # traceback, after tune.json and the storage were written)
    ("loss.0.options.alphaa=2", "config key 'loss.0.options.alphaa': unknown option 'alphaa' for loss "
                                "'heated_softmax' (did you mean 'alpha'?)"),
    ("loss.5.weight=2", "index 5 out of range (list has 1 items)"),
    ("train.epochs=[1", "the value is not valid YAML (expected ',' or ']', but got '<stream end>' at the end of the value)"),
])
def test_a_bad_override_is_named_with_the_file_or_the_command_line_it_came_from(tmp_path, capsys, override, said):
    """A space file's bad override was blamed on the recipe (and 'optim.lrr' on params.optim.lr,
    named only in the suggestion); now the space file, its key 'overrides' and the value are
    named, or the command line for a KEY=VALUE of the command; one line (PyYAML's error had
    five), and nothing is created."""
    recipe, sp = _files(tmp_path, space={**SPACE, "overrides": ["eval.every=1", override]})
    out = tmp_path / "o"
    assert cli.main(["tune", str(recipe), "--space", str(sp), "--trials", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(recipe) not in err, err
    assert err.startswith(f"deepmetric tune: error: {sp}: overrides: ") and repr(override) in err and said in err, err
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(SPACE))
    assert cli.main(["tune", str(recipe), "--space", str(plain), "--trials", "1", "--out", str(out), override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(recipe) not in err and str(plain) not in err, err
    assert err.startswith("deepmetric tune: error: the command line: ") and repr(override) in err and said in err, err
    assert not out.exists()


def test_a_bad_value_of_the_recipe_itself_is_still_named_with_the_recipe(tmp_path):
    recipe, sp = _files(tmp_path, space={**SPACE, "overrides": ["eval.every=1"]})
    good = recipe.read_text()
    recipe.write_text(good.replace("epochs: 3", "epochs: abc"))
    with pytest.raises(TuneError, match=rf"^{re.escape(str(recipe))}: config key 'train.epochs': expected int"):
        prepare_tune(recipe, sp, trials=1, out=tmp_path / "o")
    # a parameter with a misspelt option name: the space file's parameter, before any trial
    recipe.write_text(good)
    sp.write_text(yaml.safe_dump({**SPACE, "params": {"loss.0.options.alphaa": {"type": "float", "low": 1, "high": 2}}}))
    with pytest.raises(TuneError, match=rf"^{re.escape(str(sp))}: params.loss.0.options.alphaa: config key "
                                        r"'loss.0.options.alphaa': unknown option 'alphaa'"):
        prepare_tune(recipe, sp, trials=1, out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def _stored_study(setup, states):
    """The study of ``setup`` with finished trials of ``states`` added straight to its storage
    (no training: a rerun that trained would add trials)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import TrialState, create_trial

    study = open_study(setup)
    dists = {"optim.lr": FloatDistribution(1e-4, 0.1, log=True),
             "loss.0.options.alpha": CategoricalDistribution([8.0, 16.0, 32.0])}
    for i, state in enumerate(states):
        complete = state == "COMPLETE"
        study.add_trial(create_trial(state=getattr(TrialState, state), value=0.5 + 0.01 * i if complete else None,
                                     params={"optim.lr": 0.01, "loss.0.options.alpha": 16.0}, distributions=dists,
                                     intermediate_values={1: 0.4}))
    return study


def test_a_rerun_with_a_smaller_budget_says_the_storage_holds_more_and_runs_nothing(tmp_path):
    """A finished tune rerun with a smaller --trials printed '1 trials finished or pruned wanted:
    3 finished ...', the smaller budget as if it were the study's. Nothing runs (the storage
    already meets the budget); the first line now says so, with what the storage holds."""
    recipe, sp = _files(tmp_path)
    out = tmp_path / "out"
    _stored_study(prepare_tune(recipe, sp, trials=3, out=out), ["COMPLETE", "COMPLETE", "PRUNED"])
    cases = [
        (dict(trials=1), "the storage already holds 3 finished or pruned trials (2 complete), more than the 1 asked "
                         "(--trials 1): no trial runs"),
        (dict(trials=3), "the storage already holds 3 finished or pruned trials (2 complete), as many as the 3 asked "
                         "(--trials 3): no trial runs"),
        (dict(trials=1, count="completed"), "the storage already holds 2 completed trials (3 finished or pruned), "
                                            "more than the 1 asked (--trials 1 --count completed): no trial runs"),
        (dict(trials=3, count="completed", max_trials=3), "the storage already holds 3 finished or pruned trials "
                                                          "(2 complete), as many as the cap of 3 (--max-trials 3)"),
    ]
    for kw, line in cases:
        said = []
        setup = prepare_tune(recipe, sp, out=out, **kw)
        run_tune(setup, log=said.append)
        assert said[0].startswith(line), said[0]
        assert said[0].endswith(f"0 running, 0 queued; storage {setup.storage}; objective validation recall@1 "
                                "(maximize)"), said[0]
        assert _states(open_study(setup, create=False)) == {"COMPLETE": 2, "PRUNED": 1}  # nothing ran
        assert not (out / "trials").exists() and (out / "trials.csv").is_file()
        # the rewritten outputs gave the smaller number as the tune's budget and best.yaml's
        # header said "1 trials" over a table of 3
        budget = next(x for x in (out / "trials.md").read_text().splitlines() if x.startswith("- budget: "))
        header = (out / "best.yaml").read_text().splitlines()[0]
        if kw["trials"] == 1:
            held = ("2 completed trials (3 finished or pruned)" if kw.get("count") == "completed"
                    else "3 trials finished or pruned (2 complete)")
            assert budget.endswith(f"asked by the command that wrote these outputs; the storage holds {held}, "
                                   "run by an earlier command with a larger budget"), budget
            assert f", {held}," in header, header
        else:
            assert budget == f"- budget: {setup.budget_text()}", budget
    # a budget not yet met: the line as before, and trials run
    said = []
    run_tune(prepare_tune(recipe, sp, out=out, trials=4), log=said.append)
    assert said[0].startswith("4 trials finished or pruned wanted: 3 finished or pruned (2 complete), 0 running")
    assert sum(_states(open_study(setup, create=False)).values()) == 4


def test_a_storage_that_does_not_open_leaves_the_tune_folder_as_it_was(tmp_path, capsys):
    """tune.json was written before the storage opened: a URL that does not open overwrote a good
    tune.json with the set-up of a tune that never ran (and removed the drain mark), or made a
    new folder holding only tune.json. Now the folder is left byte for byte as it was."""
    recipe, sp = _files(tmp_path)
    out = tmp_path / "out"
    _stored_study(prepare_tune(recipe, sp, trials=3, out=out), ["COMPLETE"])
    (out / "tune.json").write_text(json.dumps(_setup_record(prepare_tune(recipe, sp, trials=3, out=out)), indent=1))
    (out / "DRAIN").touch()
    (tmp_path / "afile").write_text("x")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    urls = {f"postgresql://me:secret@127.0.0.1:{free_port()}/db": r"--storage postgresql://me:\*\*\*@.* cannot be opened",
            f"sqlite:///{tmp_path}": r"--storage sqlite:///.* cannot be opened \(unable to open database file\)",
            f"sqlite:///{tmp_path / 'afile' / 'x' / 't.db'}":
                rf"storage sqlite:///.*t.db: its folder {re.escape(str(tmp_path / 'afile' / 'x'))} cannot be created"}
    for url, said in urls.items():
        for folder in (out, tmp_path / "new"):
            assert cli.main(["tune", str(recipe), "--space", str(sp), "--trials", "5", "--out", str(folder),
                             "--storage", url]) == 2
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and re.search(said, err) and "secret" not in err, err
            assert {p.name: p.read_bytes() for p in out.iterdir()} == before
            assert not (tmp_path / "new").exists()

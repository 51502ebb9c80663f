"""KEY=VALUE overrides anywhere on the command line (issue 32, item 15): after options too, for
every command that takes them; any other stray token is still a one-line error."""
import json

import pytest
import yaml

from conftest import synthetic_config

from deepmetric.cli import build_parser, main, parse_command_line

optuna = pytest.importorskip("optuna")


def _parse(line: str):
    return parse_command_line(build_parser(), line.split())


@pytest.mark.parametrize("line, want", [
    ("tune R.yaml --space S.yaml --trials 5 --out D train.epochs=3", ["train.epochs=3"]),
    ("tune R.yaml a=1 --space S.yaml --trials 5 b=2 --workers 2 c.d=3", ["a=1", "b=2", "c.d=3"]),
    ("train C.yaml --overwrite optim.lr=0.1", ["optim.lr=0.1"]),
    ("train C.yaml loss.0.options.alpha=8 --resume L.pt train.epochs=2", ["loss.0.options.alpha=8", "train.epochs=2"]),
    ("demo --quick train.epochs=1", ["train.epochs=1"]),
    ("demo --out D --keep train.epochs=1 eval.every=1", ["train.epochs=1", "eval.every=1"]),
    ("study S.yaml --set a=1 --workers 2 b=2", ["a=1", "b=2"]),
])
def test_overrides_after_options_are_kept_in_order(line, want):
    assert _parse(line).overrides == want


@pytest.mark.parametrize("line, expected", [
    ("train C.yaml --overwite", "unrecognized argument(s): --overwite (expected a known option or a KEY=VALUE override"),
    ("tune R.yaml --space S --trials 5 --out D epochs", "unrecognized argument(s): epochs (expected a known option or"),
    ("tune R.yaml --space S --trials 5 --workers=2x", "argument --workers: invalid int value"),
    ("report RUN x=1", "unrecognized argument(s): x=1 (expected a known option; see --help)"),
    ("evaluate e.npz --seed 1 a.b=2", "unrecognized argument(s): a.b=2 (expected a known option;"),
])
def test_a_token_that_is_neither_an_option_nor_an_override_is_a_clear_error(line, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(line)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"deepmetric {line.split()[0]}: error: ")


def test_train_overwrite_then_an_override_runs_with_it(tmp_path):
    """The issue's 'deepmetric train CFG --overwrite KEY=VAL' (was: unrecognized arguments)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(synthetic_config(tmp_path / "run", eval={"baselines": False})))
    assert main(["train", str(cfg)]) == 0
    assert main(["train", str(cfg), "--overwrite", "train.epochs=1"]) == 0
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["epochs"] == 1
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"] == 1


def test_tune_with_an_override_after_the_options(tmp_path):
    """The issue's 'deepmetric tune RECIPE --space S --trials N --out D train.epochs=3'."""
    raw = synthetic_config(classes=8, data={"val_classes": 0.4}, train={"epochs": 3})
    del raw["train"]["progress"]  # the recipe's default (progress bars on)
    recipe, space, out = tmp_path / "r.yaml", tmp_path / "s.yaml", tmp_path / "tune"
    recipe.write_text(yaml.safe_dump(raw))
    space.write_text(yaml.safe_dump({"objective": {"metric": "recall@1"},
                                     "params": {"optim.lr": {"type": "float", "low": 0.01, "high": 0.1}}}))
    args = ["tune", str(recipe), "--space", str(space), "--trials", "1", "--out", str(out), "train.epochs=1"]
    assert main(args + ["train.progress=false", "optim.momentum=0.5"]) == 0
    assert json.loads((out / "tune.json").read_text())["overrides"] == ["train.epochs=1", "train.progress=false",
                                                                        "optim.momentum=0.5"]
    trial = yaml.safe_load((out / "trials" / "trial_0000" / "config.yaml").read_text())
    assert trial["train"]["epochs"] == 1 and trial["optim"]["momentum"] == 0.5


def test_best_yaml_undoes_and_names_the_short_run_settings(tmp_path):
    """Issue 32, item 17: best.yaml kept the tune's 'train.epochs=3' and 'progress off' silently."""
    test_tune_with_an_override_after_the_options(tmp_path)
    text = (tmp_path / "tune" / "best.yaml").read_text()
    best = yaml.safe_load(text)
    assert best["train"]["epochs"] == 3 and "progress" not in best["train"]  # the recipe's own
    assert best["optim"]["momentum"] == 0.5  # an override that is no short-run setting stays
    head = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert any("NOT in this file" in ln for ln in head)
    assert any("train.epochs=1 (recipe: 3), train.progress=false (recipe: default)" in ln for ln in head), head

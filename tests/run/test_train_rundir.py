"""Run directories are safe: a new run refuses a non-empty directory unless --overwrite or
--resume; a mismatched --resume names the differing config keys in one paragraph; a run
directory given as a checkpoint gets a hint; checkpoints get the user's normal file mode."""
import json
import os
import stat

import pytest
import torch
import yaml

from deepmetric import cli
from deepmetric.run import checkpoint as ck
from deepmetric.train.state import CheckpointMismatchError
from deepmetric.run.config_io import config_diff, config_from_dict
from deepmetric.run.rundir import RunDirectoryError
from deepmetric.train.loop import train
from conftest import synthetic_config
from deepmetric.run.rundir import read_log


def _raw(out_dir, **model_options):
    return synthetic_config(out_dir, per_class=8, hidden=16, model={"options": model_options},
                            train={"epochs": 2, "batch_size": 12})


def _steps(log):
    return [r["step"] for r in read_log(log, type="step")]


def test_new_run_refuses_a_non_empty_run_directory(tmp_path):
    run = tmp_path / "run"
    train(config_from_dict(_raw(run)))
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    with pytest.raises(RunDirectoryError) as exc:
        train(config_from_dict(_raw(run)))
    msg = str(exc.value)
    assert f"run directory {run} is not empty" in msg and "last.pt" in msg
    assert f"--resume {run / 'last.pt'}" in msg and "--overwrite" in msg and "\n" not in msg
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before  # nothing touched


def test_overwrite_starts_afresh_and_resume_is_allowed(tmp_path):
    run = tmp_path / "run"
    raw = _raw(run)
    raw["data"]["val_classes"] = 2  # the first run leaves a best.pt
    train(config_from_dict(raw))
    assert (run / "best.pt").is_file()
    (run / "notes.txt").write_text("mine")
    res = train(config_from_dict(_raw(run)), overwrite=True)  # no validation split now
    assert _steps(run / "log.jsonl") == list(range(1, res.iteration + 1))  # one run's steps only
    assert not (run / "best.pt").exists()  # the old run's best.pt would be misleading
    assert (run / "notes.txt").read_text() == "mine"  # only run files are removed
    assert json.loads((run / "metrics.json").read_text())["selected"] is None
    # --resume into the same directory is fine
    raw2 = _raw(run)
    raw2["train"]["epochs"] = 3
    again = train(config_from_dict(raw2), resume=run / "last.pt")
    assert again.epochs_completed == 3
    assert _steps(run / "log.jsonl") == list(range(1, again.iteration + 1))  # continued, no step twice


def test_cli_refuses_then_overwrites(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_raw(tmp_path / "run")))
    assert cli.main(["train", str(cfg)]) == 0
    assert cli.main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--overwrite" in err
    assert cli.main(["train", str(cfg), "--overwrite"]) == 0
    assert "--overwrite" in cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()


def test_resume_with_another_model_names_the_differing_keys(tmp_path):
    train(config_from_dict(_raw(tmp_path / "run")))
    cfg = config_from_dict(_raw(tmp_path / "other", embedding_dim=16))
    with pytest.raises(CheckpointMismatchError) as exc:
        train(cfg, resume=tmp_path / "run" / "last.pt")
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 1200, msg  # one paragraph, not a traceback of 80 keys
    assert "different model or config" in msg
    assert "model.options.embedding_dim 8 -> 16" in msg and "train.out_dir" in msg
    assert "head.weight [8, 16] -> [16, 16]" in msg


def test_resume_with_other_classes_names_the_loss_state(tmp_path):
    train(config_from_dict(_raw(tmp_path / "run")))
    raw = _raw(tmp_path / "other")
    raw["data"]["options"]["num_classes"] = 5
    with pytest.raises(CheckpointMismatchError, match=r"data.options.num_classes 6 -> 5.*loss term 0.*weight \[6, 8\] -> \[5, 8\]"):
        train(config_from_dict(raw), resume=tmp_path / "run" / "last.pt")


def test_a_run_directory_given_as_checkpoint_gets_a_hint(tmp_path, capsys):
    run = tmp_path / "run"
    train(config_from_dict(_raw(run)))
    with pytest.raises(IsADirectoryError, match=rf"{run} is a run directory.*did you mean {run / 'last.pt'}\?"):
        ck.load_checkpoint(run)
    with pytest.raises(IsADirectoryError, match="holds no last.pt"):
        ck.load_checkpoint(tmp_path)
    assert cli.main(["embed", str(run), "--out", str(tmp_path / "e.npz")]) == 2
    assert f"did you mean {run / 'last.pt'}" in capsys.readouterr().err


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_checkpoints_get_the_users_file_mode(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = ck.save_checkpoint({"model": {"w": torch.ones(2)}, "config": {}}, tmp_path / "x.pt")
        train(config_from_dict(_raw(tmp_path / "run")))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "run" / "last.pt").stat().st_mode) == mode


def test_config_diff_lists_changed_keys():
    a = config_from_dict(_raw("a"))
    b = config_from_dict(_raw("b", embedding_dim=4))
    b.loss[0].options["alpha"] = 8.0
    assert config_diff(a, b) == [("loss.0.options.alpha", 16.0, 8.0),
                                 ("model.options.embedding_dim", 8, 4), ("train.out_dir", "a", "b")]
    assert config_diff(a, a) == []


def test_overwrite_removes_nothing_when_the_new_run_fails_while_it_is_built(tmp_path):
    """--overwrite replaces the old run only once the new one has been built: a new config that
    fails on its data (a batch larger than the split) or its model leaves every old file as it
    was; a config that builds replaces them."""
    run = tmp_path / "run"
    train(config_from_dict(_raw(run)))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    for bad in ({"train": {"batch_size": 100_000}}, {"model": {"options": {"embedding_dim": -8}}}):
        raw = _raw(run)
        for section, values in bad.items():
            for key, value in values.items():
                if isinstance(value, dict):
                    raw[section].setdefault(key, {}).update(value)
                else:
                    raw[section][key] = value
        with pytest.raises((ValueError, RuntimeError)):
            train(config_from_dict(raw), overwrite=True)
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before, bad
    for key, value, message in (("optim.lr", float("nan"), "'optim.lr': must be a finite number"),
                                ("train.seed", -1, "'train.seed': must be an integer in 0 .. 4294967295")):
        raw = _raw(run)
        section, name = key.split(".")
        raw[section][name] = value
        with pytest.raises(ValueError, match=message):
            train(config_from_dict(raw), overwrite=True)
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before, key
    res = train(config_from_dict(_raw(run)), overwrite=True)
    assert _steps(run / "log.jsonl") == list(range(1, res.iteration + 1))  # replaced: one run's steps only


def test_resume_of_a_missing_file_says_so(tmp_path, capsys):
    """--resume of a path that is not there is named as missing (not as another run's
    checkpoint, as it was in a non-empty folder), and the folder is untouched."""
    run = tmp_path / "run"
    train(config_from_dict(_raw(run)))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(_raw(run)))
    for missing, needle in ((tmp_path / "nosuch.pt", "no such file"), (tmp_path, "not a file")):
        assert cli.main(["train", str(cfg), "--resume", str(missing)]) == 2
        err = capsys.readouterr().err
        assert f"--resume {missing}: {needle}" in err and "another run" not in err and err.count("\n") == 1, err
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_an_atomic_write_that_fails_names_the_file_asked_for(tmp_path):
    from deepmetric.run.rundir import write_text_atomic

    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "m.json"  # its folder is a file: the write fails
    with pytest.raises(OSError) as exc:
        write_text_atomic(target, "{}")
    assert str(exc.value).startswith(f"{target}: cannot write there (") and ".tmp" not in str(exc.value)
    write_text_atomic(tmp_path / "ok.json", "{}")
    assert (tmp_path / "ok.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ok.json"]

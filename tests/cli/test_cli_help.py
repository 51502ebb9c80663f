"""The command line speaks to new users: every sub-command's --help has runnable examples and
describes every option; 'deepmetric train' without arguments says what it needs; an error in
a data-loader worker is one line naming the file and the reason."""
import argparse
import re
import shlex

import numpy as np
import pytest
from PIL import Image

from deepmetric.cli import build_parser, main


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


@pytest.mark.parametrize("name", sorted(_subparsers()))
def test_every_subcommand_help_has_examples_and_describes_every_option(name):
    sub = _subparsers()[name]
    text = sub.format_help()
    assert "examples:" in text or "example:" in text, f"'deepmetric {name} --help' has no examples"
    for action in sub._actions:
        if action.dest == "help" or isinstance(action, argparse._SubParsersAction):
            continue  # nested sub-commands are described by their own parsers
        assert action.help and action.help.strip(), f"deepmetric {name}: option {action.dest!r} has no help"
    tail = re.split(r"examples?:", text)[-1]
    ours = [part.strip() for line in tail.splitlines() for part in re.split(r"&&|;", line.split("#")[0])
            if part.strip().startswith("deepmetric ")]
    assert ours, text
    for line in ours:  # every example is a valid command line for this parser
        args = build_parser().parse_args(shlex.split(line)[1:])
        assert args.command in _subparsers()


def test_top_level_help_has_examples_that_parse():
    text = build_parser().format_help()
    lines = [line.split("#")[0].strip() for line in text.split("examples:")[-1].splitlines()]
    lines = [line for line in lines if line.startswith("deepmetric ")]
    assert len(lines) >= 5, text
    for line in lines:
        assert build_parser().parse_args(shlex.split(line)[1:]).command in _subparsers()


def test_train_without_arguments_says_what_is_needed(capsys):
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert "give a YAML config and/or KEY=VALUE overrides" in err
    assert "train.epochs=N" in err and "deepmetric train recipes/own_folder.yaml" in err
    assert "Traceback" not in err


def test_train_with_overrides_only_uses_the_defaults(capsys, tmp_path):
    """No config file: the first KEY=VALUE is an override, and the config error names the key."""
    assert main(["train", "data.name=synthetic", "model.name=synthetic_mlp"]) == 2
    err = capsys.readouterr().err
    assert "give exactly one of 'train.epochs' and 'train.iterations'" in err


def _truncated_jpeg(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header is intact, the pixels are cut off


def test_worker_error_is_unwrapped_to_the_workers_message(tmp_path):
    from deepmetric.data import build_dataset, make_loader
    from deepmetric.data.loader import worker_error_message

    for c in ("a", "b"):
        (tmp_path / "d" / c).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "d" / c / "0.png")
    bad = tmp_path / "d" / "b" / "1.jpg"
    _truncated_jpeg(bad)
    ds = build_dataset("folder", tmp_path / "d", split="all", verify="open")  # the header check passes
    loader = make_loader(ds, batch_size=3, num_workers=1)
    with pytest.raises(OSError) as exc:
        list(loader)
    assert "Original Traceback" in str(exc.value)  # what torch gives
    msg = worker_error_message(exc.value)
    assert msg.startswith(f"folder: cannot read image {bad}: not an image that can be decoded (image file is truncated")
    assert "Traceback" not in msg and "File \"" not in msg
    assert worker_error_message(ValueError("plain")) is None


def test_index_export_and_migrate_are_named_as_typed(tmp_path, capsys):
    """'deepmetric index export' is parsed as the sub-command index-export; its usage, its
    argparse errors and its one-line errors say 'index export', as the user typed it."""
    with pytest.raises(SystemExit):
        main(["index", "export", str(tmp_path)])  # --to missing: argparse's error
    assert "deepmetric index export: error: the following arguments are required: --to" in capsys.readouterr().err
    assert main(["index", "export", str(tmp_path / "none"), "--to", f"parquet:{tmp_path / 'a.parquet'}"]) == 2
    assert capsys.readouterr().err.startswith("deepmetric index export: error: index folder ")
    assert main(["index", "migrate", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("deepmetric index migrate: error: ")
    with pytest.raises(SystemExit):
        main(["index", "migrate", "--help"])
    assert capsys.readouterr().out.startswith("usage: deepmetric index migrate ")

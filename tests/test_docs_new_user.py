"""What a new user reads agrees with itself and with the project (issue 32, items 13, 17, 18):
every recipe the docs name exists, the demo's time is the same in --help and README, `mlflow ui`
comes with the install command it needs, the default demo is not called the glyph demo, and the
multi-machine and shared-tune set-ups are documented with their commands."""
import re
from pathlib import Path

from deepmetric.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_every_recipe_the_docs_name_exists():
    missing = [(p.name, r) for p in DOCS for r in re.findall(r"recipes/\w[\w/.-]*\.yaml", _text(p))
               if not (ROOT / r).is_file()]
    assert missing == []


def test_the_demo_time_is_the_same_in_help_and_readme():
    readme = re.search(r"about (\d+) minutes on 2 idle cores", _text(ROOT / "README.md"))
    parent_help = " ".join(build_parser().format_help().split())  # the commands' one-line helps, unwrapped
    helps = re.findall(r"about (\d+) minutes on 2 idle cores", parent_help)
    assert readme and helps == [readme.group(1)], (readme, helps)


def test_mlflow_ui_comes_with_the_full_mlflow_install():
    pin = re.search(r'"mlflow-skinny==([\d.]+)"', _text(ROOT / "pyproject.toml")).group(1)
    seen = 0
    for path in DOCS:
        lines = _text(path).splitlines()
        for i, line in enumerate(lines):
            if line.lstrip("$ ").startswith("mlflow ui"):
                before = "\n".join(lines[max(0, i - 3):i])
                assert f"pip install mlflow=={pin}" in before, (path.name, i + 1)
                seen += 1
    assert seen, "no 'mlflow ui' line in the docs: this guard checks nothing (update it with the docs)"


def test_the_default_demo_is_not_called_the_glyph_demo():
    seen = 0
    for path in DOCS:
        for line in _text(path).splitlines():
            if re.match(r"\s*deepmetric demo\s*(#|$)", line):
                assert "glyph" not in line, (path.name, line)
                seen += 1
    assert seen, "no 'deepmetric demo' line in the docs: this guard checks nothing (update it with the docs)"


def test_several_machines_are_documented_with_commands():
    training, tuning = _text(ROOT / "docs" / "training.md"), _text(ROOT / "docs" / "tuning.md")
    for needle in ("--nnodes 2", "--node_rank 1", "--rdzv_endpoint", "only global rank 0", "per-node"):
        assert needle in training, needle
    for needle in ("initdb -D", "pg_ctl -D", "createdb -h", "createuser", "--storage postgresql://",
                   "pg_hba.conf", "OUT/trials/trial_NNNN/", "interrupted"):
        assert needle in tuning, needle

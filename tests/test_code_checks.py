"""The layers contract (import-linter) and the linter (ruff) run with the test suite, so CI fails
when an import goes up a layer (docs/architecture.md) or ruff flags a likely bug."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: install.sh installs it with the dev extra")
    return str(path)


def test_the_layers_contract_holds():
    r = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "Contracts: 1 kept, 0 broken" in r.stdout


def test_ruff_finds_nothing():
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", "src", "tests", "bench"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_the_contract_catches_an_upward_import(tmp_path):
    """The check itself can fail: a copy of the package with one upward import (train -> report)
    breaks the contract."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "src" / "deepmetric", src / "deepmetric",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (src / "deepmetric" / "train" / "upward.py").write_text("from deepmetric.report import make_report  # noqa: F401\n")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    env = {"PYTHONPATH": str(src), "PATH": str(BIN)}
    r = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode != 0
    assert "deepmetric.train is not allowed to import deepmetric.report" in r.stdout
    assert "deepmetric.train.upward -> deepmetric.report" in r.stdout

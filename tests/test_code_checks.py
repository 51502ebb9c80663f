"""The layers contract (import-linter) and the linter (ruff) run with the test suite, so CI fails
when an import goes up a layer (docs/architecture.md) or ruff flags a likely bug; and the size
rules of issue 31 (no function over 80 lines, no module over 600) and its one suggestion."""
import ast
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
    assert "Contracts: 2 kept, 0 broken" in r.stdout


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


def test_report_and_search_never_import_train(tmp_path):
    """The second contract: search (or report) reading anything of train/ breaks it, although
    train is below them in the layers."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "src" / "deepmetric", src / "deepmetric",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (src / "deepmetric" / "search" / "sneak.py").write_text("from deepmetric.train import loop  # noqa: F401\n")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    r = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": str(src), "PATH": str(BIN)})
    assert r.returncode != 0
    assert "deepmetric.search is not allowed to import deepmetric.train" in r.stdout


MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 600


def too_long(path: Path) -> list[str]:
    """Functions over MAX_FUNCTION_LINES (def line to last line, docstring included) and a
    module over MAX_MODULE_LINES, as ``path:line name (N lines)``."""
    text = path.read_text(encoding="utf-8")
    out = []
    if len(text.splitlines()) > MAX_MODULE_LINES:
        out.append(f"{path}: module ({len(text.splitlines())} lines)")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_80_lines_and_no_module_over_600(tmp_path):
    found = [hit for p in sorted((REPO / "src").rglob("*.py")) for hit in too_long(p)]
    assert found == [], "\n".join(found)
    # the measure itself: an 81-line function and a 601-line module are caught, 80 / 600 are not
    body = "def f():\n" + "    x = 1\n" * 79
    (tmp_path / "ok.py").write_text(body + "\n" * (600 - 80))
    (tmp_path / "long.py").write_text(body + "    x = 2\n")
    (tmp_path / "big.py").write_text("x = 1\n" * 601)
    assert too_long(tmp_path / "ok.py") == []
    assert [h.split()[-3] for h in too_long(tmp_path / "long.py")] == ["f"]
    assert too_long(tmp_path / "big.py") == [f"{tmp_path / 'big.py'}: module (601 lines)"]


def test_the_closest_name_suggestion_is_written_once():
    """Every "did you mean" comes from deepmetric.registry (did_you_mean / suggest)."""
    hits = [str(p.relative_to(REPO)) for p in sorted((REPO / "src").rglob("*.py"))
            if "did you mean" in p.read_text(encoding="utf-8").lower()]
    assert hits == ["src/deepmetric/registry.py"]


def test_a_missing_optional_package_is_always_the_cli_s_one_line_error():
    """An ImportError the package raises itself names a package to install, so it must be a
    MissingPackageError (the CLI keeps the traceback of any other ImportError)."""
    import re

    plain = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "src").rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"raise ImportError\b", line)]
    assert plain == []
    raised = [p for p in (REPO / "src").rglob("*.py") if "raise MissingPackageError(" in p.read_text(encoding="utf-8")]
    assert len(raised) >= 5  # the check above reads the files it should


def _machine_paths(text: str) -> list[str]:
    """Absolute paths under the folders a machine keeps its work in (``/work/...``, ``/home/...``,
    ``/tmp/...``, ...), not inside a URL or a relative path."""
    import re

    roots = "work|home|tmp|root|Users|mnt|scratch|private|var/folders"
    return re.findall(rf"(?<![\w.~:/-])/(?:{roots})/[^\s\"'`)|,;]+", text)


def test_committed_results_hold_no_machine_paths():
    """Committed results (bench/results/, bench/studies/: every data file, report and table, not
    the READMEs' prose, which may name a machine's folder on purpose) give paths relative to the
    repository: a path of the machine a result ran on says nothing to a reader (issue 30)."""
    assert _machine_paths("checkpoint /work/main/runs/demo/last.pt; ok runs/demo/last.pt") == [
        "/work/main/runs/demo/last.pt"]  # the check finds what it is for
    assert _machine_paths("see https://example.org/home/x and runs/tmp/y and sqlite:///runs/t.db") == []
    files = subprocess.run(["git", "ls-files", "bench/results", "bench/studies"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    found = []
    for name in files:
        path = REPO / name
        if path.name == "README.md" or path.suffix in (".png", ".svg", ".db") or not path.is_file():
            continue
        hits = _machine_paths(path.read_text(encoding="utf-8", errors="replace"))
        found += [f"{name}: {h}" for h in hits[:3]]
    assert len(files) > 100 and not found, found[:20]

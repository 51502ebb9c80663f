"""No module imports a private name (``_x``) of another deepmetric package.

A package (``deepmetric.data``, ``deepmetric.models``, ...) offers its public names to the
others; its ``_x`` names and ``_x`` modules are its own.  Checked on the source text (the
AST), so a new ``from deepmetric.models import _MODELS`` or ``registry._OPTIONS`` fails here.
"""
import ast
from pathlib import Path

import deepmetric

SRC = Path(deepmetric.__file__).resolve().parent.parent  # the folder that holds deepmetric/


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])  # deepmetric.data.registry -> deepmetric.data


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path) -> list[str]:
    """``"line: what"`` for every private name of another package that ``path`` uses."""
    module = _module_name(path)
    is_package = path.name == "__init__.py"
    found, bound = [], {}  # bound: local name -> the deepmetric module / object it stands for
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("deepmetric"):
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                bound[alias.asname or alias.name] = full
                if _package(full) != _package(module) and any(map(_private, full.split(".")[1:])):
                    found.append(f"{node.lineno}: from {target} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("deepmetric"):
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "deepmetric"
                    if _package(alias.name) != _package(module) and any(map(_private, alias.name.split(".")[1:])):
                        found.append(f"{node.lineno}: import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                full = ".".join([bound[value.id], *reversed(chain), node.attr])
                if _package(full) != _package(module):
                    found.append(f"{node.lineno}: {full}")
    return found


def test_no_module_imports_a_private_name_of_another_package():
    found = {str(p.relative_to(SRC)): use for p in sorted((SRC / "deepmetric").rglob("*.py"))
             if (use := private_uses(p))}
    assert found == {}


def test_the_check_finds_private_uses(tmp_path, monkeypatch):
    # the check itself can fail: a module of deepmetric.train reading private names of data and models
    pkg = tmp_path / "deepmetric" / "train"
    pkg.mkdir(parents=True)
    bad = pkg / "bad.py"
    bad.write_text("from deepmetric.data.transforms import _BUILDERS, list_transforms\n"
                   "from deepmetric.evaluate._checks import check_embeddings\n"
                   "from deepmetric import models as M\n"
                   "from .config import _own_private\n"
                   "from deepmetric.data import registry\n"
                   "x = M._MODELS, registry._OPTIONS, M.list_models, M.__name__\n")
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    assert private_uses(bad) == [
        "1: from deepmetric.data.transforms import _BUILDERS",
        "2: from deepmetric.evaluate._checks import check_embeddings",
        "6: deepmetric.models._MODELS",
        "6: deepmetric.data.registry._OPTIONS",
    ]

"""Every global name the package's modules read is defined: a kernel dispatched only on
another CPU (the AVX512-VNNI paths, which this machine may skip) must not call a function
that is gone. A static check over the source, so it covers the code paths no test here runs."""
from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest

from conftest import REPO_ROOT

PACKAGES = ("ggmlpy", "llamapy")
MODULES = sorted(p for pkg in PACKAGES for p in (REPO_ROOT / pkg).rglob("*.py"))


def _bound_anywhere(tree: ast.AST) -> set[str]:
    """Names the module binds in any scope: assignments, parameters, definitions, imports,
    loop, with and except targets (a name read in a scope that binds it is not a global)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_name_read_is_defined(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = importlib.import_module(_module_name(path))
    known = _bound_anywhere(tree) | set(dir(module)) | set(dir(builtins))
    unknown = sorted({n.id for n in ast.walk(tree)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in known})
    assert unknown == [], f"{path.name} reads names nothing defines"

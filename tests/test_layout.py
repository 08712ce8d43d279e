"""The library's shape: small modules, private names kept private, folders that import one way.

Host-only checks over the source tree (``ast``, no imports of the library).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "graphbucket"
MAX_MODULE_LINES = 450


def modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(LIBRARY.rglob("*.py"))}


def imported_names(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from graphbucket... import name`` in ``path``."""
    return [(node.module, alias.name) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module
            and node.module.startswith("graphbucket") for alias in node.names]


def test_every_library_module_is_at_most_450_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_MODULE_LINES} == {}


def test_no_private_name_is_imported_from_another_module():
    crossing = [(name, module, imported) for name, path in modules().items()
                for module, imported in imported_names(path)
                if imported.startswith("_") and module != name]
    assert crossing == []


def folder(module: str, names: dict[str, Path]) -> str:
    """The package a module lives in (a package's __init__ belongs to its own package)."""
    if names[module].name == "__init__.py":
        return module
    return module.rpartition(".")[0]


def test_subpackages_import_each_other_one_way():
    # The top-level package holds the core (plans, ladders, buffers, the runner) that every
    # subpackage builds on; between subpackages each arrow goes one way only.
    names = modules()
    arrows = set()
    for name, path in names.items():
        for module, imported in imported_names(path):
            full = f"{module}.{imported}"
            target = full if full in names else module
            if target not in names:
                continue
            a, b = folder(name, names), folder(target, names)
            if a != b and a != "graphbucket" and b != "graphbucket":
                arrows.add((a, b))
    both_ways = sorted((a, b) for a, b in arrows if (b, a) in arrows and a < b)
    assert both_ways == []
    assert ("graphbucket.sparse", "graphbucket.models") not in arrows  # models build on sparse

"""The Python floor that pyproject.toml states (``requires-python = ">=X.Y"``) is the one the code
needs: every source file parses with X.Y's grammar, imports no standard module newer than X.Y, and
the interpreter running the tests satisfies it."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("interp", "analyses", "tests", "benchmarks")
# Standard modules added since Python 3.8, with the version that added them ("What's New in Python").
NEW_STANDARD_MODULES = {"graphlib": (3, 9), "zoneinfo": (3, 9), "tomllib": (3, 11)}


def python_floor() -> tuple[int, int]:
    """(major, minor) of pyproject.toml's ``requires-python = ">=X.Y"``."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", requires.strip())
    assert match, f"requires-python = {requires!r}; this test reads only the form '>=X.Y'"
    return int(match[1]), int(match[2])


def sources() -> list[Path]:
    """Every .py file of the source directories (each must have some, or the test checks nothing)."""
    found = {directory: sorted((ROOT / directory).rglob("*.py")) for directory in SOURCE_DIRS}
    assert all(found.values()), f"no .py files under {[d for d, paths in found.items() if not paths]}"
    return [path for paths in found.values() for path in paths]


def imported_modules(tree: ast.Module) -> set[str]:
    """Top-level names of the absolute imports anywhere in ``tree``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_interpreter_meets_the_floor():
    assert sys.version_info[:2] >= python_floor()


def test_sources_need_nothing_newer_than_the_floor():
    floor = python_floor()
    problems = []
    for path in sources():
        name = path.relative_to(ROOT)
        try:
            tree = ast.parse(path.read_text(), filename=str(name), feature_version=floor)
        except SyntaxError as error:
            problems.append(f"{name}:{error.lineno}: {error.msg}")
            continue
        problems += [f"{name}: imports {module} (Python {'.'.join(map(str, NEW_STANDARD_MODULES[module]))})"
                     for module in sorted(imported_modules(tree))
                     if NEW_STANDARD_MODULES.get(module, floor) > floor]
    assert not problems, f"pyproject.toml says Python >= {floor[0]}.{floor[1]}, but:\n" + "\n".join(problems)

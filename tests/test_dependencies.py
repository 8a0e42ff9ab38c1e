"""What a plain `pip install .` brings is what interp imports (issue 43.1).

`make setup` installs every extra, and the tracr extra's jax brought scipy along, so an import of
scipy that no dependency declared went unseen until a user ran `pip install .` and every command died.
Two checks close that door: (1) every third-party module imported by `interp` and `analyses` is a
declared dependency, read from pyproject.toml and the installed distributions' metadata (at module
level, a core dependency; inside a function, a core dependency or an extra's, the extras' own
lazy-import rule); (2) the CLI runs in a subprocess that can import only the core dependencies and
what they require, as in a fresh venv with `pip install .` after torch.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Mapping

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("interp", "analyses")
# Modules that exist for one extra alone, imported only inside functions elsewhere (checked below):
# their module-level imports may be that extra's.
EXTRA_MODULES = {"analyses/studies/on_ray.py": "ray"}


def distribution_name(requirement: str) -> str:
    """'transformer-lens>=4.3,<5' -> 'transformer-lens' (normalised: lower case, '-' for '_' and '.')."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; (]", requirement.strip(), maxsplit=1)[0]).lower()


def declared() -> tuple[set[str], set[str]]:
    """(core dependencies, every extra's dependencies) as normalised distribution names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = {distribution_name(d) for d in project["dependencies"]}
    extras = {distribution_name(d) for group in project["optional-dependencies"].values() for d in group}
    return core, extras


def closure(names: set[str]) -> set[str]:
    """The distributions ``names`` require, transitively (their metadata's requirements without an
    extra marker): what `pip install` of ``names`` puts in a venv."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            todo += [distribution_name(r) for r in (md.requires(name) or []) if "extra ==" not in r]
        except md.PackageNotFoundError:
            pass
    return found


@functools.cache
def installed() -> Mapping[str, list[str]]:
    """Top-level module -> the installed distributions that provide it."""
    return md.packages_distributions()


def providers(module: str) -> set[str]:
    """The installed distributions that provide the top-level ``module``."""
    return {re.sub(r"[-_.]+", "-", d).lower() for d in installed().get(module, [module])}


def guarded(node: ast.AST, parents: dict) -> bool:
    """Whether an import sits inside ``try: ... except ImportError`` (or ModuleNotFoundError)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            return True
    return False


def third_party_imports() -> list[tuple[str, str, bool]]:
    """(file, top-level module, at module level) for every unguarded third-party import in our packages."""
    found = []
    for package in OURS:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in OURS or guarded(node, parents):
                        continue
                    found.append((str(path.relative_to(ROOT)), top, parents.get(node) is tree))
    return found


def test_every_imported_module_is_a_declared_dependency():
    core, extras = declared()
    imports = third_party_imports()
    assert {top for _, top, _ in imports} >= {"torch", "transformer_lens", "pandas"}  # the scan sees imports
    undeclared = sorted({f"{file}: {top}" for file, top, module_level in imports
                         if not providers(top) & (core if module_level and file not in EXTRA_MODULES else core | extras)})
    assert not undeclared, ("imported but not declared in pyproject.toml (at module level: a core dependency; "
                            f"inside a function: core or an extra): {undeclared}")


# Run in a subprocess: every top-level module that no allowed distribution provides is marked absent
# (None in sys.modules: `import` raises ModuleNotFoundError and importlib.util.find_spec answers None,
# as for a module that is not installed, so libraries that probe for optional modules behave as in a
# fresh venv).
_BLOCKER = """
import importlib.metadata as md, re, sys
allowed = set(sys.argv[1].split(","))
norm = lambda d: re.sub(r"[-_.]+", "-", d).lower()
for top, owners in md.packages_distributions().items():
    if top not in sys.stdlib_module_names and top not in ("interp", "analyses") \\
            and not {norm(d) for d in owners} & allowed:
        sys.modules[top] = None
from analyses.cli import main
for command in sys.argv[2].split(";"):  # each command's words, space-separated; one process for all
    try:
        status = main(command.split())
    except SystemExit as done:  # --help exits
        status = done.code
    if status:
        sys.exit(f"interp {command} exited with {status}")
"""


def run_with_core_only(*commands: str) -> subprocess.CompletedProcess:
    core, _ = declared()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", _BLOCKER, ",".join(sorted(closure(core))), ";".join(commands)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_extra_modules_are_imported_lazily():
    """An extra's own module is never imported at module level by another of our modules."""
    dotted = {file[:-3].replace("/", ".") for file in EXTRA_MODULES}
    for package in OURS:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                assert not set(names) & dotted, f"{path.relative_to(ROOT)} imports an extra's module at module level"


def test_the_blocker_refuses_what_only_an_extra_brings():
    """The subprocess would catch an undeclared import: scipy (the tracr extra's) cannot be imported there."""
    core, extras = declared()
    assert "scipy" not in closure(core) and "jax" in extras
    result = subprocess.run([sys.executable, "-c", _BLOCKER.replace("from analyses.cli import main", "import scipy"), "-",
                             ",".join(sorted(closure(core)))], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "ModuleNotFoundError: import of scipy halted" in result.stderr


def subcommands() -> list[str]:
    from analyses.cli import build_parser
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_help_runs_with_the_core_dependencies_alone():
    result = run_with_core_only("--help", *(f"{command} --help" for command in subcommands()))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("usage: interp") == 1 + len(subcommands())


def test_the_toy_report_runs_with_the_core_dependencies_alone(tmp_path):
    result = run_with_core_only(f"report --model toy --out {tmp_path / 'toy'} --quiet")
    assert result.returncode == 0, result.stderr[-2000:]
    assert {"index.html", "report.md", "head_roles.csv", "meta.json"} <= {p.name for p in (tmp_path / "toy").iterdir()}

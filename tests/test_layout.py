"""The house's rules (architecture §1, docs/architecture.md), read from the source's imports:
``interp`` never imports ``analyses``; no room of ``analyses`` imports a room above it (nor a
sibling on its own floor); no library module imports a command module (``analyses/cli/``); and no
import circle among the modules, counting the imports inside functions too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# each room of analyses/ and its floor: a room imports only rooms on lower floors (and itself)
FLOORS = {
    "core": 0,
    "interventions": 1,
    "roles": 2,
    "components": 3,
    "tasks": 3,
    "circuits": 4,
    "report": 5,
    "studies": 6,
    "cli": 7,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in ("interp", "analyses") for path in (ROOT / package).rglob("*.py")}


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (a name imported from a package counts as its submodule
    where one of that name exists)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in known)
    return found


GRAPH = {name: imports(path, set(modules())) for name, path in modules().items()}


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "analyses" and len(parts) > 2 else None


def test_every_module_of_analyses_lives_in_a_room():
    flat = [name for name in GRAPH if name.count(".") == 1 and name.startswith("analyses.")
            and name not in {f"analyses.{r}" for r in FLOORS} and name != "analyses.__main__"]
    assert flat == []
    assert {room(name) for name in GRAPH if room(name)} == set(FLOORS)


def test_interp_never_imports_analyses():
    assert [(a, b) for a, deps in GRAPH.items() for b in deps
            if a.startswith("interp") and b.startswith("analyses")] == []


def test_no_room_imports_a_room_above_it_or_beside_it():
    climbs = [(a, b) for a, deps in GRAPH.items() for b in deps
              if room(a) and room(b) and room(a) != room(b) and FLOORS[room(b)] >= FLOORS[room(a)]]
    assert climbs == []


def test_no_library_module_imports_a_command_module():
    library = [name for name in GRAPH if not name.startswith("analyses.cli") and name not in ("analyses.__main__",)]
    assert [(a, b) for a in library for b in GRAPH[a] if b.startswith("analyses.cli")] == []


def test_the_package_root_imports_the_library_only():
    """``from analyses import X`` re-exports library names; no room imports the package root."""
    assert not any(b.startswith("analyses.cli") for b in GRAPH["analyses"])
    assert [a for a, deps in GRAPH.items() if "analyses" in deps and a != "analyses.__main__"] == []


def cycles() -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    # a package's __init__ re-exporting its submodules is not a circle (the submodules never import it)
    assert cycles() == []


@pytest.mark.parametrize("name", ["SelfAttentionV1", "GroupedQueryAttention", "from_hf"])
def test_interp_keeps_its_public_names(name):
    import interp

    assert hasattr(interp, name)


def room_entries(page: str) -> dict[str, str]:
    """The layer diagram of docs/architecture.md: each room's entry (its line and the indented lines
    that continue it), by room."""
    diagram = page.split("## The layers", 1)[1].split("```")[1]
    entries, current = {}, None
    for line in diagram.splitlines():
        found = [r for r in FLOORS if f"analyses/{r}/" in line]
        if found:
            current = found[0]
            entries[current] = line
        elif current and line.startswith(" " * 20) and line.strip():
            entries[current] += " " + line
        else:
            current = None
    return entries


def test_the_architecture_page_names_every_room_and_module():
    """docs/architecture.md's picture stays true: each room's entry names each of its modules."""
    entries = room_entries((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert set(entries) == set(FLOORS)
    missing = [name for name in GRAPH if room(name) and name.count(".") == 2
               and not re.search(rf"\b{name.split('.')[-1]}\b", entries[room(name)])]
    assert missing == []

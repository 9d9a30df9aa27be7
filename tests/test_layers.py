"""The package layering rule (docs/architecture.md): imports point down, never up or across a cycle.

Every module under ftrun/ is parsed with ``ast``; every ``import ftrun.x`` / ``from ftrun.x
import ...`` (deferred imports inside functions included) is checked against the layer table,
and the modules of one package must not import each other in a cycle either.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ftrun"

# Higher imports lower, never the reverse. Packages on one layer do not import each other.
LAYERS: dict[str, int] = {
    "__main__": 11,  # entry points and tools
    "__init__": 11,
    "faults": 11,
    "testing": 11,  # the tests' and benches' harness (imports anything, imported by nothing)
    "integrations": 11,  # framework glue over the rank API (imported by nothing in ftrun)
    "cli": 10,
    "launcher": 9,
    "store": 8,
    "coordinator": 7,
    "rank": 6,
    "snapshot": 5,
    "protocol": 4,
    "_exec": 3,  # base modules from here down
    "_torch": 2,
    "exit_codes": 2,
    "jobs": 2,
    "log": 2,
    "sigrelay": 2,
    "pdeath": 2,
    "knobs": 1,
    "errors": 1,
    "_enum": 0,
}


def _unit(module: str) -> str:
    """The layer unit of a dotted module name under ftrun (its package, or the base module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1] if len(parts) > 2 else [*parts[:-1], "__init__"]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported ftrun module) for every import of ftrun in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("ftrun.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "ftrun":
                out += [(node.lineno, f"ftrun.{a.name}") for a in node.names]
            elif node.module.startswith("ftrun."):
                out.append((node.lineno, node.module))
    return out


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _module_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The ftrun modules ``path`` imports: ``from ftrun.p import m`` names module ``ftrun.p.m``
    when there is one, else (a name defined in it) ``ftrun.p``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif node.module in modules:
                    out.add(node.module)
    return out


def _edges() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, where) across units."""
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        src = _unit(_module_name(path))
        for line, target in _imports(path):
            dst = _unit(target)
            if dst != src:
                edges.append((src, dst, f"{path.relative_to(ROOT.parent)}:{line} imports {target}"))
    return edges


def test_every_unit_has_a_layer() -> None:
    units = {_unit(_module_name(p)) for p in ROOT.rglob("*.py")}
    assert not units - set(LAYERS), f"give these a layer in LAYERS: {sorted(units - set(LAYERS))}"


def test_imports_point_down() -> None:
    upward = [where for src, dst, where in _edges() if LAYERS[dst] >= LAYERS[src]
              and not (src in ("__init__", "__main__") and dst != src)]
    assert not upward, "imports that do not point down a layer:\n" + "\n".join(upward)


def test_no_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for src, dst, _ in _edges():
        graph.setdefault(src, set()).add(dst)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(u for u in graph if reaches(u, u, {u}))
    assert not cycles, f"packages on an import cycle: {cycles}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each node that lies on one (as a path that ends where it starts)."""
    found = []
    for start in sorted(graph):
        stack, paths = [start], {start: [start]}
        while stack:
            node = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    found.append([*paths[node], start])
                    stack.clear()
                    break
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    stack.append(nxt)
    return found


def test_cycle_finder() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", sorted(u for u in LAYERS if (ROOT / u).is_dir()))
def test_no_cycle_inside_a_package(package: str) -> None:
    """The modules of one package import each other without a cycle (deferred imports
    included: a cycle hidden in a function still ties the two modules into one)."""
    modules = _modules()
    inside = {m: p for m, p in modules.items() if _unit(m) == package}
    graph = {m: {t for t in _module_imports(p, modules) if t in inside and t != m}
             for m, p in inside.items()}
    cycles = _cycles(graph)
    assert not cycles, f"modules of ftrun.{package} on an import cycle: " + "; ".join(
        " -> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", ["ftrun.rank.snapshotter", "ftrun.rank.save",
                                    "ftrun.rank.restore", "ftrun.rank.state",
                                    "ftrun.rank.context", "ftrun.rank.shards"])
def test_rank_side_never_imports_the_store(module: str) -> None:
    path = ROOT.parent / (module.replace(".", "/") + ".py")
    assert not [t for _, t in _imports(path) if _unit(t) in ("store", "launcher", "cli")]


@pytest.mark.parametrize("package", ["cli", "launcher"])
def test_only_the_store_and_the_rank_map_segments(package: str) -> None:
    """The store's catalog names and opens the segments (the rank its own two buffers):
    ``ftrun inspect`` and the launcher go through ``ftrun.store.catalog``."""
    modules = _modules()
    hits = [f"{p.relative_to(ROOT.parent)} imports {t}"
            for m, p in modules.items() if _unit(m) == package
            for t in _module_imports(p, modules) if t == "ftrun.snapshot.segment"]
    assert not hits, "\n".join(hits)

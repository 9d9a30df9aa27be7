"""The package layering rule (docs/architecture.md): imports point down, never up or across a cycle.

Every module under ftrun/ is parsed with ``ast``; every ``import ftrun.x`` / ``from ftrun.x
import ...`` (deferred imports inside functions included) is checked against the layer table.
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


@pytest.mark.parametrize("module", ["ftrun.rank.snapshotter", "ftrun.rank.save",
                                    "ftrun.rank.restore", "ftrun.rank.state",
                                    "ftrun.rank.context", "ftrun.rank.shards"])
def test_rank_side_never_imports_the_store(module: str) -> None:
    path = ROOT.parent / (module.replace(".", "/") + ".py")
    assert not [t for _, t in _imports(path) if _unit(t) in ("store", "launcher", "cli")]

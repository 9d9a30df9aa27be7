"""The reference pages under docs/reference/, generated from the code so that they cannot drift.

Each page is prose written by hand around one or more regions this module fills in::

    <!-- generated: NAME (python -m ftrun.cli.docs --write) -->
    ...
    <!-- end generated: NAME -->

The regions: ``variables-set`` and ``variables-worker`` (``ftrun.knobs.ALL``, by scope),
``exit-codes`` (the constants of ``ftrun/exit_codes.py`` and their comments) and ``flags``
(ftrun's argument group of :func:`ftrun.launcher.args.build_parser`). ``tests/test_docs.py``
fails when a committed page differs from what this module makes of it::

    python -m ftrun.cli.docs --write     # rewrite the regions in place
    python -m ftrun.cli.docs --check     # exit 1 when a page is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"
PAGES = ("variables.md", "exit-codes.md", "flags.md")
_REGION = re.compile(
    r"(<!-- generated: (?P<name>[a-z-]+) \(python -m ftrun\.cli\.docs --write\) -->\n)"
    r".*?"
    r"(<!-- end generated: (?P=name) -->)",
    re.S,
)


def _cell(text: str) -> str:
    """One Markdown table cell: pipes escaped, < and > as entities."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _variables(worker: bool) -> str:
    from ftrun import knobs

    rows = [
        (f"`{k.name}`", _cell(k.type), f"`{k.default}`" if k.default else "unset",
         _cell(k.meaning))
        for k in knobs.ALL if (k.scope == "worker") == worker
    ]
    return _table(("Variable", "Type", "Default", "Meaning"), rows)


def _exit_codes() -> str:
    """The module's constants in order, each with its trailing comment or the comment lines
    just above it."""
    from ftrun import exit_codes

    source = Path(exit_codes.__file__).read_text(encoding="utf-8").splitlines()
    rows: list[tuple[str, ...]] = []
    above: list[str] = []
    for line in source:
        m = re.match(r"([A-Z_]+) = (\d+)\s*(?:#\s*(.*))?$", line)
        if m:
            comment = m.group(3) or " ".join(above)
            rows.append((m.group(2), f"`{m.group(1)}`", _cell(comment)))
        above = above + [line.lstrip("# ")] if line.startswith("#") else []
    return _table(("Code", "Name in `ftrun.exit_codes`", "Meaning"), rows)


def _flags() -> str:
    from ftrun.launcher import args

    knob_of = {args._dest(flag): knob for flag, knob, _typ, _help in args._FTRUN_FLAGS}
    group = next(g for g in args.build_parser()._action_groups
                 if g.title and g.title.startswith("ftrun options"))
    rows = []
    for action in group._group_actions:
        knob = knob_of[action.dest]
        spellings = " / ".join(f"`{s}`" for s in action.option_strings)
        help_text = re.sub(r" \[env [A-Z_=0-9]+\]$", "", action.help or "").replace("%%", "%")
        if action.choices:
            help_text += " Choices: " + ", ".join(action.choices) + "."
        rows.append((spellings, f"`{knob.name}`", f"`{knob.default}`" if knob.default
                     else "unset", _cell(help_text)))
    return _table(("Flag", "Variable", "Default", "Meaning"), rows)


REGIONS: dict[str, Callable[[], str]] = {
    "variables-set": lambda: _variables(worker=False),
    "variables-worker": lambda: _variables(worker=True),
    "exit-codes": _exit_codes,
    "flags": _flags,
}


def render(text: str) -> str:
    """``text`` with every generated region filled in afresh."""
    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in REGIONS:
            raise KeyError(f"unknown generated region {name!r}; known: {', '.join(REGIONS)}")
        return m.group(1) + REGIONS[name]() + m.group(3)

    return _REGION.sub(fill, text)


def stale(directory: Path = REFERENCE) -> list[str]:
    """The pages whose committed text differs from what render() makes of it."""
    return [p for p in PAGES
            if render((directory / p).read_text(encoding="utf-8"))
            != (directory / p).read_text(encoding="utf-8")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftrun.cli.docs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the stale pages")
    parser.add_argument("--check", action="store_true", help="exit 1 when a page is stale")
    parser.add_argument("--dir", type=Path, default=REFERENCE, help="the reference pages")
    ns = parser.parse_args(argv)
    behind = stale(ns.dir)
    if ns.write:
        for page in behind:
            path = ns.dir / page
            path.write_text(render(path.read_text(encoding="utf-8")), encoding="utf-8")
            print(f"wrote {path}")
        return 0
    for page in behind:
        print(f"{ns.dir / page} is stale: run python -m ftrun.cli.docs --write")
    return 1 if behind else 0


if __name__ == "__main__":
    sys.exit(main())

"""The documentation holds together: the generated reference pages match the code, and every
relative link in README.md and docs/ points at a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ftrun import exit_codes
from ftrun.cli import docs

ROOT = Path(__file__).resolve().parent.parent
MARKDOWN = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "bench" / "RESULTS.md",
                   *(ROOT / "bench" / "history").glob("*.md"),
                   *(ROOT / "docs").rglob("*.md")])
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", docs.PAGES)
def test_reference_page_matches_the_code(page: str) -> None:
    text = (docs.REFERENCE / page).read_text(encoding="utf-8")
    assert "<!-- generated: " in text, f"{page} has no generated region"
    assert docs.render(text) == text, f"docs/reference/{page} is stale: python -m ftrun.cli.docs --write"


def test_render_fills_a_region_and_refuses_an_unknown_one() -> None:
    region = "<!-- generated: exit-codes (python -m ftrun.cli.docs --write) -->\n"
    filled = docs.render(region + "old\n<!-- end generated: exit-codes -->")
    assert "old" not in filled and "| 8 | `ISOLATED` |" in filled
    with pytest.raises(KeyError, match="nope"):
        docs.render(region.replace("exit-codes", "nope") + "<!-- end generated: nope -->")


def test_every_exit_code_has_a_row_in_the_command_table() -> None:
    text = (docs.REFERENCE / "exit-codes.md").read_text(encoding="utf-8")
    table = text.split("## The constants")[0]
    codes = {v for k, v in vars(exit_codes).items() if k.isupper() and isinstance(v, int)}
    missing = [c for c in sorted(codes) if f"\n| {c} |" not in table]
    assert not missing, f"exit codes without a row in docs/reference/exit-codes.md: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def _links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [m.group(1) for m in _LINK.finditer(text)]


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"

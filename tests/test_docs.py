"""Every relative link in README.md, CHANGELOG.md and docs/*.md points at a file of the
repository, and every #anchor at a heading of its target, so moving a page or renaming a
heading cannot leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def links(text: str) -> list[str]:
    """Link targets outside code blocks and code spans."""
    return LINK.findall(CODE_SPAN.sub("", FENCE.sub("", text)))


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    found = set()
    for title in HEADING.findall(FENCE.sub("", text)):
        title = re.sub(r"[`*]", "", title).strip().lower()
        found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def broken_links(page: Path) -> list[str]:
    """The links of ``page`` that name no file, or no heading of their markdown target."""
    bad = []
    for target in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    return bad


def test_the_pages_exist():
    assert (ROOT / "docs" / "design.md") in PAGES
    assert all(page.exists() for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert links(page.read_text()), f"{page.name} links to nothing"
    bad = broken_links(page)
    assert not bad, f"{page.relative_to(ROOT)} has dead links: {bad}"


def test_a_dead_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading-with-code) [gone](missing.md) "
                    "[bad anchor](there.md#nope) [web](https://example.com) "
                    "`[in code](missing-too.md)`\n")
    assert broken_links(page) == [f"missing.md (no file {tmp_path / 'missing.md'})",
                                  "there.md#nope (no heading #nope in there.md)"]

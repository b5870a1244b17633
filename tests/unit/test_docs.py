"""The documentation a user reads: the README short enough to read, every relative link landing
on a file (and a heading, where it names one), every `make` target it names one the Makefile has,
and no issue numbers (a user cannot see the tracker)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from contracts.paths import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "CHANGELOG.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (REPO_ROOT / "Makefile").read_text(), re.M))


def test_the_readme_is_short_enough_to_read():
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_lands(page: Path):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue   # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        landing = (page.parent / path).resolve() if path else page
        assert landing.exists(), f"{page.name}: {target} points nowhere"
        if anchor:
            assert anchor in _anchors(landing), f"{page.name}: {target}: no such heading in {landing.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_make_target_named_exists(page: Path):
    code = " ".join(CODE.findall(page.read_text()))
    named = set(re.findall(r"(?<![\w-])make ([a-z][\w-]*)", code))
    assert named <= _make_targets(), f"{page.name} names make targets the Makefile lacks: {named - _make_targets()}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_issue_numbers(page: Path):
    assert not re.search(r"\bissues? #?\d+", page.read_text(), re.I), page.name


def test_the_checks_can_fail(tmp_path: Path):
    """A link to a missing file or heading, and a make target that does not exist, are caught."""
    page = tmp_path / "page.md"
    page.write_text("# Here\n[a](missing.md) [b](#there) `make nothing`\n")
    assert [t for t in LINK.findall(page.read_text())] == ["missing.md", "#there"]
    assert "there" not in _anchors(page) and "here" in _anchors(page)
    assert "nothing" not in _make_targets() and {"test", "demo", "up", "stack", "docs"} <= _make_targets()

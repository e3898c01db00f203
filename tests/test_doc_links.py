"""Every relative link in README.md and docs/**/*.md points at a file that exists, and every
#anchor at a heading of that file, so moving or renaming a page, record or report shows up here."""

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)  # fenced code blocks
INLINE_CODE = re.compile(r"(`+).+?\1", re.DOTALL)
# [text](target) and ![alt](target), the target optionally in <...> and followed by a "title"
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)  # [name]: target
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def prose(text: str) -> str:
    """The page without code, where link syntax is an example rather than a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(page: Path) -> list[str]:
    text = prose(page.read_text(encoding="utf-8"))
    return [target for target in INLINE_LINK.findall(text) + REFERENCE.findall(text) if target]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*~]|<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")  # repeated headings get -1, -2, ...
    return frozenset(found)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor.lower() not in anchors(resolved):
            broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_the_checker_finds_links_and_ignores_code(tmp_path):
    (tmp_path / "there.md").write_text("# A heading: with `code_name`, punctuation!\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n[ok](there.md) ![img](missing.png) [anchor](there.md#a-heading-with-code_name-punctuation)\n"
        "[twice](there.md#twice-1) [bad anchor](there.md#nowhere) [web](https://example.com/x.md)\n"
        "`[not a link](inline.md)` [self](#top) [no self](#bottom)\n\n"
        "```\n[not a link](fenced.md)\n```\n\n[ref]: <gone.md>\n"
    )
    assert broken_links(page) == [
        "missing.png: no such file",
        "there.md#nowhere: no such heading",
        "#bottom: no such heading",
        "gone.md: no such file",
    ]

"""Every relative link of README.md and docs/*.md points to a file that exists, and every
``#anchor`` to a heading of its target (GitHub's heading slugs).

Links inside code (fenced blocks and inline spans) are not links; web links (``scheme:``) are not
checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", *sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line without inline code spans) of every line outside fenced blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            marker = stripped[:3]
            fence = marker if fence is None else (None if marker == fence else fence)
            continue
        if fence is None:
            out.append((number, re.sub(r"`[^`]*`", "", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match is None:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """'line: target (why)' for each relative link of ``page`` that does not resolve."""
    broken = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            destination = (page.parent / file_part).resolve() if file_part else page
            if not destination.exists():
                broken.append(f"{number}: {target} (no file {destination})")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                broken.append(f"{number}: {target} (no heading #{anchor} in {destination.name})")
    return broken


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    broken = broken_links(ROOT / page)
    assert not broken, f"{page} has broken links:\n" + "\n".join(broken)


def test_a_broken_file_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## verl's FSDP engine\n\n## A\n\n## A\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md#verls-fsdp-engine) [ok](other.md#a-1) [ok](#page) [web](https://x.y/z)\n"
        "[gone](missing.md) [bad anchor](other.md#nothing) [self](#nowhere)\n"
        "`[code](missing.md)`\n\n```md\n[fenced](missing.md)\n```\n"
    )
    assert broken_links(page) == [
        f"4: missing.md (no file {tmp_path / 'missing.md'})",
        "4: other.md#nothing (no heading #nothing in other.md)",
        "4: #nowhere (no heading #nowhere in page.md)",
    ]


def test_slug_follows_github():
    assert slug("With HuggingFace models (FSDP2, TRL)") == "with-huggingface-models-fsdp2-trl"
    assert slug("Limitations (each raises an error)") == "limitations-each-raises-an-error"
    assert slug("verl's engine: tree vs. THD") == "verls-engine-tree-vs-thd"

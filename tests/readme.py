"""The project's Markdown as tests read it: a section by its heading, its fenced blocks,
the metric names it mentions. Tests that keep the README true share these."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: every page that documents the router to its users
PAGES = (README, ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md")))

_HEADING = re.compile(r"^(#{1,6}) (.+)$", re.MULTILINE)
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_METRIC = re.compile(r"\bkvroute_\w+")
#: the sample suffixes of a histogram or a summary, which name no family of their own
_SAMPLE_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def section(title: str, text: str | None = None) -> str:
    """The text under the heading `title` (any level), up to the next heading of that
    level or above; KeyError if no heading has that title."""
    text = README.read_text() if text is None else text
    found = _headings(text)
    for i, heading in enumerate(found):
        if heading.group(2).strip() != title:
            continue
        level = len(heading.group(1))
        end = next((h.start() for h in found[i + 1 :] if len(h.group(1)) <= level), None)
        return text[heading.end() : end]
    raise KeyError(f"no heading {title!r}")


def blocks(text: str) -> list[tuple[str, str]]:
    """Each fenced block of `text` in order, as (language, content)."""
    return [(lang, code) for lang, code in _FENCE.findall(text)]


def metric_names(text: str) -> set[str]:
    """Every `kvroute_*` family `text` names, a histogram's sample names as its family."""
    return {_SAMPLE_SUFFIX.sub("", name) for name in _METRIC.findall(text)}


def anchors(text: str) -> set[str]:
    """The fragments that link to `text`'s headings."""
    return {anchor(h.group(2).strip()) for h in _headings(text)}


def anchor(title: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces `-`."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _headings(text: str) -> list[re.Match[str]]:
    """The heading lines of `text`; a shell comment in a fenced block is none."""
    fenced = [m.span() for m in _FENCE.finditer(text)]
    return [h for h in _HEADING.finditer(text) if not any(a < h.start() < b for a, b in fenced)]

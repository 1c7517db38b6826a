"""Every relative link in the docs (README, docs/, deploy/README.md) reaches a file of the
repository, and every `#fragment` a heading of the page it names, so moving a section
cannot leave a link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import readme

#: a Markdown link's target, outside code spans
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _links(page: Path) -> list[str]:
    text = re.sub(r"`[^`]*`", "", page.read_text())
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", readme.PAGES, ids=lambda p: str(p.relative_to(readme.ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, fragment = target.partition("#")
        reached = (page.parent / path).resolve() if path else page
        if not reached.exists():
            broken.append(f"{target}: no {reached.relative_to(readme.ROOT)}")
        elif fragment and fragment not in readme.anchors(reached.read_text()):
            broken.append(f"{target}: no heading #{fragment}")
    assert not broken, broken


def test_the_anchor_is_githubs() -> None:
    assert readme.anchor("PREFIX_AWARE: consistent hashing, with load") == (
        "prefix_aware-consistent-hashing-with-load"
    )
    assert readme.anchor("Workers: every core") == "workers-every-core"

"""TextBlocks: block keys straight from the text, checked against the recurrence they
are defined by, computed one block at a time with Python integers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hashing.text_blocks import TextBlocks

MASK = (1 << 64) - 1
P = 0x9E3779B97F4A7C15
ROOT = 0x1234_5678_9ABC_DEF0


def _mix(x: int) -> int:
    x ^= x >> 30
    x = x * 0xBF58476D1CE4E5B9 & MASK
    x ^= x >> 27
    x = x * 0x94D049BB133111EB & MASK
    return x ^ (x >> 31)


def _lane_keys(lanes: int) -> list[int]:
    out, state = [], 0x243F6A8885A308D3
    for _ in range(lanes):
        state = (state + P) & MASK
        out.append(_mix(state) | 1)
    return out


def reference(root: int, text: str, block_size: int, max_blocks: int) -> list[int]:
    """key_i = mix(S_i), S_i = S_{i-1} * P + mix(sum of lane_l * K_l), S_-1 = root."""
    chars = 4 * block_size
    keys_k, s, out = _lane_keys(chars // 2), root, []
    for b in range(min(len(text) // chars, max_blocks)):
        block = [ord(c) for c in text[b * chars : (b + 1) * chars]]
        lanes = [block[2 * i] | block[2 * i + 1] << 32 for i in range(chars // 2)]
        g = _mix(sum(lane * k for lane, k in zip(lanes, keys_k, strict=True)) & MASK)
        s = (s * P + g) & MASK
        out.append(_mix(s))
    return out


@given(st.text(max_size=700) | st.text(alphabet="ab é<|>\n", max_size=700))
@settings(max_examples=200, deadline=None)
def test_keys_follow_their_definition(text: str) -> None:
    assert TextBlocks(4, 8).keys(ROOT, text) == reference(ROOT, text, 4, 8)


def test_keys_of_a_prefix_are_a_prefix_of_the_keys() -> None:
    blocks = TextBlocks(16, 1000)
    doc = "the document " * 500
    whole = blocks.keys(ROOT, doc + "first question")
    assert blocks.keys(ROOT, doc) == whole[: len(doc) // 64]
    assert blocks.keys(ROOT, doc + "another question, longer")[: len(doc) // 64] == whole[:101]


def test_a_later_accent_keeps_the_ascii_prefix_keys() -> None:
    blocks = TextBlocks(16, 1000)
    doc = "x" * 640
    assert blocks.keys(ROOT, doc + "é" * 64)[:10] == blocks.keys(ROOT, doc)


@pytest.mark.parametrize(
    ("text", "other"),
    [
        pytest.param("a" * 64, "b" + "a" * 63, id="first-char"),
        pytest.param("a" * 64, "a" * 63 + "b", id="last-char"),
        pytest.param("一" * 64, "丁" * 64, id="cjk"),
    ],
)
def test_one_character_changes_the_key(text: str, other: str) -> None:
    blocks = TextBlocks(16, 10)
    assert blocks.keys(ROOT, text) != blocks.keys(ROOT, other)


def test_the_root_and_the_cap_apply() -> None:
    blocks = TextBlocks(16, 3)
    text = "y" * 64 * 5
    assert len(blocks.keys(ROOT, text)) == 3
    assert set(blocks.keys(ROOT, text)).isdisjoint(blocks.keys(ROOT + 1, text))
    assert blocks.keys(ROOT, "y" * 63) == []

"""A stream's usage event taken out, whatever the chunks' boundaries."""

from __future__ import annotations

import pytest

from router.ingress.usage_strip import WithoutUsage

EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"b"}}],"usage":null}\n\n',
    b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n',
    b"data: [DONE]\n\n",
]
STREAM = b"".join(EVENTS)
WITHOUT = EVENTS[0] + EVENTS[1] + EVENTS[3]


@pytest.mark.parametrize("size", [1, 7, 40, 64, len(STREAM)])
def test_the_usage_event_goes_and_every_other_byte_stays(size: int) -> None:
    stripped = WithoutUsage()
    out = b"".join(stripped.feed(STREAM[i : i + size]) for i in range(0, len(STREAM), size))
    assert out + stripped.rest() == WITHOUT


def test_an_event_passes_as_soon_as_it_is_whole() -> None:
    stripped = WithoutUsage()
    assert stripped.feed(EVENTS[0][:-1]) == b""
    assert stripped.feed(b"\n" + EVENTS[1][:10]) == EVENTS[0]
    assert stripped.rest() == EVENTS[1][:10]  # a stream cut mid-event ends as it came

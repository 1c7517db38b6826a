"""The token counts an answer reports in its `usage` (OpenAI's format, as vLLM writes it).

Read once, at the exchange's end, from the answer's last long chunk (`BodyClock.tail`):
a JSON answer's whole body, a stream's usage event (`stream_options.include_usage`).
Nothing is decoded: the last `"usage"` key is found and its numbers read, so a long
answer costs a search from its end, not a parse.
"""

from __future__ import annotations

import re
from typing import NamedTuple

#: how far past the last `"usage"` key its counts are looked for (the object is ~200 bytes)
_USAGE_SPAN = 512
_COUNT = re.compile(rb'"(prompt_tokens|completion_tokens|cached_tokens)"\s*:\s*(\d+)')


class Usage(NamedTuple):
    """Token counts of one answer; None: the answer did not say."""

    prompt: int | None
    cached: int | None
    completion: int | None


NO_USAGE = Usage(None, None, None)


def usage(tail: bytes) -> Usage:
    """The counts of the last `usage` object in `tail` (NO_USAGE if none, or `null`)."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return NO_USAGE
    counts = dict(_COUNT.findall(tail, at, at + _USAGE_SPAN))
    if not counts:
        return NO_USAGE
    return Usage(
        _int(counts, b"prompt_tokens"),
        _int(counts, b"cached_tokens"),
        _int(counts, b"completion_tokens"),
    )


def _int(counts: dict[bytes, bytes], key: bytes) -> int | None:
    found = counts.get(key)
    return None if found is None else int(found)

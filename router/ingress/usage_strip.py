"""A stream's usage event taken out: the router asked for it (`usage.stream_usage`) to
count the stream's tokens, and the client, which did not, gets the stream it asked for.

Events pass through whole, as the backend wrote them; only the partial event at a
chunk's end waits for the next chunk (the client could not use it before). An event is
the usage event when its data has `"choices":[]` and a `"usage"` object, as vLLM ends
a stream with `include_usage`.
"""

from __future__ import annotations

import re

_USAGE_ONLY = re.compile(rb'"choices"\s*:\s*\[\s*\]')


class WithoutUsage:
    """Feed a stream's chunks; get them back without the usage event."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        """What of `chunk` (after what an earlier one left) can go to the client now."""
        data = self._tail + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._tail = data
            return b""
        whole, self._tail = data[: end + 2], data[end + 2 :]
        if b'"usage"' not in whole:
            return whole
        return b"".join(e for e in _events(whole) if not _usage_only(e))

    def rest(self) -> bytes:
        """What the stream left unterminated at its end, as it came."""
        rest, self._tail = self._tail, b""
        return rest


def _events(data: bytes) -> list[bytes]:
    """Whole events, each with its blank line."""
    return [e + b"\n\n" for e in data.split(b"\n\n")[:-1]]


def _usage_only(event: bytes) -> bool:
    return b'"usage"' in event and _USAGE_ONLY.search(event) is not None

"""An answer's `model` given back the name the client asked for, when a pool's
`model_map` sent the request to its backend under another (a quantised variant): the
client sees the name it knows, whole answers and every SSE event alike.

Only the `"model": "<the backend's name>"` pairs are rewritten, found by search, nothing
decoded: a JSON string holding those bytes escapes its quotes, so the pattern matches
keys alone. A stream's reads are rewritten line by line; a read's unfinished last line
waits for the next read (the client could not use a part of an event anyway), and
what a stream leaves unterminated goes out as it came. Answers of an unmapped backend
never come here: their bytes pass untouched.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import orjson

from router.upstream.relay import Sink, TransformingSink


class ModelRename:
    """Rewrites `served` (the backend's model name) into `asked` in one answer."""

    __slots__ = ("_pattern", "_replace", "_served", "_tail")

    def __init__(self, served: str, asked: str) -> None:
        quoted = orjson.dumps(served)
        self._served = quoted[1:-1]  # a cheap test before the search
        self._pattern = re.compile(rb'("model"\s*:\s*)' + re.escape(quoted))
        named = orjson.dumps(asked)
        self._replace: Callable[[re.Match[bytes]], bytes] = lambda m: m[1] + named
        self._tail = b""

    def whole(self, body: bytes) -> bytes:
        """A whole answer, its model renamed."""
        if self._served not in body:
            return body
        return self._pattern.sub(self._replace, body)

    def feed(self, chunk: bytes) -> bytes:
        """What of a stream's `chunk` (after what the last one left) goes out now: its
        whole lines, renamed."""
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n") + 1
        self._tail = data[cut:]
        return self.whole(data[:cut]) if cut else b""

    def rest(self) -> bytes:
        """What the stream left unterminated at its end, renamed."""
        rest, self._tail = self._tail, b""
        return self.whole(rest)


class RenamingSink(TransformingSink):
    """A Sink that renames the model in what it passes to `inner`."""

    __slots__ = ("_rename",)

    def __init__(self, inner: Sink, rename: ModelRename) -> None:
        super().__init__(inner)
        self._rename = rename

    def put(self, chunk: bytes) -> None:
        if out := self._rename.feed(chunk):
            self._inner.put(out)

    def end(self) -> None:
        """The body ended: what it left unterminated goes out."""
        if rest := self._rename.rest():
            self._inner.put(rest)

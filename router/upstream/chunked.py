"""A backend's chunked body, decoded as it arrives, knowing where its chunks end.

Why not aiohttp's parser for this part: a stream relayed to a client that also reads
chunked framing does not need its chunks decoded and framed again. A read that holds
only whole chunks (how an SSE server flushes its events, nearly always) is passed on as
it came, and the decoding, the reader's buffer and the framing per event are skipped:
about a quarter of a streaming router's CPU per event. The decoded pieces are still
given, for readers that want the body (and for reads that split a chunk).
"""

from __future__ import annotations

import re

#: a chunk's size line: hex size, optional extensions (ignored), CRLF
_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\r\n]*)?\r\n")
_MAX_LINE = 4096  # a size line (with its extensions) longer than this is not HTTP
_MAX_TRAILERS = 8190  # aiohttp's limit for one header field
_CRLF = b"\r\n"

_SIZE, _DATA, _DATA_END, _TRAILERS, _DONE = range(5)


class ChunkError(ValueError):
    """The body is not valid chunked framing."""


def payload(chunks: bytes) -> bytes:
    """The data of one read of whole chunks (a decoder of its own: it starts at a chunk)."""
    return b"".join(ChunkedBody().feed(chunks)[0])


class ChunkedBody:
    """Decodes one chunked body read by read (trailers are read and dropped)."""

    __slots__ = ("_left", "_line", "_state", "done", "overrun")

    def __init__(self) -> None:
        self._state = _SIZE
        self._left = 0  # data bytes of the current chunk still to come (or CRLF bytes)
        self._line = b""  # a size or trailer line split across reads
        self.done = False  # the last chunk and the trailers arrived
        self.overrun = False  # bytes came after the end: the connection is not reusable

    def feed(self, data: bytes) -> tuple[list[bytes], bytes | None]:
        """The data pieces in `data`, and `data` itself (its last chunk and trailers cut
        off) when it held only whole chunks, else None. Raises ChunkError."""
        if self._state is not _SIZE or self._line:
            return self._walk(data, 0, [], False)
        # the usual read: whole chunks with plain size lines, as SSE servers flush events
        pieces: list[bytes] = []
        pos, size = 0, len(data)
        while pos < size:
            eol = data.find(_CRLF, pos, pos + 17)
            if eol <= pos:
                break
            line = data[pos:eol]
            try:
                length = int(line, 16)
            except ValueError:
                break
            end = eol + 2 + length
            if length <= 0 or b"%x" % length != line or data[end : end + 2] != _CRLF:
                break  # the last chunk, a split one, or an unusual size line
            pieces.append(data[eol + 2 : end])
            pos = end + 2
        if pos == size:
            return pieces, data
        return self._walk(data, pos, pieces, True)

    def _walk(
        self, data: bytes, pos: int, pieces: list[bytes], aligned: bool
    ) -> tuple[list[bytes], bytes | None]:
        """`feed` from `pos` on, any framing; `aligned`: `data` began at a chunk."""
        size, last = len(data), -1
        while pos < size:
            state = self._state
            if state is _DATA:
                take = min(self._left, size - pos)
                pieces.append(data[pos : pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    self._state, self._left = _DATA_END, 2
            elif state is _DATA_END:
                take = min(self._left, size - pos)
                if data[pos : pos + take] != _CRLF[2 - self._left :][:take]:
                    raise ChunkError("a chunk's data is not followed by CRLF")
                pos += take
                self._left -= take
                if not self._left:
                    self._state = _SIZE
            elif state is _DONE:
                self.overrun = True
                break
            else:
                line, pos = self._read_line(data, pos)
                if line is None:
                    break
                if state is _TRAILERS:
                    if line == _CRLF:
                        self._state, self.done = _DONE, True
                    continue
                found = _SIZE_LINE.fullmatch(line)
                if found is None:
                    raise ChunkError(f"invalid chunk size line {line[:40]!r}")
                self._left = int(found[1], 16)
                if self._left:
                    self._state = _DATA
                else:
                    self._state = _TRAILERS
                    last = pos - len(line)  # the last chunk's line began here (if in data)
        if not aligned or not ((self._state is _SIZE and not self._line) or self.done):
            return pieces, None
        if self.done and last >= 0:
            return pieces, data[:last]
        return pieces, data

    def _read_line(self, data: bytes, pos: int) -> tuple[bytes | None, int]:
        """The line starting at `pos` (with what an earlier read left of it) and where it
        ends; (None, end of data) while it is incomplete."""
        end = data.find(b"\n", pos)
        limit = _MAX_TRAILERS if self._state is _TRAILERS else _MAX_LINE
        if end < 0:
            self._line += data[pos:]
            if len(self._line) > limit:
                raise ChunkError("a chunk size or trailer line is too long")
            return None, len(data)
        line = self._line + data[pos : end + 1] if self._line else data[pos : end + 1]
        self._line = b""
        if len(line) > limit:
            raise ChunkError("a chunk size or trailer line is too long")
        if not line.endswith(_CRLF):
            raise ChunkError("a chunk size or trailer line does not end with CRLF")
        return line, end + 1

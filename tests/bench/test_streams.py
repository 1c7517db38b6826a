"""bench.studies.streams counts SSE events however the bytes are split across reads."""

from __future__ import annotations

import itertools

import pytest

from bench.studies.streams import Board, Stream

EVENT = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


class _Transport:
    def __init__(self) -> None:
        self.closed = False
        self.sent = b""

    def write(self, data: bytes) -> None:
        self.sent += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _feed(response: bytes, cuts: list[int]) -> tuple[Stream, Board, _Transport]:
    board = Board()
    stream = Stream(b"POST / HTTP/1.1\r\n\r\n", board)
    transport = _Transport()
    stream.connection_made(transport)
    edges = [0, *cuts, len(response)]
    for a, b in itertools.pairwise(edges):
        if not transport.closed:
            stream.data_received(response[a:b])
    return stream, board, transport


STREAM_3 = HEAD + _chunked(EVENT, EVENT, EVENT, b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    "cuts",
    [
        pytest.param([], id="one-read"),
        pytest.param([len(HEAD)], id="head-then-body"),
        pytest.param([len(HEAD) + 6], id="split-inside-the-first-prefix"),
        pytest.param([len(STREAM_3) - 12], id="split-inside-done"),
        pytest.param(list(range(12, len(STREAM_3), 7)), id="every-7-bytes"),
        pytest.param(list(range(1, len(STREAM_3))), id="byte-by-byte"),
    ],
)
async def test_every_event_is_counted_once_and_done_closes(cuts: list[int]) -> None:
    stream, board, transport = _feed(STREAM_3, cuts)
    assert (stream.status, stream.events, stream.done) == (200, 4, True)  # 3 + [DONE]
    assert (board.events, board.done, board.errors) == (4, 1, [])
    assert transport.closed and transport.sent.startswith(b"POST")


async def test_an_error_status_is_a_failure_not_a_stream() -> None:
    answer = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}"
    stream, board, transport = _feed(answer, [])
    assert stream.first.done() and isinstance(stream.first.exception(), ConnectionError)
    assert board.errors and "503" in board.errors[0] and transport.closed


async def test_a_cut_stream_is_a_failure_and_a_client_close_is_not() -> None:
    cut, board, _ = _feed(HEAD + _chunked(EVENT)[:-5], [])
    cut.connection_lost(None)
    assert board.errors == ["closed after 1 events (by the server)"]
    ended, board, _ = _feed(HEAD + _chunked(EVENT)[:-5], [])
    ended.close()
    ended.connection_lost(None)
    assert board.errors == [] and board.open == 0 and board.peak == 1

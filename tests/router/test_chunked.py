"""router.upstream.chunked: a chunked body decoded read by read, with reads of whole chunks passed
on as they came."""

from __future__ import annotations

import itertools

import pytest

from router.upstream.chunked import ChunkedBody, ChunkError

EVENTS = [b"data: one\n\n", b"data: " + b"x" * 300 + b"\n\n", b"data: [DONE]\n\n"]
BODY = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"


def relayed(reads: list[bytes]) -> tuple[bytes, bytes, ChunkedBody]:
    """(decoded body, what a relay writes: passed-on reads or re-framed pieces, decoder)."""
    body, decoded, out = ChunkedBody(), [], []
    for read in reads:
        pieces, whole = body.feed(read)
        decoded += pieces
        out.append(whole if whole is not None else b"".join(_frame(p) for p in pieces if p))
    return b"".join(decoded), b"".join(out), body


def _frame(piece: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(piece), piece)


def test_a_read_of_one_whole_chunk_is_passed_on_as_it_came() -> None:
    read = _frame(EVENTS[0])
    pieces, whole = ChunkedBody().feed(read)
    assert pieces == [EVENTS[0]]
    assert whole is read


def test_a_read_of_several_whole_chunks_and_the_end() -> None:
    body = ChunkedBody()
    pieces, whole = body.feed(BODY)
    assert pieces == EVENTS
    assert whole == BODY[: -len(b"0\r\n\r\n")]  # the relay writes its own last chunk
    assert body.done and not body.overrun


@pytest.mark.parametrize("cut", range(1, len(BODY)))
def test_every_split_into_two_reads_decodes_and_relays_the_same(cut: int) -> None:
    decoded, out, body = relayed([BODY[:cut], BODY[cut:]])
    assert decoded == b"".join(EVENTS)
    assert body.done
    again, _, _ = relayed([out + b"0\r\n\r\n"])  # what the client got is valid framing
    assert again == decoded


def test_byte_by_byte() -> None:
    decoded, out, body = relayed([bytes([b]) for b in BODY])
    assert decoded == b"".join(EVENTS)
    assert body.done
    assert relayed([out + b"0\r\n\r\n"])[0] == decoded


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"0A\r\n0123456789\r\n0\r\n\r\n", id="leading-zero"),
        pytest.param(b"A\r\n0123456789\r\n0\r\n\r\n", id="upper-case"),
        pytest.param(b"a;name=value\r\n0123456789\r\n0\r\n\r\n", id="extension"),
        pytest.param(b"a\r\n0123456789\r\n0\r\nX-Trailer: 1\r\nY: 2\r\n\r\n", id="trailers"),
    ],
)
def test_unusual_but_valid_framing(body: bytes) -> None:
    for cut in range(1, len(body)):
        decoded, _, chunked = relayed([body[:cut], body[cut:]])
        assert decoded == b"0123456789"
        assert chunked.done


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"zz\r\nab\r\n", id="not-hex"),
        pytest.param(b"2\r\nabX\r\n", id="no-crlf-after-data"),
        pytest.param(b"2\nab\r\n", id="bare-lf"),
        pytest.param(b"1" * 5000, id="endless-size-line"),
        pytest.param(b"0\r\n" + b"X: " + b"y" * 9000, id="endless-trailer"),
        pytest.param(b"-2\r\nab\r\n", id="negative"),
        pytest.param(b"0x2\r\nab\r\n", id="0x-prefix"),
    ],
)
@pytest.mark.parametrize("size", [0, 1], ids=["whole", "byte-by-byte"])
def test_invalid_framing_raises(body: bytes, size: int) -> None:
    chunked = ChunkedBody()
    with pytest.raises(ChunkError):
        for i in range(0, len(body), size or len(body)):
            chunked.feed(body[i : i + (size or len(body))])


def test_bytes_after_the_end_are_an_overrun() -> None:
    body = ChunkedBody()
    pieces, whole = body.feed(BODY + b"HTTP/1.1 200 OK\r\n")
    assert pieces == EVENTS and body.done and body.overrun
    assert whole == BODY[: -len(b"0\r\n\r\n")]
    later = ChunkedBody()
    later.feed(BODY)
    assert later.feed(b"more") == ([], None) and later.overrun


def test_random_splits_of_many_chunks() -> None:
    events = [b"e%d" % i * (i % 7 + 1) for i in range(40)]
    framed = b"".join(_frame(e) for e in events) + b"0\r\n\r\n"
    for step in (3, 7, 16, 61, 200):
        cuts = [*range(0, len(framed), step), len(framed)]
        reads = [framed[a:b] for a, b in itertools.pairwise(cuts)]
        decoded, out, body = relayed(reads)
        assert decoded == b"".join(events)
        assert body.done
        assert relayed([out + b"0\r\n\r\n"])[0] == decoded

"""Response compression (router/ingress/compression.py, EncodedReply in relay.py): the
Accept-Encoding choice, encoders whose every output decodes on its own, and what an
encoded reply sends, one named row per case."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable, Mapping

import pytest
import zstandard

from router.config import CompressionConfig
from router.errors import UpstreamDisconnected
from router.ingress.compression import Coding, Compression, accepted
from router.ingress.relay import THREAD_BYTES, EncodedReply, compressible, refuse
from router.ingress.relay import _end_stream_with as end_stream_with

SSE = {"Content-Type": "text/event-stream"}
JSON = {"Content-Type": "application/json"}
EVENTS = [
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"%s"},"finish_reason":null}]}\n\n' % word
    for word in (b"The", b" router", b" flushes", b" each", b" event")
] + [b"data: [DONE]\n\n"]


def _compression(**config) -> Compression:
    return Compression(CompressionConfig(enabled=True, **config))


def _coding(name: str, **config) -> Coding:
    coding = _compression(algorithms=(name,), **config).choose([name])
    assert coding is not None and coding.name == name
    return coding


#: a fresh incremental decoder, and the one-shot decoder of a whole body, per coding (a
#: stream's zstd frame does not say its size: the one-shot call is given a bound)
DECODERS: dict[str, tuple[Callable, Callable[[bytes], bytes]]] = {
    "gzip": (lambda: zlib.decompressobj(31), gzip.decompress),
    "zstd": (
        lambda: zstandard.ZstdDecompressor().decompressobj(),
        lambda body: zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 20),
    ),
}


@pytest.mark.parametrize(
    ("header", "offered", "chosen"),
    [
        pytest.param("gzip", ("zstd", "gzip"), "gzip", id="the-only-one-accepted"),
        pytest.param("gzip, zstd", ("zstd", "gzip"), "zstd", id="tie-goes-to-the-router-order"),
        pytest.param("gzip, zstd", ("gzip", "zstd"), "gzip", id="the-router-order-configured"),
        pytest.param("zstd;q=0.5, gzip", ("zstd", "gzip"), "gzip", id="client-q-first"),
        pytest.param("GZIP;Q=0.8", ("zstd", "gzip"), "gzip", id="case-insensitive"),
        pytest.param("x-gzip", ("zstd", "gzip"), "gzip", id="x-gzip-is-gzip"),
        pytest.param("gzip;q=0", ("zstd", "gzip"), None, id="q-0-refuses"),
        pytest.param("gzip;q=0, zstd;q=0.1", ("zstd", "gzip"), "zstd", id="q-0-then-another"),
        pytest.param("*", ("zstd", "gzip"), "zstd", id="star-takes-any"),
        pytest.param("*;q=0.5, gzip;q=1", ("zstd", "gzip"), "gzip", id="named-beats-star"),
        pytest.param("*, zstd;q=0", ("zstd", "gzip"), "gzip", id="star-but-not-that-one"),
        pytest.param("*;q=0", ("zstd", "gzip"), None, id="star-q-0"),
        pytest.param("identity", ("zstd", "gzip"), None, id="identity"),
        pytest.param("identity;q=1, gzip;q=0.5", ("zstd", "gzip"), None, id="identity-preferred"),
        pytest.param("identity;q=0.5, gzip", ("zstd", "gzip"), "gzip", id="gzip-preferred"),
        pytest.param("gzip;q=0.5", ("zstd", "gzip"), "gzip", id="identity-unnamed-is-last"),
        pytest.param("identity;q=0.5, gzip;q=0.5", ("gzip",), "gzip", id="tie-compresses"),
        pytest.param("br, deflate", ("zstd", "gzip"), None, id="none-offered"),
        pytest.param("br, gzip", ("zstd",), None, id="offered-not-accepted"),
        pytest.param("", ("zstd", "gzip"), None, id="empty"),
        pytest.param("gzip;q=abc, zstd;q=0.2", ("gzip", "zstd"), "zstd", id="bad-q-left-out"),
        pytest.param("gzip;q=2", ("gzip",), None, id="q-over-1-left-out"),
        pytest.param(" gzip ; level=1 ; q=0.3 ,", ("gzip",), "gzip", id="spaces-and-params"),
    ],
)
def test_accept_encoding_chooses(header: str, offered: tuple[str, ...], chosen) -> None:
    coding = _compression(algorithms=offered).choose([header])
    assert (coding.name if coding else None) == chosen


def test_header_lines_count_as_one_list() -> None:
    compression = _compression()
    assert compression.choose(["gzip;q=0.1", "zstd;q=0.9"]).name == "zstd"
    assert compression.choose([]) is None  # no Accept-Encoding: never compressed unasked


def test_weights_are_read_per_coding() -> None:
    assert accepted("gzip;q=0.5, *;q=0, Identity") == {"gzip": 0.5, "*": 0.0, "identity": 1.0}


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_each_output_decodes_to_the_events_so_far(name: str) -> None:
    encoder, (decoder, whole) = _coding(name).stream(), DECODERS[name]
    incremental, sent = decoder(), []
    for event in EVENTS:
        sent.append(encoder.compress(event))
        assert incremental.decompress(sent[-1]) == event  # nothing waits for the next one
    sent.append(encoder.finish())
    assert incremental.decompress(sent[-1]) == b""
    assert whole(b"".join(sent)) == b"".join(EVENTS)


@pytest.mark.parametrize("name", ["gzip", "zstd"])
@pytest.mark.parametrize("level", [1, 9])
def test_whole_bodies_decode_with_the_standard_library(name: str, level: int) -> None:
    body = b"".join(EVENTS) * 20
    coding = _coding(name, gzip_level=level, zstd_level=level)
    packed = coding.whole(body)
    assert len(packed) < len(body) / 4
    assert DECODERS[name][1](packed) == body


@pytest.mark.parametrize(
    ("headers", "ours"),
    [
        pytest.param(JSON, True, id="json"),
        pytest.param({"Content-Type": "application/json; charset=utf-8"}, True, id="json-utf8"),
        pytest.param(SSE, True, id="sse"),
        pytest.param({"Content-Type": "text/plain"}, True, id="text"),
        pytest.param({"Content-Type": "application/problem+json"}, True, id="plus-json"),
        pytest.param({"Content-Type": "audio/mpeg"}, False, id="audio"),
        pytest.param({}, False, id="no-type"),
        pytest.param({**JSON, "Content-Encoding": "br"}, False, id="coded-by-the-backend"),
    ],
)
def test_what_is_compressed(headers: Mapping[str, str], ours: bool) -> None:
    assert compressible(headers) is ours


class _Sink:
    """A Sink that keeps what it was given, each write apart."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def put(self, chunk: bytes) -> None:
        self.writes.append(chunk)

    def put_framed(self, chunks: bytes) -> None:
        raise AssertionError("an encoded stream's framed reads reach the sink decoded")

    def ready(self) -> bool:
        return True

    def on_ready(self, callback) -> None:
        pass


class _Reply:
    """A Reply that keeps what it was given."""

    def __init__(self) -> None:
        self.sink = _Sink()  # a direct sink, as the fast path's reply has
        self.started = False
        self.status = 0
        self.headers: Mapping[str, str] = {}
        self.body = b""
        self.chunks: list[bytes] = []
        self.ended = False

    async def whole(self, status, headers, body, close=False) -> None:
        self.status, self.headers, self.body = status, headers, body

    async def begin(self, status, headers) -> None:
        self.started, self.status, self.headers = True, status, headers

    def send(self, chunk: bytes) -> None:
        self.chunks.append(chunk)

    async def end(self) -> None:
        self.ended = True


@pytest.mark.parametrize(
    ("size", "headers", "coded"),
    [
        pytest.param(1024, JSON, True, id="at-min-bytes"),
        pytest.param(1023, JSON, False, id="under-min-bytes"),
        pytest.param(THREAD_BYTES + 1, JSON, True, id="long-in-a-thread"),
        pytest.param(4096, {**JSON, "Content-Encoding": "br"}, False, id="coded-by-the-backend"),
        pytest.param(4096, {"Content-Type": "audio/wav"}, False, id="audio"),
    ],
)
@pytest.mark.parametrize("name", ["gzip", "zstd"])
async def test_a_whole_answer(name: str, size: int, headers: dict, coded: bool) -> None:
    body, own = (b'{"content": "' + b"abcdefgh" * size)[:size], headers.get("Content-Encoding")
    inner = _Reply()
    await EncodedReply(inner, _coding(name)).whole(200, headers, body)
    assert inner.headers.get("Content-Encoding") == (name if coded else own)
    assert (inner.headers.get("Vary") == "Accept-Encoding") is coded
    assert (DECODERS[name][1](inner.body) if coded else inner.body) == body


@pytest.mark.parametrize("name", ["gzip", "zstd"])
async def test_a_stream_is_sent_event_by_event_and_finished(name: str) -> None:
    inner = _Reply()
    reply = EncodedReply(inner, _coding(name))
    assert not reply.started
    await reply.begin(200, SSE)
    assert reply.started and inner.headers["Content-Encoding"] == name
    decoder = DECODERS[name][0]()
    for event in EVENTS:
        reply.send(event)
        assert decoder.decompress(inner.chunks[-1]) == event
    await reply.end()
    assert inner.ended and decoder.decompress(inner.chunks[-1]) == b"" and decoder.eof


@pytest.mark.parametrize("name", ["gzip", "zstd"])
async def test_a_stream_relayed_from_the_callbacks_goes_through_the_encoder(name: str) -> None:
    """The fast path's relay writes to the sink: plain chunks, and reads of whole chunks
    as the backend framed them; each decodes on its own to what the backend sent."""
    inner = _Reply()
    reply = EncodedReply(inner, _coding(name))
    await reply.begin(200, SSE)
    sink = reply.sink
    assert sink is not inner.sink
    decoder = DECODERS[name][0]()
    sink.put(EVENTS[0])
    assert decoder.decompress(inner.sink.writes[-1]) == EVENTS[0]
    framed = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in EVENTS[1:3])
    sink.put_framed(framed)
    assert decoder.decompress(inner.sink.writes[-1]) == EVENTS[1] + EVENTS[2]
    await reply.end()  # the trailer, after what the sink took
    assert decoder.decompress(inner.chunks[-1]) == b"" and decoder.eof


async def test_an_answer_not_compressed_keeps_the_direct_sink() -> None:
    inner = _Reply()
    reply = EncodedReply(inner, _coding("gzip"))
    await reply.begin(200, {"Content-Type": "audio/wav"})
    assert reply.sink is inner.sink


@pytest.mark.parametrize("name", ["gzip", "zstd"])
async def test_a_broken_streams_error_event_is_in_the_encoded_stream(name: str) -> None:
    inner = _Reply()
    reply = EncodedReply(inner, _coding(name))
    await reply.begin(200, SSE)
    reply.send(EVENTS[0])
    await end_stream_with(reply, UpstreamDisconnected("The backend broke off the stream."))
    sent = DECODERS[name][1](b"".join(inner.chunks))
    assert sent.startswith(EVENTS[0]) and b"broke off the stream" in sent
    assert sent.endswith(b"data: [DONE]\n\n") and inner.ended


async def test_a_stream_coded_by_the_backend_goes_as_it_came() -> None:
    inner = _Reply()
    reply = EncodedReply(inner, _coding("gzip"))
    await reply.begin(200, {**SSE, "Content-Encoding": "br"})
    reply.send(b"\x8b\x02\x80")
    await reply.end()
    assert inner.headers["Content-Encoding"] == "br" and inner.chunks == [b"\x8b\x02\x80"]


async def test_an_error_answer_before_the_answer_began_is_left_small() -> None:
    inner = _Reply()
    await refuse(EncodedReply(inner, _coding("zstd")), UpstreamDisconnected("gone"), {})
    assert inner.status == 502 and b"gone" in inner.body
    assert "Content-Encoding" not in inner.headers

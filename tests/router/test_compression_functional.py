"""Response compression end to end, over real sockets: a router with `compression` on
in front of stub and simulated vLLM backends, and clients that decode what they read as
it arrives. Each SSE event must decode before the backend sends the next one, through
both servers (the fast path, and aiohttp's after a hand-over)."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator, Callable

import aiohttp
import orjson
import pytest
import zstandard

from bench.sim.fleet import start_fleet
from bench.sim.params import SimParams
from tests.router.conftest import running, sdk_through
from tests.stub_backend import Behaviour

ON = {"enabled": True}
CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
DECODERS: dict[str, Callable] = {
    "gzip": lambda: zlib.decompressobj(31),
    "zstd": lambda: zstandard.ZstdDecompressor().decompressobj(),
}
DONE = b"data: [DONE]\n\n"


class Decoded:
    """An answer's body, decoded read by read as it arrives (identity: as it came)."""

    def __init__(self, resp: aiohttp.ClientResponse, coding: str | None) -> None:
        self._resp = resp
        self._decoder = DECODERS[coding]() if coding else None
        self.text = b""

    async def read(self) -> bytes:
        """One read of the body, decoded; b"" at its end."""
        chunk = await self._resp.content.readany()
        out = self._decoder.decompress(chunk) if self._decoder and chunk else chunk
        self.text += out
        return chunk

    async def until_events(self, n: int) -> None:
        """Read until `n` whole events decoded (bounded by the caller's timeout)."""
        while self.text.count(b"\n\n") < n:
            assert await self.read(), f"the stream ended before event {n}: {self.text!r}"

    async def to_end(self) -> bytes:
        while await self.read():
            pass
        assert self._decoder is None or self._decoder.eof  # the trailer came
        return self.text


async def _chunked(body: bytes) -> AsyncIterator[bytes]:
    """A request body sent chunked: the fast path hands such a request to aiohttp."""
    yield body


def _post(http: aiohttp.ClientSession, url: str, body: dict, coding: str, server: str):
    data = orjson.dumps(body)
    headers = {"Accept-Encoding": coding, "Content-Type": "application/json"}
    sent = _chunked(data) if server == "aiohttp" else data
    return http.post(url + "/v1/chat/completions", data=sent, headers=headers)


@pytest.mark.parametrize("server", ["fast", "aiohttp"])
@pytest.mark.parametrize("coding", ["gzip", "zstd"])
async def test_each_event_decodes_before_the_backend_sends_the_next(
    coding: str, server: str, handovers
) -> None:
    gate, events = asyncio.Semaphore(0), 6
    async with running(1, compression=ON) as (router, stubs):
        stubs[0].behaviour = Behaviour(chunks=events, chunk_gate=gate)
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            async with _post(http, router.url, {**CHAT, "stream": True}, coding, server) as resp:
                assert resp.headers["Content-Encoding"] == coding
                assert resp.headers["Vary"] == "Accept-Encoding"
                body = Decoded(resp, coding)
                async with asyncio.timeout(10):
                    for i in range(events - 1):
                        await body.until_events(i + 1)  # the backend waits: event i is out
                        assert body.text.count(b"\n\n") == i + 1
                        assert f"tok{i} ".encode() in body.text
                        gate.release()  # the next event, or the last one and [DONE]
                    text = await body.to_end()
    assert text.endswith(b"\n\n" + DONE) and text.count(b"\n\n") == events + 1
    assert bool(handovers) is (server == "aiohttp")
    assert "Accept-Encoding" not in stubs[0].headers[-1]  # the backend answered uncoded


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
async def test_a_simulated_chat_stream_decodes_whole_and_in_order(coding: str) -> None:
    fleet = await start_fleet(1, SimParams(time_scale=0.01))
    body = {
        "model": "sim-llama-70b",
        "messages": [{"role": "user", "content": "tell me more"}],
        "max_tokens": 60,
        "stream": True,
    }
    texts = {}
    try:
        backends = [{"url": fleet.urls[0]}]
        async with running(0, backends=backends, compression=ON) as (router, _):
            async with aiohttp.ClientSession(auto_decompress=False) as http:
                for asked in (coding, "identity"):
                    async with _post(http, router.url, body, asked, "fast") as resp:
                        got = resp.headers.get("Content-Encoding")
                        assert got == (None if asked == "identity" else coding)
                        async with asyncio.timeout(20):
                            texts[asked] = await Decoded(resp, got).to_end()
    finally:
        await fleet.stop()
    events = [_event(e) for e in texts[coding].split(b"\n\n")[:-1]]
    plain = [_event(e) for e in texts["identity"].split(b"\n\n")[:-1]]
    assert events[-1] == plain[-1] == "[DONE]" and len(events) == len(plain) == 62
    assert [_content(e) for e in events[:-1]] == [_content(e) for e in plain[:-1]]


def _event(raw: bytes) -> str:
    """An event's data (it must be whole: one `data:` line)."""
    assert raw.startswith(b"data: ") and b"\n" not in raw, raw
    return raw.removeprefix(b"data: ").decode()


def _content(data: str) -> str:
    return orjson.loads(data)["choices"][0]["delta"].get("content", "")


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
async def test_a_whole_answer_is_compressed_from_min_bytes_on(coding: str) -> None:
    async with running(1, compression=ON) as (router, stubs):
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            answers = {}
            for chunks in (200, 3):  # ~1.6 KB of JSON, and ~250 bytes
                stubs[0].behaviour = Behaviour(chunks=chunks)
                async with _post(http, router.url, CHAT, coding, "fast") as resp:
                    answers[chunks] = resp.headers, await resp.read()
    (big_headers, big), (small_headers, small) = answers[200], answers[3]
    assert big_headers["Content-Encoding"] == coding and big_headers["Vary"] == "Accept-Encoding"
    assert int(big_headers["Content-Length"]) == len(big)
    unpacked = gzip.decompress(big) if coding == "gzip" else zstandard.decompress(big)
    assert orjson.loads(unpacked)["choices"][0]["message"]["content"].startswith("tok0 tok1")
    assert len(big) < len(unpacked) / 2
    assert "Content-Encoding" not in small_headers and "Vary" not in small_headers
    assert orjson.loads(small)["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "


@pytest.mark.parametrize(
    ("compression", "accept", "forwarded"),
    [
        pytest.param(ON, "identity", None, id="identity-asked"),
        pytest.param(ON, "br", None, id="nothing-offered-accepted"),
        pytest.param({}, "gzip", "gzip", id="compression-off"),
    ],
)
async def test_an_uncompressed_answer_is_the_backends_bytes(
    compression: dict, accept: str, forwarded: str | None
) -> None:
    async with running(1, compression=compression) as (router, stubs):
        stubs[0].behaviour = Behaviour(chunks=200)
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            async with _post(http, router.url, {**CHAT, "stream": True}, accept, "fast") as resp:
                assert "Content-Encoding" not in resp.headers
                text = await Decoded(resp, None).to_end()
            async with _post(http, router.url, CHAT, accept, "fast") as resp:
                assert "Content-Encoding" not in resp.headers
                whole = await resp.json()
    assert text.startswith(b'data: {"id":"chatcmpl-1"') and text.endswith(DONE)
    assert whole["choices"][0]["message"]["content"].startswith("tok0 tok1")
    assert stubs[0].headers[-1].get("Accept-Encoding") == forwarded


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
async def test_a_broken_streams_error_event_is_in_the_encoded_stream(coding: str) -> None:
    async with running(1, compression=ON) as (router, stubs):
        stubs[0].behaviour = Behaviour(chunks=5, cut_after_chunks=2)
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            async with _post(http, router.url, {**CHAT, "stream": True}, coding, "fast") as resp:
                async with asyncio.timeout(10):
                    text = await Decoded(resp, coding).to_end()
    assert b"tok1 " in text and b"broke off the stream." in text
    assert text.endswith(b"\n\n" + DONE)


async def test_the_usage_event_is_taken_out_before_the_stream_is_compressed() -> None:
    async with running(1, compression=ON, usage={"stream_usage": True}) as (router, stubs):
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            async with _post(http, router.url, {**CHAT, "stream": True}, "zstd", "fast") as resp:
                assert resp.headers["Content-Encoding"] == "zstd"
                text = await Decoded(resp, "zstd").to_end()
    assert stubs[0].received[-1]["stream_options"] == {"include_usage": True}
    assert b'"usage"' not in text and text.count(b"\n\n") == 4 and text.endswith(DONE)


async def test_the_openai_sdk_reads_compressed_answers() -> None:
    fleet = await start_fleet(1, SimParams(time_scale=0.01))
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": fleet.urls[0]}],
        "compression": {"enabled": True, "min_bytes": 64},
    }
    ask = {"model": "sim-llama-70b", "messages": [{"role": "user", "content": "hi"}]}
    async with sdk_through(config, fleet) as oai:
        raw = await oai.chat.completions.with_raw_response.create(**ask, max_tokens=20)
        assert raw.headers["content-encoding"] == "gzip"  # the SDK asks for gzip, deflate
        assert raw.parse().usage.completion_tokens == 20
        stream = await oai.chat.completions.create(**ask, max_tokens=20, stream=True)
        chunks = [c async for c in stream]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 20

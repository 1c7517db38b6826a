"""Request bodies before and while they are held: a request with an invalid token is
refused on its head, before any of its body is read (on a real router process, whose
peak memory stays flat under a crowd of such uploads), and the bodies held at once stay
within `limits.max_buffered_body_bytes` (503 + Retry-After beyond it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
import yaml

from tests.router.chaos import until
from tests.router.conftest import running, settle
from tests.router.test_fast_ingress_functional import BODY, read_response
from tests.router.test_signals_functional import kvroute
from tests.stub_backend import StubBackend

TOKEN = "body-budget-token"
AUTH = {"enabled": True, "tokens_env": "KV_BUDGET_TOKENS"}
PATHS = {"fast-path": "/v1/chat/completions", "aiohttp": "/v1/chat/completions?via=aiohttp"}


@pytest.fixture
def auth(monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("KV_BUDGET_TOKENS", TOKEN)
    return AUTH


def head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\n"
        f"{extra}Content-Length: {length}\r\n\r\n"
    ).encode()


def chunked_head(path: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: k\r\nTransfer-Encoding: chunked\r\n\r\n".encode()


def padded(size: int) -> bytes:
    """A chat request of exactly `size` bytes (JSON allows the trailing blanks)."""
    return BODY + b" " * (size - len(BODY))


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
async def test_an_invalid_token_is_refused_on_the_head_before_the_body(
    path: str, auth: dict
) -> None:
    """The body is declared (1 MB) but never sent: the 401 comes all the same (not
    once the body timed out), says `Connection: close`, and nothing of it is held."""
    async with running(1, auth=auth, limits={"body_timeout": 60}) as (router, stubs):
        for token in ("", "Authorization: Bearer wrong\r\n"):
            reader, writer = await connect(router.port)
            try:
                async with asyncio.timeout(10):
                    writer.write(head(path, 1_000_000, token) + b'{"model"')
                    status, headers, body = await read_response(reader)
                    assert router.ingress.bodies.held == 0
            finally:
                writer.close()
            assert (status, headers["connection"]) == (401, "close")
            assert orjson.loads(body)["error"]["code"] == 401
        assert stubs[0].received == []


def _peak_kib(pid: int) -> int:
    """The process's peak resident set size (VmHWM), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


async def _upload(port: int, size: int) -> tuple[asyncio.StreamWriter, asyncio.Task]:
    """Send a head declaring `size` bytes and all of the body but its last bytes,
    without a token; the connection, and the answer to come. The router may close the
    connection while the body is still being written: a refusal, lingered over."""
    reader, writer = await connect(port)
    answer = asyncio.create_task(read_response(reader))
    chunk = b" " * 65536
    try:
        writer.write(head("/v1/chat/completions", size))
        for _ in range((size - 1) // len(chunk)):
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass
    return writer, answer


async def test_unauthenticated_uploads_do_not_raise_the_routers_memory(
    tmp_path: Path, auth: dict
) -> None:
    """16 concurrent 8 MiB uploads without a token, each short of its last bytes, to a
    real `kvroute serve` process: its peak RSS grows by far less than one upload's
    worth per connection (buffered, as they were, they took twice that: 256 MiB)."""
    stub = await StubBackend().start()
    config = tmp_path / "router.yaml"
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": stub.url}],
        "workers": 1,
        "auth": auth,
        "limits": {"body_timeout": 30},
    }
    config.write_text(yaml.safe_dump(data))
    try:
        async with kvroute(config) as served:
            port = int(served.url.rsplit(":", 1)[1])
            warm = head("/v1/chat/completions", len(BODY), f"Authorization: Bearer {TOKEN}\r\n")
            reader, writer = await connect(port)
            async with asyncio.timeout(10):
                writer.write(warm + BODY)
                assert (await read_response(reader))[0] == 200
            writer.close()
            before = _peak_kib(served.proc.pid)
            uploads = await asyncio.gather(*(_upload(port, 8 << 20) for _ in range(16)))
            grown = _peak_kib(served.proc.pid) - before
            assert grown < 48 * 1024, f"peak RSS grew by {grown} KiB"
            async with asyncio.timeout(10):
                statuses = [(await answer)[0] for _, answer in uploads]
            for writer, _ in uploads:
                writer.close()
        assert statuses == [401] * 16
    finally:
        await stub.stop()


LIMITS = {"max_body_bytes": 100_000, "max_buffered_body_bytes": 250_000}
SIZE = 100_000
FRAMINGS = ["fast-path", "aiohttp", "chunked"]


def _start(framing: str) -> bytes:
    """A request of SIZE bytes, all but its last 10 body bytes."""
    body = padded(SIZE)[:-10]
    if framing == "chunked":
        return chunked_head(PATHS["aiohttp"]) + b"%x\r\n%s\r\n" % (len(body), body)
    return head(PATHS[framing], SIZE) + body


def _end(framing: str) -> bytes:
    rest = padded(SIZE)[-10:]
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest) if framing == "chunked" else rest


@pytest.mark.parametrize("framing", FRAMINGS)
async def test_bodies_beyond_the_budget_are_refused_503_until_room_is_made(framing: str) -> None:
    async with running(1, limits=LIMITS) as (router, stubs):
        bodies = router.ingress.bodies
        holders = [await connect(router.port) for _ in range(2)]
        try:
            async with asyncio.timeout(10):
                for _, writer in holders:
                    writer.write(_start(framing))
                await until(lambda: bodies.held >= 2 * (SIZE - 10))
                reader, writer = await connect(router.port)  # no room for this one
                writer.write(_start(framing))
                status, headers, body = await read_response(reader)
                assert (status, headers["retry-after"]) == (503, "1")
                assert headers["connection"] == "close"
                assert orjson.loads(body)["error"]["type"] == "ServiceUnavailableError"
                writer.close()
                for reader, writer in holders:  # the first two finish: room again
                    writer.write(_end(framing))
                    assert (await read_response(reader))[0] == 200
                await until(lambda: bodies.held == 0)
                reader, writer = holders[0]
                writer.write(_start(framing) + _end(framing))
                assert (await read_response(reader))[0] == 200
        finally:
            for _, writer in holders:
                writer.close()
        await settle(router)
        assert bodies.held == 0
        assert len(stubs[0].received) == 3

"""Signals to a real `kvroute serve` process: SIGTERM drains under load, SIGHUP reloads."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import orjson
import yaml

from tests.router.chaos import Reply, Tally, chat, until
from tests.stub_backend import Behaviour, StubBackend

CHAT_PATH = "/v1/chat/completions"
_LISTENING = re.compile(rb"listening on (http://\S+),")


class Served:
    def __init__(self, proc: asyncio.subprocess.Process, url: str, log: bytearray) -> None:
        self.proc, self.url, self.log = proc, url, log


@asynccontextmanager
async def running(config: Path) -> AsyncIterator[Served]:
    """`python -m router serve -c config` from its start, its log gathered as it comes
    (`url` unknown yet); killed if a test fails."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "serve", "-c", str(config),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    log = bytearray()

    async def read_log() -> None:
        async for line in proc.stderr:
            log.extend(line)

    reader = asyncio.create_task(read_log())
    try:
        yield Served(proc, "", log)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        await reader


@asynccontextmanager
async def kvroute(config: Path) -> AsyncIterator[Served]:
    """`python -m router serve -c config`, once it listens; killed if a test fails."""
    async with running(config) as served:
        served.url = await listening(served)
        yield served


async def listening(served: Served) -> str:
    """The URL the router logs it listens on, once it does (bounded)."""
    async with asyncio.timeout(20):
        while not (found := _LISTENING.search(served.log)):
            if served.proc.returncode is not None:
                raise AssertionError(served.log.decode())
            await asyncio.sleep(0.02)
    return found.group(1).decode()


def _write(path: Path, stubs: list[StubBackend], members: list[int], **extra) -> None:
    backends = [{"url": stubs[i].url, "name": f"s{i}"} for i in members]
    data = {"listen": {"host": "127.0.0.1", "port": 0}, "backends": backends, **extra}
    path.write_text(yaml.safe_dump(data))


async def test_sigterm_lets_streams_finish_and_refuses_new_connections(tmp_path: Path) -> None:
    stubs = [await StubBackend().start() for _ in range(2)]
    for stub in stubs:
        stub.behaviour.chunks, stub.behaviour.pace = 10, 0.1  # ~1 s streams
    path = tmp_path / "router.yaml"
    _write(path, stubs, [0, 1], shutdown={"unready_seconds": 1.0, "drain_seconds": 10})
    tally = Tally.new()
    try:
        async with kvroute(path) as served, aiohttp.ClientSession() as http:
            url = served.url + CHAT_PATH
            streams = [
                asyncio.create_task(tally.send(http, url, **chat(stream=True))) for _ in range(6)
            ]
            await until(lambda: sum(s.active for s in stubs) == 6)
            served.proc.send_signal(signal.SIGTERM)
            ready = served.url + "/ready"
            async with asyncio.timeout(1):  # the signal is handled on the router's loop
                while (await tally.send(http, ready, method="GET", expect=None)).status == 200:
                    await asyncio.sleep(0.01)
            reply = await tally.send(http, ready, method="GET", expect=503)
            assert reply.json() == {"status": "shutting down"}

            async def refused() -> bool:
                fresh = aiohttp.TCPConnector(force_close=True)
                async with aiohttp.ClientSession(connector=fresh) as other:
                    try:
                        await tally.send(other, url, expect=None, bound=2, **chat())
                    except aiohttp.ClientConnectionError:
                        tally.add("failed", -1)  # refused is the expected outcome
                        return True
                return False

            async with asyncio.timeout(3):
                while not await refused():
                    await asyncio.sleep(0.05)
            replies = await asyncio.gather(*streams)
            assert all(r.status == 200 for r in replies)
            assert all(r.events()[-1] == b"[DONE]" and b'"error"' not in r.body for r in replies)
            assert all(len(r.events()) == 11 for r in replies)  # every chunk, then [DONE]
            assert await asyncio.wait_for(served.proc.wait(), 10) == 0
        assert sum(s.aborted for s in stubs) == 0
        assert (tally.failed, tally.hung) == (0, 0)
    finally:
        for stub in stubs:
            await stub.stop()


async def test_sighup_reloads_and_a_bad_file_keeps_the_old_config(tmp_path: Path) -> None:
    stubs = [await StubBackend().start() for _ in range(2)]
    path = tmp_path / "router.yaml"
    _write(path, stubs, [0])
    tally = Tally.new()
    try:
        async with kvroute(path) as served, aiohttp.ClientSession() as http:
            url = served.url + CHAT_PATH
            assert (await tally.send(http, url, **chat())).headers["x-kvroute-backend"] == "s0"
            _write(path, stubs, [1])  # s1 only: s0 is removed
            served.proc.send_signal(signal.SIGHUP)
            async with asyncio.timeout(5):
                while (await tally.send(http, url, **chat())).headers["x-kvroute-backend"] != "s1":
                    await asyncio.sleep(0.02)
            path.write_text("backends: [{url: 'not a url'}]\n")
            served.proc.send_signal(signal.SIGHUP)
            await until(lambda: b"reload rejected" in served.log)
            assert (await tally.send(http, url, **chat())).headers["x-kvroute-backend"] == "s1"
            served.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(served.proc.wait(), 10) == 0
        assert (tally.failed, tally.hung) == (0, 0)
    finally:
        for stub in stubs:
            await stub.stop()


async def test_a_sighup_while_the_router_starts_is_a_reload_once_it_serves(tmp_path) -> None:
    """One process: a SIGHUP during its start-up probe (its backend slow to answer
    /health) waits for the router to serve, then reloads it; it used to end it."""
    stubs = [await StubBackend(behaviour=Behaviour(health_delay=1.0)).start() for _ in range(2)]
    path = tmp_path / "router.yaml"
    _write(path, stubs, [0], workers=1)
    try:
        async with running(path) as served:
            await until(lambda: stubs[0].health_checks > 0, timeout=20)  # probing, not serving
            _write(path, stubs, [0, 1])
            served.proc.send_signal(signal.SIGHUP)
            await listening(served)
            await until(lambda: b"config reloaded: 2 backends" in served.log, timeout=20)
            assert served.proc.returncode is None
            assert re.search(
                rb"listening on http://\S+, strategy KV_AWARE, 1 backend\n", served.log
            )
            assert served.log.count(b"listening on") == 1
    finally:
        for stub in stubs:
            await stub.stop()


async def test_a_sighup_while_workers_start_reloads_each_once_it_serves(tmp_path) -> None:
    """Several workers: the supervisor forwards a SIGHUP to children still starting (they
    wait for the collector's slow first probe); each reloads once it serves, none is
    ended and restarted (which read as a restart: each logged `listening on` again)."""
    stubs = [await StubBackend(behaviour=Behaviour(health_delay=1.0)).start() for _ in range(3)]
    path = tmp_path / "router.yaml"
    _write(path, stubs, [0, 1], workers=2)
    try:
        async with running(path) as served:
            await until(lambda: b"kvroute supervisor" in served.log, timeout=20)  # spawning
            _write(path, stubs, [0, 1, 2], workers=2)
            served.proc.send_signal(signal.SIGHUP)
            # two workers and the collector
            await until(lambda: served.log.count(b"config reloaded: 3 backends") == 3, timeout=30)
            assert served.log.count(b"listening on http") == 2
            assert b"exited with code" not in served.log
    finally:
        for stub in stubs:
            await stub.stop()


async def test_streams_open_at_the_drain_deadline_end_with_an_error_event(tmp_path) -> None:
    """SIGTERM while streams outlive `drain_seconds`: at the deadline each one, whichever
    server relays it (the fast path's, or aiohttp's after a hand-over: `Expect:
    100-continue`), ends with a "shutting down" error event, `[DONE]` and the chunked
    terminator, so its client can tell a shutdown from a network fault; the backend
    stops generating."""
    stub = await StubBackend().start()
    stub.behaviour.chunks, stub.behaviour.pace = 1000, 0.05  # a 50 s stream
    path = tmp_path / "router.yaml"
    _write(path, [stub], [0], shutdown={"drain_seconds": 0.5})
    tally = Tally.new()
    try:
        async with kvroute(path) as served, aiohttp.ClientSession() as http:
            host, port = served.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            body = orjson.dumps(chat(stream=True)["json"])
            head = f"POST {CHAT_PATH} HTTP/1.1\r\nHost: kvroute\r\nContent-Length: {len(body)}"
            writer.write(head.encode() + b"\r\n\r\n" + body)
            tally.add("sent")
            handed = await http.post(served.url + CHAT_PATH, expect100=True, **chat(stream=True))
            tally.add("sent")
            assert handed.status == 200
            await until(lambda: stub.active == 2)
            served.proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(10):
                raw = await reader.read()  # to EOF: the router closes the connection
                relayed = await handed.read()  # no ClientPayloadError: a whole chunked body
            writer.close()
            assert raw.startswith(b"HTTP/1.1 200 ") and b"Transfer-Encoding: chunked" in raw
            assert raw.endswith(b"\r\n0\r\n\r\n")  # the chunked terminator
            for streamed in (_unchunked(raw), relayed):
                events = Reply(200, {}, streamed).events()
                assert 1 < len(events) < 1000  # cut mid-stream
                assert events[-1] == b"[DONE]"
                error = orjson.loads(events[-2])["error"]
                assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
                assert "shutting down" in error["message"]
            assert await asyncio.wait_for(served.proc.wait(), 10) == 0
        await until(lambda: stub.aborted == 2)  # and the backend stopped generating
    finally:
        await stub.stop()
    assert tally.hung == 0


def _unchunked(raw: bytes) -> bytes:
    """The body of one chunked HTTP/1.1 answer, `raw` from its status line to its end."""
    rest = raw.partition(b"\r\n\r\n")[2]
    body = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        if not int(size, 16):
            return body
        body += rest[: int(size, 16)]
        rest = rest[int(size, 16) + 2 :]


async def test_sighup_reopens_the_access_log_that_logrotate_moved(tmp_path: Path) -> None:
    """Every worker writes its lines to the file at the path from the SIGHUP on: the
    moved file keeps the lines from before, the new one gets those after."""
    stub = await StubBackend().start()
    path = tmp_path / "router.yaml"
    access = tmp_path / "access.log"
    _write(path, [stub], [0], workers=2, access_log={"enabled": True, "path": str(access)})
    before = [f"before-{i}" for i in range(8)]
    after = [f"after-{i}" for i in range(8)]
    try:
        async with kvroute(path) as served:
            url = served.url + CHAT_PATH

            async def send(ids: list[str]) -> None:
                for rid in ids:  # new connections: the kernel spreads them over the workers
                    async with aiohttp.ClientSession() as fresh:
                        headers = {"X-Request-Id": rid}
                        async with fresh.post(url, headers=headers, **chat()) as r:
                            assert r.status == 200

            def lines(file: Path) -> str:
                return file.read_text() if file.exists() else ""

            await send(before)
            await until(lambda: all(r in lines(access) for r in before), timeout=10)
            access.rename(tmp_path / "access.log.1")
            served.proc.send_signal(signal.SIGHUP)
            await until(lambda: served.log.count(b"access log: reopened") == 2, timeout=10)
            await send(after)
            await until(lambda: all(r in lines(access) for r in after), timeout=10)
    finally:
        await stub.stop()
    moved = (tmp_path / "access.log.1").read_text()
    assert all(r in moved for r in before)
    assert not any(r in moved for r in after)
    assert not any(r in lines(access) for r in before)

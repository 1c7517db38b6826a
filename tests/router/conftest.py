"""Fixtures for functional router tests: real stub backends and a real router on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest

from router.config import build
from router.control.worker import Router
from router.ingress.fast import FastConnection
from tests.stub_backend import StubBackend

T = TypeVar("T")


@pytest.fixture
def handovers(monkeypatch) -> list[bytes]:
    """The bytes each hand-over from the fast path to aiohttp's server started from
    (router/ingress/fast.py): the requests aiohttp answered."""
    seen: list[bytes] = []
    real = FastConnection._hand_over

    def spy(self: FastConnection, data: bytes) -> None:
        seen.append(data)
        real(self, data)

    monkeypatch.setattr(FastConnection, "_hand_over", spy)
    return seen


@asynccontextmanager
async def running(
    n: int = 3, routing: dict[str, Any] | None = None, **config: Any
) -> AsyncIterator[tuple[Router, list[StubBackend]]]:
    """Start `n` stub backends and a router in front of them; stop all on exit."""
    stubs = [await StubBackend().start() for _ in range(n)]
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": s.url, "name": f"b{i}"} for i, s in enumerate(stubs)],
        "routing": routing or {"strategy": "RANDOM"},
        **config,
    }
    router = Router(build(data))
    await router.start()
    try:
        yield router, stubs
    finally:
        await router.stop()
        for stub in stubs:
            await stub.stop()


@asynccontextmanager
async def sdk_through(config: dict[str, Any], fleet: Any) -> AsyncIterator[Any]:
    """A router built from `config` (its backends: `fleet`'s) and an openai SDK client
    of it; client, router and fleet all stopped on exit."""
    from openai import AsyncOpenAI

    try:
        router = Router(build(config))
        await router.start()
        try:
            url = router.url + "/v1"
            async with AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=20) as oai:
                yield oai
        finally:
            await router.stop()
    finally:
        await fleet.stop()


async def until_tried_on(
    stub: StubBackend, send: Callable[[], Awaitable[T]], tries: int = 40
) -> list[T]:
    """`send()` until a request reached `stub` (bounded: with RANDOM over two backends,
    each request tries it first half the time); the answers, in order."""
    answers = []
    for _ in range(tries):
        answers.append(await send())
        if stub.received:
            break
    assert stub.received, f"none of {tries} requests was tried on {stub.url} first"
    return answers


async def settle(router: Router, timeout: float = 5.0) -> None:
    """Wait (bounded) until the router has nothing in flight."""
    async with asyncio.timeout(timeout):
        while router.dispatcher.active or any(b.inflight for b in router.fleet.members):
            await asyncio.sleep(0.01)


def pytest_terminal_summary(terminalreporter) -> None:
    """The chaos and abuse suite's own counts (tests/router/chaos.py)."""
    from tests.router.chaos import TALLY

    if TALLY.sent:
        terminalreporter.write_line(f"kvroute chaos and abuse suite: {TALLY}")

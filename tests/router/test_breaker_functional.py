"""The breaker fed by real requests, between a real router and stub backends on
127.0.0.1: a 500 that every backend gives a request is the request's fault and ejects
no one; a backend that alone answers 500 is ejected.
"""

from __future__ import annotations

import aiohttp
import orjson

from router.fleet.breaker import BreakerState
from tests.router.conftest import running, settle

POISON = b"a body every backend fails on"
#: sensitive on purpose: three 500s in a row would open a breaker
CONFIG = {
    "routing": {"strategy": "ROUND_ROBIN"},
    "breaker": {"failure_threshold": 3, "server_error_weight": 1.0, "open_seconds": 600},
    "retries": {"backoff": 0.001, "backoff_max": 0.01},
}


def chat(text: str) -> bytes:
    return orjson.dumps({"model": "stub-model", "messages": [{"role": "user", "content": text}]})


async def statuses(http: aiohttp.ClientSession, url: str, text: str, n: int) -> list[int]:
    out = []
    for _ in range(n):
        async with http.post(url + "/v1/chat/completions", data=chat(text)) as reply:
            await reply.read()
            out.append(reply.status)
    return out


async def test_a_body_every_backend_fails_on_ejects_no_backend() -> None:
    """Each poison request is tried on two backends, gets the second's 500, and counts
    against neither; normal requests then still go to both."""
    async with running(2, **CONFIG) as (router, stubs), aiohttp.ClientSession() as http:
        for stub in stubs:
            stub.behaviour.poison = POISON
        assert await statuses(http, router.url, POISON.decode(), 30) == [500] * 30
        assert sum(len(s.raw) for s in stubs) == 60  # two opinions, no third try
        assert [b.breaker.state for b in router.fleet.members] == [BreakerState.CLOSED] * 2
        before = [len(s.raw) for s in stubs]
        assert await statuses(http, router.url, "hello", 10) == [200] * 10
        assert all(len(s.raw) > n for s, n in zip(stubs, before, strict=True))
        await settle(router)


async def test_a_backend_that_alone_answers_500_is_ejected() -> None:
    """b0 fails every request that b1 serves: its 500s are its own, its breaker opens,
    and every client gets b1's answer."""
    async with running(2, **CONFIG) as (router, stubs), aiohttp.ClientSession() as http:
        stubs[0].behaviour.status = 500
        assert await statuses(http, router.url, "hello", 10) == [200] * 10
        b0, b1 = router.fleet.members
        assert b0.breaker.state is BreakerState.OPEN
        assert b1.breaker.state is BreakerState.CLOSED
        await settle(router)

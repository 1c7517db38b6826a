"""Active health checks and passive ejection against real stub backends on 127.0.0.1."""

from __future__ import annotations

import logging
import socket

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.config import build
from router.control.worker import Router
from router.fleet.breaker import BreakerState
from tests.router.chaos import Tally, chat, until
from tests.router.conftest import running, settle
from tests.stub_backend import Behaviour, StubBackend

FAST_CHECKS = {"interval": 0.05, "timeout": 0.3, "unhealthy_threshold": 3, "healthy_threshold": 2}
NO_CHECKS = {"enabled": False}


async def test_failing_checks_mark_down_and_passing_ones_mark_up() -> None:
    async with running(2, health=FAST_CHECKS) as (router, stubs), aiohttp.ClientSession() as http:
        b0 = router.fleet.members[0]
        stubs[0].behaviour.health_status = 503
        await until(lambda: not b0.healthy)
        tally = Tally.new()
        for _ in range(10):
            reply = await tally.send(http, router.url + "/v1/chat/completions", **chat())
            assert reply.headers["x-kvroute-backend"] == "b1"
        stubs[0].behaviour.health_status = 200
        await until(lambda: b0.healthy)
        assert b0.transitions == {"down": 1, "up": 1}
        assert (tally.failed, tally.hung) == (0, 0)


async def test_slow_but_answering_backend_is_never_marked_down() -> None:
    """peers.md §4 item 11: a busy backend answers its checks late, but in time."""
    async with running(1, health=FAST_CHECKS) as (router, stubs):
        stubs[0].behaviour.health_delay = 0.2  # slower than the check interval, inside timeout
        await until(lambda: stubs[0].health_checks >= 5, timeout=5)
        assert router.fleet.members[0].healthy
        assert router.fleet.members[0].transitions == {}


async def test_checks_that_time_out_repeatedly_mark_down() -> None:
    async with running(1, health=FAST_CHECKS) as (router, stubs):
        stubs[0].behaviour.health_delay = 1.0  # beyond the 0.3 s timeout
        await until(lambda: not router.fleet.members[0].healthy)
        async with aiohttp.ClientSession() as http, http.get(router.url + "/ready") as resp:
            assert resp.status == 503


async def test_consecutive_5xx_open_the_breaker_and_trials_close_it() -> None:
    breaker = {"failure_threshold": 3, "open_seconds": 0.3, "half_open_successes": 2}
    config = {"health": NO_CHECKS, "breaker": breaker, "retries": {"max_retries": 0}}
    async with (
        running(2, {"strategy": "ROUND_ROBIN"}, **config) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        b0 = router.fleet.members[0]
        stubs[0].behaviour.status = 502  # passed through: no retries
        tally = Tally.new()
        url = router.url + "/v1/chat/completions"
        for _ in range(6):
            await tally.send(http, url, expect={200, 502}, **chat())
        assert b0.breaker.state is BreakerState.OPEN
        assert len(stubs[0].received) == 3  # nothing more after it opened
        for _ in range(4):
            assert (await tally.send(http, url, **chat())).headers["x-kvroute-backend"] == "b1"
        stubs[0].behaviour.status = 200
        await until(lambda: b0.breaker.state is BreakerState.HALF_OPEN)
        for _ in range(6):
            await tally.send(http, url, **chat())
        assert b0.breaker.state is BreakerState.CLOSED
        assert b0.transitions == {"open": 1, "half_open": 1, "closed": 1}
        await settle(router)
        async with http.get(router.url + "/metrics") as resp:
            text = await resp.text()
        changes = {
            (s.labels["backend"], s.labels["to"]): s.value
            for f in text_string_to_metric_families(text)
            if f.name == "kvroute_backend_state_changes"
            for s in f.samples
        }
        assert changes[("b0", "open")] == 1 and changes[("b0", "closed")] == 1
        assert (tally.failed, tally.hung) == (0, 0)


async def test_500s_a_client_provokes_do_not_eject_a_healthy_backend() -> None:
    """A malformed /tokenize body makes a healthy backend answer 500: ten in a row weigh
    one failure, so twice the threshold's worth keeps every breaker closed. The 502s a
    client cannot provoke still open it."""
    breaker = {"failure_threshold": 2, "open_seconds": 60}
    config = {"health": NO_CHECKS, "breaker": breaker, "retries": {"max_retries": 0}}
    async with (
        running(2, {"strategy": "ROUND_ROBIN"}, **config) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        for stub in stubs:
            stub.behaviour.tokenize_status = 500  # what the malformed body below provokes
        tally = Tally.new()
        malformed = {"json": {"model": "stub-model", "prompt": {"not": "a prompt"}}}
        for _ in range(8):  # four to each backend, twice failure_threshold
            await tally.send(http, router.url + "/tokenize", expect=500, **malformed)
        assert [b.breaker.state for b in router.fleet.members] == [BreakerState.CLOSED] * 2
        url = router.url + "/v1/chat/completions"
        served = {(await tally.send(http, url, **chat())).headers["x-kvroute-backend"]}
        served.add((await tally.send(http, url, **chat())).headers["x-kvroute-backend"])
        assert served == {"b0", "b1"}
        stubs[0].behaviour.status = 502
        for _ in range(4):
            await tally.send(http, url, expect={200, 502}, **chat())
        assert router.fleet.members[0].breaker.state is BreakerState.OPEN
        assert (tally.failed, tally.hung) == (0, 0)
        await settle(router)


async def test_a_failed_trial_reopens_the_breaker() -> None:
    breaker = {
        "failure_threshold": 1,
        "open_seconds": 0.2,
        "half_open_successes": 1,
        "max_ejection_percent": 100,  # a lone backend may be ejected
        "panic_threshold_percent": 0,  # and then nothing is tried
    }
    config = {"health": NO_CHECKS, "breaker": breaker, "retries": {"max_retries": 0}}
    async with running(1, **config) as (router, stubs), aiohttp.ClientSession() as http:
        b0 = router.fleet.members[0]
        stubs[0].behaviour.status = 502
        tally = Tally.new()
        url = router.url + "/v1/chat/completions"
        await tally.send(http, url, expect=502, **chat())
        assert b0.breaker.state is BreakerState.OPEN
        reply = await tally.send(http, url, expect=503, **chat())  # no backend: 503
        assert reply.headers["Retry-After"] == "1"
        await until(lambda: b0.breaker.state is BreakerState.HALF_OPEN)
        await tally.send(http, url, expect=502, **chat())
        assert b0.breaker.state is BreakerState.OPEN
        assert (tally.failed, tally.hung) == (0, 0)
        await settle(router)


async def test_backends_failing_at_start_are_named_in_one_warning_with_why(caplog) -> None:
    """One backend refuses connections, one answers its checks 503: the start-up warning
    names both, each with its error, and not the healthy one."""
    with socket.socket() as closed:  # a port nothing listens on, kept from reuse
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        stub = await StubBackend(behaviour=Behaviour(health_status=503)).start()
        ok = await StubBackend().start()
        config = build(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "backends": [
                    {"url": dead, "name": "dead"},
                    {"url": stub.url, "name": "sick"},
                    {"url": ok.url, "name": "fine"},
                ],
            }
        )
        router = Router(config)
        try:
            with caplog.at_level(logging.WARNING, logger="kvroute.backends"):
                await router.start()
        finally:
            await router.stop()
            await stub.stop()
            await ok.stop()
    (warning,) = [r.getMessage() for r in caplog.records if "at start" in r.getMessage()]
    assert warning.startswith("2 of 3 backends fail their health check at start")
    assert "dead (GET /health: Connection refused)" in warning
    assert "sick (GET /health answered 503)" in warning
    assert "fine" not in warning


def _said(caplog, backend: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvroute.backends" and r.getMessage().startswith(f"backend {backend}: ")
    ]


async def test_health_transitions_are_logged_with_the_failing_checks_error(caplog) -> None:
    async with running(2, health=FAST_CHECKS) as (router, stubs):
        b0 = router.fleet.members[0]
        with caplog.at_level(logging.INFO, logger="kvroute.backends"):
            stubs[0].behaviour.health_status = 503
            await until(lambda: not b0.healthy)
            stubs[0].behaviour.health_status = 200
            await until(lambda: b0.healthy)
    assert _said(caplog, "b0") == [
        "backend b0: down (3 checks failed: GET /health answered 503)",
        "backend b0: up (2 health checks passed in a row)",
    ]


async def test_breaker_transitions_are_logged_with_what_moved_them(caplog) -> None:
    breaker = {"failure_threshold": 2, "open_seconds": 0.2, "half_open_successes": 1}
    config = {"health": NO_CHECKS, "breaker": breaker, "retries": {"max_retries": 0}}
    async with (
        running(2, {"strategy": "ROUND_ROBIN"}, **config) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        b0, tally = router.fleet.members[0], Tally.new()
        url = router.url + "/v1/chat/completions"
        with caplog.at_level(logging.INFO, logger="kvroute.backends"):
            stubs[0].behaviour.status = 502
            for _ in range(4):
                await tally.send(http, url, expect={200, 502}, **chat())
            stubs[0].behaviour.status = 200
            await until(lambda: b0.breaker.state is BreakerState.HALF_OPEN)
            for _ in range(4):
                await tally.send(http, url, **chat())
            await until(lambda: b0.breaker.state is BreakerState.CLOSED)
    assert _said(caplog, "b0") == [
        "backend b0: breaker open (failed requests in a row, the last: unavailable (502, 503, "
        "504 or no answer))",
        "backend b0: breaker half_open (open for 0.2s: one trial request next)",
        "backend b0: breaker closed (its trial request succeeded)",
    ]

"""Fault bursts and dead fleets against real simulator processes (`python -m bench.sim`).

Each simulated vLLM server is a process of its own, so a kill is a real SIGKILL: its
port closes and connections to it are refused, as with a crashed vLLM. The router runs
in the test's process. What is checked: after a cut stream, a restart and a kill in
turn, the two live backends serve every request (the ejection cap keeps the second
breaker closed, panic routes over the open one); with every backend dead, every request
gets a 503 with Retry-After at once and the fleet is marked down on the first refusal.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.processes import free_port
from router.config import build
from router.control.worker import Router
from router.fleet.breaker import BreakerState
from tests.router.chaos import Tally, until
from tests.router.conftest import settle

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-llama-70b"
CHAT_PATH = "/v1/chat/completions"


@dataclass
class Sim:
    """One simulator process serving one vLLM server on `port`."""

    port: int
    proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Sim:
        argv = ["--instances", "1", "--base-port", str(self.port), "--time-scale", "0.01"]
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.sim",
            *argv,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        line = await asyncio.wait_for(self.proc.stdout.readline(), 20)  # bound: it serves
        assert line.decode().strip() == self.url, line
        return self

    async def kill(self) -> None:
        """SIGKILL: the process dies at once and nothing listens on its port."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                await self.kill()


@asynccontextmanager
async def fleet(n: int, **config) -> AsyncIterator[tuple[Router, list[Sim]]]:
    """`n` simulator processes (sim0, sim1, ...) and a router in front of them."""
    sims: list[Sim] = []
    try:
        for _ in range(n):
            sims.append(await Sim(free_port()).start())
        data = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "backends": [{"url": s.url, "name": f"sim{i}"} for i, s in enumerate(sims)],
            "routing": {"strategy": "ROUND_ROBIN"},
            "retries": {"backoff": 0.001, "backoff_max": 0.01},
            **config,
        }
        router = Router(build(data))
        await router.start()
        try:
            yield router, sims
        finally:
            await router.stop()
    finally:
        for sim in sims:
            await sim.stop()


def ask(stream: bool = False) -> dict:
    messages = [{"role": "user", "content": "hi"}]
    return {"json": {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": stream}}


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()


def counters(router: Router, name: str) -> dict[tuple[str, ...], float]:
    """The counted samples of counter `name` on the router's /metrics page, by label
    values (not those at 0 from the start)."""
    text = router.metrics.render().decode()
    return {
        tuple(s.labels.values()): s.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for s in family.samples
        if s.name == name + "_total" and s.value
    }


async def test_after_a_burst_of_faults_the_live_backends_serve_every_request() -> None:
    """A cut stream (sim0), a restart (sim1) and a kill (sim2), in turn. sim0's breaker
    opens; sim1's would too, but two of three is past the 50% cap; sim2 is marked down
    on its first refused connection. With one backend usable of three, panic routes over
    sim0 as well: the next 100 requests all succeed, on both live backends."""
    config = {
        "breaker": {"failure_threshold": 2, "open_seconds": 600},  # no recovery meanwhile
        "health": {"interval": 600},  # only the startup check: a hung /health never fails
    }
    async with fleet(3, **config) as (router, sims), aiohttp.ClientSession() as http:
        b0, b1, b2 = router.fleet.members
        url = router.url + CHAT_PATH
        tally = Tally.new()

        await post(http, sims[0].url + "/sim/fault", {"mode": "close_midstream", "after_chunks": 1})
        for _ in range(12):  # streams cut after their first chunk: two weigh the threshold
            if b0.breaker.state is BreakerState.OPEN:
                break
            await tally.send(http, url, **ask(stream=True))
        assert b0.breaker.state is BreakerState.OPEN
        await post(http, sims[0].url + "/sim/fault", {"mode": "none"})  # sim0 is well again

        await post(http, sims[1].url + "/sim/fault", {"mode": "hang"})
        waiting: list[asyncio.Task] = []
        while b1.inflight < 2 and len(waiting) < 8:  # until two requests hang on sim1
            held = b1.inflight
            task = asyncio.create_task(tally.send(http, url, **ask()))
            waiting.append(task)
            await until(lambda t=task, n=held: t.done() or b1.inflight > n)
        assert b1.inflight == 2
        await post(http, sims[1].url + "/sim/restart", {})  # the hung ones die, retried
        await asyncio.gather(*waiting)
        assert b1.breaker.state is BreakerState.CLOSED
        assert counters(router, "kvroute_breaker_ejections_refused") == {("sim1",): 1.0}

        await sims[2].kill()
        served = []
        for _ in range(100):
            served.append((await tally.send(http, url, **ask())).headers["x-kvroute-backend"])
        assert not b2.healthy and b2.transitions["down"] == 1  # at its first refusal
        assert set(served) == {"sim0", "sim1"}
        # sim0's breaker is open: only a panic view has it among the candidates
        assert counters(router, "kvroute_panic_routing")[()] >= served.count("sim0")
        assert (tally.failed, tally.hung) == (0, 0)
        await settle(router)


async def test_a_dead_fleet_is_a_503_with_retry_after_at_once_and_comes_back() -> None:
    """Every backend killed: each request is a 503 with Retry-After, none a 502; the
    first refusals mark every backend down, so later requests try none. A restarted
    backend is marked up by its health checks and serves again."""
    config = {"health": {"interval": 0.1, "unhealthy_threshold": 3, "healthy_threshold": 2}}
    async with fleet(3, **config) as (router, sims), aiohttp.ClientSession() as http:
        url = router.url + CHAT_PATH
        tally = Tally.new()
        for _ in range(3):  # each backend serves first: keep-alive connections to them stay
            await tally.send(http, url, **ask())
        for sim in sims:
            await sim.kill()
        for _ in range(20):
            reply = await tally.send(http, url, expect=503, **ask())
            assert reply.headers["Retry-After"] == "1"
            assert reply.json()["error"]["type"] == "ServiceUnavailableError"
        assert not any(b.healthy for b in router.fleet.members)
        # each backend was tried at most twice: a dead keep-alive connection, a refusal
        tried = {f"sim{i}": 0.0 for i in range(3)}
        for (backend, _), n in counters(router, "kvroute_upstream_errors").items():
            tried[backend] += n
        assert all(1 <= n <= 2 for n in tried.values()), tried
        await sims[1].start()  # back on its port
        await until(lambda: router.fleet.members[1].healthy, timeout=10)
        reply = await tally.send(http, url, **ask())
        assert reply.headers["x-kvroute-backend"] == "sim1"
        assert (tally.failed, tally.hung) == (0, 0)
        await settle(router)

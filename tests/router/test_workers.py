"""`kvroute serve --workers N`: a real supervisor process, its workers sharing one port
(SO_REUSEPORT) and its collector; clients are aiohttp sessions each holding one
keep-alive connection whose accepting worker the test identifies (psutil shows which
worker process owns the server end of the connection).

What is checked: LEAST_OUTSTANDING_REQUESTS balances by the router-wide in-flight count;
PREFIX_AWARE places a prefix on the same backend whichever worker takes it; killing a
worker loses only its own requests, its counters are zeroed and it is restarted;
/metrics sums every worker; backends are scraped once (not once per worker) and KV
events reach every worker's index through the collector; SIGHUP reaches every worker;
SIGTERM stops them all; separate gRPC channels are served by several workers, and a
port held by another process, HTTP or gRPC, is refused. The router runs in its own
processes (on uvloop), so these tests run once, on the default test loop, not on both
loops as *_functional files do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import grpc
import orjson
import psutil
import pytest
import yaml
import zmq
import zmq.asyncio
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness.processes import free_port, process, wait_ready
from bench.sim.fleet import start_fleet
from bench.sim.params import SimParams
from proto.kvroute.v1 import kvroute_pb2 as pb
from proto.kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from router.control.supervisor import GIVE_UP, RUN_PARENT_ENV, sweep_stale
from router.dispatch.session import rendezvous
from tests.router.fake_kube import FakeKubeApi
from tests.stub_backend import Behaviour, StubBackend, stubs_on
from tests.tmpfs import small_disk

WORKERS = 2
CHAT = "/v1/chat/completions"


def chat(prompt: str, stream: bool = False, model: str = "stub-model") -> dict:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": prompt}]}


async def until(check, timeout: float = 15.0, what: str = "condition"):
    """Poll `check` (sync or async) until it returns something truthy; bounded."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@dataclass
class MultiRouter:
    proc: object
    port: int
    path: Path
    sessions: list[aiohttp.ClientSession] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def workers(self) -> list[int]:
        """Pids of the children listening on the port (the collector does not)."""
        out = []
        for child in psutil.Process(self.proc.pid).children():
            try:
                conns = child.net_connections(kind="tcp")
            except psutil.NoSuchProcess:
                continue
            if any(c.status == "LISTEN" and c.laddr.port == self.port for c in conns):
                out.append(child.pid)
        return sorted(out)

    def _mine(self, port: int | None = None) -> set[int]:
        """Local ports of this test process's open connections to the router's `port`
        (its HTTP port by default)."""
        port = port or self.port
        return {
            c.laddr.port
            for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
        }

    def _owner(self, client_port: int, port: int | None = None) -> int | None:
        """The worker holding the server end of the connection from `client_port`."""
        port = port or self.port
        for pid in self.workers():
            with contextlib.suppress(psutil.NoSuchProcess):
                for c in psutil.Process(pid).net_connections(kind="tcp"):
                    if c.raddr and c.raddr.port == client_port and c.laddr.port == port:
                        return pid
        return None

    async def pinned(self, pid: int) -> aiohttp.ClientSession:
        """A session whose one keep-alive connection was accepted by worker `pid`."""
        for _ in range(200):
            before = self._mine()
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            self.sessions.append(session)  # so close() closes it if the probe below raises
            async with session.get(self.url + "/health") as resp:
                await resp.read()
            (client_port,) = self._mine() - before
            owner = await until(lambda p=client_port: self._owner(p), 5, "the connection's owner")
            if owner == pid:
                return session
            self.sessions.remove(session)
            await session.close()
        raise AssertionError(f"no connection reached worker {pid}")

    async def close(self) -> None:
        for session in self.sessions:
            await session.close()


@asynccontextmanager
async def multi_router(
    tmp_path: Path, config: dict, runs: Path | None = None, log: Path | None = None
) -> AsyncIterator[MultiRouter]:
    """`kvroute serve` with `WORKERS` workers, its run directory in `runs` (by default
    under `tmp_path`: apart from other routers' on the machine, another suite's sweep),
    its log lines in `log` if given."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1"}, **config}))
    port = free_port()
    cmd = [sys.executable, "-m", "router", "serve", "-c", str(path), "--port", str(port)]
    if runs is None:
        runs = tmp_path / "run"
        runs.mkdir(exist_ok=True)
    env = {**os.environ, RUN_PARENT_ENV: str(runs)}
    serve = [*cmd, "--workers", str(WORKERS), "--log-level", "warning"]
    with (
        open(log or os.devnull, "w") as lines,
        process(serve, env=env, stderr=lines) as proc,
    ):
        router = MultiRouter(proc, port, path)
        try:
            await wait_ready(router.url, timeout=30)
            await until(lambda: len(router.workers()) == WORKERS, 30, "every worker listening")
            yield router
        finally:
            await router.close()


async def stubs(n: int, behaviour: Behaviour | None = None) -> list[StubBackend]:
    return [await StubBackend(behaviour=behaviour or Behaviour()).start() for _ in range(n)]


def backends(servers: list[StubBackend]) -> list[dict]:
    return [{"url": s.url, "name": f"b{i}"} for i, s in enumerate(servers)]


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """Sum of every sample of `name` on the router's /metrics page."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def arrived(servers: list[StubBackend], n: int) -> list[int] | None:
    """Each backend's requests in progress, once `n` have arrived in all."""
    loads = [s.active for s in servers]
    return loads if sum(loads) == n else None


async def test_ps_names_the_supervisor_each_worker_and_the_collector(tmp_path) -> None:
    servers = await stubs(1)
    try:
        async with multi_router(tmp_path, {"backends": backends(servers)}) as router:
            supervisor = psutil.Process(router.proc.pid)
            children = {" ".join(c.cmdline()).strip() for c in supervisor.children()}
            names = {"kvroute: collector", *(f"kvroute: worker {i}" for i in range(WORKERS))}
            assert " ".join(supervisor.cmdline()).strip() == "kvroute: supervisor"
            assert names <= children, children
    finally:
        await servers[0].stop()


async def test_least_outstanding_balances_by_the_router_wide_count(tmp_path) -> None:
    """Requests arrive alternately at the two workers and stay in flight; after each one
    the backends' loads differ by at most one. With per-worker counts, a worker that has
    sent nothing yet sees every backend idle and picks at random among all four."""
    servers = await stubs(4, Behaviour(chunks=2, pace=60.0))
    config = {"backends": backends(servers), "routing": {"strategy": "LEAST_OUTSTANDING_REQUESTS"}}
    try:
        async with multi_router(tmp_path, config) as router:
            pids = router.workers()
            held = []
            for i in range(8):
                session = await router.pinned(pids[i % WORKERS])
                resp = await session.post(router.url + CHAT, json=chat(f"q{i}", stream=True))
                assert resp.status == 200
                held.append(resp)
                loads = await until(lambda n=i + 1: arrived(servers, n), 10, "the request")
                assert max(loads) - min(loads) <= 1, loads
            for resp in held:
                resp.close()
    finally:
        for s in servers:
            await s.stop()


async def test_prefix_aware_places_a_prefix_alike_in_every_worker(tmp_path) -> None:
    servers = await stubs(4)
    routing = {"strategy": "PREFIX_AWARE", "prefix_length": 32}
    try:
        async with multi_router(tmp_path, {"backends": backends(servers), "routing": routing}) as r:
            sessions = [await r.pinned(pid) for pid in r.workers()]
            placed = []
            for i in range(24):
                prompt = f"contract {i}: the tenant shall keep the premises in good order " * 4
                homes = set()
                for session in sessions:
                    async with session.post(r.url + CHAT, json=chat(prompt)) as resp:
                        assert resp.status == 200
                        homes.add(resp.headers["x-kvroute-backend"])
                assert len(homes) == 1, (i, homes)
                placed += homes
            assert len(set(placed)) == 4  # and the prefixes are spread over the fleet
    finally:
        for s in servers:
            await s.stop()


async def test_metrics_sum_every_worker(tmp_path) -> None:
    servers = await stubs(2)
    try:
        async with multi_router(tmp_path, {"backends": backends(servers)}) as r:
            w0, w1 = [await r.pinned(pid) for pid in r.workers()]
            for session, n in ((w0, 3), (w1, 5)):
                for i in range(n):
                    async with session.post(r.url + CHAT, json=chat(f"x{i}")) as resp:
                        assert resp.status == 200
            for session in (w0, w1):  # whichever worker answers, the sum is the router's
                assert await metric(session, r.url, "kvroute_requests_total") == 8
    finally:
        for s in servers:
            await s.stop()


async def test_the_collector_alone_merges_the_metrics_and_primes_every_backend(tmp_path) -> None:
    """Whichever worker answers /metrics, the counted series come merged from the
    collector: every backend's series are on the page at 0, but only the collector's
    files hold the ones nothing counted (a worker keeps what it counted, not ~140
    series a backend and a merged page's state of its own)."""
    servers = await stubs(2)
    primed = b"kvroute_upstream_errors_total"  # no request fails here: primed only
    try:
        async with multi_router(tmp_path, {"backends": backends(servers)}) as r:
            w0, w1 = [await r.pinned(pid) for pid in r.workers()]
            async with w0.post(r.url + CHAT, json=chat("x")) as resp:
                assert resp.status == 200
            for session in (w0, w1):
                async with session.get(r.url + "/metrics") as resp:
                    assert resp.status == 200
                    page = await resp.text()
                for name in ("b0", "b1"):
                    assert (
                        f'kvroute_upstream_errors_total{{backend="{name}",kind="connect"}} 0.0'
                        in page
                    )
                assert await metric(session, r.url, "kvroute_requests_total") == 1
            files = {
                int(p.stem.rpartition("_")[2]): p.read_bytes()
                for p in (tmp_path / "run").glob("kvroute-*/metrics/counter_*.db")
            }
            (collector,) = (
                c.pid
                for c in psutil.Process(r.proc.pid).children()
                if "collector" in " ".join(c.cmdline())
            )
            assert primed in files[collector]
            for pid in r.workers():
                assert primed not in files.get(pid, b""), pid
    finally:
        for s in servers:
            await s.stop()


async def test_metrics_on_the_admin_listener_sum_every_worker(tmp_path) -> None:
    """With `metrics: {listen: admin}` the admin listener (worker 0's) shows the same
    router-wide page the data port did; the data port answers 404 in every worker."""
    servers = await stubs(2)
    token = tmp_path / "admin.token"
    token.write_text("admin-secret-token-0123456789")
    admin = {"port": free_port(), "token_file": str(token)}
    config = {"backends": backends(servers), "admin": admin, "metrics": {"listen": "admin"}}
    try:
        async with multi_router(tmp_path, config) as r, aiohttp.ClientSession() as scraper:
            w0, w1 = [await r.pinned(pid) for pid in r.workers()]
            for session, n in ((w0, 3), (w1, 5)):
                for i in range(n):
                    async with session.post(r.url + CHAT, json=chat(f"x{i}")) as resp:
                        assert resp.status == 200
            for session in (w0, w1):
                async with session.get(r.url + "/metrics") as resp:
                    assert resp.status == 404
            url = f"http://127.0.0.1:{admin['port']}"
            total = functools.partial(metric, scraper, url, "kvroute_requests_total")
            await until(lambda: _holds(total(), lambda v: v == 8), 10, "8 on the admin /metrics")
    finally:
        for s in servers:
            await s.stop()


async def test_killed_worker_loses_only_its_requests_and_counters_recover(tmp_path) -> None:
    servers = await stubs(2, Behaviour(chunks=4, pace=0.75))
    try:
        async with multi_router(tmp_path, {"backends": backends(servers)}) as r:
            survivor, victim = r.workers()
            kept = [await r.pinned(survivor) for _ in range(2)]
            lost = [await r.pinned(victim) for _ in range(2)]
            streams = [await s.post(r.url + CHAT, json=chat("long", stream=True)) for s in kept]
            doomed = [await s.post(r.url + CHAT, json=chat("long", stream=True)) for s in lost]
            probe = await r.pinned(survivor)
            inflight = "kvroute_backend_inflight_requests"
            assert await metric(probe, r.url, inflight) == 4  # both workers' requests
            os.kill(victim, signal.SIGKILL)
            for resp in doomed:  # the victim's clients see their connection end
                with pytest.raises((aiohttp.ClientError, ConnectionError)):
                    await resp.read()
            # the supervisor zeroes the dead worker's counts: only the survivor's remain
            await until(lambda: _equals(metric(probe, r.url, inflight), 2), 10, "counts to recover")
            for resp in streams:  # the survivor's streams end normally
                body = await resp.read()
                assert body.count(b"data: ") == 5 and body.endswith(b"data: [DONE]\n\n")
            await until(lambda: _equals(metric(probe, r.url, inflight), 0), 10, "zero")
            # a new worker takes the victim's place and serves
            await until(lambda: len(r.workers()) == WORKERS, 30, "the restarted worker")
            (replacement,) = set(r.workers()) - {survivor}
            fresh = await r.pinned(replacement)
            async with fresh.post(r.url + CHAT, json=chat("after")) as resp:
                assert resp.status == 200
    finally:
        for s in servers:
            await s.stop()


async def test_admission_caps_count_every_workers_requests(tmp_path) -> None:
    """`max_concurrent_per_tenant` and `max_concurrent_requests` cap the router, not each
    worker: one tenant's requests sent through both workers in turn get exactly its cap
    admitted; a request waiting in one worker's queue takes the slot freed in the other;
    a killed worker's slots come back."""
    servers = await stubs(2, Behaviour(chunks=2, pace=60.0))
    limits = {
        "max_concurrent_per_tenant": 2,
        "max_concurrent_requests": 3,
        "queue_size": 1,
        "queue_timeout": 30,
    }
    config = {"backends": backends(servers), "tenant_header": "X-Tenant", "limits": limits}
    held: list[aiohttp.ClientResponse] = []

    async def send(session: aiohttp.ClientSession | int, tenant: str) -> int:
        """A stream of `tenant`'s on `session`, or on a new connection to that worker."""
        if isinstance(session, int):
            session = await r.pinned(session)  # one connection: one stream at a time
        resp = await session.post(
            r.url + CHAT, json=chat(tenant, stream=True), headers={"X-Tenant": tenant}
        )
        if resp.status == 200:
            held.append(resp)  # streaming for a minute: it keeps its slots
        else:
            resp.release()
        return resp.status

    try:
        async with multi_router(tmp_path, config) as r:
            w0, w1 = r.workers()
            assert [await send(w, "acme") for w in (w0, w1, w0, w1)] == [200, 200, 429, 429]
            assert await send(w0, "globex") == 200  # the router's third: at the cap
            on1 = [await r.pinned(w1) for _ in range(2)]
            racing = [asyncio.create_task(send(session, "globex")) for session in on1]
            done, (queued,) = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            assert [t.result() for t in done] == [429]  # worker 1's queue holds the other
            assert sum(s.active for s in servers) == 3
            held.pop(0).close()  # acme's request in worker 0 ends: the queued one goes
            assert await asyncio.wait_for(queued, 10) == 200
            # worker 1 dies holding acme's second slot and the queued one's
            os.kill(w1, signal.SIGKILL)
            await until(lambda: w1 not in r.workers(), 10, "the worker to die")
            await until(lambda: len(r.workers()) == WORKERS, 30, "the restarted worker")
            assert [await send(w0, "acme") for _ in range(3)] == [200, 200, 429]
    finally:
        for resp in held:
            resp.close()
        for s in servers:
            await s.stop()


def _rundir(r: MultiRouter) -> Path:
    """The router's run directory (its children's Prometheus directory is in it)."""
    child = psutil.Process(r.workers()[0])
    return Path(child.environ()["PROMETHEUS_MULTIPROC_DIR"]).parent


def _serving(children: list[psutil.Process]) -> list[psutil.Process]:
    """The router's children (multiprocessing's resource tracker aside: they alone are
    named "kvroute: ...") still alive."""
    alive = []
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            named = " ".join(child.cmdline()).startswith("kvroute: ")
            if child.status() != psutil.STATUS_ZOMBIE and named:
                alive.append(child)
    return alive


async def test_a_killed_routers_run_directory_is_removed_by_the_next_start(tmp_path) -> None:
    """A supervisor killed with SIGKILL leaves its run directory (shared tables, metric
    files) in /dev/shm; the next router's start removes it, once no process of the dead
    router is left: a worker still draining its stream keeps it. A live router's
    directory is never touched."""
    servers = await stubs(1, Behaviour(chunks=2, pace=60.0))
    config = {"backends": backends(servers), "shutdown": {"drain_seconds": 60}}
    try:
        async with multi_router(tmp_path, config) as killed:
            stale = _rundir(killed)
            session = await killed.pinned(killed.workers()[0])
            stream = await session.post(killed.url + CHAT, json=chat("held", stream=True))
            assert stream.status == 200
            children = psutil.Process(killed.proc.pid).children()
            killed.proc.kill()
            await asyncio.to_thread(killed.proc.wait, 10)
            # its children were told to stop: the worker with the stream drains it
            await until(lambda: len(_serving(children)) == 1, 20, "the one left draining")
            sweep_stale(stale.parent)
            assert (stale / "load").exists()
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            _, alive = await asyncio.to_thread(psutil.wait_procs, children, 10)
            assert alive == []
            stream.close()
        assert stale.exists()
        async with multi_router(tmp_path, config) as live:
            assert not stale.exists()  # removed when the supervisor started
            mine = _rundir(live)
            sweep_stale(mine.parent)
            assert (mine / "load").exists()
            session = await live.pinned(live.workers()[0])
            async with session.post(live.url + CHAT, json=chat("after")) as resp:
                assert resp.status == 200
    finally:
        for s in servers:
            await s.stop()


async def _equals(value, expected: float) -> bool:
    return await _holds(value, lambda v: v == expected)


class CountingBackend:
    """A backend that counts /metrics scrapes, /health checks and /v1/models polls, and
    fails its checks while `failing`."""

    def __init__(self, model: str = "counted-model") -> None:
        self.model = model
        self.scrapes = 0
        self.checks = 0
        self.polls = 0
        self.failing = False
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> CountingBackend:
        app = web.Application()
        app.add_routes(
            [
                web.get("/metrics", self._metrics),
                web.get("/health", self._health),
                web.get("/v1/models", self._models),
            ]
        )
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        return web.Response(text='vllm:num_requests_waiting{engine="0"} 7.0\n')

    async def _health(self, request: web.Request) -> web.Response:
        self.checks += 1
        return web.Response(status=500 if self.failing else 200)

    async def _models(self, request: web.Request) -> web.Response:
        self.polls += 1
        return web.json_response({"object": "list", "data": [{"id": self.model}]})


async def _rate(count, seconds: float) -> float:
    start, t0 = count(), time.monotonic()
    await asyncio.sleep(seconds)
    return (count() - start) / (time.monotonic() - t0)


async def test_backends_are_scraped_once_and_every_worker_sees_the_result(tmp_path) -> None:
    backend = await CountingBackend().start()
    config = {
        "backends": [{"url": backend.url, "name": "b0", "models": ["m"]}],
        "telemetry": {"scrape_interval": 0.2},
    }
    try:
        async with multi_router(tmp_path, config) as r:
            sessions = [await r.pinned(pid) for pid in r.workers()]

            async def waiting_seen(session: aiohttp.ClientSession) -> bool:
                async with session.get(r.url + "/debug/routing") as resp:
                    return (await resp.json())["backends"]["b0"]["waiting"] == 7.0

            for session in sessions:
                await until(lambda s=session: waiting_seen(s), 10, "the collector's snapshot")
            rate = await _rate(lambda: backend.scrapes, 3.0)
            # one scraper at ~5/s (jittered ±20%); one per worker too would be >= 10/s
            assert 2.5 <= rate <= 7.5, rate
    finally:
        await backend.runner.cleanup()


async def test_backends_are_probed_once_and_every_worker_adopts_the_verdicts(tmp_path) -> None:
    backend = await CountingBackend().start()
    config = {
        "backends": [{"url": backend.url, "name": "b0"}],
        "health": {"interval": 0.2, "timeout": 1.0, "unhealthy_threshold": 1},
        "models_refresh_interval": 0.2,
    }

    async def listed(session: aiohttp.ClientSession) -> bool:
        async with session.get(r.url + "/v1/models") as resp:
            return backend.model in {m["id"] for m in (await resp.json())["data"]}

    async def ready(session: aiohttp.ClientSession) -> int:
        async with session.get(r.url + "/ready") as resp:
            return resp.status

    try:
        async with multi_router(tmp_path, config) as r:
            sessions = [await r.pinned(pid) for pid in r.workers()]
            for session in sessions:  # the collector's poll is every worker's model list
                await until(lambda s=session: listed(s), 10, "the polled model list")
            checks, polls = await asyncio.gather(
                _rate(lambda: backend.checks, 3.0), _rate(lambda: backend.polls, 3.0)
            )
            # one prober at 5/s each; one per worker as well would be >= 10/s
            assert 2.5 <= checks <= 7.5, checks
            assert 2.5 <= polls <= 7.5, polls
            backend.failing = True  # the collector's verdict takes it out of every worker
            for session in sessions:
                await until(lambda s=session: _is(ready(s), 503), 10, "b0 down everywhere")
            backend.failing = False
            for session in sessions:
                await until(lambda s=session: _is(ready(s), 200), 10, "b0 up everywhere")
    finally:
        await backend.runner.cleanup()


async def _is(status, expected: int) -> bool:
    return await status == expected


@pytest.mark.parametrize("index", ["shared", "a-copy-each"])
async def test_kv_events_reach_every_worker_through_the_collector(tmp_path, index: str) -> None:
    """The collector applies each backend's KV events, and every worker routes by them:
    over the one index of the host, or, where the run directory has no room for it (a
    64 MiB tmpfs, warned about), over its own copy the collector forwards the batches to."""
    with contextlib.ExitStack() as stack:
        runs = None
        if index == "a-copy-each":
            runs = stack.enter_context(small_disk(tmp_path / "small", "64m"))
        await _kv_events_reach_every_worker(tmp_path, runs)


async def _kv_events_reach_every_worker(tmp_path: Path, runs: Path | None) -> None:
    params = SimParams(kv_events=True, time_scale=0.01)
    fleet = await start_fleet(2, params)
    entries = [
        {
            "url": b.url,
            "name": f"sim{i}",
            "kv_events": {
                "endpoint": b.publisher.endpoint,
                "replay_endpoint": b.publisher.replay_endpoint,
            },
        }
        for i, b in enumerate(fleet.backends)
    ]
    config = {"backends": entries, "routing": {"strategy": "KV_AWARE", "seed": 1}}
    try:
        async with multi_router(tmp_path, config, runs) as r:
            pids = r.workers()
            w0, w1 = [await r.pinned(pid) for pid in pids]
            shared = list((runs or tmp_path / "run").glob("kvroute-*/index-gpu"))
            assert len(shared) == (runs is None)
            await asyncio.sleep(1.5)  # each worker's index loop sets up its appliers
            doc = "".join(f"clause {k}: keep the premises in good order. " for k in range(60))
            body = chat(doc, model="sim-llama-70b") | {"max_tokens": 2}
            async with w0.post(r.url + CHAT, json=body) as resp:
                assert resp.status == 200
                home = resp.headers["x-kvroute-backend"]

            async def keys(session: aiohttp.ClientSession) -> int:
                """Confirmed (event-fed) keys the worker holds for `home`."""
                async with session.get(r.url + "/debug/routing") as resp:
                    return (await resp.json())["backends"][home]["index_keys"][0]

            async def follows(session: aiohttp.ClientSession) -> None:
                async with session.post(r.url + CHAT, json=body) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-kvroute-backend"] == home
                    usage = (await resp.json())["usage"]
                    assert usage["prompt_tokens_details"]["cached_tokens"] > 0

            # worker 1 never routed this prompt: only the forwarded events can fill it
            await until(lambda: keys(w1), 10, "worker 1's index to learn the blocks")
            held = await keys(w1)
            await follows(w1)

            async def published(session: aiohttp.ClientSession) -> float | None:
                async with session.get(r.url + "/debug/routing") as resp:
                    return (await resp.json())["backends"][home]["events_published"]

            # no batch reaches a worker of a shared index: the collector says it came
            await until(lambda: published(w1), 10, "worker 1 to hear the backend published")
            # a worker started after the events (here: a restarted one) gets the
            # collector's index when it joins, before it serves anything
            victim = pids[1]
            os.kill(victim, signal.SIGKILL)
            await until(lambda: victim not in r.workers(), 10, "the worker to die")
            await until(lambda: len(r.workers()) == WORKERS, 30, "the restarted worker")
            (replacement,) = set(r.workers()) - set(pids[:1])
            fresh = await r.pinned(replacement)
            assert await keys(fresh) >= held
            await follows(fresh)
    finally:
        await fleet.stop()


async def test_a_backend_short_of_its_prediction_loses_it_in_every_worker(tmp_path) -> None:
    """Without KV events: a backend whose small cache (100 blocks, two documents) was
    filled behind the router's back answers a document the index placed there with
    nothing cached. Both workers drop the document's blocks, and the backend's learned
    capacity, none at first (the index trusted the scraped 100 blocks), falls to what it
    proved (not raised again when it keeps what that miss computed anew); when it then
    shows it kept more than the index trusted, both raise it again."""
    fleet = await start_fleet(1, SimParams(time_scale=0.01, num_gpu_blocks=100, max_model_len=1500))
    (sim,) = fleet.backends
    config = {
        "backends": [{"url": sim.url, "name": "sim0"}],
        # the index's blocks the engine's, so that its counts and the engine's compare
        "routing": {"strategy": "KV_AWARE", "seed": 1, "block_size": 16},
        "telemetry": {"scrape_interval": 0.2},
    }

    def document(i: int) -> dict:
        text = "".join(f"doc {i} clause {k}: keep the premises in good order. " for k in range(50))
        return chat(text, model="sim-llama-70b") | {"max_tokens": 2}

    async def ask(session: aiohttp.ClientSession, url: str, i: int) -> int:
        async with session.post(url + CHAT, json=document(i)) as resp:
            assert resp.status == 200
            return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        async with multi_router(tmp_path, config) as r, aiohttp.ClientSession() as direct:
            sessions = [await r.pinned(pid) for pid in r.workers()]
            w0, w1 = sessions

            async def state(session: aiohttp.ClientSession) -> dict:
                async with session.get(r.url + "/debug/routing") as resp:
                    return (await resp.json())["backends"]["sim0"]

            async def everywhere(check) -> bool:
                return all([check(await state(session)) for session in sessions])

            assert await ask(w0, r.url, 0) == 0
            await until(lambda: everywhere(lambda b: b["index_keys"][1] >= 30), 10, "the placement")
            placed = (await state(w1))["index_keys"][1]
            assert (await state(w1))["learned_cache"]["blocks"] is None
            kv = sim.engine.kv
            doc0 = set(kv._cached)
            for pushed in range(1, 6):  # fill its cache behind the router's back
                assert await ask(direct, sim.url, pushed) == 0
                if not kv._cached.keys() & doc0:
                    break
            assert not kv._cached.keys() & doc0
            assert await ask(w1, r.url, 0) < 100  # the index predicted the whole document

            def corrected(b: dict) -> bool:
                learned = b["learned_cache"]
                return b["index_keys"][1] == 0 and learned["misses"] == 1 and learned["blocks"]

            await until(lambda: everywhere(corrected), 10, "every worker's correction")
            shrunk = [(await state(s))["learned_cache"]["blocks"] for s in sessions]
            assert all(placed <= blocks < 100 for blocks in shrunk), (placed, shrunk)
            # the index forgot document 0; the backend kept what that miss computed anew,
            # which proves nothing of its capacity
            assert await ask(w0, r.url, 0) >= 16 * (placed - 1)
            rerun = await until(lambda: everywhere(lambda b: b["learned_cache"]["surpluses"]), 10)
            assert (
                rerun and [(await state(s))["learned_cache"]["blocks"] for s in sessions] == shrunk
            )
            # the document it was sent last behind the router's back: it kept that too
            assert await ask(w1, r.url, pushed) >= 16 * (placed - 1)

            def grown(b: dict) -> bool:
                learned = b["learned_cache"]
                return learned["surpluses"] == 2 and learned["blocks"] > max(shrunk)

            await until(lambda: everywhere(grown), 10, "every worker's capacity to grow")
            assert await metric(w0, r.url, "kvroute_kv_cache_corrections_total") == 3
            assert await ask(w1, r.url, 0) >= 16 * (placed - 1)
            assert await metric(w0, r.url, "kvroute_backend_learned_cache_blocks") > max(shrunk)
    finally:
        await fleet.stop()


async def test_every_worker_learns_a_decode_step_from_the_scraped_metrics(tmp_path) -> None:
    """Streams straight to a half-speed simulated backend, none through the router: the
    collector's scrapes reach both workers, one keeps each decode sample of two scrapes
    in the shared table, and each worker's learned step (at the streams' batch) is the
    backend's within 25%."""
    params = SimParams(time_scale=0.5, speed=0.5)
    fleet = await start_fleet(1, params)
    (sim,) = fleet.backends
    config = {
        "backends": [{"url": sim.url, "name": "sim0"}],
        "routing": {"strategy": "KV_AWARE"},
        "telemetry": {"scrape_interval": 0.2},
    }
    # 25 ms and 0.15 ms a request at full speed, times the time scale, over the speed
    step, per_request = (ms * params.time_scale / params.speed / 1000 for ms in (25, 0.15))
    streams: list[asyncio.Task] = []

    async def stream(direct: aiohttp.ClientSession, i: int) -> None:
        body = chat(f"stream {i} " * 200, stream=True, model="sim-llama-70b") | {"max_tokens": 300}
        async with direct.post(sim.url + CHAT, json=body) as resp:
            assert resp.status == 200
            await resp.read()

    try:
        async with multi_router(tmp_path, config) as r, aiohttp.ClientSession() as direct:
            sessions = [await r.pinned(pid) for pid in r.workers()]
            streams.extend(asyncio.create_task(stream(direct, i)) for i in range(6))

            async def learned(session: aiohttp.ClientSession) -> dict | None:
                assert not all(s.done() for s in streams), "every stream ended first"
                async with session.get(r.url + "/debug/routing") as resp:
                    shown = (await resp.json())["backends"]["sim0"]
                return shown["speed"] if "decode_step_s" in shown["speed_learned_figures"] else None

            for session in sessions:
                speed = await until(lambda s=session: learned(s), 30, "the learned decode step")
                at_six = speed["decode_step_s"] + 6 * speed["decode_s_per_request"]
                assert at_six == pytest.approx(step + 6 * per_request, rel=0.25), speed
            await asyncio.gather(*streams)
    finally:
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await fleet.stop()


async def test_sighup_reloads_every_worker_and_sigterm_stops_them(tmp_path) -> None:
    servers = await stubs(3)
    try:
        async with multi_router(tmp_path, {"backends": backends(servers[:2])}) as r:
            sessions = [await r.pinned(pid) for pid in r.workers()]
            children = psutil.Process(r.proc.pid).children()
            reloaded = {"backends": backends(servers), "routing": {"strategy": "RANDOM"}}
            r.path.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1"}, **reloaded}))
            os.kill(r.proc.pid, signal.SIGHUP)

            async def members(session: aiohttp.ClientSession) -> int:
                async with session.get(r.url + "/debug/routing") as resp:
                    return len((await resp.json())["backends"])

            async def primed(session: aiohttp.ClientSession) -> re.Match | None:
                """The added backend's series, at 0 under the new strategy (the
                collector primes them for every worker)."""
                async with session.get(r.url + "/metrics") as resp:
                    page = await resp.text()
                return re.search(r'_requests_total\{backend="b2",[^}]*strategy="RANDOM"', page)

            for session in sessions:
                await until(lambda s=session: _equals(members(s), 3), 15, "the reload")
                await until(lambda s=session: primed(s), 15, "b2's series under RANDOM")
            r.proc.terminate()
            assert await asyncio.to_thread(r.proc.wait, 20) == 0
            _, alive = psutil.wait_procs(children, timeout=5)
            assert alive == []
    finally:
        for s in servers:
            await s.stop()


def test_a_worker_that_fails_at_every_start_stops_the_router_with_its_error(tmp_path) -> None:
    """Every worker's job store answers nothing at start: each says why in one line, and
    after a bounded number of starts the supervisor stops with that error, exit 2, as
    a single process would."""
    redis = f"redis://127.0.0.1:{free_port()}/0"
    path = tmp_path / "router.yaml"
    config = {"listen": {"host": "127.0.0.1", "port": 0}, "backends": [{"url": "http://127.0.0.1:9"}],
              "jobs": {"enabled": True, "store": "redis", "redis": {"url": redis}}}  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    runs = tmp_path / "run"
    runs.mkdir()
    cmd = [sys.executable, "-m", "router", "serve", "-c", str(path), "--workers", str(WORKERS)]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, RUN_PARENT_ENV: str(runs)},
    )
    why = f"jobs.redis: {redis} does not answer"
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[-1].startswith(f"kvroute: invalid config: {why}")
    assert "Traceback" not in done.stderr
    restarts = [line for line in lines if f"exited with code 2: {why}" in line]
    assert GIVE_UP - 1 <= len(restarts) <= WORKERS * (GIVE_UP - 1)
    assert f"failed at each of its {GIVE_UP} starts: stopping" in done.stderr
    assert not list(runs.iterdir())  # its run directory removed


async def test_admin_edits_and_reloads_reach_every_worker(tmp_path) -> None:
    """The admin API listens in worker 0; its edits and reloads apply in both workers,
    and in the collector (a backend added there is scraped for every worker)."""
    servers = await stubs(3)
    counted = await CountingBackend().start()
    token = tmp_path / "admin.token"
    token.write_text("admin-secret-token-0123456789")
    admin_port = free_port()
    admin = {"port": admin_port, "token_file": str(token)}
    try:
        config = {
            "backends": backends(servers[:2]),
            "admin": admin,
            "telemetry": {"scrape_interval": 0.2},
        }
        async with multi_router(tmp_path, config) as r:
            sessions = [await r.pinned(pid) for pid in r.workers()]

            async def view(session: aiohttp.ClientSession) -> dict:
                async with session.get(r.url + "/debug/routing") as resp:
                    return (await resp.json())["backends"]

            async def everywhere(check, what: str) -> None:
                for session in sessions:
                    await until(lambda s=session: _holds(view(s), check), 15, what)

            base = f"http://127.0.0.1:{admin_port}/admin"
            auth = {"Authorization": "Bearer admin-secret-token-0123456789"}
            async with aiohttp.ClientSession(headers=auth) as http:
                async with http.post(base + "/backends/b0/drain") as resp:
                    assert resp.status == 200
                await everywhere(lambda v: not v["b0"]["usable"], "b0 drained")
                async with http.post(base + "/backends/b0/undrain") as resp:
                    assert resp.status == 200
                await everywhere(lambda v: v["b0"]["usable"], "b0 back")
                new = {"url": servers[2].url, "name": "b2"}
                async with http.post(base + "/backends", json=new) as resp:
                    assert resp.status == 201
                    assert (await resp.json())["added"] == ["b2"]
                await everywhere(lambda v: set(v) == {"b0", "b1", "b2"}, "b2 added")
                async with http.post(base + "/backends", json={"url": counted.url}) as resp:
                    assert resp.status == 201
                    (name,) = (await resp.json())["added"]
                await everywhere(
                    lambda v: v.get(name, {}).get("waiting") == 7.0,
                    "the added backend's scrape",
                )
                async with http.delete(base + "/backends/b1") as resp:
                    assert resp.status == 200
                await everywhere(lambda v: set(v) == {"b0", "b2", name}, "b1 removed")
                async with http.post(base + "/backends/b0/drain") as resp:
                    assert resp.status == 200
                await everywhere(lambda v: not v["b0"]["usable"], "b0 drained")
                # a restarted worker reads the file, then takes the runtime edits back
                victim = next(pid for pid in r.workers() if pid != _listener(r, admin_port))
                os.kill(victim, signal.SIGKILL)
                await until(lambda: victim not in r.workers(), 10, "the worker to die")
                await until(lambda: len(r.workers()) == WORKERS, 30, "the restarted worker")
                (replacement,) = set(r.workers()) - {_listener(r, admin_port)}
                sessions = [await r.pinned(_listener(r, admin_port)), await r.pinned(replacement)]
                view_now = await view(sessions[1])
                assert set(view_now) == {"b0", "b2", name}, view_now
                assert not view_now["b0"]["usable"]
                async with http.post(base + "/backends", json={"url": "nope"}) as resp:
                    assert resp.status == 400  # refused in worker 0: nothing broadcast
                r.path.write_text(
                    yaml.safe_dump(
                        {
                            "listen": {"host": "127.0.0.1"},
                            "backends": backends(servers),
                            "admin": admin,
                        }
                    )
                )
                async with http.post(base + "/reload") as resp:
                    assert resp.status == 200
                await everywhere(lambda v: set(v) == {"b0", "b1", "b2"}, "the reload")
    finally:
        for s in servers:
            await s.stop()
        await counted.runner.cleanup()


async def test_a_message_no_process_can_read_is_skipped_and_the_feed_goes_on(tmp_path) -> None:
    """A payload on the collector's control socket that is no edit (another release's, a
    bug's): the collector relays it and skips it, each worker skips it, and an admin edit
    sent after both said so still reaches every worker through the same relay and feed.
    (Before, the payload ended the collector's relay and each worker's feed.)"""
    servers = await stubs(2)
    token = tmp_path / "admin.token"
    token.write_text("admin-secret-token-0123456789")
    admin_port = free_port()
    config = {
        "backends": backends(servers),
        "admin": {"port": admin_port, "token_file": str(token)},
    }
    log = tmp_path / "router.log"
    context = zmq.asyncio.Context()
    try:
        async with multi_router(tmp_path, config, log=log) as r:
            (control,) = (tmp_path / "run").glob("*/control.sock")
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(f"ipc://{control}")
            await push.send(b"{not an edit")

            async def skipped() -> bool:
                text = log.read_text()
                return "an edit on the control socket was skipped" in text and (
                    text.count("a feed message (b'a') was skipped") == WORKERS
                )

            await until(skipped, 15, "the collector and every worker to skip it")
            async with aiohttp.ClientSession() as http:
                name = "kvroute_feed_messages_skipped_total"

                async def counted() -> bool:  # each worker's feed, the collector's relay
                    return await metric(http, r.url, name) == WORKERS + 1

                await until(counted, 15, "every skip counted")
            sessions = [await r.pinned(pid) for pid in r.workers()]
            auth = {"Authorization": "Bearer admin-secret-token-0123456789"}
            async with aiohttp.ClientSession(headers=auth) as http:
                url = f"http://127.0.0.1:{admin_port}/admin/backends/b0/drain"
                async with http.post(url) as resp:
                    assert resp.status == 200

            async def drained(session: aiohttp.ClientSession) -> bool:
                async with session.get(r.url + "/debug/routing") as resp:
                    return not (await resp.json())["backends"]["b0"]["usable"]

            for session in sessions:
                await until(lambda s=session: drained(s), 15, "b0 drained in every worker")
    finally:
        context.destroy(linger=0)
        for s in servers:
            await s.stop()


def _listener(r: MultiRouter, port: int) -> int:
    """The worker listening on `port` (the admin API's: worker 0)."""
    for pid in r.workers():
        conns = psutil.Process(pid).net_connections(kind="tcp")
        if any(c.status == "LISTEN" and c.laddr.port == port for c in conns):
            return pid
    raise AssertionError(f"no worker listens on {port}")


async def _holds(value, check) -> bool:
    return check(await value)


async def test_the_class_order_holds_across_workers(tmp_path) -> None:
    """One slot for the router: a sheddable request waiting in worker 0 lets a standard
    one waiting in worker 1 go first, though worker 0 frees the slot."""
    (server,) = await stubs(1, Behaviour(gate=asyncio.Event()))
    limits = {"max_concurrent_requests": 1, "queue_size": 8, "queue_timeout": 30}
    config = {"backends": backends([server]), "limits": limits}

    async def send(session: aiohttp.ClientSession, prompt: str, **headers: str) -> int:
        async with session.post(r.url + CHAT, json=chat(prompt), headers=headers) as resp:
            await resp.read()
            return resp.status

    try:
        async with multi_router(tmp_path, config) as r:
            w0, w1 = r.workers()
            probe = aiohttp.ClientSession()
            r.sessions.append(probe)
            depth = lambda: metric(probe, r.url, "kvroute_flow_queue_depth")  # noqa: E731
            held = asyncio.create_task(send(await r.pinned(w0), "held"))
            await until(lambda: server.active == 1, 10, "the held request")
            low = {"X-Kvroute-Priority": "sheddable"}
            shed = asyncio.create_task(send(await r.pinned(w0), "low", **low))
            await until(lambda: _equals(depth(), 1), 10, "the sheddable one queued")
            std = asyncio.create_task(send(await r.pinned(w1), "std"))
            await until(lambda: _equals(depth(), 2), 10, "the standard one queued")
            server.behaviour.gate.set()
            assert await asyncio.gather(held, shed, std) == [200, 200, 200]
            assert [b["messages"][0]["content"] for b in server.received] == [
                "held",
                "std",
                "low",
            ]
    finally:
        await server.stop()


async def _equals(value, expected: float) -> bool:
    return await value == expected


async def test_a_sessions_spill_in_one_worker_is_followed_by_the_others(tmp_path) -> None:
    """Soft affinity: a session whose backend is saturated spills, in worker 0, to the
    policy's pick; worker 1 then sends the session there too (the records are shared)."""
    servers = await stubs(5)
    page = 'vllm:num_requests_waiting{{model_name="m"}} {}\n'
    for server in servers:
        server.behaviour.metrics = page.format(0)
    config = {
        "backends": backends(servers),
        "routing": {"strategy": "RANDOM"},
        "telemetry": {"scrape_interval": 0.05},
        "flow": {"saturation": {"max_waiting": 2}},
    }
    names = [SimpleNamespace(name=f"b{i}") for i in range(len(servers))]

    def placed(sid: str) -> int:
        return names.index(rendezvous(sid, names))

    async def served_by(session: aiohttp.ClientSession, sid: str) -> int:
        before = [len(s.received) for s in servers]
        headers = {"X-Session-ID": sid}
        async with session.post(r.url + CHAT, json=chat("hi"), headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
        (index,) = [i for i, s in enumerate(servers) if len(s.received) > before[i]]
        return index

    try:
        async with multi_router(tmp_path, config) as r:
            w0, w1 = r.workers()
            on0, on1 = await r.pinned(w0), await r.pinned(w1)
            # sessions placed on b0, which then fills up (no worker sees it leave); with
            # records of its own, worker 1 would match worker 0's spill 1 time in 4 each
            sids = [sid for sid in (f"s-{i}" for i in range(100)) if placed(sid) == 0][:3]
            for sid in sids:
                assert await served_by(on0, sid) == 0
            servers[0].behaviour.metrics = page.format(10)

            async def saturated_in_worker_0() -> bool:
                async with on0.get(r.url + "/debug/routing") as resp:
                    return (await resp.json())["backends"]["b0"]["waiting"] == 10.0

            await until(saturated_in_worker_0, 15, "worker 0 to see b0's queue")
            for sid in sids:
                spilled = 0
                for _ in range(100):  # until RANDOM moved it
                    spilled = await served_by(on0, sid)
                    if spilled != 0:
                        break
                assert spilled != 0
                assert [await served_by(on1, sid) for _ in range(4)] == [spilled] * 4
    finally:
        for server in servers:
            await server.stop()


async def test_discovery_and_admission_checks_run_once_for_every_worker(tmp_path) -> None:
    """The collector alone watches the API server and checks the backends it finds or a
    SIGHUP adds; every worker, a restarted one too, routes over that same fleet."""
    found = await stubs_on(["127.0.0.2", "127.0.0.3"])
    static = await StubBackend().start()
    api = await FakeKubeApi("sa-token").start()
    api.slices["vllm-a"] = api.slice("vllm-a", {"127.0.0.2": True})
    source = api.source(tmp_path / "token", "sa-token", port=found[0].port)
    # no periodic checks in the test's time: every check counted is an admission check
    quiet = {"health": {"interval": 3600}, "models_refresh_interval": 3600}
    config = {"discovery": [source], **quiet}
    names = lambda *stubs: {f"{s.host}:{s.port}" for s in stubs}  # noqa: E731
    try:
        async with multi_router(tmp_path, config) as r:
            pids = r.workers()
            sessions = [await r.pinned(pid) for pid in pids]

            async def fleet(session: aiohttp.ClientSession) -> set[str]:
                async with session.get(r.url + "/debug/routing") as resp:
                    return set((await resp.json())["backends"])

            async def everywhere(expected: set[str], what: str) -> None:
                for session in sessions:
                    await until(lambda s=session: _equals(fleet(s), expected), 15, what)

            await everywhere(names(found[0]), "the listed backend in every worker")
            api.events.put_nowait(
                {"type": "ADDED", "object": api.slice("vllm-b", {"127.0.0.3": True})}
            )
            await everywhere(names(*found), "the watched backend in every worker")
            for session in sessions:
                async with session.post(r.url + CHAT, json=chat("hi")) as resp:
                    assert resp.status == 200
            assert (api.lists, api.watches) == (1, 1)  # one per worker as well would be 3
            assert [s.health_checks for s in found] == [1, 1]
            r.path.write_text(
                yaml.safe_dump(
                    {
                        "listen": {"host": "127.0.0.1"},
                        "backends": [{"url": static.url}],
                        "discovery": [source],
                        **quiet,
                    }
                )
            )
            os.kill(r.proc.pid, signal.SIGHUP)
            await everywhere(names(static, *found), "the reload, discovered backends kept")
            assert static.health_checks == 1
            # a restarted worker reads the file, then takes the discovered backends
            os.kill(pids[1], signal.SIGKILL)
            await until(lambda: pids[1] not in r.workers(), 10, "the worker to die")
            await until(lambda: len(r.workers()) == WORKERS, 30, "the restarted worker")
            (replacement,) = set(r.workers()) - {pids[0]}
            sessions = [await r.pinned(replacement)]
            await everywhere(names(static, *found), "the restarted worker's fleet")
            assert [s.health_checks for s in (static, *found)] == [1, 1, 1]
            assert (api.lists, api.watches) == (1, 1)
    finally:
        await api.stop()
        for stub in (static, *found):
            await stub.stop()


async def test_grpc_is_served_by_every_worker_and_a_busy_port_is_refused(tmp_path) -> None:
    servers = await stubs(1)
    grpc_port = free_port()
    config = {"backends": backends(servers), "grpc": {"enabled": True, "port": grpc_port}}
    try:
        async with multi_router(tmp_path, config) as r:
            listening = [
                pid
                for pid in r.workers()
                if any(
                    c.status == "LISTEN" and c.laddr.port == grpc_port
                    for c in psutil.Process(pid).net_connections(kind="tcp")
                )
            ]
            assert len(listening) == WORKERS
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # a second router on the same port fails instead of joining the first
            cmd = [sys.executable, "-m", "router", "serve", "-c", str(r.path)]
            second = await asyncio.create_subprocess_exec(
                *cmd, "--port", str(r.port), "--workers", "2", stderr=asyncio.subprocess.PIPE
            )
            _, err = await asyncio.wait_for(second.communicate(), 30)
            assert second.returncode == 1
            assert b"Address already in use" in err
    finally:
        for s in servers:
            await s.stop()


#: channels opened at most before two workers must have served one each: all of them
#: landing in one of two workers by chance is a 2**-31 event
_CHANNELS = 32


async def test_separate_grpc_channels_are_served_by_several_workers(tmp_path) -> None:
    """gRPC has every core, as HTTP has: the kernel spreads the connections of separate
    channels over every worker's listener, and each worker answers on its own."""
    servers = await stubs(1)
    grpc_port = free_port()
    config = {"backends": backends(servers), "grpc": {"enabled": True, "port": grpc_port}}
    request = pb.ChatCompletionRequest(
        model="stub-model", messages=[pb.ChatMessage(role="user", content="hi")]
    )
    # its own subchannel pool: channels to one target would share one connection
    options = [("grpc.use_local_subchannel_pool", 1)]
    served: set[int] = set()
    try:
        async with multi_router(tmp_path, config) as r, contextlib.AsyncExitStack() as open_:
            for _ in range(_CHANNELS):  # each stays open: the workers serve them side by side
                before = r._mine(grpc_port)
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=options)
                api = pb_grpc.InferenceStub(await open_.enter_async_context(channel))
                reply = await api.CreateChatCompletion(request, timeout=10)
                assert reply.choices[0].message.content == "tok0 tok1 tok2 "
                (client_port,) = r._mine(grpc_port) - before
                owner = functools.partial(r._owner, client_port, grpc_port)
                served.add(await until(owner, 5, "the channel's worker"))
                if len(served) > 1:
                    break
            assert len(served) > 1, f"all {_CHANNELS} channels went to one worker: {served}"
    finally:
        for s in servers:
            await s.stop()


async def test_a_grpc_port_another_server_holds_is_refused(tmp_path) -> None:
    """A gRPC server elsewhere listens with SO_REUSEPORT (grpcio's default), so the
    workers could join it unnoticed; the supervisor's first bind, without SO_REUSEPORT,
    fails instead and the router exits."""
    foreign = grpc.aio.server()
    grpc_port = foreign.add_insecure_port("127.0.0.1:0")
    await foreign.start()
    path = tmp_path / "router.yaml"
    config = {
        "listen": {"host": "127.0.0.1"},
        "backends": [{"url": "http://127.0.0.1:9"}],
        "grpc": {"enabled": True, "port": grpc_port},
    }
    path.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "router", "serve", "-c", str(path), "--port", str(free_port())]
    second = await asyncio.create_subprocess_exec(
        *cmd, "--workers", str(WORKERS), stderr=asyncio.subprocess.PIPE
    )
    try:
        _, err = await asyncio.wait_for(second.communicate(), 30)
        assert second.returncode == 1
        assert b"Address already in use" in err
    finally:
        if second.returncode is None:
            second.kill()
            await second.wait()
        await foreign.stop(None)


async def test_each_worker_captures_into_files_of_its_own_whole_lines_only(tmp_path) -> None:
    """Five streams through each worker, captured: every line parses, and each worker's
    five records are in the files named with its pid (written at the stop)."""
    servers = await stubs(2, Behaviour(chunks=20))
    capture = tmp_path / "capture"
    config = {"backends": backends(servers), "capture": {"enabled": True, "sample": 1.0,
              "path": str(capture)}}  # fmt: skip
    try:
        async with multi_router(tmp_path, config) as router:
            pids = router.workers()
            for pid in pids:
                session = await router.pinned(pid)
                for i in range(5):
                    body = chat(f"worker {pid} question {i}", stream=True)
                    async with session.post(router.url + CHAT, json=body) as resp:
                        assert resp.status == 200 and b"[DONE]" in await resp.read()
            router.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(router.proc.wait, 30)
    finally:
        for s in servers:
            await s.stop()
    written: dict[int, list[str]] = {}
    for f in capture.iterdir():
        pid = int(f.name.split("-")[1])
        for line in f.read_bytes().splitlines():
            record = orjson.loads(line)  # a split or interleaved line would not parse
            written.setdefault(pid, []).append(record["request"]["messages"][0]["content"])
            assert record["response"]["stream"] is True and record["response"]["events"] >= 20
    assert {pid: sorted(q) for pid, q in written.items()} == {
        pid: [f"worker {pid} question {i}" for i in range(5)] for pid in pids
    }

"""A refused connection with several workers (`kvroute serve --workers 2`): the worker
that met it marks the backend down and tells the collector, which marks it down too
and sends its verdicts to every worker, so the other worker stops sending there without
trying, and the collector's next rounds cannot bring it back up before it answers.

The router runs in its own processes (see tests/router/test_workers.py, whose helpers
are used here), so this runs once, on the default test loop.
"""

from __future__ import annotations

import aiohttp

from tests.router.test_workers import CHAT, chat, metric, multi_router, until
from tests.stub_backend import StubBackend


async def checks_up(session: aiohttp.ClientSession, url: str, backend: str) -> float:
    """`kvroute_backend_health_check_up` of `backend` in the worker `session` reaches."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    prefix = f'kvroute_backend_health_check_up{{backend="{backend}"}} '
    (line,) = (line for line in text.splitlines() if line.startswith(prefix))
    return float(line.removeprefix(prefix))


async def test_a_refusal_one_worker_meets_marks_the_backend_down_in_every_worker(
    tmp_path,
) -> None:
    servers = [await StubBackend().start() for _ in range(2)]
    config = {
        "backends": [{"url": s.url, "name": f"b{i}"} for i, s in enumerate(servers)],
        "routing": {"strategy": "ROUND_ROBIN"},
        # the collector's own checks would take 100 s to mark it down: only the refusal does
        "health": {"interval": 0.1, "unhealthy_threshold": 1000, "healthy_threshold": 1},
    }
    try:
        async with multi_router(tmp_path, config) as r:
            met, other = [await r.pinned(pid) for pid in r.workers()]
            await servers[0].kill()

            async def met_refusal() -> bool:
                async with met.post(r.url + CHAT, json=chat("q")) as resp:
                    assert resp.status == 200  # retried on b1
                return await checks_up(met, r.url, "b0") == 0

            await until(met_refusal, 10, "a request of the first worker to meet the refusal")
            await until(lambda: _down(other, r.url), 10, "the other worker to mark b0 down")
            rounds = servers[1].health_checks + 5
            await until(lambda: servers[1].health_checks >= rounds, 10, "five more rounds")
            for session in (met, other):  # the rounds' verdicts keep it down
                assert await checks_up(session, r.url, "b0") == 0
            for _ in range(6):
                async with other.post(r.url + CHAT, json=chat("q")) as resp:
                    assert resp.headers["x-kvroute-backend"] == "b1"
            assert await metric(other, r.url, "kvroute_upstream_errors_total") == 1
            await servers[0].start()  # back on its port: the collector's checks see it
            for session in (met, other):
                await until(lambda s=session: _up(s, r.url), 10, "b0 up in every worker")
    finally:
        for s in servers:
            await s.stop()


async def _down(session: aiohttp.ClientSession, url: str) -> bool:
    return await checks_up(session, url, "b0") == 0


async def _up(session: aiohttp.ClientSession, url: str) -> bool:
    return await checks_up(session, url, "b0") == 1

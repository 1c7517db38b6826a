"""A worker's side of the collector's health verdicts (router/fleet/health.py `Verdicts`).

The message goes over the collector's feed in tests/router/test_workers.py; here both
ends live in one process, so the timing of a reload against the message is the test's:
a backend the worker adds takes the collector's verdict (healthy or not, its models),
whether that came before the worker's reload or after it, and a backend the collector
says nothing of comes back for the worker to check itself once the wait is over.
"""

from __future__ import annotations

import asyncio

import policies
from policies.random import RandomParams
from router.config import BackendConfig, BreakerConfig, HealthConfig
from router.fleet.backends import Backend, Fleet
from router.fleet.health import HealthChecker, Verdicts


def _configs(names: tuple[str, ...]) -> list[BackendConfig]:
    return [BackendConfig(url=f"http://127.0.0.1:{9000 + i}", name=n) for i, n in enumerate(names)]


def _fleet(*names: str) -> Fleet:
    return Fleet(_configs(names), policies.create(RandomParams()))


def _prepared(fleet: Fleet, *names: str) -> list[Backend]:
    """Backends about to join `fleet` (as a reload prepares them): not members yet."""
    ready = fleet.prepare(_configs(names), BreakerConfig())
    return [b for b in ready if b not in fleet.members]


def _verdicts(fleet: Fleet) -> Verdicts:
    return Verdicts(fleet, HealthChecker(fleet, None, HealthConfig()))


async def test_an_added_backend_takes_the_verdict_that_came_first_or_later() -> None:
    worker = _fleet("b0")
    got = _verdicts(worker)
    before = _fleet("b0", "b1")  # the collector, having reloaded before the worker
    before.set_healthy(before.members[1], False)
    before.members[1].check_streak = -1
    got.adopt(_verdicts(before).encode())
    (b1,) = _prepared(worker, "b0", "b1")
    assert await got.take([b1], timeout=5) == []
    assert (b1.healthy, b1.check_streak) == (False, -1)
    assert b1.transitions == {}  # it joins down: no transition to count
    (b2,) = _prepared(worker, "b0", "b2")
    waiting = asyncio.create_task(got.take([b2], timeout=5))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the collector has not reported b2 yet
    after = _fleet("b0", "b2")
    after.set_discovered(after.members[1], [{"id": "m2"}])
    got.adopt(_verdicts(after).encode())
    assert await asyncio.wait_for(waiting, 1) == []
    assert b2.healthy and b2.discovered_models == frozenset({"m2"})


async def test_a_backend_the_collector_does_not_report_is_returned_after_the_wait() -> None:
    worker = _fleet("b0")
    got = _verdicts(worker)
    (stranger,) = _prepared(worker, "b0", "b9")
    waiting = asyncio.create_task(got.take([stranger], timeout=0.3))
    await asyncio.sleep(0)
    got.adopt(_verdicts(_fleet("b0")).encode())  # a message without it: the wait goes on
    for _ in range(10):  # time for the task to wake on the message and wait again
        await asyncio.sleep(0)
    assert not waiting.done()
    assert await asyncio.wait_for(waiting, 5) == [stranger]

"""Beside the request path: active health checks and model discovery.

`HealthChecker` GETs each backend's `health.path` (vLLM's `/health`, which answers
without queueing behind generations) every `interval` seconds, all backends
concurrently so a slow one never delays the others. A check fails on a connection
error, a 5xx, or no answer within `timeout`; anything else passes, however slow.
Hysteresis: `unhealthy_threshold` consecutive failures mark the backend down and
`healthy_threshold` consecutive passes mark it up again, so one lost probe never flaps
routing and a busy backend that answers late but in time is never ejected (peers.md §4,
item 11). The verdict is written with `Fleet.set_healthy`; the request path's own
outcomes feed the circuit breaker (breaker.py), the other half of ejection.

`ModelPoller` fetches each backend's `/v1/models` every `models_refresh_interval`: the
cards feed `/v1/models` and the per-model candidate lists. A failed fetch keeps what
was known; reachability is the health checker's job.

With several workers (router/workers.py) only the collector probes: `Verdicts` encodes
its health verdicts and model cards after every round, and each worker adopts them, so
a fleet is probed once per interval, not once per worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import aiohttp
import msgspec
import orjson

from router.backends import Backend, Fleet
from router.config import HealthConfig


class HealthChecker:
    def __init__(self, fleet: Fleet, session: aiohttp.ClientSession, cfg: HealthConfig) -> None:
        self._fleet = fleet
        self._session = session
        self.cfg = cfg
        #: loop time of each backend's last passed check (telemetry freshness, admin API)
        self.last_pass: dict[str, float] = {}

    async def check_once(self) -> None:
        await asyncio.gather(*(self._check(b) for b in self._fleet.members))

    async def run(self, after: Callable[[], None] | None = None) -> None:
        """Check every `interval`; `after` hears each round's end (the collector's publish)."""
        while True:
            await asyncio.sleep(self.cfg.interval)
            if self.cfg.enabled:
                await self.check_once()
                if after is not None:
                    after()

    async def admit(self, backends: list[Backend]) -> None:
        """One check for backends about to join the fleet (reload, admin API): each
        joins up if it passes and down if not, then ordinary checks take over."""
        if not self.cfg.enabled:
            return
        results = await asyncio.gather(*(self._probe(b) for b in backends))
        for backend, passed in zip(backends, results, strict=True):
            backend.healthy, backend.check_streak = passed, 1 if passed else -1

    async def _check(self, backend: Backend) -> None:
        self.judge(backend, await self._probe(backend))

    async def _probe(self, backend: Backend) -> bool:
        try:
            async with asyncio.timeout(self.cfg.timeout):
                async with self._session.get(backend.url.with_path(self.cfg.path)) as resp:
                    await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        if resp.status >= 500:
            return False
        self.last_pass[backend.name] = asyncio.get_running_loop().time()
        return True

    def judge(self, backend: Backend, passed: bool) -> None:
        """Count the check into the backend's streak; flip it at the thresholds."""
        streak = backend.check_streak
        streak = max(streak, 0) + 1 if passed else min(streak, 0) - 1
        backend.check_streak = streak
        if passed and streak >= self.cfg.healthy_threshold:
            self._fleet.set_healthy(backend, True)
        elif not passed and -streak >= self.cfg.unhealthy_threshold:
            self._fleet.set_healthy(backend, False)


class ModelPoller:
    def __init__(
        self, fleet: Fleet, session: aiohttp.ClientSession, interval: float, timeout: float
    ) -> None:
        self._fleet = fleet
        self._session = session
        self._interval = interval
        self._timeout = timeout

    async def poll_once(self) -> None:
        await self.poll(self._fleet.members)

    async def poll(self, backends: Iterable[Backend]) -> None:
        await asyncio.gather(*(self._poll(b) for b in backends))

    async def run(self, after: Callable[[], None] | None = None) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.poll_once()
            if after is not None:
                after()

    async def _poll(self, backend: Backend) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                async with self._session.get(backend.url.with_path("/v1/models")) as resp:
                    body = await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return
        if resp.status == 200:
            self._fleet.set_discovered(backend, _cards(body))


def _cards(body: bytes) -> list[dict]:
    try:
        data = orjson.loads(body).get("data")
    except (orjson.JSONDecodeError, AttributeError):
        return []
    return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []


class _Verdict(msgspec.Struct, array_like=True):
    name: str
    healthy: bool
    streak: int
    passed_ago: float | None  # seconds since the last passed check, if any
    cards: list[dict] | None  # None: the model list is not known yet


class Verdicts:
    """The collector's probe results, as one message, and their adoption by a worker."""

    def __init__(self, fleet: Fleet, health: HealthChecker) -> None:
        self._fleet = fleet
        self._health = health
        #: set once a worker adopted a first message (it serves with known health then)
        self.adopted = asyncio.Event()

    def encode(self) -> bytes:
        now = asyncio.get_running_loop().time()
        last = self._health.last_pass
        verdicts = [
            _Verdict(
                b.name,
                b.healthy,
                b.check_streak,
                now - last[b.name] if b.name in last else None,
                None if b.discovered_models is None else b.model_cards,
            )
            for b in self._fleet.members
        ]
        return msgspec.msgpack.encode(verdicts)

    def adopt(self, payload: bytes) -> None:
        """Take the collector's verdicts; backends it does not know yet keep their own
        (one just added through the admin API, whose edit reaches the collector too)."""
        now = asyncio.get_running_loop().time()
        fleet = self._fleet
        members = {b.name: b for b in fleet.members}
        for v in msgspec.msgpack.decode(payload, type=list[_Verdict]):
            backend = members.get(v.name)
            if backend is None:
                continue
            backend.check_streak = v.streak
            fleet.set_healthy(backend, v.healthy)
            if v.passed_ago is not None:
                self._health.last_pass[v.name] = now - v.passed_ago
            if v.cards is not None:
                fleet.set_discovered(backend, v.cards)
        self.adopted.set()

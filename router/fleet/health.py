"""Beside the request path: active health checks and model discovery.

`HealthChecker` GETs each backend's `health.path` (vLLM's `/health`, which answers
without queueing behind generations) every `interval` seconds, all backends
concurrently so a slow one never delays the others. A check fails on a connection
error, a 5xx, or no answer within `timeout`; anything else passes, however slow.
Hysteresis: `unhealthy_threshold` consecutive failures mark the backend down and
`healthy_threshold` consecutive passes mark it up again, so one lost probe never flaps
routing and a busy backend that answers late but in time is never ejected (peers.md §4,
item 11). The verdict is written with `Fleet.set_healthy`; the request path's own
outcomes feed the circuit breaker (breaker.py), the other half of ejection. One outcome
is as sure as the checks: a refused connection (nothing listens), which dispatch reports
to `refused`. That marks the backend down at once, as `unhealthy_threshold` failed
checks would, and `healthy_threshold` passes bring it back (with checks off it is left
to the breaker: nothing would bring it back).

`ModelPoller` fetches each backend's `/v1/models` every `models_refresh_interval`: the
cards feed `/v1/models` and the per-model candidate lists. A failed fetch keeps what
was known; reachability is the health checker's job.

A check or poll answered 401 or 403 means the backend refuses the router's credentials
(its `api_key`): each warns once per backend (`Refusals`), again only after the answer
or the credentials changed, so a wrong key is neither silent nor a line per round.

With several workers (router/control/supervisor.py) only the collector probes: `Verdicts` encodes
its health verdicts and model cards after every round, and each worker adopts them, so
a fleet is probed once per interval, not once per worker. A worker that finds a backend
refusing connections marks it down itself and tells the collector (`REFUSED` + its
name), which marks it down too and publishes its verdicts at once: every worker stops
sending there, and the next round's verdict cannot bring it back up unchecked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable

import msgspec
import orjson

from router import log
from router.config import HealthConfig
from router.errors import UpstreamConnectError, UpstreamError
from router.fleet.backends import Backend, Fleet
from router.fleet.credentials import REFUSALS

#: a worker's word to the collector, before a backend's name: it refused a connection
REFUSED = b"R"


class Refusals:
    """Warns when a backend refuses the router's credentials to one kind of request (a
    401 or 403), once until the answer or the credentials it was sent change."""

    def __init__(self) -> None:
        #: per backend refusing them, the headers it refused (secret: never shown)
        self._refused: dict[str, dict[str, str]] = {}

    def heard(self, backend: Backend, what: str, status: int) -> None:
        """`backend` answered `what` (e.g. "GET /health") with `status`."""
        name = backend.name
        if status not in REFUSALS:
            if self._refused.pop(name, None) is not None:
                log.backends.info("backend %s accepts the router's credentials again", name)
        elif self._refused.get(name) != backend.headers:
            self._refused[name] = backend.headers
            log.backends.warning(
                "backend %s refuses the router's credentials: %s answered %d (check its api_key)",
                name, what, status,
            )  # fmt: skip


#: a GET of a path on a backend: its status and body; raises UpstreamConnectError when
#: no connection was made (its cause the OSError) or UpstreamError when the backend broke
#: off (router/upstream/pages.py)
PageAsk = Callable[[Backend, str], Awaitable[tuple[int, bytes]]]


class HealthChecker:
    def __init__(self, fleet: Fleet, ask: PageAsk | None, cfg: HealthConfig) -> None:
        self._fleet = fleet
        self._ask = ask
        self.cfg = cfg
        self._refusals = Refusals()
        #: loop time of each backend's last passed check (telemetry freshness, admin API)
        self.last_pass: dict[str, float] = {}
        #: why each backend's last check failed, while it fails (for the log)
        self.last_error: dict[str, str] = {}

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
        error = await self._error(backend)
        if error is not None:
            self.last_error[backend.name] = error
            return False
        self.last_error.pop(backend.name, None)
        self.last_pass[backend.name] = asyncio.get_running_loop().time()
        return True

    async def _error(self, backend: Backend) -> str | None:
        """Why one check of `backend` fails, or None when it passes."""
        url = backend.at(self.cfg.path)
        try:
            async with asyncio.timeout(self.cfg.timeout):
                status, _ = await self._ask(backend, self.cfg.path)
        except TimeoutError:
            return f"GET {url.path} timed out after {self.cfg.timeout:g}s"
        except UpstreamConnectError as exc:
            return f"GET {url.path}: {_unconnected(exc)}"
        except UpstreamError as exc:
            return f"GET {url.path}: {exc}"
        self._refusals.heard(backend, f"GET {url.path}", status)
        return f"GET {url.path} answered {status}" if status >= 500 else None

    def failing(self, backends: Iterable[Backend]) -> list[str]:
        """`name (why)` of each of `backends` that is down, for a warning."""
        return [
            f"{b.name} ({self.last_error.get(b.name, 'no check passed yet')})"
            for b in backends
            if not b.healthy
        ]

    def refused(self, backend: Backend) -> bool:
        """Nothing listens at `backend`: down at once, as after `unhealthy_threshold`
        failed checks. False (nothing done) while checks are off."""
        if not self.cfg.enabled:
            return False
        backend.check_streak = min(backend.check_streak, -self.cfg.unhealthy_threshold)
        self._fleet.set_healthy(backend, False, "a request's connection was refused")
        return True

    def judge(self, backend: Backend, passed: bool) -> None:
        """Count the check into the backend's streak; flip it at the thresholds."""
        streak = backend.check_streak
        streak = max(streak, 0) + 1 if passed else min(streak, 0) - 1
        backend.check_streak = streak
        if passed and streak >= self.cfg.healthy_threshold:
            self._fleet.set_healthy(backend, True, f"{streak} health checks passed in a row")
        elif not passed and -streak >= self.cfg.unhealthy_threshold:
            why = self.last_error.get(backend.name, "its health check failed")
            self._fleet.set_healthy(backend, False, f"{-streak} checks failed: {why}")


def _unconnected(exc: UpstreamConnectError) -> str:
    """Why no connection was made, in the system's words ("Connection refused") or the
    certificate's, else the error's own."""
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"its TLS certificate is not trusted ({cause.verify_message or cause})"
    if isinstance(cause, OSError) and cause.errno and not isinstance(cause, ssl.SSLError):
        return os.strerror(cause.errno)
    return str(exc)


class ModelPoller:
    def __init__(self, fleet: Fleet, ask: PageAsk, interval: float, timeout: float) -> None:
        self._fleet = fleet
        self._ask = ask
        self._interval = interval
        self._timeout = timeout
        self._refusals = Refusals()

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
                status, body = await self._ask(backend, "/v1/models")
        except (UpstreamError, TimeoutError):
            return
        self._refusals.heard(backend, f"GET {backend.at('/v1/models').path}", status)
        if status == 200:
            self._fleet.set_discovered(backend, cards_of(body))


def cards_of(body: bytes) -> list[dict]:
    """The model cards of a /v1/models answer (none if it is not one)."""
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
        #: the last message's verdicts on backends this worker does not have yet
        self._ahead: dict[str, _Verdict] = {}
        self._heard = asyncio.Event()  # set (and replaced) at each message

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

    def refused(self, payload: bytes) -> bool:
        """The collector: a worker's `REFUSED` message; True if a backend was marked down
        (the verdicts are worth publishing)."""
        backend = self._fleet.find(payload.removeprefix(REFUSED).decode())
        return backend is not None and self._health.refused(backend)

    def adopt(self, payload: bytes) -> None:
        """Take the collector's verdicts. Those on backends this worker has not added yet
        (a reload or edit the collector applied first) wait for `take`."""
        fleet = self._fleet
        members = {b.name: b for b in fleet.members}
        self._ahead = {}
        for v in msgspec.msgpack.decode(payload, type=list[_Verdict]):
            backend = members.get(v.name)
            if backend is None:
                self._ahead[v.name] = v
            else:
                self._apply(backend, v)
        self._heard.set()
        self._heard = asyncio.Event()
        self.adopted.set()

    async def take(self, backends: list[Backend], timeout: float) -> list[Backend]:
        """Give `backends`, about to join this worker's fleet, the verdicts the collector
        reaches for them (it applies the same reload or edit and probes them, once for
        the router), waiting at most `timeout`; returns those it said nothing of."""
        waiting = {b.name: b for b in backends}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for name in [n for n in waiting if n in self._ahead]:
                backend, verdict = waiting.pop(name), self._ahead[name]
                backend.healthy = verdict.healthy  # it joins so: no transition to count
                self._apply(backend, verdict)
            left = deadline - loop.time()
            if not waiting or left <= 0:
                return list(waiting.values())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heard.wait(), left)

    def _apply(self, backend: Backend, v: _Verdict) -> None:
        backend.check_streak = v.streak
        self._fleet.set_healthy(backend, v.healthy, "the collector's health checks")
        if v.passed_ago is not None:
            self._health.last_pass[v.name] = asyncio.get_running_loop().time() - v.passed_ago
        if v.cards is not None:
            self._fleet.set_discovered(backend, v.cards)

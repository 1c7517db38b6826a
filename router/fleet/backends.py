"""Backend state and the per-model `FleetView` snapshots policies read.

A `Backend` holds what routing needs: identity, weight, the models it serves, whether it
is usable, and the router-wide in-flight count (summed over the workers through
router/fleet/shared_load.py when there are several; dispatch's accounting keeps it exact).
`Fleet` caches one `FleetView` per model and rebuilds the cache only when membership,
health or model lists change, so per-request work is a dict lookup. Telemetry loops
write here; the request path only reads and counts.

Usable = passes active health checks (`healthy`), its circuit breaker admits attempts,
and it is not draining. Three writers, each beside the path: the health checker
(`set_healthy`; dispatch too, when nothing listens), the request outcomes
(`attempt_begins` / `attempt_verdict`, which drive the breaker) and the operator
(`set_draining`, `update` on reload). Every change of usability drops the cached views
and counts a transition (exported at scrape time).

Envoy's two guards keep passive ejection from emptying a fleet that is up. The ejection
cap: a breaker may open only while at most `max_ejection_percent` of the members have
theirs open or half-open, counting it; past that `attempt_verdict` refuses the opening.
Each worker has its own breakers, so the cap holds per worker. Panic: when fewer than
`panic_threshold_percent` of a model's backends (not draining) are usable, its view
takes every one that passes health checks, breaker open or not, rather than answer 503.
Both are judged off the request path: the cap when a breaker would open, panic when a
view is built.

`update` swaps membership in one step with no await: unchanged backends keep their
object (in-flight count, health, breaker), so nothing in flight is lost; removed ones
move to `retired`, which no view contains, until their last request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from yarl import URL

from policies import FleetView, Policy
from router import log
from router.config import BackendConfig, BreakerConfig
from router.fleet.breaker import Breaker, BreakerState, Outcome
from router.fleet.placements import PlacementTable
from router.fleet.shared_load import LoadTable

_MAX_CACHED_VIEWS = 1024
_DEFAULT_BREAKER = BreakerConfig()
_RECOVERIES = frozenset({"up", "closed", "undrained"})


class Backend:
    __slots__ = (
        "breaker",
        "check_streak",
        "configured_models",
        "discovered_models",
        "draining",
        "healthy",
        "local_inflight",
        "local_queued",
        "model_cards",
        "name",
        "slot",
        "table",
        "transitions",
        "url",
        "waiting",
        "weight",
    )

    def __init__(
        self,
        cfg: BackendConfig,
        breaker: BreakerConfig = _DEFAULT_BREAKER,
        table: LoadTable | None = None,
    ) -> None:
        self.name = cfg.key
        self.url = URL(cfg.url)
        self.weight = cfg.weight
        self.configured_models = frozenset(cfg.models) if cfg.models else None
        self.discovered_models: frozenset[str] | None = None
        self.breaker = Breaker(breaker)
        #: consecutive active checks: > 0 passed in a row, < 0 failed in a row
        self.check_streak = 0
        self.draining = False
        #: state changes by new state (up, down, open, half_open, closed, ...)
        self.transitions: dict[str, int] = {}
        self.model_cards: list[dict] = []
        self.healthy = True
        #: this process's requests in flight here, and their queued prompt tokens
        self.local_inflight = 0
        self.local_queued = 0
        #: with several workers: the shared table and this backend's slot in it
        self.slot = None if table is None else table.slot(cfg.key, cfg.url)
        self.table = None if self.slot is None else table
        #: scraped vllm:num_requests_waiting, 0 while unknown or stale
        self.waiting = 0.0

    @property
    def models(self) -> frozenset[str] | None:
        """Models served, or None while unknown (then it is a candidate for any model)."""
        return self.configured_models or self.discovered_models

    def serves(self, model: str) -> bool:
        models = self.models
        return not model or models is None or model in models

    @property
    def inflight(self) -> int:
        """Requests in flight here, router-wide (every worker's, when there are several)."""
        table = self.table
        return self.local_inflight if table is None else table.inflight(self.slot)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens sent here and expected uncached, not yet answered (KV_AWARE)."""
        table = self.table
        return self.local_queued if table is None else table.queued_tokens(self.slot)

    def count(self, requests: int, tokens: int) -> None:
        """The request path's accounting: attempts begin (+1) and end (-1) here."""
        self.local_inflight += requests
        self.local_queued += tokens
        if self.table is not None:
            self.table.add(self.slot, requests, tokens)

    @property
    def usable(self) -> bool:
        """May new requests go here? Health checks, breaker and drain all agree."""
        return self.healthy and not self.draining and self.breaker.admits

    def reconfigure(self, cfg: BackendConfig) -> None:
        """Apply a reloaded config of the same backend (same name and URL)."""
        self.weight = cfg.weight
        self.configured_models = frozenset(cfg.models) if cfg.models else None

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, inflight={self.inflight}, healthy={self.healthy})"


class Fleet:
    """The configured backends and the cached per-model views over them."""

    def __init__(
        self,
        configs: Iterable[BackendConfig],
        policy: Policy,
        breaker: BreakerConfig = _DEFAULT_BREAKER,
        table: LoadTable | None = None,
        placements: PlacementTable | None = None,
    ) -> None:
        self.table = table
        self.placements = placements
        self.members: tuple[Backend, ...] = tuple(Backend(c, breaker, table) for c in configs)
        self.retired: tuple[Backend, ...] = ()
        self.policy = policy
        #: the breakers' settings: the ejection cap and the panic threshold are the fleet's
        self.breaker_cfg = breaker
        self._views: dict[str, FleetView] = {}
        self._attach(policy, self.members)

    def picking(self) -> contextlib.AbstractContextManager[object]:
        """Held around a pick and the count of its request in the shared load table: with
        several workers and a policy that learns from its picks (KV-aware), the
        placements' lock, so that the next worker's pick sees both where this one went
        and its load; else nothing to hold (a stateless pick need not wait for others)."""
        if self.placements is None or self.policy.block_keys is None:
            return contextlib.nullcontext()
        return self.placements

    def _attach(self, policy: Policy, members: tuple[Backend, ...]) -> None:
        """Tell `policy` its members and, with several workers, their shared placements."""
        policy.on_fleet_change(members)
        if self.placements is not None:
            self.placements.known(b.name for b in members)
            policy.share(self.placements)

    def view(self, model: str) -> FleetView:
        view = self._views.get(model)
        if view is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views = {}  # bounded: clients choose model names
            view = self._views[model] = self._build_view(model)
        return view

    def known_model(self, model: str) -> bool:
        """False when every backend's model list is known and none lists `model`."""
        return any(b.serves(model) for b in self.members)

    def changed(self) -> None:
        """Health or model lists changed: drop the cached views."""
        self._views = {}

    def set_healthy(self, backend: Backend, healthy: bool) -> None:
        if backend.healthy != healthy:
            backend.healthy = healthy
            self._transition(backend, "up" if healthy else "down")

    def set_draining(self, backend: Backend, draining: bool) -> None:
        if backend.draining != draining:
            backend.draining = draining
            self._transition(backend, "draining" if draining else "undrained")

    def attempt_begins(self, backend: Backend) -> bool:
        """An attempt is sent to `backend`; True if it is the breaker's half-open trial."""
        trial = backend.breaker.begin()
        if trial:
            self.changed()  # no other attempt until the trial's verdict
        return trial

    def attempt_verdict(self, backend: Backend, verdict: Outcome | None, trial: bool) -> bool:
        """Feed an attempt's outcome to the breaker (None: ended without a verdict).

        True when the breaker would have opened but the ejection cap kept it closed.
        """
        breaker = backend.breaker
        admitted, before = breaker.admits, breaker.state
        state = breaker.record(verdict, trial)
        refused = state is BreakerState.OPEN and before is BreakerState.CLOSED and self._capped()
        if refused:
            breaker.refuse()
            state = None
        if state is BreakerState.OPEN:
            loop = asyncio.get_running_loop()
            loop.call_later(breaker.cfg.open_seconds, self._half_open, backend)
        if state is not None:
            self._transition(backend, state.value)
        elif breaker.admits != admitted:
            self.changed()
        return refused

    def _capped(self) -> bool:
        """Are more members ejected (breaker not closed) than `max_ejection_percent`?
        O(fleet), only when a breaker opens."""
        ejected = sum(b.breaker.state is not BreakerState.CLOSED for b in self.members)
        return ejected * 100 > self.breaker_cfg.max_ejection_percent * len(self.members)

    def prepare(self, configs: Iterable[BackendConfig], breaker: BreakerConfig) -> list[Backend]:
        """The backends `configs` describe: the current object where name and URL are
        unchanged (reconfigured by `update`), else a new one, not routable until then."""
        current = {b.name: b for b in self.members}
        out = []
        for cfg in configs:
            backend = current.get(cfg.key)
            if backend is None or backend.url != URL(cfg.url):
                backend = Backend(cfg, breaker, self.table)
            out.append(backend)
        return out

    def update(
        self,
        configs: Iterable[BackendConfig],
        backends: list[Backend],
        policy: Policy,
        breaker: BreakerConfig,
    ) -> None:
        """Swap in `backends` (from `prepare`, in config order) and `policy`, no await.

        Requests in flight keep their Backend objects; removed ones go to `retired`.
        """
        for backend, cfg in zip(backends, configs, strict=True):
            backend.reconfigure(cfg)
            backend.breaker.cfg = breaker
        self.breaker_cfg = breaker
        members = tuple(backends)
        self._attach(policy, members)
        stayed = {id(b) for b in members}
        leaving = (*self.retired, *(b for b in self.members if id(b) not in stayed))
        self.retired = tuple(b for b in leaving if b.local_inflight)
        self.members, self.policy = members, policy
        self.let_go(b for b in leaving if not b.local_inflight)
        self.changed()

    def let_go(self, gone: Iterable[Backend]) -> None:
        """Free the shared-table slots of backends this process no longer uses, so they
        can serve other backends (a slot a member or a retired backend shares stays)."""
        in_use = {b.slot for b in (*self.members, *self.retired)}
        for b in gone:
            if b.table is not None and b.slot not in in_use:
                b.table.release(b.slot)

    def set_discovered(self, backend: Backend, cards: list[dict]) -> None:
        models = frozenset(str(c.get("id", "")) for c in cards if isinstance(c, dict))
        backend.model_cards = cards
        if models != backend.discovered_models:
            backend.discovered_models = models
            self.changed()

    def any_usable(self) -> bool:
        """Can requests be routed: a usable member, or (panic on) one that passes health
        checks, whatever its breaker says (with none usable, every view is in panic)."""
        panic = self.breaker_cfg.panic_threshold_percent > 0
        return any(b.usable or (panic and _alive(b)) for b in self.members)

    def find(self, name: str) -> Backend | None:
        return next((b for b in self.members if b.name == name), None)

    def _half_open(self, backend: Backend) -> None:
        state = backend.breaker.half_open()
        if state is not None:
            self._transition(backend, state.value)

    def _transition(self, backend: Backend, to: str) -> None:
        backend.transitions[to] = backend.transitions.get(to, 0) + 1
        level = logging.INFO if to in _RECOVERIES else logging.WARNING
        log.backends.log(level, "backend %s: %s", backend.name, to)
        self.changed()

    def _build_view(self, model: str) -> FleetView:
        """The usable backends serving `model`; in panic, every one passing checks."""
        serving = tuple(b for b in self.members if not b.draining and b.serves(model))
        candidates = usable = tuple(b for b in serving if b.usable)
        if len(usable) * 100 < self.breaker_cfg.panic_threshold_percent * len(serving):
            candidates = tuple(b for b in serving if _alive(b))
        panic = len(candidates) > len(usable)  # in panic only if it adds a backend
        return FleetView(self.members, candidates, frozenset(b.name for b in candidates), panic)


def _alive(backend: Backend) -> bool:
    """Passes active checks and is not draining: routable in panic, breaker or not."""
    return backend.healthy and not backend.draining

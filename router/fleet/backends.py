"""`Fleet`: the configured backends, their membership and its updates, and (from its
bases) each pool's model names and policy (pool_settings.py), the cached per-model
views (views.py) and the backends' usability (usability.py).

Telemetry loops write here; the request path only reads and counts.

`update` swaps membership in one step with no await: unchanged backends keep their
object (in-flight count, health, breaker), so nothing in flight is lost; removed ones
move to `retired`, which no view contains, until their last request ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from yarl import URL

from policies import FleetView, Policy, Speed
from router.config import (
    BackendConfig,
    BackendCredentials,
    BreakerConfig,
    PoolConfig,
)
from router.fleet.backend import DEFAULT_BREAKER, Backend
from router.fleet.credentials import Reach, reach_all
from router.fleet.placements import PlacementTable
from router.fleet.pool_settings import PoolSettings
from router.fleet.shared_load import LoadTable
from router.fleet.speeds import (
    REFRESH,
    AnswerLengths,
    SpeedLearner,
    fastest_speed,
    slowest_speed,
    speed_prior,
    typical_speed,
)

NO_CREDENTIALS = BackendCredentials()
#: block keys a KV-aware pick inserts into its index at once (a 4,096-token prefix at
#: 16 tokens a block, ~0.1-0.4 ms); the rest a slice of as many per loop turn after it
UPKEEP_SLICE = 256


class Fleet(PoolSettings):
    """The configured backends and the cached per-model views over them."""

    def __init__(
        self,
        configs: Iterable[BackendConfig],
        policy: Policy,
        breaker: BreakerConfig = DEFAULT_BREAKER,
        table: LoadTable | None = None,
        placements: PlacementTable | None = None,
        defaults: BackendCredentials = NO_CREDENTIALS,
    ) -> None:
        """ConfigError if a backend's API key or CA bundle cannot be read."""
        self.table = table
        self.placements = placements
        configs = list(configs)
        self.members: tuple[Backend, ...] = tuple(
            Backend(c, breaker, table, reach)
            for c, reach in zip(configs, reach_all(configs, defaults), strict=True)
        )
        self.retired: tuple[Backend, ...] = ()
        #: `find`'s map, and the members it was made of
        self._named: dict[str, Backend] = {}
        self._named_for: tuple[Backend, ...] | None = None
        #: what `prepare` read for each backend, for `update` to apply
        self._next_reach: dict[int, Reach] = {}
        self.policy = policy
        self.breaker_cfg = breaker
        self._views: dict[str, FleetView] = {}
        self._pool_views = {}
        self._model_maps: dict[str, dict[str, str]] = {}
        #: the pools whose renamed models answer under the client's name, and those
        #: names by the backend's (see `public_names`)
        self._public: dict[str, dict[str, tuple[str, ...]]] = {}
        #: the policy of each pool with parameters of its own (see `policy_of`)
        self._pool_policies: dict[str, Policy] = {}
        #: the last decode picks of disaggregated requests (time, model, prefilled on,
        #: decoded on), for /debug/routing beside the policy's own decisions
        self.decodes: deque[tuple[float, str, str, str]] = deque(maxlen=64)
        #: each model's answers' median length, for requests that name no max_tokens
        self.answers = AnswerLengths()
        #: every backend's streams' speed samples together (this worker's), the stand-in
        #: while no backend has a learned speed (`lend_speeds`)
        self.speed_samples = SpeedLearner()
        #: streams ended on backends with no learned speed of their own
        self._unlearned = 0
        #: the workers' first learned speeds when this worker last took theirs
        self._learned_seen = 0
        self._attach(policy, self.members)

    def learners(self, backend: Backend) -> tuple[SpeedLearner, ...]:
        """Where a sample of `backend`'s speed goes: its own samples, and while it has
        no learned speed the fleet's stand-in too (read only while no backend has one,
        so a sample there after its backend learned one would be wasted)."""
        own = backend.speed_samples
        return (own,) if backend.learned_speed else (own, self.speed_samples)

    def scraped_decode(
        self, backend: Backend, sample: tuple[float, float, float], record: bool
    ) -> None:
        """A decode sample from `backend`'s own /metrics (telemetry/scrape.py
        `decoded_between`), which counts the streams of other routers and clients too:
        kept where `record` (one process of the router, as every worker gets the same
        snapshots), and the speed computed again."""
        prior = speed_prior(self.policy.params)
        if prior is None:
            return
        if record:
            for learner in self.learners(backend):
                learner.decoded(*sample)
        self.relearn(backend, prior)

    def relearn(self, backend: Backend, prior: Speed) -> None:
        """`backend`'s samples grew: its speed computed again (each time while it has
        none, else every `REFRESH` of this worker's streams there) and lent."""
        learned = backend.speed_samples.refreshed(prior, backend.learned_speed)
        if learned is not backend.learned_speed:
            if backend.learned_speed is None and self.table is not None:
                self.table.count_learned()
            backend.learned_speed = learned
            self.lend_speeds()
        elif learned is None:
            self.learning()

    def catch_up(self) -> None:
        """Before a pick: if another worker learned a backend's first speed, this one
        takes it from the same shared samples now, not at its own next stream there
        (until then it would send more requests there at a lent speed: a slow backend's
        first ones are the slowest answers of a warm-up). One sum over the workers when
        nothing changed."""
        table = self.table
        if table is None or (seen := table.learned()) == self._learned_seen:
            return
        self._learned_seen = seen
        prior = speed_prior(self.policy.params)
        if prior is None:
            return
        caught = False
        for b in self.members:
            if b.learned_speed is None and (speed := b.speed_samples.learned(prior)) is not None:
                b.learned_speed, caught = speed, True
        if caught:
            self.lend_speeds()

    def learning(self) -> None:
        """A stream ended on a backend with no learned speed of its own: every
        `REFRESH` such streams, lend the speeds again, since the fleet's samples
        together may show more now."""
        self._unlearned += 1
        if self._unlearned % REFRESH == 0:
            self.lend_speeds()

    def lend_speeds(self) -> None:
        """Each backend's speed for routing: its learned one, else the other replicas'
        learned one, else the median of those (figure by figure), or the fastest of
        those and the configured one for a backend no stream has been sampled on yet
        (untried: at the median of slower backends learned before it, a fast one took
        no request for a whole run), else,
        while none is known, what every backend's samples show together
        (router/fleet/speeds.py). One with none of its own is judged at the slowest
        learned while requests are in flight there (`Backend.speed`): one at a time
        until its first answer shows its speed."""
        known = [b.learned_speed or b.shared_speed for b in self.members]
        learned = [s for s in known if s is not None]
        prior = speed_prior(self.policy.params)
        typical, slowest = typical_speed(learned), slowest_speed(learned)
        fastest = fastest_speed([*learned, prior] if prior is not None else learned)
        fleet_wide = typical is None and prior is not None
        if fleet_wide:
            typical = fastest = self.speed_samples.learned(prior)
        for b, speed in zip(self.members, known, strict=True):
            b.trying_speed = None if speed is not None else slowest
            if speed is not None:
                source = "learned" if b.learned_speed is not None else "shared"
            elif b.speed_samples.sampled():
                speed, source = typical, "fleet" if fleet_wide else "typical"
            else:
                speed, source = fastest, "fleet" if fleet_wide else "fastest"
            b.lent_speed, b.lent_source = speed, source if speed is not None else None

    def _attach(self, policy: Policy, members: tuple[Backend, ...]) -> None:
        """Tell `policy` its members and, with several workers, their shared placements;
        its picks leave index work past `UPKEEP_SLICE` keys to the dispatcher's upkeep."""
        policy.on_fleet_change(members)
        policy.pace(UPKEEP_SLICE)
        if self.placements is not None:
            self.placements.known(b.name for b in members)
            policy.share(self.placements)

    def prepare(
        self,
        configs: Iterable[BackendConfig],
        breaker: BreakerConfig,
        defaults: BackendCredentials = NO_CREDENTIALS,
    ) -> list[Backend]:
        """The backends `configs` describe: the current object where name and URL are
        unchanged (reconfigured by `update`, which also gives it the reach read here),
        else a new one, not routable until then. ConfigError, before anything changed,
        if a backend's API key or CA bundle cannot be read."""
        configs = list(configs)
        reaches = reach_all(configs, defaults)
        current = {b.name: b for b in self.members}
        out = []
        self._next_reach = {}
        for cfg, reach in zip(configs, reaches, strict=True):
            backend = current.get(cfg.key)
            if backend is None or backend.url != URL(cfg.url):
                backend = Backend(cfg, breaker, self.table, reach)
            self._next_reach[id(backend)] = reach
            out.append(backend)
        return out

    def update(
        self,
        configs: Iterable[BackendConfig],
        backends: list[Backend],
        policy: Policy,
        breaker: BreakerConfig,
        pools: Iterable[PoolConfig],
    ) -> None:
        """Swap in `backends` (from `prepare`, in config order), `policy` and `pools`, no
        await.

        Requests in flight keep their Backend objects; removed ones go to `retired`.
        """
        for backend, cfg in zip(backends, configs, strict=True):
            backend.reconfigure(cfg, self._next_reach.pop(id(backend), None))
            backend.breaker.cfg = breaker
        self._next_reach = {}
        self.breaker_cfg = breaker
        members = tuple(backends)
        self._attach(policy, members)
        stayed = {id(b) for b in members}
        leaving = (*self.retired, *(b for b in self.members if id(b) not in stayed))
        self.retired = tuple(b for b in leaving if b.local_inflight)
        self.members, self.policy = members, policy
        self.let_go(b for b in leaving if not b.local_inflight)
        self.set_pools(pools)

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

    def find(self, name: str) -> Backend | None:
        """The member named `name`: by a map made again whenever the members change (a
        worker looks up each backend's snapshot by name, a thousand a second at a
        thousand backends)."""
        if self._named_for is not self.members:
            self._named = {}
            for b in self.members:
                self._named.setdefault(b.name, b)
            self._named_for = self.members
        return self._named.get(name)

"""The read-only routes beside generation: /health, /ready, /v1/models and
/debug/routing (the data listener's /metrics is web.py's: the admin listener serves
the same page). None of them reaches dispatch or a backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from aiohttp import web

from hashing.cache_trust import Learned
from hashing.tiered_index import Tier, TieredIndex
from router.dispatch.dispatcher import Dispatcher
from router.errors import KvrouteError, Unauthorized
from router.fleet.backend import Backend
from router.fleet.backends import Fleet
from router.ingress.auth import AdminToken, Authenticator
from router.ingress.relay import refused
from router.jobs.faults import StoreFaults
from router.telemetry.loops import Telemetry

#: a model card's fields that name a model
_NAMING = ("id", "root", "parent")
#: a request's tenant from its headers; raises Unauthorized (HttpIngress._tenant)
Tenant = Callable[[Mapping[str, str]], str | None]


class StatusRoutes:
    """What the router says of itself and its fleet."""

    def __init__(
        self,
        fleet: Fleet,
        dispatcher: Dispatcher,
        auth: Authenticator,
        tenant: Tenant,
        telemetry: Telemetry | None,
        admin_token: AdminToken | None,
        jobs: StoreFaults | None = None,
    ) -> None:
        """`jobs`: the job store's failures, when jobs are on."""
        self._fleet = fleet
        self._dispatch = dispatcher
        self._auth = auth
        self._tenant = tenant
        self._telemetry = telemetry
        self._admin_token = admin_token
        self._jobs = jobs

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/debug/routing", self.debug_routing),
        ]

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            self._tenant(request.headers)
        except KvrouteError as err:
            return await refused(request, err)
        cards: dict[str, dict] = {}
        for backend in self._fleet.members:
            public = self._fleet.public_names(backend)
            for card in backend.model_cards:
                for listed in _as_public(card, public):
                    cards.setdefault(str(listed.get("id")), listed)
            for model in backend.configured_models or ():
                for name in public.get(model, (model,)):
                    cards.setdefault(name, _card(name))
        return web.json_response({"object": "list", "data": list(cards.values())})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        """503 while shutting down or with no usable backend. A job store that fails
        keeps it 200 (interactive requests do not need it), and its body says why."""
        if self._dispatch.draining:
            return web.json_response({"status": "shutting down"}, status=503)
        usable = self._fleet.any_usable()
        found: dict[str, object] = {"status": "ready" if usable else "no usable backend"}
        if self._jobs is not None:
            found["jobs"] = self._jobs.describe()
        return web.json_response(found, status=200 if usable else 503)

    async def debug_routing(self, request: web.Request) -> web.StreamResponse:
        """The policy's last decisions with their scores, and each backend's state: load,
        speed (null: the configured one holds; `speed_learned` false: the fleet's
        typical learned one stands in for its own; `speed_source`: learned, shared by
        the other replicas, typical, fastest (untried), fleet (every backend's samples
        together, while none has a speed of its own), slowest (no speed of its own and
        requests in flight) or null; `speed_learned_figures`:
        the figures of a learned speed its own samples gave, the others the configured
        ones), index (source, GPU and offload-tier sizes, and the publish time of the
        last KV event batch this process applied) and its last scraped vLLM metrics;
        with a KV-aware policy, its offload tiers and the media its events named that it does
        not index; with prefill/decode pools, the last decode picks. Those decisions
        show every tenant's recent requests, so with auth on only the admin token
        opens it."""
        try:
            self._operator(request.headers.get("Authorization"))
        except Unauthorized as err:
            return await refused(request, err)
        policy = self._fleet.policy
        index = getattr(policy, "index", None)
        events = getattr(policy, "event_backends", set())
        backends = {
            b.name: {
                "usable": b.usable,
                "inflight": b.inflight,
                "queued_tokens": b.queued_tokens,
                "waiting": b.waiting,
                "speed": b.speed._asdict() if b.speed is not None else None,
                "speed_learned": b.learned_speed is not None,
                "speed_source": speed_source(b),
                "speed_learned_figures": b.speed_samples.figures if b.learned_speed else (),
                "index_mode": "events" if b.name in events else "approximate",
                "index_keys": index.gpu.size(b.name) if index is not None else None,
                "tier_keys": index.tier_sizes(b.name) if index is not None else None,
                "events_published": index.published.get(b.name) if index is not None else None,
                "learned_cache": _learned(index, b.name),
                "scraped": self._telemetry.describe(b.name) if self._telemetry else None,
            }
            for b in self._fleet.members
        }
        decisions = list(getattr(policy, "recent", ()))
        found = {"backends": backends, "decisions": decisions}
        if self._fleet.disaggregated:
            found["decodes"] = [
                {"at": at, "model": model, "prefilled_on": prefill, "chosen": chosen}
                for at, model, prefill, chosen in self._fleet.decodes
            ]
        if index is not None:
            found["tiers"] = {t.medium: _tier(t) for t in index.tiers}
            found["ignored_media"] = index.ignored
        return web.json_response(found)

    def _operator(self, authorization: str | None) -> None:
        """With auth on, Unauthorized unless `authorization` carries the admin token;
        without an admin section there is none, and nothing opens what needs it."""
        if not self._auth.enabled:
            return
        if self._admin_token is None:
            raise Unauthorized("This needs the admin token, and the router has no admin API.")
        self._admin_token.check(authorization)


def _as_public(card: dict, public: dict[str, tuple[str, ...]]) -> list[dict]:
    """A backend's model card as clients are to see it: one per name they know a
    renamed model by, its `root` and `parent` (a LoRA adapter's base) renamed too when
    they name it; any other card as it is."""
    known = {k: public[v] for k in _NAMING if isinstance(v := card.get(k), str) and v in public}
    if not known:
        return [card]
    ids = known.pop("id", (card.get("id"),))
    return [{**card, **{k: names[0] for k, names in known.items()}, "id": i} for i in ids]


def _card(model: str) -> dict:
    return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "kvroute"}


def speed_source(b: Backend) -> str | None:
    """Where the speed routing reads for `b` comes from (Fleet.lend_speeds), or slowest
    while it is judged at the slowest learned one (`Backend.speed`)."""
    speed = b.speed
    if speed is not None and speed is not b.lent_speed:
        return "slowest"
    return b.lent_source


def _learned(index: TieredIndex | None, backend: str) -> dict[str, int | None] | None:
    """What the backend's answers taught the index (hashing/cache_trust.py): its learned
    capacity in blocks (null: none learned) and the answers that taught it."""
    if index is None:
        return None
    learned = index.trust.learned.get(backend)
    return learned.described() if learned is not None else Learned().described()


def _tier(tier: Tier) -> dict[str, float | bool]:
    return {"load_s_per_token": tier.load_s_per_token, "shared": tier.shared}

"""A `Backend`: what routing needs of one backend.

Identity, weight, the models it serves, whether it is usable, how to reach it, and
(from its base, backend_load.py) its in-flight count. Usable = passes active health checks
(`healthy`), its circuit breaker admits attempts, and it is not draining; only the
fleet changes those (usability.py).
"""

from __future__ import annotations

import ssl
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp
from yarl import URL

from policies import Speed
from router.config import BackendConfig, BreakerConfig
from router.fleet.backend_load import BackendLoad
from router.fleet.batch_limit import BatchLimit
from router.fleet.breaker import Breaker
from router.fleet.credentials import NO_REACH, Reach
from router.fleet.shared_load import LoadTable
from router.fleet.speeds import SpeedLearner

DEFAULT_BREAKER = BreakerConfig()


class Backend(BackendLoad):
    """One backend as routing sees it (the module's docstring); its load is
    `BackendLoad`'s."""

    __slots__ = (
        "batch",
        "breaker",
        "check_streak",
        "configured_models",
        "discovered_models",
        "draining",
        "head_lines",
        "headers",
        "healthy",
        "kv_usage",
        "learned_speed",
        "lent_source",
        "lent_speed",
        "model_cards",
        "name",
        "pool",
        "prefix",
        "shared_speed",
        "speed_samples",
        "tls",
        "transitions",
        "trying_speed",
        "unstarted_at_scrape",
        "url",
        "waiting",
        "weight",
    )

    def __init__(
        self,
        cfg: BackendConfig,
        breaker: BreakerConfig = DEFAULT_BREAKER,
        table: LoadTable | None = None,
        reach: Reach = NO_REACH,
    ) -> None:
        super().__init__(cfg, table)
        self.name = cfg.key
        self.headers: dict[str, str] = {}
        self.head_lines = ""
        self.tls: ssl.SSLContext | None = None
        self.set_reach(reach)
        self.url = URL(cfg.url)
        #: the URL's path, before every path asked for of it ("" for none)
        self.prefix = cfg.prefix
        self.weight = cfg.weight
        #: its pool's name (None in a flat fleet)
        self.pool = cfg.pool
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
        #: its speed as learned from its own streams (speeds.py), None until then; the
        #: other router replicas' learned one (config `cluster`), None alone; the
        #: speed lent to it (Fleet.lend_speeds: its own, else the others', else one of
        #: the fleet's, else None: the policy's configured speed holds); and, while it
        #: has none of its own, the one it is judged at with requests in flight there
        #: (`speed`)
        self.speed_samples = SpeedLearner(self.table, self.slot)
        self.learned_speed: Speed | None = None
        self.shared_speed: Speed | None = None
        self.lent_speed: Speed | None = None
        #: where `lent_speed` came from: learned, shared, typical (the median of the
        #: learned ones), fastest (of those and the configured one), fleet (every
        #: backend's samples together); None: the configured speed holds
        self.lent_source: str | None = None
        self.trying_speed: Speed | None = None
        #: scraped vllm:num_requests_waiting, 0 while unknown or stale
        self.waiting = 0.0
        #: scraped vllm:kv_cache_usage_perc (0..1), 0 while unknown or stale
        self.kv_usage = 0.0
        #: the router's requests here whose answer had not begun when that scrape was
        #: taken (saturation counts those added since as waiting); None without a
        #: fresh scrape
        self.unstarted_at_scrape: int | None = None
        #: how many requests it runs at once, learned from its scrapes (flow control)
        self.batch = BatchLimit()

    @property
    def speed(self) -> Speed | None:
        """The speed routing reads. A backend with no speed of its own is lent a
        fleet's one, but while requests are in flight there its first answers have not
        shown it yet, and it is judged at `trying_speed` (the slowest learned): lent the
        fastest, an empty slow backend took every new conversation of the first moments
        until its first sample."""
        trying = self.trying_speed
        if trying is not None and self.inflight:
            return trying
        return self.lent_speed

    @property
    def models(self) -> frozenset[str] | None:
        """Models served, or None while unknown (then it is a candidate for any model)."""
        return self.configured_models or self.discovered_models

    def serves(self, model: str) -> bool:
        models = self.models
        return not model or models is None or model in models

    @property
    def usable(self) -> bool:
        """May new requests go here? Health checks, breaker and drain all agree."""
        return self.healthy and not self.draining and self.breaker.admits

    def reconfigure(self, cfg: BackendConfig, reach: Reach | None = None) -> None:
        """Apply a reloaded config of the same backend (same name and URL)."""
        self.weight = cfg.weight
        self.pool = cfg.pool
        self.configured_models = frozenset(cfg.models) if cfg.models else None
        if reach is not None:
            self.set_reach(reach)

    def set_reach(self, reach: Reach) -> None:
        """What every exchange with it carries (credentials.py): the headers (secret,
        never shown; `head_lines` is them as the request head's lines, made once) and the
        TLS verification of an https backend."""
        self.headers, self.tls = reach
        self.head_lines = "".join(f"{n}: {v}\r\n" for n, v in reach.headers.items())

    def at(self, path: str) -> URL:
        """The URL of `path` (e.g. /health) on this backend, under its prefix."""
        return self.url.with_path(self.prefix + path)

    def ask(
        self, session: aiohttp.ClientSession, method: str, path: str, **kwargs: Any
    ) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        """A request beside the path (health check, model poll, scrape, /tokenize) to
        `path` under its prefix, with its headers (its key) and its TLS verification."""
        headers = {**self.headers, **kwargs.pop("headers", {})}
        ssl_arg = True if self.tls is None else self.tls
        return session.request(method, self.at(path), headers=headers, ssl=ssl_arg, **kwargs)

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, inflight={self.inflight}, healthy={self.healthy})"

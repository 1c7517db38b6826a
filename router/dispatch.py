"""One request's way through the router: canonicalise → fingerprint → pick → proxy → account.

This is the only module that chains those steps; the HTTP and gRPC ingresses parse
their wire format into a `Call` and hand it here, so both get the same routing,
accounting and metrics. Accounting survives every ending: the backend's in-flight slot
is taken with no `await` before the `try` whose `finally` gives it back, whether the
exchange succeeds, fails upstream, times out, or the client disconnects (which cancels
this task and closes the upstream connection, so the backend aborts the generation).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from multidict import CIMultiDict

from hashing.fingerprint import Fingerprinter
from policies import SPILL_REASONS, RouteRequest
from router.backends import Backend, Fleet
from router.config import Config
from router.errors import (
    BadRequest,
    KvrouteError,
    ModelNotFound,
    NoBackendAvailable,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
)
from router.metrics import Metrics
from router.proxy import Upstream, open_upstream
from router.request import Kind


@dataclass(slots=True)
class Call:
    """What an ingress hands to dispatch: the parsed routing fields and the raw request."""

    kind: Kind
    req: object
    method: str
    path: str
    body: bytes
    headers: CIMultiDict[str]
    started: float
    tenant: str | None = None


def new_request_id() -> str:
    return os.urandom(16).hex()


class Dispatcher:
    def __init__(self, config: Config, fleet: Fleet, metrics: Metrics, session) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.strategy = config.routing.__struct_config__.tag
        self._session = session
        self._timeouts = config.timeouts
        self._max_active = config.limits.max_concurrent_requests
        self.active = 0

    def route(self, call: Call) -> Backend:
        """Pick the backend for `call`; raise the client-facing error if there is none."""
        t0 = time.perf_counter()
        fleet = self.fleet
        model = call.req.model or ""
        if not fleet.known_model(model):
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        policy = fleet.policy
        fingerprinter = policy.fingerprinter
        try:
            fp = 0 if fingerprinter is None else _fingerprint(fingerprinter, call, model)
        except ValueError as exc:  # e.g. a prompt mixing texts and token ids
            raise BadRequest(f"Invalid prompt: {exc}", param="prompt") from None
        pick = policy.pick(RouteRequest(model, fp), fleet.view(model))
        m = self.metrics
        m.decision_seconds.observe(time.perf_counter() - t0)
        m.decisions.labels(self.strategy, pick.reason).inc()
        if pick.reason in SPILL_REASONS:
            m.spillovers.labels(pick.reason).inc()
        if pick.backend is None:
            raise NoBackendAvailable(
                f"No backend is available for model `{model}`; retry shortly.", retry_after=1
            )
        return pick.backend

    @asynccontextmanager
    async def exchange(self, call: Call) -> AsyncIterator[Upstream]:
        """Route `call` and open the upstream response; the body is read inside the block."""
        try:
            if self.active >= self._max_active:
                raise Overloaded("The router is at its concurrent request limit.", retry_after=1)
            backend = self.route(call)
        except KvrouteError as err:
            self.rejected(err)
            raise
        loop = asyncio.get_running_loop()
        t = self._timeouts
        end = call.started + t.total
        itl = self.metrics.itl.labels(backend.name).observe
        status = "error"
        ok = False
        upstream: Upstream | None = None
        backend.inflight += 1  # taken here, given back in `finally`: no await in between
        self.active += 1
        try:
            async with asyncio.timeout_at(min(loop.time() + t.first_byte, end)) as deadline:
                upstream = await open_upstream(
                    self._session,
                    backend.url.with_path(call.path, encoded=True),
                    call.method,
                    call.body,
                    call.headers,
                    deadline,
                    t.idle,
                    end,
                    itl,
                )
                upstream.backend_name = backend.name
                status = str(upstream.status)
                yield upstream
                ok = True
        except TimeoutError as exc:
            status = self._failed(backend, UpstreamTimeout.status, UpstreamTimeout.kind)
            raise UpstreamTimeout("The backend did not answer in time.") from exc
        except UpstreamError as exc:
            status = self._failed(backend, exc.status, exc.kind)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = "499"  # nginx's "client closed request"
            self.metrics.client_disconnects.labels(backend.name).inc()
            raise
        finally:
            backend.inflight -= 1
            self.active -= 1
            if upstream is not None:
                upstream.finish(clean=ok)
            self._account(backend, status, call.started, upstream, loop.time())

    def _failed(self, backend: Backend, status: int, kind: str) -> str:
        self.metrics.upstream_errors.labels(backend.name, kind).inc()
        return str(status)

    def _account(
        self, backend: Backend, status: str, started: float, upstream: Upstream | None, now: float
    ) -> None:
        m = self.metrics
        m.requests.labels(backend.name, self.strategy, status).inc()
        m.e2e.labels(backend.name).observe(now - started)
        if upstream is not None and upstream.first_chunk_at is not None:
            m.ttft.labels(backend.name).observe(upstream.first_chunk_at - started)

    def rejected(self, error: KvrouteError) -> None:
        """Count a request refused before it reached any backend."""
        self.metrics.requests.labels("none", self.strategy, str(error.status)).inc()


def _fingerprint(fingerprinter: Fingerprinter, call: Call, model: str) -> int:
    req = call.req
    tenant = _tenant(call.tenant, req.cache_salt)
    if call.kind is Kind.CHAT:
        return fingerprinter.chat(model, tenant, req.messages, req.tools)
    prompt = getattr(req, "prompt", None) or getattr(req, "input", None)
    if prompt is None:  # not a generation request (e.g. /v1/responses): spread evenly
        return random.getrandbits(64)
    return fingerprinter.prompt(model, tenant, prompt)


def _tenant(header: str | None, cache_salt: str | None) -> str | None:
    """The isolation key: the tenant header and vLLM's cache_salt (its own cache partition)."""
    if cache_salt is None:
        return header
    return cache_salt if header is None else f"{header}\x1f{cache_salt}"

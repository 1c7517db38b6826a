"""One request's way through the router: admit → describe → pick → attempt → account.

This is the only module that chains those steps; the HTTP and gRPC ingresses parse
their wire format into a `Call` and hand it here, so both get the same admission,
routing, retries, accounting and metrics. Each step has its module:

  admission.py   the wait queue and concurrency caps (503, 429 per tenant)
  flow.py        the queue's order (classes, fair share) and the saturation gate
  describe.py    the model check (404) and what the policy reads of the prompt
  pick.py        the policy's pick, and the first attempt begun under the pick lock
  session.py     session affinity: the first pick steered to the session's backend
  disaggregation.py  the prefill leg, with prefill and decode pools
  connect.py     the attempts until a backend answers, retrying before the first byte
  attempt.py     one attempt: its slots and the breaker's verdict
  accounting.py  the metrics, for the last attempt once the answer ended
  shutdown.py    the drain, and the cut of the exchanges left

Accounting survives every ending: each attempt takes its backend's in-flight slot (and
the breaker's trial slot) with no `await` before the `try` whose `finally` gives it
back, whether the attempt is retried, succeeds, fails upstream, times out, or the
client disconnects (which cancels this task and closes the upstream connection, so the
backend aborts the generation).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Collection, Container
from contextlib import asynccontextmanager

from router.config import Config
from router.dispatch.accounting import Accounting
from router.dispatch.admission import Admission, Counts
from router.dispatch.attempt import Attempts, blame
from router.dispatch.call import Call, Routed
from router.dispatch.connect import Connector
from router.dispatch.describe import Describer
from router.dispatch.disaggregation import Disaggregation
from router.dispatch.flow import decision, request_class
from router.dispatch.pick import Picker
from router.dispatch.records import Records
from router.dispatch.saturation import FleetRoom
from router.dispatch.session import Sessions
from router.dispatch.shutdown import OpenExchanges, shutting_down
from router.errors import KvrouteError, NoBackendAvailable, UpstreamTimeout
from router.fleet.adapters import AdapterLoader
from router.fleet.backend import Backend
from router.fleet.backends import Fleet
from router.metrics import Metrics
from router.request import LONG_BODY, Kind, asking_usage
from router.telemetry.tokenize import RemoteTokenizer
from router.upstream.proxy import Upstream, Upstreams

#: the requests whose answers report usage (chat and completions)
_GENERATION = frozenset({Kind.CHAT, Kind.COMPLETION})
#: how long the answers cut at the drain deadline get to write their ending (a client
#: that does not read it is then cut off by its server)
CUT_GRACE_SECONDS = 1.0


def new_request_id() -> str:
    """128 random bits in hex: unique enough for tracing, and no system call per request
    (`random` is seeded from the OS, and reseeded in a forked child)."""
    return random.getrandbits(128).to_bytes(16, "big").hex()


#: a client's request id the router passes on: RFC 9110 token characters, so it can
#: neither break a header line nor fail to encode, and at most 128 of them
_PASSABLE_ID = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,128}")


def passable_request_id(sent: str | None) -> str:
    """The client's request id when it is a bounded token, else a new one: anything
    else is replaced, not refused (the id only serves tracing, and any client can send
    it before authenticating)."""
    if sent is not None and _PASSABLE_ID.fullmatch(sent):
        return sent
    return new_request_id()


class Dispatcher:
    """A worker's way through for every request, whichever ingress it came by.

    Whole past ~150 lines by design: `exchange` chains every step inline so that none
    adds an await or a call per request, and the rest is the wiring of those steps."""

    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        metrics: Metrics,
        session,
        on_refused: Callable[[Backend], None] | None = None,
        counts: Counts | None = None,
        records: Records | None = None,
        tenants: Callable[[], Container[str]] = tuple,
    ) -> None:
        """`on_refused` hears each backend that refused a connection (the health
        checker's `refused`). `counts`: what admission counts against its caps (with
        several workers, the shared admission table); by default this process's own.
        `records`: the access log and the tracer, when they are on; `tenants`: the
        static tokens' ones now (a reload changes them), named in the token counters."""
        self.fleet = fleet
        self.metrics = metrics
        #: the request path's connections to the backends
        self._upstreams = Upstreams()
        #: the flow control settings now (a reload changes them)
        self._flow = config.flow
        self.admission = Admission(
            config.limits,
            counts,
            metrics,
            config.flow,
            FleetRoom(lambda: fleet.members, lambda: self._flow.saturation),
            lambda tenant: metrics.tenant_label(tenant, self._account.tenants()),
        )
        self._tokenizer = RemoteTokenizer(fleet, session, metrics)
        self._describer = Describer(fleet, self._tokenizer)
        self._adapters = AdapterLoader(fleet, session, config.lora)
        self._capture = records and records.capture
        usage = records and records.usage
        self._account = Accounting(
            metrics, fleet, records and records.access_log, self._capture, usage
        )
        #: ask streams for their usage (config usage.stream_usage)
        self._stream_usage = config.usage.stream_usage
        self._account.tenants = tenants
        self._tracing = records and records.tracing
        attempts = Attempts(fleet, metrics, on_refused)
        sessions = Sessions(config.flow, counts.sessions if counts is not None else None)
        self._picker = Picker(fleet, self._account, attempts, sessions)
        self._pd = Disaggregation(fleet, self._picker, session)
        self._connector = Connector(fleet, attempts, self._account, self._upstreams, self.route)
        #: shutting down: readiness is false (requests in flight still finish)
        self.draining = False
        self._open = OpenExchanges()
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Take the reloadable settings of `config`; requests in flight keep theirs."""
        self._account.strategy = self.metrics.strategy = config.strategy
        self._connector.configure(config)
        self._flow = config.flow
        self.admission.configure(config.limits, config.flow)
        self._picker.sessions.configure(config.flow)
        self._picker.saturation = config.flow.saturation
        self._adapters.configure(config.lora)
        self._pd.configure(config)

    def close(self) -> None:
        """Close the idle connections to the backends (at shutdown, after the listeners)."""
        self._upstreams.close()

    @property
    def strategy(self) -> str:
        """The routing strategy's name, as the metrics label it."""
        return self._account.strategy

    @property
    def active(self) -> int:
        """Requests admitted and not yet finished."""
        return self.admission.active

    def route(self, call: Call, tried: Collection[str] = ()) -> Routed:
        """Pick the backend for `call`, none named in `tried`; raise the client-facing
        error if there is none."""
        t0 = time.perf_counter()
        route_req = self._describer.describe(call)
        try:
            return self._picker.pick(route_req, t0, tried, call.role)
        except NoBackendAvailable:
            if not self._pd.whole_instead(call):  # a decode with no decode backend left
                raise
            return self._picker.pick(route_req, t0, tried, call.role)

    @asynccontextmanager
    async def exchange(self, call: Call) -> AsyncIterator[Upstream]:
        """Admit and route `call` and open the upstream response (retrying elsewhere
        while the client has seen nothing); the body is read inside the block. The
        steps are chained here inline, so that none adds an await of its own.

        One timeout guards the exchange: each attempt sets it to its first-byte
        deadline, which bounds the body too (a stream's chunks push it on), and it
        expires as an UpstreamTimeout (a 504) naming the backend tried last.
        """
        task = asyncio.current_task()
        tried: list[Backend] = []
        if self._tracing is not None:
            call.trace = self._tracing.begin(call)
        if self._capture is not None and self._capture.sampler.wants(call.tenant, call.headers):
            call.capture = call.body
        if self._stream_usage and call.kind in _GENERATION:
            asked = asking_usage(call.req, call.body)
            if asked is not None:
                call.body, call.strip_usage = asked, True
        try:
            self._open.enter(task)
            call.priority = call.priority or request_class(
                self._flow, call.tenant, call.headers, call.token_class
            )
            waited = time.perf_counter()
            try:
                held, call.queued = await self.admission.enter_timed(call.tenant, call.priority)
            except BaseException:
                call.queued = time.perf_counter() - waited
                raise
            try:
                async with asyncio.timeout(None) as deadline:
                    if self._adapters.wanted(call.req.model):
                        await self._adapters.ensure(call.req.model)
                    describer = self._describer
                    if (block_keys := describer.exact_ids()) is not None:
                        call.token_ids = await describer.token_ids(call, block_keys)
                    t0 = time.perf_counter()
                    route_req = describer.describe(call)
                    if len(call.body) >= LONG_BODY:
                        await asyncio.sleep(0)
                    if self._pd.applies(call):
                        await self._pd.prefill(call, route_req, t0)
                        t0 = time.perf_counter()  # the decode pick is a decision of its own
                    first = self._picker.first(route_req, t0, call, deadline)
                    if call.trace is not None:
                        call.trace.routed(first.routed, self._account.strategy, t0, call)
                    if self._flow.reason_header:
                        call.decision = decision(first.routed.reason, call.queued)
                    attempt = await self._connector.connect(call, first, deadline, tried)
                    ok = False
                    try:  # no await since connect returned: the attempt is released below
                        with attempt:
                            attempt.upstream.watch(deadline)
                            yield attempt.upstream
                        ok = True
                    finally:
                        self._account.finish(attempt, ok)
            except TimeoutError as exc:
                if not deadline.expired():
                    raise
                # only an attempt sets the deadline: one was made
                timeout = UpstreamTimeout("The backend did not answer in time.")
                raise blame(timeout, tried[-1]) from exc
            finally:
                self.admission.leave(held)
        except KvrouteError as err:
            if not tried:  # refused before any backend: shutting down, 429, 404, 400, 503
                self._account.rejected(err, call)
            raise
        except asyncio.CancelledError:
            if not self._open.was_cut(task):  # not the drain's cut, or the client left too
                raise
            raise shutting_down() from None
        finally:
            self._open.leave(task)

    async def drain(self, timeout: float) -> None:
        """Let the exchanges in flight, whichever ingress opened them, end within
        `timeout` seconds, then cut the ones left (each raises ShuttingDown in its task)
        and refuse new ones; return once the cut ones have ended, or after
        CUT_GRACE_SECONDS."""
        self.draining = True
        await self._open.drain(timeout, CUT_GRACE_SECONDS)

    def rejected(self, error: KvrouteError, call: Call) -> None:
        """Count a request refused before it reached any backend (`call`: what is known
        of it, for the access log)."""
        self._account.rejected(error, call)

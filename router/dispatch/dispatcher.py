"""One request's way through the router: canonicalise → fingerprint → pick → proxy → account.

This is the only module that chains those steps; the HTTP and gRPC ingresses parse
their wire format into a `Call` and hand it here, so both get the same admission,
routing, retries, accounting and metrics.

Order: admission (admission.py: wait queue, 429) → pick → attempt → [retry: the
policy's next pick without the backends tried (retry.py), only while nothing reached
the client] → relay inside `exchange` → account once, for the last attempt.

Accounting survives every ending: each attempt takes its backend's in-flight slot (and
the breaker's trial slot) with no `await` before the `try` whose `finally` gives it
back, whether the attempt is retried, succeeds, fails upstream, times out, or the
client disconnects (which cancels this task and closes the upstream connection, so the
backend aborts the generation). Each attempt's outcome feeds the backend's breaker, and
a refused connection (nothing listens) marks the backend down at once (`on_refused`).

When no answer came and every candidate was tried, the client gets a 503 with
`Retry-After` (BackendsFailed) at once: a 502 would invite it to retry at once on a
fleet that is down. With candidates left untried (the retry budget ran out), the last
failure is the answer (a 502).

Shutdown (`drain`): the exchanges in flight, whichever ingress opened them, get
`shutdown.drain_seconds` to end; then each one left is cut where it is (its task is
cancelled, and the cancellation comes out of `exchange` as ShuttingDown), so its
ingress ends the answer as it ends any failure: a 503, or an SSE error event and
`[DONE]` after a stream began, or a gRPC status. Cost per request: the task goes into
a set and out of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NamedTuple

from multidict import CIMultiDict
from prometheus_client.metrics import MetricWrapperBase

from hashing.chat_tokens import PromptBlocks
from hashing.fingerprint import Fingerprinter
from policies import SPILL_REASONS, Policy, RouteRequest
from router.config import Config, TimeoutsConfig
from router.dispatch.admission import Admission, Counts
from router.errors import (
    BackendsFailed,
    BadRequest,
    KvrouteError,
    ModelNotFound,
    NoBackendAvailable,
    ShuttingDown,
    UpstreamError,
    UpstreamTimeout,
)
from router.fleet.backends import Backend, Fleet
from router.fleet.breaker import Outcome, outcome
from router.metrics import Metrics
from router.request import Kind
from router.telemetry.tokenize import RemoteTokenizer
from router.upstream.proxy import Upstream, Upstreams, open_upstream
from router.upstream.retry import RetryPolicy, excluding

#: how long the answers cut at the drain deadline get to write their ending (a client
#: that does not read it is then cut off by its server)
CUT_GRACE_SECONDS = 1.0
_SHUTTING_DOWN = "The router is shutting down; retry the request."


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
    #: the prompt's exact token ids, when a backend's /tokenize supplied them
    token_ids: list[int] | None = None


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
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        metrics: Metrics,
        session,
        on_refused: Callable[[Backend], None] | None = None,
        counts: Counts | None = None,
    ) -> None:
        """`counts`: what admission counts against its caps (with several workers, the
        shared admission table); by default this process's own."""
        self.fleet = fleet
        self.metrics = metrics
        #: hears each backend that refused a connection (the health checker's `refused`)
        self.on_refused = on_refused
        #: the request path's connections to the backends
        self._upstreams = Upstreams()
        self.admission = Admission(config.limits, counts)
        self._tokenizer = RemoteTokenizer(fleet, session, metrics)
        # the labelled metrics every request records
        self._requests = _Labelled(metrics.requests)
        self._decisions = _Labelled(metrics.decisions)
        self._spillovers = _Labelled(metrics.spillovers)
        self._e2e = _Labelled(metrics.e2e)
        self._ttft = _Labelled(metrics.ttft)
        self._itl = _Labelled(metrics.itl)
        #: shutting down: readiness is false (requests in flight still finish)
        self.draining = False
        #: the tasks whose exchange is open (what `drain` waits for, then cuts)
        self._open: set[asyncio.Task] = set()
        self._idle: asyncio.Future[None] | None = None  # `drain` waits: set when none is open
        self._cut = False  # `drain` cut the exchanges left: new ones are refused
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Take the reloadable settings of `config`; requests in flight keep theirs."""
        self.strategy = config.routing.__struct_config__.tag
        self._timeouts = config.timeouts
        self._retry = RetryPolicy(config.retries)
        self.admission.configure(config.limits)

    def close(self) -> None:
        """Close the idle connections to the backends (at shutdown, after the listeners)."""
        self._upstreams.close()

    @property
    def active(self) -> int:
        """Requests admitted and not yet finished."""
        return self.admission.active

    def route(self, call: Call, tried: Collection[str] = ()) -> Routed:
        """Pick the backend for `call`, none named in `tried`; raise the client-facing
        error if there is none."""
        t0 = time.perf_counter()
        return self.pick(self.describe(call), t0, tried)

    def describe(self, call: Call) -> RouteRequest:
        """What the policy reads of `call`; raise the client-facing error for an unknown
        model or a prompt it cannot read. Apart from `pick`, so that the prompt is
        tokenized outside the workers' pick lock."""
        fleet = self.fleet
        model = call.req.model or ""
        if not fleet.view(model).candidates and not fleet.known_model(model):  # O(fleet)
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        try:
            return _describe(fleet.policy, call, model)
        except ValueError as exc:  # e.g. a prompt mixing texts and token ids
            raise BadRequest(f"Invalid prompt: {exc}", param="prompt") from None

    def pick(self, route_req: RouteRequest, t0: float, tried: Collection[str] = ()) -> Routed:
        """The policy's pick for a described request; `t0`: when its decision began."""
        fleet = self.fleet
        view = fleet.view(route_req.model)  # cached per model
        pick = fleet.policy.pick(route_req, excluding(view, tried) if tried else view)
        self.metrics.decision_seconds.observe(time.perf_counter() - t0)
        self._decisions(self.strategy, pick.reason).inc()
        if view.panic:
            self.metrics.panic_routing.inc()
        if pick.reason in SPILL_REASONS:
            self._spillovers(pick.reason).inc()
        if pick.backend is None:
            raise NoBackendAvailable(_unavailable(route_req.model), retry_after=1)
        return Routed(pick.backend, route_req.prompt_tokens, pick.predicted_cached)

    @asynccontextmanager
    async def exchange(self, call: Call) -> AsyncIterator[Upstream]:
        """Admit and route `call` and open the upstream response (retrying elsewhere
        while the client has seen nothing); the body is read inside the block.

        One timeout guards the exchange: each attempt sets it to its first-byte
        deadline, which bounds the body too (a stream's chunks push it on), and it
        expires as an UpstreamTimeout (a 504) naming the backend tried last.
        """
        task = self._opened()
        try:
            try:
                held = await self.admission.enter(call.tenant)
            except KvrouteError as err:
                self.rejected(err)
                raise
            tried: list[Backend] = []
            try:
                async with asyncio.timeout(None) as deadline:
                    attempt = await self._connect(call, deadline, tried)
                    ok = False
                    try:  # no await since _connect returned: the attempt is released below
                        with attempt:
                            attempt.upstream.watch(deadline)
                            yield attempt.upstream
                        ok = True
                    finally:
                        self._finish(attempt, ok)
            except TimeoutError as exc:
                if not deadline.expired():
                    raise
                # only an attempt sets the deadline: one was made
                timeout = UpstreamTimeout("The backend did not answer in time.")
                raise _blame(timeout, tried[-1]) from exc
            finally:
                self.admission.leave(held)
        except asyncio.CancelledError:
            # the drain's cut, unless the client left too (then it was cancelled twice)
            if not self._cut or task.uncancel():
                raise
            raise ShuttingDown(_SHUTTING_DOWN, retry_after=1) from None
        finally:
            self._closed(task)

    def _opened(self) -> asyncio.Task:
        """Note the exchange of the current task; ShuttingDown once the drain cut."""
        if self._cut:
            err = ShuttingDown(_SHUTTING_DOWN, retry_after=1)
            self.rejected(err)
            raise err
        task = asyncio.current_task()
        self._open.add(task)
        return task

    def _closed(self, task: asyncio.Task) -> None:
        self._open.discard(task)
        idle = self._idle
        if idle is not None and not self._open and not idle.done():
            idle.set_result(None)

    async def drain(self, timeout: float) -> None:
        """Let the exchanges in flight end within `timeout` seconds, then cut the ones
        left (each raises ShuttingDown in its task) and refuse new ones; return once the
        cut ones have ended, or after CUT_GRACE_SECONDS."""
        self.draining = True
        if self._open:
            self._idle = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle, timeout)
        self._cut = True
        cut = set(self._open)
        for task in cut:
            task.cancel()
        if cut:
            await asyncio.wait(cut, timeout=CUT_GRACE_SECONDS)

    async def _connect(
        self, call: Call, deadline: asyncio.Timeout, tried: list[Backend]
    ) -> _Attempt:
        """Send `call` until a backend gives an answer to relay, or no retry is left;
        each backend attempted is appended to `tried`.

        Returns the attempt holding its slots; its answer may be a backend's own error
        status, passed through. Raises the last failure if no answer came at all.
        """
        block_keys = self.fleet.policy.block_keys
        try:
            if block_keys is not None and (block_keys.remote or block_keys.offload):
                call.token_ids = await self._token_ids(call, block_keys)
            t0 = time.perf_counter()
            route_req = self.describe(call)
            # counted in the shared load before another worker picks (see Fleet.picking)
            with self.fleet.picking():
                routed = self.pick(route_req, t0)
                attempt = _Attempt(self, routed, call.started, deadline)
        except KvrouteError as err:
            self.rejected(err)
            raise
        while True:  # no await between an attempt's creation and its `try`
            tried.append(attempt.backend)
            try:
                with attempt:
                    await attempt.open(call, self._upstreams, self._timeouts)
            except BaseException:
                self._finish(attempt, False)
                raise
            upstream = attempt.upstream
            if upstream is not None and not self._retry.retryable_status(upstream.status):
                return attempt
            routed = self._retry_target(call, tried)
            if routed is None and upstream is not None:
                return attempt
            if routed is None:
                error = self._gave_up(call, attempt.error, tried)
                attempt.status = str(error.status)
                self._finish(attempt, False)
                raise error
            self._finish(attempt, False, retried=True)
            room = call.started + self._timeouts.total - asyncio.get_running_loop().time()
            deadline.reschedule(None)  # the backoff is bounded by `room`
            await asyncio.sleep(max(0.0, min(self._retry.backoff(len(tried) - 1), room)))
            attempt = _Attempt(self, routed, call.started, deadline)

    async def _token_ids(self, call: Call, block_keys: PromptBlocks) -> list[int] | None:
        """Exact ids from a backend's /tokenize, or from the HF tokenizer in a worker
        thread (it can take milliseconds: never on the event loop)."""
        req = call.req
        prompt = getattr(req, "prompt", None) or getattr(req, "input", None)
        if block_keys.remote:
            return await self._tokenizer.ids(call.kind, req.model or "", call.body, prompt)
        messages = req.messages if call.kind is Kind.CHAT else None
        tools = req.tools if call.kind is Kind.CHAT else None
        try:
            return await asyncio.to_thread(block_keys.local_ids, messages, tools, prompt)
        except ValueError as exc:  # e.g. the chat template refuses the conversation
            raise BadRequest(f"Cannot tokenize the prompt: {exc}") from None

    def _retry_target(self, call: Call, tried: list[Backend]) -> Routed | None:
        if not self._retry.allows(len(tried)):
            return None
        try:
            return self.route(call, [b.name for b in tried])
        except KvrouteError:  # no other candidate
            return None

    def _gave_up(self, call: Call, error: UpstreamError, tried: list[Backend]) -> UpstreamError:
        """What to answer when no attempt got an answer: the 503 once every candidate
        failed (after the refused ones were marked down, often none is left), else the
        last failure. O(candidates), on this failure path only."""
        model = call.req.model or ""
        names = {b.name for b in tried}
        if any(b.name not in names for b in self.fleet.view(model).candidates):
            return error
        why = f"{_unavailable(model)} Every backend tried failed; last: {error.message}"
        return _blame(BackendsFailed(why, retry_after=1), tried[-1])

    def _finish(self, attempt: _Attempt, ok: bool, retried: bool = False) -> None:
        """Release the attempt; account the request if this was its last attempt."""
        attempt.release(clean=ok)
        name = attempt.backend.name
        m = self.metrics
        if retried:
            error = attempt.error
            m.retries.labels(name, error.kind if error else f"http_{attempt.status}").inc()
            return
        started, upstream = attempt.started, attempt.upstream
        self._requests(name, self.strategy, attempt.status).inc()
        self._e2e(name).observe(asyncio.get_running_loop().time() - started)
        if upstream is not None and upstream.first_chunk_at is not None:
            self._ttft(name).observe(upstream.first_chunk_at - started)
        if ok and attempt.routed.prompt_tokens:
            self._check_prediction(attempt.routed, upstream)

    def _check_prediction(self, routed: Routed, upstream: Upstream) -> None:
        """Closed loop: the backend's reported cached_tokens against our prediction."""
        actual = upstream.cached_tokens()
        if actual is not None:
            self.metrics.prediction_error.observe(routed.predicted_cached - actual)
            self.metrics.cached_tokens.labels("predicted").inc(routed.predicted_cached)
            self.metrics.cached_tokens.labels("reported").inc(actual)

    def rejected(self, error: KvrouteError) -> None:
        """Count a request refused before it reached any backend."""
        self._requests("none", self.strategy, str(error.status)).inc()


class _Labelled:
    """A labelled metric's children by label values, each looked up once: prometheus'
    `labels()` validates its arguments and takes a lock on every call. The values come
    from small sets (backend names, strategies, statuses, reasons), as in the registry."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: MetricWrapperBase) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], MetricWrapperBase] = {}

    def __call__(self, *values: str) -> MetricWrapperBase:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class _Attempt:
    """One try of a request on one backend.

    Construction takes the backend's in-flight slot (and the breaker's half-open trial
    slot, when this is the trial); `release` gives them back, once. The breaker hears
    at most one verdict per attempt: at the response headers for a 5xx (breaker.py
    weighs which), when the attempt fails (connection, timeout, cut stream), or else a
    success once the answer was relayed whole, so a stream the backend cuts counts as
    the failure it is; a client that leaves gives none.
    `with attempt:` notes how the attempt ends if an exception ends it.
    """

    __slots__ = (
        "_fleet",
        "_itl",
        "_judged",
        "_metrics",
        "_queued",
        "_refused",
        "_timeout",
        "_trial",
        "backend",
        "error",
        "routed",
        "started",
        "status",
        "upstream",
    )

    def __init__(
        self, dispatcher: Dispatcher, routed: Routed, started: float, timeout: asyncio.Timeout
    ) -> None:
        self._fleet = fleet = dispatcher.fleet
        self._metrics = dispatcher.metrics
        self._refused = dispatcher.on_refused
        self.routed = routed
        self.backend = backend = routed.backend
        self._itl = dispatcher._itl(backend.name)
        self.started = started
        self._queued = routed.prompt_tokens - routed.predicted_cached
        backend.count(1, self._queued)
        self._trial = fleet.attempt_begins(backend)
        self._judged = False  # the breaker heard this attempt's verdict
        self.status = "error"
        #: the exchange's timeout: this attempt sets it and hears when it expires
        self._timeout = timeout
        self.upstream: Upstream | None = None
        self.error: UpstreamError | None = None

    async def open(self, call: Call, upstreams: Upstreams, t: TimeoutsConfig) -> None:
        """Send the request and wait for the answer's headers (`upstream`), or note
        why there is none (`error`) if it failed before the backend answered."""
        end = call.started + t.total
        self._timeout.reschedule(min(asyncio.get_running_loop().time() + t.first_byte, end))
        backend = self.backend
        try:
            upstream = await open_upstream(
                upstreams,
                backend.url,
                call.path,
                call.method,
                call.body,
                call.headers,
                t.connect,
                t.idle,
                end,
                self._itl,
                self.prefilled,
            )
        except UpstreamError as exc:  # not a timeout: worth a retry elsewhere
            self._note(exc)
            return
        upstream.backend_name = backend.name
        self.upstream = upstream
        self.status = str(upstream.status)
        verdict = outcome(upstream.status)
        if verdict is not Outcome.SUCCESS:  # a success is judged when the answer ended
            self._verdict(verdict)

    def __enter__(self) -> _Attempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb) -> None:
        """Note how the attempt ends if an exception ends it. The exchange's timeout
        cancels the task: a cancellation once it expired is a timeout (a 504)."""
        if isinstance(exc, asyncio.CancelledError) and self._timeout.expired():
            exc = UpstreamTimeout("The backend did not answer in time.")
        if exc is not None:
            self._note(exc)

    def prefilled(self) -> None:
        """The first token arrived: the prompt's tokens no longer queue on the backend."""
        self.backend.count(0, -self._queued)
        self._queued = 0

    def release(self, clean: bool) -> None:
        """Give the slots back; an answer relayed whole (`clean`) not judged yet is a
        success, and a trial ending without a verdict frees the trial slot."""
        self.backend.count(-1, -self._queued)
        self._queued = 0
        if not self._judged and (clean or self._trial):
            self._verdict(Outcome.SUCCESS if clean else None)
        if self.upstream is not None:
            self.upstream.finish(clean)

    def _note(self, exc: BaseException) -> None:
        if isinstance(exc, UpstreamError):
            _blame(exc, self.backend)
            self.error, self.status = exc, str(exc.status)
            self._metrics.upstream_errors.labels(self.backend.name, exc.kind).inc()
            self._verdict(Outcome.FAILURE)
            if self._refused is not None and isinstance(exc.__cause__, ConnectionRefusedError):
                self._refused(self.backend)  # proxy raises it from the OSError
        elif isinstance(exc, (asyncio.CancelledError, ConnectionResetError)):
            self.status = "499"  # nginx's "client closed request"
            self._metrics.client_disconnects.labels(self.backend.name).inc()

    def _verdict(self, verdict: Outcome | None) -> None:
        if self._judged:
            return
        self._judged = verdict is not None
        if self._fleet.attempt_verdict(self.backend, verdict, self._trial):
            self._metrics.ejections_refused.labels(self.backend.name).inc()
        self._trial = False


class Routed(NamedTuple):
    backend: Backend
    #: prompt tokens, and how many of them the policy expects cached (KV-aware policies)
    prompt_tokens: int = 0
    predicted_cached: int = 0


def _unavailable(model: str) -> str:
    """The message of a 503 for `model`."""
    which = f" for model `{model}`" if model else " (the request named no model)"
    return f"No backend is available{which}; retry shortly."


def _blame(err: UpstreamError, backend: Backend) -> UpstreamError:
    """`err`, naming `backend` as the one that failed (the client sees which)."""
    url = backend.url
    err.blame(backend.name, f"{url.host}:{url.port}")
    return err


def _describe(policy: Policy, call: Call, model: str) -> RouteRequest:
    """The RouteRequest with what this policy reads: a fingerprint and/or block keys."""
    req = call.req
    fingerprinter, block_keys = policy.fingerprinter, policy.block_keys
    fp = 0
    if fingerprinter is not None:
        # routing isolation: the tenant header and vLLM's cache partition (cache_salt)
        fp = _apply(fingerprinter, call, model, _tenant(call.tenant, req.cache_salt))
        fp = random.getrandbits(64) if fp is None else fp  # e.g. /v1/responses: spread
    blocks, tokens = (), 0
    if block_keys is not None and call.token_ids is not None:
        blocks, tokens = block_keys.of_ids(model, req.cache_salt, call.token_ids)
    elif block_keys is not None:
        # block keys isolate exactly as vLLM does: by cache_salt alone
        blocks, tokens = _apply(block_keys, call, model, req.cache_salt) or ((), 0)
    return RouteRequest(model, fp, blocks, tokens)


def _apply(describer: Fingerprinter | PromptBlocks, call: Call, model: str, tenant: str | None):
    """Run `describer` on the request's prompt; None when it has none (not generation)."""
    req = call.req
    if call.kind is Kind.CHAT:
        return describer.chat(model, tenant, req.messages, req.tools)
    prompt = getattr(req, "prompt", None) or getattr(req, "input", None)
    return None if prompt is None else describer.prompt(model, tenant, prompt)


def _tenant(header: str | None, cache_salt: str | None) -> str | None:
    """The isolation key: the tenant header and vLLM's cache_salt (its own cache partition)."""
    if cache_salt is None:
        return header
    return cache_salt if header is None else f"{header}\x1f{cache_salt}"

"""What a request records on its way: its routing decision, each retry, and once, for
its last attempt, its outcome (status, latencies, the tokens its answer reported, the
KV-cache prediction checked against them, its access log line); or its refusal before
any backend.

The labelled children every request touches are looked up once (`Labelled`); the
strategy label is the reloadable setting `Dispatcher.configure` sets here. Latencies are
measured from the call's `arrived` (perf_counter: sub-millisecond on every loop). A
failure (a 5xx the router makes, a retry) is logged, throttled; a success never is,
beside the access log, which writes off the request's path (router/access_log.py), as
the data capture does (router/capture.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container

from policies import SPILL_REASONS, Pick, Reason
from router import log
from router.access_log import AccessLog, Entry
from router.capture import Capture, Captured
from router.dispatch.attempt import Attempt
from router.dispatch.call import Call, Routed
from router.errors import KvrouteError
from router.fleet.backends import Fleet
from router.fleet.speeds import MIN_DECODE_TOKENS, speed_prior
from router.metrics import NO_POOL, NO_TENANT, Labelled, Metrics, model_label
from router.telemetry.cache_feedback import CacheFeedback, in_router_tokens
from router.upstream.usage import NO_USAGE, Usage
from router.usage_records import UsageRecords


class Accounting:
    """The request path's metrics and access log, by the step that records them."""

    __slots__ = (
        "_access",
        "_capture",
        "_decisions",
        "_e2e",
        "_feedback",
        "_fleet",
        "_metrics",
        "_requests",
        "_spillovers",
        "_ttft",
        "_usage",
        "strategy",
        "tenants",
    )

    def __init__(
        self,
        metrics: Metrics,
        fleet: Fleet,
        access: AccessLog | None = None,
        capture: Capture | None = None,
        usage: UsageRecords | None = None,
    ) -> None:
        self._metrics = metrics
        self._fleet = fleet
        self._feedback = CacheFeedback(fleet, metrics)
        self._access = access
        self._capture = capture
        self._usage = usage
        self._requests = Labelled(metrics.requests)
        self._decisions = Labelled(metrics.decisions)
        self._spillovers = Labelled(metrics.spillovers)
        self._e2e = Labelled(metrics.e2e)
        self._ttft = Labelled(metrics.ttft)
        #: the routing strategy's name, as the metrics label it
        self.strategy = ""
        #: the static tokens' tenants now, named in the token counters
        self.tenants: Callable[[], Container[str]] = tuple

    def decided(self, pick: Pick, panic: bool, t0: float) -> None:
        """Count the policy's pick; `t0`: when its decision began, `panic`: its view's."""
        m = self._metrics
        m.decision_seconds.observe(time.perf_counter() - t0)
        self._decisions(self.strategy, pick.reason).inc()
        if panic:
            m.panic_routing.inc()
        if pick.reason in SPILL_REASONS:
            self._spillovers(pick.reason).inc()

    def pooled(self, passed: list[tuple[str, bool]], pick: Pick) -> None:
        """Count a fleet with pools' decision: the pools passed on (saturated, or with no
        usable backend for the model) and the pool that took the request."""
        m = self._metrics
        for name, had_backend in passed:
            m.pool_spills.labels(name, "saturated" if had_backend else "unavailable").inc()
        if pick.backend is not None and pick.backend.pool is not None:
            m.pool_picks.labels(pick.backend.pool).inc()

    def finish(self, attempt: Attempt, ok: bool, retried: bool = False) -> None:
        """Release the attempt; account the request if this was its last attempt."""
        attempt.release(clean=ok)
        name, call, error = attempt.backend.name, attempt.call, attempt.error
        upstream, trace = attempt.upstream, call.trace
        if trace is not None:
            first = upstream.first_chunk_at if upstream is not None else None
            trace.attempt_ends(attempt.status, error, first)
        if retried:
            reason = error.kind if error else f"http_{attempt.status}"
            self._metrics.retries.labels(name, reason).inc()
            why = error.message if error else f"it answered {attempt.status}"
            log.requests_failed.warning(
                "request %s: retrying elsewhere, backend %s failed: %s", call.request_id, name, why
            )
            return
        endpoint, model = attempt.labels
        seconds = time.perf_counter() - call.arrived
        self._requests(name, self.strategy, attempt.status, endpoint, model).inc()
        self._e2e(name, endpoint, model).observe(seconds)
        ttft = None
        if upstream is not None and upstream.first_chunk_at is not None:
            ttft = upstream.first_chunk_at - call.arrived
            self._ttft(name, endpoint, model).observe(ttft)
        used = upstream.usage() if ok and upstream is not None else NO_USAGE
        if used is not NO_USAGE:
            label = self._metrics.tenant_label(call.tenant, self.tenants())
            pool = attempt.backend.pool
            self._metrics.count_tokens(model, label, pool, *used)
            if self._usage is not None:
                # chargeback keeps every tenant's id; only the metrics' labels are bounded
                self._usage.add(call.tenant or NO_TENANT, model, pool or NO_POOL, *used)
            if attempt.routed.prompt_tokens:
                self._check_prediction(attempt.routed, used)
        if ok and ttft is not None and upstream.streaming:
            self._learn(attempt, ttft, used)
        if trace is not None:
            trace.finish(attempt.status, error, used, name, call.attempts - 1)
        if error is not None:
            log.requests_failed.warning(
                "request %s: %s %s from backend %s: %s",
                call.request_id,
                error.status,
                error.kind,
                name,
                error.message,
            )
        captured = call.capture is not None and self._capture is not None
        if self._access is not None or captured:
            failure = type(error).__name__ if error is not None else _disconnected(attempt)
            retries = call.attempts - 1
            why = attempt.routed.reason
            status = _answered(attempt)
            entry = _entry(
                call, self.strategy, seconds, ttft, name, why, status, retries, used, failure
            )
            if self._access is not None:
                self._access.add(entry)
            if captured:
                self._captured(attempt, entry)

    def _check_prediction(self, routed: Routed, used: Usage) -> None:
        """Closed loop: the backend's reported cached_tokens against our prediction, which
        they correct (router/telemetry/cache_feedback.py)."""
        actual = used.cached
        if actual is not None:
            m = self._metrics
            m.prediction_error.observe(routed.predicted_cached - actual)
            m.cached_tokens.labels("predicted").inc(routed.predicted_cached)
            m.cached_tokens.labels("reported").inc(actual)
            found = in_router_tokens(actual, routed.prompt_tokens, used.prompt)
            if routed.reason == Reason.KV_HIT and 2 * found < routed.predicted_cached:
                m.kv_hit_shortfalls.inc()
            self._feedback.answered(
                routed.backend.name, routed.blocks, routed.predicted_cached, found
            )

    def _learn(self, attempt: Attempt, ttft: float, used: Usage) -> None:
        """A whole stream's timings: the answer's length for its model, and its
        backend's speed (router/fleet/speeds.py) for a policy that weighs speeds. The
        tokens are its usage's, else its events (about one a token)."""
        events, decoding = attempt.upstream.decoding()
        completion = used.completion or events
        fleet = self._fleet
        if completion:
            fleet.answers.add(attempt.call.req.model or "", completion)
        prior = speed_prior(fleet.policy.params)
        if prior is None:
            return
        routed, backend = attempt.routed, attempt.backend
        samples = backend.speed_samples
        if routed.prompt_tokens:
            cached = routed.predicted_cached if used.cached is None else used.cached
            tokens = routed.ahead + (used.prompt or routed.prompt_tokens) - cached
            samples.prefilled(tokens, ttft, routed.running)
        if completion > MIN_DECODE_TOKENS:
            running = (routed.running + backend.inflight) / 2 + 1  # when picked, at its end
            beside = samples.prefilled_total() - attempt.prefills_then
            samples.decoded(running, decoding / (completion - 1), beside / (completion - 1))
        learned = samples.refreshed(prior, backend.learned_speed)
        if learned is not backend.learned_speed:
            backend.learned_speed = learned
            fleet.lend_speeds()

    def rejected(self, error: KvrouteError, call: Call) -> None:
        """Count a request refused before it reached any backend; `call`: what is known
        of it (no routing fields when it was refused before its body was read)."""
        label = model_label(call.req.model, self._fleet.models)
        self._requests("none", self.strategy, str(error.status), call.kind.value, label).inc()
        if error.status >= 500:
            rid = call.request_id
            log.requests_failed.warning("request %s: %s %s", rid, error.status, error.message)
        if call.trace is not None:
            call.trace.finish(str(error.status), error, NO_USAGE, "", 0)
        if self._access is not None:
            seconds = time.perf_counter() - call.arrived
            status, failure = str(error.status), type(error).__name__
            dropped = getattr(error, "drop_reason", "")  # why admission refused it
            entry = _entry(
                call, self.strategy, seconds, None, "", dropped, status, 0, NO_USAGE, failure
            )
            self._access.add(entry)

    def _captured(self, attempt: Attempt, entry: Entry) -> None:
        """Hand the request's raw parts to the capture's queue (it encodes them)."""
        call, upstream, capture = attempt.call, attempt.upstream, self._capture
        response = upstream.body() if upstream is not None and upstream.kept else None
        sent = call.headers if call.sent_headers is None else call.sent_headers
        capture.add(
            Captured(
                entry,
                attempt.backend.pool,
                capture.headers(sent.items()),
                call.capture,
                response,
                upstream is not None and upstream.streaming,
            )
        )


def _entry(
    call: Call,
    strategy: str,
    seconds: float,
    ttft: float | None,
    backend: str,
    reason: str,
    status: str,
    retries: int,
    used: Usage,
    failure: str,
) -> Entry:
    """The request's access log line (router/access_log.py), which a capture record
    holds too."""
    return Entry(
        time.time(),
        seconds,
        ttft,
        call.request_id,
        call.tenant,
        call.method,
        call.path,
        call.req.model or "",
        strategy,
        backend,
        reason,
        call.prefilled_by or "",
        status,
        retries,
        *used,
        failure,
        call.priority or "",
        call.queued,
    )


def _answered(attempt: Attempt) -> str:
    """The status the client got: a stream's that began, even if the backend broke it
    after (its line's `error` says it did; the metrics count the failure), else the
    outcome's."""
    upstream = attempt.upstream
    if attempt.call.began and attempt.error is not None and upstream is not None:
        return str(upstream.status)
    return attempt.status


def _disconnected(attempt: Attempt) -> str:
    """The failure of an attempt that ended with no error of its backend's."""
    return "ClientDisconnected" if attempt.status == "499" else ""

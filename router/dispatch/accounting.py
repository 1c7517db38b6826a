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

Its parts: the access log line and capture record (log_line.py), the KV-cache
prediction checked (prediction.py), what a stream teaches the fleet (learning.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container

from policies import SPILL_REASONS, Pick
from router import log
from router.access_log import AccessLog
from router.capture import Capture
from router.dispatch.attempt import Attempt
from router.dispatch.call import Call
from router.dispatch.learning import learn
from router.dispatch.log_line import entry, logged
from router.dispatch.prediction import check_prediction
from router.errors import KvrouteError
from router.fleet.backends import Fleet
from router.metrics import NO_POOL, NO_TENANT, Labelled, Metrics, model_label
from router.telemetry.cache_feedback import CacheFeedback
from router.upstream.usage import NO_USAGE
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
                check_prediction(self._metrics, self._feedback, attempt.routed, used)
        if ok and ttft is not None and upstream.streaming:
            learn(self._fleet, attempt, used)
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
        if self._access is not None or (call.capture is not None and self._capture is not None):
            logged(self._access, self._capture, attempt, self.strategy, seconds, ttft, used)

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
            line = entry(
                call, self.strategy, seconds, None, "", dropped, status, 0, NO_USAGE, failure
            )
            self._access.add(line)

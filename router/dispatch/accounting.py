"""What a request records on its way: its routing decision, each retry, and once, for
its last attempt, its outcome (status, latencies, the KV-cache prediction checked
against what the backend reported); or its refusal before any backend.

The labelled children every request touches are looked up once (`Labelled`); the
strategy label is the reloadable setting `Dispatcher.configure` sets here. Latencies are
measured from the call's `arrived` (perf_counter: sub-millisecond on every loop).
"""

from __future__ import annotations

import time

from policies import SPILL_REASONS, Pick
from router.dispatch.attempt import Attempt
from router.dispatch.call import Routed
from router.errors import KvrouteError
from router.fleet.backends import Fleet
from router.metrics import Labelled, Metrics, model_label
from router.request import Kind
from router.upstream.proxy import Upstream


class Accounting:
    """The request path's metrics, by the step that records them."""

    __slots__ = (
        "_decisions",
        "_e2e",
        "_fleet",
        "_metrics",
        "_requests",
        "_spillovers",
        "_ttft",
        "strategy",
    )

    def __init__(self, metrics: Metrics, fleet: Fleet) -> None:
        self._metrics = metrics
        self._fleet = fleet
        self._requests = Labelled(metrics.requests)
        self._decisions = Labelled(metrics.decisions)
        self._spillovers = Labelled(metrics.spillovers)
        self._e2e = Labelled(metrics.e2e)
        self._ttft = Labelled(metrics.ttft)
        #: the routing strategy's name, as the metrics label it
        self.strategy = ""

    def decided(self, pick: Pick, panic: bool, t0: float) -> None:
        """Count the policy's pick; `t0`: when its decision began, `panic`: its view's."""
        m = self._metrics
        m.decision_seconds.observe(time.perf_counter() - t0)
        self._decisions(self.strategy, pick.reason).inc()
        if panic:
            m.panic_routing.inc()
        if pick.reason in SPILL_REASONS:
            self._spillovers(pick.reason).inc()

    def finish(self, attempt: Attempt, ok: bool, retried: bool = False) -> None:
        """Release the attempt; account the request if this was its last attempt."""
        attempt.release(clean=ok)
        name = attempt.backend.name
        if retried:
            error = attempt.error
            reason = error.kind if error else f"http_{attempt.status}"
            self._metrics.retries.labels(name, reason).inc()
            return
        arrived, upstream = attempt.call.arrived, attempt.upstream
        endpoint, model = attempt.labels
        self._requests(name, self.strategy, attempt.status, endpoint, model).inc()
        self._e2e(name, endpoint, model).observe(time.perf_counter() - arrived)
        if upstream is not None and upstream.first_chunk_at is not None:
            self._ttft(name, endpoint, model).observe(upstream.first_chunk_at - arrived)
        if ok and attempt.routed.prompt_tokens:
            self._check_prediction(attempt.routed, upstream)

    def _check_prediction(self, routed: Routed, upstream: Upstream) -> None:
        """Closed loop: the backend's reported cached_tokens against our prediction."""
        actual = upstream.cached_tokens()
        if actual is not None:
            m = self._metrics
            m.prediction_error.observe(routed.predicted_cached - actual)
            m.cached_tokens.labels("predicted").inc(routed.predicted_cached)
            m.cached_tokens.labels("reported").inc(actual)

    def rejected(self, error: KvrouteError, kind: Kind, model: str | None = None) -> None:
        """Count a request refused before it reached any backend (`model`: None if its
        body was not read)."""
        label = model_label(model, self._fleet.models)
        self._requests("none", self.strategy, str(error.status), kind.value, label).inc()

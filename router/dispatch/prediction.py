"""The KV-cache prediction checked against what the backend reported: closed loop, the
backend's `cached_tokens` against the pick's prediction, counted, and handed to
router/telemetry/cache_feedback.py, which corrects the index with them."""

from __future__ import annotations

from policies import Reason
from router.dispatch.call import Routed
from router.metrics import Metrics
from router.telemetry.cache_feedback import CacheFeedback, in_router_tokens
from router.upstream.usage import Usage


def check_prediction(
    metrics: Metrics, feedback: CacheFeedback, routed: Routed, used: Usage
) -> None:
    """Count the prediction's error and a KV hit that fell short, and correct the index
    (`used`: the answer's usage, `routed`: the pick, with a prompt counted in tokens)."""
    actual = used.cached
    if actual is not None:
        metrics.prediction_error.observe(routed.predicted_cached - actual)
        metrics.cached_tokens.labels("predicted").inc(routed.predicted_cached)
        metrics.cached_tokens.labels("reported").inc(actual)
        found = in_router_tokens(actual, routed.prompt_tokens, used.prompt)
        if routed.reason == Reason.KV_HIT and 2 * found < routed.predicted_cached:
            metrics.kv_hit_shortfalls.inc()
        feedback.answered(routed.backend.name, routed.blocks, routed.predicted_cached, found)

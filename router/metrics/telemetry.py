"""What the router learns of the backends beside the request path: its KV-cache
predictions against what they report, telemetry downgrades, and the source of each
backend's prefix index."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.fleet.backend import Backend

_ERROR_BUCKETS = (-8192, -2048, -512, -128, -32, -1, 0, 1, 32, 128, 512, 2048, 8192)
#: why telemetry fell back (telemetry/scrape.py, index_upkeep.py, tokenize.py)
FALLBACK_REASONS = ("scrape_failed", "stale_metrics", "event_reset", "tokenize_failed")
#: the kinds of KV cache event the prefix index applies (telemetry/kv_events.py)
KV_EVENT_KINDS = ("stored", "removed", "cleared")
#: applied KV events reach the counter at most this late (seconds)
_COUNT_EVERY_S = 0.1
#: what became of a message from the cluster's Redis (telemetry/cluster.py)
CLUSTER_OUTCOMES = ("applied", "malformed", "foreign")
#: where a message between the router's own processes can be skipped
SKIPPED_AT = ("feed", "control")


class TelemetryMetrics:
    """The telemetry metrics of `Metrics`."""

    def _declare_telemetry(self, r: CollectorRegistry) -> None:
        self.prediction_error = Histogram(
            "kvroute_kv_prediction_error_tokens",
            "Predicted minus backend-reported cached prompt tokens, per request",
            buckets=_ERROR_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvroute_cached_tokens",
            "Cached prompt tokens, as predicted by the router and as reported by backends",
            ["source"],
            registry=r,
        )
        self.kv_hit_shortfalls = Counter(
            "kvroute_kv_hit_shortfalls",
            "kv_hit decisions whose backend found less than half the prompt tokens the "
            "router predicted cached",
            registry=r,
        )
        self.kv_corrections = Counter(
            "kvroute_kv_cache_corrections",
            "Answers whose reported cached tokens corrected the prefix index, by backend and "
            "outcome (miss: fewer than predicted, surplus: more)",
            ["backend", "outcome"],
            registry=r,
        )
        self.kv_disagreements = Counter(
            "kvroute_kv_event_disagreements",
            "Answers of a backend with KV events whose reported cached tokens disagree with "
            "the index its events built (by over a block and an eighth of the prediction)",
            ["backend"],
            registry=r,
        )
        self._kv_events_applied = Counter(
            "kvroute_kv_events_applied",
            "KV cache events applied to the prefix index, by kind (stored, removed, "
            "cleared); counted once for the router, where the subscriptions are",
            ["kind"],
            registry=r,
        )
        self._kv_events_kinds = tuple(self._kv_events_applied.labels(k) for k in KV_EVENT_KINDS)
        #: applied events not yet written to the counter, by kind, and when it was last
        self._kv_events_pending = [0] * len(KV_EVENT_KINDS)
        self._kv_events_flushed = 0.0
        self.learned_cache_blocks = Gauge(
            "kvroute_backend_learned_cache_blocks",
            "KV blocks a backend without KV events proved it keeps: the router's index "
            "trusts that many of its placements there",
            ["backend"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.telemetry_fallbacks = Counter(
            "kvroute_telemetry_fallbacks",
            "Telemetry downgrades by backend and reason (scrape_failed, stale_metrics, "
            "event_reset)",
            ["backend", "reason"],
            registry=r,
        )
        self._index_bytes = Gauge(
            "kvroute_prefix_index_bytes",
            "Bytes KV_AWARE's prefix index takes, by cache medium, over every process of "
            "the router (one table the processes share, or each one's own copy where "
            "the run directory had no room to share it)",
            ["medium"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self._index_mode = Gauge(
            "kvroute_backend_index_mode",
            "1 for the prefix-index source each backend is in: events or approximate",
            ["backend", "mode"],
            registry=r,
            multiprocess_mode="livemax",
        )
        for source in ("predicted", "reported"):
            self.cached_tokens.labels(source)
        self.cluster_connected = Gauge(
            "kvroute_cluster_connected",
            "1 while this replica shares placements and load through the cluster's Redis, "
            "0 while it routes alone (config `cluster`)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.cluster_peers = Gauge(
            "kvroute_cluster_peers",
            "Other router replicas whose load this one heard within the last seconds",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.cluster_messages = Counter(
            "kvroute_cluster_messages",
            "Messages from the cluster's Redis: applied, or dropped as malformed or foreign",
            ["outcome"],
            registry=r,
        )
        for outcome in CLUSTER_OUTCOMES:
            self.cluster_messages.labels(outcome)
        self.feed_skipped = Counter(
            "kvroute_feed_messages_skipped",
            "Messages between the router's own processes that one could not read and "
            "skipped (a process of another release, a bug): on a worker's feed from the "
            "collector, or on the collector's control socket",
            ["at"],
            registry=r,
        )
        for at in SKIPPED_AT:
            self.feed_skipped.labels(at)

    def _prime_telemetry(self, backends: Iterable[Backend]) -> None:
        """Create each backend's fallback and disagreement counters at 0 (the KV-events
        alert reads them)."""
        for b in backends:
            for reason in FALLBACK_REASONS:
                self.telemetry_fallbacks.labels(b.name, reason)
            self.kv_disagreements.labels(b.name)

    def kv_events_applied(self, stored: int, removed: int, cleared: int) -> None:
        """One batch's applied events, counted here and written to the counter at most
        every `_COUNT_EVERY_S` (a multiprocess counter's write costs a lock, a process id
        check and an mmap store: at thousands of batches a second, a tenth of the
        collector's time); `flush_kv_events` writes what is left."""
        pending = self._kv_events_pending
        pending[0] += stored
        pending[1] += removed
        pending[2] += cleared
        now = time.monotonic()
        if now - self._kv_events_flushed >= _COUNT_EVERY_S:
            self.flush_kv_events(now)

    def flush_kv_events(self, now: float | None = None) -> None:
        """Write the applied events counted since the last write to the counter."""
        self._kv_events_flushed = time.monotonic() if now is None else now
        for i, child in enumerate(self._kv_events_kinds):
            if n := self._kv_events_pending[i]:
                child.inc(n)
                self._kv_events_pending[i] = 0

    def index_bytes(self, media: Mapping[str, int]) -> None:
        for medium, size in media.items():
            self._index_bytes.labels(medium).set(size)

    def index_mode(self, backend: str, events: bool) -> None:
        self._index_mode.labels(backend, "events").set(1 if events else 0)
        self._index_mode.labels(backend, "approximate").set(0 if events else 1)

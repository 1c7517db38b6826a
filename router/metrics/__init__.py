"""Every Prometheus metric of the router, defined once per router instance.

  registry.py   `Metrics`: one router's registry, what /metrics renders, and the
                process-wide choices (no `_created` series)
  requests.py   what each request records: outcomes, routing decisions, latencies,
                tenants
  admission.py  admission's queue (depth, waits) and its refusals by reason
  backends.py   the backends' side: upstream errors, the breakers' refused ejections,
                panic routing, discovery, and the per-backend gauges read at scrape time
  telemetry.py  the KV-cache prediction checked against the backends, telemetry
                downgrades, the prefix index's source
  process.py    the event loop's lag, and the process metrics or every worker's files
  tokens.py     the tokens the answers reported, by model and tenant; the access log's
                lost lines
  jobs.py       async jobs and batches: accepted, attempts, ended, leases lost, webhooks
  hot_path.py   `Tally` and `Labelled`: recording on the request path without
                prometheus-client's per-call locks and checks

Label values come from the config and the router's own vocabularies, never from what a
client sends: a tenant the config does not know is `(other)` (`tenant_request`), and so
is a model no backend lists (`model_label`).

May import: router.fleet and everything below it.
"""

from router.metrics.admission import Refusal
from router.metrics.hot_path import Labelled, Tally
from router.metrics.process import LAG_INTERVAL
from router.metrics.registry import CONTENT_TYPE, Metrics
from router.metrics.requests import OTHER_TENANT, model_label
from router.metrics.tokens import NO_POOL, NO_TENANT

__all__ = [
    "CONTENT_TYPE",
    "LAG_INTERVAL",
    "NO_POOL",
    "NO_TENANT",
    "OTHER_TENANT",
    "Labelled",
    "Metrics",
    "Refusal",
    "Tally",
    "model_label",
]

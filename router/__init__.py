"""The kvroute daemon, the only package that does I/O.

One request's way, module by module:

  http_ingress.py   aiohttp routes: read the body (413 above the limit), parse the few
                    routing fields (request.py, 400 on bad JSON), build a `Call`
  dispatch.py       the one place that chains the steps: admission limit → model check
                    (404) → fingerprint (hashing/) → policy pick (policies/) on a cached
                    per-model FleetView → take the in-flight slot → proxy → give it back
                    and record metrics, whatever the ending
  proxy.py          original bytes to the backend over a pooled keep-alive session; JSON
                    answers relayed whole, SSE relayed chunk by chunk, untouched; upstream
                    failures translated to errors.py classes (502/504)

Beside the path, never on it:

  health.py         polls each backend's /v1/models: model lists and reachability
  backends.py       backend state and cached FleetView snapshots (rebuilt on change)
  metrics.py        every Prometheus metric, one registry per router
  config.py         YAML → typed, validated Config; app.py wires it all; __main__.py CLI
"""

__all__: list[str] = []

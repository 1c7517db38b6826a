"""Fleet: the backends and what the router knows of them, beside the request path.

  backend.py      a backend's state: health, breaker, drain, how to reach it
  backend_load.py  its load: requests in flight and queued prompt tokens, router-wide
  backends.py     `Fleet`: the members, and their updates on reload or discovery
  pool_settings.py  each pool's tuned policy and the model names its `model_map` renames
  views.py        the cached per-model views the policies pick from, with Envoy's
                  panic mode
  usability.py    health, drain and breaker verdicts as they change usability, with
                  Envoy's ejection cap
  breaker.py      the per-backend circuit breaker, fed by request outcomes
  health.py       active /health checks with thresholds, /v1/models polls, and the
                  collector's verdicts as the workers adopt them
  shared_load.py  in-flight counts and queued prompt tokens in shared memory (workers)
  placements.py   recent placements shared between workers (approximate prefix mode)
  discovery.py    backends from DNS names and Kubernetes EndpointSlices
  pools.py        each pool's load, and its backends an autoscaler could remove

May import: the vocabulary (config, context, errors, log, request), policies, hashing.
"""

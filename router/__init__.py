"""The kvroute daemon, the only package that does I/O.

One request's way, module by module:

  fast_ingress.py   every connection starts here: a complete common POST to a generation
                    endpoint is read and answered without aiohttp's web layer; anything
                    else hands the connection to aiohttp's server for good
  http_ingress.py   aiohttp routes and `HttpIngress.serve`, which both servers call: check
                    the token (auth.py, 401), read the body (413 above the limit, 408 too
                    slow), parse the few routing fields (request.py, 400 on bad JSON),
                    build a `Call`, relay the answer
  grpc_ingress.py   grpc.aio: protobuf → the same JSON body and `Call`; SSE → messages
                    (grpc_convert.py converts both ways)
  dispatch.py       the one place that chains the steps: admission (admission.py: wait
                    queue, 429) → model check (404) → [KV_AWARE: exact token ids from
                    tokenize.py (a backend's /tokenize) or an HF tokenizer in a worker
                    thread] → fingerprint / block keys (hashing/) → policy
                    pick (policies/) on a cached per-model FleetView → take the in-flight
                    slot → proxy → [before the first byte: retry on the policy's next
                    pick (retry.py)] → give it back, feed the breaker, record metrics
  proxy.py          original bytes to the backend over its own pooled keep-alive client; JSON
                    answers relayed whole, SSE relayed chunk by chunk, untouched (chunked.py:
                    reads of whole chunks pass as the backend framed them); upstream
                    failures translated to errors.py classes (502/504)

Beside the path, never on it:

  health.py         active /health checks with thresholds; /v1/models discovery
  telemetry.py      /metrics scraping (waiting, KV usage, block counts) and, per backend,
  kv_events.py      the vLLM KV event subscription (ZMQ, replay) feeding the prefix index
  breaker.py        per-backend circuit breaker fed by request outcomes (passive; only
                    what a client cannot cause counts fully)
  backends.py       backend state (health, breaker, drain, in-flight) and cached
                    FleetView snapshots (rebuilt on change), with Envoy's ejection cap
                    and panic mode
  shared_load.py    with several workers: in-flight counts in shared memory, summed
  shared_admission.py  with several workers: admission's counts, router-wide caps
  workers.py        `serve --workers N`: supervisor, SO_REUSEPORT workers, the collector
                    (telemetry.py gathers once there and feeds the workers)
  reload.py         SIGHUP / admin reload: build, validate, swap
  admin.py          admin API on its own listener and token
  auth.py           data-plane bearer tokens (static, signed), `kvroute token issue`
  metrics.py        every Prometheus metric, one registry per router
  config.py         YAML → typed, validated Config; app.py wires it all; __main__.py CLI
"""

__all__: list[str] = []

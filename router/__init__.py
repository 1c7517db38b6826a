"""The kvroute daemon, the only package that does I/O.

Its folders follow a request's way through it; each says in its own docstring what
lives there and what it may import. Imports run one way, down this list
(`lint-imports`, pyproject.toml):

  control/     the processes and their roles (serve, worker, collector, supervisor),
               reload and the admin API; only the CLI (__main__.py) imports it
  ingress/     where a request enters: the fast path, the aiohttp app, gRPC, auth, body
               limits; it builds a `Call`
  jobs/        async requests and batches: stored, then run through dispatch on spare
               capacity
  dispatch/    the one way through: admission (429), model check (404), the prompt
               described, the policy's pick (policies/), the in-flight slot, the
               upstream exchange, retries before the first byte, the accounting,
               the access log's line and the spans
  upstream/    one exchange with a backend: pooled connections, the body relayed as the
               backend framed it, retry rules
  telemetry/   beside the path: /metrics scraping, KV events, exact tokens, and the
               collector's feed to the workers
  metrics/     every Prometheus metric, one registry per process
  access_log.py
               the access log's lines, buffered and written by a thread of its own
  capture.py   sampled requests and answers as JSON lines, queued and written by a
               thread of their own
  fleet/       the backends' state, health, breakers, shared load and placements,
               discovery
  request.py, config.py, secrets.py, context.py, errors.py, log.py
               the vocabulary every stage shares: the routing fields of a body, the
               typed config and the secrets it names (read from files or variables),
               a process's place among the workers, the error classes and their
               HTTP/gRPC answers, the loggers

A chat request, file by file: ingress/fast.py (or ingress/web.py) → ingress/identity.py
(auth.py) → ingress/body.py → dispatch/dispatcher.py, which chains dispatch/admission.py →
dispatch/describe.py → dispatch/pick.py (policies/) → dispatch/connect.py →
upstream/proxy.py (upstream/pool.py, connection.py, response.py; relay.py and chunked.py
for SSE) → back out through ingress/relay.py (or ingress/fast_reply.py), then
dispatch/accounting.py, which counts it and hands its line to access_log.py (and, when
traced, ends its spans: dispatch/tracing.py).
"""

__all__: list[str] = []

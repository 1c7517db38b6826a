"""Ingress: where a request enters, and everything checked before it is routed.

  fast.py           every connection starts here: a complete common POST to a generation
                    endpoint is read and answered without aiohttp's web layer; anything
                    else hands the connection to aiohttp's server for good
  fast_request.py   the fast path's parse of a first read (httptools): one it answers?
  fast_body.py      a fast-path body, read only once the token passed and it fits
  fast_reply.py     the fast path's answers, written straight to the transport
  fast_idle.py      the fast path's keep-alive timeout
  tls_door.py       the HTTPS port's first byte: TLS goes on to the handshake, plain
                    HTTP gets a 400 that says to use https://
  web.py            aiohttp routes and `HttpIngress.serve`, which both servers call: the
                    token (auth.py, 401), the body (body.py), the routing fields
                    (router/request.py, 400 on bad JSON), a `Call` for the dispatcher;
                    and aiohttp's server, with the router's limits and error answers
  body.py           the body read within the limits: 413 above the limit, 408 too slow,
                    503 past the bodies' budget (body_budget.py)
  relay.py          the answer relayed back, whole or streamed, or the error answer;
                    `Reply`, which both servers implement, and `EncodedReply` over it
  compression.py    the answer's content coding from Accept-Encoding (gzip, zstd), and
                    encoders whose every output decodes on its own (a stream's events)
  jobs_routes.py    with `jobs` on: async requests (202), and the token gate, 405s and
                    404s of every job path; it routes to files_routes.py (OpenAI's
                    Files API: uploads in pieces, streamed reads) and batches_routes.py
                    (the Batch API); jobs_http.py, what their handlers share
  status.py         the read-only routes: /health, /ready, /v1/models, /debug/routing
  grpc_service.py   grpc.aio: protobuf to the same JSON body and `Call`; SSE to messages
  grpc_convert.py   the conversions both ways
  grpc_gate.py      before every RPC's servicer: the token gate, the request parsed
                    (INVALID_ARGUMENT, never a logged traceback)
  grpc_reflection.py  server reflection as grpc.reflection.v1 and v1alpha
  identity.py       who asks: a request's tenant, token class and owner from its
                    headers, and the token an unrouted path needs with auth on
  auth.py           data-plane bearer tokens (static, signed), the admin token,
                    `kvroute token issue`
  body_budget.py    the worker's share of the router-wide budget for request bodies
  targets.py        the request target, normalised (origin form, dot segments)

May import: router.dispatch and everything below it; never router.control.
"""

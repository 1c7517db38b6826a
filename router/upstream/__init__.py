"""Upstream: one exchange with a backend, on its own pooled keep-alive connections.

  proxy.py       the exchange: the request written as received, the answer handed
                 over (JSON whole, SSE chunk by chunk as the backend framed it);
                 upstream failures as router/errors.py classes (502, 504)
  pool.py        the keep-alive connections per backend, reused last-in first-out
  connection.py  one connection: a request written, its answer read from the callbacks
  response.py    one answer: where its body goes (the parser, ChunkedBody), its end
  head.py        an answer's bytes through httptools, within aiohttp's client's limits
  body.py        a body's buffer, whose limit pauses the backend's socket
  relay.py       a streamed body relayed into the client's connection from the callbacks
  clock.py       a body's timing: the first chunk, the gaps, the idle deadline
  chunked.py     chunked transfer coding, read by read, whole chunks passed on untouched
  flow.py        read and write flow control for the router's own asyncio protocols
  failures.py    how an exchange broke, before proxy.py translates it
  usage.py       the token counts an answer reports (its `usage`), found by search
  rename.py      a renamed model's answer given back the client's name (`model_map`)
  retry.py       which failures may be retried on another backend, and how often
  pages.py       GETs beside the path (scrapes, health checks, model polls), pooled apart

May import: router.metrics, router.fleet and the vocabulary (config, errors, log).
"""

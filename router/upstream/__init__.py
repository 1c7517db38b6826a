"""Upstream: one exchange with a backend, on its own pooled keep-alive connections.

  proxy.py    the connection pool per backend, the request written as received, the
              answer relayed: JSON whole, SSE chunk by chunk as the backend framed it;
              upstream failures as router/errors.py classes (502, 504)
  chunked.py  chunked transfer coding, read by read, whole chunks passed on untouched
  retry.py    which failures may be retried on another backend, and how often

May import: router.metrics, router.fleet and the vocabulary (config, errors, log).
"""

"""Telemetry: what the backends say of themselves, feeding the policies.

  feed.py       the telemetry loops of one process: /metrics scraping, KV event
                subscriptions, and with several workers the collector's feed to them
  kv_events.py  one backend's vLLM KV event stream (ZMQ, replay) into the prefix index
  tokenize.py   exact token ids from a backend's /tokenize, for KV_AWARE

May import: router.metrics, router.fleet and the vocabulary.
"""

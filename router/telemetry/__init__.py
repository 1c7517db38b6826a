"""Telemetry: what the backends say of themselves, feeding the policies.

  loops.py           `Telemetry`: the loops of one process, in one form per role:
                     `LocalTelemetry` (a router alone watches the backends itself)
  collector_feed.py  `CollectorTelemetry`: the collector watches them for several
                     workers and feeds them
  worker_feed.py     `WorkerTelemetry`: a worker of several follows that feed
  feed.py            the feed's sockets, topics and messages
  cluster.py         `ClusterLink`: the collector's link to the router's other replicas
                     through Redis (config `cluster`): placements and load shared
  cluster_wire.py    the messages replicas exchange there, and their cadence
  cluster_peers.py   `Peers`: what a replica heard of the others, handed to the workers
  scrape.py          /metrics scraping: the vLLM series routing reads
  index_upkeep.py    the prefix index's event sources following the fleet; aging, size
  kv_events.py       one backend's vLLM KV event stream (ZMQ, replay) into the index
  tokenize.py        exact token ids from a backend's /tokenize, for KV_AWARE

May import: router.metrics, router.fleet and the vocabulary.
"""

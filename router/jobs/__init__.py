"""Async jobs and batches: requests accepted now and run later through the same
routing, on spare capacity only, from a store that survives a restart.

  store.py    what a store keeps (jobs, files, batches) and does (`JobStore`): leases,
              attempts, results, TTLs
  sqlite_store.py
              the SQLite database (WAL) every worker on one host shares
  redis_store.py
              one Redis server several router replicas share (Lua scripts for the
              steps that must be atomic)
  stores.py   the store the config names
  faults.py   the store's failures: 503s that say why, counted, logged (throttled),
              shown in /ready's body
  runner.py   each worker's loop: claim a job while there is spare capacity, run it
              through the dispatcher, record its answer, end its batch if it was last
  wire.py     OpenAI's shapes: batch input lines checked, output files written, the
              file, batch and async job objects

May import: router.dispatch and everything below it. ingress/jobs_routes.py serves it.
"""

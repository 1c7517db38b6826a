"""Async jobs and batches: requests accepted now and run later through the same
routing, on spare capacity only, from a store that survives a restart.

  store.py    what a store keeps (jobs, files, batches) and does (`JobStore`): leases,
              attempts, results, TTLs
  logic.py    what both stores do alike, once (`JobsLogic`, `FilesLogic`,
              `BatchesLogic`): the clock, the records, the tenant's rule, a file read
              in pieces, a batch's end in its order; each store gives only the
              storage's calls
  sqlite_store.py
              the jobs, files and batches in SQL (`SqliteJobStore`: one part per half)
  sqlite_db.py
              the SQLite database (WAL) every worker on one host shares: connections,
              schema, transactions, the full disk's reserve
  redis_store.py
              the jobs, files and batches in Redis keys (`RedisJobStore`), for several
              router replicas
  redis_db.py the Redis server they share: connection, keys, scripts, its failures
  redis_scripts.py
              the Lua scripts, one per step that must be atomic
  stores.py   the store the config names
  faults.py   the store's failures: 503s that say why, counted, logged (throttled),
              shown in /ready's body
  runner.py   each worker's loops: claim a job while there is spare capacity, sweep,
              deliver the webhooks due
  execute.py  one claimed job run: through the dispatcher, refusals retried, its lease
              renewed, its answer recorded, its batch ended if it was last
  wire.py     OpenAI's shapes: batch input lines checked, output files written, the
              file, batch and async job objects

May import: router.dispatch and everything below it. ingress/jobs_routes.py (with
files_routes.py and batches_routes.py) serves it.
"""

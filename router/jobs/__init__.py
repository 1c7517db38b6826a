"""Async jobs and batches: requests accepted now and run later through the same
routing, on spare capacity only, from a store that survives a restart.

  store.py    the SQLite database (WAL) every worker on the host shares: jobs and their
              leases and results, batch files, batches
  runner.py   each worker's loop: claim a job while there is spare capacity, run it
              through the dispatcher, record its answer, end its batch if it was last
  wire.py     OpenAI's shapes: batch input lines checked, output files written, the
              file, batch and async job objects

May import: router.dispatch and everything below it. ingress/jobs_routes.py serves it.
"""

"""Async jobs: requests accepted now (202) and run later through the same routing, at
a lower priority than interactive traffic, from a store that survives a restart.

  store.py    the SQLite database (WAL) every worker shares: jobs, leases, results
  runner.py   each worker's loop: claim a job when there is spare capacity, run it
              through the dispatcher, record its answer

May import: router.dispatch and everything below it.
"""

"""The harness: `kvroute bench`, `kvroute demo` and `kvroute recommend`, and what they share.

  compare.py     `kvroute bench`: one workload against each strategy (and peer router),
                 each on a fresh simulated fleet, one table
  demo.py        `kvroute demo`: `kvroute bench` with fixed arguments
  recommend.py   `kvroute recommend`: a strategy and its parameters from a capture
  traffic.py     what recommend measures in traffic: shared prefixes, concurrency, the
                 fleet's prefill rate
  replay.py      the simulator's engines driven in virtual time by policy objects
                 (`python -m bench.harness.replay`), what recommend ranks with
  workloads.py   the seeded workloads (shapes, arrivals)
  loadgen.py     a workload replayed over HTTP, one outcome per request
  knee.py        `kvroute bench --knee`: a rate ramp to each router's capacity
  report.py      summaries, tables, the JSON and the chart
  routed.py      a workload replayed through kvroute in front of a simulated fleet, for
                 the studies that need no strategy comparison
  processes.py   child processes (simulator, routers, Redis): started, awaited, stopped
  peers.py       the peer routers (sglang-router, vllm-router), installed on first use
  scrape.py      /metrics and JSON status pages, read and compared
  procstat.py    a process tree's CPU time and memory, from /proc

May import the simulator (bench.sim), router/, policies/ and hashing/; never the studies
or the micro-benchmarks, which build on it.
"""

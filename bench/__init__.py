"""What kvroute is measured with: the commands behind `kvroute bench`, `demo`, `recommend`
and `sim`, the studies behind docs/performance.md, and the micro-benchmarks.

Each folder says in its own docstring what lives there and what it may import. Imports
run one way, down this list (studies/ and micro/ not into each other), and never in a
circle (`lint-imports`, pyproject.toml):

  studies/   one script per docs/performance.md section (`python -m bench.studies.X`
             reproduces its figures), and the instant backend, SSE client and bare pipe
             they measure with
  micro/     pytest-benchmark micro-benchmarks of the hot paths (`pytest bench/micro
             --benchmark-enable`) and the locust file
  harness/   `kvroute bench`, `kvroute demo` and `kvroute recommend`, and what they
             share: workloads, load generation, child processes, reports, the
             virtual-time replay
  sim/       `kvroute sim`: simulated vLLM servers; nothing of the router

bench/ may import router/, policies/ and hashing/ (the simulator: hashing/ only); none of
them imports bench/: the `kvroute` command loads its bench tools by module name
(router/__main__.py).
"""

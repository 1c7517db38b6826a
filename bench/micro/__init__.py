"""The micro-benchmarks: pytest-benchmark tests of the hot paths, and the locust file.

  test_bench_*.py   fingerprinting, routing decisions, placements, the index's memory
                    and the relay, in-process (`pytest bench/micro --benchmark-enable`;
                    the project's `pytest` runs tests/ only)
  locustfile.py     `kvroute bench`'s workloads for locust (`pip install -e '.[bench]'`)

May import the harness (bench.harness), router/, policies/ and hashing/; never the
studies. Nothing imports them.
"""

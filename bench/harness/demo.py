"""`kvroute demo`: what cache-aware routing buys, in about a minute, from `pip install -e .`.

It is `kvroute bench` with fixed arguments: 4 simulated vLLM servers (Llama-70B-class cost
model, 4x faster than real time), the long-prefix workload (16 documents of 8,000 tokens,
6 questions of ~100 tokens on each, Poisson arrivals at 3.5 requests per simulated
second, which keeps RANDOM's fleet busy but not saturated), and RANDOM,
LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE and KV_AWARE (the default), each on a fresh,
cold fleet with a router in front, started as `kvroute serve` starts it. It prints the
table, a plain-language reading, and stops everything it started.

Why the numbers differ: with 6 requests per document spread at random over 4 backends,
each document is prefilled on about 4 * (1 - (3/4)**6) = 3.3 backends, so about 45% of
prompt tokens hit the cache; pinned to one backend, 5 of 6 requests hit (82% of the
tokens: questions are never cached). An uncached 8,000-token prompt costs about 0.8 s of
prefill before its first token, a cached one a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from bench.harness import compare as harness

__all__ = ["main"]

_REQUESTS_PER_GROUP = 6


def demo_argv(backends: int, groups: int, time_scale: float) -> list[str]:
    """The `kvroute bench` arguments of the demo."""
    rate = 3.5 * backends / 4  # the same load per backend for any fleet size
    return [
        f"--strategies={','.join(harness.DEFAULT_STRATEGIES)}",
        "--workload=long-prefix",
        f"--backends={backends}",
        f"--groups={groups}",
        f"--requests={groups * _REQUESTS_PER_GROUP}",
        f"--rate={rate:g}",
        "--max-tokens=50",
        f"--time-scale={time_scale:g}",
        "--max-wall=120",
    ]


#: what to try once the demo has shown the difference
_NEXT = """
Next:
  kvroute sim --instances 2 --base-port 8100  two simulated vLLM servers, in one terminal
  kvroute serve --backend http://127.0.0.1:8100 --backend http://127.0.0.1:8101
                                              the router in front of them, in another
  kvroute bench --workload multi-turn --peers the same comparison, another workload, beside
                                              sglang-router and vllm-router
  kvroute policies                            the strategies, and when to pick each"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvroute demo",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--backends", type=int, default=4, metavar="N", help="simulated vLLM servers"
    )
    parser.add_argument("--groups", type=int, default=16, metavar="N", help="8k-token documents")
    parser.add_argument(
        "--time-scale", type=float, default=0.25, metavar="X", help="simulated time x this"
    )
    args = parser.parse_args(argv)
    bench_argv = demo_argv(args.backends, args.groups, args.time_scale)
    print(f"kvroute demo: kvroute bench {' '.join(bench_argv)}", flush=True)
    started = time.monotonic()
    code = harness.main(bench_argv)
    if code == 0:
        print(
            "Why: a cached 8,000-token prefix saves ~0.8 s of prefill; PREFIX_AWARE and KV_AWARE "
            "send each document to one backend, the others spread it over several; KV_AWARE "
            "also sends a new document where no other prefill is queued. "
            f"({time.monotonic() - started:.0f} s)"
        )
        print(_NEXT)
    return code


if __name__ == "__main__":
    sys.exit(main())

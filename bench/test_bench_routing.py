"""Micro-benchmark of the whole routing decision for an 8,000-token chat request.

Run: .venv/bin/pytest bench/test_bench_routing.py --benchmark-enable
`route` = decode the routing fields of the raw body (msgspec) + canonical text +
fingerprint + PREFIX_AWARE pick over 16 backends + the decision metrics. The baseline in
the same group is `orjson.loads` of the same body, the full parse a naive router does
before it even starts to decide, so the result reads as a ratio to it.
Goal: fingerprint + pick median under 50 µs with the approximate tokenizer.
"""

import orjson
import pytest
from multidict import CIMultiDict

from router.config import build
from router.control.worker import Router
from router.dispatch.dispatcher import Call, Dispatcher
from router.request import Kind, parse

SENTENCE = "Route each prompt to the backend that already holds its prefix in KV cache. "
BODY = orjson.dumps(
    {
        "model": "llama-3.1-70b",
        "stream": True,
        "messages": [
            {"role": "system", "content": (SENTENCE * 300)[:20_000]},
            *(
                {"role": "user" if i % 2 == 0 else "assistant", "content": (SENTENCE * 27)[:2000]}
                for i in range(6)
            ),
        ],
    }
)


@pytest.fixture(scope="module")
def dispatcher() -> Dispatcher:
    config = build(
        {
            "backends": [{"url": f"http://127.0.0.1:{9000 + i}"} for i in range(16)],
            "routing": {"strategy": "PREFIX_AWARE", "prefix_length": 256},
        }
    )
    router = Router(config)
    return Dispatcher(config, router.fleet, router.metrics, session=None)


def test_body_is_about_8000_tokens() -> None:
    assert 30_000 < len(BODY) < 34_000


def test_baseline_full_json_parse(benchmark) -> None:
    benchmark.group = "route-8000-token-chat"
    benchmark(orjson.loads, BODY)


def test_route(benchmark, dispatcher: Dispatcher) -> None:
    benchmark.group = "route-8000-token-chat"

    def route() -> str:
        call = Call(Kind.CHAT, parse(Kind.CHAT, BODY), "POST", "/", BODY, CIMultiDict(), 0.0, 0.0)
        return dispatcher.route(call).backend.name

    assert benchmark(route) == route()  # deterministic

"""Locust users that replay the benchmark's seeded workloads (bench/harness/workloads.py).

    pip install -e '.[bench]'
    locust -f bench/micro/locustfile.py --host http://127.0.0.1:8000 --headless \\
        --users 16 --spawn-rate 4 --workload long-prefix --requests 300 --groups 50

Closed loop: every user sends the next request of one shared workload as a streaming chat
completion as soon as its previous one ended, so --users is the concurrency (arrival
offsets are not used; `kvroute bench --rate` does open-loop Poisson runs). A multi-turn
turn waits for the previous turn of its conversation. Each request reports three entries:
"POST /v1/chat/completions" (locust's own timer, which stops at the response headers),
"TTFT" (first content token) and "E2E" (`[DONE]`). A non-200 status, an SSE error event
or a stream without `[DONE]` is a failure. When the workload is used up the run stops.

Locust is an optional extra; without it this file fails at import with that advice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

try:
    import gevent
    import gevent.event
    import requests
    from locust import HttpUser, events, task
    from locust.env import Environment
    from locust.exception import StopUser
except ImportError as exc:
    raise ImportError(
        "bench/micro/locustfile.py needs locust, an optional extra: pip install -e '.[bench]'"
    ) from exc
import orjson

from bench.harness.loadgen import chat_body, has_content, request_headers
from bench.harness.workloads import SHAPES, RequestSpec, WorkloadSpec, generate

_DATA = b"data: "


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("kvroute workload (bench/harness/workloads.py)")
    group.add_argument("--workload", choices=sorted(SHAPES), default="long-prefix")
    group.add_argument("--requests", type=int, default=300, help="requests in the workload")
    group.add_argument("--groups", type=int, default=50, help="prefix groups / conversations")
    group.add_argument("--prefix-tokens", type=int, default=0, help="0: the shape's default")
    group.add_argument("--question-tokens", type=int, default=100)
    group.add_argument("--max-tokens", type=int, default=100, help="output tokens")
    group.add_argument("--zipf-s", type=float, default=1.1, help="hot-prefix Zipf exponent")
    group.add_argument(
        "--system-prompt",
        choices=["shared", "per-conversation"],
        default="shared",
        help="multi-turn: one system prompt for every conversation, or one each",
    )
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--model", default="", help="default: the host's first model")


class _Workload:
    """The shared request stream and the turn-ordering events of one locust run."""

    def __init__(self, specs: list[RequestSpec], model: str) -> None:
        self.model = model
        self.users = 0  # running users; the last one to run out ends the run
        self._pending: Iterator[RequestSpec] = iter(specs)
        self._done = {(s.group, s.turn): gevent.event.Event() for s in specs}

    def next(self) -> RequestSpec | None:
        return next(self._pending, None)

    def wait_turn(self, spec: RequestSpec) -> None:
        if spec.turn:
            self._done[(spec.group, spec.turn - 1)].wait()

    def finished(self, spec: RequestSpec) -> None:
        self._done[(spec.group, spec.turn)].set()


_workload: _Workload | None = None


@events.test_start.add_listener
def _load_workload(environment: Environment, **_: object) -> None:
    global _workload
    o = environment.parsed_options
    spec = WorkloadSpec(
        shape=o.workload,
        requests=o.requests,
        groups=o.groups,
        prefix_tokens=o.prefix_tokens or None,
        question_tokens=o.question_tokens,
        max_tokens=o.max_tokens,
        zipf_s=o.zipf_s,
        system_prompt=o.system_prompt,
        seed=o.seed,
    )
    _workload = _Workload(generate(spec), o.model or _first_model(environment.host or ""))


def _first_model(host: str) -> str:
    data = requests.get(host.rstrip("/") + "/v1/models", timeout=10).json().get("data") or []
    if not data:
        raise RuntimeError(f"{host}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


class ChatUser(HttpUser):
    """Sends the workload's requests one after another, streaming, timing TTFT and E2E."""

    def on_start(self) -> None:
        assert _workload is not None, "test_start builds the workload before users start"
        _workload.users += 1

    @task
    def chat(self) -> None:
        spec = _workload.next()
        if spec is None:
            _workload.users -= 1
            if _workload.users == 0:  # quit from outside this greenlet, which it kills
                gevent.spawn(self.environment.runner.quit)
            raise StopUser
        _workload.wait_turn(spec)
        try:
            self._send(spec)
        finally:
            _workload.finished(spec)

    def _send(self, spec: RequestSpec) -> None:
        body = orjson.dumps(chat_body(spec, _workload.model))
        headers = request_headers(spec)
        t0 = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions", data=body, headers=headers, stream=True, catch_response=True
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            error = self._read(resp, t0)
            if error:
                resp.failure(error)

    def _read(self, resp, t0: float) -> str | None:
        """Report TTFT and E2E from the SSE body; the failure reason, or None."""
        first = True
        for line in resp.iter_lines():
            if not line.startswith(_DATA):
                continue
            payload = line[len(_DATA) :].strip()
            if payload == b"[DONE]":
                self._report("E2E", t0)
                return None
            event = orjson.loads(payload)
            if "error" in event:
                return f"stream error: {event['error']}"
            if first and has_content(event):
                self._report("TTFT", t0)
                first = False
        return "stream ended without [DONE]"

    def _report(self, name: str, t0: float) -> None:
        self.environment.events.request.fire(
            request_type="SSE",
            name=name,
            response_time=(time.perf_counter() - t0) * 1e3,
            response_length=0,
            exception=None,
            context={},
        )

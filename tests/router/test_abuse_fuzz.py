"""Fuzzing the HTTP ingress with hypothesis: any body, any headers, never a 5xx, never a crash.

A stub backend and a router run on their own uvloop thread; each example is sent as raw
bytes over a fresh socket (so malformed framing, invalid UTF-8 and huge fields reach
the server untouched), and the first status line is read. Accepted: a 2xx (the request
was valid and served) or a 4xx. Refused: a 5xx, no answer (the server dropped or hung),
or a router that stops answering /health afterwards. Every request is counted in the
suite's tally.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import build
from router.control.worker import Router
from tests.router.chaos import MODEL, TALLY
from tests.stub_backend import StubBackend

MAX_BODY = 64 * 1024
# the router's own random choices (e.g. RANDOM routing) run on its thread, not in a strategy
pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/v1/responses"]
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout: float = 15):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    stub = run(StubBackend().start())
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": stub.url, "name": "b0"}],
        "limits": {"max_body_bytes": MAX_BODY, "body_timeout": 0.3, "header_timeout": 1},
        "health": {"enabled": False},
    }

    async def up() -> Router:
        router = Router(build(config))
        await router.start()
        return router

    router = run(up())
    try:
        yield router.port
    finally:
        run(router.stop())
        run(stub.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _status(port: int, raw: bytes) -> int | None:
    """Send `raw`, return the status of the first answer (None: closed without one)."""
    TALLY.add("sent")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(raw)
            data = b""
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            TALLY.add("hung")
            raise
        except ConnectionResetError:
            data = b""
    if not data.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")):
        return None
    return int(data.split()[1])


def _check(port: int, raw: bytes) -> None:
    status = _status(port, raw)
    if status is None or status >= 500:
        TALLY.add("failed")
    assert status is not None and status < 500, (status, raw[:300])
    assert _status(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") == 200


def _request(path: str, body: bytes, headers: bytes = b"") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: kvroute\r\nContent-Type: application/json\r\n"
    return head.encode() + headers + b"Content-Length: %d\r\n\r\n" % len(body) + body


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=50)
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=30,
)
_shaped = st.fixed_dictionaries(
    {},
    optional={
        "model": _json | st.just(MODEL),
        "messages": _json
        | st.lists(
            st.fixed_dictionaries({"role": _json | st.just("user"), "content": _json}), max_size=3
        ),
        "prompt": _json,
        "input": _json,
        "stream": _json,
        "tools": _json,
        "cache_salt": _json,
    },
)


def _dumps(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()  # NaN/Infinity: not valid JSON


_nested = st.integers(min_value=1, max_value=200_000).map(
    lambda n: (
        b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "x": %s%s}'
        % (MODEL.encode(), b"[" * n, b"]" * n)
    )
)
_invalid_utf8 = st.binary(min_size=1, max_size=8).map(
    lambda junk: (
        b'{"model": "%s", "messages": [{"role": "user", "content": "a\xff%s"}]}'
        % (MODEL.encode(), junk)
    )
)
_huge = st.integers(min_value=MAX_BODY - 200, max_value=MAX_BODY + 200).map(
    lambda n: (
        b'{"model": "%s", "messages": [{"role": "user", "content": "%s"}]}'
        % (MODEL.encode(), b"y" * n)
    )
)
_bodies = (
    st.binary(max_size=2000)
    | _json.map(_dumps)
    | _shaped.map(_dumps)
    | _nested
    | _invalid_utf8
    | _huge
)


@FUZZ
@given(path=st.sampled_from(PATHS), body=_bodies)
def test_any_body_is_answered_below_500(port: int, path: str, body: bytes) -> None:
    _check(port, _request(path, body))


_token = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"),
    min_size=1,
    max_size=30,
)
_header_value = st.binary(max_size=200).filter(lambda b: b"\r" not in b and b"\n" not in b)
_header = st.tuples(_token.map(str.encode), _header_value)
_special = st.sampled_from(
    [
        b"Content-Length: -1",
        b"Content-Length: abc",
        b"Content-Length: 99999999999999999999999",
        b"Transfer-Encoding: gzip",
        b"Transfer-Encoding: chunked",
        b"Content-Encoding: gzip",
        b"Authorization: Bearer \xff\xfe",
        b"X-Request-Id: \xff" + b"r" * 3000,
        b"Expect: 100-continue",
        b"Connection: upgrade",
        b"Upgrade: websocket",
        b"Host: \x00",
    ]
)


@FUZZ
@given(
    path=st.sampled_from(PATHS),
    headers=st.lists(_header, max_size=12),
    special=st.lists(_special, max_size=2),
)
def test_any_headers_are_answered_below_500(port, path, headers, special) -> None:
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode()
    lines = [name + b": " + value for name, value in headers] + special
    _check(port, _request(path, body, b"".join(line + b"\r\n" for line in lines)))

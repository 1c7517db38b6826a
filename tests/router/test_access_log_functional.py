"""The access log, as an operator reads it: one line per request (text or JSON) for a
success, a streamed answer, the client's mistakes, the router's own 5xx, a retry and a
client that left; each naming the request id its client and its backend saw. The
failures also get a (throttled) warning naming the request and the backend."""

from __future__ import annotations

import json
import logging
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import openai
import pytest

from router.access_log import Entry, json_lines, text_lines
from router.config import build
from router.control.worker import Router
from tests.router.conftest import running, settle, until_tried_on
from tests.stub_backend import Behaviour, StubBackend

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
_LOGFMT = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def _text_fields(line: str) -> dict[str, object]:
    """A logfmt line back into fields (quoted values are JSON strings, "-" is None)."""
    fields: dict[str, object] = {}
    for key, value in _LOGFMT.findall(line):
        fields[key] = None if value == "-" else json.loads(value) if value[0] == '"' else value
    return fields


def _lines(path: Path, fmt: str) -> list[dict[str, object]]:
    text = path.read_text()
    assert text.endswith("\n")
    if fmt == "json":
        return [json.loads(line) for line in text.splitlines()]
    return [_text_fields(line) for line in text.splitlines()]


def _num(value: object) -> float:
    return float(value)  # text lines hold numbers as text


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_success_stream_and_client_mistakes_each_get_a_line(tmp_path, fmt) -> None:
    path = tmp_path / "access.log"
    config = {"access_log": {"path": str(path)}, "log_format": fmt}
    async with running(1, **config) as (router, _):
        async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none") as client:
            raw = await client.chat.completions.with_raw_response.create(**CHAT)
            rid = raw.headers["x-request-id"]
            stream = await client.chat.completions.create(
                **CHAT, stream=True, stream_options={"include_usage": True}
            )
            async for _ in stream:
                pass
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(**{**CHAT, "model": "no-such-model"})
        async with aiohttp.ClientSession() as http:
            sent = {"X-Request-Id": "my-trace-42", "Content-Type": "application/json"}
            url = router.url + "/v1/chat/completions"
            async with http.post(url, data=b"{not json", headers=sent) as resp:
                assert resp.status == 400
        page = router.metrics.render().decode()
    for kind, count in (("prompt", 10), ("completion", 6)):  # two answers reported usage
        labels = f'kind="{kind}",model="stub-model",pool="(none)",tenant="(none)"'
        assert f"kvroute_tokens_total{{{labels}}} {count}.0" in page
    assert (
        'kvroute_tokens_total{kind="cached",model="stub-model",pool="(none)",tenant="(none)"} 0.0'
        in page
    )
    whole, streamed, unknown, malformed = _lines(path, fmt)
    assert whole["request_id"] == rid and len(rid) == 32
    assert whole["method"] == "POST" and whole["path"] == "/v1/chat/completions"
    assert _num(whole["status"]) == 200 and whole["backend"] == "b0"
    assert whole["model"] == "stub-model" and whole["strategy"] == "RANDOM"
    assert whole["reason"] and _num(whole["retries"]) == 0 and whole["error"] is None
    assert _num(whole["prompt_tokens"]) == 5 and _num(whole["completion_tokens"]) == 3
    assert whole["cached_tokens"] is None  # the stub does not report it
    assert whole["ttft_ms"] is None and _num(whole["duration_ms"]) > 0  # not streamed
    assert _num(streamed["status"]) == 200 and _num(streamed["completion_tokens"]) == 3
    assert _num(streamed["duration_ms"]) >= _num(streamed["ttft_ms"]) > 0
    assert _num(unknown["status"]) == 404 and unknown["error"] == "ModelNotFound"
    assert unknown["backend"] is None and unknown["model"] == "no-such-model"
    assert _num(malformed["status"]) == 400 and malformed["error"] == "BadRequest"
    assert malformed["request_id"] == "my-trace-42"  # the client's id is kept
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", str(whole["time"]))


@asynccontextmanager
async def _router(path: Path, *urls: str, **config) -> AsyncIterator[Router]:
    """A router in front of `urls` (named b0, b1, ...) writing its access log to `path`."""
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": url, "name": f"b{i}"} for i, url in enumerate(urls)],
        "routing": {"strategy": "RANDOM"},
        "access_log": {"path": str(path)},
        **config,
    }
    router = Router(build(data))
    await router.start()
    try:
        yield router
    finally:
        await router.stop()


async def _chat(http: aiohttp.ClientSession, router: Router) -> tuple[int, str]:
    async with http.post(router.url + "/v1/chat/completions", json=CHAT) as resp:
        await resp.read()
        return resp.status, resp.headers["X-Request-Id"]


async def test_a_retry_is_a_line_with_its_count_and_a_warning(tmp_path, caplog) -> None:
    path = tmp_path / "access.log"
    failing = await StubBackend(behaviour=Behaviour(status=503)).start()
    good = await StubBackend().start()
    caplog.set_level(logging.WARNING, logger="kvroute.requests")
    try:
        async with _router(path, failing.url, good.url) as router, aiohttp.ClientSession() as http:
            answers = await until_tried_on(failing, lambda: _chat(http, router))
    finally:
        await failing.stop()
        await good.stop()
    assert all(status == 200 for status, _ in answers)
    retried = [line for line in _lines(path, "text") if line["retries"] == "1"]
    assert len(retried) == 1
    (line,) = retried
    assert line["backend"] == "b1" and line["status"] == "200" and line["error"] is None
    rid = line["request_id"]
    assert rid == answers[-1][1]
    said = [r.getMessage() for r in caplog.records if r.name == "kvroute.requests"]
    assert f"request {rid}: retrying elsewhere, backend b0 failed: it answered 503" in said


async def test_the_routers_own_5xx_name_cause_and_backend(tmp_path, caplog) -> None:
    path = tmp_path / "access.log"
    hanging = await StubBackend(behaviour=Behaviour(hang_before_headers=True)).start()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    caplog.set_level(logging.WARNING, logger="kvroute.requests")
    try:
        async with aiohttp.ClientSession() as http:
            timeouts = {"first_byte": 0.3}
            async with _router(path, hanging.url, timeouts=timeouts) as router:
                timed_out = await _chat(http, router)
            async with _router(path, dead) as router:
                no_backend = await _chat(http, router)
    finally:
        await hanging.stop()
    assert timed_out[0] == 504 and no_backend[0] == 503
    first, second = _lines(path, "text")
    assert first["request_id"] == timed_out[1] and first["status"] == "504"
    assert first["backend"] == "b0" and first["error"] == "UpstreamTimeout"
    assert second["request_id"] == no_backend[1] and second["status"] == "503"
    assert second["backend"] is None and second["error"] == "NoBackendAvailable"
    said = [r.getMessage() for r in caplog.records if r.name == "kvroute.requests"]
    assert any(m.startswith(f"request {timed_out[1]}: 504 timeout from backend b0:") for m in said)
    assert any(m.startswith(f"request {no_backend[1]}: 503 No backend") for m in said)
    assert not any(r.exc_info for r in caplog.records)  # expected failures: no traceback


async def test_a_client_that_leaves_mid_stream_is_a_499_line(tmp_path) -> None:
    path = tmp_path / "access.log"
    stub = await StubBackend(behaviour=Behaviour(chunks=5, hang_after_chunks=1)).start()
    try:
        async with _router(path, stub.url) as router:
            async with aiohttp.ClientSession() as http:
                body = {**CHAT, "stream": True}
                async with http.post(router.url + "/v1/chat/completions", json=body) as resp:
                    rid = resp.headers["X-Request-Id"]
                    await resp.content.readuntil(b"\n\n")  # the first event came
            await settle(router)  # the router saw the client go
    finally:
        await stub.stop()
    (line,) = _lines(path, "text")
    assert line["request_id"] == rid and line["status"] == "499"
    assert line["error"] == "ClientDisconnected" and line["backend"] == "b0"
    assert line["ttft_ms"] is not None


async def test_a_stream_the_backend_breaks_is_the_200_its_client_got_with_the_error(
    tmp_path,
) -> None:
    """The client got a 200 and events, then an error event: the line says 200 and the
    failure; the metrics count it as the backend's 502."""
    path = tmp_path / "access.log"
    stub = await StubBackend(behaviour=Behaviour(chunks=5, cut_after_chunks=2)).start()
    try:
        async with _router(path, stub.url) as router, aiohttp.ClientSession() as http:
            body = {**CHAT, "stream": True}
            async with http.post(router.url + "/v1/chat/completions", json=body) as resp:
                got, text = resp.status, await resp.text()
            page = router.metrics.render().decode()
    finally:
        await stub.stop()
    assert got == 200 and '"code":502' in text and text.endswith("data: [DONE]\n\n")
    (line,) = _lines(path, "text")
    assert line["status"] == "200" and line["error"] == "UpstreamDisconnected"
    assert line["backend"] == "b0" and line["ttft_ms"] is not None
    labels = 'backend="b0",endpoint="chat",model="stub-model",status="502",strategy="RANDOM"'
    assert f"kvroute_requests_total{{{labels}}} 1.0" in page


def test_a_clients_strings_cannot_forge_fields_or_lines() -> None:
    evil = 'm" status=200\nfake=1'
    entry = Entry(
        1e9,
        0.5,
        None,
        "rid",
        None,
        "POST",
        "/v1/x",
        evil,
        "RANDOM",
        "",
        "",
        "",
        "400",
        0,
        None,
        None,
        None,
        "BadRequest",
    )
    (line,) = text_lines([entry]).decode().splitlines()
    fields = _text_fields(line)
    assert fields["model"] == evil and fields["status"] == "400" and "fake" not in fields


async def test_an_oversized_body_is_a_413_line_with_or_without_expect(tmp_path) -> None:
    path = tmp_path / "access.log"
    stub = await StubBackend().start()
    big = b'{"model": "stub-model", "prompt": "' + b"x" * 4096 + b'"}'
    try:
        async with _router(path, stub.url, limits={"max_body_bytes": 1024}) as router:
            async with aiohttp.ClientSession() as http:
                url = router.url + "/v1/completions"
                for expect in (False, True):
                    async with http.post(url, data=big, expect100=expect) as resp:
                        assert resp.status == 413
    finally:
        await stub.stop()
    lines = _lines(path, "text")
    assert [line["status"] for line in lines] == ["413", "413"]
    assert {line["error"] for line in lines} == {"PayloadTooLarge"}
    assert not stub.received


@pytest.mark.parametrize("known", [True, False])
def test_a_text_line_has_the_json_lines_fields_in_their_order_and_values(known: bool) -> None:
    """The text line is written field by field apart from the JSON line's dict: both
    must name the same fields, in one order, with the same values."""
    if known:
        entry = Entry(1e9, 0.25, 0.0123456, "rid 1", "acme", "POST", "/v1/chat/completions",
                      'm "q"', "KV_AWARE", "b0", "kv_hit", "p0", "200", 1, 120, 64, 7,
                      "", "interactive", 0.002)  # fmt: skip
    else:
        entry = Entry(1e9, 0.5, None, "rid", None, "GET", "/v1/models", "", "RANDOM", "",
                      "", "", "503", 0, None, None, None, "NoBackend")  # fmt: skip
    (line,) = text_lines([entry]).decode().splitlines()
    text = _text_fields(line)
    whole = json.loads(json_lines([entry]))
    assert list(text) == list(whole)
    assert text == {k: None if v is None else v if isinstance(v, str) else str(v)
                    for k, v in whole.items()}  # fmt: skip

"""What the access log's text lines cost the worker's loop: its flush formats each
request's line there (64 a loop turn, router/access_log.py).

Run: .venv/bin/pytest bench/micro/test_bench_access_log.py --benchmark-enable

A batch of 64 entries as a busy worker logs them (a request id, a model, a backend, a
reason, token counts, a TTFT). The baseline formats them as the router did until
2026-12: the JSON lines' field dict per entry, every value through one generic
quoting function; `text_lines` writes each line in one f-string and checks only the
strings for quoting. The JSON lines are shown beside them. Compare the ratios, not the
times.
"""

from __future__ import annotations

import re

import orjson
import pytest

from router.access_log import Entry, _Clock, _fields, json_lines, text_lines

_BARE = re.compile(r"[!#-<>-~]+")


@pytest.fixture(scope="module")
def entries() -> list[Entry]:
    return [
        Entry(
            1_796_600_000.0 + i / 64,
            2.5 + i / 100,
            0.08 + i / 1000,
            f"req-{i:08x}",
            None,
            "POST",
            "/v1/chat/completions",
            "meta-llama/Llama-3.1-70B-Instruct",
            "KV_AWARE",
            f"vllm-{i % 8}",
            "kv_hit",
            "",
            "200",
            0,
            8120 + i,
            8000,
            100,
            "",
            "interactive",
            0.0,
        )
        for i in range(64)
    ]


def _generic(entries: list[Entry]) -> bytes:
    clock = _Clock()
    lines = [" ".join(f"{k}={_quoted(v)}" for k, v in _fields(e, clock).items()) for e in entries]
    return ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")


def _quoted(value: object) -> str:
    if value is None or value == "":
        return "-"
    text = str(value)
    return text if _BARE.fullmatch(text) else orjson.dumps(text).decode()


def test_baseline_generic_text(benchmark, entries: list[Entry]) -> None:
    assert benchmark(_generic, entries) == text_lines(entries)


def test_text_lines(benchmark, entries: list[Entry]) -> None:
    assert benchmark(text_lines, entries).count(b"\n") == 64


def test_json_lines(benchmark, entries: list[Entry]) -> None:
    assert benchmark(json_lines, entries).count(b"\n") == 64

"""The capture's writer on its own: the bounded queue and its drops, rotation, gzip, the
record's lines, a stream reassembled."""

from __future__ import annotations

import gzip
import os
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from router.access_log import Entry
from router.capture import Capture, Captured, Sampler, line, stream
from router.config import CaptureConfig, ConfigError
from router.upstream.clock import Framed
from router.upstream.proxy import unframed
from tests import tmpfs

CHAT_STREAM = (
    b"".join(
        b"data: " + orjson.dumps(e) + b"\n\n"
        for e in (
            {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
            {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
            {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
        )
    )
    + b"data: [DONE]\n\n"
)


def record(i: int = 0, streamed: bool = False) -> Captured:
    body = CHAT_STREAM if streamed else orjson.dumps({"choices": [{"text": "x" * 100}]})
    entry = Entry(
        1.0e9, 0.5, 0.1, f"id{i}", "acme", "POST", "/v1/completions", "m", "KV_AWARE",
        "b0", "kv_hit", "", "200", 0, 9, 4, 2, "",
    )  # fmt: skip
    request = orjson.dumps({"prompt": f"question {i}"})
    return Captured(entry, "fast", (("x-team", "search"),), request, body, streamed)


class Counted:
    def __init__(self) -> None:
        self.dropped: list[str] = []
        self.written = 0

    def drop(self, why: str) -> None:
        self.dropped.append(why)

    def write(self) -> None:
        self.written += 1


def lines(path: Path) -> list[dict]:
    out = []
    for f in sorted(path.iterdir(), key=lambda p: int(p.name.split("-")[-1].split(".")[0])):
        data = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
        out.extend(orjson.loads(x) for x in data.splitlines())
    return out


def test_a_full_queue_drops_and_counts_and_never_blocks(tmp_path) -> None:
    """The writer not started yet: two records fit, the third is dropped at once."""
    counted = Counted()
    capture = Capture(
        CaptureConfig(enabled=True, path=str(tmp_path), queue_records=2),
        counted.drop,
        counted.write,
    )
    for i in range(3):
        capture.add(record(i))
    assert counted.dropped == ["queue_full"]
    capture.start()
    capture.close()
    assert [r["request_id"] for r in lines(tmp_path)] == ["id0", "id1"]
    assert counted.written == 2


@pytest.mark.parametrize("gz", [False, True])
def test_files_rotate_by_size_with_whole_lines_and_optional_gzip(tmp_path, gz: bool) -> None:
    counted = Counted()
    cfg = CaptureConfig(enabled=True, path=str(tmp_path), max_bytes=4096, gzip=gz)
    capture = Capture(cfg, counted.drop, counted.write)
    capture.start()
    for i in range(40):  # ~600 bytes each: about 7 to a file
        capture.add(record(i))
    capture.close()
    files = list(tmp_path.iterdir())
    assert len(files) >= 5 and all(f.name.endswith(".jsonl.gz" if gz else ".jsonl") for f in files)
    assert [r["request_id"] for r in lines(tmp_path)] == [f"id{i}" for i in range(40)]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs to fill (mounting one needs root: skipped otherwise)."""
    with tmpfs.small_disk(tmp_path / "disk", "256k") as disk:
        yield disk


def noisy(i: int) -> Captured:
    """A record that compresses to about 1 KB: 900 of them fill the small disk."""
    entry = record(i).entry
    body = orjson.dumps({"prompt": f"question {i} " + os.urandom(1000).hex()})
    return Captured(entry, None, (), body, None, False)


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "plain"])
def test_a_full_disk_counts_its_losses_and_leaves_whole_lines(small_disk: Path, gz: bool) -> None:
    """Every record is counted once, written or dropped (write_error), and the file
    holds exactly the written ones, each whole: a batch that does not fit is taken
    back, so the next one starts a sound gzip member."""
    counted = Counted()
    cfg = CaptureConfig(enabled=True, path=str(small_disk), gzip=gz, queue_records=1000)
    capture = Capture(cfg, counted.drop, counted.write)
    capture.start()
    sent = 900
    for i in range(sent):
        capture.add(noisy(i))
        if i % 10 == 9:  # batches of about ten records, as steady traffic makes
            deadline = time.monotonic() + 10
            while counted.written + len(counted.dropped) < i + 1:
                assert time.monotonic() < deadline
                time.sleep(0.001)
    capture.close()
    assert counted.written + len(counted.dropped) == sent
    assert set(counted.dropped) == {"write_error"} and counted.written > 0
    ids = [r["request_id"] for r in lines(small_disk)]
    assert len(ids) == len(set(ids)) == counted.written


def test_files_rotate_by_age(tmp_path) -> None:
    now = [1000.0]
    cfg = CaptureConfig(enabled=True, path=str(tmp_path), rotate_seconds=60)
    capture = Capture(cfg, Counted().drop, Counted().write, clock=lambda: now[0])
    capture.start()
    capture.add(record(0))
    capture.close()  # the queue drained: the clock moves only between records
    capture = Capture(cfg, Counted().drop, Counted().write, clock=lambda: now[0])
    capture.start()
    capture.add(record(1))
    now[0] += 61
    capture.add(record(2))
    capture.close()
    assert len(list(tmp_path.iterdir())) >= 3
    assert sorted(r["request_id"] for r in lines(tmp_path)) == ["id0", "id1", "id2"]


def test_a_line_has_the_figures_the_request_and_the_answer() -> None:
    got = orjson.loads(line(record(7, streamed=True), request=True, response=True))
    assert got["v"] == 1 and got["status"] == 200 and got["pool"] == "fast"
    assert (got["ttft_ms"], got["duration_ms"]) == (100.0, 500.0)
    assert got["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "cached_tokens": 4}
    assert got["request"] == {"prompt": "question 7"} and got["headers"] == {"x-team": "search"}
    assert got["response"]["content"] == "Hello"
    bare = orjson.loads(line(record(7), request=False, response=False))
    assert "request" not in bare and "response" not in bare and "headers" not in bare


def test_a_stream_is_reassembled_from_its_events() -> None:
    assert stream(CHAT_STREAM) == {
        "stream": True,
        "events": 4,
        "content": "Hello",
        "finish_reason": "length",
        "usage": {"prompt_tokens": 9, "completion_tokens": 2},
    }
    completion = (
        b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        b'data: {"choices": [{"index": 1, "text": "b"}]}\n\n'
    )
    assert stream(completion)["content"] == "a"  # the first choice's text
    assert stream(b"data: not json\n\n")["events"] == 1


def test_a_body_that_is_not_json_is_kept_as_text() -> None:
    bad = record()._replace(response=b"<html>502</html>")
    bad = bad._replace(entry=bad.entry._replace(status="502"))
    got = orjson.loads(line(bad, request=True, response=True))
    assert got["response"] == {"text": "<html>502</html>"} and got["status"] == 502


def test_an_unwritable_path_is_a_config_error(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"capture\.path: cannot write"):
        Capture(CaptureConfig(enabled=True, path=str(blocker / "sub")), print, print)


def test_a_kept_stream_joins_decoded_reads_and_decodes_the_relays_framed_ones() -> None:
    events = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b'data: {"n": 3}\n\n']
    framed = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events[1:]) + b"0\r\n\r\n"
    assert unframed([events[0], Framed(framed)]) == b"".join(events)


FORCE = {"X-Kvroute-Capture": "1"}


@pytest.mark.parametrize(
    ("config", "tenant", "headers", "wanted"),
    [
        pytest.param({}, "acme", FORCE, False, id="header-ignored-by-default"),
        pytest.param({"force_tenants": ("ops",)}, "ops", FORCE, True, id="force-tenant"),
        pytest.param({"force_tenants": ("ops",)}, "acme", FORCE, False, id="other-tenant"),
        pytest.param({"force_tenants": ("ops",)}, None, FORCE, False, id="no-tenant"),
        pytest.param({"force_tenants": ("ops",)}, "ops", {}, False, id="force-tenant-no-header"),
        pytest.param({"force_header_anyone": True}, None, FORCE, True, id="anyone"),
        pytest.param({"tenants": ("acme",)}, "acme", {}, True, id="captured-tenant"),
    ],
)
def test_the_force_header_counts_only_from_whom_the_config_allows(
    config: dict, tenant: str | None, headers: dict[str, str], wanted: bool
) -> None:
    sampler = Sampler(CaptureConfig(enabled=True, **config))
    assert sampler.wants(tenant, headers) is wanted

"""bench.studies.compression end to end, tiny: a simulated stream's events replayed with
compression off, gzip and zstd, the memory of an open stream, and a real router
relaying a few streams for each coding."""

from __future__ import annotations

import gzip

from bench.studies import compression


def test_a_tiny_run_prints_every_row(capsys) -> None:
    compression.main(["--tokens=12", "--repeats=1", "--streams=4", "--rounds=1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "A chat stream of 14 SSE events, " + lines[0].rsplit(", ", 1)[1]
    rows = _table(lines, "stream  coding  CPU µs/event  x off  on the wire  of off")
    codings = ["off", "gzip", "zstd"]
    assert [row[:2] for row in rows] == [[s, c] for s in ("sim", "varied") for c in codings]
    for row in rows:  # compressed: fewer bytes on the wire than compression off
        assert (row[1] == "off") is (row[5] == "100.0%")
    sizes = _table(lines, "stream  coding  per event  defaults  whole")
    assert [row[:2] for row in sizes] == [[s, c] for s in ("sim", "varied") for c in codings[1:]]
    assert all(int(flushed) > int(whole) for *_, flushed, _, whole in sizes)
    memory = _table(lines, "coding  KiB per open stream  library defaults")
    assert [m[0] for m in memory] == ["gzip", "zstd"]
    assert all(0 < float(ours) < float(default) for _, ours, default in memory)
    relayed = _table(lines, "asked     router CPU µs/event  x identity")
    assert [row[0] for row in relayed] == ["identity", "gzip", "zstd"]  # too short for CPU


def _table(lines: list[str], header: str) -> list[list[str]]:
    """The rows under `header`, split, up to the next blank line."""
    start = lines.index(header) + 1
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return [line.split() for line in lines[start:end]]


def test_the_replayed_stream_is_what_a_client_decodes() -> None:
    events = [b'data: {"n": %d}\n\n' % i for i in range(30)] + [b"data: [DONE]\n\n"]
    coding = compression.codings()["gzip"]
    encoder = coding.stream()
    body = b"".join(encoder.compress(e) for e in events) + encoder.finish()
    assert gzip.decompress(body) == b"".join(events)
    assert compression.flushed_bytes(events, coding) == len(body)
    assert compression.replay(events, coding) > len(body)  # and the chunked framing

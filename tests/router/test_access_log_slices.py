"""The access log formats a busy interval's lines a slice per event-loop turn."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router import access_log
from router.access_log import FLUSH_SLICE, AccessLog, Entry


def _entry(n: int) -> Entry:
    return Entry(
        1e9,
        0.5,
        None,
        f"rid-{n}",
        None,
        "POST",
        "/v1/chat/completions",
        "m",
        "RANDOM",
        "",
        "b0",
        "",
        "200",
        0,
        1,
        1,
        None,
        "",
    )


async def test_a_busy_intervals_lines_leave_a_slice_a_turn_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three slices' worth and more, buffered in one interval: each formatting takes at
    most FLUSH_SLICE of them, the loop turns between two, and the file gets every line
    once, in the order the requests ended (lines added meanwhile after them)."""
    batches: list[int] = []
    turns = 0
    text_lines = access_log.text_lines

    def counted(entries: list[Entry]) -> bytes:
        batches.append(len(entries))
        return text_lines(entries)

    async def turning() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    monkeypatch.setattr(access_log, "text_lines", counted)
    path = tmp_path / "access.log"
    log = AccessLog(str(path), "text", lambda n: None, flush_seconds=3600)
    total = FLUSH_SLICE * 3 + 5
    for n in range(total):
        log.add(_entry(n))
    ticker = asyncio.create_task(turning())
    log.flush()  # the interval's end
    await asyncio.sleep(0)
    log.add(_entry(total))  # ends while the others are being formatted
    try:
        async with asyncio.timeout(10):
            while len(batches) < 4:
                await asyncio.sleep(0)
    finally:
        ticker.cancel()
    log.close()
    assert batches[:4] == [FLUSH_SLICE] * 3 + [6]
    assert turns >= 3
    ids = [line.split("request_id=")[1].split()[0] for line in path.read_text().splitlines()]
    assert ids == [f"rid-{n}" for n in range(total + 1)]

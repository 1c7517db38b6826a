"""The access log: one line per request, text (logfmt) or JSON, written by a thread.

Why not `logging`: a record per request costs the request microseconds (the record, the
handler's lock, a write system call each). Here a request only appends its `Entry` (a
tuple) to a list. A timer, one per flush period, formats the batch and hands the bytes to
a writer thread, so neither the formatting nor the write happens inside a request, and a
slow disk or a full pipe never blocks the event loop. When the writer falls behind by
more than MAX_PENDING_BYTES, batches are dropped and counted, never waited for.

Each write is whole lines of at most PIPE_BUF bytes, so the lines of several workers
appending to one pipe or file never interleave mid-line.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import orjson

from router import log
from router.config import ConfigError

#: how long an entry may wait before its batch is written, seconds
FLUSH_SECONDS = 0.2
#: entries formatted per event-loop turn (~5 µs each)
FLUSH_SLICE = 64
#: bytes handed to the writer and not yet written, past which batches are dropped
MAX_PENDING_BYTES = 8 << 20
#: what one write may hold to stay atomic on a pipe (POSIX's PIPE_BUF on Linux)
_ATOMIC_BYTES = 4096
#: a client's strings (path, model) are cut to this many characters in a line
_MAX_FIELD = 512
#: logfmt values written bare; anything else is quoted and escaped as JSON strings
_BARE = re.compile(r"[!#-<>-~]+")


class Entry(NamedTuple):
    """One request as the access log writes it (None or "": not known)."""

    at: float  # wall clock, seconds, when the request ended
    seconds: float  # from arrival to the end of the answer
    ttft: float | None  # from arrival to the answer's first byte
    request_id: str
    tenant: str | None
    method: str
    path: str
    model: str
    strategy: str
    backend: str
    reason: str  # why the policy picked the backend
    prefill: str  # the backend that prefilled it (disaggregated serving), else ""
    status: str
    retries: int
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    error: str  # the failure's kind, if the router saw one
    priority: str = ""  # its flow control class
    queued: float = 0.0  # seconds it waited in admission's queue


class AccessLog:
    """Buffers `Entry`s and has them written, in batches, by a thread of its own."""

    def __init__(
        self,
        path: str,
        fmt: str,
        on_dropped: Callable[[int], None],
        flush_seconds: float = FLUSH_SECONDS,
    ) -> None:
        """`path`: "-" for standard output, else a file opened for appending (OSError if
        it cannot be); `fmt`: "text" or "json"; `on_dropped` hears each lost batch's
        number of lines."""
        self._path = path
        try:
            self._fd = os.dup(1) if path == "-" else _open_append(path)
        except OSError as exc:
            raise ConfigError(f"access_log.path {path}: cannot open: {exc.strerror}") from None
        self._format = json_lines if fmt == "json" else text_lines
        self._on_dropped = on_dropped
        self._flush_seconds = flush_seconds
        self._entries: list[Entry] = []
        self._timer: asyncio.Handle | None = None  # the next flush
        self._pending = 0  # bytes queued for the writer, not yet written
        self._queue: queue.SimpleQueue[bytes | object | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_all, name="access-log", daemon=True)
        self._writer.start()

    def add(self, entry: Entry) -> None:
        """Note one request; it is written within `flush_seconds`."""
        self._entries.append(entry)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._flush_seconds, self.flush)

    def flush(self) -> None:
        """Hand what is buffered to the writer, `FLUSH_SLICE` entries formatted per
        event-loop turn: a busy interval's lines (hundreds) formatted at once held the
        loop milliseconds, and every request on it waited."""
        self._timer = None
        entries = self._entries
        if len(entries) > FLUSH_SLICE:
            entries, self._entries = entries[:FLUSH_SLICE], entries[FLUSH_SLICE:]
            self._timer = asyncio.get_running_loop().call_soon(self.flush)
        else:
            self._entries = []
        self._hand(entries)

    def _flush_all(self) -> None:
        """Hand everything buffered to the writer now (before a reopen, at close)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        entries, self._entries = self._entries, []
        self._hand(entries)

    def _hand(self, entries: list[Entry]) -> None:
        """Format `entries` and queue them for the writer (or drop them, counted)."""
        if not entries:
            return
        data = self._format(entries)
        if self._pending + len(data) > MAX_PENDING_BYTES:
            self._on_dropped(len(entries))
            return
        self._pending += len(data)
        self._queue.put(data)

    def reopen(self) -> None:
        """Write what is buffered, then go on in a file opened anew at the path: after
        logrotate moved the old one away (SIGHUP). Standard output stays as it is."""
        if self._path == "-":
            return
        self._flush_all()
        self._queue.put(_REOPEN)

    def close(self) -> None:
        """Write what is left and stop the writer (at shutdown)."""
        self._flush_all()
        self._queue.put(None)
        self._writer.join(timeout=5.0)
        os.close(self._fd)

    def _write_all(self) -> None:
        while (data := self._queue.get()) is not None:
            if data is _REOPEN:
                self._reopened()
                continue
            assert isinstance(data, bytes)
            try:
                for piece in _pieces(data):
                    os.write(self._fd, piece)
            except OSError as exc:  # a full disk, a closed pipe: the lines are lost
                log.disk_failed.warning("access log: cannot write (%s); lines dropped", exc)
                self._on_dropped(data.count(b"\n"))
            self._pending -= len(data)

    def _reopened(self) -> None:
        """In the writer: the file at the path now, or the old one if it cannot be
        opened (the lines keep coming; a warning says why)."""
        try:
            fd = _open_append(self._path)
        except OSError as exc:
            log.server.warning("access log: cannot reopen %s (%s)", self._path, exc.strerror)
            return
        os.close(self._fd)
        self._fd = fd
        log.server.info("access log: reopened %s", self._path)


#: the writer's cue to reopen the file
_REOPEN = object()


def _open_append(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)


def _pieces(data: bytes) -> Iterator[memoryview]:
    """`data` in runs of whole lines of at most _ATOMIC_BYTES (a longer line alone)."""
    view, start, size = memoryview(data), 0, len(data)
    while start < size:
        end = start + _ATOMIC_BYTES
        if end < size:
            cut = data.rfind(b"\n", start, end)
            end = cut + 1 if cut >= start else data.index(b"\n", end) + 1
        yield view[start:end]
        start = end


def _clip(value: str) -> str:
    return value if len(value) <= _MAX_FIELD else value[:_MAX_FIELD] + "..."


class _Clock:
    """ISO 8601 UTC times to the millisecond, the date part formatted once a second."""

    __slots__ = ("_prefix", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(self, at: float) -> str:
        second = int(at)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._prefix}.{int((at - second) * 1000):03d}Z"


def _fields(entry: Entry, clock: _Clock) -> dict[str, object]:
    ttft = entry.ttft
    return {
        "time": clock(entry.at - entry.seconds),
        "request_id": entry.request_id,
        "tenant": entry.tenant,
        "method": entry.method,
        "path": _clip(entry.path),
        "model": _clip(entry.model) or None,
        "status": int(entry.status) if entry.status.isdigit() else entry.status,
        "backend": entry.backend or None,
        "reason": entry.reason or None,
        "prefill": entry.prefill or None,
        "strategy": entry.strategy,
        "retries": entry.retries,
        "prompt_tokens": entry.prompt_tokens,
        "cached_tokens": entry.cached_tokens,
        "completion_tokens": entry.completion_tokens,
        "ttft_ms": None if ttft is None else round(ttft * 1000, 3),
        "duration_ms": round(entry.seconds * 1000, 3),
        "error": entry.error or None,
        "priority": entry.priority or None,
        "queue_ms": round(entry.queued * 1000, 3),
    }


def json_lines(entries: list[Entry]) -> bytes:
    """One JSON object per entry and line."""
    clock = _Clock()
    return b"".join(
        orjson.dumps(_fields(e, clock), option=orjson.OPT_APPEND_NEWLINE) for e in entries
    )


def text_lines(entries: list[Entry]) -> bytes:
    """One logfmt line (`key=value ...`) per entry, the JSON lines' fields in their
    order; "-" for what is not known."""
    clock = _Clock()
    lines = [_text_line(e, clock) for e in entries]
    return ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")


def _text_line(e: Entry, clock: _Clock) -> str:
    """One entry's line in one f-string: only the strings a client, a backend or an
    error chose are checked for quoting; numbers and the clock never need it."""
    return (
        f"time={clock(e.at - e.seconds)} request_id={_logfmt(e.request_id)}"
        f" tenant={_logfmt(e.tenant)} method={_logfmt(e.method)}"
        f" path={_logfmt(_clip(e.path))} model={_logfmt(_clip(e.model))}"
        f" status={_logfmt(e.status)} backend={_logfmt(e.backend)}"
        f" reason={_logfmt(e.reason)} prefill={_logfmt(e.prefill)}"
        f" strategy={_logfmt(e.strategy)} retries={e.retries}"
        f" prompt_tokens={_count(e.prompt_tokens)} cached_tokens={_count(e.cached_tokens)}"
        f" completion_tokens={_count(e.completion_tokens)} ttft_ms={_ms(e.ttft)}"
        f" duration_ms={_ms(e.seconds)} error={_logfmt(e.error)}"
        f" priority={_logfmt(e.priority)} queue_ms={_ms(e.queued)}"
    )


def _logfmt(value: str | None) -> str:
    if not value:
        return "-"
    return value if _BARE.fullmatch(value) else orjson.dumps(value).decode()


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else str(round(seconds * 1000, 3))

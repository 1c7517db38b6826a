"""Data capture: sampled requests and their answers, one JSON line each, for analysis
(`kvroute recommend` reads them).

Never on the request's path. A captured request hands its raw parts (the body the
client sent, the answer's bytes, what the accounting knows) to a bounded queue, with no
await and nothing decoded or encoded; a thread of the worker turns each into one line:
the request's JSON, the answer's (a stream's events reassembled into its text, finish
reason and usage), TTFT, backend, pool, usage. When the queue is full the record is
dropped and counted, and the request never waits.

Each worker writes files of its own (its pid in the name), opened at start, rotated at
`max_bytes` or `rotate_seconds`, gzipped if asked. Only the thread that owns a file
writes it, whole lines at a time, so no record is split or interleaved with another.
"""

from __future__ import annotations

import gzip
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, NamedTuple

import orjson

from router import log
from router.access_log import Entry
from router.config import CaptureConfig, ConfigError

#: the header that captures its request whatever the sampling says (value "1")
FORCE_HEADER = "X-Kvroute-Capture"
#: headers never written as sent: the client's credentials
ALWAYS_REDACTED = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key"})
REDACTED = "[redacted]"
#: the record format's version, in every line's `v`
VERSION = 1


class Captured(NamedTuple):
    """One captured request, as the request path hands it over: raw, nothing decoded."""

    #: its figures, as the access log has them
    entry: Entry
    pool: str | None
    headers: tuple[tuple[str, str], ...]
    request: bytes | None  # the body as the client sent it
    response: bytes | None  # the answer's body, a stream's events as they came
    streamed: bool


class Sampler:
    """Which requests are captured: every one of `tenants`, any that asks with
    FORCE_HEADER, and `sample` of the rest."""

    __slots__ = ("_random", "_sample", "_tenants")

    def __init__(self, cfg: CaptureConfig) -> None:
        self._sample = cfg.sample
        self._tenants = frozenset(cfg.tenants)
        self._random = random.random

    def wants(self, tenant: str | None, headers: Mapping[str, str]) -> bool:
        if headers.get(FORCE_HEADER) == "1":
            return True
        if tenant is not None and tenant in self._tenants:
            return True
        return self._sample > 0 and self._random() < self._sample


class Capture:
    """A worker's capture: the sampler, the queue and the thread that writes it."""

    def __init__(
        self,
        cfg: CaptureConfig,
        dropped: Callable[[str], None],
        written: Callable[[], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Open the first file (ConfigError if it cannot be). `dropped(reason)` counts a
        record lost ("queue_full", "write_error"), `written()` one written; the thread
        starts with `start`."""
        self.sampler = Sampler(cfg)
        self._cfg = cfg
        self._dropped = dropped
        self._written = written
        self._clock = clock
        self._redact = ALWAYS_REDACTED | {h.lower() for h in cfg.redact}
        self._queue: queue.Queue[Captured | None] = queue.Queue(cfg.queue_records)
        self._thread = threading.Thread(target=self._write_all, name="kvroute-capture")
        self._seq = 0
        try:
            Path(cfg.path).mkdir(parents=True, exist_ok=True)
            self._file, self._opened, self._bytes = self._open(), clock(), 0
        except OSError as exc:
            raise ConfigError(f"capture.path: cannot write {cfg.path}: {exc}") from exc

    def start(self) -> None:
        self._thread.start()

    def add(self, record: Captured) -> None:
        """Queue `record` for the thread, or drop and count it if the queue is full."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._dropped("queue_full")

    def headers(self, headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
        """The request's headers to keep: none unless the config asks for requests; the
        redacted ones' values replaced. Called only for a captured request."""
        if not self._cfg.request:
            return ()
        redact = self._redact
        return tuple((str(k), REDACTED if k.lower() in redact else v) for k, v in headers)

    def close(self) -> None:
        """Write what is queued, then close the file (at the worker's stop)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._file.close()

    def _write_all(self) -> None:
        """The thread: a line per record, flushed whenever the queue runs dry."""
        while (record := self._queue.get()) is not None:
            try:
                self._write(line(record, self._cfg.request, self._cfg.response))
                self._written()
            except Exception as exc:  # a full disk, an odd record: it alone is lost
                self._dropped("write_error")
                log.server.warning("capture: a record was lost: %r", exc)
            if self._queue.empty():
                self._flush()

    def _write(self, data: bytes) -> None:
        cfg = self._cfg
        if self._bytes >= cfg.max_bytes or self._clock() - self._opened >= cfg.rotate_seconds:
            self._file.close()
            self._file, self._opened, self._bytes = self._open(), self._clock(), 0
        self._file.write(data)
        self._bytes += len(data)

    def _flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exc:
            log.server.warning("capture: cannot write %s: %s", self._cfg.path, exc)

    def _open(self) -> IO[bytes]:
        """A new file: capture-<pid>-<UTC time>-<n>.jsonl[.gz], sorted by time within a
        worker; n tells apart files opened within one second, a restarted worker's that
        got the same pid included (an existing file is never appended to)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._clock()))
        suffix = ".jsonl.gz" if self._cfg.gzip else ".jsonl"
        while True:
            self._seq += 1
            path = Path(self._cfg.path) / f"capture-{os.getpid()}-{stamp}-{self._seq}{suffix}"
            try:
                raw = open(path, "xb")  # noqa: SIM115 - kept open until rotated or closed
            except FileExistsError:
                continue
            return gzip.GzipFile(fileobj=raw, mode="wb") if self._cfg.gzip else raw


def line(record: Captured, request: bool, response: bool) -> bytes:
    """`record` as one JSON line (see VERSION); `request`/`response`: keep their bodies."""
    e = record.entry
    usage = None
    if e.prompt_tokens is not None or e.completion_tokens is not None:
        usage = {
            "prompt_tokens": e.prompt_tokens,
            "completion_tokens": e.completion_tokens,
            "cached_tokens": e.cached_tokens,
        }
    out: dict[str, object] = {
        "v": VERSION,
        "at": e.at,
        "request_id": e.request_id,
        "tenant": e.tenant,
        "method": e.method,
        "path": e.path,
        "model": e.model,
        "status": int(e.status) if e.status.isdigit() else e.status,
        "backend": e.backend or None,
        "pool": record.pool,
        "strategy": e.strategy,
        "reason": e.reason or None,
        "prefill": e.prefill or None,
        "ttft_ms": None if e.ttft is None else round(e.ttft * 1e3, 3),
        "duration_ms": round(e.seconds * 1e3, 3),
        "usage": usage,
        "error": e.error or None,
    }
    if request and record.request is not None:
        out["headers"] = dict(record.headers)
        out["request"] = _json(record.request)
    if response and record.response is not None:
        out["response"] = stream(record.response) if record.streamed else _json(record.response)
    return orjson.dumps(out) + b"\n"


def stream(body: bytes) -> dict[str, object]:
    """An SSE answer reassembled: its events counted, the first choice's text (chat
    deltas or completion text) joined, its finish reason, and the usage event's."""
    events = 0
    parts: list[str] = []
    finish = usage = None
    for raw in body.split(b"\n"):
        if not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            continue
        events += 1
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(event, dict):
            continue
        usage = event.get("usage") or usage
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str):
                parts.append(text)
            finish = choice.get("finish_reason") or finish
    return {
        "stream": True,
        "events": events,
        "content": "".join(parts),
        "finish_reason": finish,
        "usage": usage,
    }


def _json(body: bytes) -> object:
    """The body's JSON, or its text when it is not JSON (an error page, a cut body)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return {"text": body.decode(errors="replace")}

"""A streamed body relayed into a client's connection from the backend connection's own
callbacks: no task wake-up, future or generator step per chunk (the hot loop of a
streaming worker).

While the client's buffer is full, the body waits in its reader, whose limit pauses the
backend's socket; reads of whole chunks that nothing waits before are passed on as the
backend framed them (`forward`), so an SSE event is neither decoded nor framed again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from router.upstream.body import BodyReader
from router.upstream.chunked import payload
from router.upstream.clock import BodyClock
from router.upstream.failures import BackendBroke


class Sink(Protocol):
    """Where `Upstream.relay` writes a streamed body (the fast path's client connection)."""

    def put(self, chunk: bytes) -> None:
        """Write `chunk`; ConnectionError if the client is gone."""

    def ready(self) -> bool:
        """False while the client's socket buffer is full."""

    def put_framed(self, chunks: bytes) -> None:
        """Write whole chunks already framed for chunked transfer encoding, as they are."""

    def on_ready(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` when the client's buffer drains again (None: stop)."""


class TransformingSink:
    """A Sink that passes what it is given to `inner` changed (its subclass's `put`):
    the reads the relay forwards as the backend framed them are decoded first (each
    holds whole chunks), since the change applies to the payload; `inner` frames it."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Sink) -> None:
        self._inner = inner

    def put(self, chunk: bytes) -> None:
        raise NotImplementedError

    def put_framed(self, chunks: bytes) -> None:
        self.put(payload(chunks))

    def ready(self) -> bool:
        return self._inner.ready()

    def on_ready(self, callback: Callable[[], None] | None) -> None:
        self._inner.on_ready(callback)


class Relay:
    """One body on its way from a backend connection into a `Sink`; `done` resolves at
    the body's end, or with the failure (the backend's, or the client gone)."""

    __slots__ = ("_arrived", "_body", "_sink", "_taken", "done", "on_failure")

    def __init__(
        self,
        body: BodyReader,
        sink: Sink,
        clock: BodyClock,
        loop: asyncio.AbstractEventLoop,
        on_failure: Callable[[BackendBroke], BaseException],
    ) -> None:
        self._body = body
        self._sink = sink
        self._arrived = clock.arrived  # bound once: it runs per event, on the hot path
        self._taken = 0  # body bytes the relay took from the reader
        #: how a backend failure reaches the relay's caller (router/errors.py's class)
        self.on_failure = on_failure
        self.done: asyncio.Future[None] = loop.create_future()

    def drain(self) -> None:
        """Pass what the reader holds to the sink; note the end or the failure."""
        done = self.done
        if done.done():
            return
        body, sink = self._body, self._sink
        try:
            if sink.ready():
                chunk = body.read_nowait()
                if chunk:
                    self._taken += len(chunk)
                    self._arrived(chunk)
                    sink.put(chunk)
            if body.at_eof():
                done.set_result(None)
        except BackendBroke as exc:
            done.set_exception(self.on_failure(exc))
        except ConnectionError as exc:  # the client is gone
            done.set_exception(exc)

    def forward(self, chunks: bytes) -> bool:
        """Pass a read of whole chunks to the sink as the backend framed them, if nothing
        waits before it in the reader and the sink takes it now (a stream's hot path:
        nothing decoded or framed again); False: the caller puts it in the reader."""
        done = self.done
        if done.done() or self._body.total != self._taken or not self._sink.ready():
            return False
        if chunks:
            self._arrived(chunks, True)
            try:
                self._sink.put_framed(chunks)
            except ConnectionError as exc:  # the client is gone
                done.set_exception(exc)
        return True

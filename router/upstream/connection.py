"""One keep-alive HTTP/1.1 connection to a backend, one exchange at a time.

The request is written as one `writelines`; the answer is read by an `Answer`
(router/upstream/response.py) from this protocol's callbacks, and a body that a relay
takes (router/upstream/relay.py) is handed to it from here too: no task wake-up per read.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from yarl import URL

from router.upstream.body import BodyReader
from router.upstream.flow import FlowProtocol
from router.upstream.head import AnswerParser
from router.upstream.response import Answer, Head, Relaying


class Pool(Protocol):
    """Where a connection goes back once its exchange ended cleanly (router/upstream/pool.py)."""

    def keep(self, conn: _Connection) -> None: ...


class _Connection(FlowProtocol):
    """A backend connection: `send` one request, `release` it once its answer is read."""

    __slots__ = ("_answer", "_pool", "_should_close", "_spare", "backend", "idle_since", "relay")

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: Pool, backend: URL) -> None:
        super().__init__(loop)
        self._pool = pool
        self.backend = backend
        self.idle_since = 0.0
        self._answer: Answer | None = None
        #: the last answer's parser, for the next one (llhttp is between two messages)
        self._spare: AnswerParser | None = None
        self._should_close = False
        #: the answer whose body is relayed from this protocol's callbacks (Upstream.relay)
        self.relay: Relaying | None = None

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(
        self, head: bytes, body: bytes, method: str
    ) -> asyncio.Future[tuple[Head, BodyReader]]:
        """Write one request; the future gets the answer's head and its body's reader."""
        self._answer = answer = Answer(self, self._loop, method, self._spare)
        self._spare = None
        self.transport.writelines((head, body))
        return answer.head

    def release(self, clean: bool) -> None:
        """The exchange ended: back to the pool if the answer ended cleanly and the
        backend keeps the connection, else closed (a backend aborts what it sends)."""
        answer = self._answer
        spare = answer.drop() if answer is not None else None
        if (
            clean
            and self.open
            and not self._should_close
            and answer is not None
            and not answer.should_close
            and answer.body_done
        ):
            self._answer, self._spare = None, spare
            self._pool.keep(self)
        else:
            if spare is not None:
                spare.drop()
            self.close()

    def close(self) -> None:
        self._should_close = True
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None:  # bytes while idle: nothing more on this connection is trusted
            self.close()
            return
        if answer.chunked is not None:  # a stream's hot path: straight to its chunks
            answer.chunk_received(data, self.relay)
        else:
            answer.feed(data, self.relay)

    def eof_received(self) -> None:
        """The backend closed its side: so do we (`connection_lost` follows)."""

    def connection_lost(self, exc: BaseException | None) -> None:
        self._should_close = True
        if self._spare is not None:
            self._spare.drop()
            self._spare = None
        if self._answer is not None:
            self._answer.lost(exc)
        self.reading_paused = False  # nothing to resume: readers drain what was buffered
        super().connection_lost(exc)
        if self.relay is not None:
            self.relay.drain()

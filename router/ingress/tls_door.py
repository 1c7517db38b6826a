"""The HTTPS listener's door: a new connection's first byte says whether it speaks TLS.

A TLS client opens with a handshake record (content type 22): the connection goes on to
the handshake and to the fast path exactly as a server with `ssl=` would take it
(`loop.connect_accepted_socket`, which calls the protocol's `connection_made` before
any byte of the request reaches it). Anything else is plain HTTP sent to the HTTPS port:
it gets a 400 whose body says so, as nginx answers, instead of a failed handshake that
the client sees as an empty reply; the listener serves TLS clients on.

The server's own transport is closed unread as soon as it is made (a duplicate of its
descriptor keeps the connection), so no byte is consumed before the choice: the byte is
peeked (MSG_PEEK), and the socket is handed to `connect_accepted_socket`, with `ssl=`
or to the plain answer. Waiting for the byte, the handshake and a plain client's
exchange are each bounded by the header timeout.

Cost: per new connection, a dup, a transport closed unused, a readiness watch and a
peek (measured: no change in connections per second); nothing per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import ssl
from collections.abc import Callable
from typing import cast

from router.errors import BadRequest
from router.upstream.proxy import header_lines

__all__ = ["TlsDoor"]

#: a TLS record of type handshake: how every ClientHello begins
_HANDSHAKE = 0x16
#: a plain request's head is read (to answer it, not to parse it) up to this much
_MAX_HEAD = 8192
_PLAIN_HTTP_HINT = "The plain HTTP request was sent to the HTTPS port: use https:// for it."


def _plain_answer() -> bytes:
    """The whole 400 a plain HTTP request gets, as bytes."""
    headers, body = BadRequest(_PLAIN_HTTP_HINT).http_answer({"Connection": "close"})
    headers["Content-Length"] = str(len(body))
    return f"HTTP/1.1 400 Bad Request\r\n{header_lines(headers)}\r\n".encode() + body


_PLAIN_ANSWER = _plain_answer()
#: the handshakes (and plain answers) being set up
_OPENING: set[asyncio.Task[None]] = set()


class TlsDoor(asyncio.Protocol):
    """The protocol the HTTPS port's server makes for each accepted connection: it only
    takes the connection's socket (a duplicate descriptor) off the plain transport, which
    it closes at once, unread, and lets a `_Doorway` see what the client speaks."""

    def __init__(
        self, app: Callable[[], asyncio.Protocol], context: ssl.SSLContext, timeout: float
    ) -> None:
        self._app = app
        self._context = context
        self._timeout = timeout

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
        transport.abort()  # its descriptor closes alone (no shutdown): `sock` holds on
        _Doorway(sock, self._app, self._context, self._timeout)


class _Doorway:
    """One connection until its first byte: a handshake goes on to `app` over TLS, any
    other byte to a plain 400; nothing within `timeout`, or the client's end, closes it."""

    __slots__ = ("_app", "_context", "_sock", "_timeout", "_timer")

    def __init__(
        self,
        sock: socket.socket,
        app: Callable[[], asyncio.Protocol],
        context: ssl.SSLContext,
        timeout: float,
    ) -> None:
        self._sock = sock
        self._app = app
        self._context = context
        self._timeout = timeout
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._readable)
        self._timer = loop.call_later(timeout, self._expired)

    def _readable(self) -> None:
        try:
            first = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            first = b""
        self._unwatch()
        if not first:  # gone before its first byte
            self._sock.close()
            return
        tls = first[0] == _HANDSHAKE
        app = self._app if tls else functools.partial(_PlainHttp, self._timeout)
        task = asyncio.get_running_loop().create_task(
            self._open(app, self._context if tls else None)
        )
        _OPENING.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(_OPENING.discard)

    async def _open(
        self, app: Callable[[], asyncio.Protocol], context: ssl.SSLContext | None
    ) -> None:
        """The connection, as a server with (or without) `ssl=` makes it; a handshake
        that fails closes it (asyncio logs it at debug level, as for such a server)."""
        timeout = self._timeout if context is not None else None
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.get_running_loop().connect_accepted_socket(
                app, self._sock, ssl=context, ssl_handshake_timeout=timeout
            )

    def _expired(self) -> None:
        """No first byte within the header timeout."""
        self._unwatch()
        self._sock.close()

    def _unwatch(self) -> None:
        self._timer.cancel()
        asyncio.get_running_loop().remove_reader(self._sock.fileno())


class _PlainHttp(asyncio.Protocol):
    """Plain HTTP on the HTTPS port: its head is read, the 400 sent, and the connection
    closed once the client has read it and closed its end (or at `timeout`)."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._head = b""
        self._answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        self._timer = asyncio.get_running_loop().call_later(self._timeout, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return  # what follows the head is read and dropped, until the client's end
        self._head += data
        if b"\r\n\r\n" in self._head or len(self._head) > _MAX_HEAD:
            self._answered = True
            assert self._transport is not None
            self._transport.write(_PLAIN_ANSWER)
            self._transport.write_eof()  # the client reads it all, then closes its end

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()

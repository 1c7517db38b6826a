"""The request path's keep-alive connections to the backends, per backend.

Idle connections wait per backend, the last one returned reused first. One idle longer
than `KEEPALIVE_SECONDS` is closed (a sweep runs that often while any wait); one the
backend closed meanwhile is dropped when looked at.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

from yarl import URL

from router.errors import UpstreamConnectError
from router.upstream.body import BodyReader
from router.upstream.connection import _Connection
from router.upstream.failures import Closed, Reset
from router.upstream.response import Head

#: methods sent again, once, when a reused connection turns out closed (as aiohttp's client)
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
KEEPALIVE_SECONDS = 60.0  # an idle connection is closed after this long


class Upstreams:
    """Keep-alive HTTP/1.1 connections to the backends, for the request path."""

    def __init__(self) -> None:
        self._idle: dict[URL, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._running: asyncio.AbstractEventLoop | None = None

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The loop the pool's connections live on, asked for once: on Python 3.11 each
        asyncio.get_running_loop() is a getpid() system call, and a pool asked twice an
        exchange (a request, a scrape)."""
        if self._running is None:
            self._running = asyncio.get_running_loop()
        return self._running

    async def send(
        self,
        backend: URL,
        head: bytes,
        body: bytes,
        method: str,
        connect_timeout: float,
        tls: ssl.SSLContext | None = None,
    ) -> tuple[_Connection, Head, BodyReader]:
        """Write a request on a connection to `backend`; return the connection, the
        answer's head and its body's reader. `tls`: how an https backend's certificate
        is verified (default: the system's CAs). Raises UpstreamConnectError or a
        router/upstream/failures.py class."""
        retry = method in _IDEMPOTENT
        while True:
            conn = self._reuse(backend)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(backend, connect_timeout, tls)
            try:
                answer, payload = await conn.send(head, body, method)
            except (Closed, Reset):
                conn.close()
                if not (reused and retry):
                    raise
                retry = False  # the backend closed it while idle: once more
                continue
            except BaseException:  # a timeout, a client that left: the answer is not wanted
                conn.close()
                raise
            return conn, answer, payload

    def keep(self, conn: _Connection) -> None:
        """`conn` ended its exchange cleanly: keep it for the next request."""
        loop = self._loop()
        conn.idle_since = loop.time()
        self._idle.setdefault(conn.backend, []).append(conn)
        if self._sweep is None:
            self._sweep = loop.call_later(KEEPALIVE_SECONDS, self._close_expired)

    def close(self) -> None:
        """Close every idle connection (those in use close when their exchange ends)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    def _reuse(self, backend: URL) -> _Connection | None:
        idle = self._idle.get(backend)
        if not idle:
            return None
        oldest = self._loop().time() - KEEPALIVE_SECONDS
        while idle:
            conn = idle.pop()
            if conn.open and conn.idle_since > oldest:
                return conn
            conn.close()
        return None

    async def _connect(
        self, backend: URL, timeout: float, tls: ssl.SSLContext | None
    ) -> _Connection:
        loop = self._loop()
        if backend.scheme != "https":
            tls = None
        elif tls is None:
            tls = self._tls_context()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, self, backend),
                    backend.raw_host,
                    backend.port,
                    ssl=tls,
                    server_hostname=backend.raw_host if tls else None,
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"The backend did not accept a connection within {timeout:g} s."
            ) from None
        except OSError as exc:  # refused, unreachable, unknown host, TLS handshake
            raise UpstreamConnectError(_unreachable(exc)) from exc
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _close_expired(self) -> None:
        """Close connections idle for `KEEPALIVE_SECONDS`; look again that much later."""
        self._sweep = None
        oldest = self._loop().time() - KEEPALIVE_SECONDS
        for backend, idle in list(self._idle.items()):
            for conn in idle:
                if conn.idle_since <= oldest:
                    conn.close()
            idle[:] = [conn for conn in idle if conn.open]
            if not idle:
                del self._idle[backend]
        if self._idle:
            self._sweep = self._loop().call_later(KEEPALIVE_SECONDS, self._close_expired)


def _unreachable(exc: OSError) -> str:
    """Why no connection to the backend was made, in the client's terms."""
    if isinstance(exc, ConnectionRefusedError):
        return "The backend refused the connection."
    if isinstance(exc, socket.gaierror):
        return "The backend cannot be reached: its host name does not resolve."
    if isinstance(exc, ssl.SSLError):
        return "The backend cannot be reached: the TLS handshake failed."
    if exc.strerror:  # e.g. "No route to host"
        return f"The backend cannot be reached ({exc.strerror})."
    return "The backend cannot be reached."

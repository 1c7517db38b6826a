"""GETs beside the request path (the backends' /metrics scrapes, health checks and model
polls) through the request path's own HTTP/1.1 client rather than aiohttp's.

Every backend is scraped every second and checked every few: at a thousand backends
aiohttp's client cost the collector ~0.3 ms a scrape and more a check (its request and
response objects, its connector), more than reading the page. Here a GET is a request
head written on a kept connection and the body read back. The connections are a pool of
their own (`Upstreams`), apart from the request path's: a scrape never waits for a
connection a request holds, nor holds one a request would reuse.
"""

from __future__ import annotations

from router.errors import UpstreamError
from router.fleet.backend import Backend
from router.upstream.failures import BackendBroke
from router.upstream.pool import Upstreams
from router.upstream.proxy import broke


class Pages:
    """GETs to the backends, each on a kept connection to its backend."""

    def __init__(self, connect_timeout: float) -> None:
        self._upstreams = Upstreams()
        self._connect_timeout = connect_timeout

    async def ask(self, backend: Backend, path: str) -> tuple[int, bytes]:
        """The status and body of `path` under `backend`'s prefix (with its headers, its
        key, and its TLS verification). Raises UpstreamConnectError when no connection
        was made (its cause the OSError, e.g. a refusal or an untrusted certificate)
        and UpstreamError when the backend broke off or answered malformed HTTP. A
        caller that gives up (a timeout) closes the connection: the answer it abandoned
        is not read by the next GET."""
        host = backend.url.host_port_subcomponent
        target = backend.at(path).raw_path
        head = f"GET {target} HTTP/1.1\r\nHost: {host}\r\n{backend.head_lines}\r\n"
        try:
            conn, answer, body = await self._upstreams.send(
                backend.url,
                head.encode("utf-8", "surrogateescape"),
                b"",
                "GET",
                self._connect_timeout,
                backend.tls,
            )
            clean = False
            try:
                page = await body.read()
                clean = True
            finally:
                conn.release(clean)
        except BackendBroke as exc:
            raise UpstreamError(broke(exc, "answer")) from exc
        return answer.status, page

    async def get(self, backend: Backend, path: str) -> bytes | None:
        """The body of `path` when it answers 200; None when it answers anything else,
        cannot be reached or breaks off (`ask`)."""
        try:
            status, page = await self.ask(backend, path)
        except UpstreamError:
            return None
        return page if status == 200 else None

    def close(self) -> None:
        """Close the kept connections."""
        self._upstreams.close()

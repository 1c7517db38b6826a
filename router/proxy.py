"""One upstream exchange: original bytes out, response bytes back untouched.

`open_upstream` sends the client's body and headers (hop-by-hop headers dropped) over
the pooled keep-alive session and returns an `Upstream` once the backend's status and
headers arrived. Its body is then read whole (JSON answers) or chunk by chunk as the
backend flushes it (SSE): nothing is decoded or re-encoded, and nothing is buffered.
Each read pushes the idle deadline forward. Upstream failures are translated here and
only here, so a failure writing to the *client* can never pass for a backend error.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from router.errors import UpstreamConnectError, UpstreamDisconnected, UpstreamError

_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """Headers safe to pass across the proxy (end-to-end ones only)."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP)


def make_session(connect_timeout: float) -> aiohttp.ClientSession:
    """The one pooled session to all backends: keep-alive, no limit, bytes untouched."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


class Upstream:
    """A backend response whose headers arrived; its body is read through this object."""

    __slots__ = (
        "_deadline",
        "_end",
        "_idle",
        "_on_first",
        "_on_gap",
        "_resp",
        "_tail",
        "backend_name",
        "first_chunk_at",
        "headers",
        "status",
        "streaming",
    )

    def __init__(
        self,
        resp: aiohttp.ClientResponse,
        idle: float,
        end: float,
        on_gap: Callable[[float], None],
        on_first: Callable[[], None],
    ) -> None:
        self._resp = resp
        self._on_first = on_first
        self._deadline: asyncio.Timeout | None = None
        self._idle = idle
        self._end = end
        self._on_gap = on_gap
        self.first_chunk_at: float | None = None
        self._tail = b""
        self.backend_name = ""
        self.status = resp.status
        self.headers: CIMultiDictProxy[str] = resp.headers
        self.streaming = resp.content_type == "text/event-stream"

    def watch(self, deadline: asyncio.Timeout) -> None:
        """The timeout guarding the body; each chunk pushes it `idle` seconds on."""
        self._deadline = deadline

    async def read(self) -> bytes:
        try:
            self._tail = await self._resp.read()
        except aiohttp.ClientError as exc:
            raise UpstreamDisconnected(f"backend failed while sending the body: {exc}") from exc
        return self._tail

    def cached_tokens(self) -> int | None:
        """`usage.prompt_tokens_details.cached_tokens` of the answer, if it reported one.

        Streams report usage in their last event, so only the last chunk is kept (by
        reference) and searched once, at the end.
        """
        found = _CACHED_TOKENS.search(self._tail)
        return int(found.group(1)) if found else None

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield data as the backend flushes it; each chunk extends the idle deadline.

        The gap between chunks goes to `on_gap` (the inter-token latency histogram);
        `on_first` hears the first chunk (the backend finished the prompt's prefill).
        """
        loop = asyncio.get_running_loop()
        deadline, idle, end, on_gap = self._deadline, self._idle, self._end, self._on_gap
        assert deadline is not None, "watch() the body's timeout before reading it"
        content = self._resp.content
        last = None
        while True:
            try:
                chunk = await content.readany()
            except aiohttp.ClientError as exc:
                raise UpstreamDisconnected(f"backend stream broke: {exc}") from exc
            if not chunk:  # clean end; a cut-off body raises ClientPayloadError above
                return
            now = loop.time()
            if last is None:
                self.first_chunk_at = now
                self._on_first()
            else:
                on_gap(now - last)
            last = now
            self._tail = chunk
            deadline.reschedule(min(now + idle, end))
            yield chunk

    def finish(self, clean: bool) -> None:
        """Return the connection to the pool, or close it so the backend aborts."""
        if clean:
            self._resp.release()
        else:
            self._resp.close()


async def open_upstream(
    session: aiohttp.ClientSession,
    url: URL,
    method: str,
    body: bytes,
    headers: CIMultiDict[str],
    idle: float,
    end: float,
    on_gap: Callable[[float], None],
    on_first: Callable[[], None],
) -> Upstream:
    try:
        resp = await session.request(method, url, data=body or None, headers=headers)
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamConnectError(f"cannot connect to backend: {exc.os_error}") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"backend failed before responding: {exc}") from exc
    return Upstream(resp, idle, end, on_gap, on_first)

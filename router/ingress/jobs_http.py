"""What every job endpoint (jobs_routes.py, files_routes.py, batches_routes.py) shares:
its handler's shape, the body read, a JSON answer, the path's id looked up for the
caller's tenant (a 404 when it has none), a listing's paging."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from router.errors import BadRequest, KvrouteError
from router.ingress.body import BodyReader

T = TypeVar("T")
#: a job endpoint's handler: the request, and the caller's tenant
TenantHandler = Callable[[web.Request, str | None], Awaitable[web.StreamResponse]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: makes a `TenantHandler` an aiohttp handler (the token checked, refusals answered)
Guard = Callable[[TenantHandler], Handler]
JSON = "application/json"


async def read_body(body: BodyReader, request: web.Request) -> bytes:
    """The body within the router's limits; stored at once, so not held in the
    bodies' budget."""
    read = await body.read(request)
    body.bodies.give(len(read))
    return read


def json_answer(body: bytes) -> web.Response:
    return web.Response(body=body, content_type=JSON)


async def found(
    request: web.Request, tenant: str | None, fetch: Callable[[str, str | None], T | None],
    what: str,
) -> T:  # fmt: skip
    """What `fetch` finds under the path's id for `tenant`; a 404 when nothing."""
    ident = request.match_info["id"]
    found = await asyncio.to_thread(fetch, ident, tenant)
    if found is None:
        raise absent(what, ident)
    return found


def paging(request: web.Request, limits: tuple[int, int]) -> tuple[str | None, int]:
    """A listing's `after` cursor and `limit` (its default and most: `limits`)."""
    default, most = limits
    raw = request.query.get("limit")
    try:
        limit = default if raw is None else int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise BadRequest(f"limit must be a whole number from 1 to {most}", param="limit")
    return request.query.get("after"), limit


def absent(what: str, ident: str) -> KvrouteError:
    return KvrouteError(f"No {what} {ident!r}.", param="id", status=404)

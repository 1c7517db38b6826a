"""The job endpoints (with `jobs.enabled`): single async requests, and OpenAI's Files and
Batch API as the OpenAI SDK calls them. Each is the caller's tenant's alone (with auth
on, a token that names no tenant has a namespace of its own: `Authenticator.owner`):
another's job, file or batch is a 404, as an absent one is.

  POST /v1/async/{chat/completions,completions,embeddings}   202, an id and a status URL
       (X-Kvroute-Webhook: URL, to have the status POSTed there when it ends)
  GET  /v1/async/{id}                                         its status, and its answer
  POST /v1/files (purpose batch)   GET /v1/files   GET, DELETE /v1/files/{id}
  GET /v1/files/{id}/content
  POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import Annotated, TypeVar

import msgspec
from aiohttp import BodyPartReader, web

from router.config import JobsConfig
from router.errors import BadRequest, KvrouteError, PayloadTooLarge, RequestTimeout
from router.ingress.body import BodyReader
from router.ingress.relay import refused
from router.jobs.store import PIECE_BYTES, Batch, JobStore, Layout, Line
from router.jobs.webhooks import WEBHOOK_HEADER, checked_webhook
from router.jobs.wire import (
    KINDS,
    WINDOW,
    batch_json,
    batches_json,
    checked_body,
    checking_lines,
    deleted_json,
    file_json,
    files_json,
    job_json,
    new_batch,
    new_id,
    write_outputs,
)
from router.metrics import Metrics

Tenant = Callable[[Mapping[str, str]], str | None]
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_JSON = "application/json"
_UPLOAD_CHUNK = 1 << 16
#: what an upload's or a download's piece holds of the body budget at most
_PIECE_HELD = PIECE_BYTES + _UPLOAD_CHUNK
#: a form's `purpose` past this is cut (it names one of a few purposes)
_PURPOSE_BYTES = 64
#: listings' default and largest `limit`, as OpenAI's
_FILES_LIMIT = (10_000, 10_000)
_BATCHES_LIMIT = (20, 100)
#: /v1/async/chat/completions runs /v1/chat/completions later
_ASYNC = "/v1/async"
#: the paths under which every answer needs a token
_ROOTS = (_ASYNC, "/v1/files", "/v1/batches")
#: the longest a batch input file's check holds the loop at a time, seconds
_SLICE_S = 0.002


class _BatchRequest(msgspec.Struct):
    input_file_id: str
    endpoint: str
    completion_window: str
    #: as OpenAI allows: at most 16 pairs
    metadata: Annotated[dict[str, str], msgspec.Meta(max_length=16)] | None = None


_BATCH_REQUEST = msgspec.json.Decoder(_BatchRequest)


class JobRoutes:
    """The job endpoints over `store`; `wake` tells this worker's runner a job came."""

    def __init__(
        self,
        cfg: JobsConfig,
        store: JobStore,
        wake: Callable[[], None],
        tenant: Tenant,
        body: BodyReader,
        upload_timeout: float,
        metrics: Metrics,
    ) -> None:
        self._cfg = cfg
        self._metrics = metrics
        self._store = store
        self._wake = wake
        self._tenant = tenant
        self._body = body
        self._upload_timeout = upload_timeout

    def routes(self) -> list[web.RouteDef]:
        """The endpoints; then, for a token-holder only, a 405 for a method an endpoint
        does not take and a 404 for any other path under theirs, so that no one maps
        the routes without a token."""
        routes = self._endpoints()
        methods: dict[str, list[str]] = {}
        for route in routes:
            methods.setdefault(route.path, []).append(route.method)
        wrong = [
            web.route("*", path, self._guarded(_not_allowed(allowed)))
            for path, allowed in methods.items()
        ]
        unknown = [
            web.route("*", f"{root}/{{tail:.*}}", self._guarded(_unknown)) for root in _ROOTS
        ]
        return [*routes, *wrong, *unknown]

    def _endpoints(self) -> list[web.RouteDef]:
        accept = [web.post(_ASYNC + path[3:], self._guarded(self._accept)) for path in KINDS]
        return [
            *accept,
            web.get("/v1/async/{id}", self._guarded(self._job)),
            web.post("/v1/files", self._guarded(self._upload)),
            web.get("/v1/files", self._guarded(self._files)),
            web.get("/v1/files/{id}", self._guarded(self._file)),
            web.delete("/v1/files/{id}", self._guarded(self._delete_file)),
            web.get("/v1/files/{id}/content", self._guarded(self._content)),
            web.post("/v1/batches", self._guarded(self._create_batch)),
            web.get("/v1/batches", self._guarded(self._batches)),
            web.get("/v1/batches/{id}", self._guarded(self._batch)),
            web.post("/v1/batches/{id}/cancel", self._guarded(self._cancel)),
        ]

    def _guarded(
        self, handler: Callable[[web.Request, str | None], Awaitable[web.StreamResponse]]
    ) -> Handler:
        """`handler` for the caller's tenant (401 without a valid token), its refusals
        answered in OpenAI's error shape."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request, self._tenant(request.headers))
            except KvrouteError as err:
                return await refused(request, err)

        return guarded

    # single async requests
    async def _accept(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        path = "/v1" + request.path.removeprefix(_ASYNC)
        hook = request.headers.get(WEBHOOK_HEADER)
        if hook is not None:
            hook = checked_webhook(hook, self._cfg)
        body = await self._inline_body(request)
        checked_body(KINDS[path], body)
        job_id = new_id("job_")
        job = await asyncio.to_thread(self._store.put, job_id, tenant, path, body, hook)
        self._metrics.jobs_accepted.labels("async").inc()
        self._wake()
        url = f"/v1/async/{job.id}"
        return web.Response(
            status=202, body=job_json(job, url), content_type=_JSON, headers={"Location": url}
        )

    async def _inline_body(self, request: web.Request) -> bytes:
        """The body, at most `max_inline_bytes` (413 past it, before reading it all)."""
        most = self._cfg.max_inline_bytes
        too_large = PayloadTooLarge(f"An async request's body is at most {most} bytes.")
        if (request.content_length or 0) > most:
            raise too_large
        body = await self._read(request)
        if len(body) > most:
            raise too_large
        return body

    async def _read(self, request: web.Request) -> bytes:
        """The body within the router's limits; stored at once, so not held in the
        bodies' budget."""
        body = await self._body.read(request)
        self._body.bodies.give(len(body))
        return body

    async def _job(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        job = await _found(request, tenant, self._store.get, "async job")
        return _json(job_json(job, f"/v1/async/{job.id}"))

    # files
    async def _upload(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        """A batch input file from a multipart form (`purpose`, `file`), as
        `client.files.create` sends it, stored a piece at a time as it arrives: only a
        piece is held, in the body budget."""
        if not request.content_type.startswith("multipart/"):
            raise BadRequest("Upload a file as multipart/form-data with `purpose` and `file`.")
        file_id = new_id("file-")
        try:
            async with asyncio.timeout(self._upload_timeout):
                purpose, name = await self._form(request, file_id, tenant)
            if purpose != "batch":
                raise BadRequest("Only files of purpose `batch` are kept here.", param="purpose")
            if name is None:
                raise BadRequest("The form has no `file` part.", param="file")
        except BaseException as exc:
            await asyncio.to_thread(self._store.drop_parts, file_id, tenant)
            if isinstance(exc, TimeoutError):
                raise RequestTimeout("The file did not arrive in time.") from None
            raise
        ttl = self._cfg.result_ttl_s
        stored = await asyncio.to_thread(self._store.seal_file, file_id, tenant, purpose, name, ttl)
        return _json(file_json(stored))

    async def _form(
        self, request: web.Request, file_id: str, tenant: str | None
    ) -> tuple[str | None, str | None]:
        """The form's purpose and file name (None: no file), the file stored."""
        purpose, name = None, None
        form = await request.multipart()
        async for part in form:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.read_chunk(_PURPOSE_BYTES)).decode("utf-8", "replace")
                purpose = purpose.strip()
            elif part.name == "file" and name is None:
                name = part.filename or "upload.jsonl"
                await self._store_parts(part, file_id, tenant)
        return purpose, name

    async def _store_parts(self, part: BodyPartReader, file_id: str, tenant: str | None) -> None:
        """Store the file part `PIECE_BYTES` at a time; 413 past `max_file_bytes` or
        past the tenant's `max_tenant_file_bytes`."""
        cfg, bodies = self._cfg, self._body.bodies
        most, held = cfg.max_file_bytes, _PIECE_HELD
        size, n, piece = 0, 0, bytearray()
        bodies.take(held)
        try:
            while chunk := await part.read_chunk(_UPLOAD_CHUNK):
                size += len(chunk)
                if size > most:
                    raise PayloadTooLarge(f"A batch input file is at most {most} bytes.")
                piece += chunk
                if len(piece) >= PIECE_BYTES:
                    await self._put_part(file_id, tenant, n, piece)
                    n, piece = n + 1, bytearray()
            if piece:
                await self._put_part(file_id, tenant, n, piece)
        finally:
            bodies.give(held)

    async def _put_part(self, file_id: str, tenant: str | None, n: int, piece: bytearray) -> None:
        cfg = self._cfg
        quota = cfg.max_tenant_file_bytes
        if not await asyncio.to_thread(
            self._store.put_part, file_id, tenant, n, bytes(piece), cfg.result_ttl_s, quota
        ):
            raise PayloadTooLarge(
                f"The files uploaded under this tenant would pass the jobs' "
                f"max_tenant_file_bytes quota of {quota} bytes: delete some first."
            )

    async def _file(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        return _json(file_json(await _found(request, tenant, self._store.file, "file")))

    async def _files(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        """The tenant's files, newest first (`purpose`, `after`, `limit` as OpenAI's)."""
        after, limit = _paging(request, _FILES_LIMIT)
        purpose = request.query.get("purpose")
        page = await asyncio.to_thread(self._store.files, tenant, purpose, after, limit)
        return _json(files_json(page))

    async def _delete_file(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        file_id = request.match_info["id"]
        if not await asyncio.to_thread(self._store.delete_file, file_id, tenant):
            raise _absent("file", file_id)
        return _json(deleted_json(file_id))

    async def _content(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        """The file's bytes, streamed a piece at a time as the store gives them: one
        piece is held, in the body budget."""
        layout = await _found(request, tenant, self._store.layout, "file")
        bodies = self._body.bodies
        bodies.take(_PIECE_HELD)
        try:
            return await self._send(request, layout)
        finally:
            bodies.give(_PIECE_HELD)

    async def _send(self, request: web.Request, layout: Layout) -> web.StreamResponse:
        """Write the file's pieces; a client gone stops the reads. A file gone midway,
        or a store failing then, cuts the answer short of its length."""
        file_id = request.match_info["id"]
        answer = web.StreamResponse(headers={"Content-Type": "application/jsonl"})
        answer.content_length = layout.size
        await answer.prepare(request)
        for n in range(layout.pieces()):
            try:
                piece = await asyncio.to_thread(self._store.piece, file_id, layout, n)
            except KvrouteError:
                piece = None
            if piece is None:
                if request.transport is not None:
                    request.transport.close()
                return answer
            try:
                await answer.write(piece)
            except ConnectionError:
                return answer  # the client went: nothing more to read
            del piece  # the next piece is read with this one let go
        await answer.write_eof()
        return answer

    # batches
    async def _create_batch(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        try:
            asked = _BATCH_REQUEST.decode(await self._read(request))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadRequest(f"Invalid batch request: {exc}") from None
        if asked.endpoint not in KINDS:
            endpoints = ", ".join(KINDS)
            raise BadRequest(f"endpoint must be one of {endpoints}", param="endpoint")
        if asked.completion_window != WINDOW:
            raise BadRequest(f"completion_window must be {WINDOW!r}", param="completion_window")
        store = self._store
        stored = await asyncio.to_thread(store.file, asked.input_file_id, tenant)
        if stored is None or stored.purpose != "batch":
            raise _absent("batch input file", asked.input_file_id)
        bodies = self._body.bodies
        held = min(stored.size, bodies.limit)  # a file larger than the budget runs alone
        bodies.take(held)
        try:
            batch, lines = await self._checked_batch(asked, tenant)
            await asyncio.to_thread(store.put_batch, batch, tenant, lines)
        finally:
            bodies.give(held)
        if lines:
            self._metrics.jobs_accepted.labels("batch").inc(len(lines))
        self._wake()
        return _json(batch_json(batch))

    async def _checked_batch(
        self, asked: _BatchRequest, tenant: str | None
    ) -> tuple[Batch, list[Line]]:
        """The batch `asked` for, and its input file's lines (none if it failed its
        check). The file is checked on the loop in slices, between other requests."""
        content = await asyncio.to_thread(self._store.content, asked.input_file_id, tenant)
        cfg = self._cfg
        lines, errors = await _sliced(
            checking_lines(content or b"", asked.endpoint, cfg.max_batch_lines, self._body.max_body)
        )
        metadata = None if asked.metadata is None else msgspec.json.encode(asked.metadata)
        batch = new_batch(
            asked.endpoint, asked.input_file_id, metadata, len(lines), errors, cfg.result_ttl_s
        )
        return batch, lines

    async def _batch(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        return _json(batch_json(await _found(request, tenant, self._store.batch, "batch")))

    async def _batches(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        """The tenant's batches, newest first (`after`, `limit` as OpenAI's)."""
        after, limit = _paging(request, _BATCHES_LIMIT)
        page = await asyncio.to_thread(self._store.batches, tenant, after, limit)
        return _json(batches_json(page))

    async def _cancel(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        """Lines not started are dropped; those running finish; the batch ends once they
        have (with an output file of what was done)."""
        batch_id = request.match_info["id"]
        store = self._store
        if await asyncio.to_thread(store.cancel_batch, batch_id, tenant):
            files = (new_id("file-"), new_id("file-"))
            ttl = self._cfg.result_ttl_s
            await asyncio.to_thread(store.settle, batch_id, files, write_outputs, ttl)
        return await self._batch(request, tenant)


def _not_allowed(
    allowed: list[str],
) -> Callable[[web.Request, str | None], Awaitable[web.StreamResponse]]:
    async def refuse(request: web.Request, _: str | None) -> web.StreamResponse:
        raise KvrouteError(
            f"{request.path} takes {', '.join(allowed)}, not {request.method}.", status=405
        )

    return refuse


async def _unknown(request: web.Request, _: str | None) -> web.StreamResponse:
    raise KvrouteError(f"No endpoint {request.path}.", status=404)


async def _sliced(steps: Generator[None, None, T]) -> T:
    """What `steps` returns, run on the loop in slices of about `_SLICE_S`: other
    requests run between them, and no thread contends for the GIL meanwhile."""
    clock = time.perf_counter
    began = clock()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        if clock() - began > _SLICE_S:
            await asyncio.sleep(0)
            began = clock()


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type=_JSON)


async def _found(
    request: web.Request, tenant: str | None, fetch: Callable[[str, str | None], T | None],
    what: str,
) -> T:  # fmt: skip
    """What `fetch` finds under the path's id for `tenant`; a 404 when nothing."""
    ident = request.match_info["id"]
    found = await asyncio.to_thread(fetch, ident, tenant)
    if found is None:
        raise _absent(what, ident)
    return found


def _paging(request: web.Request, limits: tuple[int, int]) -> tuple[str | None, int]:
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


def _absent(what: str, ident: str) -> KvrouteError:
    return KvrouteError(f"No {what} {ident!r}.", param="id", status=404)

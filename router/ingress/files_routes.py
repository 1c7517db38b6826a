"""OpenAI's Files API (with `jobs.enabled`), as the OpenAI SDK calls it: a batch input
file uploaded a piece at a time as it arrives, listed, read back streamed, deleted.
jobs_routes.py routes to it, with the caller's tenant.

  POST /v1/files (purpose batch)   GET /v1/files   GET, DELETE /v1/files/{id}
  GET /v1/files/{id}/content
"""

from __future__ import annotations

import asyncio

from aiohttp import BodyPartReader, web

from router.config import JobsConfig
from router.errors import BadRequest, KvrouteError, PayloadTooLarge, RequestTimeout
from router.ingress.body import BodyReader
from router.ingress.jobs_http import Guard, absent, found, json_answer, paging
from router.jobs.store import PIECE_BYTES, JobStore, Layout
from router.jobs.wire import deleted_json, file_json, files_json, new_id

_UPLOAD_CHUNK = 1 << 16
#: what an upload's or a download's piece holds of the body budget at most
_PIECE_HELD = PIECE_BYTES + _UPLOAD_CHUNK
#: a form's `purpose` past this is cut (it names one of a few purposes)
_PURPOSE_BYTES = 64
#: the listing's default and largest `limit`, as OpenAI's
_FILES_LIMIT = (10_000, 10_000)


class FileRoutes:
    """The file endpoints over `store`; an upload must arrive within `upload_timeout`."""

    def __init__(
        self, cfg: JobsConfig, store: JobStore, body: BodyReader, upload_timeout: float
    ) -> None:
        self._cfg = cfg
        self._store = store
        self._body = body
        self._upload_timeout = upload_timeout

    def endpoints(self, guarded: Guard) -> list[web.RouteDef]:
        return [
            web.post("/v1/files", guarded(self._upload)),
            web.get("/v1/files", guarded(self._files)),
            web.get("/v1/files/{id}", guarded(self._file)),
            web.delete("/v1/files/{id}", guarded(self._delete_file)),
            web.get("/v1/files/{id}/content", guarded(self._content)),
        ]

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
        return json_answer(file_json(stored))

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
        return json_answer(file_json(await found(request, tenant, self._store.file, "file")))

    async def _files(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        """The tenant's files, newest first (`purpose`, `after`, `limit` as OpenAI's)."""
        after, limit = paging(request, _FILES_LIMIT)
        purpose = request.query.get("purpose")
        page = await asyncio.to_thread(self._store.files, tenant, purpose, after, limit)
        return json_answer(files_json(page))

    async def _delete_file(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        file_id = request.match_info["id"]
        if not await asyncio.to_thread(self._store.delete_file, file_id, tenant):
            raise absent("file", file_id)
        return json_answer(deleted_json(file_id))

    async def _content(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        """The file's bytes, streamed a piece at a time as the store gives them: one
        piece is held, in the body budget."""
        layout = await found(request, tenant, self._store.layout, "file")
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

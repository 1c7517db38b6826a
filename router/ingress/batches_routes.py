"""OpenAI's Batch API (with `jobs.enabled`), as the OpenAI SDK calls it: a batch made of
a stored input file, its lines checked on the loop in slices and stored as jobs at once;
listed, read, cancelled. jobs_routes.py routes to it, with the caller's tenant.

  POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from typing import Annotated, TypeVar

import msgspec
from aiohttp import web

from router.config import JobsConfig
from router.errors import BadRequest
from router.ingress.body import BodyReader
from router.ingress.jobs_http import Guard, absent, found, json_answer, paging, read_body
from router.jobs.store import Batch, JobStore, Line
from router.jobs.wire import (
    KINDS,
    WINDOW,
    batch_json,
    batches_json,
    checking_lines,
    new_batch,
    new_id,
    write_outputs,
)
from router.metrics import Metrics

T = TypeVar("T")
#: the listing's default and largest `limit`, as OpenAI's
_BATCHES_LIMIT = (20, 100)
#: the longest a batch input file's check holds the loop at a time, seconds
_SLICE_S = 0.002


class _BatchRequest(msgspec.Struct):
    input_file_id: str
    endpoint: str
    completion_window: str
    #: as OpenAI allows: at most 16 pairs
    metadata: Annotated[dict[str, str], msgspec.Meta(max_length=16)] | None = None


_BATCH_REQUEST = msgspec.json.Decoder(_BatchRequest)


class BatchRoutes:
    """The batch endpoints over `store`; `wake` tells this worker's runner lines came."""

    def __init__(
        self,
        cfg: JobsConfig,
        store: JobStore,
        wake: Callable[[], None],
        body: BodyReader,
        metrics: Metrics,
    ) -> None:
        self._cfg = cfg
        self._store = store
        self._wake = wake
        self._body = body
        self._metrics = metrics

    def endpoints(self, guarded: Guard) -> list[web.RouteDef]:
        return [
            web.post("/v1/batches", guarded(self._create_batch)),
            web.get("/v1/batches", guarded(self._batches)),
            web.get("/v1/batches/{id}", guarded(self._batch)),
            web.post("/v1/batches/{id}/cancel", guarded(self._cancel)),
        ]

    async def _create_batch(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        try:
            asked = _BATCH_REQUEST.decode(await read_body(self._body, request))
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
            raise absent("batch input file", asked.input_file_id)
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
        return json_answer(batch_json(batch))

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
        return json_answer(batch_json(await found(request, tenant, self._store.batch, "batch")))

    async def _batches(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        """The tenant's batches, newest first (`after`, `limit` as OpenAI's)."""
        after, limit = paging(request, _BATCHES_LIMIT)
        page = await asyncio.to_thread(self._store.batches, tenant, after, limit)
        return json_answer(batches_json(page))

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

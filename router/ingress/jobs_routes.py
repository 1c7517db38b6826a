"""The job endpoints (with `jobs.enabled`): single async requests here, and OpenAI's
Files and Batch API as the OpenAI SDK calls them (files_routes.py, batches_routes.py).
Each is the caller's tenant's alone (with auth on, a token that names no tenant has a
namespace of its own: `Authenticator.owner`): another's job, file or batch is a 404, as
an absent one is. Every answer under their paths needs a token.

  POST /v1/async/{chat/completions,completions,embeddings}   202, an id and a status URL
       (X-Kvroute-Webhook: URL, to have the status POSTed there when it ends)
  GET  /v1/async/{id}                                         its status, and its answer
  /v1/files...   files_routes.py
  /v1/batches... batches_routes.py
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from aiohttp import web

from router.config import JobsConfig
from router.errors import KvrouteError, PayloadTooLarge
from router.ingress.batches_routes import BatchRoutes
from router.ingress.body import BodyReader
from router.ingress.files_routes import FileRoutes
from router.ingress.jobs_http import JSON, Handler, TenantHandler, found, json_answer, read_body
from router.ingress.relay import refused
from router.jobs.store import JobStore
from router.jobs.webhooks import WEBHOOK_HEADER, checked_webhook
from router.jobs.wire import KINDS, checked_body, job_json, new_id
from router.metrics import Metrics

Tenant = Callable[[Mapping[str, str]], str | None]
#: /v1/async/chat/completions runs /v1/chat/completions later
_ASYNC = "/v1/async"
#: the paths under which every answer needs a token
_ROOTS = (_ASYNC, "/v1/files", "/v1/batches")


class JobRoutes:
    """The job endpoints over `store`, each for the caller's tenant; `wake` tells this
    worker's runner a job came."""

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
        self._files = FileRoutes(cfg, store, body, upload_timeout)
        self._batches = BatchRoutes(cfg, store, wake, body, metrics)

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
            *self._files.endpoints(self._guarded),
            *self._batches.endpoints(self._guarded),
        ]

    def _guarded(self, handler: TenantHandler) -> Handler:
        """`handler` for the caller's tenant (401 without a valid token), its refusals
        answered in OpenAI's error shape."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request, self._tenant(request.headers))
            except KvrouteError as err:
                return await refused(request, err)

        return guarded

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
            status=202, body=job_json(job, url), content_type=JSON, headers={"Location": url}
        )

    async def _inline_body(self, request: web.Request) -> bytes:
        """The body, at most `max_inline_bytes` (413 past it, before reading it all)."""
        most = self._cfg.max_inline_bytes
        too_large = PayloadTooLarge(f"An async request's body is at most {most} bytes.")
        if (request.content_length or 0) > most:
            raise too_large
        body = await read_body(self._body, request)
        if len(body) > most:
            raise too_large
        return body

    async def _job(self, request: web.Request, tenant: str | None) -> web.StreamResponse:
        job = await found(request, tenant, self._store.get, "async job")
        return json_answer(job_json(job, f"/v1/async/{job.id}"))


def _not_allowed(allowed: list[str]) -> TenantHandler:
    async def refuse(request: web.Request, _: str | None) -> web.StreamResponse:
        raise KvrouteError(
            f"{request.path} takes {', '.join(allowed)}, not {request.method}.", status=405
        )

    return refuse


async def _unknown(request: web.Request, _: str | None) -> web.StreamResponse:
    raise KvrouteError(f"No endpoint {request.path}.", status=404)

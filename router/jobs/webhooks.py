"""Webhooks: when an async job that named one ends, its status (the body of
`GET /v1/async/{id}`, answer included) is POSTed to the URL it named.

A delivery is due in the database, not in memory: the job's row holds the webhook's
state and when it is next due, so one that failed, or whose worker died mid-delivery,
is tried again after a restart too. A 2xx answer delivers it; anything else (another
status, no connection, no answer within `webhook_timeout_s`) is retried
`webhook_retries` times, each after twice the wait of the one before, then it is given
up as `failed`. At least once: a receiver may see a delivery twice.
"""

from __future__ import annotations

import asyncio

import aiohttp
from yarl import URL

from router import log
from router.config import JobsConfig, webhook_target
from router.errors import BadRequest
from router.jobs.store import Job, JobStore
from router.jobs.wire import job_json
from router.metrics import Metrics

WEBHOOK_HEADER = "X-Kvroute-Webhook"
#: where a bare host of `webhook_hosts` may be reached
_DEFAULT_PORTS = {"http": 80, "https": 443}


def checked_webhook(url: str, cfg: JobsConfig) -> str:
    """`url`, if the router may POST there: http(s), to a host and port that
    `webhook_hosts` names; else BadRequest."""
    try:
        parsed = URL(url) if url.isascii() and url.isprintable() else None
    except ValueError:
        parsed = None
    if parsed is None or parsed.scheme not in _DEFAULT_PORTS or not parsed.host:
        raise BadRequest(f"{WEBHOOK_HEADER} must be an http(s) URL.", param=WEBHOOK_HEADER)
    allowed = {webhook_target(entry) for entry in cfg.webhook_hosts}
    default = parsed.port == _DEFAULT_PORTS[parsed.scheme]
    if (parsed.host, parsed.port) not in allowed and not (
        default and (parsed.host, None) in allowed
    ):
        raise BadRequest(
            f"{WEBHOOK_HEADER}: {parsed.host}:{parsed.port} is not among the jobs' webhook_hosts.",
            param=WEBHOOK_HEADER,
        )
    return url


class Deliveries:
    """Delivers the due webhooks, `webhook_concurrency` at a time per worker."""

    def __init__(self, cfg: JobsConfig, store: JobStore, metrics: Metrics) -> None:
        self._cfg = cfg
        self._store = store
        self._metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._sending: set[asyncio.Task] = set()

    async def deliver_due(self) -> bool:
        """Start delivering the next due webhook, if there is one (whether there was),
        once fewer than `webhook_concurrency` deliveries are under way here."""
        while len(self._sending) >= self._cfg.webhook_concurrency:
            await asyncio.wait(self._sending, return_when=asyncio.FIRST_COMPLETED)
        job = await asyncio.to_thread(self._store.due_hook, self._cfg.webhook_timeout_s * 2)
        if job is None:
            return False
        task = asyncio.create_task(self._deliver(job), name=f"kvroute-webhook-{job.id}")
        self._sending.add(task)
        task.add_done_callback(self._sent)
        return True

    def _sent(self, task: asyncio.Task) -> None:
        self._sending.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.requests_failed.warning("a webhook's delivery failed: %r", exc)

    async def _deliver(self, job: Job) -> None:
        """One attempt, and what it came to (delivered, to retry, or given up)."""
        cfg = self._cfg
        delivered = await self._post(job)
        tries = job.hook_attempts + 1
        if delivered:
            state, wait, result = "delivered", 0.0, "delivered"
        elif tries > cfg.webhook_retries:
            state, wait, result = "failed", 0.0, "failed"
            log.requests_failed.warning("job %s: its webhook failed %d times", job.id, tries)
        else:
            state, wait = "pending", cfg.webhook_backoff_s * 2 ** (tries - 1)
            result = "retried"
        await asyncio.to_thread(self._store.hook_tried, job.id, state, wait)
        self._metrics.webhooks.labels(result).inc()

    async def _post(self, job: Job) -> bool:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self._cfg.webhook_timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout)
        body = job_json(job._replace(webhook=None), f"/v1/async/{job.id}")
        headers = {"Content-Type": "application/json", "X-Kvroute-Job": job.id}
        try:
            async with (
                asyncio.timeout(self._cfg.webhook_timeout_s),
                self._session.post(
                    job.webhook, data=body, headers=headers, allow_redirects=False
                ) as r,
            ):
                return 200 <= r.status < 300
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def close(self) -> None:
        """Stop the deliveries under way (each stays due: it is tried again)."""
        for task in self._sending:
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

"""How a worker of several follows the collector (router/control/collector.py), which
checks the backends once for the whole router.

At start the worker waits, bounded, for the collector's feed, its first verdicts and
the edits it replays, so the first requests see the router's fleet. Later, a change the
collector applies too (a SIGHUP, an edit broadcast by worker 0, discovered backends)
takes the collector's verdicts on the backends it adds.
"""

from __future__ import annotations

import asyncio
import contextlib

from router import log
from router.control.node import STARTUP_POLL_SECONDS
from router.fleet.backends import Backend
from router.fleet.health import Verdicts
from router.telemetry.worker_feed import WorkerTelemetry

_FEED_JOIN_SECONDS = 10.0  # a worker waits this long for the collector's feed to be live
_VERDICT_GRACE = 1.0  # beyond the collector's own admission checks, before checking itself


async def join_collector(
    feed: WorkerTelemetry, verdicts: Verdicts, edits: set[asyncio.Task]
) -> None:
    """Wait for the collector's feed, its verdicts and the replayed `edits` (bounded)."""
    if not await feed.joined(_FEED_JOIN_SECONDS):
        log.server.warning("the collector's feed is not live yet: edits may be missed")
    # the collector's first round is bounded; the edits it replays came before
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(verdicts.adopted.wait(), 2 * STARTUP_POLL_SECONDS)
    if edits:  # applied before serving (not cancelled if slow)
        await asyncio.wait(edits, timeout=STARTUP_POLL_SECONDS)


async def unjudged(
    verdicts: Verdicts, added: list[Backend], health_timeout: float
) -> list[Backend]:
    """The collector's verdicts given to `added`; returns the backends it said nothing
    of in time, the only ones this worker checks itself."""
    wait = max(health_timeout, STARTUP_POLL_SECONDS) + _VERDICT_GRACE
    return await verdicts.take(added, wait)

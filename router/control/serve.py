"""Run one router process until it is told to stop."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys

from router import log
from router.config import Config
from router.context import WorkerContext
from router.control.collector import Collector
from router.control.heap import keep_freed_memory
from router.control.reload import ConfigSource
from router.control.worker import Router


def hold_reloads() -> None:
    """Hold SIGHUP (blocked, so pending, not lost) until `serve` can reload: its default
    action would end a process still starting. Children spawned meanwhile inherit the
    hold, and `serve` in each releases it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})


#: how long a thread holds the interpreter while another waits for it (Python's default
#: is 5 ms): a thread building /metrics or compressing an answer then holds up the event
#: loop 1 ms at a time. Small requests while /metrics was scraped back to back at 64
#: backends: P99 15.4 ms at 5 ms, 5.4 ms at 1 ms (docs/performance.md).
GIL_SLICE = 0.001


async def serve(
    config: Config, source: ConfigSource | None = None, context: WorkerContext | None = None
) -> None:
    """Run until SIGINT or SIGTERM, then drain (`shutdown`); SIGHUP reopens the access
    log and reloads. With a `context`, this process is the collector or one worker of
    several."""
    keep_freed_memory()
    if context is not None and context.collector:
        node: Router | Collector = Collector(config, source, context)
    else:
        node = Router(config, source, context)
    await node.start()
    # what start-up built lives until exit: keep it out of the collector's scans, and
    # collect the young generation less often (GC was ~10% of CPU at concurrency 64)
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    sys.setswitchinterval(GIL_SLICE)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, node.hangup)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # one held is a reload now
    try:
        await stop.wait()
    finally:
        log.server.info("shutting down: draining for up to %gs", config.shutdown.drain_seconds)
        await node.shutdown()

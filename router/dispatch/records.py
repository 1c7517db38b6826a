"""What requests leave behind beside the metrics: the access log's lines, the spans and
the data capture's records.

All are optional, opened and closed with the worker: the tracer when it is built (so a
config asking for traces without the SDK fails at once, `--check` included), the access
log and the capture when it starts serving (their files are opened then), and all
flushed at its stop.
"""

from __future__ import annotations

import asyncio

from router.access_log import AccessLog
from router.capture import Capture
from router.config import Config
from router.dispatch.tracing import Tracing
from router.metrics import Metrics
from router.usage_records import UsageRecords


class Records:
    """A worker's access log, tracer, capture and usage records, when the config turns
    them on."""

    def __init__(self, config: Config, span_exporter=None) -> None:
        """`span_exporter`: where spans go (an SDK SpanExporter) instead of OTLP."""
        self._config = config
        self.tracing = Tracing(config.tracing, span_exporter) if config.tracing.enabled else None
        self.access_log: AccessLog | None = None
        self.capture: Capture | None = None
        self.usage: UsageRecords | None = None
        self._flusher: asyncio.Task | None = None

    def open(self, metrics: Metrics) -> None:
        """Open the access log and the capture (ConfigError if a file cannot be opened)."""
        cfg = self._config
        if cfg.access_log.enabled:
            dropped = metrics.access_log_dropped.inc
            self.access_log = AccessLog(cfg.access_log.path, cfg.log_format, dropped)
        if cfg.capture.enabled:
            lost = metrics.capture_dropped
            self.capture = Capture(
                cfg.capture, lambda why: lost.labels(why).inc(), metrics.capture_written.inc
            )
            self.capture.start()
        if cfg.usage.records:
            self.usage = UsageRecords(cfg.usage.path, cfg.usage.interval_s)
            self._flusher = asyncio.create_task(self.usage.run(), name="kvroute-usage")

    def reopen(self) -> None:
        """The access log in a file opened anew (logrotate moved the old one)."""
        if self.access_log is not None:
            self.access_log.reopen()

    async def close(self) -> None:
        """Write the last lines and export the last spans, once nothing is in flight; a
        collector's answer is awaited in a thread, never on the loop."""
        if self.access_log is not None:
            self.access_log.close()
            self.access_log = None
        if self.capture is not None:
            await asyncio.to_thread(self.capture.close)
            self.capture = None
        if self.usage is not None:
            self._flusher.cancel()
            await self.usage.flush()
            self.usage = None
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.close)
            self.tracing = None

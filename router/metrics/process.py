"""The serving process: its event loop's lag, and what /metrics exports of the
processes. With several workers (router/control/supervisor.py) every process writes its
counters and histograms to prometheus-client's multiprocess files and the page sums
them over all processes, dead ones included (counters never go back); gauges are
"livemax" (a dead process's gauge disappears). Process metrics (CPU, memory, fds) are
per process and are left out there. The collector merges the files, and a worker's page
is its merge plus the worker's own part (router/control/metrics_relay.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric

_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LAG_INTERVAL = 0.25  # seconds between two looks at the event loop's lag


class ProcessMetrics:
    """The process metrics of `Metrics`."""

    def _declare_process(self, r: CollectorRegistry) -> None:
        self.loop_lag = Histogram(
            "kvroute_event_loop_lag_seconds",
            "How late a serving process's event loop ran a timer: how long a new request "
            "may wait for its turn (docs/performance.md, New requests while streams flow)",
            buckets=_LAG_BUCKETS,
            registry=r,
        )

    async def watch_loop_lag(self) -> None:
        """Every LAG_INTERVAL, how late the loop woke this task (a timer): four wake-ups
        a second, nothing on the request path."""
        loop = asyncio.get_running_loop()
        observe = self.loop_lag.observe
        while True:
            due = loop.time() + LAG_INTERVAL
            await asyncio.sleep(LAG_INTERVAL)
            observe(max(0.0, loop.time() - due))


def exported(multiprocess: bool) -> CollectorRegistry:
    """What /metrics shows beside the metrics' own registry (one process) or the
    processes' files (several: router/metrics/merged.py): the process's and the
    platform's numbers, the release."""
    out = CollectorRegistry()
    if not multiprocess:
        ProcessCollector(registry=out)
    PlatformCollector(registry=out)
    out.register(_BuildInfo())
    return out


def release() -> str:
    """The installed kvroute release ("unknown" when run from a tree never installed)."""
    try:
        return version("kvroute")
    except PackageNotFoundError:
        return "unknown"


class _BuildInfo:
    """`kvroute_build_info{version} 1`: which release answers (dashboards, alerts on
    a mixed fleet during a rollout)."""

    def __init__(self) -> None:
        self._version = release()

    def collect(self) -> Iterable[Metric]:
        info = GaugeMetricFamily(
            "kvroute_build_info", "1, labelled with the kvroute release", labels=["version"]
        )
        info.add_metric([self._version], 1.0)
        return [info]

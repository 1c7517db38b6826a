"""Recording on the request path without prometheus-client's per-call cost: its
`labels()` validates its arguments and takes a lock on every call, and with several
workers each `observe` writes the mmap'd multiprocess file twice."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import Histogram
from prometheus_client.metrics import MetricWrapperBase


class Labelled:
    """A labelled metric's children by label values, each looked up once. The values
    come from small sets (backend names, strategies, statuses, reasons), as in the
    registry."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: MetricWrapperBase) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], MetricWrapperBase] = {}

    def __call__(self, *values: str) -> MetricWrapperBase:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class Tally:
    """One stream's observations of a histogram child, added to it in one go by `flush`.

    `Histogram.observe` takes a lock and, with several workers, writes the mmap'd
    multiprocess file twice per call: once per SSE event that was ~6% of a streaming
    worker's CPU. Here an observation is a bisect and two adds. Reads prometheus-client's
    child internals (`_upper_bounds`, `_buckets`, `_sum`), stable since 0.4.
    """

    __slots__ = ("_bounds", "_child", "_counts", "_total")

    def __init__(self, child: Histogram) -> None:
        self._child = child
        self._bounds = child._upper_bounds
        self._counts = [0] * len(self._bounds)
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1  # the first bound >= value
        self._total += value

    def flush(self) -> None:
        """Add what was counted since the last flush to the histogram."""
        buckets = self._child._buckets
        for i, n in enumerate(self._counts):
            if n:
                buckets[i].inc(n)
                self._counts[i] = 0
        self._child._sum.inc(self._total)
        self._total = 0.0

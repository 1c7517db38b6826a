"""The fast path's keep-alive timeout: a connection idle for `keepalive` seconds is
closed, with one timer per idle period, re-armed lazily (a request only notes the time
its idle period began, instead of cancelling and making a timer)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class IdleTimer:
    """Calls `close` once `keepalive` seconds passed without a request."""

    __slots__ = ("_busy", "_close", "_idle_at", "_keepalive", "_loop", "_timer")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        keepalive: float,
        busy: Callable[[], bool],
        close: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._keepalive = keepalive
        self._busy = busy  # True while a request is served (or its body read)
        self._close = close
        self._idle_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """An idle period begins now."""
        self._idle_at = time.monotonic()
        if self._timer is None:
            self._timer = self._loop.call_later(self._keepalive, self._check)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if self._busy():
            return  # the end of its answer starts the next idle period
        left = self._idle_at + self._keepalive - time.monotonic()
        if left > 0:
            self._timer = self._loop.call_later(left, self._check)
        else:
            self._close()

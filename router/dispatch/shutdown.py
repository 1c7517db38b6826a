"""Shutdown: the exchanges in flight, whichever ingress opened them, get their time to
end; then each one left is cut where it is (its task is cancelled, and the cancellation
comes out of `Dispatcher.exchange` as ShuttingDown), so its ingress ends the answer as
it ends any failure: a 503, or an SSE error event and `[DONE]` after a stream began, or
a gRPC status. Cost per request: the task goes into a set and out of it.
"""

from __future__ import annotations

import asyncio
import contextlib

from router.errors import ShuttingDown


class OpenExchanges:
    """The tasks whose exchange is open: what `drain` waits for, then cuts."""

    __slots__ = ("_cut", "_idle", "_tasks")

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._idle: asyncio.Future[None] | None = None  # `drain` waits: set when none is open
        self._cut = False  # `drain` cut the exchanges left: new ones are refused

    def enter(self, task: asyncio.Task) -> None:
        """Note the exchange of `task`; ShuttingDown once the drain cut."""
        if self._cut:
            raise shutting_down()
        self._tasks.add(task)

    def leave(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        idle = self._idle
        if idle is not None and not self._tasks and not idle.done():
            idle.set_result(None)

    def was_cut(self, task: asyncio.Task) -> bool:
        """Is `task`'s cancellation the drain's cut? Not if the client left too: then it
        was cancelled twice, and it stays cancelled."""
        return self._cut and not task.uncancel()

    async def drain(self, timeout: float, grace: float) -> None:
        """Let the exchanges in flight end within `timeout` seconds, then cut the ones
        left and refuse new ones; return once the cut ones have ended, or after `grace`."""
        if self._tasks:
            self._idle = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle, timeout)
        self._cut = True
        cut = set(self._tasks)
        for task in cut:
            task.cancel()
        if cut:
            await asyncio.wait(cut, timeout=grace)


def shutting_down() -> ShuttingDown:
    """The error of an exchange the drain cut or refused."""
    return ShuttingDown("The router is shutting down; retry the request.", retry_after=1)

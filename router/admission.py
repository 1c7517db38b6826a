"""Admission: a router-wide concurrency limit with a short FIFO wait queue, and per-tenant caps.

`enter` admits a request at once while fewer than `max_concurrent_requests` are active;
beyond that it waits in a FIFO queue of at most `queue_size` requests for up to
`queue_timeout` seconds. A full queue, or a wait that times out, is a 429 with
`Retry-After`, so a burst is smoothed instead of refused and an overload is refused
fast instead of piling up. A tenant at `max_concurrent_per_tenant` (admitted and
queued together) is refused at once: one tenant can never fill the queue.

Invariants: `active` counts admitted requests exactly. A freed slot is handed straight
to the oldest waiter (so `active` does not dip and a newcomer cannot barge past the
queue); a waiter that gives up (timeout, client gone) after its slot was handed over
passes it on. `enter` returns what `leave` must give back, so a reload that changes
the caps in between cannot unbalance the per-tenant counts. Cost: O(1) per request,
O(queue) only when a waiter gives up.
"""

from __future__ import annotations

import asyncio
from collections import deque

from router.config import LimitsConfig
from router.errors import Overloaded


class Admission:
    def __init__(self, limits: LimitsConfig) -> None:
        self.limits = limits
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tenants: dict[str, int] = {}

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def configure(self, limits: LimitsConfig) -> None:
        """New limits (reload); waiters that now fit are admitted."""
        self.limits = limits
        while self.active < limits.max_concurrent_requests and self._wake():
            self.active += 1

    async def enter(self, tenant: str | None) -> str | None:
        """Take a slot (waiting if need be) or raise Overloaded; returns the tenant key held."""
        held = self._take_tenant(tenant)
        try:
            await self._take_slot()
        except BaseException:
            self._give_tenant(held)
            raise
        return held

    def leave(self, held: str | None) -> None:
        self._give_tenant(held)
        if not self._wake():  # else the slot changed hands and `active` stays
            self.active -= 1

    def _wake(self) -> bool:
        """Hand a slot to the oldest live waiter; False if there is none."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # a cancelled one is still queued until its task runs
                waiter.set_result(None)
                return True
        return False

    async def _take_slot(self) -> None:
        limits = self.limits
        if self.active < limits.max_concurrent_requests and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= limits.queue_size:
            raise Overloaded("The router is at its concurrent request limit.", retry_after=1)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(limits.queue_timeout):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.leave(None)  # handed a slot just as we gave up: pass it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise Overloaded(
                    "The router is at its concurrent request limit; the wait timed out.",
                    retry_after=1,
                ) from None
            raise

    def _take_tenant(self, tenant: str | None) -> str | None:
        cap = self.limits.max_concurrent_per_tenant
        if tenant is None or cap is None:
            return None
        count = self._tenants.get(tenant, 0)
        if count >= cap:
            raise Overloaded(
                f"Tenant `{tenant}` is at its limit of {cap} concurrent requests.", retry_after=1
            )
        self._tenants[tenant] = count + 1
        return tenant

    def _give_tenant(self, held: str | None) -> None:
        if held is None:
            return
        count = self._tenants[held] - 1
        if count:
            self._tenants[held] = count
        else:
            del self._tenants[held]  # bounded: only tenants with requests in flight

"""The policies' pending upkeep, done a slice per event-loop turn between requests.

A KV-aware pick of a new long prompt inserts only its first block keys into the prefix
index and leaves the rest pending (policies/kv_aware/upkeep.py, `Policy.pace`): inserting
a 100,000-token prompt's ~2,048 keys at once holds the loop ~0.5-2.8 ms, which every small
request arriving behind it waits out. Here each slice runs in its own `call_soon`
callback, so the loop polls its sockets between two slices.
"""

from __future__ import annotations

import asyncio

from policies import Policy

__all__ = ["Upkeep"]


class Upkeep:
    """The policies with pending upkeep, drained one slice per loop turn."""

    __slots__ = ("_policies", "_scheduled")

    def __init__(self) -> None:
        self._policies: dict[Policy, None] = {}
        self._scheduled = False

    def note(self, policy: Policy) -> None:
        """After `policy` picked: drain what it left pending, from the next loop turn (at
        once without a running loop)."""
        if not policy.deferred:
            return
        self._policies[policy] = None
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            while policy.drain():
                pass
            return
        self._scheduled = True
        loop.call_soon(self._step, loop)

    def _step(self, loop: asyncio.AbstractEventLoop) -> None:
        """One slice of the first policy's upkeep; the next turn's scheduled while any is
        left (even if this one raised, so the drain never stalls)."""
        policy = next(iter(self._policies))
        more = False
        try:
            more = policy.drain()
        finally:
            if not more:
                del self._policies[policy]
            if self._policies:
                loop.call_soon(self._step, loop)
            else:
                self._scheduled = False

"""The dispatcher's drain of a policy's pending upkeep: a slice per loop turn."""

from __future__ import annotations

import asyncio

from hashing.blocks import chain, root_key
from policies import FleetView, RouteRequest, create
from policies.kv_aware import KvAwareParams
from router.dispatch.upkeep import Upkeep


class B:
    name = "a"
    inflight = 0
    weight = 1
    queued_tokens = 0
    waiting = 0.0
    speed = None


def _long_pick():
    """A paced KV_AWARE policy right after its pick of a new 2,048-block prompt."""
    policy = create(KvAwareParams(seed=1))
    policy.pace(256)
    members = (B(),)
    ids = list(range(2048 * 16))
    req = RouteRequest("m", 0, chain(root_key("m", None), ids, 16), len(ids))
    policy.pick(req, FleetView(members, members, frozenset({"a"})))
    return policy


def _held(policy) -> int:
    return policy.index.gpu.size("a")[1]


async def test_slices_run_one_per_loop_turn_until_all_are_in() -> None:
    policy, upkeep = _long_pick(), Upkeep()
    turns: list[int] = []
    upkeep.note(policy)
    assert _held(policy) == 256  # nothing more before the loop turns

    async def watch() -> None:
        while policy.deferred:
            turns.append(_held(policy))
            await asyncio.sleep(0)

    async with asyncio.timeout(5):
        await watch()
    assert _held(policy) == 2048
    assert len(set(turns)) > 2  # other tasks ran between the slices


def test_without_a_running_loop_the_rest_goes_in_at_once() -> None:
    policy = _long_pick()
    Upkeep().note(policy)
    assert _held(policy) == 2048 and not policy.deferred

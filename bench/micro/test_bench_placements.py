"""What sharing placements between workers adds to a KV_AWARE pick, as a ratio.

Run: .venv/bin/pytest bench/micro/test_bench_placements.py --benchmark-enable
Each round picks a backend for a new 8,000-token prompt (500 blocks, none cached) over
8 backends, so the pick places all 500 blocks: the costliest case for the shared table
(`place` stores two words per block; `held` probes each backend). The baseline in the
same group is the same pick in one process, with no sharing; the other adds the shared
table and its lock, uncontended (one worker's view). Rounds are bounded because
the broadcast batch of a loop turn is flushed only when the loop runs again.
"""

import asyncio
import itertools

from hashing.blocks import chain, root_key
from policies import FleetView, RouteRequest, create
from policies.kv_aware import KvAwareParams
from router.fleet.placements import PlacementTable

ROOT = root_key("m", None)
ROUNDS = 200


class _Backend:
    def __init__(self, name: str) -> None:
        self.name, self.weight, self.inflight, self.queued_tokens, self.waiting = name, 1, 0, 0, 0


MEMBERS = tuple(_Backend(f"b{i}") for i in range(8))
VIEW = FleetView(MEMBERS, MEMBERS, frozenset(b.name for b in MEMBERS))
PROMPTS = [
    RouteRequest("m", 0, chain(ROOT, [r * 10_000 + t for t in range(8000)], 16), 8000)
    for r in range(ROUNDS + 10)
]


def _policy(tmp_path, shared: bool):
    policy = create(KvAwareParams(seed=1))
    policy.on_fleet_change(MEMBERS)
    if shared:
        table = PlacementTable(tmp_path / "placements", 0, lambda payload: None, False)
        table.known(b.name for b in MEMBERS)
        policy.share(table)
    return policy


def _run(benchmark, policy) -> None:
    prompts = itertools.cycle(PROMPTS)

    async def measure() -> None:
        benchmark.pedantic(lambda: policy.pick(next(prompts), VIEW), rounds=ROUNDS, iterations=1)

    asyncio.run(measure())


def test_baseline_pick_in_one_process(benchmark, tmp_path) -> None:
    benchmark.group = "kv-aware-pick-new-8000-token-prompt"
    _run(benchmark, _policy(tmp_path, shared=False))


def test_pick_with_shared_placements(benchmark, tmp_path) -> None:
    benchmark.group = "kv-aware-pick-new-8000-token-prompt"
    _run(benchmark, _policy(tmp_path, shared=True))

"""What a new long prompt's keys cost the prefix index when it is full.

Run: .venv/bin/pytest bench/micro/test_bench_index_insert.py --benchmark-enable

A router in front of a busy fleet keeps every backend's speculative keys at its capacity,
so each new prompt's ~2,048 keys (a 32,000-token prompt, 16-token blocks) push as many
least recently used ones out: an insert into the table's id tables and a removal from
them per key (hashing/_block_table.c). `empty` learns the same prompts on a table with
room (no removal); `full` on 4 backends each at its capacity; `shared` the same over a
table in a file, as the router's workers map it. The baseline is a Python dict built
from the same keys, measured in the same run: compare the ratios, not the times.
"""

from __future__ import annotations

import itertools

import pytest

from hashing.prefix_index import PrefixIndex

BLOCK = 16
PROMPT_BLOCKS = 2048
BACKENDS = 4
CAPACITY = 200_000  # keys per backend: ~100 prompts each
ROUNDS = 400


def _keys(n: int) -> list[int]:
    """Prompt `n`'s block keys: new ones (the table mixes every key before it places it)."""
    start = (n + 1) * 1_000_000_007
    return list(range(start, start + PROMPT_BLOCKS))


def _index(mode: str, tmp_path) -> PrefixIndex:
    index = PrefixIndex(CAPACITY)
    if mode == "shared":
        index.share(str(tmp_path / "index-gpu"))
    if mode != "empty":
        for n in range(BACKENDS * CAPACITY // PROMPT_BLOCKS + BACKENDS):
            index.learn(f"b{n % BACKENDS}", _keys(ROUNDS + n), expires_at=1e12)
        assert index.size("b0")[1] == CAPACITY
    return index


def test_baseline_dict_of_the_keys(benchmark) -> None:
    prompts = itertools.count()
    benchmark.pedantic(
        dict.fromkeys, setup=lambda: ((_keys(next(prompts)), 1e12), {}), rounds=ROUNDS
    )


@pytest.mark.parametrize("mode", ["empty", "full", "shared"])
def test_learn_a_new_prompt(benchmark, mode: str, tmp_path) -> None:
    index = _index(mode, tmp_path)
    prompts = itertools.count()

    def prompt() -> tuple[tuple[str, list[int], float], dict]:
        n = next(prompts)
        if mode == "empty" and n % 20 == 0:
            for b in range(BACKENDS):
                index.cleared(f"b{b}")  # far from its capacity
        return (f"b{n % BACKENDS}", _keys(n), 1e12), {}

    benchmark.pedantic(index.learn, setup=prompt, rounds=ROUNDS)

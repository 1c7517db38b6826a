"""What a new long prompt's keys cost the prefix index when it is full.

Run: .venv/bin/pytest bench/micro/test_bench_index_insert.py --benchmark-enable

A router in front of a busy fleet keeps every backend's speculative keys at its capacity,
so each new prompt's ~2,048 keys (a 32,000-token prompt, 16-token blocks) push as many
least recently used ones out: an insert into the table's id tables and a removal from
them per key (hashing/_block_table.c). `empty` learns the same prompts on a table with
room (no removal); `full` on 4 backends each at its capacity; `shared` the same over a
table in a file, as the router's workers map it. The baseline is a Python dict built
from the same keys, measured in the same run: compare the ratios, not the times.

`test_learn_while_the_table_grows`: the slices of 256 keys the router's upkeep inserts
per event-loop turn, into a table filling from empty to 1.5M keys (its arrays and id
tables growing ten times over). Its max column is the slice that met a growth: what a
request behind it on the loop waits. The baseline is a dict filled the same way.
"""

from __future__ import annotations

import itertools
import os
import tempfile

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
        # past the capacity, and on until the last growth's id tables moved over
        for n in range(BACKENDS * CAPACITY // PROMPT_BLOCKS + 64):
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


SLICE = 256
SLICES = 6_000


def test_baseline_dict_while_it_grows(benchmark) -> None:
    table: dict[int, float] = {}
    slices = itertools.count()

    def slice_() -> tuple[tuple[dict, float], dict]:
        start = next(slices) * SLICE
        return (dict.fromkeys(range(start, start + SLICE)), 1e12), {}

    benchmark.pedantic(lambda keys, _: table.update(keys), setup=slice_, rounds=SLICES)


@pytest.mark.parametrize("mode", ["own", "shared"])
def test_learn_while_the_table_grows(benchmark, mode: str) -> None:
    index = PrefixIndex(SLICE * SLICES)
    run_dir = tempfile.TemporaryDirectory(dir="/dev/shm")  # the router's run directory's
    if mode == "shared":
        index.share(os.path.join(run_dir.name, "index-gpu"))
    slices = itertools.count()

    def slice_() -> tuple[tuple[str, list[int], float], dict]:
        n = next(slices)
        return (f"b{n % BACKENDS}", list(range(n * SLICE + 1, (n + 1) * SLICE + 1)), 1e12), {}

    with run_dir:
        benchmark.pedantic(index.learn, setup=slice_, rounds=SLICES)

"""TieredIndex: per-medium entries, placeholder stores, victim tiers, a shared tier."""

from __future__ import annotations

import msgspec
import pytest

from hashing.blocks import chain, root_key
from hashing.tiered_index import Tier, TieredIndex

ROOT = root_key("m", None)
IDS = list(range(128))  # eight blocks of 16
KEYS = chain(ROOT, IDS, 16)
ENGINE = [1000 + i for i in range(8)]
CPU = Tier("cpu", 2e-6)
REMOTE = Tier("remote", 2e-5, shared=True)


def tiered(*tiers: Tier) -> TieredIndex:
    return TieredIndex(tiers=tiers or (CPU,))


def store(index: TieredIndex, medium: str, first: int, last: int, backend: str = "a") -> bool:
    """A BlockStored with tokens of blocks first..last-1, chained from block first-1."""
    parent = ENGINE[first - 1] if first else None
    ids = IDS[first * 16 : last * 16]
    return index.stored(backend, medium, parent, ENGINE[first:last], ids, 16, ROOT)


def reached(index: TieredIndex, backend: str = "a") -> tuple[int, int, tuple[int, ...]]:
    """(GPU blocks, blocks reached with the tiers, per tier cumulative)."""
    gpu = index.gpu.longest_prefix(KEYS, backend)
    tiers = index.tier_blocks(KEYS, backend, gpu, index.reach())
    return gpu, (tiers[-1] if tiers else gpu), tiers


def test_each_medium_has_its_own_entries() -> None:
    index = tiered()
    assert store(index, "GPU", 0, 4)
    assert store(index, "cpu", 0, 8)
    assert reached(index) == (4, 8, (8,))
    assert index.tier_sizes("a") == {"cpu": 8}
    assert index.gpu.size("a") == (4, 0)


def test_a_gpu_eviction_leaves_the_cpu_copy_reachable() -> None:
    index = tiered()
    store(index, "GPU", 0, 8)
    assert index.placed("a", "CPU", ENGINE[4:8]) == 4  # offloaded tail: token-less events
    index.removed("a", "GPU", ENGINE[4:8])  # then evicted from the GPU
    assert reached(index) == (4, 8, (8,))  # the GPU holds a prefix, the CPU its tail
    index.removed("a", "cpu", ENGINE[6:8])
    assert reached(index) == (4, 6, (6,))
    index.removed("a", "GPU", ENGINE[:4])  # a removal applies to its medium only
    assert reached(index) == (0, 0, (0,))  # the CPU's blocks 4-5 are no prefix alone


def test_a_placeholder_without_a_known_block_stores_nothing() -> None:
    index = tiered()
    assert index.placed("a", "cpu", ENGINE[:2]) == 0
    assert index.placed("a", "GPU", ENGINE[:2]) == 0  # the GPU's placeholders carry nothing
    assert index.index_of("cpu").holder_keys() == 0


def test_a_tier_chain_continues_from_a_block_only_the_gpu_holds() -> None:
    index = tiered()
    store(index, "GPU", 0, 4)
    assert store(index, "cpu", 4, 8)
    assert reached(index) == (4, 8, (8,))


def test_the_tier_keeps_its_block_keys_after_the_gpu_forgot_them() -> None:
    index = tiered()
    store(index, "GPU", 0, 8)
    index.placed("a", "cpu", ENGINE)
    index.removed("a", "GPU", ENGINE)
    assert index.placed("a", "cpu", ENGINE[:1]) == 1  # resolved by the tier's own map
    index.removed("a", "cpu", ENGINE[7:])
    assert reached(index) == (0, 7, (7,))


@pytest.mark.parametrize("medium", ["STORAGE", "disk", "LocalDiskBackend"])
def test_unknown_media_are_ignored_and_counted(medium: str) -> None:
    index = tiered()
    assert not store(index, medium, 0, 4)
    index.removed("a", medium, ENGINE[:1])
    assert reached(index) == (0, 0, ())
    assert index.ignored == {medium.lower(): 2}


def test_ignored_names_are_bounded() -> None:
    index = tiered()
    for i in range(40):
        index.removed("a", f"medium-{i}", ENGINE[:1])
    assert len(index.ignored) == 17 and index.ignored["(other)"] == 24


def test_tiers_stack_cheapest_first() -> None:
    slow = Tier("storage", 1e-5)
    index = tiered(slow, CPU)
    assert [t.medium for t in index.tiers] == ["cpu", "storage"]
    store(index, "gpu", 0, 2)
    store(index, "storage", 0, 8)
    store(index, "cpu", 0, 5)
    assert reached(index) == (2, 8, (5, 8))


def test_a_shared_tier_is_reached_from_every_backend() -> None:
    index = tiered(CPU, REMOTE)
    store(index, "gpu", 0, 2, backend="b")
    store(index, "remote", 0, 6, backend="b")
    store(index, "cpu", 0, 3, backend="a")
    assert reached(index, "a") == (0, 6, (3, 6))
    assert reached(index, "c") == (0, 6, (0, 6))
    assert index.tier_holders(KEYS, 8, index.reach()) == {"a"}  # local tiers only


def test_cleared_and_forget_drop_every_medium() -> None:
    index = tiered()
    store(index, "gpu", 0, 4)
    store(index, "cpu", 0, 8)
    index.cleared("a")
    assert reached(index) == (0, 0, ())
    store(index, "cpu", 0, 8)
    index.forget("a")
    assert index.reach() == ()


def test_snapshot_restores_every_medium_through_msgpack() -> None:
    original, late = tiered(), tiered()
    store(original, "gpu", 0, 3)
    store(original, "cpu", 0, 8)
    late.restore("a", msgspec.msgpack.decode(msgspec.msgpack.encode(original.snapshot("a"))))
    assert reached(late) == (3, 8, (8,))
    late.removed("a", "cpu", ENGINE[5:])  # engine hashes came along
    assert reached(late) == (3, 5, (5,))

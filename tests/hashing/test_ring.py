"""hashing.ring: owners, walks, construction rules and pinned values of the hash ring."""

import itertools

import pytest

from hashing.ring import DEFAULT_VNODES, HashRing

THREE = [("a", 1), ("b", 2), ("c", 1)]
KEYS = [0, 1, 2**63, 2**64 - 1, 12345678901234567890, 0x2D06800538D394C2]


@pytest.mark.parametrize(
    ("members", "key", "owner", "walk"),
    [
        pytest.param(THREE, 0, 1, [1, 2, 0], id="key-zero"),
        pytest.param(THREE, 2**63, 0, [0, 1, 2], id="middle"),
        pytest.param(THREE, 2**64 - 1, 1, [1, 2, 0], id="wraps-past-the-top"),
        pytest.param([("only", 3)], 2**63, 0, [0], id="one-member"),
    ],
)
def test_golden_owner_and_walk(members, key, owner, walk):
    # Pinned: a change here re-routes prefixes and splits mixed-version replicas.
    ring = HashRing(members)
    assert ring.owner(key) == owner
    assert list(ring.walk(key)) == walk


@pytest.mark.parametrize("key", [pytest.param(k, id=f"key-{i}") for i, k in enumerate(KEYS)])
@pytest.mark.parametrize(
    "members",
    [
        pytest.param(THREE, id="weighted"),
        pytest.param([(f"10.0.0.{i}:8000", 1) for i in range(16)], id="sixteen"),
        pytest.param([("x", 1), ("y", 1)], id="two"),
    ],
)
def test_walk_yields_every_member_once_owner_first(members, key):
    ring = HashRing(members, vnodes=8)
    walk = list(ring.walk(key))
    assert sorted(walk) == list(range(len(members)))
    assert walk[0] == ring.owner(key)


def test_a_key_past_the_last_point_walks_like_key_zero():
    ring = HashRing([(f"m{i}", 1) for i in range(8)], vnodes=4)
    assert list(ring.walk(2**64 - 1)) == list(ring.walk(0))


def test_walk_is_lazy():
    ring = HashRing([(f"m{i}", 1) for i in range(64)])
    walk = ring.walk(2**40)
    assert next(walk) == ring.owner(2**40)
    assert next(walk) != ring.owner(2**40)


@pytest.mark.parametrize(
    "order",
    [pytest.param(p, id="-".join(map(str, p))) for p in itertools.permutations(range(3))],
)
def test_member_order_does_not_change_ownership(order):
    ring = HashRing([THREE[i] for i in order])
    reference = HashRing(THREE)
    for key in KEYS:
        assert ring.members[ring.owner(key)] == reference.members[reference.owner(key)]
        assert [ring.members[i] for i in ring.walk(key)] == [
            reference.members[i] for i in reference.walk(key)
        ]


def test_members_and_len():
    ring = HashRing(THREE)
    assert ring.members == ("a", "b", "c")
    assert len(ring) == 3


def test_empty_ring():
    ring = HashRing([])
    assert len(ring) == 0
    assert list(ring.walk(5)) == []
    with pytest.raises(LookupError, match="empty"):
        ring.owner(5)


@pytest.mark.parametrize(
    ("members", "vnodes", "match"),
    [
        pytest.param([("a", 1), ("a", 2)], DEFAULT_VNODES, "duplicate", id="duplicate-name"),
        pytest.param([("a", 0)], DEFAULT_VNODES, "weight", id="zero-weight"),
        pytest.param([("a", -1)], DEFAULT_VNODES, "weight", id="negative-weight"),
        pytest.param([("a", 1)], 0, "vnodes", id="zero-vnodes"),
    ],
)
def test_invalid_rings(members, vnodes, match):
    with pytest.raises(ValueError, match=match):
        HashRing(members, vnodes)

"""router/fleet/placements.py: two workers' mappings of one table, and the broadcast batch."""

from __future__ import annotations

import asyncio
import time

import pytest

from hashing.blocks import chain, root_key
from hashing.cache_trust import Answer
from router.fleet.placements import Learned, PlacementTable, decode_learned

ROOT = root_key("m", None)
DOC = chain(ROOT, list(range(3200)), 16)  # 200 blocks


def _other(shared: int) -> list[int]:
    """A prompt sharing the document's first `shared` blocks, then its own."""
    return DOC[:shared] + chain(DOC[shared - 1], list(range(90_000, 91_600)), 16)


def _worker(batch: Learned) -> int:
    return batch.worker


@pytest.fixture
def pair(tmp_path):
    sent: list[bytes] = []
    tables = [PlacementTable(tmp_path / "placements", w, sent.append, False) for w in (0, 1)]
    for t in tables:
        t.known(["b0", "b1", "b2"])
    yield *tables, sent
    for t in tables:
        t.close()


@pytest.mark.parametrize(
    ("prompt", "start", "expected"),
    [
        pytest.param(DOC, 0, ("b1", 200), id="the-same-prompt"),
        pytest.param(_other(137), 0, ("b1", 137), id="a-shared-prefix"),
        pytest.param(DOC, 50, ("b1", 150), id="from-a-later-block"),
        pytest.param(_other(1)[1:], 0, None, id="another-first-block"),
    ],
)
async def test_another_worker_sees_a_placement_at_once(pair, prompt, start, expected) -> None:
    mine, theirs, _ = pair
    mine.place("b1", DOC, 0, time.monotonic() + 60)
    found = theirs.held(prompt, start)
    assert (found and found[:2]) == expected


async def test_the_longest_holder_wins_and_expired_pairs_do_not_count(pair) -> None:
    mine, theirs, _ = pair
    mine.place("b0", _other(40), 0, time.monotonic() + 60)
    mine.place("b2", DOC, 0, time.monotonic() + 60)
    assert theirs.held(DOC, 0)[:2] == ("b2", 200)
    mine.place("b2", DOC, 0, time.monotonic() - 1)  # its TTL has passed
    assert theirs.held(DOC, 0)[:2] == ("b0", 40)


async def test_blocks_a_backend_was_found_without_are_adopted_no_more(pair) -> None:
    mine, theirs, _ = pair
    mine.place("b1", DOC, 0, time.monotonic() + 60)
    mine.place("b0", DOC, 0, time.monotonic() + 60)
    theirs.dropped("b1", DOC[30:])
    assert theirs.held(DOC, 0)[:2] == ("b0", 200)
    theirs.dropped("b0", DOC)
    assert theirs.held(DOC, 0)[:2] == ("b1", 30)


async def test_among_equal_holders_the_latest_placement_wins(pair) -> None:
    """A prompt placed on b0, then moved to b2 (b0's pair not yet expired): it is on b2."""
    mine, theirs, _ = pair
    mine.place("b0", DOC, 0, time.monotonic() + 60)
    mine.place("b2", DOC, 0, time.monotonic() + 61)
    assert theirs.held(DOC, 0)[:2] == ("b2", 200)


async def test_a_backend_outside_the_fleet_is_not_reported(pair) -> None:
    mine, theirs, _ = pair
    mine.place("gone", DOC, 0, time.monotonic() + 60)
    assert theirs.held(DOC, 0) is None


async def test_one_broadcast_batch_per_loop_turn(pair) -> None:
    mine, _, sent = pair
    expires_at = time.monotonic() + 60
    mine.place("b0", DOC, 10, expires_at)
    mine.place("b1", DOC, 0, expires_at)
    mine.place("b1", DOC, 200, expires_at)  # nothing new: nothing placed
    answer = Answer("b0", DOC[:20], 20, 4, 1.0, 600.0)
    mine.answered(answer)
    assert sent == []  # sent at the end of the turn, not per pick
    await asyncio.sleep(0)
    assert len(sent) == 1
    batch = decode_learned(sent[0])
    assert batch.worker == 0
    assert batch.placed == [("b0", expires_at, DOC[10:]), ("b1", expires_at, DOC)]
    assert batch.answers == [answer]
    assert batch.lessons == []


async def test_over_a_shared_index_only_replicas_get_placements_and_workers_lessons(
    tmp_path,
) -> None:
    """The workers share the index: a placement goes to no table and, without other
    replicas, into no batch; an answer crosses as its lesson, without the prompt's keys."""
    sent: list[bytes] = []
    alone = PlacementTable(tmp_path / "placements", 0, sent.append, False)
    replicated = PlacementTable(tmp_path / "placements", 1, sent.append, True)
    alone.known(["b0"])
    expires_at = time.monotonic() + 60
    try:
        alone.replicate("b0", DOC, 10, expires_at)
        await asyncio.sleep(0)
        assert sent == []
        replicated.replicate("b0", DOC, 10, expires_at)
        replicated.replicate("b0", DOC, 200, expires_at)  # nothing new: nothing placed
        assert alone.held(DOC, 10) is None  # the table is not written
        lesson = Answer("b0", DOC[:20], 20, 4, 1.0, 600.0).lesson
        alone.taught(lesson)
        await asyncio.sleep(0)
        first, second = sorted((decode_learned(payload) for payload in sent), key=_worker)
        assert (first.worker, first.placed, first.lessons) == (0, [], [lesson])
        assert (second.worker, second.placed) == (1, [("b0", expires_at, DOC[10:])])
        assert lesson.edge == DOC[4] and lesson.blocks == 20
    finally:
        alone.close()
        replicated.close()


async def test_a_replicated_placement_recalled_in_its_turn_reaches_no_replica(tmp_path) -> None:
    """Over a shared index, a pick the router did not follow leaves the replicas' batch
    (`recall`, `replicate`'s undo); the others of the turn go."""
    sent: list[bytes] = []
    table = PlacementTable(tmp_path / "placements", 1, sent.append, True)
    expires_at = time.monotonic() + 60
    try:
        table.replicate("b0", DOC, 10, expires_at)
        table.replicate("b1", DOC, 0, expires_at)
        table.recall("b0", DOC, 10)
        await asyncio.sleep(0)
        (batch,) = sent
        assert decode_learned(batch).placed == [("b1", expires_at, DOC)]
    finally:
        table.close()


async def test_the_pick_lock_is_exclusive_and_its_wait_bounded(pair) -> None:
    """One worker's pick holds it; another's gives up after its short wait (it must not
    stall that worker's loop behind a descheduled holder), and takes it once free."""
    mine, theirs, _ = pair
    assert mine.lock()
    assert not theirs.lock()
    mine.unlock()
    assert theirs.lock()
    theirs.unlock()


async def test_a_placement_withdrawn_in_its_turn_reaches_no_worker(pair) -> None:
    """A pick the router did not follow: its placement leaves the table and the batch."""
    mine, theirs, sent = pair
    expires_at = time.monotonic() + 60
    mine.place("b0", DOC, 10, expires_at)
    mine.place("b1", DOC, 0, expires_at)
    mine.withdraw("b0", DOC, 10)
    assert theirs.held(DOC, 0)[:2] == ("b1", 200)
    mine.withdraw("b1", DOC, 0)
    assert theirs.held(DOC, 0) is None
    mine.place("b2", DOC, 0, expires_at)
    await asyncio.sleep(0)
    (batch,) = sent
    assert decode_learned(batch).placed == [("b2", expires_at, DOC)]

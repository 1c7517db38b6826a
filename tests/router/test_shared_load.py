"""The shared load table: per-worker columns summed by readers, slots agreed on by every
worker, a dead worker's column zeroed, and a full table degrading to local counts."""

from __future__ import annotations

from router.backends import Backend
from router.config import BackendConfig
from router.shared_load import LoadTable


def tables(tmp_path, workers: int = 3, slots: int = 16) -> list[LoadTable]:
    path = tmp_path / "load"
    return [LoadTable(path, slots, workers, w) for w in range(workers)]


def test_workers_agree_on_slots_and_readers_see_the_sum(tmp_path) -> None:
    t0, t1, t2 = tables(tmp_path)
    slot = t0.slot("b0", "http://a:8000")
    assert t1.slot("b0", "http://a:8000") == slot == t2.slot("b0", "http://a:8000")
    assert t1.slot("b1", "http://b:8000") != slot
    t0.add(slot, 2, 100)
    t2.add(slot, 1, 50)
    assert t1.inflight(slot) == 3 and t1.queued_tokens(slot) == 150
    t0.add(slot, -1, -100)
    assert t2.inflight(slot) == 2 and t2.queued_tokens(slot) == 50


def test_a_dead_workers_column_is_zeroed(tmp_path) -> None:
    t0, t1, _ = tables(tmp_path)
    supervisor = LoadTable(tmp_path / "load", 16, 3, None)
    slot = t0.slot("b0", "http://a:8000")
    t0.add(slot, 4, 400)
    t1.add(slot, 1, 10)
    supervisor.clear_worker(0)
    assert t1.inflight(slot) == 1 and t1.queued_tokens(slot) == 10


def test_backends_count_router_wide_and_locally(tmp_path) -> None:
    t0, t1, _ = tables(tmp_path)
    cfg = BackendConfig(url="http://a:8000", name="b0")
    mine, theirs = Backend(cfg, table=t0), Backend(cfg, table=t1)
    mine.count(1, 300)
    theirs.count(2, 0)
    assert mine.inflight == theirs.inflight == 3
    assert mine.queued_tokens == 300
    assert (mine.local_inflight, theirs.local_inflight) == (1, 2)


def test_a_full_table_leaves_new_backends_counting_locally(tmp_path) -> None:
    (t0,) = tables(tmp_path, workers=1, slots=2)
    held = [Backend(BackendConfig(url=f"http://h{i}:8000"), table=t0) for i in range(2)]
    assert all(b.table is t0 for b in held)
    extra = Backend(BackendConfig(url="http://h9:8000"), table=t0)
    assert extra.table is None
    extra.count(1, 5)
    assert extra.inflight == 1 and extra.queued_tokens == 5

"""The shared load table: per-worker columns summed by readers, slots agreed on by every
worker, a dead worker's column zeroed, a full table degrading to local counts, and slots
reused once no worker holds their backend."""

from __future__ import annotations

from policies.round_robin import RoundRobinParams, RoundRobinPolicy
from router.config import BackendConfig, BreakerConfig
from router.fleet.backends import Backend, Fleet
from router.fleet.shared_load import LoadTable


def tables(tmp_path, workers: int = 3, slots: int = 16) -> list[LoadTable]:
    path = tmp_path / "load"
    return [LoadTable(path, slots, workers, w) for w in range(workers)]


def test_workers_agree_on_slots_and_readers_see_the_sum(tmp_path) -> None:
    t0, t1, t2 = tables(tmp_path)
    slot = t0.slot("b0", "http://a:8000")
    assert t1.slot("b0", "http://a:8000") == slot == t2.slot("b0", "http://a:8000")
    assert t1.slot("b1", "http://b:8000") != slot
    t0.add(slot, 2, 100, 2)
    t2.add(slot, 1, 50, 1)
    assert t1.inflight(slot) == 3 and t1.queued_tokens(slot) == 150 and t1.unstarted(slot) == 3
    t0.add(slot, 0, -100, -1)  # an answer began
    t0.add(slot, -1, 0, 0)  # and ended
    assert t2.inflight(slot) == 2 and t2.queued_tokens(slot) == 50 and t2.unstarted(slot) == 2


def test_a_dead_workers_column_is_zeroed(tmp_path) -> None:
    t0, t1, _ = tables(tmp_path)
    supervisor = LoadTable(tmp_path / "load", 16, 3, None)
    slot = t0.slot("b0", "http://a:8000")
    t0.add(slot, 4, 400, 4)
    t1.add(slot, 1, 10, 1)
    supervisor.clear_worker(0)
    assert t1.inflight(slot) == 1 and t1.queued_tokens(slot) == 10 and t1.unstarted(slot) == 1


def test_backends_count_router_wide_and_locally(tmp_path) -> None:
    t0, t1, _ = tables(tmp_path)
    cfg = BackendConfig(url="http://a:8000", name="b0")
    mine, theirs = Backend(cfg, table=t0), Backend(cfg, table=t1)
    mine.count(1, 300)
    theirs.count(2, 0)
    assert mine.inflight == theirs.inflight == 3 == theirs.unstarted
    assert mine.queued_tokens == 300
    mine.count(0, -300, -1)  # its answer began
    assert mine.inflight == 3 and mine.queued_tokens == 0 and theirs.unstarted == 2
    assert (mine.local_inflight, theirs.local_inflight) == (1, 2)


def test_a_full_table_leaves_new_backends_counting_locally(tmp_path) -> None:
    (t0,) = tables(tmp_path, workers=1, slots=2)
    held = [Backend(BackendConfig(url=f"http://h{i}:8000"), table=t0) for i in range(2)]
    assert all(b.table is t0 for b in held)
    extra = Backend(BackendConfig(url="http://h9:8000"), table=t0)
    assert extra.table is None
    extra.count(1, 5)
    assert extra.inflight == 1 and extra.queued_tokens == 5


def test_a_slot_no_worker_holds_is_reused_and_probe_paths_stay_whole(tmp_path) -> None:
    t0, t1 = tables(tmp_path, workers=2, slots=3)
    a, b, c = (t0.slot(n, "http://x:1") for n in ("a", "b", "c"))
    assert t0.slot("d", "http://x:1") is None  # full
    assert t1.slot("b", "http://x:1") == b  # worker 1 holds b too
    t0.release(b)
    assert t0.slot("d", "http://x:1") is None  # worker 1 still holds b
    t1.release(b)
    t0.add(a, 1, 10, 1)
    t0.release(a)
    assert t0.slot("d", "http://x:1") not in (None, a)  # a still has a request in flight
    # every key still found where it was, whichever slots were reused on its path
    assert t1.slot("a", "http://x:1") == a and t1.slot("c", "http://x:1") == c
    assert t1.inflight(a) == 1


def test_a_reused_slot_starts_from_zero_and_a_dead_worker_lets_go(tmp_path) -> None:
    t0, t1 = tables(tmp_path, workers=2, slots=1)
    supervisor = LoadTable(tmp_path / "load", 1, 2, None)
    slot = t0.slot("a", "http://x:1")
    t0.add(slot, 0, 500, 0)  # e.g. a count left behind
    t0.add(slot, 0, -500, 0)
    supervisor.clear_worker(0)  # worker 0 died holding `a`
    assert t1.slot("b", "http://x:1") == slot
    assert t1.inflight(slot) == 0 and t1.queued_tokens(slot) == 0


def test_backends_leaving_the_fleet_free_their_slots(tmp_path) -> None:
    """Discovery churn: many more backends over the router's life than the table has slots."""
    (t0,) = tables(tmp_path, workers=1, slots=4)
    breaker = BreakerConfig()
    cfgs = [BackendConfig(url=f"http://10.0.0.{i}:8000", name=f"pod-{i}") for i in range(2)]
    fleet = Fleet(cfgs, RoundRobinPolicy(RoundRobinParams()), breaker, t0)
    busy = fleet.members[0]
    busy.count(1, 0)  # a request still running on pod-0 when it leaves
    for i in range(2, 40):  # each generation: pod-(i-1) and pod-i
        cfgs = [BackendConfig(url=f"http://10.0.0.{k}:8000", name=f"pod-{k}") for k in (i - 1, i)]
        fleet.update(cfgs, fleet.prepare(cfgs, breaker), fleet.policy, breaker, ())
        assert all(b.table is t0 for b in fleet.members), i
    assert busy in fleet.retired and t0.inflight(busy.slot) == 1
    busy.count(-1, 0)


def test_backends_prepared_for_a_reload_that_never_happened_are_let_go(tmp_path) -> None:
    (t0,) = tables(tmp_path, workers=1, slots=2)
    breaker = BreakerConfig()
    cfgs = [BackendConfig(url="http://10.0.0.1:8000", name="kept")]
    fleet = Fleet(cfgs, RoundRobinPolicy(RoundRobinParams()), breaker, t0)
    for i in range(5):  # each reload prepares a newcomer, then is cancelled before the swap
        extra = [*cfgs, BackendConfig(url=f"http://10.0.1.{i}:8000", name=f"new-{i}")]
        (kept, newcomer) = fleet.prepare(extra, breaker)
        assert kept is fleet.members[0] and newcomer.table is t0, i
        fleet.let_go([newcomer])
    assert fleet.members[0].table is t0


def test_round_robin_takes_the_routers_turn_whichever_worker_picks(tmp_path) -> None:
    """Two workers' fleets over one table, picking in an order the kernel might deal
    requests to them: each pick takes the next backend in the router's rotation (with a
    turn each, the second worker started again from the first backend)."""
    t0, t1 = tables(tmp_path, workers=2)
    cfgs = [BackendConfig(url=f"http://b{i}:8000", name=f"b{i}") for i in range(4)]
    fleets = [
        Fleet(cfgs, RoundRobinPolicy(RoundRobinParams()), BreakerConfig(), table=t)
        for t in (t0, t1)
    ]
    for fleet in fleets:
        for b in fleet.members:
            b.healthy = True
        fleet.changed()
    order = [0, 1, 1, 0, 1, 1, 1, 0]
    picked = [fleets[w].policy.pick(None, fleets[w].view("m")).backend.name for w in order]
    assert picked == [f"b{i % 4}" for i in range(len(order))]
    alone = Fleet(cfgs, RoundRobinPolicy(RoundRobinParams()), BreakerConfig())
    for b in alone.members:
        b.healthy = True
    alone.changed()
    assert alone.view("m").turns is None  # one worker: its own turn
    assert [alone.policy.pick(None, alone.view("m")).backend.name for _ in range(5)] == [
        "b0",
        "b1",
        "b2",
        "b3",
        "b0",
    ]

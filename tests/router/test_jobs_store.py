"""The jobs database: leases, attempts, ownership, order, batches settled once, TTLs."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from router.config import ConfigError
from router.jobs.store import JobStore
from router.jobs.wire import new_batch, read_lines, write_outputs

CHAT = "/v1/chat/completions"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    return JobStore(str(tmp_path / "jobs.db"))


def test_the_database_is_in_wal_mode_and_a_bad_path_is_a_config_error(tmp_path: Path) -> None:
    JobStore(str(tmp_path / "j.db"))
    with sqlite3.connect(tmp_path / "j.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"jobs\.path"):
        JobStore(str(tmp_path / "file" / "j.db"))


def test_a_lease_that_ran_out_is_claimed_again_with_one_more_attempt(store: JobStore) -> None:
    store.put("j1", None, CHAT, BODY)
    first = store.claim("w1", lease_s=0.05)
    assert (first.id, first.status, first.attempts) == ("j1", "running", 1)
    assert store.claim("w2", lease_s=10) is None  # leased
    time.sleep(0.06)  # the lease's own clock: wall time is what a dead worker leaves
    again = store.claim("w2", lease_s=10)
    assert (again.id, again.attempts) == ("j1", 2)
    assert not store.renew("j1", "w1", 10)  # w1 lost it
    assert not store.finish("j1", "w1", "succeeded", 200, b"{}", 60)
    assert store.finish("j1", "w2", "succeeded", 200, b'{"ok":1}', 60)
    done = store.get("j1", None)
    assert (done.status, done.result_status, done.result) == ("succeeded", 200, b'{"ok":1}')


def test_release_puts_a_stopping_workers_jobs_back(store: JobStore) -> None:
    store.put("j1", None, CHAT, BODY)
    store.claim("w1", lease_s=60)
    assert store.release("w1") == 1
    assert store.claim("w2", lease_s=60).attempts == 2


def test_single_jobs_go_before_batch_lines_then_oldest_first(store: JobStore) -> None:
    lines, errors = read_lines(b'{"custom_id":"a","method":"POST","url":"%b","body":%b}' % (
        CHAT.encode(), BODY), CHAT, 10)  # fmt: skip
    assert not errors
    store.put_batch(new_batch(CHAT, "file-1", None, 1, []), None, lines)
    store.put("late", None, CHAT, BODY)
    store.put("later", None, CHAT, BODY)
    assert [store.claim("w", 60).id for _ in range(3)] == ["late", "later", lines[0].id]


def test_only_the_owners_tenant_sees_a_job(store: JobStore) -> None:
    store.put("j1", "acme", CHAT, BODY)
    assert store.get("j1", "acme") is not None
    assert store.get("j1", "beta") is None
    assert store.get("j1", None) is None


def test_a_batch_settles_once_when_its_last_line_ends(store: JobStore) -> None:
    text = b"\n".join(
        b'{"custom_id":"c%d","method":"POST","url":"%b","body":%b}' % (i, CHAT.encode(), BODY)
        for i in range(3)
    )
    lines, _ = read_lines(text, CHAT, 10)
    batch = new_batch(CHAT, "file-1", None, 3, [])
    store.put_batch(batch, "t", lines)
    files = ("file-out", "file-err")
    for code in (200, 500):
        job = store.claim("w", 60)
        store.finish(job.id, "w", "succeeded" if code < 400 else "failed", code, b"{}", 60)
        assert not store.settle(batch.id, files, write_outputs, 60)  # one still waits
    last = store.claim("w", 60)
    store.finish(last.id, "w", "succeeded", 200, b'{"n":3}', 60)
    wins = []

    def settle() -> None:
        wins.append(store.settle(batch.id, files, write_outputs, 60))

    threads = [threading.Thread(target=settle) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == [False, False, False, True]
    ended = store.batch(batch.id, "t")
    assert (ended.status, ended.completed, ended.failed) == ("completed", 2, 1)
    assert store.content("file-out", "t").count(b"\n") == 2
    assert b'"status_code":500' in store.content("file-err", "t")
    assert store.claim("w", 60) is None  # its lines are gone with it


def test_what_is_past_its_ttl_is_dropped(store: JobStore) -> None:
    store.put("old", None, CHAT, BODY)
    store.claim("w", 60)
    store.finish("old", "w", "succeeded", 200, b"{}", ttl_s=0.01)
    store.put_file("file-x", None, "batch", "x.jsonl", b"{}", ttl_s=0.01)
    store.put("new", None, CHAT, BODY)
    time.sleep(0.02)  # wall-clock TTLs
    assert store.expire() == 2
    assert store.get("old", None) is None
    assert store.get("new", None) is not None

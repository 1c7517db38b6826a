"""The jobs database: leases, attempts, ownership, order, batches settled once, TTLs."""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.config import ConfigError, RedisConfig
from router.jobs.logic import BatchesLogic, FilesLogic, JobsLogic
from router.jobs.redis_store import RedisJobStore
from router.jobs.sqlite_store import SqliteJobStore
from router.jobs.store import PIECE_BYTES, JobStore
from router.jobs.wire import new_batch, read_lines, write_outputs
from tests.redis_server import redis_server

CHAT = "/v1/chat/completions"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
LONGEST = 1 << 20


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path: Path) -> JobStore:
    """Each store, empty: a new database file, or a key prefix of the test's own."""
    if request.param == "sqlite":
        return SqliteJobStore(str(tmp_path / "jobs.db"))
    url = request.getfixturevalue("redis_url")
    return RedisJobStore(RedisConfig(url=url, key_prefix=f"t:{tmp_path.name}:"))


def test_the_database_is_in_wal_mode_and_a_bad_path_is_a_config_error(tmp_path: Path) -> None:
    SqliteJobStore(str(tmp_path / "j.db"))
    with sqlite3.connect(tmp_path / "j.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"jobs\.path"):
        SqliteJobStore(str(tmp_path / "file" / "j.db"))


def test_a_redis_that_does_not_answer_or_a_password_in_the_url_is_a_config_error(
    tmp_path: Path,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once it is closed
    with pytest.raises(ConfigError, match="does not answer"):
        RedisJobStore(RedisConfig(url=f"redis://127.0.0.1:{closed}/0", timeout_s=1))
    with pytest.raises(ValueError, match="password_file or password_env"):
        RedisConfig(url="redis://:secret@127.0.0.1:6379/0")


def test_a_redis_password_comes_from_its_file(tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text("s3cret\n")
    with redis_server(tmp_path, password="s3cret") as url:
        with pytest.raises(ConfigError, match="does not answer"):
            RedisJobStore(RedisConfig(url=url))
        store = RedisJobStore(RedisConfig(url=url, password_file=str(secret)))
        store.put("j1", None, CHAT, BODY)
        assert store.claim("w", 60).id == "j1"


@pytest.mark.parametrize("logic", [JobsLogic, FilesLogic, BatchesLogic])
def test_both_stores_take_their_common_steps_from_one_place(logic: type) -> None:
    """The calls logic.py writes are each store's own, and every storage call it names
    (a `_` one, or `layout`) is the store's, none left to its NotImplementedError."""
    names = [name for name in vars(logic) if not name.startswith("__")]
    given = [name for name in names if name.startswith("_") or name == "layout"]
    written = [name for name in names if name not in given]
    assert written and given
    for store in (SqliteJobStore, RedisJobStore):
        for name in written:
            assert getattr(store, name) is vars(logic)[name], (store, name)
        for name in given:
            assert getattr(store, name) is not vars(logic)[name], (store, name)


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
        CHAT.encode(), BODY), CHAT, 10, LONGEST)  # fmt: skip
    assert not errors
    store.put_batch(new_batch(CHAT, "file-1", None, 1, [], 60), None, lines)
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
    lines, _ = read_lines(text, CHAT, 10, LONGEST)
    batch = new_batch(CHAT, "file-1", None, 3, [], 60)
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
    store.expire()  # SQLite deletes here; Redis did on its own
    assert store.get("old", None) is None
    assert store.file("file-x", None) is None
    assert store.get("new", None) is not None


def lines_of(n: int) -> list:
    text = b"\n".join(
        b'{"custom_id":"c%d","method":"POST","url":"%b","body":%b}' % (i, CHAT.encode(), BODY)
        for i in range(n)
    )
    return read_lines(text, CHAT, 100, LONGEST)[0]


def test_cancel_drops_the_waiting_lines_and_the_running_one_ends_the_batch(
    store: JobStore,
) -> None:
    batch = new_batch(CHAT, "file-1", None, 3, [], 60)
    store.put_batch(batch, None, lines_of(3))
    running = store.claim("w", 60)
    assert store.cancel_batch(batch.id, None)
    assert not store.cancel_batch(batch.id, None)  # cancelling already
    assert store.claim("w", 60) is None  # the other two were dropped
    assert store.batch(batch.id, None).status == "cancelling"
    files = ("file-out", "file-err")
    assert not store.settle(batch.id, files, write_outputs, 60)  # one still runs
    store.finish(running.id, "w", "succeeded", 200, b"{}", 60)
    assert store.settle(batch.id, files, write_outputs, 60)
    ended = store.batch(batch.id, None)
    assert (ended.status, ended.completed, ended.failed) == ("cancelled", 1, 0)
    assert ended.error_file_id is None
    assert store.content(ended.output_file_id, None).count(b"\n") == 1


def test_another_tenants_batch_cannot_be_cancelled(store: JobStore) -> None:
    batch = new_batch(CHAT, "file-1", None, 1, [], 60)
    store.put_batch(batch, "acme", lines_of(1))
    assert store.batch(batch.id, "beta") is None
    assert not store.cancel_batch(batch.id, "beta")
    assert store.batch(batch.id, "acme").status == "in_progress"


def test_a_webhook_is_due_when_its_job_ends_and_again_after_a_failed_try(
    store: JobStore,
) -> None:
    store.put("j1", None, CHAT, BODY, webhook="http://127.0.0.1:9/hook")
    store.put("j2", None, CHAT, BODY)
    for _ in range(2):
        job = store.claim("w", 60)
        store.finish(job.id, "w", "succeeded", 200, b"{}", 60)
    due = store.due_hook(lease_s=60)
    assert (due.id, due.hook_state, due.hook_attempts) == ("j1", "pending", 0)
    assert store.due_hook(lease_s=60) is None  # leased to the one delivering it
    store.hook_tried("j1", "pending", retry_in=0.01)
    time.sleep(0.02)  # its retry's wall-clock due time
    again = store.due_hook(lease_s=60)
    assert (again.id, again.hook_attempts) == ("j1", 1)
    store.hook_tried("j1", "delivered", retry_in=0)
    assert store.due_hook(lease_s=60) is None
    assert store.get("j1", None).hook_state == "delivered"


def test_a_webhook_tried_after_its_job_expired_leaves_no_trace(store: JobStore) -> None:
    store.put("j1", "acme", CHAT, BODY, webhook="http://127.0.0.1:9/hook")
    job = store.claim("w", 60)
    store.finish(job.id, "w", "succeeded", 200, b"{}", ttl_s=0.05)
    assert store.due_hook(lease_s=60).id == "j1"  # leased while its answer expires
    deadline = time.monotonic() + 5
    while store.get("j1", "acme") is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # wall-clock TTL
        store.expire()
    store.hook_tried("j1", "pending", retry_in=0)
    assert store.get("j1", "acme") is None
    assert store.get("j1", "beta") is None
    assert store.due_hook(lease_s=60) is None


def test_files_are_listed_newest_first_page_by_page_and_deleted(store: JobStore) -> None:
    for i in range(5):
        purpose = "batch" if i % 2 == 0 else "batch_output"
        store.put_file(f"file-{i}", "t", purpose, f"f{i}.jsonl", b"x" * i, 60)
        time.sleep(0.002)  # distinct creation times, as uploads have
    store.put_file("file-other", "u", "batch", "o.jsonl", b"", 60)
    first = store.files("t", None, None, 2)
    assert ([f.id for f in first.items], first.more) == (["file-4", "file-3"], True)
    rest = store.files("t", None, "file-3", 10)
    assert ([f.id for f in rest.items], rest.more) == (["file-2", "file-1", "file-0"], False)
    batch_only = store.files("t", "batch", None, 10)
    assert [f.id for f in batch_only.items] == ["file-4", "file-2", "file-0"]
    assert store.files("t", None, "file-gone", 10) == ([], False)  # a lost cursor ends it
    assert not store.delete_file("file-4", "u")  # another tenant's
    assert store.delete_file("file-4", "t")
    assert not store.delete_file("file-4", "t")
    assert store.file("file-4", "t") is None
    assert [f.id for f in store.files("t", None, None, 1).items] == ["file-3"]
    time.sleep(0.002)
    store.put_file("file-late", "t", "batch", "l.jsonl", b"", 60)
    # another tenant's file as the cursor is as good as a lost one
    assert store.files("u", None, "file-late", 10) == ([], False)


def test_batches_are_listed_newest_first_with_their_counts(store: JobStore) -> None:
    ids = []
    for _ in range(3):
        batch = new_batch(CHAT, "file-1", None, 2, [], 60)
        store.put_batch(batch, "t", lines_of(2))
        ids.append(batch.id)
        time.sleep(0.002)
    job = store.claim("w", 60)
    store.finish(job.id, "w", "succeeded", 200, b"{}", 60)
    page = store.batches("t", None, 2)
    assert ([b.id for b in page.items], page.more) == ([ids[2], ids[1]], True)
    last = store.batches("t", ids[1], 2)
    assert ([b.id for b in last.items], last.more) == ([ids[0]], False)
    assert last.items[0].completed == 1  # the first batch's first line, done
    assert store.batches("u", None, 10) == ([], False)
    store.put_batch(new_batch(CHAT, "file-1", None, 1, [], 60), "u", lines_of(1))
    time.sleep(0.002)
    late = new_batch(CHAT, "file-1", None, 1, [], 60)
    store.put_batch(late, "t", lines_of(1))
    assert store.batches("u", late.id, 10) == ([], False)  # another tenant's as the cursor


def test_a_line_that_ended_early_keeps_its_answer_until_its_batch_ends(store: JobStore) -> None:
    """A batch that runs longer than the results' TTL: its TTL counts from its end."""
    batch = new_batch(CHAT, "file-1", None, 3, [], 60)
    store.put_batch(batch, None, lines_of(3))
    first = store.claim("w", 60)
    store.finish(first.id, "w", "succeeded", 200, b'{"n":1}', ttl_s=0.01)
    time.sleep(0.02)  # past the TTL a result of its own would have
    store.expire()
    for _ in range(2):
        job = store.claim("w", 60)
        store.finish(job.id, "w", "succeeded", 200, b"{}", ttl_s=0.01)
    assert store.settle(batch.id, ("file-out", "file-err"), write_outputs, 60)
    ended = store.batch(batch.id, None)
    assert (ended.status, ended.completed, ended.failed) == ("completed", 3, 0)
    assert store.content("file-out", None).count(b"\n") == 3


def test_an_upload_is_kept_piece_by_piece_within_the_tenants_quota(store: JobStore) -> None:
    assert store.put_part("file-a", "t", 0, b"x" * 600, 60, quota=1000)
    assert store.file("file-a", "t") is None  # not a file until sealed
    assert store.put_part("file-a", "t", 1, b"y" * 300, 60, quota=1000)
    assert not store.put_part("file-b", "t", 0, b"z" * 200, 60, quota=1000)  # 1100 > 1000
    assert store.put_part("file-b", "u", 0, b"z" * 200, 60, quota=1000)  # another tenant's
    sealed = store.seal_file("file-a", "t", "batch", "a.jsonl", 60)
    assert (sealed.size, store.file("file-a", "t").size) == (900, 900)
    assert bytes(store.content("file-a", "t")) == b"x" * 600 + b"y" * 300
    assert [f.id for f in store.files("t", None, None, 10).items] == ["file-a"]
    assert store.content("file-a", "u") is None
    assert store.delete_file("file-a", "t")  # frees its bytes
    assert store.put_part("file-c", "t", 0, b"z" * 1000, 60, quota=1000)
    store.drop_parts("file-c", "t")  # an upload that failed frees its bytes too
    assert store.put_part("file-d", "t", 0, b"z" * 1000, 60, quota=1000)


def test_a_file_is_read_a_piece_at_a_time_however_it_was_stored(store: JobStore) -> None:
    """An upload's pieces, and a file written whole in slices of PIECE_BYTES: each read
    holds one piece, and the pieces make the file."""
    uploaded = [bytes([65 + n]) * (PIECE_BYTES + 100) for n in range(3)]
    for n, data in enumerate(uploaded):
        assert store.put_part("file-up", "t", n, data, 60, quota=1 << 30)
    store.seal_file("file-up", "t", "batch", "in.jsonl", 60)
    written = bytes(range(256)) * ((2 * PIECE_BYTES + 999) // 256)
    store.put_file("file-out", "t", "batch_output", "out.jsonl", written, 60)
    for file_id, whole, count in (("file-up", b"".join(uploaded), 3), ("file-out", written, 3)):
        layout = store.layout(file_id, "t")
        assert (layout.size, layout.pieces()) == (len(whole), count)
        pieces = [store.piece(file_id, layout, n) for n in range(layout.pieces())]
        assert max(map(len, pieces)) <= PIECE_BYTES + 100
        assert b"".join(pieces) == whole == store.content(file_id, "t")
        assert store.layout(file_id, "u") is None  # another tenant's
        assert store.delete_file(file_id, "t")
        assert store.piece(file_id, layout, layout.pieces() - 1) is None  # gone meanwhile
    assert store.layout("file-nope", "t") is None

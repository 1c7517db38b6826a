"""The job store for several router replicas: one Redis server (not a Cluster) that every
worker of every replica shares (redis_db.py), with the leases, attempts and TTLs store.py
describes and the calls' common steps in logic.py.

Keys, under `key_prefix`: `job:<id>` (a hash per job), `queue` (the waiting ids, scored
so that single async jobs come before batch lines, each in arrival order), `running`
(ids by lease deadline), `hooks` (ids of due webhooks by due time), `file:<id>`,
`batch:<id>` (a hash that counts its open, completed and failed lines),
`batch:<id>:lines` (its line ids by line number), and for listing `files:of:<tenant>`
and `batches:of:<tenant>` (ids by creation; an id whose hash expired is dropped from
them when a listing meets it). Every step that must not be seen half
done (a claim, a renewal, a result, a release, a cancel, a batch's end) is one Lua
script (redis_scripts.py), which Redis runs atomically. TTLs are Redis's own
(`PEXPIRE`), so `expire` has nothing to do; a batch's lines have none (they go when it
ends). `unsettled` holds the batches whose last line ended, until they end: a sweep ends
those whose worker died in between.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from router.jobs import redis_scripts as lua
from router.jobs.logic import BatchesLogic, Ending, FilesLogic, JobsLogic, Outputs
from router.jobs.redis_db import RedisDb, ms, owned
from router.jobs.store import OPEN_BATCH, Batch, Job, Layout, Line, Outcome, Page, StoredFile

#: batch lines score after every single job (epoch seconds stay far below this)
_BATCH_SCORE = 1e10
#: within a batch, lines in input order (Redis scores are doubles: 1e-5 still resolves)
_LINE_STEP = 1e-5


class RedisJobs(JobsLogic, RedisDb):
    """The jobs' hashes, the queue, the running jobs by lease, the due webhooks."""

    def _add_job(self, job: Job) -> None:
        fields = _job_fields(
            job.id, job.tenant, job.path, job.body, job.created, job.created, job.webhook
        )
        with self._db.pipeline() as tx:
            tx.hset(self._key("job", job.id), mapping=fields)
            tx.zadd(self._queue, {job.id: job.created})
            tx.execute()

    def _job(self, job_id: str) -> Job | None:
        found = self._db.hgetall(self._key("job", job_id))
        return _job_from(found) if found else None

    def _lease_next(self, owner: str, now: float, until: float) -> Job | None:
        found = self._run(lua.CLAIM, [self._queue, self._running], [now, until, owner, self._p])
        return None if not found else _job_of(found)

    def _renew(self, job_id: str, owner: str, until: float) -> bool:
        return self._run(lua.RENEW, [self._running], [job_id, owner, until, self._p]) == 1

    def _finish(
        self, job_id: str, owner: str, status: str, code: int, result: bytes,
        now: float, ttl_s: float,
    ) -> bool:  # fmt: skip
        args = [job_id, owner, status, code, result, now, ms(ttl_s), self._p]
        return self._run(lua.FINISH, [self._running, self._hooks], args) == 1

    def _lease_hook(self, now: float, until: float) -> Job | None:
        found = self._run(lua.DUE_HOOK, [self._hooks], [now, until, self._p])
        return None if not found else _job_of(found)

    def _hook_tried(self, job_id: str, state: str, due: float) -> None:
        self._run(lua.HOOK_TRIED, [self._hooks], [job_id, state, due, self._p])

    def release(self, owner: str) -> int:
        return self._run(lua.RELEASE, [self._running, self._queue], [owner, self._p])

    def expire(self) -> int:
        """Nothing: Redis drops what is past its TTL itself."""
        return 0


class RedisFiles(FilesLogic, RedisDb):
    """A file's hash (its bytes written whole in `content`), the list of the pieces it
    was uploaded in, and each tenant's listing and upload counts."""

    def _add_file(
        self, stored: StoredFile, tenant: str | None, content: bytes, ttl_s: float
    ) -> None:
        key = self._key("file", stored.id)
        fields = {"purpose": stored.purpose, "filename": stored.filename}
        fields |= {"created": stored.created, "content": content}
        if tenant is not None:
            fields["tenant"] = tenant
        with self._db.pipeline() as tx:
            tx.hset(key, mapping=fields)
            tx.pexpire(key, ms(ttl_s))
            tx.zadd(self._of("files", tenant), {stored.id: stored.created})
            tx.execute()

    def _add_part(
        self, file_id: str, tenant: str | None, n: int, data: bytes, now: float, until: float,
        quota: int,
    ) -> bool:  # fmt: skip
        """Pieces come in order. What each upload holds is counted per tenant
        (`uploads:of:`, `upload_bytes:of:`) until it expires."""
        keys = [self._of("uploads", tenant), self._of("upload_bytes", tenant), self._parts(file_id)]
        return self._run(lua.PUT_PART, keys, [now, data, quota, until, file_id]) == 1

    def _seal(
        self, file_id: str, tenant: str | None, purpose: str, filename: str,
        now: float, ttl_s: float,
    ) -> int:  # fmt: skip
        key, parts = self._key("file", file_id), self._parts(file_id)
        size = int(self._db.hget(self._of("upload_bytes", tenant), file_id) or 0)
        fields = {"purpose": purpose, "filename": filename, "created": now, "content": b""}
        fields |= {"size": size} | ({} if tenant is None else {"tenant": tenant})
        with self._db.pipeline() as tx:
            tx.hset(key, mapping=fields)
            for held in (key, parts):
                tx.pexpire(held, ms(ttl_s))
            tx.zadd(self._of("files", tenant), {file_id: now})
            tx.execute()
        return size

    def drop_parts(self, file_id: str, tenant: str | None) -> None:
        with self._db.pipeline() as tx:
            tx.delete(self._parts(file_id))
            tx.zrem(self._of("uploads", tenant), file_id)
            tx.hdel(self._of("upload_bytes", tenant), file_id)
            tx.execute()

    def file(self, file_id: str, tenant: str | None) -> StoredFile | None:
        key = self._key("file", file_id)
        with self._db.pipeline() as tx:
            tx.hmget(key, ["tenant", "purpose", "filename", "created", "size"])
            tx.hstrlen(key, "content")
            (owner, purpose, name, created, parts), size = tx.execute()
        if purpose is None or not owned({b"tenant": owner} if owner else {}, tenant):
            return None
        size += int(parts or 0)
        return StoredFile(file_id, purpose.decode(), name.decode(), float(created), size)

    def layout(self, file_id: str, tenant: str | None) -> Layout | None:
        key = self._key("file", file_id)
        with self._db.pipeline() as tx:
            tx.hmget(key, ["tenant", "purpose", "size"])
            tx.hstrlen(key, "content")
            tx.llen(self._parts(file_id))
            (owner, found, uploaded), written, parts = tx.execute()
        if found is None or not owned({b"tenant": owner} if owner else {}, tenant):
            return None
        return Layout(written + int(uploaded or 0), written, parts)

    def _written(self, file_id: str, start: int, size: int) -> bytes | None:
        found = self._run(lua.WRITTEN, [self._key("file", file_id)], [start, size])
        return None if found is None else bytes(found)

    def _part(self, file_id: str, n: int) -> bytes | None:
        found = self._db.lindex(self._parts(file_id), n)
        return None if found is None else bytes(found)

    def files(
        self, tenant: str | None, purpose: str | None, after: str | None, limit: int
    ) -> Page[StoredFile]:
        index = self._of("files", tenant)
        ids, more = self._page(index, after, limit if purpose is None else None)
        found = self._listed(index, ids, lambda file_id: self.file(file_id, tenant))
        found = [f for f in found if purpose is None or f.purpose == purpose]
        return Page(found[:limit], more or len(found) > limit)

    def delete_file(self, file_id: str, tenant: str | None) -> bool:
        if self.file(file_id, tenant) is None:
            return False
        with self._db.pipeline() as tx:
            tx.delete(self._key("file", file_id), self._parts(file_id))
            tx.zrem(self._of("files", tenant), file_id)
            tx.zrem(self._of("uploads", tenant), file_id)
            tx.hdel(self._of("upload_bytes", tenant), file_id)
            tx.execute()
        return True


class RedisBatches(BatchesLogic[None], RedisDb):
    """A batch's hash, its lines (jobs' hashes, in the queue with batch scores) and the
    set of batches whose last line ended."""

    def put_batch(self, batch: Batch, tenant: str | None, lines: Sequence[Line]) -> None:
        key = self._key("batch", batch.id)
        fields = {k: v for k, v in batch._asdict().items() if v is not None}
        fields["open"] = len(lines)
        if tenant is not None:
            fields["tenant"] = tenant
        with self._db.pipeline() as tx:
            tx.hset(key, mapping=fields)
            tx.zadd(self._of("batches", tenant), {batch.id: batch.created})
            if batch.expires is not None:
                tx.pexpireat(key, int(batch.expires * 1000))
            start = _BATCH_SCORE + batch.created
            for n, line in enumerate(lines):
                score = start + n * _LINE_STEP
                job = _job_fields(line.id, tenant, line.path, line.body, batch.created, score)
                job |= {"batch_id": batch.id, "line": n, "custom_id": line.custom_id}
                tx.hset(self._key("job", line.id), mapping=job)
                tx.zadd(self._queue, {line.id: score})
                tx.zadd(key + ":lines", {line.id: n})
            tx.execute()

    def batch(self, batch_id: str, tenant: str | None) -> Batch | None:
        found = self._db.hgetall(self._key("batch", batch_id))
        if not found or not owned(found, tenant):
            return None
        return _batch_from(found)

    def batches(self, tenant: str | None, after: str | None, limit: int) -> Page[Batch]:
        index = self._of("batches", tenant)
        ids, more = self._page(index, after, limit)
        return Page(self._listed(index, ids, lambda batch_id: self.batch(batch_id, tenant)), more)

    def unsettled(self) -> list[str]:
        """The batches whose last line ended (or was cancelled) and that did not end."""
        return [b.decode() for b in self._db.smembers(self._unsettled)]

    def _cancel(self, batch_id: str, tenant: str | None, now: float) -> bool:
        key = self._key("batch", batch_id)
        keys = [key, key + ":lines", self._queue]
        return self._run(lua.CANCEL, keys, [tenant or "", now, self._p, batch_id]) == 1

    @contextmanager
    def _ending(self, batch_id: str) -> Iterator[Ending[None] | None]:
        """Nothing is held: `_end`'s script checks again that the batch may end."""
        key = self._key("batch", batch_id)
        state = self._db.hmget(key, ["status", "open"])
        if state[0] is None or state[0].decode() not in OPEN_BATCH:
            self._db.srem(self._unsettled, batch_id)  # ended, or past its TTL
            yield None
        elif int(state[1]) > 0:
            yield None
        else:
            yield Ending(self._outcomes(key + ":lines"), None)

    def _end(
        self, batch_id: str, ending: Ending[None], outputs: Outputs, now: float, ttl_s: float
    ) -> bool:
        key = self._key("batch", batch_id)
        (files, (good, bad)) = outputs
        args = [self._p, now, ms(ttl_s), *files, good, bad, batch_id]
        return self._run(lua.SETTLE, [key, key + ":lines"], args) == 1

    def _outcomes(self, lines_key: str) -> list[Outcome]:
        """A batch's finished lines, in input order."""
        ids = [i.decode() for i in self._db.zrange(lines_key, 0, -1)]
        fields = ["status", "custom_id", "result_status", "result"]
        with self._db.pipeline(transaction=False) as reads:
            for job_id in ids:
                reads.hmget(self._key("job", job_id), fields)
            rows = reads.execute()
        return [
            Outcome(job_id, custom.decode(), int(code), result)
            for job_id, (status, custom, code, result) in zip(ids, rows, strict=True)
            if status in (b"succeeded", b"failed")
        ]


class RedisJobStore(RedisJobs, RedisFiles, RedisBatches):
    """The jobs, files and batches in the Redis server `cfg` names (RedisDb)."""


def _job_fields(
    job_id: str, tenant: str | None, path: str, body: bytes, now: float, score: float,
    webhook: str | None = None,
) -> dict[str, object]:  # fmt: skip
    """A new job's hash, queued at `score`."""
    fields: dict[str, object] = {
        "id": job_id, "path": path, "body": body, "status": "queued", "created": now,
        "updated": now, "attempts": 0, "score": score, "hook_attempts": 0,
    }  # fmt: skip
    if tenant is not None:
        fields["tenant"] = tenant
    if webhook is not None:
        fields["webhook"] = webhook
    return fields


def _job_of(flat: list[bytes]) -> Job:
    """A job from a script's HGETALL (field, value, field, value, ...)."""
    return _job_from(dict(zip(flat[::2], flat[1::2], strict=True)))


def _job_from(f: dict[bytes, bytes]) -> Job:
    def text(name: bytes) -> str | None:
        value = f.get(name)
        return None if value is None else value.decode()

    code = f.get(b"result_status")
    return Job(
        id=f[b"id"].decode(),
        tenant=text(b"tenant"),
        path=f[b"path"].decode(),
        body=f[b"body"],
        status=f[b"status"].decode(),
        created=float(f[b"created"]),
        updated=float(f[b"updated"]),
        attempts=int(f.get(b"attempts", 0)),
        result_status=None if code is None else int(code),
        result=f.get(b"result"),
        batch_id=text(b"batch_id"),
        webhook=text(b"webhook"),
        hook_state=text(b"hook_state"),
        hook_attempts=int(f.get(b"hook_attempts", 0)),
    )


def _batch_from(f: dict[bytes, bytes]) -> Batch:
    def text(name: str) -> str | None:
        value = f.get(name.encode())
        return None if value is None else value.decode()

    def number(name: str) -> float | None:
        value = f.get(name.encode())
        return None if value is None else float(value)

    return Batch(
        id=text("id") or "",
        endpoint=text("endpoint") or "",
        input_file_id=text("input_file_id") or "",
        completion_window=text("completion_window") or "",
        metadata=f.get(b"metadata"),
        status=text("status") or "",
        errors=f.get(b"errors"),
        total=int(f.get(b"total", 0)),
        completed=int(f.get(b"completed", 0)),
        failed=int(f.get(b"failed", 0)),
        output_file_id=text("output_file_id"),
        error_file_id=text("error_file_id"),
        created=float(f[b"created"]),
        in_progress_at=number("in_progress_at"),
        cancelling_at=number("cancelling_at"),
        finished_at=number("finished_at"),
        expires=number("expires"),
    )

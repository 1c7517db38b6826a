"""The job store for several router replicas: one Redis server (not a Cluster) that every
worker of every replica shares, with the leases, attempts and TTLs store.py describes.

Keys, under `key_prefix`: `job:<id>` (a hash per job), `queue` (the waiting ids, scored
so that single async jobs come before batch lines, each in arrival order), `running`
(ids by lease deadline), `hooks` (ids of due webhooks by due time), `file:<id>`,
`batch:<id>` (a hash that counts its open, completed and failed lines),
`batch:<id>:lines` (its line ids by line number), and for listing `files:of:<tenant>`
and `batches:of:<tenant>` (ids by creation; an id whose hash expired is dropped from
them when a listing meets it). Every step that must not be seen half
done (a claim, a renewal, a result, a release, a cancel, a batch's end) is one Lua
script, which Redis runs atomically. TTLs are Redis's own (`PEXPIRE`), so `expire` has
nothing to do; a batch's lines have none (they go when it ends). `unsettled` holds the
batches whose last line ended, until they end: a sweep ends those whose worker died
in between.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from router.config import ConfigError, RedisConfig
from router.jobs.store import (
    OPEN_BATCH,
    Batch,
    FilePieces,
    Job,
    Layout,
    Line,
    Outcome,
    Page,
    StoredFile,
    Writer,
)
from router.secrets import redis_password

#: batch lines score after every single job (epoch seconds stay far below this)
_BATCH_SCORE = 1e10
#: within a batch, lines in input order (Redis scores are doubles: 1e-5 still resolves)
_LINE_STEP = 1e-5

_CLAIM = """
local now = tonumber(ARGV[1])
local id = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[1], 'LIMIT', 0, 1)[1]
if not id then
  id = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not id then return false end
  redis.call('ZREM', KEYS[1], id)
end
local key = ARGV[4] .. 'job:' .. id
local deadline = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], deadline, id)
redis.call('HSET', key, 'status', 'running', 'owner', ARGV[3], 'lease_until', deadline,
  'updated', ARGV[1])
redis.call('HINCRBY', key, 'attempts', 1)
return redis.call('HGETALL', key)
"""
_RENEW = """
local key = ARGV[4] .. 'job:' .. ARGV[1]
if redis.call('HGET', key, 'owner') ~= ARGV[2] then return 0 end
if redis.call('HGET', key, 'status') ~= 'running' then return 0 end
redis.call('HSET', key, 'lease_until', ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
"""
_FINISH = """
local key = ARGV[8] .. 'job:' .. ARGV[1]
if redis.call('HGET', key, 'owner') ~= ARGV[2] then return 0 end
if redis.call('HGET', key, 'status') ~= 'running' then return 0 end
local now = tonumber(ARGV[6])
redis.call('HSET', key, 'status', ARGV[3], 'result_status', ARGV[4], 'result', ARGV[5],
  'updated', ARGV[6])
redis.call('HDEL', key, 'owner')
redis.call('ZREM', KEYS[1], ARGV[1])
local batch = redis.call('HGET', key, 'batch_id')
if batch then
  local bkey = ARGV[8] .. 'batch:' .. batch
  if redis.call('HINCRBY', bkey, 'open', -1) <= 0 then
    redis.call('SADD', ARGV[8] .. 'unsettled', batch)
  end
  redis.call('HINCRBY', bkey, tonumber(ARGV[4]) < 400 and 'completed' or 'failed', 1)
else
  redis.call('PEXPIRE', key, ARGV[7])
end
if redis.call('HEXISTS', key, 'webhook') == 1 then
  redis.call('HSET', key, 'hook_state', 'pending')
  redis.call('ZADD', KEYS[2], now, ARGV[1])
end
return 1
"""
_RELEASE = """
local n = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local key = ARGV[2] .. 'job:' .. id
  if redis.call('HGET', key, 'owner') == ARGV[1] then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HSET', key, 'status', 'queued', 'lease_until', 0)
    redis.call('HDEL', key, 'owner')
    redis.call('ZADD', KEYS[2], redis.call('HGET', key, 'score'), id)
    n = n + 1
  end
end
return n
"""
_DUE_HOOK = """
local id = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1)[1]
if not id then return false end
local key = ARGV[3] .. 'job:' .. id
if redis.call('EXISTS', key) == 0 then
  redis.call('ZREM', KEYS[1], id)
  return false
end
redis.call('ZADD', KEYS[1], ARGV[2], id)
return redis.call('HGETALL', key)
"""
_HOOK_TRIED = """
local key = ARGV[4] .. 'job:' .. ARGV[1]
redis.call('HSET', key, 'hook_state', ARGV[2])
redis.call('HINCRBY', key, 'hook_attempts', 1)
if ARGV[2] == 'pending' then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
"""
_CANCEL = """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return 0 end
if (redis.call('HGET', KEYS[1], 'tenant') or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[2])
local dropped = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local key = ARGV[3] .. 'job:' .. id
  if redis.call('HGET', key, 'status') == 'queued' then
    redis.call('HSET', key, 'status', 'cancelled')
    redis.call('ZREM', KEYS[3], id)
    dropped = dropped + 1
  end
end
if redis.call('HINCRBY', KEYS[1], 'open', -dropped) <= 0 then
  redis.call('SADD', ARGV[3] .. 'unsettled', ARGV[4])
end
return 1
"""
_SETTLE = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'in_progress' and status ~= 'cancelling' then return 0 end
if tonumber(redis.call('HGET', KEYS[1], 'open')) > 0 then return 0 end
local tenant = redis.call('HGET', KEYS[1], 'tenant')
local names = {'batch_output.jsonl', 'batch_error.jsonl'}
local fields = {'output_file_id', 'error_file_id'}
for i = 1, 2 do
  local id, content = ARGV[3 + i], ARGV[5 + i]
  if content ~= '' then
    local fkey = ARGV[1] .. 'file:' .. id
    redis.call('HSET', fkey, 'purpose', 'batch_output', 'filename', names[i],
      'created', ARGV[2], 'content', content)
    if tenant then redis.call('HSET', fkey, 'tenant', tenant) end
    redis.call('PEXPIRE', fkey, ARGV[3])
    redis.call('ZADD', ARGV[1] .. 'files:of:' .. (tenant or ''), ARGV[2], id)
    redis.call('HSET', KEYS[1], fields[i], id)
  end
end
local final = status == 'cancelling' and 'cancelled' or 'completed'
redis.call('HSET', KEYS[1], 'status', final, 'finished_at', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  redis.call('DEL', ARGV[1] .. 'job:' .. id)
end
redis.call('DEL', KEYS[2])
redis.call('SREM', ARGV[1] .. 'unsettled', ARGV[8])
return 1
"""

#: a slice of a file's `content` field: only the slice crosses the network
_WRITTEN = """
local content = redis.call('HGET', KEYS[1], 'content')
if not content then return false end
return string.sub(content, tonumber(ARGV[1]) + 1, tonumber(ARGV[1]) + tonumber(ARGV[2]))
"""

_PUT_PART = """
local now = tonumber(ARGV[1])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('HDEL', KEYS[2], id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local used = 0
for _, size in ipairs(redis.call('HVALS', KEYS[2])) do used = used + tonumber(size) end
local size = string.len(ARGV[2])
if used + size > tonumber(ARGV[3]) then return 0 end
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[5], size)
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[5])
for i = 1, 3 do redis.call('PEXPIREAT', KEYS[i], math.floor(tonumber(ARGV[4]) * 1000)) end
return 1
"""


class RedisJobStore(FilePieces):
    """The jobs in the Redis server `cfg` names."""

    def __init__(self, cfg: RedisConfig) -> None:
        """Connect and check the server answers (ConfigError if not)."""
        try:
            import redis
        except ImportError:
            raise ConfigError(
                "jobs.store: redis needs the redis extra: pip install 'kvroute[redis]'"
            ) from None
        password = redis_password(cfg, "jobs.redis")
        self._redis = redis.exceptions
        self.errors: tuple[type[Exception], ...] = (redis.RedisError,)
        self._p = cfg.key_prefix
        self._db = redis.Redis.from_url(
            cfg.url, password=password, socket_timeout=cfg.timeout_s,
            socket_connect_timeout=cfg.timeout_s,
        )  # fmt: skip
        try:
            self._db.ping()
        except redis.RedisError as exc:
            raise ConfigError(f"jobs.redis: {cfg.url} does not answer: {exc}") from None
        scripts = (
            _CLAIM, _RENEW, _FINISH, _RELEASE, _DUE_HOOK, _HOOK_TRIED, _CANCEL, _SETTLE, _PUT_PART,
            _WRITTEN,
        )  # fmt: skip
        (
            self._claim, self._renew, self._finish, self._release, self._due_hook,
            self._hook_tried, self._cancel, self._settle, self._put_part, self._written_slice,
        ) = (self._db.register_script(s) for s in scripts)  # fmt: skip

    def _key(self, kind: str, ident: str) -> str:
        return f"{self._p}{kind}:{ident}"

    @property
    def _queue(self) -> str:
        return self._p + "queue"

    @property
    def _running(self) -> str:
        return self._p + "running"

    @property
    def _hooks(self) -> str:
        return self._p + "hooks"

    @property
    def _unsettled(self) -> str:
        return self._p + "unsettled"

    def reason(self, exc: Exception) -> str:
        """What failed, from redis-py's exception."""
        redis = self._redis
        for kind, reason in (
            (redis.BusyLoadingError, "Redis is loading its data"),
            (redis.AuthenticationError, "Redis refused the password"),
            (redis.TimeoutError, "Redis did not answer in time"),
            (redis.ConnectionError, "Redis does not answer"),
            (redis.ReadOnlyError, "Redis is a read-only replica"),
        ):
            if isinstance(exc, kind):
                return reason
        if str(exc).startswith("OOM"):
            return "Redis is out of memory"
        return f"Redis failed ({type(exc).__name__})"

    # jobs
    def put(
        self, job_id: str, tenant: str | None, path: str, body: bytes, webhook: str | None = None
    ) -> Job:
        now = time.time()
        fields = _job_fields(job_id, tenant, path, body, now, score=now, webhook=webhook)
        with self._db.pipeline() as tx:
            tx.hset(self._key("job", job_id), mapping=fields)
            tx.zadd(self._queue, {job_id: now})
            tx.execute()
        return Job(job_id, tenant, path, body, "queued", now, now, 0, None, None, None, webhook)

    def get(self, job_id: str, tenant: str | None) -> Job | None:
        found = self._db.hgetall(self._key("job", job_id))
        if not found or b"batch_id" in found or not _owned(found, tenant):
            return None
        return _job(found)

    def claim(self, owner: str, lease_s: float) -> Job | None:
        args = [time.time(), lease_s, owner, self._p]
        found = self._claim(keys=[self._queue, self._running], args=args)
        return None if not found else _job_of(found)

    def renew(self, job_id: str, owner: str, lease_s: float) -> bool:
        args = [job_id, owner, time.time() + lease_s, self._p]
        return self._renew(keys=[self._running], args=args) == 1

    def finish(
        self, job_id: str, owner: str, status: str, code: int, result: bytes, ttl_s: float
    ) -> bool:
        args = [job_id, owner, status, code, result, time.time(), _ms(ttl_s), self._p]
        return self._finish(keys=[self._running, self._hooks], args=args) == 1

    def release(self, owner: str) -> int:
        return self._release(keys=[self._running, self._queue], args=[owner, self._p])

    def expire(self) -> int:
        """Nothing: Redis drops what is past its TTL itself."""
        return 0

    def due_hook(self, lease_s: float) -> Job | None:
        now = time.time()
        found = self._due_hook(keys=[self._hooks], args=[now, now + lease_s, self._p])
        return None if not found else _job_of(found)

    def hook_tried(self, job_id: str, state: str, retry_in: float) -> None:
        args = [job_id, state, time.time() + retry_in, self._p]
        self._hook_tried(keys=[self._hooks], args=args)

    # files
    def put_file(
        self,
        file_id: str,
        tenant: str | None,
        purpose: str,
        filename: str,
        content: bytes,
        ttl_s: float,
    ) -> StoredFile:
        now = time.time()
        key = self._key("file", file_id)
        fields = {"purpose": purpose, "filename": filename, "created": now, "content": content}
        if tenant is not None:
            fields["tenant"] = tenant
        with self._db.pipeline() as tx:
            tx.hset(key, mapping=fields)
            tx.pexpire(key, _ms(ttl_s))
            tx.zadd(self._of("files", tenant), {file_id: now})
            tx.execute()
        return StoredFile(file_id, purpose, filename, now, len(content))

    def put_part(
        self, file_id: str, tenant: str | None, n: int, data: bytes, ttl_s: float, quota: int
    ) -> bool:
        """Keep piece `n` of an upload (pieces come in order); False, keeping nothing,
        if the tenant's uploads would then pass `quota` bytes. What each upload holds
        is counted per tenant (`uploads:of:`, `upload_bytes:of:`) until it expires."""
        now = time.time()
        keys = [self._of("uploads", tenant), self._of("upload_bytes", tenant), self._parts(file_id)]
        args = [now, data, quota, now + ttl_s, file_id]
        return self._put_part(keys=keys, args=args) == 1

    def seal_file(
        self, file_id: str, tenant: str | None, purpose: str, filename: str, ttl_s: float
    ) -> StoredFile:
        now = time.time()
        key, parts = self._key("file", file_id), self._parts(file_id)
        size = int(self._db.hget(self._of("upload_bytes", tenant), file_id) or 0)
        fields = {"purpose": purpose, "filename": filename, "created": now, "content": b""}
        fields |= {"size": size} | ({} if tenant is None else {"tenant": tenant})
        with self._db.pipeline() as tx:
            tx.hset(key, mapping=fields)
            for held in (key, parts):
                tx.pexpire(held, _ms(ttl_s))
            tx.zadd(self._of("files", tenant), {file_id: now})
            tx.execute()
        return StoredFile(file_id, purpose, filename, now, size)

    def drop_parts(self, file_id: str, tenant: str | None) -> None:
        with self._db.pipeline() as tx:
            tx.delete(self._parts(file_id))
            tx.zrem(self._of("uploads", tenant), file_id)
            tx.hdel(self._of("upload_bytes", tenant), file_id)
            tx.execute()

    def _parts(self, file_id: str) -> str:
        return self._key("file", file_id) + ":parts"

    def file(self, file_id: str, tenant: str | None) -> StoredFile | None:
        key = self._key("file", file_id)
        with self._db.pipeline() as tx:
            tx.hmget(key, ["tenant", "purpose", "filename", "created", "size"])
            tx.hstrlen(key, "content")
            (owner, purpose, name, created, parts), size = tx.execute()
        if purpose is None or not _owned({b"tenant": owner} if owner else {}, tenant):
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
        if found is None or not _owned({b"tenant": owner} if owner else {}, tenant):
            return None
        return Layout(written + int(uploaded or 0), written, parts)

    def _written(self, file_id: str, start: int, size: int) -> bytes | None:
        found = self._written_slice(keys=[self._key("file", file_id)], args=[start, size])
        return None if found is None else bytes(found)

    def _part(self, file_id: str, n: int) -> bytes | None:
        found = self._db.lindex(self._parts(file_id), n)
        return None if found is None else bytes(found)

    def files(
        self, tenant: str | None, purpose: str | None, after: str | None, limit: int
    ) -> Page[StoredFile]:
        found: list[StoredFile] = []
        index = self._of("files", tenant)
        ids, more = self._page(index, after, limit if purpose is None else None)
        for file_id in ids:
            stored = self.file(file_id, tenant)
            if stored is None:
                self._db.zrem(index, file_id)  # expired
            elif purpose is None or stored.purpose == purpose:
                found.append(stored)
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

    def _of(self, kind: str, tenant: str | None) -> str:
        """The listing index of `kind` for `tenant`."""
        return f"{self._p}{kind}:of:{tenant or ''}"

    def _page(self, index: str, after: str | None, limit: int | None) -> tuple[list[str], bool]:
        """Ids of `index`, newest first, past `after` (none if it is not there): `limit`
        of them (None: all), and whether more follow."""
        start = 0
        if after is not None:
            rank = self._db.zrevrank(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        stop = -1 if limit is None else start + limit
        ids = [i.decode() for i in self._db.zrevrange(index, start, stop)]
        if limit is None or len(ids) <= limit:
            return ids, False
        return ids[:limit], True

    # batches
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
                job = _job_fields(line.id, tenant, line.path, line.body, batch.created, score=score)
                job |= {"batch_id": batch.id, "line": n, "custom_id": line.custom_id}
                tx.hset(self._key("job", line.id), mapping=job)
                tx.zadd(self._queue, {line.id: score})
                tx.zadd(key + ":lines", {line.id: n})
            tx.execute()

    def batch(self, batch_id: str, tenant: str | None) -> Batch | None:
        found = self._db.hgetall(self._key("batch", batch_id))
        if not found or not _owned(found, tenant):
            return None
        return _batch(found)

    def batches(self, tenant: str | None, after: str | None, limit: int) -> Page[Batch]:
        index = self._of("batches", tenant)
        ids, more = self._page(index, after, limit)
        found = []
        for batch_id in ids:
            batch = self.batch(batch_id, tenant)
            if batch is None:
                self._db.zrem(index, batch_id)  # expired
            else:
                found.append(batch)
        return Page(found, more)

    def cancel_batch(self, batch_id: str, tenant: str | None) -> bool:
        key = self._key("batch", batch_id)
        keys = [key, key + ":lines", self._queue]
        args = [tenant or "", time.time(), self._p, batch_id]
        return self._cancel(keys=keys, args=args) == 1

    def settle(self, batch_id: str, files: tuple[str, str], write: Writer, ttl_s: float) -> bool:
        key = self._key("batch", batch_id)
        state = self._db.hmget(key, ["status", "open"])
        if state[0] is None or state[0].decode() not in OPEN_BATCH:
            self._db.srem(self._unsettled, batch_id)  # ended, or past its TTL
            return False
        if int(state[1]) > 0:
            return False
        good, bad = write(self._outcomes(key + ":lines"))
        args = [self._p, time.time(), _ms(ttl_s), *files, good, bad, batch_id]
        return self._settle(keys=[key, key + ":lines"], args=args) == 1

    def unsettled(self) -> list[str]:
        """The batches whose last line ended (or was cancelled) and that did not end."""
        return [b.decode() for b in self._db.smembers(self._unsettled)]

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


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _job_fields(
    job_id: str, tenant: str | None, path: str, body: bytes, now: float, score: float,
    webhook: str | None = None,
) -> dict[str, object]:  # fmt: skip
    fields: dict[str, object] = {
        "id": job_id, "path": path, "body": body, "status": "queued", "created": now,
        "updated": now, "attempts": 0, "score": score, "hook_attempts": 0,
    }  # fmt: skip
    if tenant is not None:
        fields["tenant"] = tenant
    if webhook is not None:
        fields["webhook"] = webhook
    return fields


def _owned(found: dict[bytes, bytes], tenant: str | None) -> bool:
    owner = found.get(b"tenant")
    return (owner.decode() if owner is not None else None) == tenant


def _job_of(flat: list[bytes]) -> Job:
    """A job from a script's HGETALL (field, value, field, value, ...)."""
    return _job(dict(zip(flat[::2], flat[1::2], strict=True)))


def _job(f: dict[bytes, bytes]) -> Job:
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


def _batch(f: dict[bytes, bytes]) -> Batch:
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

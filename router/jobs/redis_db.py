"""The Redis job store's server: the connection, its keys under `key_prefix`, the Lua
scripts (redis_scripts.py) registered with it, and what a failure of it is called.
redis_store.py keeps the jobs, files and batches in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from router.config import ConfigError, RedisConfig
from router.jobs import redis_scripts
from router.jobs.logic import page
from router.secrets import redis_password

T = TypeVar("T")


class RedisDb:
    """The Redis server `cfg` names (one server, not a Cluster)."""

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
        self._scripts = {source: self._db.register_script(source) for source in redis_scripts.ALL}

    def _run(self, script: str, keys: Sequence[str], args: Sequence[object]) -> Any:
        """What `script` (one of redis_scripts.py's) returns, run with `keys` and `args`."""
        return self._scripts[script](keys=keys, args=args)

    def _key(self, kind: str, ident: str) -> str:
        return f"{self._p}{kind}:{ident}"

    def _of(self, kind: str, tenant: str | None) -> str:
        """The listing index of `kind` for `tenant`."""
        return f"{self._p}{kind}:of:{tenant or ''}"

    def _parts(self, file_id: str) -> str:
        return self._key("file", file_id) + ":parts"

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
        if limit is None:
            return ids, False
        window = page(ids, limit)
        return window.items, window.more

    def _listed(self, index: str, ids: list[str], fetch: Callable[[str], T | None]) -> list[T]:
        """What `fetch` finds of `ids`, in their order; an id whose hash expired leaves
        the listing `index`."""
        found = []
        for ident in ids:
            item = fetch(ident)
            if item is None:
                self._db.zrem(index, ident)  # expired
            else:
                found.append(item)
        return found


def ms(seconds: float) -> int:
    """A TTL in Redis's milliseconds, at least 1 (PEXPIRE 0 would drop the key at once)."""
    return max(1, int(seconds * 1000))


def owned(found: dict[bytes, bytes], tenant: str | None) -> bool:
    """Whether the hash `found` is `tenant`'s."""
    owner = found.get(b"tenant")
    return (owner.decode() if owner is not None else None) == tenant

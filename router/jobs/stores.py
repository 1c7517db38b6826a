"""The job store the config names: SQLite (one host) or Redis (several replicas)."""

from __future__ import annotations

from router.config import JobsConfig
from router.jobs.redis_store import RedisJobStore
from router.jobs.sqlite_store import SqliteJobStore
from router.jobs.store import JobStore


def open_store(cfg: JobsConfig) -> JobStore:
    """The store `cfg.store` names (ConfigError if it cannot be opened)."""
    if cfg.store == "redis":
        return RedisJobStore(cfg.redis)
    return SqliteJobStore(cfg.path)

"""Secrets the config names but never holds: read from a file or an environment variable.

Every secret of the config follows this convention (`*_file`, `*_env`): the data-plane
tokens and signing key, the admin token, the backends' API keys.
"""

from __future__ import annotations

import os
from pathlib import Path

from router.config import ConfigError, RedisConfig


def read_secret(file: str | None, env: str | None, what: str) -> str:
    """A secret from a file (stripped) or an environment variable; ConfigError if absent."""
    if file is not None:
        try:
            value = Path(file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{what}: cannot read {file}: {exc.strerror}") from None
    else:
        value = os.environ.get(env or "", "").strip()
        if not value:
            raise ConfigError(f"{what}: environment variable {env} is not set")
    if not value:
        raise ConfigError(f"{what}: {file} is empty")
    return value


def redis_password(cfg: RedisConfig, what: str) -> str | None:
    """A Redis server's password as `cfg` names it (None: the server wants none)."""
    if cfg.password_file or cfg.password_env:
        return read_secret(cfg.password_file, cfg.password_env, f"{what} password")
    return None

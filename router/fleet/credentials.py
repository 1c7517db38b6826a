"""What the router sends each backend besides the client's request: its API key as
`Authorization: Bearer` (vLLM's `--api-key` checks that header) and its extra headers,
its own or the fleet's defaults (router/config.py `BackendCredentials`).

The key is read when the backend joins or the config is reloaded (a rotated key file
or variable takes effect on SIGHUP) and lives only in the backend's `headers`, which
nothing logs or shows.
"""

from __future__ import annotations

from router.config import BackendConfig, BackendCredentials, ConfigError
from router.secrets import read_secret


def upstream_headers(cfg: BackendConfig, defaults: BackendCredentials) -> dict[str, str]:
    """The headers for `cfg`'s backend; ConfigError if its key cannot be read."""
    keyed = cfg if cfg.has_key else defaults
    headers = {**defaults.headers, **cfg.headers}
    if keyed.has_key:
        what = f"backend {cfg.key}: api key"
        key = read_secret(keyed.api_key_file, keyed.api_key_env, what)
        if any(c in key for c in "\r\n\0"):  # it would split the request head
            raise ConfigError(f"{what}: holds a line break or NUL")
        headers["Authorization"] = f"Bearer {key}"
    return headers

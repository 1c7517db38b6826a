"""How the router reaches each backend besides the client's request: its API key as
`Authorization: Bearer` (vLLM's `--api-key` checks that header), its extra headers, and
for https the CA bundle its certificate is verified against; its own or the fleet's
defaults (router/config.py `BackendCredentials`).

The key is read when the backend joins or the config is reloaded (a rotated key file
or variable takes effect on SIGHUP) and lives only in the backend's `headers`, which
nothing logs or shows.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from router.config import BackendConfig, BackendCredentials, ConfigError
from router.secrets import read_secret


class Reach(NamedTuple):
    """What every exchange with one backend carries: its headers (the key among them:
    secret, never shown) and, for https, how its certificate is verified."""

    headers: dict[str, str]
    tls: ssl.SSLContext | None


NO_REACH = Reach({}, None)
#: the statuses of a backend that refuses the credentials it was sent
REFUSALS = frozenset({401, 403})


def routers_own(own: Mapping[str, str], sent: Mapping[str, str]) -> bool:
    """Whether a request carried the router's credentials rather than the client's: the
    backend's own Authorization (`own`, which replaces the client's), or none at all
    (`sent`: the client's headers as forwarded; the router keeps its own token)."""
    return "Authorization" in own or "Authorization" not in sent


def reach_all(configs: Iterable[BackendConfig], defaults: BackendCredentials) -> list[Reach]:
    """Each backend's reach, in order; ConfigError (before any is used) if a key or a
    CA bundle cannot be read."""
    contexts = TlsContexts()
    return [
        Reach(upstream_headers(c, defaults), contexts.for_backend(c, defaults)) for c in configs
    ]


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


class TlsContexts:
    """How https backends' certificates are verified (always): against their own CA
    bundle, the fleet's, or the system's. One context per bundle, made for one config
    (a reload reads a changed bundle again), shared by the backends that use it."""

    def __init__(self) -> None:
        self._made: dict[str | None, ssl.SSLContext] = {}

    def for_backend(
        self, cfg: BackendConfig, defaults: BackendCredentials
    ) -> ssl.SSLContext | None:
        """None for an http backend; ConfigError if its bundle cannot be loaded."""
        if not cfg.url.startswith("https:"):
            return None
        ca_file = cfg.ca_file or defaults.ca_file
        if ca_file not in self._made:
            try:
                self._made[ca_file] = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"backend {cfg.key}: ca_file {ca_file}: {exc}") from None
        return self._made[ca_file]

"""YAML → typed `Config`, validated once at load.

Every Struct forbids unknown fields and bounds its numbers, so a typo or a negative
threshold fails at start with the path of the field (`$.routing.prefix_length`). The
`routing:` section is the tagged union of every registered strategy's params. After
load the rest of the router trusts the config and never re-checks a value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml
from msgspec import Meta
from yarl import URL

import policies
from policies.random import RandomParams

Seconds = Annotated[float, Meta(gt=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: Port = 8000


class BackendConfig(_Strict):
    url: str
    name: str | None = None
    models: list[str] | None = None
    weight: Annotated[int, Meta(ge=1, le=1000)] = 1

    def __post_init__(self) -> None:
        url = URL(self.url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"backend url {self.url!r} must look like http://host:port")
        if url.path not in ("", "/"):
            raise ValueError(f"backend url {self.url!r} must not have a path")

    @property
    def key(self) -> str:
        """The backend's identity: its name, or host:port. Hashing is keyed by it."""
        if self.name:
            return self.name
        url = URL(self.url)
        return f"{url.host}:{url.port}"


class TimeoutsConfig(_Strict):
    """Upstream timeouts in seconds."""

    connect: Seconds = 5.0
    first_byte: Seconds = 600.0
    idle: Seconds = 120.0
    total: Seconds = 3600.0


class LimitsConfig(_Strict):
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 16 * 1024 * 1024
    max_concurrent_requests: Annotated[int, Meta(ge=1)] = 10_000


class Config(_Strict):
    backends: list[BackendConfig]
    listen: ListenConfig = ListenConfig()
    routing: policies.params_union() = RandomParams()  # type: ignore[valid-type]
    timeouts: TimeoutsConfig = TimeoutsConfig()
    limits: LimitsConfig = LimitsConfig()
    #: request header whose value isolates tenants' fingerprints (cache_salt always does)
    tenant_header: str | None = None
    #: how often backends' /v1/models is polled, seconds
    models_refresh_interval: Seconds = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("at least one backend is required")
        seen: set[str] = set()
        for backend in self.backends:
            for key in {backend.key, str(URL(backend.url))}:
                if key in seen:
                    raise ValueError(f"duplicate backend {key!r}")
                seen.add(key)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, field and problem."""


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def build(data: dict[str, Any], source: str = "config") -> Config:
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return `data` with command-line values applied (dotted keys, None = not given).

    A new `routing.strategy` keeps only the routing keys that strategy understands,
    since the file's parameters were written for the strategy it replaces.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    strategy = overrides.get("routing.strategy")
    if strategy is not None:
        routing = out.get("routing") or {}
        known = _strategy_fields(strategy)
        out["routing"] = {k: v for k, v in routing.items() if k in known}
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, _, key = dotted.rpartition(".")
        target = out.setdefault(section, {}) if section else out
        target[key] = value
    return out


def _strategy_fields(strategy: str) -> set[str]:
    try:
        params = policies.policy_class(strategy).params_type
    except KeyError:
        return set()
    return set(params.__struct_fields__)


def load(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    data = read_yaml(path) if path else {}
    return build(apply_overrides(data, overrides or {}), str(path or "command line"))

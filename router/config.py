"""YAML → typed `Config`, validated once at load.

Every Struct forbids unknown fields and bounds its numbers, so a typo or a negative
threshold fails at start with the path of the field (`$.routing.prefix_length`). The
`routing:` section is the tagged union of every registered strategy's params. After
load the rest of the router trusts the config and never re-checks a value.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import yaml
from msgspec import Meta
from yarl import URL

import policies
from policies.kv_aware import KvAwareParams, KvTokenizerParams

Seconds = Annotated[float, Meta(gt=0)]
LOG_LEVELS = ("debug", "info", "warning", "error")
#: the strategy of a `routing:` section that names none, and of a file with no section
DEFAULT_ROUTING = KvAwareParams()
#: KV_AWARE's block, in tokens, where no backend publishes KV events (then its keys need
#: only agree with its own earlier ones): a quarter of the keys of vLLM's 16-token
#: block, so a quarter of the prefix index's memory and of a new prompt's keys to insert
APPROXIMATE_BLOCK_SIZE = 64
DEFAULT_STRATEGY: str = DEFAULT_ROUTING.__struct_config__.tag
Port = Annotated[int, Meta(ge=0, le=65535)]
#: what a tenant id may be (signed tokens, static token lines, metrics.tenants)
TENANT_PATTERN = r"[A-Za-z0-9._:-]{1,64}"
Tenant = Annotated[str, Meta(pattern=f"^{TENANT_PATTERN}$")]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ListenerTls(_Strict):
    """A listener's certificate (PEM: the chain, leaf first) and its private key, as
    files (the key is never inline). Read at start and again on every reload, so a
    renewed pair at the same paths is served to new connections after a SIGHUP."""

    cert_file: str
    key_file: str


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: Port = 8000
    #: connections the kernel queues before a worker accepts them (each worker has its
    #: own queue with SO_REUSEPORT; Linux caps it at net.core.somaxconn). aiohttp's
    #: default of 128 overflows when a thousand clients connect at once.
    backlog: Annotated[int, Meta(ge=1, le=65535)] = 4096
    #: HTTPS (TLS 1.2+, HTTP/1.1) instead of plain HTTP; also gRPC's unless it sets its own
    tls: ListenerTls | None = None


class GrpcConfig(_Strict):
    """The gRPC ingress: off by default, so a router opens no second port unasked.

    `host` unset means the HTTP listener's host; the port is its own (50051, gRPC's usual).
    `tls` unset means the HTTP listener's (`listen.tls`): TLS on one means TLS on both.
    """

    enabled: bool = False
    host: str | None = None
    port: Port = 50051
    tls: ListenerTls | None = None


class KvEventsConfig(_Strict):
    """Where a backend publishes vLLM KV cache events (its `--kv-events-config`)."""

    #: the PUB socket, e.g. tcp://10.0.0.5:5557 (vLLM binds tcp://*:5557 by default)
    endpoint: str
    #: the replay ROUTER socket, if vLLM has `replay_endpoint` set; fills sequence gaps
    replay_endpoint: str | None = None
    #: frame-0 topic prefix to subscribe to ("" = all)
    topic: str = ""


class TelemetryConfig(_Strict):
    """Backend /metrics scraping, beside the request path (KV_AWARE reads it)."""

    enabled: bool = True
    scrape_interval: Seconds = 1.0
    #: metrics older than this count as absent, seconds
    stale_after: Seconds = 5.0


class _Discovered(
    msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, tag_field="kind"
):
    """What every discovered backend shares: its port and per-backend options."""

    port: Port = 8000
    weight: Annotated[int, Meta(ge=1, le=1000)] = 1
    models: list[str] | None = None
    #: each address's KV event PUB / replay ports (vLLM --kv-events-config), if any
    kv_events_port: Port | None = None
    kv_replay_port: Port | None = None
    kv_topic: str = ""
    #: the pool its backends belong to (set from `pools`)
    pool: str | None = None


class DnsDiscoveryConfig(_Discovered, tag="dns"):
    """Backends from DNS: every A/AAAA record of `name` is a vLLM server on `port`
    (e.g. a Kubernetes headless Service), re-resolved every `interval` seconds."""

    name: str
    interval: Seconds = 10.0

    @property
    def label(self) -> str:
        return self.name


class KubernetesDiscoveryConfig(_Discovered, tag="kubernetes"):
    """Backends from the Kubernetes API: the ready addresses of the EndpointSlices of
    Service `service`, listed then watched, with the pod's service-account token."""

    service: str
    #: default: the namespace this pod runs in (its service-account namespace file)
    namespace: str | None = None
    #: default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    api_server: str | None = None
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"

    @property
    def label(self) -> str:
        return f"k8s:{self.namespace or ''}/{self.service}"


#: headers the router writes itself, or that configure the connection: `headers` may
#: not set them (the key goes in `api_key_*`)
_RESERVED_HEADERS = frozenset(
    {
        "authorization",
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "x-request-id",
    }
)
_TOKEN_CHARS = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


class BackendCredentials(_Strict):
    """How the router reaches a backend besides the client's request: vLLM's `--api-key`
    checks `Authorization: Bearer <key>`, so the key read from `api_key_file` or the
    `api_key_env` variable (never written in the YAML) goes as that; `headers` (not
    secret) go with every request, health check, scrape and model poll too; `ca_file`
    verifies an https backend signed by a private CA."""

    api_key_env: str | None = None
    api_key_file: str | None = None
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    #: CA bundle (PEM) that signed an https backend's certificate; unset: the system's.
    #: The certificate is always verified, its name against the URL's host.
    ca_file: str | None = None

    def __post_init__(self) -> None:
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("give api_key_env or api_key_file, not both")
        for name, value in self.headers.items():
            if not name or not set(name) <= _TOKEN_CHARS:
                raise ValueError(f"header name {name!r} is not a valid HTTP token")
            if name.lower() in _RESERVED_HEADERS:
                raise ValueError(f"header {name!r} is the router's own (the key: api_key_*)")
            if any(c in value for c in "\r\n\0"):
                raise ValueError(f"header {name!r}: a value may not hold CR, LF or NUL")

    @property
    def has_key(self) -> bool:
        return self.api_key_env is not None or self.api_key_file is not None


class BackendConfig(BackendCredentials, kw_only=True):
    """One vLLM server; its credentials, unset, are `backend_defaults`' (a key of its
    own replaces the default key; its headers add to the default headers)."""

    url: str
    name: str | None = None
    models: list[str] | None = None
    weight: Annotated[int, Meta(ge=1, le=1000)] = 1
    kv_events: KvEventsConfig | None = None
    #: the pool it belongs to (set from `pools`; None: the one pool of a flat fleet)
    pool: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        url = URL(self.url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"backend url {self.url!r} must look like http://host:port")
        if url.query_string or url.fragment:
            raise ValueError(f"backend url {self.url!r} must not have a query or fragment")

    @property
    def prefix(self) -> str:
        """The URL's path, before every path the router asks for ("" for none): a
        backend behind a gateway at http://host/team/vllm gets /team/vllm/v1/..."""
        return URL(self.url).path.rstrip("/")

    @property
    def key(self) -> str:
        """The backend's identity: its name, or host:port and any path prefix. Hashing
        is keyed by it."""
        if self.name:
            return self.name
        url = URL(self.url)
        return f"{url.host}:{url.port}{self.prefix}"


#: at most this many pools, as the managed endpoints kvroute is modelled on allow
MAX_POOLS = 5


class PoolConfig(_Strict):
    """A pool of backends tried in `priority` order (lowest first): a request goes to
    the first pool with a backend below its saturation point (the strategy's cap), else
    on to the next. `model_map` renames the client's model for this pool's backends
    (a fallback pool serving a quantised variant under the same public name). Its
    backends and discovery sources are listed here and kept in the top-level lists,
    each marked with the pool's name."""

    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    #: required of a `both` pool; a prefill or decode pool without one comes after the
    #: pools that have one, in the order listed (its role already says where it serves)
    priority: Annotated[int, Meta(ge=0)] | None = None
    model_map: dict[str, str] = msgspec.field(default_factory=dict)
    #: false: the answers of a model `model_map` renamed name the model the client asked
    #: for, and /v1/models lists the client's names; true: both show the backends' own
    expose_backend_model: bool = False
    #: disaggregated serving (vLLM's KV connectors): a chat or completion request is
    #: prefilled in a `prefill` pool, then decoded in a `decode` pool; `both` serves whole
    role: Literal["both", "prefill", "decode"] = "both"
    #: the pool's own values of the strategy's per-pool parameters (its caps, and for
    #: KV_AWARE its backends' speeds), over the fleet's `routing`; `kvroute policies`
    #: lists which a strategy has
    routing: dict[str, Any] = msgspec.field(default_factory=dict)

    def params(self, fleet: policies.PolicyParams) -> policies.PolicyParams:
        """The strategy's parameters in this pool: the fleet's with its own."""
        return policies.tuned_params(fleet, self.routing) if self.routing else fleet


def pools_in_order(pools: Iterable[PoolConfig]) -> list[PoolConfig]:
    """The pools by priority, the preferred first; those without one (prefill and
    decode pools may leave it out) after them, in the order given."""
    return sorted(pools, key=lambda p: (p.priority is None, p.priority or 0))


class TimeoutsConfig(_Strict):
    """Upstream timeouts in seconds."""

    connect: Seconds = 5.0
    first_byte: Seconds = 600.0
    idle: Seconds = 120.0
    total: Seconds = 3600.0


class LimitsConfig(_Strict):
    """Client-side limits: sizes, read timeouts (slowloris), admission."""

    max_body_bytes: Annotated[int, Meta(ge=1024)] = 16 * 1024 * 1024
    #: requests in flight at once in the whole router (every worker's together)
    max_concurrent_requests: Annotated[int, Meta(ge=1)] = 10_000
    #: requests that may wait for a slot beyond max_concurrent_requests, in each
    #: worker (then 429)
    queue_size: Annotated[int, Meta(ge=0)] = 256
    #: longest wait for a slot in that queue, seconds (then 429)
    queue_timeout: Seconds = 5.0
    #: in-flight cap per tenant (token or tenant_header) in the whole router, None = no
    #: cap; with several workers, tenants hashed to one slot share it (shared_admission.py)
    max_concurrent_per_tenant: Annotated[int, Meta(ge=1)] | None = None
    #: longest request line or header line, bytes
    max_header_bytes: Annotated[int, Meta(ge=1024, le=1 << 20)] = 16 * 1024
    max_headers: Annotated[int, Meta(ge=8, le=1000)] = 100
    #: a connection whose request headers are incomplete (or that idles between
    #: keep-alive requests) this long is closed, seconds
    header_timeout: Seconds = 30.0
    #: the whole request body must arrive within this, seconds (else 408)
    body_timeout: Seconds = 60.0
    #: request bodies the router holds at once (arriving, or held by their request until
    #: it ends), bytes; beyond it a request is refused 503 + Retry-After before its body
    #: is read. Split evenly over the worker processes, each holding at least one
    #: max_body_bytes body (read at start).
    max_buffered_body_bytes: Annotated[int, Meta(ge=1024)] = 512 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError("limits.max_buffered_body_bytes must be at least max_body_bytes")


class LoraConfig(_Strict):
    """LoRA adapters loaded on demand (vLLM's POST /v1/load_lora_adapter, which needs
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on the backends): a request for one of
    `adapters` that no backend serves loads it on one backend first, from `source` with
    `{name}` replaced by the adapter's name. A backend keeps at most `max_loras` adapters
    the router loaded; one more unloads its least recently used. Only the listed names
    are ever loaded, so a client cannot make the router load what it likes."""

    load_on_demand: bool = False
    adapters: list[Annotated[str, Meta(min_length=1)]] = msgspec.field(default_factory=list)
    source: str = "{name}"
    max_loras: Annotated[int, Meta(ge=1)] = 4
    #: how long a load may take, listed by the backend's /v1/models included
    load_timeout: Seconds = 120.0

    def __post_init__(self) -> None:
        if self.load_on_demand and not self.adapters:
            raise ValueError("lora.load_on_demand needs lora.adapters: the names it may load")
        if "{name}" not in self.source:
            raise ValueError("lora.source must contain {name}, e.g. /models/loras/{name}")


class HealthConfig(_Strict):
    """Active checks: GET `path` on each backend every `interval` seconds.

    A check fails on a connection error, a 5xx, or no answer within `timeout`; a slow
    answer inside the timeout passes, so a busy backend is never marked down.
    """

    enabled: bool = True
    path: str = "/health"
    interval: Seconds = 10.0
    timeout: Seconds = 5.0
    #: consecutive failed checks that mark a backend down
    unhealthy_threshold: Annotated[int, Meta(ge=1)] = 3
    #: consecutive passed checks that mark it up again
    healthy_threshold: Annotated[int, Meta(ge=1)] = 2


class BreakerConfig(_Strict):
    """Passive ejection: a circuit breaker per backend fed by the request path (the
    module docstring of router/fleet/breaker.py says what counts), and Envoy's two guards."""

    enabled: bool = True
    #: consecutive failed attempts that open it: connection errors, timeouts, cut streams
    #: and 502/503/504, which a client cannot cause; 4xx, 501 and 505 never count
    failure_threshold: Annotated[int, Meta(ge=1)] = 5
    #: how much of a failure another 5xx (a 500) is: a client can make a healthy backend
    #: answer 500 (a malformed body), so it takes 1 / weight of them in a row (0: never)
    server_error_weight: Annotated[float, Meta(ge=0, le=1)] = 0.1
    #: the most of the fleet (percent of backends) breakers may hold open at once; an
    #: opening past it is refused, so passive signals alone never eject a whole fleet
    max_ejection_percent: Annotated[float, Meta(ge=0, le=100)] = 50.0
    #: panic: below this share (percent) of a model's backends usable, its requests go
    #: to those whose breaker is open too, while they pass health checks (0: never)
    panic_threshold_percent: Annotated[float, Meta(ge=0, le=100)] = 50.0
    #: how long it stays open before one trial request is let through, seconds
    open_seconds: Seconds = 10.0
    #: consecutive trial successes that close it again
    half_open_successes: Annotated[int, Meta(ge=1)] = 2


class RetryConfig(_Strict):
    """Retries before the first byte reached the client, to another backend."""

    max_retries: Annotated[int, Meta(ge=0, le=10)] = 2
    #: backend statuses worth another backend (vLLM answers 503 when its queue is full;
    #: a 500 retried tells a backend's fault from the request's: router/dispatch/connect.py)
    retry_on: tuple[Annotated[int, Meta(ge=400, le=599)], ...] = (500, 502, 503, 504)
    #: first backoff, doubled per retry up to backoff_max, with jitter; seconds
    backoff: Seconds = 0.025
    backoff_max: Seconds = 0.5


class ShutdownConfig(_Strict):
    """SIGTERM: /ready turns 503, then after `unready_seconds` (time for a load balancer
    to notice) the listener closes and requests in flight get `drain_seconds` to end."""

    unready_seconds: Annotated[float, Meta(ge=0)] = 0.0
    drain_seconds: Annotated[float, Meta(ge=0)] = 30.0


def _one_source(section: str, file: str | None, env: str | None) -> None:
    if (file is None) == (env is None):
        raise ValueError(f"{section} needs exactly one of `token_file` or `token_env`")


class AdminConfig(_Strict):
    """The admin API: its own listener (loopback by default) and its own bearer token,
    read from a file or an environment variable (never written in this file)."""

    host: str = "127.0.0.1"
    port: Port = 8001
    token_file: str | None = None
    token_env: str | None = None

    def __post_init__(self) -> None:
        _one_source("admin", self.token_file, self.token_env)


class AuthConfig(_Strict):
    """Bearer tokens on the data plane; off unless `enabled`.

    Static tokens: one per line (`TOKEN [TENANT] [priority=CLASS] [trusted=true]`, `#`
    comments) in `tokens_file`, or comma-separated in the `tokens_env` variable. Signed tokens
    (`kvroute token issue`): HMAC-SHA256 with the key in `signing_key_file` or
    `signing_key_env`, expiring, at most 12 hours, carrying a tenant.
    """

    enabled: bool = False
    tokens_file: str | None = None
    tokens_env: str | None = None
    signing_key_file: str | None = None
    signing_key_env: str | None = None
    #: a gateway in front sets `tenant_header` (and no client can): then a request whose
    #: token names no tenant takes the header's. Otherwise, with auth on, the header is
    #: ignored; a token's own tenant always wins
    tenant_header_trusted: bool = False

    def __post_init__(self) -> None:
        sources = (self.tokens_file, self.tokens_env, self.signing_key_file, self.signing_key_env)
        if self.enabled and all(s is None for s in sources):
            raise ValueError("auth.enabled needs tokens_file, tokens_env or a signing key")
        if self.signing_key_file is not None and self.signing_key_env is not None:
            raise ValueError("auth: give signing_key_file or signing_key_env, not both")


class MetricsConfig(_Strict):
    """The router's Prometheus page, `/metrics`."""

    #: where it is served: "data" (the listen port, which every client reaches) or
    #: "admin" (the admin listener only, with no token: the data port answers 404)
    listen: Literal["data", "admin"] = "data"
    #: tenants shown by name in kvroute_tenant_requests_total, beside the static tokens'
    #: ones; any other tenant counts as `(other)`, so clients cannot add series
    tenants: tuple[Tenant, ...] = ()


class AccessLogConfig(_Strict):
    """One line per request: written in batches by a thread, off the request's path."""

    enabled: bool = True
    #: where the lines go: "-" for standard output, else a file opened for appending
    #: (each worker appends whole lines; rotate by copy and truncate, or restart)
    path: str = "-"


class CaptureConfig(_Strict):
    """Sampled requests and their answers as JSON lines (router/capture.py), written by
    a thread of each worker into files of its own under `path`."""

    enabled: bool = False
    #: the share of requests captured (beside `tenants` and the force header)
    sample: Annotated[float, Meta(ge=0, le=1)] = 0.0
    #: every request of these tenants is captured (to debug one tenant's traffic)
    tenants: tuple[str, ...] = ()
    #: whose `X-Kvroute-Capture: 1` header is honoured: these tenants' requests (the
    #: token's tenant with auth on), or everyone's with `force_header_anyone` (a
    #: trusted network); else the header is ignored, so no client can fill the disk
    force_tenants: tuple[Tenant, ...] = ()
    force_header_anyone: bool = False
    path: str = "/var/lib/kvroute/capture"
    #: a file is closed and a new one begun past this size (before gzip) or age
    max_bytes: Annotated[int, Meta(ge=4096)] = 256 << 20
    rotate_seconds: Annotated[float, Meta(gt=0)] = 3600.0
    gzip: bool = False
    #: keep the request (its headers and body) and the answer (its body, a stream
    #: reassembled); off, a record keeps the figures alone
    request: bool = True
    response: bool = True
    #: headers whose values are written as "[redacted]", beside Authorization,
    #: Proxy-Authorization, Cookie and X-Api-Key, which always are
    redact: tuple[str, ...] = ()
    #: records waiting for the writer, past which new ones are dropped and counted
    queue_records: Annotated[int, Meta(ge=1)] = 1024


class UsageConfig(_Strict):
    """Token accounting beside `kvroute_tokens_total` (router/usage_records.py)."""

    #: ask vLLM for the usage of every chat and completion stream whose client did not
    #: (`stream_options.include_usage`), and take that usage event out of what the
    #: client gets, so that streams are counted too
    stream_usage: bool = False
    #: write each worker's counts by tenant, model and pool every `interval_s` to the
    #: SQLite database at `path` (read back with GET /admin/usage)
    records: bool = False
    path: str = "/var/lib/kvroute/usage.db"
    interval_s: Seconds = 60.0


#: the content codings the router can compress answers with (router/ingress/compression.py)
ContentCoding = Literal["zstd", "gzip"]


class CompressionConfig(_Strict):
    """Answers compressed for clients that ask (`Accept-Encoding`), streams included:
    each SSE event is flushed through the compressor as it arrives, so the client can
    decode it at once (router/ingress/compression.py). Off by default: then nothing of
    it runs, and the client's Accept-Encoding goes to the backend as before."""

    enabled: bool = False
    #: whole answers smaller than this go uncompressed (a few hundred bytes save less than
    #: the encoder costs); a stream is compressed whatever its size, which is not known
    #: when it begins
    min_bytes: Annotated[int, Meta(ge=1)] = 1024
    #: the codings offered, the router's preferred first; the client's q-values rank
    #: them before this order does
    algorithms: Annotated[tuple[ContentCoding, ...], Meta(min_length=1)] = ("zstd", "gzip")
    #: gzip's level: 1, nginx's default too. Measured here, level 6 made a stream 1.5%
    #: smaller (the flush after each event weighs more than the level) and whole JSON
    #: answers 6-10% smaller, for 2 to 6 times the CPU
    gzip_level: Annotated[int, Meta(ge=1, le=9)] = 1
    #: zstd's level: 3 is the library's default; higher ones cost more CPU per byte
    #: (levels past 19 want windows of hundreds of MB)
    zstd_level: Annotated[int, Meta(ge=1, le=19)] = 3

    def __post_init__(self) -> None:
        if len(set(self.algorithms)) < len(self.algorithms):
            raise ValueError(f"compression.algorithms: each at most once, got {self.algorithms}")


class TracingConfig(_Strict):
    """OpenTelemetry spans per request, exported over OTLP/HTTP (the `otel` extra).

    A client's `traceparent` decides for its request: a sampled one is continued, an
    unsampled one passes to the backend untouched, and neither costs a span. A request
    with none starts a trace at `sample_ratio`."""

    enabled: bool = False
    sample_ratio: Annotated[float, Meta(ge=0, le=1)] = 1.0
    #: an OTLP/HTTP traces endpoint (an OpenTelemetry collector, usually on the host)
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = "kvroute"


class RedisConfig(_Strict):
    """A Redis server (one, not a Cluster: the store's scripts touch keys they derive)
    for the jobs of several router replicas (and, as `ClusterRedisConfig`, for replicas
    sharing what they learn); msgspec adds the section's path to its errors."""

    url: str = "redis://127.0.0.1:6379/0"
    #: the password, from a file or an environment variable (never in the URL)
    password_file: str | None = None
    password_env: str | None = None
    #: every key the store writes starts with this (several routers' stores in one Redis)
    key_prefix: str = "kvroute:jobs:"
    timeout_s: Seconds = 5.0

    def __post_init__(self) -> None:
        parsed = URL(self.url)
        if parsed.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"url: {self.url!r} is not a redis:// URL")
        if parsed.password:
            raise ValueError(
                "url: the password goes in password_file or password_env, not in the URL"
            )
        if self.password_file and self.password_env:
            raise ValueError("password_file or password_env, not both")


class ClusterRedisConfig(RedisConfig):
    """The Redis the replicas of one router share what they learn through; a short
    timeout: a slow Redis is dropped (the replica routes alone) rather than waited for."""

    #: every key and channel starts with this (several routers sharing one Redis)
    key_prefix: str = "kvroute:cluster:"
    timeout_s: Seconds = 1.0


class ClusterConfig(_Strict):
    """Router replicas sharing one view (router/telemetry/cluster.py): each one's
    placements and per-backend load reach the others through `redis`. For fleets
    without KV events; with them on every backend the backends already tell each
    replica where prefixes are."""

    redis: ClusterRedisConfig = ClusterRedisConfig()


class JobsConfig(_Strict):
    """Async jobs and OpenAI-style batches (router/jobs/): accepted at once, run later
    through the same routing on spare capacity, from a SQLite database every worker on
    the host shares, so that accepted jobs survive a restart."""

    enabled: bool = False
    #: where jobs live: "sqlite" (the file at `path`, every worker of one host) or
    #: "redis" (the server `redis` names, shared by several router replicas)
    store: Literal["sqlite", "redis"] = "sqlite"
    path: str = "/var/lib/kvroute/jobs.db"
    redis: RedisConfig = RedisConfig()
    #: an async request's body past this is refused with 413, as the managed endpoint
    #: kvroute is modelled on does (its inline payloads are at most 128,000 bytes)
    max_inline_bytes: Annotated[int, Meta(ge=1)] = 128_000
    #: a batch input file past this is refused with 413 (an upload is stored a piece at
    #: a time; a batch holds its file in the body budget while it checks it)
    max_file_bytes: Annotated[int, Meta(ge=1)] = 64 << 20
    #: the bytes of the files each tenant (or token without one) may have uploaded and
    #: not yet expired or deleted; an upload past it is refused with 413
    max_tenant_file_bytes: Annotated[int, Meta(ge=1)] = 1 << 30
    #: lines in one batch input file, as OpenAI's Batch API allows
    max_batch_lines: Annotated[int, Meta(ge=1)] = 50_000
    #: jobs each worker runs at once
    concurrency: Annotated[int, Meta(ge=1)] = 4
    #: a job starts only while the usable backends' requests in flight are below this
    #: share of their capacity, so interactive requests keep the rest
    spare_share: Annotated[float, Meta(gt=0, le=1)] = 0.5
    #: a backend's capacity in requests, when the strategy sets no concurrency_threshold
    backend_capacity: Annotated[int, Meta(ge=1)] = 8
    #: a job's lease: a worker that died mid-job lets it go this long after its last
    #: renewal, and another worker (or the next start) runs it again
    lease_s: Seconds = 30.0
    #: how long a finished job's result (and a finished batch's files) are kept
    result_ttl_s: Seconds = 86_400.0
    #: how often a worker with nothing to run looks for a job another worker accepted
    poll_s: Seconds = 0.5
    #: a job the router refused for now (admission's 429, no backend available) is tried
    #: again this many times, each after twice the wait of the one before, from
    #: `refused_backoff_s`; then its answer is that refusal
    refused_retries: Annotated[int, Meta(ge=0)] = 5
    refused_backoff_s: Seconds = 1.0
    #: where an async request's webhook (`X-Kvroute-Webhook: URL`) may point, each
    #: `host:port` (`[v6addr]:port`), or a bare `host` for its scheme's default port
    #: only (80, 443); none: webhooks are refused (the router would POST wherever a
    #: client asked). Redirects are never followed.
    webhook_hosts: tuple[str, ...] = ()
    #: deliveries tried again after a failure (each after twice the wait of the one
    #: before, from `webhook_backoff_s`), then the webhook is given up as failed
    webhook_retries: Annotated[int, Meta(ge=0)] = 5
    webhook_backoff_s: Seconds = 1.0
    #: a delivery's whole time (connect, send, answer); past it, it failed
    webhook_timeout_s: Seconds = 10.0
    #: deliveries each worker makes at once (a slow receiver holds up only its own)
    webhook_concurrency: Annotated[int, Meta(ge=1)] = 16

    def __post_init__(self) -> None:
        for entry in self.webhook_hosts:
            webhook_target(entry)


def webhook_target(entry: str) -> tuple[str, int | None]:
    """A `webhook_hosts` entry as (host, port; None: the scheme's default); ValueError
    if it is not `host`, `host:port` or `[v6addr]:port`."""
    try:
        url = URL(f"//{entry}")
        port = url.explicit_port
    except ValueError:
        url, port = None, None
    if url is None or not url.host or url.raw_path not in ("", "/") or url.user is not None:
        raise ValueError(f"jobs.webhook_hosts: {entry!r} is not host or host:port")
    return url.host, port


#: the priority classes, the first released first (router/dispatch/flow.py); async jobs
#: and batch lines are `background`, below every interactive class
PRIORITIES = ("critical", "standard", "sheddable", "background")
Priority = Literal["critical", "standard", "sheddable", "background"]


class TokenClass(NamedTuple):
    """A static token's class (its `priority=` and `trusted=` fields, auth.tokens_file)."""

    priority: str
    #: may raise its class with the priority header
    trusted: bool


class FlowClassConfig(_Strict):
    """One priority class's wait in the router (None: the `limits` value)."""

    #: requests of the class that may wait in each worker (then 503 queue_full)
    queue_size: Annotated[int, Meta(ge=0)] | None = None
    #: longest wait, seconds (then 503 queue_timeout, or saturated)
    queue_timeout: Seconds | None = None
    #: a request waiting this long is released as if of the class above (no starving)
    max_wait: Seconds | None = None


class FlowTenantConfig(_Strict):
    """A tenant's class and share."""

    priority: Priority = "standard"
    #: its share of its class against the other tenants waiting there
    weight: Annotated[float, Meta(gt=0)] | None = None
    #: may raise its class with the priority header (others may only lower it)
    trusted: bool = False


class SaturationConfig(_Strict):
    """When a backend counts as saturated: requests then wait in the router, not in vLLM."""

    enabled: bool = True
    #: vllm:num_requests_waiting, plus the router's requests sent there since that
    #: scrape whose answer has not begun, above this; once the backend's batch limit is
    #: learned, also the router's in-flight there at that limit plus this
    max_waiting: Annotated[float, Meta(ge=0)] = 4.0
    #: vllm:kv_cache_usage_perc (0..1) at or above this
    max_kv_cache_usage: Annotated[float, Meta(gt=0, le=1)] = 0.95
    #: the most of the fleet's learned batch slots kept for requests of tenants under
    #: their share (twice that, at most half, for a class above a waiting one) while
    #: such requests come; as many are kept as their rate needs to find one free 99.8%
    #: of the time (a P99 of theirs then rarely waits)
    reserve: Annotated[float, Meta(ge=0, le=0.5)] = 0.3


class SessionAffinityConfig(_Strict):
    """A request naming a session goes where that session went last."""

    enabled: bool = True
    #: the request headers naming the session, the first one present wins (coding
    #: agents' own included)
    headers: list[str] = msgspec.field(
        default_factory=lambda: ["X-Session-ID", "X-Claude-Code-Session-Id", "session_id"]
    )
    #: soft: the session's backend while it is not saturated (with KV_AWARE, unless the
    #: prompt's cache is found elsewhere); hard: always, while it is usable
    mode: Literal["soft", "hard"] = "soft"
    #: a session idle this long is forgotten, seconds
    idle_ttl: Seconds = 1800.0
    #: sessions each worker remembers at most (the least recently used go first)
    max_sessions: Annotated[int, Meta(ge=1)] = 100_000
    #: a new session skips the backends with this many times their weight's share of the
    #: requests in flight (past a floor of 4), then goes by the rendezvous hash; null: the
    #: hash alone
    load_factor: Annotated[float, Meta(gt=1)] | None = 1.25
    #: where a new session goes: "cost", the policy's pick where the policy weighs each
    #: backend's cost (KV_AWARE: a slower or busier backend takes fewer sessions);
    #: "hash" (and any other policy): the load-bounded rendezvous hash, which every
    #: replica computes alike. Replicas with neither KV events nor `cluster` learn
    #: nothing of each other's placements: "hash" keeps a session's turns together there
    new_sessions: Literal["cost", "hash"] = "cost"


class FlowConfig(_Strict):
    """Flow control: priority classes, fair share between tenants, saturation."""

    #: the header a request names its class in (None: the header is not read); an
    #: untrusted tenant naming a class above its own is refused (403)
    priority_header: str | None = "X-Kvroute-Priority"
    #: the share of a tenant with no weight of its own
    default_weight: Annotated[float, Meta(gt=0)] = 1.0
    tenants: dict[str, FlowTenantConfig] = msgspec.field(default_factory=dict)
    classes: dict[Priority, FlowClassConfig] = msgspec.field(default_factory=dict)
    saturation: SaturationConfig = SaturationConfig()
    session_affinity: SessionAffinityConfig = SessionAffinityConfig()
    #: answer with `x-kvroute-reason` (gRPC: that trailer): why the backend was picked
    #: (`kv_hit`, `session`, `spill_threshold`, ...), then `; queued` if it waited here
    reason_header: bool = False


class Config(_Strict):
    backends: list[BackendConfig] = msgspec.field(default_factory=list)
    #: the pools, when the fleet has several (see PoolConfig); none: one flat pool
    pools: Annotated[list[PoolConfig], Meta(max_length=MAX_POOLS)] = msgspec.field(
        default_factory=list
    )
    #: credentials and headers of every backend that sets none of its own
    backend_defaults: BackendCredentials = BackendCredentials()
    #: DNS names whose addresses are backends too, beside the static list
    discovery: list[DnsDiscoveryConfig | KubernetesDiscoveryConfig] = msgspec.field(
        default_factory=list
    )
    listen: ListenConfig = ListenConfig()
    grpc: GrpcConfig = GrpcConfig()
    routing: policies.params_union() = DEFAULT_ROUTING  # type: ignore[valid-type]
    timeouts: TimeoutsConfig = TimeoutsConfig()
    limits: LimitsConfig = LimitsConfig()
    flow: FlowConfig = FlowConfig()
    health: HealthConfig = HealthConfig()
    lora: LoraConfig = LoraConfig()
    breaker: BreakerConfig = BreakerConfig()
    retries: RetryConfig = RetryConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    #: the admin API listener; none unless configured (it needs a token)
    admin: AdminConfig | None = None
    auth: AuthConfig = AuthConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    metrics: MetricsConfig = MetricsConfig()
    #: request header whose value isolates tenants' fingerprints (cache_salt always does)
    #: and keys max_concurrent_per_tenant; with auth on, only if auth.tenant_header_trusted
    tenant_header: str | None = None
    #: how often backends' /v1/models is polled, seconds
    models_refresh_interval: Seconds = 30.0
    #: processes serving requests on the listen port; 0: one per usable core
    workers: Annotated[int, Meta(ge=0, le=256)] = 0
    log_level: str = "info"
    #: how every log line is written, the access log's included: "text" or "json" (one
    #: JSON object per line, for a log pipeline)
    log_format: Literal["text", "json"] = "text"
    access_log: AccessLogConfig = AccessLogConfig()
    tracing: TracingConfig = TracingConfig()
    capture: CaptureConfig = CaptureConfig()
    usage: UsageConfig = UsageConfig()
    jobs: JobsConfig = JobsConfig()
    compression: CompressionConfig = CompressionConfig()
    #: replicas of this router sharing placements and load through Redis; none: alone
    cluster: ClusterConfig | None = None

    def __post_init__(self) -> None:
        if self.log_level.lower() not in LOG_LEVELS:
            levels = ", ".join(LOG_LEVELS)
            raise ValueError(f"log_level {self.log_level!r} is not one of {levels}")
        if not self.backends and not self.discovery:
            raise ValueError("at least one backend (or a discovery source) is required")
        if self.auth.tenant_header_trusted and self.tenant_header is None:
            raise ValueError("auth.tenant_header_trusted needs a tenant_header to trust")
        if self.metrics.listen == "admin" and self.admin is None:
            raise ValueError("metrics.listen: admin needs an admin section")
        self._check_pools()
        seen: set[str] = set()
        for backend in self.backends:
            for key in {backend.key, str(URL(backend.url))}:
                if key in seen:
                    raise ValueError(f"duplicate backend {key!r}")
                seen.add(key)

    def _check_pools(self) -> None:
        names = [p.name for p in self.pools]
        if len(set(names)) < len(names):
            raise ValueError(f"pools: names must be unique, got {names}")
        for pool in self.pools:
            if pool.priority is None and pool.role == "both":
                raise ValueError(
                    f"pools: {pool.name}: priority is required (pools are tried lowest "
                    "first); only a prefill or decode pool may leave it out"
                )
        priorities = [p.priority for p in self.pools if p.priority is not None]
        if len(set(priorities)) < len(priorities):
            raise ValueError(f"pools: priorities must be unique, got {priorities}")
        roles = {p.role for p in self.pools} - {"both"}
        if len(roles) == 1:
            raise ValueError(
                f"pools: a {roles.pop()} pool needs a pool of the other role (prefill and "
                "decode go together)"
            )
        for member in (*self.backends, *self.discovery):
            if self.pools and member.pool not in names:
                which = getattr(member, "url", None) or member.label
                raise ValueError(
                    f"{which}: with pools, every backend and discovery source belongs to "
                    f"one of them ({', '.join(names)}); it names {member.pool!r}"
                )
            if not self.pools and member.pool is not None:
                raise ValueError(f"pool {member.pool!r} is not defined under pools")
        for pool in self.pools:
            if pool.routing and pool.role == "decode":
                raise ValueError(
                    f"pools: {pool.name}: a decode pool balances on decode load (in-flight "
                    "requests), so it takes no routing parameters"
                )
            try:
                pool.params(self.routing)
            except ValueError as exc:
                raise ValueError(f"pools: {pool.name}: routing: {exc}") from None

    @property
    def strategy(self) -> str:
        """The routing strategy's registered name (what the metrics label it)."""
        return self.routing.__struct_config__.tag

    @property
    def pools_in_order(self) -> list[PoolConfig]:
        """The pools by priority, the preferred first."""
        return pools_in_order(self.pools)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, field and problem."""


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as stream:  # PyYAML's messages name the file
            data = yaml.safe_load(stream)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(path, exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def _yaml_error(path: str | Path, exc: yaml.YAMLError) -> str:
    """A syntax error in one line, as compilers put it: `FILE:LINE:COL: problem`, and
    where the construct it broke began, if elsewhere (PyYAML's own message spans lines)."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:  # e.g. bytes that are not text
        return f"{path}: not valid YAML: {' '.join(str(exc).split())}"
    line = f"{path}:{mark.line + 1}:{mark.column + 1}: {exc.problem}"
    began = exc.context_mark
    if exc.context and began and (began.line, began.column) != (mark.line, mark.column):
        return f"{line} ({exc.context} at {began.line + 1}:{began.column + 1})"
    return line


def build(data: dict[str, Any], source: str = "config") -> Config:
    routing = data.get("routing")
    if isinstance(routing, dict):
        data = {**data, "routing": _with_strategy(routing, source)}
    if isinstance(data.get("pools"), list):
        data = _flat_pools(data)
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    return _approximate(config, routing if isinstance(routing, dict) else {})


def _approximate(config: Config, given: Collection[str]) -> Config:
    """KV_AWARE's block and keys, unless the file sets them: where a backend publishes KV
    events the engines' (16-token blocks, vLLM's; keys of the token ids), which the
    index must match; else the router's own (`APPROXIMATE_BLOCK_SIZE`; keys of the text,
    tokenizer kind "text", since no event's ids need matching)."""
    routing = config.routing
    if not isinstance(routing, KvAwareParams) or publishes_kv_events(config):
        return config
    own = {"block_size": APPROXIMATE_BLOCK_SIZE, "tokenizer": KvTokenizerParams(kind="text")}
    routing = msgspec.structs.replace(routing, **{k: v for k, v in own.items() if k not in given})
    return msgspec.structs.replace(config, routing=routing)


def publishes_kv_events(config: Config) -> bool:
    """Some backend of the fleet is configured to publish KV events (or discovered so)."""
    return any(b.kv_events for b in config.backends) or any(
        d.kv_events_port is not None for d in config.discovery
    )


def _with_strategy(routing: dict[str, Any], source: str) -> dict[str, Any]:
    """`routing` with its strategy spelled as registered, or the default one filled in.

    A parameter that the default strategy lacks, in a section naming no strategy, is an
    error that says which strategies take it: guessing one would route otherwise than
    the file says.
    """
    given = routing.get("strategy")
    if given is None:
        default = DEFAULT_STRATEGY
        for field in routing:
            owners = policies.taking(field)
            if owners and default not in owners:
                raise ConfigError(
                    f"{source}: `{field}` is a parameter of {' and '.join(owners)}, not of "
                    f"{default} (the default strategy): set `routing.strategy` (--strategy) "
                    "- at `$.routing`"
                )
        return {**routing, "strategy": default}
    name = policies.canonical(given) if isinstance(given, str) else None
    if name is None:
        raise ConfigError(
            f"{source}: unknown strategy {given!r}; the strategies are "
            f"{', '.join(policies.names())} - at `$.routing.strategy`"
        )
    return {**routing, "strategy": name}


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


def _flat_pools(data: dict[str, Any]) -> dict[str, Any]:
    """`pools[].backends` and `pools[].discovery` moved to the top-level lists, each
    entry marked with its pool: the one list the rest of the router reads."""
    backends, discovery = list(data.get("backends") or []), list(data.get("discovery") or [])
    pools = []
    for pool in data["pools"]:
        if not isinstance(pool, dict):
            pools.append(pool)  # msgspec names the type error
            continue
        rest = {k: v for k, v in pool.items() if k not in ("backends", "discovery")}
        name = pool.get("name")
        for key, into in (("backends", backends), ("discovery", discovery)):
            entries = pool.get(key) or []
            if not isinstance(entries, list):
                raise ConfigError(f"pools: {name}: {key} must be a list")
            into.extend({**e, "pool": name} if isinstance(e, dict) else e for e in entries)
        pools.append(rest)
    return {**data, "backends": backends, "discovery": discovery, "pools": pools}


def _strategy_fields(strategy: str) -> set[str]:
    name = policies.canonical(strategy)
    return set(policies.policy_class(name).params_type.__struct_fields__) if name else set()


#: the tokenizers whose keys no vLLM event matches, and why
_NOT_THE_ENGINES = {"chatml4": "kvroute sim's", "text": "keys of the text, no ids"}


def advice(config: Config) -> list[str]:
    """What in a valid config will not do what its author likely means, worded as the
    start-up warning that says so."""
    routing = config.routing
    if not isinstance(routing, KvAwareParams) or not publishes_kv_events(config):
        return []
    kind = routing.tokenizer.kind
    if kind not in _NOT_THE_ENGINES:
        return []
    return [
        f"KV events are matched by token ids, and routing.tokenizer is {kind} "
        f"({_NOT_THE_ENGINES[kind]}): in front of vLLM no prompt will match them; set "
        "routing.tokenizer to {kind: backend} or {kind: hf, path: DIR}"
    ]


def load(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    data = read_yaml(path) if path else {}
    return build(apply_overrides(data, overrides or {}), str(path or "command line"))

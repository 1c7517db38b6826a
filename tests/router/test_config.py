"""Config loading: defaults, overrides, and errors that name the field."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from router.config import ConfigError, advice, apply_overrides, build, load
from router.fleet.discovery import backend_configs

ONE = [{"url": "http://127.0.0.1:9001"}]


def _pool(name: str, priority: int, port: int = 0) -> dict:
    backends = [{"url": f"http://127.0.0.1:{9100 + port + priority}"}]
    return {"name": name, "priority": priority, "backends": backends}


def test_pools_put_their_backends_and_sources_in_the_one_list_marked_with_the_pool() -> None:
    dns = {"kind": "dns", "name": "vllm-awq.test", "port": 8000}
    spare = {**_pool("spare", 5), "discovery": [dns], "model_map": {"m": "m-awq"}}
    config = build({"pools": [spare, _pool("main", 1)]})
    assert [(b.url, b.pool) for b in config.backends] == [
        ("http://127.0.0.1:9105", "spare"),
        ("http://127.0.0.1:9101", "main"),
    ]
    assert [(d.label, d.pool) for d in config.discovery] == [("vllm-awq.test", "spare")]
    assert [p.name for p in config.pools_in_order] == ["main", "spare"]
    assert config.pools_in_order[1].model_map == {"m": "m-awq"}
    (found,) = backend_configs(config.discovery[0], ["127.0.0.7"])
    assert (found.url, found.pool) == ("http://127.0.0.7:8000", "spare")


def test_a_pool_sets_its_own_strategy_parameters_over_the_fleets() -> None:
    routing = {"strategy": "KV_AWARE", "concurrency_threshold": 4, "max_queue_s": 2.0}
    fast = {**_pool("fast", 1), "routing": {"prefill_tokens_per_s": 40000, "max_queue_s": 0.5}}
    config = build({"pools": [fast, _pool("spare", 2)], "routing": routing})
    own, fleets = (p.params(config.routing) for p in config.pools_in_order)
    assert (own.prefill_tokens_per_s, own.max_queue_s, own.concurrency_threshold) == (
        40000,
        0.5,
        4,
    )
    assert fleets is config.routing


@pytest.mark.parametrize(
    ("routing", "match"),
    [
        ({"block_size": 32}, "'block_size' is not a parameter a pool may set for KV_AWARE"),
        ({"max_queue_s": -1}, r"pools: fast: routing: Expected `float` > 0.*max_queue_s"),
        ({"strategy": "RANDOM"}, "'strategy' is not a parameter a pool may set"),
    ],
)
def test_a_pools_routing_takes_only_its_strategys_per_pool_parameters(routing, match) -> None:
    fast = {**_pool("fast", 1), "routing": routing}
    with pytest.raises(ConfigError, match=match):
        build({"pools": [fast, _pool("spare", 2)]})


def test_a_decode_pool_takes_no_routing_parameters() -> None:
    pools = [
        {**_pool("p", 1), "role": "prefill"},
        {**_pool("d", 2), "role": "decode", "routing": {"concurrency_threshold": 2}},
    ]
    with pytest.raises(ConfigError, match="a decode pool balances on decode load"):
        build({"pools": pools})


def test_a_prefill_or_decode_pool_needs_no_priority() -> None:
    """Its role says where it serves; without a priority it comes after the pools that
    have one (for requests every pool may take), in the order listed."""
    role = {"prefill": 0, "decode": 1}
    unranked = [
        {"name": name, "role": name, "backends": [{"url": f"http://127.0.0.1:{9200 + i}"}]}
        for name, i in role.items()
    ]
    config = build({"pools": [*unranked, _pool("whole", 3)]})
    assert [(p.name, p.priority) for p in config.pools_in_order] == [
        ("whole", 3),
        ("prefill", None),
        ("decode", None),
    ]
    both = {k: v for k, v in _pool("whole", 3).items() if k != "priority"}
    with pytest.raises(ConfigError, match="pools: whole: priority is required"):
        build({"pools": [*unranked, both]})


def test_defaults_need_only_backends() -> None:
    cfg = build({"backends": ONE})
    assert cfg.routing.__struct_config__.tag == "KV_AWARE"
    assert cfg.listen.port == 8000
    assert cfg.limits.max_body_bytes > 0
    assert cfg.backends[0].key == "127.0.0.1:9001"
    assert not cfg.compression.enabled  # answers go as the backend wrote them


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param({"backends": ONE, "lisen": {}}, "unknown field `lisen`", id="unknown-key"),
        pytest.param(
            {"backends": ONE, "listen": {"port": "eighty"}},
            "Expected `int`, got `str` - at `$.listen.port`",
            id="wrong-type",
        ),
        pytest.param(
            {"backends": ONE, "routing": {"strategy": "PREFIX_AWARE", "concurrency_threshold": -1}},
            "Expected `int` >= 1 - at `$.routing.concurrency_threshold`",
            id="negative-threshold",
        ),
        pytest.param(
            {"backends": ONE + ONE},
            "duplicate backend",
            id="duplicate-backend",
        ),
        pytest.param(
            {"backends": [{"url": "http://a:1", "name": "x"}, {"url": "http://b:1", "name": "x"}]},
            "duplicate backend 'x'",
            id="duplicate-name",
        ),
        pytest.param(
            {"backends": ONE, "routing": {"strategy": "FASTEST"}},
            "unknown strategy 'FASTEST'; the strategies are KV_AWARE, LEAST_OUTSTANDING_REQUESTS, "
            "PREFIX_AWARE, RANDOM, ROUND_ROBIN - at `$.routing.strategy`",
            id="unknown-strategy",
        ),
        pytest.param(
            {"backends": ONE, "routing": {"stratgy": "PREFIX_AWARE"}},
            "unknown field `stratgy` - at `$.routing`",
            id="strategy-typo",
        ),
        pytest.param(
            {"backends": ONE, "routing": {"prefix_length": 128}},
            "`prefix_length` is a parameter of PREFIX_AWARE, not of KV_AWARE (the default "
            "strategy): set `routing.strategy` (--strategy) - at `$.routing`",
            id="param-without-strategy",
        ),
        pytest.param(
            {"backends": ONE, "log_level": "verbose"},
            "log_level 'verbose' is not one of debug, info, warning, error",
            id="unknown-log-level",
        ),
        pytest.param(
            {"backends": ONE, "routing": {"strategy": "RANDOM", "prefix_length": 5}},
            "unknown field `prefix_length` - at `$.routing`",
            id="param-of-another-strategy",
        ),
        pytest.param({"backends": []}, "at least one backend", id="no-backends"),
        pytest.param({}, "at least one backend (or a discovery source)", id="missing-backends"),
        pytest.param(
            {"backends": [{"url": "ftp://x:1"}]}, "must look like http://host:port", id="bad-url"
        ),
        pytest.param(
            {"backends": ONE, "routing": {"strategy": "PREFIX_AWARE", "tokenizer": {"kind": "hf"}}},
            "needs tokenizer.path",
            id="hf-without-path",
        ),
        pytest.param(
            {"backends": ONE, "auth": {"tenant_header_trusted": True}},
            "auth.tenant_header_trusted needs a tenant_header to trust",
            id="trusted-header-without-header",
        ),
        pytest.param(
            {"backends": ONE, "metrics": {"listen": "admin"}},
            "metrics.listen: admin needs an admin section",
            id="metrics-on-a-missing-admin-listener",
        ),
        pytest.param(
            {"backends": ONE, "metrics": {"tenants": ["not one"]}},
            "at `$.metrics.tenants[0]`",
            id="metrics-tenant-not-a-tenant-id",
        ),
        pytest.param(
            {"pools": [_pool(f"p{i}", i) for i in range(6)]},
            "at `$.pools`",
            id="more-than-five-pools",
        ),
        pytest.param(
            {"pools": [_pool("a", 0), _pool("a", 1)]},
            "pools: names must be unique",
            id="pool-names-twice",
        ),
        pytest.param(
            {"pools": [_pool("a", 0), _pool("b", 0)]},
            "pools: priorities must be unique",
            id="pool-priorities-twice",
        ),
        pytest.param(
            {"pools": [_pool("a", 0, 1)], "backends": ONE},
            "http://127.0.0.1:9001: with pools, every backend and discovery source belongs",
            id="a-backend-outside-the-pools",
        ),
        pytest.param(
            {"backends": [{"url": "http://127.0.0.1:9001", "pool": "x"}]},
            "pool 'x' is not defined under pools",
            id="a-pool-never-defined",
        ),
        pytest.param(
            {"pools": [{**_pool("p", 0), "role": "prefill"}, _pool("b", 1)]},
            "pools: a prefill pool needs a pool of the other role",
            id="prefill-without-decode",
        ),
        pytest.param(
            {"backends": ONE, "lora": {"load_on_demand": True}},
            "lora.load_on_demand needs lora.adapters",
            id="lora-loads-anything",
        ),
        pytest.param(
            {"backends": ONE, "lora": {"adapters": ["a"], "source": "/models/loras"}},
            "lora.source must contain {name}",
            id="lora-source-without-the-name",
        ),
        pytest.param(
            {"backends": ONE, "compression": {"algorithms": ["zstd", "br"]}},
            "Invalid enum value 'br' - at `$.compression.algorithms[1]`",
            id="compression-unknown-coding",
        ),
        pytest.param(
            {"backends": ONE, "compression": {"algorithms": ["gzip", "gzip"]}},
            "compression.algorithms: each at most once",
            id="compression-coding-twice",
        ),
        pytest.param(
            {"backends": ONE, "compression": {"algorithms": []}},
            "Expected `array` of length >= 1 - at `$.compression.algorithms`",
            id="compression-offers-nothing",
        ),
        pytest.param(
            {"backends": ONE, "compression": {"gzip_level": 10}},
            "Expected `int` <= 9 - at `$.compression.gzip_level`",
            id="compression-gzip-level",
        ),
    ],
)
def test_bad_config_names_the_problem(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(data)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("routing", "strategy"),
    [
        pytest.param({}, "KV_AWARE", id="empty-section"),
        pytest.param({"miss_penalty": 2.0}, "KV_AWARE", id="default-strategy-params"),
        pytest.param({"strategy": "random"}, "RANDOM", id="lower-case"),
        pytest.param({"strategy": "Prefix_Aware", "prefix_length": 64}, "PREFIX_AWARE", id="mixed"),
    ],
)
def test_routing_strategy_defaults_and_takes_any_case(routing: dict, strategy: str) -> None:
    cfg = build({"backends": ONE, "routing": routing})
    assert cfg.routing.__struct_config__.tag == strategy


def test_overrides_win_and_strategy_change_drops_foreign_keys() -> None:
    data = {
        "backends": ONE,
        "routing": {"strategy": "PREFIX_AWARE", "prefix_length": 64, "concurrency_threshold": 4},
    }
    out = apply_overrides(data, {"routing.strategy": "RANDOM", "listen.port": 9})
    cfg = build(out)
    assert cfg.routing.__struct_config__.tag == "RANDOM"
    assert cfg.listen.port == 9
    cfg = build(apply_overrides(data, {"routing.prefix_length": 128}))
    assert (cfg.routing.prefix_length, cfg.routing.concurrency_threshold) == (128, 4)


def test_backends_from_flags_need_no_file() -> None:
    cfg = load(None, {"backends": [{"url": "http://127.0.0.1:1"}, {"url": "http://127.0.0.1:2"}]})
    assert [b.key for b in cfg.backends] == ["127.0.0.1:1", "127.0.0.1:2"]


def test_an_unreadable_file_is_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.yaml")


def _kvroute(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "router", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("backends: [\n", "2:1: expected the node content, but found '<stream end>'",
                     id="unclosed"),
        pytest.param("backends: [a, b\n", "2:1: expected ',' or ']', but got '<stream end>' "
                     "(while parsing a flow sequence at 1:11)", id="unclosed-after-items"),
        pytest.param("a: 1\n b: 2\n", "2:3: mapping values are not allowed here", id="indent"),
    ],
)  # fmt: skip
def test_a_yaml_syntax_error_is_one_line_naming_file_line_and_column(
    tmp_path, text: str, message: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    res = _kvroute("serve", "--check", "-c", str(bad))
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == f"kvroute: invalid config: {bad}:{message}\n"


def test_check_command(tmp_path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        textwrap.dedent(
            """
            backends:
              - url: http://127.0.0.1:9001
              - url: http://127.0.0.1:9002
            routing: {strategy: PREFIX_AWARE, prefix_length: 128}
            """
        )
    )
    ok = _kvroute("serve", "--check", "-c", str(good))
    assert ok.returncode == 0, ok.stderr
    assert "2 backends, strategy PREFIX_AWARE" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "backends: [{url: http://127.0.0.1:1}]\nrouting: {strategy: PREFIX_AWARE, x: 1}\n"
    )
    res = _kvroute("serve", "--check", "-c", str(bad))
    assert res.returncode == 2
    assert "unknown field `x` - at `$.routing`" in res.stderr


@pytest.mark.parametrize(
    ("args", "out"),
    [
        pytest.param(("--strategy", "random"), "strategy RANDOM", id="strategy-any-case"),
        pytest.param(("--log-level", "WARNING"), "strategy KV_AWARE", id="log-level-any-case"),
    ],
)
def test_check_command_takes_names_in_any_case(args: tuple[str, ...], out: str) -> None:
    res = _kvroute("serve", "--check", "--backend", "http://127.0.0.1:1", *args)
    assert res.returncode == 0, res.stderr
    assert out in res.stdout


@pytest.mark.parametrize(
    ("args", "err"),
    [
        pytest.param(("--prefix-length", "128"), "set `routing.strategy` (--strategy)", id="param"),
        pytest.param(("--strategy", "fastest"), "invalid choice: 'fastest'", id="strategy"),
    ],
)
def test_check_command_refuses_flags_that_start_up_would(args: tuple[str, ...], err: str) -> None:
    res = _kvroute("serve", "--check", "--backend", "http://127.0.0.1:1", *args)
    assert res.returncode == 2
    assert err in res.stderr


def test_check_catches_what_start_up_rejects(tmp_path) -> None:
    path = tmp_path / "verbose.yaml"
    path.write_text("backends: [{url: http://127.0.0.1:1}]\nlog_level: verbose\n")
    res = _kvroute("serve", "--check", "-c", str(path))
    assert res.returncode == 2
    assert "log_level 'verbose' is not one of debug, info, warning, error" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    ("routing", "warned"),
    [
        pytest.param("{}", True, id="default-tokenizer"),
        pytest.param("{tokenizer: {kind: backend}}", False, id="backend-tokenizer"),
        pytest.param("{strategy: PREFIX_AWARE}", False, id="no-kv-index"),
    ],
)
def test_check_warns_when_kv_events_cannot_match_the_tokenizer(
    tmp_path, routing: str, warned: bool
) -> None:
    path = tmp_path / "events.yaml"
    path.write_text(
        "backends: [{url: http://127.0.0.1:1, kv_events: {endpoint: 'tcp://127.0.0.1:2'}}]\n"
        f"routing: {routing}\n"
    )
    res = _kvroute("serve", "--check", "-c", str(path))
    assert res.returncode == 0, res.stderr
    assert ("no prompt will match them" in res.stderr) is warned


def test_webhook_hosts_are_host_or_host_and_port() -> None:
    base = {"backends": [{"url": "http://127.0.0.1:8000"}]}
    hosts = ["hooks.example", "hooks.example:8443", "[::1]:9000"]
    assert build({**base, "jobs": {"webhook_hosts": hosts}}).jobs.webhook_hosts == tuple(hosts)
    for bad in ("hooks.example/path", "hooks.example:port", "user@hooks.example:1", ""):
        with pytest.raises(ConfigError, match="webhook_hosts"):
            build({**base, "jobs": {"webhook_hosts": [bad]}})


_EVENTS = {"endpoint": "tcp://127.0.0.1:5557"}


@pytest.mark.parametrize(
    ("backend", "routing", "expected"),
    [
        pytest.param({}, {}, (64, "text"), id="no-events"),
        pytest.param({"kv_events": _EVENTS}, {}, (16, "chatml4"), id="events"),
        pytest.param({}, {"block_size": 16}, (16, "text"), id="block-given"),
        pytest.param({}, {"tokenizer": {"kind": "chatml4"}}, (64, "chatml4"), id="tokenizer-given"),
    ],
)
def test_kv_aware_without_kv_events_keys_blocks_of_its_own_from_the_text(
    backend: dict, routing: dict, expected: tuple[int, str]
) -> None:
    """No event's blocks or ids to match: 64-token blocks keyed from the text, unless
    the file says otherwise; with events, the engines' blocks of the token ids."""
    config = build({"backends": [{"url": "http://127.0.0.1:9", **backend}], "routing": routing})
    assert (config.routing.block_size, config.routing.tokenizer.kind) == expected


@pytest.mark.parametrize(
    ("kind", "warned"), [("chatml4", "kvroute sim's"), ("text", "no ids"), ("backend", None)]
)
def test_kv_events_with_a_tokenizer_no_engine_shares_are_warned_of(kind: str, warned) -> None:
    config = build(
        {
            "backends": [{"url": "http://127.0.0.1:9", "kv_events": _EVENTS}],
            "routing": {"tokenizer": {"kind": kind}},
        }
    )
    warnings = advice(config)
    assert [warned in w for w in warnings] == ([True] if warned else [])

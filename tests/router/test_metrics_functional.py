"""What a request records, read off a real router's /metrics page: its endpoint and
model labels (bounded by the models the backends list), its latencies at sub-millisecond
resolution, admission's queue and refusals, and the counters a backend joining by
reload has at 0. Real stub backends and a real router on 127.0.0.1, both event loops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.control.worker import Router
from tests.router.chaos import MODEL, chat, until
from tests.router.conftest import running, settle
from tests.router.test_reload_functional import rig

CHAT_PATH = "/v1/chat/completions"
#: sample name and its labels -> value
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(router: Router) -> Samples:
    """Every sample on the router's /metrics page."""
    page = router.metrics.render().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def value(page: Samples, name: str, **labels: str) -> float | None:
    return page.get((name, frozenset(labels.items())))


def _off_the_millisecond(seconds: float) -> bool:
    """Not a whole number of milliseconds: what a clock ticking in ms cannot measure."""
    ms = seconds * 1e3
    return abs(ms - round(ms)) > 1e-6


async def test_requests_are_labelled_by_endpoint_and_a_model_the_backends_list() -> None:
    async with running(1) as (router, _), aiohttp.ClientSession() as http:
        url = router.url
        asks = [
            (CHAT_PATH, chat()["json"], 200),
            (CHAT_PATH, {"messages": [{"role": "user", "content": "no model"}]}, 200),
            (CHAT_PATH, chat(model="made-up")["json"], 404),
            ("/v1/embeddings", {"model": MODEL, "input": "x"}, 200),
            ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True}, 200),
        ]
        for path, body, status in asks:
            async with http.post(url + path, json=body) as resp:
                assert resp.status == status
                await resp.read()
        await settle(router)
        page = samples(router)
    strategy = router.dispatcher.strategy
    for backend, status, endpoint, model in [
        ("b0", "200", "chat", MODEL),
        ("b0", "200", "chat", "(none)"),  # no model named: a fixed value
        ("none", "404", "chat", "(other)"),  # a model no backend lists: not its name
        ("b0", "200", "embedding", MODEL),
        ("b0", "200", "completion", MODEL),
    ]:
        labels = {"backend": backend, "strategy": strategy, "status": status}
        got = value(page, "kvroute_requests_total", **labels, endpoint=endpoint, model=model)
        assert got == 1, (backend, status, endpoint, model)
    assert not any("made-up" in dict(labels).values() for _, labels in page)
    streamed = {"backend": "b0", "endpoint": "completion", "model": MODEL}
    assert value(page, "kvroute_time_to_first_token_seconds_count", **streamed) == 1


async def test_latencies_are_measured_below_the_millisecond() -> None:
    """The loop's clock ticks in ms on uvloop, so every latency it measured was a whole
    number of ms; a stub that answers at once (its chunks 2 ms apart, so that they
    come in reads of their own) shows what perf_counter measures."""
    labels = {"backend": "b0", "endpoint": "chat", "model": MODEL}
    kinds = ("e2e_request_latency", "time_to_first_token", "inter_token_latency")
    names = [f"kvroute_{kind}_seconds_sum" for kind in kinds]
    observed: dict[str, list[float]] = {name: [] for name in names}
    async with running(1) as (router, stubs), aiohttp.ClientSession() as http:
        stubs[0].behaviour.pace = 0.002
        before = {name: 0.0 for name in names}
        for _ in range(20):
            async with http.post(router.url + CHAT_PATH, **chat(stream=True)) as resp:
                assert resp.status == 200
                await resp.read()
            await settle(router)
            page = samples(router)
            for name in names:
                total = value(page, name, **labels)
                observed[name].append(total - before[name])  # this request's own
                before[name] = total
        bounds = {
            dict(k)["le"]
            for n, k in samples(router)
            if n == "kvroute_e2e_request_latency_seconds_bucket"
        }
    for name, seen in observed.items():
        assert any(_off_the_millisecond(s) for s in seen), (name, seen)
    assert {"0.0005", "0.001", "0.0025"} <= bounds


async def test_admission_counts_its_queue_and_why_it_refused() -> None:
    # the queue's timeout long enough for the third request to find the queue full
    # however slow the machine; the first request holds the only slot until let go
    limits = {"max_concurrent_requests": 1, "queue_size": 1, "queue_timeout": 2.0}
    async with running(1, limits=limits) as (router, stubs), aiohttp.ClientSession() as http:
        gate = stubs[0].behaviour.gate = asyncio.Event()
        url = router.url + CHAT_PATH
        held = await sent(http.post(url, **chat()), lambda: router.dispatcher.active == 1)
        queue_depth = lambda: value(samples(router), "kvroute_admission_queue_depth")  # noqa: E731
        waiting = await sent(http.post(url, **chat()), lambda: queue_depth() == 1)
        async with http.post(url, **chat()) as full:
            assert full.status == 503
            assert full.headers["x-kvroute-drop-reason"] == "queue_full"
        async with await waiting as timed_out:
            assert timed_out.status == 503
            assert timed_out.headers["x-kvroute-drop-reason"] == "queue_timeout"
        gate.set()
        async with await held as answered:
            assert answered.status == 200
        await settle(router)
        page = samples(router)
    assert value(page, "kvroute_admission_queue_depth") == 0
    rejections = {
        dict(labels)["reason"]: v
        for (name, labels), v in page.items()
        if name == "kvroute_admission_rejections_total"
    }
    assert rejections == {
        "saturated": 0, "queue_full": 1, "queue_timeout": 1, "tenant_cap": 0, "shed": 0
    }  # fmt: skip
    assert value(page, "kvroute_flow_queue_depth", **{"class": "standard"}) == 0
    assert value(page, "kvroute_flow_queue_wait_seconds_count", **{"class": "standard"}) == 1


async def test_the_queue_is_measured_by_tenant_with_the_tenant_label_bounded() -> None:
    limits = {"max_concurrent_requests": 1, "queue_size": 8, "queue_timeout": 30}
    config = {"limits": limits, "tenant_header": "X-Tenant", "metrics": {"tenants": ["known"]}}
    async with running(1, **config) as (router, stubs), aiohttp.ClientSession() as http:
        stubs[0].behaviour.gate = asyncio.Event()  # the first request holds the only slot
        url = router.url + CHAT_PATH
        queued = lambda: router.dispatcher.admission.queued  # noqa: E731
        tasks = [await sent(http.post(url, **chat()), lambda: stubs[0].active == 1)]
        for i, tenant in enumerate(["known", "stranger-1", "stranger-2", None], start=1):
            headers = {"X-Tenant": tenant} if tenant else {}
            post = http.post(url, headers=headers, **chat())
            tasks.append(await sent(post, lambda i=i: queued() == i))
        page = samples(router)
        depth = "kvroute_flow_tenant_queue_depth"
        assert value(page, depth, tenant="known") == 1
        assert value(page, depth, tenant="(other)") == 2
        assert value(page, depth, tenant="(none)") == 1
        stubs[0].behaviour.gate.set()
        for task in tasks:
            async with await task as resp:
                assert resp.status == 200
        await settle(router)
        page = samples(router)
    waits = "kvroute_flow_tenant_queue_wait_seconds_count"
    assert {t: value(page, waits, tenant=t) for t in ("known", "(other)", "(none)")} == {
        "known": 1, "(other)": 2, "(none)": 1
    }  # fmt: skip
    assert {t: value(page, depth, tenant=t) for t in ("known", "(other)", "(none)")} == {
        "known": 0, "(other)": 0, "(none)": 0
    }  # fmt: skip
    named = {dict(labels).get("tenant") for (name, labels), _ in page.items()}
    assert not any(t and t.startswith("stranger") for t in named)  # no series per stranger


async def sent(request: Awaitable, arrived: Callable[[], bool]) -> asyncio.Future:
    """Send `request` in a task; return the task once `arrived()` holds (bounded)."""
    task = asyncio.ensure_future(request)
    await until(arrived)
    return task


async def test_a_backend_that_joins_by_reload_has_its_counters_at_0(tmp_path: Path) -> None:
    async with rig(tmp_path, 2, {0: 1}) as r:
        r.write({0: 1, 1: 1})
        assert (await r.reload())["added"] == ["s1"]
        await until(lambda: r.router.fleet.find("s1").models is not None)  # its model poll
        page = samples(r.router)
    strategy = r.router.dispatcher.strategy
    for status in ("200", "502", "503", "504"):
        labels = {"backend": "s1", "strategy": strategy, "status": status, "model": MODEL}
        assert value(page, "kvroute_requests_total", **labels, endpoint="chat") == 0
    for kind in ("upstream", "connect", "disconnect", "timeout", "credentials"):
        assert value(page, "kvroute_upstream_errors_total", backend="s1", kind=kind) == 0
        assert value(page, "kvroute_retries_total", backend="s1", reason=kind) == 0
    assert value(page, "kvroute_client_disconnects_total", backend="s1") == 0
    assert value(page, "kvroute_breaker_ejections_refused_total", backend="s1") == 0
    assert value(page, "kvroute_backend_state_changes_total", backend="s1", to="open") == 0


async def test_static_token_tenants_and_latencies_are_at_0_before_any_request(
    tmp_path: Path,
) -> None:
    """A static token's tenant has its request and token counters at 0 from the start
    (and one a reload adds, from the next scrape), and each backend its latency
    histograms: rate() and histogram_quantile() see the first request."""
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-a acme\ntok-b\n")
    async with running(1, auth={"enabled": True, "tokens_file": str(tokens)}) as (router, _):
        await until(lambda: router.fleet.find("b0").models is not None)
        before = samples(router)
        tokens.write_text("tok-a acme\ntok-c globex\n")
        await router.reloader.apply(router.config)
        after = samples(router)
    for tenant, page in (("acme", before), ("globex", after)):
        assert value(page, "kvroute_tenant_requests_total", tenant=tenant) == 0
        counted = {"model": MODEL, "tenant": tenant, "pool": "(none)"}
        assert value(page, "kvroute_usage_requests_total", **counted) == 0
        for kind in ("prompt", "cached", "completion"):
            assert value(page, "kvroute_tokens_total", kind=kind, **counted) == 0
    assert value(before, "kvroute_tenant_requests_total", tenant="globex") is None
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        for endpoint in ("chat", "completion"):
            labels = {"backend": "b0", "endpoint": endpoint, "model": MODEL}
            assert value(before, f"kvroute_{name}_seconds_count", **labels) == 0
            assert value(before, f"kvroute_{name}_seconds_bucket", **labels, le="+Inf") == 0

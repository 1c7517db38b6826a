"""/metrics as an operator sees it: real routers (`python -m router serve`, one worker and
several) in front of a real stub backend, scraped over HTTP after the same traffic.

What is checked: both modes export the same series (names and label names), and every
`kvroute_*` family on the page is one the README's Metrics section lists, with its labels,
so the page and the README cannot drift apart; so is every metric the code declares, for
the labels of those the traffic here never reaches; and every `kvroute_*` name any page
of the docs mentions (README, docs/, deploy/README.md) is one the router exports. Before
any request, every family the README lists is on the page, and the counters of the known
label values are at 0. The
router runs in its own processes, so these tests run once, on the default test loop.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.processes import free_port, process, wait_ready
from policies import SPILL_REASONS, Reason
from router.config import DEFAULT_STRATEGY
from router.metrics import Metrics
from tests import readme
from tests.router.chaos import MODEL
from tests.router.test_workers import CHAT, WORKERS, chat, multi_router, until
from tests.stub_backend import Behaviour, StubBackend

#: a README name, with the labels in braces when it has some
_LISTED = re.compile(r"`(kvroute_\w+)(?:\{([\w,]*)\})?`")
#: what the traffic below makes in either mode (the scraper's failures: the stub has no
#: /metrics); the page is read once all are on it, so both modes are read alike
_MADE = frozenset(
    {
        "kvroute_requests_total",
        "kvroute_time_to_first_token_seconds",
        "kvroute_client_disconnects_total",
        "kvroute_telemetry_fallbacks_total",
    }
)

Labelled = dict[str, frozenset[str]]


def documented() -> Labelled:
    """Each `kvroute_*` family the README's Metrics section names, with its labels."""
    section = readme.section("Metrics")
    return {name: frozenset(labels.split(",")) - {""} for name, labels in _LISTED.findall(section)}


def _query_name(name: str, kind: str) -> str:
    """The name a query uses: the text format names a counter's one series `_total`."""
    return f"{name}_total" if kind == "counter" else name


def named(page: str) -> set[str]:
    """Every `kvroute_*` family on the page, with samples or not yet."""
    return {
        _query_name(f.name, f.type)
        for f in text_string_to_metric_families(page)
        if f.name.startswith("kvroute_")
    }


def labelled(page: str) -> Labelled:
    """Each `kvroute_*` family with samples, with their label names (`le`: a bucket's)."""
    return {
        _query_name(f.name, f.type): frozenset(k for s in f.samples for k in s.labels) - {"le"}
        for f in text_string_to_metric_families(page)
        if f.name.startswith("kvroute_") and f.samples
    }


def series(page: str) -> set[tuple[str, frozenset[str]]]:
    """Each sample name on the page with its label names, `process_*` aside (one
    process's own, so only a single-process router has them)."""
    return {
        (s.name, frozenset(s.labels))
        for f in text_string_to_metric_families(page)
        for s in f.samples
        if not s.name.startswith("process_")
    }


@asynccontextmanager
async def router(tmp_path: Path, workers: int, backend: str) -> AsyncIterator[str]:
    """A router with `workers` processes in front of `backend`; yields its URL."""
    tmp_path.mkdir()
    config = {"backends": [{"url": backend, "name": "b0"}]}
    if workers > 1:
        async with multi_router(tmp_path, config) as multi:
            yield multi.url
        return
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1"}, **config}))
    port = free_port()
    cmd = [sys.executable, "-m", "router", "serve", "-c", str(path), "--port", str(port)]
    with process([*cmd, "--workers", "1", "--log-level", "warning"]):
        url = f"http://127.0.0.1:{port}"
        await wait_ready(url, timeout=30)
        yield url


async def _page(http: aiohttp.ClientSession, url: str) -> str | None:
    """The /metrics page once everything `_MADE` is on it."""
    async with http.get(url + "/metrics") as resp:
        page = await resp.text()
    return page if labelled(page).keys() >= _MADE else None


async def scraped(tmp_path: Path, workers: int, backend: str) -> str:
    """/metrics after one answered request, one streamed and one the client leaves."""
    async with router(tmp_path, workers, backend) as url, aiohttp.ClientSession() as http:
        async with http.post(url + CHAT, json=chat("whole")) as resp:
            assert resp.status == 200
            await resp.read()
        async with http.post(url + CHAT, json=chat("streamed", stream=True)) as resp:
            assert resp.status == 200
            await resp.read()
        left = await http.post(url + CHAT, json=chat("left", stream=True))
        assert left.status == 200
        await left.content.readany()
        left.close()  # gone before the stream's end: a client disconnect
        return await until(lambda: _page(http, url), 30, f"{sorted(_MADE)} on /metrics")


@asynccontextmanager
async def paced_backend() -> AsyncIterator[str]:
    """A stub whose streams last long enough for a client to leave one midway."""
    stub = await StubBackend(behaviour=Behaviour(chunks=3, pace=0.3)).start()
    try:
        yield stub.url
    finally:
        await stub.stop()


@pytest.mark.parametrize("workers", [1, WORKERS])
async def test_the_readme_lists_what_metrics_exports(tmp_path: Path, workers: int) -> None:
    listed = documented()
    async with paced_backend() as backend:
        page = await scraped(tmp_path / "router", workers, backend)
    shown = labelled(page)
    assert {name: listed.get(name) for name in shown} == shown
    if workers == 1:  # one process shows every family, even one nothing was counted in
        assert named(page) == listed.keys()
        for page_of_docs in readme.PAGES:
            unknown = readme.metric_names(page_of_docs.read_text()) - named(page)
            where = page_of_docs.relative_to(readme.ROOT)
            assert not unknown, f"{where} names metrics nothing exports: {unknown}"


async def test_one_worker_and_several_export_the_same_series(tmp_path: Path) -> None:
    async with paced_backend() as backend:
        one = await scraped(tmp_path / "one", 1, backend)
        several = await scraped(tmp_path / "several", WORKERS, backend)
    assert series(one) == series(several)


def test_the_readme_lists_every_declared_metric_with_its_labels() -> None:
    declared = {
        _query_name(m._name, m._type): frozenset(m._labelnames)
        for m in vars(Metrics(list)).values()
        if isinstance(m, MetricWrapperBase)
    }
    listed = documented()
    assert {name: listed.get(name) for name in declared} == declared


#: label values -> value, of the samples of one name
Series = dict[frozenset[tuple[str, str]], float]


def _samples(page: str) -> dict[str, Series]:
    out: dict[str, Series] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def _at_zero() -> dict[str, list[dict[str, str]]]:
    """The counters (and latency histograms) a router in front of one backend (b0,
    serving MODEL) shows at 0 before its first request, by sample name."""
    outcome = {"strategy": DEFAULT_STRATEGY, "model": MODEL}
    kinds = ("upstream", "connect", "disconnect", "timeout", "credentials")
    return {
        "kvroute_requests_total": [
            {**outcome, "backend": backend, "status": status, "endpoint": endpoint}
            for endpoint in ("chat", "completion")
            for backend, statuses in (
                ("b0", ("200", "502", "503", "504")),
                ("none", ("429", "503")),
            )
            for status in statuses
        ],
        "kvroute_upstream_errors_total": [{"backend": "b0", "kind": k} for k in kinds],
        "kvroute_retries_total": [{"backend": "b0", "reason": k} for k in kinds],
        "kvroute_client_disconnects_total": [{"backend": "b0"}],
        "kvroute_breaker_ejections_refused_total": [{"backend": "b0"}],
        "kvroute_backend_state_changes_total": [
            {"backend": "b0", "to": to} for to in ("open", "half_open", "draining")
        ],
        "kvroute_policy_decisions_total": [
            {"policy": DEFAULT_STRATEGY, "reason": r} for r in Reason
        ],
        "kvroute_spillovers_total": [{"reason": r} for r in SPILL_REASONS],
        "kvroute_admission_rejections_total": [
            {"reason": r} for r in ("queue_full", "queue_timeout", "tenant_cap")
        ],
        "kvroute_tenant_requests_total": [{"tenant": "(other)"}],
        "kvroute_cached_tokens_total": [{"source": s} for s in ("predicted", "reported")],
        "kvroute_panic_routing_total": [{}],
        **{
            f"kvroute_{name}_seconds_count": [
                {"backend": "b0", "endpoint": endpoint, "model": MODEL}
                for endpoint in ("chat", "completion")
            ]
            for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency")
        },
    }


def _missing(page: str) -> list[tuple[str, dict[str, str]]]:
    """The series of `_at_zero` not on the page at 0."""
    shown = _samples(page)
    return [
        (name, labels)
        for name, wanted in _at_zero().items()
        for labels in wanted
        if shown.get(name, {}).get(frozenset(labels.items())) != 0
    ]


async def _before_traffic(http: aiohttp.ClientSession, url: str) -> str | None:
    """The page once the workers know b0's model (the collector's feed brings it)."""
    async with http.get(url + "/metrics") as resp:
        page = await resp.text()
    return page if not _missing(page) else None


@pytest.mark.parametrize("workers", [1, WORKERS])
async def test_before_any_request_the_counters_are_on_the_page_at_0(
    tmp_path: Path, workers: int
) -> None:
    async with (
        paced_backend() as backend,
        router(tmp_path / "router", workers, backend) as url,
        aiohttp.ClientSession() as http,
    ):
        try:
            page = await until(lambda: _before_traffic(http, url), 30, "counters at 0")
        except AssertionError:
            async with http.get(url + "/metrics") as resp:
                raise AssertionError(_missing(await resp.text())) from None
    listed, shown = documented(), labelled(page)
    assert {name: listed.get(name) for name in shown} == shown
    if workers == 1:  # one process shows every family, even one nothing was counted in
        assert named(page) == listed.keys()

"""Token accounting end to end: simulated vLLM servers, the router asking streams for
their usage and keeping it from clients that did not ask, the counters by tenant, and
the usage records read back through the admin API."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from openai import AsyncOpenAI

from bench.sim.fleet import start_fleet
from bench.sim.params import SimParams
from router.config import build
from router.control.worker import Router

MODEL = "sim-llama-70b"
ADMIN = "admin-token-for-usage-tests"
MAX_TOKENS = 5


@asynccontextmanager
async def accounting(usage: dict) -> AsyncIterator[tuple[Router, AsyncOpenAI]]:
    fleet = await start_fleet(2, SimParams(time_scale=0.02))
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": b.url, "name": f"sim{i}"} for i, b in enumerate(fleet.backends)],
        "usage": usage,
        "tenant_header": "X-Tenant",
        "metrics": {"tenants": ["acme", "beta"]},
        "admin": {"port": 0, "token_env": "KV_USAGE_ADMIN"},
    }
    router = Router(build(data))
    try:
        await router.start()
        async with AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as oai:
            yield router, oai
    finally:
        await router.stop()
        await fleet.stop()


async def ask(oai: AsyncOpenAI, tenant: str, i: int, stream: bool, include: bool = False):
    """(usage the client saw or None, whether any chunk carried usage)."""
    messages = [{"role": "user", "content": f"request {i} of the accounting test"}]
    args = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS}
    headers = {"X-Tenant": tenant}
    if not stream:
        answer = await oai.chat.completions.create(**args, extra_headers=headers)
        return answer.usage
    options = {"stream_options": {"include_usage": True}} if include else {}
    chunks = [
        c
        async for c in await oai.chat.completions.create(
            **args, stream=True, extra_headers=headers, **options
        )
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usages = [c.usage for c in chunks if c.usage is not None]
    return usages[-1] if usages else None


def tokens(router: Router) -> Counter:
    """kvroute_tokens_total and kvroute_usage_requests_total by (tenant, kind)."""
    found: Counter = Counter()
    for metric, kind_of in (("tokens", None), ("usage_requests", "requests")):
        for family in getattr(router.metrics, metric).collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    found[(s.labels["tenant"], kind_of or s.labels["kind"])] += s.value
    return found


async def test_streams_are_counted_and_clients_get_only_the_usage_they_asked_for(
    monkeypatch,
) -> None:
    monkeypatch.setenv("KV_USAGE_ADMIN", ADMIN)
    async with accounting({"stream_usage": True}) as (router, oai):
        acme = [await ask(oai, "acme", i, stream=False) for i in range(3)]
        acme += [await ask(oai, "acme", i, stream=True, include=True) for i in (3, 4)]
        beta = [await ask(oai, "beta", i, stream=True) for i in range(3)]  # same prompts
        counted = tokens(router)
    assert all(u is not None for u in acme) and beta == [None, None, None]
    assert counted[("acme", "prompt")] == sum(u.prompt_tokens for u in acme)
    assert counted[("acme", "completion")] == sum(u.completion_tokens for u in acme)
    assert counted[("acme", "requests")] == 5
    assert counted[("beta", "prompt")] == sum(u.prompt_tokens for u in acme[:3])
    assert counted[("beta", "completion")] == 3 * MAX_TOKENS
    assert counted[("beta", "requests")] == 3


async def test_without_stream_usage_a_stream_that_did_not_ask_is_not_counted(
    monkeypatch,
) -> None:
    monkeypatch.setenv("KV_USAGE_ADMIN", ADMIN)
    async with accounting({}) as (router, oai):
        assert await ask(oai, "beta", 0, stream=True) is None
        assert tokens(router)[("beta", "requests")] == 0


async def test_usage_records_sum_to_the_counters_by_tenant_and_window(
    monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("KV_USAGE_ADMIN", ADMIN)
    usage = {"stream_usage": True, "records": True, "path": str(tmp_path / "u.db")}
    async with accounting({**usage, "interval_s": 0.05}) as (router, oai):
        for i in range(4):
            await ask(oai, "acme" if i % 2 else "beta", i, stream=bool(i % 3))
        counted = tokens(router)
        headers = {"Authorization": f"Bearer {ADMIN}"}
        url = router.admin.url + "/admin/usage"
        async with aiohttp.ClientSession(headers=headers) as http:
            async with asyncio.timeout(10):  # until the window holding the 4th is written
                while True:
                    async with http.get(url) as resp:
                        assert resp.status == 200
                        rows = (await resp.json())["usage"]
                    if sum(r["requests"] for r in rows) == 4:
                        break
                    await asyncio.sleep(0.02)
            async with http.get(
                url, params={"tenant": "acme", "since": "1970-01-01T00:00"}
            ) as resp:
                (acme,) = (await resp.json())["usage"]
            async with http.get(url, params={"until": "yesterday"}) as resp:
                assert resp.status == 400
                assert "`until`: expected epoch seconds" in (await resp.json())["error"]["message"]
    by_tenant = {r["tenant"]: r for r in rows}
    for tenant in ("acme", "beta"):
        row = by_tenant[tenant]
        assert (row["model"], row["pool"]) == (MODEL, "(none)")
        assert row["requests"] == counted[(tenant, "requests")] == 2
        assert row["prompt_tokens"] == counted[(tenant, "prompt")]
        assert row["completion_tokens"] == counted[(tenant, "completion")] == 2 * MAX_TOKENS
        assert row["from"] <= row["to"]
    assert acme == by_tenant["acme"]


async def test_usage_is_404_with_records_off(monkeypatch) -> None:
    monkeypatch.setenv("KV_USAGE_ADMIN", ADMIN)
    async with accounting({}) as (router, _):
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            async with http.get(router.admin.url + "/admin/usage") as resp:
                assert resp.status == 404
                assert "usage.records" in (await resp.json())["error"]["message"]


async def test_usage_records_keep_a_tenant_the_metrics_label_other(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KV_USAGE_ADMIN", ADMIN)
    usage = {"records": True, "path": str(tmp_path / "u.db"), "interval_s": 0.05}
    async with accounting(usage) as (router, oai):
        used = [await ask(oai, "globex", i, stream=False) for i in range(3)]
        headers = {"Authorization": f"Bearer {ADMIN}"}
        url = router.admin.url + "/admin/usage"
        async with aiohttp.ClientSession(headers=headers) as http:
            async with asyncio.timeout(10):  # until the window holding the 3rd is written
                while True:
                    async with http.get(url, params={"tenant": "globex"}) as resp:
                        assert resp.status == 200
                        rows = (await resp.json())["usage"]
                    if sum(r["requests"] for r in rows) == 3:
                        break
                    await asyncio.sleep(0.02)
            async with http.get(url, params={"tenant": "(other)"}) as resp:
                assert (await resp.json())["usage"] == []
            async with http.get(router.url + "/metrics") as resp:
                page = await resp.text()
    (row,) = rows
    assert row["prompt_tokens"] == sum(u.prompt_tokens for u in used)
    assert row["completion_tokens"] == 3 * MAX_TOKENS
    other = 'kvroute_usage_requests_total{model="sim-llama-70b",pool="(none)",tenant="(other)"}'
    assert f"{other} 3.0" in page.splitlines()
    assert "globex" not in page

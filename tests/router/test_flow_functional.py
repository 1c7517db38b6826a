"""Flow control through a real router on 127.0.0.1: refusals, class order, fair share,
the priority header, saturation from a backend's scraped /metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from router.control.worker import Router
from tests.router.chaos import until
from tests.router.conftest import running

PATH = "/v1/chat/completions"
ONE_AT_A_TIME = {"max_concurrent_requests": 1, "queue_size": 64, "queue_timeout": 30}


def _body(label: str) -> dict[str, Any]:
    return {
        "model": "stub-model",
        "messages": [{"role": "user", "content": label}],
        "max_tokens": 1,
    }


def _order(stub) -> list[str]:
    return [r["messages"][0]["content"] for r in stub.received]


async def _post(
    http: aiohttp.ClientSession, router: Router, label: str, **headers: str
) -> tuple[int, dict[str, str]]:
    async with http.post(router.url + PATH, json=_body(label), headers=headers) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


async def _queue_behind_held(
    router: Router,
    stub,
    http: aiohttp.ClientSession,
    sends: list[tuple[str, dict]],
    held_headers: dict[str, str] | None = None,
) -> list[asyncio.Task]:
    """Hold the only slot with a gated request, then queue `sends` (label, headers) in
    that order, each once the one before is queued; the tasks, the holder's first."""
    stub.behaviour.gate = asyncio.Event()
    held = asyncio.create_task(_post(http, router, "held", **(held_headers or {})))
    await until(lambda: stub.active == 1)
    tasks = [held]
    for label, headers in sends:
        tasks.append(asyncio.create_task(_post(http, router, label, **headers)))
        queued = len(tasks) - 1
        await until(lambda: router.dispatcher.admission.queued == queued)  # noqa: B023
    return tasks


async def test_higher_class_released_first_and_forged_priority_refused() -> None:
    flow = {"tenants": {"boss": {"priority": "critical", "trusted": True}}}
    config = {"limits": ONE_AT_A_TIME, "tenant_header": "X-Tenant", "flow": flow}
    async with running(1, **config) as (router, (stub,)), aiohttp.ClientSession() as http:
        forged = {"X-Kvroute-Priority": "critical"}  # an untrusted (anonymous) client
        async with http.post(router.url + PATH, json=_body("forged"), headers=forged) as resp:
            assert resp.status == 403
            assert "trusted" in (await resp.json())["error"]["message"]
        sends = [
            ("shed", {"X-Kvroute-Priority": "sheddable"}),
            ("std", {}),
            ("crit", {"X-Tenant": "boss"}),
            ("boss-lowered", {"X-Tenant": "boss", "X-Kvroute-Priority": "standard"}),
        ]
        tasks = await _queue_behind_held(router, stub, http, sends)
        stub.behaviour.gate.set()
        assert [(await t)[0] for t in tasks] == [200] * 5
        assert _order(stub) == ["held", "crit", "std", "boss-lowered", "shed"]


async def test_fair_share_by_weight_within_a_class() -> None:
    flow = {"tenants": {"big": {"weight": 3}}}
    config = {"limits": ONE_AT_A_TIME, "tenant_header": "X-Tenant", "flow": flow}
    async with running(1, **config) as (router, (stub,)), aiohttp.ClientSession() as http:
        noisy = [(f"noisy{i}", {"X-Tenant": "noisy"}) for i in range(6)]
        big = [(f"big{i}", {"X-Tenant": "big"}) for i in range(6)]
        quiet = [(f"quiet{i}", {"X-Tenant": "quiet"}) for i in range(2)]
        tasks = await _queue_behind_held(router, stub, http, noisy + big + quiet)
        stub.behaviour.gate.set()
        await asyncio.gather(*tasks)
        served = [label.rstrip("0123456789") for label in _order(stub)[1:]]
    # turns of weight: noisy 1, big 3, quiet 1 (unknown tenants the default weight)
    assert served[:10] == ["noisy", "big", "big", "big", "quiet"] * 2


async def test_a_client_gone_while_queued_leaves_the_queue_at_once() -> None:
    async with running(1, limits=ONE_AT_A_TIME) as (router, (stub,)):
        async with aiohttp.ClientSession() as http:
            (held,) = await _queue_behind_held(router, stub, http, [])
            async with aiohttp.ClientSession() as gone:
                waiting = asyncio.create_task(_post(gone, router, "gone"))
                await until(lambda: router.dispatcher.admission.queued == 1)
                waiting.cancel()  # the client closes its connection
            await until(lambda: router.dispatcher.admission.queued == 0)
            assert stub.active == 1 and not held.done()  # the slot is still held
            stub.behaviour.gate.set()
            assert (await held)[0] == 200
            assert (await _post(http, router, "next"))[0] == 200
        assert _order(stub) == ["held", "next"]


async def test_a_lower_class_is_shed_for_a_higher_one_when_the_queue_is_full(tmp_path) -> None:
    limits = {**ONE_AT_A_TIME, "queue_size": 2}
    log = tmp_path / "access.log"
    config = {"limits": limits, "access_log": {"path": str(log)}, "log_format": "json"}
    async with running(1, **config) as (router, (stub,)), aiohttp.ClientSession() as http:
        low = {"X-Kvroute-Priority": "sheddable"}
        tasks = await _queue_behind_held(router, stub, http, [("s1", low), ("s2", low)])
        crit = asyncio.create_task(_post(http, router, "std"))
        status, headers = await tasks[2]  # the newest sheddable gives its place
        assert status == 503 and headers["x-kvroute-drop-reason"] == "shed"
        assert "Retry-After" in headers
        await until(lambda: router.dispatcher.admission.queued == 2)
        full = await _post(http, router, "s3", **low)
        assert full[0] == 503 and full[1]["x-kvroute-drop-reason"] == "queue_full"
        stub.behaviour.gate.set()
        assert (await crit)[0] == 200 and (await tasks[1])[0] == 200
        assert _order(stub) == ["held", "std", "s1"]
    lines = [orjson.loads(line) for line in log.read_text().splitlines()]
    refused = [(e["status"], e["reason"], e["priority"]) for e in lines if e["status"] == 503]
    assert sorted(refused) == [(503, "queue_full", "sheddable"), (503, "shed", "sheddable")]
    waited = [e for e in lines if e["status"] == 200 and e["priority"] == "standard"]
    assert len(waited) == 2 and max(e["queue_ms"] for e in waited) > 0  # std waited


def _vllm_page(waiting: float, kv: float, running: int = 4) -> str:
    return (
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
    )


async def test_requests_wait_in_the_router_while_every_backend_is_saturated() -> None:
    telemetry = {"scrape_interval": 0.05}
    limits = {"queue_size": 8, "queue_timeout": 30}
    classes = {"sheddable": {"queue_timeout": 0.3}}
    flow = {"saturation": {"max_waiting": 2, "max_kv_cache_usage": 0.9}, "classes": classes}
    config = {"telemetry": telemetry, "limits": limits, "flow": flow}
    async with running(2, **config) as (router, stubs), aiohttp.ClientSession() as http:
        stubs[0].behaviour.metrics = _vllm_page(waiting=5, kv=0.1)  # queue too long
        stubs[1].behaviour.metrics = _vllm_page(waiting=0, kv=0.95)  # KV cache full
        backends = router.fleet.members
        await until(lambda: all(b.waiting == 5 or b.kv_usage == 0.95 for b in backends))
        waiting = asyncio.create_task(_post(http, router, "waits"))
        await until(lambda: router.dispatcher.admission.queued == 1)
        status, headers = await _post(
            http, router, "gives-up", **{"X-Kvroute-Priority": "sheddable"}
        )
        assert status == 503 and headers["x-kvroute-drop-reason"] == "saturated"
        assert not waiting.done() and sum(len(s.received) for s in stubs) == 0
        stubs[1].behaviour.metrics = _vllm_page(waiting=0, kv=0.5)  # leaves saturation
        assert (await waiting)[0] == 200
        assert _order(stubs[0]) + _order(stubs[1]) == ["waits"]  # then routed as usual


async def test_backends_without_metrics_take_more_than_max_waiting_at_once() -> None:
    """A backend with no metrics gives saturation nothing to judge: it batches every
    request sent (a vLLM server runs dozens of sequences at once), none waits in the
    router."""
    flow = {"saturation": {"max_waiting": 2}}
    async with running(2, flow=flow) as (router, stubs), aiohttp.ClientSession() as http:
        for stub in stubs:
            stub.behaviour.gate = asyncio.Event()
        held = [asyncio.create_task(_post(http, router, f"r{i}")) for i in range(12)]
        await until(lambda: sum(s.active for s in stubs) == 12)
        assert router.dispatcher.admission.queued == 0
        for stub in stubs:
            stub.behaviour.gate.set()
        assert [status for status, _ in await asyncio.gather(*held)] == [200] * 12


async def _stream(http: aiohttp.ClientSession, router: Router, label: str) -> int:
    body = {**_body(label), "stream": True}
    async with http.post(router.url + PATH, json=body) as resp:
        await resp.read()
        return resp.status


async def test_requests_sent_since_a_scrape_count_as_waiting_until_their_answer_begins() -> None:
    """Between two scrapes a backend's queue is its scraped one plus the router's
    requests sent there since whose answer has not begun: past `max_waiting` on every
    backend the next request waits in the router, even where the scrape found nothing
    waiting (a burst sent between scrapes queues in vLLM), and it goes on as soon as
    answers begin there, though they have not ended and no new scrape came."""
    telemetry = {"scrape_interval": 0.05, "stale_after": 60}
    flow = {"saturation": {"max_waiting": 2}}
    async with (
        running(2, telemetry=telemetry, flow=flow) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        for stub in stubs:
            stub.behaviour.metrics = _vllm_page(waiting=0, kv=0.1)
        await until(lambda: all(b.kv_usage == 0.1 for b in router.fleet.members), 5)
        for stub in stubs:
            stub.behaviour.metrics = None  # scrapes fail from now on: the last one holds
            stub.behaviour.gate = asyncio.Event()
            stub.behaviour.chunk_gate = asyncio.Semaphore(0)  # answers begin, never end
        held = [asyncio.create_task(_stream(http, router, f"r{i}")) for i in range(6)]
        await until(lambda: sum(s.active for s in stubs) == 6)
        assert [s.active for s in stubs] == [3, 3]  # 3 added to 0 waiting: past 2
        last = asyncio.create_task(_stream(http, router, "last"))
        await until(lambda: router.dispatcher.admission.queued == 1)
        stubs[1].behaviour.gate.set()  # its three answers begin
        await until(lambda: stubs[1].active == 4)
        assert stubs[0].active == 3 and router.dispatcher.admission.queued == 0
        for stub in stubs:
            stub.behaviour.gate.set()
            for _ in range(4 * stub.behaviour.chunks):  # every held stream's other chunks
                stub.behaviour.chunk_gate.release()
        assert await asyncio.gather(*held, last) == [200] * 7


async def test_a_learned_batch_limit_holds_requests_in_the_router_without_a_queue_scraped() -> None:
    """A backend seen queueing with two requests running is full at two of the router's
    requests in flight there (max_waiting 0), whatever its scrapes say since: the fifth
    request to two such backends waits in the router, not in vLLM's queue, and goes on
    once one of the four ends."""
    telemetry = {"scrape_interval": 0.05}
    flow = {"saturation": {"max_waiting": 0}}
    least = {"strategy": "LEAST_OUTSTANDING_REQUESTS"}
    async with (
        running(2, routing=least, telemetry=telemetry, flow=flow) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        backends = router.fleet.members
        for stub in stubs:
            stub.behaviour.metrics = _vllm_page(waiting=1, kv=0.1, running=2)  # scraped twice
        await until(lambda: all(b.batch.slots == 2 for b in backends))
        for stub in stubs:
            stub.behaviour.metrics = _vllm_page(waiting=0, kv=0.1, running=0)
        await until(lambda: all(b.waiting == 0 for b in backends))
        for stub in stubs:
            stub.behaviour.gate = asyncio.Event()
        sent = []
        for i in range(4):
            sent.append(asyncio.create_task(_post(http, router, f"r{i}")))
            await until(lambda: sum(s.active for s in stubs) == i + 1)  # noqa: B023
        sent.append(asyncio.create_task(_post(http, router, "r4")))
        await until(lambda: router.dispatcher.admission.queued == 1)
        assert [s.active for s in stubs] == [2, 2]
        stubs[0].behaviour.gate.set()
        assert (await sent[4])[0] == 200
        stubs[1].behaviour.gate.set()
        assert [status for status, _ in await asyncio.gather(*sent)] == [200] * 5


@pytest.mark.parametrize("strategy", ["KV_AWARE", "PREFIX_AWARE"])
async def test_a_cache_hit_stays_on_its_full_backend_where_a_cold_one_goes_elsewhere(
    strategy: str,
) -> None:
    """The policy put a long document on one backend; that backend then queues past
    max_waiting while the other has room. The document's next request stays where it
    is cached (the policy weighed that backend's load against prefilling it again
    elsewhere), and a new document goes to the backend with room, as any pick on a full
    backend does."""
    telemetry = {"scrape_interval": 0.05}
    flow = {"saturation": {"max_waiting": 2}}
    async with (
        running(2, routing={"strategy": strategy}, telemetry=telemetry, flow=flow) as (
            router,
            stubs,
        ),
        aiohttp.ClientSession() as http,
    ):
        for stub in stubs:
            stub.behaviour.metrics = _vllm_page(waiting=0, kv=0.1)
        backends = router.fleet.members
        await until(lambda: all(b.kv_usage == 0.1 for b in backends))

        def document(name: str, question: str) -> dict[str, Any]:
            text = " ".join(f"{name}{i}" for i in range(6000))
            return {
                "model": "stub-model",
                "messages": [
                    {"role": "system", "content": text},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 1,
            }

        async def send(body: dict[str, Any]) -> str:
            async with http.post(router.url + PATH, json=body) as resp:
                assert resp.status == 200
                await resp.read()
                return resp.headers["x-kvroute-backend"]

        home = await send(document("alpha", "first question"))
        held, free = sorted(stubs, key=lambda s: not s.received)
        held.behaviour.metrics = _vllm_page(waiting=5, kv=0.1)  # queueing past max_waiting
        await until(lambda: {b.waiting for b in backends} == {0, 5})
        assert await send(document("alpha", "second question")) == home
        assert await send(document("beta", "a new document")) != home
        assert len(held.received) == 2 and len(free.received) == 1


async def test_a_static_tokens_class_counts_where_the_tenant_config_sets_none(
    monkeypatch,
) -> None:
    tokens = [
        "tok-vip vip priority=critical trusted=true",
        "tok-low priority=sheddable",
        "tok-cfg cfg priority=critical",
    ]
    monkeypatch.setenv("KV_FLOW_TOKENS", ",".join(tokens))
    auth = {"enabled": True, "tokens_env": "KV_FLOW_TOKENS"}
    flow = {"tenants": {"cfg": {"priority": "sheddable"}}}  # the tenant's config wins
    config = {"limits": ONE_AT_A_TIME, "auth": auth, "flow": flow}
    async with running(1, **config) as (router, (stub,)), aiohttp.ClientSession() as http:

        def bearer(token: str, **more: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {token}", **more}

        raised = bearer("tok-low", **{"X-Kvroute-Priority": "standard"})  # not trusted
        assert (await _post(http, router, "raised", **raised))[0] == 403
        sends = [
            ("low", bearer("tok-low")),
            ("cfg", bearer("tok-cfg")),
            ("vip-lowered", bearer("tok-vip", **{"X-Kvroute-Priority": "standard"})),
            ("vip", bearer("tok-vip")),
        ]
        tasks = await _queue_behind_held(router, stub, http, sends, bearer("tok-low"))
        stub.behaviour.gate.set()
        assert [(await t)[0] for t in tasks] == [200] * 5
        assert _order(stub)[1:] == ["vip", "vip-lowered", "low", "cfg"]


async def test_the_reason_header_says_when_a_request_waited_in_the_queue() -> None:
    config = {"limits": ONE_AT_A_TIME, "flow": {"reason_header": True}}
    async with running(1, **config) as (router, (stub,)), aiohttp.ClientSession() as http:
        tasks = await _queue_behind_held(router, stub, http, [("waited", {})])
        stub.behaviour.gate.set()
        (held_status, held), (waited_status, waited) = [await t for t in tasks]
    assert held_status == waited_status == 200
    reason = held["x-kvroute-reason"]
    assert reason and "queued" not in reason  # admitted at once
    assert waited["x-kvroute-reason"] == f"{reason}; queued"

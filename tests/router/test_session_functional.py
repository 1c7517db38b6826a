"""Session affinity through a real router on 127.0.0.1: soft and hard, the rendezvous
placement, the spill of a saturated session backend, and x-kvroute-reason."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from router.dispatch.session import rendezvous
from tests.router.chaos import until
from tests.router.conftest import running

PATH = "/v1/chat/completions"
BODY = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _page(waiting: float) -> str:
    return f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\nvllm:kv_cache_usage_perc 0.1\n'


def _config(mode: str) -> dict[str, Any]:
    flow = {
        "saturation": {"max_waiting": 2},
        "session_affinity": {"mode": mode},
        "reason_header": True,
    }
    return {"telemetry": {"scrape_interval": 0.05}, "flow": flow}


async def _send(http: aiohttp.ClientSession, url: str, **headers: str) -> str:
    """The answer's x-kvroute-reason; the stub that served it is read from the stubs."""
    async with http.post(url + PATH, json=BODY, headers=headers) as resp:
        assert resp.status == 200
        await resp.read()
        return resp.headers["x-kvroute-reason"]


def _served(stubs) -> list[int]:
    return [len(s.received) for s in stubs]


@pytest.mark.parametrize("mode", ["soft", "hard"])
async def test_a_session_sticks_to_its_backend_and_soft_spills_when_saturated(mode: str) -> None:
    async with running(4, **_config(mode)) as (router, stubs), aiohttp.ClientSession() as http:
        for stub in stubs:
            stub.behaviour.metrics = _page(0)
        members = router.fleet.members
        home = members.index(rendezvous("s-1", members))  # what every replica computes
        sent = [await _send(http, router.url, **{"X-Session-ID": "s-1"}) for _ in range(8)]
        assert _served(stubs)[home] == 8 and sum(_served(stubs)) == 8
        assert set(sent) <= {"session", "random"}  # RANDOM may pick it by itself
        coding_agent = {"X-Claude-Code-Session-Id": "s-1"}  # another session header
        await _send(http, router.url, **coding_agent)
        assert _served(stubs)[home] == 9

        stubs[home].behaviour.metrics = _page(10)  # its vLLM queue fills up
        await until(lambda: members[home].waiting == 10)
        session = {"X-Session-ID": "s-1"}
        if mode == "hard":
            reason = await _send(http, router.url, **session)
            assert _served(stubs)[home] == 10 and sum(_served(stubs)) == 10
            assert reason in {"session", "random"}
            return
        for _ in range(40):  # soft: the policy's pick (RANDOM) decides, until off home
            before = _served(stubs)
            assert await _send(http, router.url, **session) == "random"
            if _served(stubs)[home] == before[home]:
                break
        (spilled,) = [i for i, n in enumerate(_served(stubs)) if n > before[i]]
        assert spilled != home
        for _ in range(4):  # the backend that served the session last is its backend now
            await _send(http, router.url, **session)
        assert _served(stubs)[spilled] == before[spilled] + 5


async def test_without_a_session_the_policy_decides_and_the_reason_is_off_by_default() -> None:
    async with running(2) as (router, _), aiohttp.ClientSession() as http:
        async with http.post(router.url + PATH, json=BODY) as resp:
            assert resp.status == 200 and "x-kvroute-reason" not in resp.headers
    async with running(2, **_config("soft")) as (router, _), aiohttp.ClientSession() as http:
        assert await _send(http, router.url) == "random"


async def test_with_kv_aware_a_cache_hit_elsewhere_outweighs_a_soft_session() -> None:
    """The session is a strong preference, not an override: more of the prompt cached
    on another backend wins; cached nowhere, or as much on the session's backend, the
    session's backend takes it (new sessions placed by the hash)."""
    config = {**_config("soft"), "routing": {"strategy": "KV_AWARE"}}
    config["flow"]["session_affinity"]["new_sessions"] = "hash"
    long = "the same long system prompt, " * 200
    body = {**BODY, "messages": [{"role": "user", "content": long}]}
    async with running(4, **config) as (router, stubs), aiohttp.ClientSession() as http:
        members = router.fleet.members
        sids = [f"a-{i}" for i in range(50)]
        first = sids[0]

        async def send(sid: str) -> tuple[int, str]:
            before = _served(stubs)
            headers = {"X-Session-ID": sid}
            async with http.post(router.url + PATH, json=body, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
                reason = resp.headers["x-kvroute-reason"]
            (index,) = [i for i, n in enumerate(_served(stubs)) if n > before[i]]
            return index, reason

        home = members.index(rendezvous(first, members))
        index, reason = await send(first)  # cold everywhere: its session's backend
        assert index == home and reason in {"session", "kv_cold"}
        # the policy's own picks (its first, and its pick of the session's backend alone)
        guessed = {d["chosen"] for d in router.fleet.policy.recent}
        other = next(
            s for s in sids if rendezvous(s, members).name not in {*guessed, members[home].name}
        )
        index, reason = await send(other)
        assert reason == "kv_hit" and members[index].name in {*guessed, members[home].name}
        index, reason = await send(first)  # cached on its session's backend too: stays
        assert index == home and reason in {"session", "kv_hit"}


async def test_with_kv_aware_a_pick_a_session_overrode_leaves_no_placement() -> None:
    """A new prompt of a session goes to the session's backend, not to the policy's own
    first pick: only the backend it went to holds it in the index, or the next request
    of that prompt would be sent where it never was (new sessions placed by the hash)."""
    config = {**_config("soft"), "routing": {"strategy": "KV_AWARE"}}
    config["flow"]["session_affinity"]["new_sessions"] = "hash"
    async with running(4, **config) as (router, stubs), aiohttp.ClientSession() as http:
        members, policy = router.fleet.members, router.fleet.policy

        def placed() -> list[int]:
            return [policy.index.gpu.size(m.name)[1] for m in members]  # speculative keys

        overridden = 0
        for i in range(12):
            held, served, decided = placed(), _served(stubs), len(policy.recent)
            prompt = f"document {i}: " + "a long new prompt, " * 150
            body = {**BODY, "messages": [{"role": "user", "content": prompt}]}
            session = {"X-Session-ID": f"s-{i}"}
            async with http.post(router.url + PATH, json=body, headers=session) as resp:
                assert resp.status == 200
                await resp.read()
            went = [n > s for n, s in zip(_served(stubs), served, strict=True)]
            grew = [n > h for n, h in zip(placed(), held, strict=True)]
            assert grew == went, f"prompt {i}: served {went}, placed {grew}"
            overridden += len(policy.recent) - decided == 2  # its own pick, then home's
        assert overridden  # the session overrode the policy's first pick at least once


@pytest.mark.parametrize("load_factor", [1.25, None])
async def test_a_new_session_passes_over_a_backend_loaded_past_the_bound(
    load_factor: float | None,
) -> None:
    """Four new sessions the hash gives one backend, held there; a fifth of that
    backend goes to its runner-up by the hash among the others, where the bound is on
    (every worker and replica computes the same while loads agree); by the hash alone,
    there too."""
    config = _config("soft")
    config["flow"]["session_affinity"]["load_factor"] = load_factor
    async with running(4, **config) as (router, stubs), aiohttp.ClientSession() as http:
        members = router.fleet.members
        theirs = [f"s-{i}" for i in range(200) if rendezvous(f"s-{i}", members) is members[0]]
        held, fifth = theirs[:4], theirs[4]
        stubs[0].behaviour.gate = gate = asyncio.Event()
        posts = [
            asyncio.create_task(_send(http, router.url, **{"X-Session-ID": sid})) for sid in held
        ]
        try:
            await until(lambda: stubs[0].active == 4)
            if load_factor is None:
                task = asyncio.create_task(_send(http, router.url, **{"X-Session-ID": fifth}))
                posts.append(task)
                await until(lambda: stubs[0].active == 5)
                return
            reason = await _send(http, router.url, **{"X-Session-ID": fifth})
            assert reason in {"session", "random"}  # RANDOM may pick it by itself
            runner_up = members.index(rendezvous(fifth, members[1:]))
            assert _served(stubs) == [4 if i == 0 else int(i == runner_up) for i in range(4)]
        finally:
            gate.set()
            assert set(await asyncio.gather(*posts)) <= {"session", "random"}


@pytest.mark.parametrize("new_sessions", ["cost", "hash"])
async def test_with_kv_aware_a_new_session_goes_where_its_cost_is_lowest(new_sessions: str) -> None:
    """A new session whose hash names a backend with requests waiting in its engine:
    by cost (the default) KV_AWARE's pick places it on another, and its next turns
    follow; by the hash it goes there, as every replica computes."""
    config = {**_config("soft"), "routing": {"strategy": "KV_AWARE"}}
    config["flow"]["session_affinity"]["new_sessions"] = new_sessions
    async with running(4, **config) as (router, stubs), aiohttp.ClientSession() as http:
        members = router.fleet.members
        for stub in stubs:
            stub.behaviour.metrics = _page(0)
        stubs[0].behaviour.metrics = _page(1)  # queued work there, under saturation
        await until(lambda: members[0].waiting == 1)
        sid = next(f"s-{i}" for i in range(200) if rendezvous(f"s-{i}", members) is members[0])
        reasons = [await _send(http, router.url, **{"X-Session-ID": sid}) for _ in range(4)]
        (home,) = [i for i, n in enumerate(_served(stubs)) if n]
        assert _served(stubs)[home] == 4  # every turn where the first went
        if new_sessions == "hash":
            assert home == 0 and reasons[0] == "session"
        else:
            assert home != 0 and reasons[0] != "session"


@pytest.mark.parametrize("mode", ["soft", "hard"])
async def test_with_kv_aware_a_session_leaves_a_backend_where_it_costs_far_more(mode: str) -> None:
    """A session placed by KV_AWARE's cost on an idle fleet; then a request waits in its
    backend's engine (under saturation): a one-token answer there costs the fleet twice
    what it costs elsewhere, its short prompt cached nowhere that matters. Soft, its
    next turn goes elsewhere and the turn after follows; hard, it stays."""
    config = {**_config(mode), "routing": {"strategy": "KV_AWARE"}}
    async with running(4, **config) as (router, stubs), aiohttp.ClientSession() as http:
        members = router.fleet.members
        for stub in stubs:
            stub.behaviour.metrics = _page(0)
        await _send(http, router.url, **{"X-Session-ID": "s-1"})
        (home,) = [i for i, n in enumerate(_served(stubs)) if n]
        stubs[home].behaviour.metrics = _page(1)
        await until(lambda: members[home].waiting == 1)
        reasons = [await _send(http, router.url, **{"X-Session-ID": "s-1"}) for _ in range(2)]
        served = _served(stubs)
        if mode == "hard":
            assert served[home] == 3 and reasons == ["session", "session"]
        else:
            # the second turn moved by the policy's pick, the third followed it there
            assert served[home] == 1 and sorted(served)[-1] == 2, served
            assert reasons[0] != "session"

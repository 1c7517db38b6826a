"""KV_AWARE end to end: simulated vLLM backends publishing real KV events, the router in
front, the OpenAI SDK as client. The index follows the backends, routing follows the index."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from bench.harness.processes import free_port, simulator
from bench.sim.fleet import SimFleet, start_fleet
from bench.sim.params import SimParams
from router.config import APPROXIMATE_BLOCK_SIZE, build
from router.control.worker import Router
from router.fleet.backends import UPKEEP_SLICE
from router.fleet.speeds import EARLY_TOKENS
from tests.router.chaos import until

MODEL = "sim-llama-70b"


def document(i: int) -> str:
    return "".join(f"doc {i} clause {k}: keep the premises in good order. " for k in range(50))


@asynccontextmanager
async def kv_fleet(
    n: int,
    encoding: str = "map",
    events: bool = True,
    routing: dict | None = None,
    **sim: object,
) -> AsyncIterator[tuple[Router, SimFleet]]:
    """`n` simulated backends (`sim` overrides their SimParams) and a KV_AWARE router
    (`routing` adds to its section); with events, yields once every subscription is in
    place on its publisher, so no batch is lost to the router."""
    params = SimParams(kv_events=True, kv_events_encoding=encoding, time_scale=0.01, **sim)
    fleet = await start_fleet(n, params)
    backends = []
    for i, b in enumerate(fleet.backends):
        entry = {"url": b.url, "name": f"sim{i}"}
        if events:
            pub = b.publisher
            entry["kv_events"] = {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
        backends.append(entry)
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": backends,
        "routing": {"strategy": "KV_AWARE", "seed": 3, **(routing or {})},
        "telemetry": {"scrape_interval": 0.2},
    }
    router = Router(build(config))
    await router.start()
    try:
        if events:
            async with asyncio.timeout(10):
                for b in fleet.backends:
                    await b.publisher.subscribed.wait()
        yield router, fleet
    finally:
        await router.stop()
        await fleet.stop()


async def debug_routing(router: Router) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(router.url + "/debug/routing") as resp:
            return await resp.json()


async def until_indexed(router: Router, backend: str, keys: int, tier: str | None = None) -> None:
    """Wait (bounded) until the index holds at least `keys` confirmed block keys of
    `backend`, on the GPU or, with `tier`, on that offload tier: the events arrived."""
    async with asyncio.timeout(10):
        while True:
            state = (await debug_routing(router))["backends"][backend]
            held = state["tier_keys"].get(tier, 0) if tier else state["index_keys"][0]
            if held >= keys:
                return
            await asyncio.sleep(0.02)


async def ask(
    router: Router, doc: str, question: str, request_id: str | None = None
) -> tuple[str, int]:
    async with AsyncOpenAI(
        base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=20
    ) as oai:
        raw = await oai.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "system", "content": doc}, {"role": "user", "content": question}],
            max_tokens=2,
            extra_headers={"X-Request-Id": request_id} if request_id else None,
        )
        usage = raw.parse().usage
        return raw.headers["x-kvroute-backend"], usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_requests_follow_the_cache(encoding: str) -> None:
    async with kv_fleet(3, encoding) as (router, _):
        homes = {}
        for i in range(6):
            homes[i], cached = await ask(router, document(i), "first question")
            assert cached == 0
        for home in set(homes.values()):  # the BlockStored events arrive
            await until_indexed(router, home, 37 * list(homes.values()).count(home))
        for i in range(6):
            backend, cached = await ask(router, document(i), "a follow-up", f"follow-up-{i}")
            assert backend == homes[i]
            assert cached > 600  # the document's blocks were reused
        debug = await debug_routing(router)
        assert {b["index_mode"] for b in debug["backends"].values()} == {"events"}

        async def scraped() -> dict:
            return (await debug_routing(router))["backends"][homes[5]]["scraped"] or {}

        async with asyncio.timeout(5):  # the next scrape sees the follow-ups' hits
            while not (await scraped()).get("prefix_cache_hit_rate"):
                await asyncio.sleep(0.1)
        assert (await scraped())["block_size"] == 16
        # each decision names its request, as the access log does
        assert [d["request_id"] for d in debug["decisions"][-6:]] == [
            f"follow-up-{i}" for i in range(6)
        ]
        assert debug["decisions"][-1]["chosen"] == homes[5]
        text = router.metrics.render().decode()
        assert 'kvroute_cached_tokens_total{source="reported"}' in text
        assert "kvroute_kv_prediction_error_tokens_count 12.0" in text


async def test_approximate_mode_without_events_keeps_prefixes_together() -> None:
    async with kv_fleet(3, events=False) as (router, _):
        homes = [await ask(router, document(i), "q") for i in range(4)]
        again = [await ask(router, document(i), "another q") for i in range(4)]
        assert [h for h, _ in homes] == [a for a, _ in again]
        assert all(cached > 600 for _, cached in again)
        text = router.metrics.render().decode()
        assert 'kvroute_backend_index_mode{backend="sim0",mode="approximate"} 1.0' in text
        # the GPU's table holds the documents' keys; the CPU tier's is empty but for its
        # id tables (shown once a second)
        await until(lambda: _index_bytes(router, "gpu") > _index_bytes(router, "cpu") > 0)


def _index_bytes(router, medium: str) -> float:
    """`kvroute_prefix_index_bytes` for `medium` (0 while not yet shown)."""
    text = router.metrics.render().decode()
    found = re.search(rf'kvroute_prefix_index_bytes{{medium="{medium}"}} (\S+)', text)
    return float(found[1]) if found else 0.0


async def test_a_long_prompts_keys_all_reach_the_index_a_slice_per_loop_turn() -> None:
    long_doc = "".join(document(i) for i in range(36))  # ~21,000 tokens: past the first slice
    block = APPROXIMATE_BLOCK_SIZE  # without KV events, the router's own block
    async with kv_fleet(1, events=False) as (router, _):
        backend, _ = await ask(router, long_doc, "q")
        debug = await debug_routing(router)
        blocks = debug["decisions"][-1]["prompt_tokens"] // block
        assert blocks > UPKEEP_SLICE
        async with asyncio.timeout(10):  # the router drains the rest between requests
            while (await debug_routing(router))["backends"][backend]["index_keys"][1] < blocks:
                await asyncio.sleep(0.02)
        assert (await debug_routing(router))["backends"][backend]["index_keys"][1] == blocks
        again, cached = await ask(router, long_doc, "another q")
        assert again == backend and cached >= UPKEEP_SLICE * block


def sampled(router: Router, family: str, **labels: str) -> float:
    """The sum of `family`'s samples with `labels` in this router's registry."""
    metric = getattr(router.metrics, family)
    return sum(
        s.value
        for f in metric.collect()
        for s in f.samples
        if s.name.endswith("_total") and labels.items() <= s.labels.items()
    )


async def test_an_answer_at_odds_with_the_kv_events_is_counted() -> None:
    """The backend empties its cache and its event of it is lost: the index, which its
    events keep fresh, still credits the document; the answer's cached tokens disagree,
    and that is counted, not applied (the events are the index's source)."""
    async with kv_fleet(1) as (router, fleet):
        await ask(router, document(0), "q")
        await until_indexed(router, "sim0", 37)
        assert (await ask(router, document(0), "again"))[1] > 600
        assert sampled(router, "kv_disagreements", backend="sim0") == 0
        assert sampled(router, "kv_hit_shortfalls") == 0
        kv = fleet.backends[0].engine.kv
        assert kv.reset_prefix_cache()
        kv.take_events()  # its AllBlocksCleared is lost
        assert (await ask(router, document(0), "once more"))[1] == 0
        assert sampled(router, "kv_disagreements", backend="sim0") == 1
        assert sampled(router, "kv_hit_shortfalls") == 1  # a kv_hit that found nothing
        assert sampled(router, "kv_corrections") == 0


async def test_stalled_kv_events_fall_back_to_the_reported_figures() -> None:
    """A backend whose KV events never come (nothing publishes at its endpoint): its
    index entries are the router's placements, and an answer that found none of them
    cached is a disagreement that corrects them, as without events."""
    fleet = await start_fleet(1, SimParams(time_scale=0.01))
    (sim,) = fleet.backends
    silent = {"endpoint": f"tcp://127.0.0.1:{free_port()}"}
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": sim.url, "name": "sim0", "kv_events": silent}],
        "routing": {"strategy": "KV_AWARE", "seed": 3, "speculative_ttl_s": 600},
    }
    router = Router(build(config))
    await router.start()
    try:
        await ask(router, document(0), "q")
        assert (await ask(router, document(0), "again"))[1] > 600
        assert (await debug_routing(router))["backends"]["sim0"]["index_mode"] == "events"
        async with aiohttp.ClientSession() as http:
            async with http.post(sim.url + "/reset_prefix_cache") as resp:
                assert resp.status == 200
        assert (await ask(router, document(0), "once more"))[1] == 0
        assert sampled(router, "kv_disagreements", backend="sim0") == 1
        assert sampled(router, "kv_corrections", backend="sim0", outcome="miss") == 1
        await ask(router, document(0), "and again")  # the index credits the document no more
        (decision,) = (await debug_routing(router))["decisions"][-1:]
        assert decision["scores"]["sim0"]["cached"] == 0
    finally:
        await router.stop()
        await fleet.stop()


async def test_a_dead_backend_stops_being_preferred() -> None:
    async with kv_fleet(2) as (router, fleet):
        home, _ = await ask(router, document(0), "q")
        await until_indexed(router, home, 37)
        dead = next(b for i, b in enumerate(fleet.backends) if f"sim{i}" == home)
        await dead.stop()
        router.fleet.set_healthy(router.fleet.find(home), False)  # what health checks do
        backend, _ = await ask(router, document(0), "q again")
        assert backend != home


async def test_exact_ids_from_the_backends_tokenize_endpoint() -> None:
    """tokenizer kind "backend": ids come from /tokenize (cached), not a local tokenizer."""
    routing = {"seed": 1, "tokenizer": {"kind": "backend"}}
    async with kv_fleet(2, routing=routing) as (router, _):
        home, _ = await ask(router, document(7), "q")
        await until_indexed(router, home, 37)
        for question in ("q", "another"):  # a repeat (cached ids) and a new prompt
            backend, cached = await ask(router, document(7), question)
            assert (backend, cached > 600) == (home, True)
        decisions = router.fleet.policy.recent
        assert decisions[-1]["scores"][home]["cached"] > 600
        (fallbacks,) = router.metrics.telemetry_fallbacks.collect()
        assert not any(
            s.value for s in fallbacks.samples if s.labels["reason"] == "tokenize_failed"
        )
        assert len(router.dispatcher._tokenizer._cache) == 2  # the two distinct prompts


async def test_hf_tokenizer_runs_off_the_loop_and_template_errors_are_400(tmp_path) -> None:
    from tests.hashing.test_hf_chat import build_tokenizer_dir
    from tests.router.conftest import running

    tok_dir = build_tokenizer_dir(tmp_path, template="{{ raise_exception('no system') }}")
    routing = {"strategy": "KV_AWARE", "tokenizer": {"kind": "hf", "path": str(tok_dir)}}
    async with running(2, routing) as (router, stubs):
        async with AsyncOpenAI(
            base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10
        ) as oai:
            with pytest.raises(openai.BadRequestError, match="no system"):
                await oai.chat.completions.create(
                    model="stub-model", messages=[{"role": "user", "content": "hi"}]
                )
            assert not any(s.received for s in stubs)
    tok_dir = build_tokenizer_dir(tmp_path / "ok")
    routing["tokenizer"]["path"] = str(tok_dir)
    async with running(3, routing) as (router, stubs):
        async with AsyncOpenAI(
            base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10
        ) as oai:
            homes = set()
            for q in ("roof", "windows", "doors"):
                raw = await oai.chat.completions.with_raw_response.create(
                    model="stub-model",
                    messages=[
                        {"role": "system", "content": "the tenant keeps " * 40},
                        {"role": "user", "content": q},
                    ],
                )
                homes.add(raw.headers["x-kvroute-backend"])
            assert len(homes) == 1  # approximate mode: the shared system prompt stays together
            assert router.fleet.policy.recent[-1]["prompt_tokens"] > 40


async def test_a_reload_that_adds_kv_events_starts_the_subscription(tmp_path) -> None:
    import yaml

    from router.control.reload import ConfigSource

    fleet = await start_fleet(1, SimParams(kv_events=True, time_scale=0.01))
    backend = {"url": fleet.urls[0], "name": "sim0"}
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [backend],
        "routing": {"strategy": "KV_AWARE"},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(data))
    router = Router(build(data), ConfigSource(str(path)))
    await router.start()
    mode = 'kvroute_backend_index_mode{{backend="sim0",mode="{}"}} 1.0'
    publisher = fleet.backends[0].publisher
    try:
        async with asyncio.timeout(5):  # the index sources have synced with the config
            while mode.format("approximate") not in router.metrics.render().decode():
                await asyncio.sleep(0.05)
        assert not publisher.subscribed.is_set()
        backend["kv_events"] = {"endpoint": publisher.endpoint}
        path.write_text(yaml.safe_dump(data))
        await router.reloader.reload()
        async with asyncio.timeout(5):
            await publisher.subscribed.wait()
            while mode.format("events") not in router.metrics.render().decode():
                await asyncio.sleep(0.05)
    finally:
        await router.stop()
        await fleet.stop()


async def pushed_off_the_gpu(router: Router, fleet: SimFleet) -> tuple[str, list[int]]:
    """Route document 0, then fill its home's GPU with other documents sent to the home
    directly, until none of document 0's blocks is left there; wait for the events of
    its removal. Its home, and its blocks' engine hashes."""
    home, _ = await ask(router, document(0), "q")
    sim = fleet.backends[int(home.removeprefix("sim"))]
    kv = sim.engine.kv
    doc0 = list(kv._cached)  # the home held nothing else
    async with aiohttp.ClientSession() as http:
        for i in range(1, 6):
            if not kv._cached.keys() & set(doc0):
                break
            body = {"model": MODEL, "messages": [{"role": "user", "content": document(i)}]}
            async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
    assert not kv._cached.keys() & set(doc0)
    gpu = router.fleet.policy.index.gpu
    async with asyncio.timeout(10):
        while any(gpu.key_of(home, h) is not None for h in doc0):
            await asyncio.sleep(0.02)
    return home, doc0


def tier_decisions(router: Router) -> float:
    (family,) = router.metrics.decisions.collect()
    return sum(s.value for s in family.samples if s.labels.get("reason") == "kv_tier")


TIERED = {"num_gpu_blocks": 60, "num_cpu_blocks": 2000, "max_model_len": 900}


async def test_a_prefix_the_gpu_evicted_is_routed_to_its_cpu_copy() -> None:
    """GPU room for one document, CPU room for all: the document goes back home, scored
    at the CPU tier's load cost, and is served from CPU memory there."""
    async with kv_fleet(2, **TIERED) as (router, fleet):
        home, doc0 = await pushed_off_the_gpu(router, fleet)
        cpu = router.fleet.policy.index.index_of("cpu")
        async with asyncio.timeout(10):
            while any(cpu.key_of(home, h) is None for h in doc0):
                await asyncio.sleep(0.02)
        backend, cached = await ask(router, document(0), "again")
        assert (backend, cached > 600) == (home, True)
        sim = fleet.backends[int(home.removeprefix("sim"))]
        assert sim.stats.cpu_hit_tokens > 600
        score = router.fleet.policy.recent[-1]["scores"][home]
        assert (score["gpu"], score["tiers"]["cpu"] > 600) == (0, True)
        assert tier_decisions(router) == 1
        debug = await debug_routing(router)
        assert debug["tiers"]["cpu"]["shared"] is False
        assert debug["backends"][home]["tier_keys"]["cpu"] >= len(doc0)


async def test_tier_blind_scoring_ignores_the_cpu_copy_and_counts_it() -> None:
    async with kv_fleet(2, routing={"tiers": {}}, **TIERED) as (router, fleet):
        home, _ = await pushed_off_the_gpu(router, fleet)
        await ask(router, document(0), "again")
        scores = router.fleet.policy.recent[-1]["scores"].values()
        assert [s["cached"] for s in scores] == [0, 0]
        assert not any("tiers" in s for s in scores)
        assert tier_decisions(router) == 0
        debug = await debug_routing(router)
        assert debug["tiers"] == {}
        assert debug["ignored_media"]["cpu"] > 0  # the CPU copies' events, counted
        assert debug["backends"][home]["tier_keys"] == {}


#: the simulator's speeds at this time scale: prefill tokens/s and decode step alone,
#: for a backend at full speed and one at half (prefill and decode)
SCALE = 0.5
TRUE = {"fast": (1000 / (0.1 * SCALE), 25 * SCALE / 1000), "slow": (1000 / (0.2 * SCALE), 0.025)}
#: half of a `streamed` prompt's prefill at full speed (~2,900 tokens at 20,000 a second)
HALF_PREFILL_S = 0.07
HALF = ["--step-base-ms", "50", "--decode-per-seq-ms", "0.3", "--prefill-per-token-ms", "0.2"]


async def streamed(
    url: str, i: int, first: asyncio.Event, tokens: int = 40, session: str | None = None
) -> None:
    """A ~3,000-token prompt of its own, streamed back from `url` (a router's or a
    backend's) in `tokens` tokens with its usage, in `session` if given; `first` is set
    when its first token came."""
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20) as oai:
        words = " ".join(f"w{i}x{k}" for k in range(1600))
        stream = await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": words}],
            max_tokens=tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-ID": session} if session else None,
        )
        async for _ in stream:
            first.set()


async def overlapping(router: Router, start: int, n: int) -> None:
    """`n` streams, each sent once the one before has its first token: their prefills
    apart (each is timed alone), their decodes overlapping (the batches grow); each a
    session of its own."""
    tasks = []
    for i in range(start, start + n):
        first = asyncio.Event()
        tasks.append(asyncio.create_task(streamed(router.url, i, first, session=f"s{i}")))
        await first.wait()
    await asyncio.gather(*tasks)


async def test_learned_speeds_converge_on_a_fleet_with_two_speeds() -> None:
    """A backend at full speed and one at half, each a simulator process of its own:
    streams until both speeds are learned, then the two in the simulators' ratio within
    15% and each within 25% of its nominal speed (a loaded machine stretches both
    simulators' real times alike), in /debug/routing (each figure from its own samples:
    the decode step is learned first) and in the gauges. Each stream is a session placed
    by its hash: KV_AWARE sends few requests to a backend it learned is slow, and both
    must take enough for every figure."""
    async with contextlib.AsyncExitStack() as stack:
        backends = []
        for name, args in (("fast", []), ("slow", HALF)):
            found, _ = await stack.enter_async_context(simulator(1, SCALE, args))
            backends.append({"url": found[0]["url"], "name": name})
        config = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "backends": backends,
            "routing": {"strategy": "KV_AWARE", "seed": 3},
            "flow": {"session_affinity": {"mode": "hard", "new_sessions": "hash"}},
        }
        router = Router(build(config))
        await router.start()
        stack.push_async_callback(router.stop)
        async with asyncio.timeout(120):
            i = 0
            while not all(
                {"prefill_tokens_per_s", "decode_step_s"} <= set(b["speed_learned_figures"])
                for b in (await debug_routing(router))["backends"].values()
            ):
                await overlapping(router, i, 8)
                i += 8
            await overlapping(router, i, 16)  # more beside the first samples
        shown = (await debug_routing(router))["backends"]
        speeds = {n: b["speed"] for n, b in shown.items()}
        for b in shown.values():
            assert {"prefill_tokens_per_s", "decode_step_s"} <= set(b["speed_learned_figures"])
        for name, (rate, step) in TRUE.items():
            learned = speeds[name]
            assert learned["prefill_tokens_per_s"] == pytest.approx(rate, rel=0.25), speeds
            assert learned["decode_step_s"] == pytest.approx(step, rel=0.25), speeds
        # each simulated step also takes the simulator's own Python work in wall time,
        # a larger share of the fast backend's 12.5 ms step than of the slow one's 25 ms:
        # on a loaded machine the decode steps' ratio reads above 0.5 (0.576 seen in CI)
        for i, (key, within) in enumerate((("prefill_tokens_per_s", 0.15), ("decode_step_s", 0.2))):
            want = TRUE["fast"][i] / TRUE["slow"][i]
            assert speeds["fast"][key] / speeds["slow"][key] == pytest.approx(want, rel=within)
        text = router.metrics.render().decode()
        rate = speeds["slow"]["prefill_tokens_per_s"]
        assert f'kvroute_backend_prefill_tokens_per_second{{backend="slow"}} {rate}' in text


async def one_simulated(
    stack: contextlib.AsyncExitStack, name: str, args: list[str], **extra: object
) -> Router:
    """A router (KV_AWARE, `extra` config sections) in front of one simulator process
    started with `args` and named `name`; both stopped with `stack`."""
    found, _ = await stack.enter_async_context(simulator(1, SCALE, args))
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": found[0]["url"], "name": name}],
        "routing": {"strategy": "KV_AWARE", "seed": 3},
        **extra,
    }
    router = Router(build(config))
    await router.start()
    stack.push_async_callback(router.stop)
    return router


async def test_a_prefill_queued_behind_one_partly_done_reads_the_true_rate() -> None:
    """Each stream is sent halfway through the prefill before it, so it always finds
    one queued ahead, partly done, and almost none find the backend idle. Timed from
    its send with the one ahead counted whole, it read the backend a third fast; timed
    from the first token before its own, it reads the true rate (a loaded machine may
    only stretch the simulator's real times, so not far under either)."""
    async with contextlib.AsyncExitStack() as stack:
        router = await one_simulated(stack, "fast", [])

        async def shown() -> dict:
            return (await debug_routing(router))["backends"]["fast"]

        firsts: list[asyncio.Event] = []
        tasks: list[asyncio.Task] = []

        def send() -> None:
            firsts.append(asyncio.Event())
            tasks.append(asyncio.create_task(streamed(router.url, len(tasks), firsts[-1])))

        async with asyncio.timeout(120):
            send()
            send()
            while "prefill_tokens_per_s" not in (await shown())["speed_learned_figures"]:
                await firsts[len(tasks) - 2].wait()  # the one before the last begins now
                await asyncio.sleep(HALF_PREFILL_S)  # the traffic's pace
                send()
            await asyncio.gather(*tasks)
        speed = (await shown())["speed"]
        rate = speed["prefill_tokens_per_s"]
        assert 0.75 * TRUE["fast"][0] <= rate <= 1.1 * TRUE["fast"][0], speed


async def test_prefills_sharing_an_engine_step_read_the_true_rate() -> None:
    """Streams sent faster than one backend prefills them, the queue never empty: the
    engine prefills two or three in one step, as its token budget allows. Timed from
    the first token before its own with only its own tokens, each read the backend at
    half its rate (a step held two prompts); the first of a step's prompts counts them
    all. Not overestimated, nor far under (a loaded machine may only stretch the
    simulator's real times)."""
    async with contextlib.AsyncExitStack() as stack:
        # no saturation: the queue stays on the backend
        router = await one_simulated(stack, "fast", [], flow={"saturation": {"enabled": False}})

        async def shown() -> dict:
            return (await debug_routing(router))["backends"]["fast"]

        tasks: list[asyncio.Task] = []
        async with asyncio.timeout(120):
            while "prefill_tokens_per_s" not in (await shown())["speed_learned_figures"]:
                for _ in range(5):
                    ask = streamed(router.url, len(tasks), asyncio.Event(), 2)  # ends soon after
                    tasks.append(asyncio.create_task(ask))
                    await asyncio.sleep(0.1)  # the traffic's pace: 2/3 of a prefill
            await asyncio.gather(*tasks)
        speed = (await shown())["speed"]
        assert 0.75 * TRUE["fast"][0] <= speed["prefill_tokens_per_s"] <= 1.1 * TRUE["fast"][0], (
            speed
        )


async def test_a_backend_is_learned_while_its_first_streams_still_decode() -> None:
    """A half-speed backend's first streams, long ones: its decode step is learned from
    their first tokens' gaps while every one of them still runs (learning only as
    streams ended left a slow backend judged at the faster ones' speed the longest)."""
    async with contextlib.AsyncExitStack() as stack:
        router = await one_simulated(stack, "slow", HALF)
        # 200 tokens at ~25 ms of wall time each: ~5 s a stream
        streams = [
            asyncio.create_task(streamed(router.url, i, asyncio.Event(), 200)) for i in range(8)
        ]
        try:
            async with asyncio.timeout(60):
                while (
                    "decode_step_s"
                    not in (shown := (await debug_routing(router)))["backends"]["slow"][
                        "speed_learned_figures"
                    ]
                ):
                    assert not any(s.done() for s in streams), "a stream ended first"
                    await asyncio.sleep(0.05)
            assert not any(s.done() for s in streams)
            step = shown["backends"]["slow"]["speed"]["decode_step_s"]
            assert step == pytest.approx(TRUE["slow"][1], rel=0.25)
        finally:
            await asyncio.gather(*streams)


async def test_a_backend_slower_than_its_lent_speed_shows_it_before_its_early_tokens() -> None:
    """A backend 8 times slower than the speed it is judged at: its first stream's
    decode sample is what came in `EARLY_TOKENS` steps at that speed (a few tokens),
    not `EARLY_TOKENS` tokens, which took it 8 times as long (meanwhile it looked fast
    and took new conversations)."""
    async with contextlib.AsyncExitStack() as stack:
        routing = {"strategy": "KV_AWARE", "seed": 3, "decode_step_s": TRUE["slow"][1] / 8}
        router = await one_simulated(stack, "slow", HALF, routing=routing)
        async with AsyncOpenAI(
            base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=20
        ) as oai:
            words = " ".join(f"w{k}" for k in range(600))
            stream = await oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": words}],
                max_tokens=200,  # ~5 s at ~25 ms of wall time a token
                stream=True,
            )
            received, seen = 0, None
            async with asyncio.timeout(30):
                async for _ in stream:
                    received += 1
                    shown = (await debug_routing(router))["backends"]["slow"]
                    if "decode_step_s" in shown["speed_learned_figures"]:
                        seen = seen or (received, shown["speed"]["decode_step_s"])
        assert seen is not None, "not learned while its stream ran"
        tokens, step = seen
        assert tokens < EARLY_TOKENS - 4, f"learned after {tokens} tokens"
        assert step == pytest.approx(TRUE["slow"][1], rel=0.25)


async def test_a_backend_is_learned_from_its_metrics_when_no_stream_passes_the_router() -> None:
    """Streams sent straight to a half-speed backend, none through the router (another
    router's or client's traffic): its decode step is learned from its /metrics, the
    inter-token histogram between two scrapes, with nothing relayed."""
    async with contextlib.AsyncExitStack() as stack:
        telemetry = {"scrape_interval": 0.2}
        router = await one_simulated(stack, "slow", HALF, telemetry=telemetry)
        backend = str(router.config.backends[0].url).rstrip("/")
        streams = [
            asyncio.create_task(streamed(backend, i, asyncio.Event(), 200)) for i in range(6)
        ]
        try:
            async with asyncio.timeout(60):
                while (
                    "decode_step_s"
                    not in (shown := await debug_routing(router))["backends"]["slow"][
                        "speed_learned_figures"
                    ]
                ):
                    assert not all(s.done() for s in streams), "every stream ended first"
                    await asyncio.sleep(0.05)
            speed = shown["backends"]["slow"]["speed"]
            # the step of the six streams' batch (HALF: 0.3 ms a request) within 25%
            at_six = speed["decode_step_s"] + 6 * speed["decode_s_per_request"]
            assert at_six == pytest.approx(TRUE["slow"][1] + 6 * 0.3e-3 * SCALE, rel=0.25), speed
        finally:
            await asyncio.gather(*streams)


async def test_answers_of_one_token_teach_the_prefill_rate() -> None:
    """Streams that end with their first token (classification, a yes or no) end before
    their engine step's other first tokens are in: each counts what was prefilled by
    its end, and the rate is learned from them."""
    async with contextlib.AsyncExitStack() as stack:
        router = await one_simulated(stack, "fast", [])
        async with asyncio.timeout(60):
            i = 0
            while (
                "prefill_tokens_per_s"
                not in (await debug_routing(router))["backends"]["fast"]["speed_learned_figures"]
            ):
                await streamed(router.url, i, asyncio.Event(), 1)
                i += 1
        speed = (await debug_routing(router))["backends"]["fast"]["speed"]
        assert 0.75 * TRUE["fast"][0] <= speed["prefill_tokens_per_s"] <= 1.1 * TRUE["fast"][0]

"""kvroute_event_loop_lag_seconds on a real router's /metrics: quiet while the loop is
free, and a stall of the loop (here the test's own, which the in-process router shares)
shows up as a late look."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import LAG_INTERVAL
from tests.router.conftest import running

LAG = "kvroute_event_loop_lag_seconds"


async def lag(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    (family,) = (f for f in text_string_to_metric_families(text) if f.name == LAG)
    return {
        s.labels.get("le", s.name.removeprefix(LAG)): s.value
        for s in family.samples
        if not s.name.endswith("_created")
    }


def late(samples: dict[str, float]) -> float:
    """Looks that came more than a quarter second late."""
    return samples["_count"] - samples["0.25"]


async def test_a_stalled_loop_shows_as_lag() -> None:
    async with running(1) as (router, _), aiohttp.ClientSession() as http:
        await asyncio.sleep(3 * LAG_INTERVAL)
        quiet = await lag(http, router.url)
        assert quiet["_count"] >= 2
        assert quiet["_sum"] / quiet["_count"] < 0.1  # a free loop is on time
        time.sleep(0.6)  # the loop runs nothing for 0.6 s
        await asyncio.sleep(2 * LAG_INTERVAL)
        after = await lag(http, router.url)
        assert after["_count"] > quiet["_count"]
        assert late(after) >= late(quiet) + 1
        # the look due during the stall ran at its end: at least 0.6 s - one interval late
        assert after["_sum"] - quiet["_sum"] >= 0.6 - LAG_INTERVAL

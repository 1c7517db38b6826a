"""What a benchmark reads off the servers it measures: every sample of a /metrics page,
a JSON status page, and the deltas between two reads.

A page that does not answer reads as empty, so a run against a target that exposes less
(another router, a bare vLLM server) reports n/a instead of failing.
"""

from __future__ import annotations

from collections.abc import Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def metrics(http: aiohttp.ClientSession, url: str) -> Samples:
    """Every sample of `url`/metrics by (name, labels); empty if there is none."""
    try:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def json_of(http: aiohttp.ClientSession, url: str) -> dict:
    try:
        async with http.get(url) as resp:
            return await resp.json() if resp.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}


def merged(pages: Iterable[Samples]) -> Samples:
    """Several pages' samples added up by (name, labels): replicas of one router read as one.
    Summing is right for the counters and histogram buckets the deltas are taken of."""
    out: Samples = {}
    for page in pages:
        for key, value in page.items():
            out[key] = out.get(key, 0.0) + value
    return out


def total(samples: Samples, name: str) -> float | None:
    values = [v for (n, _), v in samples.items() if n == name]
    return sum(values) if values else None


def delta(before: Samples, after: Samples, name: str) -> float | None:
    end = total(after, name)
    return None if end is None else end - (total(before, name) or 0.0)


def bucket_deltas(before: Samples, after: Samples, name: str) -> list[tuple[str, float]]:
    """A histogram's (le label, cumulative count) deltas, in bucket order."""
    deltas = [
        (dict(labels)["le"], value - before.get((n, labels), 0.0))
        for (n, labels), value in after.items()
        if n == name
    ]
    return sorted(deltas, key=lambda bucket: float(bucket[0]))


def stat_delta(before: dict, after: dict, key: str) -> float | None:
    return None if key not in after else after[key] - before.get(key, 0)


def reported_strategy(samples: Samples) -> str | None:
    """The strategy a kvroute target reports in kvroute_policy_decisions_total, if any."""
    for (name, labels), _ in samples.items():
        if name == "kvroute_policy_decisions_total":
            return dict(labels).get("policy")
    return None

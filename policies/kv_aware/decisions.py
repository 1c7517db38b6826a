"""KV_AWARE's last decisions with their scores, for /debug/routing.

Each pick keeps its decision as it stands (a tuple, no formatting on the path); `recent`
formats the last 64 only when someone asks.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from hashing.tiered_index import Reach
from policies.base import BackendLike, RouteRequest
from policies.kv_aware.cost import Scored

__all__ = ["Decisions"]


class Decisions:
    def __init__(self) -> None:
        self._recent: deque[tuple] = deque(maxlen=64)

    def record(
        self, req: RouteRequest, chosen: BackendLike, scored: list[Scored], reach: Reach
    ) -> None:
        """Keep the decision as it stands; `recent` formats it only when someone asks."""
        media = tuple([tier.medium for tier, _ in reach]) if reach else ()
        self._recent.append(
            (time.time(), req.request_id, req.model, req.prompt_tokens, chosen.name, scored, media)
        )

    def recent(self) -> list[dict[str, Any]]:
        """The last decisions, each with its request's id (`request_id`): per backend the
        cost (`cost_s`) and its TTFT estimate (`ttft_s`), the prompt tokens it need not
        prefill (`cached`), and of those how many are on its GPU and, per tier, how many
        more it reaches there (`tiers`)."""
        return [
            {
                "at": at,
                "request_id": request_id,
                "model": model,
                "prompt_tokens": tokens,
                "chosen": chosen,
                "scores": {
                    b.name: _described(cost, ttft, covered, gpu, _per_tier(media, reached, gpu))
                    for cost, covered, b, gpu, reached, ttft, _ in scored
                },
            }
            for at, request_id, model, tokens, chosen, scored, media in self._recent
        ]


def _per_tier(media: tuple[str, ...], reached: tuple[int, ...], gpu: int) -> dict[str, int]:
    """The tokens beyond the GPU's each tier adds (`reached` is cumulative)."""
    before, added = gpu, {}
    for medium, tokens in zip(media, reached, strict=True):
        added[medium], before = tokens - before, tokens
    return added


def _described(
    cost: float, ttft: float, covered: int, gpu: int, tiers: dict[str, int]
) -> dict[str, Any]:
    found: dict[str, Any] = {"cost_s": round(cost, 6), "ttft_s": round(ttft, 6), "cached": covered}
    if tiers:
        found["gpu"] = gpu
        found["tiers"] = tiers
    return found

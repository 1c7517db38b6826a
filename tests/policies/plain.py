"""Plain objects standing in for the router's backends and views in policy tests."""

from __future__ import annotations

from dataclasses import dataclass

from policies import FleetView


@dataclass
class B:
    name: str
    inflight: int = 0
    weight: int = 1


def fleet(members: list[B], down: tuple[str, ...] = ()) -> FleetView:
    """Every member is configured; those not `down` are candidates."""
    candidates = tuple(b for b in members if b.name not in down)
    return FleetView(tuple(members), candidates, frozenset(b.name for b in candidates))

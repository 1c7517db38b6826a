"""What a kvroute row learned of each simulated backend's speed, beside the true speed.

At the end of a replay the harness reads the router's `/debug/routing` (each backend's
`speed`, as the router routes with it, where it came from, and which of its figures
its own samples gave) and the simulator's
`/sim/stats` (`true_speeds`: what there was to learn). Both are put in simulated units:
the router measures wall time, so its prefill rate is multiplied by `time_scale` and its
decode step divided by it. On a mixed fleet (`--speeds`) the footer prints each row's
error per backend: how close the learning came.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["LearnedSpeed", "learned_speeds", "speed_lines"]


class LearnedSpeed(msgspec.Struct, kw_only=True):
    """One backend's speed at the end of a replay, learned and true, in simulated units
    (None: the router routes at its configured prior, or the simulator did not say)."""

    backend: str
    source: str | None  # /debug/routing's speed_source: learned, shared, typical, fastest or None
    prefill_tokens_per_s: float | None
    true_prefill_tokens_per_s: float | None
    decode_step_ms: float | None
    true_decode_step_ms: float | None
    #: the figures its samples gave (`Speed`'s field names); the others are the prior's
    figures: tuple[str, ...] = ()


def learned_speeds(
    debug: dict, stats: Sequence[dict], names: Sequence[str], time_scale: float
) -> list[LearnedSpeed]:
    """Each backend of `names` (in the fleet's order, with `stats` its /sim/stats) as the
    router's /debug/routing page `debug` shows it; empty if the page has no backends."""
    shown = debug.get("backends") or {}
    out = []
    for name, stat in zip(names, stats, strict=True):
        backend = shown.get(name)
        if backend is None:
            continue
        speed = backend.get("speed") or {}
        true = stat.get("true_speeds") or {}
        rate, step = speed.get("prefill_tokens_per_s"), speed.get("decode_step_s")
        out.append(
            LearnedSpeed(
                backend=name,
                source=backend.get("speed_source"),
                prefill_tokens_per_s=None if rate is None else rate * time_scale,
                true_prefill_tokens_per_s=true.get("prefill_tokens_per_s"),
                decode_step_ms=None if step is None else step * 1e3 / time_scale,
                true_decode_step_ms=true.get("decode_step_base_ms"),
                figures=tuple(backend.get("speed_learned_figures") or ()),
            )
        )
    return out


def speed_lines(rows: Sequence[tuple[str, int | None, Sequence[LearnedSpeed]]]) -> list[str]:
    """The footer's lines: per (row, seed, speeds), each backend's learned prefill rate
    and decode step and their error against the true ones."""
    lines = []
    for row, seed, speeds in rows:
        if not speeds:
            continue
        cells = "; ".join(_cell(s) for s in speeds)
        lines.append(f"  {row}, seed {seed}: {cells}")
    if not lines:
        return []
    head = (
        "Learned speeds at the end of each kvroute row (/debug/routing, simulated units; "
        "error against the simulator's true speed; 'prior': not learned, the configured one):"
    )
    return [head, *lines]


def _cell(s: LearnedSpeed) -> str:
    if s.prefill_tokens_per_s is None:
        return f"{s.backend} prior"
    prefill = _error(s, "prefill_tokens_per_s", s.prefill_tokens_per_s, s.true_prefill_tokens_per_s)
    step = _error(s, "decode_step_s", s.decode_step_ms, s.true_decode_step_ms)
    source = "" if s.source in (None, "learned") else f" ({s.source})"
    return (
        f"{s.backend} {s.prefill_tokens_per_s:,.0f} tok/s {prefill}, "
        f"step {s.decode_step_ms or 0:.1f} ms {step}{source}"
    )


def _error(s: LearnedSpeed, figure: str, learned: float | None, true: float | None) -> str:
    """The figure's error against the true one, or '(prior)' where its own samples did
    not give it (a backend that learned its decode step before any long prefill)."""
    if s.source == "learned" and figure not in s.figures:
        return "(prior)"
    if learned is None or not true:
        return "(true n/a)"
    return f"({learned / true - 1:+.0%})"

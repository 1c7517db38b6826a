"""A backend's cached tokens, counted as the router counts the prompt."""

from __future__ import annotations

from router.telemetry.cache_feedback import in_router_tokens


def test_an_exact_tokenizer_changes_nothing() -> None:
    assert in_router_tokens(640, 700, 700) == 640
    assert in_router_tokens(640, 700, None) == 640  # the answer did not say


def test_an_approximate_tokenizer_counts_the_same_share() -> None:
    """llama.cpp counts the prompt 1,200 tokens where the router counted 1,500: the 960 it
    found cached are 80% of it, 1,200 of the router's."""
    assert in_router_tokens(960, 1500, 1200) == 1200
    assert in_router_tokens(1200, 1500, 1200) == 1500
    assert in_router_tokens(1300, 1500, 1200) == 1500  # never past the prompt

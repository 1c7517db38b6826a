"""Pure tests of the workload generators: determinism, prefix sharing, sizes, skew, growth."""

import itertools
from collections import Counter

import pytest

from bench.harness.workloads import SHAPES, WorkloadSpec, generate
from bench.sim import render_chat, tokenize
from policies.prefix_aware import PrefixAwareParams

BLOCK = 16  # the simulator's (and vLLM's) KV block size in tokens
SMALL = {"requests": 60, "groups": 10, "prefix_tokens": 400, "question_tokens": 20}


def _leading_tokens_shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_same_seed_same_bytes_other_seed_other_text(shape):
    spec = WorkloadSpec(shape=shape, seed=3, rate=2.0, **SMALL)
    assert generate(spec) == generate(spec)
    other = generate(WorkloadSpec(shape=shape, seed=4, rate=2.0, **SMALL))
    assert [r.messages for r in other] != [r.messages for r in generate(spec)]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_groups_share_no_kv_block(shape):
    """Different groups differ from the first token on: no common full block."""
    first = {}
    for r in generate(WorkloadSpec(shape=shape, system_prompt="per-conversation", **SMALL)):
        first.setdefault(r.group, r.messages)
    assert len({m[0]["content"][:4] for m in first.values()}) == len(first)  # first token
    prompts = [tokenize(render_chat(m)) for m in first.values()]
    for i, a in enumerate(prompts):
        for b in prompts[i + 1 :]:
            assert _leading_tokens_shared(a, b) < BLOCK


@pytest.mark.parametrize("shape", ["long-prefix", "short-prefix", "hot-prefix"])
def test_requests_of_a_group_share_exactly_the_prefix(shape):
    by_group: dict[int, list] = {}
    for r in generate(WorkloadSpec(shape=shape, **SMALL)):
        by_group.setdefault(r.group, []).append(r.messages)
    for messages in by_group.values():
        assert len({m[0]["content"] for m in messages}) == 1
        assert len({m[1]["content"] for m in messages}) == len(messages)


@pytest.mark.parametrize(
    ("shape", "prefix", "question"),
    [
        ("long-prefix", 8000, 100),
        ("short-prefix", 500, 100),
        ("hot-prefix", 8000, 100),
    ],
)
def test_default_token_sizes(shape, prefix, question):
    r = generate(WorkloadSpec(shape=shape, requests=3, groups=3))[0]
    assert len(tokenize(r.messages[0]["content"])) == prefix
    assert len(tokenize(r.messages[1]["content"])) == question
    assert prefix + question < len(tokenize(render_chat(r.messages))) < prefix + question + 30


def test_no_sharing_prompts_are_unique_and_sized():
    requests = generate(WorkloadSpec(shape="no-sharing", requests=30, groups=1))
    assert len({r.group for r in requests}) == 30
    assert {len(tokenize(r.messages[0]["content"])) for r in requests} == {1100}


def test_long_prefix_spreads_requests_evenly_and_shuffled():
    requests = generate(WorkloadSpec(shape="long-prefix", requests=62, groups=10))
    counts = Counter(r.group for r in requests)
    assert sorted(counts.values()) == [6] * 8 + [7] * 2
    assert [r.group for r in requests] != sorted(r.group for r in requests)


def test_hot_prefix_follows_zipf():
    n, groups, s = 4000, 20, 1.1
    spec = WorkloadSpec(shape="hot-prefix", requests=n, groups=groups, zipf_s=s, prefix_tokens=8)
    counts = Counter(r.group for r in generate(spec))
    norm = sum(1 / (k + 1) ** s for k in range(groups))
    for k in (0, 1, 4):
        expected = n / (k + 1) ** s / norm
        assert abs(counts[k] - expected) < 4 * expected**0.5 + 5
    assert counts[0] > 2 * counts[3]


def test_multi_turn_history_grows_turn_by_turn():
    spec = WorkloadSpec(
        shape="multi-turn",
        requests=12,
        groups=3,
        prefix_tokens=400,
        question_tokens=20,
        max_tokens=30,
    )
    previous: dict[int, list] = {}
    for r in generate(spec):
        before = previous.get(r.group)
        assert r.turn == (0 if before is None else len(before) // 2)
        assert len(r.messages) == 2 + 2 * r.turn
        if before is not None:
            assert r.messages[: len(before)] == before  # the whole history, unchanged
            reply = r.messages[len(before)]
            assert reply["role"] == "assistant" and len(tokenize(reply["content"])) == 30
            grown = len(tokenize(render_chat(r.messages))) - len(tokenize(render_chat(before)))
            assert 20 + 30 <= grown <= 20 + 30 + 20  # question + reply + template
        previous[r.group] = r.messages
    assert sorted(len(m) for m in previous.values()) == [8, 8, 8]


def test_multi_turn_conversations_share_a_system_prompt_longer_than_prefix_length():
    """By default every conversation starts with one system prompt, longer than the
    fingerprint PREFIX_AWARE takes by default, and they part at the first question."""
    requests = generate(WorkloadSpec(shape="multi-turn", requests=12, groups=4))
    first = {r.group: r.messages for r in requests if r.turn == 0}
    assert len(first) == 4
    systems = {m[0]["content"] for m in first.values()}
    assert len(systems) == 1
    (system,) = systems
    assert len(tokenize(system)) == 1000 > PrefixAwareParams().prefix_length
    prompts = [tokenize(render_chat(m)) for m in first.values()]
    shared = {_leading_tokens_shared(a, b) for a, b in itertools.combinations(prompts, 2)}
    assert min(shared) >= 1000 and max(shared) < 1000 + 2 * BLOCK  # the system prompt only


def test_poisson_arrivals_have_the_rate_and_stop_at_the_duration():
    requests = generate(WorkloadSpec(requests=5000, groups=5, prefix_tokens=8, rate=4.0))
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(requests)]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.02
    spec = WorkloadSpec(requests=5000, groups=5, prefix_tokens=8, rate=4.0, duration=10.0)
    bounded = generate(spec)
    assert 20 < len(bounded) < 60 and bounded[-1].arrival <= 10.0


def test_closed_loop_has_no_arrivals():
    assert {r.arrival for r in generate(WorkloadSpec(**SMALL))} == {None}

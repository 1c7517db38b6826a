"""Micro-benchmarks of the hashing hot path: fingerprint an 8,000-token chat, pick a backend.

Run: .venv/bin/pytest bench/micro/test_bench_hashing.py --benchmark-enable
Each group has a baseline, xxh3_64 of the same leading bytes, so results read as a ratio to
the cost of hashing alone. Goal: fingerprint + first pick under 50 µs (median).
"""

import pytest
import xxhash

from hashing.blocks import chain_each, chain_packed
from hashing.canonical import Message, chat_text
from hashing.fingerprint import Fingerprinter
from hashing.ring import HashRing
from hashing.tokens import ApproxTokenizer

CHARS_PER_TOKEN = 4.0
PROMPT_TOKENS = 8000
MEMBERS = 16


def _chat() -> list[Message]:
    """~32,000 characters: a 20,000-char system prompt and six turns of 2,000 chars."""
    sentence = "Route each prompt to the backend that already holds its prefix in KV cache. "
    system = (sentence * (20_000 // len(sentence) + 1))[:20_000]
    turns = [
        Message("user" if i % 2 == 0 else "assistant", (f"turn {i}: " + sentence * 27)[:2000])
        for i in range(6)
    ]
    return [Message("system", system), *turns]


MESSAGES = _chat()
RING = HashRing([(f"10.0.0.{i}:8000", 1) for i in range(MEMBERS)])
PREFIX_LENGTHS = [pytest.param(256, id="prefix-256"), pytest.param(8000, id="prefix-8000")]


def test_prompt_is_about_8000_tokens():
    chars = len(chat_text(MESSAGES, None, 0))
    assert abs(chars / CHARS_PER_TOKEN - PROMPT_TOKENS) < 0.02 * PROMPT_TOKENS


@pytest.mark.parametrize("prefix_length", PREFIX_LENGTHS)
def test_baseline_xxh3_of_leading_bytes(benchmark, prefix_length):
    benchmark.group = f"prefix-{prefix_length}"
    tokenization = ApproxTokenizer(CHARS_PER_TOKEN)
    text = chat_text(MESSAGES, None, tokenization.chars_for(prefix_length))
    key, _ = tokenization.leading(text, prefix_length)
    benchmark(xxhash.xxh3_64_intdigest, key)


@pytest.mark.parametrize("prefix_length", PREFIX_LENGTHS)
def test_fingerprint(benchmark, prefix_length):
    benchmark.group = f"prefix-{prefix_length}"
    fingerprinter = Fingerprinter(ApproxTokenizer(CHARS_PER_TOKEN), prefix_length)
    benchmark(fingerprinter.chat, "llama-3.1-70b", "tenant-a", MESSAGES, None)


@pytest.mark.parametrize("prefix_length", PREFIX_LENGTHS)
def test_fingerprint_and_first_pick(benchmark, prefix_length):
    benchmark.group = f"prefix-{prefix_length}"
    fingerprinter = Fingerprinter(ApproxTokenizer(CHARS_PER_TOKEN), prefix_length)

    def route() -> int:
        return next(RING.walk(fingerprinter.chat("llama-3.1-70b", "tenant-a", MESSAGES, None)))

    picked = benchmark(route)
    fingerprint = fingerprinter.chat("llama-3.1-70b", "tenant-a", MESSAGES, None)
    assert picked == RING.owner(fingerprint)


def test_ring_first_two_picks(benchmark):
    benchmark.group = "ring-16"

    def two_picks() -> tuple[int, int]:
        walk = RING.walk(0x9E3779B97F4A7C15)
        return next(walk), next(walk)

    first, second = benchmark(two_picks)
    assert first != second


BLOCK_IDS = bytes(range(256)) * (2048 * 16 * 4 // 256)  # 2,048 blocks of 16 packed ids


@pytest.mark.parametrize("how", ["baseline-xxh3-whole", "one-call", "block-by-block"])
def test_block_keys_of_a_32k_token_prompt(benchmark, how):
    """KV_AWARE's keys of a new 32,768-token prompt (hashing/blocks.py), against xxh3 of
    the same 128 KiB in one call."""
    benchmark.group = "block-keys-32k"
    if how == "baseline-xxh3-whole":
        benchmark(xxhash.xxh3_64_intdigest, BLOCK_IDS)
    else:
        chain = chain_packed if how == "one-call" else chain_each
        benchmark(chain, 7, BLOCK_IDS, 16)

"""CacheTrust: the answers' cached blocks correct the index and bound what it trusts.

A model engine with an LRU cache of a few prompts is played against the index: the index
is told every placement (as KV_AWARE's speculative insert does), the engine answers with
what it really had, and the index's learned capacity follows the engine's.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

from hashing.cache_trust import Answer, CacheTrust, Outcome
from hashing.prefix_index import PrefixIndex

TTL = 600.0


def prompt(doc: int, blocks: int = 10) -> list[int]:
    return [doc * 1000 + i for i in range(blocks)]


class LruEngine:
    """A backend's prefix cache: `capacity` blocks, least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def run(self, keys: list[int]) -> int:
        """The cached leading blocks found, then the prompt's blocks are its newest."""
        found = 0
        while found < len(keys) and keys[found] in self.blocks:
            found += 1
        for key in keys:
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return found


class Clock:
    now = 0.0


def answer(keys: list[int], predicted: int, reported: int) -> Answer:
    Clock.now += 1.0
    return Answer("b", keys, predicted, reported, Clock.now, TTL)


def route(index: PrefixIndex, trust: CacheTrust, engine: LruEngine, keys: list[int]) -> Outcome:
    """Place `keys` on backend "b" as KV_AWARE would, run it, feed the answer back."""
    predicted = index.longest_prefix(keys, "b")
    Clock.now += 1.0
    index.learn("b", keys[predicted:], Clock.now + TTL)
    return trust.observe(answer(keys, predicted, engine.run(keys)))


def test_a_miss_drops_the_blocks_past_what_the_backend_had() -> None:
    index = PrefixIndex()
    trust = CacheTrust(index)
    keys = prompt(1)
    index.learn("b", keys, Clock.now + TTL)
    outcome = trust.observe(answer(keys, 10, 3))
    assert outcome is Outcome.MISS
    assert index.longest_prefix(keys, "b") == 3
    assert index.size("b") == (0, 3)


def test_one_block_short_is_still_a_hit() -> None:
    """An engine may recompute the last block of a prompt it holds whole."""
    index = PrefixIndex()
    trust = CacheTrust(index)
    keys = prompt(1)
    index.learn("b", keys, Clock.now + TTL)
    assert trust.observe(answer(keys, 10, 9)) is Outcome.HIT
    assert index.longest_prefix(keys, "b") == 10


def served(index: PrefixIndex, trust: CacheTrust, engine: LruEngine, n: int) -> Counter:
    """`n` requests for six documents, drawn at random (seeded): their outcomes."""
    rng = random.Random(1)
    return Counter(route(index, trust, engine, prompt(rng.randrange(6))) for _ in range(n))


def test_the_learned_capacity_follows_a_small_cache_and_grows_back() -> None:
    """An engine holding two prompts of ten blocks: the index, trusting every placement,
    mispredicts at first; the learned capacity falls to about two prompts, after which
    it predicts no more than the engine has. The engine grown to hold four and a half,
    its hits and surpluses raise the capacity again."""
    index = PrefixIndex()
    trust = CacheTrust(index)
    engine = LruEngine(capacity=20)
    first = served(index, trust, engine, 100)
    learned = trust.learned["b"]
    assert first[Outcome.MISS] > 0
    assert 20 <= learned.blocks <= 30
    assert index.size("b")[1] <= 30
    then = served(index, trust, engine, 300)
    assert then[Outcome.MISS] == 0 and then[Outcome.HIT] > 50
    engine.capacity = 45
    served(index, trust, engine, 300)
    assert learned.blocks >= 40
    assert served(index, trust, engine, 300)[Outcome.HIT] > then[Outcome.HIT]


def test_one_outlier_halves_the_bound_at_most() -> None:
    """An engine that lost its whole cache once (a restart) does not collapse the bound."""
    index = PrefixIndex()
    trust = CacheTrust(index)
    for doc in range(10):
        Clock.now += 1.0
        index.learn("b", prompt(doc), Clock.now + TTL)
    keys = prompt(9)
    trust.observe(answer(keys, 10, 0))
    assert trust.learned["b"].blocks >= 45  # of the 100 blocks the index held


def test_a_surplus_puts_back_what_the_index_let_go() -> None:
    index = PrefixIndex()
    trust = CacheTrust(index)
    keys = prompt(1)
    assert trust.observe(answer(keys, 0, 8)) is Outcome.SURPLUS
    assert index.longest_prefix(keys, "b") == 8


def test_stalled_events_correct_confirmed_entries_too() -> None:
    index = PrefixIndex()
    trust = CacheTrust(index)
    keys = prompt(1)
    index.placed("b", [(k, k + 1) for k in keys])
    assert trust.stalled("b", now=0.0)
    trust.heard["b"] = 100.0
    assert not trust.stalled("b", now=105.0)
    assert trust.stalled("b", now=111.0)
    trust.observe(answer(keys, 10, 4)._replace(confirmed=True))
    assert index.longest_prefix(keys, "b") == 4
    assert index.key_of("b", keys[5] + 1) is None


def test_a_missed_prompt_found_again_raises_nothing() -> None:
    """The engine holds what a miss's request computed anew: no proof of more room."""
    index = PrefixIndex()
    trust = CacheTrust(index)
    for doc in range(4):
        Clock.now += 1.0
        index.learn("b", prompt(doc), Clock.now + TTL)
        trust.observe(answer(prompt(doc), 0, 0))
    trust.observe(answer(prompt(0), 10, 0))
    learned = trust.learned["b"].blocks
    assert trust.observe(answer(prompt(0), 0, 10)) is Outcome.SURPLUS
    assert trust.learned["b"].blocks == learned
    assert trust.observe(answer(prompt(7), 0, 10)) is Outcome.SURPLUS  # one it never lost
    assert trust.learned["b"].blocks == learned + 10


def test_a_process_sharing_the_index_learns_alike_from_the_lessons(tmp_path) -> None:
    """Another process over the same shared table gets only each answer's lesson (no
    keys: the answering process corrected the table): it learns the same counts and
    capacity, and its view of the table is the answering process's."""
    here, there = PrefixIndex(), PrefixIndex()
    for index in (here, there):
        index.share(str(tmp_path / "index-gpu"))
    mine, theirs = CacheTrust(here), CacheTrust(there)
    engine = LruEngine(capacity=20)
    rng = random.Random(5)
    outcomes: Counter = Counter()
    for n in range(400):
        engine.capacity = 20 if n < 200 else 45
        keys = prompt(rng.randrange(6))
        predicted = here.longest_prefix(keys, "b")
        Clock.now += 1.0
        here.learn("b", keys[predicted:], Clock.now + TTL)
        given = mine.witnessed(answer(keys, predicted, engine.run(keys)))
        outcomes[mine.observe(given)] += 1
        theirs.learn(given.lesson)
        assert theirs.learned["b"].described() == mine.learned["b"].described()
    assert outcomes[Outcome.MISS] and outcomes[Outcome.SURPLUS] and outcomes[Outcome.HIT]
    assert [there.longest_prefix(prompt(d), "b") for d in range(6)] == [
        here.longest_prefix(prompt(d), "b") for d in range(6)
    ]

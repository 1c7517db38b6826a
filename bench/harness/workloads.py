"""Seeded workload generators: the request streams the harness and the locust file replay.

A workload is a finite list of `RequestSpec`s: chat messages, `max_tokens`, the prefix
group the request belongs to, its turn within that group, and its arrival offset in
seconds from the start (Poisson arrivals at `rate`) or None (closed loop: sent as soon
as one of the client's workers is free).

Shapes (token counts are characters / 4, the simulator's tokenizer; a real tokenizer
differs a little). G = `groups`, N = `requests`:
  long-prefix   G documents of `prefix_tokens` (default 8,000) tokens as system prompts;
                each request is one document plus its own ~`question_tokens` (100) question.
                The N requests are spread evenly over the groups (N/G each, ±1), shuffled.
  short-prefix  the same with ~500-token shared system prompts.
  hot-prefix    long-prefix documents, but each request draws its group from a Zipf law
                with exponent `zipf_s` over G groups: a few hot prefixes take most requests.
  multi-turn    G conversations behind one `prefix_tokens` (default 1,000) system prompt,
                the same for all of them (`system_prompt` "shared", as in a chat product),
                or one per conversation ("per-conversation"). The shared one is longer than
                PREFIX_AWARE's default `prefix_length` (256 tokens), so a router that hashes
                only the leading tokens sees one prefix for every conversation. Turn t sends
                the whole history (t questions and t `max_tokens`-token replies) plus a new
                question, so prompts grow by question + reply per turn. Conversations are
                interleaved at random with their turns kept in order; a client sends turn t
                only after turn t-1 of the same group has finished. Each request names its
                conversation as a session (`RequestSpec.session`, sent as `X-Session-ID`
                and the header sglang-router's `manual` policy keys by), as chat clients
                and coding agents do.
  no-sharing    every request a unique prompt of prefix + question tokens (its own group).

Invariants: the same `WorkloadSpec` gives the same requests, byte for byte (every text comes
from a `random.Random` seeded with a string of the seed, the shape and an index, which
Python hashes with SHA-512, independent of PYTHONHASHSEED). Every text starts with a
four-character tag that is a bijection of (seed, group) for fewer than 2**20 groups, so
two groups differ from their first token on and share no KV block: their only common
bytes are the chat template's first few characters, less than one 16-token block. The
exception is multi-turn's shared system prompt: there groups differ from the first token
after it. Requests of one group share exactly the group's prefix messages.

Cost: O(characters generated), once per workload; about 1.5 ms per 8,000-token document.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = ["SHAPES", "RequestSpec", "WorkloadSpec", "generate"]

CHARS_PER_TOKEN = 4
Shape = Literal["long-prefix", "short-prefix", "hot-prefix", "multi-turn", "no-sharing"]
Message = dict[str, str]
Prompt = tuple[int, int, list[Message]]  # group, turn, messages

_DEFAULT_PREFIX_TOKENS: dict[str, int] = {
    "long-prefix": 8000,
    "short-prefix": 500,
    "hot-prefix": 8000,
    "multi-turn": 1000,
    "no-sharing": 1000,
}
_TAG_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"  # 32 symbols: 4 of them = 20 bits
_TAG_BITS = 20
_TAG_MULTIPLIER = 0x9E3B5  # odd, so multiplication is a bijection modulo 2**20
_VOCABULARY = (
    "the cache prefix token model server request answer system router latency batch "
    "memory block document question report policy vector kernel tensor engine stream "
    "budget market river mountain garden window letter history science music energy "
    "planet signal network packet buffer thread process record table column index "
    "summary chapter section figure result method sample value factor measure "
    "contract clause party payment notice term period service customer product order "
    "invoice account balance credit review patient doctor clinic treatment dose trial "
    "protein cell gene sequence species climate ocean forest harvest season weather "
    "and for with from into over under between about after before during while where"
)
_WORDS = _VOCABULARY.split()


class WorkloadSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What to generate; `prefix_tokens` None means the shape's default."""

    shape: Shape = "long-prefix"
    requests: Annotated[int, Meta(ge=1)] = 300
    groups: Annotated[int, Meta(ge=1, lt=2**_TAG_BITS)] = 50
    prefix_tokens: Annotated[int, Meta(ge=2)] | None = None
    question_tokens: Annotated[int, Meta(ge=2)] = 100
    max_tokens: Annotated[int, Meta(ge=1)] = 100
    zipf_s: Annotated[float, Meta(gt=0)] = 1.1
    system_prompt: Literal["shared", "per-conversation"] = "shared"  # multi-turn
    rate: Annotated[float, Meta(gt=0)] | None = None
    duration: Annotated[float, Meta(gt=0)] | None = None
    seed: int = 0

    @property
    def shared_tokens(self) -> int:
        return self.prefix_tokens or _DEFAULT_PREFIX_TOKENS[self.shape]


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One request to send. `turn` > 0 must wait for turn - 1 of the same group."""

    index: int
    group: int
    turn: int
    messages: list[Message]
    max_tokens: int
    arrival: float | None
    #: the conversation it continues, for session affinity (multi-turn)
    session: str | None = None


def generate(spec: WorkloadSpec) -> list[RequestSpec]:
    """The workload `spec` describes, in sending order (see the module docstring)."""
    rng = random.Random(f"{spec.seed}/{spec.shape}/order")
    prompts = SHAPES[spec.shape](spec, rng)
    arrivals = _arrivals(spec, rng)  # may stop early (duration): so does the workload
    pairs = zip(prompts, arrivals, strict=False)
    sessions = spec.shape == "multi-turn"
    return [
        RequestSpec(
            index=i,
            group=g,
            turn=t,
            messages=m,
            max_tokens=spec.max_tokens,
            arrival=arrival,
            session=f"conversation-{spec.seed}-{g}" if sessions else None,
        )
        for i, ((g, t, m), arrival) in enumerate(pairs)
    ]


def _arrivals(spec: WorkloadSpec, rng: random.Random) -> Iterator[float | None]:
    """Poisson offsets at `rate` up to `duration`, or endless None (closed loop)."""
    if spec.rate is None:
        return itertools.repeat(None)
    offsets = itertools.accumulate(rng.expovariate(spec.rate) for _ in itertools.count())
    if spec.duration is None:
        return offsets
    return itertools.takewhile(lambda t: t <= spec.duration, offsets)


def _shared_prefix(spec: WorkloadSpec, pick: Callable[[], int]) -> list[Prompt]:
    """Each request: its group's system prompt (built once) + a question of its own."""
    systems: dict[int, str] = {}
    out = []
    for i in range(spec.requests):
        g = pick()
        if g not in systems:
            systems[g] = tagged_text(spec, "doc", g, spec.shared_tokens)
        question = tagged_text(spec, "question", i, spec.question_tokens)
        out.append((g, 0, [_msg("system", systems[g]), _msg("user", question)]))
    return out


def _even(spec: WorkloadSpec, rng: random.Random) -> list[Prompt]:
    order = [i % spec.groups for i in range(spec.requests)]
    rng.shuffle(order)
    return _shared_prefix(spec, iter(order).__next__)


def _zipf(spec: WorkloadSpec, rng: random.Random) -> list[Prompt]:
    weights = list(itertools.accumulate(1.0 / (k + 1) ** spec.zipf_s for k in range(spec.groups)))
    groups = list(range(spec.groups))
    return _shared_prefix(spec, lambda: rng.choices(groups, cum_weights=weights)[0])


def _unique(spec: WorkloadSpec, rng: random.Random) -> list[Prompt]:
    tokens = spec.shared_tokens + spec.question_tokens
    return [
        (i, 0, [_msg("user", tagged_text(spec, "doc", i, tokens))]) for i in range(spec.requests)
    ]


def _multi_turn(spec: WorkloadSpec, rng: random.Random) -> list[Prompt]:
    turns = -(-spec.requests // spec.groups)
    pending = [g for g in range(spec.groups) for _ in range(turns)]
    rng.shuffle(pending)  # a uniformly random interleaving; turns are numbered in order
    shared = spec.system_prompt == "shared"
    history = {
        g: [_msg("system", tagged_text(spec, "doc", 0 if shared else g, spec.shared_tokens))]
        for g in range(spec.groups)
    }
    next_turn = dict.fromkeys(range(spec.groups), 0)
    out = []
    for g in pending[: spec.requests]:
        t = next_turn[g]
        question = tagged_text(spec, "question", g * turns + t, spec.question_tokens)
        messages = [*history[g], _msg("user", question)]
        out.append((g, t, messages))
        reply = tagged_text(spec, "reply", g * turns + t, spec.max_tokens)
        history[g] = [*messages, _msg("assistant", reply)]
        next_turn[g] = t + 1
    return out


SHAPES: dict[str, Callable[[WorkloadSpec, random.Random], list[Prompt]]] = {
    "long-prefix": _even,
    "short-prefix": _even,
    "hot-prefix": _zipf,
    "multi-turn": _multi_turn,
    "no-sharing": _unique,
}


def tagged_text(spec: WorkloadSpec, role: str, index: int, tokens: int) -> str:
    """`tokens` * 4 characters: a tag unique to (seed, index), a space, then seeded words."""
    rng = random.Random(f"{spec.seed}/{spec.shape}/{role}/{index}")
    chars = tokens * CHARS_PER_TOKEN
    body_chars = chars - CHARS_PER_TOKEN - 1
    words = rng.choices(_WORDS, k=body_chars // 3 + 1)  # every word has >= 3 letters
    return f"{_tag(spec.seed, index)} {' '.join(words)[:body_chars]}"[:chars]


def _tag(seed: int, index: int) -> str:
    """Four characters, a bijection of `index` modulo 2**20 for a given seed."""
    mask = (1 << _TAG_BITS) - 1
    v = (index * _TAG_MULTIPLIER + _tag_offset(seed)) & mask
    return "".join(_TAG_ALPHABET[(v >> shift) & 31] for shift in (15, 10, 5, 0))


@functools.cache
def _tag_offset(seed: int) -> int:
    return random.Random(seed).getrandbits(_TAG_BITS)


def _msg(role: str, content: str) -> Message:
    return {"role": role, "content": content}

"""What `kvroute recommend` measures in traffic: its shared prefixes, its concurrency and
the fleet's prefill rate, from a router's data capture or from a generated workload.

Inputs. A capture is JSON lines (optionally gzipped), one record per request as the
router's data capture writes them (format v1; `_Record` holds the fields read here).
Records without a request body, of another endpoint than chat or completions, or that
did not succeed are counted and left out. A workload (bench/harness/workloads.py) is replayed in
virtual time on simulated engines (bench/harness/replay.py, LEAST_OUTSTANDING_REQUESTS, which
ignores prefixes) to give every request the timing and usage a capture would hold.

Shared prefixes. Each prompt becomes a chain of block keys (hashing/blocks.py), counted
in PREFIX_AWARE's tokens (approx: `chars_per_token` characters of the routing text of
hashing/canonical.py, model and tenant in the root) or in the simulator's ChatML4 tokens
(hashing/chat_tokens.py, model and cache_salt in the root: what KV_AWARE and the KV cache
count). A key stands for the whole prefix up to the end of its block, so one pass over
the traffic with a dict of every distinct key seen (its count, depth and parent) gives
each request's shared length: the leading blocks whose keys an earlier request already
had. After the pass, over the distinct keys in insertion order (a key always comes after
its parent):
  - the globally shared part is the deepest block that at least `NEARLY_ALL` (90%) of
    the requests hold, a system prompt common to all;
  - a group is a block one past the global part held by two requests or more (the
    requests behind it share more than the global part); its shared part is its deepest
    descendant that nearly all of its members hold.
Lengths are whole blocks (`block_size` tokens): a shared length is rounded down to its
block, so the true global part is shorter than the global length plus one block.

Cost: O(prompt tokens) to tokenize and hash, each prompt cut at `max_tokens`; memory and
the second pass O(distinct blocks).
"""

from __future__ import annotations

import gzip
import itertools
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import msgspec
import xxhash

from bench.harness.replay import MODEL, policy_maker, replay
from bench.harness.report import percentile
from bench.harness.workloads import WorkloadSpec, generate
from hashing.blocks import chain, root_key
from hashing.canonical import Message, chat_text, prompt_text
from hashing.chat_tokens import PromptBlocks
from hashing.fingerprint import namespace
from router.errors import BadRequest
from router.request import ChatRequest, Kind, Prompt, parse

__all__ = [
    "NEARLY_ALL",
    "Concurrency",
    "Group",
    "Prefill",
    "Prefixes",
    "Seen",
    "Tokens",
    "Traffic",
    "TrafficError",
    "concurrency",
    "from_workload",
    "prefill_rate",
    "prefixes",
    "read_capture",
]

NEARLY_ALL = 0.9
#: prompts shorter than this many uncached tokens say more about queueing than prefill
_MIN_UNCACHED = 512
_MIN_PREFILL_SAMPLES = 5
_PREFILL_QUANTILE = 0.9  # the least-queued requests: their TTFT is mostly prefill
_KINDS = {"/v1/chat/completions": Kind.CHAT, "/v1/completions": Kind.COMPLETION}


class TrafficError(ValueError):
    """The input cannot be read as traffic (a missing file, a bad line, no prompts)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Seen:
    """One request as recommend reads it: whose it was, its prompt, its timing in
    seconds (`end`: when it finished) and usage, where known."""

    model: str
    tenant: str | None = None
    salt: str | None = None
    messages: Sequence[Message] | None = None
    tools: msgspec.Raw | None = None
    prompt: Prompt | None = None
    end: float | None = None
    duration: float | None = None
    backend: str | None = None
    ttft: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Traffic:
    """The requests read, where from, and how many records were left out and why."""

    source: str
    requests: list[Seen]
    skipped: dict[str, int] = field(default_factory=dict)
    #: capture files that end mid-record (still being written, or their writer killed),
    #: read up to their last complete line
    unfinished: list[str] = field(default_factory=list)


# --- reading a capture -----------------------------------------------------------------


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


class _Record(msgspec.Struct):
    """The fields of a capture record (v1) that recommend reads; the rest are skipped."""

    v: int
    at: float
    path: str
    model: str | None = None
    tenant: str | None = None
    status: int | None = None
    backend: str | None = None
    ttft_ms: float | None = None
    duration_ms: float | None = None
    usage: _Usage | None = None
    #: empty when absent (request capture off)
    request: msgspec.Raw = msgspec.Raw()


_RECORD = msgspec.json.Decoder(_Record)


def read_capture(paths: Sequence[str]) -> Traffic:
    """Every usable request of the capture files, in order; TrafficError says what is wrong."""
    requests: list[Seen] = []
    skipped: Counter[str] = Counter()
    unfinished: list[str] = []
    for path in paths:
        for record in _records(path, unfinished):
            seen = _seen(record, skipped)
            if seen is not None:
                requests.append(seen)
    source = ", ".join(paths)
    if not requests:
        left = "; ".join(f"{n} {why}" for why, n in skipped.items()) or "no records"
        raise TrafficError(
            f"{source}: no request with a prompt to analyse ({left}); capture with the "
            "request bodies on"
        )
    return Traffic(source, requests, dict(skipped), unfinished)


def _records(path: str, unfinished: list[str]) -> Iterator[_Record]:
    try:
        with _open(path) as lines:
            for number, line in _complete_lines(lines, path, unfinished):
                if line.strip():
                    yield _decode(line, f"{path}:{number}")
    except OSError as exc:  # missing, unreadable, or not gzip after all
        raise TrafficError(f"{path}: {exc.strerror or exc}") from None


def _complete_lines(
    lines: IO[bytes], path: str, unfinished: list[str]
) -> Iterator[tuple[int, bytes]]:
    """The lines of `lines`, numbered, up to the last complete one. The router's writer
    ends every record with a newline, and a gzip file it has not closed (still writing,
    or killed) lacks its end-of-stream marker: such a file stops at its last complete
    line, and `unfinished` gets its path. A last line without a newline that is whole
    JSON (a file written by hand) counts."""
    try:
        for number, line in enumerate(lines, 1):
            if not line.endswith(b"\n") and not _is_json(line):
                break
            yield number, line
        else:
            return
    except EOFError:  # gzip: the stream ends before its end-of-stream marker
        pass
    unfinished.append(path)


def _is_json(line: bytes) -> bool:
    try:
        msgspec.json.decode(line)
    except msgspec.DecodeError:
        return False
    return True


def _open(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else Path(path).open("rb")


def _decode(line: bytes, where: str) -> _Record:
    try:
        record = _RECORD.decode(line)
    except msgspec.ValidationError as exc:  # a DecodeError too: it must come first
        raise TrafficError(f"{where}: not a capture record: {exc}") from None
    except msgspec.DecodeError as exc:
        raise TrafficError(f"{where}: not a JSON line: {exc}") from None
    if record.v != 1:
        raise TrafficError(f"{where}: capture format v{record.v}; this kvroute reads v1")
    return record


def _seen(record: _Record, skipped: Counter[str]) -> Seen | None:
    kind = _KINDS.get(record.path)
    why = None
    if kind is None:
        why = "of other endpoints"
    elif record.status is not None and not 200 <= record.status < 300:
        why = "that failed"
    elif not record.request:
        why = "without a request body"
    if why is not None:
        skipped[why] += 1
        return None
    try:
        body = parse(kind, bytes(record.request))
    except BadRequest:
        skipped["with a request body routing cannot read"] += 1
        return None
    usage = record.usage or _Usage()
    is_chat = isinstance(body, ChatRequest)
    return Seen(
        model=record.model or body.model or "",
        tenant=record.tenant,
        salt=body.cache_salt,
        messages=body.messages if is_chat else None,
        tools=(body.tools or None) if is_chat else None,
        prompt=None if is_chat else body.prompt,
        end=record.at,
        duration=_seconds(record.duration_ms),
        backend=record.backend,
        ttft=_seconds(record.ttft_ms),
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
    )


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


# --- a workload ------------------------------------------------------------------------


def from_workload(spec: WorkloadSpec, backends: int) -> Traffic:
    """`spec`'s requests, timed by a virtual-time replay on `backends` simulated engines."""
    timed = replay(spec, policy_maker("LEAST_OUTSTANDING_REQUESTS", spec.seed), backends)
    requests = []
    for req in generate(spec):
        i = req.index
        prompt_tokens, cached = timed.tokens[i]
        requests.append(
            Seen(
                model=MODEL,
                messages=msgspec.convert(req.messages, list[Message]),
                end=timed.finished_at[i],
                duration=timed.finished_at[i] - timed.sent_at[i],
                backend=f"b{timed.backend[i]}",
                ttft=timed.ttft[i],
                prompt_tokens=prompt_tokens,
                cached_tokens=cached,
                completion_tokens=req.max_tokens,
            )
        )
    source = (
        f"workload {spec.shape}, timed on {backends} simulated backends "
        "(LEAST_OUTSTANDING_REQUESTS, virtual time)"
    )
    return Traffic(source, requests)


# --- shared prefixes -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tokens:
    """How prompts are counted: PREFIX_AWARE's approx tokens or the simulator's ChatML4."""

    kind: Literal["approx", "chatml4"] = "approx"
    chars_per_token: float = 4.0
    block_size: int = 16
    max_tokens: int = 32768  # KV_AWARE's max_prefix_tokens: longer prompts are cut there

    def describe(self) -> str:
        if self.kind == "approx":
            return f"PREFIX_AWARE's approx tokens ({self.chars_per_token:g} characters each)"
        return "the simulator's ChatML4 tokens (what KV_AWARE and the KV cache count)"


class Group(msgspec.Struct, frozen=True):
    requests: int
    shared_tokens: int


class Prefixes(msgspec.Struct, kw_only=True):
    """The traffic's shared prefixes, in tokens (whole blocks)."""

    tokens: str
    #: counted as PREFIX_AWARE counts (approx), so prefix_length can be read off
    approx: bool
    block_size: int
    #: per request, in order: its prompt tokens, and the leading ones it shares with an
    #: earlier request
    lengths: list[int]
    shared: list[int]
    #: common to at least NEARLY_ALL of the requests (0: nothing is)
    global_tokens: int
    groups: list[Group]
    #: largest share of the requests behind one prefix of each length (blocks 1, 2, ...)
    hottest: list[float]

    @property
    def requests(self) -> int:
        return len(self.lengths)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def reuse(self) -> float:
        """Prompt tokens an earlier request already sent, past the global part: what
        affinity can gain over spreading (every backend caches the global part anyway)."""
        past = sum(max(0, s - self.global_tokens) for s in self.shared)
        return past / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def reuse_all(self) -> float:
        """Prompt tokens an earlier request already sent: an unbounded cache's hit rate."""
        return sum(self.shared) / self.prompt_tokens if self.prompt_tokens else 0.0

    def hottest_at(self, tokens: int) -> float:
        """Largest share of the requests one fingerprint of `tokens` tokens pins together."""
        depth = min(len(self.hottest), max(1, tokens // self.block_size))
        return self.hottest[depth - 1] if self.hottest else 0.0


def prefixes(traffic: Traffic, tokens: Tokens) -> Prefixes:
    """The shared prefixes of `traffic` counted in `tokens` (see the module docstring)."""
    nodes: dict[int, list[int]] = {}  # key -> [count, depth, parent key]
    lengths, shared = [], []
    blocks_of = _block_keys(tokens)
    for req in traffic.requests:
        root, keys, count = blocks_of(req)
        lengths.append(count)
        shared.append(_walk(nodes, root, keys) * tokens.block_size)
    n = len(shared)
    depth, hottest = _global_depth(nodes, n)
    groups = _groups(nodes, depth)
    return Prefixes(
        tokens=tokens.describe(),
        approx=tokens.kind == "approx",
        block_size=tokens.block_size,
        lengths=lengths,
        shared=shared,
        global_tokens=depth * tokens.block_size,
        groups=[Group(size, blocks * tokens.block_size) for size, blocks in groups],
        hottest=[h / n for h in hottest],
    )


def _walk(nodes: dict[int, list[int]], parent: int, keys: Sequence[int]) -> int:
    """Count every key of one request; how many leading blocks were seen before."""
    seen = 0
    for depth, key in enumerate(keys, 1):
        node = nodes.get(key)
        if node is None:
            nodes[key] = [1, depth, parent]
        else:
            node[0] += 1
            seen = depth if seen == depth - 1 else seen  # a run from the first block
        parent = key
    return seen


def _global_depth(nodes: dict[int, list[int]], n: int) -> tuple[int, list[int]]:
    """The deepest block NEARLY_ALL requests hold (0: none); each depth's largest count."""
    hottest: list[int] = []
    depth = 0
    for count, d, _ in nodes.values():
        if d > len(hottest):
            hottest.extend([0] * (d - len(hottest)))
        hottest[d - 1] = max(hottest[d - 1], count)
        if count >= NEARLY_ALL * n:
            depth = max(depth, d)
    return depth, hottest


def _groups(nodes: dict[int, list[int]], depth: int) -> list[tuple[int, int]]:
    """(requests, shared blocks) of each block one past the global part that two or more
    requests hold; parents come before children in `nodes`, so one pass finds each
    block's group."""
    group_of: dict[int, int] = {}
    deepest: dict[int, int] = {}
    for key, (count, d, parent) in nodes.items():
        if d <= depth:
            continue
        head = key if d == depth + 1 else group_of.get(parent)
        if head is None or nodes[head][0] < 2:
            continue
        group_of[key] = head
        if count >= max(2, NEARLY_ALL * nodes[head][0]):
            deepest[head] = max(deepest.get(head, 0), d)
    return [(nodes[head][0], d) for head, d in deepest.items()]


_BlockKeys = Callable[[Seen], tuple[int, list[int], int]]


def _block_keys(tokens: Tokens) -> _BlockKeys:
    """A function from a request to (chain root, its block keys, its prompt tokens)."""
    if tokens.kind == "chatml4":
        blocks = PromptBlocks(tokens.block_size, tokens.max_tokens // tokens.block_size)

        def chatml4(req: Seen) -> tuple[int, list[int], int]:
            if req.messages is not None:
                keys, count = blocks.chat(req.model, req.salt, req.messages)
            else:
                keys, count = blocks.prompt(req.model, req.salt, req.prompt or "")
            return root_key(req.model, req.salt), keys, count

        return chatml4

    cpt, limit = tokens.chars_per_token, math.ceil(tokens.max_tokens * tokens.chars_per_token)

    def approx(req: Seen) -> tuple[int, list[int], int]:
        root = xxhash.xxh3_64_intdigest(namespace(req.model, req.tenant))
        ids = _ids_of(req.prompt)
        if ids is not None:
            return root, chain(root, ids[: tokens.max_tokens], tokens.block_size), len(ids)
        if req.messages is not None:
            text = chat_text(req.messages, req.tools, limit)
        else:
            text = prompt_text(req.prompt or "", limit)  # type: ignore[arg-type]
        keys = chain(root, _approx_ids(text, cpt), tokens.block_size)
        return root, keys, math.ceil(len(text) / cpt)

    return approx


def _ids_of(prompt: Prompt | None) -> list[int] | None:
    """A completions prompt given as token ids (or a batch of them: the first), else None."""
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], str):
        return None
    first = prompt[0]
    return first if isinstance(first, list) else prompt  # type: ignore[return-value]


def _approx_ids(text: str, chars_per_token: float) -> list[int]:
    """One id per approx token: token k is characters ceil(k c) to ceil((k + 1) c), as
    hashing.tokens.ApproxTokenizer cuts them."""
    count = math.ceil(len(text) / chars_per_token)
    cuts = [math.ceil(k * chars_per_token) for k in range(count + 1)]
    return [xxhash.xxh32_intdigest(text[a:b].encode()) for a, b in itertools.pairwise(cuts)]


# --- concurrency and prefill -----------------------------------------------------------


class Concurrency(msgspec.Struct, kw_only=True):
    """Requests in flight when a request arrived (it included), over the fleet and on
    its own backend; the arrival rate (requests per second)."""

    timed: int
    backends: int
    rate: float | None
    fleet_p50: float
    fleet_p99: float
    fleet_max: int
    backend_p50: float
    backend_p99: float
    backend_max: int


def concurrency(traffic: Traffic, backends: int | None) -> Concurrency | None:
    """From each request's end and duration; None when no request has both. `backends`:
    the fleet's size if known, else the distinct backends the traffic names (at least 1)."""
    spans = [
        (r.end - r.duration, r.end, r.backend)
        for r in traffic.requests
        if r.end is not None and r.duration is not None
    ]
    if not spans:
        return None
    events = sorted(
        itertools.chain(((s, 1, b) for s, _, b in spans), ((e, -1, b) for _, e, b in spans)),
        key=lambda e: (e[0], e[1]),  # one that ends as another starts was not beside it
    )
    fleet, per, fleet_seen, backend_seen = 0, Counter(), [], []
    for _, delta, backend in events:
        fleet += delta
        per[backend] += delta
        if delta > 0:
            fleet_seen.append(fleet)
            backend_seen.append(per[backend])
    starts = [s for s, _, _ in spans]
    span = max(starts) - min(starts)
    named = len({b for _, _, b in spans if b is not None})
    return Concurrency(
        timed=len(spans),
        backends=backends or max(1, named),
        rate=(len(spans) - 1) / span if span > 0 else None,
        fleet_p50=percentile(fleet_seen, 0.5) or 0.0,
        fleet_p99=percentile(fleet_seen, 0.99) or 0.0,
        fleet_max=max(fleet_seen),
        backend_p50=percentile(backend_seen, 0.5) or 0.0,
        backend_p99=percentile(backend_seen, 0.99) or 0.0,
        backend_max=max(backend_seen),
    )


class Prefill(msgspec.Struct, kw_only=True):
    """Prompt tokens a backend prefills per second, from TTFT against uncached tokens."""

    tokens_per_s: float | None
    samples: int
    why: str  # how it was estimated, or why it could not be


def prefill_rate(traffic: Traffic) -> Prefill:
    """The `_PREFILL_QUANTILE` of uncached tokens / TTFT over requests with at least
    `_MIN_UNCACHED` uncached tokens: queueing only lengthens a TTFT, so the fastest
    requests are the ones closest to prefill alone."""
    rates = [
        (r.prompt_tokens - r.cached_tokens) / r.ttft
        for r in traffic.requests
        if r.ttft and r.prompt_tokens is not None and r.cached_tokens is not None
        if r.prompt_tokens - r.cached_tokens >= _MIN_UNCACHED
    ]
    if len(rates) < _MIN_PREFILL_SAMPLES:
        why = (
            f"{len(rates)} requests have a TTFT, usage with cached_tokens and at least "
            f"{_MIN_UNCACHED} uncached prompt tokens; {_MIN_PREFILL_SAMPLES} are needed"
        )
        return Prefill(tokens_per_s=None, samples=len(rates), why=why)
    rate = percentile(rates, _PREFILL_QUANTILE)
    why = (
        f"P{_PREFILL_QUANTILE * 100:.0f} of uncached prompt tokens / TTFT over {len(rates)} "
        f"requests with {_MIN_UNCACHED}+ uncached tokens (median {statistics.median(rates):.0f})"
    )
    return Prefill(tokens_per_s=rate, samples=len(rates), why=why)

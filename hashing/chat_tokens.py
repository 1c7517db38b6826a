"""Exact prompt token ids for KV-aware matching, and their block keys, cached by prefix.

KV events speak in token ids, so KV_AWARE needs the ids the backend itself computes.
`ChatML4` reproduces `kvroute sim`'s tokenizer exactly (it is the simulator's own
definition, shared from here): chat messages rendered through a fixed ChatML template,
then one token per 4 characters, id = xxh32(chars) % 32000, no special tokens. ASCII
text is tokenized by numpy on whole arrays (~2 ns a token).

Without KV events no engine's ids need matching: the keys only have to agree with the
router's own earlier keys, so `text_chain` keys the rendered text itself (a block is
`block_size` runs of 4 characters, as the ids would have it, hashed as UTF-8: one xxh3
per block, no ids, no cache; ~10x less than the ids at 32,768 tokens).

`BlockKeyCache` turns a rendered prompt into the chain of block keys
(`hashing.blocks.chain`) for its full blocks. Keys are cached at checkpoints every
`checkpoint_blocks` blocks, keyed by xxh3 of the text up to there (one streaming pass
gives every checkpoint's id): a request that shares a cached prefix only tokenizes and
hashes the text past the last checkpoint it shares. Checkpoints fall on block boundaries
of a tokenizer whose tokens have a fixed width in characters, which is what makes text
prefixes and token prefixes line up. Cost: O(keyed text) for a new prompt (~0.2 µs a
block, the xxh3 chain), O(checkpoint) past a cached prefix; memory bounded by
`max_entries` (LRU), a prompt's checkpoints sharing one list of keys.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import xxhash

# numpy's OpenBLAS starts a pool of threads at import, before `kvroute serve` holds
# SIGHUP, and a SIGHUP the kernel hands to one of them ends a router still starting.
# The ids need no BLAS: one thread is no pool.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np

from hashing.blocks import chain, chain_packed, root_key
from hashing.canonical import Message, MessagePart
from hashing.hf_chat import HFChat
from hashing.tokens import pack_ids

__all__ = [
    "CHARS_PER_TOKEN",
    "VOCAB_SIZE",
    "BlockKeyCache",
    "ChatML4",
    "PromptBlocks",
    "make_prompt_blocks",
    "render_chat",
    "text_chain",
    "tokenize",
]

VOCAB_SIZE = 32000
CHARS_PER_TOKEN = 4


#: xxh32's primes (its specification), for `_xxh32_words`
_P1, _P2, _P3, _P4, _P5 = map(
    np.uint32, (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)
)


def _xxh32_words(words: np.ndarray) -> np.ndarray:
    """xxh32 (seed 0) of each 4-byte input, given as its little-endian uint32: the
    specification's path for a 4-byte input (one lane of 4 bytes, then the avalanche),
    on whole arrays."""
    h = words * _P3
    h += _P5 + np.uint32(CHARS_PER_TOKEN)
    h = (h << np.uint32(17)) | (h >> np.uint32(15))
    h *= _P4
    h ^= h >> np.uint32(15)
    h *= _P2
    h ^= h >> np.uint32(13)
    h *= _P3
    h ^= h >> np.uint32(16)
    return h


def packed_ids(text: str) -> bytes:
    """`tokenize(text)` as little-endian uint32s (`hashing.tokens.pack_ids`'s layout).

    ASCII text (a character is a byte) is hashed 4 bytes at a time by numpy, whole
    arrays at C speed (~2 ns a token, against ~80 ns a token in Python); other text
    one run at a time.
    """
    if not text.isascii():
        return pack_ids(_runs(text))
    raw = text.encode()
    full = len(raw) // CHARS_PER_TOKEN
    ids = _xxh32_words(np.frombuffer(raw, "<u4", full))
    ids %= np.uint32(VOCAB_SIZE)
    out = ids.astype("<u4", copy=False).tobytes()
    if full * CHARS_PER_TOKEN < len(raw):
        out += pack_ids(_runs(text[full * CHARS_PER_TOKEN :]))
    return out


def _runs(text: str) -> list[int]:
    h = xxhash.xxh32_intdigest
    return [
        h(text[i : i + CHARS_PER_TOKEN].encode()) % VOCAB_SIZE
        for i in range(0, len(text), CHARS_PER_TOKEN)
    ]


def text_chain(parent: int, text: str, block_size: int) -> list[int]:
    """Keys of every full block of `text` (`block_size` runs of CHARS_PER_TOKEN
    characters), each block's characters hashed as UTF-8 and chained as `chain`'s ids:
    a text's keys are the same whatever follows it, ASCII or not."""
    if text.isascii():  # a character is a byte: a run's 4 bytes stand where an id would
        return chain_packed(parent, text.encode(), block_size)
    step = block_size * CHARS_PER_TOKEN
    digest = xxhash.xxh3_64_intdigest
    keys: list[int] = []
    for start in range(0, len(text) - step + 1, step):
        parent = digest(text[start : start + step].encode(), parent)
        keys.append(parent)
    return keys


def tokenize(text: str) -> list[int]:
    """One id per 4-character run of `text` (the last run may be shorter)."""
    return np.frombuffer(packed_ids(text), "<u4").tolist()


def render_chat(
    messages: Iterable[tuple[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render (role, content text) pairs through the fixed ChatML template."""
    return "".join(_pieces(messages, add_generation_prompt, continue_final_message))


def _pieces(
    messages: Iterable[tuple[str, str]], add_generation_prompt: bool, continue_final_message: bool
) -> list[str]:
    """The rendering's pieces, the contents among them uncopied."""
    out: list[str] = []
    for role, content in messages:
        out += ("<|im_start|>", role, "\n", content, "<|im_end|>\n")
    if continue_final_message and out:
        out.pop()
    elif add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return out


def _head(pieces: list[str], limit: int) -> tuple[str, int]:
    """The first `limit` characters of the pieces joined, and the whole join's length:
    a long prompt is copied only as far as it is keyed."""
    total = sum(map(len, pieces))
    if total <= limit:
        return "".join(pieces), total
    taken: list[str] = []
    for piece in pieces:
        if len(piece) >= limit:
            taken.append(piece[:limit])
            break
        taken.append(piece)
        limit -= len(piece)
    return "".join(taken), total


def text_of(content: str | Sequence[MessagePart] | None) -> str:
    """Content as the template sees it: text parts concatenated, other parts dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content if part.type == "text")


class ChatML4:
    """The simulator's tokenizer as a prompt renderer for router-side matching."""

    chars_per_token = CHARS_PER_TOKEN

    def chat_text(self, messages: Sequence[Message]) -> str:
        return render_chat((m.role, text_of(m.content)) for m in messages)

    def chat_head(self, messages: Sequence[Message], limit: int) -> tuple[str, int]:
        """The rendering's first `limit` characters, and the whole rendering's length."""
        return _head(_pieces(((m.role, text_of(m.content)) for m in messages), True, False), limit)

    def tokenize(self, text: str) -> list[int]:
        return tokenize(text)


class BlockKeyCache:
    def __init__(
        self,
        tokenizer: ChatML4,
        block_size: int,
        checkpoint_blocks: int = 16,
        max_entries: int = 4096,
    ) -> None:
        self._tokenizer = tokenizer
        self._block_size = block_size
        self._step = checkpoint_blocks * block_size * tokenizer.chars_per_token
        self._max = max_entries
        #: a checkpoint's prefix id -> (the keys of a prompt through it, how many of them
        #: it covers): a prompt's checkpoints share one list
        self._cache: OrderedDict[int, tuple[list[int], int]] = OrderedDict()

    def keys(self, root: int, text: str, max_blocks: int) -> tuple[list[int], int]:
        """(keys of the first full blocks of `text`, up to max_blocks; its token count)."""
        cpt = self._tokenizer.chars_per_token
        tokens = -(-len(text) // cpt)
        end = min(len(text), max_blocks * self._block_size * cpt)
        prefixes = _prefix_ids(root, text, end, self._step)
        done, keys = self._longest_cached(prefixes)
        start = done * self._step
        parent = keys[-1] if keys else root
        keys = keys + chain_packed(parent, packed_ids(text[start:end]), self._block_size)
        self._remember(prefixes, done, keys)
        return keys, tokens

    def _longest_cached(self, prefixes: list[int]) -> tuple[int, list[int]]:
        """(checkpoints the longest cached prefix spans, its keys)."""
        for done in range(len(prefixes), 0, -1):
            found = self._cache.get(prefixes[done - 1])
            if found is not None:
                self._cache.move_to_end(prefixes[done - 1])
                keys, count = found
                return done, keys[:count]
        return 0, []

    def _remember(self, prefixes: list[int], done: int, keys: list[int]) -> None:
        per = self._step // (self._block_size * self._tokenizer.chars_per_token)
        for at in range(done, len(prefixes)):
            self._cache[prefixes[at]] = (keys, (at + 1) * per)
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)


def _prefix_ids(root: int, text: str, end: int, step: int) -> list[int]:
    """xxh3 (seeded with `root`) of `text` up to each multiple of `step` characters up
    to `end`, in one streaming pass."""
    state = xxhash.xxh3_64(seed=root)
    out: list[int] = []
    data = memoryview(text[:end].encode()) if text.isascii() else None
    for stop in range(step, end + 1, step):
        state.update(
            text[stop - step : stop].encode() if data is None else data[stop - step : stop]
        )
        out.append(state.intdigest())
    return out


class PromptBlocks:
    """A request's block keys and token count, as the KV-aware policy reads them.

    The root mixes the model (or LoRA name) and `cache_salt`, the isolation vLLM applies.
    Only the first `max_blocks` blocks are keyed: matching never needs more than the
    longest prefix worth routing on, and a chat is rendered only that far. With `ChatML4`
    keys are cached at text checkpoints, or with `text_keys` (no ids needed) chained from
    the text itself. With an `HFChat` tokenizer its own history cache saves the encoding
    and the keys are chained from the ids.
    """

    def __init__(
        self,
        block_size: int,
        max_blocks: int,
        tokenizer: ChatML4 | HFChat | None = None,
        remote: bool = False,
        text_keys: bool = False,
    ) -> None:
        #: the router asks a backend's /tokenize for the ids; the local tokenizer is the
        #: fallback when that fails
        self.remote = remote
        #: tokenizing can take milliseconds (HF): the router runs `local_ids` off its loop
        self.offload = isinstance(tokenizer, HFChat)
        self._tokenizer = tokenizer or ChatML4()
        self._cache = None if text_keys else BlockKeyCache(ChatML4(), block_size)
        self._block_size = block_size
        self._max_blocks = max_blocks
        self._max_chars = max_blocks * block_size * CHARS_PER_TOKEN

    def chat(
        self, model: str, salt: str | None, messages: Sequence[Message], tools: object = None
    ) -> tuple[list[int], int]:
        root = root_key(model, salt)
        tok = self._tokenizer
        if isinstance(tok, ChatML4):
            head, chars = tok.chat_head(messages, self._max_chars)
            return self._of_text(root, head, chars)
        return self._of_ids(root, tok.chat_ids(messages, tools or None))

    def local_ids(
        self, messages: Sequence[Message] | None, tools: object, prompt: object
    ) -> list[int] | None:
        """The HF tokenizer's ids for a chat (`messages`) or a text prompt; None otherwise."""
        tok = self._tokenizer
        if not isinstance(tok, HFChat):
            return None
        if messages is not None:
            return tok.chat_ids(messages, tools or None)
        return tok.prompt_ids(prompt) if isinstance(prompt, str) else None

    def of_ids(self, model: str, salt: str | None, ids: Sequence[int]) -> tuple[list[int], int]:
        """Keys of a prompt whose exact token ids are known (e.g. from a backend)."""
        return self._of_ids(root_key(model, salt), ids)

    def prompt(
        self, model: str, salt: str | None, prompt: str | Sequence[str | int | Sequence[int]]
    ) -> tuple[list[int], int]:
        root = root_key(model, salt)
        first = prompt if isinstance(prompt, str) else (prompt[0] if prompt else "")
        if isinstance(first, str):
            tok = self._tokenizer
            if isinstance(tok, ChatML4):
                return self._of_text(root, first[: self._max_chars], len(first))
            return self._of_ids(root, tok.prompt_ids(first))
        return self._of_ids(root, prompt if isinstance(first, int) else first)

    def _of_text(self, root: int, head: str, chars: int) -> tuple[list[int], int]:
        """Keys of a text prompt's `head` (its keyed part) and the count of its `chars`."""
        tokens = -(-chars // CHARS_PER_TOKEN)
        if self._cache is None:
            return text_chain(root, head, self._block_size)[: self._max_blocks], tokens
        return self._cache.keys(root, head, self._max_blocks)[0], tokens

    def _of_ids(self, root: int, ids: Sequence[int]) -> tuple[list[int], int]:
        head = ids[: self._max_blocks * self._block_size]
        return chain(root, head, self._block_size), len(ids)


def make_prompt_blocks(
    block_size: int,
    max_blocks: int,
    kind: str,
    path: str | None,
) -> PromptBlocks:
    """From config: kind "chatml4" (`kvroute sim`'s tokenizer), "hf" (a tokenizer dir),
    "backend" (each backend's /tokenize, ChatML4 when it fails) or "text" (no ids: keys
    of the text itself, 4 characters a token)."""
    tokenizer = HFChat(path) if kind == "hf" and path else ChatML4()
    remote = kind == "backend"
    return PromptBlocks(block_size, max_blocks, tokenizer, remote, kind == "text")

"""Exact prompt token ids for KV-aware matching, and their block keys, cached by prefix.

KV events speak in token ids, so KV_AWARE needs the ids the backend itself computes.
`ChatML4` reproduces `kvroute sim`'s tokenizer exactly (it is the simulator's own
definition, shared from here): chat messages rendered through a fixed ChatML template,
then one token per 4 characters, id = xxh32(chars) % 32000, no special tokens.

`BlockKeyCache` turns a rendered prompt into the chain of block keys
(`hashing.blocks.chain`) for its full blocks. Tokenizing a long prompt in Python costs
~0.3 µs per token, so keys are cached at checkpoints every `checkpoint_blocks` blocks,
keyed by xxh3 of the text up to there: a request that shares a cached prefix only
tokenizes and hashes the text past the last checkpoint it shares. Checkpoints fall on
block boundaries of a tokenizer whose tokens have a fixed width in characters, which is
what makes text prefixes and token prefixes line up. Cost: O(checkpoint) tokens plus one
xxh3 over the prefix per probe; memory bounded by `max_entries` (LRU).
"""

from __future__ import annotations

import array
import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import xxhash

from hashing.blocks import chain, root_key
from hashing.canonical import Message, MessagePart
from hashing.hf_chat import HFChat

__all__ = [
    "CHARS_PER_TOKEN",
    "VOCAB_SIZE",
    "BlockKeyCache",
    "ChatML4",
    "PromptBlocks",
    "make_prompt_blocks",
    "render_chat",
    "tokenize",
]

VOCAB_SIZE = 32000
CHARS_PER_TOKEN = 4


class _ChunkIds(dict):
    """Ids of 4-byte chunks, read as native uint32s, computed on first sight.

    Prompts reuse a small set of chunks (words, spaces, template markers), so after
    warm-up a token costs one C-level dict lookup instead of a slice and a hash. Bounded:
    cleared when it reaches `_MAX_CHUNKS` entries (32 MiB at most).
    """

    def __missing__(self, word: int) -> int:
        if len(self) >= _MAX_CHUNKS:
            self.clear()
        token = self[word] = xxhash.xxh32_intdigest(word.to_bytes(4, sys.byteorder)) % VOCAB_SIZE
        return token


_MAX_CHUNKS = 1 << 18
assert array.array("I").itemsize == 4, "a 4-character run is read as one uint32"
_CHUNK_IDS = _ChunkIds()


def tokenize(text: str) -> list[int]:
    """One id per 4-character run of `text` (the last run may be shorter).

    ASCII text (a character is a byte) is read as uint32 words at C speed and mapped
    through `_CHUNK_IDS`: the same ids as hashing each run, ~3x faster on long prompts
    (~80 ns a token), which matters because KV_AWARE tokenizes on the event loop.
    """
    h = xxhash.xxh32_intdigest
    if text.isascii():
        raw = text.encode()
        full = len(raw) - len(raw) % CHARS_PER_TOKEN
        out = list(map(_CHUNK_IDS.__getitem__, array.array("I", raw[:full])))
        if full < len(raw):
            out.append(h(raw[full:]) % VOCAB_SIZE)
        return out
    return [
        h(text[i : i + CHARS_PER_TOKEN].encode()) % VOCAB_SIZE
        for i in range(0, len(text), CHARS_PER_TOKEN)
    ]


def render_chat(
    messages: Iterable[tuple[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render (role, content text) pairs through the fixed ChatML template."""
    rendered = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages]
    if continue_final_message and rendered:
        rendered[-1] = rendered[-1].removesuffix("<|im_end|>\n")
    elif add_generation_prompt:
        rendered.append("<|im_start|>assistant\n")
    return "".join(rendered)


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
        self._cache: OrderedDict[int, list[int]] = OrderedDict()

    def keys(self, root: int, text: str, max_blocks: int) -> tuple[list[int], int]:
        """(keys of the first full blocks of `text`, up to max_blocks; its token count)."""
        cpt = self._tokenizer.chars_per_token
        tokens = -(-len(text) // cpt)
        end = min(len(text), max_blocks * self._block_size * cpt)
        start, keys = self._longest_cached(root, text, end)
        parent = keys[-1] if keys else root
        tail = self._tokenizer.tokenize(text[start:end])
        keys = keys + chain(parent, tail, self._block_size)
        self._remember(root, text, start, end, keys)
        return keys, tokens

    def _longest_cached(self, root: int, text: str, end: int) -> tuple[int, list[int]]:
        for stop in range(end - end % self._step, 0, -self._step):
            prefix = _prefix_id(root, text, stop)
            found = self._cache.get(prefix)
            if found is not None:
                self._cache.move_to_end(prefix)
                return stop, found
        return 0, []

    def _remember(self, root: int, text: str, start: int, end: int, keys: list[int]) -> None:
        first = start + self._step
        for stop in range(first - first % self._step, end + 1, self._step):
            blocks = stop // (self._block_size * self._tokenizer.chars_per_token)
            self._cache[_prefix_id(root, text, stop)] = keys[:blocks]
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)


def _prefix_id(root: int, text: str, stop: int) -> int:
    return xxhash.xxh3_64_intdigest(text[:stop].encode(), seed=root)


class PromptBlocks:
    """A request's block keys and token count, as the KV-aware policy reads them.

    The root mixes the model (or LoRA name) and `cache_salt`, the isolation vLLM applies.
    Only the first `max_blocks` blocks are keyed: matching never needs more than the
    longest prefix worth routing on. With `ChatML4` keys are cached at text checkpoints;
    with an `HFChat` tokenizer its own history cache saves the encoding and the keys are
    chained from the ids.
    """

    def __init__(
        self,
        block_size: int,
        max_blocks: int,
        tokenizer: ChatML4 | HFChat | None = None,
        remote: bool = False,
    ) -> None:
        #: the router asks a backend's /tokenize for the ids; the local tokenizer is the
        #: fallback when that fails
        self.remote = remote
        #: tokenizing can take milliseconds (HF): the router runs `local_ids` off its loop
        self.offload = isinstance(tokenizer, HFChat)
        self._tokenizer = tokenizer or ChatML4()
        self._cache = BlockKeyCache(ChatML4(), block_size)
        self._block_size = block_size
        self._max_blocks = max_blocks

    def chat(
        self, model: str, salt: str | None, messages: Sequence[Message], tools: object = None
    ) -> tuple[list[int], int]:
        root = root_key(model, salt)
        tok = self._tokenizer
        if isinstance(tok, ChatML4):
            return self._cache.keys(root, tok.chat_text(messages), self._max_blocks)
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
                return self._cache.keys(root, first, self._max_blocks)
            return self._of_ids(root, tok.prompt_ids(first))
        return self._of_ids(root, prompt if isinstance(first, int) else first)

    def _of_ids(self, root: int, ids: Sequence[int]) -> tuple[list[int], int]:
        head = ids[: self._max_blocks * self._block_size]
        return chain(root, head, self._block_size), len(ids)


def make_prompt_blocks(
    block_size: int, max_blocks: int, kind: str, path: str | None
) -> PromptBlocks:
    """From config: kind "chatml4" (`kvroute sim`'s tokenizer), "hf" (a tokenizer dir) or
    "backend" (each backend's /tokenize, ChatML4 when it fails)."""
    tokenizer = HFChat(path) if kind == "hf" and path else ChatML4()
    return PromptBlocks(block_size, max_blocks, tokenizer, remote=kind == "backend")

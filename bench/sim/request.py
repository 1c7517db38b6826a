"""One request inside a simulated engine: its tokens, block hashes and progress.

Invariants: `token_ids` is the prompt followed by every output token so far;
`block_hashes[i]` is the chain hash of full block i of `token_ids` (prompt and output
alike, as vLLM hashes decode output too); `blocks` are the physical KV blocks it holds,
of which the first `num_cached_blocks` went through the prefix-cache commit.
A P/D transfer marks a request: `remote_decode` prefills for a remote decode (its prompt
blocks are reported in `remote_block_ids` when it finishes), `remote_prefill` decodes from
a remote prefill (its prompt, bar the last token, is read at first admission).
Output tokens are a fixed filler cycle, 4 characters each, so `tokenize(output_text(n))`
gives back exactly n tokens.
"""

import enum
import struct
from collections.abc import Callable, Sequence
from typing import Literal

import xxhash

from bench.sim.tokenizer import CHARS_PER_TOKEN, token_strs, tokenize

_FILLER = "The quick brown fox jumps over the lazy dog; a simulated vLLM answer. "
_FILLER_STRS = token_strs(_FILLER * CHARS_PER_TOKEN)  # a whole number of 4-char runs
_FILLER_IDS = tokenize(_FILLER * CHARS_PER_TOKEN)

FinishReason = Literal["stop", "length", "abort"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def output_token_id(index: int) -> int:
    """Id of output token `index` (0-based) of any request."""
    return _FILLER_IDS[index % len(_FILLER_IDS)]


def output_text(start: int, end: int) -> str:
    """Text of output tokens [start, end)."""
    return "".join(_FILLER_STRS[i % len(_FILLER_STRS)] for i in range(start, end))


def root_hash(name: str) -> int:
    """Chain root for a served model or LoRA name: different names never share blocks."""
    return xxhash.xxh3_64_intdigest(name.encode())


def block_hashes(
    parent: int, tokens: Sequence[int], block_size: int, salt: str | None
) -> list[int]:
    """Chain hashes of the full blocks of `tokens`, continuing from `parent`.

    Block hash = xxh3_64(parent as uint64 LE + token ids as uint32 LE + extra), where
    extra is the UTF-8 salt for the chain's block 0 (`salt`, given only then) and empty
    otherwise.
    """
    raw = struct.pack(f"<{len(tokens)}I", *tokens)
    step = block_size * 4
    hashes = []
    for i in range(len(tokens) // block_size):
        extra = salt.encode() if i == 0 and salt else b""
        payload = parent.to_bytes(8, "little") + raw[i * step : (i + 1) * step] + extra
        parent = xxhash.xxh3_64_intdigest(payload)
        hashes.append(parent)
    return hashes


class SimRequest:
    """Mutable per-request state shared by the scheduler, the KV cache and the HTTP side."""

    __slots__ = (
        "arrival",
        "block_hashes",
        "block_size",
        "blocks",
        "dropped",
        "finish_reason",
        "first_token_at",
        "last_token_at",
        "limit_reason",
        "lora_id",
        "lora_name",
        "max_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_loaded_tokens",
        "num_preemptions",
        "num_transferred_tokens",
        "on_update",
        "prompt_len",
        "remote_block_ids",
        "remote_decode",
        "remote_prefill",
        "request_id",
        "root",
        "salt",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int,
        limit_reason: FinishReason,
        block_size: int,
        model: str,
        lora_id: int | None = None,
        salt: str | None = None,
        arrival: float = 0.0,
        remote_decode: bool = False,
        remote_prefill: bool = False,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.limit_reason: FinishReason = limit_reason  # "stop" mimics EOS at the limit
        self.block_size = block_size
        self.root = root_hash(model)
        self.lora_name = model if lora_id is not None else None
        self.lora_id = lora_id
        self.salt = salt
        self.arrival = arrival
        self.block_hashes: list[int] = []
        self.blocks: list[int] = []
        self.num_cached_blocks = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set at first admission, like vLLM
        self.num_loaded_tokens = 0  # of those, loaded from the CPU tier
        self.num_transferred_tokens = 0  # of those, read from a remote prefill instance
        self.remote_decode = remote_decode
        self.remote_prefill = remote_prefill
        self.remote_block_ids: list[int] = []
        self.num_preemptions = 0
        self.status = Status.WAITING
        self.finish_reason: FinishReason | None = None
        self.first_token_at: float | None = None
        self.last_token_at = arrival
        self.dropped = False  # the server "died" (restart/stop): cut the connection
        self.on_update: Callable[[], None] = _noop
        self._extend_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_output_token(self) -> None:
        self.token_ids.append(output_token_id(self.num_output))
        self._extend_hashes()

    def extra_key(self, block_index: int) -> tuple[str, ...] | None:
        """vLLM's untagged per-block extra keys: LoRA name on every block, salt on block 0."""
        keys = tuple(k for k in (self.lora_name, self.salt if block_index == 0 else None) if k)
        return keys or None

    def _extend_hashes(self) -> None:
        done, bs = len(self.block_hashes), self.block_size
        if self.num_tokens // bs == done:
            return
        parent = self.block_hashes[-1] if done else self.root
        salt = None if done else self.salt
        self.block_hashes += block_hashes(parent, self.token_ids[done * bs :], bs, salt)


def _noop() -> None:
    return None

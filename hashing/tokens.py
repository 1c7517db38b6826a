"""Tokenization adapters: the bytes that stand for the leading n tokens of a routing text.

A ``Tokenization`` answers two questions: ``chars_for(n)``, how many leading characters of a
text are enough to produce n tokens (the ``limit`` passed to ``hashing.canonical``), and
``leading(text, n)``, the key bytes of the first n tokens (or of the whole text if it is
shorter) with the number of tokens they cover.

- ``ApproxTokenizer``: n tokens are the first ceil(n * chars_per_token) characters; the key is
  their UTF-8. No model needed. Cost: one slice and one encode, O(n) with a tiny constant.
- ``HFTokenizer``: a HuggingFace ``tokenizer.json`` (``tokenizers`` is imported lazily, when
  one is built). Only a leading window of the text is tokenized, starting at 6 characters
  per wanted token and doubling while the text is longer and too few ids came back. The key
  is the first n ids packed as little-endian uint32, the layout ``ids_leading`` uses for
  prompts given as ids, so the same ids give the same key however they arrived.
  Cost: O(window) in Rust, usually one pass over about 6n characters.

Invariants. A key depends only on the first ``chars_for(n)`` characters of the text (or on
the first n ids), so requests that share that prefix share the key, on every process and
machine: nothing here depends on ``hash()`` or on the platform's byte order.
Cutting a window can change the tokens of the word the cut falls in, so the window keeps
``_CUT_SLACK`` tokens beyond the n used; a word longer than that many tokens at the cut may
still give a key that differs from tokenizing the whole text, but the same one every time.
"""

import math
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "ApproxTokenizer",
    "HFTokenizer",
    "Tokenization",
    "ids_leading",
    "make_tokenization",
    "pack_ids",
]

_HF_FIRST_WINDOW_CHARS_PER_TOKEN = 6
# Text the canonical builder must hand over for n tokens: well above the ~4 chars per token of
# prose and code; a text with longer tokens (long runs of one character) is keyed on fewer.
_HF_MAX_CHARS_PER_TOKEN = 16
_CUT_SLACK = 8


class Tokenization(Protocol):
    """What the fingerprinter needs from a tokenizer."""

    def leading(self, text: str, n: int) -> tuple[bytes, int]:
        """(key bytes of the first n tokens or of the whole text, tokens the key covers)."""
        ...

    def chars_for(self, n: int) -> int:
        """How many leading characters of a text are enough to produce n tokens."""
        ...


class ApproxTokenizer:
    """A token is ``chars_per_token`` characters: no model, a slice and an encode."""

    __slots__ = ("_chars_per_token",)

    def __init__(self, chars_per_token: float = 4.0) -> None:
        if not chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {chars_per_token!r}")
        self._chars_per_token = chars_per_token

    def leading(self, text: str, n: int) -> tuple[bytes, int]:
        head = text[: self.chars_for(n)]
        return head.encode(), min(n, math.ceil(len(head) / self._chars_per_token))

    def chars_for(self, n: int) -> int:
        return math.ceil(n * self._chars_per_token)


class HFTokenizer:
    """A HuggingFace ``tokenizer.json`` (a file, or a directory holding one)."""

    __slots__ = ("_tokenizer",)

    def __init__(self, path: str) -> None:
        self._tokenizer = _load(path)

    def leading(self, text: str, n: int) -> tuple[bytes, int]:
        ids = self._window_ids(text, n)[:n]
        return pack_ids(ids), len(ids)

    def chars_for(self, n: int) -> int:
        return n * _HF_MAX_CHARS_PER_TOKEN

    def _window_ids(self, text: str, n: int) -> list[int]:
        window = max(1, n * _HF_FIRST_WINDOW_CHARS_PER_TOKEN)
        while True:
            ids = self._tokenizer.encode(text[:window], add_special_tokens=False).ids
            if window >= len(text) or len(ids) >= n + _CUT_SLACK:
                return ids
            window *= 2


def ids_leading(ids: Sequence[int], n: int) -> tuple[bytes, int]:
    """The key of the first n token ids of a prompt given as ids, and how many it covers."""
    head = ids[:n]
    return pack_ids(head), len(head)


def make_tokenization(kind: str, chars_per_token: float, path: str | None) -> Tokenization:
    """Build the tokenization named by config: "approx", or "hf" with a tokenizer path."""
    if kind == "approx":
        return ApproxTokenizer(chars_per_token)
    if kind == "hf":
        if path is None:
            raise ValueError('tokenization "hf" needs a tokenizer path')
        return HFTokenizer(path)
    raise ValueError(f'unknown tokenization {kind!r}: expected "approx" or "hf"')


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (the layout every key here is built on)."""
    try:
        return struct.pack(f"<{len(ids)}I", *ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc


def _load(path: str) -> "Tokenizer":
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"no tokenizer.json at {path!r}")
    from tokenizers import Tokenizer  # lazy: optional dependency, slow to import

    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise ValueError(f"invalid tokenizer file {str(file)!r}: {exc}") from exc

"""Prefix fingerprints: one 64-bit number per request, equal for requests that share a prefix.

Algorithm. fingerprint = xxh3_64(namespace(model, tenant) + key), where key is the
``Tokenization`` key of the first ``prefix_length`` tokens of the routing text from
``hashing.canonical`` (or of the first ``prefix_length`` ids when the prompt is given as
ids). The canonical text is built with ``limit = chars_for(prefix_length)``, so only the
leading text the key needs is ever built, escaped, encoded and tokenized. A request shorter
than ``prefix_length`` tokens is keyed on its whole prompt.

Invariants.
- Deterministic across processes and machines: xxh3_64 with its default seed over bytes that
  depend only on the request (no ``hash()``, no byte-order dependence).
- Isolation: ``namespace`` is prefix-free (length-prefixed model, then a tag byte and a
  length-prefixed tenant), so ns1 + key1 == ns2 + key2 implies ns1 == ns2 and key1 == key2:
  two models or two tenants share a fingerprint only by a 64-bit hash collision.
- A change past the first ``prefix_length`` tokens never changes the fingerprint.

Cost. O(prefix_length): bounded by the leading text, never by the whole prompt. The
namespace of the few (model, tenant) pairs in use is memoized.
"""

import functools
import struct
from collections.abc import Sequence

import msgspec
import xxhash

from hashing.canonical import Message, chat_text, prompt_text
from hashing.tokens import Tokenization, ids_leading

__all__ = ["Fingerprinter", "Prompt", "fingerprint", "namespace"]

_NO_TENANT = b"\x00"
_TENANT = b"\x01"
_NAMESPACE_CACHE_SIZE = 4096

Prompt = str | list[str] | list[int] | list[list[int]]


@functools.lru_cache(maxsize=_NAMESPACE_CACHE_SIZE)
def namespace(model: str, tenant: str | None) -> bytes:
    """Bytes mixed in front of every key so that models and tenants never share prefixes."""
    if tenant is None:
        return _framed(model) + _NO_TENANT
    return _framed(model) + _TENANT + _framed(tenant)


def fingerprint(ns: bytes, key: bytes) -> int:
    """xxh3_64 of ns + key as an unsigned 64-bit int."""
    return xxhash.xxh3_64_intdigest(ns + key)


class Fingerprinter:
    """Fingerprints of the first ``prefix_length`` tokens of chat and completions requests."""

    __slots__ = ("_limit", "_prefix_length", "_tokenization")

    def __init__(self, tokenization: Tokenization, prefix_length: int) -> None:
        if prefix_length < 1:
            raise ValueError(f"prefix_length must be >= 1, got {prefix_length}")
        self._tokenization = tokenization
        self._prefix_length = prefix_length
        self._limit = tokenization.chars_for(prefix_length)

    def chat(
        self,
        model: str,
        tenant: str | None,
        messages: Sequence[Message],
        tools: msgspec.Raw | None,
    ) -> int:
        """The fingerprint of a chat request (tools, then every message, in order)."""
        text = chat_text(messages, tools, self._limit)
        return self._of_text(namespace(model, tenant), text)

    def prompt(self, model: str, tenant: str | None, prompt: Prompt) -> int:
        """The fingerprint of a completions prompt: text, texts, ids, or a batch of ids.

        A batch of id lists is keyed on its first element; a list of texts on their joined
        text (see ``hashing.canonical.prompt_text``). Raises ValueError on a malformed prompt:
        a list mixing texts and ids, or ids outside [0, 2**32).
        """
        ns = namespace(model, tenant)
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], str):
            return self._of_text(ns, prompt_text(prompt, self._limit))  # type: ignore[arg-type]
        first = prompt[0]
        ids = first if isinstance(first, list) else prompt
        key, _ = ids_leading(ids, self._prefix_length)  # type: ignore[arg-type]
        return fingerprint(ns, key)

    def _of_text(self, ns: bytes, text: str) -> int:
        key, _ = self._tokenization.leading(text, self._prefix_length)
        return fingerprint(ns, key)


def _framed(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<I", len(data)) + data

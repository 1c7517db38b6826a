"""hashing.fingerprint: isolated namespaces, stable values, only the leading tokens count."""

import struct

import msgspec
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from hashing.canonical import Message, MessagePart
from hashing.fingerprint import Fingerprinter, fingerprint, namespace
from hashing.tokens import ApproxTokenizer, HFTokenizer

SYSTEM = Message("system", "You are a careful assistant. " * 400)  # ~11,600 chars
HISTORY = [SYSTEM, Message("user", "What is a KV cache?"), Message("assistant", "A cache.")]
TOOLS = msgspec.Raw(b'[{"type": "function", "function": {"name": "search"}}]')


def approx(prefix_length: int) -> Fingerprinter:
    return Fingerprinter(ApproxTokenizer(4.0), prefix_length)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(("llama", None), ("llama", ""), id="no-tenant-vs-empty-tenant"),
        pytest.param(("ab", "c"), ("a", "bc"), id="model-tenant-boundary"),
        pytest.param(("a", "b"), ("b", "a"), id="swapped"),
        pytest.param(("llama", "acme"), ("llama", "globex"), id="tenants"),
        pytest.param(("llama", None), ("mistral", None), id="models"),
        pytest.param(("", None), ("\x00", None), id="model-bytes-vs-tag"),
    ],
)
def test_namespaces_differ(a, b):
    assert namespace(*a) != namespace(*b)


def test_no_namespace_is_a_prefix_of_another():
    # Prefix-free: ns1 + key1 == ns2 + key2 then forces ns1 == ns2 and key1 == key2.
    pairs = [
        ("m", None),
        ("m", ""),
        ("m", "t"),
        ("m", "t\x00"),
        ("mt", None),
        ("m\x00", None),
        ("", None),
    ]
    spaces = [namespace(model, tenant) for model, tenant in pairs]
    for i, a in enumerate(spaces):
        for j, b in enumerate(spaces):
            assert i == j or not b.startswith(a), (pairs[i], pairs[j])


@pytest.mark.parametrize(
    ("ns", "key", "expected"),
    [
        pytest.param(b"", b"", 0x2D06800538D394C2, id="xxh3-64-of-empty-input"),
        pytest.param(namespace("llama", None), b"hello", 3501590182826420728, id="model"),
        pytest.param(namespace("llama", "acme"), b"hello", 9363840436285939396, id="tenant"),
    ],
)
def test_golden_values(ns, key, expected):
    # Pinned: a change here re-routes every prefix and splits mixed-version replicas.
    assert fingerprint(ns, key) == expected


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        pytest.param(("m", None, HISTORY), ("m", None, HISTORY), True, id="deterministic"),
        pytest.param(("m", None, HISTORY), ("n", None, HISTORY), False, id="model-isolation"),
        pytest.param(("m", "t1", HISTORY), ("m", "t2", HISTORY), False, id="tenant-isolation"),
        pytest.param(("m", None, HISTORY), ("m", "", HISTORY), False, id="tenant-vs-none"),
        pytest.param(
            ("m", None, HISTORY),
            ("m", None, [SYSTEM, Message("user", "Something else entirely")]),
            True,
            id="change-past-prefix-length",
        ),
        pytest.param(
            ("m", None, HISTORY),
            ("m", None, [Message("system", "Different"), *HISTORY[1:]]),
            False,
            id="change-inside-prefix-length",
        ),
        pytest.param(
            ("m", None, HISTORY),
            ("m", None, [Message("user", SYSTEM.content), *HISTORY[1:]]),
            False,
            id="role-matters",
        ),
    ],
)
def test_chat_fingerprints(a, b, same):
    fingerprinter = approx(256)
    fa = fingerprinter.chat(a[0], a[1], a[2], None)
    fb = fingerprinter.chat(b[0], b[1], b[2], None)
    assert (fa == fb) is same


@pytest.mark.parametrize(
    ("prefix_length", "same"),
    [
        pytest.param(64, True, id="last-message-past-prefix-length"),
        pytest.param(4096, False, id="short-request-uses-every-message"),
    ],
)
def test_last_message_counts_only_within_prefix_length(prefix_length, same):
    fingerprinter = approx(prefix_length)
    changed = [*HISTORY[:-1], Message("assistant", "A different answer.")]
    before = fingerprinter.chat("m", None, HISTORY, TOOLS)
    assert (before == fingerprinter.chat("m", None, changed, TOOLS)) is same


def test_tools_come_first_and_matter():
    fingerprinter = approx(16)
    with_tools = fingerprinter.chat("m", None, HISTORY, TOOLS)
    assert with_tools != fingerprinter.chat("m", None, HISTORY, None)


def test_multimodal_content_matters():
    fingerprinter = approx(64)

    def with_image(url: bytes) -> int:
        parts = [MessagePart(text="look"), MessagePart("image_url", image_url=msgspec.Raw(url))]
        return fingerprinter.chat("m", None, [Message("user", parts)], None)

    assert with_image(b'{"url": "a.png"}') != with_image(b'{"url": "b.png"}')


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        pytest.param("x" * 5000, "x" * 5000 + "tail", True, id="text-past-prefix-length"),
        pytest.param("hello", "hello!", False, id="short-text-is-whole"),
        pytest.param("abc", ["abc"], True, id="one-text-list-is-the-text"),
        pytest.param(["abc", "d"], ["abc", "e"], False, id="short-text-list-is-whole"),
        pytest.param(list(range(300)), [*range(256), 7, 7], True, id="ids-past-prefix-length"),
        pytest.param([1, 2, 3], [1, 2, 4], False, id="short-ids-are-whole"),
        pytest.param([[1, 2, 3], [9]], [1, 2, 3], True, id="batch-uses-first-element"),
        pytest.param([[1, 2, 3], [9]], [[1, 2, 3], [8]], True, id="batch-ignores-the-rest"),
        pytest.param("", [], True, id="empty"),
    ],
)
def test_prompt_fingerprints(a, b, same):
    fingerprinter = approx(256)
    assert (fingerprinter.prompt("m", None, a) == fingerprinter.prompt("m", None, b)) is same


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param(["a", 1], id="text-then-id"),
        pytest.param([1, "a"], id="id-then-text"),
        pytest.param([1, [2]], id="id-then-list"),
        pytest.param([-1], id="negative-id"),
    ],
)
def test_malformed_prompt_is_a_value_error(prompt):
    with pytest.raises(ValueError):
        approx(256).prompt("m", None, prompt)


def test_prompt_isolation():
    fingerprinter = approx(256)
    assert fingerprinter.prompt("m", "a", "hello") != fingerprinter.prompt("m", "b", "hello")
    assert fingerprinter.prompt("m", None, [1, 2]) != fingerprinter.prompt("n", None, [1, 2])


def test_text_and_ids_of_the_same_tokens_agree(tmp_path):
    words = ["alpha", "beta", "gamma"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="alpha"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    fingerprinter = Fingerprinter(HFTokenizer(str(tmp_path)), 2)
    from_text = fingerprinter.prompt("m", None, "gamma beta alpha")
    assert from_text == fingerprinter.prompt("m", None, [2, 1])


def test_only_the_needed_text_is_built():
    class Recording(ApproxTokenizer):
        def leading(self, text: str, n: int) -> tuple[bytes, int]:
            self.seen = len(text)
            return super().leading(text, n)

    tokenization = Recording(4.0)
    Fingerprinter(tokenization, 100).chat("m", None, HISTORY, None)
    assert tokenization.seen == 400


@pytest.mark.parametrize(
    "prefix_length", [pytest.param(0, id="zero"), pytest.param(-1, id="negative")]
)
def test_prefix_length_must_be_positive(prefix_length):
    with pytest.raises(ValueError, match="prefix_length"):
        approx(prefix_length)


def test_fingerprint_is_unsigned_64_bit():
    value = approx(8).prompt("m", None, "x")
    assert 0 <= value < 2**64
    struct.pack("<Q", value)

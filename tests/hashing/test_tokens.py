"""hashing.tokens: the key bytes of the leading n tokens, approximate, HuggingFace or ids."""

import math
import struct

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from hashing.tokens import ApproxTokenizer, HFTokenizer, ids_leading, make_tokenization

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a router sends each prompt to the backend that holds its prefix",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny BPE tokenizer.json trained here on CORPUS: no download."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(CORPUS * 5, trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    return HFTokenizer(str(tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference(tokenizer_dir):
    """The same tokenizer used directly, over the whole text."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def pack(ids):
    return struct.pack(f"<{len(ids)}I", *ids)


@pytest.mark.parametrize(
    ("chars_per_token", "text", "n", "key", "count"),
    [
        pytest.param(4.0, "abcdefghij", 2, b"abcdefgh", 2, id="cut-at-n-tokens"),
        pytest.param(4.0, "abcdefghij", 5, b"abcdefghij", 3, id="short-text-is-whole"),
        pytest.param(4.0, "", 3, b"", 0, id="empty"),
        pytest.param(4.0, "abc", 0, b"", 0, id="zero-tokens"),
        pytest.param(3.3, "x" * 100, 10, b"x" * 33, 10, id="fractional-rate"),
        pytest.param(3.3, "x" * 1000, 256, b"x" * 845, 256, id="rounded-up-chars-count-n"),
        pytest.param(2.0, "ééé", 1, "éé".encode(), 1, id="chars-not-bytes"),
    ],
)
def test_approx_leading(chars_per_token, text, n, key, count):
    assert ApproxTokenizer(chars_per_token).leading(text, n) == (key, count)


@pytest.mark.parametrize(
    ("chars_per_token", "n", "chars"),
    [
        pytest.param(4.0, 256, 1024, id="default"),
        pytest.param(3.3, 256, math.ceil(256 * 3.3), id="rounded-up"),
        pytest.param(4.0, 0, 0, id="zero"),
    ],
)
def test_approx_chars_for(chars_per_token, n, chars):
    assert ApproxTokenizer(chars_per_token).chars_for(n) == chars


@pytest.mark.parametrize(
    "chars_per_token",
    [
        pytest.param(0.0, id="zero"),
        pytest.param(-1.0, id="negative"),
        pytest.param(math.nan, id="nan"),
    ],
)
def test_approx_rejects_bad_rate(chars_per_token):
    with pytest.raises(ValueError, match="chars_per_token"):
        ApproxTokenizer(chars_per_token)


@pytest.mark.parametrize(
    ("ids", "n", "expected"),
    [
        pytest.param([1, 256], 5, (b"\x01\0\0\0\0\x01\0\0", 2), id="little-endian-uint32"),
        pytest.param([7, 8, 9], 2, (pack([7, 8]), 2), id="first-n"),
        pytest.param([], 4, (b"", 0), id="empty"),
        pytest.param((2**32 - 1,), 1, (b"\xff\xff\xff\xff", 1), id="largest-id"),
    ],
)
def test_ids_leading(ids, n, expected):
    assert ids_leading(ids, n) == expected


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param([-1], id="negative"),
        pytest.param([2**32], id="too-large"),
        pytest.param(["a"], id="not-an-int"),
        pytest.param([[1]], id="nested"),
    ],
)
def test_ids_leading_rejects_bad_ids(ids):
    with pytest.raises(ValueError, match="token ids"):
        ids_leading(ids, 4)


@pytest.mark.parametrize(
    ("text", "n"),
    [
        pytest.param("the quick brown fox jumps over the lazy dog", 3, id="cut"),
        pytest.param("the quick brown fox", 50, id="short-text-is-whole"),
        pytest.param("", 5, id="empty"),
        pytest.param(" ".join(CORPUS[2:] * 40), 30, id="long-words-need-a-wider-window"),
        pytest.param(" ".join(CORPUS * 30), 200, id="many-tokens"),
    ],
)
def test_hf_leading_matches_whole_text_tokenization(hf, reference, text, n):
    ids = reference(text)[:n]
    assert hf.leading(text, n) == (pack(ids), len(ids))


def test_hf_key_equals_ids_key(hf, reference):
    text = CORPUS[1]
    assert hf.leading(text, 4) == ids_leading(reference(text), 4)


def test_hf_depends_only_on_the_leading_text(hf):
    base = " ".join(CORPUS * 20)
    n = 16
    head = base[: hf.chars_for(n)]
    assert hf.leading(head + "zzz totally different", n) == hf.leading(head + " tail", n)


def test_hf_from_directory(tokenizer_dir, hf):
    assert HFTokenizer(str(tokenizer_dir)).leading(CORPUS[0], 3) == hf.leading(CORPUS[0], 3)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        pytest.param(None, "no tokenizer.json at", id="missing"),
        pytest.param("{}", "invalid tokenizer file", id="not-a-tokenizer"),
        pytest.param("not json", "invalid tokenizer file", id="not-json"),
    ],
)
def test_hf_bad_path_names_it(tmp_path, content, match):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as error:
        HFTokenizer(str(path))
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    ("kind", "with_path", "expected"),
    [
        pytest.param("approx", False, ApproxTokenizer, id="approx"),
        pytest.param("hf", True, HFTokenizer, id="hf"),
    ],
)
def test_make_tokenization(tokenizer_dir, kind, with_path, expected):
    path = str(tokenizer_dir) if with_path else None
    assert isinstance(make_tokenization(kind, 4.0, path), expected)


@pytest.mark.parametrize(
    ("kind", "path", "match"),
    [
        pytest.param("hf", None, "needs a tokenizer path", id="hf-without-path"),
        pytest.param("sentencepiece", None, "unknown tokenization", id="unknown-kind"),
        pytest.param("approx", None, "chars_per_token", id="bad-rate"),
    ],
)
def test_make_tokenization_errors(kind, path, match):
    rate = 0.0 if kind == "approx" else 4.0
    with pytest.raises(ValueError, match=match):
        make_tokenization(kind, rate, path)

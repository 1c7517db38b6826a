"""ChatML4 rendering cut at the keyed head, and PromptBlocks' keys of a text prompt: the
exact token ids' chain, as KV events carry them, or without KV events the text's own."""

from __future__ import annotations

import pytest

from hashing.blocks import chain, root_key
from hashing.canonical import Message
from hashing.chat_tokens import (
    BlockKeyCache,
    ChatML4,
    PromptBlocks,
    packed_ids,
    render_chat,
    text_chain,
    tokenize,
)
from hashing.tokens import pack_ids

DOC = "a long shared document " * 300
MESSAGES = [Message(role="system", content=DOC), Message(role="user", content="question?")]


@pytest.mark.parametrize("limit", [0, 5, 14, 100, len(DOC) + 40, 10**9])
def test_chat_head_is_the_rendering_cut_and_its_length(limit: int) -> None:
    whole = ChatML4().chat_text(MESSAGES)
    assert ChatML4().chat_head(MESSAGES, limit) == (whole[:limit], len(whole))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param({}, "<|im_start|>u\nU<|im_end|>\n<|im_start|>assistant\n", id="gen"),
        pytest.param({"add_generation_prompt": False}, "<|im_start|>u\nU<|im_end|>\n", id="no-gen"),
        pytest.param({"continue_final_message": True}, "<|im_start|>u\nU", id="continue"),
    ],
)
def test_render_chat_template(kwargs: dict, expected: str) -> None:
    assert render_chat([("u", "U")], **kwargs) == expected


@pytest.mark.parametrize("text", ["", "abc", "abcd", "abcdefg", "héllo wörld!", DOC])
def test_packed_ids_are_the_ids_packed(text: str) -> None:
    assert packed_ids(text) == pack_ids(tokenize(text))


def test_key_cache_hits_past_many_checkpoints_match_the_uncached_chain() -> None:
    cache = BlockKeyCache(ChatML4(), 16, checkpoint_blocks=2)
    for question in ("first", "second, longer", "first"):
        text = DOC + question
        keys, tokens = cache.keys(7, text, 200)
        assert keys == chain(7, tokenize(text), 16)[:200]
        assert tokens == len(tokenize(text))


def test_only_the_keyed_head_is_read_and_the_tokens_still_count_the_whole() -> None:
    rendered = ChatML4().chat_text(MESSAGES)
    keys, tokens = PromptBlocks(16, 10).chat("m", None, MESSAGES)
    assert len(keys) == 10 and tokens == -(-len(rendered) // 4)
    keys, tokens = PromptBlocks(16, 10).prompt("m", None, rendered)
    assert len(keys) == 10 and tokens == -(-len(rendered) // 4)


@pytest.mark.parametrize("tail", ["", " and the rest", " — then a word of ünïcode", "日本語の質問"])
def test_text_keys_of_a_prefix_are_the_same_whatever_follows_it(tail: str) -> None:
    """A conversation whose next turn brings non-ASCII text keeps its earlier keys; a
    block is 4 characters a token, its characters hashed whole."""
    keys = text_chain(7, DOC, 16)
    assert len(keys) == len(DOC) // 64 > 0
    assert text_chain(7, DOC + tail, 16)[: len(keys)] == keys
    assert text_chain(7, DOC[:640] + tail, 16)[:10] == keys[:10]
    assert text_chain(8, DOC, 16) != keys  # another model or salt: another chain


def test_text_keys_count_the_blocks_in_characters_and_differ_from_the_ids() -> None:
    text = "héllo wörld, " * 40  # 520 characters, more bytes
    keys, tokens = PromptBlocks(16, 100, text_keys=True).prompt("m", None, text)
    assert len(keys) == 520 // 64 and tokens == 130
    assert keys == text_chain(root_key("m", None), text, 16)
    ids_keys, _ = PromptBlocks(16, 100).prompt("m", None, text)
    assert len(ids_keys) == len(keys) and ids_keys != keys

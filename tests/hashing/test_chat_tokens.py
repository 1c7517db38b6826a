"""ChatML4 rendering cut at the keyed head, and PromptBlocks' two kinds of text keys:
exact (token ids, as KV events carry them) while a backend publishes events, straight
from the text otherwise."""

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
    tokenize,
)
from hashing.text_blocks import TextBlocks
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


def test_keys_are_exact_while_a_backend_publishes_events_and_from_the_text_otherwise() -> None:
    events: set[str] = set()
    blocks = PromptBlocks(16, 1000, event_backends=events)
    root, rendered = root_key("m", None), ChatML4().chat_text(MESSAGES)
    tokens = -(-len(rendered) // 4)
    assert blocks.chat("m", None, MESSAGES) == (TextBlocks(16, 1000).keys(root, rendered), tokens)
    events.add("vllm-0")
    assert blocks.chat("m", None, MESSAGES) == (chain(root, tokenize(rendered), 16), tokens)
    assert PromptBlocks(16, 1000).prompt("m", None, rendered)[0] == chain(
        root, tokenize(rendered), 16
    )


def test_only_the_keyed_head_is_read_and_the_tokens_still_count_the_whole() -> None:
    rendered = ChatML4().chat_text(MESSAGES)
    for events in (set(), {"vllm-0"}):
        keys, tokens = PromptBlocks(16, 10, event_backends=events).chat("m", None, MESSAGES)
        assert len(keys) == 10 and tokens == -(-len(rendered) // 4)
        keys, tokens = PromptBlocks(16, 10, event_backends=events).prompt("m", None, rendered)
        assert len(keys) == 10 and tokens == -(-len(rendered) // 4)

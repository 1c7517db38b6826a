"""The simulator's tokenizer and chat template, simple enough for a router to reproduce.

Tokenize: split the text into runs of 4 consecutive characters (Unicode code points; the
last run may be shorter). Each run is one token whose id is
`xxhash.xxh32_intdigest(run.encode("utf-8")) % 32000` (seed 0). No BOS/EOS or other
special tokens are ever added, so `add_special_tokens` has no effect.

Chat template (ChatML-like; the same for every model):
    for each message:  "<|im_start|>" + role + "\\n" + content + "<|im_end|>\\n"
    then, if add_generation_prompt (the default):  "<|im_start|>assistant\\n"
`content` is a string, None (empty), or a list of parts whose `type == "text"` parts are
concatenated with no separator; other part types (images, audio) contribute nothing.
With continue_final_message the last message is left open (no "<|im_end|>\\n") and no
generation prompt is added.

A prompt given as token ids is used as-is. Cost: one xxh32 per 4 characters.
The definition has one implementation, `hashing.chat_tokens` (ChatML4), which the
router uses to predict these ids; this module adapts it to OpenAI-style dict messages.
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hashing.chat_tokens import CHARS_PER_TOKEN, VOCAB_SIZE, tokenize
from hashing.chat_tokens import render_chat as _render_pairs

__all__ = ["CHARS_PER_TOKEN", "VOCAB_SIZE", "render_chat", "token_strs", "tokenize"]


def token_strs(text: str) -> list[str]:
    """The text of each token of `text`, aligned with `tokenize(text)`."""
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


def render_chat(
    messages: Iterable[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render OpenAI-style chat messages (dicts) through the fixed template."""
    return _render_pairs(
        ((m.get("role") or "", _content_text(m.get("content"))) for m in messages),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )


def _content_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if part.get("type") == "text")

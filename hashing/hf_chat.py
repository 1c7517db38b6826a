"""vLLM's token ids for a chat request, from a local HuggingFace tokenizer directory.

vLLM renders `messages` with the model's Jinja chat template (from tokenizer_config.json
`chat_template`, or a `chat_template.jinja` file), with `add_generation_prompt=True`, and
encodes the result with `add_special_tokens=False` (the template already wrote BOS).
Text content parts are joined with "\\n" (vLLM's "string" content format). This module
does the same with `jinja2` (sandboxed, `trim_blocks`/`lstrip_blocks`, the `tojson`
filter and `raise_exception` helper templates expect) and `tokenizers`, both optional
dependencies imported when a tokenizer is built.

Cost: the render is Python, the encode Rust (about a millisecond per 8k tokens), so the
router calls `chat_ids` in a worker thread; the cache is locked for that. A
conversation's history is usually the long, shared part, so the token ids of the
rendered history (every message but the last) are cached by the hash of that text: a
follow-up request only encodes its last message. That needs the history's ids to be a
prefix of the whole prompt's ids, which holds when messages end with a special token (as
chat templates do); the rendered text is checked to start with the history first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from hashing.canonical import Message

__all__ = ["HFChat"]

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class HFChat:
    def __init__(self, path: str, max_entries: int = 1024) -> None:
        directory = Path(path)
        if not (directory / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {path!r}")
        from tokenizers import Tokenizer  # lazy: optional dependency

        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        self._template = _compile(_template_source(directory, config), path)
        self._specials = {k: _token_text(config.get(k)) for k in _SPECIAL_TOKENS}
        self._cache: OrderedDict[int, list[int]] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()

    def render(self, messages: Sequence[Message], tools: msgspec.Raw | None, gen: bool) -> str:
        """Raises ValueError when the template refuses the conversation."""
        import jinja2  # loaded already: _compile imported it

        dicts = [_as_dict(m) for m in messages]
        tool_list = msgspec.json.decode(tools) if tools else None
        try:
            return self._template.render(
                messages=dicts, tools=tool_list, add_generation_prompt=gen, **self._specials
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template: {exc}") from None

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def prompt_ids(self, text: str) -> list[int]:
        """A completions prompt: vLLM encodes it with the special tokens (e.g. BOS)."""
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def chat_ids(self, messages: Sequence[Message], tools: msgspec.Raw | None) -> list[int]:
        full = self.render(messages, tools, gen=True)
        if len(messages) < 2:
            return self.tokenize(full)
        head = self.render(messages[:-1], tools, gen=False)
        if not full.startswith(head):
            return self.tokenize(full)
        return self._head_ids(head) + self.tokenize(full[len(head) :])

    def _head_ids(self, head: str) -> list[int]:
        key = xxhash.xxh3_64_intdigest(head.encode())
        with self._lock:  # the router tokenizes in worker threads
            ids = self._cache.get(key)
            if ids is not None:
                self._cache.move_to_end(key)
                return ids
        ids = self.tokenize(head)
        with self._lock:
            self._cache[key] = ids
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return ids


def _as_dict(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": _content(message.content)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = msgspec.json.decode(message.tool_calls)
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _content(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.text or "" for part in content if part.type == "text")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _template_source(directory: Path, config: dict[str, Any]) -> str:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise ValueError(f"no chat template in {directory} (tokenizer_config.json or .jinja)")
    return template


def _token_text(token: Any) -> str:
    if isinstance(token, dict):  # AddedToken serialized
        return str(token.get("content", ""))
    return token or ""


def _compile(source: str, path: str):
    import jinja2  # lazy: optional dependency
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"invalid chat template in {path!r}: {exc}") from exc

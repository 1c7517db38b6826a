"""HFChat renders a chat template and encodes as vLLM does, on a tokenizer built here."""

from __future__ import annotations

import json

import msgspec
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from hashing.blocks import chain, root_key
from hashing.canonical import Message, MessagePart
from hashing.chat_tokens import make_prompt_blocks
from hashing.hf_chat import HFChat

SPECIALS = ["<unk>", "<s>", "<|start|>", "<|end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
CORPUS = ["the tenant keeps the premises in good order", "who repairs the roof and windows"]


def build_tokenizer_dir(path, template: str = TEMPLATE):
    """A tiny BPE tokenizer trained here (no download) with a chat template, in `path`."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(special_tokens=SPECIALS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def convo(turns: int) -> list[Message]:
    msgs = [Message("system", CORPUS[0])]
    for i in range(turns):
        msgs.append(Message("user" if i % 2 == 0 else "assistant", f"{CORPUS[1]} {i}"))
    return msgs


def test_render_matches_the_template(tok_dir) -> None:
    chat = HFChat(str(tok_dir))
    text = chat.render(convo(1), None, gen=True)
    assert text == (
        f"<s><|start|>system\n{CORPUS[0]}<|end|><|start|>user\n{CORPUS[1]} 0<|end|>"
        "<|start|>assistant\n"
    )


@pytest.mark.parametrize("turns", [0, 1, 4])
def test_chat_ids_equal_encoding_the_whole_prompt(tok_dir, turns: int) -> None:
    chat = HFChat(str(tok_dir))
    for _ in range(2):  # the second pass uses the cached history
        ids = chat.chat_ids(convo(turns), None)
        assert ids == chat.tokenize(chat.render(convo(turns), None, gen=True))


def test_text_parts_join_with_newlines_and_prompts_get_bos(tok_dir) -> None:
    chat = HFChat(str(tok_dir))
    parts = [
        MessagePart("text", "who repairs"),
        MessagePart("image_url"),
        MessagePart("text", "the"),
    ]
    assert "who repairs\nthe" in chat.render([Message("user", parts)], None, gen=False)
    bos = chat._tokenizer.token_to_id("<s>")
    assert chat.prompt_ids("the roof")[0] == bos


def test_tools_reach_the_template(tok_dir, tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "chat_template.jinja").write_text("{{ tools | tojson }}|{{ messages | length }}")
    chat = HFChat(str(tmp_path))
    tools = msgspec.Raw(b'[{"type": "function"}]')
    assert chat.render(convo(0), tools, gen=True) == '[{"type": "function"}]|1'


def test_prompt_blocks_with_hf(tok_dir) -> None:
    blocks = make_prompt_blocks(4, 100, "hf", str(tok_dir))
    chat = HFChat(str(tok_dir))
    ids = chat.chat_ids(convo(3), None)
    keys, tokens = blocks.chat("m", None, convo(3))
    assert tokens == len(ids) and keys == chain(root_key("m", None), ids, 4)


@pytest.mark.parametrize(
    ("files", "match"),
    [
        pytest.param({}, "no tokenizer.json", id="missing"),
        pytest.param({"tokenizer_config.json": "{}"}, "no chat template", id="no-template"),
        pytest.param({"chat_template.jinja": "{% for %}"}, "invalid chat template", id="bad"),
    ],
)
def test_bad_directories_say_why(tok_dir, tmp_path, files: dict, match: str) -> None:
    if files:
        (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=match):
        HFChat(str(tmp_path))

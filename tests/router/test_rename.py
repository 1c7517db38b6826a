"""An answer's model renamed to the client's name: only the `model` key's value, at any
chunk boundary, with the relay's framed reads decoded first."""

from __future__ import annotations

import pytest

from router.upstream.rename import ModelRename, RenamingSink

SERVED, ASKED = "llama-70b.awq", "llama-70b"
EVENTS = [
    b'data: {"id":"c1","model":"llama-70b.awq","choices":[{"delta":{"content":"a"}}]}\n\n',
    b'data: {"id":"c1","model":"llama-70b.awq","choices":[{"delta":{"content":'
    b'"say \\"model\\":\\"llama-70b.awq\\""}}]}\n\n',
    b'data: {"id":"c1","model" : "llama-70b.awq","choices":[],"usage":{"total_tokens":3}}\n\n',
    b"data: [DONE]\n\n",
]
STREAM = b"".join(EVENTS)


def renamed(data: bytes) -> bytes:
    """`data` as the client is to get it, written out by hand."""
    data = data.replace(b'"model":"llama-70b.awq"', b'"model":"llama-70b"')
    return data.replace(b'"model" : "llama-70b.awq"', b'"model" : "llama-70b"')


RENAMED = renamed(STREAM)


def test_only_the_model_keys_value_is_renamed() -> None:
    assert RENAMED.count(b"llama-70b.awq") == 1  # the content's, escaped, stays
    body = b'{"model": "llama-70b.awq", "choices": [{"text": "llama-70bXawq"}]}'
    assert ModelRename(SERVED, ASKED).whole(body) == (
        b'{"model": "llama-70b", "choices": [{"text": "llama-70bXawq"}]}'
    )
    other = b'{"model": "llama-70bXawq"}'  # the name's dot is no wildcard
    assert ModelRename(SERVED, ASKED).whole(other) is other


@pytest.mark.parametrize("size", [1, 5, 33, 80, len(STREAM)])
def test_a_stream_is_renamed_whatever_its_chunks_boundaries(size: int) -> None:
    rename = ModelRename(SERVED, ASKED)
    out = b"".join(rename.feed(STREAM[i : i + size]) for i in range(0, len(STREAM), size))
    assert out + rename.rest() == RENAMED


def test_whole_lines_pass_at_once_and_an_unterminated_end_is_renamed() -> None:
    rename = ModelRename(SERVED, ASKED)
    assert rename.feed(EVENTS[0][:30]) == b""
    assert rename.feed(EVENTS[0][30:] + EVENTS[2][:-2]) == renamed(EVENTS[0])
    assert rename.rest() == renamed(EVENTS[2][:-2])
    assert rename.rest() == b""


class _Collecting:
    """A Sink that keeps what it is given."""

    def __init__(self) -> None:
        self.got: list[bytes] = []

    def put(self, chunk: bytes) -> None:
        self.got.append(chunk)

    def put_framed(self, chunks: bytes) -> None:
        raise AssertionError("a renamed stream is framed again by its sink")

    def ready(self) -> bool:
        return True

    def on_ready(self, callback) -> None:
        pass


def test_the_sink_decodes_framed_reads_and_renames_them() -> None:
    inner = _Collecting()
    sink = RenamingSink(inner, ModelRename(SERVED, ASKED))
    framed = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in EVENTS[:2])
    sink.put_framed(framed)
    sink.put(EVENTS[2][:20])
    sink.put(EVENTS[2][20:] + EVENTS[3][:-1])
    sink.end()
    assert b"".join(inner.got) == RENAMED[:-1]
    assert inner.got[0] == renamed(EVENTS[0] + EVENTS[1])

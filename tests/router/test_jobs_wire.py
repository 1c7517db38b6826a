"""A batch input file's check: line numbers, the line limit before any parse, the
errors capped, long lines refused, and every step bounded."""

from __future__ import annotations

import orjson

from router.jobs.wire import checking_lines, read_lines

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def line(i: int, **extra) -> bytes:
    return orjson.dumps(
        {"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": BODY, **extra}
    )


def test_lines_are_read_with_their_numbers_blank_ones_skipped() -> None:
    text = line(0) + b"\r\n\n   \n" + line(1) + b"\n\t\n" + line(2)  # no final newline
    lines, errors = read_lines(text, CHAT, 10, 1 << 20)
    assert errors == []
    assert [ln.custom_id for ln in lines] == ["c0", "c1", "c2"]
    assert lines[0].body == orjson.dumps(BODY)
    bad = line(0) + b"\n\n{nope\n" + line(0) + b"\n" + line(3, method="GET")
    lines, errors = read_lines(bad, CHAT, 10, 1 << 20)
    assert lines == []
    assert [(e["code"], e["line"]) for e in errors] == [
        ("invalid_json_line", 3), ("invalid_request", 4), ("invalid_request", 5),
    ]  # fmt: skip
    assert read_lines(b" \n\n", CHAT, 10, 1 << 20)[1][0]["code"] == "empty_file"


def test_a_file_past_the_line_limit_fails_on_that_alone() -> None:
    """More lines than the limit: one error, whatever the lines hold (none is parsed)."""
    lines, errors = read_lines(b"x\n" * 1_000_000, CHAT, 50_000, 1 << 20)
    assert lines == []
    assert [e["code"] for e in errors] == ["too_many_requests"]


def test_errors_stop_at_the_first_hundred() -> None:
    lines, errors = read_lines(b"x\n" * 40_000, CHAT, 50_000, 1 << 20)
    assert lines == []
    assert len(errors) == 100
    assert [e["line"] for e in errors] == list(range(1, 101))


def test_a_line_longer_than_the_limit_is_an_error_and_is_not_parsed() -> None:
    long = b'{"custom_id": "' + b"a" * 5000 + b'"}'
    lines, errors = read_lines(line(0) + b"\n" + long + b"\n" + line(2), CHAT, 10, 1000)
    assert lines == []
    assert [(e["line"], e["message"]) for e in errors] == [(2, "Line is over 1000 bytes.")]
    _, errors = read_lines(long, CHAT, 10, 1000)  # the last line, with no newline
    assert [e["line"] for e in errors] == [1]


def test_every_step_of_the_check_is_bounded() -> None:
    """A step (between two yields) scans at most a window of blank bytes or one line:
    a file of 8 MiB of blank space takes many steps, not one."""
    steps = checking_lines(b" " * (8 << 20) + b"\n" + line(0), CHAT, 10, 1 << 20)
    count = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            lines, errors = done.value
            break
        count += 1
    assert errors == [] and [ln.custom_id for ln in lines] == ["c0"]
    assert count >= 8

"""What the job endpoints read and write, in OpenAI's shapes where OpenAI has one: a
batch input file's lines checked, the output and error files written, and the file,
batch and async job objects. Bodies go through as raw JSON, never re-encoded."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Generator, Sequence
from typing import NamedTuple

import msgspec

from router.errors import KvrouteError
from router.jobs.store import Batch, Job, Line, Outcome, Page, StoredFile
from router.request import Kind, parse

#: the endpoints a job may run, by path
KINDS = {
    "/v1/chat/completions": Kind.CHAT,
    "/v1/completions": Kind.COMPLETION,
    "/v1/embeddings": Kind.EMBEDDING,
}
#: the one completion window OpenAI's Batch API accepts
WINDOW = "24h"
_WINDOW_S = 86_400
#: errors listed for a batch that failed its check (the check stops there)
_ERRORS_LISTED = 100
#: the most bytes one step of a batch input file's check scans for a line's bounds
_SCAN_BYTES = 1 << 20
_TEXT = re.compile(rb"\S")


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class _InputLine(msgspec.Struct):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


_LINE = msgspec.json.Decoder(_InputLine)
_ENCODE = msgspec.json.Encoder()


def checked_body(kind: Kind, body: bytes) -> None:
    """Raise BadRequest for a body a job cannot run: one `parse` refuses, or a stream
    (a job's answer is kept whole)."""
    req = parse(kind, body)
    if getattr(req, "stream", False):
        raise KvrouteError(
            "A job's answer is kept whole: `stream` must be false.", param="stream", status=400
        )


def read_lines(
    content: bytes | bytearray, endpoint: str, most: int, longest: int
) -> tuple[list[Line], list[dict]]:
    """`checking_lines` run to its end at once (for callers off the event loop)."""
    steps = checking_lines(content, endpoint, most, longest)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def checking_lines(
    content: bytes | bytearray, endpoint: str, most: int, longest: int
) -> Generator[None, None, tuple[list[Line], list[dict]]]:
    """A batch input file's lines as jobs, or the errors that fail the batch (OpenAI's
    error objects, with the 1-based line number). It yields between bounded steps, so
    that the event loop can run it in slices: no step scans more than a window or a
    line of at most `longest` bytes. A file of more than `most` requests fails on
    that alone, before any line is parsed; past `_ERRORS_LISTED` errors the check
    stops (the first ones are reported, as OpenAI does)."""
    count = 0
    for span in _spans(content, longest):
        if span is not None:
            count += 1
            if count > most:
                return [], [_error("too_many_requests", f"At most {most} requests a batch.", None)]
        yield
    if count == 0:
        return [], [_error("empty_file", "The input file has no request.", None)]
    lines: list[Line] = []
    errors: list[dict] = []
    seen: set[str] = set()
    view = memoryview(content)
    for span in _spans(content, longest):
        yield
        if span is None:
            continue
        number, start, end = span
        if end < 0:
            line = _error("invalid_request", f"Line is over {longest} bytes.", number)
        else:
            line = _read_line(view[start:end], endpoint, seen, number)
        if isinstance(line, dict):
            errors.append(line)
            if len(errors) == _ERRORS_LISTED:
                break
        elif not errors:  # once the batch fails, its lines are not kept
            lines.append(Line(new_id("batch_req_"), line.custom_id, endpoint, line.body))
    return ([], errors) if errors else (lines, [])


class _Checked(NamedTuple):
    custom_id: str
    body: bytes


def _read_line(raw: memoryview, endpoint: str, seen: set[str], number: int) -> _Checked | dict:
    """One input line as a request the batch can run, or its error."""
    try:
        line = _LINE.decode(raw)
        _check_line(line, endpoint, seen)
        body = bytes(line.body)
        checked_body(KINDS[endpoint], body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return _error("invalid_json_line", f"Line is not a request: {exc}", number)
    except KvrouteError as err:
        return _error("invalid_request", err.message, number)
    seen.add(line.custom_id)
    return _Checked(line.custom_id, body)


def _spans(
    content: bytes | bytearray, longest: int
) -> Generator[tuple[int, int, int] | None, None, None]:
    """(line number, start, end) of each line that is not blank (end -1: longer than
    `longest`), and None after each bounded scan of blank bytes or of a long line."""
    size, pos, number = len(content), 0, 1
    while pos < size:
        text = _TEXT.search(content, pos, pos + _SCAN_BYTES)
        if text is None:
            stop = min(pos + _SCAN_BYTES, size)
            number += content.count(b"\n", pos, stop)
            pos = stop
            yield None
            continue
        start = text.start()
        number += content.count(b"\n", pos, start)
        end = content.find(b"\n", start, start + longest + 1)
        if end < 0 and size - start <= longest:
            end = size
        if end >= 0:
            yield number, start, end
        else:
            yield number, start, -1
            end = yield from _line_end(content, start + longest)
        pos, number = end + 1, number + 1


def _line_end(content: bytes | bytearray, pos: int) -> Generator[None, None, int]:
    """Where the line running through `pos` ends, found a bounded scan at a time."""
    size = len(content)
    while pos < size:
        end = content.find(b"\n", pos, pos + _SCAN_BYTES)
        if end >= 0:
            return end
        pos += _SCAN_BYTES
        yield None
    return size


def _check_line(line: _InputLine, endpoint: str, seen: set[str]) -> None:
    if line.method != "POST":
        raise KvrouteError(f"method must be POST, not {line.method!r}", status=400)
    if line.url != endpoint:
        raise KvrouteError(f"url {line.url!r} is not the batch's endpoint {endpoint}", status=400)
    if line.custom_id in seen:
        raise KvrouteError(f"custom_id {line.custom_id!r} is used twice", status=400)


def _error(code: str, message: str, line: int | None) -> dict:
    return {"code": code, "message": message, "param": None, "line": line}


def errors_json(errors: Sequence[dict]) -> bytes:
    return _ENCODE.encode({"object": "list", "data": list(errors[:_ERRORS_LISTED])})


def write_outputs(outcomes: list[Outcome]) -> tuple[bytes, bytes]:
    """The output file (answers below 400) and the error file (the others), a JSON line
    per request in input order, as OpenAI writes them."""
    good, bad = bytearray(), bytearray()
    for o in outcomes:
        line = {
            "id": o.id,
            "custom_id": o.custom_id,
            "response": {"status_code": o.status, "request_id": o.id, "body": _raw(o.body)},
            "error": None,
        }
        (good if o.status < 400 else bad).extend(_ENCODE.encode(line) + b"\n")
    return bytes(good), bytes(bad)


def _raw(body: bytes) -> msgspec.Raw | str:
    """The answer as JSON when it is JSON (every backend's and router's is), else text."""
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace")
    return msgspec.Raw(body)


def file_json(f: StoredFile) -> bytes:
    return _ENCODE.encode(_file(f))


def _file(f: StoredFile) -> dict:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.size,
        "created_at": int(f.created),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
    }


def deleted_json(file_id: str) -> bytes:
    return _ENCODE.encode({"id": file_id, "object": "file", "deleted": True})


def files_json(page: Page[StoredFile]) -> bytes:
    """OpenAI's list of files."""
    return _list([_file(f) for f in page.items], page.more)


def batches_json(page: Page[Batch]) -> bytes:
    """OpenAI's list of batches."""
    return _list([_batch(b) for b in page.items], page.more)


def _list(items: list[dict], more: bool) -> bytes:
    return _ENCODE.encode(
        {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
            "has_more": more,
        }
    )


def new_batch(
    endpoint: str,
    input_file_id: str,
    metadata: bytes | None,
    lines: int,
    errors: list[dict],
    ttl_s: float,
) -> Batch:
    """A batch as accepted: running, or failed by its input file's errors (and then
    kept `ttl_s`, as an ended batch is)."""
    now = time.time()
    failed = bool(errors)
    return Batch(
        id=new_id("batch_"),
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=WINDOW,
        metadata=metadata,
        status="failed" if failed else "in_progress",
        errors=errors_json(errors) if failed else None,
        total=0 if failed else lines,
        completed=0,
        failed=0,
        output_file_id=None,
        error_file_id=None,
        created=now,
        in_progress_at=None if failed else now,
        cancelling_at=None,
        finished_at=now if failed else None,
        expires=now + ttl_s if failed else None,
    )


def batch_json(b: Batch) -> bytes:
    """OpenAI's batch object."""
    return _ENCODE.encode(_batch(b))


def _batch(b: Batch) -> dict:
    end = None if b.finished_at is None else int(b.finished_at)
    return {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": _raw(b.errors) if b.errors else None,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": int(b.created),
        "in_progress_at": _int(b.in_progress_at),
        "expires_at": int(b.created) + _WINDOW_S,
        "finalizing_at": end if b.status in ("completed", "cancelled") else None,
        "completed_at": end if b.status == "completed" else None,
        "failed_at": end if b.status == "failed" else None,
        "expired_at": None,
        "cancelling_at": _int(b.cancelling_at),
        "cancelled_at": end if b.status == "cancelled" else None,
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": _raw(b.metadata) if b.metadata else None,
    }


def job_json(job: Job, status_url: str) -> bytes:
    """An async job's status, and its answer once it has one."""
    answer = {"id": job.id, "object": "async.job", "status": job.status}
    answer |= {"status_url": status_url, "created_at": int(job.created), "attempts": job.attempts}
    if job.result_status is not None and job.result is not None:
        answer["result"] = {"status_code": job.result_status, "body": _raw(job.result)}
    if job.webhook is not None:
        state = job.hook_state or "waiting"  # for the job to end
        answer["webhook"] = {"url": job.webhook, "state": state, "attempts": job.hook_attempts}
    return _ENCODE.encode(answer)


def _int(t: float | None) -> int | None:
    return None if t is None else int(t)

"""What the job endpoints read and write, in OpenAI's shapes where OpenAI has one: a
batch input file's lines checked, the output and error files written, and the file,
batch and async job objects. Bodies go through as raw JSON, never re-encoded."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

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
#: errors listed for a batch that failed its check; the count says how many in all
_ERRORS_LISTED = 100


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


def read_lines(content: bytes, endpoint: str, most: int) -> tuple[list[Line], list[dict]]:
    """A batch input file's lines as jobs, or the errors that fail the batch (OpenAI's
    error objects, with the 1-based line number)."""
    lines: list[Line] = []
    errors: list[dict] = []
    seen: set[str] = set()
    kind = KINDS[endpoint]
    for number, raw in enumerate(content.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = _LINE.decode(raw)
            _check_line(line, endpoint, seen)
            checked_body(kind, bytes(line.body))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            errors.append(_error("invalid_json_line", f"Line is not a request: {exc}", number))
            continue
        except KvrouteError as err:
            errors.append(_error("invalid_request", err.message, number))
            continue
        seen.add(line.custom_id)
        lines.append(Line(new_id("batch_req_"), line.custom_id, endpoint, bytes(line.body)))
    if not lines and not errors:
        errors.append(_error("empty_file", "The input file has no request.", None))
    if len(lines) + len(errors) > most:
        errors.append(_error("too_many_requests", f"At most {most} requests a batch.", None))
    return lines, errors


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

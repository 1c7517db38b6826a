"""A request's access log line (router/access_log.py), and the capture record that holds
it with the request's raw parts (router/capture.py): both written off the request's
path."""

from __future__ import annotations

import time

from router.access_log import AccessLog, Entry
from router.capture import Capture, Captured
from router.dispatch.attempt import Attempt
from router.dispatch.call import Call
from router.upstream.usage import Usage


def logged(
    access: AccessLog | None,
    capture: Capture | None,
    attempt: Attempt,
    strategy: str,
    seconds: float,
    ttft: float | None,
    used: Usage,
) -> None:
    """Hand a request's last attempt to the access log and, if it is captured, to the
    capture's queue."""
    call, error = attempt.call, attempt.error
    failure = type(error).__name__ if error is not None else _disconnected(attempt)
    status, name, why = _answered(attempt), attempt.backend.name, attempt.routed.reason
    line = entry(call, strategy, seconds, ttft, name, why, status, call.attempts - 1, used, failure)
    if access is not None:
        access.add(line)
    if call.capture is not None and capture is not None:
        _captured(capture, attempt, line)


def entry(
    call: Call,
    strategy: str,
    seconds: float,
    ttft: float | None,
    backend: str,
    reason: str,
    status: str,
    retries: int,
    used: Usage,
    failure: str,
) -> Entry:
    """The request's access log line, which a capture record holds too."""
    return Entry(
        time.time(),
        seconds,
        ttft,
        call.request_id,
        call.tenant,
        call.method,
        call.path,
        call.req.model or "",
        strategy,
        backend,
        reason,
        call.prefilled_by or "",
        status,
        retries,
        *used,
        failure,
        call.priority or "",
        call.queued,
    )


def _captured(capture: Capture, attempt: Attempt, line: Entry) -> None:
    """Hand the request's raw parts to the capture's queue (it encodes them)."""
    call, upstream = attempt.call, attempt.upstream
    response = upstream.body() if upstream is not None and upstream.kept else None
    sent = call.headers if call.sent_headers is None else call.sent_headers
    capture.add(
        Captured(
            line,
            attempt.backend.pool,
            capture.headers(sent.items()),
            call.capture,
            response,
            upstream is not None and upstream.streaming,
        )
    )


def _answered(attempt: Attempt) -> str:
    """The status the client got: a stream's that began, even if the backend broke it
    after (its line's `error` says it did; the metrics count the failure), else the
    outcome's."""
    upstream = attempt.upstream
    if attempt.call.began and attempt.error is not None and upstream is not None:
        return str(upstream.status)
    return attempt.status


def _disconnected(attempt: Attempt) -> str:
    """The failure of an attempt that ended with no error of its backend's."""
    return "ClientDisconnected" if attempt.status == "499" else ""

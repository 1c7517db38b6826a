"""Error classes and their one translator to OpenAI-style error bodies.

Every failure a client can see is a `KvrouteError` carrying the HTTP status and the
OpenAI `type`; `to_http()` renders it before the response started, `sse_event()` after
(a stream that already sent 200 ends with an error event and `[DONE]`, never a second
response), `to_grpc()` for the gRPC ingress (any time: gRPC's status travels in trailers).
`from_body()` turns a backend's OpenAI-style error (a non-200 answer or an in-band SSE
event) back into one, so backend errors take the same path. Subclasses also inherit the
builtin they resemble so generic handlers work.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import grpc
import orjson
from aiohttp import web
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

_STATUS_TYPE = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    417: "ExpectationFailedError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
#: what a client hears of a bug of ours (the traceback goes to the log)
INTERNAL = "The router failed to handle the request."
#: how every UpstreamError message begins, until `blame` names the backend
_SUBJECT = "The backend "


class KvrouteError(Exception):
    status = 500
    #: label for kvroute_upstream_errors_total, when the failure is the backend's
    kind = "internal"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: int | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _STATUS_TYPE.get(self.status, "Error"),
                "param": self.param,
                "code": self.status,
            }
        }

    def http_answer(self, headers: dict[str, str] | None = None) -> tuple[dict[str, str], bytes]:
        """The headers (`headers` plus the JSON type and Retry-After) and body to send."""
        extra = {**(headers or {}), "Content-Type": "application/json"}
        if self.retry_after is not None:
            extra["Retry-After"] = str(self.retry_after)
        return extra, orjson.dumps(self.body())

    def to_http(self, headers: dict[str, str] | None = None) -> web.Response:
        extra, body = self.http_answer(headers)
        return web.Response(status=self.status, body=body, headers=extra)

    def sse_event(self) -> bytes:
        """The event that ends a stream that already started: the error, then [DONE]."""
        return b"data: " + orjson.dumps(self.body()) + b"\n\ndata: [DONE]\n\n"

    # --- gRPC ---------------------------------------------------------------

    def to_grpc(self, metadata: Iterable[tuple[str, str]] = ()) -> GrpcStatus:
        """The gRPC status for this error: `await context.abort(*err.to_grpc(trailers))`.

        Trailers get `metadata`, `retry-after` (seconds) when set, and the standard
        `grpc-status-details-bin`: a google.rpc.Status with an ErrorInfo (the OpenAI type,
        the HTTP status, the param) and, when set, a RetryInfo.
        """
        code = self.grpc_code()
        trailers = list(metadata)
        info = {"http_status": str(self.status), **({"param": self.param} if self.param else {})}
        reason = _STATUS_TYPE.get(self.status, "Error")
        details = [error_details_pb2.ErrorInfo(reason=reason, domain="kvroute", metadata=info)]
        if self.retry_after is not None:
            trailers.append(("retry-after", str(self.retry_after)))
            delay = duration_pb2.Duration(seconds=self.retry_after)
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        status = status_pb2.Status(
            code=code.value[0], message=self.message, details=map(_any, details)
        )
        trailers.append(("grpc-status-details-bin", status.SerializeToString()))
        return GrpcStatus(code, self.message, tuple(trailers))

    def grpc_code(self) -> grpc.StatusCode:
        return grpc_code(self.status)

    @classmethod
    def from_body(cls, body: bytes | dict, status: int | None = None) -> KvrouteError:
        """A backend's OpenAI-style error: `{"error": {...}}` or vLLM's older flat form.

        `status` is the HTTP status of the answer; an in-band SSE event has none, so its
        `code` (an HTTP status in vLLM's events) is used, else 500.
        """
        try:
            data = orjson.loads(body) if isinstance(body, bytes) else body
        except orjson.JSONDecodeError:
            data = None
        err = data.get("error", data) if isinstance(data, dict) else None
        if not isinstance(err, dict):
            err = {}
        code = err.get("code")
        if status is None:
            status = code if isinstance(code, int) and 400 <= code <= 599 else 500
        message = err.get("message") or f"The backend answered HTTP {status}."
        param = err.get("param")
        return cls(str(message), param=param if isinstance(param, str) else None, status=status)


class BadRequest(KvrouteError, ValueError):
    status = 400


class PayloadTooLarge(KvrouteError, ValueError):
    status = 413


class HeadersTooLarge(KvrouteError, ValueError):
    """A request header (or the request line) over `max_header_bytes`, or more headers
    than `max_headers`."""

    status = 431


class Unauthorized(KvrouteError, PermissionError):
    """A missing, unknown, expired or forged bearer token."""

    status = 401


class RequestTimeout(KvrouteError, TimeoutError):
    """The client did not send its request body in time (slowloris)."""

    status = 408


class ModelNotFound(KvrouteError, LookupError):
    status = 404


#: the answer header naming why admission refused a request
DROP_REASON = "x-kvroute-drop-reason"


class Overloaded(KvrouteError):
    """Admission refused the request: 503 (the router or the fleet is full), or 429 for
    a tenant over its own cap. `drop_reason` says which (`saturated`, `queue_full`,
    `queue_timeout`, `tenant_cap`, `shed`) in the `x-kvroute-drop-reason` header, or
    the gRPC trailer of that name."""

    status = 503

    def __init__(self, message: str, *, drop_reason: str, retry_after: int = 1) -> None:
        status = 429 if drop_reason == "tenant_cap" else 503
        super().__init__(message, retry_after=retry_after, status=status)
        self.drop_reason = drop_reason

    def http_answer(self, headers: dict[str, str] | None = None) -> tuple[dict[str, str], bytes]:
        return super().http_answer({**(headers or {}), DROP_REASON: self.drop_reason})

    def to_grpc(self, metadata: Iterable[tuple[str, str]] = ()) -> GrpcStatus:
        return super().to_grpc((*metadata, (DROP_REASON, self.drop_reason)))

    def grpc_code(self) -> grpc.StatusCode:
        """RESOURCE_EXHAUSTED whatever the HTTP status: gRPC's word for a full server."""
        return _C.RESOURCE_EXHAUSTED


class NoBackendAvailable(KvrouteError):
    status = 503


class ShuttingDown(KvrouteError):
    """The router stopped while the request was in flight (`shutdown.drain_seconds` ran
    out): the client learns it should retry elsewhere, not that the network failed."""

    status = 503


class BodyBudgetFull(KvrouteError):
    """The request bodies held at once would pass `max_buffered_body_bytes`: the body
    is not read (the connection closes), and the client may retry shortly."""

    status = 503


class StoreUnavailable(KvrouteError):
    """The job store failed: its disk is full, its database locked, corrupt or gone,
    or Redis does not answer. A 503 that says which, with Retry-After: the job routes
    answer it, and the job runner backs off and tries again."""

    status = 503

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message, retry_after=retry_after)


class MetricsUnavailable(KvrouteError):
    """/metrics of a worker of several could not get the counted series from the
    collector, which merges them (restarting, or too slow): the scrape fails and says
    so, and the next one is answered as usual."""

    status = 503

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after=1)


class UpstreamError(KvrouteError, ConnectionError):
    """A backend failed before or while answering. The message says what it did, as
    "The backend ..."; `blame` names which backend once dispatch knows it."""

    status = 502
    kind = "upstream"
    #: the backend that failed: the answer's x-kvroute-backend header
    backend: str | None = None
    #: that backend's pool, in a fleet with pools
    pool: str | None = None

    def blame(self, name: str, address: str, pool: str | None = None) -> None:
        """Name the backend (and its pool) in the headers and the backend in the message:
        "The backend refused the connection." becomes "Backend b0 (10.0.0.5:8000)
        refused the connection."."""
        self.backend, self.pool = name, pool
        if self.message.startswith(_SUBJECT):
            who = name if name == address else f"{name} ({address})"
            self.message = f"Backend {who} {self.message.removeprefix(_SUBJECT)}"
            self.args = (self.message,)


class UpstreamConnectError(UpstreamError):
    kind = "connect"


class UpstreamDisconnected(UpstreamError):
    kind = "disconnect"


class UpstreamCredentialsRefused(UpstreamError, PermissionError):
    """A backend answered 401 or 403 to the router's own credentials (its `api_key`, or
    none): a 502, since the client's token is not what it refused."""

    kind = "credentials"


class UpstreamTimeout(UpstreamError, TimeoutError):
    status = 504
    kind = "timeout"


class BackendsFailed(NoBackendAvailable, UpstreamError):
    """Every candidate was tried and none answered: a 503 with Retry-After, since an
    instant retry would meet the same fleet, naming the last one tried as a 502 does."""

    status = 503


# --- gRPC: the HTTP status → gRPC code table used by to_grpc() --------------


class GrpcStatus(NamedTuple):
    """The arguments of `ServicerContext.abort`."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


_C = grpc.StatusCode
#: HTTP status → gRPC code, after grpc's doc/http-grpc-status-mapping.md, made finer where
#: the router knows the meaning (400 is the client's argument, 404 an unknown model).
_GRPC_CODE = {
    400: _C.INVALID_ARGUMENT,
    401: _C.UNAUTHENTICATED,  # the router's bearer-token check, or a backend's to the client's
    403: _C.PERMISSION_DENIED,
    404: _C.NOT_FOUND,
    408: _C.DEADLINE_EXCEEDED,
    413: _C.RESOURCE_EXHAUSTED,  # what gRPC itself answers for an oversized message
    422: _C.INVALID_ARGUMENT,
    429: _C.RESOURCE_EXHAUSTED,
    499: _C.CANCELLED,
    500: _C.INTERNAL,
    501: _C.UNIMPLEMENTED,
    502: _C.UNAVAILABLE,
    503: _C.UNAVAILABLE,
    504: _C.DEADLINE_EXCEEDED,
}


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC code for an HTTP status; other 4xx are the client's, other 5xx internal."""
    code = _GRPC_CODE.get(status)
    if code is not None:
        return code
    if 400 <= status < 500:
        return _C.INVALID_ARGUMENT
    return _C.INTERNAL if 500 <= status < 600 else _C.UNKNOWN


def _any(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


class ListenError(OSError):
    """A listener could not bind; the message names which one and its host:port."""


@contextlib.contextmanager
def listening(what: str, host: str, port: int) -> Iterator[None]:
    """Turn a failed bind of listener `what` into a ListenError that says where."""
    try:
        yield
    except OSError as exc:  # asyncio's message repeats the address: the errno's says it all
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ListenError(f"cannot listen on {host}:{port} for {what}: {reason}") from exc
    except RuntimeError as exc:  # grpcio's bind failure, with no errno
        reason = "the port is in use, or the address is not this host's"
        raise ListenError(f"cannot listen on {host}:{port} for {what}: {reason}") from exc

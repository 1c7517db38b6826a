"""Error classes and their one translator to OpenAI-style error bodies.

Every failure a client can see is a `KvrouteError` carrying the HTTP status and the
OpenAI `type`; `to_http()` renders it before the response started, `sse_event()` after
(a stream that already sent 200 ends with an error event and `[DONE]`, never a second
response). Subclasses also inherit the builtin they resemble so generic handlers work.
"""

from __future__ import annotations

import orjson
from aiohttp import web

_STATUS_TYPE = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


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

    def to_http(self, headers: dict[str, str] | None = None) -> web.Response:
        extra = dict(headers or {})
        if self.retry_after is not None:
            extra["Retry-After"] = str(self.retry_after)
        return web.Response(
            status=self.status,
            body=orjson.dumps(self.body()),
            content_type="application/json",
            headers=extra,
        )

    def sse_event(self) -> bytes:
        """The event that ends a stream that already started: the error, then [DONE]."""
        return b"data: " + orjson.dumps(self.body()) + b"\n\ndata: [DONE]\n\n"


class BadRequest(KvrouteError, ValueError):
    status = 400


class PayloadTooLarge(KvrouteError, ValueError):
    status = 413


class ModelNotFound(KvrouteError, LookupError):
    status = 404


class Overloaded(KvrouteError):
    """The router's own admission limit is reached."""

    status = 429


class NoBackendAvailable(KvrouteError):
    status = 503


class UpstreamError(KvrouteError, ConnectionError):
    status = 502
    kind = "upstream"


class UpstreamConnectError(UpstreamError):
    kind = "connect"


class UpstreamDisconnected(UpstreamError):
    kind = "disconnect"


class UpstreamTimeout(UpstreamError, TimeoutError):
    status = 504
    kind = "timeout"

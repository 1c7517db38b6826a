"""What every gRPC call passes before its servicer: the token gate, and its request
parsed as a step of the call's own, so bad bytes are a client's error.

The gate (`TokenGate`, the server's interceptor): with auth on, every service but those
named `ungated` needs a data-plane token, as every HTTP route but the probes does:
reflection, and any service added later, is closed unless let through on purpose. A
refused call answers UNAUTHENTICATED without parsing anything a stranger sent.

Parsing: grpcio parses a request before the servicer runs, and a message that does not
parse ends the call as UNKNOWN with an ERROR traceback in the log, each time, for anyone
who can reach the port. So every handler the gate passes takes bytes and parses them
itself (`parsing`): INVALID_ARGUMENT, no traceback. The Inference service parses its own
after its token check (`BytesIn`), since its handlers check the token themselves.

Cost: one closure per call of a service that is not the Inference one (health,
reflection); none for inference calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from router.errors import BadRequest, KvrouteError, Unauthorized
from router.ingress.auth import Authenticator

#: how long and how many messages a refused streaming call is read before its status
_REFUSED_DRAIN_SECONDS = 1.0
_REFUSED_DRAIN_MESSAGES = 16
_NOT_A_MESSAGE = BadRequest("The request is not a valid protobuf message of its method.")

#: how a handler is made, by (request streaming, response streaming)
_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class TokenGate(grpc.aio.ServerInterceptor):
    """The token gate and the parsing step (this module's docstring)."""

    def __init__(self, auth: Authenticator, ungated: frozenset[str]) -> None:
        self._auth = auth
        self._ungated = ungated

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        service = details.method.split("/")[1]  # the method is /package.Service/Name
        if self._auth.enabled and service not in self._ungated:
            metadata = dict(details.invocation_metadata or ())
            try:
                self._auth.authenticate(metadata.get("authorization"))
            except Unauthorized as err:
                return _refusing(handler, err)
        return parsing(handler)


def _refusing(handler: grpc.RpcMethodHandler, err: KvrouteError) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers every call with `err`.

    Requests stay bytes: a stranger's message is never parsed. A streaming request is
    read to its end (bounded) first: a status sent while the client is still writing
    fails the client's pending write, and grpcio's client then reports INTERNAL instead
    of the status the server sent."""

    async def refuse(request, context) -> None:
        await context.abort(*err.to_grpc())

    async def refuse_stream(requests, context) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_REFUSED_DRAIN_SECONDS):
                await _drain(requests, _REFUSED_DRAIN_MESSAGES)
        await context.abort(*err.to_grpc())

    make = _HANDLERS[handler.request_streaming, handler.response_streaming]
    return make(
        refuse_stream if handler.request_streaming else refuse,
        response_serializer=handler.response_serializer,
    )


async def _drain(requests, most: int) -> None:
    """Read up to `most` messages of a request stream, or to its end."""
    count = 0
    async for _ in requests:
        count += 1
        if count >= most:
            return


def parsing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler`, taking its requests as bytes and parsing them as its first step (one
    that takes bytes already is returned as it is)."""
    parse = handler.request_deserializer
    if parse is None:
        return handler
    behaviour = _behaviour(handler)
    request_of = _parsed_stream(parse) if handler.request_streaming else _parsed(parse)
    if inspect.isasyncgenfunction(behaviour):

        async def run(request, context):
            async for reply in behaviour(await request_of(request, context), context):
                yield reply

    else:

        async def run(request, context):
            return await behaviour(await request_of(request, context), context)

    make = _HANDLERS[handler.request_streaming, handler.response_streaming]
    return make(run, response_serializer=handler.response_serializer)


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable:
    return (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )


def _parsed(parse: Callable[[bytes], object]):
    """The request of a unary call, parsed (abort with INVALID_ARGUMENT if it is not)."""

    async def request_of(raw: bytes, context):
        try:
            return parse(raw)
        except DecodeError:
            await context.abort(*_NOT_A_MESSAGE.to_grpc())

    return request_of


def _parsed_stream(parse: Callable[[bytes], object]):
    """The requests of a streaming call, each parsed as it is read."""
    one = _parsed(parse)

    async def request_of(requests, context):
        async def messages():
            async for raw in requests:
                yield await one(raw, context)

        return messages()

    return request_of


class BytesIn:
    """A server for a generated `add_*Servicer_to_server` that registers its handlers
    with requests left as bytes: the servicer parses them itself, after its own token
    check, so a stranger's malformed message is UNAUTHENTICATED, a client's
    INVALID_ARGUMENT."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        """Unused: the same handlers come through `add_registered_method_handlers`."""

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        raw = {name: h._replace(request_deserializer=None) for name, h in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, raw),))
        self._server.add_registered_method_handlers(service, raw)

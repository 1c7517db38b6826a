"""gRPC ingress protocol definitions (`kvroute/v1/kvroute.proto`) and their generated code.

The *_pb2* modules are protoc's output, committed; `python -m proto.generate` rewrites
them and a test fails while they are stale.
"""

__all__: list[str] = []

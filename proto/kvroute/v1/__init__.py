"""kvroute.v1: the gRPC ingress API (kvroute.proto) and its generated modules."""

__all__: list[str] = []

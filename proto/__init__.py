"""gRPC ingress protocol definitions and their generated code (see the gRPC issue)."""

"""kvroute's own protocol definitions, one package per API version."""

__all__: list[str] = []

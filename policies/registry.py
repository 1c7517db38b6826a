"""Strategy registry: `@register` keys a policy class by its params tag.

`router/config.py` builds the `routing:` tagged union from `params_union()`, so adding a
strategy is one new file in this package and nothing else.
"""

from __future__ import annotations

import functools
import typing

from policies.base import Policy, PolicyParams

_POLICIES: dict[str, type[Policy]] = {}

T = typing.TypeVar("T", bound=type[Policy])


def register(cls: T) -> T:
    tag = cls.params_type.__struct_config__.tag
    if tag in _POLICIES:
        raise ValueError(f"strategy {tag!r} registered twice")
    _POLICIES[tag] = cls
    return cls


def names() -> list[str]:
    return sorted(_POLICIES)


def policy_class(name: str) -> type[Policy]:
    return _POLICIES[name]


def canonical(name: str) -> str | None:
    """The registered spelling of `name` in any case (`kv_aware` -> `KV_AWARE`), or None."""
    folded = name.casefold()
    return next((n for n in _POLICIES if n.casefold() == folded), None)


def taking(field: str) -> list[str]:
    """The strategies whose params have `field`, sorted."""
    return [n for n in names() if field in _POLICIES[n].params_type.__struct_fields__]


@functools.cache
def params_union() -> typing.Any:
    """The tagged union of every registered params Struct (for msgspec decoding)."""
    types = tuple(cls.params_type for cls in _POLICIES.values())
    return typing.Union[types]  # noqa: UP007 - a runtime-built union needs the subscript form


def create(params: PolicyParams) -> Policy:
    return _POLICIES[params.__struct_config__.tag](params)

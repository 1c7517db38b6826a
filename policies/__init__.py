"""Routing strategies behind one small interface (see `policies.base`).

Importing this package imports every strategy module, and each registers itself with
`policies.registry.register`; nothing else has to be edited to add one. A strategy with
several jobs is a folder of one module per job (kv_aware/: KV_AWARE's cost, scoring,
tie-break and index upkeep), which registers itself the same way.
"""

import importlib
import pkgutil

from policies.base import (
    SPILL_REASONS,
    BackendLike,
    FleetView,
    Pick,
    Placements,
    Policy,
    PolicyParams,
    Reason,
    RouteRequest,
    Speed,
    Turns,
    load_cap_per_weight,
    tuned_params,
)
from policies.registry import canonical, create, names, params_union, policy_class, taking

__all__ = [
    "SPILL_REASONS",
    "BackendLike",
    "FleetView",
    "Pick",
    "Placements",
    "Policy",
    "PolicyParams",
    "Reason",
    "RouteRequest",
    "Speed",
    "Turns",
    "canonical",
    "create",
    "load_cap_per_weight",
    "names",
    "params_union",
    "policy_class",
    "taking",
    "tuned_params",
]

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in {"base", "registry"}:
        importlib.import_module(f"{__name__}.{_mod.name}")

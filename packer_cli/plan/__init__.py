"""Pack planning: assign items (token sequences) to fixed-capacity packs.

Public API
----------
first_fit_decreasing, best_fit_decreasing, next_fit
    Compiled bin-packing kernels behind validating wrappers; each returns the
    pack index of every item.
bridge_first_fit_shuffle
    Megatron-Bridge's default packing and sample binding, reproduced exactly.
plan_packs, PackPlan
    One entry point returning the full layout (pack of each item, item order
    grouped by pack, offsets, loads).
refine_plan
    Optional improvement pass reducing the number of packs.
lower_bound, martello_toth_l2
    Lower bounds on the number of packs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The kernels are compiled with numba, whose import and set-up cost ~0.3 s and ~60 MB per
# process; they load on first use, so modules that only need this package's limits
# (``_config``) or the torch side never pay for them.
_EXPORTS = {
    "best_fit_decreasing": ".algorithms",
    "bridge_first_fit_shuffle": ".algorithms",
    "first_fit_decreasing": ".algorithms",
    "next_fit": ".algorithms",
    "lower_bound": ".bounds",
    "martello_toth_l2": ".bounds",
    "ALGORITHMS": ".plan",
    "PackPlan": ".plan",
    "plan_packs": ".plan",
    "validate_plan": ".plan",
    "refine_plan": ".refine",
}

__all__ = [
    "ALGORITHMS",
    "PackPlan",
    "best_fit_decreasing",
    "bridge_first_fit_shuffle",
    "first_fit_decreasing",
    "lower_bound",
    "martello_toth_l2",
    "next_fit",
    "plan_packs",
    "refine_plan",
    "validate_plan",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from .algorithms import best_fit_decreasing, bridge_first_fit_shuffle, first_fit_decreasing, next_fit
    from .bounds import lower_bound, martello_toth_l2
    from .plan import ALGORITHMS, PackPlan, plan_packs, validate_plan
    from .refine import refine_plan


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # Everything but the helpers this file imports for itself, plus the names not loaded yet.
    return sorted((set(globals()) - {"annotations", "importlib", "TYPE_CHECKING"}) | set(_EXPORTS))

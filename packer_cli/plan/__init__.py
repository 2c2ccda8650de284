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

from .algorithms import (
    best_fit_decreasing,
    bridge_first_fit_shuffle,
    first_fit_decreasing,
    next_fit,
)
from .bounds import lower_bound, martello_toth_l2
from .plan import ALGORITHMS, PackPlan, plan_packs, validate_plan
from .refine import refine_plan

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

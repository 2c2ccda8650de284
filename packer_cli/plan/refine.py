"""Improvement pass: fewer packs, towards the Martello–Toth L2 bound.

Packs filled exactly to capacity cannot be improved on their own, so the pass
keeps them and re-packs the items of every other pack ("the pool") with an
exact-fill heuristic (:func:`packer_cli.plan._refine_kernels._rebuild`): each
new pack takes the largest pool item, then greedily the largest items that
leave at least ``threshold`` tokens free, then closes the remaining room
exactly with one, two or three items when the pool allows it, and finally
best-fits what is left. Several thresholds are tried (largest items first
matters most when items are big, exact closing when they are small); the
best result is kept only if it beats the input, and rounds repeat on the new
non-full packs while they help. Everything is deterministic.
"""

from __future__ import annotations

import time

import numpy as np

from . import _kernels as K
from ._refine_kernels import _rebuild
from ._validate import check_lengths
from .bounds import martello_toth_l2
from .plan import PackPlan, _make_plan

__all__ = ["refine_plan"]

#: Thresholds tried, as fractions of the capacity (``capacity // d``).
_THRESHOLD_DIVISORS = (64, 32, 16, 8, 128, 4)
#: Third-item candidates tried per pack when no exact pair closes it.
_MAX_TRIPLES = 64


def _refine_round(arr: np.ndarray, plan: PackPlan, target: int):
    """One round: rebuild the non-full packs; return a better plan or None."""
    capacity = plan.capacity
    nonfull = plan.pack_load < capacity
    num_nonfull = int(nonfull.sum())
    if num_nonfull <= 1:
        return None
    pool = np.flatnonzero(nonfull[plan.pack_of_item])
    pool_lengths = np.ascontiguousarray(arr[pool], dtype=np.int64)
    kept = plan.num_packs - num_nonfull
    best = None
    for divisor in _THRESHOLD_DIVISORS:
        threshold = max(1, capacity // divisor)
        pack_of_position, sequence, num_new = _rebuild(pool_lengths, capacity, threshold, _MAX_TRIPLES)
        if num_new < num_nonfull and (best is None or num_new < best[2]):
            best = (pack_of_position, sequence, num_new)
            if kept + num_new <= target:
                break
    if best is None:
        return None
    pack_of_position, sequence, num_new = best
    # Renumber: kept (full) packs first in their old order, then the new packs.
    new_id = np.full(plan.num_packs, -1, np.int64)
    new_id[~nonfull] = np.arange(kept, dtype=np.int64)
    pack_of_item = new_id[plan.pack_of_item]
    pack_of_item[pool] = kept + pack_of_position
    # Placement sequence: kept packs' items in their old order, then the pool's.
    old_order = np.asarray(plan.order)
    kept_sequence = old_order[~nonfull[plan.pack_of_item[old_order]]]
    full_sequence = np.concatenate([kept_sequence, pool[sequence]])
    order, offsets, load = K._group_by_pack(
        full_sequence, K._gather(pack_of_item, full_sequence), K._gather(arr, full_sequence), kept + num_new
    )
    return _make_plan(pack_of_item, order, offsets, load, capacity, plan.algorithm)


def refine_plan(lengths, plan: PackPlan, *, max_rounds: int = 4) -> PackPlan:
    """Reduce the number of packs of ``plan``.

    Keeps every pack that is filled exactly to capacity and re-packs the items
    of the others with an exact-fill heuristic, trying several settings and
    keeping the best; repeats while it helps (at most ``max_rounds`` rounds)
    and stops early at the L2 lower bound. The result is deterministic, keeps
    every pack within capacity and never has more packs than ``plan``.

    Parameters
    ----------
    lengths : array-like of int, shape (N,)
        The item lengths ``plan`` was made for.
    plan : PackPlan
        Any plan (its ``capacity`` is used).
    max_rounds : int
        Upper bound on improvement rounds.

    Returns
    -------
    PackPlan
        Kept packs first (old relative order), then the rebuilt packs;
        ``algorithm`` gets a ``"+refine"`` suffix and ``refine_seconds`` the
        wall time of the pass.
    """
    start = time.perf_counter()
    arr, capacity = check_lengths(lengths, plan.capacity)
    if arr.shape[0] != plan.num_items:
        raise ValueError(f"plan covers {plan.num_items} items but {arr.shape[0]} lengths were given")
    current = plan
    if arr.shape[0]:
        target = martello_toth_l2(arr, capacity)
        for _ in range(max_rounds):
            if current.num_packs <= target:
                break
            better = _refine_round(arr, current, target)
            if better is None:
                break
            current = better
    return _make_plan(
        np.array(current.pack_of_item),
        np.array(current.order),
        np.array(current.pack_offsets),
        np.array(current.pack_load),
        capacity,
        plan.algorithm + "+refine",
        refine_seconds=time.perf_counter() - start,
    )

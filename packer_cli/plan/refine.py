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

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _kernels as K
from ._refine_kernels import _collect, _compose, _rebuild
from ._validate import check_lengths
from .bounds import _l2_of_histogram
from .plan import PackPlan, _make_plan

__all__ = ["refine_plan"]

#: Thresholds tried, as fractions of the capacity (``capacity // d``).
_THRESHOLD_DIVISORS = (64, 32, 16, 8, 128, 4)
#: Third-item candidates tried per pack when no exact pair closes it.
_MAX_TRIPLES = 64
#: Pools at least this large try two thresholds at a time, one per thread (the kernel
#: releases the GIL); below it a thread's start costs more than the rebuild.
_PARALLEL_POOL = 50_000


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # what this process may run on (Linux), not the machine
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _rebuilds(arr: np.ndarray, pool: np.ndarray, capacity: int):
    """``_rebuild`` of ``pool`` under each threshold, yielded in ``_THRESHOLD_DIVISORS`` order.

    On a large pool with two CPUs the next threshold is rebuilt on a second thread while this
    one is, and while the caller looks at a result; a caller that stops early has wasted at
    most that one. The results and their order are the same either way."""
    thresholds = [max(1, capacity // divisor) for divisor in _THRESHOLD_DIVISORS]
    if pool.size < _PARALLEL_POOL or _usable_cpus() < 2:
        for threshold in thresholds:
            yield _rebuild(arr, pool, capacity, threshold, _MAX_TRIPLES)
        return
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="packer-refine") as workers:
        running = [workers.submit(_rebuild, arr, pool, capacity, t, _MAX_TRIPLES) for t in thresholds[:2]]
        for threshold in thresholds[2:]:
            yield running.pop(0).result()
            running.append(workers.submit(_rebuild, arr, pool, capacity, threshold, _MAX_TRIPLES))
        for future in running:
            yield future.result()


def _refine_round(arr: np.ndarray, plan: PackPlan, target: int, in_place: bool = False):
    """One round: rebuild the non-full packs; return a better plan or None.

    Memory: the pool (items of non-full packs, usually a small share) costs
    4 bytes per pooled item and each rebuild 12 (the best so far, the one looked at and, on a
    large pool, the one rebuilt meanwhile); the new ``order`` 4 bytes per item, or nothing
    with ``in_place`` (``plan.order`` is rewritten, so ``plan`` must not be
    used again once a better plan is returned).
    """
    capacity = plan.capacity
    nonfull = plan.pack_load < capacity
    num_nonfull = int(nonfull.sum())
    if num_nonfull <= 1:
        return None
    # Sorted by item index so equal lengths are taken in index order.
    pool = np.sort(_collect(plan.order, plan.pack_offsets, np.flatnonzero(nonfull)))
    kept_packs = np.flatnonzero(~nonfull)
    kept = kept_packs.size
    best = None
    for sequence, ends, num_new in _rebuilds(arr, pool, capacity):
        if num_new < num_nonfull and (best is None or num_new < best[2]):
            best = (sequence, ends[: num_new + 1].copy(), num_new)
            if kept + num_new <= target:
                break
    if best is None:
        return None
    sequence, ends, num_new = best
    del pool
    # Kept (full) packs first in their old order, then the new packs. In place, each kept
    # segment only moves towards the front, so copying forward never overwrites unread items.
    if in_place:
        order = plan.order
        order.setflags(write=True)
    else:
        order = np.empty(plan.order.shape[0], np.int32)
    _compose(plan.order, plan.pack_offsets, kept_packs, sequence, order)
    kept_sizes = np.diff(plan.pack_offsets)[kept_packs]
    offsets = np.concatenate([[0], np.cumsum(kept_sizes), kept_sizes.sum() + ends[1:]])
    new_load = np.add.reduceat(arr[sequence], ends[:-1]) if num_new else np.zeros(0, np.int64)
    load = np.concatenate([plan.pack_load[kept_packs], new_load])
    return _make_plan(order, offsets, load, plan.num_items, capacity, plan.algorithm)


def _refine(arr: np.ndarray, plan: PackPlan, *, max_rounds: int = 4, in_place: bool = False) -> PackPlan:
    """:func:`refine_plan` on validated lengths (empty items allowed, they stay unpacked).

    ``in_place``: reuse ``plan.order`` for the refined order (4 bytes an item less at the
    peak); only for a caller that owns ``plan`` and drops it for the result.
    """
    start = time.perf_counter()
    current = plan
    if plan.order.shape[0]:
        target = _l2_of_histogram(K._length_histogram(arr, plan.capacity), plan.capacity)
        for _ in range(max_rounds):
            if current.num_packs <= target:
                break
            better = _refine_round(arr, current, target, in_place)
            if better is None:
                break
            current = better
    return _make_plan(current.order, current.pack_offsets, current.pack_load, current.num_items, plan.capacity,
                      plan.algorithm + "+refine", refine_seconds=time.perf_counter() - start)


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
    skipped = plan.order.shape[0] != plan.num_items
    arr, _ = check_lengths(lengths, plan.capacity, allow_zero=skipped)
    if arr.shape[0] != plan.num_items:
        raise ValueError(f"plan covers {plan.num_items} items but {arr.shape[0]} lengths were given")
    return _refine(arr, plan, max_rounds=max_rounds)

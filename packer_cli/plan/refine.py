"""Improvement pass: fewer packs, towards the Martello–Toth L2 bound.

Packs filled exactly to capacity cannot be improved on their own, so the pass
keeps them and re-packs the items of every other pack ("the pool") with an
exact-fill heuristic (:func:`packer_cli.plan._refine_kernels._rebuild_sorted`): each
new pack takes the largest pool item, then greedily the largest items that
leave at least ``threshold`` tokens free, then closes the remaining room
exactly with one, two or three items when the pool allows it, and finally
best-fits what is left. Several thresholds are tried (largest items first
matters most when items are big, exact closing when they are small); the
best result is kept only if it beats the input, and rounds repeat on the new
non-full packs while they help. A first-round result that leaves few items in
non-full packs gets its later rounds at once, so a first round whose later
rounds reach the L2 bound stops there instead of trying every threshold on
the whole pool (``_repack``). The first round also tries keeping half a pack free
(``_WIDE_DIVISOR``) when the pool's items are large (median at least C/8): exact pairs and
triples of such items close half a pack where they rarely close a quarter. Every round
finally tries a balanced greedy phase (``_BALANCED_DIVISORS``), which after the largest item
takes items of about the pool's mean length instead of the largest, so that narrow length
distributions get the mix of packs of many small and few large items their optimum needs.
Everything is deterministic.
"""

from __future__ import annotations

import numbers
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from packer_cli.errors import interrupts_kept

from ._refine_kernels import _collect, _compose, _rebuild_sorted, _sort_pool
from ._validate import check_lengths
from .bounds import _best_of_lengths
from .plan import PackPlan, _make_plan, check_layout, check_loads_fit

__all__ = ["refine_plan"]

#: Thresholds tried, as fractions of the capacity (``capacity // d``).
_THRESHOLD_DIVISORS = (8, 64, 32, 16, 128, 4)
#: Third-item candidates tried per pack when no exact pair closes it.
_MAX_TRIPLES = 64
#: The first round's extra threshold, ``capacity // _WIDE_DIVISOR`` (half a pack kept free for
#: the exact phase), tried where the pool's median length is at least ``capacity //
#: _WIDE_MEDIAN_DIVISOR``. With the six thresholds above, lengths of median C/4 (lognormal,
#: sigma 0.5, 100k items) ended 58-145 packs above the bound at C = 8k-1M: the exact phase had
#: to close a quarter of a pack with items of about that size, which two or three of them
#: rarely sum to exactly. Half a pack, closed by a pair or a triple of them, reached 0-12.
#: Of 400 random lognormal, gamma and normal sets (C = 2k-128k, 30k-300k items;
#: ``benchmarks/bench_refine.py --shapes 200``, seeds 11 and 12) it gave fewer packs on 82 and
#: more on one (423 against 419 above the bound: the first round's best rebuild is not always
#: the one whose later rounds end best), in about the same time.
_WIDE_DIVISOR = 2
_WIDE_MEDIAN_DIVISOR = 8
#: Third-item candidates for the wide threshold: four closed as many packs as 64 there, where
#: each failed candidate costs a pair search over up to 16k sizes (64 made the extra rebuild
#: cost up to 2-3 s at C = 128k, 300k items; four, 0.1-0.2 s).
_WIDE_TRIPLES = 4
#: Thresholds (``capacity // d``) tried, after the others, with the balanced greedy phase
#: (``_rebuild_body``'s ``balanced``: no item above the room's share of the pool's mean
#: length), in every round, with ``_BALANCED_TRIPLES`` third-item candidates. Lengths spread
#: narrowly around a fifth of a pack (normal, mean C/5, sd 14 % of it, 30k items at C = 4096)
#: ended 114 packs above the bound without them (about 2 %; rounding the linear programming
#: relaxation's solution packs the same lengths in 8 above it, so the gap is the heuristic's)
#: and 42 with them (``benchmarks/bench_lp.py``). Of 400 random lognormal, gamma and normal
#: sets (``benchmarks/bench_refine.py --shapes 200``, seeds 11 and 12) 79 got fewer packs and
#: none more, in about the same time; lengths of a few values (``bench_refine.py``) kept their
#: packs or gained more. Four third-item candidates close as many packs as 64 here, at a
#: third of the time at C = 128k.
_BALANCED_DIVISORS = (8, 16)
_BALANCED_TRIPLES = 4
#: Pools at least this large try two thresholds at a time, one per thread (the kernel
#: releases the GIL); below it a thread's start costs more than the rebuild.
_PARALLEL_POOL = 50_000
#: A first-round rebuild gets its later rounds at once when the items of its non-full packs
#: are at most this fraction (1 / share) of the pool (see ``_repack``).
_LOOK_AHEAD_SHARE = 4


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # what this process may run on (Linux), not the machine
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _rebuilds(arr: np.ndarray, pool: np.ndarray, capacity: int, wide: bool = False):
    """``_rebuild`` of ``pool`` under each threshold, yielded in ``_THRESHOLD_DIVISORS`` order,
    then, with ``wide`` and a pool of large items (:func:`_wide_pays`), under the wide one,
    then under the balanced ones (``_BALANCED_DIVISORS``).

    On a large pool with two CPUs the next threshold is rebuilt on a second thread while this
    one is, and while the caller looks at a result. A caller that stops early does not wait
    for the rebuild still running: it finishes on its thread and is dropped. The results and
    their order are the same either way."""
    sorted_pool = _sort_pool(arr, pool, capacity)  # the same for every threshold
    settings = [(max(1, capacity // divisor), _MAX_TRIPLES, False) for divisor in _THRESHOLD_DIVISORS]
    if wide and _wide_pays(sorted_pool[1], capacity):
        settings.append((max(1, capacity // _WIDE_DIVISOR), _WIDE_TRIPLES, False))
    settings += [(max(1, capacity // divisor), _BALANCED_TRIPLES, True) for divisor in _BALANCED_DIVISORS]
    if pool.size < _PARALLEL_POOL or _usable_cpus() < 2:
        for setting in settings:
            yield _rebuild_sorted(*sorted_pool, capacity, *setting)
        return
    workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="packer-refine")
    try:
        running = [workers.submit(_rebuild_sorted, *sorted_pool, capacity, *setting) for setting in settings[:2]]
        for setting in settings[2:]:
            yield running.pop(0).result()
            running.append(workers.submit(_rebuild_sorted, *sorted_pool, capacity, *setting))
        for future in running:
            yield future.result()
    finally:
        workers.shutdown(wait=False, cancel_futures=True)


def _wide_pays(sorted_sizes: np.ndarray, capacity: int) -> bool:
    """Whether the wide threshold is worth a rebuild: the pool's median length (``sorted_sizes``
    ascending) is at least C / ``_WIDE_MEDIAN_DIVISOR``. Smaller items close half a pack with
    three of them only at its low end, and there the rebuild gained nothing (and took up to
    three times the six others' time at C = 128k)."""
    return sorted_sizes.size > 0 and _WIDE_MEDIAN_DIVISOR * int(sorted_sizes[sorted_sizes.size // 2]) >= capacity


def _repack(arr: np.ndarray, pool: np.ndarray, num_packs: int, capacity: int, goal: int, rounds: int,
            look_ahead: bool = False, wide: bool = False):
    """A packing of ``pool`` (item indices, ascending) into fewer than ``num_packs`` packs, as
    ``(sequence, ends)`` (pack ``q`` is ``sequence[ends[q]:ends[q + 1]]``), or None.

    One round rebuilds the pool under each threshold and keeps the one with fewest packs;
    later rounds (``rounds`` in all) re-pack that one's non-full packs. It stops as soon as a
    packing has at most ``goal`` packs (the L2 bound less the packs kept outside the pool).

    ``wide`` (the first round): try the wide threshold too (:func:`_rebuilds`).

    ``look_ahead`` (the first round): a rebuild that is the round's best so far and leaves
    few items in non-full packs (at most ``1 / _LOOK_AHEAD_SHARE`` of the pool) gets its
    later rounds at once, before the next threshold's rebuild is looked at. Those rounds work
    on a small pool, and when they reach the bound the remaining first-round rebuilds, the
    expensive ones, are skipped. Otherwise nothing is lost: the round's final best gets its
    later rounds either way, and the packing with the fewest packs found is returned.
    """
    round_best = num_packs
    pending = None  # the round's best rebuild, its later rounds not run yet
    found = None  # the best packing after later rounds
    for sequence, ends, num in _rebuilds(arr, pool, capacity, wide):
        if num >= round_best:
            continue
        round_best = num
        ends = ends[: num + 1].copy()
        if num <= goal:
            return sequence, ends
        nonfull = np.add.reduceat(arr[sequence], ends[:-1]) < capacity
        rebuild = (sequence, ends, nonfull)
        if look_ahead and np.diff(ends)[nonfull].sum() * _LOOK_AHEAD_SHARE <= pool.size:
            pending = None
            found = _fewer(found, _later_rounds(arr, rebuild, capacity, goal, rounds - 1))
            if found[1].size - 1 <= goal:
                return found
        else:
            pending = rebuild
    if pending is not None:
        found = _fewer(found, _later_rounds(arr, pending, capacity, goal, rounds - 1))
    return found


def _fewer(packing, other):
    """Of two ``(sequence, ends)`` packings (the first may be None), the one with fewer packs;
    the first on a tie."""
    return other if packing is None or other[1].size < packing[1].size else packing


def _later_rounds(arr: np.ndarray, rebuild, capacity: int, goal: int, rounds: int):
    """A rebuild ``(sequence, ends, nonfull)`` with its non-full packs re-packed by up to
    ``rounds`` more rounds: its full packs first, in their order, then the re-packed ones (or
    the rebuild as it is)."""
    sequence, ends, nonfull = rebuild
    num_nonfull = int(np.count_nonzero(nonfull))
    if rounds == 0 or num_nonfull <= 1:
        return sequence, ends
    full_packs = np.flatnonzero(~nonfull)
    pool = np.sort(_collect(sequence, ends, np.flatnonzero(nonfull)))
    repacked = _repack(arr, pool, num_nonfull, capacity, goal - full_packs.size, rounds)
    if repacked is None:
        return sequence, ends
    return _join(sequence, ends, full_packs, *repacked)


def _join(sequence, ends, kept_packs, new_sequence, new_ends, out=None):
    """The ``kept_packs`` of ``(sequence, ends)``, in their order, then the packs of
    ``(new_sequence, new_ends)``, as one ``(sequence, ends)`` (written into ``out`` if given)."""
    kept_sizes = np.diff(ends)[kept_packs]
    if out is None:
        out = np.empty(int(kept_sizes.sum()) + new_sequence.size, np.int32)
    _compose(sequence, ends, kept_packs, new_sequence, out)
    joined_ends = np.concatenate([[0], np.cumsum(kept_sizes), kept_sizes.sum() + new_ends[1:]])
    return out, joined_ends


def _optimal_for_one_length(pool_lengths: np.ndarray, num_packs: int, capacity: int) -> bool:
    """Whether ``num_packs`` packs of a pool whose items all have one length are already the
    fewest: ``ceil(n / floor(C / s))``. The L2 bound is weak there (about n/3 packs where n/2
    are needed), so without this every setting re-packed the whole pool and gained nothing:
    1M items of one length took 0.3-0.8 s more than first fit's 0.02 s."""
    if pool_lengths.size == 0 or pool_lengths.min() != pool_lengths.max() or pool_lengths[0] <= 0:
        return False
    return _fewest_of_one_length(int(pool_lengths[0]), pool_lengths.size, num_packs, capacity)


def _fewest_of_one_length(length: int, count: int, num_packs: int, capacity: int) -> bool:
    """Whether ``num_packs`` packs of ``count`` items of ``length`` tokens are the fewest."""
    per_pack = capacity // length
    return per_pack > 0 and num_packs <= -(-count // per_pack)


def _one_packed_length(arr: np.ndarray) -> int:
    """The length every packed item has (empty items are never packed), 0 when they differ.

    Checked on the lengths as they are, before the pool is gathered and sorted: for 1M items
    of one length that took 35-50 ms of a 45 ms pass (first fit itself: 9 ms)."""
    packed = arr if arr.size == 0 or arr.min() > 0 else arr[arr > 0]
    if packed.size == 0:
        return 0
    low = int(packed.min())
    return low if low == int(packed.max()) else 0


def _refine(arr: np.ndarray, plan: PackPlan, *, max_rounds: int = 4, in_place: bool = False) -> PackPlan:
    """:func:`refine_plan` on validated lengths (empty items allowed, they stay unpacked).

    ``in_place``: write the refined order into ``plan.order`` (4 bytes an item less at the
    peak); only for a caller that owns ``plan`` and drops it for the result.

    Memory: the pool (items of non-full packs, usually a small share) costs 4 bytes per
    pooled item, its copy sorted by length 8 more (item and length) while a round runs, and
    the first round up to 16 more: 4 for each packing it holds (the best
    rebuild or the best packing after later rounds, the one looked at and, on a large pool,
    the one rebuilt meanwhile; briefly both the best rebuild and its later rounds' result).
    Later rounds work on smaller pools.
    """
    start = time.perf_counter()
    capacity = plan.capacity
    current = plan
    nonfull = plan.pack_load < capacity
    num_nonfull = int(nonfull.sum())
    one_length = _one_packed_length(arr) if num_nonfull > 1 else 0
    already_fewest = bool(one_length) and _fewest_of_one_length(
        one_length, int(np.diff(plan.pack_offsets)[nonfull].sum()), num_nonfull, capacity)
    if max_rounds > 0 and plan.order.shape[0] and num_nonfull > 1 and not already_fewest:
        target = _best_of_lengths(arr, capacity)
        kept_packs = np.flatnonzero(~nonfull)
        if plan.num_packs > target:
            # Sorted by item index so equal lengths are taken in index order.
            pool = np.sort(_collect(plan.order, plan.pack_offsets, np.flatnonzero(nonfull)))
            repacked = None
            if not _optimal_for_one_length(arr[pool], num_nonfull, capacity):
                repacked = _repack(arr, pool, num_nonfull, capacity, target - kept_packs.size, max_rounds,
                                   look_ahead=True, wide=True)
            del pool
            if repacked is not None:
                current = _with_packs(arr, plan, kept_packs, *repacked, in_place=in_place)
    return _make_plan(current.order, current.pack_offsets, current.pack_load, current.num_items, capacity,
                      plan.algorithm + "+refine", refine_seconds=time.perf_counter() - start)


def _with_packs(arr, plan: PackPlan, kept_packs, sequence, ends, *, in_place: bool) -> PackPlan:
    """``plan``'s ``kept_packs`` (full ones) in their old order, then the new packs."""
    # In place, each kept segment only moves towards the front, so copying forward never
    # overwrites unread items.
    if in_place:
        out = plan.order
        out.setflags(write=True)
    else:
        out = np.empty(plan.order.shape[0], np.int32)
    order, offsets = _join(plan.order, plan.pack_offsets, kept_packs, sequence, ends, out)
    new_load = np.add.reduceat(arr[sequence], ends[:-1])
    load = np.concatenate([plan.pack_load[kept_packs], new_load])
    return _make_plan(order, offsets, load, plan.num_items, plan.capacity, plan.algorithm)


@interrupts_kept
def refine_plan(lengths, plan: PackPlan, *, max_rounds: int = 4) -> PackPlan:
    """Reduce the number of packs of ``plan``.

    Keeps every pack that is filled exactly to capacity and re-packs the items
    of the others with an exact-fill heuristic, trying several settings and
    keeping the best; repeats while it helps (at most ``max_rounds`` rounds)
    and stops early at a lower bound (the largest of Martello–Toth L2, the Fekete–Schepers
    bound, which sees pairs of items L2 counts only by their sum, and, where the lengths take
    at most 64 values, Fekete–Schepers applied beside the items over half a pack). The result is deterministic, keeps
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
    if not isinstance(plan, PackPlan):
        raise TypeError(f"plan must be a PackPlan, got {type(plan).__name__}")
    if not isinstance(max_rounds, numbers.Integral) or isinstance(max_rounds, bool) or max_rounds < 0:
        raise ValueError(f"max_rounds must be an integer >= 0, got {max_rounds!r}")
    skipped = plan.order.shape[0] != plan.num_items
    arr, _ = check_lengths(lengths, plan.capacity, allow_zero=skipped)
    if arr.shape[0] != plan.num_items:
        raise ValueError(f"plan covers {plan.num_items} items but {arr.shape[0]} lengths were given")
    check_layout(plan, arr, skipped)  # the kernels below index with it unchecked
    loads = np.add.reduceat(arr[plan.order], plan.pack_offsets[:-1]) if plan.num_packs else np.zeros(0, np.int64)
    if not np.array_equal(loads, plan.pack_load):  # other lengths would be re-packed past the capacity
        raise ValueError("the plan's pack loads are not the sums of these lengths: the plan was made for others")
    check_loads_fit(plan, plan.capacity)
    return _refine(arr, plan, max_rounds=int(max_rounds))

"""Balance packs over data-parallel ranks: every rank's share of a step costs about the same.

Under data parallelism every rank waits for the slowest at the step's gradient all-reduce, so a
step lasts as long as the rank whose packs cost the most. Packs of ``C`` tokens all cost about
the same in the token-wise layers, but attention grows with ``Σ sᵢ²``: at ``C = 32768`` one pack
holding a single 32k-token sample does over 100 times the attention work of one holding
a hundred 300-token samples (32768² against 100 · 300²). Dealt at random, some rank gets the
expensive ones.

:func:`balance_ranks` deals each step's packs again: *longest processing time first* with a
cardinality limit. The step's packs are taken by decreasing cost (ties by position), and each
goes to the rank with the least cost so far among those still short of their ``per_rank``
packs (ties to the lowest rank). Every rank gets exactly ``per_rank`` packs of each group, and
the result depends only on the costs, so every rank computes the same assignment without
communicating.

    >>> balance_ranks([9.0, 1.0, 8.0, 2.0], ranks=2, per_rank=2).tolist()   # doctest: +SKIP
    [0, 0, 1, 1]                      # rank 0: 9 + 1, rank 1: 8 + 2
"""

from __future__ import annotations

import numpy as np

from packer_cli._kernel_cache import njit

from ._config import NJIT_FLAGS

__all__ = ["balance_ranks"]


@njit(**NJIT_FLAGS)
def _less(loads, heap, a, b):
    """Heap order: lower load first, then lower rank (the tie rule of the linear scan)."""
    ra, rb = heap[a], heap[b]
    return loads[ra] < loads[rb] or (loads[ra] == loads[rb] and ra < rb)


@njit(**NJIT_FLAGS)
def _sift_down(loads, heap, size, at):
    while True:
        smallest, left = at, 2 * at + 1
        if left < size and _less(loads, heap, left, smallest):
            smallest = left
        if left + 1 < size and _less(loads, heap, left + 1, smallest):
            smallest = left + 1
        if smallest == at:
            return
        heap[at], heap[smallest] = heap[smallest], heap[at]
        at = smallest


@njit(**NJIT_FLAGS)
def _balance_groups(costs, ranks, per_rank):
    """Rank of every item, consecutive groups of ``ranks * per_rank`` items balanced apart.

    A binary heap of the ranks still open, keyed by ``(load, rank)``, stands in for the scan
    of all ranks each item would take: O(n log ranks) instead of O(n · ranks), which matters
    at thousands of ranks. The loads are added in the same order either way, so the result is
    the scan's to the bit (the tests compare them)."""
    group = ranks * per_rank
    out = np.empty(costs.shape[0], np.int64)
    loads = np.empty(ranks, np.float64)
    counts = np.empty(ranks, np.int64)
    heap = np.empty(ranks, np.int64)
    for first in range(0, costs.shape[0], group):
        part = costs[first:first + group]
        order = np.argsort(-part, kind="mergesort")  # decreasing cost, ties by position
        loads[:] = 0.0
        counts[:] = 0
        for r in range(ranks):
            heap[r] = r  # all loads 0: ordered by rank, already a heap
        size = ranks
        for k in range(group):
            item = order[k]
            rank = heap[0]
            out[first + item] = rank
            loads[rank] += part[item]
            counts[rank] += 1
            if counts[rank] == per_rank:  # full: leaves the heap
                size -= 1
                heap[0] = heap[size]
            _sift_down(loads, heap, size, 0)
    return out


def balance_ranks(costs, ranks: int, per_rank: int) -> np.ndarray:
    """The rank (``0 .. ranks-1``) of every item; see the module docstring for the rule.

    Parameters
    ----------
    costs : array of float, length a multiple of ``ranks * per_rank``
        Cost of each item (for packs: what a step spends on it, e.g. its training FLOPs),
        finite and ``>= 0``. Each consecutive group of ``ranks * per_rank`` items is balanced
        on its own (a group is one training step's packs).
    ranks, per_rank : int
        Data-parallel ranks, and the items each gets of every group.

    Returns
    -------
    int64 array, one rank per item: each rank appears ``per_rank`` times in every group.
    """
    for name, value in (("ranks", ranks), ("per_rank", per_rank)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    arr = np.ascontiguousarray(costs, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"costs must be one-dimensional, got shape {arr.shape}")
    group = int(ranks) * int(per_rank)
    if arr.size % group:
        raise ValueError(f"{arr.size} costs do not make whole groups of ranks * per_rank = {group}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        bad = int(np.flatnonzero(~np.isfinite(arr) | (arr < 0))[0])
        raise ValueError(f"costs must be finite and >= 0; item {bad} costs {float(arr[bad])!r}")
    with np.errstate(over="ignore"):
        overflows = arr.size > 0 and not np.isfinite(arr.sum())
    if overflows:
        # Finite costs whose sums overflow: the ranks' running loads would turn to inf and every
        # later pack go to the lowest rank. Scaled to at most 1 a pack, no sum can overflow.
        arr = arr / arr.max()
    return _balance_groups(arr, int(ranks), int(per_rank))

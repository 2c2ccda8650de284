"""Private numba kernels of the refinement pass (:mod:`packer_cli.plan.refine`)."""

from __future__ import annotations

import numpy as np
from numba import njit

from ._config import NJIT_FLAGS
from ._kernels import _bitset_clear, _bitset_layout, _bitset_prev, _bitset_set


@njit(**NJIT_FLAGS)
def _pool_take(size, counts, fill, bits, offsets):
    """Index (into the pool's size-sorted item list) of the next item of ``size``."""
    k = fill[size]
    fill[size] = k + 1
    counts[size] -= 1
    if counts[size] == 0:
        _bitset_clear(bits, offsets, size)
    return k


@njit(**NJIT_FLAGS)
def _find_pair(room, counts, bits, offsets):
    """Sizes ``(a, b)``, ``a <= b``, ``a + b == room``, both available; the most
    balanced such pair. Returns ``(-1, -1)`` when there is none."""
    a = _bitset_prev(bits, offsets, room // 2)
    while a >= 1:
        b = room - a
        if counts[a] > 0 and counts[b] > 0 and (b != a or counts[a] >= 2):
            return a, b
        a = _bitset_prev(bits, offsets, a - 1)
    return -1, -1



@njit(**NJIT_FLAGS)
def _place(s, placed, room, by_size, counts, fill, bits, offs, pool, sequence):
    """Take one pooled item of length ``s`` into the open pack; returns the new (placed, room)."""
    k = by_size[_pool_take(s, counts, fill, bits, offs)]
    sequence[placed] = pool[k]
    return placed + 1, room - s

@njit(**NJIT_FLAGS)
def _rebuild(lengths, pool, capacity, threshold, max_triples):
    """Pack a pool of items, aiming at packs filled exactly to ``capacity``.

    Each pack takes the largest remaining item, then greedily the largest item
    that leaves at least ``threshold`` free, then tries to close the remaining
    room exactly with one item, a pair, or a triple (at most ``max_triples``
    candidates for the third item), and finally falls back to best fit
    (largest item that fits, repeatedly).

    Parameters
    ----------
    lengths : int[N]
        Lengths of all items.
    pool : int32[M]
        The pool's item indices (lengths in ``[1, capacity]``).
    capacity : int
    threshold : int
        Room kept free by the greedy phase for the exact phase.
    max_triples : int
        Bound on third-item candidates tried per pack.

    Returns
    -------
    sequence : int32[M]
        Pool items grouped by new pack, in placement order (packs are built one
        after another, so placement order is already grouped).
    ends : int64[M + 1]
        New pack ``q`` holds ``sequence[ends[q]:ends[q + 1]]`` (only the first
        ``num_packs + 1`` entries are set).
    num_packs : int
    """
    m = pool.shape[0]
    counts = np.zeros(capacity + 1, np.int64)
    for k in range(m):
        counts[lengths[pool[k]]] += 1
    starts = np.zeros(capacity + 2, np.int64)
    for s in range(capacity + 1):
        starts[s + 1] = starts[s] + counts[s]
    fill = starts[: capacity + 1].copy()
    by_size = np.empty(m, np.int32)
    for k in range(m):
        s = lengths[pool[k]]
        by_size[fill[s]] = k
        fill[s] += 1
    fill[:] = starts[: capacity + 1]

    offs = _bitset_layout(capacity + 1)
    bits = np.zeros(offs[-1], np.uint64)
    for s in range(1, capacity + 1):
        if counts[s] > 0:
            _bitset_set(bits, offs, s)

    sequence = np.empty(m, np.int32)
    ends = np.empty(m + 1, np.int64)
    ends[0] = 0
    placed = 0
    pack = 0
    while placed < m:
        room = capacity
        # 1. largest remaining item
        s = _bitset_prev(bits, offs, room)
        placed, room = _place(s, placed, room, by_size, counts, fill, bits, offs, pool, sequence)
        # 2. greedy, keeping ``threshold`` free
        while placed < m and room > threshold:
            s = _bitset_prev(bits, offs, room - threshold)
            if s < 1:
                break
            placed, room = _place(s, placed, room, by_size, counts, fill, bits, offs, pool, sequence)
        # 3. exact close: one item, a pair, a triple
        if placed < m and room > 0:
            a = -1
            b = -1
            c = -1
            if counts[room] > 0:
                a = room
            else:
                a, b = _find_pair(room, counts, bits, offs)
                if a < 0:
                    tries = 0
                    c = _bitset_prev(bits, offs, room - 2)
                    while c >= 1 and tries < max_triples:
                        counts[c] -= 1
                        a, b = _find_pair(room - c, counts, bits, offs)
                        counts[c] += 1
                        if a >= 0:
                            break
                        tries += 1
                        c = _bitset_prev(bits, offs, c - 1)
                    if a < 0:
                        c = -1
            for s in (c, a, b):
                if s > 0:
                    placed, room = _place(s, placed, room, by_size, counts, fill, bits, offs, pool, sequence)
        # 4. best fit for whatever room is left
        while placed < m and room > 0:
            s = _bitset_prev(bits, offs, room)
            if s < 1:
                break
            placed, room = _place(s, placed, room, by_size, counts, fill, bits, offs, pool, sequence)
        pack += 1
        ends[pack] = placed
    return sequence, ends, pack


@njit(**NJIT_FLAGS)
def _collect(order, offsets, packs):
    """The items of ``packs`` (their grouped segments concatenated), int32."""
    total = 0
    for q in packs:
        total += offsets[q + 1] - offsets[q]
    out = np.empty(total, np.int32)
    k = 0
    for q in packs:
        for i in range(offsets[q], offsets[q + 1]):
            out[k] = order[i]
            k += 1
    return out


@njit(**NJIT_FLAGS)
def _compose(order, offsets, kept_packs, sequence, out):
    """``out`` = the kept packs' segments (old order), then ``sequence``."""
    k = 0
    for q in kept_packs:
        for i in range(offsets[q], offsets[q + 1]):
            out[k] = order[i]
            k += 1
    out[k:] = sequence

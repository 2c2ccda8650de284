"""Private numba kernels of the refinement pass (:mod:`packer_cli.plan.refine`)."""

from __future__ import annotations

import numpy as np

from packer_cli._kernel_cache import njit

from ._config import NJIT_FLAGS, NJIT_INLINE_FLAGS
from ._kernels import _ALL, _ONE, _bitset_clear, _bitset_layout, _bitset_prev, _bitset_set, _msb


# The pool's available sizes are kept twice: in a hierarchical bitset (bit ``s`` set while an
# item of size ``s`` is left; "largest size <= x" queries) and, level 0 only, mirrored (bit
# ``capacity - s``). The mirror turns "is ``room - a`` available too?" for 64 candidate sizes
# ``a`` at once into one AND: bit ``a`` of the mirror read from bit ``capacity - room`` on is
# bit ``room - a`` of the sizes. The exact-close step asks that question up to 64 times per
# pack (once per third item tried), so a scan over every available size below ``room / 2``
# (up to ``capacity / 2`` of them on a dense length distribution) was most of the pass's time.


#: Words of candidate sizes one pair search looks at (64 sizes each, from ``room / 2`` down):
#: all of them up to C = 2**15, the 16,384 sizes closest to balanced beyond. Unbounded, the
#: search cost O(C / 64) a call, up to 65 calls a pack: 23 s at C = 2**24 for 30,000 items.
PAIR_WORDS = 256


@njit(**NJIT_INLINE_FLAGS)
def _mirror_words(capacity):
    """Words of the mirrored bitset: bits 0..capacity plus one word read past the last."""
    return (capacity + 64) // 64 + 1


@njit(**NJIT_INLINE_FLAGS)
def _mirror_set(mirror, bit):
    mirror[bit >> 6] |= _ONE << np.uint64(bit & 63)


@njit(**NJIT_INLINE_FLAGS)
def _mirror_clear(mirror, bit):
    mirror[bit >> 6] &= ~(_ONE << np.uint64(bit & 63))


@njit(**NJIT_INLINE_FLAGS)
def _mirror_window(mirror, start):
    """64 bits of ``mirror`` from bit ``start`` on (bit j of the result is bit start + j)."""
    q = start >> 6
    r = start & 63
    if r == 0:
        return mirror[q]
    return (mirror[q] >> np.uint64(r)) | (mirror[q + 1] << np.uint64(64 - r))


@njit(**NJIT_INLINE_FLAGS)
def _pool_take(size, counts, fill, bits, offsets, mirror, capacity):
    """Index (into the pool's size-sorted item list) of the next item of ``size``."""
    k = fill[size]
    fill[size] = k + 1
    counts[size] -= 1
    if counts[size] == 0:
        _bitset_clear(bits, offsets, size)
        _mirror_clear(mirror, capacity - size)
    return k


@njit(**NJIT_INLINE_FLAGS)
def _find_pair(room, counts, bits, offsets, mirror, capacity, sparse):
    """Sizes ``(a, b)``, ``a <= b``, ``a + b == room``, both available; the most
    balanced such pair. Returns ``(-1, -1)`` when there is none.

    Candidates come 64 at a time from ``bits`` (level 0: sizes ``a``) AND the mirror
    (sizes ``room - a``); each is confirmed by ``counts``, which the caller may have lowered
    below what the bits say (a third item held out) and which decides ``a == b``.

    ``sparse`` (a compile-time constant, see ``_rebuild_sorted``): jump over words with no
    size ``a``, which level 1 of the bitset tells 64 words at a time. On a sparse pool at a
    large capacity most words are empty (2-3.5x faster at C = 2**20-2**24); on a dense one
    the extra branch in this loop alone made the pass 2.5x slower, taken or not."""
    half = room // 2
    if half < 1:
        return -1, -1
    shift = capacity - room
    w = half >> 6
    top = _ALL >> np.uint64(63 - (half & 63))
    stop = max(-1, w - PAIR_WORDS)  # the most balanced candidates come first; see PAIR_WORDS
    while w > stop:
        cand = bits[w] & _mirror_window(mirror, (w << 6) + shift) & top
        top = _ALL
        while cand != np.uint64(0):
            t = _msb(cand)
            a = (w << 6) + t
            b = room - a
            if a >= 1 and counts[a] > 0 and counts[b] > 0 and (b != a or counts[a] >= 2):
                return a, b
            cand &= ~(_ONE << np.uint64(t))
        w -= 1
        if sparse and w > stop and bits[w] == np.uint64(0) and offsets.shape[0] > 2:
            while w > stop:
                block = bits[offsets[1] + (w >> 6)] & (_ALL >> np.uint64(63 - (w & 63)))
                if block != np.uint64(0):
                    w = ((w >> 6) << 6) + _msb(block)
                    break
                w = ((w >> 6) << 6) - 1
    return -1, -1


@njit(**NJIT_INLINE_FLAGS)
def _place(s, placed, room, items, counts, fill, bits, offs, mirror, capacity, sequence):
    """Take one pooled item of length ``s`` into the open pack; returns the new (placed, room)."""
    sequence[placed] = items[_pool_take(s, counts, fill, bits, offs, mirror, capacity)]
    return placed + 1, room - s


@njit(**NJIT_INLINE_FLAGS)
def _sparse(capacity, num_items):
    """A pool whose items are few against the capacity: its pair searches jump over empty
    words (see ``_find_pair``)."""
    return capacity > 8 * num_items


@njit(**NJIT_FLAGS)
def _sort_pool(lengths, pool, capacity):
    """The pool's items ordered by length, pool order within a length, and their lengths:
    ``(items int32[M], sizes int32[M])``, ``sizes`` ascending (lengths are at most
    ``MAX_CAPACITY``, 2**24).

    A counting sort (a table of C + 1 entries) unless the capacity is far above the pool's
    size, then a stable comparison sort: at C = 2**22 a pool of a few thousand items would
    otherwise walk a table of four million sizes."""
    m = pool.shape[0]
    sizes = np.empty(m, np.int32)
    for k in range(m):
        sizes[k] = lengths[pool[k]]
    if capacity > 32 * m:
        order = np.argsort(sizes, kind="mergesort")
        return pool[order], sizes[order]
    starts = np.zeros(capacity + 2, np.int64)
    for k in range(m):
        starts[sizes[k] + 1] += 1
    for s in range(capacity + 1):
        starts[s + 1] += starts[s]
    items = np.empty(m, np.int32)
    sorted_sizes = np.empty(m, np.int32)
    for k in range(m):
        s = sizes[k]
        items[starts[s]] = pool[k]
        sorted_sizes[starts[s]] = s
        starts[s] += 1
    return items, sorted_sizes


@njit(**NJIT_FLAGS)
def _rebuild(lengths, pool, capacity, threshold, max_triples, balanced=False):
    """:func:`_rebuild_sorted` of ``pool``, sorting it first."""
    items, sizes = _sort_pool(lengths, pool, capacity)
    return _rebuild_sorted(items, sizes, capacity, threshold, max_triples, balanced)


@njit(**NJIT_FLAGS)
def _rebuild_sorted(items, sizes, capacity, threshold, max_triples, balanced=False):
    """:func:`_rebuild_body`, compiled twice, once for a sparse pool (see ``_find_pair``)."""
    # Each call inlines the body with ``sparse`` a constant, so the compiler drops the other's
    # branches from the pair search's loop. ``balanced`` only steers the greedy phase, once
    # per item, so it stays a run-time flag.
    if _sparse(capacity, items.shape[0]):
        return _rebuild_body(items, sizes, capacity, threshold, max_triples, True, balanced)
    return _rebuild_body(items, sizes, capacity, threshold, max_triples, False, balanced)


@njit(**NJIT_INLINE_FLAGS)
def _balanced_limit(room, items_left, tokens_left):
    """The largest item the balanced greedy phase takes into ``room``: ``room // k``, where
    ``k`` (at least 1) is how many items of the pool's mean length (``tokens_left /
    items_left``, what is still unplaced) fill ``room``, rounded to the nearest."""
    k = (2 * room * items_left + tokens_left) // (2 * tokens_left)
    return room // k if k > 1 else room


@njit(**NJIT_INLINE_FLAGS)
def _rebuild_body(items, sizes, capacity, threshold, max_triples, sparse, balanced):
    """Pack a pool of items, aiming at packs filled exactly to ``capacity``.

    Each pack takes the largest remaining item, then greedily the largest item
    that leaves at least ``threshold`` free, then tries to close the remaining
    room exactly with one item, a pair, or a triple (at most ``max_triples``
    candidates for the third item), and finally falls back to best fit
    (largest item that fits, repeatedly).

    ``balanced``: the greedy phase takes no item above the room's share of an item of the
    pool's mean length (:func:`_balanced_limit`). Taking the largest items together used up
    the middle sizes as closers and left, on lengths spread narrowly around C/5, packs of five
    items that a sixth does not fit; the optimum mixes packs of five large items with packs
    of six small ones, which a large item followed by items of about the mean length leaves
    room for.

    Parameters
    ----------
    items, sizes : int32[M], int32[M]
        The pool sorted by :func:`_sort_pool` (item indices, and their lengths, each in
        ``[1, capacity]``): the same for every threshold, so a caller trying several sorts
        the pool once.
    capacity : int
    threshold : int
        Room kept free by the greedy phase for the exact phase.
    max_triples : int
        Bound on third-item candidates tried per pack.
    sparse : bool
        Compile-time constant: jump over empty words in pair searches (see ``_find_pair``).
    balanced : bool
        Cap the greedy phase's items at the room's share (above).

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
    # Tables indexed by size, set up from the sorted pool only where a size is present, so a
    # rebuild costs O(M) plus zeroing counts and bitsets (``fill`` is read at present sizes only).
    m = items.shape[0]
    counts = np.zeros(capacity + 1, np.int32)
    fill = np.empty(capacity + 1, np.int64)
    offs = _bitset_layout(capacity + 1)
    bits = np.zeros(offs[-1], np.uint64)
    mirror = np.zeros(_mirror_words(capacity), np.uint64)
    tokens_left = np.int64(0)  # the unplaced items' lengths, at the open pack's start
    for j in range(m):
        s = sizes[j]
        tokens_left += s
        if counts[s] == 0:
            fill[s] = j
            _bitset_set(bits, offs, s)
            _mirror_set(mirror, capacity - s)
        counts[s] += 1

    sequence = np.empty(m, np.int32)
    ends = np.empty(m + 1, np.int64)
    ends[0] = 0
    placed = 0
    pack = 0
    while placed < m:
        room = capacity
        # 1. largest remaining item
        s = _bitset_prev(bits, offs, room)
        placed, room = _place(s, placed, room, items, counts, fill, bits, offs, mirror, capacity, sequence)
        # 2. greedy, keeping ``threshold`` free
        while placed < m and room > threshold:
            limit = room - threshold
            if balanced:
                limit = min(limit, _balanced_limit(np.int64(room), np.int64(m - placed),
                                                   tokens_left - (capacity - room)))
            s = _bitset_prev(bits, offs, limit)
            if s < 1:
                break
            placed, room = _place(s, placed, room, items, counts, fill, bits, offs, mirror, capacity, sequence)
        # 3. exact close: one item, a pair, a triple
        if placed < m and room > 0:
            a = -1
            b = -1
            c = -1
            if counts[room] > 0:
                a = room
            else:
                a, b = _find_pair(room, counts, bits, offs, mirror, capacity, sparse)
                if a < 0:
                    tries = 0
                    c = _bitset_prev(bits, offs, room - 2)
                    while c >= 1 and tries < max_triples:
                        counts[c] -= 1
                        a, b = _find_pair(room - c, counts, bits, offs, mirror, capacity, sparse)
                        counts[c] += 1
                        if a >= 0:
                            break
                        tries += 1
                        c = _bitset_prev(bits, offs, c - 1)
                    if a < 0:
                        c = -1
            for s in (c, a, b):
                if s > 0:
                    placed, room = _place(s, placed, room, items, counts, fill, bits, offs, mirror, capacity,
                                          sequence)
        # 4. best fit for whatever room is left
        while placed < m and room > 0:
            s = _bitset_prev(bits, offs, room)
            if s < 1:
                break
            placed, room = _place(s, placed, room, items, counts, fill, bits, offs, mirror, capacity, sequence)
        tokens_left -= capacity - room
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

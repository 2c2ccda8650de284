"""Private numba kernels of the planner.

Every kernel takes contiguous ``int32``/``int64`` arrays and plain integers and
trusts its caller: validation (lengths in ``[1, capacity]``, capacity in range)
is done by the Python wrappers in :mod:`packer_cli.plan.algorithms`.

Pack numbers are dense and follow opening order. "Placement order" is the order
in which an algorithm assigned items; the grouping kernel turns it into the
``order``/``pack_offsets`` layout of :class:`packer_cli.plan.PackPlan`.
"""

from __future__ import annotations

import numpy as np

from packer_cli._kernel_cache import njit

from ._config import NJIT_FLAGS

# ---------------------------------------------------------------------------
# Ordering
# ---------------------------------------------------------------------------


@njit(**NJIT_FLAGS)
def _length_histogram(lengths, capacity):
    """Count items per length.

    Parameters
    ----------
    lengths : int32[:] or int64[:]
        Item lengths, each in ``[1, capacity]``.
    capacity : int
        Largest possible length.

    Returns
    -------
    counts : int64[capacity + 1]
        ``counts[L]`` is the number of items of length ``L``.
    """
    counts = np.zeros(capacity + 1, np.int64)
    for i in range(lengths.shape[0]):
        counts[lengths[i]] += 1
    return counts


@njit(**NJIT_FLAGS)
def _order_increasing(lengths, counts):
    """Stable counting sort: items by increasing length, ties by input index.

    Returns
    -------
    order : int64[N]
        Item indices; bucket ``L`` occupies ``order[starts[L]:starts[L + 1]]``.
    starts : int64[capacity + 2]
        Bucket boundaries.
    """
    capacity = counts.shape[0] - 1
    starts = np.empty(capacity + 2, np.int64)
    acc = 0
    for length in range(capacity + 1):
        starts[length] = acc
        acc += counts[length]
    starts[capacity + 1] = acc
    fill = starts[: capacity + 1].copy()
    order = np.empty(lengths.shape[0], np.int64)
    for i in range(lengths.shape[0]):
        length = lengths[i]
        order[fill[length]] = i
        fill[length] += 1
    return order, starts


# ---------------------------------------------------------------------------
# Max segment tree (leaves at tree[size:], root at tree[1])
# ---------------------------------------------------------------------------


@njit(**NJIT_FLAGS)
def _tree_find_first(tree, size, lo, need):
    """Leftmost leaf index ``>= lo`` whose value is ``>= need``, or -1.

    Parameters
    ----------
    tree : int32[2 * size] or int64[2 * size]
        Max segment tree; node ``i`` has children ``2i`` and ``2i + 1``.
    size : int
        Number of leaves (a power of two).
    lo : int
        First leaf considered.
    need : int
        Threshold.
    """
    if lo >= size:
        return -1
    i = lo + size
    while tree[i] < need:
        # Move to the next subtree on the right: climb while i is a right child.
        while i & 1:
            i >>= 1
        if i == 0:
            return -1
        i += 1
    while i < size:
        i <<= 1
        if tree[i] < need:
            i += 1
    return i - size


@njit(**NJIT_FLAGS)
def _tree_set(tree, size, leaf, value):
    """Set a leaf and repair its ancestors (stops as soon as nothing changes)."""
    i = leaf + size
    tree[i] = value
    i >>= 1
    while i >= 1:
        left = tree[2 * i]
        right = tree[2 * i + 1]
        best = left if left >= right else right
        if tree[i] == best:
            break
        tree[i] = best
        i >>= 1


# ---------------------------------------------------------------------------
# First fit
# ---------------------------------------------------------------------------


@njit(**NJIT_FLAGS)
def _placed(counts):
    """Number of non-empty items in a length histogram (``counts[0]`` is not placed)."""
    n = 0
    for length in range(1, counts.shape[0]):
        n += counts[length]
    return n


@njit(**NJIT_FLAGS)
def _ffd_positions(counts, capacity, tree):
    """First-fit decreasing, from the length histogram alone.

    Items are placed by decreasing length, ties by input index, so the ``j``-th
    placement ("position" ``j``) is fully determined by the histogram; the
    item behind a position is recovered later by :func:`_positions_to_items`
    or :func:`_scatter_items`, which is why no N-sized order array is needed.

    Equal lengths are handled as one group: once a pack has taken items of
    length ``L`` the next item of that length can only go to the same pack or
    to a later one (earlier packs had no room and never gain any), so the
    search restarts from there, and a pack takes ``min(remaining // L, left)``
    items at once.

    Parameters
    ----------
    counts : int64[top + 1]
        Histogram of the item lengths, ``top <= capacity`` (no item longer than
        ``top``: a window of short items need not count up to the capacity);
        ``counts[0]`` (empty items) is ignored.
    capacity : int
        Pack capacity.
    tree : int32[2 * size]
        Work array; ``size`` is a power of two. Overwritten.

    Returns
    -------
    pack_of_position : int32[n]
        Pack of each placement position (``n = counts[1:].sum()``).
    num_packs : int
        Packs used, or -1 when ``size`` leaves were too few (retry with a
        larger tree).
    """
    n = _placed(counts)
    size = tree.shape[0] // 2
    tree[:] = capacity  # unopened packs read as empty packs
    pack_of_position = np.empty(n, np.int32)
    num_packs = 0
    pos = 0
    for length in range(counts.shape[0] - 1, 0, -1):
        end = pos + counts[length]
        pack = 0
        while pos < end:
            pack = _tree_find_first(tree, size, pack, length)
            if pack < 0:
                return pack_of_position, -1
            room = tree[size + pack]
            take = room // length
            if take > end - pos:
                take = end - pos
            pack_of_position[pos:pos + take] = pack
            pos += take
            _tree_set(tree, size, pack, room - take * length)
            if pack >= num_packs:
                num_packs = pack + 1
            pack += 1
    return pack_of_position, num_packs


@njit(**NJIT_FLAGS)
def _first_fit(seq_lengths, capacity, tree):
    """Plain first fit in the given order (leftmost pack with room).

    Parameters
    ----------
    seq_lengths : int32[M] or int64[M]
        Lengths in processing order.
    capacity : int
        Pack capacity.
    tree : int32[2 * size]
        Work array as in :func:`_ffd_positions`.

    Returns
    -------
    pack_of_position : int32[M]
        Pack of the ``k``-th processed length.
    num_packs : int
    """
    m = seq_lengths.shape[0]
    pack_of_position = np.empty(m, np.int32)
    num_packs = _first_fit_into(seq_lengths, m, capacity, tree, tree.shape[0] // 2, pack_of_position)
    return pack_of_position, num_packs


@njit(**NJIT_FLAGS)
def _first_fit_into(seq_lengths, m, capacity, tree, size, pack_of_position):
    """:func:`_first_fit` of ``seq_lengths[:m]`` into ``pack_of_position[:m]``, over the first
    ``2 * size`` entries of ``tree`` (``size`` a power of two, at least ``m``); the number of
    packs."""
    tree[1:2 * size] = capacity
    num_packs = 0
    for k in range(m):
        length = seq_lengths[k]
        pack = _tree_find_first(tree, size, 0, length)
        _tree_set(tree, size, pack, tree[size + pack] - length)
        pack_of_position[k] = pack
        if pack >= num_packs:
            num_packs = pack + 1
    return num_packs


@njit(**NJIT_FLAGS)
def _best_fit_into(seq_lengths, m, capacity, room, pack_of_position):
    """Plain best fit of ``seq_lengths[:m]`` in the given order (least remaining room that fits,
    ties to the lowest pack), by scanning the open packs: O(M * packs), for the few items of a
    small window, where :func:`_bfd_positions`' tables over the capacity would cost more. The
    pack of each into ``pack_of_position[:m]``, with ``room`` (int64, at least ``m`` entries) as
    work space; returns the number of packs."""
    num_packs = 0
    for k in range(m):
        length = seq_lengths[k]
        best = -1
        for p in range(num_packs):
            if room[p] >= length and (best < 0 or room[p] < room[best]):
                best = p
        if best < 0:
            best = num_packs
            room[best] = capacity
            num_packs += 1
        room[best] -= length
        pack_of_position[k] = best
    return num_packs


# ---------------------------------------------------------------------------
# Hierarchical bitset (64-ary): "first set bit >= pos" in O(log64 n) with few
# branches. Level 0 holds one bit per index; a bit at level l + 1 is set iff
# the matching word at level l is non-zero. Layout: one uint64 array, level l
# starting at word offsets[l].
# ---------------------------------------------------------------------------

_ONE = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_TABLE = np.array(
    [0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4,
     62, 55, 59, 36, 53, 51, 43, 22, 45, 39, 33, 30, 24, 18, 12, 5,
     63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52, 21, 44, 32, 23, 11,
     46, 26, 40, 15, 34, 20, 31, 10, 25, 14, 19, 9, 13, 8, 7, 6],
    dtype=np.int64,
)


@njit(**NJIT_FLAGS)
def _ctz(word):
    """Index of the lowest set bit of a non-zero uint64."""
    low = word & (~word + _ONE)
    return _DEBRUIJN_TABLE[np.int64((low * _DEBRUIJN) >> np.uint64(58))]


@njit(**NJIT_FLAGS)
def _bitset_layout(nbits):
    """Word offsets of each level of a hierarchical bitset over ``nbits`` bits.

    Returns
    -------
    offsets : int64[levels + 1]
        Level ``l`` occupies words ``offsets[l]:offsets[l + 1]``; the bitset
        needs ``offsets[-1]`` zeroed ``uint64`` words.
    """
    levels = 1
    words = (nbits + 63) // 64
    while words > 1:
        words = (words + 63) // 64
        levels += 1
    offsets = np.zeros(levels + 1, np.int64)
    words = (nbits + 63) // 64
    for level in range(levels):
        offsets[level + 1] = offsets[level] + words
        words = (words + 63) // 64
    return offsets


@njit(**NJIT_FLAGS)
def _bitset_next(bits, offsets, pos):
    """Smallest set index ``>= pos``, or -1."""
    levels = offsets.shape[0] - 1
    level = 0
    p = pos
    while True:
        if level == levels:
            return -1
        w = p >> 6
        if offsets[level] + w >= offsets[level + 1]:
            return -1
        masked = bits[offsets[level] + w] & (_ALL << np.uint64(p & 63))
        if masked != np.uint64(0):
            p = (w << 6) | _ctz(masked)
            break
        p = w + 1
        level += 1
    while level > 0:
        level -= 1
        p = (p << 6) | _ctz(bits[offsets[level] + p])
    return p


@njit(**NJIT_FLAGS)
def _msb(word):
    """Index of the highest set bit of a non-zero uint64."""
    word |= word >> np.uint64(1)
    word |= word >> np.uint64(2)
    word |= word >> np.uint64(4)
    word |= word >> np.uint64(8)
    word |= word >> np.uint64(16)
    word |= word >> np.uint64(32)
    return _ctz((word >> np.uint64(1)) + _ONE)


@njit(**NJIT_FLAGS)
def _bitset_prev(bits, offsets, pos):
    """Largest set index ``<= pos``, or -1."""
    if pos < 0:
        return -1
    levels = offsets.shape[0] - 1
    level = 0
    p = pos
    while True:
        if level == levels:
            return -1
        w = p >> 6
        if offsets[level] + w >= offsets[level + 1]:
            # Past the end of this level: clamp to its last bit.
            w = offsets[level + 1] - offsets[level] - 1
            p = (w << 6) | 63
        masked = bits[offsets[level] + w] & (_ALL >> np.uint64(63 - (p & 63)))
        if masked != np.uint64(0):
            p = (w << 6) | _msb(masked)
            break
        if w == 0:
            return -1
        p = w - 1
        level += 1
    while level > 0:
        level -= 1
        p = (p << 6) | _msb(bits[offsets[level] + p])
    return p


@njit(**NJIT_FLAGS)
def _bitset_set(bits, offsets, pos):
    p = pos
    for level in range(offsets.shape[0] - 1):
        w = offsets[level] + (p >> 6)
        was = bits[w]
        bits[w] = was | (_ONE << np.uint64(p & 63))
        if was != np.uint64(0):
            return
        p >>= 6


@njit(**NJIT_FLAGS)
def _bitset_clear(bits, offsets, pos):
    p = pos
    for level in range(offsets.shape[0] - 1):
        w = offsets[level] + (p >> 6)
        now = bits[w] & ~(_ONE << np.uint64(p & 63))
        bits[w] = now
        if now != np.uint64(0):
            return
        p >>= 6


# ---------------------------------------------------------------------------
# Best fit: bitset of non-empty remaining-capacity buckets + one pairing heap
# of pack numbers per bucket (ties go to the lowest pack number).
# ---------------------------------------------------------------------------


@njit(**NJIT_FLAGS)
def _heap_meld(a, b, child, sibling):
    if a < 0:
        return b
    if b < 0:
        return a
    if a < b:
        sibling[b] = child[a]
        child[a] = b
        return a
    sibling[a] = child[b]
    child[b] = a
    return b


@njit(**NJIT_FLAGS)
def _heap_pop(root, child, sibling, stack):
    """Remove the root of a pairing heap; return the new root (two-pass pairing)."""
    c = child[root]
    child[root] = -1
    top = 0
    while c >= 0:
        a = c
        b = sibling[a]
        sibling[a] = -1
        if b < 0:
            stack[top] = a
            top += 1
            break
        c = sibling[b]
        sibling[b] = -1
        stack[top] = _heap_meld(a, b, child, sibling)
        top += 1
    if top == 0:
        return -1
    res = stack[top - 1]
    for j in range(top - 2, -1, -1):
        res = _heap_meld(stack[j], res, child, sibling)
    return res


@njit(**NJIT_FLAGS)
def _bfd_positions(counts, capacity, max_packs, bits, offsets):
    """Best-fit decreasing.

    Each item (decreasing length, ties by index) goes to the pack with the
    least remaining room that still fits, ties to the lowest pack number;
    otherwise a new pack is opened. After pack ``p`` drops from ``r`` to
    ``r - L`` free tokens, the next item of the same length ``L`` goes to ``p``
    again while ``r - L >= L``, with no search: ``r`` was the least room of at
    least ``L`` (or no pack had ``L``), so no pack has a room in ``[L, r)`` and
    ``p`` is still the best fit. That skips most heap work.

    Like :func:`_ffd_positions` it works from the histogram alone and returns
    the pack of each placement position.

    Parameters
    ----------
    counts : int64[top + 1]
        Histogram of the item lengths, ``top <= capacity`` (as for
        :func:`_ffd_positions`); ``counts[0]`` is ignored.
    capacity : int
        Pack capacity.
    max_packs : int
        Upper bound on the number of packs.
    bits : uint64[:]
        Zeroed hierarchical bitset over ``capacity + 1`` bits
        (:func:`_bitset_layout`); bit ``r`` is set when some pack has exactly
        ``r`` free tokens. Overwritten.
    offsets : int64[:]
        Level offsets of ``bits``.

    Returns
    -------
    pack_of_position : int32[n]
    num_packs : int
    """
    n = _placed(counts)
    bucket_root = np.full(capacity + 1, -1, np.int32)
    child = np.full(max_packs, -1, np.int32)
    sibling = np.full(max_packs, -1, np.int32)
    stack = np.empty(max_packs, np.int32)
    pack_of_position = np.empty(n, np.int32)
    num_packs = 0
    pos = 0
    for length in range(counts.shape[0] - 1, 0, -1):
        end = pos + counts[length]
        while pos < end:
            r = _bitset_next(bits, offsets, length)
            if r < 0:
                pack = num_packs
                num_packs += 1
                room = capacity
            else:
                pack = bucket_root[r]
                new_root = _heap_pop(pack, child, sibling, stack)
                bucket_root[r] = new_root
                if new_root < 0:
                    _bitset_clear(bits, offsets, r)
                room = r
            # Place as many items of this length into ``pack`` as best fit allows.
            while True:
                pack_of_position[pos] = pack
                pos += 1
                room -= length
                if pos == end or room < length:
                    break
            if room > 0:
                old_root = bucket_root[room]
                bucket_root[room] = _heap_meld(old_root, pack, child, sibling)
                if old_root < 0:
                    _bitset_set(bits, offsets, room)
    return pack_of_position, num_packs


# ---------------------------------------------------------------------------
# Next fit
# ---------------------------------------------------------------------------


@njit(**NJIT_FLAGS)
def _next_fit(lengths, capacity):
    """Order-preserving next fit: one open pack, a new one when an item does not fit."""
    n = lengths.shape[0]
    pack_of_item = np.empty(n, np.int32)
    pack = -1
    room = 0
    for i in range(n):
        length = lengths[i]
        if length > room:
            pack += 1
            room = capacity
        room -= length
        pack_of_item[i] = pack
    return pack_of_item, pack + 1


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------


@njit(**NJIT_FLAGS)
def _decreasing_starts(counts):
    """First placement position of each length when items go by decreasing length.

    Returns ``start`` (int64[capacity + 1]); empty items (``counts[0]``) come last.
    """
    capacity = counts.shape[0] - 1
    start = np.empty(capacity + 1, np.int64)
    acc = 0
    for length in range(capacity, 0, -1):
        start[length] = acc
        acc += counts[length]
    start[0] = acc
    return start


@njit(**NJIT_FLAGS)
def _positions_to_slots(pack_of_position, counts, num_packs):
    """Turn the pack of each placement position into its slot in the grouped layout, in place.

    Slots number the items pack by pack (pack 0's first), in placement order within
    a pack, which is the ``order``/``pack_offsets`` layout of ``PackPlan``.

    Returns
    -------
    offsets : int64[num_packs + 1]
    load : int32[num_packs]
    """
    capacity = counts.shape[0] - 1
    offsets = np.zeros(num_packs + 1, np.int64)
    load = np.zeros(num_packs, np.int32)
    pos = 0
    for length in range(capacity, 0, -1):
        for _ in range(counts[length]):
            p = pack_of_position[pos]
            offsets[p + 1] += 1
            load[p] += length
            pos += 1
    for p in range(num_packs):
        offsets[p + 1] += offsets[p]
    fill = offsets[:num_packs].copy()
    for j in range(pos):
        p = pack_of_position[j]
        pack_of_position[j] = fill[p]
        fill[p] += 1
    return offsets, load


@njit(**NJIT_FLAGS)
def _scatter_items(lengths, counts, slot_of_position, out):
    """``out[slot_of_position[j]] = i`` for the item ``i`` placed at position ``j``.

    The stable decreasing counting sort is replayed instead of stored: item ``i``
    of length ``L`` sits at the next free position of its length. Empty items
    (length 0) have no position and are skipped.
    """
    start = _decreasing_starts(counts)
    for i in range(lengths.shape[0]):
        length = lengths[i]
        if length > 0:
            j = start[length]
            start[length] = j + 1
            out[slot_of_position[j]] = i


@njit(**NJIT_FLAGS)
def _positions_to_items(lengths, counts, value_of_position, missing):
    """``out[i] = value_of_position[j]`` for the position ``j`` of item ``i``; ``missing``
    for empty items (int32[N])."""
    start = _decreasing_starts(counts)
    out = np.empty(lengths.shape[0], np.int32)
    for i in range(lengths.shape[0]):
        length = lengths[i]
        if length > 0:
            j = start[length]
            start[length] = j + 1
            out[i] = value_of_position[j]
        else:
            out[i] = missing
    return out


@njit(**NJIT_FLAGS)
def _group_by_pack(sequence, pack_of_sequence, lengths_of_sequence, num_packs):
    """Stable counting sort of a placement sequence by pack.

    Parameters
    ----------
    sequence : int[M]
        Values in placement order (item indices, or positions).
    pack_of_sequence : int[M]
        Pack of ``sequence[k]``.
    lengths_of_sequence : int[M]
        Length of ``sequence[k]``.
    num_packs : int

    Returns
    -------
    grouped : int32[M]
        ``sequence`` regrouped by pack number, placement order kept within a pack.
    offsets : int64[num_packs + 1]
    load : int32[num_packs]
    """
    m = sequence.shape[0]
    offsets = np.zeros(num_packs + 1, np.int64)
    load = np.zeros(num_packs, np.int32)
    for k in range(m):
        p = pack_of_sequence[k]
        offsets[p + 1] += 1
        load[p] += lengths_of_sequence[k]
    for p in range(num_packs):
        offsets[p + 1] += offsets[p]
    fill = offsets[:num_packs].copy()
    grouped = np.empty(m, np.int32)
    for k in range(m):
        p = pack_of_sequence[k]
        grouped[fill[p]] = sequence[k]
        fill[p] += 1
    return grouped, offsets, load


@njit(**NJIT_FLAGS)
def _pack_of_item(order, offsets, num_items):
    """Inverse of the grouped layout: pack of every item, -1 for items in no pack. A layout that
    would index outside ``order`` or ``out`` (a plan made by hand) raises instead (the kernels
    run without bounds checks)."""
    out = np.full(num_items, -1, np.int32)
    for p in range(offsets.shape[0] - 1):
        if offsets[p] < 0 or offsets[p + 1] > order.shape[0]:
            raise ValueError("pack_offsets are inconsistent")
        for k in range(offsets[p], offsets[p + 1]):
            item = order[k]
            if item < 0 or item >= num_items:
                raise ValueError("order holds an item index out of range")
            out[item] = p
    return out


#: What :func:`_layout_problem` finds, by its return code.
LAYOUT_OK, LAYOUT_OFFSETS, LAYOUT_EMPTY_PACK, LAYOUT_NOT_PERMUTATION = 0, 1, 2, 3


@njit(**NJIT_FLAGS)
def _layout_problem(order, offsets, lengths, skip_empty):
    """The first fault of a grouped layout over ``lengths`` (one O(N) pass, a LAYOUT_* code):
    offsets that do not run from 0 up to ``order``'s end, an empty pack, or an ``order`` that is
    not every item once (with ``skip_empty``: every non-empty item once, and no empty one)."""
    n, m = lengths.shape[0], order.shape[0]
    if offsets.shape[0] < 1 or offsets[0] != 0 or offsets[offsets.shape[0] - 1] != m:
        return LAYOUT_OFFSETS
    for p in range(offsets.shape[0] - 1):
        if offsets[p + 1] < offsets[p]:
            return LAYOUT_OFFSETS
    seen = np.zeros(n, np.bool_)
    for k in range(m):
        item = order[k]
        if item < 0 or item >= n or seen[item]:
            return LAYOUT_NOT_PERMUTATION
        seen[item] = True
    for i in range(n):
        if seen[i] != (not skip_empty or lengths[i] != 0):
            return LAYOUT_NOT_PERMUTATION
    for p in range(offsets.shape[0] - 1):
        if offsets[p + 1] == offsets[p]:
            return LAYOUT_EMPTY_PACK
    return LAYOUT_OK


@njit(**NJIT_FLAGS)
def _bind_buckets(positions, seq_lengths, bin_of_position, bucket_items, bucket_starts):
    """Bind items to placed lengths by popping the end of each length bucket.

    Parameters
    ----------
    positions : int32[M]
        Positions of the processed sequence, grouped by bin in bin order and
        in placement order within a bin.
    seq_lengths : int32[M]
        Length at each position.
    bin_of_position : int32[M]
        Bin of each position.
    bucket_items : int64[N]
        Item indices grouped by length (ascending), each bucket already
        permuted.
    bucket_starts : int64[capacity + 2]
        Bucket boundaries in ``bucket_items``.

    Returns
    -------
    order : int32[M]
        Item indices in output order.
    pack_of_item : int32[M]
    """
    m = positions.shape[0]
    ends = bucket_starts[1:].copy()
    order = np.empty(m, np.int32)
    pack_of_item = np.empty(m, np.int32)
    for k in range(m):
        pos = positions[k]
        length = seq_lengths[pos]
        ends[length] -= 1
        item = bucket_items[ends[length]]
        order[k] = item
        pack_of_item[item] = bin_of_position[pos]
    return order, pack_of_item


# ---------------------------------------------------------------------------
# Small windows
# ---------------------------------------------------------------------------


@njit(**NJIT_FLAGS)
def _sort_decreasing(lengths, a, b, idx, scratch_len):
    """Put the local indices of the non-empty items of ``lengths[a:b]`` into ``idx[:m]`` by
    decreasing length, ties by index (FFD's placement order), and their lengths into
    ``scratch_len[:m]``; returns ``m``. Insertion sort for a few items, a stable merge sort
    beyond."""
    m = 0
    for i in range(a, b):
        if lengths[i]:
            idx[m] = i - a
            scratch_len[m] = lengths[i]
            m += 1
    if m <= 32:
        for k in range(1, m):
            item, length = idx[k], scratch_len[k]
            j = k - 1
            while j >= 0 and scratch_len[j] < length:  # strict: equal lengths keep index order
                idx[j + 1] = idx[j]
                scratch_len[j + 1] = scratch_len[j]
                j -= 1
            idx[j + 1] = item
            scratch_len[j + 1] = length
    else:
        by_length = np.argsort(-scratch_len[:m], kind="mergesort")
        items = idx[:m][by_length]
        sorted_lengths = scratch_len[:m][by_length]
        idx[:m] = items
        scratch_len[:m] = sorted_lengths
    return m


@njit(**NJIT_FLAGS)
def _plan_small_windows(lengths, starts, w, stop, capacity, bfd, refine_ratio, refine,
                        order, offsets, load, placed, packs, idx, scratch_len, pack_of, room, tree):
    """Plan windows ``w, w + 1, …, stop - 1`` of ``lengths`` (window ``v`` is
    ``lengths[starts[v]:starts[v + 1]]``, the last running to the end) each on its own from its
    items sorted by decreasing length (FFD: first fit over a tree of its packs; BFD: best fit by
    a scan of its open packs), appending to the grouped layout: items to ``order[placed:]``
    (global indices), packs to ``offsets[packs + 1:]`` (global ends) and ``load[packs:]``.

    With ``refine``, stops at a window the refine pass may shorten (above ceil(Σ/C) packs and
    at least ``capacity / refine_ratio`` items, as ``plan._refine_pays`` judges): the caller
    plans that one; what was written past the returned ``placed``/``packs`` is its to
    overwrite. The work arrays hold the widest window: ``idx``, ``scratch_len``, ``pack_of``
    (int32), ``room`` (int64) that many entries, ``tree`` twice the power of two at or above
    it. Returns ``(window reached, placed, packs)``, the window reached ``stop`` when all are
    planned.
    """
    num_windows = starts.shape[0]
    n = lengths.shape[0]
    while w < stop:
        a = starts[w]
        b = starts[w + 1] if w + 1 < num_windows else n
        items = 0
        total = 0
        for i in range(a, b):
            if lengths[i]:
                items += 1
                total += lengths[i]
        if items == 0:
            w += 1
            continue
        _sort_decreasing(lengths, a, b, idx, scratch_len)
        if bfd:
            num = _best_fit_into(scratch_len, items, capacity, room, pack_of)
        else:
            size = 1
            while size < items:
                size <<= 1
            num = _first_fit_into(scratch_len, items, capacity, tree, size, pack_of)
        if refine and items * refine_ratio >= capacity and num > (total + capacity - 1) // capacity:
            return w, placed, packs
        # Group by pack (stable: placement order within a pack), straight into the output.
        for p in range(num):
            offsets[packs + p + 1] = 0
            load[packs + p] = 0
        for k in range(items):
            p = pack_of[k]
            offsets[packs + p + 1] += 1
            load[packs + p] += scratch_len[k]
        end = placed
        for p in range(num):
            count = offsets[packs + p + 1]
            offsets[packs + p + 1] = end  # the pack's start, for now
            end += count
        for k in range(items):
            at = packs + pack_of[k] + 1
            order[offsets[at]] = a + idx[k]
            offsets[at] += 1  # ends at the pack's end
        placed = end
        packs += num
        w += 1
    return w, placed, packs

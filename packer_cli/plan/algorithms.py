"""Bin-packing algorithms: validating Python wrappers around compiled kernels.

All functions take item ``lengths`` (1-D integers, each in ``[1, capacity]``)
and a pack ``capacity`` and number packs densely in opening order.
"""

from __future__ import annotations

import numpy as np

from packer_cli.errors import interrupts_kept

from . import _kernels as K
from ._validate import check_lengths

__all__ = [
    "first_fit_decreasing",
    "best_fit_decreasing",
    "next_fit",
    "bridge_first_fit_shuffle",
]


def _max_packs(lengths: np.ndarray, capacity: int) -> int:
    """Upper bound on the packs any any-fit algorithm can open.

    In any-fit packing at most one pack is at most half full, so
    ``packs <= 2 * sum / capacity + 1``; it is also at most ``N``.
    """
    n = lengths.shape[0]
    total = int(lengths.sum(dtype=np.int64))
    return max(1, min(n, 2 * (total // capacity) + 2))


def _tree(leaves: int) -> np.ndarray:
    size = 1
    while size < leaves:
        size <<= 1
    return np.empty(2 * size, np.int32)


# Internal entry points on validated arrays. FFD and BFD work from the length
# histogram and return the pack of each *placement position* (items by
# decreasing length, ties by index); ``K._positions_to_slots`` and
# ``K._scatter_items`` turn that into the grouped layout without ever holding
# an N-sized order array, which keeps the planner at 12 bytes per item.


def _run_ffd_positions(counts: np.ndarray, capacity: int, total: int):
    """(pack_of_position int32, num_packs). The tree starts a little above the
    continuous bound ceil(total / C) and doubles in the rare case FFD needs more."""
    leaves = max(64, (-(-total // capacity)) * 5 // 4 + 64)
    while True:
        pack_of_position, num_packs = K._ffd_positions(counts, capacity, _tree(leaves))
        if num_packs >= 0:
            return pack_of_position, num_packs
        leaves *= 2


def _run_bfd_positions(counts: np.ndarray, capacity: int, max_packs: int):
    offsets = K._bitset_layout(capacity + 1)
    bits = np.zeros(offsets[-1], np.uint64)
    return K._bfd_positions(counts, capacity, max_packs, bits, offsets)


def _decreasing_positions(arr: np.ndarray, capacity: int, algorithm: str, top: int | None = None):
    """(histogram, pack_of_position, num_packs) of FFD or BFD; empty items are skipped.
    ``top``: the longest item, when known to be below ``capacity`` (a histogram of ``top + 1``
    entries: each window of a windowed plan then costs its own longest item, not the capacity)."""
    counts = K._length_histogram(arr, capacity if top is None else top)
    total = int(arr.sum(dtype=np.int64))
    if algorithm == "ffd":
        pack_of_position, num_packs = _run_ffd_positions(counts, capacity, total)
    else:
        pack_of_position, num_packs = _run_bfd_positions(counts, capacity, _max_packs(arr, capacity))
    return counts, pack_of_position, num_packs


def _pack_of_item_decreasing(arr: np.ndarray, capacity: int, algorithm: str) -> np.ndarray:
    counts, pack_of_position, _ = _decreasing_positions(arr, capacity, algorithm)
    return K._positions_to_items(arr, counts, pack_of_position, -1)


def _run_next_fit(arr: np.ndarray, capacity: int):
    pack_of_item, num_packs = K._next_fit(arr, capacity)
    return pack_of_item, num_packs


def _run_bridge(arr: np.ndarray, capacity: int, seed):
    """Returns (pack_of_item, order, offsets, load, num_packs); ``order`` is already grouped."""
    rng = np.random.RandomState(seed)
    # 1-2. ascending list of all lengths, shuffled with the legacy MT19937 stream (its swaps
    # depend on the count alone, so 4-byte lengths are shuffled as Bridge's 8-byte ones are).
    # The arrays here are 4 bytes an item: with 8-byte ones `pack` of 60M tiny sequences with
    # this plan peaked at 2.88 GB, now 2.40 GB (ffd: 1.22 GB).
    shuffled = arr.astype(np.int32)
    shuffled.sort()
    rng.shuffle(shuffled)
    # 3. first fit over the shuffled lengths.
    bin_of_position, num_packs = K._first_fit(shuffled, capacity, _tree(_max_packs(arr, capacity)))
    positions = np.arange(shuffled.shape[0], dtype=np.int32)
    positions, offsets, load = K._group_by_pack(positions, bin_of_position, shuffled, num_packs)
    # 4. one permutation per non-empty bucket, ascending length.
    counts = K._length_histogram(arr, capacity)
    bucket_items, starts = K._order_increasing(arr, counts)
    for length in np.flatnonzero(counts):
        lo, hi = starts[length], starts[length + 1]
        bucket_items[lo:hi] = bucket_items[lo:hi][rng.permutation(hi - lo)]
    # 5. bins in order, lengths in placement order, pop() from each bucket's end.
    order, pack_of_item = K._bind_buckets(positions, shuffled, bin_of_position, bucket_items, starts)
    return pack_of_item, order, offsets, load, num_packs


@interrupts_kept
def first_fit_decreasing(lengths, capacity) -> np.ndarray:
    """First-fit decreasing (FFD).

    Items are taken by decreasing length (ties in input order) and each goes to
    the lowest-numbered pack with enough room; packs are numbered in opening
    order. Runs in ``O(N + C + N log P)``: a counting sort plus a max segment
    tree over pack slots searched leftmost-first.

    Parameters
    ----------
    lengths : array-like of int, shape (N,)
        Item lengths, each in ``[1, capacity]``.
    capacity : int
        Pack capacity (tokens per pack).

    Returns
    -------
    numpy.ndarray of int32, shape (N,)
        Pack index of every item.

    Raises
    ------
    ValueError
        A length is below 1 or above ``capacity``, or ``capacity < 1``.
    TypeError
        Lengths or a capacity that are not integers (floats, strings, objects).
    """
    arr, capacity = check_lengths(lengths, capacity)
    if arr.shape[0] == 0:
        return np.zeros(0, np.int32)
    return _pack_of_item_decreasing(arr, capacity, "ffd")


@interrupts_kept
def best_fit_decreasing(lengths, capacity) -> np.ndarray:
    """Best-fit decreasing (BFD).

    Items are taken by decreasing length (ties in input order) and each goes to
    the pack with the least remaining room that still fits it (ties to the
    lowest pack number), otherwise to a new pack. Runs in
    ``O(N log C + N log P)`` amortized (a 64-ary bitset over remaining
    capacities plus a pairing heap of pack numbers per capacity).

    Parameters and errors as :func:`first_fit_decreasing`.
    """
    arr, capacity = check_lengths(lengths, capacity)
    if arr.shape[0] == 0:
        return np.zeros(0, np.int32)
    return _pack_of_item_decreasing(arr, capacity, "bfd")


@interrupts_kept
def next_fit(lengths, capacity) -> np.ndarray:
    """Order-preserving next fit: items stay in input order, and a new pack is
    opened whenever the current one cannot take the next item.

    Parameters and errors as :func:`first_fit_decreasing`.
    """
    arr, capacity = check_lengths(lengths, capacity)
    if arr.shape[0] == 0:
        return np.zeros(0, np.int32)
    return _run_next_fit(arr, capacity)[0]


@interrupts_kept
def bridge_first_fit_shuffle(lengths, capacity, seed) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-Bridge's default ``first_fit_shuffle`` + ``fill_packing_strategy``.

    Reproduces Bridge's random stream and binding exactly:

    1. a legacy MT19937 stream seeded with ``seed`` (``np.random.RandomState``,
       the same stream as ``np.random.seed``; the global RNG is not touched);
    2. the ascending-sorted list of all lengths is ``shuffle``-d;
    3. first fit over that order (leftmost pack with room);
    4. for each non-empty length bucket in ascending length order,
       ``permutation(len(bucket))`` of the bucket's item indices (input order);
    5. for each pack in order and each length in its placement order, the last
       element of that bucket is popped.

    Parameters
    ----------
    lengths, capacity
        As :func:`first_fit_decreasing`. Pass Bridge's ``seq_len`` values
        (stored length minus one) to reproduce its packs.
    seed : int
        Anything ``np.random.seed`` accepts.

    Returns
    -------
    pack_of_item : numpy.ndarray of int32, shape (N,)
    order : numpy.ndarray of int32, shape (N,)
        Item indices in output order: pack 0's items in placement order, then
        pack 1's, and so on.
    """
    arr, capacity = check_lengths(lengths, capacity)
    if arr.shape[0] == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    pack_of_item, order, _, _, _ = _run_bridge(arr, capacity, seed)
    return pack_of_item, order

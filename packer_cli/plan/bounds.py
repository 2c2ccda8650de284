"""Lower bounds on the number of packs."""

from __future__ import annotations

import numpy as np

from ._validate import check_lengths

__all__ = ["lower_bound", "martello_toth_l2"]


def lower_bound(lengths, capacity) -> int:
    """Continuous lower bound ``L1 = ceil(sum(lengths) / capacity)``.

    Parameters and errors as :func:`packer_cli.plan.first_fit_decreasing`.
    """
    arr, capacity = check_lengths(lengths, capacity)
    total = int(arr.sum(dtype=np.int64))
    return -(-total // capacity)


def martello_toth_l2(lengths, capacity) -> int:
    """Martello–Toth lower bound ``L2`` (exact maximum over every threshold).

    For an integer threshold ``K`` in ``[0, C // 2]`` split the items into
    ``J1 = {s > C - K}``, ``J2 = {C/2 < s <= C - K}`` and
    ``J3 = {K <= s <= C/2}``; then

    ``L(K) = |J1| + |J2| + max(0, ceil((sum(J3) - (|J2| C - sum(J2))) / C))``

    and ``L2 = max_K L(K)``. ``L(0) = max(|{s > C/2}|, L1)``, so ``L2 >= L1``.
    Computed from prefix sums over the distinct lengths (a histogram, or a sort when
    C > 4N), at the thresholds where ``L(K)`` changes.

    Parameters and errors as :func:`packer_cli.plan.first_fit_decreasing`.
    """
    arr, capacity = check_lengths(lengths, capacity)
    return _l2_of_lengths(arr, capacity)


def _l2_of_lengths(arr: np.ndarray, capacity: int) -> int:
    """L2 of validated lengths (empty items, length 0, ignored)."""
    if arr.shape[0] == 0:
        return 0
    return l2_of_sizes(*_sizes_and_counts(arr, capacity), capacity)


def _best_of_lengths(arr: np.ndarray, capacity: int) -> int:
    """The largest of L2, the Fekete–Schepers bound (:func:`_fs_of_sizes`) and, for lengths of
    few values, :func:`_split_fs_of_sizes`, of validated lengths: what the improvement pass
    stops at."""
    if arr.shape[0] == 0:
        return 0
    sizes, counts = _sizes_and_counts(arr, capacity)
    bounds = [l2_of_sizes(sizes, counts, capacity), _fs_of_sizes(sizes, counts, capacity)]
    if np.count_nonzero(sizes) <= SPLIT_FS_MAX_SIZES:
        bounds.append(_split_fs_of_sizes(sizes, counts, capacity))
    return max(bounds)


def _sizes_and_counts(arr: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct lengths, ascending, and how many items have each: from a histogram of C
    sizes, or a sort where that costs less (C > 4N)."""
    if capacity > 4 * arr.shape[0]:
        return np.unique(arr, return_counts=True)
    hist = histogram(arr, capacity + 1)
    sizes = np.flatnonzero(hist)
    return sizes, hist[sizes]


#: :func:`_split_fs_of_sizes` is computed where the lengths take at most this many values (one
#: Fekete–Schepers bound per value; many values give L2 and FS enough to stop at).
SPLIT_FS_MAX_SIZES = 64


def _split_fs_of_sizes(sizes: np.ndarray, counts: np.ndarray, capacity: int) -> int:
    """The largest ``|{s > C - K}| + FS({K <= s <= C - K})`` over K = each length up to C/2.

    An item over ``C - K`` (more than half a pack) shares its pack with no item of K or more,
    so those items need packs of their own, and FS bounds the rest by themselves. L2 counts the
    rest by their sum alone: items of 2,948 and 1,340 tokens at C = 4,096 need one pack per
    2,948 and one per three 1,340s, where L2 and FS saw a 1,340 as 0.327 of a pack, and the
    improvement pass searched 0.3-0.6 s per 1M items to find first fit optimal."""
    sizes = np.asarray(sizes, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    keep = sizes > 0
    sizes, counts = sizes[keep], counts[keep]
    best = 0
    for k in np.unique(sizes[2 * sizes <= capacity]):
        big = sizes > capacity - k
        middle = (sizes >= k) & ~big
        best = max(best, int(counts[big].sum()) + _fs_of_sizes(sizes[middle], counts[middle], capacity))
    return best


#: The Fekete–Schepers functions tried: u_k for k = 1 .. FS_MAX_K.
FS_MAX_K = 32


def _fs_of_sizes(sizes: np.ndarray, counts: np.ndarray, capacity: int, max_k: int = FS_MAX_K) -> int:
    """Fekete–Schepers lower bound: the largest ``ceil(sum(u_k(s)) / C)`` for k = 1..``max_k``
    (and L1), with the dual feasible function ``u_k(s) = s`` where ``(k + 1) s / C`` is an
    integer and ``floor((k + 1) s / C) C / k`` elsewhere (no pack's items can sum to more than
    C under it).

    Where few lengths repeat it sees what L2 cannot: items of 700, 1,500 and 2,900 tokens at
    C = 4,096 (a 2,900 fits only beside a 700, two 1,500s at most share a pack) need one pack
    per 2,900 and one per two 1,500s. u_2 counts exactly that (2,900 → C, 1,500 → C/2, 700 → 0);
    L2 was 9 % lower, so the improvement pass re-packed 1M such items for 0.25 s to find first
    fit's plan optimal. Sums are kept exact: ``sum(u_k) k = k A + C B`` with ``A`` the lengths
    where ``(k + 1) s / C`` is whole and ``B`` the floors elsewhere."""
    c = capacity
    sizes = np.asarray(sizes, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    keep = sizes > 0
    sizes, counts = sizes[keep], counts[keep]
    if sizes.size == 0:
        return 0
    best = -(-int((sizes * counts).sum()) // c)  # L1: the identity is dual feasible too
    if sizes.size * max_k <= _FS_TABLE_CELLS:  # every k at once
        k = np.arange(1, max_k + 1, dtype=np.int64)[:, None]
        scaled = (k + 1) * sizes
        whole = scaled % c == 0
        a = np.where(whole, sizes * counts, 0).sum(axis=1)
        b = np.where(whole, 0, (scaled // c) * counts).sum(axis=1)
        k = k[:, 0]
        return max(best, int((-(-(k * a + c * b) // (k * c))).max()))
    for k in range(1, max_k + 1):
        scaled = (k + 1) * sizes
        whole = scaled % c == 0
        a = int((sizes[whole] * counts[whole]).sum())
        b = int(((scaled[~whole] // c) * counts[~whole]).sum())
        best = max(best, -(-(k * a + c * b) // (k * c)))
    return best


#: Up to this many (k, length) cells, :func:`_fs_of_sizes` computes every k in one table.
_FS_TABLE_CELLS = 1 << 20


def histogram(values: np.ndarray, size: int) -> np.ndarray:
    """``np.bincount(values, minlength=size)`` a million values at a time: bincount converts its
    input to int64 first, 8 bytes a value at once otherwise (at the planner's memory peak).
    Each million is counted up to its own largest value only: at C = 2^24, ``minlength`` gave
    every chunk a fresh 128 MB array to fault in and add."""
    hist = np.zeros(size, np.int64)
    for a in range(0, values.size, 1 << 20):
        counts = np.bincount(values[a:a + (1 << 20)])
        hist[:counts.size] += counts
    return hist


def usable_capacity(capacity: int, multiple: int) -> int:
    """The part of a pack's capacity sequences padded to multiples of ``multiple`` can fill:
    the bounds of such a packing are those of capacity ``⌊C/m⌋·m`` (C=100, m=8: 96)."""
    return capacity // multiple * multiple if 1 <= multiple <= capacity else capacity


def l2_of_histogram(hist: np.ndarray, capacity: int) -> int:
    """L2 from a length histogram ``hist[0..C]`` (``hist[0]``, empty items, is ignored)."""
    hist = np.asarray(hist, dtype=np.int64)
    sizes = np.flatnonzero(hist)
    return l2_of_sizes(sizes, hist[sizes], capacity)


def l2_of_sizes(sizes: np.ndarray, counts: np.ndarray, capacity: int) -> int:
    """L2 from the distinct lengths (ascending, at most C) and how many items have each.

    ``L(K)`` changes only where an item enters ``J1`` (``K = C - s + 1``) or leaves ``J3``
    (``K = s + 1``), so it is evaluated at ``K = 0`` and at those points only: O(D log D) for
    D distinct lengths, where every ``K`` up to ``C / 2`` took tables of C entries (seconds
    at C = 2**24)."""
    c = capacity
    sizes = np.asarray(sizes, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    keep = sizes > 0  # empty items are not packed
    sizes, counts = sizes[keep], counts[keep]
    n = int(counts.sum())
    if n == 0:
        return 0
    half = c // 2  # s > C/2  <=>  s > half
    # cnt_le[i] / sum_le[i]: items (and their total length) among the i smallest distinct sizes.
    cnt_le = np.concatenate([[0], np.cumsum(counts)])
    sum_le = np.concatenate([[0], np.cumsum(counts * sizes)])

    def at_most(v):  # index into cnt_le / sum_le for "s <= v"
        return np.searchsorted(sizes, v, side="right")

    k = np.unique(np.concatenate([[0], c - sizes[sizes > half] + 1, sizes[sizes <= half] + 1]))
    k = k[k <= half]
    upper = at_most(c - k)
    mid = at_most(half)
    n1 = n - cnt_le[upper]
    n2 = cnt_le[upper] - cnt_le[mid]
    s2 = sum_le[upper] - sum_le[mid]
    s3 = sum_le[mid] - sum_le[at_most(k - 1)]
    excess = s3 - (n2 * c - s2)
    extra = np.where(excess > 0, -(-excess // c), 0)
    return int((n1 + n2 + extra).max())

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
    Computed in ``O(N + C)`` from a length histogram and prefix sums.

    Parameters and errors as :func:`packer_cli.plan.first_fit_decreasing`.
    """
    arr, capacity = check_lengths(lengths, capacity)
    if arr.shape[0] == 0:
        return 0
    return _l2_of_histogram(np.bincount(arr, minlength=capacity + 1), capacity)


def _l2_of_histogram(hist: np.ndarray, capacity: int) -> int:
    """L2 from a length histogram ``hist[0..C]`` (``hist[0]``, empty items, is ignored)."""
    c = capacity
    hist = np.asarray(hist, dtype=np.int64).copy()
    hist[0] = 0
    n = int(hist.sum())
    if n == 0:
        return 0
    # cnt_le[v] = #items with s <= v, sum_le[v] = total length of those items.
    cnt_le = np.cumsum(hist)
    sum_le = np.cumsum(hist * np.arange(c + 1, dtype=np.int64))
    half = c // 2  # s > C/2  <=>  s > half
    k = np.arange(half + 1, dtype=np.int64)
    n1 = n - cnt_le[c - k]
    n2 = cnt_le[c - k] - cnt_le[half]
    s2 = sum_le[c - k] - sum_le[half]
    below_k = np.where(k > 0, sum_le[np.maximum(k - 1, 0)], 0)
    s3 = sum_le[half] - below_k
    excess = s3 - (n2 * c - s2)
    extra = np.where(excess > 0, -(-excess // c), 0)
    return int((n1 + n2 + extra).max())

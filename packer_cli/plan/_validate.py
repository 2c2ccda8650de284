"""Input validation shared by the public planner functions."""

from __future__ import annotations

import numbers

import numpy as np

from ._config import MAX_CAPACITY


def check_capacity(capacity) -> int:
    """Return ``capacity`` as an ``int`` after checking it is an integer in ``[1, MAX_CAPACITY]``."""
    if isinstance(capacity, (bool, np.bool_)) or not isinstance(capacity, numbers.Integral):
        raise TypeError(f"capacity must be an integer, got {type(capacity).__name__}")
    capacity = int(capacity)
    if capacity < 1:
        raise ValueError(f"capacity = {capacity} must be >= 1")
    if capacity > MAX_CAPACITY:
        raise ValueError(f"capacity = {capacity} exceeds the supported maximum {MAX_CAPACITY}")
    return capacity


def check_lengths(lengths, capacity, *, allow_zero: bool = False) -> tuple[np.ndarray, int]:
    """Validate ``lengths`` against ``capacity``.

    Returns a contiguous ``int32`` or ``int64`` 1-D array (the input itself when
    it already is one, otherwise an ``int64`` copy) and the capacity as ``int``.

    Raises
    ------
    TypeError
        ``lengths`` is not an integer array-like, or ``capacity`` is not an integer.
    ValueError
        ``lengths`` is not 1-D, a length is below 1 (0 with ``allow_zero``) or above ``capacity``, or
        ``capacity`` is out of range. The message names the first offending index.
    """
    capacity = check_capacity(capacity)
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got an array of shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64), capacity
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"lengths must hold integers, got dtype {arr.dtype}")
    floor = 0 if allow_zero else 1
    low = arr.min()
    if low < floor:
        i = int(np.flatnonzero(arr < floor)[0])
        raise ValueError(f"lengths[{i}] = {int(arr[i])} is below {floor} (every length must be >= {floor})")
    high = arr.max()
    if high > capacity:
        i = int(np.flatnonzero(arr > capacity)[0])
        raise ValueError(f"lengths[{i}] = {int(arr[i])} exceeds capacity {capacity}")
    if arr.dtype in (np.dtype(np.int64), np.dtype(np.int32)) and arr.flags.c_contiguous:
        return arr, capacity
    return np.ascontiguousarray(arr, dtype=np.int64), capacity

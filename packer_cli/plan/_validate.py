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


def _refuse_python_ints(arr: np.ndarray, capacity: int, floor: int) -> None:
    """NumPy makes an object array of Python ints beyond int64 (``[2**70]``): being integers,
    they get the range error an int64 array gets, naming the first length out of range."""
    values = arr.tolist()
    if all(type(x) is int for x in values):
        i = next((i for i, x in enumerate(values) if x < floor or x > capacity), None)
        if i is None:  # an object array made on purpose, every length in range: refused for its dtype
            return
        if values[i] < floor:
            raise ValueError(f"lengths[{i}] = {values[i]} is below {floor} (every length must be >= {floor})")
        raise ValueError(f"lengths[{i}] = {values[i]} exceeds capacity {capacity}")


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
    floor = 0 if allow_zero else 1
    arr = np.asarray(lengths)
    if arr.dtype.kind not in "iu" and not (arr.ndim == 1 and arr.size == 0):
        if arr.ndim == 0:  # None, a string, a set: no array of lengths at all
            raise TypeError(f"lengths must be a 1-D array of integers, got {type(lengths).__name__}")
        if arr.ndim == 1 and arr.dtype.kind == "O":
            _refuse_python_ints(arr, capacity, floor)
        raise TypeError(f"lengths must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got an array of shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64), capacity
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

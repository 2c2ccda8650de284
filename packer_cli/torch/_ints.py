"""Integer arguments (indices, counts, ranks): Python and NumPy integers, never bools, floats,
strings or arrays, which would otherwise fail later, deep inside NumPy or torch, or not at all;
and flags: Python and NumPy bools only (``shuffle="false"`` is truthy: it shuffled).

>>> integer(3), integer(np.int64(3)), integer(2.0), integer(True)
(3, 3, None, None)
"""
from __future__ import annotations

import operator

import numpy as np


def integer(value) -> int | None:
    """``value`` as an ``int``, or None when it is not an integer."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:  # floats, strings, None; arrays of more than one element
        return None


def flag(value, name: str, none: bool = False) -> bool | None:
    """``value`` as a plain ``bool`` (what a checkpoint of a state holding it can load with
    ``weights_only``); ValueError for anything else (and for None unless ``none``)."""
    if none and value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be True{', False or None' if none else ' or False'}, got {value!r}")

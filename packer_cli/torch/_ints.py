"""Integer arguments (indices, counts, ranks): Python and NumPy integers, never bools, floats,
strings or arrays, which would otherwise fail later, deep inside NumPy or torch, or not at all.

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

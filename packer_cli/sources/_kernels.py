"""Compiled one-pass checks behind the fast path of :func:`packer_cli.sources.normalize.normalize_batch`.

Each kernel answers one question — "is every value of this batch acceptable?" — in a single
pass over the flat values, without the int64 copies and boolean temporaries of the vectorized
checks. A kernel never builds an error message: when it returns False, the caller re-runs
the batch through the vectorized path, which finds and words every problem exactly as before.
All kernels release the GIL so a reader thread can validate while the main thread spills.
"""
from __future__ import annotations

from numba import njit

IGNORE_INDEX = -100

_FLAGS = {"cache": True, "nogil": True, "boundscheck": False}


@njit(**_FLAGS)
def tokens_in_range(values, limit):
    """True when every id is in ``[0, limit)``."""
    for i in range(values.size):
        v = values[i]
        if v < 0 or v >= limit:
            return False
    return True


@njit(**_FLAGS)
def mask_is_binary(values):
    """True when every loss-mask value is 0 or 1."""
    for i in range(values.size):
        v = values[i]
        if v != 0 and v != 1:
            return False
    return True


@njit(**_FLAGS)
def labels_to_targets(labels, tokens, out):
    """Target flags from HF labels (``-100`` or the token id); False at the first other value."""
    for i in range(labels.size):
        v = labels[i]
        if v == IGNORE_INDEX:
            out[i] = 0
        elif v == tokens[i]:
            out[i] = 1
        else:
            return False
    return True


@njit(**_FLAGS)
def answer_targets(offsets, start, out):
    """Target flags from ``answer_start_idx``: position ≥ start within each row."""
    for r in range(offsets.size - 1):
        a = offsets[r]
        b = offsets[r + 1]
        s = a + start[r]
        for i in range(a, b):
            out[i] = 1 if i >= s else 0


@njit(**_FLAGS)
def target_counts(targets, lengths, cap, runtime, tail):
    """Per sample: runtime targets Σ targets[1:n] and those past a truncation at ``cap``."""
    pos = 0
    for k in range(lengths.size):
        n = lengths[k]
        cut = min(cap + 1, n)
        before = 0
        for j in range(1, cut):
            before += targets[pos + j]
        after = 0
        for j in range(cut, n):
            after += targets[pos + j]
        runtime[k] = before + after
        tail[k] = after
        pos += n

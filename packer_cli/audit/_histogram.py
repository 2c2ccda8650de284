"""Integer histograms as count arrays (index = value): merge, summarize, serialize, bucket.

A histogram of non-negative integers is ``np.bincount(values)``; two of them merge by adding
(after padding the shorter one). Percentiles follow NumPy's default (linear interpolation
between the two nearest ranks), so they equal ``np.percentile(values, q)`` exactly:

>>> h = np.bincount([3, 1, 4, 1, 5])
>>> summarize(h)["median"], float(np.median([3, 1, 4, 1, 5]))
(3.0, 3.0)
>>> to_sparse(h)
{'values': [1, 3, 4, 5], 'counts': [2, 1, 1, 1]}
"""
from __future__ import annotations

import numpy as np


def add_hist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.size < b.size:
        a, b = b, a
    out = a.astype(np.int64, copy=True)
    out[:b.size] += b
    return out


def _value_at_rank(cum: np.ndarray, k: int) -> int:
    """The value of rank ``k`` (0-based) in sorted order."""
    return int(np.searchsorted(cum, k, side="right"))


def percentile(hist: np.ndarray, q: float) -> float:
    cum = np.cumsum(hist)
    n = int(cum[-1])
    rank = q / 100.0 * (n - 1)
    lo, hi = int(np.floor(rank)), int(np.ceil(rank))
    a, b = float(_value_at_rank(cum, lo)), float(_value_at_rank(cum, hi))
    t = rank - lo
    # NumPy's interpolation, both sides (from the upper value past half-way): bit for bit
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


def summarize(hist: np.ndarray) -> dict:
    """``count, min, max, mean, median, p90, p99`` (all None when the histogram is empty)."""
    n = int(hist.sum()) if hist.size else 0
    if n == 0:
        return {"count": 0, "min": None, "max": None, "mean": None, "median": None, "p90": None, "p99": None}
    nz = np.flatnonzero(hist)
    values = np.arange(hist.size, dtype=np.float64)
    return {
        "count": n, "min": int(nz[0]), "max": int(nz[-1]), "mean": float((values * hist).sum() / n),
        "median": percentile(hist, 50), "p90": percentile(hist, 90), "p99": percentile(hist, 99),
    }


def to_sparse(hist: np.ndarray) -> dict:
    """``{"values": [...], "counts": [...]}`` over the non-zero entries (exact, compact)."""
    nz = np.flatnonzero(hist)
    return {"values": nz.tolist(), "counts": hist[nz].tolist()}


def from_sparse(record: dict) -> np.ndarray:
    values = np.asarray(record["values"], np.int64)
    hist = np.zeros(int(values.max()) + 1 if values.size else 0, np.int64)
    hist[values] = np.asarray(record["counts"], np.int64)
    return hist


def buckets(hist: np.ndarray, n: int = 16) -> list[tuple[int, int, int]]:
    """At most ``n`` equal-width ``(low, high, count)`` buckets from the first to the last value."""
    nz = np.flatnonzero(hist)
    if nz.size == 0:
        return []
    lo, hi = int(nz[0]), int(nz[-1])
    width = max(1, -(-(hi - lo + 1) // n))
    edges = np.arange(lo, hi + 1, width)
    cum = np.concatenate([[0], np.cumsum(hist)])
    ends = np.minimum(edges + width, hi + 1)
    return [(int(a), int(b) - 1, int(cum[b] - cum[a])) for a, b in zip(edges, ends)]

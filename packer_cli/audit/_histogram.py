"""Integer histograms kept sparse: merge, summarize, serialize, bucket.

A :class:`Hist` holds the distinct values of some non-negative integers, ascending, and how
many times each occurs. Two merge with ``+``. Percentiles follow NumPy's default (linear
interpolation between the two nearest ranks), so they equal ``np.percentile(values, q)``
exactly:

>>> h = Hist.of([3, 1, 4, 1, 5])
>>> summarize(h)["median"], float(np.median([3, 1, 4, 1, 5]))
(3.0, 3.0)
>>> to_sparse(h)
{'values': [1, 3, 4, 5], 'counts': [2, 1, 1, 1]}

Why not ``np.bincount`` (an entry for every integer up to the largest): pack loads run up to
the pack size, and at C = 2^24 each shard's load histogram was 16M entries (128 MB to fault in,
copy on every merge and scan three times for the percentiles): ``verify`` of 118M tokens took
1.7-2.0 s against 0.5-0.9 s at C = 4096, and a report document naming a value of 2^40 asked
for 8 TB. A sparse one costs what the distinct values cost.
"""
from __future__ import annotations

import numpy as np

#: Up to this largest value (or 4 per value counted) a count by ``np.bincount`` beats a sort.
DENSE_COUNT_MAX = 1 << 16


class Hist:
    """How many times each non-negative integer occurs: ``values`` (int64, distinct, ascending)
    and ``counts`` (int64, each > 0)."""

    __slots__ = ("values", "counts")

    def __init__(self, values=(), counts=()):
        self.values = np.asarray(values, np.int64)
        self.counts = np.asarray(counts, np.int64)

    @classmethod
    def of(cls, data) -> "Hist":
        """The histogram of ``data`` (non-negative integers; ValueError for a negative one)."""
        data = np.asarray(data, np.int64).ravel()
        if data.size == 0:
            return cls()
        if int(data.min()) < 0:
            raise ValueError("a histogram counts non-negative integers only")
        if int(data.max()) <= max(DENSE_COUNT_MAX, 4 * data.size):
            dense = np.bincount(data)
            values = np.flatnonzero(dense)
            return cls(values, dense[values])
        values, counts = np.unique(data, return_counts=True)
        return cls(values, counts)

    @property
    def total(self) -> int:
        """How many integers were counted."""
        return int(self.counts.sum())

    def count(self, value: int) -> int:
        """How many times ``value`` occurs."""
        at = int(np.searchsorted(self.values, value))
        return int(self.counts[at]) if at < self.values.size and self.values[at] == value else 0

    def __add__(self, other: "Hist") -> "Hist":
        if not isinstance(other, Hist):
            return NotImplemented
        if not other.values.size:
            return self
        if not self.values.size:
            return other
        return _merged(np.concatenate([self.values, other.values]), np.concatenate([self.counts, other.counts]))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Hist):
            return NotImplemented
        return np.array_equal(self.values, other.values) and np.array_equal(self.counts, other.counts)

    def __repr__(self) -> str:
        return f"Hist({to_sparse(self)})"


def _merged(values: np.ndarray, counts: np.ndarray) -> Hist:
    """Sorted by value, equal values' counts added, zero counts dropped."""
    order = np.argsort(values, kind="stable")
    values, counts = values[order], counts[order]
    if values.size:
        starts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
        values, counts = values[starts], np.add.reduceat(counts, starts)
    kept = counts > 0
    return Hist(values[kept], counts[kept])


def _value_at_rank(hist: Hist, cum: np.ndarray, k: int) -> int:
    """The value of rank ``k`` (0-based) in sorted order."""
    return int(hist.values[np.searchsorted(cum, k, side="right")])


def percentile(hist: Hist, q: float) -> float:
    cum = np.cumsum(hist.counts)
    n = int(cum[-1])
    rank = q / 100.0 * (n - 1)
    lo, hi = int(np.floor(rank)), int(np.ceil(rank))
    a, b = float(_value_at_rank(hist, cum, lo)), float(_value_at_rank(hist, cum, hi))
    t = rank - lo
    # NumPy's interpolation, both sides (from the upper value past half-way): bit for bit
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


def summarize(hist: Hist) -> dict:
    """``count, min, max, mean, median, p90, p99`` (all None when the histogram is empty)."""
    n = hist.total
    if n == 0:
        return {"count": 0, "min": None, "max": None, "mean": None, "median": None, "p90": None, "p99": None}
    total = int((hist.values * hist.counts).sum())  # exact: one rounding, in the division
    return {
        "count": n, "min": int(hist.values[0]), "max": int(hist.values[-1]), "mean": total / n,
        "median": percentile(hist, 50), "p90": percentile(hist, 90), "p99": percentile(hist, 99),
    }


def to_sparse(hist: Hist) -> dict:
    """``{"values": [...], "counts": [...]}`` (exact, compact)."""
    return {"values": hist.values.tolist(), "counts": hist.counts.tolist()}


#: The largest value or count a histogram document may hold: lengths and loads are at most a
#: pack size (2^24) and counts at most an output's sequences, and within this the report's sums
#: stay exact in int64.
DOCUMENT_MAX = 1 << 40
#: The largest sum of value × count a histogram document may hold (tokens of an output).
DOCUMENT_SUM_MAX = 1 << 60


def from_sparse(record: dict) -> Hist:
    """The inverse of :func:`to_sparse`: ValueError for anything it does not write (values not
    strictly ascending, a count below 1, anything but integers in ``[0, DOCUMENT_MAX]``, lists
    of different lengths). Coercing instead read ``1.5`` as 1 and ``"7"`` as 7, and a count of
    2^62 overflowed the report's sums into a wrong mean or an IndexError."""
    values, counts = _document_ints(record["values"]), _document_ints(record["counts"])
    if values.size != counts.size:
        raise ValueError("a histogram needs as many counts as values")
    if values.size and ((np.diff(values) <= 0).any() or counts.min() < 1):
        raise ValueError("a histogram's values ascend strictly and each count is at least 1")
    pairs = zip(record["values"], record["counts"])  # Python's integers: no overflow while checking
    if sum(record["counts"]) > DOCUMENT_MAX or sum(v * c for v, c in pairs) > DOCUMENT_SUM_MAX:
        raise ValueError("a histogram's counts and their sum are beyond any output's")
    return Hist(values, counts)


def _document_ints(items) -> np.ndarray:
    if not isinstance(items, list) or not all(type(x) is int and 0 <= x <= DOCUMENT_MAX for x in items):
        raise ValueError(f"a histogram holds lists of integers from 0 to {DOCUMENT_MAX}")
    return np.array(items, dtype=np.int64)


def buckets(hist: Hist, n: int = 16) -> list[tuple[int, int, int]]:
    """At most ``n`` equal-width ``(low, high, count)`` buckets from the first to the last value."""
    if hist.values.size == 0:
        return []
    lo, hi = int(hist.values[0]), int(hist.values[-1])
    width = max(1, -(-(hi - lo + 1) // n))
    edges = np.arange(lo, hi + 1, width, dtype=np.int64)
    ends = np.minimum(edges + width, hi + 1)
    cum = np.concatenate([[0], np.cumsum(hist.counts)])
    below = cum[np.searchsorted(hist.values, edges)]
    upto = cum[np.searchsorted(hist.values, ends)]
    return [(int(a), int(b) - 1, int(c)) for a, b, c in zip(edges, ends, upto - below)]

"""From samples to sequences (the items the planner packs), without a per-sequence table.

A sample of n tokens has s = n − 1 runtime positions (inputs t[0:n−1], labels t[1:n]). Each
sequence is padded to p = ceil(s/m)·m. A sample whose s exceeds the maximum sequence length
``cap`` is handled by the over-long policy; with ``split`` it becomes several sequences, each
covering consecutive runtime positions [offset, offset + s) of its sample.

Memory is the point of this module. Pass one keeps one integer per sample (its token count:
uint16 when every sample is shorter than 65,536 tokens, else int32) and nothing else: target
counts are only ever needed as totals, so they are summed as batches go by
(:class:`ReadTotals`), and stream positions are stored as runs (:class:`SourceMap`), which cost
nothing unless records were skipped. Sequences are *derived*
from the lengths: item ``k < N`` is sample k's first (usually only) sequence, items ``N + e``
are the further pieces of split samples (a small table). :meth:`Items.resolve` recomputes
sample, offset, length, padded length and spill position for any run of items, with the spill
position taken from a prefix sum stored once per 64 samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from packer_cli._kernel_cache import njit
from packer_cli.errors import DataError
from packer_cli.spec import OverlongPolicy, PackSpec

#: Samples per stored spill-offset block (the rest of an offset is summed from the lengths).
BLOCK = 64


@dataclass
class ReadTotals:
    """Totals of pass one: everything the summary needs about target tokens and over-long samples."""

    samples: int = 0
    runtime_tokens: int = 0          # Σ (n − 1) over all samples
    target_tokens: int = 0           # Σ runtime targets over all samples
    no_target: int = 0               # samples without a runtime target
    over_samples: int = 0            # samples with n − 1 > cap
    over_runtime: int = 0            # Σ (n − 1) over those
    over_excess: int = 0             # Σ (n − 1 − cap) over those
    over_targets: int = 0            # Σ runtime targets over those
    over_tail_targets: int = 0       # Σ targets past the cap over those
    over_no_target: int = 0          # over-long samples without a runtime target
    over_none_kept: int = 0          # over-long samples with no target before the cap (truncate keeps none)
    over_pieces: int = 0             # Σ ceil((n − 1) / cap) over those
    first_over: int = -1             # kept-sample index of the first over-long sample


class SourceMap:
    """Kept sample k → its stream position, stored as runs ``position = k + shift``.

    A new run starts only where records were skipped (bad or too short), so a clean input
    costs one entry.
    """

    def __init__(self) -> None:
        self._starts: list[np.ndarray] = []
        self._shifts: list[np.ndarray] = []
        self._last = None
        self._kept = 0
        self.starts = np.zeros(0, np.int64)
        self.shifts = np.zeros(0, np.int64)

    def add(self, source_index: np.ndarray) -> None:
        n = source_index.size
        if not n:
            return
        shift = np.asarray(source_index, dtype=np.int64) - np.arange(self._kept, self._kept + n, dtype=np.int64)
        change = np.flatnonzero(shift[1:] != shift[:-1]) + 1
        if self._last is None or shift[0] != self._last:
            change = np.concatenate([[0], change])
        self._starts.append(change + self._kept)
        self._shifts.append(shift[change])
        self._last = shift[-1]
        self._kept += n

    def finish(self) -> "SourceMap":
        if self._starts:
            self.starts = np.concatenate(self._starts)
            self.shifts = np.concatenate(self._shifts)
            self._starts, self._shifts = [], []
        return self

    def __getitem__(self, samples) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.int64)
        if not self.starts.size:
            return samples
        run = np.searchsorted(self.starts, samples, side="right") - 1
        return samples + self.shifts[run]

    @property
    def num_samples(self) -> int:
        """Kept samples added so far."""
        return self._kept

    def first_kept_at(self, positions) -> np.ndarray:
        """The inverse, for each stream position: the first kept sample at or after it
        (``num_samples`` past the last); skipped records leave gaps between the runs."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.starts.size:
            return np.minimum(positions, self._kept)
        run_first = self.starts + self.shifts  # each run's first position, increasing
        run = np.searchsorted(run_first, positions, side="right") - 1
        inside = run >= 0
        run = np.maximum(run, 0)
        k = np.where(inside, positions - self.shifts[run], 0)
        run_end = np.append(self.starts[1:], self._kept)[run]
        return np.where(k < run_end, k, run_end)  # in a gap after the run: the next run's first sample


class _Counts:
    """A growing array of token counts: uint16 (2 bytes a sample) until a count needs more.

    One block, doubled when full (its untouched tail is never resident). Thousands of small
    per-batch arrays would instead sit between pass one's short-lived decode buffers and keep
    the heap from shrinking: resident memory then grew with the number of batches.
    """

    def __init__(self) -> None:
        self._data = np.empty(1 << 16, np.uint16)
        self.size = 0

    def extend(self, counts: np.ndarray) -> None:
        n = self.size + counts.size
        if self._data.dtype == np.uint16 and counts.size and counts.max() >= 2**16:
            self._data = self._data.astype(np.int32)
        if n > self._data.size:
            grown = np.empty(max(n, 2 * self._data.size), self._data.dtype)
            grown[:self.size] = self._data[:self.size]
            self._data = grown
        self._data[self.size:n] = counts
        self.size = n

    def take(self) -> np.ndarray:
        """All counts (uint16 when every one is below 65,536, else int32); the log forgets them."""
        out, self._data, self.size = self._data[:self.size], np.empty(0, np.uint16), 0
        return out


class SampleLog:
    """What pass one keeps: the token counts, the source map and the totals."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._lengths = _Counts()
        self.sources = SourceMap()
        self.totals = ReadTotals()

    def add(self, lengths: np.ndarray, source_index: np.ndarray, targets: np.ndarray, tail: np.ndarray) -> None:
        """One validated batch: ``targets`` are runtime target counts, ``tail`` those past the cap."""
        t, cap = self.totals, self.cap
        runtime = lengths.astype(np.int64) - 1
        over = runtime > cap
        no_target = targets == 0
        if over.any():
            if t.first_over < 0:
                t.first_over = t.samples + int(np.argmax(over))
            r = runtime[over]
            t.over_samples += int(over.sum())
            t.over_runtime += int(r.sum())
            t.over_excess += int((r - cap).sum())
            t.over_targets += int(targets[over].sum())
            t.over_tail_targets += int(tail[over].sum())
            t.over_no_target += int((no_target & over).sum())
            t.over_none_kept += int((targets[over] == tail[over]).sum())
            t.over_pieces += int((-(-r // cap)).sum())
        t.samples += lengths.size
        t.runtime_tokens += int(runtime.sum())
        t.target_tokens += int(targets.sum())
        t.no_target += int(no_target.sum())
        if lengths.size and lengths.max() >= 2**31:
            raise DataError(f"a sample of {int(lengths.max())} tokens is longer than packer supports (2**31 - 1)")
        self._lengths.extend(lengths)
        self.sources.add(source_index)

    def lengths(self) -> np.ndarray:
        """All token counts as one array, handed over (the log keeps none): uint16 when every
        sample is shorter than 65,536 tokens (2 bytes a sample), else int32."""
        return self._lengths.take()


@dataclass
class OverlongCounts:
    samples: int = 0
    tokens_lost: int = 0
    targets_lost: int = 0
    pieces: int = 0
    dropped: int = 0


@njit(cache=True, nogil=True)
def _aligned(s, m):
    """Runtime length ``s`` padded up to a multiple of ``m``."""
    return (s + m - 1) // m * m


@njit(cache=True, nogil=True)
def _first_pieces(lengths, cap, m, drop, out):
    """Padded length of each sample's first sequence (0 when dropped); returns how many
    sequences have alignment padding."""
    misaligned = 0
    for k in range(lengths.size):
        s = lengths[k] - 1
        if s > cap:
            if drop:
                out[k] = 0
                continue
            s = cap
        out[k] = _aligned(s, m)
        if out[k] != s:
            misaligned += 1
    return misaligned


@njit(cache=True, nogil=True)
def _extra_pieces(lengths, cap, m, samples, out_sample, out_offset, out_length, out_padded):
    """Pieces 2.. of the split samples ``samples`` (in sample order); returns how many have
    alignment padding."""
    e = 0
    misaligned = 0
    for k in samples:
        s = lengths[k] - 1
        offset = cap
        while offset < s:
            out_sample[e] = k
            out_offset[e] = offset
            out_length[e] = min(s - offset, cap)
            out_padded[e] = _aligned(out_length[e], m)
            if out_padded[e] != out_length[e]:
                misaligned += 1
            offset += cap
            e += 1
    return misaligned


@njit(cache=True, nogil=True)
def _resolve(items, lengths, block_start, block, cap, m, extra_sample, extra_offset, extra_length,
             sample, offset, length, padded, src):
    n = lengths.size
    for t in range(items.size):
        q = items[t]
        if q < n:
            k = q
            o = 0
            s = min(lengths[k] - 1, cap)
        else:
            e = q - n
            k = extra_sample[e]
            o = extra_offset[e]
            s = extra_length[e]
        sample[t] = k
        offset[t] = o
        length[t] = s
        padded[t] = _aligned(s, m)
        src[t] = sample_start(k, lengths, block_start, block) + o


@njit(cache=True, nogil=True, inline="always")
def sample_start(k, lengths, block_start, block):
    """Stream position of sample ``k``'s first token (``block_start`` holds every
    ``block``-th sample's: see :func:`_block_starts`)."""
    start = block_start[k // block]
    for j in range(k - k % block, k):
        start += lengths[j]
    return start


@njit(cache=True, nogil=True)
def _block_starts(lengths, block):
    out = np.zeros((lengths.size + block - 1) // block + 1, np.int64)
    acc = 0
    for k in range(lengths.size):
        if k % block == 0:
            out[k // block] = acc
        acc += lengths[k]
    out[-1] = acc
    return out


@dataclass
class Resolved:
    """Per-sequence columns of a run of items (run-sized arrays)."""

    sample: np.ndarray   # int32 kept-sample index
    offset: np.ndarray   # int32 runtime start within the sample
    length: np.ndarray   # int32 real runtime length s
    padded: np.ndarray   # int32 padded length p
    src: np.ndarray      # int64 stream position of the sequence's first token


@dataclass
class Items:
    """The sequences to pack, derived from the sample lengths (see the module docstring)."""

    lengths: np.ndarray | None      # token count of each kept sample (uint16 or int32)
    num_samples: int
    cap: int
    m: int
    extra_sample: np.ndarray        # pieces 2.. of split samples: item N + e
    extra_offset: np.ndarray
    extra_length: np.ndarray
    misaligned: int                 # sequences whose padded length differs from the real one
    block_start: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))

    @property
    def num_items(self) -> int:
        return self.num_samples + self.extra_sample.size

    def attach(self, lengths: np.ndarray) -> None:
        """(Re)attach the sample lengths and index the spill offsets, once per 64 samples."""
        self.lengths = lengths
        self.block_start = _block_starts(lengths, BLOCK)

    def resolve(self, items: np.ndarray) -> Resolved:
        items = np.ascontiguousarray(items)
        r = Resolved(*(np.empty(items.size, np.int32) for _ in range(4)), np.empty(items.size, np.int64))
        _resolve(items, self.lengths, self.block_start, BLOCK, self.cap, self.m, self.extra_sample,
                 self.extra_offset, self.extra_length, r.sample, r.offset, r.length, r.padded, r.src)
        return r


def build_items(lengths: np.ndarray, totals: ReadTotals, spec: PackSpec, locate) -> tuple[Items, np.ndarray, OverlongCounts]:
    """The items of all kept samples and their padded lengths (the planner's input, int32,
    0 for dropped samples), under the spec's alignment and over-long policy."""
    m, cap, policy = spec.pad_multiple, spec.max_sequence_length, spec.overlong
    counts = OverlongCounts(samples=totals.over_samples)
    if totals.over_samples and policy is OverlongPolicy.ERROR:
        first = totals.first_over
        raise DataError(
            f"{locate(first)}: sample has {int(lengths[first]) - 1} runtime tokens, more than the "
            f"{cap} a pack of {spec.pack_size} can hold (alignment {m}); use --overlong truncate|drop|split"
        )
    if policy is OverlongPolicy.DROP:
        counts.dropped = totals.over_samples
        counts.tokens_lost = totals.over_runtime
        counts.targets_lost = totals.over_targets
    elif policy is OverlongPolicy.TRUNCATE:
        counts.tokens_lost = totals.over_excess
        counts.targets_lost = totals.over_tail_targets
    elif policy is OverlongPolicy.SPLIT:
        counts.pieces = totals.over_pieces
    padded_first = np.empty(lengths.size, np.int32)
    misaligned = _first_pieces(lengths, cap, m, policy is OverlongPolicy.DROP, padded_first)
    n_extra = counts.pieces - counts.samples if policy is OverlongPolicy.SPLIT else 0
    extra = [np.empty(n_extra, np.int32) for _ in range(4)]
    if n_extra:
        over = np.flatnonzero(lengths.astype(np.int64) - 1 > cap)
        misaligned += _extra_pieces(lengths, cap, m, over, *extra)
        padded_first = np.concatenate([padded_first, extra[3]])
    items = Items(lengths=None, num_samples=lengths.size, cap=cap, m=m, extra_sample=extra[0],
                  extra_offset=extra[1], extra_length=extra[2], misaligned=misaligned)
    return items, padded_first, counts

"""From samples to sequences: runtime lengths, alignment padding and the over-long policy.

A sample of n tokens has s = n − 1 runtime positions (inputs t[0:n−1], labels t[1:n]). Each
sequence is padded to p = ceil(s/m)·m. A sample whose p exceeds the pack size C is handled by
the over-long policy; with ``split`` it becomes several sequences, each covering consecutive
runtime positions [offset, offset + s) of its sample.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packer_cli.errors import DataError
from packer_cli.spec import OverlongPolicy, PackSpec


@dataclass
class SequenceTable:
    """One entry per packed sequence (vectorized int32 columns: 16 bytes a sequence).

    int32 always suffices: lengths are at most the pack size, offsets lie inside one sample
    (stored as int32 in the shards too) and there are fewer than 2**31 samples.
    """

    sample: np.ndarray   # index into the kept-sample arrays
    offset: np.ndarray   # runtime start within the sample
    length: np.ndarray   # real runtime length s
    padded: np.ndarray   # padded length p


@dataclass
class OverlongCounts:
    samples: int = 0
    tokens_lost: int = 0
    targets_lost: int = 0
    pieces: int = 0


def build_sequences(lengths: np.ndarray, tail_targets: np.ndarray, targets: np.ndarray,
                    spec: PackSpec, locate) -> tuple[SequenceTable, OverlongCounts, np.ndarray]:
    """Sequences of all kept samples under the spec's alignment and over-long policy.

    ``lengths`` are sample token counts (n ≥ 2); ``targets`` the runtime target counts and
    ``tail_targets`` the targets a truncation to the maximum length would lose. Returns the
    table, the over-long counts and a boolean mask of samples that were dropped.
    """
    m, cap = spec.pad_multiple, spec.max_sequence_length
    runtime = lengths - 1
    over = runtime > cap
    counts = OverlongCounts(samples=int(over.sum()))
    dropped = np.zeros(lengths.size, dtype=bool)
    policy = spec.overlong
    if counts.samples and policy is OverlongPolicy.ERROR:
        first = int(np.flatnonzero(over)[0])
        raise DataError(
            f"{locate(first)}: sample has {runtime[first]} runtime tokens, more than the "
            f"{cap} a pack of {spec.pack_size} can hold (alignment {m}); use --overlong truncate|drop|split"
        )
    sample = np.arange(lengths.size, dtype=np.int64)
    if policy is OverlongPolicy.SPLIT and counts.samples:
        pieces = np.where(over, -(-runtime // cap), 1)
        counts.pieces = int(pieces[over].sum())
        sample = np.repeat(sample, pieces)
        first_piece = np.concatenate([[0], np.cumsum(pieces)[:-1]])
        offset = (np.arange(sample.size) - np.repeat(first_piece, pieces)) * cap
        length = np.minimum(runtime[sample] - offset, cap)
        return _table(sample, offset, length, m), counts, dropped
    if policy is OverlongPolicy.DROP:
        dropped = over
        counts.tokens_lost = int(runtime[over].sum())
        counts.targets_lost = int(targets[over].sum())
        sample = sample[~over]
        length = runtime[~over]
    else:  # truncate
        counts.tokens_lost = int((runtime[over] - cap).sum())
        counts.targets_lost = int(tail_targets[over].sum())
        length = np.minimum(runtime, cap)
    return _table(sample, np.zeros(sample.size, dtype=np.int64), length, m), counts, dropped


def _table(sample, offset, length, m) -> SequenceTable:
    length = length.astype(np.int32)
    padded = (-(-length // m) * m).astype(np.int32)
    return SequenceTable(sample=sample.astype(np.int32), offset=offset.astype(np.int32), length=length,
                         padded=padded)

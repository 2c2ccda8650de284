"""Hand-made packs for tests and examples: the stored row format, built the obvious way.

``make_row`` lays samples out exactly as packer's writer stores them, so batch-building
code can be tested on tiny packs with known answers, without writing shards::

    >>> row = make_row([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], multiple=4)
    >>> row.cu_seqlens.tolist(), row.seq_lens.tolist(), row.last_token.tolist()
    ([0, 8, 12], [5, 3], [6, 10])

A sample of ``n`` tokens is a sequence of runtime length ``s = n - 1``: inputs
``sample[:-1]``, final label ``sample[-1]``; the label-aligned loss mask is 1 where the
next token is a target. ``InMemoryReader`` serves such rows with a metadata dict, the
way ``packer_cli.shards.reader.PackedReader`` serves shards.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import numpy as np

from packer_cli.shards.format import FORMAT_VERSION


def make_row(
    samples: Sequence[Sequence[int]],
    *,
    multiple: int = 1,
    pad_id: int = 0,
    targets: Sequence[Sequence[int]] | None = None,
    source_index: Sequence[int] | None = None,
) -> SimpleNamespace:
    """One stored pack from whole samples.

    Args:
        samples: token lists, each of at least 2 tokens.
        multiple: per-sequence padding multiple ``m`` (``p = ceil(s / m) * m``).
        pad_id: token written into alignment padding.
        targets: optional input-aligned masks (1 = this token is a training target); the
            stored mask is label-aligned, ``loss[j] = targets[j + 1]``. Default: all targets.
        source_index: sample indices to record (default ``0..N-1``).
    """
    tokens, loss, cu, lens, last = [], [], [0], [], []
    for k, sample in enumerate(samples):
        x = np.asarray(sample, dtype=np.int64)
        if x.size < 2:
            raise ValueError("a sample needs at least 2 tokens (inputs + final label)")
        s = x.size - 1
        p = -(-s // multiple) * multiple
        tgt = np.ones(x.size, dtype=np.uint8) if targets is None else np.asarray(targets[k], dtype=np.uint8)
        tokens += [x[:-1], np.full(p - s, pad_id)]
        loss += [tgt[1:], np.zeros(p - s, dtype=np.uint8)]
        cu.append(cu[-1] + p)
        lens.append(s)
        last.append(int(x[-1]))
    n = len(samples)
    return SimpleNamespace(
        tokens=np.concatenate(tokens).astype(np.int32) if n else np.zeros(0, np.int32),
        loss_mask=np.concatenate(loss).astype(np.uint8) if n else np.zeros(0, np.uint8),
        cu_seqlens=np.asarray(cu, dtype=np.int32),
        seq_lens=np.asarray(lens, dtype=np.int32),
        last_token=np.asarray(last, dtype=np.int32),
        source_index=np.asarray(source_index if source_index is not None else range(n), dtype=np.int64),
        source_offset=np.zeros(n, dtype=np.int32),
    )


def make_meta(
    rows: Sequence[SimpleNamespace],
    *,
    pack_size: int,
    multiple: int = 1,
    cp: int = 1,
    pad_id: int = 0,
    pad_to_max_length: bool = False,
    pad_cu_seqlens: bool = False,
) -> dict:
    """A ``metadata.json``-shaped dict for ``rows``, with Bridge's packing statistics."""
    physical = [int(r.cu_seqlens[-1]) for r in rows]
    seq_max = [int(np.diff(r.cu_seqlens).max()) for r in rows if r.seq_lens.size]
    return {
        "format_version": FORMAT_VERSION,
        "spec": {
            "pack_size": pack_size,
            "pad_seq_to_mult": multiple,
            "cp": cp,
            "tp": 1,
            "sp": False,
            "pad_id": pad_id,
            "pad_to_max_length": pad_to_max_length,
            "pad_cu_seqlens": pad_cu_seqlens,
        },
        "bridge": {
            "dataset_max_seqlen": max(seq_max, default=0),
            "max_samples_per_bin": max((int(r.seq_lens.size) for r in rows), default=0),
            "min_packed_seqlen": min(physical, default=0),
            "pack_size": pack_size,
        },
    }


class InMemoryReader:
    """Reader-shaped access (``metadata``, ``len``, ``row(i)``) to rows held in memory."""

    def __init__(self, rows: Sequence[SimpleNamespace], metadata: dict) -> None:
        self.rows = list(rows)
        self.metadata = metadata

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> SimpleNamespace:
        return self.rows[i]

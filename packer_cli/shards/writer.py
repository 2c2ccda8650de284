"""Write packs into Arrow IPC shards and describe them in a manifest.

The pipeline hands each run of packs over as flat arrays (see ``SpillReader.gather``), turns it
into one record batch with :func:`pack_record_batch` and appends it to its :class:`ShardFile`
(which runs go to which shard is decided before any is written, so shards can be written side
by side). Every byte is hashed on its way to the file (no re-read), and the manifest lists
name, bytes, rows, tokens and hash.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import xxhash

from packer_cli._arrow import list_array
from packer_cli.shards._sink import OutputFile
from packer_cli.shards.format import CHECKSUM, PACK_SCHEMA, shard_name


def pack_record_batch(tokens, loss_mask, cu_seqlens, seq_lens, last_token, source_index, source_offset,
                      pack_seq_offsets: np.ndarray) -> pa.RecordBatch:
    """One record batch of packs from flat arrays; ``pack_seq_offsets`` delimits sequences.

    ``loss_mask`` (0/1 a token) is stored as a bitmap: the batch's masks are packed 8 a byte
    end to end, so a pack's mask may start mid-byte (Arrow's boolean layout).
    """
    n_packs = pack_seq_offsets.size - 1
    seq_counts = np.diff(pack_seq_offsets)
    cu_offsets = pack_seq_offsets + np.arange(n_packs + 1)
    token_offsets = cu_seqlens[cu_offsets[1:] - 1].astype(np.int64).cumsum()
    token_offsets = np.concatenate([[0], token_offsets])
    assert token_offsets[-1] == tokens.size and seq_counts.sum() == seq_lens.size
    columns = [
        list_array(token_offsets, tokens, pa.int32()),
        list_array(token_offsets, loss_mask, pa.bool_()),
        list_array(cu_offsets, cu_seqlens, pa.int32()),
        list_array(pack_seq_offsets, seq_lens, pa.int32()),
        list_array(pack_seq_offsets, last_token, pa.int32()),
        list_array(pack_seq_offsets, source_index, pa.int64()),
        list_array(pack_seq_offsets, source_offset, pa.int32()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=PACK_SCHEMA)


def file_checksum(path: str) -> str:
    digest = xxhash.xxh3_64()
    buffer = bytearray(1 << 22)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


class ShardFile:
    """One ``packs-NNNNN.arrow``: record batches are appended (and hashed on their way to the
    file); :meth:`finish` writes the footer and returns the shard's manifest entry.

    A context manager, so a shard abandoned by an error is closed; the pipeline writes into a
    temporary directory, so an unfinished shard is never seen as output.
    """

    def __init__(self, directory: str, index: int, direct: bool = True):
        self.name = shard_name(index)
        self.path = os.path.join(directory, self.name)
        self._sink = OutputFile(self.path, direct=direct)
        self._writer = pa.ipc.new_file(self._sink, PACK_SCHEMA)
        self.rows = self.tokens = 0

    def __enter__(self) -> "ShardFile":
        return self

    def __exit__(self, *exc) -> None:
        self._sink.discard()  # after finish() a no-op; otherwise the shard is abandoned

    def write(self, batch: pa.RecordBatch, tokens: int) -> None:
        self._writer.write_batch(batch)
        self.rows += batch.num_rows
        self.tokens += tokens

    def finish(self) -> dict:
        self._writer.close()
        self._sink.close()
        return {"name": self.name, "bytes": os.path.getsize(self.path), "rows": self.rows, "tokens": self.tokens,
                CHECKSUM: self._sink.digest.hexdigest()}

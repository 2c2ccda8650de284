"""Write one split as Bridge's Parquet file, from the same gathered packs as the native shards.

::

    spill ─SpillReader.gather─▶ native runtime rows ─to_bridge_rows─▶ stored rows ─▶ {split}_{C}.idx.parquet

The native gather (:class:`packer_cli.shards._gather.SpillReader`) produces each pack's runtime
stream; :func:`to_bridge_rows` re-lays it out the way Bridge stores it (each sequence followed by
its last label, alignment padding as the end-of-sequence id) in one compiled pass. Steps
are whole multiples of the row-group size, so every group but the last has exactly
``row_group_size`` packs.

Parquet encoding (compression, above all) is most of the work. Each step's row groups are
encoded by the thread that built it (:func:`~packer_cli.shards._parquet_encode.
encode_list_columns`: packer's own encoder, about half the CPU of pyarrow's writer on these
columns), and :func:`write_bridge_file` appends the steps' pages to the split's one file in
order and writes one footer (:mod:`packer_cli.shards._parquet_stitch`), so both cores encode.
With ``PACKER_PARQUET_ENCODER=arrow`` each step is a Parquet file pyarrow wrote, and the files
are joined into the same bytes one pyarrow writer would produce.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packer_cli._arrow import list_array
from packer_cli._kernel_cache import njit
from packer_cli.errors import ConfigError, counted, env_choice
from packer_cli.shards.bridge import BRIDGE_FORMAT, BRIDGE_FORMAT_VERSION, PARQUET_ENCODING_NAMES
from packer_cli.shards._parquet_encode import EncodedPart, encode_list_columns
from packer_cli.shards._parquet_stitch import ParquetStitcher
from packer_cli.shards._sink import OutputFile

#: Set ``PACKER_PARQUET_ENCODER=arrow`` to encode the split's row groups with pyarrow's writer
#: instead of :func:`~packer_cli.shards._parquet_encode.encode_list_columns`.
ENV_ENCODER = "PACKER_PARQUET_ENCODER"
ENCODERS = ("packer", "arrow")  # the first is the default

#: Tokens gathered per write step (about 40 bytes per token while a step is built; a few steps
#: are in flight).
BATCH_TOKENS = 1 << 20

#: Bridge's three columns with the types its reader documents (its own writer stores int64 ids
#: and starts; the reader takes any integer type, and 32 bits halve what is encoded), then
#: packer's own (ignored by Bridge).
BRIDGE_SCHEMA = pa.schema([
    pa.field("input_ids", pa.list_(pa.int32())),
    pa.field("loss_mask", pa.list_(pa.int8())),
    pa.field("seq_start_id", pa.list_(pa.int32())),
    pa.field("packer_seq_lens", pa.list_(pa.int32())),
    pa.field("packer_source_index", pa.list_(pa.int64())),
    pa.field("packer_source_offset", pa.list_(pa.int32())),
])


def packs_per_step(row_group_size: int, pack_size: int) -> int:
    """Packs written per step: whole row groups, about ``BATCH_TOKENS`` tokens (at least one group)."""
    return row_group_size * max(1, BATCH_TOKENS // (row_group_size * pack_size))


def resolve_eos(eos_id: int | None, last_tokens: np.ndarray, needs_padding: bool) -> tuple[int | None, str]:
    """The end-of-sequence id to pad with, and where it came from.

    ``--eos-id`` wins. Otherwise, when every sample ends with the same token, that token is the
    EOS id ("inferred"). Otherwise it is needed only if some sequence has alignment padding:
    then this raises a :class:`ConfigError` asking for ``--eos-id``.
    """
    if eos_id is not None:
        return int(eos_id), "given"
    if last_tokens.size and (last_tokens == last_tokens[0]).all():
        return int(last_tokens[0]), "inferred"
    if not needs_padding:
        return None, "not needed"
    values, counts = np.unique(last_tokens, return_counts=True)
    top = np.argsort(counts)[::-1][:3]
    seen = ", ".join(f"{int(values[k])} ({counted(int(counts[k]), 'sample')})" for k in top)
    raise ConfigError(
        "alignment padding must use the end-of-sequence id (Bridge finds real lengths by scanning "
        f"for it), but samples end with different tokens ({seen}{', ...' if values.size > 3 else ''}); "
        "pass --eos-id"
    )


def to_bridge_rows(tokens, mask, last, seq_len, seq_pad, pack_seq_offsets, eos):
    """Bridge's stored layout of a run of packs, from the native runtime stream.

    Sequence ``k`` (real runtime length ``s``, padded ``p``) occupies native positions
    ``[o, o + p)`` and stored positions ``[o + k, o + k + p + 1)``: its ``s`` real inputs, then
    its last label, then ``p - s`` copies of ``eos``. The stored loss mask is the native one
    shifted the same way, with 0 on the sequence's final slot.

    Returns ``(input_ids int32, loss_mask int8, row_offsets, seq_start_id int32)``: flat stored
    values, each pack's stored extent, and each sequence's start within its pack.
    """
    p = seq_pad.astype(np.int64)
    n = p.size
    ids = np.empty(int(p.sum()) + n, dtype=np.int32)
    loss = np.empty(ids.size, dtype=np.int8)
    stored_start = np.empty(n, dtype=np.int64)
    _lay_out_stored(tokens, mask, last, seq_len, seq_pad, 0 if eos is None else eos, ids, loss, stored_start)
    seq_ends = np.concatenate([[0], np.cumsum(p + 1)])
    row_offsets = seq_ends[pack_seq_offsets]
    pack_of_seq = np.repeat(np.arange(pack_seq_offsets.size - 1), np.diff(pack_seq_offsets))
    seq_start = (stored_start - row_offsets[pack_of_seq]).astype(np.int32)
    return ids, loss, row_offsets, seq_start


@njit(cache=True, nogil=True)
def _lay_out_stored(tokens, mask, last, seq_len, seq_pad, fill, ids, loss, stored_start):
    """Copy each sequence's inputs, last label, padding and mask to its stored place (one pass,
    the GIL released: the two building threads run it side by side). Slice copies, not loops
    over elements: numba turns them into block copies, 3x faster here (1.2 against 4 ms a
    million tokens)."""
    native = stored = 0
    for k in range(seq_pad.size):
        s, p = np.int64(seq_len[k]), np.int64(seq_pad[k])
        stored_start[k] = stored
        ids[stored:stored + s] = tokens[native:native + s]
        ids[stored + s] = last[k]
        ids[stored + s + 1:stored + p + 1] = fill
        loss[stored:stored + p] = mask[native:native + p]
        loss[stored + p] = 0
        native += p
        stored += p + 1


def logical_length_mismatches(tokens, last, seq_len, seq_pad, eos) -> tuple[int, int]:
    """How many sequences Bridge's EOS scan would measure too short, and too long (by one).

    With ``pad_seq_to_mult > 1`` Bridge takes a sequence's real length to end at its last input
    that is not EOS. Too short: the real inputs themselves end with EOS (then trailing real
    tokens are treated as padding). Too long by one: the last label is not EOS and padding
    follows (harmless: one extra causal position with loss 0).
    """
    p = seq_pad.astype(np.int64)
    s = seq_len.astype(np.int64)
    native_start = np.concatenate([[0], np.cumsum(p)[:-1]]).astype(np.int64)
    last_input = tokens[native_start + s - 1]
    short = (last_input == eos) & ((p == s) | (last == eos))
    long = (p > s) & (last != eos)
    return int(short.sum()), int(long.sum())


def bridge_schema(eos: int | None) -> pa.Schema:
    """The split file's schema, with packer's format and the EOS id in its key-value metadata."""
    return BRIDGE_SCHEMA.with_metadata({
        "packer_format": BRIDGE_FORMAT, "packer_format_version": str(BRIDGE_FORMAT_VERSION),
        "eos_id": "" if eos is None else str(eos),
    })


#: How the split file is encoded (``--parquet-encoding``): pyarrow writer settings by name.
#: Nothing is dictionary-encoded (pyarrow's default, and Bridge's own writer's): with row
#: groups of about 1 MiB (:func:`~packer_cli.shards.bridge.default_row_group_size`) each group's
#: dictionary of ids held about 60 % as many ids as the group itself, so it made the file no
#: smaller (4.86 against 4.70 bytes a token, int64 ids with Snappy) and tripled the encoding
#: time; the 0/1 loss mask stored plainly compresses as well under Zstandard (+0.005 bytes a
#: token) and 4 % worse under Snappy, for 10-50 % less encoding time.
PARQUET_ENCODINGS: dict[str, dict] = {
    # every Parquet reader, any pyarrow version
    "plain-zstd": dict(use_dictionary=False, compression="zstd", compression_level=1),
    # Bridge's own writer's codec, the fastest to write and decode, the largest file
    "plain-snappy": dict(use_dictionary=False, compression="snappy"),
    # ids split into byte streams (their high bytes compress to nothing): the smallest file for
    # ids without repeats, 6-13 % larger than plain-zstd on real text (the streams break up its n-grams);
    # readers need Parquet's BYTE_STREAM_SPLIT for integers (Arrow/pyarrow >= 16)
    "split-zstd": dict(use_dictionary=False, compression="zstd", compression_level=1,
                       use_byte_stream_split=["input_ids.list.element"]),  # pyarrow names values by path
}
DEFAULT_PARQUET_ENCODING = PARQUET_ENCODING_NAMES[0]
assert tuple(PARQUET_ENCODINGS) == PARQUET_ENCODING_NAMES


def writes_integer_byte_streams() -> bool:
    """Whether this pyarrow writes BYTE_STREAM_SPLIT for integers (``split-zstd``): 16 and later;
    before, the write failed at the first row group ("only supports FLOAT and DOUBLE")."""
    return int(pa.__version__.split(".")[0]) >= 16


def encode_parquet(table: pa.Table, schema: pa.Schema, row_group_size: int,
                   encoding: str = DEFAULT_PARQUET_ENCODING) -> pa.Buffer:
    """``table`` as a complete Parquet file in memory, with the settings of every part of a
    split's file (:data:`PARQUET_ENCODINGS`; statistics off: nobody reads them)."""
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, schema, write_statistics=False, **PARQUET_ENCODINGS[encoding]) as writer:
        if table.num_rows:  # pyarrow would write an empty row group
            writer.write_table(table, row_group_size=row_group_size)
    return sink.getvalue()


def _encode(columns, eos: int | None, row_group_size: int, encoding: str) -> EncodedPart | pa.Buffer:
    """Bridge's six columns (``(row offsets, values)`` each) as row groups to join into the file:
    by packer's encoder, or as a file of pyarrow's writer (``PACKER_PARQUET_ENCODER=arrow``)."""
    if env_choice(ENV_ENCODER, ENCODERS) == "arrow":
        table = pa.Table.from_arrays([list_array(offsets, values, f.type.value_type)
                                      for (offsets, values), f in zip(columns, BRIDGE_SCHEMA)], schema=BRIDGE_SCHEMA)
        return encode_parquet(table, bridge_schema(eos), row_group_size, encoding)
    return encode_list_columns(columns, bridge_schema(eos), row_group_size, PARQUET_ENCODINGS[encoding])


@dataclass
class BridgeStep:
    """One write step: whole row groups encoded as a Parquet file of their own, and what the
    step adds to the split file's totals."""

    part: EncodedPart | pa.Buffer  # a pa.Buffer: a whole file pyarrow wrote (PACKER_PARQUET_ENCODER=arrow)
    packs: int
    stored_tokens: int
    runtime_tokens: int
    eos_scan_too_short: int
    eos_scan_too_long: int


def bridge_step(tokens, mask, last, seq_len, seq_pad, seq_source, seq_offset, run_offsets, *, eos: int | None,
                pad_multiple: int, row_group_size: int, encoding: str = DEFAULT_PARQUET_ENCODING) -> BridgeStep:
    """Bridge's rows for a run of packs, encoded, from the native runtime stream of its sequences
    (``tokens``, label-aligned ``mask`` and ``last`` labels, as ``SpillReader.gather`` returns
    them) and their per-sequence columns; ``run_offsets`` delimits the packs."""
    ids, loss, row_offsets, seq_start = to_bridge_rows(tokens, mask, last, seq_len, seq_pad, run_offsets, eos)
    short = long = 0
    if eos is not None and pad_multiple > 1:
        short, long = logical_length_mismatches(tokens, last, seq_len, seq_pad, eos)
    columns = [(row_offsets, ids), (row_offsets, loss), (run_offsets, seq_start), (run_offsets, seq_len),
               (run_offsets, seq_source), (run_offsets, seq_offset)]
    part = _encode(columns, eos, row_group_size, encoding)
    return BridgeStep(part, run_offsets.size - 1, int(ids.size), int(tokens.size), short, long)


def write_bridge_file(path: str, *, steps: Iterable[BridgeStep], n_packs: int, eos: int | None,
                      row_group_size: int, progress, direct_io: bool = True,
                      encoding: str = DEFAULT_PARQUET_ENCODING) -> tuple[dict, dict]:
    """Join the encoded packs of ``steps`` (each whole row groups, in output order) into one
    Parquet file, hashed on its way (``direct_io``: with ``O_DIRECT`` where the file system
    allows it).

    Returns the manifest entry and the diagnostics (EOS-scan mismatches when ``m > 1``).
    """
    short = long = stored_tokens = runtime_tokens = 0
    task = progress.task("writing", total=n_packs, unit="packs")
    sink = OutputFile(path, direct=direct_io)
    try:
        stitcher = ParquetStitcher(sink)
        joined = 0
        for step in steps:
            _join(stitcher, step.part)
            joined += 1
            stored_tokens += step.stored_tokens
            runtime_tokens += step.runtime_tokens
            short, long = short + step.eos_scan_too_short, long + step.eos_scan_too_long
            progress.advance(task, step.packs)
        if not joined:  # no packs: still a file with the schema and no row groups
            none = (np.zeros(1, np.int64), np.zeros(0, np.int32))
            _join(stitcher, _encode([none] * len(BRIDGE_SCHEMA), eos, row_group_size, encoding))
        stitcher.finish()
        sink.close()
    finally:
        sink.discard()  # a no-op after close(); otherwise the file is being abandoned
    entry = {
        "name": os.path.basename(path), "bytes": os.path.getsize(path), "rows": int(n_packs),
        "tokens": runtime_tokens, "stored_tokens": stored_tokens,
        "row_group_size": int(row_group_size), "row_groups": -(-int(n_packs) // row_group_size),
        "parquet_encoding": encoding,
        "xxh3_64": sink.digest.hexdigest(),
    }
    return entry, {"eos_scan_too_short": short, "eos_scan_too_long": long}


def _join(stitcher: ParquetStitcher, part: EncodedPart | pa.Buffer) -> None:
    if isinstance(part, EncodedPart):
        stitcher.add_encoded(part)
    else:
        stitcher.add(part)

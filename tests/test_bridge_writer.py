"""The Bridge writer's two parallel parts: the stored layout kernel and joining Parquet parts.

* ``to_bridge_rows`` (one compiled pass) must lay out exactly what the plain NumPy formulation
  below does, for any sequence lengths, padding and EOS id;
* a split file joined from parts that pyarrow encoded apart must be byte for byte the file one
  pyarrow writer makes of the same row groups, and read back the same.
"""
from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from packer_cli._arrow import list_array
from packer_cli._thrift import read_fields, write_fields
from packer_cli.shards._parquet_stitch import ParquetStitcher, StitchError, _parse, split_file
from packer_cli.shards.bridge import PARQUET_ENCODING_NAMES
from packer_cli.shards.bridge_writer import (
    BRIDGE_SCHEMA, PARQUET_ENCODINGS, bridge_schema, encode_parquet, to_bridge_rows, writes_integer_byte_streams,
)


# -- the stored layout -----------------------------------------------------------------------------
def reference_rows(tokens, mask, last, seq_len, seq_pad, pack_seq_offsets, eos):
    """Bridge's stored layout with whole-array NumPy operations (the slow, obvious formulation)."""
    n = seq_pad.size
    p, s = seq_pad.astype(np.int64), seq_len.astype(np.int64)
    native_start = np.concatenate([[0], np.cumsum(p)[:-1]]).astype(np.int64)
    stored_start = native_start + np.arange(n, dtype=np.int64)
    seq_of_token = np.repeat(np.arange(n, dtype=np.int64), p)
    dest = np.arange(int(p.sum()), dtype=np.int64) + seq_of_token
    real = (np.arange(dest.size, dtype=np.int64) - native_start[seq_of_token]) < s[seq_of_token]
    ids = np.full(int(p.sum()) + n, 0 if eos is None else eos, dtype=np.int64)
    ids[dest[real]] = tokens[real]
    ids[stored_start + s] = last
    loss = np.zeros(ids.size, dtype=np.int8)
    loss[dest] = mask
    row_offsets = np.concatenate([[0], np.cumsum(p + 1)])[pack_seq_offsets]
    pack_of_seq = np.repeat(np.arange(pack_seq_offsets.size - 1), np.diff(pack_seq_offsets))
    return ids, loss, row_offsets, stored_start - row_offsets[pack_of_seq]


@st.composite
def runs_of_packs(draw):
    """A gathered run: sequences (real length s ≥ 1, padded p ≥ s) grouped into packs."""
    seqs = draw(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 5)), min_size=1, max_size=30))
    seq_len = np.array([s for s, _ in seqs], dtype=np.int32)
    seq_pad = np.array([s + extra for s, extra in seqs], dtype=np.int32)
    cuts = sorted(draw(st.sets(st.integers(1, len(seqs) - 1), max_size=len(seqs) - 1))) if len(seqs) > 1 else []
    pack_seq_offsets = np.array([0, *cuts, len(seqs)], dtype=np.int64)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    total = int(seq_pad.sum())
    tokens = rng.integers(0, 200_000, total).astype(np.int32)
    mask = rng.integers(0, 2, total).astype(np.uint8)
    last = rng.integers(0, 200_000, len(seqs)).astype(np.int32)
    eos = draw(st.one_of(st.none(), st.integers(0, 200_000)))
    return tokens, mask, last, seq_len, seq_pad, pack_seq_offsets, eos


@settings(max_examples=300, deadline=None)
@given(runs_of_packs())
def test_stored_layout_matches_the_numpy_formulation(run):
    got = to_bridge_rows(*run)
    want = reference_rows(*run)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert got[0].dtype == np.int32 and got[1].dtype == np.int8 and got[3].dtype == np.int32


# -- joining Parquet parts -------------------------------------------------------------------------
def bridge_table(rng, packs: int) -> pa.Table:
    """``packs`` rows of Bridge's schema with random contents (some lists empty, large ids)."""
    lengths = rng.integers(0, 40, packs)
    seqs = rng.integers(0, 4, packs)
    off, soff = np.concatenate([[0], np.cumsum(lengths)]), np.concatenate([[0], np.cumsum(seqs)])
    n, m = int(off[-1]), int(soff[-1])
    return pa.Table.from_arrays([
        list_array(off, rng.integers(0, 2**31, n).astype(np.int32), pa.int32()),
        list_array(off, rng.integers(0, 2, n).astype(np.int8), pa.int8()),
        list_array(soff, rng.integers(0, 100, m).astype(np.int32), pa.int32()),
        list_array(soff, rng.integers(0, 100, m).astype(np.int32), pa.int32()),
        list_array(soff, rng.integers(0, 10**6, m), pa.int64()),
        list_array(soff, rng.integers(0, 100, m).astype(np.int32), pa.int32()),
    ], schema=BRIDGE_SCHEMA)


def single_writer(tables, schema, rows: int, **options) -> bytes:
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, schema, **options) as writer:
        for table in tables:
            writer.write_table(table, row_group_size=rows)
    return sink.getvalue().to_pybytes()


def stitched(parts) -> bytes:
    out = io.BytesIO()
    stitcher = ParquetStitcher(out)
    for part in parts:
        stitcher.add(part)
    size = stitcher.finish()
    assert size == len(out.getvalue())
    return out.getvalue()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(1, 4), min_size=1, max_size=7), st.integers(0, 60),
       st.integers(0, 2**32 - 1), st.sampled_from(PARQUET_ENCODING_NAMES))
def test_joined_parts_are_the_single_writer_file(rows, groups_per_part, last_packs, seed, encoding):
    """Parts of whole row groups (the last part any size) joined == one writer, byte for byte."""
    assume(encoding != "split-zstd" or writes_integer_byte_streams())
    rng = np.random.default_rng(seed)
    tables = [bridge_table(rng, rows * g) for g in groups_per_part]
    if last_packs:
        tables.append(bridge_table(rng, last_packs))
    schema = bridge_schema(7)
    parts = [encode_parquet(t, schema, rows, encoding) for t in tables]
    joined = stitched(parts)
    assert joined == single_writer(tables, schema, rows, write_statistics=False, **PARQUET_ENCODINGS[encoding])
    back = pq.read_table(pa.BufferReader(joined))
    assert back.equals(pa.concat_tables(tables).replace_schema_metadata(back.schema.metadata))


def test_many_row_groups_and_statistics_join_exactly():
    """More than 15 row groups (the footer's long list form) and pyarrow's default statistics."""
    rng = np.random.default_rng(3)
    tables = [bridge_table(rng, 40) for _ in range(9)]
    schema = bridge_schema(None)

    def part(table):
        sink = pa.BufferOutputStream()
        with pq.ParquetWriter(sink, schema) as writer:
            writer.write_table(table, row_group_size=2)
        return sink.getvalue()

    joined = stitched([part(t) for t in tables])
    assert joined == single_writer(tables, schema, 2)
    meta = pq.ParquetFile(pa.BufferReader(joined)).metadata
    assert meta.num_row_groups == 180 and meta.num_rows == 360
    assert [meta.row_group(k).num_rows for k in range(3)] == [2, 2, 2]


def test_footer_round_trips_through_the_typed_thrift_reader():
    rng = np.random.default_rng(9)
    part = encode_parquet(bridge_table(rng, 50), bridge_schema(2), 7).to_pybytes()
    footer_len = int.from_bytes(part[-8:-4], "little")
    footer = part[-8 - footer_len:-8]
    fields, end = read_fields(footer)
    assert end == footer_len
    out = bytearray()
    write_fields(out, fields)
    assert bytes(out) == footer


def test_stitcher_refuses_what_it_cannot_join():
    rng = np.random.default_rng(1)
    good = encode_parquet(bridge_table(rng, 10), bridge_schema(2), 5)
    with pytest.raises(StitchError, match="footer length out of range"):
        ParquetStitcher(io.BytesIO()).add(b"PAR1 not really PAR1")
    footer_len = int.from_bytes(good.to_pybytes()[-8:-4], "little")
    with pytest.raises(StitchError, match="Parquet footer truncated"):  # all but the footer's first 3 bytes lost
        split_file(good.to_pybytes()[:-8 - footer_len + 3] + (3).to_bytes(4, "little") + b"PAR1")
    with pytest.raises(StitchError, match="not a complete Parquet file"):
        ParquetStitcher(io.BytesIO()).add(good.to_pybytes()[:-1])
    with pytest.raises(StitchError, match="footer length out of range"):
        split_file(b"PAR1" + b"\0" * 8 + (10**6).to_bytes(4, "little") + b"PAR1")
    other = encode_parquet(bridge_table(rng, 10), bridge_schema(3), 5)  # another EOS in the metadata
    stitcher = ParquetStitcher(io.BytesIO())
    stitcher.add(good)
    with pytest.raises(StitchError, match="different schemas"):
        stitcher.add(other)
    with pytest.raises(StitchError, match="no Parquet parts"):
        ParquetStitcher(io.BytesIO()).finish()
    with pytest.raises(StitchError, match="footer length out of range"):  # a footer overlapping the leading magic
        split_file(b"PAR1" + b"\0" + (3).to_bytes(4, "little") + b"PAR1")
    raw = good.to_pybytes()  # two bytes between the footer and its length: it does not end where it says
    with pytest.raises(StitchError, match="Parquet footer does not end where its length says"):
        split_file(raw[:-8] + b"\0\0" + (footer_len + 2).to_bytes(4, "little") + b"PAR1")
    view, footer_start, footer = _parse(raw)
    for fid in (3, 4):  # FileMetaData's row count, its row groups
        tail = bytearray()
        write_fields(tail, [field for field in footer if field[0] != fid])
        with pytest.raises(StitchError, match="Parquet footer lacks its row count, its row groups or their column"):
            ParquetStitcher(io.BytesIO()).add(bytes(view[:footer_start]) + tail + len(tail).to_bytes(4, "little")
                                              + b"PAR1")
    from packer_cli.shards._parquet_encode import encode_list_columns

    def encoded(eos: int):
        offsets, one = np.array([0, 3]), np.arange(2)
        columns = [(offsets, np.array([1, 2, 3], np.int32)), (offsets, np.ones(3, np.int8)),
                   (one, np.zeros(1, np.int32)), (one, np.array([2], np.int32)), (one, np.zeros(1, np.int64)),
                   (one, np.zeros(1, np.int32))]
        return encode_list_columns(columns, bridge_schema(eos), 1, PARQUET_ENCODINGS["plain-zstd"])

    stitcher = ParquetStitcher(io.BytesIO())
    stitcher.add_encoded(encoded(2))
    with pytest.raises(StitchError, match="different schemas"):  # parts the writer encoded itself, too
        stitcher.add_encoded(encoded(3))


@pytest.mark.parametrize("encoding, ids_encoding, codec", [
    ("plain-zstd", "PLAIN", "ZSTD"), ("plain-snappy", "PLAIN", "SNAPPY"), ("split-zstd", "BYTE_STREAM_SPLIT", "ZSTD"),
])
def test_each_encoding_stores_ids_as_named_and_nothing_with_dictionaries(encoding, ids_encoding, codec):
    if encoding == "split-zstd" and not writes_integer_byte_streams():
        pytest.skip(f"pyarrow {pa.__version__} cannot write integers as byte streams (needs 16)")
    rng = np.random.default_rng(11)
    table = bridge_table(rng, 60)
    data = encode_parquet(table, bridge_schema(4), 20, encoding)
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    for g in range(meta.num_row_groups):
        assert ids_encoding in meta.row_group(g).column(0).encodings
        for c in range(6):
            column = meta.row_group(g).column(c)
            assert column.compression == codec and "RLE_DICTIONARY" not in column.encodings
    back = pq.read_table(pa.BufferReader(data))
    assert back.equals(table.replace_schema_metadata(back.schema.metadata))


@pytest.mark.parametrize("encoder", ["packer", "arrow"])
def test_a_split_without_packs_is_still_a_parquet_file(tmp_path, monkeypatch, encoder):
    """No steps at all (nothing to pack in this split): the file still has the schema, 0 rows."""
    from packer_cli.progress import Progress

    monkeypatch.setenv("PACKER_PARQUET_ENCODER", encoder)
    from packer_cli.shards.bridge_writer import write_bridge_file

    path = tmp_path / "training_512.idx.parquet"
    with Progress(enabled=False) as progress:
        entry, diagnostics = write_bridge_file(str(path), steps=[], n_packs=0, eos=None, row_group_size=4,
                                               progress=progress, direct_io=False)
    meta = pq.ParquetFile(path).metadata
    assert meta.num_rows == 0 and meta.num_row_groups == 0
    assert pq.read_schema(path).names == BRIDGE_SCHEMA.names and pq.read_schema(path).metadata[b"eos_id"] == b""
    assert meta.created_by.startswith("packer-cli" if encoder == "packer" else "parquet-cpp")
    assert entry["rows"] == 0 and entry["bytes"] == path.stat().st_size and entry["parquet_encoding"] == "plain-zstd"
    assert diagnostics == {"eos_scan_too_short": 0, "eos_scan_too_long": 0}


@pytest.mark.parametrize("pad_multiple, counted", [(1, (0, 0)), (2, (0, 1))])
def test_bridge_measures_a_padded_sequence_whose_last_label_is_not_eos_one_too_long(pad_multiple, counted):
    """Bridge takes a real length to end at the last input that is not EOS once sequences are
    padded (its pad_seq_to_mult > 1): of two sequences of 3 inputs whose last label (9) is not
    EOS, the unpadded one (p = s) is measured exactly and the padded one (p = s + 1) one too
    long; without padding nothing is counted."""
    from packer_cli.shards.bridge_writer import bridge_step

    tokens = np.array([5, 6, 7, 5, 6, 2, 0], np.int32)  # the second sequence's padding slot holds pad id 0
    step = bridge_step(tokens, np.ones(7, np.int8), np.array([9, 9], np.int32), np.array([3, 3], np.int32),
                       np.array([3, 4], np.int32), np.zeros(2, np.int64), np.zeros(2, np.int32), np.array([0, 2]),
                       eos=2, pad_multiple=pad_multiple, row_group_size=1)
    assert (step.eos_scan_too_short, step.eos_scan_too_long) == counted


def with_inline_copies(part: bytes) -> bytes:
    """``part`` laid out as pyarrow before 18 writes a file (packer supports 14 on): each column
    chunk's footer entry copied right after the chunk's pages, where its ``file_offset`` points.
    The pyarrow under test may write none, so the layout is made by hand from its file."""
    from packer_cli._thrift import STRUCT
    from packer_cli.shards._parquet_stitch import _field, _replace

    view, _, footer = _parse(part)
    out, groups = bytearray(b"PAR1"), []
    for group in _field(footer, 4)[1]:
        chunks, group_start = [], len(out)
        for chunk in _field(group, 1)[1]:
            meta = _field(chunk, 3)
            start = _field(meta, 11) or _field(meta, 9)  # the dictionary page comes first
            moved = len(out) - start
            meta = [(fid, kind, value + moved if fid in (9, 11) and value else value) for fid, kind, value in meta]
            out += view[start:start + _field(meta, 7)]
            chunk = _replace(_replace(chunk, 2, len(out)), 3, meta)
            write_fields(out, chunk)
            chunks.append(chunk)
        groups.append(_replace(_replace(group, 1, (STRUCT, chunks)), 5, group_start))
    tail = bytearray()
    write_fields(tail, _replace(footer, 4, (STRUCT, groups)))
    return bytes(out + tail + len(tail).to_bytes(4, "little") + b"PAR1")


def test_inline_chunk_copies_of_old_pyarrow_are_rewritten_with_every_position_moved():
    """Parts of pyarrow before 18 carry a copy of each column chunk's footer entry after its
    pages. Joined, each copy is rewritten in place with its moved positions, as one writer would
    have written it; a moved position past 8 KiB takes a byte more, so every position after a
    grown copy moves by the growth of all the copies before it (and not by its own)."""
    from packer_cli.shards._parquet_stitch import _field

    rng = np.random.default_rng(4)
    tables = [bridge_table(rng, 120) for _ in range(3)]
    schema = bridge_schema(5)
    parts = [with_inline_copies(encode_parquet(t, schema, 40).to_pybytes()) for t in tables]
    for part, table in zip(parts, tables):  # the hand-made layout is a file pyarrow reads
        back = pq.read_table(pa.BufferReader(part))
        assert back.equals(table.replace_schema_metadata(back.schema.metadata))
    joined = stitched(parts)
    _, footer_start, footer = _parse(joined)
    assert footer_start > sum(_parse(part)[1] - 4 for part in parts) + 4, "no copy grew: the case is not exercised"
    back = pq.ParquetFile(pa.BufferReader(joined))
    whole = pa.concat_tables(tables).replace_schema_metadata(back.schema_arrow.metadata)
    assert back.read().equals(whole)
    for g, group in enumerate(_field(footer, 4)[1]):
        assert back.read_row_group(g).equals(whole.slice(40 * g, 40))
        for chunk in _field(group, 1)[1]:
            copy, _ = read_fields(memoryview(joined)[:footer_start], _field(chunk, 2))
            assert copy == chunk, f"row group {g}: the copy at its file_offset is not its footer entry"


def page_indexed_parts(tables, schema, rows: int) -> list[bytes]:
    parts = []
    for table in tables:
        sink = pa.BufferOutputStream()
        with pq.ParquetWriter(sink, schema, write_page_index=True) as writer:
            writer.write_table(table, row_group_size=rows)
        parts.append(sink.getvalue().to_pybytes())
    return parts


def test_parts_with_a_page_index_are_refused():
    """An offset index lists its pages' positions in the part that wrote it; joined as they are,
    every part after the first would point readers that use the index (DuckDB, Spark,
    parquet-rs) into another part's bytes. packer's parts have none, and one that does is
    refused, first or later, before any of its bytes are written."""
    rng = np.random.default_rng(6)
    tables = [bridge_table(rng, 30) for _ in range(2)]
    indexed = page_indexed_parts(tables, bridge_schema(1), 10)
    assert pq.ParquetFile(pa.BufferReader(indexed[0])).metadata.row_group(0).column(0).has_offset_index
    for parts in (indexed, [encode_parquet(tables[0], bridge_schema(1), 10).to_pybytes(), indexed[1]]):
        sink = io.BytesIO()
        stitcher = ParquetStitcher(sink)
        with pytest.raises(StitchError, match="Parquet parts with a page index cannot be joined"):
            for part in parts:
                before = sink.tell()
                stitcher.add(part)
        assert sink.tell() == before  # the refused part wrote nothing

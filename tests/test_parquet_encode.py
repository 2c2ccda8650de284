"""packer's own Parquet encoder for Bridge's list columns (``shards._parquet_encode``).

What pyarrow reads back is the contract: every file ``encode_list_columns`` makes must read as
the same table, with the same Arrow schema and the same row groups, as pyarrow's writer makes of
the same rows with the same settings; packer's own decoder must read it too (on its fast path);
parts joined by the stitcher must be byte for byte the file one encoder call makes. The level
kernel is held to a NumPy formulation of Parquet's levels and RLE runs.
"""
from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packer_cli import __version__
from packer_cli._arrow import list_array
from packer_cli._thrift import I32, STRUCT, read_struct, write_fields
from packer_cli.shards import _parquet_encode
from packer_cli.shards._parquet_encode import PAGE_BYTES, _page_levels, _page_rows, encode_list_columns
from packer_cli.shards._parquet_stitch import ParquetStitcher
from packer_cli.shards.bridge import PARQUET_ENCODING_NAMES
from packer_cli.shards.bridge_writer import (
    BRIDGE_SCHEMA, PARQUET_ENCODINGS, bridge_schema, encode_parquet, writes_integer_byte_streams,
)
from packer_cli.sources.parquet_lists import ListColumnReader, RowGroupRuns
from parquet_checks import count_run_paths

ENCODINGS = [e for e in PARQUET_ENCODING_NAMES if e != "split-zstd" or writes_integer_byte_streams()]


# -- the level runs --------------------------------------------------------------------------------
def decode_runs(data: bytes, pos: int) -> tuple[list[tuple[int, int]], int]:
    """The ``(value, count)`` RLE runs of a length-prefixed level section (one value byte each)."""
    size = int.from_bytes(data[pos:pos + 4], "little")
    pos, end, runs = pos + 4, pos + 4 + size, []
    while pos < end:
        header = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            header |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        assert header & 1 == 0, "only RLE runs are written, never bit-packed ones"
        runs.append((data[pos], header >> 1))
        pos += 1
    assert pos == end
    return runs, end


def numpy_levels(lengths: np.ndarray, full: int, empty: int) -> tuple[np.ndarray, np.ndarray]:
    """Parquet's repetition and definition levels of list rows (one level for an empty row)."""
    slots = np.maximum(lengths, 1)
    starts = (np.cumsum(slots) - slots).astype(np.int64)
    rep = np.ones(int(slots.sum()), dtype=np.int64)
    rep[starts] = 0
    define = np.repeat(np.where(lengths > 0, full, empty), slots)
    return rep, define


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 300), st.just(70_000)), min_size=1, max_size=60),
       st.sampled_from([(3, 1), (2, 0), (1, 0)]))
# runs whose varint header (count << 1) is exactly 0x80 or 0x4000 take a byte more: 64 ones
# (a row of 65 values), 64 present values, 64 empty rows, 8192 ones
@example(lengths=[65], levels=(3, 1))
@example(lengths=[1] * 64 + [0] * 64, levels=(2, 0))
@example(lengths=[8193, 2], levels=(1, 0))
def test_level_runs_expand_to_parquets_levels(lengths, levels):
    lengths = np.array(lengths, dtype=np.int64)
    full, empty = levels
    out = np.empty(18 * lengths.size + 8, dtype=np.uint8)
    used = _page_levels(lengths, full, empty, out)
    data = out[:used].tobytes()
    rep_runs, pos = decode_runs(data, 0)
    def_runs, pos = decode_runs(data, pos)
    assert pos == used
    want_rep, want_def = numpy_levels(lengths, full, empty)
    for runs, want in ((rep_runs, want_rep), (def_runs, want_def)):
        got = np.repeat([v for v, _ in runs], [c for _, c in runs]).astype(np.int64)
        np.testing.assert_array_equal(got, want)
        assert all(c > 0 for _, c in runs)
        assert all(a[0] != b[0] for a, b in zip(runs, runs[1:])), "equal neighbours are merged"


def test_pages_hold_whole_rows_of_about_a_page_of_values():
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 90_000, 400)
    lengths[[10, 11, 200]] = [PAGE_BYTES // 4 + 1, 3 * PAGE_BYTES // 4, 0]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    bounds = _page_rows(starts, 4)
    assert bounds[0] == 0 and bounds[-1] == lengths.size and all(a < b for a, b in zip(bounds, bounds[1:]))
    for a, b in zip(bounds, bounds[1:]):
        page_bytes = 4 * (starts[b] - starts[a])
        assert page_bytes <= PAGE_BYTES or b == a + 1, "only a lone row may be larger than a page"
        if b < lengths.size:  # greedy: the next row would not have fitted
            assert 4 * (starts[b + 1] - starts[a]) > PAGE_BYTES


# -- files pyarrow reads ---------------------------------------------------------------------------
def bridge_columns(rng, packs: int, max_len: int = 40, huge: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``packs`` rows of Bridge's six columns (some lists empty; ``huge`` rows of a page or more)."""
    lengths = rng.integers(0, max_len + 1, packs)
    if huge and packs:
        lengths[rng.integers(0, packs, huge)] = rng.integers(PAGE_BYTES // 4, PAGE_BYTES // 2 * 3, huge)
    seqs = rng.integers(0, 4, packs)
    off, soff = np.concatenate([[0], np.cumsum(lengths)]), np.concatenate([[0], np.cumsum(seqs)])
    n, m = int(off[-1]), int(soff[-1])
    return [
        (off, rng.integers(0, 2**31, n).astype(np.int32)),
        (off, rng.integers(-128, 128, n).astype(np.int8)),
        (soff, rng.integers(0, 100, m).astype(np.int32)),
        (soff, rng.integers(0, 100, m).astype(np.int32)),
        (soff, rng.integers(-2**62, 2**62, m)),
        (soff, rng.integers(-2**31, 2**31, m).astype(np.int32)),
    ]


def as_table(columns, schema=BRIDGE_SCHEMA) -> pa.Table:
    return pa.Table.from_arrays([list_array(o, v, f.type.value_type) for (o, v), f in zip(columns, schema)],
                                schema=schema)


def ours(columns, schema, rows, encoding) -> bytes:
    return encode_list_columns(columns, schema, rows, PARQUET_ENCODINGS[encoding]).file_bytes()


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 70), st.integers(1, 30), st.integers(0, 60), st.booleans(), st.integers(0, 2**32 - 1),
       st.sampled_from(ENCODINGS))
def test_pyarrow_reads_what_pyarrows_writer_would_have_written(packs, rows, max_len, huge, seed, encoding):
    rng = np.random.default_rng(seed)
    columns = bridge_columns(rng, packs, max_len, huge=int(huge))
    schema = bridge_schema(seed % 5 or None)
    data = ours(columns, schema, rows, encoding)
    theirs = encode_parquet(as_table(columns, schema), schema, rows, encoding)
    got, want = pq.ParquetFile(io.BytesIO(data)), pq.ParquetFile(pa.BufferReader(theirs))
    assert got.schema_arrow == want.schema_arrow and got.schema_arrow.metadata == want.schema_arrow.metadata
    assert got.schema == want.schema  # the Parquet schema too
    assert got.read().equals(want.read())
    assert got.metadata.num_rows == packs and got.metadata.num_row_groups == want.metadata.num_row_groups
    for g in range(got.metadata.num_row_groups):
        a, b = got.metadata.row_group(g), want.metadata.row_group(g)
        assert a.num_rows == b.num_rows
        assert got.read_row_group(g).equals(want.read_row_group(g))
        for c in range(6):
            x, y = a.column(c), b.column(c)
            assert (x.num_values, x.physical_type, x.compression, set(x.encodings), x.path_in_schema) == \
                   (y.num_values, y.physical_type, y.compression, set(y.encodings), y.path_in_schema)
            assert not x.has_dictionary_page and x.statistics is None
    assert got.metadata.created_by == f"packer-cli version {__version__}"


def page_headers(data: bytes, chunk) -> list[dict]:
    """The page headers of a column chunk (``ColumnChunkMetaData``), read in order."""
    pos, end, headers = chunk.data_page_offset, chunk.data_page_offset + chunk.total_compressed_size, []
    while pos < end:
        header, pos = read_struct(data, pos, "page header")
        headers.append(header)
        pos += header[3]  # compressed_page_size
    assert pos == end
    return headers


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_packers_decoders_read_it(encoding, tmp_path, monkeypatch):
    """``pack`` reads Parquet and the audit reads Bridge's runs with packer's own decoders: both
    read these files (plain or byte-stream-split values) with nothing left to pyarrow, the
    audit's on its bulk path."""
    monkeypatch.delenv("PACKER_PARQUET_DECODER", raising=False)
    rng = np.random.default_rng(8)
    columns = bridge_columns(rng, 90, max_len=5000, huge=2)
    columns = [(o, v) for o, v in columns[:2]]  # no empty row: what the bulk path takes
    lengths = np.diff(columns[0][0])
    keep = np.flatnonzero(lengths > 0)
    columns = [(np.concatenate([[0], np.cumsum(lengths[keep])]), np.concatenate([v[o[k]:o[k + 1]] for k in keep]))
               for o, v in columns]
    schema = pa.schema(list(BRIDGE_SCHEMA)[:2])
    file = tmp_path / "split.parquet"
    file.write_bytes(ours(columns, schema, 7, encoding))
    table = as_table(columns, schema)
    pf = pq.ParquetFile(file)
    pages = [page_headers(file.read_bytes(), pf.metadata.row_group(g).column(0))
             for g in range(pf.metadata.num_row_groups)]
    assert max(len(p) for p in pages) >= 2, "some chunk spans several pages"

    taken = count_run_paths(monkeypatch)
    groups = pf.metadata.num_row_groups
    with RowGroupRuns(str(file), pf) as runs:
        for first, end in ((0, 4), (4, groups)):
            batch = runs.read(first, end, schema.names)
            assert batch is not None, "packer's decoder declined the file"
            assert pa.Table.from_batches([batch]).equals(pf.read_row_groups(range(first, end)).cast(batch.schema))
    assert taken == {"bulk": 2, "paged": 0}

    reader = ListColumnReader(str(file), schema.names)
    got = pa.Table.from_batches(list(reader))
    assert got.equals(table.cast(got.schema))
    assert reader.fallback_reason is None and reader.fast_rows == len(table) and reader.arrow_rows == 0


def test_parts_joined_are_the_one_call_file_byte_for_byte():
    rng = np.random.default_rng(21)
    schema, rows = bridge_schema(3), 6
    parts = [bridge_columns(rng, rows * k, max_len=300) for k in (1, 3, 2)] + [bridge_columns(rng, 4, max_len=300)]
    whole = [(np.concatenate([[0], *[o[1:] + sum(p[c][0][-1] for p in parts[:i]) for i, o in
                                     enumerate(part[c][0] for part in parts)]]),
              np.concatenate([part[c][1] for part in parts])) for c in range(6)]
    out = io.BytesIO()
    stitcher = ParquetStitcher(out)
    for columns in parts:
        stitcher.add_encoded(encode_list_columns(columns, schema, rows, PARQUET_ENCODINGS["plain-zstd"]))
    assert stitcher.finish() == len(out.getvalue())
    assert out.getvalue() == ours(whole, schema, rows, "plain-zstd")
    assert pq.read_table(io.BytesIO(out.getvalue())).equals(as_table(whole, schema).replace_schema_metadata(
        pq.read_schema(io.BytesIO(out.getvalue())).metadata))


def test_only_list_of_integer_schemas_are_encoded():
    with pytest.raises(ValueError, match="only lists of integers"):
        _parquet_encode._template(pa.schema([pa.field("x", pa.list_(pa.float32()))]))
    with pytest.raises(ValueError, match="2 columns for a schema of 6"):
        encode_list_columns(bridge_columns(np.random.default_rng(0), 3)[:2], BRIDGE_SCHEMA, 2,
                            PARQUET_ENCODINGS["plain-zstd"])


@pytest.mark.parametrize("uncompressed, compressed, values, encoding", [
    (0, 0, 0, 0), (63, 64, 1, 0), (1 << 20, 3, 300_000, 9), (2**31 - 1, 2**30, 2**31 - 1, 0)])
def test_page_header_is_the_compact_protocol_struct(uncompressed, compressed, values, encoding):
    """The hand-built page header (no per-page Python objects) equals the typed writer's."""
    want = bytearray()
    write_fields(want, [(1, I32, 0), (2, I32, uncompressed), (3, I32, compressed),
                        (5, STRUCT, [(1, I32, values), (2, I32, encoding), (3, I32, 3), (4, I32, 3)])])
    assert _parquet_encode._page_header(uncompressed, compressed, values, encoding) == bytes(want)
    assert read_struct(bytes(want))[0][5] == {1: values, 2: encoding, 3: 3, 4: 3}


def test_each_schemas_metadata_is_its_own():
    """Schemas that differ only in their metadata (the EOS id) compare equal in pyarrow; each
    file still carries its own."""
    rng = np.random.default_rng(1)
    columns = bridge_columns(rng, 5)
    for eos in (1, 2, None, 1):
        data = ours(columns, bridge_schema(eos), 2, "plain-zstd")
        assert pq.read_schema(io.BytesIO(data)).metadata[b"eos_id"] == (b"" if eos is None else str(eos).encode())


def test_row_groups_carry_no_ordinal_past_its_i16():
    # a row group's ordinal is a Thrift i16: readers on Thrift's C++ or Java libraries read a
    # split's row group 32768 as -32768 (and some refuse it); packer's encoder writes none, as
    # recent pyarrow does, and joining parts that carry one (pyarrow 14's) keeps it only while it fits
    from packer_cli._thrift import I16, I64, LIST
    from packer_cli.shards._parquet_stitch import ORDINAL_LIMIT, _field, _moved_group, _parse, _Relocation

    rng = np.random.default_rng(5)
    schema, rows = bridge_schema(3), 2
    data = ours(bridge_columns(rng, 12, max_len=50), schema, rows, "plain-zstd")
    _, _, footer = _parse(data)
    groups = _field(footer, 4)[1]
    assert len(groups) == 6 and all(_field(group, 7) is None for group in groups)

    part_group = [(1, LIST, (STRUCT, [])), (5, I64, 4), (7, I16, 0)]
    assert _field(_moved_group(part_group, _Relocation(0), ORDINAL_LIMIT - 1), 7) == ORDINAL_LIMIT - 1
    assert _field(_moved_group(part_group, _Relocation(0), ORDINAL_LIMIT), 7) is None


def test_the_footers_sizes_and_counts_are_its_pages():
    """Every size and count the footer states is what its pages hold: each column chunk's sizes
    (page headers included), its encoding stats' page count, each row group's total byte size
    (uncompressed) and total compressed size, and where it starts; and the pages are compressed
    at the level the encoding names (zstd 1). pyarrow reads none of these back, so its reading
    the same table could not tell them wrong."""
    import zstandard

    from packer_cli._thrift import read_fields
    from packer_cli.shards._parquet_stitch import _field, _parse

    rng = np.random.default_rng(0)
    lengths = np.array([700_000, 5, 300_000, 9])  # rows 0 and 2 are pages of their own
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(0, 50_000, offsets[-1]).astype(np.int32)
    one = np.arange(lengths.size + 1)
    columns = [(offsets, ids), (offsets, (ids % 2).astype(np.int8)), (one, np.zeros(lengths.size, np.int32)),
               (one, lengths.astype(np.int32)), (one, np.arange(lengths.size, dtype=np.int64)),
               (one, np.zeros(lengths.size, np.int32))]
    data = encode_list_columns(columns, bridge_schema(2), 2, PARQUET_ENCODINGS["plain-zstd"]).file_bytes()
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    _, _, footer = _parse(data)
    level_1 = zstandard.ZstdCompressor(level=1)
    page_counts = []
    for g, group in enumerate(_field(footer, 4)[1]):
        stated, chunks = meta.row_group(g), _field(group, 1)[1]
        uncompressed_sum = compressed_sum = 0
        for c, chunk in enumerate(chunks):
            column = stated.column(c)
            pos, end = column.data_page_offset, column.data_page_offset + column.total_compressed_size
            pages = uncompressed = 0
            while pos < end:
                header, body_at = read_fields(memoryview(data), pos, what="page header")
                fields = {fid: value for fid, _, value in header}
                page = data[body_at:body_at + fields[3]]
                body = zstandard.ZstdDecompressor().decompress(page, max_output_size=fields[2])
                assert level_1.compress(body) == page
                uncompressed += body_at - pos + fields[2]
                pages += 1
                pos = body_at + fields[3]
            assert pos == end
            assert column.total_uncompressed_size == uncompressed
            stats = _field(_field(chunk, 3), 13)[1]
            assert [dict((fid, value) for fid, _, value in s)[3] for s in stats] == [pages]
            uncompressed_sum += uncompressed
            compressed_sum += column.total_compressed_size
            page_counts.append(pages)
        assert stated.total_byte_size == uncompressed_sum
        assert _field(group, 6) == compressed_sum
        assert _field(group, 5) == stated.column(0).data_page_offset
    assert page_counts == [2, 2, 1, 1, 1, 1] * 2  # the ids and the mask of each group: two pages


@pytest.mark.parametrize("width", [1, 4, 8])
def test_a_page_takes_rows_up_to_exactly_a_page_of_values_of_its_width(width):
    """A page is filled greedily up to :data:`PAGE_BYTES` of values of the column's own width (the
    int8 loss mask holds 8 times as many values a page as the int64 source indexes), and rows
    that fill it exactly still share it."""
    per_page = PAGE_BYTES // width
    lengths = np.array([per_page // 2, per_page - per_page // 2, 1, per_page, 3])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    assert _page_rows(starts, width) == [0, 2, 3, 4, 5]


def test_lists_declared_not_null_keep_their_empty_rows_empty():
    """Bridge's columns are nullable lists; the encoder derives each column's levels from the
    Parquet schema, so a list (or element) declared not null gets its own: an empty row reads
    back empty, never as a null element or a value of the next row."""
    schema = pa.schema([
        pa.field("ids", pa.list_(pa.field("element", pa.int32(), nullable=False)), nullable=False),
        pa.field("idx", pa.list_(pa.int64()), nullable=False),
        pa.field("mask", pa.list_(pa.field("element", pa.int8(), nullable=False))),
    ])
    rows = [[1, 2], [], [3], [], [], [4, 5, 6]]
    lengths = np.array([len(r) for r in rows])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.array([v for r in rows for v in r])
    columns = [(offsets, flat.astype(np.int32)), (offsets, flat.astype(np.int64)), (offsets, flat.astype(np.int8))]
    table = pa.table([pa.array(rows, type=f.type) for f in schema], schema=schema)
    got = pq.read_table(io.BytesIO(ours(columns, schema, 4, "plain-zstd")))
    assert got.equals(pq.read_table(pa.BufferReader(encode_parquet(table, schema, 4))))
    assert [got.column(c).to_pylist() for c in range(3)] == [rows] * 3

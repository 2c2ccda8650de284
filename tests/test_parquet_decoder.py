"""The compiled Parquet list decoder (``parquet_lists.ListColumnReader``) reads exactly what pyarrow reads.

* every layout the fast path supports (list / large_list of int8..int64 / uint8..uint32; PLAIN and
  dictionary pages, data page v1 and v2, no compression / Snappy / Zstandard / gzip / LZ4_RAW, tiny
  pages, many row groups) is decoded by packer itself, row for row equal to ``pq.read_table``; Brotli
  pages (and legacy LZ4: tests/test_parquet_lz4.py) go to pyarrow;
* layouts it does not support (nulls, other encodings, other types, deeper nesting) fall back to pyarrow
  for the remaining rows, say why, and still give the same data;
* ``PACKER_PARQUET_DECODER=arrow`` forces pyarrow throughout;
* corrupt files raise ``ValueError`` / ``ArrowException`` / ``OSError`` — never a crash, never silently
  different data (checked in subprocesses, so a segfault is a clear test failure);
* ``pack()`` writes byte-identical output with either decoder, also when records are bad;
* the real SFT files in ../shared/data (when present) take the fast path throughout.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import warnings
import zlib
from decimal import Decimal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SHARED_DATA, require_shared
from packer_cli import BadRecordPolicy, DataError, PackSpec, SourceSpec, pack
from packer_cli._arrow import numpy_dtype
from packer_cli._thrift import TRUE, read_fields, write_fields
from packer_cli.demo import demo_table
from packer_cli.sources.parquet_lists import ListColumnReader, RowGroupRuns

ENV = "PACKER_PARQUET_DECODER"
REPO = Path(__file__).resolve().parents[1]
ALLOWED_ERRORS = (ValueError, pa.ArrowException, OSError)

FAST_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32()]
CODECS = ["none", "snappy", "zstd", "gzip", "lz4"]  # decoded by packer ("lz4": LZ4_RAW pages)
ARROW_CODECS = ["brotli"]  # handed to pyarrow (see parquet_lists._CODECS)


@pytest.fixture(autouse=True, params=["small pages inline", "every page on the threads"])
def _default_decoder(monkeypatch, request):
    """Every test starts with the decoder chosen automatically (the variable unset), and maps
    every page payload: the test files' pages are small, and the rest of the suite reads them
    with ``pread`` (the corrupt-file test reads each file both ways). Each runs twice: small
    pages decoded on the reading thread (as they are), then every page handed to the decoding
    threads (as large pages are)."""
    from packer_cli.sources import parquet_lists

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(parquet_lists, "_MAP_PAYLOAD", 0)
    if request.param == "every page on the threads":
        monkeypatch.setattr(parquet_lists, "SMALL_PAGE", 0)


# --- helpers ---------------------------------------------------------------------------------

def read_with_packer(path, fields, batch_rows=2048):
    """All batches of a ListColumnReader, checking the batch contract on the way."""
    reader = ListColumnReader(str(path), list(fields), batch_rows=batch_rows)
    batches = list(reader)
    for b in batches:
        assert 1 <= b.num_rows <= batch_rows, f"batch of {b.num_rows} rows (batch_rows={batch_rows})"
        assert b.schema.names == list(fields)
    return reader, batches


def _first_difference(got: pa.ChunkedArray, want: pa.ChunkedArray) -> str:
    if len(got) != len(want):
        return f"{len(got)} rows, pyarrow has {len(want)}"
    a, b = got.combine_chunks(), want.combine_chunks()
    step = 512
    for lo in range(0, len(a), step):
        if not a.slice(lo, step).equals(b.slice(lo, step)):
            for row in range(lo, min(lo + step, len(a))):
                x, y = a[row].as_py(), b[row].as_py()
                if x != y:
                    return f"row {row}: {str(x)[:200]} != pyarrow's {str(y)[:200]}"
            return f"rows {lo}..{lo + step}: validity differs"
    return "chunks differ"


def assert_same_as_pyarrow(path, fields, batches) -> pa.Table:
    """The batches form exactly ``pq.read_table(path, columns=fields)``: types, values and nulls."""
    want = pq.read_table(path, columns=list(fields))
    if not batches:
        assert want.num_rows == 0, f"no batches, but the file has {want.num_rows} rows"
        return want
    got = pa.Table.from_batches(batches)
    assert got.column_names == want.column_names
    assert [f.type for f in got.schema] == [f.type for f in want.schema]
    for name in fields:
        g, w = got.column(name), want.column(name)
        assert g.equals(w), f"column {name!r}: {_first_difference(g, w)}"
    return want


def list_array(lengths, values, value_type, *, large=False, item_nullable=True, validity=None):
    """A list array of ``lengths`` over ``values``; a null row (``validity`` False) holds no
    values, as a Parquet file stores it (pyarrow before 24 cannot write a null row that spans
    values), so its values are left out."""
    if validity is not None:
        keep = np.repeat(np.asarray(validity), lengths)
        values = pa.array(values, type=value_type).filter(pa.array(keep))
        lengths = np.where(validity, lengths, 0)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    item = pa.field("item", value_type, nullable=item_nullable)
    kind, otype, cls = ((pa.large_list, pa.int64(), pa.LargeListArray) if large
                        else (pa.list_, pa.int32(), pa.ListArray))
    mask = None if validity is None else pa.array(~np.asarray(validity))
    return cls.from_arrays(pa.array(offsets, type=otype), pa.array(values, type=value_type), type=kind(item),
                           mask=mask)


def int_values(rng, value_type, n, small_vocab):
    """``n`` values across the full range of the type (extremes included), or from a few distinct ones."""
    dtype = numpy_dtype(value_type)
    info = np.iinfo(dtype)
    if small_vocab:
        vocab = rng.integers(info.min, info.max, size=int(rng.integers(1, 40)), dtype=dtype, endpoint=True)
        vocab[0] = info.max
        return vocab[rng.integers(0, vocab.size, n)]
    out = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    if n:
        out[rng.integers(0, n, min(n, 4))] = [info.min, info.max, 0, info.max][: min(n, 4)]
    return out


def token_table(n_rows, seed=0, max_len=60, vocab=1000):
    """``input_ids`` list<int32> and a same-length ``loss_mask`` list<uint8>."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len + 1, n_rows)
    n = int(lengths.sum())
    return pa.table({
        "input_ids": list_array(lengths, rng.integers(0, vocab, n).astype(np.int32), pa.int32()),
        "loss_mask": list_array(lengths, rng.integers(0, 2, n).astype(np.uint8), pa.uint8()),
    })


# --- 1. supported layouts: packer's decoder, equal to pyarrow -----------------------------------

@st.composite
def layouts(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    n_rows = draw(st.one_of(st.integers(0, 5), st.integers(0, 5000)))
    max_len = draw(st.sampled_from([0, 1, 3, 20, 300, 3000]))
    columns = []
    for k in range(draw(st.integers(1, 3))):
        columns.append(dict(
            name=f"c{k}",
            type=draw(st.sampled_from(FAST_TYPES)),
            large=draw(st.booleans()),
            small_vocab=draw(st.booleans()),
            nullable=draw(st.booleans()),
            item_nullable=draw(st.booleans()),
            empty_share=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        ))
    fields = draw(st.permutations([c["name"] for c in columns]))
    fields = fields[: draw(st.integers(1, len(fields)))]
    options = dict(
        compression=draw(st.sampled_from(CODECS)),
        use_dictionary=draw(st.booleans()),
        data_page_version=draw(st.sampled_from(["1.0", "2.0"])),
        data_page_size=draw(st.one_of(st.sampled_from([64, 65536]), st.integers(64, 65536))),
        write_statistics=draw(st.booleans()),
        version=draw(st.sampled_from(["1.0", "2.6"])),
        store_schema=draw(st.booleans()),
        use_compliant_nested_type=draw(st.booleans()),
        dictionary_pagesize_limit=draw(st.sampled_from([None, 64, 1024])),
        write_batch_size=draw(st.sampled_from([None, 37, 500])),
    )
    if draw(st.booleans()):
        _delta_values(options, columns)
    rg = draw(st.one_of(st.integers(1, 300), st.integers(300, 10_000)))
    options["row_group_size"] = max(rg, n_rows // 200, 1)  # at most ~200 row groups: keeps writing fast
    batch_rows = draw(st.one_of(st.integers(1, 64), st.integers(1, 5000)))
    return seed, n_rows, max_len, columns, fields, options, batch_rows


def _delta_values(options: dict, columns: list[dict]) -> None:
    """Store every column's values as DELTA_BINARY_PACKED (Spark's and DuckDB's v2 writers do):
    no dictionary; the key is the leaf's path, which pyarrow's nested-type naming decides (it
    silently ignores ``{"c0": ...}`` for a list column)."""
    leaf = "element" if options["use_compliant_nested_type"] else "item"
    options["use_dictionary"] = False
    options["column_encoding"] = {f"{c['name']}.list.{leaf}": "DELTA_BINARY_PACKED" for c in columns}


def _layout_table(seed, n_rows, max_len, columns, budget=300_000):
    rng = np.random.default_rng(seed)
    arrays, schema = [], []
    for c in columns:
        lengths = rng.integers(0, max_len + 1, n_rows)
        if max_len >= 300:  # mostly short lists, a long tail up to max_len
            lengths = np.where(rng.random(n_rows) < 0.05, lengths, lengths % 40)
        lengths[rng.random(n_rows) < c["empty_share"]] = 0
        while lengths.sum() > budget:
            lengths //= 2
        values = int_values(rng, c["type"], int(lengths.sum()), c["small_vocab"])
        arr = list_array(lengths, values, c["type"], large=c["large"], item_nullable=c["item_nullable"])
        arrays.append(arr)
        schema.append(pa.field(c["name"], arr.type, nullable=c["nullable"]))
    return pa.Table.from_arrays(arrays, schema=pa.schema(schema))


def _random_layout(seed: int):
    """The same kind of layout as ``layouts()``, every choice drawn from one seed (a wide sweep)."""
    rng = np.random.default_rng(seed)
    pick = lambda seq: seq[int(rng.integers(len(seq)))]  # noqa: E731
    n_rows = int(pick([0, 1, 3, 100, 1000, 5000]) and rng.integers(1, pick([10, 1000, 5001])))
    columns = [dict(name=f"c{k}", type=pick(FAST_TYPES), large=bool(rng.random() < 0.3),
                    small_vocab=bool(rng.random() < 0.5), nullable=bool(rng.random() < 0.7),
                    item_nullable=bool(rng.random() < 0.7), empty_share=pick([0.0, 0.1, 0.5, 1.0]))
               for k in range(int(rng.integers(1, 4)))]
    fields = [c["name"] for c in columns]
    rng.shuffle(fields)
    options = dict(
        compression=pick(CODECS), use_dictionary=bool(rng.random() < 0.6),
        data_page_version=pick(["1.0", "2.0"]), data_page_size=int(pick([64, 200, 1024, 8192, 65536])),
        write_statistics=bool(rng.random() < 0.5), version=pick(["1.0", "2.6"]),
        store_schema=bool(rng.random() < 0.7), use_compliant_nested_type=bool(rng.random() < 0.5),
        dictionary_pagesize_limit=pick([None, 64, 1024]), write_batch_size=pick([None, 37, 500]),
        row_group_size=max(int(pick([1, 50, 700, 10_000])), n_rows // 200, 1),
    )
    if seed % 4 == 1:  # a quarter of the seeds: every column's values DELTA_BINARY_PACKED
        _delta_values(options, columns)
    batch_rows = int(pick([1, 2, 97, 2048, 5000]))
    return int(seed), n_rows, int(pick([0, 3, 20, 300, 3000])), columns, fields, options, batch_rows


def check_layout(tmp_path, layout):
    """Write the layout's table with its options; packer's decoder must read it all, equal to pyarrow."""
    seed, n_rows, max_len, columns, fields, options, batch_rows = layout
    table = _layout_table(seed, n_rows, max_len, columns)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, **options)
    if "column_encoding" in options and n_rows and table.column(0).combine_chunks().values is not None:
        encodings = {e for g in range(pq.ParquetFile(path).metadata.num_row_groups)
                     for e in pq.ParquetFile(path).metadata.row_group(g).column(0).encodings}
        assert "DELTA_BINARY_PACKED" in encodings or not len(table.column(0).combine_chunks().values)
    reader, batches = read_with_packer(path, fields, batch_rows)
    assert_same_as_pyarrow(path, fields, batches)
    assert (reader.fast_rows, reader.arrow_rows) == (n_rows, 0), reader.fallback_reason
    assert reader.fallback_reason is None


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(layout=layouts())
def test_supported_layouts_decoded_fast_and_equal_to_pyarrow(tmp_path, layout):
    """Random list<int> tables under random writer options: packer's decoder reads every row itself,
    in batches of at most batch_rows, and the result equals pq.read_table exactly."""
    check_layout(tmp_path, layout)


@pytest.mark.parametrize("seed", range(40))
def test_supported_layouts_seeded_sweep(tmp_path, monkeypatch, seed):
    """The same property over 40 fixed seeds that each vary every choice at once (Hypothesis spends
    many of its examples on small variations; this sweep covers big tables and long lists too).
    A third of the seeds give every page a slab of its own (each batch over several pages is
    copied together), a third slabs of 4 KB (views and copies mixed)."""
    from packer_cli.sources import parquet_lists

    monkeypatch.setattr(parquet_lists, "SLAB_BYTES", [parquet_lists.SLAB_BYTES, 1, 4096][seed % 3])
    check_layout(tmp_path, _random_layout(seed))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("page_version", ["1.0", "2.0"])
@pytest.mark.parametrize("dictionary", [True, False])
def test_each_codec_and_page_kind_decoded_fast(tmp_path, codec, page_version, dictionary):
    """Every codec × data page version × dictionary/plain: fast path throughout, equal to pyarrow."""
    table = token_table(700, seed=3)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, compression=codec, data_page_version=page_version, use_dictionary=dictionary,
                   data_page_size=512, row_group_size=250)
    reader, batches = read_with_packer(path, ["input_ids", "loss_mask"], 100)
    assert_same_as_pyarrow(path, ["input_ids", "loss_mask"], batches)
    assert (reader.fast_rows, reader.arrow_rows, reader.fallback_reason) == (700, 0, None)


@pytest.mark.parametrize("codec", ARROW_CODECS)
def test_codecs_left_to_pyarrow_read_equal(tmp_path, codec):
    """Brotli pages go to pyarrow from the first row, with the reason given."""
    table = token_table(300, seed=4)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, compression=codec, data_page_size=512, row_group_size=100)
    reader, batches = read_with_packer(path, ["input_ids", "loss_mask"], 64)
    assert_same_as_pyarrow(path, ["input_ids", "loss_mask"], batches)
    assert (reader.fast_rows, reader.arrow_rows) == (0, 300)
    assert "compressed with" in reader.fallback_reason


def test_dictionary_falling_back_to_plain_mid_chunk(tmp_path):
    """A column chunk whose dictionary outgrows the limit switches to PLAIN pages half-way: still fast."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 50, 3000)
    values = rng.integers(0, 2**31 - 1, int(lengths.sum())).astype(np.int32)
    values[: values.size // 2] %= 7  # the first half dictionary-friendly
    table = pa.table({"input_ids": list_array(lengths, values, pa.int32())})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, dictionary_pagesize_limit=256, data_page_size=1024, row_group_size=100_000)
    encodings = pq.ParquetFile(path).metadata.row_group(0).column(0).encodings
    assert "PLAIN" in encodings and "RLE_DICTIONARY" in encodings
    reader, batches = read_with_packer(path, ["input_ids"], 333)
    assert_same_as_pyarrow(path, ["input_ids"], batches)
    assert (reader.fast_rows, reader.arrow_rows) == (3000, 0), reader.fallback_reason


@pytest.mark.parametrize("page_version", ["1.0", "2.0"])
def test_all_empty_lists_and_empty_file(tmp_path, page_version):
    """Only empty lists (no values at all), and a file without rows: fast, equal, no empty batches."""
    empty = pa.table({"input_ids": list_array(np.zeros(500, np.int64), np.zeros(0, np.int32), pa.int32())})
    path = tmp_path / "empty_lists.parquet"
    pq.write_table(empty, path, data_page_version=page_version, row_group_size=128)
    reader, batches = read_with_packer(path, ["input_ids"], 64)
    assert_same_as_pyarrow(path, ["input_ids"], batches)
    assert (reader.fast_rows, reader.arrow_rows) == (500, 0), reader.fallback_reason
    path = tmp_path / "no_rows.parquet"
    pq.write_table(empty.slice(0, 0), path, data_page_version=page_version)
    reader, batches = read_with_packer(path, ["input_ids"])
    assert batches == [] and reader.fast_rows == 0 and reader.arrow_rows == 0


# --- 2. unsupported layouts: fallback to pyarrow, same data --------------------------------------

def _fallback_tables():
    rng = np.random.default_rng(9)
    base = token_table(300, seed=9)
    ids = base.column("input_ids").combine_chunks()
    lengths = np.diff(ids.offsets.to_numpy())
    n = int(lengths.sum())
    null_rows = np.zeros(300, bool)
    null_rows[[0, 17, 299]] = True
    with_null_elements = ids.values.to_pylist()
    with_null_elements[5] = None
    yield "null_lists", base.set_column(0, "input_ids", list_array(lengths, ids.values, pa.int32(),
                                                                   validity=~null_rows)), {}
    yield "null_elements", base.set_column(0, "input_ids", list_array(lengths, with_null_elements,
                                                                      pa.int32())), {}
    yield "scalar_column", base.append_column("answer_start_idx", pa.array(rng.integers(0, 9, 300))), {}
    nested = pa.ListArray.from_arrays(pa.array(np.arange(301, dtype=np.int32)), ids)
    yield "list_of_lists", base.append_column("nested", nested), {}
    yield "float_list", base.append_column("floats", list_array(lengths, rng.random(n), pa.float64())), {}
    yield "float32_list", base.append_column("floats", list_array(lengths, rng.random(n).astype(np.float32),
                                                                  pa.float32())), {}
    # INT32 / INT64 physical types that are not integers in Arrow: the decoder must not return ints.
    yield "timestamp_list", base.append_column(
        "ts", list_array(lengths, rng.integers(0, 2**40, n), pa.timestamp("ms"))), {}
    yield "date_list", base.append_column(
        "dates", list_array(lengths, rng.integers(0, 20000, n).astype(np.int32), pa.date32())), {}
    yield "time_list", base.append_column(
        "times", list_array(lengths, rng.integers(0, 86_400_000, n).astype(np.int32), pa.time32("ms"))), {}
    cents = [Decimal(int(v)).scaleb(-2) for v in rng.integers(-10**6, 10**6, n)]
    yield "decimal_as_int", base.append_column("dec", list_array(lengths, cents, pa.decimal128(9, 2))), {
        "store_decimal_as_integer": True}
    yield "string_list", base.append_column("words", list_array(lengths, [str(v) for v in range(n)],
                                                                pa.string())), {}
    yield "bool_list", base.append_column("flags", list_array(lengths, rng.random(n) < 0.5, pa.bool_())), {}


FALLBACK_CASES = {name: (table, opts) for name, table, opts in _fallback_tables()}
# inputs older pyarrow cannot write: decimals as integers
WRITTEN_BY = {"decimal_as_int": 17}
PYARROW_MAJOR = int(pa.__version__.split(".")[0])
#: what the hand-built pages below are compared with: pyarrow 14 (the lowest supported) accepts a
#: second dictionary page, and reads a page of two gzip members, or an empty compressed section,
#: otherwise than the format says, where the release these tests were written against does not
PYARROW_AS_REFERENCE = pytest.mark.skipif(PYARROW_MAJOR < 26, reason=f"pyarrow {pa.__version__} reads these "
                                          "hand-built pages otherwise than the format says: no reference")


@pytest.mark.parametrize("case", list(FALLBACK_CASES))
@pytest.mark.parametrize("batch_rows", [7, 2048])
def test_unsupported_layout_falls_back_with_same_data(tmp_path, case, batch_rows):
    """Nulls, scalar, nested, float and other
    non-integer columns (also INT32/INT64 physical ones: timestamp, date, time, decimal): pyarrow
    takes over, says why, and the data is exactly pq.read_table's."""
    table, opts = FALLBACK_CASES[case]
    if case in WRITTEN_BY and PYARROW_MAJOR < WRITTEN_BY[case]:
        pytest.skip(f"pyarrow {pa.__version__} cannot write this input (needs {WRITTEN_BY[case]})")
    path = tmp_path / f"{case}.parquet"
    pq.write_table(table, path, row_group_size=100, data_page_size=1024, **opts)
    for enc in opts.get("column_encoding", {}).values():
        assert enc in pq.ParquetFile(path).metadata.row_group(0).column(0).encodings
    fields = table.column_names
    reader, batches = read_with_packer(path, fields, batch_rows)
    assert_same_as_pyarrow(path, fields, batches)
    assert reader.fallback_reason, "an unsupported layout must say why pyarrow took over"
    assert reader.arrow_rows > 0
    assert reader.fast_rows + reader.arrow_rows == table.num_rows


@pytest.mark.parametrize("value_type", FAST_TYPES)
@pytest.mark.parametrize("page_version, codec", [("1.0", "zstd"), ("2.0", "snappy"), ("1.0", "none"), ("2.0", "gzip")])
def test_byte_stream_split_values_decoded_fast(tmp_path, value_type, page_version, codec):
    """BYTE_STREAM_SPLIT (byte k of every value in stream k; Arrow writes it for integers from
    16 on, packer's ``split-zstd`` Bridge files use it): read by packer's decoder, equal to pyarrow."""
    if PYARROW_MAJOR < 16:
        pytest.skip(f"pyarrow {pa.__version__} cannot write integers as byte streams (needs 16)")
    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 300, 900)
    info = np.iinfo(value_type.to_pandas_dtype())
    values = rng.integers(info.min, info.max, int(lengths.sum()), endpoint=True).astype(value_type.to_pandas_dtype())
    table = pa.table({"input_ids": list_array(lengths, values, value_type),
                      "loss_mask": list_array(lengths, rng.integers(0, 2, int(lengths.sum())).astype(np.uint8),
                                              pa.uint8())})
    path = tmp_path / "bss.parquet"
    pq.write_table(table, path, row_group_size=300, data_page_size=4096, data_page_version=page_version,
                   compression=codec, use_dictionary=False,
                   column_encoding={"input_ids.list.element": "BYTE_STREAM_SPLIT"})
    assert "BYTE_STREAM_SPLIT" in pq.ParquetFile(path).metadata.row_group(0).column(0).encodings
    for batch_rows in (7, 2048):
        reader, batches = read_with_packer(path, ["input_ids", "loss_mask"], batch_rows)
        assert_same_as_pyarrow(path, ["input_ids", "loss_mask"], batches)
        assert (reader.fast_rows, reader.arrow_rows, reader.fallback_reason) == (900, 0, None)


@pytest.mark.parametrize("case", ["uint64", "fixed_size_list", "large_list_uint64"])
def test_other_integer_layouts_read_equal(tmp_path, case):
    """Layouts at the edge of the contract (uint64 values, fixed_size_list): whichever decoder reads
    them, the data and the Arrow type are exactly pyarrow's."""
    rng = np.random.default_rng(2)
    if case == "fixed_size_list":
        arr = pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 1000, 1200).astype(np.int32)), 4)
    else:
        lengths = rng.integers(0, 30, 300)
        values = rng.integers(0, 2**64 - 1, int(lengths.sum()), dtype=np.uint64, endpoint=True)
        arr = list_array(lengths, values, pa.uint64(), large=case.startswith("large"))
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"x": arr}), path, row_group_size=100, data_page_size=512)
    reader, batches = read_with_packer(path, ["x"], 64)
    assert_same_as_pyarrow(path, ["x"], batches)
    assert reader.fast_rows + reader.arrow_rows == 300


@pytest.mark.parametrize("dictionary", [False, True])  # decoded whole / page by page
@pytest.mark.parametrize("group_rows", [1, 7, 100, 3000])
@pytest.mark.parametrize("batch_rows", [1, 64, 2048])
def test_runs_of_small_row_groups_give_full_batches(tmp_path, group_rows, batch_rows, dictionary):
    """Consecutive row groups are read as one run, so batches cross their boundaries and hold
    batch_rows rows up to the last (a file of 10-row groups had been read 10 rows a batch, at
    a fifth of the usual speed); the rows are exactly pyarrow's."""
    import packer_cli.sources.parquet_lists as parquet_lists

    path = tmp_path / "t.parquet"
    pq.write_table(token_table(2500, seed=group_rows), path, row_group_size=group_rows, data_page_size=300,
                   use_dictionary=dictionary)
    reader, batches = read_with_packer(path, ["input_ids", "loss_mask"], batch_rows)
    assert_same_as_pyarrow(path, ["input_ids", "loss_mask"], batches)
    assert reader.fast_rows == 2500 and reader.fallback_reason is None
    run_rows = batch_rows * parquet_lists.RUN_BATCHES
    runs, rows = [], 0  # each run closes before a group would take it past run_rows rows
    for count in [group_rows] * (2500 // group_rows) + ([2500 % group_rows] if 2500 % group_rows else []):
        if rows and rows + count > run_rows:
            runs.append(rows)
            rows = 0
        rows += count
    runs += [rows] if rows else []
    expected = []  # each run's batches: full ones, then its rest
    for rows in runs:
        expected += [batch_rows] * (rows // batch_rows) + ([rows % batch_rows] if rows % batch_rows else [])
    sizes = [b.num_rows for b in batches]
    assert sizes == expected


@pytest.mark.parametrize("dictionary", [False, True])
def test_a_damaged_row_group_inside_a_run_is_named(tmp_path, dictionary):
    """Row group 37 of 100 ten-row groups states 3 rows fewer than it holds (the file's total
    too): the run holding it names it, as a group read alone did."""
    path = tmp_path / "t.parquet"
    pq.write_table(token_table(1000, seed=5), path, row_group_size=10, use_dictionary=dictionary)
    raw = path.read_bytes()
    footer, footer_at = _footer_of(raw)
    group = _field(footer, 4)[1][37]
    _set(group, 3, _field(group, 3) - 3)
    _set(footer, 3, _field(footer, 3) - 3)
    path.write_bytes(_with_footer(raw, footer_at, footer))
    with pytest.raises(ValueError, match=r"^row group 37: column 'input_ids': column chunk holds more rows"):
        read_with_packer(path, ["input_ids", "loss_mask"], 64)


@pytest.mark.parametrize("batch_rows", [1, 64, 100, 2048])
def test_nulls_in_a_later_row_group_switch_over_mid_file(tmp_path, batch_rows):
    """Nulls only in rows 250..260 (row groups of 100): the first row groups are decoded fast, pyarrow
    reads the rest, and together they give every row once, equal to pyarrow."""
    table = token_table(1000, seed=4)
    ids = table.column("input_ids").combine_chunks()
    lengths = np.diff(ids.offsets.to_numpy())
    valid = np.ones(1000, bool)
    valid[250:261] = False
    table = table.set_column(0, "input_ids", list_array(lengths, ids.values, pa.int32(), validity=valid))
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=100, data_page_size=256)
    reader, batches = read_with_packer(path, ["input_ids", "loss_mask"], batch_rows)
    assert_same_as_pyarrow(path, ["input_ids", "loss_mask"], batches)
    assert reader.fallback_reason
    # Whole batches before the nulls come from packer's decoder (with 2048-row batches the
    # first batch would hold them: all from pyarrow), the rest from pyarrow's.
    assert (reader.fast_rows > 0) == (batch_rows < 250) and reader.arrow_rows > 0, (reader.fast_rows, reader.arrow_rows)
    assert reader.fast_rows + reader.arrow_rows == 1000
    assert reader.fast_rows <= 250


def test_nulls_in_one_column_only_later(tmp_path):
    """A null element in the *second* requested column of row group 3: the switch keeps the two
    columns row-aligned."""
    table = token_table(600, seed=6)
    mask = table.column("loss_mask").combine_chunks()
    values = mask.values.to_pylist()
    first_of_row_350 = mask.offsets.to_numpy()[350]
    values[first_of_row_350] = None
    lengths = np.diff(mask.offsets.to_numpy())
    assert lengths[350] > 0
    table = table.set_column(1, "loss_mask", list_array(lengths, values, pa.uint8()))
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=100, data_page_size=300)
    reader, batches = read_with_packer(path, ["loss_mask", "input_ids"], 128)
    assert_same_as_pyarrow(path, ["loss_mask", "input_ids"], batches)
    assert reader.fast_rows > 0 and reader.arrow_rows > 0 and reader.fast_rows + reader.arrow_rows == 600


def test_a_page_stating_too_many_values_is_left_to_pyarrow(tmp_path, monkeypatch):
    """A page is decoded whole, into room for the values its header states: run-length encoding
    lets a few KB state billions. Past ``LARGE_PAGE_VALUES`` pyarrow, which streams within a
    page, reads the rest of the file; rows before it come from packer's decoder."""
    from packer_cli.sources import parquet_lists

    rng = np.random.default_rng(8)
    lengths = np.where(np.arange(1000) < 600, 5, 400)  # a row group's chunk is one page until row 600
    n = int(lengths.sum())
    mask = rng.integers(0, 2, n).astype(np.uint8)
    table = pa.table({"input_ids": list_array(lengths, rng.integers(0, 1000, n).astype(np.int32), pa.int32()),
                      "loss_mask": list_array(lengths, mask, pa.uint8())})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=100, data_page_size=4096)
    monkeypatch.setattr(parquet_lists, "LARGE_PAGE_VALUES", 10_000)  # the mask's later pages hold 16.5k
    reader, batches = read_with_packer(path, ["input_ids", "loss_mask"], 100)
    assert_same_as_pyarrow(path, ["input_ids", "loss_mask"], batches)
    assert reader.fallback_reason is not None and reader.fallback_reason.startswith("a page of "), reader.fallback_reason
    assert 0 < reader.fast_rows <= 600 and reader.fast_rows + reader.arrow_rows == 1000, (reader.fast_rows, reader.arrow_rows)


# --- 3. the environment variable -----------------------------------------------------------------

def test_env_var_forces_pyarrow(tmp_path, monkeypatch):
    """PACKER_PARQUET_DECODER=arrow: pyarrow reads every row, the reason says so, the data is the same."""
    path = tmp_path / "t.parquet"
    pq.write_table(token_table(500, seed=1), path, row_group_size=128)
    monkeypatch.setenv(ENV, "arrow")
    reader, batches = read_with_packer(path, ["input_ids", "loss_mask"], 100)
    assert_same_as_pyarrow(path, ["input_ids", "loss_mask"], batches)
    assert (reader.fast_rows, reader.arrow_rows) == (0, 500)
    assert reader.fallback_reason and (ENV in reader.fallback_reason or "arrow" in reader.fallback_reason.lower())
    monkeypatch.delenv(ENV)
    reader, _ = read_with_packer(path, ["input_ids", "loss_mask"], 100)
    assert (reader.fast_rows, reader.arrow_rows, reader.fallback_reason) == (500, 0, None)


# --- 4. corrupt files --------------------------------------------------------------------------

_CHILD = r"""
import json, sys, traceback
import pyarrow as pa, pyarrow.parquet as pq
from packer_cli.sources.parquet_lists import ListColumnReader

ALLOWED = (ValueError, pa.ArrowException, OSError)
jobs = json.load(open(sys.argv[1]))

def say(**kw):
    print(json.dumps(kw), flush=True)

from packer_cli.sources import parquet_lists

def ours(path, fields):
    batches = list(ListColumnReader(path, fields, batch_rows=97))
    return pa.Table.from_batches(batches) if batches else None

def ours_both_ways(path, fields):
    # every page payload read with pread, then every one memory-mapped: the same outcome
    default = parquet_lists._MAP_PAYLOAD
    outcomes = []
    for threshold in (1 << 62, 0):
        parquet_lists._MAP_PAYLOAD = threshold
        outcomes.append(attempt(ours, path, fields))
    parquet_lists._MAP_PAYLOAD = default
    (s1, t1, d1), (s2, t2, d2) = outcomes
    if s1 != s2 or (s1 == "ok" and not same(t1, t2)) or (s1 == "raised" and d1 != d2):
        raise AssertionError(f"read and mapped payloads differ: {s1} {d1!r} / {s2} {d2!r}")
    if s1 == "raised":
        raise ValueError(d1)
    return t1

def theirs(path, fields):
    t = pq.read_table(path, columns=fields)
    return t if t.num_rows else None

def runs(path, fields):
    # the whole file as runs of row groups (RowGroupRuns), the second run read ahead; a run
    # left to pyarrow (None) is read by pyarrow, as its callers do
    n = pq.ParquetFile(path).metadata.num_row_groups
    cuts = [(0, n)] if n < 2 else [(0, n // 2), (n // 2, n)]
    tables = []
    with parquet_lists.RowGroupRuns(path) as r:
        for k, (first, end) in enumerate(cuts):
            batch = r.read(first, end, fields)
            if k + 1 < len(cuts):
                r.read_ahead(*cuts[k + 1], fields)
            tables.append(pq.ParquetFile(path).read_row_groups(range(first, end), columns=fields)
                          if batch is None else pa.Table.from_batches([batch]))
    t = pa.concat_tables(tables) if tables else None
    return t if t is not None and t.num_rows else None

def attempt(fn, path, fields):
    try:
        return "ok", fn(path, fields), ""
    except ALLOWED as exc:
        return "raised", None, f"{type(exc).__name__}: {exc}"[:300]
    except BaseException as exc:  # noqa: BLE001 - reported as a contract violation
        return "bad", None, traceback.format_exc()[-1500:]

def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return (a.column_names == b.column_names and [f.type for f in a.schema] == [f.type for f in b.schema]
            and all(a.column(n).equals(b.column(n)) for n in a.column_names))

for i in range(int(sys.argv[2]), len(jobs)):
    path, fields = jobs[i]
    say(i=i, phase="packer")
    s1, t1, d1 = attempt(ours_both_ways, path, fields)
    say(i=i, phase="runs")
    s3, t3, d3 = attempt(runs, path, fields)
    say(i=i, phase="pyarrow")
    s2, t2, d2 = attempt(theirs, path, fields)
    say(i=i, done=True, packer=s1, packer_detail=d1, pyarrow=s2, pyarrow_detail=d2,
        equal=same(t1, t2) if s1 == s2 == "ok" else None,
        runs=s3, runs_detail=d3, runs_equal=same(t3, t2) if s3 == s2 == "ok" else None)
"""


def run_isolated(jobs: list[tuple[str, list[str]]], tmp_path: Path, timeout=240) -> list[dict]:
    """Read every (path, fields) with ListColumnReader and with pyarrow in child processes; a crash
    or a hang of one read is recorded for that job and the rest continue in a fresh child."""
    job_file = tmp_path / "jobs.json"
    job_file.write_text(json.dumps([[str(p), f] for p, f in jobs]))
    env = {k: v for k, v in os.environ.items() if k != ENV}
    results: dict[int, dict] = {}
    start = 0
    while start < len(jobs):
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(job_file), str(start)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            hung = True
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        for rec in lines:
            if rec.get("done"):
                results[rec["i"]] = rec
        if proc.returncode == 0:
            break
        last = next((r for r in reversed(lines) if "phase" in r), None)
        if last is None:
            raise AssertionError(f"the child failed before any job (rc={proc.returncode}):\n{err[-3000:]}")
        what = "hang" if hung else f"crash (exit code {proc.returncode})"
        results[last["i"]] = {"i": last["i"], "died": what, "phase": last["phase"], "stderr": err[-2000:]}
        start = last["i"] + 1
    return [results[i] for i in range(len(jobs))]


def _chunk_span(path, rg, col):
    meta = pq.ParquetFile(path).metadata.row_group(rg).column(col)
    start = meta.dictionary_page_offset if meta.has_dictionary_page else meta.data_page_offset
    return start, meta.data_page_offset, start + meta.total_compressed_size


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    start = pos
    while True:
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        shift += 7
        pos += 1
        if byte < 0x80:
            return value, pos - start


def _varint(value: int, length: int) -> bytes:
    """Zigzag varint of a thrift i32, padded (non-canonically) to ``length`` bytes when it fits."""
    zz = (value << 1) ^ (value >> 31) if value < 0 else value << 1
    groups = []
    while zz or not groups:
        groups.append(zz & 0x7F)
        zz >>= 7
    groups += [0] * (length - len(groups))
    return bytes([g | 0x80 for g in groups[:-1]] + [groups[-1]])


def _page_sizes(raw: bytes, offset: int) -> dict[str, tuple[int, int, int]]:
    """Where a page header's uncompressed / compressed size varints lie: (position, length, value).
    A thrift compact PageHeader starts with fields 1, 2, 3: i32 type, uncompressed, compressed size."""
    out, pos = {}, offset
    for name in ("type", "uncompressed", "compressed"):
        assert raw[pos] == 0x15, f"unexpected page header at {offset}"
        zz, length = _read_varint(raw, pos + 1)
        out[name] = (pos + 1, length, (zz >> 1) ^ -(zz & 1))
        pos += 1 + length
    return out


def _level_edits(table: pa.Table, tmp_path: Path) -> list[tuple[str, bytes]]:
    """Targeted damage inside the one uncompressed v1 dictionary data page of a column chunk: the
    level length prefixes, the levels themselves and the dictionary index bit width."""
    path = tmp_path / "one-page.parquet"
    pq.write_table(table.select(["input_ids"]), path, compression="none", use_dictionary=True,
                   data_page_version="1.0", data_page_size=1 << 20)
    raw = path.read_bytes()
    _, d0, e0 = _chunk_span(path, 0, 0)
    payload = e0 - _page_sizes(raw, d0)["compressed"][2]
    assert 10 < payload - d0 < 64, "expected a single data page"
    rep_len = int.from_bytes(raw[payload:payload + 4], "little")
    def_at = payload + 4 + rep_len
    def_len = int.from_bytes(raw[def_at:def_at + 4], "little")
    width_at = def_at + 4 + def_len
    edits = []

    def put(what, at, data):
        edits.append((f"one-page.parquet: {what}", raw[:at] + data + raw[at + len(data):]))

    put("repetition levels' length 2^32-1", payload, b"\xff\xff\xff\xff")
    put("repetition levels' length 0", payload, b"\x00\x00\x00\x00")
    put("definition levels' length 2^31", def_at, b"\x00\x00\x00\x80")
    put("definition levels' length + 1", def_at, (def_len + 1).to_bytes(4, "little"))
    put("repetition levels all 0 (more rows than the row group)", payload + 4, bytes(rep_len))
    put("repetition levels all 0xff", payload + 4, b"\xff" * rep_len)
    put("definition levels all 0 (null lists)", def_at + 4, bytes(def_len))
    put("definition levels all 0xff", def_at + 4, b"\xff" * def_len)
    for width in (0, raw[width_at] - 1, raw[width_at] + 1, 33, 64, 255):
        put(f"dictionary index bit width {raw[width_at]} -> {width}", width_at, bytes([width]))
    put("index runs all 0xff", width_at + 1, b"\xff" * (e0 - width_at - 1))
    return edits


def _corrupt_variants(tmp_path: Path) -> list[tuple[str, Path, list[str]]]:
    """(what was done, the damaged file, the fields to read): ~170 variants from 6 valid files
    (7 with a file of BYTE_STREAM_SPLIT ids where pyarrow writes it; two of DELTA_BINARY_PACKED)."""
    table = token_table(300, seed=12, max_len=40, vocab=300)
    variants = []
    bases = [("none", True), ("none", False), ("snappy", True), ("snappy", False)]
    bases += [("none", "split")] if PYARROW_MAJOR >= 16 else []
    bases += [("none", "delta"), ("snappy", "delta")]
    for k, (codec, dictionary) in enumerate(bases):
            base = tmp_path / f"base-{codec}-{int(bool(dictionary))}-{dictionary}.parquet"
            encoding = {"split": {"input_ids.list.element": "BYTE_STREAM_SPLIT"},
                        "delta": {"input_ids.list.element": "DELTA_BINARY_PACKED",
                                  "loss_mask.list.element": "DELTA_BINARY_PACKED"}}.get(dictionary)
            split = {"column_encoding": encoding} if encoding else {}
            pq.write_table(table, base, compression=codec, use_dictionary=dictionary is True, data_page_size=512,
                           row_group_size=150, **split)
            raw = base.read_bytes()
            rng = np.random.default_rng(k)
            edits: list[tuple[str, bytes]] = []
            a0, d0, e0 = _chunk_span(base, 0, 0)
            a1, d1, e1 = _chunk_span(base, 1, 1)
            for cut in (e0 - 3, len(raw) - 9, len(raw) - 1):
                edits.append((f"truncated at {cut}", raw[:cut]))
            footer_len = int.from_bytes(raw[-8:-4], "little") + 8
            body_end = len(raw) - footer_len
            # a hole inside the data with the footer intact: offsets point past what is there
            edits.append(("bytes removed mid-chunk", raw[:(a0 + e0) // 2] + raw[(a0 + e0) // 2 + 40:]))
            edits.append(("data cut, footer kept", raw[:d1 + 10] + raw[body_end:]))
            for name, offset in (("dictionary/first page header", a0), ("data page header", d0),
                                 ("last chunk's first page header", d1)):
                b = bytearray(raw)
                b[offset:offset + 12] = rng.integers(0, 256, 12, dtype=np.uint8).tobytes()
                edits.append((f"garbage over the {name}", bytes(b)))
            # well-formed thrift of the wrong shape: a map keyed by lists / by structs
            for name, header in (("list", b"\x1b\x01\x99\x15\x02\x15\x02\x00"),
                                 ("struct", b"\x1b\x01\xcc\x00\x00\x00")):
                edits.append((f"page header holding a map keyed by {name}s",
                               raw[:d0] + header + raw[d0 + len(header):]))
            for k in range(7):
                lo, hi = ((a0, e0), (a1, e1))[k % 2]
                width = int(rng.integers(1, 24))
                at = int(rng.integers(lo, max(lo + 1, hi - width)))
                b = bytearray(raw)
                b[at:at + width] = rng.integers(0, 256, width, dtype=np.uint8).tobytes()
                edits.append((f"{width} random bytes at {at} (chunk {lo}..{hi})", bytes(b)))
            b = bytearray(raw)
            b[d0 + 20:e0] = b"\xff" * (e0 - d0 - 20)
            edits.append(("0xff over the first chunk's data pages", bytes(b)))
            # page headers that lie about the page's sizes (negative, zero, off by one, huge)
            pages = [("data page", d0)] + ([("dictionary page", a0)] if a0 != d0 else [])
            for page, offset in pages:
                sizes = _page_sizes(raw, offset)
                for field, value in (("compressed", -1), ("compressed", 0), ("compressed", +1),
                                     ("compressed", 2**31 - 1), ("uncompressed", -1),
                                     ("uncompressed", 2**31 - 1), ("uncompressed", +1)):
                    pos, length, old = sizes[field]
                    new = old + 1 if value == +1 else value
                    edits.append((f"{page} header: {field}_page_size {old} -> {new}",
                                  raw[:pos] + _varint(new, length) + raw[pos + length:]))
            for j, (what, data) in enumerate(edits):
                path = tmp_path / f"bad-{codec}-{dictionary}-{j}.parquet"
                path.write_bytes(data)
                variants.append((f"{base.name}: {what}", path, ["input_ids", "loss_mask"]))
    for j, (what, data) in enumerate(_level_edits(table, tmp_path)):
        path = tmp_path / f"bad-one-page-{j}.parquet"
        path.write_bytes(data)
        variants.append((what, path, ["input_ids"]))
    return variants


def test_corrupt_files_raise_and_never_crash_or_lie(tmp_path):
    """~120 corrupted variants (truncated, holes, garbage or lying page headers, damaged levels and
    index bit widths, random bytes in the column chunks; snappy and uncompressed, dictionary and
    plain), read by ListColumnReader and by RowGroupRuns (runs of row groups, one read ahead):
    each read either raises ValueError /
    ArrowException / OSError or yields exactly what pyarrow yields — no crash, no hang, no other
    exception type. Data pyarrow rejects but packer yields is reported as a warning."""
    variants = _corrupt_variants(tmp_path)
    results = run_isolated([(p, fields) for _, p, fields in variants], tmp_path)
    problems, lenient = [], []
    for (what, path, _), r in zip(variants, results):
        if "died" in r:
            if r["phase"] in ("packer", "runs"):
                reader = "ListColumnReader" if r["phase"] == "packer" else "RowGroupRuns"
                problems.append(f"{what}: {reader} {r['died']}\n{r['stderr'][-600:]}")
            continue  # pyarrow itself died: not packer's decoder
        if r["runs"] == "bad":
            problems.append(f"{what}: RowGroupRuns raised an exception outside the contract:\n{r['runs_detail']}")
        elif r["runs"] == "ok" and r["pyarrow"] == "ok" and not r["runs_equal"]:
            problems.append(f"{what}: RowGroupRuns yielded data different from pyarrow's without an error")
        if r["packer"] == "bad":
            problems.append(f"{what}: raised an exception outside the contract:\n{r['packer_detail']}")
        elif r["packer"] == "ok" and r["pyarrow"] == "ok" and not r["equal"]:
            problems.append(f"{what}: yielded data different from pyarrow's without an error")
        elif r["packer"] == "ok" and r["pyarrow"] != "ok":
            lenient.append(f"{what} ({path.name}): packer yielded data, pyarrow raised {r['pyarrow_detail']}")
        elif r["packer"] != "ok" and r["pyarrow"] == "ok":
            lenient.append(f"{what} ({path.name}): packer raised {r['packer_detail']}, pyarrow read it")
    for note in lenient:
        warnings.warn(note)
    assert not problems, "\n\n".join(problems)


def _footer_flips(tmp_path) -> list[tuple[str, Path]]:
    """A small file of three row groups (two list columns; Snappy ids, uncompressed mask), then
    copies with one bit of one footer byte flipped: for every byte, its lowest bit (a varint's
    lowest bit is a zigzag integer's sign: a row count of 20 becomes -21) and one chosen by the
    byte's position."""
    rng = np.random.default_rng(29)
    lengths = rng.integers(0, 40, 60)
    ids = list_array(lengths, rng.integers(0, 70_000, int(lengths.sum())).astype(np.int32), pa.int32())
    mask = list_array(lengths, rng.integers(0, 2, int(lengths.sum())).astype(np.int8), pa.int8())
    base = tmp_path / "footer-base.parquet"
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": mask}), base, row_group_size=20,
                   compression={"input_ids": "snappy", "loss_mask": "none"},
                   store_schema=False)  # the footer without the Arrow schema: its row groups are most of it
    raw = base.read_bytes()
    size = int.from_bytes(raw[-8:-4], "little")
    variants = []
    for at in range(len(raw) - 8 - size, len(raw) - 8):
        for bit in sorted({0, at % 8}):
            b = bytearray(raw)
            b[at] ^= 1 << bit
            path = tmp_path / f"footer-{at}-{bit}.parquet"
            path.write_bytes(bytes(b))
            variants.append((f"footer byte {at} ^ {1 << bit}", path))
    return variants


def _names_kept(path, fields) -> bool:
    """False for a flip that renamed a field (the readers' callers refuse a missing field first)."""
    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except (pa.ArrowException, OSError, ValueError):
        return True
    return all(name in names for name in fields)


def test_damaged_footers_never_abort_or_yield_what_pyarrow_refuses(tmp_path):
    """Every footer byte of a small file with one bit flipped, read by ListColumnReader and by
    RowGroupRuns in child processes. Some of pyarrow's own accessors of a damaged footer end the
    process (SIGABRT: an unknown codec, a level histogram of the wrong length), and a negative row
    count once sized a kernel's writes; packer's decoders read the footer themselves and leave a
    file whose row counts, types, codecs, offsets or histograms they do not trust to pyarrow.
    So: no crash, no exception outside the contract, and no data where pyarrow raises on one of
    the fields the decoders read."""
    fields = ["input_ids", "loss_mask"]
    variants = [(what, path) for what, path in _footer_flips(tmp_path) if _names_kept(path, fields)]
    results = run_isolated([(p, fields) for _, p in variants], tmp_path)
    problems, read_anyway = [], 0
    for (what, path), r in zip(variants, results):
        if "died" in r:
            if r["phase"] in ("packer", "runs"):
                problems.append(f"{what}: {'ListColumnReader' if r['phase'] == 'packer' else 'RowGroupRuns'} "
                                f"{r['died']}\n{r['stderr'][-600:]}")
            continue
        for reader, equal in (("packer", "equal"), ("runs", "runs_equal")):
            if r[reader] == "bad":
                problems.append(f"{what}: {reader} raised outside the contract: {r[reader + '_detail']}")
            elif r[reader] == "ok" and r["pyarrow"] == "ok" and not r[equal]:
                problems.append(f"{what}: {reader} yielded data different from pyarrow's")
        if r["packer"] == "ok" and r["pyarrow"] != "ok":
            read_anyway += 1
            detail = r["pyarrow_detail"]
            if any(word in detail for word in ("type", "codec", "histogram", "num_rows", "offset")):
                problems.append(f"{what}: packer read it, pyarrow raised {detail}")
    assert not problems, f"{len(problems)} problems:\n" + "\n\n".join(problems[:20])
    assert read_anyway < len(variants) // 4  # what pyarrow alone refuses stays a small share


def test_dictionary_index_out_of_range_raises(tmp_path):
    """Dictionary indices past the end of the dictionary (0xff over bit-packed index data of an
    uncompressed page): packer raises, as pyarrow does, instead of yielding whatever lies beyond."""
    rng = np.random.default_rng(13)
    values = rng.integers(0, 5, 800).astype(np.int32)  # 5 distinct → bit width 3, every index real
    table = pa.table({"input_ids": list_array(np.full(100, 8), values, pa.int32(), item_nullable=False)},
                     schema=pa.schema([pa.field("input_ids", pa.list_(pa.field("item", pa.int32(), False)),
                                                False)]))
    path = tmp_path / "dict.parquet"
    pq.write_table(table, path, compression="none", use_dictionary=True, data_page_size=1 << 20)
    start, data_start, end = _chunk_span(path, 0, 0)
    b = bytearray(path.read_bytes())
    b[end - 24:end] = b"\xff" * 24
    bad = tmp_path / "dict-bad.parquet"
    bad.write_bytes(bytes(b))
    [r] = run_isolated([(bad, ["input_ids"])], tmp_path)
    assert "died" not in r or r["phase"] != "packer", f"ListColumnReader {r.get('died')}: {r.get('stderr')}"
    if r.get("pyarrow") == "raised":
        assert r["packer"] == "raised", f"pyarrow raises ({r['pyarrow_detail']}), packer gave {r['packer']}"
    assert r.get("packer") != "bad", r.get("packer_detail")



def _repeated_run_values(raw: bytes, lo: int, hi: int, width: int) -> list[tuple[int, int]]:
    """(position, value) of each repeated-value run's value byte in the hybrid stream raw[lo:hi]."""
    out, pos = [], lo
    while pos < hi:
        header, length = _read_varint(raw, pos)
        pos += length
        if header & 1:
            pos += (header >> 1) * width
        else:
            out.append((pos, raw[pos]))
            pos += (width + 7) // 8
    return out


def _wide_run_variants(tmp_path: Path) -> list[tuple[str, Path]]:
    """Files whose repeated-value runs (repetition levels, definition levels, dictionary indices)
    hold a value with bits set past the run's bit width: 35 for a level of width 1, say. pyarrow
    reads a run's whole bytes and rejects them; masking them to the width would read other data."""
    variants = []
    for dictionary in (False, True):
        rows = [[7] * 100, [9] * 100, [7] * 100] if dictionary else [list(range(1, 101))] * 3
        path = tmp_path / f"runs-{int(dictionary)}.parquet"
        pq.write_table(pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32()))}), path,
                       compression="none", use_dictionary=dictionary, data_page_version="1.0")
        raw = path.read_bytes()
        _, d0, e0 = _chunk_span(path, 0, 0)
        payload = e0 - _page_sizes(raw, d0)["compressed"][2]
        rep_len = int.from_bytes(raw[payload:payload + 4], "little")
        def_at = payload + 4 + rep_len
        def_len = int.from_bytes(raw[def_at:def_at + 4], "little")
        def_width = pq.ParquetFile(path).schema.column(0).max_definition_level.bit_length()
        streams = [("repetition level", payload + 4, def_at, 1),
                   ("definition level", def_at + 4, def_at + 4 + def_len, def_width)]
        if dictionary:
            width_at = def_at + 4 + def_len
            streams.append(("dictionary index", width_at + 1, e0, raw[width_at]))
        for what, lo, hi, width in streams:
            for k, (at, value) in enumerate(_repeated_run_values(raw, lo, hi, width)):
                for wide in (value | (1 << width), 35):
                    bad = tmp_path / f"wide-{int(dictionary)}-{len(variants)}.parquet"
                    bad.write_bytes(raw[:at] + bytes([wide]) + raw[at + 1:])
                    variants.append((f"{path.name}: {what} run {k}: {value} -> {wide}", bad))
    return variants


def test_run_values_wider_than_their_bit_width_are_never_masked(tmp_path):
    """A repeated-value run whose stored value has bits past the bit width (a level of 35 where
    the maximum is 1; a dictionary index of 2 in a 1-bit stream) is an error, as pyarrow makes it,
    never read as the value's low bits (which gave other rows, or other tokens, silently)."""
    variants = _wide_run_variants(tmp_path)
    kinds = {what.split(": ")[1].split(" run")[0] for what, _ in variants}
    assert kinds == {"repetition level", "definition level", "dictionary index"}, kinds
    results = run_isolated([(path, ["input_ids"]) for _, path in variants], tmp_path)
    wrong = [f"{what}: packer {r.get('packer', r.get('died'))} {r.get('packer_detail', '')}, "
             f"pyarrow {r.get('pyarrow')} {r.get('pyarrow_detail', '')}"
             for (what, _), r in zip(variants, results) if r.get("packer") != "raised" or r.get("pyarrow") != "raised"]
    assert not wrong, "\n".join(wrong)


def test_pack_names_the_row_group_pyarrow_rejects(tmp_path):
    """Where packer hands a damaged file to pyarrow and pyarrow rejects it, the one-line error
    names the file and the row group."""
    what, bad = _wide_run_variants(tmp_path)[0]
    with pytest.raises(DataError) as info:
        pack(bad, tmp_path / "out", PackSpec(pack_size=128))
    message = str(info.value)
    assert message.startswith(f"{bad}: cannot read as Parquet: row group 0: "), message
    assert "\n" not in message and not (tmp_path / "out").exists()

# --- 5. the pipeline ---------------------------------------------------------------------------

def _pack_both(monkeypatch, path, tmp_path, spec, source=SourceSpec()):
    outs, summaries = [], []
    for name, env in (("fast", None), ("arrow", "arrow")):
        if env:
            monkeypatch.setenv(ENV, env)
        else:
            monkeypatch.delenv(ENV, raising=False)
        out = tmp_path / name
        summaries.append(pack([str(path)], str(out), spec, source))
        outs.append(out)
    monkeypatch.delenv(ENV, raising=False)
    return outs, summaries


def assert_identical_dirs(a: Path, b: Path):
    names_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    assert names_a == names_b
    assert "metadata.json" in names_a and any(n.startswith("packs-") for n in names_a)
    for name in names_a:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between the decoders"


@pytest.fixture(scope="module")
def paged_parquet(tmp_path_factory) -> Path:
    """3,000 samples, lengths up to 2,000, over several row groups of small pages."""
    path = tmp_path_factory.mktemp("paged") / "paged.parquet"
    pq.write_table(demo_table(3000, seed=21, max_len=2000), path, row_group_size=700, data_page_size=8192,
                   compression="zstd")
    return path


def test_pack_output_identical_with_either_decoder(paged_parquet, tmp_path, monkeypatch):
    """pack() writes byte-identical shards, manifest and metadata with the compiled decoder and with
    PACKER_PARQUET_DECODER=arrow."""
    outs, summaries = _pack_both(monkeypatch, paged_parquet, tmp_path, PackSpec(pack_size=4096, cp=2))
    assert summaries[0].counts == summaries[1].counts
    assert_identical_dirs(*outs)


def test_pack_reads_parquet_with_the_fast_decoder(paged_parquet, tmp_path, monkeypatch):
    """pack() on a supported Parquet file goes through ListColumnReader and decodes every row itself."""
    readers = []
    original = ListColumnReader.__iter__

    def spy(self):
        readers.append(self)
        return original(self)

    monkeypatch.setattr(ListColumnReader, "__iter__", spy)
    pack([str(paged_parquet)], str(tmp_path / "out"), PackSpec(pack_size=4096))
    assert readers, "pack() did not read the Parquet file with ListColumnReader"
    assert sum(r.fast_rows for r in readers) == 3000
    assert sum(r.arrow_rows for r in readers) == 0


def _bad_records_file(tmp_path) -> Path:
    table = demo_table(1500, seed=22, max_len=2000)
    rows = table.to_pylist()
    rows[40]["input_ids"][3] = -5  # a negative token id
    rows[777]["loss_mask"] = rows[777]["loss_mask"][:-1]  # mask shorter than the input
    rows[1400]["input_ids"] = []  # too short to keep
    bad = pa.Table.from_pylist(rows, schema=table.schema)
    path = tmp_path / "bad.parquet"
    pq.write_table(bad, path, row_group_size=400, data_page_size=4096)
    return path


def test_pack_bad_records_counted_the_same_with_either_decoder(tmp_path, monkeypatch):
    """Skipped bad records (negative id, mask length ≠ input length, empty sample) give the same
    summary counts and the same output bytes with either decoder."""
    path = _bad_records_file(tmp_path)
    source = SourceSpec(on_bad_record=BadRecordPolicy.SKIP)
    outs, summaries = _pack_both(monkeypatch, path, tmp_path, PackSpec(pack_size=4096), source)
    assert summaries[0].counts == summaries[1].counts
    assert summaries[0].counts["bad_records"] >= 2
    assert_identical_dirs(*outs)


def test_pack_bad_record_error_message_same_with_either_decoder(tmp_path, monkeypatch):
    """With on_bad_record=error both decoders stop with the same DataError (same file and row)."""
    path = _bad_records_file(tmp_path)
    messages = []
    for env in (None, "arrow"):
        if env:
            monkeypatch.setenv(ENV, env)
        with pytest.raises(DataError) as info:
            pack([str(path)], str(tmp_path / f"out-{env}"), PackSpec(pack_size=4096))
        messages.append(str(info.value))
    assert messages[0] == messages[1]


# --- 6. real data ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["sft_gsm8k.parquet", "sft_codealpaca.parquet"])
def test_real_sft_files_decoded_fast(name):
    """The real SFT files (zstd, dictionary pages, 2 row groups): fast path throughout, equal to pyarrow."""
    require_shared()
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    fields = ["input_ids", "loss_mask"]
    reader, batches = read_with_packer(path, fields)
    want = assert_same_as_pyarrow(path, fields, batches)
    assert (reader.fast_rows, reader.arrow_rows, reader.fallback_reason) == (want.num_rows, 0, None)


def test_verify_source_reads_parquet_with_the_other_decoder(paged_parquet, tmp_path, monkeypatch):
    """A decoder bug in pack (here: every decoded token id off by one) cannot agree with itself in
    ``verify --source``, which decodes Parquet with pyarrow."""
    from packer_cli.audit import verify_output
    from packer_cli.sources import parquet_lists

    real = parquet_lists._decode_page

    def off_by_one(layout, *args):
        page = real(layout, *args)
        if layout.name == "input_ids":
            page.values += 1
        return page

    monkeypatch.setattr(parquet_lists, "_decode_page", off_by_one)
    out = tmp_path / "out"
    pack([str(paged_parquet)], str(out), PackSpec(pack_size=4096))
    assert verify_output(str(out)).ok  # internally consistent...
    report = verify_output(str(out), [str(paged_parquet)])
    assert not report.ok  # ...but not what the file holds
    assert any(f.check == "source.tokens" for f in report.findings)
    monkeypatch.setattr(parquet_lists, "_decode_page", real)
    fine = tmp_path / "fine"
    pack([str(paged_parquet)], str(fine), PackSpec(pack_size=4096))
    assert verify_output(str(fine), [str(paged_parquet)]).ok


@pytest.mark.parametrize("ahead_bytes", [1, 1 << 12])
def test_read_ahead_bounded_by_bytes_reads_the_same(paged_parquet, monkeypatch, ahead_bytes):
    """With the read-ahead byte budget at its smallest (one page in flight per column) the data and
    the fast path are unchanged."""
    from packer_cli.sources import parquet_lists

    monkeypatch.setattr(parquet_lists, "AHEAD_BYTES", ahead_bytes)
    reader, batches = read_with_packer(paged_parquet, ["input_ids", "loss_mask"], 500)
    assert_same_as_pyarrow(paged_parquet, ["input_ids", "loss_mask"], batches)
    assert reader.fallback_reason is None and reader.arrow_rows == 0


# --- the level kernels against the obvious NumPy -----------------------------------------------

def _row_lengths_numpy(rep, defs, max_def, empty_def):
    """The row lengths of a page's levels, spelled out with NumPy (oracle for the kernels):
    ("ok", lead, lengths, values) or the problem's name."""
    n = rep.size
    if n == 0:
        return "ok", 0, [], 0
    if rep.max() > 1 or defs.max() > max_def:
        return "above"
    starts = np.flatnonzero(rep == 0)
    empties = np.flatnonzero(defs != max_def)
    if empties.size and (defs[empties] != empty_def).any():
        return "nulls"
    if empties.size and (rep[empties] != 0).any():
        return "continues"
    entries = np.diff(np.append(starts, n))
    is_empty = np.isin(starts, empties)
    if (entries[is_empty] != 1).any():
        return "has values"
    lead = int(starts[0]) if starts.size else n
    return "ok", lead, (entries - is_empty).tolist(), n - empties.size


@pytest.mark.parametrize("nullable_elements", [False, True])
def test_row_length_kernels_match_numpy(nullable_elements):
    from packer_cli.sources import _parquet_kernels as K

    names = {K.LEVEL_ABOVE_MAX: "above", K.NULLS: "nulls", K.EMPTY_CONTINUES: "continues",
             K.EMPTY_HAS_VALUES: "has values"}
    max_def = 3 if nullable_elements else 2
    empty_def = max_def - 1 - int(nullable_elements)
    rng = np.random.default_rng(11)
    seen = set()
    for trial in range(3000):
        n = int(rng.integers(0, 40))
        rep = (rng.random(n) < 0.8).astype(np.uint8)  # mostly rows continuing
        defs = np.full(n, max_def, np.uint8)
        if trial % 3:  # empty lists, well placed (row starts) or not
            at = rng.random(n) < 0.15
            defs[at] = empty_def
            if trial % 2:
                rep[at] = 0
        if trial % 7 == 0 and n:  # a stray level: too high, or a null
            rep[rng.integers(n)] = rng.choice([0, 1, 2])
            defs[rng.integers(n)] = rng.choice([0, empty_def, max_def, max_def + 1])
        want = _row_lengths_numpy(rep, defs, max_def, empty_def)
        problem, rows, empties = K.level_checks(rep, defs, max_def, empty_def)
        lengths = np.full(rows, -7, np.int64)
        if not problem:
            problem, lead = K.row_lengths(rep, defs, max_def, lengths)
        if problem:
            assert names[problem] == want, (rep, defs)
        else:
            assert want == ("ok", lead, lengths.tolist(), n - empties), (rep, defs)
        seen.add(want if isinstance(want, str) else want[0])
    assert seen == {"ok", "above", "nulls", "continues", "has values"}


def _hybrid_stream(levels: np.ndarray, bit_width: int, rng) -> bytes:
    """``levels`` as a random mix of repeated-value runs and bit-packed runs (the last group of
    a bit-packed run padded with zeros), the way writers may lay them out."""
    def varint(v):
        out = bytearray()
        while True:
            out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
            v >>= 7
            if not v:
                return bytes(out)

    out, i, n = bytearray(), 0, levels.size
    while i < n:
        same = 1
        while i + same < n and levels[i + same] == levels[i]:
            same += 1
        if same >= 2 and rng.random() < 0.7:
            take = int(rng.integers(1, same + 1))
            out += varint(take << 1) + int(levels[i]).to_bytes(max(1, (bit_width + 7) // 8), "little")
        else:
            groups = int(rng.integers(1, 4))
            take = min(8 * groups, n - i)
            chunk = np.zeros(8 * groups, np.uint64)
            chunk[:take] = levels[i:i + take]
            bits = ((chunk[:, None] >> np.arange(bit_width, dtype=np.uint64)) & 1).astype(np.uint8).ravel()
            out += varint((groups << 1) | 1) + np.packbits(bits, bitorder="little").tobytes()
        i += take
    return bytes(out)


def test_full_page_levels_read_as_runs_match_the_general_path():
    """The run-level reading of a page whose entries are all values (definition levels one run,
    repetition levels scanned 64 at a time) gives the general path's lead and row lengths, and
    declines (None) every other page: empty lists, nulls, damaged or oddly ended streams.

    Among them, definition levels bit-packed where a run's first byte happens to equal the
    maximum level (levels ``max_def`` then 0s: empty lists): read without checking the run's
    kind, the run passed as a repeated run of ``max_def`` (its group count taken as a value
    count, its other bytes as further runs), the page as all values, and a valid page of empty
    lists was refused as corrupt ("page is shorter than its values")."""
    from packer_cli.sources import parquet_lists as PL

    def layout_of(max_def, empty_def):
        return PL._ColumnLayout(name="x", leaf=0, arrow_type=pa.list_(pa.int32()), physical_dtype=np.dtype(np.int32),
                                value_dtype=np.dtype(np.int32), max_def=max_def, empty_def=empty_def)

    def both_ways(layout, rep_raw, def_raw, n):
        """(the run-level reading, the general path's (lead, lengths), "not full" or "rejected")."""
        width = layout.max_def.bit_length()
        rep_span, def_span = (rep_raw, 0, rep_raw.size), (def_raw, 0, def_raw.size)
        fast = PL._rows_of_full_page(layout, rep_span, def_span, n)
        try:
            r = np.empty(n, np.uint8)
            PL._check(PL.hybrid_decode(*rep_span, 1, n, r))
            d = np.empty(n, np.uint8)
            PL._check(PL.hybrid_decode(*def_span, width, n, d))
            lead, lengths, count = PL._row_lengths(layout, r, d)
            general = (lead, lengths.tolist()) if count == n and (d == layout.max_def).all() else "not full"
        except (PL._Corrupt, PL._Unsupported):
            general = "rejected"
        return fast, general

    rng = np.random.default_rng(5)
    layout = layout_of(3, 1)
    outcomes = set()
    for trial in range(3000):
        n = int(rng.integers(0, 300))
        rep = (rng.random(n) < rng.choice([0.5, 0.97, 1.0])).astype(np.uint8)
        defs = np.full(n, 3, np.uint8)
        if trial % 4 == 0 and n:
            defs[rng.integers(n)] = rng.choice([1, 2])  # an empty list or a null element
        rep_raw = np.frombuffer(_hybrid_stream(rep, 1, rng), np.uint8)
        def_raw = np.frombuffer(_hybrid_stream(defs, 2, rng), np.uint8)
        if trial % 9 == 0 and rep_raw.size:  # damage: cut short, or a byte flipped
            rep_raw = rep_raw[:-1] if trial % 2 else rep_raw ^ (np.arange(rep_raw.size) == rng.integers(rep_raw.size))
        fast, general = both_ways(layout, rep_raw, def_raw, n)
        if fast is None:
            outcomes.add("declined")
            # a full page is only declined when a writer bit-packed its definition levels
            assert not (isinstance(general, tuple) and _single_runs(def_raw)), trial
        else:
            outcomes.add("read")
            assert (fast[0], fast[1].tolist()) == general, trial
    assert outcomes == {"declined", "read"}

    # A bit-packed definition-level run whose first byte equals max_def (one row per entry).
    cases = [
        # max_def 1 (bit width 1): 07 = 3 groups bit-packed, 01 6c 01 = levels 1,0,0,0,0,0,0,0 |
        # 0,0,1,1,0,1,1,0 | 1,0 (padding); misread: 3 x level 1, then 6c 01 = 54 x level 1
        (1, 0, "07016c01", [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 0], "not full"),
        # max_def 2 (bit width 2): repeated runs of 5 x level 2, then 07 = 3 groups bit-packed, 02 aa
        # aa aa 6a 02 = levels 2,0,0,0 | 2 x 12 | 2,2,2,1 | 2 (then padding); misread: 3 x level 2,
        # then the varint aa aa aa 6a = millions x level 2
        (2, 1, "02020202040202020702aaaaaa6a02", [2] * 6 + [0] * 3 + [2] * 15 + [1, 2], "rejected"),  # null lists
    ]
    for max_def, empty_def, stream, levels, want in cases:
        n = len(levels)
        def_raw = np.frombuffer(bytes.fromhex(stream), np.uint8)
        decoded = np.empty(n, np.uint8)
        assert PL.hybrid_decode(def_raw, 0, def_raw.size, max_def.bit_length(), n, decoded) == def_raw.size
        assert decoded.tolist() == levels
        rep_raw = np.frombuffer(bytes([n << 1, 0]), np.uint8)  # one run of level 0: a row per entry
        fast, general = both_ways(layout_of(max_def, empty_def), rep_raw, def_raw, n)
        assert (fast, general) == (None, want), stream
        assert PL.levels_all_equal(def_raw, 0, def_raw.size, max_def.bit_length(), n, max_def) is False, stream


def _single_runs(def_raw: np.ndarray) -> bool:
    """Whether a definition-level stream is repeated-value runs only (the fast path's condition)."""
    pos = 0
    while pos < def_raw.size:
        header, length = _read_varint(def_raw.tobytes(), pos)
        if header & 1:
            return False
        pos += length + 1  # the header, then the 1-byte value
    return True


def test_dictionary_decode_finds_an_index_past_the_dictionary_anywhere():
    """One index past the dictionary, at any position of a stream of bit-packed and repeated-value
    runs (inside the word-at-a-time loop, in a run's byte-by-byte tail, in a repeated run), makes
    dictionary_decode return INDEX_RANGE; without it the values are the dictionary's. Any index
    is past an empty dictionary."""
    from packer_cli.sources import _parquet_kernels as K

    rng = np.random.default_rng(17)
    dictionary = rng.integers(0, 1 << 20, 37).astype(np.int32)
    for bit_width in (6, 9, 17):
        for trial in range(150):
            n = int(rng.integers(1, 400))
            indices = rng.integers(0, dictionary.size, n)
            if trial % 3 == 0:  # some long repeats, written as repeated-value runs
                indices[: n // 2] = indices[0]
            out = np.empty(n, np.int32)
            raw = np.frombuffer(_hybrid_stream(indices, bit_width, rng), np.uint8)
            assert K.dictionary_decode(raw, 0, raw.size, bit_width, n, dictionary, out) == raw.size
            assert np.array_equal(out, dictionary[indices])
            bad = indices.copy()  # every other trial the first index out of range, the size itself
            if trial % 6 == 3:  # in the long repeat: a repeated-value run of it
                bad[: max(1, n // 2)] = dictionary.size
            else:
                bad[rng.integers(n)] = dictionary.size if trial % 2 else rng.integers(dictionary.size, 1 << bit_width)
            raw = np.frombuffer(_hybrid_stream(bad, bit_width, rng), np.uint8)
            assert K.dictionary_decode(raw, 0, raw.size, bit_width, n, dictionary, out) == K.INDEX_RANGE, trial
    # A dictionary page of no values: index 0 is past it too, in a bit-packed run (16 8-bit zeros,
    # the run padded to three groups, so all are unpacked a word at a time) as in a repeated one.
    # (The word loop once clamped each index to "size - 1", which wrapped to 2**64 - 1: it read
    # past the empty dictionary, no error.)
    empty, out = dictionary[:0], np.empty(16, np.int32)
    for raw in (np.array([3 << 1 | 1] + [0] * 24, np.uint8), np.array([16 << 1, 0], np.uint8)):
        assert K.dictionary_decode(raw, 0, raw.size, 8, 16, empty, out) == K.INDEX_RANGE, raw[0]


def test_payloads_read_where_files_cannot_be_mapped(paged_parquet, monkeypatch):
    """On a file system that refuses memory maps, page payloads are read with pread instead:
    same data, still the fast path."""
    import mmap as mmap_module

    from packer_cli.sources import parquet_lists

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # ENODEV: what mmap raises where mapping is unsupported

    monkeypatch.setattr(parquet_lists.mmap, "mmap", refuse)
    assert parquet_lists.mmap is mmap_module
    reader, batches = read_with_packer(paged_parquet, ["input_ids", "loss_mask"], 500)
    assert_same_as_pyarrow(paged_parquet, ["input_ids", "loss_mask"], batches)
    assert reader.fallback_reason is None and reader.arrow_rows == 0


@pytest.mark.parametrize("compression", ["none", "snappy"])
def test_large_and_small_pages_at_the_default_map_threshold(tmp_path, monkeypatch, compression):
    """With the threshold as shipped, pages of 1 MB are mapped and the small ones (the loss mask,
    each chunk's last page) read: same data as pyarrow, all on the fast path."""
    from packer_cli.sources import parquet_lists

    monkeypatch.setattr(parquet_lists, "_MAP_PAYLOAD", 256 << 10)
    path = tmp_path / "large-pages.parquet"
    pq.write_table(demo_table(2000, seed=5, max_len=1500), path, row_group_size=1200, data_page_size=1 << 20,
                   compression=compression)
    meta = pq.ParquetFile(path).metadata
    chunk = meta.row_group(0).column(0)
    assert chunk.total_compressed_size > 2 * (256 << 10)  # at least one page over the threshold
    assert meta.row_group(0).column(1).total_compressed_size < 256 << 10  # the mask's pages are read
    real_mmap, mapped = parquet_lists.mmap.mmap, []

    def counting_mmap(*args, **kwargs):
        mapped.append(args[1])
        return real_mmap(*args, **kwargs)

    monkeypatch.setattr(parquet_lists.mmap, "mmap", counting_mmap)
    reader, batches = read_with_packer(path, ["input_ids", "loss_mask"], 300)
    assert_same_as_pyarrow(path, ["input_ids", "loss_mask"], batches)
    assert reader.fallback_reason is None and reader.arrow_rows == 0
    assert mapped and all(length >= 256 << 10 for length in mapped)


# --- 7. what pyarrow reads is counted; crafted column chunks ------------------------------------

def test_pyarrow_reading_a_group_short_is_an_error(tmp_path, monkeypatch):
    """pyarrow's ``iter_batches`` can read fewer rows than a row group holds and say nothing
    (pyarrow 26 reads the last one-row group of a file of data pages v2 and 64-byte pages as
    none). Where pyarrow decodes (here for the boolean mask), its rows are counted against the
    footer's: a group read short is a one-line error naming the file and the group, and pack
    writes nothing, where it wrote the file a record short."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 150_000, int(n)).tolist() for n in rng.integers(50, 1500, 40)]
    table = pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32())),
                      "loss_mask": pa.array([[v % 2 == 0 for v in r] for r in rows], pa.list_(pa.bool_()))})
    fields = ["input_ids", "loss_mask"]
    tiny = tmp_path / "v2-tiny-pages.parquet"
    pq.write_table(table, tiny, data_page_version="2.0", data_page_size=64, row_group_size=3)
    try:
        read = sum(batch.num_rows for batch in ListColumnReader(str(tiny), fields, 97))
    except ValueError as exc:
        assert re.fullmatch(r"row group \d+: pyarrow read \d+ of its \d+ rows", str(exc)), exc
    else:  # a pyarrow without the bug
        assert read == 40
    # whatever this pyarrow does with that file: a group read short, through pack
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=3)
    real = pq.ParquetFile.iter_batches

    def short(self, *args, row_groups=None, **kwargs):
        batches = list(real(self, *args, row_groups=row_groups, **kwargs))
        return iter(batches[:-1] if row_groups == [5] else batches)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", short)
    with pytest.raises(DataError) as info:
        pack([str(path)], str(tmp_path / "out"), PackSpec(pack_size=4096))
    assert str(info.value) == f"{path}: cannot read as Parquet: row group 5: pyarrow read 0 of its 3 rows"
    assert not (tmp_path / "out").exists()


def _footer_of(raw: bytes) -> tuple[list, int]:
    """A file's footer, typed (:func:`packer_cli._thrift.read_fields`), and where it starts."""
    size = int.from_bytes(raw[-8:-4], "little")
    return read_fields(raw[-8 - size:-8])[0], len(raw) - 8 - size


def _field(fields: list, field_id: int):
    return next(value for fid, _, value in fields if fid == field_id)


def _set(fields: list, field_id: int, value=None, kind=None) -> None:
    """Field ``field_id`` of ``fields`` (in place) given ``value`` and/or wire type ``kind``."""
    fields[:] = [(fid, kind or k, v if value is None else value) if fid == field_id else (fid, k, v)
                 for fid, k, v in fields]


def _with_footer(raw: bytes, footer_at: int, footer: list) -> bytes:
    out = bytearray()
    write_fields(out, footer)
    return raw[:footer_at] + bytes(out) + len(out).to_bytes(4, "little") + b"PAR1"


def _first_chunk_meta(footer: list) -> list:
    return _field(_field(_field(footer, 4)[1][0], 1)[1][0], 3)


def _chunk_pages(raw: bytes, start: int, end: int) -> list:
    """The pages of the column chunk at ``raw[start:end]``, as [(header fields, payload)]."""
    pages, pos = [], start
    while pos < end:
        header, pos = read_fields(raw, pos)
        pages.append((header, raw[pos:pos + _field(header, 3)]))
        pos += _field(header, 3)
    return pages


def _rewrite_pages(path: Path, out: Path, transform, rows: int = 0) -> Path:
    """``path`` (one row group of one column) with its chunk's pages, as [(header fields,
    payload)], replaced by ``transform(pages)``: each header's compressed size and the chunk's
    sizes follow; ``rows`` more rows (and their level entries, counted in the pages'
    headers) when pages are added from elsewhere."""
    raw = path.read_bytes()
    footer, footer_at = _footer_of(raw)
    meta = _first_chunk_meta(footer)
    start, data_start, end = _chunk_span(path, 0, 0)
    pages = _chunk_pages(raw, start, end)
    body, levels = bytearray(), 0
    for header, payload in transform(pages):
        _set(header, 3, len(payload))
        write_fields(body, header)
        body += payload
        levels += _level_count(header)
    _set(meta, 5, levels)
    _set(meta, 6, len(body))
    _set(meta, 7, len(body))
    group = _field(footer, 4)[1][0]
    _set(group, 3, _field(group, 3) + rows)
    _set(footer, 3, _field(footer, 3) + rows)
    head = raw[:start] + bytes(body) + raw[end:footer_at]
    out.write_bytes(_with_footer(head, len(head), footer))
    return out


def _level_count(header: list) -> int:
    """A data page's level entries (v1: its header's field 5, v2: 8); 0 for other pages."""
    sub = {0: 5, 3: 8}.get(_field(header, 1))
    return 0 if sub is None else _field(_field(header, sub), 1)


def _two_groups(tmp_path, bool_mask: bool, compression: str = "snappy", dictionary: bool = True) -> Path:
    """Ten 3-token rows with an int8 (or boolean: pyarrow decodes it) mask, in two row groups
    (of PLAIN pages only, without ``dictionary``)."""
    rows = [[i, i + 1, i + 2] for i in range(10)]
    mask = pa.array([[1, 0, 1]] * 10, pa.list_(pa.int8()))
    if bool_mask:
        mask = mask.cast(pa.list_(pa.bool_()))
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32())), "loss_mask": mask}), path,
                   row_group_size=5, compression=compression, use_dictionary=dictionary)
    return path


@pytest.mark.parametrize("how", ["compiled", "bool mask", "arrow_only", ENV])
def test_footer_row_counts_checked_whichever_decoder_reads(tmp_path, monkeypatch, how):
    """A footer whose row groups' row counts do not add up to the file's (the first group's one
    lower) is the same one-line error whichever decoder would read the file: packer's (an int8
    mask), or pyarrow's (a boolean mask, ``verify --source``'s second opinion, the variable),
    which reads the stated count and stops, a record short."""
    path = _two_groups(tmp_path, bool_mask=how == "bool mask")
    raw = path.read_bytes()
    footer, footer_at = _footer_of(raw)
    group = _field(footer, 4)[1][0]
    _set(group, 3, _field(group, 3) - 1)
    path.write_bytes(_with_footer(raw, footer_at, footer))
    if how == ENV:
        monkeypatch.setenv(ENV, "arrow")
    reader = ListColumnReader(str(path), ["input_ids", "loss_mask"], arrow_only=how == "arrow_only")
    with pytest.raises(ValueError, match="^the footer is damaged: its row groups' row counts are negative or do not"):
        list(reader)


_PAGES_DISAGREE = {  # what packer's decoder says of each damage
    "fewer rows": "column chunk holds more rows than its row group",
    "more values": "the column chunk's pages end before the value count its footer states",
    "fewer values": "pages hold more values than the column chunk",
    "fewer rows and values": "pages hold more values than the column chunk",
}


@pytest.mark.parametrize("how", ["compiled", "compiled plain", "brotli", "bool mask", ENV])
@pytest.mark.parametrize("damage", ["fewer rows", "more values", "fewer values", "fewer rows and values"])
def test_a_footer_that_agrees_with_itself_but_not_the_pages_is_an_error(tmp_path, monkeypatch, how, damage):
    """The last group's row count and the file's both 3 lower (the footer adds up, the pages
    hold 3 rows more), or a column chunk's value count off by one: packer's decoder refused
    it, but wherever pyarrow decoded (Brotli pages, a boolean mask, the variable) the file was
    read 3 records short, exit 0, and verify --source passed (or read whole, the count wrong).
    Without dictionary pages the run of small groups is first decoded whole (RowGroupRuns),
    which read the file without error, its chunk's value count unchecked against its pages'.
    packer's decoder words each damage: pages holding more values than the footer states
    were said to "end before the value count its footer states"."""
    path = _two_groups(tmp_path, bool_mask=how == "bool mask", compression="brotli" if how == "brotli" else "zstd",
                       dictionary=how != "compiled plain")
    raw = path.read_bytes()
    footer, footer_at = _footer_of(raw)
    last = _field(footer, 4)[1][-1]
    if damage.startswith("fewer rows"):
        _set(last, 3, _field(last, 3) - 3)
        _set(footer, 3, _field(footer, 3) - 3)
    if damage == "fewer rows and values":  # the footer adds up with itself throughout
        for column in _field(last, 1)[1]:
            meta = _field(column, 3)
            _set(meta, 5, _field(meta, 5) - 9)
    elif damage != "fewer rows":
        meta = _field(_field(last, 1)[1][0], 3)
        _set(meta, 5, _field(meta, 5) + (1 if damage == "more values" else -1))
    path.write_bytes(_with_footer(raw, footer_at, footer))
    if how == ENV:
        monkeypatch.setenv(ENV, "arrow")
    if how == "bool mask" and damage == "fewer rows and values":  # the headers one at a time, unmapped
        import mmap

        def unmappable(*args, **kwargs):
            raise OSError(19, "No such device")

        monkeypatch.setattr(mmap, "mmap", unmappable)
    with pytest.raises(DataError, match=r"t\.parquet: cannot read as Parquet: row group 1: .*(value|row)") as info:
        pack([str(path)], str(tmp_path / "out"), PackSpec(pack_size=64))
    if how.startswith("compiled"):
        assert str(info.value) == (f"{path}: cannot read as Parquet: row group 1: column 'input_ids': "
                                   f"{_PAGES_DISAGREE[damage]}")
    assert not (tmp_path / "out").exists()


def test_a_negative_row_count_in_a_data_page_v2_is_an_error(tmp_path):
    """pyarrow refuses it ("negative number of rows"); packer's decoder packed the file, which
    its own verify --source (reading through pyarrow) then failed."""
    path = tmp_path / "v2.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int32()))}), path,
                   data_page_version="2.0", compression="none")

    def negative_rows(pages):
        for header, _ in pages:
            if _field(header, 1) == 3:  # DATA_PAGE_V2: its num_rows is field 3 of field 8
                _set(_field(header, 8), 3, -1)
        return pages

    bad = _rewrite_pages(path, tmp_path / "bad.parquet", negative_rows)
    with pytest.raises((pa.ArrowException, OSError), match="negative number of rows"):
        pq.read_table(bad)
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read as Parquet: row group 0: .*invalid row count"):
        pack([str(bad)], str(tmp_path / "out"), PackSpec(pack_size=64))


@pytest.mark.parametrize("group, level, says", [
    (1, 0, "row group 1: column 'input_ids': the first value of a column chunk does not start a row"),
    (0, 52, "row group 0: column 'input_ids': column chunk holds fewer rows than its row group"),
], ids=["chunk starts inside a row", "chunk a row short"])
def test_a_row_start_flipped_in_a_chunks_repetition_levels_is_named(tmp_path, group, level, says):
    """One bit flipped in a chunk's repetition levels (a row start, level 0, made 1) of a file of
    three 40-row groups read page by page (batches of 20 rows; groups 0 and 1 one run, one
    cursor over both chunks) is named by its row group as soon as the cursor reaches it. The
    first level of group 1's chunk (pyarrow refuses it: "must be 0"): the file was read without
    error, that chunk's rows shifted by a value (its first row empty). Row 35's first level
    (group 0's chunk then holds 39 rows; pyarrow reads 119): the short chunk was not caught at
    its end; group 1's rows were yielded a row early, and the error came at the run's end,
    naming row group 1."""
    rows = [list(range(10 * i, 10 * i + 1 + i % 2)) for i in range(120)]  # 1, 2, 1, ... values: no 8 equal levels
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), path, row_group_size=40,
                   compression="none", use_dictionary=False)
    raw = bytearray(path.read_bytes())
    _, data_at, end = _chunk_span(path, group, 0)
    payload = end - _page_sizes(raw, data_at)["compressed"][2]  # the chunk's one page: u32 length, levels, ...
    header, length = _read_varint(raw, payload + 4)
    assert header == (8 << 1) | 1  # its 60 repetition levels one bit-packed run: level k is bit k
    at = payload + 4 + length + level // 8  # level 52: rows 0-34 hold 35 + 17 values
    assert raw[at] >> level % 8 & 1 == 0  # a row start
    raw[at] |= 1 << level % 8
    path.write_bytes(bytes(raw))
    got = []
    with pytest.raises(ValueError) as info:
        for batch in ListColumnReader(str(path), ["input_ids"], batch_rows=20):
            got += batch.column(0).to_pylist()
    assert str(info.value) == says
    assert got == rows[:20]  # (group 0's last row is complete once group 1's chunk is reached)


def _dictionary_file(tmp_path) -> tuple[Path, list]:
    """One chunk: a dictionary page, then several small dictionary-encoded pages (uncompressed)."""
    rows = [[i % 5, (i + 1) % 5, 7] for i in range(40)]
    path = tmp_path / "dictionary.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), path, use_dictionary=True,
                   data_page_size=40, write_statistics=False, compression="none")
    return path, rows


@PYARROW_AS_REFERENCE
def test_a_second_dictionary_page_is_an_error(tmp_path):
    """A column chunk with a second dictionary page after its first data page (its values
    shifted): pyarrow refuses it ("more than one dictionary"), and so does packer, where it
    read the pages after it through the second dictionary (other tokens, without an error)."""
    base, _ = _dictionary_file(tmp_path)

    def second_dictionary(pages):
        (header, payload), first, *rest = pages
        assert _field(header, 1) == 2 and rest  # a dictionary page, then two data pages or more
        shifted = (np.frombuffer(payload, dtype="<i4") + 1000).astype("<i4").tobytes()
        return [(header, payload), first, (list(header), shifted), *rest]

    path = _rewrite_pages(base, tmp_path / "two-dictionaries.parquet", second_dictionary)
    with pytest.raises((OSError, pa.ArrowException), match="more than one dictionary"):
        pq.read_table(path)
    with pytest.raises(ValueError, match="^row group 0: column 'input_ids': a second dictionary page in the"):
        list(ListColumnReader(str(path), ["input_ids"]))
    with RowGroupRuns(str(path)) as runs, pytest.raises(ValueError, match="a second dictionary page"):
        runs.read(0, 1, ["input_ids"])


@pytest.mark.parametrize("off_by", [1, -1])
def test_an_uncompressed_page_whose_stated_size_is_off_reads_as_pyarrow_reads_it(tmp_path, off_by):
    """An uncompressed data page whose header states one byte more or fewer than it stores:
    pyarrow trusts the stored bytes and reads the file, so ListColumnReader hands it to pyarrow
    (the same rows) and RowGroupRuns leaves the run to it (None). Held to the stated size, the
    page was refused ("page does not decompress to its stated size"): a file pyarrow reads was
    an error."""
    base = tmp_path / "base.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[i, i + 1, 7] for i in range(40)], pa.list_(pa.int32()))}),
                   base, use_dictionary=False, compression="none", write_statistics=False)

    def misstate(pages):
        for header, _ in pages:
            if _field(header, 1) == 0:  # a data page: its uncompressed size off by one
                _set(header, 2, _field(header, 2) + off_by)
        return pages

    path = _rewrite_pages(base, tmp_path / "misstated.parquet", misstate)
    assert pq.read_table(path).num_rows == 40
    reader, batches = read_with_packer(path, ["input_ids"])
    assert_same_as_pyarrow(path, ["input_ids"], batches)
    assert (reader.fast_rows, reader.arrow_rows) == (0, 40) and "sizes disagree" in reader.fallback_reason
    with RowGroupRuns(str(path)) as runs:
        assert runs.read(0, 1, ["input_ids"]) is None


def test_a_dictionary_encoded_page_cut_after_its_levels_is_an_error(tmp_path):
    """A dictionary-encoded data page whose values (the bit-width byte and the indices) are cut
    off, its sizes following: pyarrow refuses it, and both readers say the values end early. They
    once read the missing bit-width byte one past the page: an IndexError traceback."""
    base, _ = _dictionary_file(tmp_path)

    def cut_values(pages):
        dictionary, (header, payload), *rest = pages
        assert _field(header, 1) == 0  # a data page v1: each level run prefixed by its byte length
        rep = int.from_bytes(payload[:4], "little")
        levels_end = 8 + rep + int.from_bytes(payload[4 + rep:8 + rep], "little")
        _set(header, 2, levels_end)  # the uncompressed size (the compressed one follows)
        return [dictionary, (header, payload[:levels_end]), *rest]

    path = _rewrite_pages(base, tmp_path / "cut.parquet", cut_values)
    with pytest.raises((OSError, pa.ArrowException)):
        pq.read_table(path)
    with pytest.raises(ValueError, match="^row group 0: column 'input_ids': encoded values end early$"):
        list(ListColumnReader(str(path), ["input_ids"]))
    with RowGroupRuns(str(path)) as runs, pytest.raises(ValueError, match="^row groups 0-0: column 'input_ids': encoded"):
        runs.read(0, 1, ["input_ids"])


def test_a_dictionary_page_after_plain_pages_reads_as_pyarrow_reads(tmp_path):
    """A chunk's one dictionary page after PLAIN data pages (a chunk of PLAIN pages joined to a
    dictionary-encoded one): not where the format puts it, but pyarrow reads it, so packer does
    too, the same rows (refusing it would make the outcome depend on the decoder)."""
    dictionary, later = _dictionary_file(tmp_path)
    plain = tmp_path / "plain.parquet"
    first = [[i, i + 1] for i in range(20)]
    pq.write_table(pa.table({"input_ids": pa.array(first, pa.list_(pa.int32()))}), plain, use_dictionary=False,
                   data_page_size=40, write_statistics=False, compression="none")
    start, _, end = _chunk_span(dictionary, 0, 0)
    appended = _chunk_pages(dictionary.read_bytes(), start, end)
    path = _rewrite_pages(plain, tmp_path / "late-dictionary.parquet", lambda pages: pages + appended,
                          rows=len(later))
    want = pq.read_table(path)
    assert want.column(0).to_pylist() == first + later
    reader, batches = read_with_packer(path, ["input_ids"])
    assert_same_as_pyarrow(path, ["input_ids"], batches)
    assert reader.fallback_reason is None


def _values_at(header: list) -> int:
    """Where a page's compressed bytes start: after a v2 page's levels, else at its start."""
    if _field(header, 1) != 3:
        return 0
    v2 = _field(header, 8)
    return _field(v2, 5) + _field(v2, 6)


def _recompress(codec: str, how: str):
    """A transform for :func:`_rewrite_pages`: every data page's compressed bytes made again,
    ``how``: as two Zstandard frames, two gzip members, or one gzip stream and 4 zero bytes."""
    import zstandard

    def again(data: bytes) -> bytes:
        half = len(data) // 2
        if how == "two frames":
            return zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(data[half:])
        if how == "two members":
            return gzip.compress(data[:half]) + gzip.compress(data[half:])
        return gzip.compress(data) + bytes(4)

    def transform(pages):
        out = []
        for header, payload in pages:
            at = _values_at(header)
            size = _field(header, 2) - at
            data = (zstandard.ZstdDecompressor().decompress(payload[at:], max_output_size=size) if codec == "zstd"
                    else zlib.decompress(payload[at:], wbits=47))
            out.append((header, payload[:at] + again(data)))
        return out
    return transform


@PYARROW_AS_REFERENCE
@pytest.mark.parametrize("page_version", ["1.0", "2.0"])
@pytest.mark.parametrize("codec,how", [("zstd", "two frames"), ("gzip", "two members"), ("gzip", "trailing zeros")])
def test_pages_of_several_frames_or_members_read_as_pyarrow_reads(tmp_path, codec, how, page_version):
    """Zstandard pages of two frames and gzip pages of two members are valid, and pyarrow reads
    them: so does packer, the same rows (it said they do not decompress to their size, reading
    the first frame or member only). A gzip stream followed by other bytes pyarrow refuses, and
    packer too (it ignored them)."""
    rows = [[(i * 7 + j) % 1000 for j in range(50)] for i in range(40)]
    base = tmp_path / "base.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), base, use_dictionary=False,
                   compression=codec, write_statistics=False, data_page_version=page_version)
    path = _rewrite_pages(base, tmp_path / "recompressed.parquet", _recompress(codec, how))
    if how == "trailing zeros":
        with pytest.raises((OSError, pa.ArrowException)):
            pq.read_table(path)
        with pytest.raises(ValueError, match="^row group 0: column 'input_ids': page does not decompress"):
            list(ListColumnReader(str(path), ["input_ids"]))
        return
    assert pq.read_table(path).column(0).to_pylist() == rows
    _, batches = read_with_packer(path, ["input_ids"])
    assert_same_as_pyarrow(path, ["input_ids"], batches)


@PYARROW_AS_REFERENCE
@pytest.mark.parametrize("codec", ["snappy", "zstd", "gzip"])
def test_empty_compressed_value_sections_read(tmp_path, codec):
    """A data page v2 of empty lists only has no values: 0 bytes. A writer may mark them
    compressed all the same (pyarrow marks them not): pyarrow reads them as nothing, and so
    does packer, on its fast path (it said they do not decompress)."""
    rows = [[]] * 10 + [[1, 2, 3]] * 5 + [[]] * 10
    base = tmp_path / "base.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), base, use_dictionary=False,
                   compression=codec, write_statistics=False, data_page_version="2.0", data_page_size=1,
                   write_batch_size=10)
    marked = []

    def compressed(pages):
        for header, payload in pages:
            v2 = _field(header, 8)
            if _field(header, 2) == _values_at(header):  # no values
                v2[:] = sorted([entry for entry in v2 if entry[0] != 7] + [(7, TRUE, None)])
                marked.append(len(payload) == _values_at(header))
        return pages

    path = _rewrite_pages(base, tmp_path / "empty-values.parquet", compressed)
    assert marked and all(marked)
    assert pq.read_table(path).column(0).to_pylist() == rows
    reader, batches = read_with_packer(path, ["input_ids"])
    assert_same_as_pyarrow(path, ["input_ids"], batches)
    assert reader.fallback_reason is None


def _rows_in_child(path: str, queue) -> None:
    queue.put(sum(batch.num_rows for batch in ListColumnReader(path, ["input_ids", "loss_mask"], 64)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_shared_decoding_threads_are_made_again_in_a_forked_child(tmp_path):
    """Files share the process's two decoding threads (a pool a file cost most of a small
    file's reading); a forked child has none of its parent's threads, so it makes its own
    rather than wait forever on the parent's."""
    import multiprocessing

    path = tmp_path / "t.parquet"
    pq.write_table(token_table(300, seed=1), path, row_group_size=40)
    assert read_with_packer(path, ["input_ids", "loss_mask"], 64)[0].fast_rows == 300  # the parent's pool exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_rows_in_child, args=(str(path), queue))
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and queue.get(timeout=5) == 300


def test_a_run_of_row_groups_stays_within_its_rows_and_values():
    """A run decoded whole is in memory at once: 600 one-row groups before a 1M-row group were
    one run of 1,000,600 rows, and ten-row groups of 32k-token samples would make a run of 8,192
    rows a gigabyte. A run closes before either bound; a larger group is a run of its own."""
    from packer_cli.sources.parquet_lists import _runs

    assert list(_runs([1] * 600 + [1_000_000, 5], [3] * 600 + [9_000_000, 15], 8192, 4 << 20)) == [
        (0, 600), (600, 601), (601, 602)]
    runs = list(_runs([10] * 100, [320_000] * 100, 8192, 4 << 20))  # 13 groups hold 4.16M values
    assert runs[0] == (0, 13) and all(end - first <= 13 for first, end in runs) and runs[-1][1] == 100
    assert list(_runs([], [], 8192, 4 << 20)) == [] and list(_runs([0, 0], [0, 0], 1, 1)) == [(0, 2)]


def _long_and_short_rows(n_rows: int, seed: int) -> pa.Table:
    """``token_table``-like rows of 0-60 values, every 97th row 800 (longer than the value budget
    the tests below set)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 61, n_rows)
    lengths[::97] = 800
    n = int(lengths.sum())
    return pa.table({
        "input_ids": list_array(lengths, rng.integers(0, 1000, n).astype(np.int32), pa.int32()),
        "loss_mask": list_array(lengths, rng.integers(0, 2, n).astype(np.uint8), pa.uint8()),
    })


@pytest.mark.parametrize("dictionary", [False, True])
def test_a_batch_of_long_rows_closes_at_its_value_budget(tmp_path, dictionary):
    """A batch closes before ``batch_rows`` rows where they would pass ``batch_values`` values: 2,048
    rows of 100k tokens in one row group were one batch of 200M tokens (1.9 GB at the peak). Each
    batch holds at most the budget, or one longer row alone, and closes only when the next row
    would pass it; together the batches are pyarrow's rows."""
    path = tmp_path / "t.parquet"
    fields = ["input_ids", "loss_mask"]
    pq.write_table(_long_and_short_rows(3000, 1), path, row_group_size=5000, data_page_size=300,
                   use_dictionary=dictionary)
    reader = ListColumnReader(str(path), fields, batch_rows=2048, batch_values=500)
    batches = list(reader)
    assert_same_as_pyarrow(path, fields, batches)
    assert reader.fallback_reason is None
    sizes = [len(b.column(0).flatten()) for b in batches]
    assert all(size <= 500 or b.num_rows == 1 for size, b in zip(sizes, batches))
    lengths = pq.read_table(path, columns=["input_ids"]).column(0).combine_chunks().value_lengths().to_numpy()
    ends = np.cumsum([b.num_rows for b in batches])
    for size, end in zip(sizes[:-1], ends[:-1]):
        assert size + lengths[end] > 500  # the next row did not fit
    assert len(batches) > 3000 * 30 // 500  # (about 30 values a row)


def test_pyarrow_reads_a_group_of_long_rows_in_batches_of_its_mean_row_budget(tmp_path):
    """Where pyarrow decodes (``verify --source``'s second opinion), a batch is sized from the row
    group's mean row length: ``verify --source`` of 2,048 rows of 100k tokens held 4.6 GB."""
    path = tmp_path / "t.parquet"
    fields = ["input_ids", "loss_mask"]
    table = _long_and_short_rows(3000, 2)
    pq.write_table(table, path, row_group_size=1000, data_page_size=300)
    reader = ListColumnReader(str(path), fields, batch_rows=2048, arrow_only=True, batch_values=500)
    batches = list(reader)
    assert_same_as_pyarrow(path, fields, batches)
    meta = pq.ParquetFile(path).metadata
    expected = []
    for g in range(meta.num_row_groups):
        rows = meta.row_group(g).num_rows
        values = max(meta.row_group(g).column(j).num_values for j in range(2))
        step = max(1, min(2048, 500 * rows // values))
        expected += [step] * (rows // step) + ([rows % step] if rows % step else [])
    assert [b.num_rows for b in batches] == expected
    assert max(expected) < 30  # not 1,000-row batches


def test_a_footer_stating_dictionary_offset_zero_without_a_dictionary_reads_as_pyarrow_reads_it(tmp_path):
    """Some writers state ``dictionary_page_offset = 0`` for a column chunk without dictionary:
    pyarrow reads such a file, and so must packer's decoder (0 is no offset, not the file's start)."""
    from packer_cli._thrift import I64

    path = tmp_path / "t.parquet"
    table = pa.table({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]] * 50,
                      "loss_mask": [[1, 1, 0], [0, 1], [1, 1, 1, 1]] * 50})
    pq.write_table(table, path, write_statistics=False, use_dictionary=False)
    raw = path.read_bytes()
    footer, footer_at = _footer_of(raw)
    for group in _field(footer, 4)[1]:
        for chunk in _field(group, 1)[1]:
            meta = _field(chunk, 3)
            assert all(fid != 11 for fid, _, _ in meta)
            meta.append((11, I64, 0))
            meta.sort(key=lambda field: field[0])
    path.write_bytes(_with_footer(raw, footer_at, footer))
    assert pq.read_table(path).equals(table)
    batches = list(ListColumnReader(str(path), ["input_ids", "loss_mask"]))
    assert pa.Table.from_batches(batches).equals(table.cast(batches[0].schema))


def test_gzip_pages_without_their_trailer_are_refused_as_pyarrow_refuses_them(tmp_path):
    """A gzip stream cut before its 8-byte trailer (CRC-32 and size) holds all the data but does
    not end: pyarrow refuses the page, and so does packer's decoder, naming the column."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]] * 50}), path, write_statistics=False,
                   use_dictionary=False, compression="gzip")
    bad = _rewrite_pages(path, tmp_path / "cut.parquet", lambda pages: [(h, p[:-8]) for h, p in pages])
    with pytest.raises((pa.ArrowException, OSError)):
        pq.read_table(bad)
    with pytest.raises(ValueError, match=r"column 'input_ids': page does not decompress \(gzip: incomplete or "
                                         r"truncated stream\)"):
        list(ListColumnReader(str(bad), ["input_ids"]))


# --- page headers read from windows of a chunk ----------------------------------------------------

def _windows(monkeypatch, first: int, later: int, alone: int = 64 << 10) -> None:
    """Set the windows ``_ChunkPages`` reads small pages' headers from (0, 0: none, every page
    read alone and its header parsed in Python), and the payload from which a page is read alone."""
    from packer_cli.sources import parquet_lists

    monkeypatch.setattr(parquet_lists, "FIRST_WINDOW", first)
    monkeypatch.setattr(parquet_lists, "HEADER_WINDOW", later)
    monkeypatch.setattr(parquet_lists, "ALONE_PAYLOAD", alone)


def _one_group_file(path, codec="snappy", dictionary=True, page_size=512, version="1.0", rows=3000, seed=21):
    """One row group larger than a batch, so the page cursors (not whole runs) read it."""
    pq.write_table(token_table(rows, seed=seed, max_len=50), path, compression=codec, use_dictionary=dictionary,
                   data_page_size=page_size, data_page_version=version, row_group_size=rows)
    return path


@pytest.mark.parametrize("first,later", [(64, 3200), (300, 16384), (32 << 10, 256 << 10)],
                         ids=["windows of a page or two", "windows of a few pages", "default windows"])
@pytest.mark.parametrize("codec,dictionary,version", [("snappy", True, "1.0"), ("none", False, "2.0"),
                                                      ("zstd", True, "2.0"), ("lz4", False, "1.0")])
def test_small_pages_read_from_windows_equal_pyarrow(tmp_path, monkeypatch, first, later, codec, dictionary,
                                                     version):
    """Pages straddling window ends, windows of one page, a first window too short for the
    dictionary page: all read equal to pyarrow on the fast path, the headers of pages lying
    whole in a window walked by compiled code (Python parses only the others)."""
    from packer_cli import _parquet_thrift as thrift

    path = _one_group_file(tmp_path / "t.parquet", codec, dictionary, version=version)
    _windows(monkeypatch, first, later, alone=1 << 30)  # (pages of ~1.5 KB: each window's last straddles its end)
    parsed = []
    real = thrift.read_page_header
    monkeypatch.setattr(thrift, "read_page_header", lambda *a: parsed.append(a) or real(*a))
    reader, batches = read_with_packer(path, ["input_ids", "loss_mask"], 256)
    assert_same_as_pyarrow(path, ["input_ids", "loss_mask"], batches)
    assert (reader.fast_rows, reader.arrow_rows) == (3000, 0)
    raw = np.fromfile(path, dtype=np.uint8)
    num_pages = too_long = 0
    for column in (0, 1):
        start, _, end = _chunk_span(path, 0, column)
        walked = pages_walk(raw, np.array([start]), np.array([end]))
        spans = np.diff(np.concatenate([[start], walked[:, 2]]))  # header and payload of each page (2: HI)
        num_pages += spans.size
        too_long += int((spans > later).sum())
    assert num_pages > 60 and too_long < num_pages
    # Read alone: each chunk's first page (where the first window is short of it) and the pages
    # no window holds; a page straddling a window's end starts the next window.
    assert len(parsed) <= too_long + 2, (len(parsed), too_long, num_pages)


def pages_walk(raw, lo, hi):
    from packer_cli.sources._parquet_pages import walk

    return walk(raw, lo, hi)


def _outcome(path) -> str:
    """What ListColumnReader makes of a file: its error, or a digest of its rows."""
    try:
        reader = ListColumnReader(str(path), ["input_ids", "loss_mask"], batch_rows=256)
        table = pa.Table.from_batches(list(reader))
    except (ValueError, pa.ArrowException, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"rows {table.num_rows}, fast {reader.fast_rows}, " + hashlib.sha256(
        b"".join(np.asarray(c.combine_chunks().values).tobytes() for c in table.columns)).hexdigest()


def test_a_damaged_header_reads_the_same_from_a_window_as_alone(tmp_path, monkeypatch):
    """Every byte of the first pages' headers of both columns, flipped three ways: the reading
    (its error, or its rows) is the same with the headers walked from windows as with every header
    parsed in Python, so the walk never reads a header other than the parser does (it leaves any
    header it does not read, damaged or odd, to the parser, which words the error)."""
    base = _one_group_file(tmp_path / "base.parquet", page_size=256, rows=600)
    raw = base.read_bytes()
    table = pages_walk(np.frombuffer(raw, np.uint8), *(np.array([x]) for x in (
        _chunk_span(base, 0, 0)[0], _chunk_span(base, 0, 0)[2])))
    header_bytes = []
    for column in (0, 1):
        start, _, end = _chunk_span(base, 0, column)
        rows = pages_walk(np.frombuffer(raw, np.uint8), np.array([start]), np.array([end]))
        heads = [start] + rows[:-1, 2].tolist()  # each header starts where the page before ends
        for page in range(min(3, rows.shape[0])):
            header_bytes += range(heads[page], int(rows[page, 1]))
    assert table.shape[0] > 3 and len(header_bytes) > 40
    compared = errors = 0
    for at in header_bytes:
        for mask in (0x01, 0x10, 0xFF):
            damaged = bytearray(raw)
            damaged[at] ^= mask
            # A fresh file each time: a page of the last one may still be decoding on a thread
            # from a mapping, which rewriting that file in place would cut (SIGBUS).
            path = tmp_path / f"damaged-{at}-{mask}.parquet"
            path.write_bytes(bytes(damaged))
            _windows(monkeypatch, 32 << 10, 256 << 10)
            windowed = _outcome(path)
            _windows(monkeypatch, 0, 0)
            alone = _outcome(path)
            assert windowed == alone, f"byte {at} ^ {mask:#x}"
            path.unlink()  # (a mapping outlives it)
            compared += 1
            errors += not windowed.startswith("rows")
    assert errors > compared // 10  # the damage was seen, not only skipped


def test_a_file_of_tiny_pages_is_handed_to_pyarrow_which_reads_them_faster(tmp_path, monkeypatch,
                                                                          synthetic_parquet):
    """Pages of fewer than TINY_PAGE_VALUES level entries on average over a column's first
    TINY_PAGES data pages: the rest of the file is pyarrow's, from the row reached (equal rows,
    equal shards); pages above it, and a mask column of few bytes but many values a page, stay
    on the fast path."""
    from conftest import DEFAULT_TINY_PAGE_VALUES
    from parquet_checks import packed_shard_digests

    from packer_cli.sources import parquet_lists
    from packer_cli.sources._parquet_pages import NUM_VALUES, PAGE_TYPE

    monkeypatch.setattr(parquet_lists, "TINY_PAGE_VALUES", DEFAULT_TINY_PAGE_VALUES)
    fields = ["input_ids", "loss_mask"]
    table = pq.read_table(synthetic_parquet)
    tiny, usual = tmp_path / "tiny.parquet", tmp_path / "usual.parquet"
    pq.write_table(table, tiny, data_page_size=1024, row_group_size=table.num_rows)
    pq.write_table(table, usual, data_page_size=64 << 10, row_group_size=table.num_rows)
    raw = np.fromfile(tiny, dtype=np.uint8)
    start, _, end = _chunk_span(tiny, 0, 0)
    walked = pages_walk(raw, np.array([start]), np.array([end]))
    data_values = walked[walked[:, PAGE_TYPE] != 2][:, NUM_VALUES]  # data pages' value counts (2: the dictionary)
    assert data_values.size > parquet_lists.TINY_PAGES and data_values.mean() < DEFAULT_TINY_PAGE_VALUES

    reader, batches = read_with_packer(tiny, fields, 256)
    assert_same_as_pyarrow(tiny, fields, batches)
    assert "values on average, which pyarrow reads faster" in reader.fallback_reason
    assert "'input_ids'" in reader.fallback_reason
    assert 0 < reader.arrow_rows and reader.fast_rows + reader.arrow_rows == table.num_rows
    reader, batches = read_with_packer(usual, fields, 256)
    assert_same_as_pyarrow(usual, fields, batches)
    assert (reader.fast_rows, reader.fallback_reason) == (table.num_rows, None)

    assert packed_shard_digests(usual, tmp_path / "usual") == packed_shard_digests(tiny, tmp_path / "tiny")


@pytest.mark.parametrize("rows", [1045, 1046])
def test_a_page_read_alone_after_a_window_is_not_read_again(tmp_path, rows):
    """A large page handed out from a window (64 KiB or more: the next page is read alone), then
    a smaller one read alone, then more pages: the window's remaining pages are behind the read.
    A review found the next call handing one of them out again: 209 rows read twice and the
    chunk's last page lost without an error (1,045 rows), or a valid file refused as holding
    more values than its chunk (1,046)."""
    v = np.repeat(np.arange(rows, dtype=np.int32)[:, None], 100, axis=1)
    v[209:418] = np.random.default_rng(0).integers(0, 2**31 - 1, (209, 100))  # one page of ~80 KB
    offsets = np.arange(0, v.size + 1, 100, dtype=np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(v.ravel()))})
    path = tmp_path / "mixed.parquet"
    pq.write_table(table, path, compression="snappy", use_dictionary=False, data_page_size=80 << 10)
    raw = np.fromfile(path, dtype=np.uint8)
    start, _, end = _chunk_span(path, 0, 0)
    sizes = np.diff(pages_walk(raw, np.array([start]), np.array([end]))[:, 1:3], axis=1).ravel()
    assert sizes.max() >= 64 << 10 and sizes.min() < 64 << 10 and sizes.size >= 4
    reader, batches = read_with_packer(path, ["input_ids"], 256)
    assert_same_as_pyarrow(path, ["input_ids"], batches)
    assert reader.fast_rows == rows


def test_the_page_walk_reads_no_header_the_parser_refuses_or_reads_otherwise():
    """Page headers of real files with one to three bytes changed, inserted or removed: where the
    compiled walk (windows, RowGroupRuns) reads a header, Python's reader reads the same fields
    and size; a review found a page-type header repeated with another wire type read by the walk
    and refused by the parser (so a damaged file read or failed as the page fitted a window)."""
    from packer_cli import _parquet_thrift as thrift
    from packer_cli.sources import _parquet_pages as pages_mod

    headers = []
    for version in ("1.0", "2.0"):
        buf = io.BytesIO()
        pq.write_table(token_table(200, seed=5), buf, data_page_version=version, data_page_size=512)
        raw = np.frombuffer(buf.getvalue(), np.uint8)
        f = pq.ParquetFile(io.BytesIO(buf.getvalue()))
        meta = f.metadata.row_group(0).column(0)
        lo = meta.dictionary_page_offset or meta.data_page_offset
        walked = pages_walk(raw, np.array([lo]), np.array([lo + meta.total_compressed_size]))
        heads = [lo] + walked[:-1, 2].tolist()
        headers += [bytes(raw[h:int(row[1])]) for h, row in zip(heads[:4], walked[:4])]
    rng = np.random.default_rng(11)
    table = np.empty((1, len(pages_mod.FIELDS)), np.int64)
    payload = bytes(4096)
    read = 0
    crafted = (b"\x15\x00\x15\x14\x15\x14\x2c\x15\x04\x15\x00\x15\x06\x15\x06\x00\x05\x0a\x00\x00",)  # field 5 twice
    mutants = list(crafted)
    for header in headers:
        for _ in range(150):
            b = bytearray(header)
            for _ in range(int(rng.integers(1, 4))):
                at = int(rng.integers(0, len(b)))
                op = rng.integers(0, 3)
                if op == 0:
                    b[at] = int(rng.integers(0, 256))
                elif op == 1:
                    b.insert(at, int(rng.integers(0, 256)))
                elif len(b) > 1:
                    del b[at]
            mutants.append(bytes(b))
    for header in mutants:
        buf = np.frombuffer(header + payload, np.uint8)
        if not pages_mod.complete_pages(buf, 0, buf.size, table):
            continue
        read += 1
        try:
            parsed = thrift.parse_page_header(header + payload)
        except thrift.ThriftError as exc:
            raise AssertionError(f"the walk read {header.hex()}, the parser refused it: {exc}") from None
        row = table[0]
        assert parsed.size == int(row[pages_mod.LO]), header.hex()
        assert parsed.compressed_size == int(row[pages_mod.HI] - row[pages_mod.LO])
        assert (parsed.page_type, parsed.uncompressed_size, parsed.num_values, parsed.encoding) == tuple(
            int(row[k]) for k in (pages_mod.PAGE_TYPE, pages_mod.UNCOMPRESSED, pages_mod.NUM_VALUES,
                                  pages_mod.ENCODING)), header.hex()
    assert read > 100
    assert not pages_mod.complete_pages(np.frombuffer(crafted[0] + payload, np.uint8), 0, 4096, table)

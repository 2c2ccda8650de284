"""packer's own reading of a Parquet footer (what the compiled decoder trusts) against pyarrow's.

Damaged footers, read by the decoders in child processes, are in
``test_parquet_decoder.py::test_damaged_footers_never_abort_or_yield_what_pyarrow_refuses``.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packer_cli._thrift import I16, I32, I64
from packer_cli.sources import _parquet_footer as footer_module
from packer_cli.sources._parquet_footer import footer_problem, read_footer
from packer_cli.sources.parquet_lists import ListColumnReader
from test_parquet_decoder import _field, _footer_of, _set, _with_footer


def _table(rng, rows: int) -> pa.Table:
    lengths = rng.integers(0, 300, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(offsets, rng.integers(0, 100_000, int(offsets[-1])).astype(np.int64))
    mask = pa.ListArray.from_arrays(offsets, rng.integers(0, 2, int(offsets[-1])).astype(np.int8))
    return pa.table({"name": pa.array([f"r{i}" for i in range(rows)]), "input_ids": ids, "loss_mask": mask})


def _read(path):
    pf = pq.ParquetFile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        return pf, read_footer(fd, os.fstat(fd).st_size, pf.metadata.num_row_groups, pf.metadata.num_columns)
    finally:
        os.close(fd)


@pytest.mark.parametrize("options", [
    dict(compression="snappy"),
    dict(compression="zstd", use_dictionary=False, write_statistics=False),
    dict(compression="gzip", data_page_version="2.0", row_group_size=7),
    dict(compression="none", write_page_index=True, row_group_size=1),
    dict(compression={"name": "zstd", "input_ids": "snappy", "loss_mask": "none"}, version="1.0", row_group_size=50),
], ids=["snappy", "zstd-plain", "gzip-v2", "page-index", "mixed"])
def test_footer_read_as_pyarrow_reads_it(tmp_path, options):
    """Row counts, and every column chunk's codec, value count and byte span, as pyarrow states
    them; a healthy file gives the decoder nothing to distrust."""
    path = tmp_path / "t.parquet"
    pq.write_table(_table(np.random.default_rng(3), 120), path, **options)
    pf, footer = _read(path)
    meta = pf.metadata
    assert footer is not None and footer.num_rows == meta.num_rows == 120
    assert footer.group_rows.tolist() == [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            theirs = meta.row_group(g).column(c)
            start = theirs.data_page_offset
            if theirs.has_dictionary_page and 0 < theirs.dictionary_page_offset < start:
                start = theirs.dictionary_page_offset
            ours = footer.chunk(g, c)
            assert (ours.codec, ours.num_values, ours.start, ours.end) == (
                theirs.compression, theirs.num_values, start, start + theirs.total_compressed_size), (g, c)
    leaves = {1: ("INT64", 1, 3), 2: ("INT32", 1, 3)}
    assert footer_problem(footer, leaves) is None


def _damaged(footer, column, value, row=0):
    chunks = footer.chunks.copy()
    group_rows = footer.group_rows.copy()
    if column == "group_rows" and isinstance(value, list):
        group_rows[:] = value
    elif column == "group_rows":
        group_rows[row] = value
    else:
        chunks[row, column] = value
    return type(footer)(footer.num_rows, group_rows, chunks, footer.columns)


@pytest.mark.parametrize("column,value,says,damaged", [
    ("group_rows", -9, "row counts are negative", True),
    ("group_rows", [-1, 121], "row counts are negative", True),
    ("group_rows", 61, "do not add up", True),
    (footer_module.TYPE, 5, "do not all state its schema's type INT64", True),
    (footer_module.CODEC, 22, "unknown codec", True),
    (footer_module.DEF_HISTOGRAM, 3, "histograms of the wrong length", True),
    (footer_module.REP_HISTOGRAM, 9, "histograms of the wrong length", True),
    (footer_module.COMPRESSED, -1, "negative size or offset", True),
    (footer_module.DATA_OFFSET, -4, "negative size or offset", True),
    (footer_module.FILE_PATH, 5, "another file", False),
    (footer_module.FILE_PATH, 1, "another file", False),
])
def test_footer_problems_named(tmp_path, column, value, says, damaged):
    """What the decoder will not read by: each damage alone (the ids column's first chunk, or the
    first row group's count) is named, and is damage (an error) but for a chunk in another file
    (left to pyarrow); the same in a column the caller does not read (the names, leaf 0) does
    not matter, but row counts always do. A negative count is damage even where the counts add
    up to the file's (-1 and 121 for 60 and 60 passed when only the sum was checked), and a
    path one byte long is another file (only paths of 2 bytes or more were once)."""
    path = tmp_path / "t.parquet"
    pq.write_table(_table(np.random.default_rng(4), 120), path, row_group_size=60)
    _, footer = _read(path)
    leaves = {1: ("INT64", 1, 3)}
    row = 1  # the first row group's ids chunk (leaf 1)
    if column == "group_rows":
        row = 0
    problem = footer_problem(_damaged(footer, column, value, row), leaves)
    assert problem is not None and says in problem.reason and problem.damaged == damaged, problem
    if column != "group_rows":
        assert footer_problem(_damaged(footer, column, value, 0), leaves) is None


def _footer_edited(path, edit):
    raw = path.read_bytes()
    footer, footer_at = _footer_of(raw)
    edit(footer)
    path.write_bytes(_with_footer(raw, footer_at, footer))


def test_row_groups_of_other_column_counts_are_not_read(tmp_path):
    """Two row groups of three column chunks rewritten as four and two: the counts multiply to
    pyarrow's six, but the walk does not read the footer (None: pyarrow names the row group
    short of columns). Numbering each group's chunks without checking them against the schema
    took that footer, and the file was refused as one whose chunks do not state their column's
    type."""
    path = tmp_path / "t.parquet"
    pq.write_table(_table(np.random.default_rng(6), 120), path, row_group_size=60)

    def move_a_chunk(footer):
        first, second = _field(footer, 4)[1]
        _field(first, 1)[1].append(_field(second, 1)[1].pop(0))

    _footer_edited(path, move_a_chunk)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_footer(fd, os.fstat(fd).st_size, 2, 3) is None
    finally:
        os.close(fd)


def test_no_footer_is_a_problem_not_an_error(tmp_path):
    """A footer the walk does not read (here the magic of an encrypted one) is left to pyarrow."""
    path = tmp_path / "t.parquet"
    pq.write_table(_table(np.random.default_rng(5), 10), path)
    raw = bytearray(path.read_bytes())
    raw[-4:] = b"PARE"
    path.write_bytes(bytes(raw))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_footer(fd, len(raw), 1, 3) is None
        assert read_footer(fd, len(raw), 2, 3) is None  # and counts other than pyarrow's
    finally:
        os.close(fd)
    problem = footer_problem(None, {})
    assert "not one the compiled decoder reads" in problem.reason and not problem.damaged


def test_encrypted_chunks_are_left_to_pyarrow(tmp_path):
    """Columns encrypted under a plaintext footer: the walk reads the footer, notes the chunks'
    crypto metadata, and leaves the file to pyarrow, whose error says it cannot decrypt them
    (packer read the encrypted bytes as pages: 'page header: missing or invalid page type')."""
    import base64

    encryption = pytest.importorskip("pyarrow.parquet.encryption")

    class Kms(encryption.KmsClient):
        def __init__(self, config):
            super().__init__()

        def wrap_key(self, key, master_key_identifier):
            return base64.b64encode(key)

        def unwrap_key(self, wrapped_key, master_key_identifier):
            return base64.b64decode(wrapped_key)

    config = encryption.EncryptionConfiguration(footer_key="f", column_keys={"k": ["input_ids"]},
                                                plaintext_footer=True, double_wrapping=False)
    properties = encryption.CryptoFactory(Kms).file_encryption_properties(encryption.KmsConnectionConfig(), config)
    table = pa.table({"input_ids": pa.array([[1, 2, 3, 4]] * 20, pa.list_(pa.int32())),
                      "loss_mask": pa.array([[0, 1, 1, 1]] * 20, pa.list_(pa.int8()))})
    path = tmp_path / "encrypted.parquet"
    try:
        pq.write_table(table, path, encryption_properties=properties)
    except OSError as exc:  # pyarrow 14: "Encrypted column input_ids not in file schema"
        pytest.skip(f"pyarrow {pa.__version__} cannot write this file: {exc}")
    _, footer = _read(path)
    assert footer is not None and footer.chunks[:, footer_module.ENCRYPTED].tolist() == [1, -1]
    problem = footer_problem(footer, {0: ("INT32", 1, 3)})
    assert problem is not None and "encrypted" in problem.reason and not problem.damaged
    assert footer_problem(footer, {1: ("INT32", 1, 3)}) is None  # the plaintext column alone is read
    with pytest.raises((OSError, pa.ArrowException)) as theirs:
        pq.read_table(path)
    with pytest.raises(ValueError) as ours:
        list(ListColumnReader(str(path), ["input_ids", "loss_mask"]))
    assert str(ours.value) == f"row group 0: {str(theirs.value).strip()}" and "decrypt" in str(ours.value)


def _retyped_footer(path, out, where, kind):
    """``path`` with one integer field of its footer given wire type ``kind`` (same varint)."""
    raw = path.read_bytes()
    footer, footer_at = _footer_of(raw)
    group = _field(footer, 4)[1][0]
    fields, field_id = {"file num_rows": (footer, 3), "group num_rows": (group, 3)}.get(where) or (
        _field(_field(group, 1)[1][0], 3), int(where.split()[-1]))
    _set(fields, field_id, kind=kind)
    out.write_bytes(_with_footer(raw, footer_at, footer))
    return out


@pytest.mark.parametrize("where,kind", [
    ("file num_rows", I32), ("group num_rows", I32), ("chunk meta 1", I64), ("chunk meta 4", I16),
    ("chunk meta 5", I32), ("chunk meta 7", I32), ("chunk meta 9", I32), ("chunk meta 11", I32),
], ids=["file-rows", "group-rows", "type", "codec", "values", "size", "data-offset", "dictionary-offset"])
def test_footer_integers_of_another_wire_type_are_not_read(tmp_path, where, kind):
    """An integer footer field of another wire type than parquet.thrift declares (i64 row counts,
    sizes and offsets; i32 type and codec), the same varint: Apache Thrift, pyarrow's reader,
    skips such a field. Without a required one pyarrow refuses the file; without the optional
    dictionary page offset it reads the chunk from its data page, which here fails. The walk
    read them all as if well typed (a file pyarrow refuses, read); now it does not read such a
    footer, and the file is pyarrow's to judge."""
    base = tmp_path / "t.parquet"
    rows = [[i % 3, 7, i] for i in range(30)]
    pq.write_table(pa.table({"x": pa.array(rows, pa.list_(pa.int32()))}), base, row_group_size=10,
                   compression="none")
    path = _retyped_footer(base, tmp_path / "retyped.parquet", where, kind)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_footer(fd, os.fstat(fd).st_size, 3, 1) is None
    finally:
        os.close(fd)
    with pytest.raises((OSError, pa.ArrowException)):
        pq.read_table(path)
    with pytest.raises((OSError, pa.ArrowException, ValueError)):
        list(ListColumnReader(str(path), ["x"]))

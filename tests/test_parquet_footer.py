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

from packer_cli.sources import _parquet_footer as footer_module
from packer_cli.sources._parquet_footer import footer_problem, read_footer


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
    if column == "group_rows":
        group_rows[row] = value
    else:
        chunks[row, column] = value
    return type(footer)(footer.num_rows, group_rows, chunks, footer.columns)


@pytest.mark.parametrize("column,value,says,damaged", [
    ("group_rows", -9, "row counts are negative", True),
    ("group_rows", 61, "do not add up", True),
    (footer_module.TYPE, 5, "do not all state its schema's type INT64", True),
    (footer_module.CODEC, 22, "unknown codec", True),
    (footer_module.DEF_HISTOGRAM, 3, "histograms of the wrong length", True),
    (footer_module.REP_HISTOGRAM, 9, "histograms of the wrong length", True),
    (footer_module.COMPRESSED, -1, "negative size or offset", True),
    (footer_module.DATA_OFFSET, -4, "negative size or offset", True),
    (footer_module.FILE_PATH, 5, "another file", False),
])
def test_footer_problems_named(tmp_path, column, value, says, damaged):
    """What the decoder will not read by: each damage alone (the ids column's first chunk, or the
    first row group's count) is named, and is damage (an error) but for a chunk in another file
    (left to pyarrow); the same in a column the caller does not read (the names, leaf 0) does
    not matter, but row counts always do."""
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

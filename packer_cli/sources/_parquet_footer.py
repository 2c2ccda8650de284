"""What the compiled decoder needs of a Parquet footer, read by packer itself and checked first.

pyarrow parses the footer when a file is opened, but some of its per-column-chunk accessors
(``RowGroupMetaData.column(i)``, ``ColumnChunkMetaData.compression``) throw C++ exceptions that
Python cannot catch: a codec number the library does not know, or a level histogram of the
wrong length, ends the process with SIGABRT. And nothing in pyarrow checks a row group's row
count before a compiled kernel would size its arrays by it. So the decoder never asks pyarrow
for a column chunk: :func:`read_footer` walks the footer's row groups and column chunks with
the compiled compact-protocol reader of :mod:`~packer_cli.sources._parquet_pages` (every read
bounds-checked) into two tables, and :func:`footer_problem` says what in them the decoder will
not trust: a footer that contradicts itself or the schema is an error (pyarrow's reader does
not always notice), one the walk does not read, or whose chunks are encrypted, is left to pyarrow.

FileMetaData field ids (parquet.thrift): 3 num_rows, 4 row_groups; RowGroup: 1 columns,
3 num_rows; ColumnChunk: 1 file_path, 3 meta_data, 8 crypto_metadata, 9 encrypted_column_metadata;
ColumnMetaData: 1 type, 4 codec, 5 num_values, 7 total_compressed_size, 9 data_page_offset,
11 dictionary_page_offset, 16 size_statistics (SizeStatistics: 2 repetition_level_histogram,
3 definition_level_histogram). An integer field of another wire type than parquet.thrift's
makes the footer one the walk does not read (Apache Thrift, pyarrow's reader, skips such a
field: pyarrow then refuses the file for a required one, and reads without an optional one).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from packer_cli._kernel_cache import njit
from packer_cli.sources._parquet_pages import _I32, _I64, _field_head, _int_field, _skip, _varint, int_field_into

_LIST, _STRUCT, _BINARY = 9, 12, 8

#: One row per column chunk, in footer order (-1 where the footer has no such field).
CHUNK_FIELDS = ("group", "column", "type", "codec", "num_values", "compressed_size", "data_page_offset",
                "dictionary_page_offset", "file_path", "rep_histogram", "def_histogram", "encrypted")
# (file_path holds the path's length in bytes; the histograms their number of entries; encrypted
# is 1 where the chunk has crypto metadata or encrypted column metadata.)
(GROUP, COLUMN, TYPE, CODEC, NUM_VALUES, COMPRESSED, DATA_OFFSET, DICT_OFFSET, FILE_PATH, REP_HISTOGRAM,
 DEF_HISTOGRAM, ENCRYPTED) = range(len(CHUNK_FIELDS))

#: Parquet's physical types and codecs by number, as pyarrow names them.
PHYSICAL_TYPES = {0: "BOOLEAN", 1: "INT32", 2: "INT64", 3: "INT96", 4: "FLOAT", 5: "DOUBLE", 6: "BYTE_ARRAY",
                  7: "FIXED_LEN_BYTE_ARRAY"}
CODECS = {0: "UNCOMPRESSED", 1: "SNAPPY", 2: "GZIP", 3: "LZO", 4: "BROTLI", 5: "LZ4", 6: "ZSTD", 7: "LZ4_RAW"}

ODD = -1  # the walk does not read this footer (or it runs past its bytes)
_MAGIC = b"PAR1"


@njit(cache=True, nogil=True)
def _list_head(buf, pos, hi):
    """(element count, element type, position after the list header), or (-1, -1, -1)."""
    if pos >= hi:
        return np.int64(-1), np.int64(-1), np.int64(-1)
    head = np.int64(buf[pos])
    pos += 1
    size = head >> 4
    if size == 15:
        size, pos = _varint(buf, pos, hi)
        if size < 0:
            return np.int64(-1), np.int64(-1), np.int64(-1)
    return size, head & 0x0F, pos


@njit(cache=True, nogil=True)
def _size_statistics(buf, pos, hi, row):
    """Note the lengths of a SizeStatistics' level histograms in ``row``; position after it, or -1."""
    last = np.int64(0)
    while True:
        fid, kind, pos = _field_head(buf, pos, hi, last)
        if pos < 0:
            return -1
        if kind == 0:
            return pos
        if (fid == 2 or fid == 3) and kind == _LIST:
            size, _, after = _list_head(buf, pos, hi)
            if after < 0:
                return -1
            row[REP_HISTOGRAM if fid == 2 else DEF_HISTOGRAM] = size
        pos = _skip(buf, pos, hi, kind)
        if pos < 0:
            return -1
        last = fid


_META_FIELDS = np.array([1, 4, 5, 7, 9, 11], dtype=np.int64)
_META_COLUMNS = np.array([TYPE, CODEC, NUM_VALUES, COMPRESSED, DATA_OFFSET, DICT_OFFSET], dtype=np.int64)
_META_KINDS = np.array([_I32, _I32, _I64, _I64, _I64, _I64], dtype=np.int64)  # type and codec are enums: i32


@njit(cache=True, nogil=True)
def _column_meta(buf, pos, hi, row):
    """Read a ColumnMetaData into ``row``; the position after it, or -1."""
    last = np.int64(0)
    while True:
        fid, kind, pos = _field_head(buf, pos, hi, last)
        if pos < 0:
            return -1
        if kind == 0:
            return pos
        known, pos = int_field_into(buf, pos, hi, kind, fid, row, _META_FIELDS, _META_KINDS, _META_COLUMNS)
        if not known and pos >= 0:
            if fid == 16 and kind == _STRUCT:
                pos = _size_statistics(buf, pos, hi, row)
            else:
                pos = _skip(buf, pos, hi, kind)
        if pos < 0:
            return -1
        last = fid


@njit(cache=True, nogil=True)
def _column_chunk(buf, pos, hi, row):
    """Read a ColumnChunk (its file_path and meta_data, whether it is encrypted) into ``row``; the
    position after it, or -1."""
    last = np.int64(0)
    while True:
        fid, kind, pos = _field_head(buf, pos, hi, last)
        if pos < 0:
            return -1
        if kind == 0:
            return pos
        if fid == 1 and kind == _BINARY:
            size, _ = _varint(buf, pos, hi)
            row[FILE_PATH] = size  # some writers store an empty path for "this file"
        if fid == 8 or fid == 9:  # its pages are encrypted (the footer may be plaintext all the same)
            row[ENCRYPTED] = 1
        if fid == 3 and kind == _STRUCT:
            pos = _column_meta(buf, pos, hi, row)
        else:
            pos = _skip(buf, pos, hi, kind)
        if pos < 0:
            return -1
        last = fid


@njit(cache=True, nogil=True)
def _row_group(buf, pos, hi, g, group_rows, chunks, n):
    """Read RowGroup ``g``: its row count into ``group_rows[g]``, its column chunks into
    ``chunks[n:]``. Returns (position after it, chunks read so far), position -1 when odd."""
    last = np.int64(0)
    while True:
        fid, kind, pos = _field_head(buf, pos, hi, last)
        if pos < 0:
            return np.int64(-1), n
        if kind == 0:
            return pos, n
        if fid == 1 and kind == _LIST:
            size, element, pos = _list_head(buf, pos, hi)
            if pos < 0 or element != _STRUCT or size > chunks.shape[0] - n:
                return np.int64(-1), n
            for c in range(size):
                row = chunks[n]
                row[:] = -1
                row[GROUP] = g
                row[COLUMN] = c
                pos = _column_chunk(buf, pos, hi, row)
                if pos < 0:
                    return np.int64(-1), n
                n += 1
        elif fid == 3:
            value, pos = _int_field(buf, pos, hi, kind, _I64)
            if pos < 0:
                return np.int64(-1), n
            group_rows[g] = value
        else:
            pos = _skip(buf, pos, hi, kind)
            if pos < 0:
                return np.int64(-1), n
        last = fid


@njit(cache=True, nogil=True)
def footer_tables(buf, group_rows, chunks, totals):
    """Walk the FileMetaData in ``buf``: each row group's row count into ``group_rows`` (-1 when
    it has none), one row of :data:`CHUNK_FIELDS` per column chunk into ``chunks``, the file's
    row count and row groups into ``totals``. Returns the number of chunks, or :data:`ODD`
    (including more row groups or chunks than the tables have room for)."""
    pos = np.int64(0)
    hi = np.int64(buf.size)
    last = np.int64(0)
    n = np.int64(0)
    totals[:] = -1
    while True:
        fid, kind, pos = _field_head(buf, pos, hi, last)
        if pos < 0:
            return ODD
        if kind == 0:
            return n
        if fid == 3:
            value, pos = _int_field(buf, pos, hi, kind, _I64)
            if pos < 0:
                return ODD
            totals[0] = value
        elif fid == 4 and kind == _LIST:
            size, element, pos = _list_head(buf, pos, hi)
            if pos < 0 or element != _STRUCT or size > group_rows.size:
                return ODD
            totals[1] = size
            for g in range(size):
                group_rows[g] = -1
                pos, n = _row_group(buf, pos, hi, g, group_rows, chunks, n)
                if pos < 0:
                    return ODD
        else:
            pos = _skip(buf, pos, hi, kind)
            if pos < 0:
                return ODD
        last = fid


@dataclass(frozen=True)
class ChunkMeta:
    """What the decoder reads of one column chunk: its codec (pyarrow's name), its level
    entries, and the file's bytes ``[start, end)`` holding its pages (dictionary first)."""

    codec: str
    num_values: int
    start: int
    end: int


@dataclass(frozen=True)
class Footer:
    """A file's row groups and column chunks as its footer states them."""

    num_rows: int
    group_rows: np.ndarray  # int64, one per row group
    chunks: np.ndarray  # int64 rows of CHUNK_FIELDS, row group by row group
    columns: int  # column chunks per row group

    def group_values(self, columns: list[int]) -> np.ndarray:
        """Each row group's largest level-entry count among ``columns`` (int64, one per group)."""
        if not columns or self.group_rows.size == 0:
            return np.zeros(self.group_rows.size, np.int64)
        counts = self.chunks[:, NUM_VALUES].reshape(self.group_rows.size, self.columns)
        return counts[:, columns].max(axis=1)

    def chunk(self, group: int, column: int) -> ChunkMeta:
        row = self.chunks[group * self.columns + column]
        start, dictionary = int(row[DATA_OFFSET]), int(row[DICT_OFFSET])
        if 0 < dictionary < start:
            start = dictionary
        return ChunkMeta(CODECS[int(row[CODEC])], int(row[NUM_VALUES]), start, start + int(row[COMPRESSED]))


def read_footer(fd: int, file_size: int, groups: int, columns: int) -> Footer | None:
    """The footer of the file open as ``fd``, which pyarrow opened as ``groups`` row groups of
    ``columns`` column chunks each; None where the walk does not read it (an encrypted footer,
    a layout it does not know, or other counts than pyarrow's)."""
    if file_size < 12:
        return None
    tail = os.pread(fd, 8, file_size - 8)
    size = int.from_bytes(tail[:4], "little")
    if tail[4:] != _MAGIC or size > file_size - 12:
        return None
    buf = np.frombuffer(os.pread(fd, size, file_size - 8 - size), dtype=np.uint8)
    if buf.size != size:
        return None
    group_rows = np.empty(groups, dtype=np.int64)
    chunks = np.empty((groups * columns, len(CHUNK_FIELDS)), dtype=np.int64)
    totals = np.empty(2, dtype=np.int64)
    n = footer_tables(buf, group_rows, chunks, totals)
    if n != groups * columns or totals[1] != groups:
        return None
    if groups and (chunks[:, COLUMN].reshape(groups, columns) != np.arange(columns)).any():
        return None
    return Footer(int(totals[0]), group_rows, chunks, columns)


@dataclass(frozen=True)
class FooterProblem:
    """Why the decoder does not read a file by its footer. ``damaged``: the footer contradicts
    itself or the schema (an error: pyarrow's reader does not always notice, e.g. pyarrow 14
    reads a row group's stated row count and stops, so the file would read short); else a
    footer the decoder leaves to pyarrow."""

    reason: str
    damaged: bool


def footer_problem(footer: Footer | None, leaves: dict[int, tuple[str, int, int]]) -> FooterProblem | None:
    """Why the decoder should not read a file by ``footer``, or None. ``leaves`` maps each column
    it reads to (physical type name, max repetition level, max definition level). Row counts
    that contradict each other are damage whatever the columns (and first: damage is an error
    even where pyarrow would have read the file)."""
    if footer is None:
        return FooterProblem("its footer is not one the compiled decoder reads", damaged=False)
    rows = footer.group_rows
    if (rows < 0).any() or int(rows.sum()) != footer.num_rows:
        return FooterProblem("its row groups' row counts are negative or do not add up to the file's", damaged=True)
    picked = footer.chunks[np.isin(footer.chunks[:, COLUMN], list(leaves))]
    if (picked[:, ENCRYPTED] > 0).any():  # pyarrow says what it needs to decrypt them
        return FooterProblem("a column chunk is encrypted", damaged=False)
    if (picked[:, FILE_PATH] > 0).any():
        return FooterProblem("a column chunk lies in another file", damaged=False)
    reason = _contradiction(picked, leaves)
    return FooterProblem(reason, damaged=True) if reason else None


def _contradiction(picked: np.ndarray, leaves: dict[int, tuple[str, int, int]]) -> str | None:
    for leaf, (physical, max_rep, max_def) in leaves.items():
        mine = picked[picked[:, COLUMN] == leaf]
        if (mine[:, TYPE] != _type_number(physical)).any():
            return f"column {leaf}'s chunks do not all state its schema's type {physical}"
        for column, levels in ((REP_HISTOGRAM, max_rep), (DEF_HISTOGRAM, max_def)):
            lengths = mine[:, column]  # -1: none; pyarrow writes an empty one for a level always 0
            if ((lengths != -1) & (lengths != levels + 1) & ((lengths != 0) | (levels != 0))).any():
                return f"column {leaf}'s chunks hold level histograms of the wrong length"
    if not np.isin(picked[:, CODEC], list(CODECS)).all():
        return "a column chunk names an unknown codec"
    # (A chunk without values may state a data page offset of 0: pyarrow writes one.)
    if ((picked[:, NUM_VALUES] < 0) | (picked[:, COMPRESSED] < 0) | (picked[:, DATA_OFFSET] < 0)).any():
        return "a column chunk has a negative size or offset"
    return None


def _type_number(physical: str) -> int:
    return next(k for k, name in PHYSICAL_TYPES.items() if name == physical)

"""A compiled Parquet decoder for the columns packer reads: lists of integers.

Tokenized SFT data is one or two ``list<int>`` columns (``input_ids``, ``loss_mask``/``labels``),
and decoding them is most of what ``packer pack`` spends on a Parquet input. pyarrow's general
decoder walks the repetition and definition levels value by value; here they are decoded run by
run (a row of 500 tokens is typically one run of repetition level 1), so the work per token is
the dictionary lookup or the plain copy, in compiled code without the GIL.

:class:`ListColumnReader` yields record batches equal to what pyarrow reads. It decodes itself
what it fully understands — ``list``/``large_list`` of integers without nulls, data pages v1 and
v2, PLAIN, BYTE_STREAM_SPLIT, DELTA_BINARY_PACKED and dictionary encodings, uncompressed,
Snappy, Zstandard, gzip or LZ4_RAW pages — and hands
the rest of the file to pyarrow the moment anything else appears (a null, another encoding or
codec, another type) or its pages prove too small to pay (``TINY_PAGE_VALUES``), so the output
never depends on which decoder ran. Corrupt pages raise
:class:`ValueError` naming the row group and column; nothing is read out of bounds. The footer's
row counts are checked before either decoder is chosen, and where pyarrow decodes, the rows it
reads of each row group are counted against them (:meth:`ListColumnReader._arrow_group`).

:class:`RowGroupRuns` reads runs of consecutive row groups whole, for files of many small groups
(Megatron-Bridge's, which the audit reads): one compiled walk over the run's page headers
(:mod:`._parquet_pages`), then the pages (data pages v1 of PLAIN or BYTE_STREAM_SPLIT values,
as packer writes Bridge's files) decoded chunk by chunk on two threads straight into one array per column. A run
with anything else in it (dictionary pages, data pages v2, empty lists) is read by the
page-at-a-time cursors.

Set ``PACKER_PARQUET_DECODER=arrow`` to use pyarrow throughout.

Two known differences from pyarrow, both on files pyarrow itself mishandles: pyarrow's writer
can put an empty data page first in a chunk (one-row row groups with ``data_page_size=1`` and
dictionary encoding), and pyarrow then reads those rows as absent although the footer counts
them; this decoder returns them (where pyarrow decodes such a file, e.g. with
``PACKER_PARQUET_DECODER=arrow``, its rows fall short of the footer's: an error). And where
pyarrow takes over on a damaged file, the result is what its ``iter_batches`` returns, which on
some damaged files differs from ``read_table``.
"""
from __future__ import annotations

import functools
import mmap
import os
import threading
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packer_cli import _parquet_thrift as thrift
from packer_cli._arrow import from_numpy, memory_pool, numpy_dtype, to_numpy, unpack_bits
from packer_cli.errors import env_choice
from packer_cli.sources import _parquet_pages as pages
from packer_cli.sources._parquet_footer import ChunkMeta, Footer, footer_problem, read_footer
from packer_cli.sources._parquet_delta import delta_decode
from packer_cli.sources._parquet_kernels import (EMPTY_CONTINUES, EMPTY_HAS_VALUES, LEVEL_ABOVE_MAX, MESSAGES, NULLS,
                                                 TRUNCATED, UNUSUAL, dictionary_decode, hybrid_decode,
                                                 level_checks, levels_all_equal, repetition_rows,
                                                 row_lengths, usual_page_rows)
from packer_cli.sources._parquet_lz4 import MAX_EXTRA, MAX_RATIO, MESSAGES as LZ4_MESSAGES, lz4_block_decode

ENV_DECODER = "PACKER_PARQUET_DECODER"
DECODERS = ("packer", "arrow")  # the first is the default
PARQUET_BUFFER = 4 << 20  # pyarrow's page-stream read size when it decodes
PAGES_AHEAD = 3  # pages of each column decoding ahead of the rows taken...
AHEAD_BYTES = 32 << 20  # ...unless they already hold this many values' bytes (files of huge pages)
SLAB_BYTES = 16 << 20  # consecutive pages decode into one array of up to this size (see _ColumnCursor)
#: Consecutive row groups are read as one run until a run holds this many batches' rows. A
#: run of groups smaller than a batch is decoded whole by :class:`RowGroupRuns` (one compiled
#: walk of its page headers, one read, the next run decoding meanwhile), larger groups by a
#: cursor a column, page by page: a file of 10-row groups, read a group at a time, paid a
#: cursor, threads' work and a short batch every 10 rows (7-12 M tokens/s against ~60 M).
RUN_BATCHES = 4
#: ...and until a column holds this many values: a run decoded whole is in memory at once (and
#: the next one decoding), so rows of long samples must close it sooner (16 MiB of int32 ids).
RUN_VALUES = 4 << 20
#: Values a batch holds at most in a column (one long row alone may pass it): rows of long samples
#: close it before ``batch_rows``. 2,048 rows of 100k tokens in one row group were one batch of
#: 200M tokens, 1.9 GB at the peak.
BATCH_VALUES = 4 << 20
#: The codecs decompressed here. pyarrow decompresses the others: legacy LZ4 (Hadoop's framing
#: or a bare block, which pyarrow tells apart by trying), BROTLI and LZO.
_CODECS = ("UNCOMPRESSED", "SNAPPY", "ZSTD", "GZIP", "LZ4_RAW")
_MAP_PAYLOAD = 256 << 10  # page payloads this large are mapped, smaller ones read
SMALL_PAGE = 32 << 10  # page payloads smaller than this decode on the reading thread...
SMALL_PAGE_VALUES = 1 << 16  # ...unless they hold more level entries than this
#: A page is decoded whole, into room for the level entries its header states: a page stating
#: more than this (64 MiB of int32 values) goes to pyarrow, which streams within a page. Writers
#: close pages at about 1 MiB (pyarrow's hold up to ~4M entries of a run-length-encoded mask);
#: 3.6 KB of runs stated 2^29 tokens and took 2.4 GB, a corrupt header 8 GiB before its data.
LARGE_PAGE_VALUES = 1 << 24
#: A column whose first TINY_PAGES data pages (in a run of row groups the page cursors read)
#: hold fewer than TINY_PAGE_VALUES level entries on average hands the rest of the file to
#: pyarrow: each page costs this decoder some 20 us of Python, and pyarrow reads such pages
#: faster (`pack` of the benchmark's 100k samples in pages of 1,379 ids: 2.2-3.4 s against
#: 1.5-2.0 s; of 2,308: 1.9-2.5 s against 1.7-1.9 s; of 4,004: alike).
TINY_PAGES = 64
TINY_PAGE_VALUES = 3072


class _Unsupported(Exception):
    """Something the compiled decoder does not handle: pyarrow takes over from here."""


class _Corrupt(ValueError):
    chunk = 0  # which of a cursor's chunks (a run's row groups, from its first) it was found in


@dataclass(frozen=True)
class _ColumnLayout:
    """How one requested ``list<int>`` field is stored: its leaf column and its levels."""

    name: str
    leaf: int
    arrow_type: pa.DataType  # the list type pyarrow reads (field names and nullability kept)
    value_dtype: np.dtype  # NumPy dtype of the list values
    physical_dtype: np.dtype  # how the values are stored: <i4 or <i8
    max_def: int  # definition level of a present value
    empty_def: int  # definition level of an empty list


def _leaf_count(t: pa.DataType) -> int:
    if pa.types.is_struct(t):
        return sum(_leaf_count(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _leaf_count(t.key_type) + _leaf_count(t.item_type)
    if _is_list(t):
        return _leaf_count(t.value_type)
    return 1


def _first_leaves(pf: pq.ParquetFile) -> dict[str, int] | None:
    """Each field's first leaf column, or None where the schema does not map one-to-one onto the
    file's columns."""
    arrow = pf.schema_arrow
    first_leaf, leaf = {}, 0
    for f in arrow:
        first_leaf[f.name] = leaf
        leaf += _leaf_count(f.type)
    if leaf != len(pf.schema) or len(set(arrow.names)) != len(arrow.names):
        return None
    return first_leaf


def _column_layouts(pf: pq.ParquetFile, fields: list[str]) -> list[_ColumnLayout]:
    """The layout of every requested field, or :class:`_Unsupported` saying why one is not ours."""
    arrow = pf.schema_arrow
    first_leaf = _first_leaves(pf)
    if first_leaf is None:
        raise _Unsupported("the file's schema does not map one-to-one onto its columns")
    layouts = []
    for name in fields:
        f = arrow.field(name)
        t = f.type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_integer(t.value_type):
            raise _Unsupported(f"field '{name}' is {t}, not a list of integers")
        column = pf.schema.column(first_leaf[name])
        element_nullable = t.value_field.nullable
        max_def = int(f.nullable) + 1 + int(element_nullable)
        if (column.max_repetition_level != 1 or column.max_definition_level != max_def
                or column.physical_type not in ("INT32", "INT64")):
            raise _Unsupported(f"field '{name}' is stored in a layout the compiled decoder does not read")
        layouts.append(_ColumnLayout(
            name=name, leaf=first_leaf[name], arrow_type=t, value_dtype=numpy_dtype(t.value_type),
            physical_dtype=np.dtype("<i4" if column.physical_type == "INT32" else "<i8"),
            max_def=max_def, empty_def=max_def - 1 - int(element_nullable)))
    return layouts


# --- pages --------------------------------------------------------------------------------------

def _snappy_length(data: bytes) -> int:
    """The uncompressed length a Snappy stream declares (its leading varint)."""
    result = shift = 0
    for byte in data[:5]:
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result
        shift += 7
    return -1


_SNAPPY: list = []
_THREAD = threading.local()


def _zstd():
    """This thread's Zstandard decompressor (one may not be used by two threads at once, and
    making one per page costs as much as decompressing a small page)."""
    try:
        return _THREAD.zstd
    except AttributeError:
        import zstandard

        _THREAD.zstd = zstandard.ZstdDecompressor()
        return _THREAD.zstd


def _decompress(codec: str, data: bytes, size: int) -> bytes | pa.Buffer:
    """Decompress one page, checking that it yields exactly ``size`` bytes."""
    if size < 0:
        raise _Corrupt("page sizes are inconsistent")
    if size == 0 and len(data) == 0:  # an empty section (a v2 page of empty lists has no values): pyarrow reads it
        return b""
    try:
        if codec == "UNCOMPRESSED":
            if len(data) != size:  # pyarrow trusts the stored bytes over the header: let it judge
                raise _Unsupported("an uncompressed page's sizes disagree")
            out = data
        elif codec == "SNAPPY":
            # pyarrow returns a buffer of the size asked for whatever the stream holds; Snappy
            # states its length up front and checks it, so compare that first.
            if _snappy_length(data) != size:
                raise _Corrupt("page does not decompress to its stated size")
            if not _SNAPPY:
                _SNAPPY.append(pa.Codec("snappy"))
            out = _SNAPPY[0].decompress(data, decompressed_size=size, memory_pool=memory_pool())
        elif codec == "ZSTD":
            out = _unzstd(data, size)
        elif codec == "LZ4_RAW":
            out = _unlz4(data, size)
        else:  # GZIP: zlib or gzip framing
            out = _gunzip(data, size)
    except (_Corrupt, _Unsupported):
        raise
    except Exception as exc:  # each codec library raises its own error types
        raise _Corrupt(f"page does not decompress ({codec.lower()}: {exc})") from None
    if len(out) != size:
        raise _Corrupt("page does not decompress to its stated size")
    return out


def _unzstd(data, size: int) -> bytes:
    """A page of one Zstandard frame with nothing after it, as writers compress pages. pyarrow
    also reads frames back to back (and skippable ones), which zstandard's one-shot call does
    not: a page that is not one whole frame, damaged ones included, is pyarrow's to judge."""
    try:
        return _zstd().decompress(data, max_output_size=size, allow_extra_data=False)
    except Exception as exc:  # zstandard.ZstdError
        raise _Unsupported(f"a Zstandard page that is not one whole frame ({exc})") from None


def _unlz4(data, size: int) -> pa.Buffer:
    """An LZ4_RAW page: one LZ4 block, decoded by :func:`lz4_block_decode` into exactly ``size``
    bytes. (pyarrow's ``Codec.decompress`` returns the size asked for whatever the block
    produced: a short or damaged block would read as data with garbage after it.) A block the
    format's end-of-block rules forbid, some of which liblz4 reads, is pyarrow's to judge."""
    if size > MAX_RATIO * len(data) + MAX_EXTRA:  # no block that short decodes to that much
        raise _Corrupt("page does not decompress to its stated size")
    out = pa.allocate_buffer(size, memory_pool=memory_pool())  # as the other codecs' pages
    status = lz4_block_decode(np.frombuffer(data, dtype=np.uint8), 0, len(data), np.frombuffer(out, dtype=np.uint8))
    if status == UNUSUAL:
        raise _Unsupported("an LZ4 page outside the block format's end-of-block rules")
    if status < 0:
        raise _Corrupt(f"page does not decompress (lz4_raw: {LZ4_MESSAGES[status]})")
    return out


def _gunzip(data, size: int) -> bytes:
    """A gzip page: gzip or zlib streams back to back, each complete and nothing after the last,
    as pyarrow reads one (``zlib.decompress`` stops after the first and ignores what follows).
    At most ``size + 1`` bytes come out, however much the streams hold."""
    parts, total = [], 0
    while True:
        stream = zlib.decompressobj(wbits=47)
        part = stream.decompress(data, size + 1 - total)
        parts.append(part)
        total += len(part)
        if total > size:
            raise _Corrupt("page does not decompress to its stated size")
        if not stream.eof:
            raise _Corrupt("page does not decompress (gzip: incomplete or truncated stream)")
        data = stream.unused_data
        if not data:
            return parts[0] if len(parts) == 1 else b"".join(parts)


def _chunk_span(chunk: ChunkMeta) -> tuple[int, int]:
    """The file's bytes ``[start, end)`` holding a column chunk's pages (its dictionary first)."""
    return chunk.start, chunk.end


def _leaves(pf: pq.ParquetFile, fields: list[str]) -> dict[int, tuple[str, int, int]]:
    """Every leaf column of ``fields`` as :func:`footer_problem` takes them: (physical type, max
    repetition level, max definition level); none where the schema does not map onto the
    columns (the row counts are checked all the same)."""
    first_leaf = _first_leaves(pf)
    if first_leaf is None:
        return {}
    leaves = {}
    for name in fields:
        if name in first_leaf:
            start = first_leaf[name]
            for leaf in range(start, start + _leaf_count(pf.schema_arrow.field(name).type)):
                column = pf.schema.column(leaf)
                leaves[leaf] = (column.physical_type, column.max_repetition_level, column.max_definition_level)
    return leaves


def _single_leaves(pf: pq.ParquetFile, fields: list[str]) -> dict[str, int]:
    """The leaf column of each of ``fields`` that is a list of scalars or a scalar (whose level
    entries :func:`_level_entries` counts), where the schema maps onto the columns."""
    first_leaf = _first_leaves(pf) or {}
    leaves = {}
    for name in (f for f in fields if f in first_leaf):
        t = pf.schema_arrow.field(name).type
        if _is_list(t):
            t = t.value_type
        if not pa.types.is_nested(t):
            leaves[name] = first_leaf[name]
    return leaves


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _level_entries(column: pa.Array) -> int:
    """The level entries a Parquet column chunk holds for ``column`` (a list of scalars, or a
    scalar): a list's values, or one entry for an empty or null list; one per scalar row.
    Counted over the buffers: pyarrow's compute functions given a Python scalar import pandas."""
    n = len(column)
    if not _is_list(column.type) or n == 0:
        return n
    fixed = pa.types.is_fixed_size_list(column.type)
    if not column.null_count:  # the usual batch, counted in two array operations (once a batch)
        if fixed:
            return n * max(column.type.list_size, 1)
        offsets = to_numpy(column.offsets)
        return int(offsets[-1] - offsets[0]) + int(np.count_nonzero(offsets[1:] == offsets[:-1]))
    valid = unpack_bits(np.frombuffer(column.buffers()[0], np.uint8), column.offset, column.offset + n) == 1
    if fixed:
        lengths = np.full(n, column.type.list_size, np.int64)
    else:
        lengths = np.diff(to_numpy(column.offsets)).astype(np.int64)
    return int(np.where(valid, np.maximum(lengths, 1), 1).sum())


def _paged_levels_of(path: str, chunks: list[ChunkMeta]) -> list[int | None]:
    """The level entries of each column chunk's data pages by their headers alone, or None for a
    chunk whose headers cannot be walked (left to pyarrow, which reports what it finds).

    The compiled walk reads the headers of every chunk in one call over one memory map of the
    file (only the pages holding headers are touched; a map and a walk a chunk cost ~0.1 ms:
    2 s of a 10,000-group file). Where it declines a header, each chunk is walked alone over
    the same map; a chunk still declined, or a file that cannot be mapped, is read one header
    at a time."""
    spans = [_chunk_span(chunk) for chunk in chunks]
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        levels: list[int | None] = [None if not 0 <= start <= end <= size else 0 if start == end else -1
                                    for start, end in spans]
        todo = [i for i, n in enumerate(levels) if n == -1]
        if todo:
            try:
                with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
                    raw = np.frombuffer(mapped, dtype=np.uint8)
                    for group in ([todo] + [[i] for i in todo]):  # all at once; else one at a time
                        if all(levels[i] != -1 for i in group):
                            continue
                        walked = _walked_levels(raw, [spans[i] for i in group])
                        if walked is not None:
                            for i, n in zip(group, walked):
                                levels[i] = n
                    del raw  # the map cannot close while an array views it
            except (OSError, ValueError):  # a file system that cannot map files
                pass
        for i in todo:
            if levels[i] == -1:
                try:
                    levels[i] = thrift.data_page_levels(f.fileno(), *spans[i])
                except thrift.ThriftError:
                    levels[i] = None
    return levels


def _walked_levels(raw: np.ndarray, spans: list[tuple[int, int]]) -> list[int] | None:
    """Each span's data-page level entries by the compiled walk of ``raw``, or None where it
    declines a header."""
    lo, hi = (np.array(bounds, dtype=np.int64) for bounds in zip(*spans))
    table = pages.walk(raw, lo, hi)
    if table is None:
        return None
    data = (table[:, pages.PAGE_TYPE] == thrift.DATA_PAGE) | (table[:, pages.PAGE_TYPE] == thrift.DATA_PAGE_V2)
    sums = np.zeros(len(spans), dtype=np.int64)
    np.add.at(sums, table[data, pages.CHUNK], table[data, pages.NUM_VALUES])
    return sums.tolist()


def _footer(fd: int, file_size: int, pf: pq.ParquetFile, fields: list[str]) -> tuple[Footer | None, str | None]:
    """The file's footer as packer reads it, checked before either decoder reads ``fields``: a
    footer that contradicts itself or the schema is a ValueError whichever decoder would read
    the file (pyarrow reads short by a row count that is too low). Else (footer, None), or
    (None, why) where the compiled decoder leaves the file to pyarrow (a footer the walk does
    not read, encrypted chunks, a chunk in another file: see
    :mod:`~packer_cli.sources._parquet_footer`)."""
    footer = read_footer(fd, file_size, pf.metadata.num_row_groups, pf.metadata.num_columns)
    problem = footer_problem(footer, _leaves(pf, fields))
    if problem is not None and problem.damaged:
        raise ValueError(f"the footer is damaged: {problem.reason}")
    if problem is not None:
        return None, f"the footer: {problem.reason}"
    return footer, None


#: Page headers are read from windows of a column chunk this large by the compiled walk
#: (``pages.complete_pages``), and a small page's payload is a slice of its window: one read
#: and no Python parsing for many pages. A page whose header the walk does not read, or one
#: that does not fit a window, is read alone, and after a large one (ALONE_PAYLOAD) the next
#: too. A chunk's first window is FIRST_WINDOW long: a chunk of large pages wastes
#: little reading it.
HEADER_WINDOW = 256 << 10
FIRST_WINDOW = 32 << 10
ALONE_PAYLOAD = 64 << 10  # a page this large is read alone, and the next one too
_WINDOW_PAGES = 256  # pages a window's walk reads at most


class _ChunkPages:
    """The pages of one column chunk, one at a time: (header, payload).

    Small pages come from windows of the chunk (``HEADER_WINDOW`` bytes read at once, their
    headers walked by compiled code). Other pages' headers are read with ``pread`` and
    :mod:`packer_cli._parquet_thrift`, which also judges and words any header the walk does not
    read. A large payload is a view of its own read-only memory map of
    the file (unmapped once the last view of it goes): the decompressor and the kernels read the
    page cache directly, where a ``pread`` would copy every page into a fresh allocation. Only the
    pages in flight are mapped, so resident memory stays bounded however large the row groups.
    (As with any memory map, a file truncated by another process while it is being read ends
    the process with SIGBUS where a ``pread`` would have come up short.)
    """

    def __init__(self, fd: int, chunk: ChunkMeta, file_size: int):
        start, end = _chunk_span(chunk)
        self.fd, self.pos, self.end = fd, start, end
        self.file_size = file_size
        if start < 0 or end < start:
            raise _Corrupt("column chunk has a negative offset or size")
        self.window: bytes = b""  # the last window read, from file offset ``window_at``
        self.window_at = 0
        self.table: np.ndarray | None = None  # its pages (``pages.FIELDS`` rows)
        self.rows = self.row = 0  # pages in the table, the next one to hand out
        self.alone = False  # the last page was large: the next one is read alone too
        self.window_size = FIRST_WINDOW

    def next(self) -> tuple[thrift.PageHeader, bytes | memoryview]:
        if self.pos >= self.end:  # asked for more: the chunk's value count says there is more
            raise _Corrupt("the column chunk's pages end before the value count its footer states")
        if not self.alone:
            page = self._windowed()
            if page is not None:
                return page
        header, start, size = self.skip()
        self.rows = self.row = 0  # the window's pages are behind: the next window starts here
        self.alone = size >= ALONE_PAYLOAD
        if size >= _MAP_PAYLOAD:
            base = start - start % mmap.ALLOCATIONGRANULARITY
            try:
                view = memoryview(mmap.mmap(self.fd, start + size - base, prot=mmap.PROT_READ, offset=base))
                return header, view[start - base:]
            except OSError:  # a file system that cannot map files: read the page instead
                pass
        return header, os.pread(self.fd, size, start)

    def _windowed(self) -> tuple[thrift.PageHeader, memoryview] | None:
        """The next page from a window of the chunk, or None where it does not lie whole in one
        (or the walk does not read its header)."""
        if self.row == self.rows:
            if self.table is None:
                self.table = np.empty((_WINDOW_PAGES, len(pages.FIELDS)), np.int64)
            self.window = os.pread(self.fd, min(self.window_size, self.end - self.pos), self.pos)
            self.window_at = self.pos
            self.rows = pages.complete_pages(np.frombuffer(self.window, np.uint8), 0, len(self.window), self.table)
            self.row = 0
            self.window_size = HEADER_WINDOW
            if not self.rows:
                return None
        row = self.table[self.row]
        header_at = self.table[self.row - 1, pages.HI] if self.row else 0
        self.row += 1
        lo, hi = int(row[pages.LO]), int(row[pages.HI])
        self.pos = self.window_at + hi
        self.alone = hi - lo >= ALONE_PAYLOAD
        return _header_of(row, lo - int(header_at)), memoryview(self.window)[lo:hi]

    def skip(self) -> tuple[thrift.PageHeader, int, int]:
        """The next page's header, and where its payload starts and how long it is (then passed)."""
        try:
            header = thrift.read_page_header(self.fd, self.pos, self.end)
        except thrift.ThriftError as exc:
            raise _Corrupt(str(exc)) from None
        start = self.pos + header.size
        size = header.compressed_size
        if start + size > self.end:
            raise _Corrupt("page runs past its column chunk")
        if start + size > self.file_size:
            raise _Corrupt("file ends inside a page")
        self.pos = start + size
        return header, start, size


def _header_of(row: np.ndarray, size: int) -> thrift.PageHeader:
    """The header of a page-table row (``size``: the header's own bytes), as
    :func:`thrift.parse_page_header` reads it."""
    kind, uncompressed, values, encoding = (int(x) for x in row[[pages.PAGE_TYPE, pages.UNCOMPRESSED,
                                                                 pages.NUM_VALUES, pages.ENCODING]])
    common = dict(size=size, page_type=kind, uncompressed_size=uncompressed,
                  compressed_size=int(row[pages.HI] - row[pages.LO]), num_values=values, encoding=encoding)
    if kind == thrift.DATA_PAGE:
        return thrift.PageHeader(**common, def_encoding=int(row[pages.DEF_ENCODING]),
                                 rep_encoding=int(row[pages.REP_ENCODING]))
    if kind == thrift.DATA_PAGE_V2:
        return thrift.PageHeader(**common, def_bytes=int(row[pages.DEF_BYTES]), rep_bytes=int(row[pages.REP_BYTES]),
                                 is_compressed=bool(row[pages.IS_COMPRESSED]))
    return thrift.PageHeader(**common)  # a dictionary page (the only other kind the walk reads)


# --- one page -----------------------------------------------------------------------------------

def _check(status: int) -> int:
    if status == UNUSUAL:
        raise _Unsupported("a page's encoded values do not end where the page does")
    if status < 0:
        raise _Corrupt(MESSAGES[status])
    return status


def _read_dictionary(layout: _ColumnLayout, codec: str, header: thrift.PageHeader, payload: bytes) -> np.ndarray:
    if header.encoding not in (thrift.PLAIN, thrift.PLAIN_DICTIONARY):
        raise _Unsupported(f"dictionary encoded as {thrift.ENCODING_NAMES.get(header.encoding, header.encoding)}")
    data = _decompress(codec, payload, header.uncompressed_size)
    if header.num_values * layout.physical_dtype.itemsize != len(data):
        raise _Unsupported("a dictionary page's size does not match its values")
    stored = np.frombuffer(data, dtype=layout.physical_dtype, count=header.num_values)
    return stored.astype(layout.value_dtype)  # wraps like pyarrow's cast


def _split_v1(codec: str, header: thrift.PageHeader, payload: bytes):
    """Data page v1: the whole page is compressed; each level run is prefixed by its byte length."""
    if header.rep_encoding != thrift.RLE or header.def_encoding != thrift.RLE:
        raise _Unsupported("levels are not RLE encoded")
    data = np.frombuffer(_decompress(codec, payload, header.uncompressed_size), dtype=np.uint8)
    pos, spans = 0, []
    for _ in range(2):  # repetition, then definition levels
        if pos + 4 > data.size:
            raise _Corrupt("page ends inside its levels")
        n = int(data[pos:pos + 4].view("<u4")[0])
        if pos + 4 + n > data.size:
            raise _Corrupt("page ends inside its levels")
        spans.append((data, pos + 4, pos + 4 + n))
        pos += 4 + n
    return spans[0], spans[1], (data, pos, data.size)


def _split_v2(codec: str, header: thrift.PageHeader, payload: bytes):
    """Data page v2: levels first, uncompressed and without length prefixes; then the values."""
    rep_end = header.rep_bytes
    def_end = rep_end + header.def_bytes
    if def_end > len(payload):
        raise _Corrupt("page is shorter than its levels")
    raw = np.frombuffer(payload, dtype=np.uint8)
    values = payload[def_end:]
    if header.is_compressed:
        values = _decompress(codec, values, header.uncompressed_size - def_end)
    vals = np.frombuffer(values, dtype=np.uint8)
    return (raw, 0, rep_end), (raw, rep_end, def_end), (vals, 0, vals.size)


@dataclass
class _Page:
    """One decoded data page: ``lead`` values finish the row the previous page left open (all of
    them when ``lengths`` is empty), then ``lengths`` are the rows starting here (the last one
    may continue on the next page), and ``values`` are all of the page's values."""

    lead: int
    lengths: np.ndarray
    values: np.ndarray


_LEVEL_PROBLEMS = {
    LEVEL_ABOVE_MAX: (_Corrupt, "level above the column's maximum"),
    NULLS: (_Unsupported, "the column holds null lists or null values"),
    EMPTY_CONTINUES: (_Corrupt, "an empty list continues a row"),
    EMPTY_HAS_VALUES: (_Corrupt, "an empty list has values"),
}


def _row_lengths(layout: _ColumnLayout, rep: np.ndarray, defs: np.ndarray) -> tuple[int, np.ndarray, int]:
    """(lead, lengths of the rows starting in the page, number of values) from its levels."""
    problem, rows, empties = level_checks(rep, defs, layout.max_def, layout.empty_def)
    lengths = np.empty(rows, dtype=np.int64)
    if not problem:
        problem, lead = row_lengths(rep, defs, layout.max_def, lengths)
    if problem:
        error, message = _LEVEL_PROBLEMS[problem]
        raise error(message)
    return lead, lengths, rep.size - empties


#: Values stored whole, one after another (PLAIN), or byte k of every value in stream k
#: (BYTE_STREAM_SPLIT, Parquet 2.8: for integers written by Arrow >= 16, e.g. a Bridge split of
#: ``--parquet-encoding split-zstd``).
_PLAIN_VALUES = (thrift.PLAIN, thrift.BYTE_STREAM_SPLIT)


def _stored_values(data, at: int, n: int, dtype: np.dtype, encoding: int) -> np.ndarray:
    """The ``n`` values of ``dtype`` stored from byte ``at`` of ``data`` in one of
    :data:`_PLAIN_VALUES` (the caller has checked that they fit): a view of PLAIN values; for
    BYTE_STREAM_SPLIT the streams joined back into values (a copy)."""
    if encoding == thrift.PLAIN:
        return np.frombuffer(data, dtype=dtype, count=n, offset=at)
    width = dtype.itemsize
    streams = np.frombuffer(data, dtype=np.uint8, count=n * width, offset=at).reshape(width, n)
    joined = np.empty((n, width), dtype=np.uint8)
    joined[...] = streams.T
    return joined.view(dtype).reshape(n)


#: The value encodings decoded here (pyarrow reads the others: DELTA_BYTE_ARRAY and the like
#: are not used for integers).
_DECODED = (*_PLAIN_VALUES, thrift.PLAIN_DICTIONARY, thrift.RLE_DICTIONARY, thrift.DELTA_BINARY_PACKED)


def _decode_values(layout: _ColumnLayout, header: thrift.PageHeader, span, count: int,
                   dictionary: np.ndarray | None, out: np.ndarray) -> np.ndarray:
    """The page's ``count`` values, decoded into ``out[:count]``."""
    data, lo, hi = span
    out = out[:count]
    if header.encoding in _PLAIN_VALUES:
        width = layout.physical_dtype.itemsize
        if lo + count * width > hi:
            raise _Corrupt("page is shorter than its values")
        if lo + count * width < hi:
            _check(UNUSUAL)
        stored = _stored_values(data, lo, count, layout.physical_dtype, header.encoding)
        np.copyto(out, stored, casting="unsafe")  # wraps like pyarrow's cast
        return out
    if header.encoding == thrift.DELTA_BINARY_PACKED:
        width = layout.physical_dtype.itemsize
        if out.dtype == layout.physical_dtype:
            _check(delta_decode(data, lo, hi, count, 8 * width, out))
        else:  # decoded in the stored type, then cast as pyarrow casts (wrapping)
            stored = np.empty(count, dtype=layout.physical_dtype)
            _check(delta_decode(data, lo, hi, count, 8 * width, stored))
            np.copyto(out, stored, casting="unsafe")
        return out
    if count:
        if dictionary is None:
            raise _Corrupt("dictionary-encoded page without a dictionary")
        if lo >= hi:
            raise _Corrupt(MESSAGES[TRUNCATED])
        _check(dictionary_decode(data, lo + 1, hi, int(data[lo]), count, dictionary, out))
    return out


class _Decoded:
    """A page decoded on the spot, with a future's ``result`` and ``cancel`` (a failure is kept
    and raised where the future's would be: when the cursor takes the page in)."""

    def __init__(self, *args):
        try:
            self._page, self._error = _decode_page(*args), None
        except Exception as exc:  # noqa: BLE001 - raised by result(), in page order
            self._page, self._error = None, exc

    def result(self) -> "_Page":
        if self._error is not None:
            raise self._error
        return self._page

    def cancel(self) -> bool:
        return False


def _decode_page(layout: _ColumnLayout, codec: str, header: thrift.PageHeader, payload: bytes,
                 dictionary: np.ndarray | None, out: np.ndarray) -> _Page:
    """Decode one data page on its own (no state from other pages: pages decode in parallel),
    its values into ``out`` (room for ``header.num_values``)."""
    if header.encoding not in _DECODED:
        raise _Unsupported(f"values encoded as {thrift.ENCODING_NAMES.get(header.encoding, header.encoding)}")
    split = _split_v1 if header.page_type == thrift.DATA_PAGE else _split_v2
    rep_span, def_span, value_span = split(codec, header, payload)
    n = header.num_values
    full = _rows_of_full_page(layout, rep_span, def_span, n)
    if full is not None:
        lead, lengths = full
        count = n
    else:
        rep = np.empty(n, dtype=np.uint8)
        _check(hybrid_decode(*rep_span, 1, n, rep))
        defs = np.empty(n, dtype=np.uint8)
        _check(hybrid_decode(*def_span, layout.max_def.bit_length(), n, defs))
        lead, lengths, count = _row_lengths(layout, rep, defs)
    return _Page(lead, lengths, _decode_values(layout, header, value_span, count, dictionary, out))


def _rows_of_full_page(layout: _ColumnLayout, rep_span, def_span, n: int) -> tuple[int, np.ndarray] | None:
    """(lead, row lengths) of a page whose every entry is a value, read from the level runs
    without decoding the levels; None for any other page (the general path reads it)."""
    if not levels_all_equal(*def_span, layout.max_def.bit_length(), n, layout.max_def):
        return None
    rows, _ = repetition_rows(*rep_span, n, _NO_LENGTHS, False)
    if rows < 0:
        return None
    lengths = np.empty(rows, dtype=np.int64)
    return repetition_rows(*rep_span, n, lengths, True)[1], lengths


_NO_LENGTHS = np.zeros(0, dtype=np.int64)


# --- one column ---------------------------------------------------------------------------------

class _ColumnCursor:
    """Decoded rows of one column over consecutive row groups' chunks: ``take(rows)`` →
    (offsets, values).

    Pages are read in order on the caller's thread and decoded up to ``PAGES_AHEAD`` ahead
    (fewer when those already hold ``AHEAD_BYTES`` of values) on ``pool`` (the kernels release the GIL, so two columns' pages, or one column's next pages,
    decode on both cores); their rows are then stitched together in order here. A row never
    crosses from one chunk into the next, and each chunk must hold exactly its row group's rows
    (``group_rows``).

    Each page decodes straight into the next free stretch of a *slab*, an array shared by
    consecutive pages (up to ``SLAB_BYTES``, and no larger than the chunks' values), so the
    values of a batch usually lie side by side already and ``take`` hands out a view of them;
    only a batch that crosses into a new slab, or past a page with empty lists, is copied. A
    slab is freed when the last batch viewing it is.
    """

    def __init__(self, fd: int, file_size: int, layout: _ColumnLayout, chunks: list[ChunkMeta],
                 group_rows: list[int], pool: ThreadPoolExecutor):
        for chunk in chunks:
            if chunk.codec not in _CODECS:
                raise _Unsupported(f"column '{layout.name}' is compressed with {chunk.codec}")
        self.layout, self.pool = layout, pool
        self.codecs = [chunk.codec for chunk in chunks]
        self.chunk_pages = [_ChunkPages(fd, chunk, file_size) for chunk in chunks]
        self.chunk_levels = [chunk.num_values for chunk in chunks]  # level entries not yet read, per chunk
        self.group_rows = list(group_rows)
        self.levels_unread = sum(self.chunk_levels)  # level entries (values and empty lists) not yet read
        self.reading = 0  # the chunk whose pages are read next
        self.dictionary: np.ndarray | None = None  # the dictionary of chunk ``reading``
        self.decoding: deque = deque()  # (level count, slab, start, future of _Page, chunk), in page order
        self.ahead_values = 0  # level entries of the pages in ``decoding`` (a bound on their values)
        self.taking = 0  # the chunk whose rows are being taken in
        self.chunk_rows = 0  # rows of chunk ``taking`` completed so far
        self.lengths: list[np.ndarray] = []  # lengths of complete rows not yet taken
        self.rows_ready = 0
        self.values_ready = 0  # their values
        self.open_length = -1  # length so far of the row the last page left open (-1: none)
        self.values: deque = deque()  # [slab, start, stop] runs of values not yet taken, in order
        self.slab: np.ndarray | None = None  # where the next page decodes, from ``slab_used`` on
        self.slab_used = 0
        self.at = 0  # the chunk the cursor was last working in: where a corruption it finds lies
        self.data_pages = self.page_levels = 0  # data pages read, and their level entries (up to TINY_PAGES)

    def _read_ahead(self) -> None:
        while self.levels_unread and len(self.decoding) < PAGES_AHEAD and (
                not self.decoding or self.ahead_values * self.layout.value_dtype.itemsize < AHEAD_BYTES):
            while not self.chunk_levels[self.reading]:  # a chunk read to its last level entry
                self.reading += 1
                self.dictionary = None
            chunk = self.at = self.reading
            header, payload = self.chunk_pages[chunk].next()
            if header.page_type == thrift.DICTIONARY_PAGE:
                if self.dictionary is not None:  # pyarrow refuses it too: the pages after it would read other tokens
                    raise _Corrupt("a second dictionary page in the column chunk")
                self.dictionary = _read_dictionary(self.layout, self.codecs[chunk], header, payload)
            elif header.page_type in (thrift.DATA_PAGE, thrift.DATA_PAGE_V2):
                if header.num_values > self.chunk_levels[chunk]:
                    raise _Corrupt("pages hold more values than the column chunk")
                if header.num_values > LARGE_PAGE_VALUES:
                    raise _Unsupported(f"a page of {header.num_values:,} values")
                if self.data_pages < TINY_PAGES:
                    self._count_page(header.num_values)
                slab, start = self._reserve(header.num_values)
                self.chunk_levels[chunk] -= header.num_values
                self.levels_unread -= header.num_values
                self.ahead_values += header.num_values
                args = (self.layout, self.codecs[chunk], header, payload, self.dictionary,
                        slab[start:start + header.num_values])
                # A small page decodes here: handing it to a thread cost more than decoding it
                # (60-90 us a page; 1 KiB pages read at a sixth of pyarrow's speed). Small in bytes
                # and in values: a few KB of run-length-encoded mask can hold millions.
                small = len(payload) < SMALL_PAGE and header.num_values <= SMALL_PAGE_VALUES
                decoded = _Decoded(*args) if small else self.pool.submit(_decode_page, *args)
                self.decoding.append((header.num_values, slab, start, decoded, chunk))
            # index pages (and page types from the future) carry nothing we need

    def _count_page(self, levels: int) -> None:
        self.data_pages += 1
        self.page_levels += levels
        if self.data_pages == TINY_PAGES and self.page_levels < TINY_PAGES * TINY_PAGE_VALUES:
            raise _Unsupported(f"column '{self.layout.name}' is written in pages of "
                               f"{self.page_levels // TINY_PAGES:,} values on average, which pyarrow reads faster")

    def _next_page(self) -> bool:
        """Take in the next decoded page's rows; False once the chunks have no more pages."""
        self._read_ahead()
        if not self.decoding:
            self._end_chunks(len(self.group_rows))
            return False
        levels, slab, start, future, chunk = self.decoding.popleft()
        self.ahead_values -= levels
        self._end_chunks(chunk)
        self.at = chunk
        page = future.result()
        if page.lead:  # the page continues the open row
            if self.open_length < 0:
                raise _Corrupt("the first value of a column chunk does not start a row")
            self.open_length += page.lead
        if page.lengths.size:
            if self.open_length >= 0:
                self._complete(np.array([self.open_length], dtype=np.int64))
            self._complete(page.lengths[:-1])
            self.open_length = int(page.lengths[-1])
        if page.values.size:
            self._append_values(slab, start, start + page.values.size)
        return True

    def _end_chunks(self, until: int) -> None:
        """Close the chunks before chunk ``until``: the last row of each ends with it, and each
        must have held its row group's rows."""
        while self.taking < until:
            if self.open_length >= 0:
                self._complete(np.array([self.open_length], dtype=np.int64))
                self.open_length = -1
            expected = self.group_rows[self.taking]
            if self.chunk_rows != expected:
                self.at = self.taking
                raise _Corrupt(f"column chunk holds {'more' if self.chunk_rows > expected else 'fewer'} rows "
                               f"than its row group")
            self.taking += 1
            self.chunk_rows = 0

    def _reserve(self, n: int) -> tuple[np.ndarray, int]:
        """Room for ``n`` values (a page's level count, a bound on its values): (slab, start)."""
        if self.slab is None or self.slab_used + n > self.slab.size:
            itemsize = self.layout.value_dtype.itemsize
            size = max(n, min(SLAB_BYTES // itemsize, self.levels_unread))
            self.slab = np.empty(size, dtype=self.layout.value_dtype)
            self.slab_used = 0
        self.slab_used += n
        return self.slab, self.slab_used - n

    def _append_values(self, slab: np.ndarray, start: int, stop: int) -> None:
        """Queue a page's values, joined to the previous page's when they are adjacent in one slab."""
        if self.values and self.values[-1][0] is slab and self.values[-1][2] == start:
            self.values[-1][2] = stop
        else:
            self.values.append([slab, start, stop])

    def _complete(self, lengths: np.ndarray) -> None:
        self.lengths.append(lengths)
        self.rows_ready += lengths.size
        self.values_ready += int(lengths.sum())
        self.chunk_rows += lengths.size

    def _take_values(self, count: int) -> np.ndarray:
        """The next ``count`` values: a view of their slab when they lie side by side in one,
        else copied out run by run into one array."""
        if count and self.values[0][2] - self.values[0][1] >= count:
            return self._take_run(count)
        out = np.empty(count, dtype=self.layout.value_dtype)
        done = 0
        while done < count:
            n = min(count - done, self.values[0][2] - self.values[0][1])
            out[done:done + n] = self._take_run(n)
            done += n
        return out

    def _take_run(self, n: int) -> np.ndarray:
        """The next ``n`` values of the first run of values (which holds at least ``n``)."""
        run = self.values[0]
        slab, start = run[0], run[1]
        run[1] += n
        if run[1] == run[2]:
            self.values.popleft()
        return slab[start:start + n]

    def rows_within(self, rows: int, values: int) -> int:
        """How many of the next ``rows`` rows hold at most ``values`` values (at least one row),
        decoding pages only as far as that needs: a batch of long rows closes sooner. Where the
        pages run out first, ``rows`` (:meth:`take` then says what is wrong)."""
        while self.rows_ready < rows and self.values_ready < values:
            if not self._next_page():
                return rows
        if self.values_ready <= values and self.rows_ready <= rows:
            return self.rows_ready
        within = int(np.searchsorted(np.cumsum(self._ready_lengths()[:rows]), values, side="right"))
        return max(1, min(rows, within))

    def _ready_lengths(self) -> np.ndarray:
        """The lengths of the complete rows not yet taken, as one array (kept so, for ``take``)."""
        if len(self.lengths) != 1:
            self.lengths = [np.concatenate(self.lengths) if self.lengths
                            else np.zeros(0, dtype=np.int64)]  # (none: a run of row groups without rows)
        return self.lengths[0]

    def take(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``rows`` rows: (int64 offsets from 0, values)."""
        while self.rows_ready < rows:
            if not self._next_page() and self.rows_ready < rows:  # (the last chunk's last row just closed)
                self.at = len(self.group_rows) - 1
                raise _Corrupt("column chunk holds fewer rows than its row group")
        lengths = self._ready_lengths()
        taken, rest = lengths[:rows], lengths[rows:]
        self.lengths = [rest] if rest.size else []
        self.rows_ready -= rows
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(taken, out=offsets[1:])
        self.values_ready -= int(offsets[-1])
        return offsets, self._take_values(int(offsets[-1]))

    def finish(self) -> None:
        """Check that each chunk ends where its row group does."""
        while self._next_page():
            pass
        if self.rows_ready:
            self.at = len(self.group_rows) - 1
            raise _Corrupt("column chunk holds more rows than its row group")

    def cancel(self) -> None:
        for *_, future, _chunk in self.decoding:
            future.cancel()


_POOL_LOCK = threading.Lock()
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (the process it was made in, the pool)


def decode_pool() -> ThreadPoolExecutor:
    """The process's two page-decoding threads, shared by every file it reads: a pool a file
    cost two thread starts and joins a file (1-3 ms, most of a small file's reading). A forked
    child makes its own (the parent's threads are not in it)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=2, thread_name_prefix="packer-parquet"))
        return _POOL[1]


def _runs(group_rows: list[int], group_values: list[int], run_rows: int,
          run_values: int) -> Iterator[tuple[int, int]]:
    """``(first, end)`` of consecutive row groups, each run closed before it would pass
    ``run_rows`` rows or ``run_values`` values (level entries) in a column; a group past either
    on its own is a run of its own."""
    first, rows, values = 0, 0, 0
    for group, (count, entries) in enumerate(zip(group_rows, group_values)):
        if group > first and (rows + count > run_rows or values + entries > run_values):
            yield first, group
            first, rows, values = group, 0, 0
        rows += count
        values += entries
    if first < len(group_rows):
        yield first, len(group_rows)


def _group_at(group_rows: list[int], first: int, done: int) -> tuple[int, int]:
    """The row group holding the run's row ``done`` (the run starting at group ``first``), and
    that row's place in it: where a reading that stops after ``done`` rows resumes."""
    group = first
    while done and done >= group_rows[group]:
        done -= group_rows[group]
        group += 1
    return group, done


def _named(cursor: _ColumnCursor, step, *args):
    """Run one step of a column's cursor, naming the column in any corruption it finds (and
    noting, as ``chunk``, which of the cursor's chunks it was in)."""
    try:
        return step(*args)
    except _Corrupt as exc:
        named = _Corrupt(f"column '{cursor.layout.name}': {exc}")
        named.chunk = cursor.at
        raise named from None


def _list_array(layout: _ColumnLayout, offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    if pa.types.is_large_list(layout.arrow_type):
        return pa.LargeListArray.from_arrays(from_numpy(offsets), from_numpy(values), type=layout.arrow_type)
    if offsets[-1] >= 2**31:
        raise _Unsupported("a batch holds more than 2^31 values")
    return pa.ListArray.from_arrays(from_numpy(offsets.astype(np.int32)), from_numpy(values), type=layout.arrow_type)


# --- the reader -------------------------------------------------------------------------------

class ListColumnReader:
    """Record batches (1..``batch_rows`` rows, fewer where they would pass ``batch_values`` values
    in a column) of ``fields`` of one Parquet file.

    ``fast_rows`` and ``arrow_rows`` count the rows each decoder produced; ``fallback_reason``
    says why pyarrow took over (None while the compiled decoder reads everything).
    """

    def __init__(self, path: str, fields: list[str], batch_rows: int = 2048, *, arrow_only: bool = False,
                 batch_values: int = BATCH_VALUES):
        self.path, self.fields, self.batch_rows = path, list(fields), max(1, batch_rows)
        self.batch_values = max(1, batch_values)  # a batch of long rows closes before this many values (a column)
        self.arrow_only = arrow_only  # pyarrow throughout (``verify --source`` wants a second opinion)
        self.fast_rows = self.arrow_rows = 0
        self.fallback_reason: str | None = None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        # When pyarrow decodes, it streams pages too: its pre-buffering reads far ahead (hundreds
        # of MB) and an unbuffered read holds a whole column chunk (gigabytes in a file of
        # million-row groups).
        pf = pq.ParquetFile(self.path, pre_buffer=False, buffer_size=PARQUET_BUFFER)
        with open(self.path, "rb") as f:  # checked first: its row counts whichever decoder reads
            footer, unread = _footer(f.fileno(), os.fstat(f.fileno()).st_size, pf, self.fields)
        try:
            if self.arrow_only:
                raise _Unsupported("pyarrow asked for")
            if env_choice(ENV_DECODER, DECODERS) == "arrow":
                raise _Unsupported(f"{ENV_DECODER}=arrow")
            layouts = _column_layouts(pf, self.fields)
            if footer is None:
                raise _Unsupported(unread)
        except _Unsupported as exc:
            self.fallback_reason = str(exc)
            yield from self._arrow(pf, 0, 0, footer)
            return
        schema = pa.schema([pf.schema_arrow.field(name) for name in self.fields])
        fd = os.open(self.path, os.O_RDONLY)
        file_size = os.fstat(fd).st_size
        pool = decode_pool()
        group_rows = [int(rows) for rows in footer.group_rows]
        read = functools.partial(self._run, fd, file_size, footer, layouts, schema, pool)
        group_values = footer.group_values([layout.leaf for layout in layouts]).tolist()
        runs = list(_runs(group_rows, group_values, self.batch_rows * RUN_BATCHES, RUN_VALUES))
        # Runs of groups smaller than a batch are decoded whole; larger groups stream page by page.
        small = [end - first > 1 and sum(group_rows[first:end]) < self.batch_rows * (end - first)
                 for first, end in runs]
        whole_runs = self._whole_runs(pf, footer, layouts) if any(small) else None
        try:
            for k, (first, end) in enumerate(runs):
                if small[k]:
                    following = runs[k + 1] if k + 1 < len(runs) and small[k + 1] else None
                    whole = self._whole_run(whole_runs, first, end, following)
                    if whole is not None:
                        for at in range(0, whole.num_rows, self.batch_rows):
                            batch = whole.slice(at, self.batch_rows)
                            self.fast_rows += batch.num_rows
                            yield batch
                        continue
                done = 0
                try:
                    for batch in read(first, end):
                        done += batch.num_rows
                        self.fast_rows += batch.num_rows
                        yield batch
                except _Unsupported as exc:
                    self.fallback_reason = str(exc)
                    yield from self._arrow(pf, *_group_at(group_rows, first, done), footer)
                    return
                except _Corrupt as exc:
                    raise ValueError(f"row group {first + exc.chunk}: {exc}") from None
        finally:
            if whole_runs is not None:
                whole_runs.close()
            os.close(fd)  # (the pool's decoding never reads the file: pages are read on this thread)

    def _whole_runs(self, pf: pq.ParquetFile, footer: Footer, layouts) -> "RowGroupRuns":
        """A :class:`RowGroupRuns` of this file that knows its footer and layouts already."""
        whole_runs = RowGroupRuns(self.path, pf, decode_pool())
        whole_runs._footers[tuple(self.fields)] = footer
        whole_runs._layouts[tuple(self.fields)] = layouts
        return whole_runs

    def _whole_run(self, whole_runs: "RowGroupRuns", first: int, end: int,
                   following: tuple[int, int] | None) -> pa.RecordBatch | None:
        """Row groups ``first..end-1`` decoded whole, the ``following`` run (if any) set decoding
        meanwhile; None where the cursors must read it: a type, encoding or nulls the compiled
        decoder leaves to pyarrow, or damage, which the cursors name by group."""
        try:
            whole = whole_runs.read(first, end, self.fields)
        except ValueError:
            whole = None
        if whole is not None and following is not None:
            whole_runs.read_ahead(*following, self.fields)
        return whole

    def _run(self, fd, file_size: int, footer: Footer, layouts, schema, pool, first: int,
             end: int) -> Iterator[pa.RecordBatch]:
        """Batches of row groups ``first..end-1``, read as one run: a cursor a column over their chunks."""
        rows_of = [int(footer.group_rows[group]) for group in range(first, end)]
        num_rows = sum(rows_of)
        cursors = [_ColumnCursor(fd, file_size, layout, [footer.chunk(group, layout.leaf) for group in range(first, end)],
                                 rows_of, pool)
                   for layout in layouts]
        try:
            done = 0
            while done < num_rows:
                rows = min(self.batch_rows, num_rows - done)
                for cursor in cursors:  # start every column's pages decoding before waiting on any
                    _named(cursor, cursor._read_ahead)
                for cursor in cursors:
                    rows = _named(cursor, cursor.rows_within, rows, self.batch_values)
                arrays = [_list_array(cursor.layout, *_named(cursor, cursor.take, rows)) for cursor in cursors]
                done += rows
                yield pa.RecordBatch.from_arrays(arrays, schema=schema)
            for cursor in cursors:
                _named(cursor, cursor.finish)
        finally:
            for cursor in cursors:
                cursor.cancel()

    def _arrow(self, pf: pq.ParquetFile, group: int, skip: int, footer: Footer | None) -> Iterator[pa.RecordBatch]:
        """pyarrow's batches from row group ``group`` on, less the first ``skip`` rows (already
        yielded); ``footer``, packer's reading of it, where the walk read it."""
        pool = pa.default_memory_pool()
        leaves = _single_leaves(pf, self.fields) if footer is not None else {}
        groups = range(group, pf.metadata.num_row_groups)
        chunks = [footer.chunk(g, leaf) for g in groups for leaf in leaves.values()]
        paged = iter(_paged_levels_of(self.path, chunks) if chunks else ())
        k = 0
        for g in groups:  # one group at a time, to name a damaged one
            stated = {name: self._stated_levels(footer.chunk(g, leaf), next(paged), g, name)
                      for name, leaf in leaves.items()}
            try:
                for batch in self._arrow_group(pf, g, skip if g == group else 0, stated):
                    yield batch
                    k += 1
                    if k % 16 == 0:
                        pool.release_unused()  # the allocator otherwise keeps freed decode buffers
            except (pa.ArrowException, OSError) as exc:
                raise ValueError(f"row group {g}: {str(exc).strip() or type(exc).__name__}") from None
        pool.release_unused()

    @staticmethod
    def _stated_levels(chunk: ChunkMeta, paged: int | None, group: int, name: str) -> int:
        """A column chunk's level entries as its footer entry states them, checked against its
        pages' headers where they could be walked (``paged``: a footer whose row and value counts
        were all lowered together adds up, and pyarrow reads the stated rows and stops)."""
        if paged is not None and paged != chunk.num_values:
            raise ValueError(f"row group {group}: column {name!r}: the footer states {chunk.num_values} values, "
                             f"the column chunk's page headers {paged}")
        return chunk.num_values

    def _arrow_group(self, pf: pq.ParquetFile, group: int, skip: int,
                     stated_values: dict[str, int]) -> Iterator[pa.RecordBatch]:
        """Row group ``group`` less its first ``skip`` rows. pyarrow's ``iter_batches`` can read
        fewer rows than a group holds and say nothing (pyarrow 26 reads a last one-row group of
        data pages v2 and tiny pages as none), so its rows are counted against the footer's:
        a file never reads short. Its level entries are counted too, against each column
        chunk's value count (``stated_values``): a footer whose group and file row counts were
        both lowered adds up, and pyarrow stops at the count, rows short, where packer's decoder
        finds the pages holding more; a value count off either way is refused by both."""
        stated, read = pf.metadata.row_group(group).num_rows, 0
        levels = dict.fromkeys(stated_values, 0)
        # Rows a batch: about ``batch_values`` values at the group's mean row length.
        most = max(stated_values.values(), default=0)
        batch_rows = max(1, min(self.batch_rows, self.batch_values * stated // most)) if most else self.batch_rows
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[group], columns=self.fields):
            read += batch.num_rows
            for name in levels:
                levels[name] += _level_entries(batch.column(name))
            if read > stated:
                raise ValueError(f"row group {group}: pyarrow read more than its {stated} rows")
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            if skip:
                batch, skip = batch.slice(skip), 0
            self.arrow_rows += batch.num_rows
            yield batch
        if read != stated:
            raise ValueError(f"row group {group}: pyarrow read {read} of its {stated} rows")
        for name, count in levels.items():
            if count != stated_values[name]:
                raise ValueError(f"row group {group}: column {name!r}: pyarrow read {count} values, the column chunk's "
                                 f"footer entry states {stated_values[name]}")


# --- whole runs of row groups ------------------------------------------------------------------

class _NotBulk(Exception):
    """A run that :func:`_read_bulk` does not decode: the page-at-a-time cursors read it."""


_MERGE_GAP = 256 << 10  # chunks this close are read in one pread, the bytes between them too


def _read_spans(fd: int, file_size: int, spans: list[tuple[int, int]]) -> tuple[np.ndarray, list[int]]:
    """The bytes of ``spans`` (file ranges, in file order) in one buffer, and where each starts in it."""
    if any(start < 0 or end < start or end > file_size for start, end in spans):
        raise _NotBulk
    reads: list[list[int]] = []  # [file start, file end, buffer start]
    at: list[int] = []
    size = 0
    for start, end in spans:
        if reads and reads[-1][1] <= start <= reads[-1][1] + _MERGE_GAP:
            size += start - reads[-1][1]
            reads[-1][1] = end
        elif not reads or start > reads[-1][1]:
            reads.append([start, end, size])
        else:  # overlapping chunks: not a layout writers produce
            raise _NotBulk
        at.append(size)
        size += end - start
    raw = np.empty(size, dtype=np.uint8)
    for start, end, pos in reads:
        done = 0
        while done < end - start:
            n = os.preadv(fd, [memoryview(raw[pos + done:pos + end - start])], start + done)
            if n <= 0:
                raise _NotBulk
            done += n
    return raw, at


@dataclass
class _Chunk:
    """One column chunk of a run, decoded into its column's arrays at ``value_at`` / ``row_at``."""

    codec: str
    pages: list  # its rows of the page table, as lists
    value_at: int
    row_at: int
    rows: int


def _decode_chunks(layout: _ColumnLayout, chunks: list[_Chunk], raw: memoryview, values: np.ndarray,
                   lengths: np.ndarray) -> None:
    """Decode whole chunks of one column (data pages v1 of PLAIN or BYTE_STREAM_SPLIT values): their values into
    ``values``, their row lengths into ``lengths``, each at its chunk's offsets (so chunks decode
    in any order, on any thread). :class:`_NotBulk` for any page but the usual one
    (:func:`_usual_page`) or rows that disagree with the footer: the cursors read those runs;
    :class:`_Corrupt` for a page that does not decompress."""
    for chunk in chunks:
        v, r, end = chunk.value_at, chunk.row_at, chunk.row_at + chunk.rows
        open_length = -1
        for row in chunk.pages:
            ok, r, open_length = _usual_page(layout, chunk.codec, row, raw[row[pages.LO]:row[pages.HI]], values, v,
                                             lengths, r, end, open_length)
            if not ok:
                raise _NotBulk
            v += row[pages.NUM_VALUES]
        if open_length >= 0:  # the chunk's last row ends with it
            if r == end:
                raise _NotBulk
            lengths[r] = open_length
            r += 1
        if r != end:
            raise _NotBulk


def _usual_page(layout: _ColumnLayout, codec: str, row: list[int], payload, values: np.ndarray, v: int,
                lengths: np.ndarray, r: int, end: int, open_length: int) -> tuple[bool, int, int]:
    """A data page v1 of PLAIN (or BYTE_STREAM_SPLIT) values, its rows read by one kernel call (:func:`usual_page_rows`):
    (ok, r, open_length) after it; not ok for anything but the usual page, which the cursors judge.

    It splits the page and checks its values' length itself rather than through
    :func:`_split_v1` and :func:`_decode_values` (a page header object and NumPy views a page):
    with those, a Bridge split of ~11,000 mostly small pages was audited 8-15 % slower (8
    alternations), the per-page Python holding the GIL the decode threads wait on."""
    if row[pages.REP_ENCODING] != thrift.RLE or row[pages.DEF_ENCODING] != thrift.RLE:
        return False, r, open_length
    data = _decompress(codec, payload, row[pages.UNCOMPRESSED])
    size = len(data)
    if size < 4:
        return False, r, open_length
    def_at = 4 + int.from_bytes(data[0:4], "little")
    if def_at + 4 > size:
        return False, r, open_length
    values_at = def_at + 4 + int.from_bytes(data[def_at:def_at + 4], "little")
    n = row[pages.NUM_VALUES]
    if values_at + n * layout.physical_dtype.itemsize != size:
        return False, r, open_length
    levels = np.frombuffer(data, dtype=np.uint8)
    ok, r, open_length = usual_page_rows(levels, 4, def_at, def_at + 4, values_at, n, layout.max_def.bit_length(),
                                         layout.max_def, lengths, r, end, open_length)
    if ok:  # wraps like pyarrow's cast
        np.copyto(values[v:v + n], _stored_values(data, values_at, n, layout.physical_dtype, row[pages.ENCODING]),
                  casting="unsafe")
    return ok, r, open_length


def _halves(chunks: list[_Chunk], sizes: list[int]) -> list[list[_Chunk]]:
    """``chunks`` cut in two runs of about equal ``sizes`` (compressed bytes), so that one
    column's work spreads over both threads."""
    total, acc = sum(sizes), 0
    for i, size in enumerate(sizes):
        acc += size
        if 2 * acc >= total:
            return [part for part in (chunks[:i + 1], chunks[i + 1:]) if part]
    return [chunks]


class RowGroupRuns:
    """Runs of consecutive row groups of one Parquet file, each decoded whole into one record
    batch by the compiled decoder: ``read(first, end, fields)``.

    For files of many small row groups (Megatron-Bridge's are ~1 MiB, for its shuffled reads)
    the per-group work of :class:`ListColumnReader` (a batch, arrays and cursors per group)
    outweighs the decoding; here each column is one cursor over the run's chunks, its values
    one array. Use as a context manager (it holds a file descriptor and two decoding threads)::

        with RowGroupRuns(path) as runs:
            batch = runs.read(0, 36, ["input_ids", "loss_mask"])  # None: pyarrow's to read
    """

    def __init__(self, path: str, pf: pq.ParquetFile | None = None, pool: ThreadPoolExecutor | None = None):
        self.pf = pf if pf is not None else pq.ParquetFile(path, pre_buffer=False)
        self.fd = os.open(path, os.O_RDONLY)
        self.file_size = os.fstat(self.fd).st_size
        self._own_pool = pool is None  # a pool given (the process's decoding threads) is left running
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="packer-parquet") if pool is None else pool
        self._layouts: dict[tuple, list[_ColumnLayout] | None] = {}
        self._footers: dict[tuple, Footer] = {}  # the footer, by the fields it was checked for
        self._ahead: ThreadPoolExecutor | None = None  # where the next run is read while this one is used
        self._pending: tuple | None = None  # ((first, end, fields), future of its read)

    def __enter__(self) -> "RowGroupRuns":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            if self._ahead is not None:
                self._ahead.shutdown(wait=True, cancel_futures=True)
            if self._own_pool:
                self.pool.shutdown(wait=True, cancel_futures=True)
            os.close(self.fd)
            self.fd = -1

    def _layouts_of(self, fields: list[str]) -> list[_ColumnLayout] | None:
        key = tuple(fields)
        if key not in self._layouts:
            try:
                # checked first: its row counts whichever decoder reads (pyarrow reads short)
                footer, unread = _footer(self.fd, self.file_size, self.pf, list(fields))
                if env_choice(ENV_DECODER, DECODERS) == "arrow":
                    raise _Unsupported(f"{ENV_DECODER}=arrow")
                layouts = _column_layouts(self.pf, list(fields))
                if footer is None:
                    raise _Unsupported(unread)
                self._footers[key] = footer
                self._layouts[key] = layouts
            except _Unsupported:
                self._layouts[key] = None
        return self._layouts[key]

    def read_ahead(self, first: int, end: int, fields: list[str]) -> None:
        """Start reading the run that :meth:`read` will be asked for next, on a thread of its
        own, so that it decodes while the caller works on the current one."""
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packer-parquet-ahead")
        self._forget_pending()
        self._pending = ((first, end, tuple(fields)), self._ahead.submit(self._read, first, end, fields))

    def _forget_pending(self) -> None:
        if self._pending is not None:
            _, future = self._pending
            self._pending = None
            if not future.cancel():
                future.exception()  # wait: its pages must not decode into a run nobody reads

    def read(self, first: int, end: int, fields: list[str]) -> pa.RecordBatch | None:
        """Row groups ``first..end-1`` of ``fields`` as one record batch, equal to what
        pyarrow's ``read_row_groups`` reads; None where the compiled decoder does not read the
        file (another type, codec or encoding, nulls); :class:`ValueError` naming the groups
        and the column for a damaged run."""
        if self._pending is not None and self._pending[0] == (first, end, tuple(fields)):
            _, future = self._pending
            self._pending = None
            return future.result()
        self._forget_pending()
        return self._read(first, end, fields)

    def _read(self, first: int, end: int, fields: list[str]) -> pa.RecordBatch | None:
        layouts = self._layouts_of(fields)
        if layouts is None:
            return None
        footer = self._footers[tuple(fields)]
        groups = range(first, end)
        try:
            arrays = self._read_bulk(layouts, footer, groups)
        except (_NotBulk, _Unsupported, _Corrupt):  # the cursors read it again, and judge
            return self._read_paged(first, end, layouts, footer, fields)
        return pa.RecordBatch.from_arrays(arrays, schema=self._schema(fields))

    def _schema(self, fields: list[str]) -> pa.Schema:
        return pa.schema([self.pf.schema_arrow.field(name) for name in fields])

    def _read_bulk(self, layouts: list[_ColumnLayout], footer: Footer, groups: range) -> list[pa.Array]:
        """The run's columns, every page header read by one compiled walk and the pages decoded
        chunk by chunk on both threads, straight into one array per column."""
        columns = [[footer.chunk(g, layout.leaf) for g in groups] for layout in layouts]
        if any(chunk.codec not in _CODECS for chunks in columns for chunk in chunks):
            raise _NotBulk
        spans = sorted((_chunk_span(chunk), i, j) for i, chunks in enumerate(columns) for j, chunk in enumerate(chunks))
        raw, at = _read_spans(self.fd, self.file_size, [span for span, _, _ in spans])
        lo = np.array(at, dtype=np.int64)
        hi = lo + np.array([end - start for (start, end), _, _ in spans], dtype=np.int64)
        table = pages.walk(raw, lo, hi)
        if table is None:
            raise _NotBulk
        table = table.tolist()
        rows_of = [[] for _ in spans]
        for row in table:
            rows_of[row[pages.CHUNK]].append(row)
        where = {(i, j): k for k, (_, i, j) in enumerate(spans)}
        group_rows = footer.group_rows[groups.start:groups.stop].tolist()  # >= 0: footer_problem
        row_at = np.concatenate([[0], np.cumsum(group_rows)]).tolist()
        view = memoryview(raw)
        outputs, work = [], []
        for i, (layout, chunks) in enumerate(zip(layouts, columns)):
            planned, sizes, value_at = [], [], 0
            for j, chunk in enumerate(chunks):
                rows = rows_of[where[i, j]]
                if any(row[pages.PAGE_TYPE] != thrift.DATA_PAGE or row[pages.ENCODING] not in _PLAIN_VALUES
                       for row in rows):
                    raise _NotBulk  # dictionary pages, data pages v2: packer writes Bridge's files with neither
                levels = sum(row[pages.NUM_VALUES] for row in rows)
                if levels != chunk.num_values:
                    raise _NotBulk
                planned.append(_Chunk(chunk.codec, rows, value_at, row_at[j], group_rows[j]))
                sizes.append(chunk.end - chunk.start)
                value_at += levels
            values = np.empty(value_at, dtype=layout.value_dtype)
            lengths = np.empty(row_at[-1], dtype=np.int64)
            outputs.append((layout, values, lengths))
            work += [(sum(chunk.end - chunk.start for chunk in chunks), layout, part, values, lengths)
                     for part in _halves(planned, sizes)]
        work.sort(key=lambda unit: -unit[0])  # the largest first, so both threads finish together
        futures = [self.pool.submit(_decode_chunks, layout, part, view, values, lengths)
                   for _, layout, part, values, lengths in work]
        for future in futures:
            future.result()
        arrays = []
        for layout, values, lengths in outputs:
            offsets = np.zeros(lengths.size + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            arrays.append(_list_array(layout, offsets, values))
        return arrays

    def _read_paged(self, first: int, end: int, layouts, footer: Footer, fields) -> pa.RecordBatch | None:
        """The run read by one page-at-a-time cursor per column."""
        group_rows = footer.group_rows[first:end].tolist()
        cursors: list[_ColumnCursor] = []
        try:
            for layout in layouts:
                cursors.append(_ColumnCursor(self.fd, self.file_size, layout,
                                             [footer.chunk(g, layout.leaf) for g in range(first, end)], group_rows,
                                             self.pool))
            for cursor in cursors:  # start every column's pages decoding before waiting on any
                _named(cursor, cursor._read_ahead)
            arrays = [_list_array(cursor.layout, *_named(cursor, cursor.take, sum(group_rows))) for cursor in cursors]
            for cursor in cursors:
                _named(cursor, cursor.finish)
        except _Unsupported:
            return None
        except _Corrupt as exc:
            raise ValueError(f"row groups {first}-{end - 1}: {exc}") from None
        finally:
            for cursor in cursors:
                cursor.cancel()
        return pa.RecordBatch.from_arrays(arrays, schema=self._schema(fields))

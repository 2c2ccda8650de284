"""A compiled Parquet decoder for the columns packer reads: lists of integers.

Tokenized SFT data is one or two ``list<int>`` columns (``input_ids``, ``loss_mask``/``labels``),
and decoding them is most of what ``packer pack`` spends on a Parquet input. pyarrow's general
decoder walks the repetition and definition levels value by value; here they are decoded run by
run (a row of 500 tokens is typically one run of repetition level 1), so the work per token is
the dictionary lookup or the plain copy, in compiled code without the GIL.

:class:`ListColumnReader` yields record batches equal to what pyarrow reads. It decodes itself
what it fully understands — ``list``/``large_list`` of integers without nulls, data pages v1 and
v2, PLAIN and dictionary encodings, uncompressed, Snappy, Zstandard or gzip pages — and hands
the rest of the file to pyarrow the moment anything else appears (a null, another encoding or
codec, another type), so the output never depends on which decoder ran. Corrupt pages raise
:class:`ValueError` naming the row group and column; nothing is read out of bounds.

Set ``PACKER_PARQUET_DECODER=arrow`` to use pyarrow throughout.

Two known differences from pyarrow, both on files pyarrow itself mishandles: pyarrow's writer
can put an empty data page first in a chunk (one-row row groups with ``data_page_size=1`` and
dictionary encoding), and pyarrow then reads those rows as absent although the footer counts
them; this decoder returns them. And where pyarrow takes over on a damaged file, the result is
what its ``iter_batches`` returns, which on some damaged files differs from ``read_table``.
"""
from __future__ import annotations

import mmap
import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packer_cli._arrow import from_numpy, memory_pool, numpy_dtype
from packer_cli.sources import _parquet_thrift as thrift
from packer_cli.sources._parquet_kernels import (EMPTY_CONTINUES, EMPTY_HAS_VALUES, LEVEL_ABOVE_MAX, MESSAGES, NULLS,
                                                 TRUNCATED, UNUSUAL, dictionary_decode, hybrid_decode,
                                                 level_checks, levels_all_equal, repetition_rows,
                                                 row_lengths)

ENV_DECODER = "PACKER_PARQUET_DECODER"
PARQUET_BUFFER = 4 << 20  # pyarrow's page-stream read size when it decodes
_HEADER_PROBE = 1 << 10  # bytes read for a page header; retried with more if it is longer
_MAX_HEADER = 16 << 20
PAGES_AHEAD = 3  # pages of each column decoding ahead of the rows taken...
AHEAD_BYTES = 32 << 20  # ...unless they already hold this many values' bytes (files of huge pages)
SLAB_BYTES = 16 << 20  # consecutive pages decode into one array of up to this size (see _ColumnCursor)
_CODECS = ("UNCOMPRESSED", "SNAPPY", "ZSTD", "GZIP")
_MAP_PAYLOAD = 256 << 10  # page payloads this large are mapped, smaller ones read


class _Unsupported(Exception):
    """Something the compiled decoder does not handle: pyarrow takes over from here."""


class _Corrupt(ValueError):
    pass


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
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _leaf_count(t.value_type)
    return 1


def _column_layouts(pf: pq.ParquetFile, fields: list[str]) -> list[_ColumnLayout]:
    """The layout of every requested field, or :class:`_Unsupported` saying why one is not ours."""
    arrow = pf.schema_arrow
    first_leaf, leaf = {}, 0
    for f in arrow:
        first_leaf[f.name] = leaf
        leaf += _leaf_count(f.type)
    if leaf != len(pf.schema) or len(set(arrow.names)) != len(arrow.names):
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


def _decompress(codec: str, data: bytes, size: int) -> bytes | pa.Buffer:
    """Decompress one page, checking that it yields exactly ``size`` bytes."""
    if size < 0:
        raise _Corrupt("page sizes are inconsistent")
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
            import zstandard

            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
        else:  # GZIP: zlib or gzip framing
            out = zlib.decompress(data, wbits=47)
    except (_Corrupt, _Unsupported):
        raise
    except Exception as exc:  # each codec library raises its own error types
        raise _Corrupt(f"page does not decompress ({codec.lower()}: {exc})") from None
    if len(out) != size:
        raise _Corrupt("page does not decompress to its stated size")
    return out


class _ChunkPages:
    """The pages of one column chunk, one at a time: (header, payload).

    Headers are read with ``pread``. A large payload is a view of its own read-only memory map of
    the file (unmapped once the last view of it goes): the decompressor and the kernels read the
    page cache directly, where a ``pread`` would copy every page into a fresh allocation. Only the
    pages in flight are mapped, so resident memory stays bounded however large the row groups.
    (As with any memory map, a file truncated by another process while it is being read ends
    the process with SIGBUS where a ``pread`` would have come up short.)
    """

    def __init__(self, fd: int, chunk: pq.ColumnChunkMetaData, file_size: int):
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
            start = chunk.dictionary_page_offset
        self.fd, self.pos, self.end = fd, start, start + chunk.total_compressed_size
        self.file_size = file_size
        if start < 0 or chunk.total_compressed_size < 0:
            raise _Corrupt("column chunk has a negative offset or size")

    def next(self) -> tuple[thrift.PageHeader, bytes | memoryview]:
        probe = _HEADER_PROBE
        while True:
            raw = os.pread(self.fd, min(probe, self.end - self.pos), self.pos)
            try:
                header = thrift.parse_page_header(raw)
                break
            except thrift.ThriftError as exc:
                if not thrift.is_truncated(exc) or len(raw) < probe or probe >= _MAX_HEADER:
                    raise _Corrupt(str(exc)) from None
                probe *= 16
        start = self.pos + header.size
        size = header.compressed_size
        if start + size > self.end:
            raise _Corrupt("page runs past its column chunk")
        if start + size > self.file_size:
            raise _Corrupt("file ends inside a page")
        self.pos = start + size
        if size >= _MAP_PAYLOAD:
            base = start - start % mmap.ALLOCATIONGRANULARITY
            try:
                view = memoryview(mmap.mmap(self.fd, start + size - base, prot=mmap.PROT_READ, offset=base))
                return header, view[start - base:]
            except OSError:  # a file system that cannot map files: read the page instead
                pass
        return header, os.pread(self.fd, size, start)


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


def _decode_values(layout: _ColumnLayout, header: thrift.PageHeader, span, count: int,
                   dictionary: np.ndarray | None, out: np.ndarray) -> np.ndarray:
    """The page's ``count`` values, decoded into ``out[:count]``."""
    data, lo, hi = span
    out = out[:count]
    if header.encoding == thrift.PLAIN:
        width = layout.physical_dtype.itemsize
        if lo + count * width > hi:
            raise _Corrupt("page is shorter than its values")
        if lo + count * width < hi:
            _check(UNUSUAL)
        np.copyto(out, data[lo:lo + count * width].view(layout.physical_dtype), casting="unsafe")  # wraps like pyarrow's cast
        return out
    if count:
        if dictionary is None:
            raise _Corrupt("dictionary-encoded page without a dictionary")
        if lo >= hi:
            raise _Corrupt(MESSAGES[TRUNCATED])
        _check(dictionary_decode(data, lo + 1, hi, int(data[lo]), count, dictionary, out))
    return out


def _decode_page(layout: _ColumnLayout, codec: str, header: thrift.PageHeader, payload: bytes,
                 dictionary: np.ndarray | None, out: np.ndarray) -> _Page:
    """Decode one data page on its own (no state from other pages: pages decode in parallel),
    its values into ``out`` (room for ``header.num_values``)."""
    if header.encoding not in (thrift.PLAIN, thrift.PLAIN_DICTIONARY, thrift.RLE_DICTIONARY):
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
    """Decoded rows of one column chunk: ``take(rows)`` → (offsets, values).

    Pages are read in order on the caller's thread and decoded up to ``PAGES_AHEAD`` ahead
    (fewer when those already hold ``AHEAD_BYTES`` of values) on ``pool`` (the kernels release the GIL, so two columns' pages, or one column's next pages,
    decode on both cores); their rows are then stitched together in order here.

    Each page decodes straight into the next free stretch of a *slab*, an array shared by
    consecutive pages (up to ``SLAB_BYTES``, and no larger than the chunk's values), so the
    values of a batch usually lie side by side already and ``take`` hands out a view of them;
    only a batch that crosses into a new slab, or past a page with empty lists, is copied. A
    slab is freed when the last batch viewing it is.
    """

    def __init__(self, fd: int, file_size: int, layout: _ColumnLayout, chunk: pq.ColumnChunkMetaData,
                 pool: ThreadPoolExecutor):
        if chunk.compression not in _CODECS:
            raise _Unsupported(f"column '{layout.name}' is compressed with {chunk.compression}")
        self.layout, self.codec, self.pool = layout, chunk.compression, pool
        self.pages = _ChunkPages(fd, chunk, file_size)
        self.levels_unread = chunk.num_values  # level entries (values and empty lists) not yet read
        self.dictionary: np.ndarray | None = None
        self.decoding: deque = deque()  # (level count, slab, start, future of _Page), in page order
        self.ahead_values = 0  # level entries of the pages in ``decoding`` (a bound on their values)
        self.lengths: list[np.ndarray] = []  # lengths of complete rows not yet taken
        self.rows_ready = 0
        self.open_length = -1  # length so far of the row the last page left open (-1: none)
        self.values: deque = deque()  # [slab, start, stop] runs of values not yet taken, in order
        self.slab: np.ndarray | None = None  # where the next page decodes, from ``slab_used`` on
        self.slab_used = 0

    def _read_ahead(self) -> None:
        while self.levels_unread and len(self.decoding) < PAGES_AHEAD and (
                not self.decoding or self.ahead_values * self.layout.value_dtype.itemsize < AHEAD_BYTES):
            header, payload = self.pages.next()
            if header.page_type == thrift.DICTIONARY_PAGE:
                self.dictionary = _read_dictionary(self.layout, self.codec, header, payload)
            elif header.page_type in (thrift.DATA_PAGE, thrift.DATA_PAGE_V2):
                if header.num_values > self.levels_unread:
                    raise _Corrupt("pages hold more values than the column chunk")
                slab, start = self._reserve(header.num_values)
                self.levels_unread -= header.num_values
                self.ahead_values += header.num_values
                self.decoding.append((header.num_values, slab, start, self.pool.submit(
                    _decode_page, self.layout, self.codec, header, payload, self.dictionary,
                    slab[start:start + header.num_values])))
            # index pages (and page types from the future) carry nothing we need

    def _next_page(self) -> bool:
        """Take in the next decoded page's rows; False once the chunk has no more pages."""
        self._read_ahead()
        if not self.decoding:
            return False
        levels, slab, start, future = self.decoding.popleft()
        self.ahead_values -= levels
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

    def take(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``rows`` rows: (int64 offsets from 0, values)."""
        while self.rows_ready < rows:
            if not self._next_page():
                if self.open_length >= 0:  # the chunk's last row ends with the chunk
                    self._complete(np.array([self.open_length], dtype=np.int64))
                    self.open_length = -1
                    continue
                raise _Corrupt("column chunk holds fewer rows than its row group")
        lengths = np.concatenate(self.lengths) if len(self.lengths) != 1 else self.lengths[0]
        taken, rest = lengths[:rows], lengths[rows:]
        self.lengths = [rest] if rest.size else []
        self.rows_ready -= rows
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(taken, out=offsets[1:])
        return offsets, self._take_values(int(offsets[-1]))

    def finish(self) -> None:
        """Check that the chunk ends where its row group does."""
        while self._next_page():
            pass
        if self.rows_ready or self.open_length >= 0:
            raise _Corrupt("column chunk holds more rows than its row group")

    def cancel(self) -> None:
        for *_, future in self.decoding:
            future.cancel()


def _named(cursor: _ColumnCursor, step, *args):
    """Run one step of a column's cursor, naming the column in any corruption it finds."""
    try:
        return step(*args)
    except _Corrupt as exc:
        raise _Corrupt(f"column '{cursor.layout.name}': {exc}") from None


def _list_array(layout: _ColumnLayout, offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    if pa.types.is_large_list(layout.arrow_type):
        return pa.LargeListArray.from_arrays(from_numpy(offsets), from_numpy(values), type=layout.arrow_type)
    if offsets[-1] >= 2**31:
        raise _Unsupported("a batch holds more than 2^31 values")
    return pa.ListArray.from_arrays(from_numpy(offsets.astype(np.int32)), from_numpy(values), type=layout.arrow_type)


# --- the reader -------------------------------------------------------------------------------

class ListColumnReader:
    """Record batches (1..``batch_rows`` rows) of ``fields`` of one Parquet file.

    ``fast_rows`` and ``arrow_rows`` count the rows each decoder produced; ``fallback_reason``
    says why pyarrow took over (None while the compiled decoder reads everything).
    """

    def __init__(self, path: str, fields: list[str], batch_rows: int = 2048, *, arrow_only: bool = False):
        self.path, self.fields, self.batch_rows = path, list(fields), max(1, batch_rows)
        self.arrow_only = arrow_only  # pyarrow throughout (``verify --source`` wants a second opinion)
        self.fast_rows = self.arrow_rows = 0
        self.fallback_reason: str | None = None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        # When pyarrow decodes, it streams pages too: its pre-buffering reads far ahead (hundreds
        # of MB) and an unbuffered read holds a whole column chunk (gigabytes in a file of
        # million-row groups).
        pf = pq.ParquetFile(self.path, pre_buffer=False, buffer_size=PARQUET_BUFFER)
        try:
            if self.arrow_only:
                raise _Unsupported("pyarrow asked for")
            if os.environ.get(ENV_DECODER, "").lower() == "arrow":
                raise _Unsupported(f"{ENV_DECODER}=arrow")
            layouts = _column_layouts(pf, self.fields)
        except _Unsupported as exc:
            self.fallback_reason = str(exc)
            yield from self._arrow(pf, 0, 0)
            return
        schema = pa.schema([pf.schema_arrow.field(name) for name in self.fields])
        fd = os.open(self.path, os.O_RDONLY)
        file_size = os.fstat(fd).st_size
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="packer-parquet")
        try:
            for group in range(pf.metadata.num_row_groups):
                done = 0
                try:
                    for batch in self._row_group(fd, file_size, pf, group, layouts, schema, pool):
                        done += batch.num_rows
                        self.fast_rows += batch.num_rows
                        yield batch
                except _Unsupported as exc:
                    self.fallback_reason = str(exc)
                    yield from self._arrow(pf, group, done)
                    return
                except _Corrupt as exc:
                    raise ValueError(f"row group {group}: {exc}") from None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            os.close(fd)

    def _row_group(self, fd, file_size: int, pf, group: int, layouts, schema, pool) -> Iterator[pa.RecordBatch]:
        meta = pf.metadata.row_group(group)
        cursors = [_ColumnCursor(fd, file_size, layout, meta.column(layout.leaf), pool) for layout in layouts]
        try:
            done = 0
            while done < meta.num_rows:
                rows = min(self.batch_rows, meta.num_rows - done)
                for cursor in cursors:  # start every column's pages decoding before waiting on any
                    _named(cursor, cursor._read_ahead)
                arrays = [_list_array(cursor.layout, *_named(cursor, cursor.take, rows)) for cursor in cursors]
                done += rows
                yield pa.RecordBatch.from_arrays(arrays, schema=schema)
            for cursor in cursors:
                _named(cursor, cursor.finish)
        finally:
            for cursor in cursors:
                cursor.cancel()

    def _arrow(self, pf: pq.ParquetFile, group: int, skip: int) -> Iterator[pa.RecordBatch]:
        """pyarrow's batches from row group ``group`` on, less the first ``skip`` rows (already yielded)."""
        pool = pa.default_memory_pool()
        k = 0
        for g in range(group, pf.metadata.num_row_groups):  # one group at a time, to name a damaged one
            try:
                for batch in self._arrow_group(pf, g, skip if g == group else 0):
                    yield batch
                    k += 1
                    if k % 16 == 0:
                        pool.release_unused()  # the allocator otherwise keeps freed decode buffers
            except (pa.ArrowException, OSError) as exc:
                raise ValueError(f"row group {g}: {str(exc).strip() or type(exc).__name__}") from None
        pool.release_unused()

    def _arrow_group(self, pf: pq.ParquetFile, group: int, skip: int) -> Iterator[pa.RecordBatch]:
        for batch in pf.iter_batches(batch_size=self.batch_rows, row_groups=[group], columns=self.fields):
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            if skip:
                batch, skip = batch.slice(skip), 0
            self.arrow_rows += batch.num_rows
            yield batch

"""Encode list-of-integer columns as a Parquet file directly: the pages of Bridge's layout.

A Bridge split's file is six list columns of integers with no nulls. Encoding them is simple
once the values are laid out flat, and pyarrow's writer did it at a cost: for every value it
builds a repetition and a definition level, then run-length encodes the levels back into what a
list of lengths says in the first place (on the benchmark input it spent 4.0-4.3 s of CPU where
this module spends 1.9-2.2 s, most of that Zstandard). Here a data page (version 1) is built as:

    4-byte length | repetition levels | 4-byte length | definition levels | values

with the levels as RLE runs made from the row lengths by one compiled pass (repetition levels:
"0", then ``n - 1`` times "1" for a row of ``n`` values; definition levels: one run of the
present value's level, merged across rows),
the values as their plain little-endian bytes (or split into byte streams for
``BYTE_STREAM_SPLIT``), and the page compressed in one call. The footer is pyarrow's own for
the schema (a pyarrow writer opened and closed without rows, once per schema: the Parquet
schema, the Arrow schema in the key-value metadata, column orders), with the row groups this
module wrote in place of none, so readers see the types pyarrow would give them.

Pages hold whole rows (a row longer than a page gets a page of its own), as pyarrow's writer
keeps them, so readers that read a row group's pages one at a time never stitch rows.
"""
from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pyarrow as pa

from packer_cli._kernel_cache import njit
from packer_cli._thrift import BINARY, I32, I64, LIST, STRUCT, _put_varint
from packer_cli.shards._parquet_stitch import ParquetStitcher, _field, _parse

#: Values per page, in bytes before compression (pyarrow's default data page size).
PAGE_BYTES = 1 << 20

# parquet.thrift enums
_INT32, _INT64 = 1, 2
_PLAIN, _RLE, _BYTE_STREAM_SPLIT = 0, 3, 9
_DATA_PAGE = 0
_CODECS = {"uncompressed": 0, "snappy": 1, "zstd": 6}
_REQUIRED = 0
_CREATED_BY = 6  # FileMetaData field

_THREAD = threading.local()


def _zstd_compress(level: int):
    """This thread's Zstandard compressor's ``compress`` (one may not be shared by threads)."""
    compressors = getattr(_THREAD, "zstd", None)
    if compressors is None:
        compressors = _THREAD.zstd = {}
    compress = compressors.get(level)
    if compress is None:
        import zstandard

        compress = compressors[level] = zstandard.ZstdCompressor(level=level).compress
    return compress


def _compressor(codec: str, level: int | None):
    if codec == "zstd":
        return _zstd_compress(1 if level is None else level)
    if codec == "snappy":
        snappy = pa.Codec("snappy")
        return lambda data: snappy.compress(data, asbytes=True)
    if codec == "uncompressed":
        return bytes
    raise ValueError(f"codec {codec!r} is not one packer encodes")


# -- levels ----------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _put_run(out, pos, count, value):
    """One RLE run (bit width <= 8, so its value is one byte); merged runs come in whole."""
    header = count << 1
    while header >= 0x80:
        out[pos] = (header & 0x7F) | 0x80
        header >>= 7
        pos += 1
    out[pos] = header
    out[pos + 1] = value
    return pos + 2


@njit(cache=True, nogil=True)
def _push(out, pos, run_value, run_count, value, count):
    """Add ``count`` levels of ``value`` to the open run, or write the open run and start
    another: ``(pos, run_value, run_count)`` after it."""
    if value == run_value:
        return pos, run_value, run_count + count
    if run_count:
        pos = _put_run(out, pos, run_count, run_value)
    return pos, value, count


@njit(cache=True, nogil=True)
def _page_levels(lengths, full_level, empty_level, out):
    """A v1 data page's level sections for rows of ``lengths``: the repetition levels' byte
    length (4 bytes, little-endian) and RLE runs, then the definition levels' the same way.

    A row of ``n > 0`` values has repetition levels ``0`` then ``n - 1`` times ``1``, and
    definition level ``full_level`` for each value; an empty row has one ``0`` and one
    ``empty_level``. Equal neighbours merge into one run. ``out`` needs ``18 * rows + 8`` bytes.
    Returns the bytes written.
    """
    pos = 0
    for section in range(2):
        start = pos
        pos += 4
        value, count = -1, 0
        for k in range(lengths.size):
            n = lengths[k]
            if section == 0:
                pos, value, count = _push(out, pos, value, count, 0, 1)
                if n > 1:
                    pos, value, count = _push(out, pos, value, count, 1, n - 1)
            else:
                pos, value, count = _push(out, pos, value, count, full_level if n > 0 else empty_level, max(n, 1))
        if count:
            pos = _put_run(out, pos, count, value)
        size = pos - start - 4
        for b in range(4):
            out[start + b] = (size >> (8 * b)) & 0xFF
    return pos


# -- the footer ------------------------------------------------------------------------------
class _Leaf:
    """What encoding one column needs from the Parquet schema pyarrow derived."""

    def __init__(self, name: str, physical: int, full_level: int, empty_level: int):
        self.name = name
        self.physical = physical
        self.dtype = np.dtype("<i4" if physical == _INT32 else "<i8")
        self.full_level = full_level
        self.empty_level = empty_level
        self.path = [name.encode(), b"list", b"element"]


def _template(schema: pa.Schema) -> tuple[list, tuple[_Leaf, ...]]:
    """pyarrow's footer for ``schema`` with no row groups, and each leaf column's layout."""
    # cached by the serialized schema: schemas compare equal whatever their metadata (the EOS id)
    return _template_of(schema.serialize().to_pybytes())


@lru_cache(maxsize=8)
def _template_of(serialized: bytes) -> tuple[list, tuple[_Leaf, ...]]:
    import pyarrow.parquet as pq

    from packer_cli import __version__

    schema = pa.ipc.read_schema(pa.py_buffer(serialized))

    for field in schema:
        if not (pa.types.is_list(field.type) and pa.types.is_integer(field.type.value_type)):
            raise ValueError(f"column {field.name}: only lists of integers are encoded here")
    sink = pa.BufferOutputStream()
    pq.ParquetWriter(sink, schema).close()  # no row groups: the codec and encodings leave no trace
    _, _, footer = _parse(sink.getvalue())
    # created_by names the writer of the pages (readers key workarounds for known writer bugs
    # on it); the rest (schema, key-value metadata, column orders) stays pyarrow's
    footer = [(fid, kind, f"packer-cli version {__version__}".encode() if fid == _CREATED_BY else value)
              for fid, kind, value in footer]
    elements = [dict((fid, value) for fid, _, value in element) for element in _field(footer, 2)[1]]
    leaves, k = [], 1
    for field in schema:
        outer, group, leaf = elements[k:k + 3]
        if outer.get(4) != field.name.encode() or leaf.get(1) not in (_INT32, _INT64):
            raise ValueError(f"column {field.name}: not the three-level list pyarrow writes")
        optional = [e.get(3, _REQUIRED) != _REQUIRED for e in (outer, group, leaf)]  # group: REPEATED
        leaves.append(_Leaf(field.name, leaf[1], sum(optional), int(optional[0])))
        k += 3
    return footer, tuple(leaves)


# -- pages -----------------------------------------------------------------------------------
def _page_header(uncompressed: int, compressed: int, num_values: int, encoding: int) -> bytes:
    """A DATA_PAGE ``PageHeader`` in the compact protocol (no statistics, no checksum)."""
    head = bytearray(b"\x15\x00\x15")  # 1: type i32 = DATA_PAGE (zigzag 0), 2: uncompressed size
    _put_varint(head, uncompressed << 1)
    head.append(0x15)  # 3: compressed size
    _put_varint(head, compressed << 1)
    head.append(0x2C)  # 5: data_page_header (struct, delta 2)
    head.append(0x15)  # 1: num_values
    _put_varint(head, num_values << 1)
    head += bytes((0x15, encoding << 1, 0x15, _RLE << 1, 0x15, _RLE << 1, 0x00, 0x00))  # 2-4, stops
    return bytes(head)


def _page_rows(values_start: np.ndarray, width: int) -> list[int]:
    """Row boundaries of pages of about :data:`PAGE_BYTES` of values, whole rows each."""
    bounds, first, rows = [0], 0, values_start.size - 1
    while first < rows:
        limit = values_start[first] + PAGE_BYTES // width
        end = int(np.searchsorted(values_start, limit, side="right")) - 1
        end = max(end, first + 1)
        bounds.append(min(end, rows))
        first = bounds[-1]
    return bounds


class _Chunk:
    """A column chunk's pages as they are appended to the file, and its footer entry."""

    def __init__(self, leaf: _Leaf, codec: int, value_encoding: int, offset: int):
        self.leaf, self.codec, self.value_encoding = leaf, codec, value_encoding
        self.offset = offset  # of its first page, within the part's pages
        self.parts: list[bytes] = []
        self.num_values = self.uncompressed = self.compressed = self.pages = 0

    def add_page(self, lengths: np.ndarray, values: np.ndarray, compress) -> None:
        levels = np.empty(18 * lengths.size + 8, dtype=np.uint8)
        used = _page_levels(lengths, self.leaf.full_level, self.leaf.empty_level, levels)
        width = self.leaf.dtype.itemsize
        body = np.empty(used + values.size * width, dtype=np.uint8)
        body[:used] = levels[:used]
        if self.value_encoding == _BYTE_STREAM_SPLIT:  # stream k: byte k of every value
            values = np.ascontiguousarray(values, dtype=self.leaf.dtype)
            body[used:].reshape(width, -1)[...] = values.view(np.uint8).reshape(-1, width).T
        else:  # cast (an int8 mask stored as INT32) while copying, unaligned or not
            body[used:].view(self.leaf.dtype)[...] = values
        data = compress(body)
        levels = values.size + int(np.count_nonzero(lengths == 0))  # an empty row still has one
        header = _page_header(body.size, len(data), levels, self.value_encoding)
        self.parts += (header, data)
        self.num_values += levels
        self.uncompressed += len(header) + body.size
        self.compressed += len(header) + len(data)
        self.pages += 1

    def entry(self, shift: int) -> list:
        """The chunk's footer entry (``ColumnChunk``), its pages moved by ``shift`` bytes."""
        meta = [
            (1, I32, self.leaf.physical),
            (2, LIST, (I32, [_RLE, self.value_encoding])),
            (3, LIST, (BINARY, self.leaf.path)),
            (4, I32, self.codec),
            (5, I64, self.num_values),
            (6, I64, self.uncompressed),
            (7, I64, self.compressed),
            (9, I64, self.offset + shift),
            (13, LIST, (STRUCT, [[(1, I32, _DATA_PAGE), (2, I32, self.value_encoding), (3, I32, self.pages)]])),
        ]
        return [(2, I64, 0), (3, STRUCT, meta)]


@dataclass
class _Group:
    """A row group's footer entry, waiting for where its part lands in the file."""

    rows: int
    start: int  # within the part's pages
    chunks: list[_Chunk]

    def entry(self, shift: int) -> list:
        """The ``RowGroup`` struct with every position moved by ``shift`` bytes.

        The optional ``ordinal`` is left out, as pyarrow leaves it out: it is an i16, and
        readers on Thrift's C++ or Java libraries read a split's row group 32768 as -32768.
        """
        return [
            (1, LIST, (STRUCT, [chunk.entry(shift) for chunk in self.chunks])),
            (2, I64, sum(chunk.uncompressed for chunk in self.chunks)), (3, I64, self.rows),
            (5, I64, self.start + shift), (6, I64, sum(chunk.compressed for chunk in self.chunks)),
        ]


@dataclass
class EncodedPart:
    """Row groups encoded apart from the file they go into: their pages laid end to end, what
    their footer entries need, and the schema's footer. :class:`~packer_cli.shards.
    _parquet_stitch.ParquetStitcher` appends one to a file without parsing anything."""

    pages: bytes
    rows: int
    groups: list[_Group]
    footer: list  # the schema's FileMetaData fields, no row groups

    def file_bytes(self) -> bytes:
        """The part as a complete Parquet file of its own."""
        out = io.BytesIO()
        stitcher = ParquetStitcher(out)
        stitcher.add_encoded(self)
        stitcher.finish()
        return out.getvalue()


def encode_list_columns(columns: list[tuple[np.ndarray, np.ndarray]], schema: pa.Schema, row_group_size: int,
                        encoding: dict) -> EncodedPart:
    """``columns`` (each ``(row offsets, flat values)``, the same rows) as Parquet row groups of
    ``row_group_size`` rows, as ``encoding`` (one of :data:`~packer_cli.shards.bridge_writer.
    PARQUET_ENCODINGS`) says: a codec, and which columns' values are split into byte streams."""
    footer, leaves = _template(schema)
    if len(columns) != len(leaves):
        raise ValueError(f"{len(columns)} columns for a schema of {len(leaves)}")
    codec = _CODECS[encoding.get("compression", "uncompressed")]
    compress = _compressor(encoding.get("compression", "uncompressed"), encoding.get("compression_level"))
    split = {path.split(".")[0] for path in encoding.get("use_byte_stream_split", ())}
    rows = columns[0][0].size - 1
    pages: list[bytes] = []
    groups, position = [], 0
    for first in range(0, rows, row_group_size):
        end = min(first + row_group_size, rows)
        group = _Group(end - first, position, [])
        for (offsets, values), leaf in zip(columns, leaves):
            chunk = _Chunk(leaf, codec, _BYTE_STREAM_SPLIT if leaf.name in split else _PLAIN, position)
            starts = np.asarray(offsets[first:end + 1], dtype=np.int64)
            bounds = _page_rows(starts, leaf.dtype.itemsize)
            for a, b in zip(bounds, bounds[1:]):
                chunk.add_page(np.diff(starts[a:b + 1]), values[starts[a]:starts[b]], compress)
            pages += chunk.parts
            chunk.parts = []
            position += chunk.compressed
            group.chunks.append(chunk)
        groups.append(group)
    return EncodedPart(b"".join(pages), rows, groups, footer)

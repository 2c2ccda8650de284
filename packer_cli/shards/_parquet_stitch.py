"""Join Parquet files written apart into one file, so that its row groups can be encoded in parallel.

pyarrow's Parquet writer encodes a file's row groups one after another on the calling thread,
and encoding (dictionary, levels, Snappy) is most of the work of writing Bridge's layout. Yet a
Parquet file is only its row groups' pages laid end to end, then a footer (Thrift's compact
protocol) that says where each column chunk starts::

    PAR1 | pages of row group 0 | pages of row group 1 | ... | footer | footer length | PAR1

So each run of row groups is written by pyarrow as a small file of its own, on any thread, and
:class:`ParquetStitcher` appends the runs' pages in order and writes one footer listing all
their row groups, with every file offset moved by where the run's pages landed. Nothing else in
a footer depends on the position (the schema, key-value metadata, ``created_by`` and column
orders are the same for every run), so the result is byte for byte the file a single writer
makes of the same row groups (``tests/test_parquet_stitch.py`` holds it to that).

The footer is rewritten with a small typed reader and writer of the compact protocol: a struct
is a list of ``(field id, type, value)`` in their order, so fields this module does not know
pass through unchanged.
"""
from __future__ import annotations

import struct

MAGIC = b"PAR1"

# compact-protocol types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)

# Field ids (parquet.thrift) of the absolute file positions to move, per struct.
_FILE_ROWS, _FILE_ROW_GROUPS = 3, 4                       # FileMetaData
_GROUP_COLUMNS, _GROUP_FILE_OFFSET, _GROUP_ORDINAL = 1, 5, 7  # RowGroup
_CHUNK_META = 3                                           # ColumnChunk
_CHUNK_OFFSETS = (2, 4, 6)  # file_offset, offset_index_offset, column_index_offset
_META_OFFSETS = (9, 10, 11, 14)  # data_page, index_page, dictionary_page, bloom_filter offsets


class StitchError(ValueError):
    """A part that is not a complete Parquet file, or whose schema differs from the first part's."""


# -- the compact protocol, typed ------------------------------------------------------------
def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _put_varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _unzigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63)


def _read_value(buf, pos: int, kind: int):
    if kind in (_I16, _I32, _I64):
        raw, pos = _varint(buf, pos)
        return _zigzag(raw), pos
    if kind == _BINARY:
        n, pos = _varint(buf, pos)
        return bytes(buf[pos:pos + n]), pos + n
    if kind == _STRUCT:
        return read_struct(buf, pos)
    if kind in (_LIST, _SET):
        head = buf[pos]
        size, element = head >> 4, head & 0x0F
        pos += 1
        if size == 15:
            size, pos = _varint(buf, pos)
        items = []
        for _ in range(size):
            if element in (_TRUE, _FALSE):  # in a list a boolean takes a byte of its own
                items.append(buf[pos] == _TRUE)
                pos += 1
            else:
                item, pos = _read_value(buf, pos, element)
                items.append(item)
        return (element, items), pos
    if kind == _BYTE:
        return struct.unpack_from("<b", buf, pos)[0], pos + 1
    if kind == _DOUBLE:
        return struct.unpack_from("<d", buf, pos)[0], pos + 8
    raise StitchError(f"footer: unsupported Thrift type {kind}")  # maps: none in a Parquet footer


def read_struct(buf, pos: int = 0) -> tuple[list, int]:
    """The struct at ``buf[pos:]`` as ``[(field id, type, value), ...]`` and the position after it
    (a boolean field's value is its type: ``_TRUE`` or ``_FALSE``)."""
    fields, last = [], 0
    while True:
        head = buf[pos]
        pos += 1
        if head & 0x0F == 0:
            return fields, pos
        kind, delta = head & 0x0F, head >> 4
        if delta:
            field_id = last + delta
        else:
            raw, pos = _varint(buf, pos)
            field_id = _zigzag(raw)
        value = None
        if kind not in (_TRUE, _FALSE):
            value, pos = _read_value(buf, pos, kind)
        fields.append((field_id, kind, value))
        last = field_id


def _write_value(out: bytearray, kind: int, value) -> None:
    if kind in (_I16, _I32, _I64):
        _put_varint(out, _unzigzag(value) & 0xFFFFFFFFFFFFFFFF)
    elif kind == _BINARY:
        _put_varint(out, len(value))
        out += value
    elif kind == _STRUCT:
        write_struct(out, value)
    elif kind in (_LIST, _SET):
        element, items = value
        if len(items) < 15:
            out.append(len(items) << 4 | element)
        else:
            out.append(0xF0 | element)
            _put_varint(out, len(items))
        for item in items:
            if element in (_TRUE, _FALSE):
                out.append(_TRUE if item else _FALSE)
            else:
                _write_value(out, element, item)
    elif kind == _BYTE:
        out += struct.pack("<b", value)
    elif kind == _DOUBLE:
        out += struct.pack("<d", value)
    else:
        raise StitchError(f"footer: unsupported Thrift type {kind}")


def write_struct(out: bytearray, fields: list) -> None:
    """Append ``fields`` (as :func:`read_struct` returns them) in the compact protocol."""
    last = 0
    for field_id, kind, value in fields:
        delta = field_id - last
        if 0 < delta <= 15:
            out.append(delta << 4 | kind)
        else:
            out.append(kind)
            _put_varint(out, _unzigzag(field_id) & 0xFFFF)
        if kind not in (_TRUE, _FALSE):
            _write_value(out, kind, value)
        last = field_id
    out.append(0)


# -- moving row groups -----------------------------------------------------------------------
def _field(fields: list, field_id: int):
    for fid, _, value in fields:
        if fid == field_id:
            return value
    return None


def _replace(fields: list, field_id: int, value) -> list:
    return [(fid, kind, value if fid == field_id else old) for fid, kind, old in fields]


def _moved(fields: list, offsets: tuple[int, ...], shift: int) -> list:
    """``fields`` with the i64 fields named in ``offsets`` moved by ``shift`` (0: not set, kept)."""
    return [(fid, kind, value + shift if fid in offsets and kind == _I64 and value else value)
            for fid, kind, value in fields]


def _moved_chunk(chunk: list, shift: int) -> list:
    chunk = _moved(chunk, _CHUNK_OFFSETS, shift)
    meta = _field(chunk, _CHUNK_META)
    return chunk if meta is None else _replace(chunk, _CHUNK_META, _moved(meta, _META_OFFSETS, shift))


def _moved_group(group: list, shift: int, ordinal: int) -> list:
    moved = []
    for fid, kind, value in group:
        if fid == _GROUP_COLUMNS:
            value = (value[0], [_moved_chunk(chunk, shift) for chunk in value[1]])
        elif fid == _GROUP_FILE_OFFSET and value:
            value += shift
        elif fid == _GROUP_ORDINAL:
            value = ordinal
        moved.append((fid, kind, value))
    return moved


def split_file(data) -> tuple[memoryview, list]:
    """A complete Parquet file's pages (everything between the leading magic and the footer)
    and its parsed footer."""
    view = memoryview(data).cast("B")  # unsigned bytes, whatever the buffer's own format
    if len(view) < 12 or view[:4] != MAGIC or view[-4:] != MAGIC:
        raise StitchError("not a complete Parquet file")
    footer_len = int.from_bytes(view[-8:-4], "little")
    footer_start = len(view) - 8 - footer_len
    if footer_start < 4:
        raise StitchError("Parquet footer length out of range")
    try:
        footer, end = read_struct(view[footer_start:len(view) - 8])
    except (IndexError, struct.error) as exc:
        raise StitchError("Parquet footer cut short") from exc
    if end != footer_len:
        raise StitchError("Parquet footer does not end where its length says")
    return view[4:footer_start], footer


class ParquetStitcher:
    """Write whole Parquet files (same schema, same writer settings) into ``sink`` as one file.

    ``sink`` needs only ``write``. Call :meth:`add` with each part in order, then :meth:`finish`.
    """

    def __init__(self, sink):
        self._sink = sink
        self._position = len(MAGIC)
        self._first: list | None = None
        self._groups: list = []
        self._rows = 0
        sink.write(MAGIC)

    def add(self, part) -> None:
        pages, footer = split_file(part)
        if self._first is None:
            self._first = footer
        elif _schema(footer) != _schema(self._first):
            raise StitchError("Parquet parts have different schemas")
        shift = self._position - len(MAGIC)  # the part's own pages start right after its magic
        for group in _field(footer, _FILE_ROW_GROUPS)[1]:
            self._groups.append(_moved_group(group, shift, len(self._groups)))
        self._rows += _field(footer, _FILE_ROWS)
        self._sink.write(pages)
        self._position += len(pages)

    def finish(self) -> int:
        """Write the footer; returns the file's size in bytes."""
        if self._first is None:
            raise StitchError("no Parquet parts to join")
        element = _field(self._first, _FILE_ROW_GROUPS)[0]
        footer = _replace(_replace(self._first, _FILE_ROWS, self._rows), _FILE_ROW_GROUPS, (element, self._groups))
        out = bytearray()
        write_struct(out, footer)
        out += len(out).to_bytes(4, "little") + MAGIC
        self._sink.write(out)
        return self._position + len(out)


def _schema(footer: list):
    return _field(footer, 2), _field(footer, 5)  # schema elements, key-value metadata

"""Parquet page headers: a small reader for Thrift's compact protocol.

A Parquet column chunk is a run of pages, each preceded by a ``PageHeader`` struct encoded
with Thrift's compact protocol. The file footer is read by pyarrow; only the page headers,
one per page, are read here (a few hundred per file, so plain Python is fast enough).

The reader is generic (it decodes any struct into ``{field id: value}``) and strict: a header
that runs past its buffer, nests absurdly deep or uses an unknown type raises
:class:`ThriftError`, which callers turn into a one-line error naming the file.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

# PageType
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
# Encoding
PLAIN, PLAIN_DICTIONARY, RLE, BIT_PACKED, RLE_DICTIONARY = 0, 2, 3, 4, 8
ENCODING_NAMES = {0: "PLAIN", 2: "PLAIN_DICTIONARY", 3: "RLE", 4: "BIT_PACKED", 5: "DELTA_BINARY_PACKED",
                  6: "DELTA_LENGTH_BYTE_ARRAY", 7: "DELTA_BYTE_ARRAY", 8: "RLE_DICTIONARY", 9: "BYTE_STREAM_SPLIT"}

_MAX_DEPTH = 16


class ThriftError(ValueError):
    """A page header that cannot be decoded."""


class _Truncated(ThriftError):
    """The header runs past the bytes given (the caller may retry with more)."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise _Truncated("page header truncated")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ThriftError("page header: varint too long")


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _take(buf: bytes, pos: int, n: int) -> tuple[bytes, int]:
    if n < 0 or pos + n > len(buf):
        raise _Truncated("page header truncated")
    return buf[pos:pos + n], pos + n


def _value(buf: bytes, pos: int, kind: int, depth: int):
    if kind in (1, 2):  # a boolean field carries its value in the type nibble
        return kind == 1, pos
    if kind == 3:
        raw, pos = _take(buf, pos, 1)
        return struct.unpack("<b", raw)[0], pos
    if kind in (4, 5, 6):
        n, pos = _varint(buf, pos)
        return _zigzag(n), pos
    if kind == 7:
        raw, pos = _take(buf, pos, 8)
        return struct.unpack("<d", raw)[0], pos
    if kind == 8:
        n, pos = _varint(buf, pos)
        return _take(buf, pos, n)
    if kind in (9, 10):
        return _list(buf, pos, depth)
    if kind == 11:
        return _map(buf, pos, depth)
    if kind == 12:
        return read_struct(buf, pos, depth + 1)
    raise ThriftError(f"page header: unknown field type {kind}")


def _element(buf: bytes, pos: int, kind: int, depth: int):
    if kind in (1, 2):  # in a list a boolean takes one byte of its own
        raw, pos = _take(buf, pos, 1)
        return raw[0] == 1, pos
    return _value(buf, pos, kind, depth)


def _list(buf: bytes, pos: int, depth: int):
    head, pos = _take(buf, pos, 1)
    size, kind = head[0] >> 4, head[0] & 0x0F
    if size == 15:
        size, pos = _varint(buf, pos)
    if size > len(buf):  # every element takes at least one byte... except booleans packed in types
        raise _Truncated("page header truncated")
    items = []
    for _ in range(size):
        item, pos = _element(buf, pos, kind, depth + 1)
        items.append(item)
    return items, pos


def _map(buf: bytes, pos: int, depth: int):
    """A map, as a list of (key, value) pairs (keys may be unhashable structs or lists)."""
    size, pos = _varint(buf, pos)
    if size == 0:
        return [], pos
    if size > len(buf):
        raise _Truncated("page header truncated")
    head, pos = _take(buf, pos, 1)
    key_kind, value_kind = head[0] >> 4, head[0] & 0x0F
    pairs = []
    for _ in range(size):
        key, pos = _element(buf, pos, key_kind, depth + 1)
        value, pos = _element(buf, pos, value_kind, depth + 1)
        pairs.append((key, value))
    return pairs, pos


def read_struct(buf: bytes, pos: int = 0, depth: int = 0) -> tuple[dict, int]:
    """One compact-protocol struct at ``buf[pos:]``: ({field id: value}, position after it)."""
    if depth > _MAX_DEPTH:
        raise ThriftError("page header nests too deep")
    fields: dict = {}
    last = 0
    while True:
        head, pos = _take(buf, pos, 1)
        if head[0] & 0x0F == 0:  # STOP (Apache Thrift reads the type nibble alone, and so do we)
            return fields, pos
        kind, delta = head[0] & 0x0F, head[0] >> 4
        if delta:
            field_id = last + delta
        else:
            raw, pos = _varint(buf, pos)
            field_id = _zigzag(raw)
        fields[field_id], pos = _value(buf, pos, kind, depth)
        last = field_id


@dataclass(frozen=True)
class PageHeader:
    """What the decoder needs of one page header (field numbers from parquet.thrift)."""

    size: int  # bytes of the header itself
    page_type: int
    uncompressed_size: int
    compressed_size: int
    num_values: int = 0
    encoding: int = PLAIN
    def_encoding: int = RLE
    rep_encoding: int = RLE
    # data page v2 only
    def_bytes: int = 0
    rep_bytes: int = 0
    is_compressed: bool = True


def _int(fields: dict, key: int, what: str) -> int:
    value = fields.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ThriftError(f"page header: missing or invalid {what}")
    return value


def parse_page_header(buf: bytes) -> PageHeader:
    """Decode the page header at the start of ``buf`` (raises ``_Truncated`` if ``buf`` is too short)."""
    fields, size = read_struct(buf)
    page_type = _int(fields, 1, "page type")
    common = dict(size=size, page_type=page_type, uncompressed_size=_int(fields, 2, "uncompressed size"),
                  compressed_size=_int(fields, 3, "compressed size"))
    if page_type == DATA_PAGE:
        sub = fields.get(5)
        if not isinstance(sub, dict):
            raise ThriftError("page header: data page without its header")
        return PageHeader(**common, num_values=_int(sub, 1, "value count"), encoding=_int(sub, 2, "encoding"),
                          def_encoding=_int(sub, 3, "level encoding"), rep_encoding=_int(sub, 4, "level encoding"))
    if page_type == DATA_PAGE_V2:
        sub = fields.get(8)
        if not isinstance(sub, dict):
            raise ThriftError("page header: data page v2 without its header")
        return PageHeader(**common, num_values=_int(sub, 1, "value count"), encoding=_int(sub, 4, "encoding"),
                          def_bytes=_int(sub, 5, "level length"), rep_bytes=_int(sub, 6, "level length"),
                          is_compressed=sub.get(7, True) is not False)
    if page_type == DICTIONARY_PAGE:
        sub = fields.get(7)
        if not isinstance(sub, dict):
            raise ThriftError("page header: dictionary page without its header")
        return PageHeader(**common, num_values=_int(sub, 1, "value count"), encoding=_int(sub, 2, "encoding"))
    return PageHeader(**common)  # index pages and unknown types are skipped by size


def is_truncated(exc: ThriftError) -> bool:
    return isinstance(exc, _Truncated)

"""Thrift's compact protocol, in which Parquet encodes its page headers and its footer.

Two views of a struct, from one strict reader:

* :func:`read_struct` gives ``{field id: value}``: what the Parquet decoder needs of a page
  header (``packer_cli._parquet_thrift``);
* :func:`read_fields` gives ``[(field id, type, value), ...]`` in order, types kept, and
  :func:`write_fields` writes that back byte for byte: what rewriting a footer needs
  (``packer_cli.shards._parquet_stitch``), fields it does not know passing through unchanged.

In the typed view a list or set is ``(element type, [items])``, a map
``(key type, value type, [(key, value), ...])``, a struct a list of fields, and a boolean
field's value is its type (``TRUE`` or ``FALSE``, the value itself ``None``).

Strict: a struct that runs past its buffer raises :class:`Truncated` (the caller may retry
with more bytes); one that nests absurdly deep, has an over-long varint or an unknown type
raises :class:`ThriftError`. Messages start with what was being read (``what``).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

# compact-protocol types
TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(1, 13)

#: Structs nested inside the one read, at most: pyarrow's Thrift reader allows 64 levels in all, so
#: a header or footer it reads is read here too (the recursion is 2 Python frames a level).
_MAX_DEPTH = 63


class ThriftError(ValueError):
    """Bytes that are not a well-formed compact-protocol struct."""


class Truncated(ThriftError):
    """The struct runs past the bytes given (the caller may retry with more)."""


class _Reader:
    def __init__(self, buf, what: str):
        self.buf, self.what = buf, what

    def fail(self, problem: str):
        raise ThriftError(f"{self.what}: {problem}")

    def truncated(self):
        raise Truncated(f"{self.what} truncated")

    def take(self, pos: int, n: int):
        if n < 0 or pos + n > len(self.buf):
            self.truncated()
        return self.buf[pos:pos + n], pos + n

    def varint(self, pos: int) -> tuple[int, int]:
        result = shift = 0
        while True:
            if pos >= len(self.buf):
                self.truncated()
            byte = self.buf[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result, pos
            shift += 7
            if shift > 63:
                self.fail("varint too long")

    def value(self, pos: int, kind: int, depth: int):
        if kind in (I16, I32, I64):
            n, pos = self.varint(pos)
            return (n >> 1) ^ -(n & 1), pos
        if kind == BINARY:
            n, pos = self.varint(pos)
            raw, pos = self.take(pos, n)
            return bytes(raw), pos
        if kind == STRUCT:
            return self.fields(pos, depth + 1)
        if kind in (LIST, SET):
            return self.collection(pos, depth)
        if kind == MAP:
            return self.map(pos, depth)
        if kind == BYTE:
            raw, pos = self.take(pos, 1)
            return struct.unpack("<b", raw)[0], pos
        if kind == DOUBLE:
            raw, pos = self.take(pos, 8)
            return struct.unpack("<d", raw)[0], pos
        self.fail(f"unknown field type {kind}")

    def element(self, pos: int, kind: int, depth: int):
        if kind in (TRUE, FALSE):  # in a collection a boolean takes a byte of its own
            raw, pos = self.take(pos, 1)
            return raw[0] == TRUE, pos
        return self.value(pos, kind, depth)

    def collection(self, pos: int, depth: int):
        if depth > _MAX_DEPTH:  # lists of lists nest as deep as structs do (Python's own stack ran out)
            self.fail("nests too deep")
        head, pos = self.take(pos, 1)
        size, kind = head[0] >> 4, head[0] & 0x0F
        if size == 15:
            size, pos = self.varint(pos)
        if size > len(self.buf):  # every element takes at least one byte
            self.truncated()
        items = []
        for _ in range(size):
            item, pos = self.element(pos, kind, depth + 1)
            items.append(item)
        return (kind, items), pos

    def map(self, pos: int, depth: int):
        if depth > _MAX_DEPTH:
            self.fail("nests too deep")
        size, pos = self.varint(pos)
        if size == 0:
            return (0, 0, []), pos
        if size > len(self.buf):
            self.truncated()
        head, pos = self.take(pos, 1)
        key_kind, value_kind = head[0] >> 4, head[0] & 0x0F
        pairs = []
        for _ in range(size):
            key, pos = self.element(pos, key_kind, depth + 1)
            value, pos = self.element(pos, value_kind, depth + 1)
            pairs.append((key, value))
        return (key_kind, value_kind, pairs), pos

    def fields(self, pos: int, depth: int) -> tuple[list, int]:
        if depth > _MAX_DEPTH:
            self.fail("nests too deep")
        fields, last = [], 0
        while True:
            head, pos = self.take(pos, 1)
            if head[0] & 0x0F == 0:  # STOP (Apache Thrift reads the type nibble alone, and so do we)
                return fields, pos
            kind, delta = head[0] & 0x0F, head[0] >> 4
            if delta:
                field_id = last + delta
            else:
                raw, pos = self.varint(pos)
                field_id = (raw >> 1) ^ -(raw & 1)
            value = None
            if kind not in (TRUE, FALSE):  # a boolean field carries its value in the type nibble
                value, pos = self.value(pos, kind, depth)
            fields.append((field_id, kind, value))
            last = field_id


def read_fields(buf, pos: int = 0, what: str = "struct") -> tuple[list, int]:
    """The struct at ``buf[pos:]``, typed (see the module's docstring), and the position after it."""
    return _Reader(buf, what).fields(pos, 0)


def read_struct(buf, pos: int = 0, what: str = "struct") -> tuple[dict, int]:
    """The struct at ``buf[pos:]`` as ``{field id: value}`` (nested structs as dicts, lists as
    lists, maps as lists of pairs), and the position after it."""
    fields, pos = read_fields(buf, pos, what)
    return _plain_struct(fields), pos


def _plain_struct(fields: list) -> dict:
    return {field_id: _plain(kind, value) for field_id, kind, value in fields}


def _plain(kind: int, value):
    if kind in (TRUE, FALSE):
        return kind == TRUE if value is None else value
    if kind == STRUCT:
        return _plain_struct(value)
    if kind in (LIST, SET):
        element, items = value
        return [_plain(element, item) for item in items]
    if kind == MAP:
        key_kind, value_kind, pairs = value
        return [(_plain(key_kind, k), _plain(value_kind, v)) for k, v in pairs]
    return value


# -- writing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Written:
    """``count`` list items already in the compact protocol (``data``), to stand for the items
    of a list value: a long list (a footer's row groups) can wait as bytes, not as objects."""

    count: int
    data: bytes


def _put_varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(n: int, bits: int) -> int:
    return ((n << 1) ^ (n >> (bits - 1))) & ((1 << bits) - 1)


def _write_value(out: bytearray, kind: int, value) -> None:
    if kind in (I16, I32, I64):
        _put_varint(out, _zigzag(value, 64))
    elif kind == BINARY:
        _put_varint(out, len(value))
        out += value
    elif kind == STRUCT:
        write_fields(out, value)
    elif kind in (LIST, SET):
        element, items = value
        count = items.count if isinstance(items, Written) else len(items)
        if count < 15:
            out.append(count << 4 | element)
        else:
            out.append(0xF0 | element)
            _put_varint(out, count)
        if isinstance(items, Written):
            out += items.data
        else:
            for item in items:
                _write_element(out, element, item)
    elif kind == MAP:
        key_kind, value_kind, pairs = value
        _put_varint(out, len(pairs))
        if pairs:
            out.append(key_kind << 4 | value_kind)
        for key, item in pairs:
            _write_element(out, key_kind, key)
            _write_element(out, value_kind, item)
    elif kind == BYTE:
        out += struct.pack("<b", value)
    elif kind == DOUBLE:
        out += struct.pack("<d", value)
    else:
        raise ThriftError(f"cannot write Thrift type {kind}")


def _write_element(out: bytearray, kind: int, item) -> None:
    if kind in (TRUE, FALSE):
        out.append(TRUE if item else FALSE)
    else:
        _write_value(out, kind, item)


def write_fields(out: bytearray, fields: list) -> None:
    """Append ``fields`` (as :func:`read_fields` gives them) in the compact protocol."""
    last = 0
    for field_id, kind, value in fields:
        delta = field_id - last
        if 0 < delta <= 15:
            out.append(delta << 4 | kind)
        else:
            out.append(kind)
            _put_varint(out, _zigzag(field_id, 16))
        if kind not in (TRUE, FALSE):
            _write_value(out, kind, value)
        last = field_id
    out.append(0)

"""Compiled walk over the pages of Parquet column chunks held in memory: one row per page.

A Parquet column chunk is a run of pages, each preceded by a ``PageHeader`` struct in Thrift's
compact protocol. :func:`page_table` reads the headers of many chunks in one call and writes
what the decoder needs of each page (:data:`FIELDS`) into a table, so that a file of small row
groups (thousands of chunks and pages) costs no Python per header.

It reads the usual headers only: data pages (v1 and v2) and dictionary pages whose fields have
the expected types. Anything else, or anything odd (a header running past its chunk, a missing
or negative size, nesting deeper than :data:`MAX_DEPTH`), answers :data:`ODD`, and the caller
reads those chunks with the page-at-a-time path, which judges and words the problem.
Every read is checked against the end of its chunk: nothing is read out of bounds.
"""
from __future__ import annotations

import numpy as np

from packer_cli._kernel_cache import njit
from packer_cli.sources._parquet_kernels import varint

# compact-protocol types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
# PageType
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3

#: The page table's columns: the chunk (its index in the call), the payload's bounds in the
#: buffer, then the header's fields (-1 where the page type has none).
FIELDS = ("chunk", "lo", "hi", "page_type", "uncompressed_size", "num_values", "encoding",
          "def_encoding", "rep_encoding", "def_bytes", "rep_bytes", "is_compressed", "num_nulls", "num_rows")
(CHUNK, LO, HI, PAGE_TYPE, UNCOMPRESSED, NUM_VALUES, ENCODING, DEF_ENCODING, REP_ENCODING, DEF_BYTES,
 REP_BYTES, IS_COMPRESSED, NUM_NULLS, NUM_ROWS) = range(len(FIELDS))

ODD = -1  # a header the walk does not read: the page-at-a-time path judges it
FULL = -2  # the table has no room for another page: call again with a larger one
MAX_DEPTH = 16


@njit(cache=True, nogil=True, inline="always")
def _varint(buf, pos, hi):
    """(unsigned varint at ``pos``, position after it); (-1, pos) when it runs past ``hi`` or
    past 9 bytes (63 bits)."""
    return varint(buf, pos, hi, 9)


@njit(cache=True, nogil=True)
def _int_field(buf, pos, hi, kind, want):
    """(value, position after it) of an integer field that parquet.thrift declares ``want``
    (``_I32`` or ``_I64``: a zigzag varint); (-1, -1) for a field of another wire type, an i32
    out of its range, or a value that runs past ``hi``. Negative values are returned as they
    are (the caller refuses them). The wire type must be the declared one: Apache Thrift, which
    pyarrow reads with, skips a field of another type and then refuses the struct for the
    missing field, so reading it anyway would read a file pyarrow cannot."""
    if kind != want:
        return np.int64(-1), np.int64(-1)
    raw, pos = _varint(buf, pos, hi)
    if raw < 0:
        return np.int64(-1), np.int64(-1)
    value = (raw >> 1) ^ -(raw & 1)
    if want == _I32 and (value < -2**31 or value >= 2**31):
        return np.int64(-1), np.int64(-1)
    return value, pos


@njit(cache=True, nogil=True)
def _skip(buf, pos, hi, kind):
    """Position after a struct field's value of type ``kind`` at ``pos``, or -1. Nested structs,
    lists, sets and maps are walked with an explicit stack (no recursion in compiled code):
    ``frames`` holds, per open level, whether it is a struct and, for a list, set or map, how
    many elements remain and their types (a map's keys and values alternate)."""
    is_struct = np.zeros(MAX_DEPTH, dtype=np.bool_)
    left = np.zeros(MAX_DEPTH, dtype=np.int64)
    kinds = np.zeros((MAX_DEPTH, 2), dtype=np.int64)
    taken = np.zeros(MAX_DEPTH, dtype=np.int64)
    depth = 0
    field = True  # a struct field's boolean has no payload; a boolean element takes a byte
    while True:
        if kind == _TRUE or kind == _FALSE:
            pos += 0 if field else 1
        elif kind == _BYTE:
            pos += 1
        elif kind == _I16 or kind == _I32 or kind == _I64:
            raw, pos = _varint(buf, pos, hi)
            if raw < 0:
                return -1
        elif kind == _DOUBLE:
            pos += 8
        elif kind == _BINARY:
            size, pos = _varint(buf, pos, hi)
            if size < 0 or size > hi - pos:
                return -1
            pos += size
        elif kind == _STRUCT or kind == _LIST or kind == _SET or kind == _MAP:
            if depth == MAX_DEPTH:
                return -1
            is_struct[depth] = kind == _STRUCT
            taken[depth] = 0
            if kind == _LIST or kind == _SET:
                if pos >= hi:
                    return -1
                head = np.int64(buf[pos])
                pos += 1
                size = head >> 4
                if size == 15:
                    size, pos = _varint(buf, pos, hi)
                    if size < 0:
                        return -1
                left[depth] = size
                kinds[depth, 0] = kinds[depth, 1] = head & 0x0F
            elif kind == _MAP:
                size, pos = _varint(buf, pos, hi)
                if size < 0:
                    return -1
                left[depth] = 2 * size
                if size:
                    if pos >= hi:
                        return -1
                    kinds[depth, 0] = np.int64(buf[pos]) >> 4
                    kinds[depth, 1] = np.int64(buf[pos]) & 0x0F
                    pos += 1
            depth += 1
        else:
            return -1
        if pos > hi:
            return -1
        # the next value to skip: a field of the innermost struct, or an element
        while True:
            if depth == 0:
                return pos
            top = depth - 1
            if is_struct[top]:
                if pos >= hi:
                    return -1
                head = np.int64(buf[pos])
                pos += 1
                if head & 0x0F == 0:  # STOP
                    depth -= 1
                    continue
                if head >> 4 == 0:  # the field id follows as a zigzag varint
                    raw, pos = _varint(buf, pos, hi)
                    if raw < 0:
                        return -1
                kind = head & 0x0F
                field = True
                break
            if left[top] == 0:
                depth -= 1
                continue
            kind = kinds[top, taken[top] & 1]
            taken[top] += 1
            left[top] -= 1
            field = False
            if pos >= hi:  # every element takes at least a byte: a huge count ends here
                return -1
            break


@njit(cache=True, nogil=True)
def _field_head(buf, pos, hi, last):
    """(field id, type, position after the field's header) of the field at ``pos``, with type 0
    for the struct's end; (-1, -1, -1) when it runs past ``hi``."""
    if pos >= hi:
        return np.int64(-1), np.int64(-1), np.int64(-1)
    head = np.int64(buf[pos])
    pos += 1
    kind = head & 0x0F
    if kind == 0:
        return np.int64(0), np.int64(0), pos
    delta = head >> 4
    if delta:
        return last + delta, kind, pos
    raw, pos = _varint(buf, pos, hi)
    if raw < 0:
        return np.int64(-1), np.int64(-1), np.int64(-1)
    return (raw >> 1) ^ -(raw & 1), kind, pos


@njit(cache=True, nogil=True, inline="always")
def int_field_into(buf, pos, hi, kind, fid, row, fields, kinds, columns):
    """(known, position after it): when field ``fid`` is ``fields[i]``, declared of integer
    type ``kinds[i]``, its value goes to ``row[columns[i]]``; position -1 when it is of another
    wire type or runs past ``hi``."""
    for i in range(fields.size):
        if fid == fields[i]:
            value, pos = _int_field(buf, pos, hi, kind, kinds[i])
            if pos >= 0:
                row[columns[i]] = value
            return True, pos
    return False, pos


@njit(cache=True, nogil=True)
def _sub_header(buf, pos, hi, row, fields, kinds, columns, flag_field, flag_column):
    """Read the struct at ``pos`` (a data or dictionary page's own header) into ``row``: field
    ``fields[i]`` (an integer of wire type ``kinds[i]``) into column ``columns[i]``, boolean
    field ``flag_field`` into ``flag_column`` (1 or 0); other fields are skipped. Returns the
    position after it, or -1 (also for a flag of another wire type: the Python reader judges)."""
    last = np.int64(0)
    while True:
        fid, kind, pos = _field_head(buf, pos, hi, last)
        if pos < 0:
            return -1
        if kind == 0:
            return pos
        known, pos = int_field_into(buf, pos, hi, kind, fid, row, fields, kinds, columns)
        if pos < 0:
            return -1
        if not known:
            if fid == flag_field:
                if kind != _TRUE and kind != _FALSE:
                    return -1
                row[flag_column] = 1 if kind == _TRUE else 0
            else:
                pos = _skip(buf, pos, hi, kind)
                if pos < 0:
                    return -1
        last = fid


# Every field read of a page header is a required i32 (parquet.thrift). DataPageHeaderV2's null
# and row counts are not used, but read all the same: without them pyarrow refuses the page.
_V1_FIELDS = np.array([1, 2, 3, 4], dtype=np.int64)
_V1_COLUMNS = np.array([NUM_VALUES, ENCODING, DEF_ENCODING, REP_ENCODING], dtype=np.int64)
_V2_FIELDS = np.array([1, 2, 3, 4, 5, 6], dtype=np.int64)
_V2_COLUMNS = np.array([NUM_VALUES, NUM_NULLS, NUM_ROWS, ENCODING, DEF_BYTES, REP_BYTES], dtype=np.int64)
_DICT_FIELDS = np.array([1, 2], dtype=np.int64)
_DICT_COLUMNS = np.array([NUM_VALUES, ENCODING], dtype=np.int64)
_I32_KINDS = np.full(6, _I32, dtype=np.int64)
_TOP_COLUMNS = np.array([PAGE_TYPE, UNCOMPRESSED, HI], dtype=np.int64)  # HI holds the compressed size at first


@njit(cache=True, nogil=True)
def _page_header(buf, pos, hi, row):
    """Read the page header at ``pos`` into ``row`` (HI holding the compressed size); the
    position after it, or -1 for a header the walk does not read."""
    row[:] = -1
    row[IS_COMPRESSED] = 1
    last = np.int64(0)
    sub = np.int64(-1)  # the field id of the page type's own header, once read
    while True:
        fid, kind, pos = _field_head(buf, pos, hi, last)
        if pos < 0:
            return -1
        if kind == 0:
            break
        if fid == 1 or fid == 2 or fid == 3:
            value, pos = _int_field(buf, pos, hi, kind, _I32)
            if pos < 0:
                return -1
            row[_TOP_COLUMNS[fid - 1]] = value
        elif (fid == 5 or fid == 7 or fid == 8) and kind != _STRUCT:
            return -1  # a page-type header of another wire type: the Python reader refuses it
        elif fid == 5 or fid == 7 or fid == 8:
            if fid == 5:
                pos = _sub_header(buf, pos, hi, row, _V1_FIELDS, _I32_KINDS, _V1_COLUMNS, -1, -1)
            elif fid == 8:
                pos = _sub_header(buf, pos, hi, row, _V2_FIELDS, _I32_KINDS, _V2_COLUMNS, 7, IS_COMPRESSED)
            else:
                pos = _sub_header(buf, pos, hi, row, _DICT_FIELDS, _I32_KINDS, _DICT_COLUMNS, -1, -1)
            if pos < 0 or sub >= 0:  # a second page-type header: not the usual page
                return -1
            sub = fid
        else:
            pos = _skip(buf, pos, hi, kind)
            if pos < 0:
                return -1
        last = fid
    page_type = row[PAGE_TYPE]
    wanted = 5 if page_type == _DATA_PAGE else 8 if page_type == _DATA_PAGE_V2 else 7 if page_type == _DICTIONARY_PAGE else -2
    if sub != wanted or row[UNCOMPRESSED] < 0 or row[HI] < 0 or row[NUM_VALUES] < 0 or row[ENCODING] < 0:
        return -1
    if page_type == _DATA_PAGE and (row[DEF_ENCODING] < 0 or row[REP_ENCODING] < 0):
        return -1
    if page_type == _DATA_PAGE_V2 and (row[DEF_BYTES] < 0 or row[REP_BYTES] < 0 or row[NUM_NULLS] < 0
                                       or row[NUM_ROWS] < 0):
        return -1
    return pos


@njit(cache=True, nogil=True)
def page_table(buf, chunk_lo, chunk_hi, table):
    """Walk the pages of chunks ``buf[chunk_lo[c]:chunk_hi[c]]``, one row of ``table`` (int64,
    ``len(FIELDS)`` columns) per page, in order. Returns the number of pages, :data:`ODD` for a
    header the walk does not read or a payload past its chunk, or :data:`FULL` when ``table``
    has no room left."""
    n = 0
    for c in range(chunk_lo.size):
        pos = chunk_lo[c]
        hi = chunk_hi[c]
        if pos < 0 or hi > buf.size or pos > hi:
            return ODD
        while pos < hi:
            if n == table.shape[0]:
                return FULL
            row = table[n]
            start = _page_header(buf, pos, hi, row)
            if start < 0 or row[HI] > hi - start:
                return ODD
            row[CHUNK] = c
            row[LO] = start
            row[HI] += start
            pos = row[HI]
            n += 1
    return n


@njit(cache=True, nogil=True)
def complete_pages(buf, pos, hi, table):
    """The pages that lie whole in ``buf[pos:hi]`` (a window of one chunk's bytes), one row of
    ``table`` each as :func:`page_table` writes them, from ``pos`` up to the first page whose
    header or payload runs past ``hi`` or whose header the walk does not read, or until
    ``table`` is full. Returns their number (0: the caller reads the page at ``pos`` alone)."""
    n = 0
    while pos < hi and n < table.shape[0]:
        row = table[n]
        start = _page_header(buf, pos, hi, row)
        if start < 0 or row[HI] > hi - start:
            break
        row[CHUNK] = 0
        row[LO] = start
        row[HI] += start
        pos = row[HI]
        n += 1
    return n


def walk(raw: np.ndarray, lo: np.ndarray, hi: np.ndarray, capacity: int = 0) -> np.ndarray | None:
    """The page table of the chunks ``raw[lo[c]:hi[c]]`` (int64, one row of :data:`FIELDS` per
    page), or None where :func:`page_table` declines them. The table starts with room for
    ``capacity`` pages (default: two a chunk) and doubles until the pages fit."""
    table = np.empty((capacity or max(16, 2 * lo.size), len(FIELDS)), dtype=np.int64)
    while True:
        n = page_table(raw, lo, hi, table)
        if n != FULL:
            return table[:n] if n >= 0 else None
        table = np.empty((2 * table.shape[0], len(FIELDS)), dtype=np.int64)

"""Parquet page headers, read with the compact-protocol reader of :mod:`packer_cli._thrift`.

A Parquet column chunk is a run of pages, each preceded by a ``PageHeader`` struct encoded
with Thrift's compact protocol. Only the page headers, one per page, are read here (a few
hundred per file, so plain Python is fast enough), for the compiled decoder
(:mod:`packer_cli.sources.parquet_lists`) and for the readers of Megatron-Bridge files, which
count a column chunk's values by its headers before pyarrow decodes it
(:func:`data_page_levels`). Plain Python without numba: the torch side imports it.

The reader is strict: a header that runs past its buffer, nests absurdly deep or uses an
unknown type, or a required field missing or of another wire type than parquet.thrift declares
(Apache Thrift, pyarrow's reader, refuses those too), raises :class:`ThriftError`, which
callers turn into a one-line error naming the file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from packer_cli._thrift import FALSE, I32, STRUCT, TRUE, ThriftError, Truncated, read_fields

# PageType
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
# Encoding
PLAIN, PLAIN_DICTIONARY, RLE, BIT_PACKED, RLE_DICTIONARY = 0, 2, 3, 4, 8
BYTE_STREAM_SPLIT = 9
DELTA_BINARY_PACKED = 5
HEADER_PROBE = 1 << 10  # bytes read for a page header; retried with more if it is longer
MAX_HEADER = 16 << 20
ENCODING_NAMES = {0: "PLAIN", 2: "PLAIN_DICTIONARY", 3: "RLE", 4: "BIT_PACKED", 5: "DELTA_BINARY_PACKED",
                  6: "DELTA_LENGTH_BYTE_ARRAY", 7: "DELTA_BYTE_ARRAY", 8: "RLE_DICTIONARY", 9: "BYTE_STREAM_SPLIT"}


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


def _typed(fields: list) -> dict:
    """``{field id: (wire type, value)}`` of a struct's fields (a repeated id: the last, as
    Apache Thrift keeps)."""
    return {field_id: (kind, value) for field_id, kind, value in fields}


def _int(fields: dict, key: int, what: str, *, signed: bool = False) -> int:
    """Required i32 field ``key``. Of another wire type it is refused as missing, as Apache
    Thrift (pyarrow's reader) refuses it: a file read here would otherwise be one pyarrow
    cannot read, a Megatron-Bridge split that ``packer verify`` passes and Bridge cannot load."""
    kind, value = fields.get(key, (None, None))
    if kind is not None and kind != I32:
        raise ThriftError(f"page header: {what} is not an i32")
    if kind is None or not -2**31 <= value < 2**31 or (value < 0 and not signed):
        raise ThriftError(f"page header: missing or invalid {what}")
    return value


def _sub(fields: dict, key: int, what: str) -> dict:
    kind, value = fields.get(key, (None, None))
    if kind != STRUCT:  # (Apache Thrift skips a field of another type: the header is missing)
        raise ThriftError(f"page header: {what} without its header")
    return _typed(value)


def parse_page_header(buf: bytes) -> PageHeader:
    """Decode the page header at the start of ``buf`` (raises ``Truncated`` if ``buf`` is too short)."""
    top, size = read_fields(buf, what="page header")
    fields = _typed(top)
    page_type = _int(fields, 1, "page type")
    common = dict(size=size, page_type=page_type, uncompressed_size=_int(fields, 2, "uncompressed size"),
                  compressed_size=_int(fields, 3, "compressed size"))
    if page_type == DATA_PAGE:
        sub = _sub(fields, 5, "data page")
        return PageHeader(**common, num_values=_int(sub, 1, "value count"), encoding=_int(sub, 2, "encoding"),
                          def_encoding=_int(sub, 3, "level encoding"), rep_encoding=_int(sub, 4, "level encoding"))
    if page_type == DATA_PAGE_V2:
        sub = _sub(fields, 8, "data page v2")
        _int(sub, 2, "null count", signed=True)  # unused, but required: pyarrow refuses a page without them
        _int(sub, 3, "row count")  # pyarrow refuses a negative one too (a null count it takes)
        # is_compressed is optional: of another wire type Apache Thrift skips it (true, the default)
        return PageHeader(**common, num_values=_int(sub, 1, "value count"), encoding=_int(sub, 4, "encoding"),
                          def_bytes=_int(sub, 5, "level length"), rep_bytes=_int(sub, 6, "level length"),
                          is_compressed=sub.get(7, (TRUE, None))[0] != FALSE)
    if page_type == DICTIONARY_PAGE:
        sub = _sub(fields, 7, "dictionary page")
        return PageHeader(**common, num_values=_int(sub, 1, "value count"), encoding=_int(sub, 2, "encoding"))
    return PageHeader(**common)  # index pages and unknown types are skipped by size


def is_truncated(exc: ThriftError) -> bool:
    return isinstance(exc, Truncated)


def read_page_header(fd: int, pos: int, end: int) -> PageHeader:
    """The header of the page at byte ``pos`` of the file open as ``fd``, in a column chunk
    that ends at ``end``: 1 KiB read first, then 16 times more while the header runs past
    what was read (statistics can make one long), up to 16 MiB. :class:`ThriftError` when it
    cannot be read."""
    probe = HEADER_PROBE
    while True:
        raw = os.pread(fd, min(probe, end - pos), pos)
        try:
            return parse_page_header(raw)
        except ThriftError as exc:
            if not is_truncated(exc) or len(raw) < probe or probe >= MAX_HEADER:
                raise
            probe *= 16


def data_page_levels(fd: int, start: int, end: int) -> int:
    """The level entries of the data pages in bytes ``[start, end)`` of the file open as
    ``fd`` (one column chunk), by their headers alone: the payloads are not read.

    What a column chunk's footer entry states (``num_values``) is what its pages must hold, and
    pyarrow does not check it before decoding them: a 1.2 MB Megatron-Bridge file whose pages
    held 200 times the values its footer stated took 0.8 GB to verify before the rows came out
    wrong. :class:`ThriftError` where a header cannot be read or a page runs past ``end``."""
    levels, pos = 0, start
    while pos < end:
        header = read_page_header(fd, pos, end)
        pos += header.size + header.compressed_size
        if pos > end:
            raise ThriftError("page header: the page runs past its column chunk")
        if header.page_type in (DATA_PAGE, DATA_PAGE_V2):
            levels += header.num_values
    return levels

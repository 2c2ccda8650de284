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
makes of the same row groups (``tests/test_bridge_writer.py`` holds it to that).

pyarrow before 18 also writes a copy of each column chunk's footer entry right after the
chunk's pages, where the entry's ``file_offset`` points. Those copies hold positions too, so
they are rewritten in place with the moved positions, as a single writer would have written
them; a moved position can take more bytes to encode, so every position after a copy moves by
the copies' growth before it as well (:class:`_Relocation`).

Parts with a page index (``write_page_index=True``) are refused: an offset index lists its
pages' absolute positions in its own body, which this does not rewrite, and packer's parts
are written without one (readers that use it, DuckDB, Spark or parquet-rs, would otherwise
read another part's bytes as the pages of every part after the first).

The footer is rewritten through the typed view of :mod:`packer_cli._thrift`: a struct is a
list of ``(field id, type, value)`` in their order, so fields this module does not know pass
through unchanged.

Row groups packer encodes itself (:mod:`packer_cli.shards._parquet_encode`) come as pages and
footer entries not yet written (:meth:`ParquetStitcher.add_encoded`): nothing to parse, each
entry written once with its final positions.
"""
from __future__ import annotations

from bisect import bisect_left

from packer_cli._thrift import I64, STRUCT, ThriftError, Written, read_fields, write_fields

MAGIC = b"PAR1"

# Field ids (parquet.thrift) of the absolute file positions to move, per struct.
_FILE_ROWS, _FILE_ROW_GROUPS = 3, 4                       # FileMetaData
_GROUP_COLUMNS, _GROUP_FILE_OFFSET, _GROUP_ORDINAL = 1, 5, 7  # RowGroup
#: A row group's ordinal is an i16: readers built on Thrift's C++ or Java libraries read 32768 as
#: -32768 and some refuse it, so a file with more row groups carries no ordinal past this.
ORDINAL_LIMIT = 2**15
_CHUNK_META = 3                                           # ColumnChunk
_CHUNK_FILE_OFFSET = 2
_CHUNK_PAGE_INDEX = (4, 6)  # offset_index_offset, column_index_offset
_META_OFFSETS = (9, 10, 11, 14)  # data_page, index_page, dictionary_page, bloom_filter offsets


class StitchError(ValueError):
    """A part that is not a complete Parquet file, or whose schema differs from the first part's."""


# -- moving row groups -----------------------------------------------------------------------
def _field(fields: list, field_id: int):
    for fid, _, value in fields:
        if fid == field_id:
            return value
    return None


def _replace(fields: list, field_id: int, value) -> list:
    return [(fid, kind, value if fid == field_id else old) for fid, kind, old in fields]


class _Relocation:
    """Where a position in a part lands in the joined file: moved by where the part's pages
    start (``shift``), plus the growth of the inline copies rewritten before that position."""

    def __init__(self, shift: int):
        self.shift = shift
        self._starts: list[int] = []  # of the rewritten copies, increasing
        self._growth: list[int] = []  # total growth of the copies up to and including each

    def grew(self, start: int, growth: int) -> None:
        self._starts.append(start)
        self._growth.append((self._growth[-1] if self._growth else 0) + growth)

    @property
    def total_growth(self) -> int:
        return self._growth[-1] if self._growth else 0

    def __call__(self, position: int) -> int:
        k = bisect_left(self._starts, position)  # copies that start before the position
        return position + self.shift + (self._growth[k - 1] if k else 0)


def _moved(fields: list, offsets: tuple[int, ...], relocate: _Relocation) -> list:
    """``fields`` with the i64 positions named in ``offsets`` relocated (0: not set, kept)."""
    return [(fid, kind, relocate(value) if fid in offsets and kind == I64 and value else value)
            for fid, kind, value in fields]


def _moved_chunk(chunk: list, relocate: _Relocation) -> list:
    chunk = _moved(chunk, (_CHUNK_FILE_OFFSET,), relocate)
    meta = _field(chunk, _CHUNK_META)
    return chunk if meta is None else _replace(chunk, _CHUNK_META, _moved(meta, _META_OFFSETS, relocate))


def _moved_group(group: list, relocate: _Relocation, ordinal: int) -> list:
    group = _moved(group, (_GROUP_FILE_OFFSET,), relocate)
    columns = _field(group, _GROUP_COLUMNS)
    group = _replace(group, _GROUP_COLUMNS, (columns[0], [_moved_chunk(chunk, relocate) for chunk in columns[1]]))
    if ordinal < ORDINAL_LIMIT:
        return _replace(group, _GROUP_ORDINAL, ordinal)
    return [entry for entry in group if entry[0] != _GROUP_ORDINAL]  # past Thrift's i16: leave it out


def _inline_copies(view: memoryview, footer_start: int, groups: list) -> list[tuple[int, int, list]]:
    """``(start, end, chunk)`` of each column chunk's copy of its footer entry within the pages
    (pyarrow before 18 writes one after each chunk, at its ``file_offset``), in file order."""
    copies = []
    for group in groups:
        for chunk in _field(group, _GROUP_COLUMNS)[1]:
            start = _field(chunk, _CHUNK_FILE_OFFSET)
            if not start or not len(MAGIC) <= start < footer_start:
                continue  # 0 (pyarrow 18 on): no copy
            try:
                copy, end = read_fields(view[:footer_start], start, what="Parquet column chunk")
            except ThriftError:
                continue
            if copy == chunk:
                copies.append((start, end, chunk))
    return sorted(copies, key=lambda c: c[0])


def split_file(data) -> tuple[memoryview, list]:
    """A complete Parquet file's pages (everything between the leading magic and the footer)
    and its parsed footer."""
    view, footer_start, footer = _parse(data)
    return view[len(MAGIC):footer_start], footer


def _parse(data) -> tuple[memoryview, int, list]:
    view = memoryview(data).cast("B")  # unsigned bytes, whatever the buffer's own format
    if len(view) < 12 or view[:4] != MAGIC or view[-4:] != MAGIC:
        raise StitchError("not a complete Parquet file")
    footer_len = int.from_bytes(view[-8:-4], "little")
    footer_start = len(view) - 8 - footer_len
    if footer_start < 4:
        raise StitchError("Parquet footer length out of range")
    try:
        footer, end = read_fields(view[footer_start:len(view) - 8], what="Parquet footer")
    except ThriftError as exc:
        raise StitchError(str(exc)) from None
    if end != footer_len:
        raise StitchError("Parquet footer does not end where its length says")
    groups = _field(footer, _FILE_ROW_GROUPS)
    if (type(_field(footer, _FILE_ROWS)) is not int or not _structs(groups)
            or not all(_structs(_field(group, _GROUP_COLUMNS)) for group in groups[1])):
        raise StitchError("Parquet footer lacks its row count, its row groups or their column chunks")
    return view, footer_start, footer


def _structs(value) -> bool:
    """Whether a typed Thrift value is a list of structs."""
    return isinstance(value, tuple) and len(value) == 2 and value[0] == STRUCT


class ParquetStitcher:
    """Write whole Parquet files (same schema, same writer settings) into ``sink`` as one file.

    ``sink`` needs only ``write``. Call :meth:`add` with each part in order, then :meth:`finish`.
    """

    def __init__(self, sink):
        self._sink = sink
        self._position = len(MAGIC)
        self._first: list | None = None
        # the row groups' footer entries, moved and written as they come: about 1 KB a group as
        # bytes, where parsed they were a few KB of Python objects each (thousands per file)
        self._groups = bytearray()
        self._group_count = 0
        self._rows = 0
        sink.write(MAGIC)

    def add(self, part) -> None:
        view, footer_start, footer = _parse(part)
        groups = _field(footer, _FILE_ROW_GROUPS)[1]
        if any(_field(chunk, fid) for group in groups for chunk in _field(group, _GROUP_COLUMNS)[1]
               for fid in _CHUNK_PAGE_INDEX):
            raise StitchError("Parquet parts with a page index cannot be joined (its offset index holds the part's "
                              "own page positions)")
        if self._first is None:
            self._first = footer
        elif _schema(footer) != _schema(self._first):
            raise StitchError("Parquet parts have different schemas")
        relocate = _Relocation(self._position - len(MAGIC))  # the part's pages start right after its magic
        done = len(MAGIC)
        for start, end, chunk in _inline_copies(view, footer_start, groups):
            copy = bytearray()
            write_fields(copy, _moved_chunk(chunk, relocate))  # its positions all lie before it
            self._sink.write(view[done:start])
            self._sink.write(copy)
            relocate.grew(start, len(copy) - (end - start))
            done = end
        self._sink.write(view[done:footer_start])
        for group in groups:
            write_fields(self._groups, _moved_group(group, relocate, self._group_count))
            self._group_count += 1
        self._rows += _field(footer, _FILE_ROWS)
        self._position += footer_start - len(MAGIC) + relocate.total_growth

    def add_encoded(self, part) -> None:
        """Append row groups encoded by :func:`~packer_cli.shards._parquet_encode.
        encode_list_columns`: their pages as they are, their footer entries with the position
        where the pages land (nothing to parse)."""
        if self._first is None:
            self._first = part.footer
        elif _schema(part.footer) != _schema(self._first):
            raise StitchError("Parquet parts have different schemas")
        shift = self._position
        self._sink.write(part.pages)
        for group in part.groups:
            write_fields(self._groups, group.entry(shift))
            self._group_count += 1
        self._rows += part.rows
        self._position += len(part.pages)

    def finish(self) -> int:
        """Write the footer; returns the file's size in bytes."""
        if self._first is None:
            raise StitchError("no Parquet parts to join")
        groups = (STRUCT, Written(self._group_count, bytes(self._groups)))
        footer = _replace(_replace(self._first, _FILE_ROWS, self._rows), _FILE_ROW_GROUPS, groups)
        out = bytearray()
        write_fields(out, footer)
        out += len(out).to_bytes(4, "little") + MAGIC
        self._sink.write(out)
        return self._position + len(out)


def _schema(footer: list):
    return _field(footer, 2), _field(footer, 5)  # schema elements, key-value metadata

"""Check that an Arrow IPC *file* holds what its footer says, and nothing else.

An IPC file is the magic ``ARROW1`` (padded to 8 bytes), an IPC stream (the schema message,
dictionary and record batch messages one after another, the end-of-stream marker), then the
footer, the footer's length and the magic again. pyarrow reads a file from its end: the
footer's blocks say where each message is, and nothing checks the bytes in between. Two
files joined with ``cat`` therefore read as the *first* file's batches under the second's
footer (the block offsets count from the start), and verify against that same input agrees,
so the second file's samples would be lost without a word.

:func:`check_file_layout` walks the footer's blocks and requires the messages to lie end to
end from the schema message to the footer, with at most the end-of-stream marker before it.
Every Arrow writer lays a file out this way; the check reads the footer (a few bytes per
batch) and one message prefix, never a batch.
"""
from __future__ import annotations

import struct

from packer_cli.errors import DataError

_MAGIC = b"ARROW1"
_CONTINUATION = b"\xff\xff\xff\xff"
#: What may stand between the last message and the footer: the end-of-stream marker (a
#: continuation and a zero length; a bare zero length in the pre-1.0 format) or nothing.
_BEFORE_FOOTER = (b"\xff\xff\xff\xff\x00\x00\x00\x00", b"\x00\x00\x00\x00", b"")
#: Footer table fields (File.fbs): version, schema, dictionaries, recordBatches.
_DICTIONARIES, _RECORD_BATCHES = 2, 3
#: struct Block { offset: long; metaDataLength: int; (4 bytes padding) bodyLength: long; }
_BLOCK = struct.Struct("<qi4xq")


def check_file_layout(path: str, source) -> None:
    """Raise :class:`DataError` unless ``source`` (an open ``pa.memory_map`` of ``path``, a file
    pyarrow opened as an IPC file) is laid out as its footer says."""
    size = source.size()
    if not source.read_at(len(_MAGIC), 0).startswith(_MAGIC):
        raise DataError(f"{path}: an Arrow IPC file must start with {_MAGIC.decode()} (a damaged file, "
                        "or bytes before it)")
    footer_length = int.from_bytes(source.read_at(4, size - 10), "little", signed=True)
    footer_start = size - 10 - footer_length
    try:
        blocks = sorted(_footer_blocks(source.read_at(footer_length, footer_start)))
    except struct.error:
        raise DataError(f"{path}: the Arrow IPC file's footer is damaged") from None
    position = _schema_message_end(source)
    for number, (offset, metadata_length, body_length) in enumerate(blocks):
        if offset != position:
            raise _misplaced(path, f"message {number + 1} of {len(blocks)} is at byte {offset:,}, "
                                   f"the one before it ends at byte {position:,}")
        position = offset + metadata_length + body_length
    gap = footer_start - position
    if not 0 <= gap <= 8 or bytes(source.read_at(gap, position)) not in _BEFORE_FOOTER:
        raise _misplaced(path, f"its messages end at byte {position:,}, the footer starts at byte "
                               f"{footer_start:,}")


def _misplaced(path: str, detail: str) -> DataError:
    return DataError(f"{path}: the Arrow IPC file's footer does not describe its contents ({detail}): "
                     "files joined together, or a damaged file")


def _schema_message_end(source) -> int:
    """Where the schema message that follows the leading magic ends (it has no body)."""
    prefix = source.read_at(8, 8)
    if prefix[:4] == _CONTINUATION:
        return 16 + int.from_bytes(prefix[4:], "little", signed=True)
    return 12 + int.from_bytes(prefix[:4], "little", signed=True)  # pre-1.0: the length alone


def _footer_blocks(footer: bytes) -> list[tuple[int, int, int]]:
    """The dictionary and record batch blocks of a footer flatbuffer, as
    ``(offset, metadata length, body length)``."""
    table = _u32(footer, 0)
    vtable = table - struct.unpack_from("<i", footer, table)[0]
    vtable_size = struct.unpack_from("<H", footer, vtable)[0]
    blocks = []
    for slot in (_DICTIONARIES, _RECORD_BATCHES):
        entry = vtable + 4 + 2 * slot
        field = struct.unpack_from("<H", footer, entry)[0] if entry + 2 <= vtable + vtable_size else 0
        if not field:
            continue
        vector = table + field + _u32(footer, table + field)
        count = _u32(footer, vector)
        blocks += [_BLOCK.unpack_from(footer, vector + 4 + _BLOCK.size * i) for i in range(count)]
    return blocks


def _u32(data: bytes, at: int) -> int:
    return struct.unpack_from("<I", data, at)[0]

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
Every Arrow writer lays its batches out this way, but not every one writes the schema message
the same way: pyarrow and arrow-rs frame it as the stream format does (a continuation marker
and a length; arrow-rs after zero padding up to byte 64), arrow-js writes none (the schema is
in the footer only: the first block starts at byte 8), polars writes the bare flatbuffer, whose
end only a flatbuffer parser could find. That schema then reaches up to the first block (or to
the end-of-stream marker of a file without batches), and the stretch must not hold what two
joined files always leave between them (one's closing magic right before the other's padded
opening one), nor messages lying end to end up to the first listed block (batches the footer
leaves out). The check reads the footer (a few bytes per batch) and the schema, never a batch.
"""
from __future__ import annotations

import struct

import pyarrow as pa

from packer_cli._ipc_footer import CONTINUATION, footer_blocks, read_footer
from packer_cli.errors import DataError

_MAGIC = b"ARROW1"
#: The furthest a schema message's continuation marker lies after zero padding (arrow-rs aligns
#: the first message to 64 bytes).
_ALIGNED_SCHEMA_AT = 64
#: What ``cat`` leaves between two IPC files: one's closing magic, the next one's padded opening
#: magic (a field's name may hold these bytes too: see :func:`_holds_a_whole_file`).
_JOINED = _MAGIC + _MAGIC + b"\0\0"
#: What may stand between the last message and the footer: the end-of-stream marker (a
#: continuation and a zero length; a bare zero length in the pre-1.0 format) or nothing.
_BEFORE_FOOTER = (b"\xff\xff\xff\xff\x00\x00\x00\x00", b"\x00\x00\x00\x00", b"")
#: The most bytes an unframed schema message may take (a schema is a few kilobytes, with a
#: ``datasets`` features description perhaps a few hundred).
_LARGEST_SCHEMA = 16 << 20


def check_file_layout(path: str, source) -> None:
    """Raise :class:`DataError` unless ``source`` (an open ``pa.memory_map`` of ``path``, a file
    pyarrow opened as an IPC file) is laid out as its footer says."""
    if not source.read_at(len(_MAGIC), 0).startswith(_MAGIC):
        raise DataError(f"{path}: an Arrow IPC file must start with {_MAGIC.decode()} (a damaged file, "
                        "or bytes before it)")
    try:
        footer_start, footer = read_footer(source)
        blocks = sorted(footer_blocks(footer))
    except (struct.error, ValueError):
        raise DataError(f"{path}: the Arrow IPC file's footer is damaged") from None
    position = _schema_end(path, source, blocks[0][0] if blocks else None, footer_start)
    for number, (offset, metadata_length, body_length) in enumerate(blocks):
        if offset != position:
            raise _misplaced(path, f"message {number + 1} of {len(blocks)} is at byte {offset:,}, "
                                   f"the one before it ends at byte {position:,}")
        position = offset + metadata_length + body_length
    if not _ends_messages(source, position, footer_start):
        raise _misplaced(path, f"its messages end at byte {position:,}, the footer starts at byte "
                               f"{footer_start:,}")


def _misplaced(path: str, detail: str) -> DataError:
    return DataError(f"{path}: the Arrow IPC file's footer does not describe its contents ({detail}): "
                     "files joined together, or a damaged file")


def _schema_end(path: str, source, first_block: int | None, footer_start: int) -> int:
    """Where the schema message that follows the leading magic ends (it has no body).

    A framed schema says its length. One behind a continuation marker must end where the first
    block starts (or the messages end): anything between is a message the footer does not list,
    which a file reader would skip. An unframed one (polars) ends where the first block starts,
    or, in a file without batches, where the end-of-stream marker before the footer starts; it
    is accepted unless two files' magics lie in it end to end (as ``cat`` leaves them). So is a
    pre-1.0 schema (its length alone, which an unframed schema's first bytes also read as).
    """
    if first_block == 8:  # no schema message at all: arrow-js keeps the schema in the footer only
        return 8
    framed_end, marked = _framed_schema_end(source)
    if first_block is None:
        if _ends_messages(source, framed_end, footer_start):
            return framed_end
        if marked:
            raise _misplaced(path, f"the schema message ends at byte {framed_end:,}, the footer lists no message "
                                   f"and starts at byte {footer_start:,}")
        tail = bytes(source.read_at(min(8, footer_start - 8), footer_start - min(8, footer_start - 8)))
        end = footer_start - max((len(m) for m in _BEFORE_FOOTER if tail.endswith(m)), default=0)
    elif first_block == framed_end:
        return framed_end
    elif marked:
        raise _misplaced(path, f"the first message it lists is at byte {first_block:,}, the schema message "
                               f"ends at byte {framed_end:,}")
    else:
        end = first_block
    if not 16 <= end <= 8 + _LARGEST_SCHEMA:
        raise _misplaced(path, f"an unframed schema message would take bytes 8 to {end:,}")
    stretch = bytes(source.read_at(end - 8, 8))
    if _holds_a_whole_file(path, source, stretch):
        raise _misplaced(path, f"one file's end and another's start lie in its schema message, bytes 8 to {end:,}")
    unlisted = _messages_ending_at_end(stretch)
    if unlisted is not None:
        raise _misplaced(path, f"a message the footer does not list is at byte {8 + unlisted:,}, after an "
                               f"unframed schema message and before byte {end:,}")
    return end


def _messages_ending_at_end(stretch: bytes) -> int | None:
    """Where in ``stretch`` (an unframed schema's bytes, up to the first listed block) messages
    begin that lie end to end up to its end, or None: a record batch the footer leaves out,
    which a file reader skips. Candidates are continuation markers at 8-byte alignment (where
    messages start), and each must read as a message (pyarrow verifies its flatbuffer); a
    schema flatbuffer holds no 0xFFFFFFFF word of its own but in a binary metadata value."""
    at = stretch.find(CONTINUATION, 8)
    while at >= 0:
        if at % 8 == 0:
            reader = pa.BufferReader(stretch[at:])
            try:
                while reader.tell() < len(stretch) - at:
                    pa.ipc.read_message(reader)
                return at
            except (pa.ArrowException, ValueError, OSError, EOFError):
                pass
        at = stretch.find(CONTINUATION, at + 1)
    return None


def _holds_a_whole_file(path: str, source, schema: bytes) -> bool:
    """Whether the stretch ``schema`` (bytes 8.. of ``source``) holds where one IPC file ends and
    the next starts: the closing and opening magics end to end, with everything before them a
    whole file, as :func:`check_file_layout` and pyarrow judge one (so a field named
    ``ARROW1ARROW1``, whose bytes are the same, is not taken for it)."""
    at = schema.find(_JOINED)
    while at >= 0:
        try:
            prefix = _Prefix(source, 8 + at + len(_MAGIC))
            check_file_layout(path, prefix)
            # and pyarrow opens it (its footer a verified flatbuffer): a field name's bytes, read
            # as a footer, can pass the layout walk as a file without batches
            pa.ipc.open_file(pa.BufferReader(source.read_at(prefix.size(), 0)))
            return True
        except (DataError, struct.error, ValueError, IndexError, OSError, ArithmeticError):
            pass
        except Exception as exc:  # noqa: BLE001 - pyarrow's own errors on a nonsense offset
            if type(exc).__module__.split(".")[0] != "pyarrow":
                raise
        at = schema.find(_JOINED, at + 1)
    return False


class _Prefix:
    """The first ``size`` bytes of ``source``, read as a file of their own."""

    def __init__(self, source, size: int):
        self._source, self._size = source, size

    def size(self) -> int:
        return self._size

    def read_at(self, nbytes: int, offset: int):
        if offset < 0 or nbytes < 0 or offset + nbytes > self._size:
            raise ValueError("outside the prefix")
        return self._source.read_at(nbytes, offset)


def _framed_schema_end(source) -> tuple[int, bool]:
    """Where a schema message framed as in a stream ends, and whether a continuation marker
    frames it: after the marker and a length (the marker may follow zero padding that aligns it,
    up to byte 64, as arrow-rs writes), or (pre-1.0) after the length alone at byte 8."""
    head = bytes(source.read_at(min(_ALIGNED_SCHEMA_AT + 8, source.size()), 0))
    at = 8
    while at < _ALIGNED_SCHEMA_AT and head[at:at + 8] == bytes(8):
        at += 8
    if head[at:at + 4] == CONTINUATION and len(head) >= at + 8:
        return at + 8 + int.from_bytes(head[at + 4:at + 8], "little", signed=True), True
    return 12 + int.from_bytes(head[8:12], "little", signed=True), False


def _ends_messages(source, position: int, footer_start: int) -> bool:
    """Whether the messages may end at ``position``: at most an end-of-stream marker between it and the footer."""
    gap = footer_start - position
    return 0 <= gap <= 8 and bytes(source.read_at(gap, position)) in _BEFORE_FOOTER

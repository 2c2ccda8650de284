"""Arrow IPC file structure read straight from its flatbuffers: the footer's blocks, and
whether a record batch's body is compressed, without pyarrow reading any batch.

An IPC file is the magic ``ARROW1`` (padded to 8 bytes), the messages of a stream, the footer
(a ``Footer`` flatbuffer, File.fbs), its length and the magic again. Each message is framed by
a continuation marker and a length (pre-1.0: the length alone), then a ``Message`` flatbuffer
(Message.fbs) and its body. Used by the sources (checking an input file's layout) and by the
shards' readers (refusing a compressed shard); imports nothing heavy, as the torch side reads
shards without numba.
"""
from __future__ import annotations

import struct

CONTINUATION = b"\xff\xff\xff\xff"
#: Footer table fields (File.fbs): version, schema, dictionaries, recordBatches.
DICTIONARIES, RECORD_BATCHES = 2, 3
#: struct Block { offset: long; metaDataLength: int; (4 bytes padding) bodyLength: long; }
_BLOCK = struct.Struct("<qi4xq")


def footer_blocks(footer: bytes, slots: tuple[int, ...] = (DICTIONARIES, RECORD_BATCHES)) -> list[tuple[int, int, int]]:
    """The dictionary and record batch blocks (``slots``) of a footer flatbuffer, as
    ``(offset, metadata length, body length)``."""
    table = u32(footer, 0)
    blocks = []
    for slot in slots:
        field = _field(footer, table, slot)
        if not field:
            continue
        vector = table + field + u32(footer, table + field)
        count = u32(footer, vector)
        blocks += [_BLOCK.unpack_from(footer, vector + 4 + _BLOCK.size * i) for i in range(count)]
    return blocks


#: Message.header_type of a record batch (MessageHeader in Message.fbs), the Message table's
#: header_type and header fields, RecordBatch's compression field, BodyCompression's codec.
_RECORD_BATCH_HEADER, _HEADER_TYPE, _HEADER, _COMPRESSION, _CODEC = 3, 1, 2, 3, 0
_CODECS = {0: "LZ4", 1: "Zstandard"}


def first_compressed_batch(source) -> tuple[int, str] | None:
    """(number, codec) of the first record batch of an IPC file (``source``, an open
    ``pa.memory_map``) whose body is compressed, None where none is. Reads the footer and each
    batch's message header, never a body: pyarrow decompresses a body whole as it reads the
    batch (70 KB of Zstandard held a 2^29-token pack)."""
    size = source.size()
    footer_length = int.from_bytes(source.read_at(4, size - 10), "little", signed=True)
    footer = bytes(source.read_at(footer_length, size - 10 - footer_length))
    batches = footer_blocks(footer, slots=(RECORD_BATCHES,))
    for number, (offset, metadata_length, _body) in enumerate(batches):
        meta = bytes(source.read_at(metadata_length, offset))
        flat = meta[8:] if meta[:4] == CONTINUATION else meta[4:]
        message = u32(flat, 0)
        kind, header = _field(flat, message, _HEADER_TYPE), _field(flat, message, _HEADER)
        if not kind or flat[message + kind] != _RECORD_BATCH_HEADER or not header:
            continue
        batch = message + header + u32(flat, message + header)
        compression = _field(flat, batch, _COMPRESSION)
        if compression:
            body = batch + compression + u32(flat, batch + compression)
            codec = _field(flat, body, _CODEC)
            return number, _CODECS.get(flat[body + codec] if codec else 0, "an unknown codec")
    return None


def _field(flat: bytes, table: int, slot: int) -> int:
    """Offset of field ``slot`` within the flatbuffer table at ``table``; 0 where it is absent."""
    vtable = table - struct.unpack_from("<i", flat, table)[0]
    vtable_size = struct.unpack_from("<H", flat, vtable)[0]
    entry = vtable + 4 + 2 * slot
    return struct.unpack_from("<H", flat, entry)[0] if entry + 2 <= vtable + vtable_size else 0


def u32(data: bytes, at: int) -> int:
    return struct.unpack_from("<I", data, at)[0]

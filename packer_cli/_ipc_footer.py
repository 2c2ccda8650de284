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
#: header_type, header and custom_metadata fields, RecordBatch's compression field,
#: BodyCompression's codec, KeyValue's key and value.
_VERSION, _RECORD_BATCH_HEADER, _HEADER_TYPE, _HEADER, _CUSTOM_METADATA = 0, 3, 1, 2, 4
_COMPRESSION, _CODEC, _KEY, _VALUE = 3, 0, 0, 1
_CODECS = {0: "LZ4", 1: "Zstandard"}
#: How Arrow 0.17 marked a compressed body (metadata version V4, no compression field), which
#: pyarrow still honours, in a V4 message only (MetadataVersion V4 = 3).
_V4 = 3
_EXPERIMENTAL_COMPRESSION = b"ARROW:experimental_compression"
_EXPERIMENTAL_CODECS = {b"lz4": "LZ4", b"lz4_frame": "LZ4", b"zstd": "Zstandard"}


def first_compressed_batch(source) -> tuple[int, str] | None:
    """(number, codec) of the first record batch of an IPC file (``source``, an open
    ``pa.memory_map``) whose body is compressed, None where none is. Reads the footer and each
    batch's message header, never a body: pyarrow decompresses a body whole as it reads the
    batch (70 KB of Zstandard held a 2^29-token pack)."""
    batches = footer_blocks(read_footer(source)[1], slots=(RECORD_BATCHES,))
    for number, (offset, metadata_length, _body) in enumerate(batches):
        meta = _read(source, metadata_length, offset)
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
        version = _field(flat, message, _VERSION)
        if not version or struct.unpack_from("<h", flat, message + version)[0] != _V4:
            continue
        marked = _custom_value(flat, message, _EXPERIMENTAL_COMPRESSION)
        if marked is not None:
            return number, _EXPERIMENTAL_CODECS.get(marked, "an unknown codec")
    return None


def read_footer(source) -> tuple[int, bytes]:
    """(where it starts, its bytes) of the footer flatbuffer of an IPC file (``source``, an open
    ``pa.memory_map``): it ends 10 bytes before the file does, at its length and the magic."""
    size = source.size()
    length = int.from_bytes(_read(source, 4, size - 10), "little", signed=True)
    return size - 10 - length, _read(source, length, size - 10 - length)


def _read(source, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset``, which must lie within the file (a damaged footer's
    negative length crashed pyarrow's read with a SystemError)."""
    if length < 0 or offset < 0 or offset + length > source.size():
        raise ValueError(f"{length} bytes at byte {offset} lie outside the file")
    return bytes(source.read_at(length, offset))


def _custom_value(flat: bytes, message: int, key: bytes) -> bytes | None:
    """The value of ``key`` in a Message's custom_metadata, None where it has none."""
    field = _field(flat, message, _CUSTOM_METADATA)
    if not field:
        return None
    vector = message + field + u32(flat, message + field)
    for i in range(u32(flat, vector)):
        at = vector + 4 + 4 * i
        pair = at + u32(flat, at)
        if _string(flat, pair, _KEY) == key:
            return _string(flat, pair, _VALUE)
    return None


def _string(flat: bytes, table: int, slot: int) -> bytes:
    field = _field(flat, table, slot)
    if not field:
        return b""
    at = table + field + u32(flat, table + field)
    return flat[at + 4:at + 4 + u32(flat, at)]


def _field(flat: bytes, table: int, slot: int) -> int:
    """Offset of field ``slot`` within the flatbuffer table at ``table``; 0 where it is absent."""
    vtable = table - struct.unpack_from("<i", flat, table)[0]
    vtable_size = struct.unpack_from("<H", flat, vtable)[0]
    entry = vtable + 4 + 2 * slot
    return struct.unpack_from("<H", flat, entry)[0] if entry + 2 <= vtable + vtable_size else 0


def u32(data: bytes, at: int) -> int:
    return struct.unpack_from("<I", data, at)[0]

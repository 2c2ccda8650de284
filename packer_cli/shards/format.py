"""The native on-disk format: names, version and the Arrow schema of a pack row.

Defined once here; docs/FORMAT.md describes it for humans. An output directory holds::

    metadata.json        spec, counts, bounds, Bridge keys   (written last)
    manifest.json        every shard: name, bytes, rows, tokens, xxh3_64
    packs-00000.arrow    Arrow IPC file, uncompressed, one row per pack (loss mask as a bitmap)
    packs-00001.arrow    ...
"""
from __future__ import annotations

import os
import re
import struct

import pyarrow as pa

from packer_cli._ipc_footer import first_compressed_batch

FORMAT_NAME = "packer-thd"
FORMAT_VERSION = 2
#: Versions the readers (loader, inspect, verify) still accept; only FORMAT_VERSION is written.
READABLE_VERSIONS = (1, 2)
READABLE_VERSIONS_TEXT = ", ".join(map(str, READABLE_VERSIONS))  # for messages: "1, 2"
METADATA_FILE = "metadata.json"
MANIFEST_FILE = "manifest.json"
CHECKSUM = "xxh3_64"
MAX_LISTED_BAD = 1000  # metadata.json's bad_records lists the first this many (counts.bad_records counts all)


def is_readable_version(value) -> bool:
    """Whether a recorded ``format_version`` is one this packer reads (an int, not ``true``)."""
    return type(value) is int and value in READABLE_VERSIONS


def metadata_checksum(meta: dict) -> str:
    """xxh3_64 of the metadata's canonical JSON (sorted keys), without its own checksum key."""
    import orjson
    import xxhash

    body = {k: v for k, v in meta.items() if k != "checksum"}
    return xxhash.xxh3_64_hexdigest(orjson.dumps(body, option=orjson.OPT_SORT_KEYS))


def read_json_value(path: str):
    """The JSON value in the regular file at ``path`` (orjson: nesting past 1,024 levels is a
    decode error, not a RecursionError; so is nesting past the 254 levels orjson writes, which
    the metadata checksum would otherwise raise on).

    Raises ``OSError`` (``FileNotFoundError`` when there is no such file; also for a FIFO, a
    device or a directory, which the file is opened non-blocking to find out: reading a FIFO
    without a writer would wait forever) or ``orjson.JSONDecodeError``; callers word them.
    """
    import errno
    import stat

    import orjson

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:  # before open(fd): a directory raised IsADirectoryError naming the descriptor ('Is a directory: 5')
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
    except OSError:
        os.close(fd)
        raise
    with open(fd, "rb") as f:
        value = orjson.loads(f.read())
    try:  # the metadata checksum and --json reports write values out again: orjson writes 254 levels at most
        orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise orjson.JSONDecodeError(f"nested deeper than orjson writes ({exc})", "", 0) from None
    return value


def write_json(path: str, obj) -> None:
    """One of an output's JSON files (manifest, metadata): indented, keys sorted, newline-terminated,
    so two runs' files diff line by line."""
    import orjson

    from packer_cli.shards._atomic import write_synced

    write_synced(path, orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")


def seal_metadata(meta: dict) -> dict:
    """The metadata with ``checksum`` added, so any later edit of any field is detectable."""
    return {**meta, "checksum": {CHECKSUM: metadata_checksum(meta)}}


def metadata_checksum_problem(meta: dict) -> str | None:
    """Why the metadata's self-checksum does not hold (None when it does)."""
    recorded = meta.get("checksum")
    if not isinstance(recorded, dict) or CHECKSUM not in recorded:
        return f"has no checksum.{CHECKSUM}"
    actual = metadata_checksum(meta)
    if recorded[CHECKSUM] != actual:
        return f"checksum.{CHECKSUM} is {recorded[CHECKSUM]!r} but its content hashes to {actual!r} (edited after writing)"
    return None


def compressed_shard_problem(source) -> str | None:
    """What is wrong with a shard (``source``, an open ``pa.memory_map``) whose record batches
    are compressed, None where none is. Shards are uncompressed so that packs are read through
    the memory map; a compressed batch is decompressed whole as pyarrow reads it (70 KB of
    Zstandard held a 2^29-token pack: 2.3 GB to inspect). Read from the batches' headers
    alone, before any body is."""
    try:
        found = first_compressed_batch(source)
    except (struct.error, IndexError, ValueError, OSError, SystemError, OverflowError):
        return "the Arrow IPC footer or a record batch header is damaged"
    if found is None:
        return None
    number, codec = found
    return (f"record batch {number} is compressed ({codec}): {FORMAT_NAME} shards are uncompressed, "
            "to be memory-mapped (written by another tool, or rewritten?)")


def shard_name(index: int) -> str:
    return f"packs-{index:05d}.arrow"


_SHARD_NAME = re.compile(r"packs-\d{5,}\.arrow")


def is_output_file_name(name: str) -> bool:
    """Whether ``name`` is one of the files packer writes into a native output directory."""
    return name in (MANIFEST_FILE, METADATA_FILE) or _SHARD_NAME.fullmatch(name) is not None


#: One row per pack. Per-token columns have Σp entries (the runtime stream incl. alignment
#: padding, no tail); per-sequence columns have N entries; cu_seqlens has N+1. ``loss_mask`` is
#: an Arrow boolean list, stored as a bitmap (1 bit a token; version 1 stored a uint8 a token).
def pack_schema(version: int = FORMAT_VERSION) -> pa.Schema:
    """The pack row schema of a format version (:data:`READABLE_VERSIONS`)."""
    mask_type = pa.uint8() if version == 1 else pa.bool_()
    return pa.schema(
        [
            pa.field("tokens", pa.list_(pa.int32()), nullable=False),
            pa.field("loss_mask", pa.list_(mask_type), nullable=False),
            pa.field("cu_seqlens", pa.list_(pa.int32()), nullable=False),
            pa.field("seq_lens", pa.list_(pa.int32()), nullable=False),
            pa.field("last_token", pa.list_(pa.int32()), nullable=False),
            pa.field("source_index", pa.list_(pa.int64()), nullable=False),
            pa.field("source_offset", pa.list_(pa.int32()), nullable=False),
        ],
        metadata={"format": FORMAT_NAME, "format_version": str(version)},
    )


PACK_SCHEMA = pack_schema()

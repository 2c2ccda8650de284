"""The native on-disk format: names, version and the Arrow schema of a pack row.

Defined once here; docs/FORMAT.md describes it for humans. An output directory holds::

    metadata.json        spec, counts, bounds, Bridge keys   (written last)
    manifest.json        every shard: name, bytes, rows, tokens, xxh3_64
    packs-00000.arrow    Arrow IPC file, uncompressed, one row per pack
    packs-00001.arrow    ...
"""
from __future__ import annotations

import pyarrow as pa

FORMAT_NAME = "packer-thd"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
MANIFEST_FILE = "manifest.json"
CHECKSUM = "xxh3_64"


def shard_name(index: int) -> str:
    return f"packs-{index:05d}.arrow"


#: One row per pack. Per-token columns have Σp entries (the runtime stream incl. alignment
#: padding, no tail); per-sequence columns have N entries; cu_seqlens has N+1.
PACK_SCHEMA = pa.schema(
    [
        pa.field("tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("cu_seqlens", pa.list_(pa.int32()), nullable=False),
        pa.field("seq_lens", pa.list_(pa.int32()), nullable=False),
        pa.field("last_token", pa.list_(pa.int32()), nullable=False),
        pa.field("source_index", pa.list_(pa.int64()), nullable=False),
        pa.field("source_offset", pa.list_(pa.int32()), nullable=False),
    ],
    metadata={"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)},
)

PER_TOKEN = ("tokens", "loss_mask")
PER_SEQUENCE = ("seq_lens", "last_token", "source_index", "source_offset")

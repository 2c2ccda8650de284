"""The Megatron-Bridge drop-in format: names, layout and the stored row of a sequence.

``packer pack --format megatron-bridge`` writes what Bridge's offline packing writes, so a
Bridge config can point at it unchanged (docs/MEGATRON_BRIDGE.md)::

    OUT/
      training_4096.idx.parquet     one row per pack: input_ids, loss_mask, seq_start_id
                                    (+ packer_seq_lens, packer_source_index, packer_source_offset)
      validation_4096.idx.parquet   written by a second run with --split validation
      4096_metadata.jsonl           a JSON *array*, one dict of Bridge's six keys per split
      training.metadata.json        packer's own metadata of the split (inspect, verify, readers)
      training.manifest.json        the split's file: name, bytes, rows, tokens, xxh3_64
      validation.metadata.json, validation.manifest.json

How one sequence is stored. A sample of n tokens has s = n − 1 runtime positions padded to
p = ceil(s/m)·m. Bridge stores the sequence *with* its last label, so it takes p + 1 stored
slots; alignment padding is the end-of-sequence id E with loss 0 (m = 4, n = 6, s = 5, p = 8)::

    stored      x0 x1 x2 x3 x4 x5 E  E  E        p + 1 = 9 slots, seq_start_id points at x0
    inputs      x0 x1 x2 x3 x4 x5 E  E           stored[0:p]
    labels      x1 x2 x3 x4 x5 E  E  E           stored[1:p+1]
    loss_mask   m1 m2 m3 m4 m5 0  0  0  0        element j: is stored[j+1] a target?

packer's native row keeps the same runtime stream but writes ``pad_id`` where Bridge has x5
and the padding, and keeps x5 apart as ``last_token``; the ``packer_*`` columns (ignored by
Bridge) make the conversion exact both ways (:mod:`packer_cli.shards.bridge_reader`).
"""
from __future__ import annotations

import os
import re
from enum import Enum

BRIDGE_FORMAT = "megatron-bridge"
BRIDGE_FORMAT_VERSION = 1

#: Bridge's reader requires these three columns; it ignores any others.
BRIDGE_COLUMNS = ("input_ids", "loss_mask", "seq_start_id")
#: packer's per-sequence columns: real runtime length, input record, runtime offset in it.
PACKER_COLUMNS = ("packer_seq_lens", "packer_source_index", "packer_source_offset")

#: Target uncompressed bytes of one row group (see :func:`default_row_group_size`).
ROW_GROUP_BYTES = 1 << 20
#: Bridge's own writer uses 500 rows per group; the default never exceeds it.
BRIDGE_ROW_GROUP_ROWS = 500
#: Bytes per token the default row-group size is computed for: an int64 id and an int8 flag,
#: as Bridge's own writer stores them. packer writes int32 ids (5 bytes a token), so its
#: groups hold about 5/9 of ROW_GROUP_BYTES; kept at 9 so row groups, and outputs, stay as they were.
STORED_TOKEN_BYTES = 9


class OutputFormat(str, Enum):
    """What ``packer pack`` writes."""

    NATIVE = "native"
    """packer's Arrow IPC shards (docs/FORMAT.md)."""
    MEGATRON_BRIDGE = "megatron-bridge"
    """Bridge's ``{split}_{C}.idx.parquet`` + ``{C}_metadata.jsonl`` (docs/MEGATRON_BRIDGE.md)."""


class Split(str, Enum):
    """Bridge's two packed splits (Bridge never packs ``test``)."""

    TRAINING = "training"
    VALIDATION = "validation"


SPLITS = tuple(s.value for s in Split)


class ParquetEncoding(str, Enum):
    """How the split file is encoded (``shards.bridge_writer.PARQUET_ENCODINGS`` has the settings)."""

    PLAIN_ZSTD = "plain-zstd"
    """Token ids stored plainly, Zstandard: every Parquet reader (the default)."""
    PLAIN_SNAPPY = "plain-snappy"
    """Token ids stored plainly, Snappy (Bridge's own writer's codec): the largest file."""
    SPLIT_ZSTD = "split-zstd"
    """Token ids as byte streams, Zstandard: smallest for ids without repeats, larger than plain-zstd
    on real text (6-13 %: the streams break up its repeated n-grams); readers need Arrow >= 16."""


PARQUET_ENCODING_NAMES = tuple(e.value for e in ParquetEncoding)


def data_name(split: str, pack_size: int) -> str:
    """Bridge's data file name, e.g. ``training_4096.idx.parquet``."""
    return f"{split}_{pack_size}.idx.parquet"


def bridge_metadata_name(pack_size: int) -> str:
    """Bridge's metadata file name, e.g. ``4096_metadata.jsonl`` (a JSON array despite .jsonl)."""
    return f"{pack_size}_metadata.jsonl"


def split_metadata_name(split: str) -> str:
    return f"{split}.metadata.json"


def split_manifest_name(split: str) -> str:
    return f"{split}.manifest.json"


_LAYOUT_NAMES = (
    re.compile(r"^(training|validation)_(\d+)\.idx\.parquet$"),
    re.compile(r"^(\d+)_metadata\.jsonl$"),
    re.compile(r"^(training|validation)\.(metadata|manifest)\.json$"),
)


def default_row_group_size(pack_size: int) -> int:
    """Rows per Parquet row group: about :data:`ROW_GROUP_BYTES` of stored tokens.

    Bridge's reader keeps only the last row group it read, and its sampler visits rows in a
    shuffled order, so nearly every row costs one whole row group read and decoded. Small
    groups keep that cost near one pack; 1 MiB (a Parquet data page) keeps the footer small
    (one entry per column per group, read once at start-up).

    >>> default_row_group_size(4096), default_row_group_size(32768), default_row_group_size(512)
    (28, 3, 227)
    """
    rows = ROW_GROUP_BYTES // (STORED_TOKEN_BYTES * max(1, pack_size))
    return int(min(BRIDGE_ROW_GROUP_ROWS, max(1, rows)))


def is_layout_name(name: str) -> bool:
    """Whether ``name`` is one of the files of a Bridge layout (data, metadata, packer's split files)."""
    return any(p.match(name) for p in _LAYOUT_NAMES)


def layout_files(out_dir: str) -> list[str] | None:
    """The entries of ``out_dir`` if it looks like a Bridge layout (or is empty), else None."""
    names = sorted(os.listdir(out_dir))
    return names if all(map(is_layout_name, names)) else None


def layout_pack_sizes(names: list[str]) -> set[int]:
    """Pack sizes named by the Bridge files among ``names``."""
    sizes = set()
    for n in names:
        for p in _LAYOUT_NAMES[:2]:
            if match := p.match(n):
                sizes.add(int(match.groups()[-1]))
    return sizes


def is_bridge_dir(out_dir) -> bool:
    """True when ``out_dir`` holds at least one split written with ``--format megatron-bridge``:
    its metadata or its manifest (a split that lost its metadata is damage, not another tool's)."""
    return bool(packer_splits_in(out_dir))


def packer_splits_in(out_dir) -> list[str]:
    """Splits with a file only packer writes (metadata or manifest), in Bridge's order."""
    out_dir = os.fspath(out_dir)
    return [s for s in SPLITS if any(os.path.isfile(os.path.join(out_dir, name(s)))
                                     for name in (split_metadata_name, split_manifest_name))]


def data_only_split(out_dir: str, split: str) -> str | None:
    """The data file of ``split`` when it is here without either of packer's JSON files (a split
    Megatron-Bridge wrote itself, or one that lost both): nothing can check it. Else None."""
    if any(os.path.isfile(os.path.join(out_dir, name(split))) for name in (split_metadata_name, split_manifest_name)):
        return None
    data = sorted(n for n in os.listdir(out_dir) if (m := _LAYOUT_NAMES[0].match(n)) and m.group(1) == split)
    return data[0] if data else None


def split_has_files(out_dir: str, split: str) -> bool:
    """Whether any file of ``split`` (its data, metadata or manifest) is in ``out_dir``: a split
    with some files but not its metadata is damaged, one with none was never written."""
    return any(m.group(1) == split for n in os.listdir(out_dir) for p in (_LAYOUT_NAMES[0], _LAYOUT_NAMES[2])
               if (m := p.match(n)))


def lost_metadata(out_dir: str, split: str) -> str | None:
    """What is wrong with ``split`` when packer's manifest of it is in ``out_dir`` but its
    metadata is not (a split is found by its metadata, so it would go unverified); else None."""
    path = os.path.join(out_dir, split_metadata_name(split))
    if os.path.isfile(path) or not os.path.isfile(os.path.join(out_dir, split_manifest_name(split))):
        return None
    what = "not a regular file" if os.path.lexists(path) else "missing"
    return (f"{what}, but {split_manifest_name(split)} is here: the {split} split packer wrote "
            "cannot be verified without it")


def splits_in(out_dir: str) -> list[str]:
    """Splits of a Bridge layout that packer wrote, in Bridge's order (training first)."""
    return [s for s in SPLITS if os.path.isfile(os.path.join(out_dir, split_metadata_name(s)))]


def describe(output: dict) -> str:
    """One line for the summary: where the split went and where the EOS id came from."""
    eos = output.get("eos_id")
    source = output.get("eos_id_source")
    why = {
        "given": "--eos-id",
        "inferred": "inferred: every sample ends with it",
        "not needed": "no alignment padding, so none was needed",
        "not checked": "dry run: not checked",
    }.get(source, source)
    eos_text = f"eos id {eos} ({why})" if eos is not None else f"eos id: {why}"
    files = output.get("files", {})
    where = files.get("data", output.get("split"))
    encoding = f", {output['parquet_encoding']}" if output.get("parquet_encoding") else ""
    size = output.get("row_group_size")
    return (f"megatron-bridge: {where} (row groups of {size} pack{'' if size == 1 else 's'}{encoding}), "
            f"{files.get('bridge_metadata', '')}; {eos_text}")

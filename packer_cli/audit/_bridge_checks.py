"""Megatron-Bridge's own metadata file, ``{C}_metadata.jsonl``, checked for one split.

It is the file Bridge reads as ``packed_metadata_path`` (needed with ``pad_cu_seqlens``): a
JSON array with one dict of six keys per split, and Bridge takes the max/min of each key over
all entries. ``packer pack`` appends the split's ``bridge`` record of its metadata and, on
``--overwrite``, removes the split's old one (:mod:`packer_cli.shards.bridge_output`), so:

* ``bridge.array`` — the file exists and is such an array, every entry has the six keys with
  their types, and its ``pack_size`` is the C in the file's name (the one Bridge reads it for);
* ``bridge.file`` — what the split's manifest entry and its metadata's ``output`` record say
  about its Parquet file holds: the values' types, the two records alike, and the file's footer
  (row groups, rows per group, codec, byte-stream split ids, stored token count);
* ``bridge.entry`` — one entry equals this split's values (verify: recomputed from the data;
  inspect: as its metadata records them), and there are no more entries than splits, so no
  stale entry moves Bridge's max/min. Each split claims a distinct entry (two splits of equal
  values need two), assigned alike in every split's audit and in ``pack --overwrite``
  (:func:`~packer_cli.shards.bridge_output.claim_entries`).
"""
from __future__ import annotations

import os

from packer_cli._cycles import sweep
from packer_cli.audit._meta_checks import _same
from packer_cli.audit._meta_schema import BRIDGE_KEYS, _count
from packer_cli.audit.findings import FindingSink
from packer_cli.errors import DataError, shown
from packer_cli.shards.bridge import (BRIDGE_FORMAT, PARQUET_ENCODING_NAMES, SPLITS, bridge_metadata_name, data_name,
                                      data_only_split, lost_metadata, split_manifest_name, split_metadata_name)
from packer_cli.shards.bridge_output import claim_entries, present_split_values, read_bridge_array

RATIO_KEYS = ("packing_factor", "packing_efficiency")


def check_bridge_array(store, sink: FindingSink) -> list | None:
    """``bridge.array`` findings; the entries when the file could be read (else None)."""
    C = store.pack_size
    if C is None:
        return None  # metadata.spec reports it
    name = bridge_metadata_name(C)
    path = os.path.join(store.out, name)
    if not os.path.isfile(path):
        sink.add("bridge.array", "missing: Megatron-Bridge reads it as packed_metadata_path (required with "
                 "pad_cu_seqlens)", shard=name)
        return None
    try:
        array = read_bridge_array(path)
    except DataError as exc:
        sink.add("bridge.array", str(exc).removeprefix(f"{path}: "), shard=name)
        return None
    if not array:
        sink.add("bridge.array", "holds no entry; packer adds one per split", shard=name)
    for i, entry in enumerate(array):
        for problem in _entry_problems(entry, C):
            sink.add("bridge.array", f"entry {i}: {problem}", shard=name)
    return array


def check_split_metadata_present(store, sink: FindingSink) -> None:
    """``structure.json``: every split whose manifest packer wrote has its metadata. A split is
    found by its metadata alone, so without it the split (a Bridge-written one, as it seems) is
    never verified, whatever its data file holds."""
    for split in SPLITS:
        if problem := lost_metadata(store.out, split):
            sink.add("structure.json", problem, shard=split_metadata_name(split))
        elif data := data_only_split(store.out, split):  # Bridge's own, or one that lost both: said, not failed
            sink.warn("structure.unverified", f"the {split} split's data file is here without "
                      f"{split_metadata_name(split)} or {split_manifest_name(split)} (Megatron-Bridge's own split, "
                      "or one that lost both): it is not verified", shard=data)


def _entry_problems(entry: dict, C: int):
    for key in BRIDGE_KEYS:
        value = entry.get(key)
        if key not in entry:
            yield f"{key} is missing"
        elif key in RATIO_KEYS and (type(value) not in (int, float) or not value >= 0):
            yield f"{key} is {value!r}, expected a number"
        elif key not in RATIO_KEYS and (type(value) is not int or value < 0):
            yield f"{key} is {value!r}, expected an integer"
    if type(entry.get("pack_size")) is int and entry["pack_size"] != C:
        yield f"pack_size is {entry['pack_size']}, but Bridge reads this file for pack size {C}"


def check_bridge_entries(store, array: list, expected: dict, sink: FindingSink, what: str = "the data has") -> None:
    """``bridge.entry``: ``expected`` (this split's six values) is one entry; no stale entries."""
    name = bridge_metadata_name(store.pack_size)
    claims = _split_values(store, expected)
    # One assignment, the same in every split's audit (and pack's): two splits with the same
    # values need two such entries, else an edited one would pass as the other split's.
    taken, unclaimed = claim_entries(array, claims)
    if taken[store.split] is None and unclaimed:  # the closest entry is taken to be this split's, edited
        k = min(unclaimed, key=lambda i: len(_differences(array[i], expected, what)))
        unclaimed.remove(k)
        sink.add("bridge.entry", f"entry {k}, the {store.split} split's: "
                 f"{'; '.join(_differences(array[k], expected, what))}", shard=name)
    elif taken[store.split] is None:
        sink.add("bridge.entry", f"no entry describes the {store.split} split ({what} {expected})", shard=name)
    unmatched_others = sum(taken.get(split) is None for split, _ in claims if split != store.split)
    if len(unclaimed) > unmatched_others:  # each other split may hold one entry its own audit judges
        splits = len(claims)
        sink.add("bridge.entry", f"holds {len(array)} entries for the {splits} split{'s' if splits > 1 else ''} "
                 f"here; Bridge takes the max/min over all of them, so a stale entry changes what it reads",
                 shard=name)


def _split_values(store, expected: dict) -> list[tuple[str, dict | None]]:
    """``(split, its six values)`` of every split with a data file here, this one included (with
    ``expected``), in Bridge's order. Another split's are its recorded ``bridge`` record (None:
    not known, as for a split Bridge itself wrote, which has no packer metadata)."""
    present = dict(present_split_values(store.out, store.pack_size))
    return [(split, expected if split == store.split else present[split]) for split in SPLITS
            if split == store.split or split in present]


def _differences(entry: dict, expected: dict, what: str) -> list[str]:
    return [f"{key} is {entry[key]!r} but {what} {expected.get(key)!r}" if key in entry else f"{key} is missing"
            for key in BRIDGE_KEYS if key not in entry or not _same(entry[key], expected.get(key))]


#: The EOS id's origins a split's metadata records (see ``shards.bridge_writer.resolve_eos``).
EOS_SOURCES = ("given", "inferred", "not needed", "not checked")


def check_file_facts(store, sink: FindingSink) -> None:
    """``bridge.file``: the split's manifest entry and metadata ``output`` record against each
    other and against its Parquet file's footer (a footer read, no data). Every packer that
    wrote this layout recorded the row groups and stored tokens; ``parquet_encoding`` came
    later, and is not looked for where it is absent."""
    entries = store.shard_entries()
    if len(entries) != 1 or not isinstance(entries[0], dict) or store.pack_size is None:
        return  # structure.* report it
    entry, C = entries[0], store.pack_size
    _check_manifest_entry(store, entry, sink)
    _check_output_record(store, entry, C, sink)
    _check_footer(store, entry, sink)


def _check_manifest_entry(store, entry: dict, sink: FindingSink) -> None:
    for key, ok, want in (("row_groups", _count, "a count"), ("stored_tokens", _count, "a count"),
                          ("row_group_size", lambda v: _count(v) and v > 0, "a positive integer"),
                          ("parquet_encoding", lambda v: v in PARQUET_ENCODING_NAMES,
                           f"one of {', '.join(PARQUET_ENCODING_NAMES)}")):
        if (key in entry or key != "parquet_encoding") and not ok(entry.get(key)):
            sink.add("bridge.file", f"{key} is {shown(entry.get(key))}, expected {want}", shard=store.manifest_name)
    rows, size = entry.get("rows"), entry.get("row_group_size")
    if _count(rows) and _count(size) and size > 0 and _count(entry.get("row_groups")) \
            and entry["row_groups"] != -(-rows // size):
        sink.add("bridge.file", f"row_groups is {entry['row_groups']}, but {rows} rows in groups of {size} make "
                 f"{-(-rows // size)}", shard=store.manifest_name)


def _check_output_record(store, entry: dict, C: int, sink: FindingSink) -> None:
    output = store.metadata.get("output")
    if not isinstance(output, dict):
        return  # metadata.schema reports it
    files = {"data": data_name(store.split, C), "bridge_metadata": bridge_metadata_name(C),
             "metadata": split_metadata_name(store.split), "manifest": split_manifest_name(store.split)}
    expected = {"format": BRIDGE_FORMAT, "split": store.split, "files": files,
                "parquet_encoding": entry.get("parquet_encoding"), "row_group_size": entry.get("row_group_size")}
    for key, value in expected.items():
        if key == "parquet_encoding" and key not in output and key not in entry:
            continue  # written before packer recorded it (in both records, or in neither)
        if key not in output:
            sink.add("bridge.file", f"output.{key} is missing", shard=store.metadata_name)
        elif output[key] != value or type(output[key]) is not type(value):
            whose = "the manifest's" if key in ("parquet_encoding", "row_group_size") else "this split's"
            sink.add("bridge.file", f"output.{key} is {shown(output.get(key), 120)}, {whose} is {shown(value, 120)}",
                     shard=store.metadata_name)
    if "eos_id_source" in output and output["eos_id_source"] not in EOS_SOURCES:
        sink.add("bridge.file", f"output.eos_id_source is {shown(output.get('eos_id_source'))}, expected one of "
                 f"{', '.join(EOS_SOURCES)}", shard=store.metadata_name)
    for key in ("eos_scan_too_short", "eos_scan_too_long", "samples_not_ending_with_eos"):
        if key in output and not (output[key] is None or _count(output[key])):
            sink.add("bridge.file", f"output.{key} is {shown(output[key])}, expected a count",
                     shard=store.metadata_name)
    if output.get("eos_id_source") == "inferred" and output.get("samples_not_ending_with_eos") not in (0, None):
        sink.add("bridge.file", f"output.samples_not_ending_with_eos is {shown(output['samples_not_ending_with_eos'])}, "
                 "but an inferred EOS id is the token every sample ends with", shard=store.metadata_name)


#: Parquet's codec numbers pyarrow knows (UNCOMPRESSED, SNAPPY, GZIP, LZO, BROTLI, LZ4, ZSTD, LZ4_RAW).
_KNOWN_CODECS = range(8)


def _unsafe_footer(path: str, footer) -> str | None:
    """Why pyarrow's per-column-chunk accessors may not be asked about the footer of the file at
    ``path`` (``footer``: pyarrow's metadata of it), or None. A codec number pyarrow does not know
    (one flipped bit in a footer) made ``ColumnChunkMetaData.compression`` throw a C++ exception
    Python cannot catch, ending ``verify`` and ``inspect`` with SIGABRT. The footer is read here
    by packer first: with the input decoder's compiled walk where numba is loaded already
    (``verify``, ``inspect``: 1-2 ms), else with the strict pure-Python Thrift reader (the
    PyTorch side, which runs these checks too and loads no compiler: 0.2 s for the 1,031 row
    groups of the benchmark's split, once as a dataset opens)."""
    import sys

    if "numba" in sys.modules:
        from packer_cli.sources._parquet_footer import CODEC, CODECS, read_footer

        fd = os.open(path, os.O_RDONLY)
        try:
            walked = read_footer(fd, os.fstat(fd).st_size, footer.num_row_groups, footer.num_columns)
        finally:
            os.close(fd)
        if walked is None:
            return "its row groups or column chunks are not the ones pyarrow read"
        if not set(walked.chunks[:, CODEC].tolist()) <= set(CODECS):
            return "a column chunk names an unknown codec"
        return None  # (row counts that do not add up: shard.unreadable says so where the file is read)
    from packer_cli._thrift import ThriftError, read_struct

    with open(path, "rb") as f:
        f.seek(-8, os.SEEK_END)
        tail = f.read(8)
        size = int.from_bytes(tail[:4], "little")
        f.seek(-8 - size, os.SEEK_END)
        raw = f.read(size)
    try:
        meta, _ = read_struct(raw, 0, "the footer")
        chunks = [chunk for group in meta.get(4, []) for chunk in group.get(1, [])]
        codecs = {chunk.get(3, {}).get(4) for chunk in chunks}
    except (ThriftError, AttributeError, TypeError) as exc:  # AttributeError, TypeError: a field of another type
        return f"it does not parse ({exc})"
    if len(meta.get(4, [])) != footer.num_row_groups or len(chunks) != footer.num_row_groups * footer.num_columns:
        return "its row groups or column chunks are not the ones pyarrow read"
    if not codecs <= set(_KNOWN_CODECS):
        return "a column chunk names an unknown codec"
    return None


#: Row groups from which the footer ``_check_footer`` reads is freed at once (about 5 KB a group).
SWEPT_FOOTER_GROUPS = 1024


def _check_footer(store, entry: dict, sink: FindingSink) -> None:
    """The manifest entry against the footer; a large footer's copy is freed before the data is
    read (pyarrow holds it in a reference cycle, and the CLI runs with the collector off: a
    split of 255k row groups held 1.4 GB more through inspect and verify)."""
    groups = _check_footer_facts(store, entry, sink)
    if groups >= SWEPT_FOOTER_GROUPS:
        sweep()


def _check_footer_facts(store, entry: dict, sink: FindingSink) -> int:
    """The checks of :func:`_check_footer`; the number of row groups read (0 for none)."""
    import pyarrow.parquet as pq

    name, size = entry.get("name"), entry.get("row_group_size")
    path = os.path.join(store.out, name)
    if not os.path.isfile(path):  # opening a FIFO waits for a writer: shard.* report it
        return 0
    try:
        footer = pq.ParquetFile(path).metadata
        problem = _unsafe_footer(path, footer)
    except Exception:  # noqa: BLE001 - unreadable: shard.* report it with the reason
        return 0
    where = store.manifest_name
    if problem:
        sink.add("bridge.file", f"its footer cannot be read: {problem}", shard=name)
        return 0
    groups = [footer.row_group(g) for g in range(footer.num_row_groups)]
    if any(g.num_rows <= 0 for g in groups) or sum(g.num_rows for g in groups) != footer.num_rows:
        return len(groups)  # a damaged footer: shard.unreadable reports it where the file is opened
    if "row_groups" in entry and entry["row_groups"] != len(groups):
        sink.add("bridge.file", f"row_groups is {shown(entry.get('row_groups'))}, the file has {len(groups)}", shard=where)
    sizes = [g.num_rows for g in groups]
    if _count(size) and size > 0 and (any(n != size for n in sizes[:-1]) or (sizes and not 0 < sizes[-1] <= size)):
        sink.add("bridge.file", f"row_group_size is {size}, the file's groups hold {_sizes(sizes)} rows", shard=where)
    encoding = entry.get("parquet_encoding")
    if encoding in PARQUET_ENCODING_NAMES:
        codec = "SNAPPY" if encoding.endswith("snappy") else "ZSTD"
        found = {g.column(c).compression for g in groups for c in range(g.num_columns)}
        if found - {codec}:
            sink.add("bridge.file", f"parquet_encoding is {encoding}, the file's columns are compressed with "
                     f"{', '.join(sorted(found))}", shard=where)
    ids = [c for c in range(footer.num_columns) if footer.schema.column(c).path == "input_ids.list.element"]
    if ids and groups:
        split = any("BYTE_STREAM_SPLIT" in g.column(ids[0]).encodings for g in groups)
        if encoding in PARQUET_ENCODING_NAMES and split != encoding.startswith("split"):
            sink.add("bridge.file", f"parquet_encoding is {encoding}, but the file's ids are "
                     f"{'' if split else 'not '}split into byte streams", shard=where)
        values = sum(g.column(ids[0]).num_values for g in groups)
        if _count(entry.get("stored_tokens")) and entry["stored_tokens"] != values:
            sink.add("bridge.file", f"stored_tokens is {entry['stored_tokens']}, the file's input_ids hold {values} "
                     "values", shard=where)
    return len(groups)


def _sizes(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:3]))}, ..., {', '.join(map(str, sizes[-2:]))}"

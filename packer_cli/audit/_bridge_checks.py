"""Megatron-Bridge's own metadata file, ``{C}_metadata.jsonl``, checked for one split.

It is the file Bridge reads as ``packed_metadata_path`` (needed with ``pad_cu_seqlens``): a
JSON array with one dict of six keys per split, and Bridge takes the max/min of each key over
all entries. ``packer pack`` appends the split's ``bridge`` record of its metadata and, on
``--overwrite``, removes the split's old one (:mod:`packer_cli.shards.bridge_output`), so:

* ``bridge.array`` — the file exists and is such an array, every entry has the six keys with
  their types, and its ``pack_size`` is the C in the file's name (the one Bridge reads it for);
* ``bridge.entry`` — one entry equals this split's values (verify: recomputed from the data;
  inspect: as its metadata records them), and there are no more entries than splits, so no
  stale entry moves Bridge's max/min. Each split claims a distinct entry (two splits of equal
  values need two), assigned alike in every split's audit and in ``pack --overwrite``
  (:func:`~packer_cli.shards.bridge_output.claim_entries`).
"""
from __future__ import annotations

import os

from packer_cli.audit._meta_checks import _same
from packer_cli.audit._meta_schema import BRIDGE_KEYS
from packer_cli.audit.findings import FindingSink
from packer_cli.errors import DataError
from packer_cli.shards.bridge import SPLITS, bridge_metadata_name, lost_metadata, split_metadata_name
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

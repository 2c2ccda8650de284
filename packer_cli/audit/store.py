"""How the audit reads an output: a format plugs in by yielding :class:`PackBatch` objects.

::

    OUT ──open_store──▶ PackStore ──shard_names()──▶ "packs-00000.arrow", ...
                            │
                            └──read_shard(name, columns)──▶ PackBatch, PackBatch, ...
                                                               └──row(i)──▶ PackRow

A :class:`PackBatch` is a run of consecutive packs of one shard in columnar form: for each
column, the flat ``values`` of all its packs and ``offsets`` (``num_rows + 1`` entries) that
cut them into rows, exactly the shape of an Arrow list column. :meth:`PackBatch.row` gives one
pack as the :class:`~packer_cli.shards.reader.PackRow` every other part of packer uses.

The columns are those of the native format (:data:`packer_cli.shards.format.PACK_SCHEMA`):
``tokens``/``loss_mask`` per runtime position, ``cu_seqlens`` per sequence boundary and
``seq_lens``/``last_token``/``source_index``/``source_offset`` per sequence; the loss mask, stored
as a bitmap, is unpacked to one uint8 0/1 a token as its column is loaded. Another on-disk
format joins the audit by converting its rows to these columns in ``read_shard`` and adding
its class to :data:`STORES` under its metadata ``format`` name; inspect and verify need no change.

Columns are decoded lazily (``batch.column(name)``): inspect never touches the token pages of
a memory-mapped shard, so it reads only the columns it needs.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import orjson
import pyarrow as pa

from packer_cli.errors import DataError, first_line
from packer_cli._arrow import bits_to_numpy, to_numpy
from packer_cli.shards.format import (FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, METADATA_FILE, PACK_SCHEMA,
                                      READABLE_VERSIONS, READABLE_VERSIONS_TEXT, is_readable_version, pack_schema,
                                      compressed_shard_problem, read_json_value, shard_name)
from packer_cli.shards.reader import PackRow, schema_difference

COLUMNS = tuple(PACK_SCHEMA.names)
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ShardError(DataError):
    """A shard (or one of its record batches) cannot be read; carries the shard name."""

    def __init__(self, shard: str, message: str, row: int | None = None):
        self.shard, self.row, self.reason = shard, row, message
        super().__init__(f"{shard}{f' row {row}' if row is not None else ''}: {message}")

    def __reduce__(self):  # pickle's default calls the class with the message alone
        return type(self), (self.shard, self.reason, self.row)


@dataclass
class PackBatch:
    """Consecutive packs ``first_row .. first_row + num_rows`` of one shard, column by column."""

    shard: str
    first_row: int
    num_rows: int
    _load: Callable[[str], tuple[np.ndarray, np.ndarray]]
    _cache: dict = field(default_factory=dict, repr=False)

    def column(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(values, offsets)`` of a column as NumPy arrays (views of the mapped file)."""
        if name not in self._cache:
            self._cache[name] = self._load(name)
        return self._cache[name]

    def lengths(self, name: str) -> np.ndarray:
        """Entries per row of a column (int64)."""
        return np.diff(self.column(name)[1])

    def row(self, i: int) -> PackRow:
        """Pack ``i`` of this batch (0-based within the batch)."""
        parts = {}
        for name in COLUMNS:
            values, offsets = self.column(name)
            parts[name] = values[offsets[i]:offsets[i + 1]]
        return PackRow(**parts)


def read_json_file(path: str) -> dict:
    """A JSON object from ``path``; :class:`DataError` names the file when it is not one."""
    try:
        record = read_json_value(path)
    except FileNotFoundError:
        raise DataError(f"{os.path.basename(path)}: missing") from None
    except OSError as exc:
        raise DataError(f"{os.path.basename(path)}: cannot be read ({exc.strerror or exc})") from None
    except orjson.JSONDecodeError as exc:
        raise DataError(f"{os.path.basename(path)}: empty or corrupted JSON ({exc})") from None
    if not isinstance(record, dict):
        raise DataError(f"{os.path.basename(path)}: expected a JSON object, got {type(record).__name__}")
    return record


def manifest_problems(manifest: dict, metadata: dict | None = None) -> list[str]:
    """Why a manifest cannot be used (empty when it can): format, version (which must be the
    metadata's, when that records a readable one), shard entries."""
    if manifest.get("format") != FORMAT_NAME:
        return [f"format is {manifest.get('format')!r}, expected {FORMAT_NAME!r}"]
    version = manifest.get("format_version")
    if not is_readable_version(version):
        return [f"format_version is {version!r}; this packer knows versions {READABLE_VERSIONS_TEXT}"]
    recorded = (metadata or {}).get("format_version")
    if is_readable_version(recorded) and recorded != version:
        return [f"format_version is {version}, but {METADATA_FILE} records {recorded}"]
    return shard_entry_problems(manifest.get("shards"), reserved=(METADATA_FILE, MANIFEST_FILE))


def shard_entry_problems(shards, reserved=()) -> list[str]:
    """Why a manifest's ``shards`` list cannot be used (empty when it can): each entry an object
    with a safe file name (listed once, none of the ``reserved`` JSON files), counts and a checksum."""
    if not isinstance(shards, list):
        return ["'shards' is not a list"]
    problems, seen = [], set()
    for i, entry in enumerate(shards):
        if not isinstance(entry, dict):
            problems.append(f"shard entry {i} is not an object")
            continue
        name = entry.get("name")
        if not isinstance(name, str) or not SAFE_NAME.match(name) or name in reserved:
            problems.append(f"shard entry {i} has an unusable name {name!r}")
        elif name in seen:
            problems.append(f"shard {name} is listed twice")
        else:  # a usable name only: a list or object is unhashable
            seen.add(name)
        for key in ("bytes", "rows", "tokens"):
            if type(entry.get(key)) is not int or entry[key] < 0:
                problems.append(f"shard entry {i} ({name}): '{key}' is {entry.get(key)!r}, expected a count")
        if not isinstance(entry.get("xxh3_64"), str):
            problems.append(f"shard entry {i} ({name}): 'xxh3_64' is missing")
    return problems


class NativeStore:
    """The native format: ``metadata.json``, ``manifest.json`` and Arrow IPC shards.

    The interface a store offers the audit: ``metadata``, ``shard_entries()`` (manifest
    entries with ``name`` and, when known, ``bytes``/``rows``/``tokens``/``xxh3_64``),
    ``shard_names()``, ``expected_files()``, ``shard_name(index)`` (the name the writer gives
    shard ``index``, None if unknown), ``metadata_name``/``manifest_name`` (its JSON files) and
    ``read_shard(name, columns)``; the class has
    ``format``, ``version`` (the one it writes; optionally ``versions``, all it reads),
    ``open(out, meta=None)`` and optionally ``detect(out)`` (for layouts without a
    ``metadata.json``).
    """

    format = FORMAT_NAME
    version = FORMAT_VERSION  # written by this packer
    versions = READABLE_VERSIONS  # read by this packer
    metadata_name, manifest_name = METADATA_FILE, MANIFEST_FILE

    def __init__(self, out: str, metadata: dict, manifest: dict):
        self.out, self.metadata, self.manifest = out, metadata, manifest
        # The version this output was written in (shards are checked against its schema).
        recorded = [v for v in (metadata.get("format_version"), manifest.get("format_version")) if is_readable_version(v)]
        self.version = recorded[0] if recorded else FORMAT_VERSION

    @classmethod
    def open(cls, out: str, meta: dict | None = None) -> "NativeStore":
        """Open ``out`` for reading, raising :class:`DataError` when it is not usable."""
        meta = meta if meta is not None else read_json_file(os.path.join(out, METADATA_FILE))
        if not is_readable_version(meta.get("format_version")):
            raise DataError(f"{out}: unsupported format version {meta.get('format_version')!r}; "
                            f"this packer reads versions {READABLE_VERSIONS_TEXT}")
        manifest = read_json_file(os.path.join(out, MANIFEST_FILE))
        problems = manifest_problems(manifest, meta)
        if problems:
            raise DataError(f"{MANIFEST_FILE}: {problems[0]}")
        return cls(out, meta, manifest)

    def shard_entries(self) -> list[dict]:
        return list(self.manifest["shards"])

    def shard_names(self) -> list[str]:
        return [entry["name"] for entry in self.manifest["shards"]]

    def expected_files(self) -> set[str]:
        return {METADATA_FILE, MANIFEST_FILE, *self.shard_names()}

    def shard_name(self, index: int) -> str:
        """The name the writer gives its shard ``index`` (manifest entry ``index``)."""
        return shard_name(index)

    def read_shard(self, name: str, columns=COLUMNS) -> Iterator[PackBatch]:
        """Record batches of one shard, memory-mapped; :class:`ShardError` when unreadable.

        Only ``columns`` are validated (offsets in bounds, no nulls); other columns may still
        be read through :meth:`PackBatch.column` but are then the caller's to check.
        """
        path = os.path.join(self.out, name)
        try:
            source = pa.memory_map(path)
            reader = pa.ipc.open_file(source)
        except FileNotFoundError:
            raise ShardError(name, "missing") from None
        except (OSError, pa.ArrowException) as exc:
            raise ShardError(name, f"cannot open as Arrow IPC ({first_line(exc)})") from None
        expected = pack_schema(self.version)
        if not reader.schema.equals(expected, check_metadata=False):
            raise ShardError(name, f"schema differs from the {FORMAT_NAME} version {self.version} pack schema: "
                                   f"{schema_difference(reader.schema, expected)}")
        schema_keys = reader.schema.metadata or {}
        for key, expected_value in (("format", FORMAT_NAME), ("format_version", str(self.version))):
            recorded = schema_keys.get(key.encode())
            if recorded != expected_value.encode():
                shown = "missing" if recorded is None else repr(recorded.decode("utf-8", "replace")[:40])
                raise ShardError(name, f"schema {key} is {shown}, expected {expected_value}")
        if (problem := compressed_shard_problem(source)) is not None:
            raise ShardError(name, problem)
        row = 0
        for b in range(reader.num_record_batches):
            try:
                batch = reader.get_batch(b)
                for col in columns:
                    arr = batch.column(col)
                    arr.validate(full=True)
                    if arr.null_count or arr.values.null_count:
                        raise pa.ArrowInvalid(f"column {col} holds nulls")
            except (OSError, pa.ArrowException) as exc:
                raise ShardError(name, f"record batch {b} is corrupted ({first_line(exc)})", row=row) from None
            yield PackBatch(name, row, batch.num_rows, _loader(batch))
            row += batch.num_rows

    def batch_at(self, name: str, first_row: int) -> PackBatch:
        """The batch of shard ``name`` that starts at row ``first_row`` (read again, mapped)."""
        for batch in self.read_shard(name):
            if batch.first_row == first_row:
                return batch
        raise ShardError(name, f"no record batch starts at row {first_row}")


def _loader(batch: pa.RecordBatch) -> Callable[[str], tuple[np.ndarray, np.ndarray]]:
    def load(name: str):
        arr = batch.column(name)
        values = bits_to_numpy(arr.values) if pa.types.is_boolean(arr.type.value_type) else to_numpy(arr.values)
        return values, to_numpy(arr.offsets).astype(np.int64)
    return load


#: Metadata ``format`` name → store class (a future format registers itself here).
STORES = {FORMAT_NAME: NativeStore}


def open_store(out: str, split: str | None = None) -> NativeStore:
    """The store for ``out``, chosen by the ``format`` its metadata records (or ``detect``).

    ``split`` picks one split of a layout that holds several (Megatron-Bridge's).
    """
    if not os.path.exists(os.path.join(out, METADATA_FILE)):
        for store in STORES.values():
            if getattr(store, "detect", None) and store.detect(out):
                return store.open(out, split=split)
    meta = read_json_file(os.path.join(out, METADATA_FILE))
    store = STORES.get(meta.get("format")) if isinstance(meta.get("format"), str) else None  # a list is unhashable
    if store is None:
        raise DataError(f"{out}: unsupported data format {meta.get('format')!r}; known: {', '.join(STORES)}")
    return store.open(out, meta)


def _register_bridge() -> None:
    """Megatron-Bridge layouts (``pack --format megatron-bridge``) through their own store.

    Such a layout has no ``metadata.json``; :func:`open_store` and verify find it with
    ``detect`` (any split's metadata file present).
    """
    try:
        from packer_cli.shards.bridge import is_bridge_dir
        from packer_cli.shards.bridge_store import BridgeStore
    except ImportError:  # pragma: no cover - a build without the Bridge format
        return
    if not hasattr(BridgeStore, "detect"):
        detect = classmethod(lambda cls, out: is_bridge_dir(out))
        BridgeStore = type("BridgeStore", (BridgeStore,), {"detect": detect})
    STORES.setdefault(BridgeStore.format, BridgeStore)


_register_bridge()

"""Read a native output directory: metadata, manifest and memory-mapped pack rows.

``PackedReader(out)`` opens every shard named by the manifest with ``pa.memory_map`` and gives
random access to packs. :meth:`PackedReader.row` returns NumPy views into the mapped files; only
the pack's loss mask, stored as a bitmap, is unpacked (a copy of one byte a token of that pack).
Outputs of format version 1 (a uint8 mask a token) read the same.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import orjson
import pyarrow as pa

from packer_cli.errors import ConfigError, DataError, counted, not_a_directory
from packer_cli._arrow import bitmap_of, to_numpy, unpack_bits
from packer_cli.shards.format import (FORMAT_NAME, MANIFEST_FILE, METADATA_FILE, PACK_SCHEMA, READABLE_VERSIONS_TEXT,
                                      compressed_shard_problem, is_readable_version, pack_schema, read_json_value)

COLUMNS = PACK_SCHEMA.names


@dataclass(frozen=True)
class PackRow:
    """One pack: per-token ``tokens``/``loss_mask``, per-sequence arrays, ``cu_seqlens``."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    cu_seqlens: np.ndarray
    seq_lens: np.ndarray
    last_token: np.ndarray
    source_index: np.ndarray
    source_offset: np.ndarray

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.size)


def first_line(exc: BaseException) -> str:
    """An exception's message as one line (pyarrow's often run over several)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def column_name_problem(schema: pa.Schema) -> str | None:
    """Which column name of ``schema`` is not valid UTF-8 (a flipped bit leaves it so), or None.
    pyarrow decodes a name only when it is asked for, raising ``UnicodeDecodeError`` then, so a
    schema check asks for each here first."""
    for i in range(len(schema)):
        try:
            schema.field(i).name
        except UnicodeDecodeError as exc:
            return f"column {i}'s name {bytes(exc.object)[:60]!r} is not valid UTF-8"
    return None


def schema_difference(found: pa.Schema, expected: pa.Schema) -> str:
    """The first way ``found`` differs from ``expected``, in a few words (not the whole schema)."""
    def short(x) -> str:
        text = str(x).replace("\n", " ")
        return text if len(text) <= 60 else text[:57] + "..."

    if undecodable := column_name_problem(found):
        return undecodable
    names = list(found.names)
    for i, want in enumerate(expected):
        if i >= len(names):
            return f"column {want.name} is missing"
        if names[i] != want.name:
            return f"column {i} is {short(names[i])}, expected {want.name}"
        if not found.field(i).equals(want):
            kind = lambda f: short(f.type) + ("" if f.nullable else " not null")  # noqa: E731
            return f"column {want.name} is {kind(found.field(i))}, expected {kind(want)}"
    return f"unexpected column {short(names[len(expected)])}"


def footer_name_problem(exc: UnicodeDecodeError) -> str:
    """What ``UnicodeDecodeError`` from opening a Parquet file means: pyarrow decodes its footer's
    column names as it opens it, and one is not valid UTF-8."""
    return f"a column name in its footer, {bytes(exc.object)[:60]!r}, is not valid UTF-8"


def read_json(path: str) -> dict:
    try:
        return read_json_value(path)
    except FileNotFoundError:
        raise DataError(f"{path}: missing") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except orjson.JSONDecodeError as exc:
        raise DataError(f"{path}: empty or corrupted JSON ({exc})") from None


def load_metadata(out_dir: str, split: str | None = None) -> dict:
    """metadata.json of an output, rejecting unknown formats and versions by name.

    A Megatron-Bridge layout has one metadata file per split (``split`` picks it; see
    :mod:`packer_cli.shards.bridge`).
    """
    if not os.path.isdir(out_dir):
        raise DataError(not_a_directory(out_dir))
    if _wants_bridge(out_dir, split):
        from packer_cli.shards.bridge_reader import load_bridge_metadata

        return load_bridge_metadata(out_dir, split)
    meta = read_json(os.path.join(out_dir, METADATA_FILE))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DataError(f"{out_dir}: unsupported data format {meta.get('format') if isinstance(meta, dict) else None!r}; expected {FORMAT_NAME!r}")
    if not is_readable_version(meta.get("format_version")):
        raise DataError(f"{out_dir}: unsupported format version {meta.get('format_version')!r}; "
                        f"this packer reads versions {READABLE_VERSIONS_TEXT}")
    return meta


#: Findings of the layout checks that change nothing a reader serves: a stray file in the
#: directory, and Bridge's ``{C}_metadata.jsonl`` (``bridge.array``, ``bridge.entry``: the reader
#: takes only static shapes from it, checked apart, and it may hold other writers' entries).
#: verify still reports both. A Bridge data file's footer findings (``bridge.file``) stop a
#: reader: a footer stating a row of 2^27 ids in 181 KB was decoded (5.6 GB) before the row
#: was found longer than C.
_NOT_FOR_READERS = ("structure.files", "bridge.array", "bridge.entry")


def check_recorded_rows(path: str, held: int, entry: dict, manifest: str) -> None:
    """Refuse a file holding ``held`` packs where its manifest ``entry`` records another number:
    a footer listing fewer record batches (or row groups) served fewer packs without a word."""
    recorded = entry.get("rows")
    if type(recorded) is int and held != recorded:
        raise DataError(f"{path}: holds {counted(held, 'pack')}, {manifest} records {recorded} "
                        "(a damaged footer, or the file replaced)")


def check_layout_for_reading(out_dir: str, split: str | None = None) -> None:
    """Run verify's checks that read no shard content (:func:`packer_cli.audit._layout_checks.check_layout`:
    metadata self-checksum, schema and usable spec; manifest well-formed, entry i is shard i,
    totals equal to the metadata's counts; every shard present with its recorded size) and raise
    :class:`~packer_cli.audit._layout_checks.InconsistentOutput` (a :class:`DataError`) naming the
    output, with the first finding of each failed check. They cost a JSON read and a stat a shard,
    and load no compiler (the audit's kernels stay unimported)."""
    from packer_cli.audit._layout_checks import check_layout, raise_if_inconsistent
    from packer_cli.audit.findings import FindingSink

    sink = FindingSink()
    check_layout(out_dir, sink, split)
    raise_if_inconsistent(out_dir, sink, "loaded", ignore=_NOT_FOR_READERS)


class _Bits:
    """The values of a boolean (bitmap) Arrow array; a slice is unpacked to uint8 0/1."""

    def __init__(self, arr: pa.BooleanArray):
        self.bitmap, self.offset = bitmap_of(arr)

    def __getitem__(self, part: slice) -> np.ndarray:
        return unpack_bits(self.bitmap, self.offset + int(part.start), self.offset + int(part.stop))


def list_values(arr: pa.ListArray):
    """The flat values of a list column: a NumPy view, or :class:`_Bits` for a boolean one."""
    if pa.types.is_boolean(arr.type.value_type):
        return _Bits(arr.values)
    return to_numpy(arr.values)


class _Batch:
    """NumPy views of one record batch's list columns (values + offsets)."""

    def __init__(self, batch: pa.RecordBatch):
        self.columns = {}
        for name in COLUMNS:
            arr = batch.column(name)
            offsets = to_numpy(arr.offsets)
            self.columns[name] = (list_values(arr), offsets)

    def row(self, i: int) -> PackRow:
        parts = {}
        for name, (values, offsets) in self.columns.items():
            parts[name] = values[offsets[i]:offsets[i + 1]]
        return PackRow(**parts)


def _wants_bridge(out_dir, split) -> bool:
    from packer_cli.shards.bridge import is_bridge_dir

    native = os.path.isfile(os.path.join(os.fspath(out_dir), METADATA_FILE))
    if native and split is not None:  # said as "no 'training' split here (found: none)", as if empty
        raise ConfigError(f"{os.fspath(out_dir)}: split={split!r} applies to a Megatron-Bridge layout; "
                          "this is a native output, which has no splits: leave split out")
    return split is not None or (not native and is_bridge_dir(out_dir))


class PackedReader:
    """Random access to the packs of an output directory.

    For a Megatron-Bridge layout (``--format megatron-bridge``) this constructs a
    :class:`~packer_cli.shards.bridge_reader.BridgeReader` of ``split`` (default: training),
    which yields the same rows as the native output of the same plan.
    """

    def __new__(cls, out_dir=None, split: str | None = None, *, check: bool = True):
        if cls is PackedReader and out_dir is not None and _wants_bridge(out_dir, split):
            from packer_cli.shards.bridge_reader import BridgeReader

            cls = BridgeReader
        return super().__new__(cls)

    def __init__(self, out_dir: str, split: str | None = None, *, check: bool = True):
        """``check``: run verify's layout checks first (:func:`check_layout_for_reading`) and raise
        :class:`~packer_cli.audit._layout_checks.InconsistentOutput` when one fails; a process re-opening an output already checked
        (a DataLoader worker) may pass False."""
        self.out_dir = out_dir = os.fspath(out_dir)
        self.metadata = load_metadata(out_dir)
        self.manifest = read_json(os.path.join(out_dir, MANIFEST_FILE))
        if check:
            check_layout_for_reading(out_dir)
        if not isinstance(self.manifest, dict) or not isinstance(self.manifest.get("shards"), list):
            raise DataError(f"{os.path.join(out_dir, MANIFEST_FILE)}: no 'shards' list")
        self._batches: list[_Batch] = []
        self._paths: list[str] = []
        starts = [0]
        version = self.metadata["format_version"]
        schema = pack_schema(version)
        for entry in self.manifest["shards"]:
            path = os.path.join(out_dir, entry["name"]) if isinstance(entry, dict) else None
            if not isinstance(path, str):
                raise DataError(f"{os.path.join(out_dir, MANIFEST_FILE)}: shard entry {entry!r} has no name")
            try:
                source = pa.memory_map(path)
                reader = pa.ipc.open_file(source)
                if not reader.schema.equals(schema, check_metadata=False):  # as verify: nullable columns too
                    raise DataError(f"{path}: schema differs from the {FORMAT_NAME} version {version} pack schema: "
                                    f"{schema_difference(reader.schema, schema)}")
                if (problem := compressed_shard_problem(source)) is not None:
                    raise DataError(f"{path}: {problem}")
                first = starts[-1]
                for b in range(reader.num_record_batches):
                    batch = reader.get_batch(b)
                    # A damaged batch header (lengths, buffer sizes) is refused here: taken as
                    # written, it made NumPy's views fail (ValueError, even SystemError).
                    # Shallow: buffer sizes, not every offset (the rows are checked as built).
                    batch.validate()
                    self._batches.append(_Batch(batch))
                    self._paths.append(path)
                    starts.append(starts[-1] + batch.num_rows)
            except (OSError, pa.ArrowException, KeyError, ValueError, SystemError) as exc:
                raise DataError(f"{path}: cannot open shard ({first_line(exc)})") from None
            check_recorded_rows(path, starts[-1] - first, entry, "the manifest")
        self._starts = np.asarray(starts, dtype=np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def row(self, i: int) -> PackRow:
        if not -len(self) <= i < len(self):
            raise IndexError(f"pack {i} out of range for {counted(len(self), 'pack')}")
        i %= len(self)
        b = int(np.searchsorted(self._starts, i, side="right") - 1)
        return self._batches[b].row(i - int(self._starts[b]))

    def locate(self, i: int) -> str:
        """Where pack ``i`` is stored, for messages: ``"<file> row <r>"``. ``_starts[k]`` is the
        first pack of the k-th part read (a record batch of a shard, a row group of a Bridge
        file) and ``_paths[k]`` its file."""
        i %= len(self)
        k = int(np.searchsorted(self._starts, i, side="right") - 1)
        first = self._paths.index(self._paths[k])  # the file's first part
        return f"{self._paths[k]} row {i - int(self._starts[first])}"

    @property
    def spec(self) -> dict:
        return self.metadata["spec"]

    def pack_len(self, row: PackRow) -> int:
        """Physical length T of a pack as a loader builds it (C when padded to max length)."""
        return self.spec["pack_size"] if self.spec["pad_to_max_length"] else int(row.tokens.size)

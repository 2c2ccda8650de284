"""Read a Megatron-Bridge split back as packer's native rows.

``PackedReader(out_dir[, split=...])`` returns a :class:`BridgeReader` when ``out_dir`` holds
the Bridge layout, so ``PackedDataset`` (and the audit, through
:class:`~packer_cli.shards.bridge_store.BridgeStore`) sees the same
:class:`~packer_cli.shards.reader.PackRow` for both formats of one plan. The conversion
undoes :func:`packer_cli.shards.bridge_writer.to_bridge_rows` with the ``packer_*`` columns::

    stored   x0 x1 x2 x3 x4 x5 E E E | ...     seq_start_id [0, ...], packer_seq_lens [5, ...]
    native   x0 x1 x2 x3 x4 P  P P   | ...     tokens: stored[0:p], pad_id from s on
             last_token = x5 = stored[s];  loss_mask = stored loss_mask[0:p]

Like Bridge's own reader, it decodes one Parquet row group at a time and keeps the last one.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packer_cli.errors import DataError
from packer_cli.shards.bridge import (
    BRIDGE_COLUMNS, BRIDGE_FORMAT, BRIDGE_FORMAT_VERSION, PACKER_COLUMNS, SPLITS, split_manifest_name,
    split_metadata_name, splits_in,
)
from packer_cli.shards.reader import PackedReader, PackRow, check_layout_for_reading, first_line, read_json

COLUMNS = BRIDGE_COLUMNS + PACKER_COLUMNS


def resolve_split(out_dir: str, split: str | None) -> str:
    """``split`` if present in ``out_dir``; by default ``training``, else the only split there."""
    present = splits_in(out_dir)
    if split is None:
        if not present:
            names = ", ".join(map(split_metadata_name, SPLITS))
            raise DataError(f"{out_dir}: no split written by packer ({names} missing)")
        return present[0]
    if split not in present:
        raise DataError(f"{out_dir}: no {split!r} split here (found: {', '.join(present) or 'none'})")
    return split


def load_bridge_metadata(out_dir: str, split: str | None = None) -> dict:
    """The split's metadata (``{split}.metadata.json``), rejecting unknown versions by name."""
    if not os.path.isdir(out_dir):
        raise DataError(f"{out_dir}: not a directory")
    split = resolve_split(out_dir, split)
    meta = read_json(os.path.join(out_dir, split_metadata_name(split)))
    if not isinstance(meta, dict) or meta.get("format") != BRIDGE_FORMAT:
        raise DataError(f"{out_dir}: {split_metadata_name(split)} is not packer's {BRIDGE_FORMAT!r} metadata")
    if meta.get("format_version") != BRIDGE_FORMAT_VERSION:
        raise DataError(f"{out_dir}: unsupported {BRIDGE_FORMAT} version {meta.get('format_version')!r}; "
                        f"this packer reads version {BRIDGE_FORMAT_VERSION}")
    return meta


def read_split_manifest(out_dir: str, split: str) -> dict:
    """The split's manifest (``{split}.manifest.json``); :class:`DataError` names the file and
    says what is wrong when it is not the manifest packer writes."""
    from packer_cli.audit.store import read_json_file

    name = split_manifest_name(split)
    manifest = read_json_file(os.path.join(out_dir, name))
    problems = split_manifest_problems(manifest, split)
    if problems:
        raise DataError(f"{name}: {'; '.join(problems)}")
    return manifest


def split_manifest_problems(manifest: dict, split: str) -> list[str]:
    """Why a split's manifest cannot be used (empty when it can): format, version, split, entries."""
    from packer_cli.audit.store import shard_entry_problems

    version = manifest.get("format_version")
    if manifest.get("format") != BRIDGE_FORMAT:
        return [f"format is {manifest.get('format')!r}, expected {BRIDGE_FORMAT!r}"]
    if type(version) is not int or version != BRIDGE_FORMAT_VERSION:
        return [f"format_version is {version!r}; this packer reads version {BRIDGE_FORMAT_VERSION}"]
    if manifest.get("split") != split:
        return [f"split is {manifest.get('split')!r}, but the file is the {split} split's"]
    reserved = [name(s) for s in SPLITS for name in (split_metadata_name, split_manifest_name)]
    return shard_entry_problems(manifest.get("shards"), reserved=reserved)


def pad_id_of(metadata: dict) -> int:
    """The pad id packer's readers put in a rebuilt native row's padding (``spec.pad_id``)."""
    spec = metadata.get("spec")
    pad_id = spec.get("pad_id", 0) if isinstance(spec, dict) else 0
    if type(pad_id) is not int:
        raise DataError(f"spec.pad_id is {pad_id!r}, not a token id")
    return pad_id


def native_columns(table: pa.Table, pad_id: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The native columns (``values``, int64 ``offsets``) of all packs in ``table``, vectorized.

    ``table`` holds Bridge rows with packer's columns (one decoded row group, say). Sequence k
    spans stored ``[a_k, b_k)``; its runtime length is ``p_k = b_k - a_k - 1``.
    """
    cols = {}
    for name in COLUMNS:
        arr = table.column(name).combine_chunks()
        cols[name] = (np.asarray(arr.values), np.asarray(arr.offsets).astype(np.int64))
    ids, row_off = cols["input_ids"]
    starts, seq_off = cols["seq_start_id"]
    n_rows = row_off.size - 1
    counts = np.diff(seq_off)
    row_of_seq = np.repeat(np.arange(n_rows), counts)
    first = seq_off[:-1] - seq_off[0]
    a = starts[seq_off[0]:seq_off[-1]].astype(np.int64) + row_off[:-1][row_of_seq]
    b = np.empty_like(a)
    b[:-1] = a[1:]
    b[first + counts - 1] = row_off[1:]                # a row's last sequence ends with the row
    p = b - a - 1
    s = cols["packer_seq_lens"][0][seq_off[0]:seq_off[-1]].astype(np.int64)
    P = np.concatenate([[0], np.cumsum(p)])
    # The runtime stream is the stored one without each sequence's last slot (its last label):
    # a boolean compress, not a gather (no per-token index arrays).
    lo, hi = int(row_off[0]), int(row_off[-1])
    keep = np.ones(hi - lo, dtype=bool)
    keep[b - 1 - lo] = False
    tokens = ids[lo:hi][keep].astype(np.int32, copy=False)
    pads = p - s  # alignment padding, stored as EOS: the native stream holds pad_id there
    if pads.any():
        first_pad = P[:-1] + s
        before = np.cumsum(pads) - pads
        tokens[np.repeat(first_pad - before, pads) + np.arange(int(pads.sum()))] = pad_id
    cu_off = first + np.arange(n_rows + 1)[:-1]
    cu_len = counts + 1
    cu_idx = np.arange(int(cu_len.sum())) - np.repeat(cu_off, cu_len) + np.repeat(first, cu_len)
    cu = (P[cu_idx] - np.repeat(P[first], cu_len)).astype(np.int32)
    seq_offsets = np.concatenate([[0], np.cumsum(counts)])
    per_seq = lambda name, dtype: (cols[name][0][seq_off[0]:seq_off[-1]].astype(dtype), seq_offsets)  # noqa: E731
    token_offsets = P[seq_offsets]
    return {
        "tokens": (tokens, token_offsets),
        "loss_mask": (cols["loss_mask"][0][lo:hi][keep].astype(np.uint8, copy=False), token_offsets),
        "cu_seqlens": (cu, seq_offsets + np.arange(n_rows + 1)),
        "seq_lens": (s.astype(np.int32), seq_offsets),
        "last_token": (ids[a + s].astype(np.int32), seq_offsets),
        "source_index": per_seq("packer_source_index", np.int64),
        "source_offset": per_seq("packer_source_offset", np.int32),
    }


class _Group:
    """One decoded row group as native columns; :meth:`row` slices one pack out of them."""

    def __init__(self, table: pa.Table, pad_id: int):
        self.columns = native_columns(table, pad_id)

    def row(self, i: int) -> PackRow:
        return PackRow(**{name: values[offsets[i]:offsets[i + 1]]
                          for name, (values, offsets) in self.columns.items()})


class BridgeReader(PackedReader):
    """Random access to the packs of one split of a Bridge layout, as native rows."""

    def __init__(self, out_dir, split: str | None = None, *, check: bool = True):
        self.out_dir = out_dir = os.fspath(out_dir)
        self.split = resolve_split(out_dir, split)
        self.metadata = load_bridge_metadata(out_dir, self.split)
        if check:
            check_layout_for_reading(out_dir, self.split)
        self.manifest = read_split_manifest(out_dir, self.split)
        self._pad_id = pad_id_of(self.metadata)
        self._groups: list[tuple[pq.ParquetFile, int]] = []
        self._paths: list[str] = []
        starts = [0]
        for entry in self.manifest["shards"]:
            path = os.path.join(out_dir, entry["name"])
            try:
                pf = pq.ParquetFile(path, memory_map=True)
            except (OSError, pa.ArrowException) as exc:
                raise DataError(f"{path}: cannot open Parquet file ({first_line(exc)})") from None
            missing = [c for c in COLUMNS if c not in pf.schema_arrow.names]
            if missing:
                raise DataError(f"{path}: missing columns {missing} (not written by packer --format megatron-bridge)")
            for g in range(pf.num_row_groups):
                self._groups.append((pf, g))
                self._paths.append(path)
                starts.append(starts[-1] + pf.metadata.row_group(g).num_rows)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._cached: tuple[int, _Group] | None = None

    def _group(self, g: int) -> _Group:
        if self._cached is None or self._cached[0] != g:
            pf, index = self._groups[g]
            try:
                table = pf.read_row_group(index, columns=list(COLUMNS))
            except (OSError, pa.ArrowException) as exc:
                raise DataError(f"{self._paths[g]}: cannot read row group {index} ({first_line(exc)}); "
                                f"run `packer verify` for a full report") from None
            try:
                group = _Group(table, self._pad_id)
            except (ValueError, IndexError) as exc:
                raise DataError(f"{self._paths[g]}: row group {index} is malformed ({first_line(exc)}); "
                                f"run `packer verify` for a full report") from None
            self._cached = (g, group)
        return self._cached[1]

    def row(self, i: int) -> PackRow:
        if not -len(self) <= i < len(self):
            raise IndexError(f"pack {i} out of range for {len(self)} packs")
        i %= len(self)
        g = int(np.searchsorted(self._starts, i, side="right") - 1)
        return self._group(g).row(i - int(self._starts[g]))


"""``BridgeStore``: a Megatron-Bridge split seen through the audit's store interface.

The audit (``packer inspect`` / ``packer verify``) reads an output through a *store*
(:mod:`packer_cli.audit.store`): ``shard_names()``, ``shard_entries()``, ``expected_files()``
and ``read_shard(name, columns)`` yielding :class:`~packer_cli.audit.store.PackBatch` runs of
native columns. This store gives one split of a Bridge layout that interface, one Parquet row
group per batch, converted by :func:`~packer_cli.shards.bridge_reader.native_columns`, so the
audit's checks run unchanged::

    store = BridgeStore.open("packed/", split="validation")
    for batch in store.read_shard(store.shard_names()[0]):
        batch.row(0)                       # the same PackRow as the native output of the plan
"""
from __future__ import annotations

import os
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from packer_cli.errors import DataError
from packer_cli.shards.bridge import BRIDGE_FORMAT, layout_files, split_manifest_name
from packer_cli.shards.bridge_reader import COLUMNS, load_bridge_metadata, native_columns, resolve_split
from packer_cli.shards.reader import read_json


class BridgeStore:
    """One split of a Bridge layout: its metadata, manifest and Parquet file."""

    format = BRIDGE_FORMAT

    def __init__(self, out: str, metadata: dict, manifest: dict, split: str):
        self.out, self.metadata, self.manifest, self.split = out, metadata, manifest, split

    @classmethod
    def open(cls, out: str, meta: dict | None = None, split: str | None = None) -> "BridgeStore":
        """Open ``split`` of ``out`` (default: training, else the only split)."""
        split = resolve_split(out, split)
        meta = meta if meta is not None else load_bridge_metadata(out, split)
        manifest = read_json(os.path.join(out, split_manifest_name(split)))
        if not isinstance(manifest.get("shards"), list):
            raise DataError(f"{split_manifest_name(split)}: 'shards' is not a list")
        return cls(out, meta, manifest, split)

    def shard_entries(self) -> list[dict]:
        return list(self.manifest["shards"])

    def shard_names(self) -> list[str]:
        return [entry["name"] for entry in self.manifest["shards"]]

    def expected_files(self) -> set[str]:
        """Every file a Bridge layout may hold (both splits, Bridge's metadata array)."""
        return set(layout_files(self.out) or ()) | set(self.shard_names())

    def read_shard(self, name: str, columns=None) -> Iterator:
        """Row groups of the split's Parquet file as native :class:`PackBatch` runs."""
        from packer_cli.audit.store import PackBatch, ShardError

        path = os.path.join(self.out, name)
        try:
            pf = pq.ParquetFile(path, memory_map=False)
        except FileNotFoundError:
            raise ShardError(name, "missing") from None
        except (OSError, pa.ArrowException) as exc:
            raise ShardError(name, f"cannot open as Parquet ({exc})") from None
        missing = [c for c in COLUMNS if c not in pf.schema_arrow.names]
        if missing:
            raise ShardError(name, f"missing columns {missing}")
        pad_id = int(self.metadata.get("spec", {}).get("pad_id", 0))
        row = 0
        for g in range(pf.num_row_groups):
            try:
                cols = native_columns(pf.read_row_group(g, columns=list(COLUMNS)), pad_id)
            except (OSError, pa.ArrowException, ValueError, IndexError) as exc:
                raise ShardError(name, f"row group {g} is unreadable ({exc})", row=row) from None
            n = pf.metadata.row_group(g).num_rows
            yield PackBatch(name, row, n, cols.__getitem__)
            row += n

    def batch_at(self, name: str, first_row: int):
        """The row group of ``name`` that starts at row ``first_row``, decoded alone."""
        from packer_cli.audit.store import PackBatch, ShardError

        path = os.path.join(self.out, name)
        pad_id = int(self.metadata.get("spec", {}).get("pad_id", 0))
        try:
            pf = pq.ParquetFile(path, memory_map=False)
            row = 0
            for g in range(pf.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if row == first_row:
                    return PackBatch(name, row, n, native_columns(pf.read_row_group(g, columns=list(COLUMNS)),
                                                                  pad_id).__getitem__)
                row += n
        except (OSError, pa.ArrowException, ValueError, IndexError) as exc:
            raise ShardError(name, f"cannot be read again ({exc})") from None
        raise ShardError(name, f"no row group starts at row {first_row}")

"""Checks the Parquet decoder's tests share: byte flips read against pyarrow, and which path of
``RowGroupRuns`` read a run."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from packer_cli.sources.parquet_lists import ListColumnReader, RowGroupRuns


def flips_read_otherwise(raw: bytes, start: int, end: int, scratch: Path,
                         masks=(0x01, 0x80, 0xFF)) -> tuple[list[str], int]:
    """Every byte of ``raw[start:end]`` (a Parquet file's bytes) changed by each mask (its low
    bit, its high bit, all its bits): the changes packer's reader reads as data pyarrow refuses or
    reads otherwise (a refusal, ValueError, is always fine), and how many it read as data."""
    problems, read = [], 0
    for at in range(start, end):
        for mask in masks:
            damaged = bytearray(raw)
            damaged[at] ^= mask
            # a fresh file each time: a page of the last may still be mapped on a decoding thread
            variant = scratch / f"variant-{at}-{mask}.parquet"
            variant.write_bytes(bytes(damaged))
            try:
                want = pq.read_table(variant).column("input_ids")
            except (pa.ArrowException, OSError, ValueError):
                want = None
            try:
                got = pa.Table.from_batches(list(ListColumnReader(str(variant), ["input_ids"]))).column("input_ids")
            except ValueError:
                continue
            finally:
                variant.unlink()
            read += 1
            if want is None or not got.equals(want):
                problems.append(f"byte {at - start} ^ {mask:#x}: packer read data "
                                + ("pyarrow refuses" if want is None else "other than pyarrow's"))
    return problems, read


def count_run_paths(monkeypatch) -> dict[str, int]:
    """How many runs ``RowGroupRuns`` reads by its bulk path and by its page cursors, from now on."""
    taken = {"bulk": 0, "paged": 0}
    for path, method in (("bulk", "_read_bulk"), ("paged", "_read_paged")):
        def counted(self, *args, _real=getattr(RowGroupRuns, method), _path=path):
            taken[_path] += 1
            return _real(self, *args)

        monkeypatch.setattr(RowGroupRuns, method, counted)
    return taken


def packed_shard_digests(path: Path, out: Path, **spec) -> list[str]:
    """The xxh3 checksums of the shards ``pack`` writes from one Parquet file (``PackSpec(**spec)``,
    pack size 2048 by default): two files holding the same table must give the same ones."""
    import json

    from packer_cli import PackSpec, pack

    pack([str(path)], str(out), PackSpec(**{"pack_size": 2048, **spec}))
    return [shard["xxh3_64"] for shard in json.loads((out / "manifest.json").read_text())["shards"]]

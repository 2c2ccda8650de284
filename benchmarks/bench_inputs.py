"""Parquet layouts: packer's decoder against pyarrow's on the same tokens written many ways.

``pack`` reads Parquet token columns with its own compiled decoder, which hands a file (from
the row reached) to pyarrow wherever it does not decode a layout or pyarrow reads it faster. This
step writes the benchmark table's first samples in the layouts writers produce (codecs, data
page versions, encodings, page and row-group sizes) and, for each, times (rounds alternating):

* ``cli``        ``packer pack`` of the file (a fresh process), as users run it;
* ``cli_arrow``  the same with ``PACKER_PARQUET_DECODER=arrow``: pyarrow decodes every page (the
                 peer: what packer would be without its decoder);
* ``packer``     reading both columns in 2,048-row batches with ``ListColumnReader`` (what ``pack``
                 runs) in one process, with the share of rows it decoded itself and why it handed
                 the rest to pyarrow, if it did;
* ``pyarrow``    the same with ``ParquetFile.iter_batches``.

Decoding alone, pyarrow's reader is the faster on some layouts where ``pack`` is not slower:
``pack`` decodes on its reading threads while its main thread encodes the spill.

    python benchmarks/bench_inputs.py --input benchmarks/_data/sft4k_200000.parquet --samples 100000
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import shutil

import pyarrow.parquet as pq

from _util import PACKER, emit, median, run_measured, user_env

FIELDS = ["input_ids", "loss_mask"]
BATCH = 2048


def layouts() -> dict[str, dict]:
    """``pq.write_table`` arguments of each layout (row groups of 4,096 rows unless said)."""
    delta = {"input_ids.list.element": "DELTA_BINARY_PACKED", "loss_mask.list.element": "DELTA_BINARY_PACKED"}
    split = {"input_ids.list.element": "BYTE_STREAM_SPLIT"}
    found = {
        "snappy, dictionary (pyarrow's default)": {},
        "zstd": {"compression": "zstd"},
        "gzip": {"compression": "gzip"},
        "lz4 (LZ4_RAW)": {"compression": "lz4"},
        "uncompressed, plain": {"compression": "none", "use_dictionary": False},
        "data pages v2": {"data_page_version": "2.0"},
        "DELTA_BINARY_PACKED": {"use_dictionary": False, "column_encoding": delta},
        "BYTE_STREAM_SPLIT ids, zstd": {"use_dictionary": False, "column_encoding": split, "compression": "zstd"},
        "16 KiB pages": {"data_page_size": 16 << 10},
        "4 KiB pages": {"data_page_size": 4 << 10},
        "1 KiB pages": {"data_page_size": 1 << 10},
        "100-row groups": {"row_group_size": 100},
        "brotli": {"compression": "brotli"},
    }
    return found


def write_layouts(table, directory: str) -> dict[str, str]:
    paths = {}
    for k, (name, kwargs) in enumerate(layouts().items()):
        path = os.path.join(directory, f"layout{k}.parquet")
        try:
            pq.write_table(table, path, **{"row_group_size": 4096, **kwargs})
        except Exception as exc:  # noqa: BLE001 - a layout this pyarrow cannot write (BYTE_STREAM_SPLIT ints < 16)
            print(f"# {name}: not written ({exc})", flush=True)
            continue
        paths[name] = path
    return paths


def read_packer(path: str):
    from packer_cli.sources.parquet_lists import ListColumnReader

    reader = ListColumnReader(path, FIELDS, batch_rows=BATCH)
    for _ in reader:
        pass
    return reader


def read_pyarrow(path: str) -> None:
    for _ in pq.ParquetFile(path).iter_batches(batch_size=BATCH, columns=FIELDS):
        pass


def run_cli(path: str, out: str, env: dict) -> float:
    shutil.rmtree(out, ignore_errors=True)
    return run_measured([PACKER, "pack", path, "-o", out, "--pack-size", "4096"], env={**user_env(), **env})["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="the benchmark's tokenized Parquet file")
    ap.add_argument("--samples", type=int, default=100_000, help="its first samples, written in each layout")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    table = pq.read_table(args.input, columns=FIELDS).slice(0, args.samples)
    tokens = int(table.column("input_ids").combine_chunks().values.__len__())
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.input))) as directory:
        for name, path in write_layouts(table, directory).items():
            reader = read_packer(path)  # untimed: kernels loaded, pages in the page cache
            read_pyarrow(path)
            out = os.path.join(directory, "out")
            run_cli(path, out, {})
            times = {"cli": [], "cli_arrow": [], "packer": [], "pyarrow": []}
            for _ in range(args.runs):
                for tool, env in (("cli", {}), ("cli_arrow", {"PACKER_PARQUET_DECODER": "arrow"})):
                    times[tool].append(run_cli(path, out, env))
                for tool, read in (("packer", read_packer), ("pyarrow", read_pyarrow)):
                    t0 = time.perf_counter()
                    read(path)
                    times[tool].append(time.perf_counter() - t0)
            shutil.rmtree(out, ignore_errors=True)
            emit({"what": "layout", "layout": name, "samples": table.num_rows, "tokens": tokens,
                  "bytes": os.path.getsize(path), **{tool: median(t) for tool, t in times.items()},
                  "packer_rows": reader.fast_rows / max(1, reader.fast_rows + reader.arrow_rows),
                  "handed_over": reader.fallback_reason})


if __name__ == "__main__":
    main()

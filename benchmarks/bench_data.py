"""Benchmark datasets, generated deterministically into ``benchmarks/_data/`` (git-ignored).

* ``sft4k`` tokenized SFT table: lognormal lengths (median 400, sigma 0.9, clipped to
  [16, 4096] — the ``sft4k`` planner distribution), random ids below 100,000, a prompt of
  10–60 % of each sample with loss 0 and the response with loss 1. Written as Parquet
  (snappy, 4,096 rows per row group, like the shared real files) and as JSON Lines, plain and
  gzipped (Python's gzip module at its default level 6, as ``gzip`` writes by default).
* Length-only distributions for plan quality: ``sft4k``, ``gamma1k``, ``long8k`` (the same
  generator and seeds as ``bench_plan.py``) and the real files in ``../shared/data`` when present.

    python benchmarks/bench_data.py --samples 200000     # writes the Parquet and JSONL files
"""
from __future__ import annotations

import argparse
import glob
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numba import njit

from _util import HERE, REPO, emit

DATA = os.path.join(HERE, "_data")
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")
ROWS_PER_GROUP = 4096
CHUNK_ROWS = 16384


def sft_chunks(samples: int, seed: int = 0):
    """(offsets int64, tokens int32, mask uint8) chunks of the tokenized SFT table."""
    rng = np.random.default_rng(seed)
    done = 0
    while done < samples:
        n = min(CHUNK_ROWS, samples - done)
        lengths = np.clip(rng.lognormal(np.log(400.0), 0.9, n), 16, 4096).astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        tokens = rng.integers(3, 100_000, size=int(offsets[-1]), dtype=np.int32)
        prompt = (lengths * rng.uniform(0.1, 0.6, n)).astype(np.int64)
        position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
        mask = (position >= np.repeat(prompt, lengths)).astype(np.uint8)
        yield offsets, tokens, mask
        done += n


def sft_parquet(samples: int, seed: int = 0) -> str:
    """The tokenized table as Parquet (cached by name); returns its path."""
    path = os.path.join(DATA, f"sft4k_{samples}.parquet")
    if os.path.exists(path):
        return path
    os.makedirs(DATA, exist_ok=True)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))])
    tmp = path + ".tmp"
    with pq.ParquetWriter(tmp, schema) as writer:
        for offsets, tokens, mask in sft_chunks(samples, seed):
            o = pa.array(offsets.astype(np.int32))
            table = pa.table({"input_ids": pa.ListArray.from_arrays(o, pa.array(tokens)),
                              "loss_mask": pa.ListArray.from_arrays(o, pa.array(mask))}, schema=schema)
            writer.write_table(table, row_group_size=ROWS_PER_GROUP)
    os.replace(tmp, path)
    return path


@njit(cache=True)
def _format_jsonl(offsets, tokens, mask, out):
    """``{"input_ids":[...],"loss_mask":[...]}`` lines into ``out``; returns the byte count."""
    head1 = b'{"input_ids":['
    head2 = b'],"loss_mask":['
    pos = 0
    digits = np.empty(12, np.uint8)
    for r in range(offsets.size - 1):
        for c in head1:
            out[pos] = c
            pos += 1
        for i in range(offsets[r], offsets[r + 1]):
            if i > offsets[r]:
                out[pos] = 44
                pos += 1
            v = tokens[i]
            n = 0
            while True:
                digits[n] = 48 + v % 10
                v //= 10
                n += 1
                if v == 0:
                    break
            for k in range(n - 1, -1, -1):
                out[pos] = digits[k]
                pos += 1
        for c in head2:
            out[pos] = c
            pos += 1
        for i in range(offsets[r], offsets[r + 1]):
            if i > offsets[r]:
                out[pos] = 44
                pos += 1
            out[pos] = 48 + mask[i]
            pos += 1
        out[pos] = 93
        out[pos + 1] = 125
        out[pos + 2] = 10
        pos += 3
    return pos


def sft_jsonl(samples: int, seed: int = 0) -> str:
    """The same table as JSON Lines (the first ``samples`` rows); returns its path."""
    path = os.path.join(DATA, f"sft4k_{samples}.jsonl")
    if os.path.exists(path):
        return path
    os.makedirs(DATA, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for offsets, tokens, mask in sft_chunks(samples, seed):
            out = np.empty(int(offsets[-1]) * 9 + (offsets.size - 1) * 40, dtype=np.uint8)
            n = _format_jsonl(offsets, tokens, mask, out)
            out[:n].tofile(f)
    os.replace(tmp, path)
    return path


def sft_jsonl_gz(jsonl: str) -> str:
    """``jsonl`` gzipped beside it (``.jsonl.gz``, level 6); returns its path."""
    import gzip
    import shutil

    path = jsonl + ".gz"
    if os.path.exists(path):
        return path
    tmp = path + ".tmp"
    with open(jsonl, "rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, path)
    return path


def length_distributions(n: int, seed: int = 0) -> dict[str, tuple[np.ndarray, int]]:
    """Item lengths and capacity of every quality distribution (synthetic + shared real data)."""
    from bench_plan import DISTRIBUTIONS, make_lengths

    out = {name: make_lengths(name, n, seed) for name in DISTRIBUTIONS}
    for path in sorted(glob.glob(os.path.join(SHARED, "*.parquet"))):
        lengths = pq.read_table(path, columns=["input_ids"]).column("input_ids").combine_chunks().value_lengths()
        runtime = np.asarray(lengths, dtype=np.int64) - 1  # packed items are runtime lengths n - 1
        out[f"real:{os.path.basename(path)}"] = (runtime, 4096)
    return out


def table_stats(path: str) -> dict:
    md = pq.ParquetFile(path).metadata
    col = pq.read_table(path, columns=["input_ids"]).column("input_ids").combine_chunks()
    return {"path": os.path.relpath(path, REPO), "samples": md.num_rows, "tokens": int(len(col.values)),
            "bytes": os.path.getsize(path), "row_groups": md.num_row_groups}


def main() -> None:
    global DATA  # --data replaces the default every function here uses
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA, help="where the datasets are written (default: benchmarks/_data)")
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--jsonl-samples", type=int, default=50_000)
    args = ap.parse_args()
    DATA = os.path.abspath(args.data)
    emit({"what": "parquet", **table_stats(sft_parquet(args.samples))})
    path = sft_jsonl(args.jsonl_samples)
    emit({"what": "jsonl", "path": os.path.relpath(path, REPO), "samples": args.jsonl_samples,
          "bytes": os.path.getsize(path)})
    gz = sft_jsonl_gz(path)
    emit({"what": "jsonl_gz", "path": os.path.relpath(gz, REPO), "samples": args.jsonl_samples,
          "bytes": os.path.getsize(gz)})


if __name__ == "__main__":
    main()

"""Host-side throughput of one DataLoader worker of ``packer_cli.torch`` (needs torch).

Packs the input once, then times ``PackedDataset.micro_batch`` — read the packs from the
memory-mapped shards, build the THD batch (tokens, labels, position ids, ``cu_seqlens``),
concatenate and slice for a CP rank — over every pack, in one process: the work one worker
does. Tokens are runtime-stream tokens per second.

    python benchmarks/bench_loader.py --input benchmarks/_data/sft4k_50000.parquet
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

from _util import HERE, emit, median

OUT = os.path.join(HERE, "_out", "loader")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--pack-size", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1, help="packs per micro-batch (THD + CP needs 1)")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    try:
        from packer_cli.torch import PackedDataset
    except ImportError as exc:
        emit({"what": "skipped", "reason": str(exc)})
        return
    from packer_cli import PackSpec, pack

    summary = pack([args.input], OUT, PackSpec(pack_size=args.pack_size, cp=args.cp), overwrite=True)
    tokens = summary.counts["padded_tokens"]
    try:
        ds = PackedDataset(OUT)
        batches = [list(range(i, min(i + args.micro_batch, len(ds)))) for i in range(0, len(ds), args.micro_batch)]
        times = []
        for r in range(args.runs + 1):
            t0 = time.perf_counter()
            for rank in range(args.cp):
                for indices in batches:
                    ds.micro_batch(indices, cp_size=args.cp, cp_rank=rank)
            seconds = (time.perf_counter() - t0) / args.cp  # one rank's worker sees every pack once
            if r:
                times.append(seconds)
        sec = median(times)
        emit({"what": "summary", "packs": len(ds), "tokens": tokens, "micro_batch": args.micro_batch, "cp": args.cp,
              "median_s": sec, "tokens_per_s": tokens / sec, "runs": args.runs})
    finally:
        shutil.rmtree(OUT, ignore_errors=True)


if __name__ == "__main__":
    main()

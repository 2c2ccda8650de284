"""Throughput of ``packer verify`` and ``packer inspect`` on a large synthetic output.

Generates a tokenized SFT-like Parquet input (log-normal lengths, random ids, prompt/response
loss masks), packs it once with the library, then times the audit functions. Each timing is
the best of ``--repeat`` runs with the shards in the page cache (the first, cold-ish run and
the numba compile/load are reported apart). One JSON line per measurement on stdout::

    python benchmarks/bench_audit.py --tokens 200e6               # inspect + verify, native and Bridge
    python benchmarks/bench_audit.py --tokens 50e6 --source       # also verify --source

Throughput is runtime-stream tokens (Σp over all packs) per second of wall time.

Measured (2 vCPU AMD EPYC, 23 GiB RAM, warm page cache; 426.6M tokens, 52,075 packs of
C=8192, CP=2, 2.1 GB in 8 shards; ``--tokens 400e6 --source --repeat 3``):

    inspect                5.9–10 G tokens/s  (0.04–0.07 s: reads only lengths and loss mask)
    verify                 1.09 G tokens/s    (0.39 s; 0.7–0.8 s in a fresh process, 0.55 GB peak RSS)
    verify --source        85 M tokens/s      (5.0 s; includes re-reading and validating the Parquet input)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def make_input(path: str, tokens: float, seed: int = 0, rows_per_group: int = 65536) -> int:
    """Write ~``tokens`` tokens of synthetic samples to ``path``; returns the token count."""
    rng = np.random.default_rng(seed)
    written = 0
    with pq.ParquetWriter(path, pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))])) as w:
        while written < tokens:
            n = np.clip(rng.lognormal(np.log(600), 0.8, rows_per_group), 2, 4000).astype(np.int64)
            total = int(n.sum())
            offsets = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
            ids = rng.integers(0, 100_000, total, dtype=np.int32)
            prompt = (n * rng.uniform(0.2, 0.7, n.size)).astype(np.int64)
            pos = np.arange(total) - np.repeat(offsets[:-1], n)
            mask = (pos >= np.repeat(prompt, n)).astype(np.uint8)
            w.write_table(pa.table({
                "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
                "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            }))
            written += total
    return written


def timed(fn, repeat: int):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return result, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=200e6, help="approximate input tokens")
    ap.add_argument("--pack-size", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--source", action="store_true", help="also time verify --source (slower)")
    ap.add_argument("--workdir", default=None, help="keep input/output here (default: a temp dir, removed)")
    ap.add_argument("--no-bridge", action="store_true",
                    help="skip the same audits of a Megatron-Bridge split of the same plan")
    args = ap.parse_args()

    from packer_cli.audit import inspect_output, verify_output
    from packer_cli.pipeline import pack
    from packer_cli.spec import PackSpec

    work = args.workdir or tempfile.mkdtemp(prefix="bench_audit_")
    os.makedirs(work, exist_ok=True)
    inp, out = os.path.join(work, "input.parquet"), os.path.join(work, "out")
    try:
        t = time.perf_counter()
        n_in = make_input(inp, args.tokens)
        gen_s = time.perf_counter() - t
        t = time.perf_counter()
        summary = pack([inp], out, PackSpec(pack_size=args.pack_size, cp=args.cp), overwrite=True)
        pack_s = time.perf_counter() - t
        tokens = summary.counts["padded_tokens"]
        env = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "input_tokens": n_in, "stream_tokens": tokens, "packs": summary.counts["packs"],
               "shard_bytes": sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))}
        print(json.dumps({"what": "setup", "generate_s": round(gen_s, 2), "pack_s": round(pack_s, 2), **env}))
        runs = [("inspect", lambda: inspect_output(out)), ("verify", lambda: verify_output(out))]
        if args.source:
            runs.append(("verify --source", lambda: verify_output(out, [inp])))
        if not args.no_bridge:  # the same plan as Bridge's Parquet file (default encoding)
            from packer_cli.shards.bridge_output import BridgeOutput

            bridge = os.path.join(work, "bridge")
            pack([inp], bridge, PackSpec(pack_size=args.pack_size, cp=args.cp), overwrite=True,
                 output=BridgeOutput(eos_id=0))
            runs += [("inspect (megatron-bridge)", lambda: inspect_output(bridge)),
                     ("verify (megatron-bridge)", lambda: verify_output(bridge))]
        for name, fn in runs:
            result, times = timed(fn, 1 + args.repeat)
            if name.startswith("verify") and not result.ok:
                raise SystemExit(f"{name} found problems: {[f.line() for f in result.findings[:5]]}")
            best = min(times[1:])
            print(json.dumps({"what": name, "first_s": round(times[0], 3), "best_s": round(best, 3),
                              "tokens_per_s": round(tokens / best), "M_tokens_per_s": round(tokens / best / 1e6, 1)}))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

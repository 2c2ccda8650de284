"""Throughput of ``packer verify`` and ``packer inspect`` on a large synthetic output.

Generates a tokenized SFT-like Parquet input (log-normal lengths, random ids, prompt/response
loss masks), packs it once with the library, then times the audit functions. Each timing is
taken two ways, interleaved, with the shards in the page cache: the command (``packer verify
OUT``, ``packer inspect OUT``: a fresh process, what a data pipeline runs; the median of
``--repeat`` runs after one untimed run) and the library call in a warm process (median and best
of ``--repeat`` runs; the first, cold-ish call and the numba compile/load are reported apart).
The target (≥ 100 M tokens/s) is judged on the command's median. One JSON line per measurement
on stdout::

    python benchmarks/bench_audit.py --tokens 200e6               # inspect + verify, native and Bridge
    python benchmarks/bench_audit.py --tokens 50e6 --source       # also verify --source

Throughput is runtime-stream tokens (Σp over all packs) per second of wall time.

benchmarks/RESULTS.md has the latest figures (``benchmarks/run.py`` runs this with ``--repeat 5``).
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

from _util import PACKER, median, run_measured


def make_input(path: str, tokens: float, seed: int = 0, rows_per_group: int = 65536) -> int:
    """Write ~``tokens`` tokens of synthetic samples to ``path``; returns the token count."""
    rng = np.random.default_rng(seed)
    written = 0
    with pq.ParquetWriter(path, pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))])) as w:
        while written < tokens:
            # the last group only as large as the tokens still wanted (~830 a sample on average)
            rows = int(min(rows_per_group, max(1, (tokens - written) // 800 + 1)))
            n = np.clip(rng.lognormal(np.log(600), 0.8, rows), 2, 4000).astype(np.int64)
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


def timed(fn):
    t = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t


def command_seconds(cmd: list[str]) -> float:
    """Wall seconds of one fresh ``packer`` process (run_measured raises if it fails)."""
    return run_measured(cmd)["wall_s"]


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
        # (name, library call, the same as a command; a nonzero exit raises)
        runs = [("inspect", lambda: inspect_output(out), [PACKER, "inspect", out]),
                ("verify", lambda: verify_output(out), [PACKER, "verify", out])]
        if args.source:
            runs.append(("verify --source", lambda: verify_output(out, [inp]),
                         [PACKER, "verify", out, "--source", inp]))
        if not args.no_bridge:  # the same plan as Bridge's Parquet file (default encoding)
            from packer_cli.shards.bridge_output import BridgeOutput

            bridge = os.path.join(work, "bridge")
            pack([inp], bridge, PackSpec(pack_size=args.pack_size, cp=args.cp), overwrite=True,
                 output=BridgeOutput(eos_id=0))
            runs += [("inspect (megatron-bridge)", lambda: inspect_output(bridge), [PACKER, "inspect", bridge]),
                     ("verify (megatron-bridge)", lambda: verify_output(bridge), [PACKER, "verify", bridge])]
        for name, fn, cmd in runs:
            result, first = timed(fn)
            if name.startswith("verify") and not result.ok:
                raise SystemExit(f"{name} found problems: {[f.line() for f in result.findings[:5]]}")
            command_seconds(cmd)  # untimed: the page cache and numba's cache files, as the library had
            api, cli = [], []
            for _ in range(args.repeat):  # interleaved, so both see the same machine noise
                api.append(timed(fn)[1])
                cli.append(command_seconds(cmd))
            print(json.dumps({
                "what": name, "first_s": round(first, 3), "best_s": round(min(api), 3),
                "median_s": round(median(api), 3), "cli_median_s": round(median(cli), 3),
                "cli_min_s": round(min(cli), 3), "tokens_per_s": round(tokens / median(cli)),
                "api_tokens_per_s": round(tokens / median(api)), "api_best_tokens_per_s": round(tokens / min(api)),
                "M_tokens_per_s": round(tokens / median(cli) / 1e6, 1)}))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

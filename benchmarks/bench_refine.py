"""The improvement pass on lengths that take few distinct values (outside the full run).

Real SFT lengths take thousands of values, and there the pass reaches its stopping bound in a
few tens of milliseconds (``bench_plan.py``). With a handful of values the bounds are weaker
and the pass may search without gaining: this scans random sets of ``k`` lengths drawn from
``[1, C]`` and times ``plan_packs(L, C, refine=True)`` against ``plan_packs(L, C)``, printing
one JSON object per set, then a summary (how many sets the pass took over 0.1 s and 0.5 s on,
and the packs it gained)::

    .venv/bin/python benchmarks/bench_refine.py                 # 216 sets of 1M lengths, ~5 min
    .venv/bin/python benchmarks/bench_refine.py --n 100000 --seeds 3
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from packer_cli.plan import plan_packs


def few_lengths(capacity: int, k: int, seed: int, n: int) -> np.ndarray:
    """``n`` lengths drawn from ``k`` values in ``[1, capacity]`` (the values from ``seed``)."""
    values = np.random.default_rng(seed).integers(1, capacity + 1, k)
    return values[np.random.default_rng(seed + 100).integers(0, k, n)]


def time_refine(lengths: np.ndarray, capacity: int) -> dict:
    start = time.perf_counter()
    plain = plan_packs(lengths, capacity)
    middle = time.perf_counter()
    refined = plan_packs(lengths, capacity, refine=True)
    end = time.perf_counter()
    return {"refine_s": (end - middle) - (middle - start), "packs": plain.num_packs,
            "gained": plain.num_packs - refined.num_packs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="lengths per set")
    ap.add_argument("--capacities", type=int, nargs="+", default=[1024, 4096, 32768])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8], help="distinct values per set")
    ap.add_argument("--seeds", type=int, default=12, help="sets per (capacity, k)")
    args = ap.parse_args(argv)
    plan_packs(np.array([3, 5, 7, 2]), 10, refine=True)  # kernels loaded before any clock starts
    rows = []
    for capacity in args.capacities:
        for k in args.ks:
            for seed in range(args.seeds):
                row = {"capacity": capacity, "k": k, "seed": seed,
                       **time_refine(few_lengths(capacity, k, seed, args.n), capacity)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    seconds = sorted(row["refine_s"] for row in rows)
    print(json.dumps({"what": "summary", "sets": len(rows), "n": args.n,
                      "over_0.1s": sum(s > 0.1 for s in seconds), "over_0.5s": sum(s > 0.5 for s in seconds),
                      "median_s": seconds[len(seconds) // 2], "max_s": seconds[-1],
                      "slow_sets_gaining": sum(row["refine_s"] > 0.1 and row["gained"] > 0 for row in rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

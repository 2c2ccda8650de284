"""The improvement pass on lengths that take few distinct values, and on random shapes (outside
the full run).

Real SFT lengths take thousands of values, and there the pass reaches its stopping bound in a
few tens of milliseconds (``bench_plan.py``). With a handful of values the bounds are weaker
and the pass may search without gaining: this scans random sets of ``k`` lengths drawn from
``[1, C]`` and times ``plan_packs(L, C, refine=True)`` against ``plan_packs(L, C)``, printing
one JSON object per set, then a summary (how many sets the pass took over 0.1 s and 0.5 s on,
and the packs it gained)::

    .venv/bin/python benchmarks/bench_refine.py                 # 216 sets of 1M lengths, ~5 min
    .venv/bin/python benchmarks/bench_refine.py --n 100000 --seeds 3

``--shapes N`` instead draws N random sets of lognormal, gamma and normal lengths (C = 2k-128k,
30k-300k lengths, medians C/64-C/2) and plans each with the pass as it is and without one of
its settings (``--without``): ``balanced``, the balanced rebuilds every round ends with
(``refine._BALANCED_DIVISORS``: items of about the pool's mean length after the largest), or
``wide``, the first round's wide threshold (``refine._WIDE_DIVISOR``: half a pack kept free,
large items). It prints packs above the stopping bound and seconds for both, then how many
sets each way won::

    .venv/bin/python benchmarks/bench_refine.py --shapes 200 --seed 11                  # ~1-2 min
    .venv/bin/python benchmarks/bench_refine.py --shapes 200 --seed 11 --without wide
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from packer_cli.plan import plan_packs
from packer_cli.plan import refine
from packer_cli.plan.bounds import _best_of_lengths


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


def random_shape(draw: np.random.Generator, seed: int) -> tuple[str, np.ndarray, int]:
    """One random set for ``--shapes``: its description, lengths and capacity."""
    capacity = int(draw.choice([2048, 4096, 8192, 16384, 32768, 131072]))
    n = int(draw.choice([30_000, 100_000, 300_000]))
    shape = draw.choice(["lognormal", "gamma", "normal"])
    rng = np.random.default_rng(seed)
    if shape == "lognormal":
        median = capacity * float(np.exp(draw.uniform(np.log(1 / 64), np.log(1 / 2))))
        sigma = float(draw.uniform(0.2, 1.5))
        x, what = rng.lognormal(np.log(median), sigma, n), f"lognormal median {median / capacity:.3f}C sigma {sigma:.2f}"
    elif shape == "gamma":
        k = float(draw.uniform(1, 8))
        mean = capacity * float(np.exp(draw.uniform(np.log(1 / 64), np.log(1 / 3))))
        x, what = rng.gamma(k, mean / k, n), f"gamma k {k:.1f} mean {mean / capacity:.3f}C"
    else:
        mean = capacity * float(draw.uniform(0.05, 0.5))
        sd = mean * float(draw.uniform(0.05, 0.4))
        x, what = rng.normal(mean, sd, n), f"normal mean {mean / capacity:.3f}C sd {sd / mean:.2f} of it"
    return f"{what}, n {n}, C {capacity}", np.clip(np.rint(x), 1, capacity).astype(np.int64), capacity


#: What ``--without`` turns off, and how: the attribute of ``refine`` and its "off" value.
SETTINGS = {
    "wide": ("_WIDE_MEDIAN_DIVISOR", 0),  # 0: the median test never passes
    "balanced": ("_BALANCED_DIVISORS", ()),
}


def compare_without(sets: int, seed: int, setting: str) -> None:
    """``--shapes``: the pass as it is and without one of its settings on ``sets`` random shapes."""
    draw = np.random.default_rng(seed)
    name, off = SETTINGS[setting]
    on = getattr(refine, name)
    totals = {way: {"above_bound": 0, "seconds": 0.0, "over_0.02%": 0} for way in ("with", "without")}
    wins = losses = 0
    for k in range(sets):
        what, lengths, capacity = random_shape(draw, seed * 100_003 + k)
        bound = _best_of_lengths(lengths, capacity)
        row = {"set": what, "bound": bound}
        ways = (("without", off), ("with", on))
        for way, value in ways if k % 2 == 0 else ways[::-1]:  # alternated: neither runs second always
            setattr(refine, name, value)
            start = time.perf_counter()
            above = plan_packs(lengths, capacity, refine=True).num_packs - bound
            seconds = time.perf_counter() - start
            row[way] = {"above_bound": above, "seconds": round(seconds, 3)}
            totals[way]["above_bound"] += above
            totals[way]["seconds"] += seconds
            totals[way]["over_0.02%"] += above > 0.0002 * bound
        setattr(refine, name, on)
        wins += row["with"]["above_bound"] < row["without"]["above_bound"]
        losses += row["with"]["above_bound"] > row["without"]["above_bound"]
        print(json.dumps(row), flush=True)
    for way in totals:
        totals[way]["seconds"] = round(totals[way]["seconds"], 2)
    print(json.dumps({"what": "summary", "sets": sets, "seed": seed, "without": setting,
                      "fewer_packs_with_it": wins, "more_packs_with_it": losses, **totals}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="lengths per set")
    ap.add_argument("--capacities", type=int, nargs="+", default=[1024, 4096, 32768])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8], help="distinct values per set")
    ap.add_argument("--seeds", type=int, default=12, help="sets per (capacity, k)")
    ap.add_argument("--shapes", type=int, default=0, metavar="N",
                    help="instead: N random lognormal/gamma/normal sets, with and without one setting")
    ap.add_argument("--seed", type=int, default=11, help="--shapes: which random sets")
    ap.add_argument("--without", choices=sorted(SETTINGS), default="balanced",
                    help="--shapes: the setting compared (the first round's wide threshold, or every "
                         "round's balanced rebuilds)")
    args = ap.parse_args(argv)
    plan_packs(np.array([3, 5, 7, 2]), 10, refine=True)  # kernels loaded before any clock starts
    if args.shapes:
        compare_without(args.shapes, args.seed, args.without)
        return 0
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

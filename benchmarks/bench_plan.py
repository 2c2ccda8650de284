"""Benchmark of the pack planner (bin assignment only).

Generates three seeded length distributions (N items each):

* ``sft4k``   lognormal, median 400, sigma 0.9, clipped to [16, 4096], capacity 4096
* ``gamma1k`` gamma(k=5, theta=20), clipped to [10, 1024], capacity 1024
* ``long8k``  normal(4096, 512), clipped to [100, 8192], capacity 8192

and times packer's FFD / BFD / next fit / Bridge first-fit-shuffle and the
refinement pass, LightBinPack's ``obfd`` / ``ffd`` / ``bfd`` when the package is
importable (benchmark only; it is not a packer dependency), and a pure-Python
FFD baseline (segment tree, the way Megatron-Bridge does it; capped at
``--python-n`` items). Every timing is the median of ``--runs`` runs after one
warm-up call, so numba compilation is excluded; compile time is measured
separately in a subprocess with an empty numba cache.

Usage::

    python benchmarks/bench_plan.py --n 1000000 --runs 5 --json-out bench_plan.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from packer_cli.plan import (
    best_fit_decreasing,
    bridge_first_fit_shuffle,
    first_fit_decreasing,
    lower_bound,
    martello_toth_l2,
    next_fit,
    plan_packs,
    refine_plan,
    validate_plan,
)

DISTRIBUTIONS = ("sft4k", "gamma1k", "long8k")


def make_lengths(name: str, n: int, seed: int) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(seed)
    if name == "sft4k":
        x, lo, hi = rng.lognormal(np.log(400.0), 0.9, n), 16, 4096
    elif name == "gamma1k":
        x, lo, hi = rng.gamma(5.0, 20.0, n), 10, 1024
    elif name == "long8k":
        x, lo, hi = rng.normal(4096.0, 512.0, n), 100, 8192
    else:
        raise ValueError(f"unknown distribution {name!r}")
    return np.clip(np.round(x), lo, hi).astype(np.int64), hi


def python_ffd(lengths: list[int], capacity: int) -> list[int]:
    """Pure-Python FFD: sort, then a max segment tree over bins searched leftmost-first."""
    n = len(lengths)
    order = sorted(range(n), key=lambda i: -lengths[i])
    size = 1
    while size < max(n, 1):
        size *= 2
    tree = [capacity] * (2 * size)
    pack_of_item = [0] * n
    for i in order:
        need = lengths[i]
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        pack = node - size
        tree[node] -= need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
        pack_of_item[i] = pack
    return pack_of_item


def interleaved(tools: dict, runs: int) -> tuple[dict, dict]:
    """Each tool's times over ``runs`` rounds (one warm-up call each first), every round
    calling every tool once in turn; and each tool's last result."""
    out = {name: fn() for name, fn in tools.items()}
    times = {name: [] for name in tools}
    for _ in range(runs):
        for name, fn in tools.items():
            t0 = time.perf_counter()
            out[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return times, out


def timed(fn, runs: int, warmup: bool = True):
    if warmup:
        fn()
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), result


_COMPILE_SNIPPET = """
import time, numpy as np
t0 = time.perf_counter()
from packer_cli import plan
t1 = time.perf_counter()
x = np.array([5, 3, 8, 2, 9, 1, 4], dtype=np.int64)
out = {"import_s": t1 - t0}
for name, fn in [
    ("ffd", lambda: plan.first_fit_decreasing(x, 10)),
    ("bfd", lambda: plan.best_fit_decreasing(x, 10)),
    ("next_fit", lambda: plan.next_fit(x, 10)),
    ("first-fit-shuffle", lambda: plan.bridge_first_fit_shuffle(x, 10, 0)),
    ("plan_packs+refine", lambda: plan.plan_packs([6, 5, 4, 5], 10, "sequential", refine=True)),
]:
    t = time.perf_counter(); fn(); out[name] = time.perf_counter() - t
print(__import__("json").dumps(out))
"""


def measure_compile() -> dict:
    """First-call times in fresh interpreters: with an empty numba cache (JIT
    compile) and again with the cache just written (cache load)."""
    result = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
        for label in ("cold_compile", "cached_load"):
            proc = subprocess.run(
                [sys.executable, "-c", _COMPILE_SNIPPET], env=env, capture_output=True, text=True, check=True
            )
            result[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="items per distribution")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per implementation (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dists", nargs="+", default=list(DISTRIBUTIONS), choices=DISTRIBUTIONS)
    ap.add_argument("--python-n", type=int, default=100_000, help="item cap for the pure-Python FFD (0 skips it)")
    ap.add_argument("--no-lightbinpack", action="store_true", help="skip LightBinPack even if installed")
    ap.add_argument("--no-compile-check", action="store_true", help="skip the JIT compile measurement")
    ap.add_argument("--json-out", help="write the rows as JSON to this file")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")

    lbp = None
    if not args.no_lightbinpack:
        try:
            import lightbinpack as lbp
        except ImportError:
            print("lightbinpack not importable; skipping it")

    rows: list[dict] = []
    header = f"{'dist':8s} {'impl':24s} {'n':>8s} {'median_s':>9s} {'min_s':>9s} {'packs':>8s} {'vs L1 %':>8s} {'vs L2 %':>8s} {'x obfd':>7s}"
    print(header)
    for dist in args.dists:
        lengths, capacity = make_lengths(dist, args.n, args.seed)
        l1, l2 = lower_bound(lengths, capacity), martello_toth_l2(lengths, capacity)
        dist_rows = []

        def add(impl, n, med, best, packs, extra=None):
            row = {
                "dist": dist, "impl": impl, "n": n, "capacity": capacity, "runs": args.runs,
                "median_s": med, "min_s": best, "packs": int(packs),
            }
            if n == args.n:
                row.update(L1=l1, L2=l2, gap_vs_L1_pct=100.0 * (packs - l1) / l1, gap_vs_L2_pct=100.0 * (packs - l2) / l2)
            row.update(extra or {})
            dist_rows.append(row)

        # Every tool is timed once per round, in turn, so all of them see the same machine noise.
        plan = plan_packs(lengths, capacity, "ffd")  # the plan refine_plan improves (timed below as well)
        as_list = lengths.tolist() if lbp is not None else None
        tools = {
            "packer.ffd": lambda: first_fit_decreasing(lengths, capacity),
            "packer.bfd": lambda: best_fit_decreasing(lengths, capacity),
            "packer.next_fit": lambda: next_fit(lengths, capacity),
            # plan_packs' default seed, as the quality table
            "packer.first_fit_shuffle": lambda: bridge_first_fit_shuffle(lengths, capacity, 0)[0],
            "packer.plan_packs(ffd)": lambda: plan_packs(lengths, capacity, "ffd"),
            "packer.refine_plan(ffd)": lambda: refine_plan(lengths, plan),
            # What ``pack`` runs by default: the plan and the improvement pass, one call.
            "packer.plan_packs(ffd, refine)": lambda: plan_packs(lengths, capacity, "ffd", refine=True),
        }
        if lbp is not None:
            tools["list.tolist"] = lambda: lengths.tolist()  # the conversion LightBinPack's input needs
            # nf (next fit, no search at all) measures what any LightBinPack call pays to take a
            # list and return a list of lists: the part of obfd's time that is not its algorithm
            for name in ("obfd", "ffd", "bfd", "nf"):
                tools[f"lightbinpack.{name}"] = (lambda fn: lambda: fn(as_list, capacity))(getattr(lbp, name))
        times, out = interleaved(tools, args.runs)
        for impl, result in out.items():
            if impl == "list.tolist":
                continue
            med, best = statistics.median(times[impl]), min(times[impl])
            if impl.startswith("lightbinpack."):
                add(impl, args.n, med, best, len(result), {"tolist_s": statistics.median(times["list.tolist"])})
            elif impl.startswith("packer.plan_packs") or impl == "packer.refine_plan(ffd)":
                if impl == "packer.refine_plan(ffd)":
                    validate_plan(result, lengths, capacity)
                    add(impl, args.n, med, best, result.num_packs, {"refine_seconds_reported": result.refine_seconds})
                else:
                    add(impl, args.n, med, best, result.num_packs)
            else:
                add(impl, args.n, med, best, result.max() + 1)

        if args.python_n:
            m = min(args.n, args.python_n)
            sub = lengths[:m].tolist()
            med, best, out = timed(lambda: python_ffd(sub, capacity), args.runs, warmup=False)
            add("python.ffd(segment tree)", m, med, best, max(out) + 1)

        obfd = next((r for r in dist_rows if r["impl"] == "lightbinpack.obfd"), None)
        for row in dist_rows:
            if obfd is not None and row["n"] == obfd["n"]:
                row["ratio_vs_obfd"] = row["median_s"] / obfd["median_s"]
                row["same_packs_as_obfd"] = row["packs"] == obfd["packs"]
            ratio = f"{row['ratio_vs_obfd']:7.3f}" if "ratio_vs_obfd" in row else f"{'-':>7s}"
            gap1 = f"{row['gap_vs_L1_pct']:8.4f}" if "gap_vs_L1_pct" in row else f"{'-':>8s}"
            gap2 = f"{row['gap_vs_L2_pct']:8.4f}" if "gap_vs_L2_pct" in row else f"{'-':>8s}"
            print(f"{dist:8s} {row['impl']:24s} {row['n']:8d} {row['median_s']:9.4f} {row['min_s']:9.4f} "
                  f"{row['packs']:8d} {gap1} {gap2} {ratio}")
        print(f"{dist:8s} bounds: L1 = {l1}, L2 = {l2}")
        rows.extend(dist_rows)

    report = {"rows": rows, "n": args.n, "runs": args.runs, "seed": args.seed,
              "numpy": np.__version__, "cpus": os.cpu_count()}
    if not args.no_compile_check:
        report["first_call_s"] = measure_compile()
        print("first call (s), fresh interpreter:")
        for label, times in report["first_call_s"].items():
            print(f"  {label}: " + ", ".join(f"{k}={v:.3f}" for k, v in times.items()))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

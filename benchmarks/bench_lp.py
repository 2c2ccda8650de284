"""How far the improvement pass is from the optimum, by linear programming (outside the full run).

The pass stops at the largest of L2 and the Fekete–Schepers bounds, and where it ends above
that bound, the bound alone cannot tell whether the packing or the bound is weak. The linear
programming relaxation of bin packing (Gilmore–Gomory: one variable per way of filling a pack,
"pattern") is within a pack of the optimum on almost every instance known, so it tells. This
solves it by column generation: HiGHS (``pip install highspy``; a benchmark dependency only)
solves the restricted problem, a bounded knapsack over the lengths (numba)
prices new patterns with its duals, a few per round. For each set it prints:

- ``ffd``, ``refine``: packs of first-fit decreasing and of the pass (``pack``'s default);
- ``bound``: the pass's stopping bound;
- ``lp_bound``: the relaxation's bound, ``ceil`` of Farley's ``z / max price`` (valid at any
  round, so a stopped run still gives a bound);
- ``lp_packing``: packs of a real packing built from the relaxation's solution (each pattern
  taken ``floor(x)`` times while its items last, the rest first-fit decreasing): packs that are
  achievable on these lengths.

The pricing's table has C + 1 entries per pattern item, so sets are kept to C <= 16k::

    .venv/bin/python benchmarks/bench_lp.py                  # four narrow sets, ~1-4 min
    .venv/bin/python benchmarks/bench_lp.py --shapes 10 --seed 11
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numba
import numpy as np

from packer_cli.plan import plan_packs
from packer_cli.plan.bounds import _best_of_lengths

#: Patterns added per round at most (from the best knapsack fills of different room).
COLUMNS_PER_ROUND = 8


def narrow_normal(mean: float, sd: float, capacity: int, n: int, seed: int) -> np.ndarray:
    """``n`` lengths, normal with ``mean`` and ``sd`` as fractions of ``capacity`` and of the mean."""
    x = np.random.default_rng(seed).normal(mean * capacity, sd * mean * capacity, n)
    return np.clip(np.rint(x), 1, capacity).astype(np.int64)


def default_sets():
    yield "normal mean 0.192C sd 0.14 of it, n 30000, C 4096", narrow_normal(0.192, 0.14, 4096, 30000, 5), 4096
    yield "normal mean 0.192C sd 0.14 of it, n 30000, C 2048", narrow_normal(0.192, 0.14, 2048, 30000, 6), 2048
    yield "normal mean 0.102C sd 0.08 of it, n 30000, C 2048", narrow_normal(0.102, 0.08, 2048, 30000, 7), 2048
    x = np.random.default_rng(8).lognormal(np.log(0.39 * 8192), 0.29, 30000)
    yield "lognormal median 0.390C sigma 0.29, n 30000, C 8192", np.clip(np.rint(x), 1, 8192).astype(np.int64), 8192


@numba.njit(cache=True)
def best_fills(sizes, values, copies, capacity, how_many):
    """The bounded knapsack over ``sizes`` (value ``values``, at most ``copies`` of each) into
    ``capacity``: up to ``how_many`` fills of the highest values, each the best fill of a
    different room, as ``(values float64[k], counts int64[k, n])``, best first."""
    n = sizes.shape[0]
    # binary splitting: copies c of a size become parts 1, 2, 4, ..., rest (0/1 items)
    parts = 0
    for i in range(n):
        c, k = copies[i], 1
        while c > 0:
            parts += 1
            c -= min(k, c)
            k *= 2
    weight = np.empty(parts, np.int64)
    worth = np.empty(parts, np.float64)
    owner = np.empty(parts, np.int64)
    mult = np.empty(parts, np.int64)
    j = 0
    for i in range(n):
        c, k = copies[i], 1
        while c > 0:
            t = min(k, c)
            weight[j], worth[j], owner[j], mult[j] = t * sizes[i], t * values[i], i, t
            j += 1
            c -= t
            k *= 2
    best = np.zeros(capacity + 1)
    took = np.zeros((parts, capacity + 1), np.bool_)
    for j in range(parts):
        for x in range(capacity, weight[j] - 1, -1):
            if best[x - weight[j]] + worth[j] > best[x] + 1e-12:
                best[x] = best[x - weight[j]] + worth[j]
                took[j, x] = True
    rooms = np.argsort(-best)[:how_many]
    counts = np.zeros((rooms.shape[0], n), np.int64)
    for r in range(rooms.shape[0]):
        x = rooms[r]
        for j in range(parts - 1, -1, -1):
            if took[j, x]:
                counts[r, owner[j]] += mult[j]
                x -= weight[j]
    return best[rooms], counts


def lp_relaxation(lengths: np.ndarray, capacity: int, max_rounds: int, max_seconds: float):
    """Column generation: ``(sizes, counts, patterns int64[P, n], x float64[P], z, bound, rounds)``.

    One HiGHS model throughout: each round adds its patterns as columns and re-solves from the
    last basis (a fresh solve of each round's problem made this 10-50x slower)."""
    import highspy

    sizes, counts = np.unique(lengths[lengths > 0], return_counts=True)
    most = np.minimum(counts, capacity // sizes)
    lp = highspy.Highs()
    lp.setOptionValue("output_flag", False)
    inf = highspy.kHighsInf
    for count in counts:  # one row a length: its count, covered
        lp.addRow(float(count), inf, 0, np.zeros(0, np.int32), np.zeros(0))
    patterns = []

    def add(pattern):
        rows = np.flatnonzero(pattern).astype(np.int32)
        lp.addCol(1.0, 0.0, inf, rows.size, rows, pattern[rows].astype(np.float64))
        patterns.append(pattern)

    for i in range(sizes.size):
        add(np.where(np.arange(sizes.size) == i, most[i], 0))
    bound, start = 0.0, time.perf_counter()
    for rounds in range(1, max_rounds + 1):
        lp.run()
        if lp.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            raise RuntimeError(f"HiGHS: {lp.modelStatusToString(lp.getModelStatus())}")
        z = lp.getInfo().objective_function_value
        duals = np.maximum(np.asarray(lp.getSolution().row_dual), 0.0)
        copies = np.where(duals > 1e-12, most, 0)
        values, fills = best_fills(sizes, duals, copies, capacity, COLUMNS_PER_ROUND)
        bound = max(bound, z / max(values[0], 1.0))
        if values[0] <= 1 + 1e-9 or math.ceil(bound - 1e-7) >= math.ceil(z - 1e-7):
            break
        if time.perf_counter() - start > max_seconds:
            break
        for value, fill in zip(values, fills):
            if value > 1 + 1e-9:
                add(fill)
    x = np.asarray(lp.getSolution().col_value)
    return sizes, counts, np.array(patterns), x, z, math.ceil(bound - 1e-7), rounds


def packing_from(sizes, counts, patterns, x, capacity) -> int:
    """Packs of a real packing from the relaxation's solution ``x``: each pattern ``floor(x)``
    times (as far as its items last, largest ``x`` first), then first-fit decreasing of the rest."""
    left = counts.copy()
    packs = 0
    for p in np.argsort(-x):
        used = patterns[p] > 0
        times = int(min(math.floor(x[p] + 1e-9), (left[used] // patterns[p][used]).min()))
        if times > 0:
            left -= times * patterns[p]
            packs += times
    rest = np.repeat(sizes, left)
    return packs + (plan_packs(rest, capacity, "ffd").num_packs if rest.size else 0)


def report(what: str, lengths: np.ndarray, capacity: int, args) -> dict:
    start = time.perf_counter()
    row = {"set": what, "ffd": plan_packs(lengths, capacity).num_packs,
           "refine": plan_packs(lengths, capacity, refine=True).num_packs,
           "bound": _best_of_lengths(lengths, capacity)}
    sizes, counts, patterns, x, z, bound, rounds = lp_relaxation(lengths, capacity, args.max_rounds, args.max_seconds)
    row.update(lp_value=round(z, 3), lp_bound=bound, lp_packing=packing_from(sizes, counts, patterns, x, capacity),
               rounds=rounds, patterns=len(patterns), seconds=round(time.perf_counter() - start, 1))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=int, default=0, metavar="N",
                    help="instead of the four narrow sets: N random sets of bench_refine.py --shapes (C <= 16k)")
    ap.add_argument("--seed", type=int, default=11, help="--shapes: which random sets")
    ap.add_argument("--max-rounds", type=int, default=5000)
    ap.add_argument("--max-seconds", type=float, default=600.0, help="per set; the bound stays valid when cut short")
    args = ap.parse_args(argv)
    if args.shapes:
        from bench_refine import random_shape

        draw = np.random.default_rng(args.seed)
        sets = []
        k = 0
        while len(sets) < args.shapes:
            what, lengths, capacity = random_shape(draw, args.seed * 100_003 + k)
            k += 1
            if capacity <= 16384:
                sets.append((what, lengths, capacity))
    else:
        sets = list(default_sets())
    for what, lengths, capacity in sets:
        print(json.dumps(report(what, lengths, capacity, args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

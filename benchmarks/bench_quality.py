"""Packing quality: packs against the lower bounds, for every distribution.

For each length distribution (``sft4k``, ``gamma1k``, ``long8k`` from ``bench_plan.py`` and the
real files in ``../shared/data``) it reports L1 = ceil(Σp / C), the Martello–Toth bound L2
(``packer_cli.plan.martello_toth_l2``) and the packs of: packer's FFD, FFD + refine (the
``pack`` default), BFD and Bridge's first-fit-shuffle; LightBinPack's ``obfd``; and the plain
pure-Python first-fit decreasing of ``bench_plan.py`` (the Bridge-style baseline: a segment
tree over packs, no compiled code).

    python benchmarks/bench_quality.py --n 1000000
"""
from __future__ import annotations

import argparse
import time

from _util import emit
from bench_data import length_distributions
from bench_plan import python_ffd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="items per synthetic distribution")
    ap.add_argument("--python-n", type=int, default=1_000_000, help="item cap for the pure-Python FFD")
    args = ap.parse_args()
    from packer_cli.plan import lower_bound, martello_toth_l2, plan_packs

    try:
        import lightbinpack
    except ImportError:
        lightbinpack = None
    for name, (lengths, capacity) in length_distributions(args.n).items():
        row = {"what": "quality", "dist": name, "n": int(lengths.size), "capacity": capacity,
               "L1": lower_bound(lengths, capacity), "L2": martello_toth_l2(lengths, capacity)}
        for label, algorithm, refine in (("packer.ffd", "ffd", False), ("packer.ffd+refine", "ffd", True),
                                         ("packer.bfd", "bfd", False), ("packer.first-fit-shuffle", "first-fit-shuffle",
                                                                        False)):
            t0 = time.perf_counter()
            row[label] = plan_packs(lengths, capacity, algorithm, refine=refine).num_packs
            row[label + ".seconds"] = time.perf_counter() - t0
        if lightbinpack is not None:
            row["lightbinpack.obfd"] = len(lightbinpack.obfd(lengths.tolist(), capacity))
        if lengths.size <= args.python_n:
            t0 = time.perf_counter()
            row["python.ffd"] = max(python_ffd(lengths.tolist(), capacity)) + 1
            row["python.ffd.seconds"] = time.perf_counter() - t0
        emit(row)


if __name__ == "__main__":
    main()

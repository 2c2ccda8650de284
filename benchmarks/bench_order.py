"""Order-preserving packing: what keeping the input order costs in packs, and how fast it plans.

For each quality distribution (``bench_data.length_distributions``) it plans the lengths as
``pack`` does with ``--no-shuffle`` and reports packs against the Martello–Toth bound L2, and
how much of the input order the packs keep (Spearman's rank correlation between a sequence's
input position and its pack's position: 1 is the input order):

* ``global``      FFD + refine over the whole input (the default);
* ``window:W``    ``--window W``: FFD + refine per window of W records, packs in window order;
* ``sequential``  ``--algorithm sequential``: next fit in input order;
* ``trl.bfd``     the peer: TRL's ``pack_dataset(strategy="bfd")``, which packs each
                  1,000-row ``map`` batch on its own (a windowed BFD); its packs only, since
                  TRL reports no sample of each pack.
* ``bfd.window:1000.norefine`` packer's BFD in TRL's windows without the refine pass: the same
                  packs as TRL's where both run exact best-fit decreasing (a cross-check).

    python benchmarks/bench_order.py --n 200000
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from _util import emit
from bench_data import length_distributions

WINDOWS = (1_000, 10_000)


def rank_correlation(plan) -> float:
    """Spearman's rho between each packed item's input position and its pack's position."""
    pack_of = np.repeat(np.arange(plan.num_packs), np.diff(plan.pack_offsets))
    items = plan.order.astype(np.int64)
    ranks_in = np.argsort(np.argsort(items, kind="stable"), kind="stable").astype(np.float64)
    ranks_pack = np.argsort(np.argsort(pack_of, kind="stable"), kind="stable").astype(np.float64)
    # ties in pack position are ranked by placement, which favours no order: rho is a lower bound
    return float(np.corrcoef(ranks_in, ranks_pack)[0, 1]) if items.size > 1 else 1.0


def trl_packs(lengths: np.ndarray, capacity: int) -> tuple[int, float] | None:
    try:
        import datasets
        import pyarrow as pa
        from datasets import Dataset
        from datasets.table import InMemoryTable
        from trl import pack_dataset
    except ImportError:
        return None
    datasets.disable_progress_bars()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.ones(int(offsets[-1]), np.int32)))
    ds = Dataset(InMemoryTable(pa.table({"input_ids": ids})))
    t0 = time.perf_counter()
    out = pack_dataset(ds, capacity, strategy="bfd")
    return len(out), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="items per synthetic distribution")
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL peer")
    args = ap.parse_args()
    from packer_cli.plan import martello_toth_l2, plan_packs

    for name, (lengths, capacity) in length_distributions(args.n).items():
        lengths = np.minimum(lengths, capacity)  # as pack's truncate policy leaves them
        row = {"what": "order", "dist": name, "n": int(lengths.size), "capacity": capacity,
               "L2": martello_toth_l2(lengths, capacity)}
        runs = [("global", "ffd", True, None), *((f"window:{w}", "ffd", True, w) for w in WINDOWS),
                ("sequential", "sequential", False, None), ("bfd.window:1000.norefine", "bfd", False, 1000)]
        for label, algorithm, refine, window in runs:
            plan_packs(lengths[:5000], capacity, algorithm, refine=refine, window=window)  # untimed: kernels loaded
            t0 = time.perf_counter()
            plan = plan_packs(lengths, capacity, algorithm, refine=refine, window=window)
            row[label] = plan.num_packs
            row[label + ".seconds"] = time.perf_counter() - t0
            row[label + ".rho"] = rank_correlation(plan)
        if not args.no_trl and (trl := trl_packs(lengths, capacity)) is not None:
            row["trl.bfd"], row["trl.bfd.seconds"] = trl
        emit(row)


if __name__ == "__main__":
    main()

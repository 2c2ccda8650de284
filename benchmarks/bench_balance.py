"""Data-parallel balance: how long the slowest rank keeps a step waiting, dealt and balanced.

A training step ends with the gradient all-reduce, so it lasts as long as the rank whose packs
cost the most. For each length distribution (the benchmark's synthetic ones, ``long32k``:
lognormal lengths of median 1,500 up to C = 32,768, and the real files in ``../shared/data``)
this plans the packs (``ffd`` + refine, what ``pack`` does), takes each pack's real tokens and
``Σ s²``, and deals one epoch's seeded permutation over ``dp`` ranks taking ``k`` micro-batches
(one pack each) a step in two ways:

* ``dealt``: micro-batch ``j`` to rank ``j mod dp``, what ``THDLoader(balance=None)`` and torch's
  ``DistributedSampler`` do;
* ``balanced``: the same steps' packs dealt again by ``THDLoader(balance=...)``'s rule
  (:func:`packer_cli.plan.balance.balance_ranks`).

It reports the mean over steps of ``max / mean`` of the ranks' step cost (1.0: no rank waits),
for three costs: attention work ``Σ s²``, and the training FLOPs of Llama-3-8B-shaped and
Llama-3-70B-shaped models (:func:`packer_cli.torch.flops.flops_cost`, which needs torch
installed). ``speedup`` is dealt over balanced: the step time saved where a step's time
follows its FLOPs. Also the seconds ``balance_ranks`` takes for 1M packs.

    python benchmarks/bench_balance.py --n 200000
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from _util import emit
from bench_data import length_distributions

#: The two model shapes, as :func:`packer_cli.torch.flops.flops_cost` takes them.
MODELS = {
    "8B": dict(num_layers=32, hidden_size=4096, num_heads=32, head_dim=128, ffn_hidden_size=14336,
               num_query_groups=8, vocab_size=128256),
    "70B": dict(num_layers=80, hidden_size=8192, num_heads=64, head_dim=128, ffn_hidden_size=28672,
                num_query_groups=8, vocab_size=128256),
}
SETUPS = ((8, 4), (64, 8), (256, 4))  # (dp ranks, micro-batches a step)


def long32k(n: int, seed: int) -> tuple[np.ndarray, int]:
    x = np.random.default_rng(seed).lognormal(np.log(1500.0), 1.3, n)
    return np.clip(np.round(x), 16, 32768).astype(np.int64), 32768


def pack_statistics(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    from packer_cli.plan import plan_packs

    plan = plan_packs(lengths, capacity, "ffd", refine=True)
    pack = np.repeat(np.arange(plan.num_packs), np.diff(plan.pack_offsets))
    items = lengths[plan.order].astype(np.float64)
    return np.bincount(pack, items, plan.num_packs), np.bincount(pack, items * items, plan.num_packs)


def step_factor(costs: np.ndarray, ranks: np.ndarray, dp: int) -> float:
    """Mean over steps of max / mean of the ranks' costs; ``ranks``: ``[steps, dp * k]``."""
    steps = ranks.shape[0]
    loads = np.zeros((steps, dp))
    np.add.at(loads, (np.repeat(np.arange(steps), ranks.shape[1]), ranks.ravel()), costs.ravel())
    return float((loads.max(axis=1) / loads.mean(axis=1)).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="samples per synthetic distribution")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from packer_cli.plan.balance import balance_ranks
    from packer_cli.torch.flops import flops_cost

    distributions = length_distributions(args.n, args.seed)
    distributions["long32k"] = long32k(args.n, args.seed)
    models = {name: flops_cost(**shape) for name, shape in MODELS.items()}
    for name, (lengths, capacity) in distributions.items():
        tokens, squares = pack_statistics(lengths, capacity)
        for dp, k in SETUPS:
            group = dp * k
            steps = tokens.size // group
            if steps < 4:
                continue
            order = np.random.default_rng([args.seed, 0]).permutation(tokens.size)[:steps * group]
            dealt = np.tile(np.arange(group) % dp, (steps, 1))
            row = {"what": "balance", "dist": name, "capacity": capacity, "packs": int(tokens.size), "dp": dp,
                   "k": k, "steps": steps}
            for cost_name, costs in (("attention", squares),
                                     *((m, cost(tokens, squares)) for m, cost in models.items())):
                step_costs = costs[order].reshape(steps, group)
                balanced = balance_ranks(step_costs.ravel(), dp, k).reshape(steps, group)
                before, after = step_factor(step_costs, dealt, dp), step_factor(step_costs, balanced, dp)
                row[cost_name] = {"dealt": round(before, 4), "balanced": round(after, 4),
                                  "speedup": round(before / after, 4)}
            emit(row)
    costs = np.random.default_rng(1).random(1 << 20)
    for dp, k in SETUPS:
        balance_ranks(costs[:dp * k], dp, k)  # compiled or loaded from the cache first
        t0 = time.perf_counter()
        balance_ranks(costs[:costs.size - costs.size % (dp * k)], dp, k)
        emit({"what": "balance_time", "dp": dp, "k": k, "packs": costs.size, "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()

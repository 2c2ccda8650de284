"""Data-parallel balance: how long the slowest rank keeps a step waiting, dealt and balanced.

A training step ends with the gradient all-reduce, so it lasts as long as the rank whose packs
cost the most. For each length distribution (the benchmark's synthetic ones, ``long32k``:
lognormal lengths of median 1,500 up to C = 32,768, and the real files in ``../shared/data``)
this plans the packs (``ffd`` + refine, what ``pack`` does), takes each pack's real tokens and
``Σ s²``, and serves one epoch to ``dp`` ranks taking ``k`` micro-batches (one pack each) a
step, through ``THDLoader``'s own sampler (``MicroBatchSampler``), three ways:

* ``dealt``: ``balance=None``, micro-batch ``j`` to rank ``j mod dp`` (torch's
  ``DistributedSampler``'s rule);
* ``step``: ``balance=...``, each step's packs dealt again (``balance_scope="step"``);
* ``epoch``: ``balance_scope="epoch"``, each step made of packs of about the same cost;
* ``16``, ``64``: ``balance_scope=16`` / ``64``, the same within windows of that many steps.

The peer is LightBinPack's ``pack(variant="square", dp_size=dp)``, which packs the lengths into
groups of ``dp`` bins balanced in ``Σ s²`` (a group is one round: bin ``r`` to rank ``r``, ``k``
groups a step), with its own packs.

Each figure is the mean over steps of ``max / mean`` of the ranks' step cost (1.0: no rank
waits), for three costs: attention work ``Σ s²``, and the training FLOPs of Llama-3-8B- and
Llama-3-70B-shaped models (:func:`packer_cli.torch.flops.flops_cost`, which needs torch
installed). The balancing is by the cost measured. Also the seconds ``balance_ranks`` takes
for 1M packs.

    python benchmarks/bench_balance.py --n 200000
"""
from __future__ import annotations

import argparse
import importlib.util
import time
import warnings

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
SETUPS = ((8, 1), (8, 4), (64, 8), (256, 4))  # (dp ranks, micro-batches a step)


def long32k(n: int, seed: int) -> tuple[np.ndarray, int]:
    x = np.random.default_rng(seed).lognormal(np.log(1500.0), 1.3, n)
    return np.clip(np.round(x), 16, 32768).astype(np.int64), 32768


def pack_statistics(lengths: np.ndarray, pack_of: np.ndarray, packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Per pack ``Σ s`` and ``Σ s²`` of items ``lengths`` placed in packs ``pack_of``."""
    items = lengths.astype(np.float64)
    return np.bincount(pack_of, items, packs), np.bincount(pack_of, items * items, packs)


def step_factor(rank_costs: np.ndarray, k: int) -> float:
    """``rank_costs``: ``[micro-batches, ranks]``; the mean over whole steps of max / mean."""
    steps = rank_costs.shape[0] // k
    loads = rank_costs[:steps * k].reshape(steps, k, -1).sum(axis=1)
    return float((loads.max(axis=1) / loads.mean(axis=1)).mean())


def served(costs: np.ndarray | None, dp: int, k: int, scope: str | int, seed: int, weights: np.ndarray) -> np.ndarray:
    """``[micro-batches, ranks]`` costs ``weights`` of what each rank is served in epoch 0."""
    from packer_cli.torch.sampler import MicroBatchSampler

    orders = [MicroBatchSampler(weights.size, dp_size=dp, dp_rank=r, seed=seed, costs=costs,
                                micro_batches_per_step=k, balance_scope=scope).epoch_order(0)[:, 0]
              for r in range(dp)]
    return np.stack([weights[o] for o in orders], axis=1)


def lightbinpack_square(lengths: np.ndarray, capacity: int, dp: int):
    """LightBinPack's groups of ``dp`` bins: ``(pack of each item, packs, [groups, dp] pack ids, seconds)``."""
    import lightbinpack

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = lightbinpack.pack(lengths.tolist(), capacity, variant="square", dp_size=dp)
    seconds = time.perf_counter() - t0
    pack_of = np.empty(lengths.size, np.int64)
    grid, packs = [], 0
    for group in groups:
        ids = []
        for bin_items in group:
            pack_of[bin_items] = packs
            ids.append(packs)
            packs += 1
        if len(ids) == dp:  # a short last group makes no round
            grid.append(ids)
    return pack_of, packs, np.array(grid, dtype=np.int64).reshape(-1, dp), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="samples per synthetic distribution")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from packer_cli.plan import plan_packs
    from packer_cli.plan.balance import balance_ranks
    from packer_cli.torch.flops import flops_cost

    peer = importlib.util.find_spec("lightbinpack") is not None
    distributions = length_distributions(args.n, args.seed)
    distributions["long32k"] = long32k(args.n, args.seed)
    models = {name: flops_cost(**shape) for name, shape in MODELS.items()}
    for name, (lengths, capacity) in distributions.items():
        plan = plan_packs(lengths, capacity, "ffd", refine=True)
        pack_of = np.empty(lengths.size, np.int64)
        pack_of[plan.order] = np.repeat(np.arange(plan.num_packs), np.diff(plan.pack_offsets))
        tokens, squares = pack_statistics(lengths, pack_of, plan.num_packs)
        for dp, k in SETUPS:
            if plan.num_packs // (dp * k) < 4:
                continue
            row = {"what": "balance", "dist": name, "capacity": capacity, "packs": plan.num_packs, "dp": dp, "k": k,
                   "steps": plan.num_packs // (dp * k)}
            costs = {"attention": squares, **{m: cost(tokens, squares) for m, cost in models.items()}}
            for cost_name, cost in costs.items():
                row[cost_name] = {"dealt": round(step_factor(served(None, dp, k, "step", args.seed, cost), k), 4)}
                for scope in ("step", 16, 64, "epoch"):
                    row[cost_name][str(scope)] = round(step_factor(served(cost, dp, k, scope, args.seed, cost), k), 4)
            if peer:
                peer_pack_of, peer_packs, grid, seconds = lightbinpack_square(lengths, capacity, dp)
                peer_tokens, peer_squares = pack_statistics(lengths, peer_pack_of, peer_packs)
                rounds = np.random.default_rng(args.seed).permutation(grid.shape[0])  # steps in a shuffled order
                row["lightbinpack_square"] = {"packs": peer_packs, "seconds": round(seconds, 4)}
                peer_costs = {"attention": peer_squares,
                              **{m: cost(peer_tokens, peer_squares) for m, cost in models.items()}}
                for cost_name, cost in peer_costs.items():
                    row["lightbinpack_square"][cost_name] = round(step_factor(cost[grid[rounds]], k), 4)
            emit(row)
    costs = np.random.default_rng(1).random(1 << 20)
    for dp, k in SETUPS[1:]:
        balance_ranks(costs[:dp * k], dp, k)  # compiled or loaded from the cache first
        t0 = time.perf_counter()
        balance_ranks(costs[:costs.size - costs.size % (dp * k)], dp, k)
        emit({"what": "balance_time", "dp": dp, "k": k, "packs": costs.size, "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()

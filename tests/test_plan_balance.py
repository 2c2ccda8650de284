"""``packer_cli.plan.balance.balance_ranks``: the kernel behind ``THDLoader(balance=...)``, against a
slow reference. Needs no torch, so it also runs in the lowest-versions pass (bounds-checked)."""
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packer_cli.plan.balance import balance_ranks


def scan_balance(costs, ranks, per_rank):
    """Slow reference: each group's items by decreasing cost (ties by position), each to the
    least-loaded rank with room (ties to the lowest rank), found by scanning every rank."""
    out = np.empty(len(costs), np.int64)
    group = ranks * per_rank
    for first in range(0, len(costs), group):
        part = [float(c) for c in costs[first:first + group]]
        loads, counts = [0.0] * ranks, [0] * ranks
        for item in sorted(range(group), key=lambda i: (-part[i], i)):
            rank = min((r for r in range(ranks) if counts[r] < per_rank), key=lambda r: (loads[r], r))
            out[first + item] = rank
            loads[rank] += part[item]
            counts[rank] += 1
    return out


@settings(max_examples=200, deadline=None)
@given(ranks=st.integers(1, 9), per_rank=st.integers(1, 5), groups=st.integers(0, 4), data=st.data())
def test_balance_ranks_is_the_scan_s_assignment_with_per_rank_items_each(ranks, per_rank, groups, data):
    # small integers make ties in cost and in load, where the heap must break them as the scan does
    values = st.integers(0, 6).map(float) | st.floats(0, 1e6, allow_nan=False)
    costs = np.array(data.draw(st.lists(values, min_size=ranks * per_rank * groups,
                                        max_size=ranks * per_rank * groups)), dtype=np.float64)
    got = balance_ranks(costs, ranks, per_rank)
    assert got.tolist() == scan_balance(costs, ranks, per_rank).tolist()
    for group in got.reshape(groups, ranks * per_rank):
        assert np.bincount(group, minlength=ranks).tolist() == [per_rank] * ranks


def test_balanced_shares_of_a_step():
    # dealt in order (the unbalanced sampler's rule) rank 0 gets 9 + 8 and rank 1 gets 1 + 2
    assert balance_ranks([9.0, 1.0, 8.0, 2.0], ranks=2, per_rank=2).tolist() == [0, 0, 1, 1]
    # one 12 against four 3s: 12 alone cannot be matched, the rest is spread
    ranks = balance_ranks([3.0, 12.0, 3.0, 3.0, 3.0, 1.0], ranks=3, per_rank=2)
    loads = np.bincount(ranks, weights=[3, 12, 3, 3, 3, 1])
    assert sorted(loads.tolist()) == [6.0, 6.0, 13.0]


@pytest.mark.parametrize("args, says", [
    (([1.0, 2.0, 3.0], 2, 1), "do not make whole groups"),
    (([1.0, -2.0], 2, 1), "item 1 costs -2.0"),
    (([1.0, float("nan")], 1, 2), "item 1 costs nan"),
    (([1.0, 2.0], 0, 1), "ranks must be an integer >= 1"),
    (([1.0, 2.0], 2, True), "per_rank must be an integer >= 1"),
    (([[1.0, 2.0]], 1, 2), "one-dimensional"),
])
def test_balance_ranks_refuses_bad_arguments(args, says):
    with pytest.raises(ValueError, match=says):
        balance_ranks(*args)


def test_costs_whose_sums_overflow_are_balanced_as_at_any_scale():
    costs = np.random.default_rng(5).uniform(0.5, 1.0, 8 * 16)
    ranks = balance_ranks(costs, 8, 16)
    huge = costs / costs.max() * 1.0e308  # finite, but any two of them sum to inf
    with np.errstate(over="ignore"):
        assert np.isfinite(huge).all() and not np.isfinite(huge[0] + huge[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor does it warn of the overflow it avoids
        assert balance_ranks(huge, 8, 16).tolist() == ranks.tolist()

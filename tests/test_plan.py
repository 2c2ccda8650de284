"""Tests of packer_cli.plan against the naive references in tests/naive.py."""

from __future__ import annotations

import numpy as np
import numpy.testing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packer_cli.plan import (
    ALGORITHMS,
    PackPlan,
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
from packer_cli.plan.bounds import _best_of_lengths, _fs_of_sizes, _split_fs_of_sizes
from packer_cli.plan.refine import _one_packed_length

try:
    from tests import naive
except ImportError:  # tests/ is not a package
    import naive

KERNELS = [
    (first_fit_decreasing, naive.first_fit_decreasing),
    (best_fit_decreasing, naive.best_fit_decreasing),
    (next_fit, naive.next_fit),
]
KERNEL_IDS = ["ffd", "bfd", "next_fit"]


@st.composite
def instances(draw, max_capacity=64, max_items=60):
    capacity = draw(st.integers(1, max_capacity))
    top = draw(st.integers(1, capacity))
    lengths = draw(st.lists(st.integers(1, top), max_size=max_items))
    return np.array(lengths, dtype=np.int64), capacity


def edge_cases():
    return [
        ([], 5),
        ([3], 3),
        ([1], 1),
        ([1, 1, 1, 1], 1),
        ([7] * 9, 7),
        ([1] * 33, 8),
        ([3] * 10, 8),
        ([5, 5, 5, 5], 10),
        ([6, 4, 6, 4, 6, 4], 10),
        ([4096, 1, 4095, 2, 4094], 4096),
        ([2, 5, 4, 7, 1, 3, 8], 10),
    ]


def pack_loads(pack_of_item, lengths):
    if len(lengths) == 0:
        return np.zeros(0, np.int64)
    return np.bincount(pack_of_item, weights=lengths).astype(np.int64)


# ---------------------------------------------------------------------------
# Kernels equal the naive references
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fast,slow", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("lengths,capacity", edge_cases())
def test_kernel_edge_cases(fast, slow, lengths, capacity):
    got = fast(lengths, capacity)
    assert got.dtype == np.int32
    npt.assert_array_equal(got, slow(lengths, capacity))


@pytest.mark.parametrize("fast,slow", KERNELS, ids=KERNEL_IDS)
@settings(max_examples=150, deadline=None)
@given(inst=instances())
def test_kernel_matches_naive(fast, slow, inst):
    lengths, capacity = inst
    got = fast(lengths, capacity)
    npt.assert_array_equal(got, slow(lengths, capacity))
    if len(lengths):
        assert pack_loads(got, lengths).max() <= capacity
        assert set(np.unique(got)) == set(range(got.max() + 1))


@pytest.mark.parametrize("fast,slow", KERNELS, ids=KERNEL_IDS)
def test_kernel_matches_naive_many_ties(fast, slow):
    # Few distinct lengths and many packs: exercises tie-breaking and grouping.
    rng = np.random.default_rng(5)
    for capacity in (10, 97, 1000):
        lengths = rng.choice([1, 2, capacity // 3 or 1, capacity // 2 or 1, capacity - 1 or 1], 700)
        npt.assert_array_equal(fast(lengths, capacity), slow(lengths, capacity))


def test_ffd_bfd_hand_computed():
    # decreasing: 8(i6) 7(i3) 5(i1) 4(i2) 3(i5) 2(i0) 1(i4)
    lengths = [2, 5, 4, 7, 1, 3, 8]
    # FFD: 8->P0(2 left) 7->P1(3) 5->P2(5) 4->P2(1) 3->P1(0) 2->P0(0) 1->P2(0)
    npt.assert_array_equal(first_fit_decreasing(lengths, 10), [0, 2, 2, 1, 2, 1, 0])
    # BFD: same packs here
    npt.assert_array_equal(best_fit_decreasing(lengths, 10), [0, 2, 2, 1, 2, 1, 0])
    # FFD and BFD differ: 7 -> P0 (3 left), 4, 4 -> P1 (2 left); the 1 goes to
    # P0 under FFD (first with room) and to P1 under BFD (least room).
    lengths = [1, 4, 7, 4]
    npt.assert_array_equal(first_fit_decreasing(lengths, 10), [0, 1, 0, 1])
    npt.assert_array_equal(best_fit_decreasing(lengths, 10), [1, 1, 0, 1])
    npt.assert_array_equal(next_fit([6, 5, 4, 1], 10), [0, 1, 1, 1])


def test_input_dtypes_and_layouts():
    lengths = np.array([5, 3, 8, 2, 9, 1, 4], dtype=np.int64)
    want = naive.first_fit_decreasing(lengths, 10)
    for variant in (
        lengths.astype(np.int32),
        lengths.astype(np.uint16),
        lengths.astype(">i8"),
        np.repeat(lengths, 2)[::2],
        lengths.tolist(),
        tuple(lengths.tolist()),
    ):
        npt.assert_array_equal(first_fit_decreasing(variant, np.int64(10)), want)


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "func", [first_fit_decreasing, best_fit_decreasing, next_fit, lower_bound, martello_toth_l2]
)
def test_validation(func):
    with pytest.raises(ValueError, match=r"lengths\[2\] = 5000 exceeds capacity 4096"):
        func([1, 2, 5000, 9000], 4096)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0 is below 1"):
        func([1, 0, 3], 4096)
    with pytest.raises(ValueError, match=r"lengths\[0\] = -3"):
        func([-3], 4096)
    with pytest.raises(ValueError, match="capacity = 0"):
        func([1], 0)
    with pytest.raises(ValueError, match="1-D"):
        func([[1, 2]], 4)
    with pytest.raises(TypeError):
        func([1.5, 2.0], 4)
    with pytest.raises(TypeError):
        func([True, False], 4)
    with pytest.raises(TypeError):
        func([1, 2], 4.0)
    with pytest.raises(ValueError, match="supported maximum"):
        func([1], 1 << 40)
    # what is no array of lengths is a TypeError, as the docstring says (it was "must be 1-D")
    for not_lengths, name in ((None, "NoneType"), ("123", "str"), ({1, 2}, "set")):
        with pytest.raises(TypeError, match=f"lengths must be a 1-D array of integers, got {name}"):
            func(not_lengths, 4096)
    # Python ints beyond int64 (an object array to NumPy) are integers out of range, not "not integers"
    with pytest.raises(ValueError, match=rf"lengths\[1\] = {2**70} exceeds capacity 4096"):
        func([1, 2**70], 4096)
    with pytest.raises(ValueError, match=rf"lengths\[0\] = {-2**70} is below 1"):
        func([-2**70, 1], 4096)
    with pytest.raises(TypeError, match="lengths must hold integers, got dtype object"):
        func([1, 2**70, None], 4096)


def test_validation_shuffle_and_plan():
    with pytest.raises(ValueError, match=r"lengths\[0\] = 9 exceeds capacity 8"):
        bridge_first_fit_shuffle([9], 8, 0)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 9 exceeds capacity 8"):
        plan_packs([1, 9], 8, "bfd")
    with pytest.raises(ValueError, match="unknown algorithm"):
        plan_packs([1], 8, "worst-fit")


def test_empty_inputs():
    for f in (first_fit_decreasing, best_fit_decreasing, next_fit):
        out = f([], 10)
        assert out.dtype == np.int32 and out.shape == (0,)
    pack, order = bridge_first_fit_shuffle(np.zeros(0, np.int32), 10, 3)
    assert pack.shape == order.shape == (0,)
    assert lower_bound([], 10) == 0 and martello_toth_l2([], 10) == 0
    for algorithm in ALGORITHMS:
        plan = plan_packs([], 10, algorithm)
        assert plan.num_packs == 0
        npt.assert_array_equal(plan.pack_offsets, [0])


# ---------------------------------------------------------------------------
# Megatron-Bridge first_fit_shuffle binding
# ---------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(inst=instances(max_capacity=40, max_items=80), seed=st.integers(0, 2**32 - 1))
def test_bridge_matches_transcription(inst, seed):
    lengths, capacity = inst
    pack, order = bridge_first_fit_shuffle(lengths, capacity, seed)
    want_pack, want_order = naive.bridge_first_fit_shuffle(lengths, capacity, seed)
    npt.assert_array_equal(pack, want_pack)
    npt.assert_array_equal(order, want_order)


def test_bridge_larger_and_global_rng_untouched():
    rng = np.random.default_rng(11)
    lengths = np.clip(rng.lognormal(np.log(60), 0.8, 3000).round(), 1, 512).astype(np.int64)
    np.random.seed(123)
    before = np.random.get_state()
    pack, order = bridge_first_fit_shuffle(lengths, 512, 42)
    after = np.random.get_state()
    assert before[0] == after[0] and (before[1] == after[1]).all() and before[2:] == after[2:]
    want_pack, want_order = naive.bridge_first_fit_shuffle(lengths, 512, 42)
    npt.assert_array_equal(pack, want_pack)
    npt.assert_array_equal(order, want_order)
    # A different seed gives a different result.
    assert not np.array_equal(bridge_first_fit_shuffle(lengths, 512, 43)[1], order)


# ---------------------------------------------------------------------------
# plan_packs / PackPlan
# ---------------------------------------------------------------------------


def _placement(lengths, algorithm):
    n = len(lengths)
    if algorithm == "sequential":
        return list(range(n))
    return sorted(range(n), key=lambda i: (-lengths[i], i))


@pytest.mark.parametrize("algorithm", ["ffd", "bfd", "sequential"])
@settings(max_examples=60, deadline=None)
@given(inst=instances())
def test_plan_layout(algorithm, inst):
    lengths, capacity = inst
    plan = plan_packs(lengths, capacity, algorithm)
    assert isinstance(plan, PackPlan)
    validate_plan(plan, lengths, capacity)
    slow = {"ffd": naive.first_fit_decreasing, "bfd": naive.best_fit_decreasing,
            "sequential": naive.next_fit}[algorithm]
    want = slow(lengths, capacity)
    npt.assert_array_equal(plan.pack_of_item, want)
    order, offsets = naive.pack_layout(want, _placement(lengths.tolist(), algorithm))
    npt.assert_array_equal(plan.order, order)
    npt.assert_array_equal(plan.pack_offsets, offsets)
    npt.assert_array_equal(plan.pack_load, pack_loads(want, lengths))
    # 12 bytes per item at most: int32 items and loads, int64 offsets (one per pack).
    for arr, dtype in ((plan.order, np.int32), (plan.pack_of_item, np.int32), (plan.pack_offsets, np.int64),
                       (plan.pack_load, np.int32)):
        assert arr.dtype == dtype


@settings(max_examples=40, deadline=None)
@given(inst=instances(max_capacity=30), seed=st.integers(0, 1000))
def test_plan_first_fit_shuffle(inst, seed):
    lengths, capacity = inst
    plan = plan_packs(lengths, capacity, "first-fit-shuffle", seed=seed)
    validate_plan(plan, lengths, capacity)
    pack, order = naive.bridge_first_fit_shuffle(lengths, capacity, seed)
    npt.assert_array_equal(plan.pack_of_item, pack)
    npt.assert_array_equal(plan.order, order)


def test_plan_api():
    plan = plan_packs([2, 5, 4, 7, 1, 3, 8], 10, "ffd")
    assert plan.num_packs == 3 and plan.num_items == 7 and plan.capacity == 10
    npt.assert_array_equal(plan.pack_items(0), [6, 0])
    npt.assert_array_equal(plan.pack_items(1), [3, 5])
    npt.assert_array_equal(plan.pack_items(2), [1, 2, 4])
    npt.assert_array_equal(plan.pack_load, [10, 10, 10])
    with pytest.raises(ValueError):
        plan.order[0] = 1
    with pytest.raises(AttributeError):
        plan.capacity = 3


def test_validate_plan_detects_overflow():
    plan = plan_packs([3, 3], 6, "ffd")
    with pytest.raises(ValueError, match="above capacity 5"):
        validate_plan(plan, [3, 3], 5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_respects_capacity(algorithm):
    rng = np.random.default_rng(1)
    for capacity in (1, 7, 512, 4096):
        lengths = rng.integers(1, capacity + 1, 2000)
        plan = plan_packs(lengths, capacity, algorithm, seed=7)
        validate_plan(plan, lengths, capacity)
        assert plan.num_packs >= lower_bound(lengths, capacity)


# ---------------------------------------------------------------------------
# Lower bounds
# ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(inst=instances(max_capacity=40, max_items=40))
def test_l2_matches_brute_force(inst):
    lengths, capacity = inst
    l1 = lower_bound(lengths, capacity)
    l2 = martello_toth_l2(lengths, capacity)
    assert l2 == naive.martello_toth_l2(lengths, capacity)
    assert l1 <= l2 <= (first_fit_decreasing(lengths, capacity).max() + 1 if len(lengths) else 0)


@settings(max_examples=80, deadline=None)
@given(inst=instances(max_capacity=20, max_items=9))
def test_l2_below_optimum(inst):
    lengths, capacity = inst
    assert martello_toth_l2(lengths, capacity) <= naive.optimal_packs(lengths, capacity)


def _fs(lengths, capacity):
    sizes, counts = np.unique(np.asarray(lengths, np.int64), return_counts=True)
    return _fs_of_sizes(sizes, counts, capacity)


@settings(max_examples=120, deadline=None)
@given(inst=instances(max_capacity=20, max_items=9))
def test_fekete_schepers_below_optimum(inst):
    """What the improvement pass stops at must never exceed the fewest packs possible."""
    lengths, capacity = inst
    optimum = naive.optimal_packs(lengths, capacity)
    assert lower_bound(lengths, capacity) <= _fs(lengths, capacity) <= optimum
    sizes, counts = np.unique(np.asarray(lengths, np.int64), return_counts=True)
    assert _split_fs_of_sizes(sizes, counts, capacity) <= optimum
    assert martello_toth_l2(lengths, capacity) <= _best_of_lengths(np.asarray(lengths, np.int64), capacity) <= optimum


def test_fekete_schepers_sees_pairs_l2_cannot():
    """Eight items of 15 at C = 41 pair at most (three are 45), and the 29s take only a 7:
    6 packs are needed. L2 counts the 15s by their total (ceil(120 / 41) = 3), u_2 as halves."""
    lengths = [29, 29] + [15] * 8 + [7, 7]
    assert martello_toth_l2(lengths, 41) == 5
    assert _fs(lengths, 41) == 6 == naive.optimal_packs(lengths, 41)
    assert _fs([], 41) == 0 and _fs([0, 0], 41) == 0
    assert _fs([41, 41, 1], 41) == 3  # L1: each u_k alone counts the 1 as nothing


def test_fekete_schepers_table_and_loop_agree(monkeypatch):
    """Every k in one table (the usual case) or one k at a time (over 32k distinct lengths)."""
    import packer_cli.plan.bounds as bounds

    rng = np.random.default_rng(11)
    cases = []
    for _ in range(200):
        capacity = int(rng.integers(1, 1 << 20))
        sizes = np.unique(rng.integers(1, capacity + 1, int(rng.integers(1, 60))))
        cases.append((sizes, rng.integers(1, 1 << 30, sizes.size), capacity))
    table = [_fs_of_sizes(*case) for case in cases]
    monkeypatch.setattr(bounds, "_FS_TABLE_CELLS", 0)
    assert table == [_fs_of_sizes(*case) for case in cases]


def test_split_fekete_schepers_counts_the_items_big_ones_exclude():
    """29s (over C/2 at C = 40) take no 12 (41 > 40), and three 12s share a pack: 2 + 4 = 6
    packs. L2 and FS count ten 12s as 3 packs' worth (120 / 40); bounding the 12s alone gives 4."""
    lengths = [29, 29] + [12] * 10
    sizes, counts = np.unique(lengths, return_counts=True)
    assert martello_toth_l2(lengths, 40) == _fs(lengths, 40) == 5
    assert _split_fs_of_sizes(sizes, counts, 40) == 6 == naive.optimal_packs(lengths, 40)
    assert _best_of_lengths(np.asarray(lengths, np.int64), 40) == 6


def test_bounds_hand_computed():
    assert lower_bound([5, 5, 5], 10) == 2
    assert martello_toth_l2([5, 5, 5], 10) == 2
    # Three items just above half: L1 = 2, L2 = 3.
    assert lower_bound([6, 6, 6], 10) == 2
    assert martello_toth_l2([6, 6, 6], 10) == 3
    # K = 3: J1 = {8, 8}, J2 = {}, J3 = {3, 3, 3}: 2 + ceil(9 / 10) = 3 (L1 = 3 too).
    assert martello_toth_l2([8, 8, 3, 3, 3], 10) == 3
    # K = 5: J1 = {6, 6} (nothing >= 5 fits beside them), J3 = {5, 5, 5}:
    # 2 + ceil(15 / 10) = 4, while L1 = ceil(27 / 10) = 3.
    assert lower_bound([6, 6, 5, 5, 5], 10) == 3
    assert martello_toth_l2([6, 6, 5, 5, 5], 10) == 4
    # Items of 4 with capacity 10, but 7s pair with nothing >= 4: L1 = 3, L2 = 4.
    assert lower_bound([7, 7, 7, 4, 4], 10) == 3
    assert martello_toth_l2([7, 7, 7, 4, 4], 10) == 4
    assert lower_bound([1] * 9, 1) == 9 and martello_toth_l2([1] * 9, 1) == 9


def test_l2_large_sample_consistent():
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.normal(500, 120, 5000).round(), 100, 1000).astype(np.int64)
    l1, l2 = lower_bound(lengths, 1000), martello_toth_l2(lengths, 1000)
    assert l1 <= l2 <= first_fit_decreasing(lengths, 1000).max() + 1


# ---------------------------------------------------------------------------
# Refinement
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=40, deadline=None)
@given(inst=instances(max_capacity=80, max_items=120), seed=st.integers(0, 100))
def test_refine_invariants(algorithm, inst, seed):
    lengths, capacity = inst
    base = plan_packs(lengths, capacity, algorithm, seed=seed)
    refined = refine_plan(lengths, base)
    validate_plan(refined, lengths, capacity)
    assert martello_toth_l2(lengths, capacity) <= refined.num_packs <= base.num_packs
    assert refined.algorithm == f"{algorithm}+refine"
    assert refined.refine_seconds is not None and refined.refine_seconds >= 0
    again = refine_plan(lengths, base)
    npt.assert_array_equal(again.pack_of_item, refined.pack_of_item)
    npt.assert_array_equal(again.order, refined.order)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(2, 300), data=st.data())
def test_exact_fill_rebuild_matches_reference(capacity, data):
    # The compiled pass finds pairs 64 candidate sizes at a time through a mirrored bitset;
    # the reference scans every size. Few distinct sizes (pairs often missing) and many
    # (long scans, sizes on both sides of 64-bit word edges) are both drawn.
    from packer_cli.plan._refine_kernels import _rebuild

    distinct = data.draw(st.lists(st.integers(1, capacity), min_size=1, max_size=40, unique=True))
    lengths = np.array(data.draw(st.lists(st.sampled_from(distinct), min_size=1, max_size=150)), np.int64)
    pool = np.array(sorted(data.draw(st.sets(st.integers(0, lengths.size - 1), min_size=1))), np.int32)
    threshold = data.draw(st.integers(1, capacity))
    max_triples = data.draw(st.sampled_from([0, 1, 3, 4, 64]))
    balanced = data.draw(st.booleans())
    sequence, ends, num = _rebuild(lengths, pool, capacity, threshold, max_triples, balanced)
    got = [sequence[ends[q]:ends[q + 1]].tolist() for q in range(num)]
    assert got == naive.exact_fill_rebuild(lengths, pool, capacity, threshold, max_triples, balanced=balanced)


@pytest.mark.parametrize("capacity", [64, 127, 128, 1024, 4096])
def test_exact_fill_rebuild_matches_reference_dense(capacity):
    # Every size present (the case the mirrored bitset is for), with pairs and triples needed.
    from packer_cli.plan._refine_kernels import _rebuild

    rng = np.random.default_rng(capacity)
    lengths = rng.integers(1, capacity // 2 + 1, 600 if capacity > 1000 else 300).astype(np.int64)
    pool = np.arange(lengths.size, dtype=np.int32)
    # (2, 4): the first round's wide setting; balanced ones: every round's last two
    for divisor, triples, balanced in ((64, 64, False), (8, 64, False), (4, 64, False), (2, 4, False),
                                       (8, 4, True), (16, 4, True)):
        sequence, ends, num = _rebuild(lengths, pool, capacity, max(1, capacity // divisor), triples, balanced)
        got = [sequence[ends[q]:ends[q + 1]].tolist() for q in range(num)]
        assert got == naive.exact_fill_rebuild(lengths, pool, capacity, max(1, capacity // divisor), triples,
                                               balanced=balanced)


@pytest.mark.parametrize("n, seed", [(20000, 2), (30000, 7)])
def test_refine_threads_change_nothing(monkeypatch, n, seed):
    # Large pools try two thresholds at a time on two threads; the plan must be the one the
    # sequential loop makes. The first input reaches the bound with its first rebuild (the
    # second, already running, is dropped); the second looks ahead from its first rebuild and
    # reaches the bound with its second round's third.
    from packer_cli.plan import refine as R

    capacity = 1024
    lengths = np.clip(np.random.default_rng(seed).gamma(5, 20, n).round(), 10, capacity).astype(np.int64)
    base = plan_packs(lengths, capacity, "ffd")
    monkeypatch.setattr(R, "_PARALLEL_POOL", 10**12)
    sequential = refine_plan(lengths, base)
    monkeypatch.setattr(R, "_PARALLEL_POOL", 0)
    threaded = refine_plan(lengths, base)
    npt.assert_array_equal(threaded.order, sequential.order)
    npt.assert_array_equal(threaded.pack_offsets, sequential.pack_offsets)
    assert threaded.num_packs < base.num_packs
    # Every threshold's rebuild comes back, in order, the same on both paths.
    pool = np.arange(lengths.size, dtype=np.int32)
    together = list(R._rebuilds(lengths, pool, capacity))
    monkeypatch.setattr(R, "_PARALLEL_POOL", 10**12)
    alone = list(R._rebuilds(lengths, pool, capacity))
    assert len(together) == len(alone) == len(R._THRESHOLD_DIVISORS) + len(R._BALANCED_DIVISORS)
    for (s1, e1, n1), (s2, e2, n2) in zip(together, alone):
        assert n1 == n2
        npt.assert_array_equal(s1, s2)
        npt.assert_array_equal(e1[: n1 + 1], e2[: n2 + 1])


@pytest.mark.parametrize("n, seed", [(60000, 3), (100000, 1)])
def test_refine_look_ahead_skips_rebuilds_and_loses_nothing(monkeypatch, n, seed):
    # Looking ahead from a first-round rebuild that leaves few items in non-full packs may
    # end the first round early at the bound; the packing must never have more packs than
    # the plain rounds make (best of every threshold, then later rounds on that one).
    from packer_cli.plan import refine as R
    from packer_cli.plan._refine_kernels import _collect

    capacity = 1024
    lengths = np.clip(np.random.default_rng(seed).gamma(5, 20, n).round(), 10, capacity).astype(np.int64)
    base = plan_packs(lengths, capacity, "ffd")
    nonfull = base.pack_load < capacity
    pool = np.sort(_collect(base.order, base.pack_offsets, np.flatnonzero(nonfull)))
    bound = martello_toth_l2(lengths, capacity) - int((~nonfull).sum())
    pools = []
    real_rebuild = R._rebuild_sorted
    monkeypatch.setattr(R, "_rebuild_sorted", lambda items, *a: pools.append(items.size) or real_rebuild(items, *a))
    packs, first_round = {}, {}
    for look_ahead in (False, True):
        for goal in (0, bound):  # 0: never reached, every threshold is tried
            pools.clear()
            sequence, ends = R._repack(lengths, pool, int(nonfull.sum()), capacity, goal, 4, look_ahead=look_ahead)
            npt.assert_array_equal(np.sort(sequence), pool)
            assert ends[0] == 0 and ends[-1] == pool.size and (np.diff(ends) > 0).all()
            assert (np.add.reduceat(lengths[sequence], ends[:-1]) <= capacity).all()
            packs[look_ahead, goal] = ends.size - 1
            first_round[look_ahead, goal] = pools.count(pool.size)
    for goal in (0, bound):
        assert packs[True, goal] <= packs[False, goal]
    assert first_round[False, 0] == first_round[True, 0] == len(R._THRESHOLD_DIVISORS) + len(R._BALANCED_DIVISORS)
    assert packs[True, bound] == bound  # these inputs all reach the bound ...
    assert first_round[True, bound] < first_round[False, bound]  # ... with fewer first-round rebuilds


def test_refine_reaches_bound_on_small_items():
    # Many small items: FFD leaves a few tokens free in most packs; exact
    # filling closes them.
    rng = np.random.default_rng(2)
    lengths = np.clip(rng.gamma(5, 20, 20000).round(), 10, 1024).astype(np.int64)
    base = plan_packs(lengths, 1024, "ffd")
    refined = plan_packs(lengths, 1024, "ffd", refine=True)
    validate_plan(refined, lengths, 1024)
    l2 = martello_toth_l2(lengths, 1024)
    assert refined.num_packs < base.num_packs
    assert refined.num_packs <= l2 + 2
    # Full packs of the input are kept, first, in their old order.
    full = np.flatnonzero(base.pack_load == 1024)
    for new, old in enumerate(full[:50]):
        npt.assert_array_equal(refined.pack_items(new), base.pack_items(old))


def _refined_with_and_without(monkeypatch, lengths, capacity, **settings):
    """``(bound, refined, without)``: the stopping bound, and the pass's plans as it is and with
    ``settings`` (attributes of ``refine``) changed, both checked valid."""
    from packer_cli.plan import refine as R

    plans = [plan_packs(lengths, capacity, refine=True)]
    for name, value in settings.items():
        monkeypatch.setattr(R, name, value)
    plans.append(plan_packs(lengths, capacity, refine=True))
    for plan in plans:
        validate_plan(plan, lengths, capacity)
    return _best_of_lengths(lengths, capacity), *plans


def _lognormal_quarter(capacity: int, seed: int, n: int = 20000) -> np.ndarray:
    """Lengths of median C/4 (lognormal, sigma 0.5): a pack holds about four."""
    x = np.random.default_rng(seed).lognormal(np.log(capacity / 4), 0.5, n)
    return np.clip(np.rint(x), 1, capacity).astype(np.int64)


@pytest.mark.parametrize("capacity, seed", [(4096, 0), (8192, 1)])
def test_refine_wide_threshold_reaches_the_bound_on_large_items(monkeypatch, capacity, seed):
    # With a quarter of a pack kept free at most, the exact phase has to close it with items
    # of about that size, which rarely sum to it exactly: 16-19 packs stayed above the bound.
    # Half a pack (the first round's wide threshold) is closed by a pair or a triple of them.
    lengths = _lognormal_quarter(capacity, seed)
    # The balanced rebuilds close the first of these sets' gap too (and 6 of the second's 16
    # packs), so they are left out to see the wide threshold's own effect.
    bound, refined, narrow = _refined_with_and_without(
        monkeypatch, lengths, capacity, _WIDE_MEDIAN_DIVISOR=0, _BALANCED_DIVISORS=())  # 0: the median never passes
    assert refined.num_packs == bound
    assert narrow.num_packs >= bound + 10
    assert narrow.num_packs < plan_packs(lengths, capacity).num_packs  # it gains, just less


@pytest.mark.parametrize("parallel_pool", [0, 10**12])
def test_refine_wide_threshold_only_in_the_first_round_and_for_large_items(monkeypatch, parallel_pool):
    # The wide rebuild comes after the six thresholds, with its own few third-item candidates,
    # and only where it is asked for (the first round) and the pool's median is at least C/8;
    # the two balanced rebuilds come last, always. The same on one thread or two.
    from packer_cli.plan import refine as R
    from packer_cli.plan._refine_kernels import _rebuild

    monkeypatch.setattr(R, "_PARALLEL_POOL", parallel_pool)
    capacity = 4096
    large = _lognormal_quarter(capacity, 3, 3000)
    small = np.clip(np.random.default_rng(4).gamma(5, 20, 3000).round(), 10, capacity).astype(np.int64)
    pool = np.arange(3000, dtype=np.int32)
    for lengths, wide, expected in ((large, True, 9), (large, False, 8), (small, True, 8)):
        rebuilds = list(R._rebuilds(lengths, pool, capacity, wide))
        assert len(rebuilds) == expected
        balanced = [_rebuild(lengths, pool, capacity, capacity // d, R._BALANCED_TRIPLES, True)
                    for d in R._BALANCED_DIVISORS]
        for (sequence, ends, num), (want_sequence, want_ends, want_num) in zip(rebuilds[-2:], balanced):
            assert num == want_num
            npt.assert_array_equal(sequence, want_sequence)
            npt.assert_array_equal(ends[: num + 1], want_ends[: num + 1])
    sequence, ends, num = list(R._rebuilds(large, pool, capacity, True))[6]
    want_sequence, want_ends, want_num = _rebuild(large, pool, capacity, capacity // 2, R._WIDE_TRIPLES)
    assert num == want_num
    npt.assert_array_equal(sequence, want_sequence)
    npt.assert_array_equal(ends[: num + 1], want_ends[: num + 1])
    # The median decides: C/8 exactly passes, one token less does not.
    assert R._wide_pays(np.array([1, capacity // 8, capacity]), capacity)
    assert not R._wide_pays(np.array([1, capacity // 8 - 1, capacity]), capacity)
    assert not R._wide_pays(np.zeros(0, np.int32), capacity)


def _narrow_fifth(capacity: int, seed: int, n: int = 30000) -> np.ndarray:
    """Lengths spread narrowly around C/5 (normal, sd 14 % of the mean): packs of five and six."""
    x = np.random.default_rng(seed).normal(0.192 * capacity, 0.14 * 0.192 * capacity, n)
    return np.clip(np.rint(x), 1, capacity).astype(np.int64)


@pytest.mark.parametrize("capacity, seed", [(4096, 5), (2048, 6)])
def test_refine_balanced_rebuilds_close_most_of_the_gap_on_narrow_lengths(monkeypatch, capacity, seed):
    # Taking the largest items together leaves, on these lengths, about 2 % of packs holding
    # five items with room for no sixth. Items of about the mean length after the largest
    # leave the small ones to make packs of six.
    bound, refined, greedy = _refined_with_and_without(monkeypatch, _narrow_fifth(capacity, seed), capacity,
                                                       _BALANCED_DIVISORS=())
    assert greedy.num_packs - bound >= 0.01 * bound
    assert refined.num_packs - bound <= (greedy.num_packs - bound) / 2


def test_refine_hand_instance():
    # FFD (C=10): 6->P0 5,5->P1 4->P0 4,3,3->P2 3,3->P3: 4 packs; the total
    # is 36 so L1 = 4 and refine keeps 4 packs.
    lengths = [6, 5, 5, 4, 4, 3, 3, 3, 3]
    assert refine_plan(lengths, plan_packs(lengths, 10)).num_packs == 4
    # Next fit in input order wastes room; refine re-packs to the optimum (2).
    lengths = [6, 5, 4, 5]
    base = plan_packs(lengths, 10, "sequential")
    assert base.num_packs == 3
    refined = refine_plan(lengths, base)
    validate_plan(refined, lengths, 10)
    assert refined.num_packs == 2


@given(st.integers(1, 300), st.integers(1, 400), st.integers(0, 120))
@settings(max_examples=60, deadline=None)
def test_refine_of_one_length_keeps_an_optimal_plan_and_improves_another(length, capacity, n):
    """Items of one length need exactly ceil(n / floor(C / s)) packs. A plan with that many is
    kept as it is (the pass had re-packed the whole pool under every setting for nothing); one
    with more is still refined down to it."""
    length = min(length, capacity)
    lengths = np.full(n, length, np.int64)
    fewest = -(-n // (capacity // length))
    ffd = plan_packs(lengths, capacity)
    assert ffd.num_packs == fewest
    kept = refine_plan(lengths, ffd)
    validate_plan(kept, lengths, capacity)
    npt.assert_array_equal(kept.order, ffd.order)
    npt.assert_array_equal(kept.pack_offsets, ffd.pack_offsets)
    alone = _hand_plan(np.arange(n), np.arange(n + 1), np.full(n, length), num_items=n, capacity=capacity)
    refined = refine_plan(lengths, alone)  # one item a pack: room to gain wherever two fit
    validate_plan(refined, lengths, capacity)
    assert refined.num_packs == fewest


def test_refine_of_one_length_with_empty_items_skipped():
    """Empty items are never packed, so they do not make a pool of one length a mixed one:
    an optimal plan is kept, one with a pack to spare is still refined."""
    lengths = np.array([0, 4, 4, 0, 4, 4, 4, 0], np.int64)
    assert _one_packed_length(lengths) == 4  # the check made before any pool is gathered
    assert _one_packed_length(np.array([0, 4, 5])) == 0 and _one_packed_length(np.zeros(3, np.int64)) == 0
    ffd = plan_packs(lengths, 10, skip_empty=True)
    assert ffd.num_packs == 3
    kept = refine_plan(lengths, ffd)
    npt.assert_array_equal(kept.order, ffd.order)
    npt.assert_array_equal(kept.pack_offsets, ffd.pack_offsets)
    packed = np.flatnonzero(lengths)
    alone = _hand_plan(packed, np.arange(packed.size + 1), np.full(packed.size, 4), num_items=lengths.size,
                       capacity=10)
    refined = refine_plan(lengths, alone)
    validate_plan(refined, lengths, 10, skip_empty=True)
    assert refined.num_packs == 3


def test_refine_errors_and_empty():
    assert refine_plan([], plan_packs([], 8)).num_packs == 0
    with pytest.raises(ValueError, match="covers 2 items"):
        refine_plan([1, 2, 3], plan_packs([1, 2], 8))


def _hand_plan(order, offsets, load, num_items=6, capacity=10):
    return PackPlan(order=np.asarray(order, np.int32), pack_offsets=np.asarray(offsets, np.int64),
                    pack_load=np.asarray(load, np.int32), num_items=num_items, capacity=capacity)


# A layout the compiled kernels would have indexed with unchecked: offsets running past order
# (read past its end: a hang, heap corruption or a segfault by how far), a negative index
# (wrapped by NumPy in the load check, then listed in the refined plan with an item lost),
# duplicates (returned as they were), an empty pack, a load above the capacity.
BAD_PLANS = [
    (_hand_plan(range(6), [0, 1, 2, 30_000_000], [3, 3, 12]), "pack_offsets are inconsistent"),
    (_hand_plan(range(6), [0, 4, 2, 6], [12, -6, 12]), "pack_offsets are inconsistent"),
    (_hand_plan([0, 1, 2, 3, 4, -1], [0, 2, 4, 6], [6, 6, 6]), "order is not a permutation"),
    (_hand_plan([0, 0, 1, 1, 2, 2], [0, 2, 4, 6], [6, 6, 6]), "order is not a permutation"),
    (_hand_plan([0, 1, 2, 3, 4, 6], [0, 2, 4, 6], [6, 6, 6]), "order is not a permutation"),
    (_hand_plan(range(6), [0, 2, 2, 6], [6, 0, 12]), "pack 1 is empty"),
    # two empty packs: the message names the first
    (_hand_plan(range(6), [0, 2, 2, 4, 4, 6], [6, 0, 6, 0, 6]), "pack 1 is empty"),
    # offsets of two packs, loads of one
    (_hand_plan(range(6), [0, 3, 6], [18], capacity=20), "pack_offsets are inconsistent"),
    (_hand_plan(range(6), [0, 4, 6], [12, 6]), "pack 0 holds 12 tokens, above capacity 10"),
]


@pytest.mark.parametrize("plan, message", BAD_PLANS)
def test_refine_and_validate_refuse_a_hand_made_plan_they_cannot_trust(plan, message):
    lengths = [3] * 6
    with pytest.raises(ValueError, match=message):
        validate_plan(plan, lengths)
    with pytest.raises(ValueError, match=message):
        refine_plan(lengths, plan)


def test_a_plan_listing_an_item_twice_or_stating_other_loads_is_refused():
    """Two layouts the table above leaves out: an item listed twice in an order longer than the
    items (every index in range, every pack within capacity), and loads that are not the packs'
    sums (a plan made for other lengths)."""
    twice = _hand_plan([0, 0, 1], [0, 1, 3], [3, 5], num_items=2)
    with pytest.raises(ValueError, match="plan does not cover every item"):
        validate_plan(twice, [3, 2])
    with pytest.raises(ValueError, match="order is not a permutation of the items"):
        refine_plan([3, 2], twice)
    made = plan_packs([5, 4, 3], 8)
    lower = _hand_plan(made.order, made.pack_offsets, np.asarray(made.pack_load) - 1, num_items=3, capacity=8)
    with pytest.raises(ValueError, match="pack_load does not match the item lengths"):
        validate_plan(lower, [5, 4, 3])
    with pytest.raises(ValueError, match="the plan's pack loads are not the sums of these lengths"):
        refine_plan([5, 4, 3], lower)


def test_refine_finds_the_fewest_packs_of_one_length_from_one_pack_too_many():
    """Six items of 3 at C = 10 fit three a pack: a plan of three packs of two is refined to two
    (the test of whether a plan of one length is already optimal is exact, not one pack loose)."""
    lengths = [3] * 6
    three = _hand_plan(range(6), [0, 2, 4, 6], [6, 6, 6])
    refined = refine_plan(lengths, three)
    validate_plan(refined, lengths, 10)
    assert refined.num_packs == 2 and sorted(refined.pack_load.tolist()) == [9, 9]


def test_pack_of_item_refuses_an_index_outside_the_items():
    """It wrote ``out[order[k]]`` unchecked: an index of 2 among 2 items wrote past the array."""
    for order, offsets in (([0, 2], [0, 2]), ([0, 2_000_000_000], [0, 2]), ([0, 1], [0, 5])):
        plan = _hand_plan(order, offsets, [5], num_items=2)
        with pytest.raises(ValueError, match="out of range|pack_offsets are inconsistent"):
            plan.pack_of_item


def test_a_hand_made_plan_of_lists_or_other_integer_dtypes_works_as_arrays():
    lengths = [3, 2, 2]
    want = refine_plan(lengths, _hand_plan([0, 2, 1], [0, 2, 3], [5, 2], num_items=3, capacity=8))
    # byte-swapped and unsigned arrays too: refine_plan handed a big-endian order to the kernels
    # (a numba TypingError), and uint64 offsets failed in NumPy's casting rules
    swapped = [np.array([0, 2, 1], ">i4"), np.array([0, 2, 1], ">i8"), np.array([0, 2, 1], ">u4")]
    for order in ([0, 2, 1], (0, 2, 1), np.array([0, 2, 1], np.uint64), np.array([0, 2, 1], np.int16), *swapped):
        for offsets in ([0, 2, 3], np.array([0, 2, 3], np.uint64), np.array([0, 2, 3], ">i8")):
            plan = PackPlan(order=order, pack_offsets=offsets, pack_load=np.array([5, 2], ">i4"), num_items=3,
                            capacity=8)
            npt.assert_array_equal(plan.pack_of_item, [0, 1, 0])
            validate_plan(plan, lengths)
            got = refine_plan(lengths, plan)
            npt.assert_array_equal(got.order, want.order)
            npt.assert_array_equal(got.pack_offsets, want.pack_offsets)
    empty = PackPlan(order=[], pack_offsets=[0], pack_load=[], num_items=0, capacity=8)  # [] is float64 to NumPy
    validate_plan(empty, [])
    assert refine_plan([], empty).num_packs == 0


@pytest.mark.parametrize("fields, error, message", [
    ({"order": [0.0, 2.0, 1.0]}, TypeError, "order must hold integers, got dtype float64"),
    ({"order": [[0, 2, 1]]}, ValueError, r"order must be a 1-D array, got shape \(1, 3\)"),
    ({"pack_load": None}, TypeError, "pack_load must be a 1-D array of integers, got NoneType"),
    ({"pack_offsets": np.array([0, 2, 2**64 - 1], np.uint64)}, ValueError, "pack_offsets holds 18446744073709551615"),
    ({"num_items": "3"}, TypeError, "num_items must be an integer, got str"),
    ({"num_items": -1}, ValueError, "num_items must be >= 0"),
    ({"num_items": True}, TypeError, "num_items must be an integer, got bool"),
    ({"capacity": 8.0}, TypeError, "capacity must be an integer, got float"),
    ({"capacity": np.bool_(True)}, TypeError, "capacity must be an integer, got bool"),
    ({"capacity": -8}, ValueError, "capacity must be >= 0"),
])
def test_a_hand_made_plan_that_is_no_plan_is_refused_by_name(fields, error, message):
    """It was taken, and failed later as an IndexError, a NumPy casting error, or a message
    contradicting itself ('covers 4 items but 4 lengths were given' for num_items='4')."""
    plan = {"order": [0, 2, 1], "pack_offsets": [0, 2, 3], "pack_load": [5, 2], "num_items": 3, "capacity": 8}
    with pytest.raises(error, match=message):
        PackPlan(**{**plan, **fields})


@pytest.mark.parametrize("capacity, dtype", [(4096, np.uint32), (4096, np.uint16), (255, np.uint8),
                                             (2**24, np.int32)])
def test_a_hand_made_plan_with_a_numpy_integer_capacity_refines_as_with_an_int(capacity, dtype):
    """The refine pass's arithmetic on a NumPy capacity wrapped at its width: an OverflowError
    (uint32, uint16, int32 at 2**24) or a broadcast error (uint8) instead of a plan."""
    lengths = np.random.default_rng(3).integers(1, capacity // 3, 2000)
    plan = plan_packs(lengths, capacity, "ffd")
    hand = PackPlan(order=plan.order, pack_offsets=plan.pack_offsets, pack_load=plan.pack_load,
                    num_items=np.int64(plan.num_items), capacity=dtype(capacity))
    assert type(hand.capacity) is int and type(hand.num_items) is int
    want, got = refine_plan(lengths, plan), refine_plan(lengths, hand)
    validate_plan(got, lengths)
    assert got.num_packs == want.num_packs
    npt.assert_array_equal(got.order, want.order)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=30), st.integers(0, 2**32 - 1), st.data())
def test_a_damaged_plan_is_refused_or_still_sound(lengths, seed, data):
    """Any one entry of a good plan's order or offsets changed: refine_plan either refuses it
    or (the change kept it sound) returns a plan validate_plan accepts."""
    plan = plan_packs(lengths, 10, "ffd")
    rng = np.random.default_rng(seed)
    order, offsets = plan.order.copy(), plan.pack_offsets.copy()
    target = data.draw(st.sampled_from(["order", "offsets"]))
    values = order if target == "order" else offsets
    values[rng.integers(values.size)] = data.draw(st.integers(-3, len(lengths) + 3))
    damaged = PackPlan(order=order, pack_offsets=offsets, pack_load=plan.pack_load, num_items=plan.num_items,
                       capacity=10)
    try:
        refined = refine_plan(lengths, damaged)
    except ValueError:
        return
    validate_plan(damaged, lengths)
    validate_plan(refined, lengths)


# ---------------------------------------------------------------------------
# Internal structures
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("nbits", [1, 63, 64, 65, 4097, 70000])
def test_bitset_matches_set(nbits):
    from packer_cli.plan import _kernels as K

    rng = np.random.default_rng(nbits)
    offsets = K._bitset_layout(nbits)
    bits = np.zeros(offsets[-1], np.uint64)
    ref = set()
    for _ in range(400):
        v = int(rng.integers(0, nbits))
        if rng.random() < 0.6:
            K._bitset_set(bits, offsets, v)
            ref.add(v)
        else:
            K._bitset_clear(bits, offsets, v)
            ref.discard(v)
        q = int(rng.integers(0, nbits))
        assert K._bitset_next(bits, offsets, q) == min((a for a in ref if a >= q), default=-1)
        assert K._bitset_prev(bits, offsets, q) == max((a for a in ref if a <= q), default=-1)


def test_plan_packs_refine_flag():
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 300, 3000)
    direct = refine_plan(lengths, plan_packs(lengths, 512, "bfd"))
    flagged = plan_packs(lengths, 512, "bfd", refine=True)
    npt.assert_array_equal(direct.pack_of_item, flagged.pack_of_item)
    npt.assert_array_equal(direct.order, flagged.order)
    assert flagged.algorithm == "bfd+refine"
    assert plan_packs([], 8, refine=True).algorithm == "ffd+refine"


@pytest.mark.parametrize("algorithm_any", ALGORITHMS)
@settings(max_examples=40, deadline=None)
@given(inst=instances(), data=st.data())
def test_skip_empty_plans_the_rest_as_if_alone(algorithm_any, inst, data):
    """Empty items are left out and the others are planned exactly as without them."""
    lengths, capacity = inst
    holes = data.draw(st.lists(st.integers(0, lengths.size), max_size=8))
    with_empty = np.insert(lengths, sorted(holes), 0)
    kept = np.flatnonzero(with_empty)
    plan = plan_packs(with_empty, capacity, algorithm_any, seed=5, skip_empty=True, refine=True)
    alone = plan_packs(lengths, capacity, algorithm_any, seed=5, refine=True)
    validate_plan(plan, with_empty, capacity, skip_empty=True)
    npt.assert_array_equal(plan.order, kept[alone.order])
    npt.assert_array_equal(plan.pack_offsets, alone.pack_offsets)
    assert (plan.pack_of_item[with_empty == 0] == -1).all()
    with pytest.raises(ValueError, match="below 1"):
        plan_packs(with_empty if holes else np.append(lengths, 0), capacity, algorithm_any)


def test_refine_at_a_large_capacity_stays_valid_with_its_bounded_pair_search():
    # Beyond C = 2**15 a pair search looks at the 16,384 sizes nearest to balance, not all C/2.
    from packer_cli.plan._refine_kernels import PAIR_WORDS

    capacity = 1 << 20
    assert capacity // 2 // 64 > PAIR_WORDS
    lengths = np.random.default_rng(4).integers(1, capacity // 3, 3000).astype(np.int64)
    base = plan_packs(lengths, capacity, "ffd")
    refined = refine_plan(lengths, base)
    validate_plan(refined, lengths, capacity)
    assert martello_toth_l2(lengths, capacity) <= refined.num_packs <= base.num_packs


@pytest.mark.parametrize("capacity, seed", [((1 << 20) + 5, 0), (1 << 22, 1)])
def test_exact_fill_rebuild_matches_reference_at_a_huge_capacity(capacity, seed):
    # Far fewer items than sizes: the pool is sorted by comparison, not by a table of C sizes,
    # and a pair search jumps over empty words and stops after PAIR_WORDS of them. Each
    # ``capacity - room`` item leaves a room that a (small, room - small) pair closes exactly,
    # but that pair lies outside the window, so the bound changes which items close it.
    from packer_cli.plan._refine_kernels import PAIR_WORDS, _rebuild

    rng = np.random.default_rng(seed)
    room = rng.integers(capacity // 24, capacity // 9, 40)
    small = rng.integers(1, 3_000, 40)
    near_half = capacity // 2 - rng.integers(0, 40_000, 60)
    lengths = np.concatenate([capacity - room, small, room - small, rng.integers(1, capacity // 3, 100),
                              near_half, capacity - near_half]).astype(np.int64)
    pool = np.sort(rng.choice(lengths.size, 260, replace=False)).astype(np.int32)
    assert capacity > 32 * pool.size and capacity // 2 // 64 > PAIR_WORDS
    _assert_sorted_pool(lengths, pool, capacity)
    threshold = capacity // 8
    want = naive.exact_fill_rebuild(lengths, pool, capacity, threshold, 64, PAIR_WORDS)
    assert want != naive.exact_fill_rebuild(lengths, pool, capacity, threshold, 64)  # the bound matters
    for divisor in (8, 64):
        sequence, ends, num = _rebuild(lengths, pool, capacity, capacity // divisor, 64)
        got = [sequence[ends[q]:ends[q + 1]].tolist() for q in range(num)]
        assert got == naive.exact_fill_rebuild(lengths, pool, capacity, capacity // divisor, 64, PAIR_WORDS)


def _assert_sorted_pool(lengths, pool, capacity):
    from packer_cli.plan._refine_kernels import _sort_pool

    items, sizes = _sort_pool(lengths, pool, capacity)
    npt.assert_array_equal(items, pool[np.argsort(lengths[pool], kind="stable")])
    npt.assert_array_equal(sizes, lengths[items])


@pytest.mark.parametrize("capacity", [60, 10**6])
def test_pool_sorted_by_size_either_way(capacity):
    # A counting sort while C is at most 32x the pool, a stable comparison sort beyond: the same
    # order, pool order within a size.
    lengths = np.random.default_rng(capacity).integers(1, 61, 400).astype(np.int64)
    pool = np.sort(np.random.default_rng(1).choice(400, 100, replace=False)).astype(np.int32)
    _assert_sorted_pool(lengths, pool, capacity)


def test_plan_arguments_of_the_wrong_kind_are_refused_not_taken_for_something_else():
    """refine="no" is truthy and refined; pack_items(-1) read offsets[-1]..offsets[0], an empty
    pack, silently; validate_plan(dict) failed as an AttributeError where refine_plan names it."""
    lengths = np.array([5, 3, 3, 2, 7])
    for flag in ("no", 1, None):
        with pytest.raises(ValueError, match="refine must be True or False"):
            plan_packs(lengths, 8, refine=flag)
    plan = plan_packs(lengths, 8, refine=np.bool_(True))
    assert [sorted(plan.pack_items(q).tolist()) for q in range(plan.num_packs)] == [[4], [0, 1], [2, 3]]
    for pack in (-1, plan.num_packs):
        with pytest.raises(IndexError, match=f"pack {pack} out of range for 3 packs"):
            plan.pack_items(pack)
    with pytest.raises(TypeError, match="plan must be a PackPlan, got dict"):
        validate_plan({"order": plan.order}, lengths)


@given(st.lists(st.integers(0, 3000), max_size=40), st.integers(0, 3), st.integers(3001, 5000))
@settings(max_examples=60, deadline=None)
def test_length_histogram_counts_every_chunk_up_to_its_own_largest_value(values, copies, size):
    """The planner's histogram counts a million values at a time, each chunk only up to its own
    largest value; the sum must be NumPy's whole-array bincount."""
    from packer_cli.plan.bounds import histogram

    big = np.concatenate([np.full((1 << 20) * copies, 7, np.int32), np.asarray(values, np.int32)])
    npt.assert_array_equal(histogram(big, size), np.bincount(big, minlength=size))


def test_refine_max_rounds_zero_keeps_the_plan_and_one_rebuilds_only_the_first_pool(monkeypatch):
    """``max_rounds`` bounds the rounds: 0 runs none (the plan comes back as it was), 1 only the
    first (every rebuild is of the whole pool of non-full packs, none of a later round's smaller
    pool), while these lengths get later rounds, and fewer packs, when they are allowed."""
    from packer_cli.plan import refine as R

    capacity = 2048
    lengths = _narrow_fifth(capacity, 0, 2000)
    base = plan_packs(lengths, capacity)
    first_pool = int(np.diff(base.pack_offsets)[base.pack_load < capacity].sum())
    pools = []
    real_rebuild = R._rebuild_sorted
    monkeypatch.setattr(R, "_rebuild_sorted", lambda items, *a: pools.append(items.size) or real_rebuild(items, *a))
    plans = {}
    for rounds in (0, 1, 2):
        pools.clear()
        plans[rounds] = refine_plan(lengths, base, max_rounds=rounds)
        validate_plan(plans[rounds], lengths, capacity)
        if rounds == 0:
            assert pools == []
        elif rounds == 1:
            assert pools and set(pools) == {first_pool}
        else:
            assert any(size < first_pool for size in pools)
    npt.assert_array_equal(plans[0].order, base.order)
    npt.assert_array_equal(plans[0].pack_offsets, base.pack_offsets)
    assert plans[0].algorithm == "ffd+refine"
    assert plans[2].num_packs < plans[1].num_packs < base.num_packs


def test_refine_returns_a_plan_it_cannot_improve_as_it_was():
    """The pass keeps a re-packing only when it has fewer packs: a first-fit-decreasing plan that
    stays at its number of packs comes back with its order and packs unchanged, not re-shuffled
    into as many packs."""
    rng = np.random.default_rng(0)
    unchanged = 0
    for _ in range(300):
        lengths = rng.integers(20, 60, int(rng.integers(5, 40)))
        base = plan_packs(lengths, 100)
        refined = refine_plan(lengths, base)
        validate_plan(refined, lengths, 100)
        if refined.num_packs == base.num_packs:
            unchanged += 1
            npt.assert_array_equal(refined.order, base.order)
            npt.assert_array_equal(refined.pack_offsets, base.pack_offsets)
    assert unchanged > 0


def test_refine_merges_two_non_full_packs_and_keeps_full_ones_of_one_length():
    """Two non-full packs are enough to gain from (two items alone that fit one pack), and a
    plan of one length is judged optimal on its non-full packs only: full packs beside two
    half-full ones still leave a pack to gain."""
    merged = refine_plan([6, 4], _hand_plan([0, 1], [0, 1, 2], [6, 4], num_items=2))
    validate_plan(merged, [6, 4], 10)
    assert merged.num_packs == 1
    lengths = [5] * 6
    refined = refine_plan(lengths, _hand_plan(range(6), [0, 2, 4, 5, 6], [10, 10, 5, 5]))
    validate_plan(refined, lengths, 10)
    assert refined.num_packs == 3 and refined.pack_load.tolist() == [10, 10, 10]


def test_refine_fewer_keeps_the_packing_with_fewer_packs_the_first_on_a_tie():
    """The look-ahead keeps the best packing of several later-round results: the one with fewer
    packs, the one found first when they tie (so the result does not depend on more than the
    order of the settings)."""
    from packer_cli.plan.refine import _fewer

    seq = np.arange(6, dtype=np.int32)
    two, three = (seq, np.array([0, 3, 6])), (seq, np.array([0, 2, 4, 6]))
    other_two = (seq[::-1].copy(), np.array([0, 3, 6]))
    assert _fewer(None, three) is three
    assert _fewer(three, two) is two and _fewer(two, three) is two
    assert _fewer(two, other_two) is two


def test_exact_fill_rebuild_tries_third_items_from_two_below_the_room():
    # A third item of room - 1 leaves 1 for a pair, which no pair sums to: the candidates start
    # at room - 2, so a single try (the wide and balanced settings allow four) closes the room
    # 9 left by 11 with 3 + 3 + 3 even though an 8 is there.
    from packer_cli.plan._refine_kernels import _rebuild

    lengths = np.array([11, 8, 3, 3, 3], np.int64)
    pool = np.arange(lengths.size, dtype=np.int32)
    sequence, ends, num = _rebuild(lengths, pool, 20, 9, 1, False)
    got = [sequence[ends[q]:ends[q + 1]].tolist() for q in range(num)]
    assert got == naive.exact_fill_rebuild(lengths, pool, 20, 9, 1) == [[0, 2, 3, 4], [1]]


@pytest.mark.parametrize(
    "func", [first_fit_decreasing, best_fit_decreasing, next_fit, lower_bound, martello_toth_l2]
)
def test_validation_names_the_first_length_below_one_and_the_value_it_holds(func):
    """Several lengths below 1: the message names the first of them (the docstring's "first
    offending index") with its own value, not the last one or the smallest length."""
    with pytest.raises(ValueError, match=r"^lengths\[1\] = -1 is below 1"):
        func([5, -1, 3, -7, 0], 10)
    with pytest.raises(ValueError, match=r"^lengths\[2\] = 0 is below 1"):
        func([5, 4, 0, -9], 10)


def test_validation_with_skip_empty_names_the_first_negative_length():
    with pytest.raises(ValueError, match=r"^lengths\[1\] = -1 is below 0"):
        plan_packs([5, -1, 0, -7], 10, skip_empty=True)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_int32_lengths_are_left_untouched_and_planned_as_int64_ones(algorithm):
    """int32 lengths are used as they are (no copy): no algorithm may sort or shuffle them in
    place, which would change the caller's array and plan other lengths than were given."""
    lengths = np.random.default_rng(8).integers(1, 100, 500).astype(np.int32)
    kept = lengths.copy()
    plan = plan_packs(lengths, 100, algorithm, seed=3)
    npt.assert_array_equal(lengths, kept)
    validate_plan(plan, kept, 100)
    want = plan_packs(kept.astype(np.int64), 100, algorithm, seed=3)
    npt.assert_array_equal(plan.order, want.order)
    npt.assert_array_equal(plan.pack_offsets, want.pack_offsets)


def test_bridge_first_fit_shuffle_leaves_int32_lengths_untouched():
    lengths = np.random.default_rng(9).integers(1, 40, 300).astype(np.int32)
    kept = lengths.copy()
    pack, order = bridge_first_fit_shuffle(lengths, 40, 11)
    npt.assert_array_equal(lengths, kept)
    want_pack, want_order = naive.bridge_first_fit_shuffle(kept, 40, 11)
    npt.assert_array_equal(pack, want_pack)
    npt.assert_array_equal(order, want_order)


def test_bridge_first_fit_shuffle_returns_int32_arrays_for_no_items_too():
    for lengths in ([], np.zeros(0, np.int32), [4, 2]):
        pack, order = bridge_first_fit_shuffle(lengths, 10, 3)
        assert pack.dtype == np.int32 and order.dtype == np.int32


@pytest.mark.parametrize("capacity, n", [(100, 300), (1000, 1500)])
def test_ffd_opening_more_packs_than_its_first_tree_holds_matches_naive(monkeypatch, capacity, n):
    """Items just over half a pack go one to a pack, about twice ceil(sum / C), which the FFD
    search tree is first sized from: the planner must retry with a larger tree (the tree search
    at its last leaf and the retry are otherwise never run)."""
    from packer_cli.plan import _kernels as K

    calls = []
    ffd = K._ffd_positions
    monkeypatch.setattr(K, "_ffd_positions", lambda *args: calls.append(1) or ffd(*args))
    rng = np.random.default_rng(n)
    lengths = np.concatenate([np.full(n, capacity // 2 + 1), rng.integers(1, 3, n // 10)])  # a few 1s and 2s
    lengths = rng.permutation(lengths)
    want = naive.first_fit_decreasing(lengths, capacity)
    npt.assert_array_equal(first_fit_decreasing(lengths, capacity), want)
    assert len(calls) > 1  # the first tree was too small
    plan = plan_packs(lengths, capacity, "ffd")
    validate_plan(plan, lengths, capacity)
    npt.assert_array_equal(plan.pack_of_item, want)


@pytest.mark.parametrize("size", [1, 2, 8, 16])
def test_tree_search_matches_a_scan_of_the_leaves_from_any_start(size):
    """The FFD tree search, against a plain scan of the leaves, for every start leaf up to and
    including ``size`` (past the last leaf: nothing found). It runs as plain Python, where NumPy
    checks every read: compiled code has no bounds checks, so a search that read past the tree
    there would return whatever lies beyond it, and only sometimes a wrong pack."""
    from packer_cli.plan import _kernels as K

    search = K._tree_find_first.py_func
    rng = np.random.default_rng(size)
    for _ in range(20):
        tree = np.zeros(2 * size, np.int32)
        for leaf, value in enumerate(rng.integers(0, 10, size)):
            K._tree_set.py_func(tree, size, leaf, value)
        leaves = tree[size:]
        for lo in range(size + 1):
            for need in range(0, 11):
                fits = np.flatnonzero(leaves[lo:] >= need)
                want = lo + int(fits[0]) if fits.size else -1
                assert search(tree, size, lo, need) == want, (leaves.tolist(), lo, need)


def test_validate_plan_names_the_pack_above_the_capacity():
    lengths = [5, 5, 9]
    plan = plan_packs(lengths, 10, "ffd")
    assert plan.pack_load.tolist() == [9, 10]  # 9 alone, then 5 + 5
    with pytest.raises(ValueError, match=r"pack 1 holds 10 tokens, above capacity 9"):
        validate_plan(plan, lengths, 9)


def test_validate_plan_refuses_a_plan_of_another_number_of_items():
    """A plan that says it covers 4 items, checked against 3 lengths, is no plan of them (its
    pack_of_item has 4 entries), though its order and packs fit the 3."""
    good = plan_packs([3, 3, 3], 10)
    more = PackPlan(order=good.order, pack_offsets=good.pack_offsets, pack_load=good.pack_load, num_items=4,
                    capacity=10)
    with pytest.raises(ValueError, match="plan does not cover every item"):
        validate_plan(more, [3, 3, 3])


@pytest.mark.parametrize("capacity", range(3, 42, 2))
def test_l2_counts_items_of_half_an_odd_capacity_rounded_up_as_big(capacity):
    """At an odd C an item of (C + 1) / 2 is over half a pack: three of them need three packs,
    where their sum alone says two."""
    big = (capacity + 1) // 2
    for lengths in ([big] * 3, [big] * 5 + [1] * 3, [big, big, big - 1, big - 1]):
        assert martello_toth_l2(lengths, capacity) == naive.martello_toth_l2(lengths, capacity)
    assert martello_toth_l2([big] * 3, capacity) == 3


def test_validate_plan_refuses_an_explicit_capacity_of_zero():
    """capacity=None means the plan's own; 0 is a capacity given, and out of range."""
    plan = plan_packs([3, 4], 10)
    validate_plan(plan, [3, 4])
    with pytest.raises(ValueError, match="capacity = 0 must be >= 1"):
        validate_plan(plan, [3, 4], 0)

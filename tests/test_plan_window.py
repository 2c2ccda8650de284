"""``plan_packs(window=...)``: FFD/BFD planned window by window (``pack --window``), against the
linear-scan references of ``naive.py`` run on each window. Needs no torch."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import naive
from packer_cli.plan import plan_packs, validate_plan

SLOW = {"ffd": naive.first_fit_decreasing, "bfd": naive.best_fit_decreasing}


def windowed_reference(lengths, capacity, algorithm, starts):
    """(order, offsets): each window planned by the slow scan over its non-empty items, its
    packs numbered after the earlier windows' packs, items in placement order within a pack."""
    order, offsets = [], [0]
    ends = list(starts[1:]) + [len(lengths)]
    for a, b in zip(starts, ends):
        kept = [i for i in range(a, b) if lengths[i] > 0]
        if not kept:
            continue
        sub = [lengths[i] for i in kept]
        pack_of = SLOW[algorithm](sub, capacity)
        placement = naive._decreasing(sub)
        sub_order, sub_offsets = naive.pack_layout(pack_of, placement)
        order += [kept[j] for j in sub_order]
        offsets += [offsets[-1] + int(x) for x in sub_offsets[1:]]
    return order, offsets


@st.composite
def windowed_instances(draw):
    capacity = draw(st.integers(1, 40))
    lengths = draw(st.lists(st.integers(0, capacity), min_size=1, max_size=90))
    if not any(lengths):
        lengths[0] = 1
    n = len(lengths)
    if draw(st.booleans()):
        window = draw(st.integers(1, n + 3))
        starts = list(range(0, n, window))
        return lengths, capacity, {"window": window}, starts
    cuts = draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=6, unique=True)) if n > 1 else []
    starts = [0] + sorted(cuts)
    return lengths, capacity, {"window_starts": np.array(starts)}, starts


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
@settings(max_examples=150, deadline=None)
@given(inst=windowed_instances())
def test_a_windowed_plan_is_each_window_planned_on_its_own_in_window_order(algorithm, inst):
    lengths, capacity, kwargs, starts = inst
    arr = np.array(lengths, dtype=np.int32)
    plan = plan_packs(arr, capacity, algorithm, skip_empty=True, **kwargs)
    validate_plan(plan, arr, skip_empty=True)
    order, offsets = windowed_reference(lengths, capacity, algorithm, starts)
    assert plan.order.tolist() == order
    assert plan.pack_offsets.tolist() == offsets
    window_of = np.searchsorted(np.array(starts), np.arange(len(lengths)), side="right") - 1
    pack_windows = [set(window_of[plan.pack_items(p)].tolist()) for p in range(plan.num_packs)]
    assert all(len(w) == 1 for w in pack_windows)  # no pack mixes windows
    firsts = [min(w) for w in pack_windows]
    assert firsts == sorted(firsts)  # packs in window order


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
def test_each_window_is_refined_on_its_own(algorithm):
    arr = np.random.default_rng(0).integers(200, 530, 3000).astype(np.int32)  # triples: FFD leaves room
    window = 1000
    got = plan_packs(arr, 1024, algorithm, refine=True, window=window)
    validate_plan(got, arr)
    assert got.algorithm == f"{algorithm}+refine" and got.refine_seconds >= 0
    order, loads = [], []
    for a in range(0, arr.size, window):
        part = plan_packs(arr[a:a + window], 1024, algorithm, refine=True)
        order += (part.order + a).tolist()
        loads += part.pack_load.tolist()
    assert got.order.tolist() == order and got.pack_load.tolist() == loads
    unrefined = plan_packs(arr, 1024, algorithm, window=window)
    assert got.num_packs < unrefined.num_packs  # the refine pass ran, per window (1,144 → 1,115)


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
def test_one_window_over_everything_is_the_global_plan(algorithm):
    arr = np.random.default_rng(1).integers(0, 500, 3000).astype(np.int32)
    whole = plan_packs(arr, 512, algorithm, skip_empty=True, refine=True)
    for kwargs in ({"window": 3000}, {"window": 10**9}, {"window_starts": [0]}):
        got = plan_packs(arr, 512, algorithm, skip_empty=True, refine=True, **kwargs)
        assert got.order.tolist() == whole.order.tolist()
        assert got.pack_offsets.tolist() == whole.pack_offsets.tolist()


def test_a_window_of_long_items_plans_as_the_full_capacity_histogram_does():
    """A window's histogram stops at its longest item (not the capacity): the same packs."""
    rng = np.random.default_rng(8)
    capacity = 131_072
    arr = np.concatenate([rng.integers(1, 300, 500), rng.integers(60_000, capacity + 1, 500)]).astype(np.int32)
    for algorithm in ("ffd", "bfd"):
        got = plan_packs(arr, capacity, algorithm, window=500)
        order, offsets = windowed_reference(arr.tolist(), capacity, algorithm, [0, 500])
        assert got.order.tolist() == order and got.pack_offsets.tolist() == offsets


@pytest.mark.parametrize("kwargs,error,match", [
    ({"algorithm": "sequential", "window": 5}, ValueError, "keeps the input order itself"),
    ({"algorithm": "first-fit-shuffle", "window": 5}, ValueError, "windows apply to ffd and bfd"),
    ({"window": 0}, ValueError, "window must be >= 1"),
    ({"window": 2.5}, TypeError, "window must be an integer"),
    ({"window": True}, TypeError, "window must be an integer"),
    ({"window": 4, "window_starts": [0, 4]}, ValueError, "not both"),
    ({"window_starts": [1, 4]}, ValueError, "begin with 0"),
    ({"window_starts": []}, ValueError, "begin with 0"),
    ({"window_starts": [0, 6, 6]}, ValueError, "strictly increasing"),
    ({"window_starts": [0, 10]}, ValueError, "below 10"),
    ({"window_starts": [0.0, 4.0]}, TypeError, "must hold integers"),
])
def test_windows_are_refused_as_documented(kwargs, error, match):
    kwargs = {"algorithm": "ffd", **kwargs}
    with pytest.raises(error, match=match):
        plan_packs(np.full(10, 3, np.int32), 10, **kwargs)


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 5000), data=st.data())
def test_a_window_sorted_or_counted_gives_the_same_packs(algorithm, capacity, data):
    """A window is placed from its sorted items (first fit over a tree of packs, or a scan of the
    open packs for best fit) or from its length histogram, whichever is cheaper: both are the
    reference's packs, numbered and ordered alike."""
    from packer_cli.plan.plan import _plan_decreasing, _plan_sorted_window

    size = st.integers(0, capacity) | st.integers(max(0, capacity - 3), capacity) | st.just(capacity // 3)
    lengths = data.draw(st.lists(size, min_size=1, max_size=120))
    if not any(lengths):
        lengths[0] = capacity
    part = np.array(lengths, dtype=np.int32)
    order, offsets = windowed_reference(lengths, capacity, algorithm, [0])
    for plan in (_plan_sorted_window(part, capacity, algorithm),
                 _plan_decreasing(part, capacity, algorithm, int(part.max()))):
        assert plan.order.tolist() == order and plan.pack_offsets.tolist() == offsets
        assert plan.pack_load.tolist() == [int(part[order[a:b]].sum()) for a, b in zip(offsets, offsets[1:])]


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
def test_small_windows_of_long_items_at_a_huge_capacity(algorithm):
    """Windows of 10 items at C = 2**24 (placed from their sorted items: tables over the capacity or
    the longest item had cost 40-90 ms a window) give the reference's packs."""
    capacity = 2**24
    rng = np.random.default_rng(2)
    arr = rng.integers(capacity // 10, capacity // 2, 2000).astype(np.int32)
    got = plan_packs(arr, capacity, algorithm, window=10, refine=True)
    validate_plan(got, arr)
    unrefined = plan_packs(arr, capacity, algorithm, window=10)
    order, offsets = windowed_reference(arr.tolist(), capacity, algorithm, list(range(0, 2000, 10)))
    assert unrefined.order.tolist() == order and unrefined.pack_offsets.tolist() == offsets
    assert got.num_packs <= unrefined.num_packs


def test_windows_of_fewer_than_capacity_over_256_sequences_are_not_refined():
    """The refine pass's tables span the capacity: a window of fewer than C/256 sequences is left
    as planned (at C = 65,536, windows of 200), one of at least C/256 is refined (windows of
    1,000: the pass gains there, as it would in the small windows)."""
    from packer_cli.plan.plan import REFINE_ITEMS_RATIO

    capacity = 65_536
    arr = (np.random.default_rng(0).integers(200, 530, 3000) * 64).astype(np.int32)  # triples leave room
    assert 200 < capacity // REFINE_ITEMS_RATIO <= 1000
    for window, refined in ((200, False), (1000, True)):
        plain = plan_packs(arr, capacity, "ffd", window=window)
        got = plan_packs(arr, capacity, "ffd", window=window, refine=True)
        assert (got.num_packs < plain.num_packs) == refined
        assert refined or got.order.tolist() == plain.order.tolist()
    # the pass would gain in windows of 200 too: they are left alone for its cost, not its gain
    assert sum(plan_packs(arr[a:a + 200], capacity, "ffd", refine=True).num_packs for a in range(0, 3000, 200)) \
        < plan_packs(arr, capacity, "ffd", window=200).num_packs


def per_window_plan(arr, capacity, algorithm, starts, refine):
    """(order, offsets, loads) of each window planned by the per-window path alone (the sorted or
    histogram placement ``_plan_window`` picks, refined where ``_refine_pays``): what the
    compiled loop over runs of small windows must reproduce."""
    from packer_cli.plan.plan import _plan_window, _refine_pays
    from packer_cli.plan.refine import _refine

    order, offsets, loads = [], [0], []
    for a, b in zip(starts, [*starts[1:], arr.size]):
        part = arr[a:b]
        if not part.any():
            continue
        plan = _plan_window(part, capacity, algorithm, int(part.max()))
        if refine and _refine_pays(plan, capacity):
            plan = _refine(part, plan)
        order += (plan.order + a).tolist()
        offsets += (plan.pack_offsets[1:] + offsets[-1]).tolist()
        loads += plan.pack_load.tolist()
    return order, offsets, loads


@st.composite
def mixed_windows(draw):
    """Windows of a few items (the compiled loop), of hundreds (the histogram pass) and of
    enough sequences for the refine pass to be handed back, in any order."""
    capacity = draw(st.sampled_from([7, 64, 1024, 4096, 65_536]))
    # (at least two: one window over everything is the global plan, refined without the C/256 gate)
    sizes = draw(st.lists(st.integers(1, 12) | st.integers(13, 80) | st.integers(250, 700), min_size=2,
                          max_size=12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["triples", "uniform", "short", "with empty"]))
    n = sum(sizes)
    if kind == "triples":  # FFD leaves room that the refine pass can take back
        arr = rng.integers(capacity // 5 + 1, capacity // 2 + 2, n)
    elif kind == "uniform":
        arr = rng.integers(1, capacity + 1, n)
    elif kind == "short":  # long windows of short items: the sorted path by the FFD ratio
        arr = rng.integers(1, max(2, capacity // 64), n)
    else:
        arr = rng.integers(0, capacity + 1, n) * (rng.random(n) < 0.7)
    arr = np.clip(arr, 0, capacity).astype(np.int32)
    if not arr.any():
        arr[0] = 1
    return arr, capacity, np.cumsum([0, *sizes[:-1]]).tolist()


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
@settings(max_examples=120, deadline=None)
@given(inst=mixed_windows(), refine=st.booleans())
def test_the_compiled_loop_plans_each_window_as_the_per_window_path(algorithm, inst, refine):
    """Runs of small windows go through one compiled loop, which hands back windows the
    histogram pass or the refine pass takes: the plan is the per-window path's, window by window."""
    arr, capacity, starts = inst
    got = plan_packs(arr, capacity, algorithm, refine=refine, skip_empty=True, window_starts=starts)
    validate_plan(got, arr, skip_empty=True)
    order, offsets, loads = per_window_plan(arr, capacity, algorithm, starts, refine)
    assert got.order.tolist() == order
    assert got.pack_offsets.tolist() == offsets
    assert got.pack_load.tolist() == loads


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
def test_refined_windows_amid_small_ones_are_handed_back_and_refined(algorithm):
    """Windows of 40 triples at C = 1,024 (at least C/256 items, FFD above ceil(Σ/C)): the
    compiled loop stops at each and the refine pass shortens it; the packs are those of each
    window refined on its own."""
    arr = np.random.default_rng(3).integers(200, 530, 4000).astype(np.int32)
    got = plan_packs(arr, 1024, algorithm, refine=True, window=40)
    plain = plan_packs(arr, 1024, algorithm, window=40)
    assert got.num_packs < plain.num_packs
    order, offsets, loads = per_window_plan(arr, 1024, algorithm, list(range(0, 4000, 40)), True)
    assert got.order.tolist() == order and got.pack_offsets.tolist() == offsets


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
def test_windows_of_one_or_two_records_over_many_items(algorithm):
    """Windows of 1 and 2 items over 200k lengths (each its own pack, or two sharing one where
    they fit), planned in one compiled loop: every item placed once, the reference's packs."""
    arr = np.random.default_rng(4).integers(0, 4097, 200_000).astype(np.int32)
    for window in (1, 2):
        got = plan_packs(arr, 4096, algorithm, window=window, skip_empty=True)
        validate_plan(got, arr, skip_empty=True)
        pairs = arr[: arr.size // window * window].reshape(-1, window)
        if window == 1:
            expected = int(np.count_nonzero(arr))
        else:
            nonzero = np.count_nonzero(pairs, axis=1)
            expected = int((nonzero == 1).sum() + np.where(pairs.sum(axis=1) <= 4096, 1, 2)[nonzero == 2].sum())
        assert got.num_packs == expected
        kept = np.flatnonzero(arr)  # by window, then longest first, ties by index
        assert got.order.tolist() == kept[np.lexsort((kept, -arr[kept], kept // window))].tolist()


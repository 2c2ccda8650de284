"""The :class:`PackPlan` result type and :func:`plan_packs`."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from packer_cli.errors import counted, interrupts_kept

from . import _kernels as K
from ._validate import check_lengths
from .algorithms import _decreasing_positions, _run_bridge, _run_next_fit, _tree

__all__ = ["ALGORITHMS", "PackPlan", "plan_packs", "validate_plan"]

#: Algorithms accepted by :func:`plan_packs`.
ALGORITHMS = ("ffd", "bfd", "first-fit-shuffle", "sequential")


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _plan_array(name: str, value) -> np.ndarray:
    """``value`` as a 1-D array of native signed integers (an empty list is one); the planner's
    int32/int64 arrays as they are, unsigned ones as int64 where every value fits."""
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.ndim == 0:
        raise TypeError(f"{name} must be a 1-D array of integers, got {type(value).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0 and arr.dtype.kind not in "iu":
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {int(arr.max())}, beyond int64")
    if arr.dtype.kind == "u" or not arr.dtype.isnative:
        return arr.astype(np.int64)
    return arr


def _plan_count(name: str, value) -> int:
    """``value`` as a non-negative Python ``int`` (a NumPy integer's arithmetic wraps at its width)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return count


@dataclass(frozen=True, eq=False)
class PackPlan:
    """Assignment of items to packs, stored grouped by pack (12 bytes per item at most).

    Attributes
    ----------
    order : int32[M]
        Packed item indices grouped by pack in pack-number order; within a pack,
        in placement order.
    pack_offsets : int64[P + 1]
        Pack ``p`` holds ``order[pack_offsets[p]:pack_offsets[p + 1]]``.
    pack_load : int32[P]
        Sum of the item lengths of each pack.
    num_items : int
        ``N``, the number of items planned (``M == N`` unless empty items were
        skipped, see :func:`plan_packs`).
    capacity : int
        Pack capacity the plan was made for.
    algorithm : str
        Algorithm name (``"+refine"`` appended when refined).
    refine_seconds : float or None
        Wall time of the refinement pass, when one ran.
    """

    order: np.ndarray
    pack_offsets: np.ndarray
    pack_load: np.ndarray
    num_items: int
    capacity: int = 0
    algorithm: str = ""
    refine_seconds: float | None = None

    def __post_init__(self):
        # A plan made by hand may hold lists, unsigned or byte-swapped arrays: the compiled
        # passes take native signed integers, so each array becomes one here (the planner's
        # own arrays pass through as they are) and anything else is refused by name.
        for name in ("order", "pack_offsets", "pack_load"):
            object.__setattr__(self, name, _plan_array(name, getattr(self, name)))
        # Python ints too: a NumPy uint32 capacity overflowed in the refine pass's arithmetic
        for name in ("num_items", "capacity"):
            object.__setattr__(self, name, _plan_count(name, getattr(self, name)))

    @property
    def num_packs(self) -> int:
        """Number of packs ``P``."""
        return int(self.pack_load.shape[0])

    @cached_property
    @interrupts_kept
    def pack_of_item(self) -> np.ndarray:
        """int32[N]: pack number of every item, -1 for skipped empty items.

        Derived from ``order`` on first use (the planner itself never needs it,
        so a plan of N items costs 4 bytes less per item until someone asks).
        """
        order, offsets = _layout_arrays(self)
        return _frozen(K._pack_of_item(order, offsets, self.num_items))

    def pack_items(self, pack: int) -> np.ndarray:
        """Item indices of ``pack`` (``0 <= pack < num_packs``) in placement order."""
        if not 0 <= pack < self.num_packs:  # -1 read offsets[-1]..offsets[0]: an empty pack, silently
            raise IndexError(f"pack {pack} out of range for {counted(self.num_packs, 'pack')}")
        return self.order[self.pack_offsets[pack] : self.pack_offsets[pack + 1]]


def _is_bool(value) -> bool:
    """True or False, Python's or NumPy's (never a string such as ``"no"``, which is truthy)."""
    return isinstance(value, (bool, np.bool_))


def _make_plan(order, offsets, load, num_items, capacity, algorithm, refine_seconds=None):
    return PackPlan(
        order=_frozen(np.asarray(order, dtype=np.int32)),
        pack_offsets=_frozen(np.asarray(offsets, dtype=np.int64)),
        pack_load=_frozen(np.asarray(load, dtype=np.int32)),
        num_items=int(num_items),
        capacity=capacity,
        algorithm=algorithm,
        refine_seconds=refine_seconds,
    )


def _empty_plan(num_items: int, capacity: int, algorithm: str) -> PackPlan:
    z = np.zeros(0, np.int32)
    return _make_plan(z, np.zeros(1, np.int64), z.copy(), num_items, capacity, algorithm)


def _plan_decreasing(arr: np.ndarray, capacity: int, algorithm: str, top: int | None = None) -> PackPlan:
    """FFD/BFD straight into the grouped layout: histogram → pack of each placement
    position → (in place) slot of each position → item of each slot."""
    counts, slots, num_packs = _decreasing_positions(arr, capacity, algorithm, top)
    offsets, load = K._positions_to_slots(slots, counts, num_packs)
    order = np.empty(slots.shape[0], np.int32)
    K._scatter_items(arr, counts, slots, order)
    del slots
    return _make_plan(order, offsets, load, arr.shape[0], capacity, algorithm)


def _plan_compacted(arr: np.ndarray, capacity: int, algorithm: str, seed) -> PackPlan:
    """Sequential and first-fit-shuffle plans, over the non-empty items only."""
    keep = None
    if arr.min() == 0:
        keep = np.flatnonzero(arr).astype(np.int32)
        sub = arr[keep]
    else:
        sub = arr
    if sub.shape[0] == 0:
        return _empty_plan(arr.shape[0], capacity, algorithm)
    if algorithm == "first-fit-shuffle":
        _, order, offsets, load, _ = _run_bridge(sub, capacity, seed)
    else:
        pack_of_item, num_packs = _run_next_fit(sub, capacity)
        order, offsets, load = K._group_by_pack(np.arange(sub.shape[0], dtype=np.int32), pack_of_item, sub,
                                                num_packs)
    if keep is not None:
        order = keep[order]
    return _make_plan(order, offsets, load, arr.shape[0], capacity, algorithm)


def _window_starts(window, window_starts, num_items: int, algorithm: str) -> np.ndarray | None:
    """The item indices where windows begin (int64, first 0, strictly increasing, all below
    ``num_items``), from ``window`` (items a window) or ``window_starts``; None: one window."""
    if window is None and window_starts is None:
        return None
    if window is not None and window_starts is not None:
        raise ValueError("give window or window_starts, not both")
    if algorithm not in ("ffd", "bfd"):
        raise ValueError(f"windows apply to ffd and bfd, not {algorithm!r} (which keeps the input order itself)"
                         if algorithm == "sequential" else f"windows apply to ffd and bfd, not {algorithm!r}")
    if window is not None:
        if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)):
            raise TypeError(f"window must be an integer, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        return np.arange(0, max(num_items, 1), int(window), dtype=np.int64)
    starts = _plan_array("window_starts", window_starts).astype(np.int64, copy=False)
    if starts.size == 0 or starts[0] != 0:
        raise ValueError("window_starts must begin with 0")
    if (np.diff(starts) <= 0).any() or (num_items and starts[-1] >= num_items) or (not num_items and starts.size > 1):
        raise ValueError(f"window_starts must be strictly increasing item indices below {max(num_items, 1)}")
    return starts


#: A window is planned from its sorted items rather than from its length histogram when that is
#: cheaper: FFD's histogram pass costs its longest item, so a window of fewer than 1/32 of that
#: many items is sorted and placed by first fit (a tree over its packs); BFD's tables span the
#: capacity, so a window of at most sqrt(capacity) items is placed by a scan of its open packs.
#: A window of at most SORTED_ITEMS items is always placed so (a compiled loop plans runs of
#: such windows without a Python round each). Either way the packs are the same (tests compare
#: both ways on every window).
SORTED_FFD_RATIO = 32
SORTED_ITEMS = 256


def _sorted_is_cheaper(items, top, capacity: int, algorithm: str):
    """Whether windows of ``items`` non-empty items, the longest ``top``, are planned from their
    sorted items (scalars, or arrays elementwise)."""
    if algorithm == "ffd":
        return (items <= SORTED_ITEMS) | (items * SORTED_FFD_RATIO < top)
    return (items <= SORTED_ITEMS) | (items * items <= capacity)


def _plan_sorted_window(part: np.ndarray, capacity: int, algorithm: str) -> PackPlan:
    """FFD/BFD of one window's items sorted by decreasing length (ties by index), in the grouped
    layout ``_plan_decreasing`` gives: the compiled loop's placement, on this window alone."""
    n = int(np.count_nonzero(part))
    order, offsets, load = np.empty(n, np.int32), np.zeros(n + 1, np.int64), np.empty(n, np.int32)
    scratch = (np.empty(n, np.int32), np.empty(n, part.dtype), np.empty(n, np.int32), np.empty(n, np.int64),
               _tree(max(n, 1)))
    _, _, packs = K._plan_small_windows(part, np.zeros(1, np.int64), 0, 1, capacity, algorithm == "bfd",
                                        REFINE_ITEMS_RATIO, False, order, offsets, load, 0, 0, *scratch)
    return _make_plan(order, offsets[:packs + 1], load[:packs], part.shape[0], capacity, algorithm)


def _plan_window(part: np.ndarray, capacity: int, algorithm: str, top: int) -> PackPlan:
    if _sorted_is_cheaper(int(np.count_nonzero(part)), top, capacity, algorithm):
        return _plan_sorted_window(part, capacity, algorithm)
    return _plan_decreasing(part, capacity, algorithm, top)


#: A window is refined only where it holds at least capacity / REFINE_ITEMS_RATIO sequences: the
#: refine pass's rebuilds keep tables that span the capacity (about 40 ms each at C = 2**24), so
#: windows of a few sequences at a large capacity cost far more to refine than to plan.
REFINE_ITEMS_RATIO = 256


def _refine_pays(plan: PackPlan, capacity: int) -> bool:
    """Whether refining one window's plan can gain and is worth its cost: it is above
    ceil(Σ/C) packs (at that bound nothing can improve it: most windows of a few records) and
    holds enough sequences for the pass's tables over the capacity (``REFINE_ITEMS_RATIO``)."""
    if plan.order.shape[0] * REFINE_ITEMS_RATIO < capacity:
        return False
    return plan.num_packs > -(-int(plan.pack_load.sum(dtype=np.int64)) // capacity)


def _small_window_scratch(arr: np.ndarray, starts: np.ndarray, capacity: int, algorithm: str):
    """Work arrays for ``K._plan_small_windows``, sized to the widest window the sorted path can
    take (``_sorted_is_cheaper``), or the widest window if that is narrower."""
    widest = int(np.diff(starts, append=arr.shape[0]).max())
    cap = capacity // SORTED_FFD_RATIO + 1 if algorithm == "ffd" else math.isqrt(capacity) + 1
    m = max(1, min(widest, max(cap, SORTED_ITEMS)))
    return (np.empty(m, np.int32), np.empty(m, arr.dtype), np.empty(m, np.int32), np.empty(m, np.int64),
            _tree(m))


def _histogram_windows(arr: np.ndarray, starts: np.ndarray, capacity: int, algorithm: str) -> np.ndarray:
    """The windows planned from their length histogram (not ``_sorted_is_cheaper``), ascending;
    empty windows are not among them."""
    items = np.add.reduceat(arr != 0, starts)
    top = np.maximum.reduceat(arr, starts)
    return np.flatnonzero(~_sorted_is_cheaper(items, top, capacity, algorithm))


def _plan_windows(arr: np.ndarray, capacity: int, algorithm: str, starts: np.ndarray, refine: bool) -> PackPlan:
    """FFD/BFD (each window refined on its own with ``refine``) over each window of items
    ``arr[starts[w]:starts[w + 1]]``: no pack mixes windows, and the packs are numbered window
    by window, so the plan's pack order follows the windows' order.

    Runs of windows placed from their sorted items and not refined are planned by one compiled
    loop (``K._plan_small_windows``); it hands back each window it leaves to this function's
    per-window path (the histogram pass, the refine pass). Windows of a few items thus cost
    about a microsecond each rather than the tens of a Python round."""
    from .refine import _refine

    histogram_windows = _histogram_windows(arr, starts, capacity, algorithm)  # before the layout: its peak
    items = int(np.count_nonzero(arr))
    order = np.empty(items, np.int32)
    offsets = np.zeros(items + 1, np.int64)  # packs <= items
    load = np.empty(items, np.int32)
    scratch = _small_window_scratch(arr, starts, capacity, algorithm)
    placed = packs = 0
    refine_seconds = 0.0

    def plan_window(w: int) -> None:  # the per-window path: histogram and refine passes
        nonlocal placed, packs, refine_seconds
        a = int(starts[w])
        part = arr[a:int(starts[w + 1])] if w + 1 < starts.shape[0] else arr[a:]
        plan = _plan_window(part, capacity, algorithm, int(part.max()))
        if refine and _refine_pays(plan, capacity):
            plan = _refine(part, plan, in_place=True)
            refine_seconds += plan.refine_seconds
        n, k = plan.order.shape[0], plan.num_packs
        np.add(plan.order, a, out=order[placed:placed + n])
        np.add(plan.pack_offsets[1:], placed, out=offsets[packs + 1:packs + 1 + k])
        load[packs:packs + k] = plan.pack_load
        placed += n
        packs += k

    def plan_sorted_windows(w: int, stop: int) -> None:  # the compiled loop, and what it hands back
        nonlocal placed, packs
        while w < stop:
            w, placed, packs = K._plan_small_windows(arr, starts, w, stop, capacity, algorithm == "bfd",
                                                     REFINE_ITEMS_RATIO, refine, order, offsets, load, placed,
                                                     packs, *scratch)
            if w < stop:
                plan_window(w)
                w += 1

    # The windows the histogram pass is cheaper for are judged here at once, so a run of them
    # costs no call into the compiled loop.
    w = 0
    for hist in histogram_windows:
        plan_sorted_windows(w, int(hist))
        plan_window(int(hist))
        w = int(hist) + 1
    plan_sorted_windows(w, starts.shape[0])
    try:  # in place where nothing else refers to them: no second copy at the peak
        offsets.resize(packs + 1)
        load.resize(packs)
    except ValueError:  # referred to elsewhere (a debugger holding the frame's locals, say)
        offsets, load = offsets[:packs + 1].copy(), load[:packs].copy()
    return _make_plan(order, offsets, load, arr.shape[0], capacity,
                      algorithm + ("+refine" if refine else ""), refine_seconds=refine_seconds if refine else None)


@interrupts_kept
def plan_packs(lengths, capacity, algorithm: str = "ffd", seed=0, *, refine: bool = False,
               skip_empty: bool = False, window=None, window_starts=None) -> PackPlan:
    """Assign items to packs of ``capacity`` tokens.

    Parameters
    ----------
    lengths : array-like of int, shape (N,)
        Item lengths, each in ``[1, capacity]`` (``[0, capacity]`` with ``skip_empty``).
        Contiguous ``int32``/``int64`` input is used as is; anything else is converted.
    capacity : int
        Pack capacity.
    algorithm : {"ffd", "bfd", "first-fit-shuffle", "sequential"}
        ``"ffd"``/``"bfd"``: first/best fit decreasing (placement order is
        decreasing length, ties by index). ``"first-fit-shuffle"``:
        Megatron-Bridge's default packing and binding for ``seed``.
        ``"sequential"``: next fit in input order.
    seed : int
        Only used by ``"first-fit-shuffle"``.
    refine : bool
        Run :func:`packer_cli.plan.refine_plan` on the result to reduce the
        number of packs (deterministic; the time is in ``refine_seconds``).
    skip_empty : bool
        Accept items of length 0 and leave them out of every pack (their
        ``pack_of_item`` is -1). The other items are planned exactly as if the
        empty ones were not there.
    window : int, optional
        ``"ffd"``/``"bfd"`` only: plan each run of ``window`` consecutive items
        on its own (with ``refine``, refined on its own where it holds at least
        ``capacity / 256`` items and is above ceil(Σ/C) packs: the pass's
        tables span the capacity). No pack mixes windows,
        and packs are numbered window by window, so pack order follows item
        order at window granularity (an order-preserving mode for curricula
        that packs far tighter than ``"sequential"``). None: one global plan.
    window_starts : array-like of int, optional
        Windows of unequal size instead of ``window``: the item indices where
        windows begin, strictly increasing from 0 (``pack()`` windows by input
        records, whose split pieces follow their sample).

    Returns
    -------
    PackPlan
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    for name, flag in (("refine", refine), ("skip_empty", skip_empty)):
        if not _is_bool(flag):  # refine="no" is truthy: it refined
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    arr, capacity = check_lengths(lengths, capacity, allow_zero=skip_empty)
    starts = _window_starts(window, window_starts, arr.shape[0], algorithm)
    if arr.shape[0] == 0:
        plan = _empty_plan(0, capacity, algorithm)
    elif starts is not None and starts.size > 1:
        return _plan_windows(arr, capacity, algorithm, starts, refine)
    elif algorithm in ("ffd", "bfd"):
        plan = _plan_decreasing(arr, capacity, algorithm)
    else:
        plan = _plan_compacted(arr, capacity, algorithm, seed)
    if refine:
        from .refine import _refine

        plan = _refine(arr, plan, in_place=True)  # the unrefined plan is never seen
    return plan


@interrupts_kept
def validate_plan(plan: PackPlan, lengths, capacity=None, *, skip_empty: bool = False) -> None:
    """Check a plan's invariants; raise ``ValueError`` on the first violation.

    Every (non-empty, with ``skip_empty``) item is in exactly one pack, loads
    are the sums of lengths, no pack is empty and no load exceeds the capacity.
    """
    if not isinstance(plan, PackPlan):  # a dict failed as an AttributeError, as refine_plan does not
        raise TypeError(f"plan must be a PackPlan, got {type(plan).__name__}")
    capacity = plan.capacity if capacity is None else capacity
    arr, capacity = check_lengths(lengths, capacity, allow_zero=skip_empty)
    packed = int(np.count_nonzero(arr)) if skip_empty else arr.shape[0]
    if plan.num_items != arr.shape[0] or plan.order.shape != (packed,):
        raise ValueError("plan does not cover every item")
    check_layout(plan, arr, skip_empty)
    sizes = np.diff(plan.pack_offsets)
    load = np.bincount(np.repeat(np.arange(plan.num_packs), sizes), weights=arr[plan.order],
                       minlength=plan.num_packs).astype(np.int64)
    if (load != plan.pack_load).any():
        raise ValueError("pack_load does not match the item lengths")
    check_loads_fit(plan, capacity)


def check_layout(plan: PackPlan, arr: np.ndarray, skip_empty: bool) -> None:
    """``ValueError`` unless ``plan``'s grouped layout is sound over the validated lengths
    ``arr``: offsets from 0 to the end of ``order``, no empty pack, and every item (every
    non-empty one, with ``skip_empty``) exactly once. One compiled O(N) pass: the compiled
    consumers of a plan index with what it says, unchecked, so a plan made by hand is checked
    before any of them sees it."""
    order, offsets = _layout_arrays(plan)
    if offsets.shape != (plan.num_packs + 1,):
        raise ValueError("pack_offsets are inconsistent")
    problem = K._layout_problem(order, offsets, arr, bool(skip_empty))
    if problem == K.LAYOUT_OFFSETS:
        raise ValueError("pack_offsets are inconsistent")
    if problem == K.LAYOUT_NOT_PERMUTATION:
        raise ValueError("order is not a permutation of the items")
    if problem == K.LAYOUT_EMPTY_PACK:
        raise ValueError(f"pack {int(np.flatnonzero(np.diff(offsets) == 0)[0])} is empty")


def _layout_arrays(plan: PackPlan) -> tuple[np.ndarray, np.ndarray]:
    """``order`` (int32 as the planner makes it, else int64) and int64 ``pack_offsets`` for the
    compiled passes (a plan's arrays are 1-D native integers: :class:`PackPlan` sees to it)."""
    order, offsets = plan.order, plan.pack_offsets
    return (order if order.dtype == np.int32 else order.astype(np.int64)), offsets.astype(np.int64, copy=False)


def check_loads_fit(plan: PackPlan, capacity: int) -> None:
    """``ValueError`` for a pack whose load is above ``capacity``."""
    if plan.num_packs and plan.pack_load.max() > capacity:
        q = int(np.argmax(plan.pack_load))
        raise ValueError(f"pack {q} holds {int(plan.pack_load[q])} tokens, above capacity {capacity}")

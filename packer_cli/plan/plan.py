"""The :class:`PackPlan` result type and :func:`plan_packs`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _kernels as K
from ._validate import check_lengths
from .algorithms import _run_bfd, _run_bridge, _run_ffd, _run_next_fit

__all__ = ["ALGORITHMS", "PackPlan", "plan_packs", "validate_plan"]

#: Algorithms accepted by :func:`plan_packs`.
ALGORITHMS = ("ffd", "bfd", "first-fit-shuffle", "sequential")


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class PackPlan:
    """Assignment of items to packs.

    Attributes
    ----------
    pack_of_item : int64[N]
        Pack number of every item (packs numbered densely from 0).
    order : int64[N]
        Item indices grouped by pack in pack-number order; within a pack, in
        placement order.
    pack_offsets : int64[P + 1]
        Pack ``p`` holds ``order[pack_offsets[p]:pack_offsets[p + 1]]``.
    pack_load : int64[P]
        Sum of the item lengths of each pack.
    capacity : int
        Pack capacity the plan was made for.
    algorithm : str
        Algorithm name (``"+refine"`` appended when refined).
    refine_seconds : float or None
        Wall time of the refinement pass, when one ran.
    """

    pack_of_item: np.ndarray
    order: np.ndarray
    pack_offsets: np.ndarray
    pack_load: np.ndarray
    capacity: int = 0
    algorithm: str = ""
    refine_seconds: float | None = None

    @property
    def num_packs(self) -> int:
        """Number of packs ``P``."""
        return int(self.pack_load.shape[0])

    @property
    def num_items(self) -> int:
        """Number of items ``N``."""
        return int(self.pack_of_item.shape[0])

    def pack_items(self, pack: int) -> np.ndarray:
        """Item indices of ``pack`` in placement order."""
        return self.order[self.pack_offsets[pack] : self.pack_offsets[pack + 1]]


def _make_plan(pack_of_item, order, offsets, load, capacity, algorithm, refine_seconds=None):
    return PackPlan(
        pack_of_item=_frozen(pack_of_item),
        order=_frozen(order),
        pack_offsets=_frozen(offsets),
        pack_load=_frozen(load),
        capacity=capacity,
        algorithm=algorithm,
        refine_seconds=refine_seconds,
    )


def _empty_plan(capacity: int, algorithm: str) -> PackPlan:
    z = np.zeros(0, np.int64)
    return _make_plan(z, z.copy(), np.zeros(1, np.int64), z.copy(), capacity, algorithm)


def plan_packs(lengths, capacity, algorithm: str = "ffd", seed=0, *, refine: bool = False) -> PackPlan:
    """Assign items to packs of ``capacity`` tokens.

    Parameters
    ----------
    lengths : array-like of int, shape (N,)
        Item lengths, each in ``[1, capacity]``.
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

    Returns
    -------
    PackPlan
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    arr, capacity = check_lengths(lengths, capacity)
    if arr.shape[0] == 0:
        plan = _empty_plan(capacity, algorithm)
    elif algorithm == "first-fit-shuffle":
        pack_of_item, order, offsets, load, _ = _run_bridge(arr, capacity, seed)
        plan = _make_plan(pack_of_item, order, offsets, load, capacity, algorithm)
    else:
        run = {"ffd": _run_ffd, "bfd": _run_bfd, "sequential": _run_next_fit}[algorithm]
        pack_of_item, sequence, num_packs = run(arr, capacity)
        seq_lengths = K._gather(arr, sequence)
        order, offsets, load = K._group_by_pack(
            sequence, K._gather(pack_of_item, sequence), seq_lengths, num_packs
        )
        plan = _make_plan(pack_of_item, order, offsets, load, capacity, algorithm)
    if refine:
        from .refine import refine_plan

        plan = refine_plan(arr, plan)
    return plan


def validate_plan(plan: PackPlan, lengths, capacity=None) -> None:
    """Check a plan's invariants; raise ``ValueError`` on the first violation.

    Every item is assigned exactly once, ``order``/``pack_offsets`` agree with
    ``pack_of_item``, loads are the sums of lengths, no pack is empty and no
    load exceeds the capacity.
    """
    capacity = plan.capacity if capacity is None else capacity
    arr, capacity = check_lengths(lengths, capacity)
    n = arr.shape[0]
    p = plan.num_packs
    if plan.pack_of_item.shape != (n,) or plan.order.shape != (n,):
        raise ValueError("plan does not cover every item")
    if plan.pack_offsets.shape != (p + 1,) or plan.pack_offsets[0] != 0 or plan.pack_offsets[-1] != n:
        raise ValueError("pack_offsets are inconsistent")
    if n and (np.sort(plan.order) != np.arange(n)).any():
        raise ValueError("order is not a permutation of the items")
    sizes = np.diff(plan.pack_offsets)
    if (sizes <= 0).any():
        raise ValueError(f"pack {int(np.flatnonzero(sizes <= 0)[0])} is empty")
    if (plan.pack_of_item[plan.order] != np.repeat(np.arange(p), sizes)).any():
        raise ValueError("order does not match pack_of_item")
    load = np.bincount(plan.pack_of_item, weights=arr, minlength=p).astype(np.int64) if n else np.zeros(0, np.int64)
    if (load != plan.pack_load).any():
        raise ValueError("pack_load does not match the item lengths")
    if p and plan.pack_load.max() > capacity:
        q = int(np.argmax(plan.pack_load))
        raise ValueError(f"pack {q} holds {int(plan.pack_load[q])} tokens, above capacity {capacity}")

"""Which packs each data-parallel rank reads, in which order, from where it left off.

Every epoch is a seeded permutation of the packs (``numpy.random.default_rng([seed, epoch])``),
cut into micro-batches of ``batch_packs`` packs; micro-batch ``k`` goes to DP rank
``k % dp_size``. So:

* all ranks agree on the order without communicating (same seed, same epoch);
* the CP ranks of one DP replica are *not* part of the sharding: they get the same
  packs, which is what context parallelism needs (each then keeps its own slice);
* every DP rank gets the same number of micro-batches (the remainder is dropped: other
  packs each epoch when shuffled, the same last packs without shuffling, which the loader
  warns about), so no rank waits for a step another rank never takes;
* the position inside an epoch is one integer, which makes resuming exact.

Example: 10 packs, ``batch_packs=2``, ``dp_size=2`` -> 2 micro-batches per rank per epoch
(the last 2 packs of the permutation are dropped).

With ``costs`` (one per pack, e.g. its training FLOPs) the packs of each training step, the
``micro_batches_per_step`` rounds of ``dp_size`` micro-batches that end in one gradient
all-reduce, are dealt to the ranks again so that every rank's share costs about the same
(:func:`packer_cli.plan.balance.balance_ranks`): the step then lasts as long as the balanced
share, not as long as the unluckiest rank's. A step still holds exactly the packs it held
unbalanced and each rank still gets ``micro_batches_per_step * batch_packs`` of them, in
the permutation's order; only which rank takes which changes. The last step of an epoch may
have fewer rounds, and is balanced over those.

That cannot help a step of one pack a rank (``micro_batches_per_step * batch_packs == 1``): it
lasts as long as its costliest pack whoever takes it. ``balance_scope="epoch"`` also chooses
which packs make a step: the epoch's packs sorted by cost are cut into steps, so a step holds
packs of about the same cost, and the steps are served in a seeded order (a step's packs are
then alike, as with Hugging Face's ``group_by_length``; the default, ``"step"``, keeps the
permutation's steps). Sorted whole, the epoch makes about the same steps every epoch (only
their order changes); ``balance_scope=W``, a number of steps, sorts each window of ``W`` steps
of the permutation instead, so the steps' make-up changes with the epoch too, at some cost in
balance (at 8 ranks of one pack a step, 32k context, 8B FLOPs: 1.24 dealt, 1.012 with 16,
1.003 with 64, 1.000 with the whole epoch).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from packer_cli.errors import first_line
from packer_cli.torch._ints import flag, integer


def _rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator of ``(seed, epoch)``: ``default_rng([seed, epoch])`` while both fit in 32
    bits (the orders every earlier version gave); beyond, NumPy splits a seed into 32-bit words
    and pads with zeros, so ``[5 + 2**32, 0]`` and ``[5, 1]`` would be the same seed, and the
    epoch goes in a spawn key of its own instead."""
    if seed < 2**32 and epoch < 2**32:
        return np.random.default_rng([seed, epoch])
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(epoch,)))


class MicroBatchSampler:
    """Yields, for one DP rank, lists of pack indices (one list per micro-batch).

    Args:
        num_packs: dataset length.
        batch_packs: packs per micro-batch (concatenated into one THD row).
        dp_size, dp_rank: data-parallel world size and rank.
        seed: base seed; the permutation of epoch ``e`` depends on ``(seed, e)`` only.
        shuffle: False keeps pack order (useful for evaluation).
        costs: None, or the cost of every pack (finite, ``>= 0``): balance each step's packs
            over the ranks by it.
        micro_batches_per_step: micro-batches each rank takes per optimizer step (gradient
            accumulation); the packs balanced together are one step's. Used with ``costs``.
        balance_scope: ``"step"`` (deal each step's packs again), ``"epoch"`` (also make
            each step of packs of about the same cost, sorting the whole epoch) or a number of
            steps ``W`` (the same, sorting each window of ``W`` steps). Used with ``costs``.
    """

    def __init__(
        self,
        num_packs: int,
        *,
        batch_packs: int = 1,
        dp_size: int = 1,
        dp_rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        costs: np.ndarray | None = None,
        micro_batches_per_step: int = 1,
        balance_scope: str | int = "step",
    ) -> None:
        counts = [integer(v) for v in (batch_packs, dp_size, dp_rank)]  # a float fails later, in the slicing
        if None in counts or counts[0] < 1 or counts[1] < 1 or not 0 <= counts[2] < counts[1]:
            raise ValueError(f"bad sharding: batch_packs={batch_packs!r}, dp_size={dp_size!r}, dp_rank={dp_rank!r}")
        seed_value = integer(seed)
        if seed_value is None or seed_value < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.num_packs = num_packs
        self.batch_packs, self.dp_size, self.dp_rank = counts
        self.seed = seed_value  # a plain int: a checkpoint holding state_dict() loads with weights_only
        self.shuffle = flag(shuffle, "shuffle")
        steps = integer(micro_batches_per_step)
        if steps is None or steps < 1:
            raise ValueError(f"micro_batches_per_step must be an integer >= 1, got {micro_batches_per_step!r}")
        self.micro_batches_per_step = steps
        self.costs = None if costs is None else checked_costs(costs, num_packs)
        window = integer(balance_scope)
        if (window is None and balance_scope not in BALANCE_SCOPES) or (window is not None and window < 1):
            shown = repr(balance_scope) if window is None else window
            raise ValueError(f"balance_scope must be 'step', 'epoch' or a number of steps >= 1, got {shown}")
        if window is not None:
            balance_scope = window  # a plain int, for the loader's state
        if balance_scope != "step" and costs is None:
            raise ValueError(f"balance_scope={balance_scope!r} needs the packs' costs (THDLoader's balance=)")
        self.balance_scope = balance_scope
        self.epoch = 0
        self.start = 0  # micro-batches of this epoch already consumed by this rank
        self._balanced: tuple[int, np.ndarray] | None = None  # (epoch, its order): one balancing an epoch

    @property
    def per_epoch(self) -> int:
        """Micro-batches per epoch for every DP rank."""
        return self.num_packs // (self.batch_packs * self.dp_size)

    @property
    def dropped(self) -> int:
        """Packs of each epoch's order that make no whole micro-batch for every rank."""
        return self.num_packs - self.per_epoch * self.batch_packs * self.dp_size

    def __len__(self) -> int:
        return self.per_epoch - self.start

    def epoch_order(self, epoch: int) -> np.ndarray:
        """``[per_epoch, batch_packs]`` pack indices of this rank for ``epoch``."""
        if self._balanced is not None and self._balanced[0] == epoch:  # balanced once an epoch
            return self._balanced[1]
        if self.shuffle:
            order = _rng(self.seed, epoch).permutation(self.num_packs)
        else:
            order = np.arange(self.num_packs)
        used = self.per_epoch * self.batch_packs * self.dp_size
        if self.costs is not None:
            return self._balanced_order(epoch, order[:used])
        groups = order[:used].reshape(self.per_epoch, self.dp_size, self.batch_packs)
        return groups[:, self.dp_rank, :]

    def _balanced_order(self, epoch: int, order: np.ndarray) -> np.ndarray:
        """This rank's ``[per_epoch, batch_packs]`` packs when each step's are balanced."""
        from packer_cli.plan.balance import balance_ranks  # numba: only a balancing loader pays for it

        step_packs = self.micro_batches_per_step * self.batch_packs * self.dp_size
        whole = order.size - order.size % step_packs
        if self.balance_scope != "step":
            order = self._grouped(epoch, order, step_packs, whole)
        ranks = np.empty(order.size, np.int64)
        ranks[:whole] = balance_ranks(self.costs[order[:whole]], self.dp_size, step_packs // self.dp_size)
        if whole < order.size:  # the epoch's last step, with fewer rounds
            rest = order[whole:]
            ranks[whole:] = balance_ranks(self.costs[rest], self.dp_size, rest.size // self.dp_size)
        # Boolean selection keeps the permutation's order inside every step, and every step gives
        # each rank the same number of packs, so this rank's micro-batches follow step by step.
        mine = order[ranks == self.dp_rank].reshape(self.per_epoch, self.batch_packs)
        self._balanced = (epoch, mine)
        return mine

    def _grouped(self, epoch: int, order: np.ndarray, step_packs: int, whole: int) -> np.ndarray:
        """``order``'s packs by decreasing cost, the whole epoch or each window of
        ``balance_scope`` steps apart (ties in ``order``'s own order, which the epoch's
        permutation sets), cut into steps; the whole steps in a seeded order of their own, the
        epoch's shorter last step last (sorted whole, it holds the epoch's cheapest packs)."""
        if order.size == 0:
            return order
        window = order.size if self.balance_scope == "epoch" else self.balance_scope * step_packs
        order = order.copy()
        full = order.size - order.size % window
        if full:  # the whole windows, sorted together as the rows of one array
            windows = order[:full].reshape(-1, window)
            by_cost = np.argsort(-self.costs[windows], axis=1, kind="stable")
            order[:full] = np.take_along_axis(windows, by_cost, axis=1).ravel()
        rest = order[full:]
        order[full:] = rest[np.argsort(-self.costs[rest], kind="stable")]
        if self.shuffle and whole:
            steps = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(epoch, 1)))
            order[:whole] = order[:whole].reshape(-1, step_packs)[steps.permutation(whole // step_packs)].ravel()
        return order

    def __iter__(self) -> Iterator[list[int]]:
        # Evaluated now, not lazily: later changes to epoch/start do not affect this pass.
        return iter(self.epoch_order(self.epoch)[self.start :].tolist())


#: ``balance_scope`` by name: what balancing may change: which rank takes which pack of a step, or
#: also which packs make a step, sorting the whole epoch (a number of steps sorts windows of them).
BALANCE_SCOPES = ("step", "epoch")


def checked_costs(costs, num_packs: int) -> np.ndarray:
    """``costs`` as a float64 array of one finite cost ``>= 0`` a pack; ValueError otherwise."""
    if hasattr(costs, "detach"):  # a torch tensor: any dtype, on any device, with grad or not
        costs = costs.detach().cpu().double().numpy()
    try:
        arr = np.asarray(costs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"costs must be {num_packs} numbers, one a pack: {first_line(exc)}") from None
    if arr.dtype.kind not in "iuf" or arr.shape != (num_packs,):
        raise ValueError(f"costs must be {num_packs} numbers, one a pack; got {arr.dtype} of shape {arr.shape}")
    arr = arr.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        raise ValueError(f"costs must be finite and >= 0; pack {int(bad[0])} costs {float(arr[bad[0]])!r}")
    return arr

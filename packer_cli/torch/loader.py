"""``THDLoader``: packed micro-batches for one (DP rank, CP rank), delivered to the GPU.

Data flow::

    MicroBatchSampler (main process)        seeded order, DP shard, resume position
          | [pack ids]
    DataLoader workers (CPU)                read rows (mmap) -> THDBatch -> concat packs
          |                                 -> slice for this CP rank (T/CP tokens)
    pin-memory thread                       THDBatch.pin_memory()
          |
    cuda_prefetch (side stream)             non_blocking H2D, one batch ahead, record_stream
          v
    training step                           THDBatch on the GPU; max_seqlen and the
                                            statistics are Python ints: no device sync

Every CP rank of a DP replica builds the same packs (CP is not part of the sharding)
and keeps only its own zig-zag slice, so only ``T/CP`` tokens per rank cross PCIe (and
``seq_idx``, 4 bytes a token, whole); the boundary vectors stay global, as Transformer
Engine expects.

Example::

    ds = PackedDataset("out/")
    loader = THDLoader(ds, cp_size=2, cp_rank=cp_rank, dp_size=dp, dp_rank=dp_rank, seed=1)
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            out = model(batch.tokens, position_ids=batch.position_ids,
                        packed_seq_params=batch.packed_seq_params())
        ...
    ckpt["loader"] = loader.state_dict()       # exact resume: loader.load_state_dict(...)
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from packer_cli.errors import DataError, PackerWarning, counted, first_line
from packer_cli.torch._ints import flag, integer
from packer_cli.torch.batch import CP_MBS_ERROR, THDBatch
from packer_cli.torch.config import validate_training_config
from packer_cli.torch.cp import cp_rank_arguments
from packer_cli.torch.dataset import PackedDataset
from packer_cli.torch.prefetch import cuda_prefetch
from packer_cli.torch.sampler import MicroBatchSampler, checked_costs


#: ``THDLoader(on_damaged=...)``: raise the DataError, or step on a lossless stand-in.
ON_DAMAGED = ("raise", "lossless")

#: ``THDLoader(balance=...)`` by name: a pack's real tokens, or its attention work ``Σ s_i²``.
BALANCE = ("tokens", "attention")


class _Damaged:
    """A micro-batch that did not build: its DataError's message, sent from the worker as a
    value and raised again in the main process (:meth:`THDLoader._host_batches`).

    Raised in a worker, torch re-raises the error in the main process with its own first line
    ("Caught DataError in DataLoader worker process 1.") and the worker's traceback in the
    message, where the loader promises the one-line error naming the file and pack that
    ``num_workers=0`` gives."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


class _MicroBatches(Dataset):
    """Worker-side view: item ``[pack ids]`` -> this CP rank's THD row, or :class:`_Damaged`."""

    def __init__(self, dataset: PackedDataset, cp_size: int, cp_rank: int) -> None:
        self.dataset = dataset
        self.cp_size = cp_size
        self.cp_rank = cp_rank

    def __getitem__(self, indices: Sequence[int]) -> THDBatch | _Damaged:  # type: ignore[override]
        try:
            return self.dataset.micro_batch(indices, self.cp_size, self.cp_rank)
        except DataError as exc:
            return _Damaged(str(exc))


def _pack_costs(dataset: PackedDataset, balance: Any) -> np.ndarray | None:
    """The cost of every pack ``balance`` names (None: no balancing)."""
    if balance is None:
        return None
    named = isinstance(balance, str) and balance in BALANCE
    if not named and (isinstance(balance, str) or not callable(balance)):
        raise ValueError(f"balance must be None, {', '.join(map(repr, BALANCE))} or a callable "
                         f"(num_real_tokens, seqlen_sq_sum) -> cost a pack, got {balance!r}")
    tokens, squares = dataset.pack_statistics()
    costs = (tokens if balance == "tokens" else squares) if named else balance(tokens, squares)
    try:
        return checked_costs(costs, len(dataset))
    except ValueError as exc:
        raise ValueError(f"THDLoader(balance={balance!r}): {exc}") from None


def _as_is(batch: THDBatch) -> THDBatch:
    return batch


def _count(value: Any, name: str) -> int:
    """``value`` as a count (an integer >= 0, NumPy's too); ValueError otherwise (a float or a
    negative position would silently resume elsewhere)."""
    count = integer(value)
    if count is None or count < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return count


class THDLoader:
    """Iterable of :class:`THDBatch` for one rank, on ``device``; resumable.

    Args:
        dataset: a :class:`PackedDataset`.
        batch_packs: packs concatenated into each micro-batch row (``> 1`` needs CP=1:
            Bridge's CP slicing expects one physical pack per micro-batch).
        cp_size, cp_rank: context parallelism; each rank gets its zig-zag slice.
        tp_size, sequence_parallel: the run's tensor parallelism and whether sequence
            parallelism is on: with both, Megatron splits each row's tokens over the TP ranks,
            so the data must have been packed for them (``--tp``/``--sp``); checked here with
            :func:`validate_training_config`, like CP.
        dp_size, dp_rank: data parallelism (excluding CP); ranks get disjoint packs.
        seed: shuffle seed; epoch ``e`` is a permutation seeded by ``(seed, e)``.
        shuffle: False keeps the stored order.
        device: ``"cuda"`` (or ``"cuda:N"``) for pinned, stream-prefetched copies;
            ``"cpu"`` yields the worker batches directly.
        num_workers: DataLoader worker processes building batches (0 = in-process).
        pin_memory: pin host batches (only meaningful for a CUDA device).
        prefetch_factor: batches each worker keeps ready (an integer >= 1, or None for torch's
            default; unused without workers).
        on_damaged: what a micro-batch holding a damaged pack does. ``"raise"``: the
            :class:`~packer_cli.errors.DataError`, at its own position. ``"lossless"``: a warning
            naming it, and a stand-in in its place, the rank's previous micro-batch of this pass
            made lossless (:meth:`THDBatch.without_loss`; for the pass's first, the next one's),
            so that every data-parallel rank still takes ``len(loader)`` steps. Only the rank
            holding the pack sees the damage; with ``"raise"`` its peers would wait for it in
            their next collective.
        balance: None, or what each step's packs are balanced over the DP ranks by, so no
            rank waits at the gradient all-reduce for one dealt the costly packs: ``"tokens"``
            (real tokens a pack), ``"attention"`` (``Σ s_i²``), or a callable taking the arrays
            of :meth:`PackedDataset.pack_statistics` and returning a cost a pack, such as
            :func:`~packer_cli.torch.flops.flops_cost` of the model (what a step's time
            follows). The ranks get other packs of the same step; see :class:`MicroBatchSampler`.
        micro_batches_per_step: micro-batches each rank takes per optimizer step (its gradient
            accumulation): the packs balanced together. Only with ``balance``.
        balance_scope: ``"step"`` keeps each step's packs and deals them again; ``"epoch"``
            also makes each step of packs of about the same cost (the epoch sorted, then the
            steps served in a seeded order), which balances a step of one pack a rank too; a
            number of steps ``W`` does the same sorting each window of ``W`` steps, so the
            steps' make-up changes with the epoch. Only with ``balance``.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        *,
        batch_packs: int = 1,
        cp_size: int = 1,
        cp_rank: int = 0,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        dp_size: int = 1,
        dp_rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        device: str | torch.device = "cuda",
        num_workers: int = 2,
        pin_memory: bool = True,
        prefetch_factor: int = 2,
        on_damaged: str = "raise",
        balance: str | Callable[[np.ndarray, np.ndarray], Any] | None = None,
        micro_batches_per_step: int = 1,
        balance_scope: str | int = "step",
    ) -> None:
        if not isinstance(dataset, PackedDataset):  # a path or a Subset failed as a bare AttributeError
            raise TypeError(f"THDLoader needs a PackedDataset, got {type(dataset).__name__}: "
                            f"THDLoader(PackedDataset(path), ...)")
        # a float or a bool failed in a worker's first batch
        cp_size, cp_rank = cp_rank_arguments(cp_size, cp_rank)
        tp = integer(tp_size)
        if tp is None or tp < 1:
            raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
        packs = integer(batch_packs)
        if packs is None or packs < 1:  # '2' failed as a bare TypeError of the comparison below
            raise ValueError(f"bad sharding: batch_packs={batch_packs!r} (an integer >= 1)")
        batch_packs, pin_memory = packs, flag(pin_memory, "pin_memory")
        if batch_packs > 1 and cp_size > 1:
            raise ValueError(CP_MBS_ERROR)
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):  # batches would stay on the CPU without a word
            raise ValueError(f"THDLoader(device={str(device)!r}): batches are served on 'cpu' or 'cuda'; "
                             f"for another device pass device='cpu' and move each batch with batch.to(device)")
        workers, prefetch = integer(num_workers), integer(prefetch_factor)
        if workers is None or workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        # torch refuses a bad one only at the first batch, from inside its iterator
        if workers > 0 and prefetch_factor is not None and (prefetch is None or prefetch < 1):
            raise ValueError(f"prefetch_factor must be an integer >= 1 with worker processes, got {prefetch_factor!r}")
        num_workers = workers
        if on_damaged not in ON_DAMAGED:
            raise ValueError(f"on_damaged must be one of {', '.join(map(repr, ON_DAMAGED))}, got {on_damaged!r}")
        self.on_damaged = on_damaged
        if kind == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"THDLoader(device={str(device)!r}) needs CUDA, which is unavailable; pass device='cpu'")
        spec = dataset.metadata.get("spec", {})
        validate_training_config(
            seq_length=spec.get("pack_size"),
            micro_batch_size=1,  # batch_packs packs form ONE physical THD row
            context_parallel_size=cp_size,
            tensor_model_parallel_size=tp,
            sequence_parallel=flag(sequence_parallel, "sequence_parallel"),
            offline_packing=True,
            pack_size=spec.get("pack_size"),
            pad_to_max_length=bool(spec.get("pad_to_max_length", False)),
            pad_cu_seqlens=dataset.static,
            data_pad_multiple=dataset.pad_multiple,
        )
        self.dataset = dataset
        self.device = torch.device(device)
        self.cp_size, self.cp_rank = cp_size, cp_rank
        costs = _pack_costs(dataset, balance)
        self.sampler = MicroBatchSampler(
            len(dataset), batch_packs=batch_packs, dp_size=dp_size, dp_rank=dp_rank, seed=seed, shuffle=shuffle,
            costs=costs, micro_batches_per_step=micro_batches_per_step, balance_scope=balance_scope,
        )
        s = self.sampler
        one_each = s.micro_batches_per_step * s.batch_packs == 1 and s.balance_scope == "step"
        if costs is not None and (s.dp_size == 1 or one_each):
            why = ("one DP rank has no other to balance against" if s.dp_size == 1 else
                   "each rank takes one pack a step (micro_batches_per_step=1, batch_packs=1), and the step lasts "
                   "as long as its costliest pack whichever rank takes it; pass micro_batches_per_step, the "
                   "gradient accumulation, or balance_scope='epoch' (or a number of steps)")
            warnings.warn(f"THDLoader(balance={balance!r}): {why}: balancing gains nothing", stacklevel=2)
        if s.per_epoch == 0:  # a loop over it would run empty epochs without a word
            packs = counted(len(dataset), "pack")
            warnings.warn(f"THDLoader: {packs} {'makes' if len(dataset) == 1 else 'make'} no micro-batch of "
                          f"{counted(s.batch_packs, 'pack')} for each of {counted(s.dp_size, 'DP rank')}; every "
                          f"epoch is empty", stacklevel=2)
        elif s.dropped and not shuffle:  # shuffled, the dropped packs change with the epoch
            last, make, are = (("the last pack", "makes", "is") if s.dropped == 1 else
                               (f"the last {s.dropped} packs", "make", "are"))
            warnings.warn(f"THDLoader(shuffle=False): {last} of {len(dataset)} {make} no whole micro-batch for "
                          f"every DP rank and {are} never served (batch_packs={s.batch_packs}, "
                          f"dp_size={s.dp_size})", stacklevel=2)
        self._position = 0  # micro-batches handed to the caller in the current epoch
        # set_epoch() chose the epoch the next pass serves; otherwise a pass that consumed the
        # whole epoch without exhausting the iterator continues with the next epoch.
        self._epoch_chosen = False
        cuda = self.device.type == "cuda"
        self._loader = DataLoader(
            _MicroBatches(dataset, cp_size, cp_rank),
            batch_size=None,
            sampler=self.sampler,
            collate_fn=_as_is,
            num_workers=num_workers,
            pin_memory=pin_memory and cuda,
            persistent_workers=num_workers > 0,
            prefetch_factor=prefetch if num_workers > 0 else None,
        )

    # -- epochs and resume ------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``; a new epoch starts at its beginning.

        Calling it with the current epoch keeps the position, so
        ``load_state_dict(...)`` followed by the usual ``set_epoch(e)`` resumes exactly.
        """
        epoch = _count(epoch, "epoch")
        if epoch != self.sampler.epoch:
            self.sampler.epoch = epoch
            self._position = 0
        self._epoch_chosen = True

    def state_dict(self) -> dict[str, Any]:
        """Position of this rank: epoch, micro-batches consumed, what defines the order, and the
        output's fingerprint (``PackedDataset.fingerprint``), so it resumes only on that output."""
        s = self.sampler
        return {
            "output": getattr(self.dataset, "fingerprint", None),
            "epoch": s.epoch,
            "position": self._position,
            "seed": s.seed,
            "num_packs": s.num_packs,
            "batch_packs": s.batch_packs,
            "dp_size": s.dp_size,
            "dp_rank": s.dp_rank,
            "shuffle": s.shuffle,
            "balance": self._balance_state(),
        }

    def _balance_state(self) -> dict[str, Any] | None:
        """What defines a balanced order beyond the permutation: the step's size and a digest of
        the costs (a state saved balancing by other costs would resume in another order)."""
        s = self.sampler
        if s.costs is None:
            return None
        digest = hashlib.blake2b(s.costs.tobytes(), digest_size=8).hexdigest()
        return {"micro_batches_per_step": s.micro_batches_per_step, "scope": s.balance_scope, "costs": digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the last micro-batch recorded in ``state``."""
        s = self.sampler
        saved_on, mine = state.get("output"), getattr(self.dataset, "fingerprint", None)
        if saved_on is not None and mine is not None and saved_on != mine:
            # another run's packs (another seed, other inputs) at the same positions: some samples
            # served twice, others never; a state saved before fingerprints were recorded has none
            raise ValueError(f"loader state was saved reading another output (fingerprint {saved_on!r}, this "
                             f"dataset's is {mine!r}): the positions it records are of other packs")
        for key in ("seed", "num_packs", "batch_packs", "dp_size", "dp_rank", "shuffle"):
            if key in state and state[key] != getattr(s, key):
                raise ValueError(f"loader state has {key}={state[key]!r} but this loader has {getattr(s, key)!r}")
        saved, mine = state.get("balance"), self._balance_state()  # a state from before balancing has none
        if saved != mine:
            raise ValueError(f"loader state has balance={saved!r} but this loader has {mine!r}: the ranks' "
                             "packs of each step would differ from those of the run that saved it")
        missing = [key for key in ("epoch", "position") if key not in state]
        if missing:
            raise ValueError(f"loader state has no {' or '.join(missing)}")
        epoch, position = _count(state["epoch"], "epoch"), _count(state["position"], "position")
        if position > s.per_epoch:
            raise ValueError(f"loader state has position={position}, past the {s.per_epoch} micro-batches of an "
                             "epoch for this rank")
        s.epoch, self._position = epoch, position
        self._epoch_chosen = False  # the state replaces an earlier set_epoch(); a later one still counts

    # -- iteration --------------------------------------------------------------------
    def __len__(self) -> int:
        """Micro-batches per epoch for this rank."""
        return self.sampler.per_epoch

    def _host_batches(self, start: int) -> Iterator[THDBatch]:
        self.sampler.start = start
        try:
            for batch in self._loader:
                if isinstance(batch, _Damaged):
                    raise DataError(batch.message)
                yield batch
        finally:
            self.sampler.start = 0

    def __iter__(self) -> Iterator[THDBatch]:
        if not self._epoch_chosen and 0 < self.sampler.per_epoch <= self._position:
            # The last pass took every micro-batch but was not run to its end (islice, zip,
            # a break after the last step): this one starts the next epoch, not an empty pass.
            self.sampler.epoch += 1
            self._position = 0
        self._epoch_chosen = False
        if self.on_damaged == "raise":
            for batch in self._batches():
                self._position += 1
                yield batch
        else:
            yield from self._standing_in()
        self.sampler.epoch += 1  # a completed pass moves on to the next permutation
        self._position = 0

    def _batches(self, start: int | None = None) -> Iterator[THDBatch]:
        """This pass's micro-batches from ``start`` (by default the position), on the loader's device."""
        batches = self._host_batches(self._position if start is None else start)
        if self.device.type == "cuda":
            batches = cuda_prefetch(batches, self.device)
        return batches

    def _standing_in(self) -> Iterator[THDBatch]:
        """The pass with ``on_damaged="lossless"``: a damaged micro-batch is skipped and a
        lossless stand-in takes its step, so the count stays ``len(loader)``.

        The position counts steps served, stand-ins included, so a state saved between two
        stand-ins resumes at the second; the stand-in is the last good micro-batch before the
        damaged one in this pass (built again after a resume), else the next good one: the
        stream is the same, resumed or not."""
        start = self._position
        read_at = start  # the next micro-batch to read: ahead of the position while stand-ins are owed
        last: THDBatch | None = None
        looked_back = start == 0  # a resumed pass looks for its stand-in before ``start`` once
        owed: list[str] = []  # damaged micro-batches with no good one before them in this pass
        while True:
            try:
                for batch in self._batches(read_at):
                    read_at += 1
                    for _ in owed:  # the next good micro-batch stands in for them
                        self._position += 1
                        yield batch.without_loss()
                    owed.clear()
                    self._position += 1
                    last = batch
                    yield batch
                break
            except DataError as exc:
                read_at += 1  # past the damaged micro-batch
                warnings.warn(f"THDLoader: {first_line(exc)}; this rank steps on a lossless stand-in (epoch "
                              f"{self.sampler.epoch}, micro-batch {read_at - 1})", PackerWarning, stacklevel=3)
                if last is None and not looked_back:
                    last, looked_back = self._good_before(start), True
                if last is not None:
                    self._position += 1
                    yield last.without_loss()
                else:
                    owed.append(str(exc))
        if owed:  # every micro-batch of the pass was damaged: nothing to stand in with
            raise DataError(f"{owed[0]} (and no good micro-batch in this pass to stand in for it)")

    def _good_before(self, position: int) -> THDBatch | None:
        """The last micro-batch of this pass before ``position`` that builds (the stand-in a pass
        run from its start would have had), on the loader's device; None if there is none."""
        order = self.sampler.epoch_order(self.sampler.epoch)
        for k in range(position - 1, -1, -1):
            batch = self._loader.dataset[list(order[k])]
            if isinstance(batch, _Damaged):
                continue
            return batch if self.device.type == "cpu" else batch.to(self.device)
        return None

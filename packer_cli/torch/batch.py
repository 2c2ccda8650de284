"""``THDBatch``: one packed micro-batch in THD layout, ready for Megatron-core, flash-attn or HF.

THD means all sequences of the micro-batch are concatenated along one token axis of
length ``T`` (the tensors are ``[1, T]``); boundaries travel as cumulative-length vectors.
For real lengths ``[5, 3, 9]`` padded to multiples of 4 (CP=2)::

    tokens        a a a a a . . . | b b b . | c c c c c c c c c . . .      T = 24
    cu_seqlens           [0, 5, 8, 17]          real (logical) boundaries
    cu_seqlens_padded    [0, 8, 12, 24]         physical offsets, last == T
    position_ids  0 1 2 3 4 5 6 7 | 0 1 2 3 | 0 1 ... 11  (padding keeps counting)
    seq_idx       0 ...         0 | 1 ... 1 | 2 ...    2
    padding_mask  . . . . . X X X | . . . X | . ...  X X X
    max_seqlen = 12, seqlen_sq_sum = 25 + 9 + 81 = 115

Per-token tensors (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, ``padding_mask``)
are the only ones :meth:`THDBatch.for_cp_rank` slices; the boundary vectors, ``seq_idx``,
``max_seqlen`` and the host statistics always describe the whole pack, which is what
Transformer Engine expects (it divides by ``cp_size`` itself) and what a Mamba mixer under CP
takes (its all-to-all gives it the whole sequence, so ``seq_idx`` stays ``[1, T]``).

When no sequence has alignment padding, ``cu_seqlens_padded is cu_seqlens`` (one
object): consumers that test identity (TE's ``pad_between_seqs``) then keep the fast
FlashAttention path. :meth:`to`, :meth:`pin_memory` and :meth:`concat` preserve that.
Static (CUDA-graph) batches of an output with ``pad_seq_to_mult > 1`` are the exception:
they always carry a distinct ``cu_seqlens_padded``, padded or not, because a captured graph
replays one structure (a ``None`` in one step and a tensor in the next is a mismatch).

Labels are pre-shifted within each sequence (``labels[t]`` is the target of input ``t``)
and never cross a sequence boundary; padding has label ``-100`` and loss weight 0.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from packer_cli.torch._wire import from_wire, to_wire
from packer_cli.torch.cp import check_cp_boundaries, cp_partition_indices, cp_rank_arguments
from packer_cli.torch.params import make_packed_seq_params

#: Bridge's error for a CP slice of more than one physical row (gpt_step.py).
CP_MBS_ERROR = "Packed THD batches expect micro-batch size 1 for context-parallel slicing (THD layout)"

PER_TOKEN_FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "seq_idx", "padding_mask")
#: The per-token tensors a CP rank holds its share of (``seq_idx`` stays whole: see above).
CP_SLICED_FIELDS = tuple(name for name in PER_TOKEN_FIELDS if name != "seq_idx")


@dataclass
class THDBatch:
    """A packed micro-batch. Tensors are CPU until :meth:`to` moves them.

    Attributes:
        tokens: ``[1, T]`` int64 input ids (``T/CP`` after :meth:`for_cp_rank`, as labels,
            loss_mask, position_ids and padding_mask).
        labels: ``[1, T]`` int64 pre-shifted targets, ``-100`` on padding.
        loss_mask: ``[1, T]`` float32, 1 where the label is trained.
        position_ids: ``[1, T]`` int64, 0 at each segment start, counting through padding.
        seq_idx: ``[1, T]`` int32 segment index of every token (Mamba ``seq_idx``), whole
            after :meth:`for_cp_rank` too.
        padding_mask: ``[1, T]`` bool, True on alignment and tail padding.
        cu_seqlens: ``[N+1]`` int32 cumulative real lengths (longer when static). A tail
            segment counts 0 real tokens, except in a pack without alignment padding: there
            it is kept whole (attended, never trained) so one vector serves both fields. Static
            batches of an output with ``pad_seq_to_mult > 1`` always carry two vectors, so
            every pack's ``PackedSeqParams`` has the structure a captured CUDA graph replays.
        cu_seqlens_padded: ``[N+1]`` int32 physical offsets, last == T; the same object as
            ``cu_seqlens`` when no sequence is padded (never in static batches with m > 1).
        max_seqlen: longest physical segment (host int; a dataset-wide constant when static,
            never the row's length: see :func:`packer_cli.torch.build.served_max_seqlen`).
        source_index: ``[N]`` int64 sample index of each sequence in the input stream.
        num_seqs, num_real_tokens, seqlen_sq_sum, num_loss_tokens: host ints over the full
            pack, computed from real lengths before any CP slicing (``seqlen_sq_sum`` is
            ``Σ s_i²``, exact in Python ints).
        num_tokens: physical length ``T`` of the full pack (before CP).
        num_segments: segments up to the last one carrying tokens (sequences plus a tail
            segment, if any; in a row of static packs also the earlier packs' zero-length
            repeats, which sit between real segments); ``cu_seqlens[: num_segments + 1]``
            drops only the trailing static-shape repeats.
        num_packs: how many stored packs were concatenated into this row.
        cp_size, cp_rank: the CP slice this batch holds (1, 0 when unsliced).
        host_cu_seqlens, host_cu_seqlens_padded: CPU copies of the boundary vectors, kept by
            :meth:`to` when it moves the batch off the CPU (None on a CPU batch: the vectors
            themselves are host memory). Read them through :attr:`cu_seqlens_cpu` and
            :attr:`cu_seqlens_padded_cpu`: host code never reads boundaries back from the GPU.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    seq_idx: torch.Tensor
    padding_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    source_index: torch.Tensor
    num_seqs: int
    num_real_tokens: int
    seqlen_sq_sum: int
    num_loss_tokens: int
    num_tokens: int
    num_segments: int
    num_packs: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    host_cu_seqlens: torch.Tensor | None = None
    host_cu_seqlens_padded: torch.Tensor | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_row(cls, row: Any, meta: dict, *, static: bool = False) -> "THDBatch":
        """Build the batch of one stored pack (see :func:`packer_cli.torch.build.build_thd_batch`)."""
        from packer_cli.torch.build import build_thd_batch

        return build_thd_batch(row, meta, static=static)

    @classmethod
    def concat(cls, batches: list["THDBatch"]) -> "THDBatch":
        """Concatenate whole (unsliced) packs into one THD row; boundaries are offset."""
        from packer_cli.torch.build import concat_batches

        return concat_batches(batches)

    # ------------------------------------------------------------------ properties
    @property
    def has_padding(self) -> bool:
        """True when the padded boundaries are a distinct tensor: some sequence has alignment
        padding, or the batch is static with ``pad_seq_to_mult > 1`` (which always has one)."""
        return self.cu_seqlens_padded is not self.cu_seqlens

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    # ------------------------------------------------------------------ pickling
    def __reduce__(self):
        """A CPU batch pickles as one byte buffer (a DataLoader worker's batch crosses to the
        main process as one copy, not a shared-memory segment per tensor: see
        :mod:`packer_cli.torch._wire`); a batch on another device field by field."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if any(t.device.type != "cpu" for t in self.tensors()):
            return _from_fields, (type(self), fields)
        if not self.has_padding:
            del fields["cu_seqlens_padded"]  # it is cu_seqlens: _from_wire restores the identity
        return _from_wire, (type(self), *to_wire(fields, self.tensor_fields()))

    def __copy__(self) -> "THDBatch":
        """A shallow copy shares the tensors (``copy.copy`` would otherwise go through :meth:`__reduce__`)."""
        return dataclasses.replace(self)

    def without_loss(self) -> "THDBatch":
        """The same batch with nothing to train: ``loss_mask`` all 0, ``num_loss_tokens`` 0.

        The stand-in ``THDLoader(on_damaged="lossless")`` serves for a micro-batch holding a
        damaged pack: every data-parallel rank must take the same number of steps. Shapes,
        boundaries, device and the tensors other than ``loss_mask`` are shared with this batch
        (what static shapes and captured graphs expect); the token loss adds nothing and no
        gradient, as long as it is normalised by a count summed over ranks (a rank dividing by
        its own zero count gets NaN). Auxiliary losses that ignore ``loss_mask`` (MoE load
        balancing, z-loss) still see the tokens."""
        return dataclasses.replace(self, loss_mask=torch.zeros_like(self.loss_mask), num_loss_tokens=0)

    # ------------------------------------------------------------------ tensor plumbing
    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "THDBatch":
        """Apply ``fn`` to every tensor, keeping ``cu_seqlens_padded is cu_seqlens``, and the
        boundaries' host copies: those of a CPU batch leaving the CPU, None back on it."""
        changes: dict[str, Any] = {name: fn(getattr(self, name)) for name in self.tensor_fields()}
        changes.setdefault("cu_seqlens_padded", changes["cu_seqlens"])
        if changes["cu_seqlens"].device.type == "cpu":
            changes.update(host_cu_seqlens=None, host_cu_seqlens_padded=None)
        elif self.cu_seqlens.device.type == "cpu":
            changes.update(host_cu_seqlens=self.cu_seqlens, host_cu_seqlens_padded=self.cu_seqlens_padded)
        return dataclasses.replace(self, **changes)

    @property
    def cu_seqlens_cpu(self) -> torch.Tensor | None:
        """``cu_seqlens`` in host memory without a device sync: the vector itself on a CPU
        batch, the copy :meth:`to` kept on a device batch (None for one built on the device)."""
        return self.cu_seqlens if self.cu_seqlens.device.type == "cpu" else self.host_cu_seqlens

    @property
    def cu_seqlens_padded_cpu(self) -> torch.Tensor | None:
        """``cu_seqlens_padded`` in host memory, as :attr:`cu_seqlens_cpu`."""
        if self.cu_seqlens_padded.device.type == "cpu":
            return self.cu_seqlens_padded
        return self.host_cu_seqlens_padded

    def tensor_fields(self) -> list[str]:
        """The names of the batch's distinct tensors (the shared boundary vector once)."""
        names = [*PER_TOKEN_FIELDS, "source_index", "cu_seqlens"]
        return names + ["cu_seqlens_padded"] if self.has_padding else names

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct tensor of the batch (the shared boundary vector once)."""
        return [getattr(self, name) for name in self.tensor_fields()]

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> "THDBatch":
        """Copy every tensor to ``device``; host ints stay host ints.

        ``non_blocking`` defaults to True towards an accelerator (an asynchronous copy from
        pinned memory, see :meth:`pin_memory`; no host sync) and False towards the CPU: a
        non-blocking copy from the GPU returns host memory the DMA may not have filled yet.
        """
        if non_blocking is None:
            non_blocking = torch.device(device).type != "cpu"
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "THDBatch":
        """Pinned copy; ``torch.utils.data.DataLoader(pin_memory=True)`` calls this."""
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        """Tell the CUDA caching allocator that ``stream`` uses these tensors."""
        for t in self.tensors():
            t.record_stream(stream)

    # ------------------------------------------------------------------ context parallel
    def for_cp_rank(self, cp_size: int, cp_rank: int) -> "THDBatch":
        """This rank's ``T/cp_size`` tokens (TE zig-zag); boundaries and stats stay global.

        Runs on the batch's device without a sync. On CPU tensors it also checks that every
        physical boundary is divisible by ``2 * cp_size`` (a device check would sync).
        """
        cp_size, cp_rank = cp_rank_arguments(cp_size, cp_rank)
        if cp_size == 1:
            return self
        if self.num_packs > 1:
            raise ValueError(CP_MBS_ERROR)
        if self.cp_size != 1:
            raise ValueError(f"batch is already sliced for CP rank {self.cp_rank} of {self.cp_size}")
        if self.cu_seqlens_padded.device.type == "cpu":  # a device check would sync
            check_cp_boundaries(self.cu_seqlens_padded, self.num_tokens, cp_size)
        idx = cp_partition_indices(self.cu_seqlens_padded, self.num_tokens, cp_size, cp_rank)
        changes = {name: getattr(self, name).index_select(1, idx) for name in CP_SLICED_FIELDS}
        return dataclasses.replace(self, cp_size=cp_size, cp_rank=cp_rank, **changes)

    # ------------------------------------------------------------------ consumers
    def packed_seq_params(self, *, with_total_tokens: bool = False) -> Any:
        """Megatron-core ``PackedSeqParams`` (or the field-compatible stand-in), ``qkv_format="thd"``.

        Padded fields are set when ``cu_seqlens_padded`` is a distinct tensor (some sequence
        is padded, or the batch is static with ``pad_seq_to_mult > 1``). ``with_total_tokens``
        passes the physical length so Megatron builds ``seq_idx`` for Mamba layers.
        """
        return make_packed_seq_params(
            self.cu_seqlens,
            self.cu_seqlens_padded,
            self.max_seqlen,
            total_tokens=self.num_tokens if with_total_tokens else None,
        )

    def flash_attn_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``flash_attn_varlen_func`` on the (unsliced) THD row.

        FA2 segments must be contiguous, so these are the **physical** boundaries: each
        sequence's alignment padding sits after its real tokens inside its own segment,
        which is exact for causal attention (no real query sees it; its loss is 0). For
        bidirectional attention use :meth:`packed_seq_params` (real + padded vectors).
        """
        self._check_whole_row("flash_attn_kwargs")
        return {
            "cu_seqlens_q": self.cu_seqlens_padded,
            "cu_seqlens_k": self.cu_seqlens_padded,
            "max_seqlen_q": self.max_seqlen,
            "max_seqlen_k": self.max_seqlen,
        }

    def hf_kwargs(self) -> dict[str, Any]:
        """Inputs for a Hugging Face causal LM in padding-free mode (batch dim 1, no mask).

        ``position_ids`` restart at 0 per segment, which is how HF finds boundaries.
        ``labels`` are -100 where not trained. They are already shifted, so they are also
        passed as ``shift_labels``: recent transformers' ``ForCausalLMLoss`` then uses them
        as-is instead of shifting again (a second shift would cross sequence boundaries).
        ``use_cache=False``: with a KV cache (most configs' default, in training too)
        transformers' sdpa and eager attention do not look for packed sequences in
        ``position_ids`` and attend across them. ``cu_seq_lens_q/k`` and ``max_length_q/k``
        (the boundaries of :meth:`flash_attn_kwargs`) spare its flash-attention path finding
        them from ``position_ids`` in every layer, a few device syncs each; sdpa and eager
        ignore them. A transformers whose loss takes no ``shift_labels`` (before 4.50) would
        shift the labels again, silently: refused (:func:`_hf_loss_takes_shift_labels`).
        """
        self._check_whole_row("hf_kwargs")
        _refuse_hf_without_shift_labels()
        labels = torch.where(self.loss_mask > 0, self.labels, torch.full_like(self.labels, -100))
        return {
            "input_ids": self.tokens,
            "labels": labels,
            "shift_labels": labels,
            "position_ids": self.position_ids,
            "use_cache": False,
            "cu_seq_lens_q": self.cu_seqlens_padded,
            "cu_seq_lens_k": self.cu_seqlens_padded,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    def _check_whole_row(self, consumer: str) -> None:
        """flash-attn and HF take boundaries over the tokens they are given, but a CP slice keeps
        the whole pack's boundaries: flash-attn would index past its tokens, HF would find
        sequences in zig-zag positions. Only Transformer Engine slices for CP itself."""
        if self.cp_size != 1:
            raise ValueError(
                f"{consumer}() needs the whole THD row, but this batch is CP rank {self.cp_rank} of "
                f"{self.cp_size}'s slice: use packed_seq_params() (Transformer Engine handles CP), or cp_size=1"
            )


#: the transformers release whose ``ForCausalLMLoss`` first takes ``shift_labels``
HF_SHIFT_LABELS_SINCE = "4.50"


def _refuse_hf_without_shift_labels() -> None:
    """Older transformers swallow ``shift_labels`` in the model's ``**kwargs`` and shift
    ``labels`` themselves: every input would be trained on the token two ahead, and a
    sequence's last input on the next sequence's first target, with no error."""
    transformers = sys.modules.get("transformers")  # a model to feed means it is imported
    if transformers is None or _hf_loss_takes_shift_labels():
        return
    raise RuntimeError(
        f"hf_kwargs(): transformers {getattr(transformers, '__version__', '?')} shifts the labels itself and "
        f"ignores shift_labels (taken since {HF_SHIFT_LABELS_SINCE}): the loss would be trained on the wrong "
        "tokens. Upgrade transformers, or compute the loss from the model's logits and b.labels (docs/LOADER.md)"
    )


@functools.lru_cache(maxsize=1)
def _hf_loss_takes_shift_labels() -> bool:
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # before 4.46 each model shifted inline
        return False
    return "shift_labels" in inspect.signature(ForCausalLMLoss).parameters


def _from_fields(cls: type, fields: dict) -> THDBatch:
    return cls(**fields)


def _from_wire(cls: type, host: dict, layout: list, payload: bytearray) -> THDBatch:
    fields = from_wire(host, layout, payload)
    fields.setdefault("cu_seqlens_padded", fields["cu_seqlens"])
    return cls(**fields)

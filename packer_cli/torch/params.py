"""``PackedSeqParams``: Megatron-core's when importable, else a field-compatible stand-in.

Megatron-core's attention (Transformer Engine ``DotProductAttention``) receives packed
boundaries as a ``megatron.core.packed_seq_params.PackedSeqParams`` dataclass. When
megatron-core is installed, :func:`packed_seq_params_class` returns that class; otherwise it
returns :class:`PackedSeqParams` below, which has the same field names and defaults, so code
written against one works with the other (``params.cu_seqlens_q``, ``params.max_seqlen_q``...).

Two rules from TE decide how fast attention runs:

* ``max_seqlen_q/kv`` must be Python ints. With ``None`` TE computes them with ``.item()``,
  a device sync per step that CUDA-graph capture forbids.
* TE decides ``pad_between_seqs`` from the padded fields: ``None`` (or the same object as
  the unpadded field) means "no padding between sequences" and keeps FlashAttention
  eligible; a distinct tensor selects cuDNN/FA3. So the padded fields are set only when
  the caller passes a distinct padded tensor: when some sequence really has alignment
  padding, and in static (CUDA-graph) batches with ``pad_seq_to_mult > 1``, which need one
  structure on every step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PackedSeqParams:
    """Stand-in for ``megatron.core.packed_seq_params.PackedSeqParams`` (same fields).

    Attributes mirror Megatron-core: ``cu_seqlens_q/kv`` are cumulative real lengths
    (int32, on the attention device), ``cu_seqlens_q/kv_padded`` cumulative physical
    offsets, ``max_seqlen_q/kv`` host ints over the full (pre-CP) pack, ``total_tokens``
    the physical length (Megatron builds ``seq_idx`` from it for Mamba layers).
    """

    qkv_format: str | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    local_cp_size: int | None = None
    cp_group: Any = None
    total_tokens: int | None = None
    seq_idx: torch.Tensor | None = None
    tokens_per_sample: int | None = None
    pad_between_seqs: bool | None = None
    cp_scatter_cache: object = None


def packed_seq_params_class() -> type:
    """Megatron-core's ``PackedSeqParams`` if it imports, else this module's stand-in."""
    try:
        from megatron.core.packed_seq_params import PackedSeqParams as MCorePackedSeqParams
    except Exception:  # ImportError, or a broken optional install: fall back quietly
        return PackedSeqParams
    return MCorePackedSeqParams


def make_packed_seq_params(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    max_seqlen: int,
    total_tokens: int | None = None,
) -> Any:
    """Build a THD ``PackedSeqParams`` without touching device values.

    Args:
        cu_seqlens: cumulative real lengths, used for both ``q`` and ``kv`` (same object).
        cu_seqlens_padded: cumulative physical offsets, or ``None`` / the same object as
            ``cu_seqlens`` when no sequence has alignment padding (then the padded fields
            stay ``None`` so TE keeps FlashAttention eligible).
        max_seqlen: longest physical segment of the full pack, a Python int.
        total_tokens: physical length; pass it only for Mamba/hybrid models (Megatron then
            builds ``seq_idx`` in ``__post_init__``), as Bridge does. Dropped when the class
            has no such field (Megatron-core releases up to 0.16 at least).
    """
    cls = packed_seq_params_class()
    padded = None if cu_seqlens_padded is None or cu_seqlens_padded is cu_seqlens else cu_seqlens_padded
    kwargs: dict[str, Any] = dict(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
    )
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    # Released Megatron-core (0.16) has no total_tokens/seq_idx; only newer ones build seq_idx.
    if total_tokens is not None and "total_tokens" in names:
        kwargs["total_tokens"] = int(total_tokens)
    if "cp_partition_mode" in names:  # newer Megatron-core: our partition is TE's zig-zag
        kwargs["cp_partition_mode"] = "zigzag"
    return cls(**kwargs)

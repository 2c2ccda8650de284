"""Context-parallel (CP) partition of a packed THD row, identical to Transformer Engine.

Under context parallelism every rank holds ``T / cp_size`` of the pack's ``T`` tokens.
The split is TE's "dual chunk" (zig-zag) rule, applied to every sequence separately:

* each physical segment of length ``p_i`` (a multiple of ``2 * cp_size``) is cut into
  ``2 * cp_size`` equal chunks of ``c_i = p_i / (2 * cp_size)`` tokens;
* rank ``r`` keeps chunk ``r`` and chunk ``2 * cp_size - 1 - r`` of every segment, in that
  order, and segments stay in pack order.

Pairing an early chunk with a late one balances the causal attention work across ranks.
The function below returns the same ``int32`` index vector as TE's
``thd_get_partitioned_indices(cu_seqlens, total_tokens, world_size, rank)``, including
for zero-length segments (the repeated boundaries of a static-shape ``cu_seqlens``),
but it is pure torch: it runs on CPU (in a DataLoader worker) or on GPU, and reads no
value back to the host.

Example (``cu_seqlens_padded = [0, 8, 12, 24]``, CP=2)::

    >>> cp_partition_indices(torch.tensor([0, 8, 12, 24]), 24, 2, 0).tolist()
    [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23]
"""

from __future__ import annotations

import numpy as np
import torch

from packer_cli.torch._ints import integer


def cp_partition_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Token indices of CP rank ``cp_rank`` in a THD row of ``total_tokens`` tokens.

    Args:
        cu_seqlens_padded: 1-D int32/int64 physical boundaries ``[0, p_0, p_0+p_1, ...]``.
            Every entry must be divisible by ``2 * cp_size`` and the last must equal
            ``total_tokens`` (as in TE, an uncovered tail gives undefined indices).
            Repeated entries (zero-length segments) are allowed.
        total_tokens: ``T``, the physical length of the row (a Python int, so no sync).
        cp_size: the context-parallel world size (``>= 1``).
        cp_rank: this rank, ``0 <= cp_rank < cp_size``.

    Returns:
        ``int32`` tensor of shape ``[total_tokens // cp_size]`` on the device of
        ``cu_seqlens_padded``: use it with ``index_select(1, idx)`` on ``[1, T]`` tensors.

    With ``cp_size == 1`` (no context parallelism) the rank holds the whole row:
    ``arange(total_tokens)``, whatever the segments' lengths.

    Raises:
        ValueError: on bad sizes or ranks (checked with host ints only), and on CPU where
            the segments' chunks do not add up to ``total_tokens / cp_size`` (torch finds
            it while sizing the output). The per-entry divisibility is the caller's
            contract, as in TE, because checking it would read the tensor back (a device
            sync); :func:`check_cp_boundaries` checks it, for a caller that may read.
    """
    cp_size, cp_rank = cp_rank_arguments(cp_size, cp_rank)
    total = integer(total_tokens)
    if total is None or total < 0:
        raise ValueError(f"total_tokens must be an integer >= 0, got {total_tokens!r}")
    total_tokens = total
    if not isinstance(cu_seqlens_padded, torch.Tensor) or cu_seqlens_padded.dim() != 1 \
            or cu_seqlens_padded.numel() < 2:
        raise ValueError("cu_seqlens_padded must be a 1-D tensor with at least 2 entries")
    if cu_seqlens_padded.dtype not in (torch.int32, torch.int64):  # a dtype check reads no data
        raise ValueError(f"cu_seqlens_padded must be int32 or int64, got {cu_seqlens_padded.dtype}")
    if cp_size == 1:
        return torch.arange(total_tokens, dtype=torch.int32, device=cu_seqlens_padded.device)
    two_cp = 2 * cp_size
    if total_tokens % two_cp:
        raise ValueError(f"total_tokens={total_tokens} is not divisible by 2*cp_size={two_cp}")

    # On CPU the same steps run in NumPy: torch's repeat_interleave opens a parallel region
    # however small its input (with two intra-op threads 430-490 us for 64 runs against 8 us with
    # one: a CP-sliced micro-batch built in the training process, num_workers=0, was 4-12x
    # slower), and each of torch's small ops costs microseconds where NumPy's cost a few hundred ns.
    on_cpu = cu_seqlens_padded.device.type == "cpu"
    cu = cu_seqlens_padded.to(torch.int64)
    if on_cpu:
        cu = cu.numpy()
    stack = np.stack if on_cpu else torch.stack
    chunk = (cu[1:] - cu[:-1]) // two_cp  # c_i: chunk size of segment i
    # Each segment contributes two contiguous runs of c_i tokens to this rank: the
    # concatenation of those runs, in order, is the answer. Zero-length segments add
    # empty runs, so static-shape repeats need no special case.
    run_start = stack((cu[:-1] + cp_rank * chunk, cu[:-1] + (two_cp - 1 - cp_rank) * chunk), 1).reshape(-1)
    run_len = stack((chunk, chunk), 1).reshape(-1)
    run_offset = (np.cumsum(run_len) if on_cpu else torch.cumsum(run_len, 0)) - run_len  # where each run lands
    local = total_tokens // cp_size
    try:
        if on_cpu:
            return torch.from_numpy((_repeat(run_start - run_offset, run_len, local) + np.arange(local))
                                    .astype(np.int32))
        # output_size is a host int, so repeat_interleave needs no device sync to size its output
        shift = torch.repeat_interleave(run_start - run_offset, run_len, output_size=local)
    except RuntimeError as exc:  # the runs do not fill the output: a segment is not a multiple of 2*CP
        raise ValueError(f"cu_seqlens_padded's segments do not split into {two_cp} equal chunks each covering "
                         f"total_tokens={total_tokens} ({exc}): every boundary must be divisible by "
                         f"2*cp_size={two_cp}, none below the one before, and the last one be total_tokens") from None
    return (shift + torch.arange(local, device=cu.device)).to(torch.int32)


def _repeat(values: np.ndarray, counts: np.ndarray, size: int) -> np.ndarray:
    """``values[i]`` ``counts[i]`` times each; RuntimeError, as torch's ``repeat_interleave``
    raises, unless that makes exactly ``size`` entries."""
    if (counts < 0).any():  # its sum may still be size: "the runs make 6 entries, not 6" said nothing
        raise RuntimeError("a segment's chunk is negative: the boundaries decrease")
    if int(counts.sum()) != size:
        raise RuntimeError(f"the runs make {int(counts.sum())} entries, not {size}")
    return np.repeat(values, counts)


def cp_rank_arguments(cp_size, cp_rank) -> tuple[int, int]:
    """``(cp_size, cp_rank)`` as ints; ValueError unless ``cp_size >= 1`` and ``0 <= cp_rank < cp_size``."""
    size, rank = integer(cp_size), integer(cp_rank)
    if size is None or rank is None or size < 1 or not 0 <= rank < size:
        raise ValueError(f"cp_size must be an integer >= 1 and cp_rank one of 0..cp_size-1, got cp_size="
                         f"{cp_size!r}, cp_rank={cp_rank!r}")
    return size, rank


def check_cp_boundaries(cu: torch.Tensor, total_tokens: int, cp_size: int) -> None:
    """ValueError naming the first boundary of ``cu`` not divisible by ``2 * cp_size``, or a
    last one that is not ``total_tokens``. It reads ``cu`` back: a sync on a device tensor. With
    ``cp_size == 1`` any boundaries do (the rank holds the whole row)."""
    cp_size, _ = cp_rank_arguments(cp_size, 0)
    if cp_size == 1:
        return
    two_cp = 2 * cp_size
    bad = torch.nonzero(torch.remainder(cu, two_cp)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"cu_seqlens_padded[{i}] = {int(cu[i])} is not divisible by 2*cp_size={two_cp}: every "
                         f"sequence must be padded to a multiple of {two_cp} (pack the data with --cp "
                         f"{cp_size}; in-batch, pad_to_multiple_of=pad_multiple(cp={cp_size}))")
    if int(cu[-1]) != total_tokens:
        raise ValueError(f"cu_seqlens_padded ends at {int(cu[-1])}, but total_tokens is {total_tokens}")


def cp_partition_reference(cu_seqlens_padded: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """The obvious loop form of the same rule, kept as a test oracle and for reading.

    For each segment ``[o, o + p)``, with ``c = p // (2 * cp_size)``, rank ``r`` takes
    ``range(o + r*c, o + (r+1)*c)`` then ``range(o + (2cp-1-r)*c, o + (2cp-r)*c)``.
    """
    out: list[int] = []
    two_cp = 2 * cp_size
    for o, e in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:]):
        c = (e - o) // two_cp
        out.extend(range(o + cp_rank * c, o + (cp_rank + 1) * c))
        out.extend(range(o + (two_cp - 1 - cp_rank) * c, o + (two_cp - cp_rank) * c))
    return out

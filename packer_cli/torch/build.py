"""Turn one stored pack (numpy arrays) into a :class:`~packer_cli.torch.batch.THDBatch`.

A stored row holds, for each sequence ``i`` with real length ``s_i`` and physical length
``p_i`` (a multiple of the pad multiple), its ``s_i`` input tokens then ``p_i - s_i``
alignment pads; the label-aligned ``loss_mask``; the physical ``cu_seqlens``; ``seq_lens``;
and ``last_token`` (the label of the last input token). Labels are rebuilt per sequence::

    j in [o, o + s_i - 1)  -> tokens[j + 1]        (o = cu_seqlens[i])
    j == o + s_i - 1       -> last_token[i]
    padding                -> -100

With ``spec.pad_to_max_length`` the row is extended to ``pack_size`` by one tail segment
(pad tokens, label -100, loss 0, ``padding_mask`` True, positions restarting at 0).

Everything here is vectorized numpy on host arrays: this runs in DataLoader workers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from packer_cli.torch.batch import THDBatch


class StaticShapeError(ValueError):
    """Static (CUDA-graph) shapes were asked for but the data or metadata cannot give them."""


def static_shape(meta: dict) -> tuple[int, int, int]:
    """``(T, len(cu_seqlens), max_seqlen)`` for static-shape batches of this output.

    ``T`` is ``spec.pack_size``; boundaries have ``max_samples_per_bin + 2`` entries (a
    leading 0, up to ``max_samples_per_bin`` sequences, one tail segment); ``max_seqlen``
    is Bridge's ``max(dataset_max_seqlen, pack_size - min_packed_seqlen)``, which bounds
    every sequence and the tail segment, except where that bound is ``T`` itself (a sequence
    fills a pack: truncated, split or exactly C long): there it is ``T + m`` (``T + 1`` where
    ``m == T``), see :func:`served_max_seqlen`.
    """
    spec = meta.get("spec", {})
    if not spec.get("pad_to_max_length", False):
        raise StaticShapeError(
            "static shapes need every pack padded to pack_size: repack with pad_to_max_length=True "
            "(pad_cu_seqlens requires pad_to_max_length)"
        )
    bridge = meta.get("bridge") or {}
    needed = ("max_samples_per_bin", "dataset_max_seqlen", "min_packed_seqlen")
    missing = [k for k in needed if bridge.get(k) is None]
    if missing or spec.get("pack_size") is None:
        raise StaticShapeError(
            f"static shapes need metadata.json 'bridge' keys {list(needed)} and spec.pack_size; "
            f"missing: {missing or ['spec.pack_size']}"
        )
    t = int(spec["pack_size"])
    cu_len = int(bridge["max_samples_per_bin"]) + 2
    bound = max(int(bridge["dataset_max_seqlen"]), t - int(bridge["min_packed_seqlen"]))
    return t, cu_len, served_max_seqlen(bound, t, _recorded_multiple(spec) or 1)


def _recorded_multiple(spec: dict) -> int | None:
    """The spec's ``pad_seq_to_mult`` where it is a usable one (an int >= 1), else None."""
    multiple = spec.get("pad_seq_to_mult")
    return multiple if type(multiple) is int and multiple >= 1 else None


def served_max_seqlen(bound: int, pack_size: int, multiple: int) -> int:
    """The constant ``max_seqlen`` static batches carry: ``bound`` (the longest segment a pack
    can hold), raised past ``pack_size`` where it equals it.

    Megatron-core's unfused THD RoPE (``apply_rope_fusion=False``, its default) sizes its
    rotary table by ``max_seqlen`` and, when that length equals the row's ``cu_seqlens[-1]``,
    reads the table as covering the whole row: it then rotates each sequence from its offset in
    the pack instead of from 0. A static row is ``T = k·pack_size`` tokens long, so the served
    value must be no multiple of ``pack_size``: ``pack_size + multiple`` (still divisible by
    2·CP), or ``pack_size + 1`` where ``multiple == pack_size`` (Transformer Engine's CP code
    floor-divides it by 2·CP, which still gives the chunks' length). A larger ``max_seqlen`` is
    still an upper bound for Transformer Engine and flash-attn.
    """
    if bound < pack_size:
        return bound
    return pack_size + (multiple if multiple < pack_size else 1)


def _check_row(row: Any, tokens: np.ndarray, loss: np.ndarray, cu: np.ndarray, s: np.ndarray, p: np.ndarray,
               multiple: int | None, pad_id: int) -> None:
    """What a damaged row would otherwise turn into a batch silently (a flipped offset or
    length, a mask value that would weight the loss): ``ValueError`` naming the first problem."""
    if cu.size < 1 or cu[0] != 0 or cu[-1] != tokens.size or loss.size != tokens.size:
        raise ValueError(
            f"malformed pack: cu_seqlens must start at 0 and end at len(tokens)={tokens.size} "
            f"(got {cu[:1].tolist()}..{cu[-1:].tolist()}), len(loss_mask)={loss.size}"
        )
    if s.size != p.size or (p < s).any() or (s < 1).any():
        raise ValueError(f"malformed pack: need 1 <= seq_lens <= physical lengths, got {s.tolist()} vs {p.tolist()}")
    for name in ("last_token", "source_index", "source_offset"):
        values = getattr(row, name, None)
        if values is not None and len(values) != s.size:
            raise ValueError(f"malformed pack: {len(values)} {name} entries for {s.size} sequences")
    if multiple is not None and (p % multiple).any():
        k = int(np.flatnonzero(p % multiple)[0])
        raise ValueError(f"malformed pack: sequence {k} spans {p[k]} tokens, not a multiple of pad_seq_to_mult="
                         f"{multiple}")
    if multiple is not None and (p - s >= multiple).any():
        # Each sequence is padded to the next multiple, never further: a real length lowered
        # by m or more still passes the checks above but would turn real tokens into padding.
        k = int(np.flatnonzero(p - s >= multiple)[0])
        raise ValueError(f"malformed pack: sequence {k} has {s[k]} real tokens in {p[k]}, more padding than "
                         f"pad_seq_to_mult={multiple} allows")
    _check_padding(tokens, loss, cu, s, p, pad_id)
    if loss.size and loss.dtype != np.bool_ and _not_zero_or_one(loss):
        bad = int(np.flatnonzero((loss != 0) & (loss != 1))[0])
        raise ValueError(f"malformed pack: loss_mask holds {loss[bad]} at token {bad}, not 0 or 1")
    if tokens.size and tokens.dtype.kind == "i" and int(tokens.min()) < 0:  # pack refuses them in its inputs
        bad = int(np.flatnonzero(tokens < 0)[0])
        raise ValueError(f"malformed pack: token {bad} has the id {tokens[bad]}, a negative one")
    last = getattr(row, "last_token", None)  # each sequence's final label: trained where its mask is 1
    if last is not None and len(last) and int(np.min(last)) < 0:
        k = int(np.flatnonzero(np.asarray(last) < 0)[0])
        raise ValueError(f"malformed pack: sequence {k} has the last_token {last[k]}, a negative id")


def _not_zero_or_one(loss: np.ndarray) -> bool:
    """Whether an integer or float mask holds a value other than 0 and 1. Integers are judged by
    their range alone (two reductions); a float mask needs each value compared, else 0.5 or 1.5
    (or NaN) would pass a range check and weight the loss."""
    if loss.dtype.kind in "iu":
        return int(loss.max()) > 1 or (loss.dtype.kind == "i" and int(loss.min()) < 0)
    return bool(((loss != 0) & (loss != 1)).any())


def _check_padding(tokens: np.ndarray, loss: np.ndarray, cu: np.ndarray, s: np.ndarray, p: np.ndarray,
                   pad_id: int) -> None:
    """Each sequence's alignment padding (its last ``p - s`` slots) holds ``pad_id`` with loss 0,
    as stored: a real length lowered within the padding would otherwise train its last real
    token's label as a pad and its real tokens as padding. (One raised within the padding reads
    as a real token equal to ``pad_id``: only verify's checksums see that.)"""
    pads = p - s
    total = int(pads.sum())
    if not total:
        return
    first = np.repeat(cu[:-1] + s - (np.cumsum(pads) - pads), pads)
    slots = first + np.arange(total)
    wrong = (tokens[slots] != pad_id) | (loss[slots] != 0)
    if wrong.any():
        j = int(slots[np.flatnonzero(wrong)[0]])
        k = int(np.searchsorted(cu, j, side="right") - 1)
        raise ValueError(f"malformed pack: sequence {k} has {s[k]} real tokens in {p[k]}, but its padding slot at "
                         f"token {j} holds {tokens[j]} with loss {int(loss[j])}, not pad_id={pad_id} with loss 0")


def _check_sources(row: Any, meta: dict) -> None:
    """Source indices point at input records: ``0 <= i < counts.records`` where that is recorded."""
    index = np.asarray(row.source_index)
    if not index.size:
        return
    counts = meta.get("counts")
    records = counts.get("records") if isinstance(counts, dict) else None
    lo, hi = int(index.min()), int(index.max())
    if lo < 0 or (type(records) is int and hi >= records):
        raise ValueError(f"malformed pack: source_index {lo if lo < 0 else hi} is not one of the {records} input "
                         "records")


def build_thd_batch(row: Any, meta: dict, *, static: bool = False) -> THDBatch:
    """Build the CPU :class:`THDBatch` of one stored pack.

    Args:
        row: object with numpy arrays ``tokens, loss_mask, cu_seqlens, seq_lens,
            last_token, source_index`` (the reader's row).
        meta: the output's ``metadata.json`` (``spec.pad_id``, ``spec.pack_size``,
            ``spec.pad_to_max_length``; the ``bridge`` keys when ``static``).
        static: CUDA-graph shapes: ``T = pack_size``, boundaries extended to
            ``max_samples_per_bin + 2`` entries by repeating their last value, and a
            constant ``max_seqlen`` (see :func:`static_shape`).
    """
    spec = meta.get("spec", {})
    pad_id = int(spec.get("pad_id", 0))
    tokens_in = np.asarray(row.tokens)
    loss_in = np.asarray(row.loss_mask)
    cu_in = np.asarray(row.cu_seqlens, dtype=np.int64)
    s = np.asarray(row.seq_lens, dtype=np.int64)
    p = np.diff(cu_in)
    multiple = _recorded_multiple(spec)
    _check_row(row, tokens_in, loss_in, cu_in, s, p, multiple, pad_id)
    n = s.size
    phys = int(cu_in[-1])

    if static:
        t, cu_len, static_max = static_shape(meta)
    elif spec.get("pad_to_max_length", False):
        t = int(spec["pack_size"])
    else:
        t = phys
    capacity = spec.get("pack_size")
    limit = min(t, capacity) if type(capacity) is int else t  # no pack holds more than C, padded or not
    if phys > limit:
        raise ValueError(f"pack has {phys} physical tokens, more than pack_size={limit}")
    _check_sources(row, meta)
    tail = t - phys

    # Segments: the sequences, then the tail (if any). seg_real is what is trained/attended
    # for labels and padding_mask; the tail has no real tokens.
    seg_p = np.append(p, tail) if tail else p
    seg_real = np.append(s, 0) if tail else s
    nseg = seg_p.size
    # Static batches replay one CUDA graph, so every pack must have the same structure: where
    # sequences are aligned (m > 1) some packs have padding, so all carry two vectors.
    aligned = multiple is not None and multiple > 1
    padded = bool((p != s).any()) or (static and aligned)

    cu_pad = np.zeros(nseg + 1, dtype=np.int64)
    np.cumsum(seg_p, out=cu_pad[1:])
    if padded:
        cu_real = np.zeros(nseg + 1, dtype=np.int64)
        np.cumsum(seg_real, out=cu_real[1:])
    else:
        # No alignment padding (and not static with m > 1): the tail is kept as an ordinary
        # (attended, untrained) segment so one vector serves both fields and TE keeps
        # FlashAttention eligible.
        cu_real = cu_pad

    seg = np.repeat(np.arange(nseg, dtype=np.int32), seg_p)  # [T] segment of each token
    pos = np.arange(t, dtype=np.int64)
    pos -= np.repeat(cu_pad[:-1], seg_p)  # restarts at 0 at every segment start
    padding_mask = pos >= np.repeat(seg_real, seg_p)

    tok = np.empty(t, dtype=np.int64)
    tok[:phys] = tokens_in
    tok[phys:] = pad_id
    # labels[j] = tokens[j + 1] inside a sequence, last_token at its last input, -100 on
    # padding. labels[-1] is always covered: a row ends on a last input or on padding.
    labels = np.empty(t, dtype=np.int64)
    labels[:-1] = tok[1:]
    labels[cu_pad[:n] + s - 1] = np.asarray(row.last_token, dtype=np.int64)
    labels[padding_mask] = -100
    loss = np.zeros(t, dtype=np.float32)
    loss[:phys] = loss_in
    loss[padding_mask] = 0.0

    max_seqlen = int(seg_p.max()) if nseg else 0
    if static:
        if nseg + 1 > cu_len:
            raise StaticShapeError(
                f"pack has {nseg} segments but metadata max_samples_per_bin allows {cu_len - 2} (+1 tail)"
            )
        if max_seqlen > static_max:
            raise StaticShapeError(
                f"segment of {max_seqlen} tokens exceeds the static max_seqlen {static_max} from metadata"
            )
        cu_pad = np.concatenate([cu_pad, np.full(cu_len - nseg - 1, cu_pad[-1])])
        cu_real = cu_pad if not padded else np.concatenate([cu_real, np.full(cu_len - nseg - 1, cu_real[-1])])
        max_seqlen = static_max

    cu_pad_t = torch.from_numpy(cu_pad.astype(np.int32))
    cu_real_t = cu_pad_t if cu_real is cu_pad else torch.from_numpy(cu_real.astype(np.int32))
    return THDBatch(
        tokens=torch.from_numpy(tok).view(1, t),
        labels=torch.from_numpy(labels).view(1, t),
        loss_mask=torch.from_numpy(loss).view(1, t),
        position_ids=torch.from_numpy(pos).view(1, t),
        seq_idx=torch.from_numpy(seg).view(1, t),
        padding_mask=torch.from_numpy(padding_mask).view(1, t),
        cu_seqlens=cu_real_t,
        cu_seqlens_padded=cu_pad_t,
        max_seqlen=max_seqlen,
        source_index=torch.from_numpy(np.array(row.source_index, dtype=np.int64)),
        num_seqs=n,
        num_real_tokens=int(s.sum()),
        seqlen_sq_sum=int((s * s).sum()),
        num_loss_tokens=int(np.count_nonzero(loss)),
        num_tokens=t,
        num_segments=nseg,
    )


def _real_boundaries(b: THDBatch) -> torch.Tensor:
    """``b``'s real boundaries with its tail (and any static filler) as length-0 segments.

    A pack without alignment padding carries one vector, ``cu_seqlens is cu_seqlens_padded``,
    whose tail segment counts as real (see :class:`THDBatch`). Joined into a row that has
    padding, so two vectors, that tail must count 0 as every other pack's does, or the real
    vector holds tokens ``num_real_tokens`` and ``seqlen_sq_sum`` leave out."""
    if b.has_padding or b.cu_seqlens.numel() - 1 == b.num_seqs:
        return b.cu_seqlens
    real = b.cu_seqlens.clone()
    real[b.num_seqs + 1:] = real[b.num_seqs]  # on the batch's device: no host read
    return real


def concat_batches(batches: list[THDBatch]) -> THDBatch:
    """One THD row from several whole packs (micro-batch of ``len(batches)`` packs, CP=1).

    Token tensors are concatenated; each pack's boundaries are offset by the physical
    (resp. real) length before it and its leading 0 dropped; ``seq_idx`` is offset by the
    number of boundary segments before it so it still indexes ``cu_seqlens``.
    """
    if len(batches) == 0:
        raise ValueError("concatenate at least one pack (got an empty list)")
    if len(batches) == 1:
        return batches[0]
    if any(b.cp_size != 1 for b in batches):
        raise ValueError("concatenate packs before slicing them for a CP rank")
    cat = lambda name: torch.cat([getattr(b, name) for b in batches], dim=1)  # noqa: E731
    off_pad = off_seg = 0
    off_real = torch.zeros((), dtype=torch.int32, device=batches[0].cu_seqlens.device)  # no host read
    padded = any(b.has_padding for b in batches)
    cu_pad, cu_real, seq_idx = [batches[0].cu_seqlens_padded[:1]], [batches[0].cu_seqlens[:1]], []
    segments = 0
    for b in batches:
        real = _real_boundaries(b) if padded else b.cu_seqlens
        cu_pad.append(b.cu_seqlens_padded[1:] + off_pad)
        cu_real.append(real[1:] + off_real)
        seq_idx.append(b.seq_idx + off_seg)
        segments = off_seg + b.num_segments
        off_pad += b.num_tokens
        off_real = off_real + real[-1]
        off_seg += b.cu_seqlens.numel() - 1
    cu_pad_t = torch.cat(cu_pad)
    cu_real_t = torch.cat(cu_real) if padded else cu_pad_t
    return THDBatch(
        tokens=cat("tokens"),
        labels=cat("labels"),
        loss_mask=cat("loss_mask"),
        position_ids=cat("position_ids"),
        seq_idx=torch.cat(seq_idx, dim=1),
        padding_mask=cat("padding_mask"),
        cu_seqlens=cu_real_t,
        cu_seqlens_padded=cu_pad_t,
        max_seqlen=max(b.max_seqlen for b in batches),
        source_index=torch.cat([b.source_index for b in batches]),
        num_seqs=sum(b.num_seqs for b in batches),
        num_real_tokens=sum(b.num_real_tokens for b in batches),
        seqlen_sq_sum=sum(b.seqlen_sq_sum for b in batches),
        num_loss_tokens=sum(b.num_loss_tokens for b in batches),
        num_tokens=off_pad,
        num_segments=segments,
        num_packs=sum(b.num_packs for b in batches),
    )

"""In-batch packing: turn a right-padded ``[B, S]`` micro-batch into one THD row.

This is the VLM path, where samples are not packed offline: the collator gives a padded
``[B, S]`` batch and it is packed on the fly. Semantics follow Megatron-Bridge's
``pack_batch_sequences``:

* Row length: the number of non-zero entries of ``padding_mask[i]`` when a mask is given (a
  mask that is not right padding, a real token after a padded one, is a ValueError), else
  the index of the last token ``!= pad_token_id`` plus one. Empty rows are dropped.
* Each length is rounded up to ``pad_to_multiple_of`` (``lcm(2*CP, CP*TP with SP)``), and
  ``cu_seqlens`` uses the **padded** lengths so THD RoPE and CP slicing line up.
* Added padding: token ``pad_token_id``, label -100, loss 0, positions continuing from the
  row's last position + 1.

Example: rows of lengths 3 and 5 with ``pad_to_multiple_of=2`` give ``cu_seqlens = [0, 4, 10]``
and ``max_seqlen = 6``.

Unlike offline packing this needs one host read (the lengths decide the output shape);
run it at collate time, not in the step.
"""

from __future__ import annotations

import logging

import torch

from packer_cli.torch._ints import integer

logger = logging.getLogger(__name__)


def _row_lengths(tokens: torch.Tensor, pad_token_id: int, padding_mask: torch.Tensor | None) -> torch.Tensor:
    if padding_mask is not None:  # nonzero = real (a mask of 0/2 or -1 still counts tokens, not weights)
        return (padding_mask != 0).sum(dim=1)
    width = tokens.shape[1]
    if width == 0:
        return torch.zeros(tokens.shape[0], dtype=torch.int64, device=tokens.device)
    nonpad = tokens != pad_token_id
    # index of the last non-pad token + 1, via argmax over the reversed row; 0 if none
    last_from_end = torch.argmax(nonpad.flip(1).to(torch.int8), dim=1)
    return torch.where(nonpad.any(dim=1), width - last_from_end, torch.zeros_like(last_from_end))


def _after_padding(padding_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``[B, S-1]``: where a real token follows padding (all False for right padding)."""
    if padding_mask is None or padding_mask.shape[1] < 2:
        return torch.zeros((), dtype=torch.int64, device=device)
    real = padding_mask != 0
    return real[:, 1:] & ~real[:, :-1]


def _refuse_left_padding(padding_mask: torch.Tensor) -> None:
    """A row whose real tokens do not all come first: read from column 0 for the mask's count,
    its padding would be packed as content and its last real tokens dropped."""
    row, col = torch.nonzero(_after_padding(padding_mask, padding_mask.device))[0].tolist()
    raise ValueError(f"padding_mask row {row} has a real token at column {col + 1} after padding: the batch must "
                     "be right-padded (each row's real tokens first)")


def _holds_ignored_label(dtype: torch.dtype) -> bool:
    """Whether labels of ``dtype`` can hold -100."""
    if dtype.is_floating_point or dtype.is_complex:
        return True
    return dtype != torch.bool and torch.iinfo(dtype).min <= -100


def pack_batch_sequences(
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    padding_mask: torch.Tensor | None = None,
) -> tuple[
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
    None,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """Pack the rows of a right-padded batch into one ``[1, total]`` THD row.

    Args:
        tokens: ``[B, S]`` token ids, right-padded with ``pad_token_id``.
        labels, loss_mask: ``[B, S]`` or ``None`` (non-last pipeline stages); ``None``
            passes through.
        attention_mask: ignored; the packed row has none (boundaries replace it).
        position_ids: ``[B, S]`` positions (may be expanded views).
        pad_token_id: padding token id, used to find lengths without a mask.
        pad_to_multiple_of: each row's length is rounded up to this multiple.
        padding_mask: optional ``[B, S]`` mask, True/1 on real tokens (the collator's
            attention mask); the count of its non-zero entries in a row is that row's length.

    Returns:
        ``(tokens, labels, loss_mask, None, position_ids, cu_seqlens, max_seqlen)`` with
        ``[1, total]`` tensors in the input dtypes, ``cu_seqlens`` int32 ``[rows+1]`` over
        padded lengths, and ``max_seqlen`` a 0-dim int32 tensor; all on the input device.
        An all-padding batch logs a warning and gives ``[1, 0]`` tensors, ``cu_seqlens=[0]``
        and ``max_seqlen=0``.
    """
    del attention_mask  # replaced by cu_seqlens
    multiple = integer(pad_to_multiple_of)
    if multiple is None or multiple < 1:
        raise ValueError(f"pad_to_multiple_of must be an integer >= 1, got {pad_to_multiple_of!r}")
    pad_to_multiple_of = multiple
    pad = integer(pad_token_id)
    if pad is None:
        raise TypeError(f"pad_token_id must be an integer, got {pad_token_id!r}")
    pad_token_id = pad
    for name, t in (("tokens", tokens), ("position_ids", position_ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be a [B, S] tensor, got shape {list(tokens.shape)}")
    if not tokens.dtype.is_floating_point and not tokens.dtype.is_complex and tokens.dtype != torch.bool:
        info = torch.iinfo(tokens.dtype)
        if not info.min <= pad_token_id <= info.max:  # the padding is filled with it
            raise ValueError(f"pad_token_id {pad_token_id} does not fit the tokens' dtype {tokens.dtype} "
                             f"({info.min}..{info.max})")
    for name, t in (("labels", labels), ("loss_mask", loss_mask), ("position_ids", position_ids),
                    ("padding_mask", padding_mask)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
        if t is not None and t.shape != tokens.shape:
            raise ValueError(f"{name} has shape {list(t.shape)}, but tokens has {list(tokens.shape)}")
    if labels is not None and not _holds_ignored_label(labels.dtype):
        # the padding's labels are -100 (ignored by the loss): an unsigned type would wrap it
        raise TypeError(f"labels of dtype {labels.dtype} cannot hold -100, the ignored label of the padding")
    device = tokens.device
    width = tokens.shape[1]
    lengths = _row_lengths(tokens, pad_token_id, padding_mask)
    keep = lengths > 0  # empty rows are dropped
    padded_all = (lengths + pad_to_multiple_of - 1) // pad_to_multiple_of * pad_to_multiple_of  # 0 if empty
    # The one host read: the output's length and row count depend on the data (and whether the
    # mask is right padding, which a row's count read from column 0 needs).
    total, kept, gaps = torch.stack((padded_all.sum(), keep.sum(), _after_padding(padding_mask, device).sum())).tolist()
    if gaps:
        _refuse_left_padding(padding_mask)
    # The kept rows in order, by a stable sort rather than a boolean mask (each mask is one more sync).
    rows = torch.argsort((~keep).to(torch.int8), stable=True)[:kept]
    lens = lengths[rows]
    padded = padded_all[rows]
    cu = torch.zeros(kept + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(padded, 0).to(torch.int32)

    if total == 0:
        logger.warning("pack_batch_sequences: every row is padding; returning an empty packed batch")
        empty = lambda t: None if t is None else t.new_empty((1, 0))  # noqa: E731
        return (
            empty(tokens),
            empty(labels),
            empty(loss_mask),
            None,
            empty(position_ids),
            cu,
            torch.zeros((), dtype=torch.int32, device=device),
        )

    seg = torch.repeat_interleave(torch.arange(rows.numel(), device=device), padded, output_size=total)
    j = torch.arange(total, device=device) - cu[:-1].to(torch.int64)[seg]  # offset in the row
    row = rows[seg]
    seg_len = lens[seg]
    real = j < seg_len
    col = torch.minimum(j, torch.full_like(j, width - 1))  # padding may run past S

    def gather(t: torch.Tensor, fill: float | int) -> torch.Tensor:
        vals = t[row, col]
        return torch.where(real, vals, torch.full_like(vals, fill))

    last_pos = position_ids[row, seg_len - 1]
    pos = torch.where(real, position_ids[row, col], last_pos + (j - seg_len + 1))
    out_labels = None if labels is None else gather(labels, -100).view(1, total)
    out_loss = None if loss_mask is None else gather(loss_mask, 0).view(1, total)
    max_seqlen = padded.max().to(torch.int32)
    return (
        gather(tokens, pad_token_id).view(1, total),
        out_labels,
        out_loss,
        None,
        pos.to(position_ids.dtype).view(1, total),
        cu,
        max_seqlen,
    )

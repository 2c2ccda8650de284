"""Compiled gather: copy each packed sequence's tokens and targets out of the spill files.

The kernel works on flat arrays only (no Python objects), one memcpy-like loop per sequence,
and releases the GIL so reading, gathering and writing can overlap on separate threads.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _gather_kernel(spill_tokens, spill_targets, sample_start, seq_sample, seq_offset, seq_len, seq_pad,
                   pack_seq_offsets, pad_id, out_tokens, out_mask, out_last, out_cu):
    pos = 0
    cu_pos = 0
    for k in range(pack_seq_offsets.size - 1):
        pack_start = pos
        out_cu[cu_pos] = 0
        cu_pos += 1
        for i in range(pack_seq_offsets[k], pack_seq_offsets[k + 1]):
            src = sample_start[seq_sample[i]] + seq_offset[i]
            s = seq_len[i]
            for j in range(s):
                out_tokens[pos + j] = spill_tokens[src + j]
                out_mask[pos + j] = spill_targets[src + 1 + j]  # label-aligned: target of token j+1
            for j in range(s, seq_pad[i]):
                out_tokens[pos + j] = pad_id
                out_mask[pos + j] = 0
            out_last[i] = spill_tokens[src + s]
            pos += seq_pad[i]
            out_cu[cu_pos] = pos - pack_start
            cu_pos += 1


def gather_packs(spill_tokens, spill_targets, sample_start, seq_sample, seq_offset, seq_len, seq_pad,
                 pack_seq_offsets, pad_id):
    """Build the flat per-token and per-sequence values of a run of packs.

    Sequence arrays are in output order; ``pack_seq_offsets`` (len P+1) delimits each pack's
    sequences. Returns ``tokens`` (int32), ``loss_mask`` (uint8, label-aligned), ``last_token``
    (int32 per sequence) and ``cu_seqlens`` (int32, N_k+1 entries per pack, concatenated).
    """
    total = int(seq_pad.sum())
    n_seq = seq_pad.size
    n_packs = pack_seq_offsets.size - 1
    out_tokens = np.empty(total, dtype=np.int32)
    out_mask = np.empty(total, dtype=np.uint8)
    out_last = np.empty(n_seq, dtype=np.int32)
    out_cu = np.empty(n_seq + n_packs, dtype=np.int32)
    _gather_kernel(spill_tokens, spill_targets, sample_start, seq_sample, seq_offset, seq_len, seq_pad,
                   pack_seq_offsets, np.int32(pad_id), out_tokens, out_mask, out_last, out_cu)
    return out_tokens, out_mask, out_last, out_cu

"""Compiled loops of the audit: the only work proportional to the number of tokens.

* :func:`scan_sequences` — verify's one pass over every sequence's tokens and loss mask;
* :func:`compare_pieces` — ``verify --source``: packed pieces against their source samples;
* :func:`segment_sums`  — per-sample sums of target flags.

Everything else is per pack or per sequence and done with NumPy. Each kernel walks slices
indexed from 0 (so LLVM drops negative-index handling and vectorizes the hot reductions: about
0.2 ns per token for the scan) and expects its ranges to be in bounds: callers check
``cu_seqlens`` and lengths first.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _scan_kernel(tokens, mask, start, mstart, real, padded, pad_id, targets, mask_bits, tok_bits, tok_max, pad_loss,
                 pad_tok):
    for i in range(start.size):
        s = real[i]
        # Slices indexed from 0 let LLVM drop negative-index handling and vectorize the loop.
        tk = tokens[start[i]:start[i] + s]
        mk = mask[mstart[i]:mstart[i] + s]
        t = np.int64(0)
        bits = np.uint8(0)
        orv = np.int32(0)
        hi = np.int32(-2147483648)
        for j in range(s):
            v = mk[j]
            t += v
            bits |= v
            x = tk[j]
            orv |= x
            hi = max(hi, x)
        loss = 0
        wrong = 0
        pt = tokens[start[i] + s:start[i] + padded[i]]
        pm = mask[mstart[i] + s:mstart[i] + padded[i]]
        for j in range(pt.size):
            loss += pm[j] != 0
            wrong += pt[j] != pad_id
        targets[i] = t
        mask_bits[i] = bits
        tok_bits[i] = orv
        tok_max[i] = hi
        pad_loss[i] = loss
        pad_tok[i] = wrong


def scan_sequences(tokens: np.ndarray, mask: np.ndarray, start: np.ndarray, mask_start: np.ndarray,
                   real: np.ndarray, padded: np.ndarray, pad_id: int) -> dict[str, np.ndarray]:
    """Per-sequence facts from the flat ``tokens`` (int32) and ``loss_mask`` (uint8) values.

    Sequence ``i`` occupies ``[start[i], start[i] + padded[i])`` of the flat tokens (and the
    same length from ``mask_start[i]`` of the mask), its first ``real[i]`` positions real.
    Returns, over the real positions, ``targets`` (Σ loss mask), ``mask_bits`` (OR of the mask
    values: > 1 means a value other than 0/1), ``tok_bits`` (OR of the ids: negative means some
    id is negative) and ``tok_max``; over the padding, ``pad_loss`` (positions with loss) and
    ``pad_tok`` (tokens other than ``pad_id``). Bitwise ORs instead of min/max keep the hot loop
    a plain reduction the compiler vectorizes.
    """
    n = start.size
    out = {
        "targets": np.empty(n, np.int64), "mask_bits": np.empty(n, np.uint8),
        "tok_bits": np.empty(n, np.int32), "tok_max": np.empty(n, np.int32),
        "pad_loss": np.empty(n, np.int64), "pad_tok": np.empty(n, np.int64),
    }
    _scan_kernel(np.ascontiguousarray(tokens, dtype=np.int32), np.ascontiguousarray(mask, dtype=np.uint8),
                 start.astype(np.int64), mask_start.astype(np.int64), real.astype(np.int64),
                 padded.astype(np.int64), np.int32(pad_id),
                 out["targets"], out["mask_bits"], out["tok_bits"], out["tok_max"], out["pad_loss"], out["pad_tok"])
    return out


@njit(cache=True, nogil=True)
def _first_diff(a, b):
    """Index of the first position where ``a`` and ``b`` differ (same length), or -1."""
    for j in range(a.size):
        if a[j] != b[j]:
            return j
    return -1


@njit(cache=True, nogil=True)
def _compare_kernel(src_tok, src_tgt, src_start, pk_tok, pk_mask, pk_start, pk_mstart, lens, tok_diff, tgt_diff):
    for i in range(lens.size):
        n = lens[i]
        tok_diff[i] = _first_diff(src_tok[src_start[i]:src_start[i] + n], pk_tok[pk_start[i]:pk_start[i] + n])
        # labels: the target flag of the next source token
        tgt_diff[i] = _first_diff(src_tgt[src_start[i] + 1:src_start[i] + 1 + n],
                                  pk_mask[pk_mstart[i]:pk_mstart[i] + n])


def compare_pieces(src_tok: np.ndarray, src_tgt: np.ndarray, src_start: np.ndarray, pk_tok: np.ndarray,
                   pk_mask: np.ndarray, pk_start: np.ndarray, pk_mstart: np.ndarray,
                   lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First differing position of each packed piece against its source, or −1 when equal.

    Piece ``i`` is ``lens[i]`` runtime positions: packed tokens from ``pk_start[i]`` must equal
    source tokens from ``src_start[i]``, and the packed (label-aligned) loss mask from
    ``pk_mstart[i]`` must equal the source's input-aligned target flags from ``src_start[i] + 1``.
    Returns ``(token_diff, target_diff)``.
    """
    tok_diff = np.empty(lens.size, np.int64)
    tgt_diff = np.empty(lens.size, np.int64)
    _compare_kernel(src_tok, src_tgt, src_start.astype(np.int64), pk_tok, pk_mask, pk_start.astype(np.int64),
                    pk_mstart.astype(np.int64), lens.astype(np.int64), tok_diff, tgt_diff)
    return tok_diff, tgt_diff


@njit(cache=True, nogil=True)
def _segment_sums_kernel(values, starts, ends, out):
    for i in range(starts.size):
        seg = values[starts[i]:ends[i]]
        t = np.int64(0)
        for j in range(seg.size):
            t += seg[j]
        out[i] = t


def segment_sums(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``values[starts[i]:ends[i]].sum()`` for every i, as int64 (empty segments give 0)."""
    out = np.empty(starts.size, np.int64)
    _segment_sums_kernel(values, starts.astype(np.int64), ends.astype(np.int64), out)
    return out

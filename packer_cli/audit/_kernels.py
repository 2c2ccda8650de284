"""Compiled loops of the audit: the only work proportional to the number of tokens.

* :func:`scan_sequences` — verify's one pass over every sequence's tokens and loss mask;
* :func:`fingerprints`   — ``verify --source``: a 64-bit fingerprint of each sequence's values,
  taken as the shards stream past and compared with the source's, so no shard stays mapped;
* :func:`segment_sums`  — per-sample sums of target flags.

Everything else is per pack or per sequence and done with NumPy. Each kernel walks slices
indexed from 0 (so LLVM drops negative-index handling and vectorizes the hot reductions: about
0.2 ns per token for the scan) and expects its ranges to be in bounds: callers check
``cu_seqlens`` and lengths first.
"""
from __future__ import annotations

import numpy as np

from packer_cli._kernel_cache import njit


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


_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)


@njit(cache=True, nogil=True, inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(cache=True, nogil=True, inline="always")
def _round(acc, value):
    """xxHash64's lane round: a bijection of ``value`` for a fixed ``acc`` and of ``acc`` for a
    fixed ``value``, so changing any one value always changes the fingerprint."""
    return _rotl(acc + np.uint64(value) * _P2, 31) * _P1


@njit(cache=True, nogil=True)
def _fingerprint(values, start, n):
    """Fingerprint of ``values[start:start + n]`` taken as int64s (any integer dtype gives the
    same result for the same numbers): four independent lanes, so the multiplications of
    consecutive values overlap, then the length, then a final avalanche."""
    v = values[start:start + n]
    a0, a1, a2, a3 = _P1 + _P2, _P2, np.uint64(0), np.uint64(0) - _P1
    j = 0
    while j + 4 <= n:
        a0 = _round(a0, np.int64(v[j]))
        a1 = _round(a1, np.int64(v[j + 1]))
        a2 = _round(a2, np.int64(v[j + 2]))
        a3 = _round(a3, np.int64(v[j + 3]))
        j += 4
    h = _rotl(a0, 1) + _rotl(a1, 7) + _rotl(a2, 12) + _rotl(a3, 18) + np.uint64(n)
    while j < n:
        h = _round(h, np.int64(v[j]))
        j += 1
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    h ^= h >> np.uint64(32)
    return h


@njit(cache=True, nogil=True)
def _fingerprints_kernel(values, starts, lens, out):
    for i in range(starts.size):
        out[i] = _fingerprint(values, starts[i], lens[i])


def fingerprints(values: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``uint64`` fingerprint of ``values[starts[i]:starts[i] + lens[i]]`` for every i.

    The numbers, not their dtype, decide it: int32 tokens in a shard and int64 tokens from a
    source give the same fingerprint when they hold the same ids. Two sequences that differ in
    one value always get different fingerprints; any other difference goes unnoticed with
    probability about 2⁻⁶⁴.
    """
    out = np.empty(starts.size, np.uint64)
    _fingerprints_kernel(values, starts.astype(np.int64), lens.astype(np.int64), out)
    return out


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

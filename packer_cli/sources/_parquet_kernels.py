"""Compiled decoding of Parquet's RLE / bit-packing hybrid (levels and dictionary indices).

The hybrid stream is a run of ``varint header`` + payload pairs: header ``h`` with its low bit
set is ``h >> 1`` groups of 8 values bit-packed little-endian at ``bit_width`` bits each;
otherwise it is ``h >> 1`` copies of one value stored in ``ceil(bit_width / 8)`` bytes.
Repetition and definition levels and dictionary indices all use it. Every read is checked
against the end of its buffer: a corrupt page returns an error code, never reads out of bounds.
"""
from __future__ import annotations

import numpy as np
from numba import njit

TRUNCATED = -1  # the stream ends before n values
BAD_WIDTH = -2  # bit width over 32
INDEX_RANGE = -3  # a dictionary index past the dictionary
# The values decode, but the stream is not what writers produce: bytes left over after the
# last value, or a last bit-packed run whose padding is cut short. Valid files do not look
# like this, damaged ones (a wrong bit width, say) often do; the caller lets pyarrow judge.
UNUSUAL = -4

MESSAGES = {TRUNCATED: "encoded values end early", BAD_WIDTH: "bit width over 32",
            INDEX_RANGE: "dictionary index out of range"}

NO_DICTIONARY = np.zeros(0, dtype=np.int64)


_U8 = np.uint64(8)


@njit(cache=True, nogil=True, inline="always")
def _word(buf, p):
    """The 8 bytes at ``buf[p:]`` as one little-endian integer.

    Unsigned indices matter: with them LLVM folds the eight byte loads into one (a signed index
    keeps NumPy's negative-index check on every byte).
    """
    word = np.uint64(0)
    for k in range(8):
        word |= np.uint64(buf[p + np.uint64(k)]) << (_U8 * np.uint64(k))
    return word


@njit(cache=True, nogil=True, inline="always")
def _put(out, i, value, dictionary, mapped):
    """Store one decoded value (through the dictionary when ``mapped``); False if it is out of range."""
    if mapped:
        if value >= np.uint64(dictionary.size):
            return False
        out[i] = dictionary[value]
    else:
        out[i] = value
    return True


@njit(cache=True, nogil=True, inline="always")
def _fill(out, i, count, value, dictionary, mapped):
    """``out[i:i+count]`` = one value (through the dictionary when ``mapped``); False if out of range."""
    if mapped:
        if value >= dictionary.size:
            return False
        out[i:i + count] = dictionary[value]
    else:
        out[i:i + count] = value
    return True


@njit(cache=True, nogil=True, inline="always")
def _unpack_words(buf, pos, hi, bit_width, take, out, i, dictionary, mapped):
    """Unpack bit-packed values ``0 .. j`` of the run at ``pos`` (those whose 8-byte word lies in
    the buffer) into ``out[i:]``; returns j, or -1 for a dictionary index out of range."""
    width = np.uint64(bit_width)
    mask = (np.uint64(1) << width) - np.uint64(1)
    base = np.uint64(pos)
    limit = min(take, ((hi - pos - 8) * 8) // bit_width + 1) if hi - pos >= 8 else 0
    for j in range(limit):
        bit = np.uint64(j) * width
        value = (_word(buf, base + (bit >> np.uint64(3))) >> (bit & np.uint64(7))) & mask
        if not _put(out, i + j, value, dictionary, mapped):
            return -1
    return limit


@njit(cache=True, nogil=True)
def _decode(buf, lo, hi, bit_width, n, out, dictionary, mapped):
    if bit_width > 32:
        return BAD_WIDTH
    value_bytes = (bit_width + 7) // 8
    mask = (np.int64(1) << bit_width) - 1
    pos = lo
    i = 0
    short_run = False
    while i < n:
        header = np.int64(0)
        shift = 0
        while True:
            if pos >= hi or shift > 28:
                return TRUNCATED
            byte = np.int64(buf[pos])
            pos += 1
            header |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        count = header >> 1
        if header & 1:  # bit-packed groups of 8
            count *= 8
            take = min(count, n - i)
            if pos + (take * bit_width + 7) // 8 > hi:
                return TRUNCATED
            if pos + (count * bit_width) // 8 > hi:
                short_run = True  # writers pad the last group; see UNUSUAL
            if bit_width == 0:  # every value is 0
                if not _fill(out, i, take, 0, dictionary, mapped):
                    return INDEX_RANGE
            else:  # whole 8-byte words while they lie inside the buffer, then byte by byte
                j = _unpack_words(buf, pos, hi, bit_width, take, out, i, dictionary, mapped)
                if j < 0:
                    return INDEX_RANGE
                while j < take:
                    bit = j * bit_width
                    value = np.int64(0)
                    for b in range(((bit & 7) + bit_width + 7) // 8):
                        value |= np.int64(buf[pos + (bit >> 3) + b]) << (8 * b)
                    if not _put(out, i + j, np.uint64((value >> (bit & 7)) & mask), dictionary, mapped):
                        return INDEX_RANGE
                    j += 1
            pos += (count * bit_width) // 8  # the run's full length (its last group may be padding)
        else:  # one value repeated
            if pos + value_bytes > hi:
                return TRUNCATED
            value = np.int64(0)
            for j in range(value_bytes):
                value |= np.int64(buf[pos + j]) << (8 * j)
            pos += value_bytes
            take = min(count, n - i)
            if not _fill(out, i, take, value & mask, dictionary, mapped):
                return INDEX_RANGE
        i += take
    if short_run or pos != hi:
        return UNUSUAL
    return pos


@njit(cache=True, nogil=True)
def hybrid_decode(buf, lo, hi, bit_width, n, out):
    """Decode ``n`` values of the hybrid stream ``buf[lo:hi]`` into ``out[:n]`` (levels).

    Returns ``hi`` (the stream ends with its last value), or a negative code.
    """
    return _decode(buf, lo, hi, bit_width, n, out, NO_DICTIONARY, False)


@njit(cache=True, nogil=True)
def dictionary_decode(buf, lo, hi, bit_width, n, dictionary, out):
    """Decode ``n`` dictionary indices of ``buf[lo:hi]`` and store ``dictionary[index]`` in ``out[:n]``.

    Returns ``hi``, or a negative code (INDEX_RANGE for an index past the dictionary).
    """
    return _decode(buf, lo, hi, bit_width, n, out, dictionary, True)

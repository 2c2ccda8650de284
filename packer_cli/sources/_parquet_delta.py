"""Compiled decoding of Parquet's DELTA_BINARY_PACKED integers (which Parquet v2 writers such as
parquet-mr's, Spark's and DuckDB's use for integer columns, e.g. once a dictionary grows too large).

A stream is a header and blocks::

    header: <block size> <miniblocks a block> <value count> <first value>   (varints; the first
            value zigzag-encoded)
    block:  <min delta (zigzag varint)> <one bit width byte a miniblock> <miniblocks>

Each miniblock holds ``block size / miniblocks`` deltas less the block's min delta, bit-packed
little-endian at its bit width, and is stored whole (a last one short of values is padded).
Value ``i`` is value ``i - 1`` plus its delta, in the wrapping arithmetic of the column's
physical type (32 or 64 bits). Miniblocks after the last value may be left out.

Every read is checked against the end of the values, and every position only grows: a
truncated stream returns an error code, never reads out of bounds. A stream writers do not
produce returns UNUSUAL, and pyarrow then reads the file and judges it: a block size that is not
a multiple of 128, miniblocks of other than a multiple of 32 values, a bit width above the
type's (in any miniblock of a block, used or not), another value count than the page's, bytes
left after the last miniblock, or a varint wider than pyarrow reads it (header fields 32 bits,
the first value and min deltas the column's 32 or 64 bits, in at most 5 or 10 bytes): a value
that silently lost its high bits would read as other data where pyarrow stops.
"""
from __future__ import annotations

import numpy as np

from packer_cli._kernel_cache import njit
from packer_cli._unaligned import load_u64
from packer_cli.sources._parquet_kernels import TRUNCATED, UNUSUAL

_ONE = np.uint64(1)


@njit(cache=True, nogil=True, inline="always")
def _uvarint(buf, pos, hi, bits):
    """(the unsigned varint at ``pos`` as uint64, position after it, status): status 0, TRUNCATED
    when it runs past ``hi``, or UNUSUAL when it does not fit ``bits`` (32 or 64) bits in the
    bytes that takes (5 or 10), as pyarrow's reader reads a varint of the column's type."""
    value = np.uint64(0)
    for k in range((bits + 6) // 7):
        if pos >= hi:
            return value, pos, TRUNCATED
        byte = np.uint64(buf[pos])
        pos += 1
        value |= (byte & np.uint64(0x7F)) << np.uint64(7 * k)
        if byte < np.uint64(0x80):
            if 7 * k + 7 > bits and byte >> np.uint64(bits - 7 * k) != np.uint64(0):
                return value, pos, UNUSUAL  # bits past the type's width in its last byte
            return value, pos, 0
    return value, pos, UNUSUAL  # longer than the type's varints


@njit(cache=True, nogil=True, inline="always")
def _unzigzag(z):
    """The signed value a zigzag-encoded uint64 stands for, as uint64 bits (arithmetic wraps)."""
    return (z >> _ONE) ^ (np.uint64(0) - (z & _ONE))


@njit(cache=True, nogil=True, inline="always")
def _signed(bits, sign):
    """The value of a physical type held in the low ``64 - sign`` of ``bits``, sign-extended."""
    return np.int64(bits << sign) >> np.int64(sign)


@njit(cache=True, nogil=True, inline="always")
def _bits_at(buf, base, bit, width, hi):
    """The ``width`` bits (1..64) at bit ``bit`` of the bytes from ``base`` (all inside ``hi``)."""
    at = base + (bit >> 3)
    shift = bit & 7
    if width <= 56 and at + 8 <= hi:  # one unaligned load holds them
        word = load_u64(np.uint64(buf.ctypes.data) + np.uint64(at))
        return (word >> np.uint64(shift)) & ((_ONE << np.uint64(width)) - _ONE)
    value = np.uint64(0)
    got = 0
    while got < width:  # byte by byte: near the end of the values, or widths over 56 bits
        take = min(8 - shift, width - got)
        part = (np.uint64(buf[at]) >> np.uint64(shift)) & ((_ONE << np.uint64(take)) - _ONE)
        value |= part << np.uint64(got)
        got += take
        at += 1
        shift = 0
    return value


@njit(cache=True, nogil=True, inline="always")
def _header(buf, pos, hi, bits):
    """The header's four varints (block size, miniblocks a block and value count, each 32-bit;
    the zigzag first value, of the column's ``bits``), the position after them and a status."""
    fields = np.zeros(4, np.uint64)
    status = 0
    for k in range(4):
        fields[k], pos, status = _uvarint(buf, pos, hi, bits if k == 3 else 32)
        if status:
            break
    return fields, pos, status


@njit(cache=True, nogil=True)
def delta_decode(buf, lo, hi, n, bits, out):
    """Decode the ``n`` values of the DELTA_BINARY_PACKED stream ``buf[lo:hi]`` of a ``bits``-bit
    (32 or 64) physical type into ``out[:n]`` (int32 or int64). Returns ``hi``, TRUNCATED or
    UNUSUAL."""
    header, pos, status = _header(buf, lo, hi, bits)
    if status:
        return status
    block, minis, total, first = header[0], header[1], header[2], header[3]
    if (block == 0 or block % np.uint64(128) or minis == 0 or block % minis
            or (block // minis) % np.uint64(32) or total != np.uint64(n)):
        return UNUSUAL
    per_mini = np.int64(block // minis)
    keep = ~np.uint64(0) if bits == 64 else np.uint64(0xFFFFFFFF)
    sign = np.uint64(64 - bits)
    last = _unzigzag(first) & keep
    if n:
        out[0] = _signed(last, sign)
    i = 1
    while i < n:
        min_delta, pos, status = _uvarint(buf, pos, hi, bits)
        if status:
            return status
        step = _unzigzag(min_delta)
        widths = pos
        pos += np.int64(minis)
        if pos > hi:
            return TRUNCATED
        for m in range(np.int64(minis)):  # every width of the block, as pyarrow checks them all
            if np.int64(buf[widths + m]) > bits:
                return UNUSUAL
        for m in range(np.int64(minis)):
            if i >= n:
                break
            width = np.int64(buf[widths + m])
            take = min(per_mini, n - i)
            if pos + (take * width + 7) // 8 > hi:
                return TRUNCATED
            if 0 < width <= 56 and pos + (take * width) // 8 + 8 <= hi:  # every value one unaligned load
                base = np.uint64(buf.ctypes.data) + np.uint64(pos)
                mask = (_ONE << np.uint64(width)) - _ONE
                for j in range(take):
                    bit = np.uint64(j * width)
                    delta = (load_u64(base + (bit >> np.uint64(3))) >> (bit & np.uint64(7))) & mask
                    last = (last + step + delta) & keep
                    out[i + j] = _signed(last, sign)
            else:
                for j in range(take):
                    delta = _bits_at(buf, pos, j * width, width, hi) if width else np.uint64(0)
                    last = (last + step + delta) & keep
                    out[i + j] = _signed(last, sign)
            i += take
            pos += (per_mini * width) // 8  # the whole miniblock, padding included
    if pos != hi:  # a last miniblock padded short, or bytes after the values
        return UNUSUAL
    return hi

"""Compiled decoding of LZ4 blocks: Parquet's LZ4_RAW pages (codec 7, what pyarrow writes for
``compression="lz4"``).

A page is one LZ4 *block*, without a frame or a stated size (the page header states the
decompressed size). A block is a run of sequences::

    sequence: <token> [literal length bytes] <literals> [<offset> [match length bytes]]

The token's high nibble is the literal count, its low nibble the match length less 4
(``MINMATCH``); a nibble of 15 is continued by bytes added to it, up to and including the first
one below 255. The literals are copied to the output; then a 2-byte little-endian offset
(1..65535) names where the match starts, that many bytes back in the output, and the match is
copied from there byte after byte: it may overlap the bytes it writes (offset 1 repeats one
byte). The last sequence is literals only and the block ends right after them: there is no
end marker, and nothing states the output's size, so a block cut after any sequence reads as a
shorter one.

The decoder writes into an output of exactly the page's stated size and checks every read and
write against the ends of its input and output. Where liblz4 (which pyarrow calls) surely
refuses the stream, it returns an error code, never reads or writes out of bounds:

* TRUNCATED: the input ends inside a sequence (a length's bytes, the literals, the offset);
* BAD_OFFSET: an offset reaching before the output's start;
* OVERRUN: literals or a match that would write past the output's end;
* SHORT: the stream ends (after its literals, or between sequences) with the output not full:
  liblz4 returns the count it produced and pyarrow's Parquet reader compares it with the page's
  ("Page didn't decompress to expected size"; ``pa.Codec.decompress`` alone does not).

What the format forbids but a lenient decoder could read: a match starting in the last 12
bytes of the output, a match reaching into its last 5 (the last sequence then has fewer than 5
literals, or only a match), and an offset of 0. liblz4 reads some of these: its shortcut for
short sequences (literals 0..14, match 4..18, offset >= 8, starting 32 bytes or more before the
output's end) skips the end-of-block checks, so ``<14 literals, match of 18 at offset 8>`` and
an empty last sequence fill 32 bytes, and an offset of 0 reads as zeros (pyarrow 26, measured);
outside the shortcut it refuses them. So packer decides none of them: such a stream is decoded
on to its end (an error further on is still that error) and returns UNUSUAL, and pyarrow reads
the file from that row group on and judges. packer never returns data for a stream pyarrow
refuses or reads otherwise. Writers (liblz4's compressors, which pyarrow's and parquet-mr's
use) never produce one. Bytes after the last literals are an error (TRUNCATED, or OVERRUN for
a match past the full output), as for liblz4; so is an empty input (SHORT: liblz4 refuses it;
the page reader passes on a v2 page's empty values section before decoding), while the single
byte 0 is the empty block (any other block that fills an empty page, which liblz4 refuses
though a token of no literals writes nothing, returns UNUSUAL).

Copies are 8 bytes wide where they fit: two for up to 16 literals or a match of up to 16 bytes
at an offset of 8 or more (for most sequences), ``memcpy`` for longer runs and matches apart
from what they write. The wide copies may write up to 15 bytes past the run they copy, still
inside the output: the next sequence writes over them, and an output left short is an error,
so no stray byte survives. A match overlapping what it writes repeats its last ``offset``
bytes, so any multiple of the offset back is as good a source: at an offset below 8 its first
bytes are copied one by one until the pattern spans 8 bytes, then it is copied in chunks from
the match's start, each as long as everything written since (a doubling distance).

Measured on the benchmark's 200k samples written with ``compression="lz4"`` (285 pages, 255 MB,
nearly all literals): 20 ms against pyarrow's ``Codec.decompress`` 19 ms into the same memory
pool; on compressible data from 0.5x (1 MB of random bytes 0..2: 190k short sequences, 0.79
against 0.45 ms) to 2x (runs of one byte or a 4-byte pattern) liblz4's speed.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from packer_cli._kernel_cache import njit
from packer_cli._unaligned import load_u64, store_u64
from packer_cli.sources._parquet_kernels import TRUNCATED, UNUSUAL

BAD_OFFSET = -5  # a match offset reaching before the output's start
OVERRUN = -6  # literals or a match past the output's end
SHORT = -7  # the stream ends before the output is full

MESSAGES = {TRUNCATED: "the stream ends inside a sequence", BAD_OFFSET: "a match offset reaches before the output",
            OVERRUN: "the stream writes past the page's stated size",
            SHORT: "the stream ends before the page's stated size"}

#: No block decodes to more than this many bytes a byte of input, and a few more: a match's
#: length grows by 255 a byte.
MAX_RATIO = 255
MAX_EXTRA = 64


@intrinsic
def _memcpy(typingctx, to, frm, count):
    """Copy ``count`` bytes from address ``frm`` to address ``to`` (regions apart): LLVM's memcpy."""
    def codegen(context, builder, signature, args):
        byte_pointer = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], byte_pointer), builder.inttoptr(args[1], byte_pointer),
                           args[2], 1)
        return context.get_dummy_value()

    return types.void(types.uint64, types.uint64, types.int64), codegen


@njit(cache=True, nogil=True, inline="always")
def _copy8(to, at, frm, src):
    """The 8 bytes at address ``frm + src`` written at ``to + at`` (offsets int64, addresses uint64)."""
    store_u64(to + np.uint64(at), load_u64(frm + np.uint64(src)))


@njit(cache=True, nogil=True, inline="always")
def _length(buf, ip, hi, length):
    """A nibble of 15 continued: (the length, position after its bytes), or (-1, ip) where the
    bytes run past ``hi``."""
    while True:
        if ip >= hi:
            return np.int64(-1), ip
        byte = np.int64(buf[ip])
        ip += 1
        length += byte
        if byte != 255:
            return length, ip


@njit(cache=True, nogil=True)
def lz4_block_decode(buf, lo, hi, out):
    """Decode the LZ4 block ``buf[lo:hi]`` (uint8) into all of ``out`` (uint8, the stated size).
    Returns ``out.size``, or TRUNCATED, BAD_OFFSET, OVERRUN, SHORT or UNUSUAL."""
    n = np.int64(out.size)
    src = np.uint64(buf.ctypes.data)
    dst = np.uint64(out.ctypes.data)
    ip = np.int64(lo)
    op = np.int64(0)
    unusual = False
    while ip < hi:
        token = np.int64(buf[ip])
        ip += 1
        lit = token >> 4
        if lit < 15 and hi - ip >= 16 + 2 and n - op >= 16:
            # Most sequences: 16 bytes copied for up to 14 literals, and a match follows (its
            # offset lies in the input).
            _copy8(dst, op, src, ip)
            _copy8(dst, op + 8, src, ip + 8)
            ip += lit
            op += lit
        else:
            if lit == 15:
                lit, ip = _length(buf, ip, hi, lit)
                if lit < 0:
                    return TRUNCATED
            if lit > hi - ip:
                return TRUNCATED
            if lit > n - op:
                return OVERRUN
            _memcpy(dst + np.uint64(op), src + np.uint64(ip), lit)
            ip += lit
            op += lit
            if ip == hi:  # the last sequence: literals only
                if op != n:
                    return SHORT
                if n == 0 and (hi - lo != 1 or buf[lo] != 0):  # liblz4's empty block is the byte 0 alone
                    return UNUSUAL
                return UNUSUAL if unusual else n
            if hi - ip < 2:
                return TRUNCATED
        offset = np.int64(buf[ip]) | (np.int64(buf[ip + 1]) << 8)
        ip += 2
        length = token & 15
        if length == 15:
            length, ip = _length(buf, ip, hi, length)
            if length < 0:
                return TRUNCATED
        length += 4
        if offset > op:
            return BAD_OFFSET
        if length > n - op:
            return OVERRUN
        end = op + length
        if offset == 0 or op > n - 12 or end > n - 5:  # liblz4 reads some of these
            unusual = True
            if offset == 0:  # decoding goes on (an error further on is still one), zeros for the match
                out[op:end] = 0
                op = end
                continue
        match = op - offset
        if offset >= 8 and length <= 16 and n - op >= 16:  # most matches
            _copy8(dst, op, dst, match)
            _copy8(dst, op + 8, dst, match + 8)  # (at an offset below 16: bytes the first wrote)
            op = end
            continue
        if offset >= length:  # apart: the match does not overlap what it writes
            _memcpy(dst + np.uint64(op), dst + np.uint64(match), length)
            op = end
            continue
        # Overlapping: the match repeats the ``offset`` bytes before it, so any multiple of
        # ``offset`` back is as good a source. Below 8, one by one until the pattern spans 8
        # bytes; then chunks from the match's start, each as long as all written since.
        if offset < 8:
            first = min(end, op + offset * ((8 + offset - 1) // offset) - offset)
            while op < first:
                out[op] = out[op - offset]
                op += 1
        while op < end:
            chunk = min(op - match, end - op)  # a multiple of offset back, 8 or more
            if chunk <= 16 and n - op >= 16:
                _copy8(dst, op, dst, match)
                _copy8(dst, op + 8, dst, match + 8)
            elif chunk < 8:  # near the output's end
                for k in range(chunk):
                    out[op + k] = out[match + k]
            else:
                _memcpy(dst + np.uint64(op), dst + np.uint64(match), chunk)
            op += chunk
    # The input ends after a match (or is empty): the last sequence had a match. One that fills
    # the output ended within its last 5 bytes (UNUSUAL, noted).
    return UNUSUAL if op == n and unusual else SHORT

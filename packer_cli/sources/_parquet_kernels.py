"""Compiled decoding of Parquet's RLE / bit-packing hybrid (levels and dictionary indices).

The hybrid stream is a run of ``varint header`` + payload pairs: header ``h`` with its low bit
set is ``h >> 1`` groups of 8 values bit-packed little-endian at ``bit_width`` bits each;
otherwise it is ``h >> 1`` copies of one value stored in ``ceil(bit_width / 8)`` bytes.
Repetition and definition levels and dictionary indices all use it. Every read is checked
against the end of its buffer: a corrupt page returns an error code, never reads out of bounds.
"""
from __future__ import annotations

import numpy as np

from packer_cli._kernel_cache import njit
from packer_cli._unaligned import load_u64

TRUNCATED = -1  # the stream ends before n values
BAD_WIDTH = -2  # bit width over 32
INDEX_RANGE = -3  # a dictionary index past the dictionary
# The values decode, but the stream is not what writers produce: bytes left over after the
# last value, a last bit-packed run whose padding is cut short, or a repeated value with bits
# set past the bit width (pyarrow reads its whole bytes, so masking them would read other
# data). Valid files do not look like this, damaged ones (a wrong bit width, say) often do;
# the caller lets pyarrow judge.
UNUSUAL = -4

MESSAGES = {TRUNCATED: "encoded values end early", BAD_WIDTH: "bit width over 32",
            INDEX_RANGE: "dictionary index out of range"}

NO_DICTIONARY = np.zeros(0, dtype=np.int64)


@njit(cache=True, nogil=True, inline="always")
def _word(buf, p):
    """The 8 bytes at ``buf[p:]`` (``p`` unsigned) as one little-endian integer: one unaligned load."""
    return load_u64(np.uint64(buf.ctypes.data) + p)


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
def _packed(buf, base, j, width, mask):
    """Value ``j`` of the bit-packed run at ``buf[base:]`` (its 8-byte word lies in the buffer)."""
    bit = np.uint64(j) * width
    return (_word(buf, base + (bit >> np.uint64(3))) >> (bit & np.uint64(7))) & mask


@njit(cache=True, nogil=True, inline="always")
def _repeated(buf, pos, value_bytes):
    """The value of a repeated-value run, stored in ``value_bytes`` little-endian bytes at ``pos``."""
    value = np.int64(0)
    for j in range(value_bytes):
        value |= np.int64(buf[pos + j]) << (8 * j)
    return value


@njit(cache=True, nogil=True, inline="always")
def _unpack_words(buf, pos, hi, bit_width, take, out, i, dictionary, mapped):
    """Unpack bit-packed values ``0 .. j`` of the run at ``pos`` (those whose 8-byte word lies in
    the buffer) into ``out[i:]``; returns j, or -1 for a dictionary index out of range."""
    width = np.uint64(bit_width)
    mask = (np.uint64(1) << width) - np.uint64(1)
    base = np.uint64(pos)
    limit = min(take, ((hi - pos - 8) * 8) // bit_width + 1) if hi - pos >= 8 else 0
    at = np.uint64(i)
    if not mapped:
        for j in range(limit):
            out[at + np.uint64(j)] = _packed(buf, base, j, width, mask)
        return limit
    if limit and dictionary.size == 0:
        return -1
    # No early exit: an index past the dictionary is noted and clamped, so the loop has no branch.
    last = np.uint64(dictionary.size - 1)
    beyond = False
    for j in range(limit):
        index = _packed(buf, base, j, width, mask)
        beyond |= index > last
        out[at + np.uint64(j)] = dictionary[min(index, last)]
    return -1 if beyond else limit


@njit(cache=True, nogil=True, inline="always")
def varint(buf, pos, hi, max_bytes):
    """(the unsigned varint at ``pos``, position after it), reading at most ``max_bytes`` bytes;
    (-1, pos) when it runs past ``hi`` or is longer."""
    value = np.int64(0)
    for k in range(max_bytes):
        if pos >= hi:
            break
        byte = np.int64(buf[pos])
        pos += 1
        value |= (byte & 0x7F) << (7 * k)
        if byte < 0x80:
            return value, pos
    return np.int64(-1), pos


@njit(cache=True, nogil=True, inline="always")
def _run_header(buf, pos, hi):
    """(header, position after it) of the run at ``pos`` (an unsigned varint of at most 5 bytes),
    or (-1, pos) when the stream ends inside it."""
    return varint(buf, pos, hi, 5)


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
        header, pos = _run_header(buf, pos, hi)
        if header < 0:
            return TRUNCATED
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
            value = _repeated(buf, pos, value_bytes)
            if value > mask:  # bits past the width: pyarrow reads the whole bytes, so let it judge
                return UNUSUAL
            pos += value_bytes
            take = min(count, n - i)
            if not _fill(out, i, take, value, dictionary, mapped):
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


# --- levels read as runs, for the usual page ---------------------------------------------------
# A page of a list column whose entries are all values (no empty or null list, no null element)
# has one run of the maximum definition level, and repetition levels that are 0 once per row and
# 1 elsewhere. Its row lengths can be read off the runs without writing out two level bytes per
# value; anything else (or anything odd about the streams) answers "no", and the general path
# above decodes the page and words the problem.

@njit(cache=True, nogil=True)
def levels_all_equal(buf, lo, hi, bit_width, n, value):
    """True when the hybrid stream ``buf[lo:hi]`` is repeated-value runs of ``value`` only,
    covering ``n`` values and ending exactly at ``hi``."""
    value_bytes = (bit_width + 7) // 8
    pos = lo
    i = 0
    while i < n:
        header, pos = _run_header(buf, pos, hi)
        if header < 0 or header & 1 or pos + value_bytes > hi:
            return False
        if _repeated(buf, pos, value_bytes) != value:  # all its bytes: a level of 35 is not 1
            return False
        pos += value_bytes
        i += min(header >> 1, n - i)
    return pos == hi


@njit(cache=True, nogil=True, inline="always")
def _row_start(p, rows, last, lengths, fill):
    """Note a row starting at level ``p``: the previous row's length when filling. Returns the
    new (rows, last row start)."""
    if fill and last >= 0:
        lengths[rows - 1] = p - last
    return rows + 1, p


@njit(cache=True, nogil=True)
def repetition_rows(buf, lo, hi, n, lengths, fill):
    """(rows, lead) of ``n`` repetition levels (bit width 1) in ``buf[lo:hi]``: the rows starting in
    the page (a level 0 each) and the levels before the first of them. With ``fill``, ``lengths``
    gets each row's level count (the last row's up to the page's end). rows is -1 when the stream
    is truncated, padded short or ends before ``hi``: the general path judges those.

    Rows are hundreds of levels long, so bit-packed runs are scanned 64 levels at a time while
    all are 1."""
    ones = ~np.uint64(0)
    pos = lo
    i = 0
    rows = 0
    last = -1
    lead = n
    while i < n:
        header, pos = _run_header(buf, pos, hi)
        if header < 0:
            return -1, 0
        count = header >> 1
        if header & 1:  # bit-packed: count * 8 levels in count bytes
            take = min(count * 8, n - i)
            if pos + count > hi:
                return -1, 0
            b = 0
            while b < (take + 7) // 8:
                if 8 * b + 64 <= take and _word(buf, np.uint64(pos + b)) == ones:
                    b += 8
                    continue
                zeros = ~np.int64(buf[pos + b]) & 0xFF
                if 8 * b + 8 > take:
                    zeros &= (np.int64(1) << (take - 8 * b)) - 1
                t = 0
                while zeros:
                    if zeros & 1:
                        rows, last = _row_start(i + 8 * b + t, rows, last, lengths, fill)
                        lead = min(lead, last)
                    zeros >>= 1
                    t += 1
                b += 1
            pos += count
        else:  # one level repeated
            if pos + 1 > hi or buf[pos] > 1:  # a level above 1: the general path judges it
                return -1, 0
            take = min(count, n - i)
            if buf[pos] == 0:  # rows of one value each
                for p in range(i, i + take):
                    rows, last = _row_start(p, rows, last, lengths, fill)
                lead = min(lead, i) if take else lead
            pos += 1
        i += take
    if pos != hi:
        return -1, 0
    if fill and last >= 0:
        lengths[rows - 1] = n - last
    return rows, lead


# Why a page's levels are rejected (0: they are not); see :func:`level_checks` and :func:`row_lengths`.
LEVEL_ABOVE_MAX = 1  # a repetition level above 1 or a definition level above the column's maximum
NULLS = 2  # an entry that is neither a value nor an empty list: a null list or element
EMPTY_CONTINUES = 3  # an empty list that is not the start of a row
EMPTY_HAS_VALUES = 4  # a row that starts with an empty list and has further entries


@njit(cache=True, nogil=True)
def _level_ranges(rep, defs):
    """(largest repetition level, number of 1s among them, smallest and largest definition level):
    reductions only, so the loop vectorizes."""
    top_rep = np.uint8(0)
    low_def = np.uint8(255)
    top_def = np.uint8(0)
    ones = np.int64(0)
    for i in range(rep.size):
        top_rep = max(top_rep, rep[i])
        ones += np.int64(rep[i])
        low_def = min(low_def, defs[i])
        top_def = max(top_def, defs[i])
    return np.int64(top_rep), ones, np.int64(low_def), np.int64(top_def)


@njit(cache=True, nogil=True)
def _empty_counts(rep, defs, max_def, empty_def):
    """(entries holding a value, empty lists, empty lists at a row start)."""
    present = 0
    empty = 0
    empty_starts = 0
    for i in range(rep.size):
        d = defs[i]
        present += np.int64(d == max_def)
        is_empty = np.int64(d == empty_def)
        empty += is_empty
        empty_starts += is_empty & np.int64(rep[i] == 0)
    return present, empty, empty_starts


@njit(cache=True, nogil=True)
def level_checks(rep, defs, max_def, empty_def):
    """(problem, rows starting in the page, empty lists) of a page's levels.

    The usual page (every entry a value) takes one pass of reductions; one with empty lists or
    nulls a second, counting pass. Problems are told apart in the order of their codes."""
    top_rep, ones, low_def, top_def = _level_ranges(rep, defs)
    rows = rep.size - ones  # once every level is 0 or 1
    if top_rep > 1 or top_def > max_def:
        return LEVEL_ABOVE_MAX, 0, 0
    if low_def == max_def:
        return 0, rows, 0
    present, empty, empty_starts = _empty_counts(rep, defs, max_def, empty_def)
    empties = rep.size - present
    if present + empty != rep.size:
        return NULLS, rows, empties
    if empty_starts != empty:
        return EMPTY_CONTINUES, rows, empties
    return 0, rows, empties


@njit(cache=True, nogil=True, inline="always")
def _row_values(entries, empty_row):
    """Values of a row of ``entries`` level entries: all of them, or none for a row that is an
    empty list; -1 when an empty list has further entries."""
    if not empty_row:
        return entries
    return 0 if entries == 1 else -1


@njit(cache=True, nogil=True)
def row_lengths(rep, defs, max_def, lengths):
    """Values in each row that starts in a page whose levels passed :func:`level_checks`.

    A row starts at every repetition level 0 and holds its level entries as values, except a
    row that starts with an empty list (definition level below ``max_def``): that must be its
    only entry, and it has no value. ``lengths`` has one slot per row start. Returns (problem,
    lead), ``lead`` being the entries before the first row start (they finish the previous
    page's row) and ``problem`` 0 or :data:`EMPTY_HAS_VALUES`. Row starts are rare (one per
    row, hundreds of entries apart), so the levels are skipped 8 at a time while all are 1.
    """
    n = rep.size
    lead = n
    k = -1
    start = 0
    empty_row = False
    ones = np.uint64(0x0101010101010101)
    i = 0
    while i < n:
        if i + 8 <= n and _word(rep, np.uint64(i)) == ones:
            i += 8
            continue
        if rep[i] == 0:
            if k >= 0:
                lengths[k] = _row_values(i - start, empty_row)
                if lengths[k] < 0:
                    return EMPTY_HAS_VALUES, 0
            else:
                lead = i
            k += 1
            start = i
            empty_row = defs[i] != max_def
        i += 1
    if k >= 0:
        lengths[k] = _row_values(n - start, empty_row)
        if lengths[k] < 0:
            return EMPTY_HAS_VALUES, 0
    return 0, lead


# --- a whole usual page, for runs of row groups decoded in bulk ---------------------------------

@njit(cache=True, nogil=True)
def usual_page_rows(levels, rep_lo, rep_hi, def_lo, def_hi, n, def_width, max_def, lengths, r, end, open_length):
    """The rows of one usual page (every entry a value, see above) of a column chunk, in one
    call: the lengths of the rows it finishes go into ``lengths[r:]`` (up to ``end``, its
    chunk's last row). ``open_length`` is the length so far of the row the chunk's previous page
    left open (-1: none). Returns (ok, r, open_length) after the page; not ok when the page is
    not a usual one or its rows do not fit, and then the caller decodes the chunk another way.
    (The values are copied by NumPy, which vectorizes the cast from unaligned bytes.)"""
    if not levels_all_equal(levels, def_lo, def_hi, def_width, n, max_def):
        return False, r, open_length
    rows, lead = repetition_rows(levels, rep_lo, rep_hi, n, lengths[:0], False)  # counting: nothing written
    if rows < 0:
        return False, r, open_length
    if lead:
        if open_length < 0:  # the chunk's first value does not start a row
            return False, r, open_length
        open_length += lead
    if rows:
        if open_length >= 0:
            if r >= end:
                return False, r, open_length
            lengths[r] = open_length
            r += 1
        if r + rows > min(end, lengths.size):  # more rows start in the chunk than its row group holds
            return False, r, open_length
        repetition_rows(levels, rep_lo, rep_hi, n, lengths[r:r + rows], True)
        r += rows - 1
        open_length = lengths[r]
    return True, r, open_length

"""Compiled JSON Lines scanner: the integer lists of the wanted fields, straight from the bytes.

:func:`scan` walks the bytes of complete lines once. For every record it either

* fully parses it — a JSON object whose wanted fields each appear once, as a list of integers
  within int32 (or an integer, for scalar fields; or a list of ``true``/``false``, read as 1/0,
  for flag fields such as a loss mask) — and appends the values to flat arrays, or
* gives up on it and records the line's byte span, so the reader can hand exactly that line to
  the orjson path, which reports problems with the same messages as before.

Giving up is always safe; accepting a record requires that orjson would accept the whole line
and produce the same values. So the scanner validates everything it skips (strings with their
escapes and UTF-8, numbers, literals, nesting) and gives up on anything it is not sure of:
escapes in keys, surrogate escapes, duplicate wanted fields, very long or very precise
numbers, integers outside int32, nesting deeper than 64.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

from packer_cli._kernel_cache import njit
from packer_cli._unaligned import load_u64

_FLAGS = {"cache": True, "nogil": True, "boundscheck": False}
#: Small helpers are inlined into their callers (numba does not inline across njit functions by itself).
_INLINE = dict(_FLAGS, inline="always")

#: What a wanted field holds (``kinds``): a list of integers, one integer, or a list of integers
#: or booleans (a loss mask; ``true``/``false`` read as 1/0).
LIST, SCALAR, FLAGS = 0, 1, 2
#: Values of ``state`` (an int64 array shared with the caller between calls).
ROWS, LINE, SLOW, STATUS = 0, 1, 2, 3
#: Why :func:`scan` returned.
BATCH_FULL, NEED_DATA, NEED_SPACE = 0, 1, 2

MAX_DEPTH = 64
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1

_SPACE, _TAB, _LF, _CR = 32, 9, 10, 13
_VT, _FF = 11, 12
_QUOTE, _BACKSLASH, _COMMA, _COLON = 34, 92, 44, 58
_LBRACKET, _RBRACKET, _LBRACE, _RBRACE = 91, 93, 123, 125
_MINUS, _PLUS, _DOT, _ZERO, _NINE = 45, 43, 46, 48, 57


@intrinsic
def _memchr(typingctx, address, byte, nbytes):
    """libc ``memchr``: the offset of ``byte`` in ``nbytes`` bytes at ``address``, or -1."""
    sig = types.int64(types.uint64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        char_p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(char_p, [char_p, ir.IntType(32), ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "memchr")
        address_, byte_, nbytes_ = args
        found = builder.call(fn, [builder.inttoptr(address_, char_p), builder.trunc(byte_, ir.IntType(32)), nbytes_])
        offset = builder.sub(builder.ptrtoint(found, ir.IntType(64)), address_)
        missing = builder.icmp_unsigned("==", found, ir.Constant(char_p, None))
        return builder.select(missing, ir.Constant(ir.IntType(64), -1), offset)

    return sig, codegen


_ASCII_ZEROS = np.uint64(0x3030303030303030)
_SIX = np.uint64(0x0606060606060606)
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)


@njit(**_INLINE)
def _digits8(buf, i):
    """Up to 8 decimal digits at ``buf[i:i+8]`` at once (SWAR): (digit count, value).

    A count of 8 means the number may go on. Each byte is XORed with '0', so digits become
    0..9; a byte is a digit iff neither it nor it + 6 reaches 16. (A carry out of a non-digit
    byte can only mark bytes after the first non-digit, which are not looked at.) The digits
    are then shifted to the top bytes and combined in pairs, quads and eights by three
    multiplications.
    """
    t = load_u64(np.uint64(buf.ctypes.data) + np.uint64(i)) ^ _ASCII_ZEROS
    other = ((t + _SIX) | t) & _HIGH_NIBBLES
    count = 8 if other == 0 else np.int64(trailing_zeros(other)) >> 3
    if count == 0:
        return 0, np.int64(0)
    t <<= np.uint64(8 * (8 - count))
    t = (t * np.uint64(10) + (t >> np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
    t = (t * np.uint64(100) + (t >> np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    t = (t * np.uint64(10000) + (t >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
    return count, np.int64(t)


@njit(**_INLINE)
def _line_end(buf, pos, end):
    """Index of the next newline in ``buf[pos:end]``, or ``end`` (libc memchr: vectorized)."""
    if pos >= end:
        return end
    found = _memchr(buf.ctypes.data + pos, _LF, end - pos)
    return end if found < 0 else pos + found


@njit(**_INLINE)
def _ws(buf, i, end):
    while i < end:
        c = buf[i]
        if c != _SPACE and c != _TAB and c != _CR and c != _LF:
            break
        i += 1
    return i


@njit(**_INLINE)
def _is_hex(c):
    return (48 <= c <= 57) or (65 <= c <= 70) or (97 <= c <= 102)


@njit(**_FLAGS)
def _string(buf, i, end):
    """``i`` at the opening quote. Returns (index after the closing quote, has_escape), or (-1, _)."""
    i += 1
    escaped = False
    while i < end:
        c = buf[i]
        if c == _QUOTE:
            return i + 1, escaped
        if c < 32:
            return -1, escaped
        if c == _BACKSLASH:
            escaped = True
            if i + 1 >= end:
                return -1, escaped
            e = buf[i + 1]
            if e == 117:  # \uXXXX; surrogates are left to orjson
                if i + 5 >= end:
                    return -1, escaped
                for k in range(2, 6):
                    if not _is_hex(buf[i + k]):
                        return -1, escaped
                first = buf[i + 2] | 32
                if first == 100 and (buf[i + 3] | 32) >= 56:  # 'd' then '8'..'f': D800-DFFF
                    return -1, escaped
                i += 6
            elif e == 34 or e == 92 or e == 47 or e == 98 or e == 102 or e == 110 or e == 114 or e == 116:
                i += 2
            else:
                return -1, escaped
        elif c < 128:
            i += 1
        else:  # UTF-8: reject overlong forms, surrogates and code points above U+10FFFF
            if 0xC2 <= c <= 0xDF:
                n = 1
                lo, hi = 0x80, 0xBF
            elif c == 0xE0:
                n = 2
                lo, hi = 0xA0, 0xBF
            elif 0xE1 <= c <= 0xEC or c == 0xEE or c == 0xEF:
                n = 2
                lo, hi = 0x80, 0xBF
            elif c == 0xED:
                n = 2
                lo, hi = 0x80, 0x9F
            elif c == 0xF0:
                n = 3
                lo, hi = 0x90, 0xBF
            elif 0xF1 <= c <= 0xF3:
                n = 3
                lo, hi = 0x80, 0xBF
            elif c == 0xF4:
                n = 3
                lo, hi = 0x80, 0x8F
            else:
                return -1, escaped
            if i + n >= end:
                return -1, escaped
            b = buf[i + 1]
            if b < lo or b > hi:
                return -1, escaped
            for k in range(2, n + 1):
                b = buf[i + k]
                if b < 0x80 or b > 0xBF:
                    return -1, escaped
            i += n + 1
    return -1, escaped


@njit(**_INLINE)
def _number(buf, i, end):
    """Skip a JSON number; -1 when malformed or too long/precise to be sure orjson agrees."""
    if i < end and buf[i] == _MINUS:
        i += 1
    if i >= end:
        return -1
    c = buf[i]
    digits = 0
    if c == _ZERO:
        i += 1
        digits = 1
        if i < end and _ZERO <= buf[i] <= _NINE:
            return -1
    elif _ZERO < c <= _NINE:
        while i < end and _ZERO <= buf[i] <= _NINE:
            i += 1
            digits += 1
    else:
        return -1
    if i < end and buf[i] == _DOT:
        i += 1
        start = i
        while i < end and _ZERO <= buf[i] <= _NINE:
            i += 1
        if i == start:
            return -1
        digits += i - start
    if i < end and (buf[i] == 101 or buf[i] == 69):
        i += 1
        if i < end and (buf[i] == _PLUS or buf[i] == _MINUS):
            i += 1
        start = i
        while i < end and _ZERO <= buf[i] <= _NINE:
            i += 1
        if i == start or i - start > 2:
            return -1
    if digits > 17:
        return -1
    return i


@njit(**_INLINE)
def _literal(buf, i, end, word):
    n = word.size
    if i + n > end:
        return -1
    for k in range(n):
        if buf[i + k] != word[k]:
            return -1
    return i + n


_TRUE = np.frombuffer(b"true", dtype=np.uint8)
_FALSE = np.frombuffer(b"false", dtype=np.uint8)
_NULL = np.frombuffer(b"null", dtype=np.uint8)


@njit(**_INLINE)
def _key_colon(buf, i, end):
    """Skip an object key and the colon after it (``i`` at the opening quote); -1 when malformed."""
    if i >= end or buf[i] != _QUOTE:
        return -1
    i, _ = _string(buf, i, end)
    if i < 0:
        return -1
    i = _ws(buf, i, end)
    if i >= end or buf[i] != _COLON:
        return -1
    return i + 1


@njit(**_FLAGS)
def _skip_value(buf, i, end, stack):
    """Validate and skip any JSON value; -1 when malformed or unsupported."""
    depth = 0
    expect_value = True
    while True:
        if depth == 0 and not expect_value:
            return i
        i = _ws(buf, i, end)
        if i >= end:
            return -1
        c = buf[i]
        if expect_value:
            if c == _LBRACE or c == _LBRACKET:
                if depth == MAX_DEPTH:
                    return -1
                stack[depth] = c
                depth += 1
                i = _ws(buf, i + 1, end)
                if i >= end:
                    return -1
                close = _RBRACE if c == _LBRACE else _RBRACKET
                if buf[i] == close:
                    depth -= 1
                    i += 1
                    expect_value = False
                elif c == _LBRACE:
                    i = _key_colon(buf, i, end)
                    if i < 0:
                        return -1
                continue
            if c == _QUOTE:
                i, _ = _string(buf, i, end)
            elif c == _MINUS or _ZERO <= c <= _NINE:
                i = _number(buf, i, end)
            elif c == 116:
                i = _literal(buf, i, end, _TRUE)
            elif c == 102:
                i = _literal(buf, i, end, _FALSE)
            elif c == 110:
                i = _literal(buf, i, end, _NULL)
            else:
                return -1
            if i < 0:
                return -1
            expect_value = False
        else:
            top = stack[depth - 1]
            if c == _COMMA:
                i = _ws(buf, i + 1, end)
                if top == _LBRACE:
                    i = _key_colon(buf, i, end)
                    if i < 0:
                        return -1
                expect_value = True
            elif (top == _LBRACE and c == _RBRACE) or (top == _LBRACKET and c == _RBRACKET):
                depth -= 1
                i += 1
            else:
                return -1


@njit(**_INLINE)
def _int(buf, i, end):
    """Parse an int32 JSON integer at ``i``: (value, index after it), index -1 when it is not one."""
    neg = False
    if i < end and buf[i] == _MINUS:
        neg = True
        i += 1
    if i >= end:
        return 0, -1
    c = buf[i]
    if c < _ZERO or c > _NINE:
        return 0, -1
    if c == _ZERO:
        value = 0
        i += 1
        if i < end and _ZERO <= buf[i] <= _NINE:
            return 0, -1
    else:
        value = 0
        digits = 0
        while i < end and _ZERO <= buf[i] <= _NINE:
            value = value * 10 + (buf[i] - _ZERO)
            i += 1
            digits += 1
            if digits > 10:
                return 0, -1
    if i < end and (buf[i] == _DOT or buf[i] == 101 or buf[i] == 69):
        return 0, -1
    if neg:
        value = -value
    if value < _INT32_MIN or value > _INT32_MAX:
        return 0, -1
    return value, i


@njit(**_INLINE)
def _int_list(buf, i, end, values, k, n):
    """Parse a list of int32 JSON integers at ``i`` into ``values[k, n:]``.

    Returns (index after the list, new n), or (-1, 0) to give up, or (-1, -1) when ``values``
    is full. The loop is written for the common shapes ``[1,2,3]`` and ``[1, 2, 3]``: digits
    are read 8 at a time (:func:`_digits8`), and a comma or ``]`` right after them is all the
    common path checks.
    """
    if i >= end or buf[i] != _LBRACKET:
        return -1, 0
    cap = values.shape[1]
    i = _ws(buf, i + 1, end)
    if i < end and buf[i] == _RBRACKET:
        return i + 1, n
    while True:
        neg = False
        if i < end and buf[i] == _MINUS:
            neg = True
            i += 1
        start = i
        count = 0
        v = 0
        if i + 8 <= end:  # the common case: up to 8 digits in one step
            count, v = _digits8(buf, i)
            i += count
        if count == 0 or count == 8:  # near the end of the data, or a long number: digit by digit
            while i < end:
                d = np.int64(buf[i]) - _ZERO
                if d < 0 or d > 9:
                    break
                v = v * 10 + d
                i += 1
        digits = i - start
        if digits == 0 or digits > 10 or (digits > 1 and buf[start] == _ZERO):
            return -1, 0
        if neg:
            v = -v
        if digits == 10 and (v < _INT32_MIN or v > _INT32_MAX):  # 9 digits always fit
            return -1, 0
        if n == cap:
            return -1, -1
        values[k, n] = v
        n += 1
        if i >= end:
            return -1, 0
        c = buf[i]
        if c == _COMMA:
            i += 1
            if i < end and buf[i] <= _SPACE:
                i = _ws(buf, i, end)
            continue
        if c == _RBRACKET:
            return i + 1, n
        if c == _DOT or c == 101 or c == 69:  # a fraction or exponent: not an integer
            return -1, 0
        i = _ws(buf, i, end)
        if i < end and buf[i] == _COMMA:
            i = _ws(buf, i + 1, end)
            continue
        if i < end and buf[i] == _RBRACKET:
            return i + 1, n
        return -1, 0


@njit(**_FLAGS)  # not inlined: kept out of the integer lists' path
def _bool_list(buf, i, end, values, k, n):
    """Parse a non-empty list of JSON booleans at ``i`` into ``values[k, n:]`` as 1/0.

    Same returns as :func:`_int_list`. A list mixing booleans with anything else is given up on
    (orjson's path reads it).
    """
    cap = values.shape[1]
    i = _ws(buf, i + 1, end)  # past the '['
    while True:
        if i < end and buf[i] == 116:
            v, i = 1, _literal(buf, i, end, _TRUE)
        elif i < end and buf[i] == 102:
            v, i = 0, _literal(buf, i, end, _FALSE)
        else:
            return -1, 0
        if i < 0:
            return -1, 0
        if n == cap:
            return -1, -1
        values[k, n] = v
        n += 1
        i = _ws(buf, i, end)
        if i >= end:
            return -1, 0
        c = buf[i]
        if c == _COMMA:
            i = _ws(buf, i + 1, end)
            continue
        if c == _RBRACKET:
            return i + 1, n
        return -1, 0


@njit(**_INLINE)
def _starts_bool_list(buf, i, end):
    """Whether the value at ``i`` is a list whose first item starts like ``true`` or ``false``."""
    if i >= end or buf[i] != _LBRACKET:
        return False
    i = _ws(buf, i + 1, end)
    return i < end and (buf[i] == 116 or buf[i] == 102)


@njit(**_INLINE)
def _field_of(buf, a, b, names, name_offsets):
    for k in range(name_offsets.size - 1):
        lo = name_offsets[k]
        n = name_offsets[k + 1] - lo
        if n == b - a:
            same = True
            for j in range(n):
                if buf[a + j] != names[lo + j]:
                    same = False
                    break
            if same:
                return k
    return -1


@njit(**_FLAGS)
def _record(buf, i, end, names, name_offsets, kinds, row, offsets, values, scalars, seen, stack):
    """Parse one record spanning ``buf[i:end]``; 1 parsed, 0 give up, -1 out of value space."""
    k_fields = kinds.shape[0]  # the wanted fields; the names after them are fields no record may have
    for k in range(k_fields):
        seen[k] = False
        offsets[k, row + 1] = offsets[k, row]
    i = _ws(buf, i, end)
    if i >= end or buf[i] != _LBRACE:
        return 0
    i = _ws(buf, i + 1, end)
    if i < end and buf[i] == _RBRACE:
        i += 1
    else:
        while True:
            if i >= end or buf[i] != _QUOTE:
                return 0
            key_end, escaped = _string(buf, i, end)
            if key_end < 0 or escaped:
                return 0
            k = _field_of(buf, i + 1, key_end - 1, names, name_offsets)
            if k >= k_fields:
                return 0
            i = _ws(buf, key_end, end)
            if i >= end or buf[i] != _COLON:
                return 0
            i = _ws(buf, i + 1, end)
            if k < 0:
                i = _skip_value(buf, i, end, stack)
                if i < 0:
                    return 0
            elif seen[k]:
                return 0
            elif kinds[k] == SCALAR:
                v, i = _int(buf, i, end)
                if i < 0:
                    return 0
                scalars[k, row] = v
                seen[k] = True
            else:
                if kinds[k] == FLAGS and _starts_bool_list(buf, i, end):
                    i, n = _bool_list(buf, i, end, values, k, offsets[k, row])
                else:
                    i, n = _int_list(buf, i, end, values, k, offsets[k, row])
                if i < 0:
                    return n
                offsets[k, row + 1] = n
                seen[k] = True
            i = _ws(buf, i, end)
            if i >= end:
                return 0
            if buf[i] == _COMMA:
                i = _ws(buf, i + 1, end)
                continue
            if buf[i] == _RBRACE:
                i += 1
                break
            return 0
    if _ws(buf, i, end) != end:
        return 0
    for k in range(k_fields):
        if not seen[k]:
            return 0
    return 1


@njit(**_FLAGS)
def scan(buf, pos, end, eof, max_rows, names, name_offsets, kinds, state, lines, offsets, values, scalars,
         slow_rows, slow_spans):
    """Scan complete lines of ``buf[pos:end]`` into the current batch; returns the new ``pos``.

    ``state[ROWS]`` records are in the batch so far, ``state[LINE]`` is the number of the last
    line read, ``state[SLOW]`` the count of records left to orjson (their row in ``slow_rows``,
    their byte span in ``slow_spans``); ``state[STATUS]`` says why the call returned. A last
    line without a newline counts only when ``eof``. Blank lines (only ASCII whitespace, as
    ``bytes.strip`` sees it) are skipped but counted.
    """
    seen = np.zeros(name_offsets.size - 1, dtype=np.bool_)
    stack = np.empty(MAX_DEPTH, dtype=np.uint8)
    while True:
        if state[ROWS] == max_rows:
            state[STATUS] = BATCH_FULL
            return pos
        if pos >= end:
            state[STATUS] = NEED_DATA
            return end
        line_end = _line_end(buf, pos, end)
        if line_end == end and not eof:
            state[STATUS] = NEED_DATA
            return pos
        blank = True
        for j in range(pos, line_end):
            c = buf[j]
            if c != _SPACE and c != _TAB and c != _CR and c != _VT and c != _FF:
                blank = False
                break
        if blank:
            state[LINE] += 1
            pos = line_end + 1
            continue
        row = state[ROWS]
        got = _record(buf, pos, line_end, names, name_offsets, kinds, row, offsets, values, scalars, seen, stack)
        if got < 0:
            state[STATUS] = NEED_SPACE
            return pos
        state[LINE] += 1
        lines[row] = state[LINE]
        if got == 0:
            for k in range(kinds.shape[0]):
                offsets[k, row + 1] = offsets[k, row]
            slow_rows[state[SLOW]] = row
            slow_spans[state[SLOW], 0] = pos
            slow_spans[state[SLOW], 1] = line_end + 1 if line_end < end else line_end  # with its newline
            state[SLOW] += 1
        state[ROWS] = row + 1
        pos = line_end + 1


@njit(**_FLAGS)
def batch_span(buf, pos, end, eof, max_rows):
    """Where the next ``max_rows`` records starting at ``pos`` end: (position, records, lines).

    Fewer records when the complete lines run out (a last line without a newline counts only
    when ``eof``); blank lines are counted as lines, not records. Lets the reader cut a batch
    into halves that two threads scan at once.
    """
    rows = 0
    lines = 0
    while rows < max_rows and pos < end:
        line_end = _line_end(buf, pos, end)
        if line_end == end and not eof:
            break
        lines += 1
        for j in range(pos, line_end):
            c = buf[j]
            if c != _SPACE and c != _TAB and c != _CR and c != _VT and c != _FF:
                rows += 1
                break
        pos = line_end + 1
    return min(pos, end), rows, lines

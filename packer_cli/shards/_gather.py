"""The spill: samples written in pass one, gathered pack by pack in pass two.

``samples.bin`` holds every kept sample once, in stream order, in the write batches of pass
one. A batch is a run of *blocks*: 8 tokens of ``b`` bits each, the fewest that hold every id
of the batch (17 below 131,072, which covers cl100k and Llama 3; 18 for Qwen's 151k), packed
little-endian into ``b`` bytes (token j at bit ``j·b``), then one byte holding their 8 target
flags (bit j: token j's); the batch's last block is padded with zeros. A token and its flag so
take (b + 1)/8 bytes, 2¼ for a 17-bit vocabulary (byte-aligned tokens took 3⅛), and a
sequence's tokens and flags lie side by side, so the gather reads any sequence, even a few
tokens out of a long sample, with one ``pread`` of the blocks it spans. ``layout.bin``
records, per batch, its first token position, first byte and ``b`` (written by
:class:`SpillWriter`, read by :class:`SpillReader`).

The kernels work on flat arrays only (no Python objects), one pass over the bytes of each
sequence, and release the GIL so reading, gathering and writing can overlap on separate threads.

:class:`SpillReader` reads the spill's file with ``pread``: no page of it is ever mapped into
the process, so resident memory stays bounded by the output buffers however large the spill
is (touched pages of a memory map count toward RSS, and a run of packs touches pages all over
the file). The spill's first batches live in memory instead (:class:`SpillMemory`, ``pack
--spill-memory``, 256 MiB by default), up to a fixed budget: byte positions then run on from
that memory into the file, and the gather decodes those sequences where they lie.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import queue

import numpy as np
import pyarrow as pa
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from packer_cli._arrow import memory_pool
from packer_cli._kernel_cache import njit
from packer_cli._unaligned import load_u32, load_u64, store_u32, store_u64


def _libc_io(name: str):
    """Codegen of a call to libc's ``name(fd, address, nbytes, offset)`` (``pread``/``pwrite``),
    bound by symbol name so the kernels that use it cache."""
    def codegen(context, builder, signature, args):
        char_p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(32), char_p, ir.IntType(64), ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        fd_, address_, nbytes_, offset_ = args
        return builder.call(fn, [builder.trunc(fd_, ir.IntType(32)), builder.inttoptr(address_, char_p),
                                 nbytes_, offset_])

    return codegen


_IO_SIGNATURE = types.int64(types.int64, types.uint64, types.int64, types.int64)


@intrinsic
def _pread(typingctx, fd, address, nbytes, offset):
    """libc ``pread(fd, address, nbytes, offset)``."""
    return _IO_SIGNATURE, _libc_io("pread")


@intrinsic
def _pwrite(typingctx, fd, address, nbytes, offset):
    """libc ``pwrite(fd, address, nbytes, offset)``."""
    return _IO_SIGNATURE, _libc_io("pwrite")


@njit(cache=True, nogil=True, inline="always")
def _transfer_exact(fd, address, nbytes, offset, write):
    """``pwrite`` (``write``) or ``pread`` all ``nbytes`` at ``offset`` from or into ``address``,
    as many calls as it takes; False on an error, or a read that meets the end of the file."""
    while nbytes > 0:
        done = _pwrite(fd, address, nbytes, offset) if write else _pread(fd, address, nbytes, offset)
        if done <= 0:
            return False
        address += done
        nbytes -= done
        offset += done
    return True


@njit(cache=True, nogil=True)
def _read_exact(fd, address, nbytes, offset):
    """Read ``nbytes`` at ``offset`` into ``address``; False on an error or a short file."""
    return _transfer_exact(fd, address, nbytes, offset, False)


@njit(cache=True, nogil=True)
def _write_exact(fd, address, nbytes, offset):
    """Write ``nbytes`` from ``address`` at ``offset``; False on an error."""
    return _transfer_exact(fd, address, nbytes, offset, True)


class SpillError(OSError):
    """Reading the spill (or copying it into its stages) failed: the spill directory's trouble,
    which ``pack`` names as such when ``--spill-dir`` put the spill elsewhere than OUT."""


def spill_os_error(exc: OSError, doing: str) -> SpillError:
    """``exc`` (a failed system call on a spill file while ``doing``) as a :class:`SpillError`
    worded as :func:`spill_error` words them, errno kept."""
    if isinstance(exc, SpillError):
        return exc
    name = f" ({os.path.basename(exc.filename)})" if isinstance(exc.filename, str) else ""
    error = SpillError(f"{doing} failed: [Errno {exc.errno}] {exc.strerror}{name}" if exc.errno and exc.strerror
                       else f"{doing} failed: {exc}")
    error.errno = exc.errno
    return error


def save_array(path: str, array: np.ndarray) -> None:
    """Write ``array``'s bytes to ``path``, whole or not at all: NumPy's ``tofile`` drops a
    failed flush of an array small enough to sit in its buffer (a full disk left an empty file
    and no error, and pass two then read garbage). :class:`SpillError` on failure."""
    try:
        with open(path, "wb") as f:
            f.write(memoryview(np.ascontiguousarray(array)).cast("B"))
    except OSError as exc:
        if exc.filename is None:
            exc.filename = path
        raise spill_os_error(exc, "writing the spill") from exc


def load_array(path: str, dtype, count: int | None = None) -> np.ndarray:
    """The array :func:`save_array` wrote to ``path`` (``count`` items when given):
    :class:`SpillError` for a file that cannot be read or holds another number of items."""
    try:
        array = np.fromfile(path, dtype=dtype)
    except OSError as exc:
        raise spill_os_error(exc, "reading the spill files") from exc
    if count is not None and array.size != count:
        raise SpillError(f"reading the spill files failed: {os.path.basename(path)} holds {array.size:,} items, {count:,} "
                         "expected (removed or truncated?)")
    return array


def last_errno() -> int:
    """This thread's ``errno`` as the C library left it (after a compiled ``pread``/``pwrite``
    returned -1; nothing between that call and this one makes a system call)."""
    return ctypes.c_int.from_address(_errno_location()).value if _errno_location else 0


def spill_error(what: str, guess: str) -> SpillError:
    """``what`` failed: with the C library's errno when it holds one, else ``guess`` as a hint."""
    code = last_errno()
    if not code:
        return SpillError(f"{what} failed ({guess})")
    return spill_os_error(OSError(code, os.strerror(code)), what)


# resolved once, so no symbol lookup runs between the failure and the read (glibc and musl)
_errno_location = getattr(ctypes.CDLL(None, use_errno=False), "__errno_location", None)
if _errno_location is not None:
    _errno_location.restype = ctypes.c_void_p


SPILL_FILE = "samples.bin"
LAYOUT_FILE = "layout.bin"
BLOCK_TOKENS = 8  # tokens per spill block, whose flags fill its last byte


MAX_BITS = 32  # ids are validated int32 ≥ 0: 31 bits at most; 32 is allowed for the layout's sake
#: Readable bytes a reader needs past the last block it decodes (a token is read with an 8-byte
#: load at the byte where it starts, the flag byte with a 4-byte one).
READ_SLACK = 8


def batch_bits(tokens: np.ndarray, max_token: int | None) -> int:
    """Bits a token of this batch takes in the spill (``max_token``: its largest id, when known)."""
    return token_bits(int(tokens.max(initial=0)) if max_token is None else max_token)


def batch_spill_bytes(n_tokens: int, bits: int) -> int:
    """Bytes a batch of ``n_tokens`` tokens of ``bits`` bits takes in the spill (whole blocks)."""
    return -(-n_tokens // BLOCK_TOKENS) * block_bytes(bits)


def stays_in_memory(so_far: bool, used: int, size: int, budget: int) -> bool:
    """Whether a batch of ``size`` spill bytes goes to the memory part (``used`` of ``budget``
    bytes taken): whole batches, from the first, until one does not fit (the rest to the file,
    so the memory part is the spill's start)."""
    return so_far and used + size <= budget


def token_bits(max_id: int) -> int:
    """Bits a spilled token takes when the largest id of its batch is ``max_id`` (at least 1)."""
    return max(1, int(max_id).bit_length())


def block_bytes(bits: int) -> int:
    """Bytes of one spill block: 8 tokens of ``bits`` bits (``bits`` bytes), then their flags."""
    return bits + 1


_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_ONES = np.uint64(0x0101010101010101)
_GATHER_BITS = np.uint64(0x0102040810204080)


@njit(cache=True, nogil=True, inline="always")
def _flag_byte(address):
    """The 8 target bytes at ``address`` as one byte, bit j set when byte j is not 0: each byte
    becomes 0 or 1 (its low 7 bits plus 0x7F carry into bit 7 unless all are 0), and one
    multiplication gathers the 8 low bits into the top byte."""
    x = load_u64(address)
    nonzero = ((((x & _LOW7) + _LOW7) | x) >> np.uint64(7)) & _ONES
    return np.uint8((nonzero * _GATHER_BITS) >> np.uint64(56))


@njit(cache=True, nogil=True, inline="always")
def _store_full_blocks(tokens, targets, bits, out, blocks):
    """The first ``blocks`` blocks of a batch, all full (:func:`_store_blocks`).

    Inlined where ``bits`` is a constant, the 8-token loop unrolls into straight-line shifts
    and stores: 0.5 ns a token instead of 1.5 with ``bits`` known only at run time."""
    stride = np.uint64(bits + 1)
    o = np.uint64(out.ctypes.data)
    g = np.uint64(targets.ctypes.data)
    for b in range(blocks):
        q = o + np.uint64(b) * stride
        acc = np.uint64(0)
        filled = np.uint64(0)
        for j in range(8):
            acc |= np.uint64(np.uint32(tokens[8 * b + j])) << filled
            filled += np.uint64(bits)
            if filled >= 32:
                store_u32(q, np.uint32(acc & np.uint64(0xFFFFFFFF)))
                q += np.uint64(4)
                acc >>= np.uint64(32)
                filled -= np.uint64(32)
        while filled > 0:
            out[q - o] = np.uint8(acc & np.uint64(0xFF))
            q += np.uint64(1)
            acc >>= np.uint64(8)
            filled -= np.uint64(8)
        out[q - o] = _flag_byte(g + np.uint64(8 * b))


@njit(cache=True, nogil=True)
def _store_blocks(tokens, targets, bits, out):
    """Lay a batch out as the spill stores it (module docstring); ``out`` holds whole blocks.

    Each block's tokens go through a 64-bit accumulator that is emptied four bytes at a time
    (the 8 tokens fill exactly ``bits`` bytes, so the last one to three are stored singly);
    whole blocks take their flags 8 at once, the last, partial block one by one. The widths
    of common vocabularies (15 bits: 32k ids; 16: 50-65k; 17: 100-131k; 18: 151-262k) each
    get their own copy of the full blocks' loop, with the width a constant."""
    n = tokens.size
    full = n // 8
    if bits == 17:
        _store_full_blocks(tokens, targets, 17, out, full)
    elif bits == 16:
        _store_full_blocks(tokens, targets, 16, out, full)
    elif bits == 18:
        _store_full_blocks(tokens, targets, 18, out, full)
    elif bits == 15:
        _store_full_blocks(tokens, targets, 15, out, full)
    else:
        _store_full_blocks(tokens, targets, bits, out, full)
    if full * 8 == n:
        return
    q = full * (bits + 1)  # the last block: its tokens, zeros after them, one flag each
    acc = np.uint64(0)
    filled = 0
    flags = 0
    for j in range(8):
        k = 8 * full + j
        if k < n:
            acc |= np.uint64(np.uint32(tokens[k])) << np.uint64(filled)
            if targets[k] != 0:
                flags |= 1 << j
        filled += bits
        while filled >= 8:
            out[q] = np.uint8(acc & np.uint64(0xFF))
            q += 1
            acc >>= np.uint64(8)
            filled -= 8
    out[q] = flags


def _bit_spreads() -> np.ndarray:
    """Byte b → 8 bytes, byte j holding bit j of b (one flag byte of a block → its 8 flags)."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return np.ascontiguousarray(bits).view(np.uint64).ravel()


_SPREAD = _bit_spreads()


@njit(cache=True, nogil=True, inline="always")
def _token_at(block, k, bits):
    """Token ``k`` of the block at address ``block``: an 8-byte load at the byte it starts in,
    shifted and masked (a token of up to 32 bits starts at most 7 bits into that byte)."""
    first = np.uint64(k * bits)
    word = load_u64(block + (first >> np.uint64(3))) >> (first & np.uint64(7))
    return np.int32(word & ((np.uint64(1) << np.uint64(bits)) - np.uint64(1)))


@njit(cache=True, nogil=True)
def _load_token(base, u, bits):
    """Token ``u`` (counted from the first block) of the blocks at address ``base``
    (``READ_SLACK`` readable bytes past them)."""
    return _token_at(base + np.uint64(u >> 3) * np.uint64(bits + 1), u & 7, bits)


@njit(cache=True, nogil=True)
def _locate(position, token_starts, widths):
    """(batch, bits per token) of the token at stream ``position``: the last batch starting at
    or before it. (A binary search by hand: ``np.searchsorted`` would make loading this kernel
    from the cache import numba's array-math module, ~18 ms of every CLI start.)"""
    lo, hi = 0, token_starts.size  # token_starts[0] == 0 <= position
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if token_starts[mid] <= position:
            lo = mid
        else:
            hi = mid
    return lo, np.int64(widths[lo])


@njit(cache=True, nogil=True)
def _read_blocks(fd, token_starts, byte_starts, widths, memory, memory_bytes, position, count, scratch):
    """Find the blocks holding tokens ``position .. position+count-1``: in the spill's memory
    part (the first ``memory_bytes`` bytes, at address ``memory``) where they lie, else read
    from the file with ``pread`` into ``scratch``.

    Returns (bits per token, index of token ``position`` within the blocks, their address), or
    0 bits when the read fails. A batch lies wholly in memory or wholly in the file, so the
    blocks of one sample never straddle the two."""
    first, start, blocks, w = _span(position, count, token_starts, byte_starts, widths)
    if w == 0:  # past the last token (the layout ends with a batch of 0 bits)
        return np.int64(0), np.int64(0), np.uint64(0)
    nbytes = blocks * (w + 1)
    if start + nbytes <= memory_bytes:
        return w, position - first, memory + np.uint64(start)
    if not _read_exact(fd, scratch.ctypes.data, nbytes, start - memory_bytes):
        return np.int64(0), np.int64(0), np.uint64(0)
    return w, position - first, np.uint64(scratch.ctypes.data)


@njit(cache=True, nogil=True, inline="always")
def _span(position, count, token_starts, byte_starts, widths):
    """The spill blocks holding tokens ``position .. position+count-1`` (all in one batch):
    (stream position of the first block's first token, byte position, blocks, bits per token)."""
    b, w = _locate(position, token_starts, widths)
    r = position - token_starts[b]
    first = r // BLOCK_TOKENS
    blocks = (r + count - 1) // BLOCK_TOKENS - first + 1
    return token_starts[b] + BLOCK_TOKENS * first, byte_starts[b] + first * (w + 1), blocks, w


@njit(cache=True, nogil=True, inline="always")
def _copy_edge_block(q, b, d, s, bits, out_tokens, out_mask, pos):
    """Block ``b`` (at address ``q``) of a sequence whose tokens are ``d .. d+s`` of its
    blocks, token by token: those in ``[d, d+s)`` to ``out_tokens``, the flags of those in
    ``(d, d+s]`` to ``out_mask``; returns token ``d + s`` when this block holds it, else -1."""
    flags = load_u32(q + np.uint64(bits)) & np.uint32(0xFF)
    last = np.int32(-1)
    for k in range(8):
        u = 8 * b + k
        if d <= u < d + s:
            out_tokens[pos + u - d] = _token_at(q, k, bits)
        if d < u <= d + s:
            out_mask[pos + u - d - 1] = np.uint8((flags >> np.uint32(k)) & np.uint32(1))
        if u == d + s:
            last = _token_at(q, k, bits)
    return last


@njit(cache=True, nogil=True, inline="always")
def _copy_sequence(at, d, s, bits, out_tokens, out_mask, pos):
    """Decode one sequence where its blocks lie (address ``at``, ``READ_SLACK`` readable bytes
    past them): tokens ``d .. d+s−1`` of the blocks to ``out_tokens[pos:pos+s]``, the flags of
    tokens ``d+1 .. d+s`` (the label-aligned mask) to ``out_mask[pos:pos+s]``; returns token
    ``d + s``, the last label.

    Every block between the first and the one holding token ``d + s`` lies wholly inside both
    output ranges (``d`` < 8), so its 8 tokens are stored straight and its 8 flags with one
    8-byte store; only the two edge blocks go token by token. Inlined where ``bits`` is a
    constant, each token is one load, a shift and a mask. 22M tokens of 17 bits gathered in
    random order from memory (``benchmarks/bench_gather.py``): 1.13-1.27 ns a token, 1.2-1.6×
    NumPy copying their tokens and mask bytes, against 2.0-2.2 ns decoding into a scratch
    buffer first with ``bits`` known only at run time."""
    stride = np.uint64(bits + 1)
    last_block = (d + s) // 8
    last = _copy_edge_block(at, 0, d, s, bits, out_tokens, out_mask, pos)
    if last_block == 0:
        return last
    mask_at = np.uint64(out_mask.ctypes.data)
    for b in range(1, last_block):
        q = at + np.uint64(b) * stride
        o = pos - d + 8 * b
        for k in range(8):
            out_tokens[o + k] = _token_at(q, k, bits)
        store_u64(mask_at + np.uint64(o - 1), _SPREAD[load_u32(q + np.uint64(bits)) & np.uint32(0xFF)])
    return _copy_edge_block(at + np.uint64(last_block) * stride, last_block, d, s, bits, out_tokens, out_mask, pos)


@njit(cache=True, nogil=True)
def _pread_gather_kernel(fd, token_starts, byte_starts, widths, memory, memory_bytes, seq_src, seq_len, seq_pad,
                         pack_seq_offsets, pad_id, scratch, out_tokens, out_mask, out_last, out_cu):
    """Copy a run of sequences (in output order), pack by pack.

    For sequence i (first token at stream position ``seq_src[i]``; real length s, padded
    length p): s input tokens, then p − s copies of ``pad_id``; the label-aligned mask is the
    flags of tokens 1..s; the last label is token s; ``out_cu`` gets each pack's physical
    offsets (N_k + 1 entries). A sequence's blocks (those holding its s + 1 tokens) are
    decoded where they lie in the memory part, or after one ``pread`` into ``scratch``
    (``READ_SLACK`` bytes longer than the blocks of the longest sequence), straight into the
    output (:func:`_copy_sequence`, with the widths of common vocabularies as constants).
    Returns False when a read fails.
    """
    pos = 0
    cu_pos = 0
    for k in range(pack_seq_offsets.size - 1):
        pack_start = pos
        out_cu[cu_pos] = 0
        cu_pos += 1
        for i in range(pack_seq_offsets[k], pack_seq_offsets[k + 1]):
            s = np.int64(seq_len[i])
            p = seq_pad[i]
            w, d, at = _read_blocks(fd, token_starts, byte_starts, widths, memory, memory_bytes, seq_src[i], s + 1,
                                    scratch)
            if w == 17:
                out_last[i] = _copy_sequence(at, d, s, 17, out_tokens, out_mask, pos)
            elif w == 16:
                out_last[i] = _copy_sequence(at, d, s, 16, out_tokens, out_mask, pos)
            elif w == 18:
                out_last[i] = _copy_sequence(at, d, s, 18, out_tokens, out_mask, pos)
            elif w == 15:
                out_last[i] = _copy_sequence(at, d, s, 15, out_tokens, out_mask, pos)
            elif w != 0:
                out_last[i] = _copy_sequence(at, d, s, w, out_tokens, out_mask, pos)
            else:
                return False
            for j in range(s, p):
                out_tokens[pos + j] = pad_id
                out_mask[pos + j] = 0
            pos += p
            out_cu[cu_pos] = pos - pack_start
            cu_pos += 1
    return True


@njit(cache=True, nogil=True)
def _pread_last_tokens_kernel(fd, token_starts, byte_starts, widths, memory, memory_bytes, lengths, scratch, out):
    """The last token of every sample (one small ``pread`` each from the file part)."""
    end = np.int64(0)
    for k in range(lengths.size):
        end += np.int64(lengths[k])
        w, d, at = _read_blocks(fd, token_starts, byte_starts, widths, memory, memory_bytes, end - 1, 1, scratch)
        if w == 0:
            return False
        out[k] = _load_token(at, d, w)
    return True


@njit(cache=True, nogil=True)
def _pread_run_items_kernel(fd_order, plan_offsets, pack_order, out_items, out_offsets):
    base = out_items.ctypes.data
    pos = 0
    out_offsets[0] = 0
    for k in range(pack_order.size):
        p = pack_order[k]
        n = plan_offsets[p + 1] - plan_offsets[p]
        if not _read_exact(fd_order, base + pos * 4, n * 4, plan_offsets[p] * 4):
            return False
        pos += n
        out_offsets[k + 1] = pos
    return True


#: The plan's item order, parked in the spill directory during pass two (int32).
ORDER_FILE = "order.bin"


class SpillMemory:
    """The spill's first ``budget`` bytes, held in anonymous memory instead of the file.

    What fits never goes to the file, and pass two decodes those sequences where they lie,
    without a ``pread`` each. The budget is reserved up front but only the pages written
    become resident, so a small input costs only its own size. ``used`` is how many bytes the
    writer put here; batches go here until one does not fit, then every later one goes to
    the file.

    ``pack`` holds up to 256 MiB here by default. On the benchmark VM, whose free memory goes
    back to the host (balloon free-page reporting), a standalone write of 266 MB took 0.07-1.75 s
    into a new file (fast only right after another file's pages were freed), 0.20-0.35 s into
    a shared anonymous mapping (what this memory used to be; shared memory gets 4 KiB pages
    from most kernels; 0.20-0.28 s when alternated with the next) and 0.15-0.17 s into a
    private one with 4 KiB pages, which this is: faulting a page of shared memory goes through
    the kernel's page cache for it. The same
    private mapping with transparent huge pages took 2.2-2.6 s there (each 2 MiB page found and
    zeroed), so huge pages are refused for it (``MADV_NOHUGEPAGE``; a kernel whose THP setting
    is ``always`` would otherwise use them). The benchmark's ``pack`` (a 266 MB spill): median
    1.47 s against 1.84 s with all of it in the file (CLI, 8 runs each, ABBA, 2 s apart), pass
    one 0.61 against 0.98 s; private against shared memory, 1.75 against 1.83 s (8 runs each,
    alternating, on a slower day). Earlier sessions measured no difference between the file and
    memory on the same machine (1.90 against 1.94 s), when the page cache's writes were cheap.
    """

    SLACK = 64  # readable bytes past the last block (at least READ_SLACK)

    def __init__(self, budget: int):
        self.budget = max(0, int(budget))
        self.used = 0
        self._map = mmap.mmap(-1, self.budget + self.SLACK, flags=mmap.MAP_PRIVATE) if self.budget else None
        if self._map is not None and hasattr(mmap, "MADV_NOHUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_NOHUGEPAGE)
            except OSError:  # a kernel without transparent huge pages
                pass
        self.array = np.frombuffer(self._map, dtype=np.uint8) if self._map else np.zeros(self.SLACK, np.uint8)

    @property
    def address(self) -> np.uint64:
        return np.uint64(self.array.ctypes.data)

    def release(self) -> None:
        """Give the pages back; call only once no thread reads the spill any more."""
        self.array = np.zeros(self.SLACK, np.uint8)
        self.used = self.budget = 0
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still exists (an error's traceback): freed with it
                pass
            self._map = None


class SpillWriter:
    """Appends batches of samples in the spill layout (see the module docstring): into
    ``memory`` while they fit its budget, then into ``samples.bin``. ``close`` writes
    ``layout.bin``: per batch, its first token position, first byte and bits per token, then
    the end (token count, byte count, 0 bits); byte positions run on from the memory part into the
    file (file offset = position − ``memory.used``)."""

    def __init__(self, spill_dir: str, memory: SpillMemory | None = None):
        self._dir = spill_dir
        self._memory = memory if memory is not None else SpillMemory(0)
        self._file = open(os.path.join(spill_dir, SPILL_FILE), "wb")
        self._buffer = np.empty(0, dtype=np.uint8)  # reused: a fresh buffer is a fresh memory map
        self._batches: list[tuple[int, int, int]] = []
        self._tokens = self._bytes = 0
        self._in_memory = True  # until the first batch that does not fit

    def write(self, tokens: np.ndarray, targets: np.ndarray, max_token: int | None = None) -> None:
        """Spill one batch of validated samples (their tokens, ids ≥ 0, and target flags);
        ``max_token``, when validation found it, is at least the largest id (else it is found here)."""
        bits = batch_bits(tokens, max_token)
        size = batch_spill_bytes(tokens.size, bits)
        memory = self._memory
        self._in_memory = stays_in_memory(self._in_memory, memory.used, size, memory.budget)
        if self._in_memory:
            out = memory.array[memory.used:memory.used + size]
        else:
            if self._buffer.size < size:
                self._buffer = np.empty(max(size, 2 * self._buffer.size), dtype=np.uint8)
            out = self._buffer[:size]
        _store_blocks(np.ascontiguousarray(tokens, dtype=np.int32), np.ascontiguousarray(targets, dtype=np.uint8),
                      bits, out)
        if self._in_memory:
            memory.used += size
        else:
            self._file.write(out)
        self._batches.append((self._tokens, self._bytes, bits))
        self._tokens += tokens.size
        self._bytes += size

    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def in_memory_bytes(self) -> int:
        return self._memory.used

    @property
    def max_bits(self) -> int:
        return max((bits for _, _, bits in self._batches), default=1)

    def close(self) -> None:
        self._file.close()
        # a last row of 0 bits marks the end: a read past the last token fails
        table = np.array(self._batches + [(self._tokens, self._bytes, 0)], dtype=np.int64).reshape(-1, 3)
        save_array(os.path.join(self._dir, LAYOUT_FILE), table)

    def abandon(self) -> None:
        """Close without finishing the spill (pass one is unwinding from an error, which a full
        disk's error on the way out must not replace): no layout, write errors ignored."""
        try:
            self._file.close()
        except OSError:
            pass


class SpillTally:
    """A dry run's :class:`SpillWriter`: what the spill of these batches would take, counted and
    not written (``total_bytes``, of which ``in_memory_bytes`` a memory part of ``budget`` bytes
    would hold; ``max_bits``, the widest ids of any batch)."""

    def __init__(self, budget: int = 0):
        self.budget, self.total_bytes, self.in_memory_bytes, self.max_bits = budget, 0, 0, 1
        self._in_memory = True

    def write(self, tokens: np.ndarray, targets: np.ndarray, max_token: int | None = None) -> None:
        bits = batch_bits(tokens, max_token)
        self.max_bits = max(self.max_bits, bits)
        size = batch_spill_bytes(tokens.size, bits)
        self._in_memory = stays_in_memory(self._in_memory, self.in_memory_bytes, size, self.budget)
        self.total_bytes += size
        if self._in_memory:
            self.in_memory_bytes += size

    def close(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class SpillReader:
    """Gathers runs of packs from the spill (its ``memory`` part where they lie there, else
    ``samples.bin`` with ``pread``), and reads runs of the plan order from ``order.bin`` when
    the pipeline parked it there.

    Output buffers handed back with :meth:`recycle` are reused by later runs: a fresh
    multi-megabyte allocation is a fresh memory map, and faulting its pages in costs as much
    as the copy itself. New buffers come from Arrow's memory pool.
    """

    def __init__(self, spill_dir: str, memory: SpillMemory | None = None):
        self._fds = []
        self._memory = memory if memory is not None else SpillMemory(0)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        table = load_array(os.path.join(spill_dir, LAYOUT_FILE), np.int64)
        if table.size < 3 or table.size % 3 or table[-1] != 0:  # its last row is the end mark (0 bits)
            raise SpillError(f"reading the spill files failed: {LAYOUT_FILE} is damaged (removed or truncated?)")
        table = table.reshape(-1, 3)
        self._layout = (np.ascontiguousarray(table[:, 0]), np.ascontiguousarray(table[:, 1]),
                        np.ascontiguousarray(table[:, 2]))  # token starts, byte starts, bits per batch
        order = os.path.join(spill_dir, ORDER_FILE)
        try:
            self._fds.append(os.open(os.path.join(spill_dir, SPILL_FILE), os.O_RDONLY))
            self._order_fd = os.open(order, os.O_RDONLY) if os.path.exists(order) else None
        except OSError as exc:  # the spill directory removed meanwhile
            self.close()
            raise spill_os_error(exc, "reading the spill files") from exc
        if self._order_fd is not None:
            self._fds.append(self._order_fd)

    def run_items(self, plan_offsets: np.ndarray, pack_order: np.ndarray):
        """The items of the packs ``pack_order`` (in that order) and each pack's offsets into
        them, read from the plan order parked in ``order.bin`` (int32) with one ``pread`` per
        pack, so the order never has to be resident."""
        if self._order_fd is None:
            raise FileNotFoundError(f"no {ORDER_FILE} in the spill directory: the plan order was not parked")
        sizes = plan_offsets[1:][pack_order] - plan_offsets[:-1][pack_order]
        out_items = np.empty(int(sizes.sum()), dtype=np.int32)
        out_offsets = np.empty(pack_order.size + 1, dtype=np.int64)
        if not _pread_run_items_kernel(self._order_fd, plan_offsets, np.ascontiguousarray(pack_order), out_items,
                                       out_offsets):
            raise SpillError("reading the spill files failed (were they removed or truncated?)")
        return out_items, out_offsets

    def recycle(self, buffers) -> None:
        """Give back the ``buffers`` of a gathered run once nothing reads them any more."""
        self._free.put(buffers)

    def _buffers(self, total: int):
        try:
            tokens, mask = self._free.get_nowait()
            if tokens.size >= total:
                return tokens, mask
        except queue.Empty:
            pass
        # From packer's Arrow memory pool, which still holds the pages pass one decoded into.
        pool = memory_pool()
        tokens = np.frombuffer(pa.allocate_buffer(4 * total, memory_pool=pool), dtype=np.int32)
        return tokens, np.frombuffer(pa.allocate_buffer(total, memory_pool=pool), dtype=np.uint8)

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def __enter__(self) -> "SpillReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def last_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """The last token of every sample (``lengths``: all samples' token counts, in order);
        one small ``pread`` each from the file part, nothing mapped; read where they lie from
        the memory part."""
        out = np.empty(lengths.size, dtype=np.int32)
        scratch = np.empty(2 * block_bytes(MAX_BITS) + READ_SLACK, dtype=np.uint8)
        if not _pread_last_tokens_kernel(self._fds[0], *self._layout, self._memory.address, self._memory.used,
                                         np.ascontiguousarray(lengths), scratch, out):
            raise SpillError("reading the spill files failed (were they removed or truncated?)")
        return out

    def gather(self, seq_src, seq_len, seq_pad, pack_seq_offsets, pad_id, min_buffer: int = 0):
        """Gather a run of packs: sequence i starts at stream position ``seq_src[i]`` and has
        real length ``seq_len[i]`` and padded length ``seq_pad[i]``; ``pack_seq_offsets``
        delimits the packs.

        Returns ``tokens`` (int32), ``loss_mask`` (uint8, label-aligned), ``last_token`` (int32
        per sequence), ``cu_seqlens`` (int32, N_k+1 entries per pack, concatenated) and the
        buffers to :meth:`recycle` (new ones hold at least ``min_buffer`` tokens)."""
        return self._gather_from(self._fds[0], self._layout, self._memory.address, self._memory.used, seq_src,
                                 seq_len, seq_pad, pack_seq_offsets, pad_id, min_buffer)

    def gather_run(self, first: int, seq, pack_seq_offsets, pad_id, min_buffer: int = 0):
        """:meth:`gather` of the resolved sequences ``seq`` of the run of output packs that
        starts at output position ``first`` (a staged reader needs to know which run it is)."""
        return self.gather(seq.src, seq.length, seq.padded, pack_seq_offsets, pad_id, min_buffer)

    def _gather_from(self, fd, layout, memory_address, memory_bytes, seq_src, seq_len, seq_pad, pack_seq_offsets,
                     pad_id, min_buffer):
        """:meth:`gather` from any spill image: ``layout`` (token starts, byte starts, bits per
        entry) over bytes that lie at ``memory_address`` up to ``memory_bytes``, then in ``fd``."""
        n_seq = seq_len.size
        n_packs = pack_seq_offsets.size - 1
        total = int(seq_pad.sum(dtype=np.int64))
        buffers = self._buffers(max(total, min_buffer))
        out_tokens, out_mask = buffers
        out_last = np.empty(n_seq, dtype=np.int32)
        out_cu = np.empty(n_seq + n_packs, dtype=np.int32)
        # the blocks of the longest sequence's s + 1 tokens, wherever in a block it starts
        scratch = np.empty((int(seq_len.max(initial=0)) // BLOCK_TOKENS + 2) * block_bytes(MAX_BITS) + READ_SLACK,
                           dtype=np.uint8)
        ok = _pread_gather_kernel(fd, *layout, memory_address, memory_bytes,
                                  np.ascontiguousarray(seq_src, dtype=np.int64),
                                  np.ascontiguousarray(seq_len), np.ascontiguousarray(seq_pad),
                                  np.ascontiguousarray(pack_seq_offsets, dtype=np.int64), np.int32(pad_id), scratch,
                                  out_tokens, out_mask, out_last, out_cu)
        if not ok:
            raise SpillError("reading the spill files failed (were they removed or truncated?)")
        return out_tokens[:total], out_mask[:total], out_last, out_cu, buffers

"""The spill: samples written in pass one, gathered pack by pack in pass two.

``samples.bin`` holds every kept sample once, in stream order, as its n tokens followed by its
n target flags (one byte each). Tokens are stored in as few little-endian bytes as the ids of
their write batch need (2 below 65,536, 3 below 2^24, else 4), so a token and its flag take
3 to 5 bytes; ``layout.bin`` records, per batch, its first token position, first byte and width
(written by :class:`SpillWriter`, read by :class:`SpillReader`). Keeping a sample's tokens and flags together lets the gather read a
whole sequence with one ``pread``.

The kernels work on flat arrays only (no Python objects), one memcpy-like step per sequence,
and release the GIL so reading, gathering and writing can overlap on separate threads.

:class:`SpillReader` reads the spill with ``pread`` straight into the output buffers:
no page of the spill is ever mapped into the process, so resident memory stays bounded by
the output buffers however large the spill is (touched pages of a memory map count toward
RSS, and a run of packs touches pages all over the file).
"""
from __future__ import annotations

import os
import queue

import numpy as np
import pyarrow as pa
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _pread(typingctx, fd, address, nbytes, offset):
    """libc ``pread(fd, address, nbytes, offset)``, bound by symbol name so the kernel caches."""
    sig = types.int64(types.int64, types.uint64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        char_p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(32), char_p, ir.IntType(64), ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "pread")
        fd_, address_, nbytes_, offset_ = args
        return builder.call(fn, [builder.trunc(fd_, ir.IntType(32)), builder.inttoptr(address_, char_p),
                                 nbytes_, offset_])

    return sig, codegen


@njit(cache=True, nogil=True)
def _read_exact(fd, address, nbytes, offset):
    """Read ``nbytes`` at ``offset`` into ``address``; False on an error or a short file."""
    while nbytes > 0:
        got = _pread(fd, address, nbytes, offset)
        if got <= 0:
            return False
        address += got
        nbytes -= got
        offset += got
    return True


SPILL_FILE = "samples.bin"
LAYOUT_FILE = "layout.bin"
_ONE_READ_GAP = 4096  # bytes between a sequence's tokens and its flags still read in one call


def token_width(max_id: int) -> int:
    """Bytes a spilled token takes when the largest id of its batch is ``max_id``."""
    return 2 if max_id < 1 << 16 else 3 if max_id < 1 << 24 else 4


@njit(cache=True, nogil=True)
def _copy_bytes(dst, dst_at, src, src_at, n):
    """``dst[dst_at:dst_at+n] = src[src_at:src_at+n]`` (uint8 arrays; unsigned indices vectorize)."""
    d = np.uint64(dst_at)
    s = np.uint64(src_at)
    for j in range(n):
        dst[d + np.uint64(j)] = src[s + np.uint64(j)]


@njit(cache=True, nogil=True)
def _interleave(tokens, targets, lengths, width, out):
    """Lay a batch of samples out as the spill stores them: each sample's tokens (``width`` low
    bytes each, little-endian), then its flags."""
    token_bytes = tokens.view(np.uint8)
    a = 0
    pos = 0
    for k in range(lengths.size):
        n = lengths[k]
        if width == 4:
            _copy_bytes(out, pos, token_bytes, 4 * a, 4 * n)
        else:
            _narrow(tokens, a, n, width, out, pos)
        _copy_bytes(out, pos + width * n, targets, a, n)
        pos += (width + 1) * n
        a += n


@njit(cache=True, nogil=True)
def _narrow(tokens, a, n, width, out, pos):
    """``out[pos:]`` = the ``width`` (2 or 3) low bytes of ``tokens[a:a+n]``, token after token."""
    q = np.uint64(pos)
    w = np.uint64(width)
    for j in range(n):
        t = np.uint32(tokens[a + j])
        out[q] = t & 0xFF
        out[q + np.uint64(1)] = (t >> 8) & 0xFF
        if width == 3:
            out[q + np.uint64(2)] = (t >> 16) & 0xFF
        q += w


@njit(cache=True, nogil=True)
def _widen(out_tokens, at, count, width):
    """Turn ``count`` tokens stored in ``width`` bytes each at ``out_tokens[at:]`` into int32 in
    place, last first (the int32 of token j never overwrites the bytes of a token before it)."""
    if width == 4:
        return
    raw = out_tokens.view(np.uint8)
    base = np.uint64(4 * at)
    w = np.uint64(width)
    for j in range(count - 1, -1, -1):
        q = base + w * np.uint64(j)
        value = np.int32(raw[q]) | (np.int32(raw[q + np.uint64(1)]) << 8)
        if width == 3:
            value |= np.int32(raw[q + np.uint64(2)]) << 16
        out_tokens[at + j] = value


@njit(cache=True, nogil=True)
def _sample_record(start, token_starts, byte_starts, widths):
    """(first byte, token width) of the sample whose first token is stream position ``start``."""
    b = np.searchsorted(token_starts, start, side="right") - 1
    w = np.int64(widths[b])
    return byte_starts[b] + (w + 1) * (start - token_starts[b]), w


@njit(cache=True, nogil=True)
def _pread_gather_kernel(fd, token_starts, byte_starts, widths, seq_src, seq_offset, sample_len, seq_len, seq_pad,
                         pack_seq_offsets, pad_id, out_tokens, out_mask, out_last, out_cu):
    """Copy a run of sequences (in output order), pack by pack.

    For sequence i (first token at stream position ``seq_src[i]``, ``seq_offset[i]`` tokens into
    a sample of ``sample_len[i]`` tokens; real length s, padded length p): s input tokens, then
    p − s copies of ``pad_id``; the label-aligned mask is the targets of tokens 1..s; the last
    label is token s; ``out_cu`` gets each pack's physical offsets (N_k + 1 entries). A sequence
    is one ``pread`` of its s+1 stored tokens and s flags, with the bytes between them, into
    ``out_tokens`` where its tokens belong (the flags, read past them into space later sequences
    will overwrite, are copied to ``out_mask`` first; ``out_tokens`` has room for that after its
    last sequence); then the tokens are widened to int32 in place. When what lies between is
    long (a truncated sample's tail) it is two reads: the tokens into ``out_tokens`` and the
    flags into ``out_mask``. The last token read is the final label, overwritten by padding or
    the next sequence. Returns False when a read fails.
    """
    tok_base = out_tokens.ctypes.data
    mask_base = out_mask.ctypes.data
    out_bytes = out_tokens.view(np.uint8)
    pos = 0
    cu_pos = 0
    for k in range(pack_seq_offsets.size - 1):
        pack_start = pos
        out_cu[cu_pos] = 0
        cu_pos += 1
        for i in range(pack_seq_offsets[k], pack_seq_offsets[k + 1]):
            s = seq_len[i]
            p = seq_pad[i]
            o = seq_offset[i]
            record, w = _sample_record(seq_src[i] - o, token_starts, byte_starts, widths)
            tok_at = record + w * o
            flag_at = record + w * sample_len[i] + o + 1
            span = flag_at + s - tok_at
            if flag_at - (tok_at + w * (s + 1)) <= _ONE_READ_GAP and 4 * pos + span <= out_bytes.size:
                if not _read_exact(fd, tok_base + pos * 4, span, tok_at):
                    return False
                _copy_bytes(out_mask, pos, out_bytes, 4 * pos + flag_at - tok_at, s)
            else:
                if not _read_exact(fd, tok_base + pos * 4, (s + 1) * w, tok_at):
                    return False
                if not _read_exact(fd, mask_base + pos, s, flag_at):
                    return False
            _widen(out_tokens, pos, s + 1, w)
            out_last[i] = out_tokens[pos + s]
            for j in range(s, p):
                out_tokens[pos + j] = pad_id
                out_mask[pos + j] = 0
            pos += p
            out_cu[cu_pos] = pos - pack_start
            cu_pos += 1
    return True


@njit(cache=True, nogil=True)
def _pread_last_tokens_kernel(fd, token_starts, byte_starts, widths, lengths, out):
    """The last token of every sample (one small ``pread`` each)."""
    start = np.int64(0)
    base = out.ctypes.data
    for k in range(lengths.size):
        n = np.int64(lengths[k])
        record, w = _sample_record(start, token_starts, byte_starts, widths)
        out[k] = 0
        if not _read_exact(fd, base + k * 4, w, record + w * (n - 1)):
            return False
        start += n
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


class SpillWriter:
    """Appends batches of samples to ``samples.bin`` in the spill layout (see the module docstring);
    ``close`` writes ``layout.bin``: per batch, its first token position, first byte and width."""

    def __init__(self, spill_dir: str):
        self._dir = spill_dir
        self._file = open(os.path.join(spill_dir, SPILL_FILE), "wb")
        self._buffer = np.empty(0, dtype=np.uint8)  # reused: a fresh buffer is a fresh memory map
        self._batches: list[tuple[int, int, int]] = []
        self._tokens = self._bytes = 0

    def write(self, tokens: np.ndarray, targets: np.ndarray, lengths: np.ndarray) -> None:
        """Spill one batch of validated samples (token ids are ≥ 0)."""
        width = token_width(int(tokens.max(initial=0)))
        size = (width + 1) * tokens.size
        if self._buffer.size < size:
            self._buffer = np.empty(max(size, 2 * self._buffer.size), dtype=np.uint8)
        out = self._buffer[:size]
        _interleave(np.ascontiguousarray(tokens, dtype=np.int32), np.ascontiguousarray(targets, dtype=np.uint8),
                    np.ascontiguousarray(lengths, dtype=np.int64), width, out)
        self._file.write(out)
        self._batches.append((self._tokens, self._bytes, width))
        self._tokens += tokens.size
        self._bytes += size

    def close(self) -> None:
        self._file.close()
        table = np.array(self._batches or [(0, 0, 4)], dtype=np.int64).reshape(-1, 3)
        table.tofile(os.path.join(self._dir, LAYOUT_FILE))


class SpillReader:
    """Gathers runs of packs from ``samples.bin`` with ``pread``, and reads runs of the plan
    order from ``order.bin`` when the pipeline parked it there.

    Output buffers handed back with :meth:`recycle` are reused by later runs: a fresh
    multi-megabyte allocation is a fresh memory map, and faulting its pages in costs as much
    as the copy itself. New buffers come from Arrow's memory pool.
    """

    def __init__(self, spill_dir: str):
        self._fds = []
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        table = np.fromfile(os.path.join(spill_dir, LAYOUT_FILE), dtype=np.int64).reshape(-1, 3)
        self._layout = (np.ascontiguousarray(table[:, 0]), np.ascontiguousarray(table[:, 1]),
                        np.ascontiguousarray(table[:, 2]))  # token starts, byte starts, widths per batch
        self._fds.append(os.open(os.path.join(spill_dir, SPILL_FILE), os.O_RDONLY))
        order = os.path.join(spill_dir, ORDER_FILE)
        self._order_fd = os.open(order, os.O_RDONLY) if os.path.exists(order) else None
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
            raise OSError("reading the spill files failed (were they removed or truncated?)")
        return out_items, out_offsets

    def recycle(self, buffers) -> None:
        """Give back the ``buffers`` of a gathered run once nothing reads them any more."""
        self._free.put(buffers)

    def _buffers(self, total: int):
        try:
            tokens, mask = self._free.get_nowait()
            if tokens.size > total:
                return tokens, mask
        except queue.Empty:
            pass
        # From Arrow's memory pool, which still holds the pages pass one decoded into.
        tokens = np.frombuffer(pa.allocate_buffer(4 * (total + 1)), dtype=np.int32)
        return tokens, np.frombuffer(pa.allocate_buffer(total), dtype=np.uint8)

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def __enter__(self) -> "SpillReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def last_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """The last token of every sample (``lengths``: all samples' token counts, in order);
        one small ``pread`` each, nothing mapped."""
        out = np.empty(lengths.size, dtype=np.int32)
        if not _pread_last_tokens_kernel(self._fds[0], *self._layout, np.ascontiguousarray(lengths), out):
            raise OSError("reading the spill files failed (were they removed or truncated?)")
        return out

    def gather(self, seq_src, seq_offset, sample_len, seq_len, seq_pad, pack_seq_offsets, pad_id,
               min_buffer: int = 0):
        """Gather a run of packs: sequence i starts at stream position ``seq_src[i]``, which is
        ``seq_offset[i]`` tokens into a sample of ``sample_len[i]`` tokens; it has real length
        ``seq_len[i]`` and padded length ``seq_pad[i]``; ``pack_seq_offsets`` delimits the packs.

        Returns ``tokens`` (int32), ``loss_mask`` (uint8, label-aligned), ``last_token`` (int32
        per sequence), ``cu_seqlens`` (int32, N_k+1 entries per pack, concatenated) and the
        buffers to :meth:`recycle` (new ones hold at least ``min_buffer`` tokens)."""
        n_seq = seq_len.size
        n_packs = pack_seq_offsets.size - 1
        total = int(seq_pad.sum(dtype=np.int64))
        # room after the last sequence for the flags read past its tokens (see the kernel)
        room = (_ONE_READ_GAP + int(seq_len.max(initial=0)) + 10) // 4
        buffers = self._buffers(max(total + room, min_buffer))
        out_tokens, out_mask = buffers
        out_last = np.empty(n_seq, dtype=np.int32)
        out_cu = np.empty(n_seq + n_packs, dtype=np.int32)
        ok = _pread_gather_kernel(self._fds[0], *self._layout, np.ascontiguousarray(seq_src, dtype=np.int64),
                                  np.ascontiguousarray(seq_offset, dtype=np.int64),
                                  np.ascontiguousarray(sample_len, dtype=np.int64), np.ascontiguousarray(seq_len),
                                  np.ascontiguousarray(seq_pad), np.ascontiguousarray(pack_seq_offsets, dtype=np.int64),
                                  np.int32(pad_id), out_tokens, out_mask, out_last, out_cu)
        if not ok:
            raise OSError("reading the spill files failed (were they removed or truncated?)")
        return out_tokens[:total], out_mask[:total], out_last, out_cu, buffers

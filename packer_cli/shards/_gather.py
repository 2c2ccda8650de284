"""The spill: samples written in pass one, gathered pack by pack in pass two.

``samples.bin`` holds every kept sample once, in stream order, as its n tokens (int32) followed
by its n target flags (uint8): 5 bytes a token, so the sample whose first token is stream
token P starts at byte 5·P (:class:`SpillWriter`). Keeping a sample's tokens and flags together
lets the gather read a whole sequence with one ``pread`` instead of two.

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
BYTES_PER_TOKEN = 5  # int32 token + uint8 target flag
_ONE_READ_GAP = 4096  # bytes between a sequence's tokens and its flags still read in one call


@njit(cache=True, nogil=True)
def _copy_bytes(dst, dst_at, src, src_at, n):
    """``dst[dst_at:dst_at+n] = src[src_at:src_at+n]`` (uint8 arrays; unsigned indices vectorize)."""
    d = np.uint64(dst_at)
    s = np.uint64(src_at)
    for j in range(n):
        dst[d + np.uint64(j)] = src[s + np.uint64(j)]


@njit(cache=True, nogil=True)
def _interleave(tokens, targets, lengths, out):
    """Lay a batch of samples out as the spill stores them: each sample's tokens, then its flags."""
    token_bytes = tokens.view(np.uint8)
    a = 0
    pos = 0
    for k in range(lengths.size):
        n = lengths[k]
        _copy_bytes(out, pos, token_bytes, 4 * a, 4 * n)
        _copy_bytes(out, pos + 4 * n, targets, a, n)
        pos += 5 * n
        a += n


@njit(cache=True, nogil=True)
def _pread_gather_kernel(fd, seq_src, seq_offset, sample_len, seq_len, seq_pad, pack_seq_offsets, pad_id,
                         out_tokens, out_mask, out_last, out_cu):
    """Copy a run of sequences (in output order), pack by pack.

    For sequence i (first token at stream position ``seq_src[i]``, ``seq_offset[i]`` tokens into
    a sample of ``sample_len[i]`` tokens; real length s, padded length p): s input tokens, then
    p − s copies of ``pad_id``; the label-aligned mask is the targets of tokens 1..s; the last
    label is token s; ``out_cu`` gets each pack's physical offsets (N_k + 1 entries). A sequence
    is one ``pread`` of its s+1 tokens and s flags, with the bytes between them, into
    ``out_tokens`` where its tokens belong (the flags, read past them into space later sequences
    will overwrite, are then copied to ``out_mask``; ``out_tokens`` has room for that after its
    last sequence). When what lies between is long (a truncated sample's tail) it is two reads:
    the tokens into ``out_tokens`` and the flags into ``out_mask``. The last token read is the
    final label, overwritten by padding or the next sequence.
    Returns False when a read fails.
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
            start = seq_src[i] - o  # the sample's first token
            tok_at = BYTES_PER_TOKEN * start + 4 * o
            flag_at = BYTES_PER_TOKEN * start + 4 * sample_len[i] + o + 1
            span = flag_at + s - tok_at
            if flag_at - (tok_at + 4 * (s + 1)) <= _ONE_READ_GAP and 4 * pos + span <= out_bytes.size:
                if not _read_exact(fd, tok_base + pos * 4, span, tok_at):
                    return False
                _copy_bytes(out_mask, pos, out_bytes, 4 * pos + flag_at - tok_at, s)
            else:
                if not _read_exact(fd, tok_base + pos * 4, (s + 1) * 4, tok_at):
                    return False
                if not _read_exact(fd, mask_base + pos, s, flag_at):
                    return False
            out_last[i] = out_tokens[pos + s]
            for j in range(s, p):
                out_tokens[pos + j] = pad_id
                out_mask[pos + j] = 0
            pos += p
            out_cu[cu_pos] = pos - pack_start
            cu_pos += 1
    return True


@njit(cache=True, nogil=True)
def _pread_tokens_kernel(fd, byte_offsets, out):
    base = out.ctypes.data
    for i in range(byte_offsets.size):
        if not _read_exact(fd, base + i * 4, 4, byte_offsets[i]):
            return False
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
    """Appends batches of samples to ``samples.bin`` in the spill layout (see the module docstring)."""

    def __init__(self, spill_dir: str):
        self._file = open(os.path.join(spill_dir, SPILL_FILE), "wb")
        self._buffer = np.empty(0, dtype=np.uint8)  # reused: a fresh buffer is a fresh memory map

    def write(self, tokens: np.ndarray, targets: np.ndarray, lengths: np.ndarray) -> None:
        size = BYTES_PER_TOKEN * tokens.size
        if self._buffer.size < size:
            self._buffer = np.empty(max(size, 2 * self._buffer.size), dtype=np.uint8)
        out = self._buffer[:size]
        _interleave(np.ascontiguousarray(tokens, dtype=np.int32), np.ascontiguousarray(targets, dtype=np.uint8),
                    np.ascontiguousarray(lengths, dtype=np.int64), out)
        self._file.write(out)

    def close(self) -> None:
        self._file.close()


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
        ends = np.cumsum(lengths, dtype=np.int64)
        byte_offsets = BYTES_PER_TOKEN * ends - lengths.astype(np.int64) - 4
        out = np.empty(byte_offsets.size, dtype=np.int32)
        if not _pread_tokens_kernel(self._fds[0], byte_offsets, out):
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
        room = (_ONE_READ_GAP + int(seq_len.max(initial=0)) + 2 * BYTES_PER_TOKEN) // 4
        buffers = self._buffers(max(total + room, min_buffer))
        out_tokens, out_mask = buffers
        out_last = np.empty(n_seq, dtype=np.int32)
        out_cu = np.empty(n_seq + n_packs, dtype=np.int32)
        ok = _pread_gather_kernel(self._fds[0], np.ascontiguousarray(seq_src, dtype=np.int64),
                                  np.ascontiguousarray(seq_offset, dtype=np.int64),
                                  np.ascontiguousarray(sample_len, dtype=np.int64), np.ascontiguousarray(seq_len),
                                  np.ascontiguousarray(seq_pad), np.ascontiguousarray(pack_seq_offsets, dtype=np.int64),
                                  np.int32(pad_id), out_tokens, out_mask, out_last, out_cu)
        if not ok:
            raise OSError("reading the spill files failed (were they removed or truncated?)")
        return out_tokens[:total], out_mask[:total], out_last, out_cu, buffers

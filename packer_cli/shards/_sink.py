"""A write-only output file that hashes every byte and bypasses the page cache where it can.

Writing through the page cache costs the kernel a page for every 4 KiB, and on machines whose
free memory goes back to a hypervisor (cloud VMs with free-page reporting, like the benchmark
machine) that page costs a fault to the host first: there a 600 MB buffered write into memory
idle for a few seconds took 1.5 s of system time, the same write right after a delete 0.14 s.
With ``O_DIRECT`` the bytes go from one reused buffer straight to the device: 600 MB in 4 MiB
writes took 0.47-0.56 s of wall time and 0.02-0.05 s of CPU, fsync included (the device's own
rate, ``benchmarks/bench_e2e.py``'s ``disk_direct`` row), whatever the state of memory.

So :class:`OutputFile` stages writes in two page-aligned buffers, reused for the whole file:
while the file's I/O thread writes a full one, the writer fills the other. The file's last,
partial block is written padded to the alignment and the file cut back to its true size.

``O_DIRECT`` is an optimisation, never a requirement: where the platform has no such flag or
the file system refuses it, at ``open`` (tmpfs before Linux 6.6, some FUSE mounts) or at a
``write``, the file is written through the page cache instead, with the same bytes. And it is
only asked for where it helps (:func:`use_direct_io`): on a network file system such as NFS a
direct write is a synchronous round trip to the server, where buffered writes stream behind.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

#: Bytes staged per direct write. Two such buffers per file: one is written (by the file's
#: I/O thread) while the other fills, so the device stays busy. Measured on the benchmark
#: (pass two, 597 MB in three shards, two at a time): 4 MiB 0.51-0.56 s, 8 MiB 0.51-0.59,
#: 16 MiB 0.50-0.61, 32 MiB 0.60-0.71 (larger buffers are fresh memory to fault in per file).
DIRECT_BLOCK = 4 << 20
#: Offsets and lengths of direct writes are multiples of this (the largest logical block size
#: in use; the staging buffers are page-aligned by ``mmap``).
ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)

#: File systems whose direct writes go to their devices as they come: local block file systems
#: and the parallel file systems built for large direct writes. Anything else (NFS and SMB,
#: whose direct writes each wait for the server; FUSE; tmpfs; overlays) is written through
#: the page cache unless direct I/O is asked for explicitly.
DIRECT_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "lustre", "gpfs"})
MOUNTINFO = "/proc/self/mountinfo"


def file_system_type(path: str) -> str | None:
    """The type of the file system ``path`` lies on (from ``/proc/self/mountinfo``: the last
    mount on the longest mount point above it), or None where that cannot be told."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:  # not Linux, or no /proc
        return None
    target = os.path.realpath(path)
    best, found = -1, None
    for line in lines:
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040 is a space
        if target == point or target.startswith(point.rstrip("/") + "/"):
            if len(point) >= best:
                best, found = len(point), fields[fields.index("-", 6) + 1]
    return found


def use_direct_io(directory: str, asked: bool | None) -> bool:
    """Whether to write files in ``directory`` with ``O_DIRECT``: as ``asked``, or, when that is
    None, where its file system is one of :data:`DIRECT_FILE_SYSTEMS`."""
    if asked is not None:
        return asked
    return file_system_type(directory) in DIRECT_FILE_SYSTEMS


class OutputFile:
    """``write``/``tell``/``close`` over one new file, hashing (xxh3_64) every byte on its way.

    ``direct=False`` (or a platform or file system without ``O_DIRECT``) writes through the
    page cache. :meth:`close` flushes the staged tail; :meth:`discard` only closes, for a file
    an error abandons. Accepted by ``pa.ipc.new_file``; the hash and the copies release the GIL.
    """

    def __init__(self, path: str, direct: bool = True, block: int | None = None):
        block = block or DIRECT_BLOCK
        assert block % ALIGN == 0
        self.path = path
        self.digest = xxhash.xxh3_64()
        self.closed = False
        self._pos = 0
        self._staged = 0
        self._fd = _open_direct(path) if direct and _O_DIRECT else -1
        #: whether writes are staged in blocks, and whether the file still takes them directly
        #: (a file system may refuse ``O_DIRECT`` at the first write: the blocks then go buffered)
        self._staging = self.direct = self._fd >= 0
        if not self._staging:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            return
        self._maps = [mmap.mmap(-1, block) for _ in range(2)]
        self._stages = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        self._filling = 0
        self._stage = self._stages[0]
        self._pending = None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="packer-io")

    # -- the file-like surface pyarrow uses -------------------------------------------------
    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        if self._staging:
            self._stage_bytes(np.frombuffer(view, dtype=np.uint8))
        else:
            _write_all(self._fd, view)
        self._pos += view.nbytes
        return view.nbytes

    def close(self) -> None:
        """Write what is staged and close; the file then holds exactly the bytes written."""
        if self.closed:
            return
        try:
            if self._staging:
                self._wait()  # the last full block's write: its error is the file's, even with no tail
            if self._staged:
                self._write_tail()
            os.fsync(self._fd)  # durable before the output is renamed into place (a write-back error shows here)
        finally:
            self.discard()

    def discard(self) -> None:
        """Close without writing what is still staged (the file is being abandoned)."""
        if self.closed:
            return
        self.closed = True
        if self._staging:
            if self._pending is not None:
                self._pending.exception()  # waits for it; an error there is moot, the file is abandoned
            self._io.shutdown()
        os.close(self._fd)
        if self._staging:
            del self._stage, self._stages
            for m in self._maps:
                m.close()

    # -- staging ----------------------------------------------------------------------------
    def _stage_bytes(self, data: np.ndarray) -> None:
        block = self._stage.size
        done = 0
        while done < data.size:
            n = min(block - self._staged, data.size - done)
            self._stage[self._staged:self._staged + n] = data[done:done + n]  # numpy copies without the GIL
            self._staged += n
            done += n
            if self._staged == block:
                self._wait()
                self._pending = self._io.submit(self._write_staged, self._filling, block)
                self._filling ^= 1
                self._stage = self._stages[self._filling]
                self._staged = 0

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write_staged(self, index: int, nbytes: int) -> None:
        with memoryview(self._maps[index]) as whole, whole[:nbytes] as view:
            written = 0
            if self.direct:
                try:
                    written = os.write(self._fd, view)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise  # a full disk, an I/O error: the caller's to report
                if written < nbytes:  # refused, or a short write that leaves the offset unaligned
                    self._leave_direct()
            # released here even when the write fails: the error's traceback keeps _write_all's
            # frame, and a view of the map alive there makes discard's m.close() a BufferError
            with view[written:] as rest:
                _write_all(self._fd, rest)

    def _write_tail(self) -> None:
        """The last, partial block: a direct write must cover whole ``ALIGN``-byte blocks, so
        it is written padded with zeros and the file cut back to the bytes written."""
        self._wait()
        if not self.direct:
            self._write_staged(self._filling, self._staged)
            return
        padded = -(-self._staged // ALIGN) * ALIGN
        self._stage[self._staged:padded] = 0
        self._write_staged(self._filling, padded)
        os.ftruncate(self._fd, self._pos)

    def _leave_direct(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self.direct = False


def _open_direct(path: str) -> int:
    """A new file opened for direct writes, or -1 where the file system refuses them."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o666)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return -1


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < view.nbytes:
        done += os.write(fd, view[done:])

"""OutputFile: shards written with O_DIRECT where the file system allows, through the page
cache where it does not, always the same bytes and the same hash."""
from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
import xxhash

from packer_cli.shards import _sink
from packer_cli.shards._sink import ALIGN, OutputFile

BLOCK = 4 * ALIGN  # small staging blocks, so every test crosses many of them


def _pieces(seed: int, total: int) -> list[bytes]:
    """Random bytes cut at random sizes: empty pieces, single bytes, pieces larger than a block."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, total, dtype=np.uint8).tobytes()
    cuts = np.sort(rng.integers(0, total + 1, 40))
    cuts = np.concatenate([[0], cuts, [cuts[-1]], [total]])  # one empty piece at least
    return [data[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def _write(path, pieces, **kw) -> OutputFile:
    f = OutputFile(str(path), block=BLOCK, **kw)
    for piece in pieces:
        assert f.write(piece) == len(piece)
    f.close()
    return f


def _direct_supported(tmp_path) -> bool:
    f = OutputFile(str(tmp_path / "probe"), block=BLOCK)
    f.discard()
    os.unlink(tmp_path / "probe")
    return f.direct


@pytest.mark.parametrize("total", [0, 1, ALIGN - 1, ALIGN, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 7 * BLOCK + 123])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_the_file_holds_exactly_the_bytes_written_and_their_hash(tmp_path, total, direct):
    pieces = _pieces(total, total)
    expected = b"".join(pieces)
    f = _write(tmp_path / "out", pieces, direct=direct)
    assert (tmp_path / "out").read_bytes() == expected  # no padding left past the end
    assert f.tell() == total and f.digest.hexdigest() == xxhash.xxh3_64(expected).hexdigest()
    if not direct:
        assert not f.direct


def test_direct_writes_are_direct_where_the_file_system_takes_them(tmp_path):
    if not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path}: this file system refuses O_DIRECT (the buffered path is tested)")
    f = OutputFile(str(tmp_path / "out"), block=BLOCK)
    with open(f"/proc/self/fdinfo/{f._fd}") as info:
        flags = int(next(line for line in info if line.startswith("flags:")).split()[1], 8)
    f.discard()
    assert flags & os.O_DIRECT


def test_a_file_system_that_refuses_o_direct_at_open_gets_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    pieces = _pieces(1, 3 * BLOCK + 17)
    f = _write(tmp_path / "out", pieces)
    assert not f.direct and (tmp_path / "out").read_bytes() == b"".join(pieces)


@pytest.mark.parametrize("how", ["refused", "short"])
def test_a_direct_write_refused_or_cut_short_continues_buffered(tmp_path, monkeypatch, how):
    """EINVAL at the first write (a file system that took the flag at open), or a write that
    stops at an unaligned offset: the rest of the file goes through the page cache."""
    if not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path}: this file system refuses O_DIRECT at open (tested above)")
    import fcntl

    real_write = os.write
    calls, short = [], []

    def flaky_write(fd, data):
        calls.append(len(data))
        if len(calls) == 2:  # the second block
            if how == "refused":
                raise OSError(errno.EINVAL, "Invalid argument")
            # a real short write: 1000 bytes land and the offset is left unaligned (with O_DIRECT
            # still set, writing 1000 bytes would itself be refused, the case above again)
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            try:
                short.append(real_write(fd, memoryview(data)[:1000]))
                return short[-1]
            finally:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", flaky_write)
    pieces = _pieces(2, 5 * BLOCK + 99)
    f = _write(tmp_path / "out", pieces)
    assert not f.direct and len(calls) > 2
    assert short == ([1000] if how == "short" else [])
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)


def test_a_failing_write_is_raised_to_the_writer_and_no_thread_is_left(tmp_path, monkeypatch):
    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    threads = threading.active_count()
    f = OutputFile(str(tmp_path / "out"), block=BLOCK)
    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError) as raised:
        for piece in _pieces(3, 6 * BLOCK):
            f.write(piece)
        f.close()
    assert raised.value.errno == errno.ENOSPC
    f.discard()
    assert f.closed and threading.active_count() == threads


@pytest.mark.parametrize("tail", [0, 5])
def test_the_last_blocks_failing_write_is_raised_by_close(tmp_path, monkeypatch, tail):
    """A file of whole blocks has no tail to write at close: close() discarded the last block's
    pending write and its error, and the file was short with a hash of all its bytes."""
    write = os.write
    calls = []

    def full_at_the_second_block(fd, data):
        calls.append(len(data))
        if len(calls) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    f = OutputFile(str(tmp_path / "out"), block=BLOCK)
    if not f.direct:
        pytest.skip("the file system here takes no direct writes")
    monkeypatch.setattr(os, "write", full_at_the_second_block)
    f.write(b"x" * (2 * BLOCK + tail))
    with pytest.raises(OSError) as raised:
        f.close()
    assert raised.value.errno == errno.ENOSPC and f.closed


def test_discard_abandons_the_staged_bytes_and_joins_the_writer(tmp_path):
    threads = threading.active_count()
    f = OutputFile(str(tmp_path / "out"), block=BLOCK)
    data = b"x" * (2 * BLOCK + 5)
    f.write(data)
    f.discard()
    f.discard()  # idempotent
    f.close()  # a no-op once discarded
    assert f.closed and threading.active_count() == threads
    assert os.path.getsize(tmp_path / "out") <= 2 * BLOCK  # whole blocks at most, never the tail


def test_without_o_direct_on_the_platform_writes_are_buffered(tmp_path, monkeypatch):
    monkeypatch.setattr(_sink, "_O_DIRECT", 0)
    pieces = _pieces(4, 2 * BLOCK + 1)
    f = _write(tmp_path / "out", pieces)
    assert not f.direct and (tmp_path / "out").read_bytes() == b"".join(pieces)


MOUNTS = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 253:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:50 / /mnt/shared rw,relatime shared:7 - nfs4 server:/export rw,vers=4.2
41 27 0:51 / /mnt/with\\040space rw,relatime - xfs /dev/vdb rw
42 40 0:52 / /mnt/shared/scratch rw,relatime - lustre 10.0.0.1@tcp:/fs rw
43 27 0:53 / /mnt/over rw,relatime - nfs server:/a rw
44 27 0:54 / /mnt/over rw,relatime - tmpfs tmpfs rw
"""


@pytest.mark.parametrize("path,fs", [
    ("/work/data/out", "ext4"),                 # only the root mount lies above it
    ("/mnt/shared/out", "nfs4"),
    ("/mnt/shared", "nfs4"),                    # the mount point itself
    ("/mnt/sharedish/out", "ext4"),             # a name that merely starts like a mount point
    ("/mnt/shared/scratch/run1/out", "lustre"),  # the longest mount point wins
    ("/mnt/with space/out", "xfs"),             # mountinfo writes a space as \040
    ("/mnt/over/out", "tmpfs"),                 # of two mounts on one point, the later one shows
])
def test_file_system_type_reads_the_innermost_mount(tmp_path, monkeypatch, path, fs):
    (tmp_path / "mountinfo").write_text(MOUNTS)
    monkeypatch.setattr(_sink, "MOUNTINFO", str(tmp_path / "mountinfo"))
    assert _sink.file_system_type(path) == fs


def test_use_direct_io_follows_the_request_else_the_file_system(tmp_path, monkeypatch):
    (tmp_path / "mountinfo").write_text(MOUNTS)
    monkeypatch.setattr(_sink, "MOUNTINFO", str(tmp_path / "mountinfo"))
    assert _sink.use_direct_io("/work/out", None) and _sink.use_direct_io("/mnt/shared/scratch/o", None)
    assert not _sink.use_direct_io("/mnt/shared/out", None) and not _sink.use_direct_io("/mnt/over/o", None)
    assert _sink.use_direct_io("/mnt/shared/out", True) and not _sink.use_direct_io("/work/out", False)
    monkeypatch.setattr(_sink, "MOUNTINFO", str(tmp_path / "missing"))  # no /proc: nothing is known
    assert _sink.file_system_type("/work/out") is None and not _sink.use_direct_io("/work/out", None)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("total", [0, BLOCK + 1])
def test_close_syncs_the_file_before_it_is_closed(tmp_path, monkeypatch, direct, total):
    """close() makes the bytes durable (the output is renamed into place only after): the file's
    own descriptor is fsynced, after its last write and before it is closed."""
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(_sink.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    f = OutputFile(str(tmp_path / "out"), block=BLOCK, direct=direct)
    fd = f._fd
    f.write(b"\x01" * total)
    assert synced == []
    f.close()
    assert synced == [fd]
    assert (tmp_path / "out").read_bytes() == b"\x01" * total

"""Build OUT in a temporary sibling directory, then put it in place in one rename.

The temporary directory is ``OUT.tmp-PID-RANDOM``, created only if no such name exists (two
runs with one process id, in two containers or on two nodes sharing a file system, each get
their own); the names are made and recognized here only. Where
``OUT``'s own name is too long for that (a file name holds 255 bytes), the sibling's name keeps
the start of it and a digest of the whole (:func:`_sibling_prefix`).
``--overwrite`` replaces an OUT only when :func:`check_replaceable` agrees it is packer's own.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from packer_cli.errors import ConfigError, interrupts_deferred

#: The signals the CLI unwinds a command on (a closed terminal or dropped ssh sends SIGHUP).
STOPPING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_HELD = STOPPING_SIGNALS


def remove_tree(path: str, ignore_errors: bool = True) -> None:
    """``shutil.rmtree`` with a signal's exception held until it is done: raised between two of
    rmtree's own steps (Python 3.11 closes a directory's descriptor, then marks it closed), its
    cleanup closed the descriptor again and the run ended in 'Bad file descriptor' (exit 129 and
    two error lines, with a joined Bridge split already in place), a number another thread may
    have reused meanwhile."""
    with interrupts_deferred():
        shutil.rmtree(path, ignore_errors=ignore_errors)


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block is done, then deliver them.

    For the few renames that move a finished output into place: an exception (or the default
    SIGTERM death) between two of them would leave OUT renamed aside or half-updated, and the
    caller's cleanup would then delete the new output. Signals arriving meanwhile are recorded
    and raised again, in order, once the block ends. Only the main thread can hold them (it
    runs Python's signal handlers); elsewhere the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for signum in _HELD:
        handler = signal.getsignal(signum)
        if handler is not None and handler is not signal.SIG_IGN:  # None: installed outside Python
            previous[signum] = handler
            signal.signal(signum, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in caught:
            signal.raise_signal(signum)


_TMP = ".tmp-"
_OLD = REPLACED = ".old-"
_NAME_MAX = 255  # bytes in one file name (ext4, xfs, btrfs, tmpfs, NFS, Lustre)
_PID_DIGITS = 10  # room kept for the process id that ends a sibling's name
_RANDOM_HEX = 8  # then "-" and this many hex digits: unique where process ids are not
_SUFFIX_ROOM = _PID_DIGITS + 1 + _RANDOM_HEX
_SUFFIX = re.compile(r"(\d+)(?:-[0-9a-f]{%d})?" % _RANDOM_HEX)  # also the PID-only names of earlier releases


def _sibling_prefix(name: str, marker: str) -> str:
    """How the names of ``name``'s siblings (temporary, replaced) start, a process id to follow:
    ``name + marker``; where that would not fit in a file name, ``name`` cut short plus a digest
    of all of it, so two long OUT names that share their start still get siblings of their own.
    A 250-byte OUT (a valid name) failed with "File name too long" on ``OUT.tmp-PID``."""
    encoded = os.fsencode(name)
    if len(encoded) + len(marker) + _SUFFIX_ROOM <= _NAME_MAX:
        return name + marker
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    room = _NAME_MAX - _SUFFIX_ROOM - len(marker) - len(digest) - 1
    start = encoded[:room].decode("utf-8", errors="ignore")  # ending on a whole character
    return f"{start}~{digest}{marker}"


def _sibling(out: str, marker: str) -> str:
    """A new name beside ``out``: its prefix, this process's id and a random part."""
    parent, name = os.path.split(os.path.normpath(out))
    return os.path.join(parent, f"{_sibling_prefix(name, marker)}{os.getpid()}-{secrets.token_hex(_RANDOM_HEX // 2)}")


def output_target(out: str) -> str:
    """The directory an output named ``out`` is built as: ``out`` itself or, when ``out`` is a
    symbolic link (to an earlier output, or dangling: to where one is to go), what it points to.

    The temporary sibling and the final rename then happen beside the target, so the link
    keeps pointing at the output; renaming onto the link itself would replace the link (and,
    with ``--overwrite``, leave it renamed aside), or fail at the very end on a dangling one.
    """
    out = os.path.normpath(out)
    if not os.path.islink(out):
        return out
    target = os.path.realpath(out)
    if os.path.islink(target):  # realpath leaves a loop unresolved
        raise ConfigError(f"{out} is a symbolic link that does not resolve (a loop)")
    return target


def check_parent(out: str) -> None:
    """The directory that will hold ``out`` must be one (a :class:`ConfigError` saying why not)."""
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        why = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ConfigError(f"{parent}: output parent directory {why}")
    name = os.fsencode(os.path.basename(os.path.abspath(out)))
    try:
        longest = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = None
    if longest and len(name) > longest:  # the temporary output's name is shortened: only the final rename failed
        raise ConfigError(f"{out}: a name of {len(name):,} bytes, longer than its directory allows ({longest})")
    if os.path.isdir(out) and _is_mount_point(out):  # else the whole run, then EXDEV or EBUSY renaming into it
        raise ConfigError(f"{out} is a mount point: the output is built beside OUT and renamed into place, "
                          "which cannot replace a mount point or move files onto another file system; "
                          "write into a directory inside it")


def _is_mount_point(path: str) -> bool:
    """Whether something is mounted at ``path``: ``os.path.ismount`` (another device, or the
    same directory as its parent), or a mount point in ``/proc/self/mountinfo`` (a bind mount
    from the same file system, which ismount cannot tell, as containers and clusters use)."""
    if os.path.ismount(path):
        return True
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            table = f.read()
    except OSError:  # not Linux, or no /proc
        return False
    real = os.fsencode(os.path.realpath(path))
    for line in table.splitlines():
        fields = line.split(b" ")
        if len(fields) > 4 and _unescaped(fields[4]) == real:
            return True
    return False


def _unescaped(field: bytes) -> bytes:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes."""
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field)


def check_writable(directory: str, what: str) -> None:
    """For a dry run, which makes nothing: would the real run be let to create entries in
    ``directory``? (The real run finds out by creating them.)"""
    if not os.access(directory or os.curdir, os.W_OK | os.X_OK):
        raise ConfigError(f"{directory}: {what} is not writable")


def make_temporary(out: str) -> str:
    """Create and return a temporary sibling of ``out`` that no other run has.

    The name is new and ``mkdir`` refuses an existing one, so a directory another run is
    building (one with the same process id, in another container or on another node) is never
    taken over or deleted, as it was when the name held the process id alone.
    """
    while True:
        tmp = _sibling(out, _TMP)
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue  # drawn before (2**-32): draw again
        except BaseException:  # a Ctrl-C raised as mkdir returns: the directory may exist, unknown to the caller
            if os.path.isdir(tmp) and not os.listdir(tmp):
                os.rmdir(tmp)
            raise


def stale_temporaries(out: str, tmp: str, marker: str = _TMP) -> list[str]:
    """Temporary siblings of ``out`` other than ``tmp``: left by runs that were killed outright
    (with ``marker`` ``.old-``: an old OUT that such a run had renamed aside to replace it).

    One whose process id is a live process here is left out: most likely a run still packing
    (it may be another node's, which no check here can tell)."""
    out = os.path.normpath(out)
    parent, name = os.path.split(os.path.abspath(out))
    prefix = _sibling_prefix(name, marker)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    ours = os.path.basename(os.path.normpath(tmp))
    stale = []
    for n in names:
        match = _SUFFIX.fullmatch(n[len(prefix):]) if n.startswith(prefix) and n != ours else None
        if match and not _alive(int(match.group(1))):
            stale.append(os.path.join(os.path.dirname(out), n))
    return sorted(stale)


SPILL_PREFIX = "packer-spill-"


def host_name() -> str:
    """This machine's name as a file name part (a scratch directory may be shared by nodes)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"


def spill_dir_prefix() -> str:
    """How this run's private spill directory under ``--spill-dir`` starts: with its machine and
    process id, so that a later run on the same machine can tell one left by a run killed
    outright (and leaves other machines' alone: a scratch directory may be shared)."""
    return f"{SPILL_PREFIX}{host_name()}-{os.getpid()}-"


def stale_spill_dirs(spill_parent: str) -> list[str]:
    """This machine's spill directories in ``spill_parent`` whose process is gone (killed outright)."""
    try:
        names = os.listdir(spill_parent)
    except OSError:
        return []
    # the whole name: host "vm" must not read host "vm-99999"'s spill as its own process 99999
    ours = re.compile(re.escape(f"{SPILL_PREFIX}{host_name()}-") + r"(\d+)-[A-Za-z0-9_]+")
    return sorted(os.path.join(spill_parent, n) for n in names
                  if (match := ours.fullmatch(n)) and not _alive(int(match.group(1))))


def _alive(pid: int) -> bool:
    """Whether a process with this id runs here (and may be the run that owns a sibling)."""
    if pid <= 0:  # os.kill(0, ...) would signal this process group
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's process
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return True


def sync_dir(path: str, *, in_place: bool = False) -> None:
    """Make ``path``'s entries durable (files created in it, renames into or out of it): its own
    ``fsync``. A file system that cannot sync a directory (some FUSE and network mounts refuse
    it) is left as it is; a failing device is the caller's error, unless ``in_place``: the
    output is already renamed into place (and any old one deleted), so failing the run then
    would report an output that is there as not written."""
    try:
        fd = os.open(path or os.curdir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if not in_place and exc.errno not in (errno.EINVAL, errno.EROFS, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


def write_synced(path: str, data: bytes) -> None:
    """Write a small file whole and durable (``fsync`` before it is renamed into place)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_dir(tmp: str, out: str, overwrite: bool = True,
                still_replaceable: Callable[[str], None] | None = None,
                foreign_names: Callable[[str, list[str]], list[str]] | None = None) -> str | None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is replaced, then deleted.

    Readers see either the old directory or the new one, never a mix, and never no ``out``:
    where the kernel and the file system can (Linux ``renameat2(RENAME_EXCHANGE)``: ext4, xfs,
    btrfs, tmpfs) the two are swapped in one step, the old one then renamed to ``OUT.old-*``
    and deleted. Elsewhere (NFS, other systems) ``out`` is renamed aside first, and is absent
    between the two renames; signals are held across them, so only a run killed outright (or
    a power loss) in that window leaves no ``out``. Should the second rename fail, the old
    directory is put back.

    Without ``overwrite`` an ``out`` that appeared since the run checked it (another run to the
    same OUT finished first) is a :class:`ConfigError`, not replaced: both runs reported
    success and the first one's output was gone. Its message advises ``--overwrite`` unless
    ``foreign_names`` (given: see :func:`check_replaceable`) says that would be refused too.

    ``still_replaceable(path)``, given, judges the old OUT as it is now and raises to keep it:
    the run checked OUT when it started, and a directory of other files that appeared at OUT
    while it packed was deleted. It judges OUT in place, under OUT's lock (other runs wait), so a
    refused OUT never moves; after a swap it judges the old OUT again under its new name, and
    keeps it as ``OUT.old-*`` (returned) when files packer did not write appeared in it in the
    moment between; on the two-rename path, it judges OUT once renamed aside (nobody else's to
    change by name) too, putting it back when it raises.

    Returns the old directory when it was not deleted (a read-only one: its files cannot be
    unlinked; or, after a swap, one that files packer did not write appeared in as it was
    swapped out), for the caller to point out; else None.
    """
    out = os.path.normpath(out)
    # Durable before it is visible: the files are synced as they are closed, their entries
    # here, and the rename in OUT's parent after it (a power loss leaves the old or the new OUT).
    sync_dir(tmp)
    if not overwrite:
        try:
            os.rename(tmp, out)  # refused onto a file or a non-empty directory
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
            refusal = overwrite_refusal(out, foreign_names) if foreign_names else None  # no circular advice
            raise ConfigError(f"{out} already exists (it appeared while this run was packing: another run?); "
                              f"{refusal or 'pass --overwrite to replace it'}") from None
        sync_dir(os.path.dirname(out), in_place=True)
        return None
    while True:
        kept = _replace_once(tmp, out, still_replaceable)
        if kept is not _AGAIN:
            sync_dir(os.path.dirname(out), in_place=True)
            return kept


_AGAIN = object()  # _replace_once: another run's OUT appeared in the moment OUT was absent


def _replace_once(tmp: str, out: str, still_replaceable) -> str | None | object:
    """One try of :func:`replace_dir` with ``--overwrite``, under OUT's lock (a Bridge split
    joining OUT holds it too); :data:`_AGAIN` where another run's OUT appeared in the moment
    OUT was absent (the loser exited 3 with the put-back's "Directory not empty", leaving
    OUT.old-* behind): the replaced OUT is deleted, as it was to be, and the new one replaced."""
    with locked(out), locked(tmp):  # tmp becomes OUT's directory: runs waiting on OUT wait on it too
        with signals_held():  # one block: a signal met on the way is raised only once all is done
            if os.path.lexists(out) and _judged_in_place(out, still_replaceable) and _exchange(tmp, out):
                return _discard_swapped(tmp, out, still_replaceable)
            return _rename_twice(tmp, out, still_replaceable)


def _judged_in_place(out: str, still_replaceable) -> bool:
    """Judge OUT where it is, under its lock, before anything moves, so a refused OUT is never
    even renamed (a kill or a failed put-back would leave it missing); True where it is a real
    directory, which may be swapped out."""
    if os.path.islink(out):
        raise _appeared_link(out)
    if still_replaceable is not None:
        still_replaceable(out)
    return os.path.isdir(out)


def _appeared_link(out: str) -> ConfigError:
    """OUT was resolved when the run began (:func:`output_target`): a link there is someone else's since."""
    return ConfigError(f"{out} is now a symbolic link (it appeared while this run was packing: another run?); "
                       "--overwrite replaces only a packer output")


def _discard_swapped(tmp: str, out: str, still_replaceable) -> str | None:
    """The old OUT, swapped out to ``tmp``'s name: judged again there (nobody else's to change by
    name; a file written into OUT between the judgement in place and the swap is seen), renamed
    to ``OUT.old-*`` and deleted, or kept there when it is no longer packer's to delete. The new
    output is in place by now, so neither that nor a failure here fails the run: the old one is
    returned for the caller to point out (raising would have the caller's clean-up treat
    ``tmp``, the old output, as its own unfinished directory)."""
    trash = _sibling(out, _OLD)
    try:
        os.rename(tmp, trash)
    except OSError:
        trash = tmp
    try:
        if still_replaceable is not None:
            still_replaceable(trash)
    except Exception:  # noqa: BLE001 - whatever the judgement says, the old OUT is not deleted
        return trash
    remove_tree(trash)
    return trash if os.path.lexists(trash) else None


def _rename_twice(tmp: str, out: str, still_replaceable) -> str | None | object:
    """:func:`_replace_once` where OUT cannot be swapped in one call (absent, or a kernel or
    file system without ``RENAME_EXCHANGE``): OUT renamed aside, then ``tmp`` into place."""
    trash, moved_in, again = None, False, False
    try:
        with signals_held():
            if os.path.lexists(out):
                moved = _sibling(out, _OLD)
                os.rename(out, moved)
                trash = moved  # only now: a put-back of a name never made hid why the rename failed
                if os.path.islink(moved):  # one that appeared after the judgement in place
                    raise _appeared_link(out)
                if still_replaceable is not None:
                    still_replaceable(moved)
            try:
                os.rename(tmp, out)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not os.path.isdir(out):
                    raise
                again = True
            moved_in = not again
    finally:  # also when a held signal is delivered as the block ends
        with signals_held():  # nor may one stop the old OUT's removal half-way
            if trash and (moved_in or again):
                remove_tree(trash)
            elif trash:
                os.rename(trash, out)
    if again:
        return _AGAIN
    return trash if trash and os.path.lexists(trash) else None


_RENAME_EXCHANGE = 2  # renameat2's flag (Linux 3.15; ext4, xfs, btrfs, tmpfs; not NFS)
_AT_FDCWD = -100
_EXCHANGE_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP)


def _renameat2():
    """libc's ``renameat2`` (None where there is none: another OS, an older C library)."""
    import ctypes

    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


def _exchange(a: str, b: str) -> bool:
    """Swap the entries ``a`` and ``b`` in one step, so that ``b`` is never absent (a run
    killed outright between two renames left no OUT at all). False where the kernel or the
    file system cannot, or where ``b`` vanished meanwhile (the caller renames instead)."""
    import ctypes

    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _EXCHANGE_UNSUPPORTED or err == errno.ENOENT and os.path.lexists(a):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


@contextmanager
def locked(out: str) -> Iterator[None]:
    """An exclusive ``flock`` on the directory at ``out`` for the block, as it is once the lock
    is held (a run that replaced it meanwhile: the new one is locked instead); no lock where
    ``out`` is no directory or the file system offers none. Runs moving files into one output
    (Bridge splits joining a layout, ``--overwrite`` replacing it) take turns: a run replacing
    OUT while a split joined it put the split's files into the new output."""
    while True:
        try:
            fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # absent, or not a directory: nothing to take turns on
            fd = None
        if fd is None:
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # no locks here (some network file systems)
                pass
            held = os.fstat(fd)
            try:
                now = os.stat(out)
            except OSError:
                now = None
            if now is None or (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                yield
                return
        finally:
            os.close(fd)  # releases the lock


def within(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or lies below it (as strings: resolve both first)."""
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _foreign(out: str, foreign_names: Callable[[str, list[str]], list[str]]) -> str:
    """The files in directory ``out`` packer did not write there (``foreign_names``, given the
    directory and its entries), as a message names them ("notes.txt and 2 more"); empty when
    there are none."""
    foreign = foreign_names(out, sorted(os.listdir(out)))
    return f"{foreign[0]}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}" if foreign else ""


def foreign_files(out: str, foreign_names: Callable[[str, list[str]], list[str]]) -> str:
    """:func:`_foreign` of ``out``, empty where it cannot be listed."""
    try:
        return _foreign(out, foreign_names)
    except OSError:
        return ""


def _input_inside(out: str, inputs: Iterable[str]) -> str | None:
    """The first of ``inputs`` that really lies inside ``out``, or None."""
    real_out = os.path.realpath(out)
    return next((path for path in inputs if within(os.path.realpath(path), real_out)), None)


def overwrite_refusal(out: str, foreign_names: Callable[[str, list[str]], list[str]],
                      inputs: Iterable[str] = ()) -> str | None:
    """Why ``--overwrite`` would not replace the existing directory ``out`` either (what
    :func:`check_replaceable` refuses: files packer did not write, an input inside it), said to
    a run without it instead of advising ``--overwrite`` (the user went round in a circle); None
    when it would."""
    if foreign := foreign_files(out, foreign_names):
        return f"it holds files packer did not write ({foreign}): choose another directory"
    if inside := _input_inside(out, inputs):
        return f"the input {inside} lies inside it: write the output elsewhere"
    return None


def check_replaceable(out: str, inputs: Iterable[str], foreign_names: Callable[[str, list[str]], list[str]],
                      shown: str | None = None) -> None:
    """Refuse to replace an existing directory ``out`` unless everything in it is a file packer
    wrote there (none of ``foreign_names(out, entries)``) and no input lies inside it;
    ``shown``: the name to give it in the message (OUT, for the old OUT judged again as it is
    replaced).

    ``--overwrite`` deletes the old OUT once the new one is in place; a mistyped ``-o`` (the
    data directory, the working directory, a home directory) must not cost the user their files.
    """
    if not os.path.isdir(out):  # a file or a link appeared where OUT was (judged again as it is replaced)
        raise ConfigError(f"{shown or out} exists and is not a directory (it appeared while this run was packing: "
                          "another run?); --overwrite replaces only a packer output")
    if foreign := _foreign(out, foreign_names):
        raise ConfigError(f"{shown or out} holds files packer did not write ({foreign}); --overwrite replaces "
                          "only a packer output: remove it yourself or choose another directory")
    if inside := _input_inside(out, inputs):
        raise ConfigError(f"{inside}: this input lies inside {out}, which --overwrite would replace; "
                          "write the output elsewhere")

"""How the command line sets up glibc's allocator: freed memory is kept for reuse.

A command allocates and frees the same few sizes again and again: each Parquet slab, each run
of a Bridge file's row groups, each gathered batch is a NumPy array of megabytes, freed once the
next stage is done with it. glibc's defaults hand that memory back to the kernel: every thread
that allocates gets an arena of its own (64 MiB heaps, created and deleted as the thread's
blocks come and go), an allocation above a threshold (128 KiB, raised as such blocks are freed)
is a fresh mapping, and free space at the top of a heap is trimmed. The next allocation of the
same size then faults in new pages, which the kernel zeroes first: 0.6-0.8 GB zeroed by one
``packer verify`` of a 200M-token Bridge split (the data itself needs about a third of that),
its system time 0.8-1.2 s of a 2 s run.

:func:`keep_freed_memory` makes every thread allocate from the one main arena (the decode and
write threads allocate few, large blocks: no contention to speak of), serves blocks up to
32 MiB from the heap (glibc's limit for this setting) and never trims it below 1 GiB of free
space. Freed blocks are then reused as they are, already faulted in. Peak resident memory does
not grow, as the heap's free space is what later allocations reuse (the same runs: 0.30 GB for
``pack``, 0.34 against 0.36 GB for that ``verify``); the resident size simply stays at its
peak until the process ends, which for a command is soon.

Only the command line calls this (as it alone sets ``OPENBLAS_NUM_THREADS``): in a library
the process belongs to its user. Settings the user made (``MALLOC_ARENA_MAX`` and its siblings,
``GLIBC_TUNABLES``) are left alone, and so is every C library other than glibc.
"""
from __future__ import annotations

import os

#: mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

#: Blocks up to this size come from the heap (glibc refuses more: half its heap size on 64-bit).
MMAP_THRESHOLD = 32 << 20
#: Free space at the top of the heap kept rather than returned.
TRIM_THRESHOLD = 1 << 30

#: Environment variables by which a user tunes glibc's malloc (read at process start).
USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                 "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (AttributeError, ValueError, OSError):  # not a POSIX system, or no such name here
        return False


def user_tuned_malloc(environ=os.environ) -> bool:
    """Whether the user set any of glibc's malloc parameters for this process."""
    return any(name in environ for name in USER_SETTINGS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """Set glibc's allocator to keep and reuse freed memory (see the module's docstring);
    False where nothing was changed (another C library, or the user's own settings)."""
    if not _glibc() or user_tuned_malloc():
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # the arena count first: only threads started after this use it, and all of packer's are
    done = [mallopt(M_ARENA_MAX, 1), mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)]
    return all(done)

"""Compiler flags and limits shared by every kernel in :mod:`packer_cli.plan`.

Kernels never hard-code numba options; they use ``@njit(**NJIT_FLAGS)`` so the
flags can be changed in one place.
"""

from __future__ import annotations

#: Flags passed to every ``numba.njit`` kernel of the planner. ``cache=True``
#: stores compiled code next to the sources; ``nogil=True`` lets callers run
#: kernels from worker threads; ``error_model="numpy"`` drops the
#: division-by-zero checks (the wrappers guarantee non-zero divisors).
NJIT_FLAGS: dict = {
    "cache": True,
    "nogil": True,
    "fastmath": False,
    "boundscheck": False,
    "error_model": "numpy",
}

#: Flags of small helpers called once per item in an inner loop. A call to another compiled
#: function increfs and decrefs every array it passes, each an atomic instruction; in the
#: refinement pass's pool bookkeeping those calls were half its time, and inlining the helpers
#: (in numba's IR, before LLVM sees them) removes them. Not for everything: the bitset
#: searches of :mod:`._kernels` inlined into the refinement pass made it 25 % slower.
NJIT_INLINE_FLAGS: dict = {**NJIT_FLAGS, "inline": "always"}

#: Largest pack capacity accepted by the planner. The decreasing algorithms and the
#: improvement pass use tables indexed by length, so their memory grows linearly with it.
MAX_CAPACITY: int = 1 << 24

"""Load numba's cached kernels without setting up its compiler (what the CLI does).

Every packer kernel is compiled once and cached on disk (``@njit(cache=True)``). Before numba
loads a cached kernel it *refreshes* its target context: it imports and registers every typing
and lowering implementation it has (about forty modules: arrays, ``np.random``, ``linalg``,
typed containers, ...). All of that is needed to compile and none of it to run machine code
that is already compiled. In a fresh process it cost the first kernel load ~85-95 ms, and a
``packer pack`` run 1.565 → 1.475 s median without it (16 alternating runs each, benchmark
input).

:func:`light_cache_loads` makes a cached load set up only what compiled code links against
(numba's runtime, NRT: its allocator and reference-counting functions) and then load it as
numba does. A kernel that is not in the cache is compiled as usual, and numba's compiler
refreshes the context itself first. If a light load fails for any reason, numba's own
``load_overload`` (refresh included) is used instead. Only the command line calls this: it
changes how the whole process loads cached numba functions, which is packer's to decide only
when the process is packer's.
"""
from __future__ import annotations

from packer_cli.errors import interrupts_deferred, reraise_interrupt


def light_cache_loads() -> bool:
    """Install the light loader on numba's cache (idempotent); False when this numba does not
    look the way it was written for, and is then left alone."""
    try:
        from numba.core import caching
        from numba.core.runtime import nrt
    except ImportError:
        return False
    cache = caching.Cache
    full = cache.load_overload
    if getattr(full, "packer_light", False):
        return True
    needed = (hasattr(cache, "_load_overload"), hasattr(cache, "_guard_against_spurious_io_errors"),
              hasattr(getattr(nrt, "rtsys", None), "initialize"))
    if not all(needed):
        return False

    def load_overload(self, sig, target_context):
        try:
            with interrupts_deferred():  # a signal in the middle of a load crashed numba 0.59
                nrt.rtsys.initialize(target_context)  # what the cached machine code links against
                with self._guard_against_spurious_io_errors():
                    return self._load_overload(sig, target_context)
        except Exception as exc:
            reraise_interrupt(exc)  # a Ctrl-C inside the load is not a failure to fall back from
            return full(self, sig, target_context)  # numba's own way: refresh, then load

    load_overload.packer_light = True
    load_overload.__doc__ = full.__doc__
    cache.load_overload = load_overload
    return True

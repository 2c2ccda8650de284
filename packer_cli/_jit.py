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

import threading
import time
from typing import Callable

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


class CompileLog:
    """packer's kernels that a process compiled rather than loaded from the cache, and the time
    it took (see :func:`log_compiles`). A kernel compiled inside another's compilation (a
    helper it calls) is part of that one: ``kernels`` counts the outermost, and ``seconds`` is
    their wall time."""

    def __init__(self, on_first: Callable[[], None]):
        self.kernels = 0
        self.seconds = 0.0
        self._on_first = on_first
        self._local = threading.local()  # depth and start of this thread's compilation

    def started(self, dispatcher) -> None:
        from packer_cli._kernel_cache import is_packer_function

        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            return
        self._local.ours = is_packer_function(getattr(dispatcher, "py_func", None))
        self._local.start = time.perf_counter()
        if self._local.ours and self._on_first is not None:
            on_first, self._on_first = self._on_first, None  # once a process
            on_first()

    def ended(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0 and self._local.ours:
            self.kernels += 1
            self.seconds += time.perf_counter() - self._local.start


_log: CompileLog | None = None


def log_compiles(on_first: Callable[[], None]) -> CompileLog | None:
    """Count packer's kernels that this process compiles (a cache miss: the first use after an
    install or upgrade, or on another kind of CPU) and call ``on_first`` as the first one
    starts, so that a command does not sit silent for the 10-30 s compiling takes. Loading a
    cached kernel is not a compilation. The same log for every call in a process; None where
    this numba has no compile events (the commands then just run)."""
    global _log
    if _log is None:
        log = CompileLog(on_first)
        if listen(log) is not None:
            _log = log
    return _log


def listen(log: CompileLog):
    """Register a listener feeding ``log`` with numba's compile events; returns it (for
    ``numba.core.event.unregister``), or None where this numba has no such events."""
    try:
        from numba.core import event
    except ImportError:
        return None
    if not all(hasattr(event, name) for name in ("Listener", "register")):
        return None

    class _Listener(event.Listener):
        # A failure here must not fail the compilation it reports on.
        def on_start(self, ev) -> None:
            try:
                log.started((getattr(ev, "data", None) or {}).get("dispatcher"))
            except Exception as exc:  # noqa: BLE001
                reraise_interrupt(exc)

        def on_end(self, ev) -> None:
            try:
                log.ended()
            except Exception as exc:  # noqa: BLE001
                reraise_interrupt(exc)

    listener = _Listener()
    event.register("numba:compile", listener)
    return listener

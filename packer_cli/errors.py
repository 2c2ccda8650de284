"""Errors packer raises on purpose, each mapped to one exit code.

Anything a user can cause (bad options, bad data) is a :class:`PackerError`; the CLI turns
it into a one-line message and an exit code, never a traceback.
"""
from __future__ import annotations

import errno
import functools
import os
import signal
import threading
from contextlib import contextmanager


class PackerError(Exception):
    """Base of every error packer reports to users."""

    exit_code = 1


class ConfigError(PackerError):
    """The options or the spec are unusable (exit code 2)."""

    exit_code = 2


class DataError(PackerError):
    """The input data is bad: malformed, missing fields, out-of-range ids (exit code 1)."""

    exit_code = 1


class OutputError(PackerError):
    """The output or its scratch files could not be written: disk full, I/O error (exit code 3).

    Nothing is left at the output path; the message names it and the system's reason.
    """

    exit_code = 3


def out_of_memory(where, exc: BaseException) -> OutputError:
    """The error for running out of memory (a ``MemoryError``, pyarrow's too, or a thread whose
    stack could not be mapped) while working on ``where``."""
    return OutputError(f"{where}: out of memory: {str(exc) or type(exc).__name__} (an address-space limit, "
                       "ulimit -v, or the node's memory)")


def not_a_directory(path) -> str:
    """Why ``path`` (no directory) cannot be read as one, worded as ``pack`` words a missing
    input: a path that does not exist (a link to nothing included) is not "not a directory"."""
    if os.path.exists(path):
        return f"{os.fspath(path)}: not a directory"
    return f"{os.fspath(path)}: {why_unreachable(path) or 'no such file or directory'}"


def why_unreachable(path) -> str | None:
    """Why ``path`` cannot be reached, where that is not its absence (``permission denied``,
    ``too many levels of symbolic links``, ``not a directory``), else None: ``os.path.exists``
    is False for each of these too, and they were reported as missing files."""
    try:
        os.stat(path)
    except OSError as exc:
        return unless_missing(exc)
    return None


def unless_missing(exc: OSError) -> str | None:
    """An ``OSError``'s reason in a message's words (``permission denied``), or None when it
    says the path does not exist (which the caller words itself)."""
    if exc.errno in (errno.ENOENT, None) or not exc.strerror:
        return None
    return exc.strerror[:1].lower() + exc.strerror[1:]


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: argv or directory bytes of another encoding come to
    Python as lone surrogates, which pyarrow, orjson and the metadata's JSON take nowhere."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (pyarrow's run to many), or its type when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def counted(n: int, word: str) -> str:
    """``n`` with its noun, in the singular for one: "1 pack", "2,048 packs"."""
    return f"{n:,} {word if n == 1 else word + 's'}"


def shown(value, limit: int = 60, text: str | None = None) -> str:
    """``repr(value)`` (or the given ``text``, another spelling of it) for a message, cut to
    about ``limit`` characters: a bad record's reason is one line, and is kept in metadata.json,
    where a 64 MB string quoted whole took 64 MB."""
    text = repr(value) if text is None else text
    if len(text) <= limit:
        return text
    return f"{text[:limit - 20]}… ({len(text):,} characters)"


@contextmanager
def reading_document(kind: str):
    """Turn a malformed document given to a ``from_dict`` (a key missing, a wrong shape) into a
    ValueError naming what it is not, instead of a bare ``KeyError: 'totals'``."""
    try:
        yield
    except KeyError as exc:
        raise ValueError(f"not {kind} as to_dict() writes it: key {exc.args[0]!r} is missing") from None
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"not {kind} as to_dict() writes it ({exc})") from None


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``name`` as one of ``choices`` (any case; unset or empty: the
    first, the default). Any other value is a :class:`ConfigError`: a misspelt switch such as
    ``PACKER_PARQUET_DECODER=pyarrow`` silently did nothing."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return choices[0]
    if value not in choices:
        raise ConfigError(f"{name}={shown(os.environ[name])}: expected "
                          + " or ".join(repr(c) for c in choices) + " (or unset)")
    return value


class BadRecord(DataError):
    """One record is bad; carries where it is so `--on-bad-record skip` can count it."""

    def __init__(self, path: str, row: int, reason: str, *, line: int | None = None):
        self.path, self.row, self.reason, self.line = path, row, reason, line
        where = f"line {line}" if line is not None else f"row {row}"
        super().__init__(f"{path}: {where}: {reason}")

    def __reduce__(self):
        # pickle's default calls the class with the message alone: a process pool running pack()
        # hung on a bad record (multiprocessing.Pool) or reported a broken pool
        return _bad_record, (self.path, self.row, self.reason, self.line)


def _bad_record(path: str, row: int, reason: str, line: int | None) -> BadRecord:
    return BadRecord(path, row, reason, line=line)


class PackerWarning(UserWarning):
    """Base of the warnings packer gives through :mod:`warnings` (the CLI prints each as one
    ``warning:`` line)."""


class KernelCacheWarning(PackerWarning):
    """No directory could hold packer's compiled kernels: they compile in memory, in every run."""


class Interrupted(BaseException):
    """SIGINT (Ctrl-C), SIGTERM (a scheduler preempting the job) or SIGHUP (a closed terminal),
    raised in the main thread by the CLI's handler (:func:`raise_interrupted`).

    It unwinds the command like an error, so every ``finally`` runs: background threads are
    stopped and joined, and the temporary output and spill are removed. Not a
    KeyboardInterrupt, which typer would turn into a silent exit, and not an Exception, which
    nothing on the way may swallow.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_signal_received: int | None = None  # set by raise_interrupted, for check_interrupted
_raising = True  # until stop_raising_interrupts
_deferred = 0  # depth of interrupts_deferred blocks on the main thread
_handling = False  # the CLI's handlers are installed (handling_signals)
_result_in_place = False  # set by result_in_place


_arrivals: int | None = None  # read end of the pipe Python's C-level handler writes signal numbers to


def record_arrival_order() -> None:
    """Have each signal's number written, as it arrives, to a pipe :func:`raise_interrupted`
    reads (``signal.set_wakeup_fd``; main thread only, the CLI's, once).

    Python runs the handlers of the signals pending at one check in the order of their
    numbers, not of their arrival: a SIGTERM followed a millisecond later by a Ctrl-C, both
    pending while the main thread was in C code, ran the SIGINT's handler first, and the run
    reported ``interrupted`` (130) for a job its scheduler had terminated (a review: 14 of 25
    such pairs at the lowest versions, 3 of 15 at the current ones)."""
    global _arrivals
    if _arrivals is not None or threading.current_thread() is not threading.main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    _arrivals = read_end


def _first_arrived(signum: int) -> int:
    """The earliest of the signals handled by :func:`raise_interrupted` that the pipe of
    :func:`record_arrival_order` holds; ``signum`` (the one being handled) without it."""
    try:
        arrived = os.read(_arrivals, 1024) if _arrivals is not None else b""
    except OSError:
        arrived = b""
    return next((s for s in arrived if signal.getsignal(s) is raise_interrupted), signum)


#: Python code that C code calls back in the middle of its own work, where an exception left
#: that work half done: numba boxes a kernel's returned arrays with
#: ``numba.core.serialize._numba_unpickle`` (the array type), and a signal handled there made
#: the kernel return a tuple holding a NULL item, which crashed the process as it was unpacked
#: (SIGSEGV, 2 in about 330 pairs of Ctrl-C and SIGTERM sent during ``pack``), or made the call
#: fail as a ``SystemError``.
_CALLBACK_MODULES = frozenset({"numba.core.serialize"})


def _inside_callback(frame) -> bool:
    """Whether ``frame`` (the one a signal handler was called in) or any frame it was called
    from runs the code of :data:`_CALLBACK_MODULES`."""
    while frame is not None:
        if frame.f_globals.get("__name__") in _CALLBACK_MODULES:
            return True
        frame = frame.f_back
    return False


def _send_again_soon(signum: int) -> None:
    """Send ``signum`` to the main thread again in a millisecond, from another thread: handled
    then, once the callback it landed in has returned. (Sent again from the handler itself, it
    was handled at once inside the handler, and again inside that one, until Python's recursion
    limit raised in the callback after all.)"""
    timer = threading.Timer(0.001, _send_to, (threading.main_thread().ident, signum))
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:  # no thread to be had (ulimit -u): the run's next check raises it
        pass


def _send_to(thread_id: int, signum: int) -> None:
    try:
        signal.pthread_kill(thread_id, signum)
    except (OSError, ValueError):  # the main thread is gone: the process is ending anyway
        pass


def raise_interrupted(signum: int, frame=None) -> None:
    """The CLI's handler for SIGINT, SIGTERM and SIGHUP: remember the signal, then raise it, once.

    A second signal (Ctrl-C pressed twice) is only recorded: raised, it would land in the
    cleanup the first one set off and cut it short, leaving ``OUT.tmp-PID-RANDOM`` behind. Should the
    first one's exception have been lost, :func:`check_interrupted` raises it again at the
    next check (pass one checks at every batch, pass two at every shard). The first is the
    first to arrive, should Python run two pending handlers in another order
    (:func:`record_arrival_order`). Handled inside a callback of :data:`_CALLBACK_MODULES`, the
    signal is not raised there but sent again a millisecond later (:func:`_send_again_soon`)."""
    global _signal_received, _raising
    if _signal_received is None:  # the first one is what stopped the run
        _signal_received = _first_arrived(signum)
    if _raising and not _deferred:
        if _inside_callback(frame):
            _send_again_soon(signum)
            return
        _raising = False
        raise Interrupted(_signal_received)


@contextmanager
def interrupts_deferred():
    """Native code that cannot take an exception at any point runs in this block: a signal that
    :func:`raise_interrupted` receives meanwhile is raised as the block ends, not inside it.

    For numba loading a cached kernel: the handler's exception raised in the middle of it left
    the machine code half-registered, and numba then wrote through a null address (SIGSEGV
    with numba 0.59, 1 of 700 Ctrl-Cs 0.15-0.45 s into ``pack``; 0 of 400 with this). Only the
    main thread defers (it alone runs signal handlers); a block that raises leaves the signal to
    the next :func:`check_interrupted`."""
    global _deferred, _raising
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferred += 1
    try:
        yield
    finally:
        _deferred -= 1
    if not _deferred and _raising and _signal_received is not None:
        _raising = False
        raise Interrupted(_signal_received)


def interrupted() -> bool:
    """Whether :func:`raise_interrupted` received a signal in this process."""
    return _signal_received is not None


def signal_received() -> int | None:
    """The first signal :func:`raise_interrupted` received in this process, if any."""
    return _signal_received


def stop_raising_interrupts() -> None:
    """The command is over: a stopping signal from now on is only recorded, not raised where
    nothing would catch it (the final flush of its output). One assignment, so no signal can
    land half-way through it, as one could while ``signal.signal`` swapped two handlers."""
    global _raising
    _raising = False


def handling_signals() -> None:
    """The CLI is about to install :func:`raise_interrupted`: from now on
    :func:`result_in_place` applies (in a process of the Python API it changes nothing)."""
    global _handling
    _handling = True


def result_in_place() -> None:
    """The command's result is in place (a finished output renamed into OUT): a signal from now
    on is only recorded, and neither raised nor a failure of the command, which has nothing
    left to stop. Exiting 130 with a complete output in OUT told a job the opposite of what
    happened, and its retry then failed on the existing OUT. A signal held across the renames
    and raised as they end comes before this call: the caller tells by the output itself
    whether it landed (``pipeline._Run._publish``)."""
    global _raising, _result_in_place
    if _handling:
        _raising = False
        _result_in_place = True


def late_signal() -> int | None:
    """The signal that came after :func:`result_in_place`, if one did."""
    return _signal_received if _result_in_place else None


def check_interrupted() -> None:
    """Raise again a signal :func:`raise_interrupted` received, should its exception have been
    lost on the way: called where a command goes on to work that matters (after its imports,
    between a run's phases, at every batch and shard) and before an output is moved into place
    or a result printed.

    Python runs a signal handler wherever the main thread is, C code included, and C code may
    clear the error a call it makes leaves. Seen here: the handler ran inside ``compile()`` as a
    module was imported from source (no cached bytecode, e.g. ``PYTHONDONTWRITEBYTECODE``) and
    its exception never came out, so the run went on to exit 0 with its output written (about 1
    start in 40 with a Ctrl-C 0.2-0.3 s in); and inside a finalizer, whose exception Python only
    prints. No-op where no handler of packer's ran (the Python API, or no signal), and once
    the command's result is in place (:func:`result_in_place`)."""
    if _signal_received is not None and not _result_in_place:
        raise Interrupted(_signal_received)


def exception_chain(exc: BaseException | None):
    """``exc``, then what it was raised from or during (``__cause__``, else ``__context__``),
    each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        yield exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__


def reraise_interrupt(exc: BaseException) -> None:
    """Raise again the interrupt an exception stands for, if any, before a handler that means to
    recover from an ordinary failure does so.

    A signal handler raises wherever the main thread is; inside C code calling back into Python
    (numba's dispatcher loading a cached kernel, a codec) the C code reports a ``SystemError``
    with the interrupt as its context, which an ``except Exception`` that falls back to another
    way would swallow: the Ctrl-C was lost and the run went on to exit 0."""
    if (interrupt := interrupt_behind(exc)) is not None:
        raise interrupt


def interrupt_behind(exc: BaseException) -> BaseException | None:
    """The interrupt in ``exc``'s chain, if any: a KeyboardInterrupt, the CLI's signal, SystemExit."""
    return next((cause for cause in exception_chain(exc) if not isinstance(cause, Exception)), None)


def interrupts_kept(func):
    """For the public API: a Ctrl-C that C code turned into a ``SystemError`` comes out as the
    ``KeyboardInterrupt`` it was.

    Python's handler raises wherever the main thread is; inside numba's dispatcher (a kernel
    called or loaded) the dispatcher then reports ``SystemError: ... returned a result with an
    exception set`` with the interrupt as its context: 12 of 100 Ctrl-Cs during ``plan_packs``,
    which an ``except KeyboardInterrupt`` missed and an ``except Exception`` took for a failure."""
    @functools.wraps(func)
    def kept(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except SystemError as exc:
            interrupt = interrupt_behind(exc)
            if interrupt is None:
                raise
            raise interrupt from None  # its traceback without the SystemError's text above it
    return kept

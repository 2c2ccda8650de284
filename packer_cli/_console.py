"""rich Consoles whose reader may go away (``packer ... 2>&1 | head -1``, a killed ``tee``).

rich answers a broken pipe with ``SystemExit(1)`` (13.8 and later; earlier it raises the
``BrokenPipeError``), which a ``pack`` run took for a failure: its temporary output was
removed over a warning nobody could read any more. Here a stderr that is gone becomes
/dev/null and the command goes on (warnings and progress are incidental), and a stdout that is
gone raises ``BrokenPipeError`` for :func:`packer_cli.cli.main` to end the command quietly.

The same holds for every other write error (a full disk under ``2> log``, ``> /dev/full``, an
I/O error): :func:`guard_std_streams` makes a stderr that cannot be written /dev/null, and a
stdout that cannot be written raise :class:`StdoutLost`, which no library on the way
(click, rich) takes for anything else: it reaches :func:`packer_cli.cli.main` as it happened.
"""
from __future__ import annotations

import codecs
import errno
import io
import os
import re
import select
import sys

from rich.console import Console as _RichConsole
from rich.text import Text


def quiet_stream(fd: int) -> None:
    """Point ``fd`` (1 or 2) at /dev/null: what is still written there goes nowhere, quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    except OSError:
        pass
    finally:
        os.close(devnull)


class Console(_RichConsole):
    """rich's Console, without markup or emoji codes unless a caller asks for them: what packer
    prints holds paths and messages from the user's files, and ``run[v2]``, ``od[/b]`` or
    ``run:100:`` are names, not styles or emoji (rich would drop the first, raise on the second
    and print the third as ``run💯``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("markup", False)
        kwargs.setdefault("emoji", False)
        # COLUMNS=0 or LINES=0 (exported so by some shells and CI runners) count as unset, as
        # Python's shutil.get_terminal_size takes them: rich took a width of 0 and printed
        # nothing, error lines and verify's verdict included
        if any(_zero(os.environ.get(name)) for name in ("COLUMNS", "LINES")):
            kwargs.setdefault("_environ", {k: v for k, v in os.environ.items()
                                           if not (k in ("COLUMNS", "LINES") and _zero(v))})
        super().__init__(*args, **kwargs)

    def on_broken_pipe(self) -> None:
        if self.stderr:
            quiet_stream(2)
            return
        quiet_stream(1)
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def _zero(value: str | None) -> bool:
    return value is not None and value.isdigit() and int(value) == 0


class StdoutLost(Exception):
    """Writing stdout failed with ``cause``: its reader went away (``EPIPE``) or the write
    itself failed (``ENOSPC``, ``EIO``). The command's report was not delivered."""

    def __init__(self, cause: OSError):
        super().__init__(str(cause))
        self.cause = cause

    @property
    def reader_gone(self) -> bool:
        return self.cause.errno == errno.EPIPE


class _GuardedStream:
    """A text stream whose write errors are answered by ``on_error`` (see the module's doc);
    everything else is the stream's own."""

    def __init__(self, stream, on_error):
        self._stream = stream
        self._on_error = on_error

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._on_error(exc)
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._on_error(exc)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


_stdout_failures: list[OSError] = []


def stdout_failure() -> OSError | None:
    """The first error writing stdout met since :func:`guard_std_streams`, if any (also one a
    caller swallowed, so that the command's exit status can still answer it)."""
    return _stdout_failures[0] if _stdout_failures else None


def _stdout_failed(exc: OSError) -> None:
    _stdout_failures.append(exc)
    quiet_stream(1)  # what is still buffered, and the final flush, go nowhere
    raise StdoutLost(exc) from exc


def _stderr_failed(exc: OSError) -> None:
    quiet_stream(2)  # warnings and progress are incidental: the command goes on


class _WholeWrites(io.RawIOBase):
    """File descriptor ``fd``, each write written whole or failing.

    CPython's buffered writer returns a short count for a large write that the system call
    wrote only in part, and the text layer above it drops that count: a 500 kB ``--json``
    document to ``| head -c 10`` or onto a nearly full disk was cut at the first 64 or 256 kB,
    silently and with exit 0. Looping here, the next ``write`` says why it stopped (``EPIPE``,
    ``ENOSPC``), and that reaches :func:`_stdout_failed`."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def seekable(self) -> bool:  # a regular file: the text layer writes a UTF-16 BOM only at its start
        try:
            os.lseek(self._fd, 0, os.SEEK_CUR)
        except OSError:
            return False
        return True

    def tell(self) -> int:
        return os.lseek(self._fd, 0, os.SEEK_CUR)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return os.lseek(self._fd, offset, whence)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            try:
                done += os.write(self._fd, view[done:])
            except BlockingIOError:  # a non-blocking descriptor (handed down so), full for now: wait
                select.select([], [self._fd], [])
        return done


_replaced: list = []
_ESCAPE = "packer-escape"


def _escape(exc: UnicodeError):
    """A character stdout's encoding lacks: the byte a lone surrogate stands for (a path's byte
    that is not UTF-8, as ``surrogateescape`` writes it), else its backslash escape."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    bad = exc.object[exc.start:exc.end]
    if _bytes_pass_through(exc.encoding) and all("\udc80" <= c <= "\udcff" for c in bad):
        return bytes(ord(c) - 0xDC00 for c in bad), exc.end
    return codecs.backslashreplace_errors(exc)


def _bytes_pass_through(encoding: str) -> bool:
    """Whether ``encoding`` writes ASCII as one byte each, so a raw byte can stand among its
    output (UTF-16 and UTF-32 refuse a replacement of one byte: a traceback)."""
    try:
        return "\n".encode(encoding) == b"\n"
    except (LookupError, UnicodeError):
        return False


codecs.register_error(_ESCAPE, _escape)


def _written_whole(stream):
    """``stream`` (``sys.stdout``) over :class:`_WholeWrites` of its descriptor, with its
    encoding and line buffering; ``stream`` itself when it has no descriptor.

    A character the encoding lacks (``PYTHONIOENCODING=ascii``, a Latin-1 locale, and a
    summary's arrow or a path's accent) is written as its escape: it raised
    ``UnicodeEncodeError``, a traceback after the output was complete."""
    if type(stream) is not io.TextIOWrapper:  # a test runner's stream, or another wrapper: left as it is
        return stream
    try:
        fd = stream.fileno()
        stream.flush()
    except (OSError, ValueError):  # one already failing
        return stream
    _replaced.append(stream)  # kept: collected, it would close the descriptor (one /dev/null took for `>&-`)
    errors = _ESCAPE if stream.errors in ("strict", "surrogateescape") else stream.errors
    return io.TextIOWrapper(io.BufferedWriter(_WholeWrites(fd)), encoding=stream.encoding, errors=errors,
                            line_buffering=stream.line_buffering)


def stdout_takes_utf8() -> bool:
    """Whether stdout encodes UTF-8 (a JSON document is written ASCII-escaped where not)."""
    try:
        return codecs.lookup(sys.stdout.encoding or "ascii").name == "utf-8"
    except (AttributeError, LookupError):
        return False


def guard_std_streams() -> None:
    """Route write errors of ``sys.stdout`` and ``sys.stderr`` as the module's doc says."""
    if not isinstance(sys.stdout, _GuardedStream):
        sys.stdout = _GuardedStream(_written_whole(sys.stdout), _stdout_failed)
    if not isinstance(sys.stderr, _GuardedStream):
        sys.stderr = _GuardedStream(sys.stderr, _stderr_failed)


#: The rich live displays on stderr now (packer's progress bars, :mod:`packer_cli.progress`;
#: the innermost last). rich's consoles write past its redirection of stderr, so a line another
#: console printed while one was live landed at the end of the bar's line, to be drawn over:
#: :func:`say` prints through the live display's own console, which puts the line above it.
LIVE: list = []


#: What would break a message's one line or reach the terminal as a control: C0 characters but
#: tab, DEL, C1, and Unicode's line and paragraph separators. Only the data puts them there (a
#: file or field name, a record's text), never packer's own words.
_UNPRINTABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: str) -> str:
    """``text`` with each character of :data:`_UNPRINTABLE` written as a Python string literal
    writes it (``\\n``, ``\\x1b``): a file named ``a<newline>b.jsonl`` made its error two lines,
    and an escape sequence in a name was sent to the terminal."""
    return _UNPRINTABLE.sub(lambda found: repr(found.group())[1:-1], text)


def say(line: "str | Text", console: _RichConsole | None = None) -> None:
    """One line on stderr, after what stdout holds (a --json document comes first, as it was
    written first), unless stderr's reader has gone (then nothing, and nothing later). Above
    the progress bars while they are live (:data:`LIVE`), else through ``console`` when given
    (a ``Text`` keeps its styles, and a string is printed as it is, never read as rich markup:
    messages hold paths). Control characters are escaped (:func:`one_line`): one line it is."""
    if isinstance(line, str):
        line = one_line(line)
    elif _UNPRINTABLE.search(line.plain):  # rare: the styles go, the line stays one
        line = one_line(line.plain)
    try:
        sys.stdout.flush()
    except (OSError, ValueError, StdoutLost):  # stdout gone or failing: main() answers that
        pass
    try:
        if LIVE:
            LIVE[-1].console.print(line, markup=False, highlight=False, emoji=False)
        elif console is None:
            print(line, file=sys.stderr, flush=True)
        else:
            console.print(line, markup=False)
    except BrokenPipeError:  # rich 13 raises it; later versions call on_broken_pipe
        quiet_stream(2)

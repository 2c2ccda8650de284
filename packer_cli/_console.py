"""rich Consoles whose reader may go away (``packer ... 2>&1 | head -1``, a killed ``tee``).

rich answers a broken pipe with ``SystemExit(1)`` (13.8 and later; earlier it raises the
``BrokenPipeError``), which a ``pack`` run took for a failure: its temporary output was
removed over a warning nobody could read any more. Here a stderr that is gone becomes
/dev/null and the command goes on (warnings and progress are incidental), and a stdout that is
gone raises ``BrokenPipeError`` for :func:`packer_cli.cli.main` to end the command quietly.
"""
from __future__ import annotations

import errno
import os
import sys

from rich.console import Console as _RichConsole


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
    def on_broken_pipe(self) -> None:
        if self.stderr:
            quiet_stream(2)
            return
        quiet_stream(1)
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def say(line: str, console: _RichConsole | None = None, markup: bool = False) -> None:
    """One line on stderr, after what stdout holds (a --json document comes first, as it was
    written first), unless stderr's reader has gone (then nothing, and nothing later). Through
    ``console`` when given (rich markup; a live progress display stays below the line)."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # stdout's own reader gone: main() answers that
        pass
    try:
        if console is None:
            print(line, file=sys.stderr, flush=True)
        else:
            console.print(line, markup=markup)
    except BrokenPipeError:  # rich 13 raises it; later versions call on_broken_pipe
        quiet_stream(2)

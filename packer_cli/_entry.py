"""The ``packer`` console script: Ctrl-C while the command line is still starting ends it quietly.

Python's own SIGINT handler raises ``KeyboardInterrupt`` wherever the main thread is, so a
Ctrl-C during the imports that come before a command installs its handlers (typer, rich,
numpy, pyarrow, numba: a few tenths of a second) printed a traceback. Nothing needs unwinding
yet, so until then Ctrl-C gets the default action: the process ends at once, and a shell
reports 130 as for any interrupted command. :func:`packer_cli.cli.main` then installs the
handler that unwinds a running command (and a SIGINT the shell ignores stays ignored).
"""
from __future__ import annotations

# The C module under ``signal``, built into the interpreter: importing ``signal`` itself (and
# the enum module it builds its constants with) took about a millisecond, during which a
# Ctrl-C still printed a traceback.
import _signal


def main() -> None:
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    from packer_cli.cli import main as run_command

    run_command()

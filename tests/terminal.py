"""Running a command with stderr on a pseudo-terminal: what packer says only to a terminal."""
from __future__ import annotations

import os
import pty
import re
import subprocess
import tempfile
from pathlib import Path


def run_on_a_terminal(args: list[str], env: dict, cwd: Path) -> tuple[int, str, str]:
    """(exit status, stdout, what the terminal showed) of ``args`` run with stderr on a
    pseudo-terminal (stdout a file): packer speaks of compiling only to a terminal."""
    master, slave = pty.openpty()
    with tempfile.TemporaryFile() as stdout:
        child = subprocess.Popen(args, stdout=stdout, stderr=slave, env=env, cwd=cwd)
        os.close(slave)
        shown = bytearray()
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed its side
                break
            if not chunk:
                break
            shown += chunk
        os.close(master)
        status = child.wait(timeout=600)
        stdout.seek(0)
        out = stdout.read().decode()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode(errors="replace")).replace("\r", "\n")
    return status, out, text

"""A first run after an install, in a subprocess: packer's package copied with or without some
of its cached kernels, and a command run with stderr on a pseudo-terminal (packer speaks of
compiling only to a terminal)."""
from __future__ import annotations

import os
import pty
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import packer_cli


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


def package_copy(tmp_path: Path, missing: str | None) -> Path:
    """packer's package copied with its cached kernels (copy2 keeps the stamps valid), less those
    of ``missing`` (``dir/stem``), which a run in the copy therefore compiles."""
    copy = tmp_path / "pkg"
    shutil.copytree(Path(packer_cli.__file__).parent, copy / "packer_cli")
    if missing:
        directory, stem = missing.split("/")
        for path in (copy / "packer_cli" / directory / "__pycache__").glob(f"{stem}.*.nb[ic]"):
            path.unlink()
    found = subprocess.run([sys.executable, "-c", "import packer_cli; print(packer_cli.__file__)"], cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(copy)}, capture_output=True, text=True, check=True)
    if not found.stdout.strip().startswith(str(copy)):
        pytest.skip(f"the copy is not what Python imports here ({found.stdout.strip()})")
    return copy

"""Put a finished temporary directory in place of OUT in one rename."""
from __future__ import annotations

import os
import shutil


def replace_dir(tmp: str, out: str) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is first renamed aside, then deleted.

    Readers see either the old directory or the new one, never a mix: the only window in
    which ``out`` is absent lies between two renames.
    """
    out = os.path.normpath(out)
    trash = None
    if os.path.exists(out):
        trash = f"{out}.old-{os.getpid()}"
        os.rename(out, trash)
    os.rename(tmp, out)
    if trash:
        shutil.rmtree(trash, ignore_errors=True)

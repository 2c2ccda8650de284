"""The command line's allocator setting: freed memory is reused, not faulted in anew."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from packer_cli import _allocator

needs_glibc = pytest.mark.skipif(not _allocator._glibc(), reason="the setting is glibc's malloc's")

#: Worker threads allocate three 20 MiB arrays a round and the main thread frees them (as decode
#: threads and their consumer do); prints whether the setting was applied and the minor page
#: faults of four rounds after a first.
ROUNDS = """
    import resource, threading
    from packer_cli._allocator import keep_freed_memory
    applied = keep_freed_memory()
    import numpy as np

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def one_round():
        arrays = []
        worker = threading.Thread(target=lambda: arrays.extend(np.ones(20 << 17) for _ in range(3)))
        worker.start()
        worker.join()
        del arrays[:]

    one_round()
    before = faults()
    for _ in range(4):
        one_round()
    print(applied, faults() - before)
"""


def _rounds(**env: str) -> tuple[str, int]:
    environ = {k: v for k, v in os.environ.items() if k not in _allocator.USER_SETTINGS and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(ROUNDS)], capture_output=True, text=True,
                          env={**environ, **env}, timeout=120)
    assert done.returncode == 0, done.stderr
    applied, faults = done.stdout.split()
    return applied, int(faults)


@needs_glibc
def test_freed_arrays_are_reused_without_new_page_faults():
    applied, faults = _rounds()
    assert applied == "True"
    # glibc's defaults, the user's own setting kept: the same rounds fault their 240 MiB in again
    untouched, default_faults = _rounds(MALLOC_ARENA_MAX="64")
    assert untouched == "False"
    assert default_faults > 2000  # at least a third of the 61,440 4 KiB pages (huge pages: fewer faults)
    assert faults * 20 < default_faults


# the environment variables glibc's malloc reads at start (glibc manual, "Memory Allocation
# Tunables"): each one set, even to glibc's default, is the user's choice and left alone
GLIBC_MALLOC_VARIABLES = ["MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                          "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"]


@pytest.mark.parametrize("env", [{"MALLOC_ARENA_MAX": "2"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"},
                                 *({name: "1"} for name in GLIBC_MALLOC_VARIABLES)])
def test_a_users_own_malloc_settings_are_kept(env):
    assert _allocator.user_tuned_malloc(env)
    assert not _allocator.user_tuned_malloc({"GLIBC_TUNABLES": "glibc.rtld.nns=2", "HOME": "/"})


def test_the_command_line_applies_it_before_any_command():
    script = textwrap.dedent("""
        import sys
        import packer_cli.cli as cli
        cli.keep_freed_memory = lambda: print("kept", "numpy" in sys.modules, flush=True)
        sys.argv = ["packer", "--help"]
        cli.main()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "kept False"  # first, before numpy or any thread

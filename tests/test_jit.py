"""The command line loads cached kernels without numba's compiler set-up, and falls back to
numba's own loading whenever the light way fails."""
from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from packer_cli.demo import demo_table

from firstrun import package_copy, run_on_a_terminal

# Runs `packer pack` in a fresh process the way the console script does (main() minus the
# os._exit) and reports how often numba refreshed its context and how many kernels came
# from its cache.
CHILD = textwrap.dedent("""
    import json, sys
    from numba.core import base, dispatcher
    refreshes = []
    full_refresh = base.BaseContext.refresh
    base.BaseContext.refresh = lambda self: (refreshes.append(1), full_refresh(self))[1]
    from packer_cli.cli import app
    try:
        app(sys.argv[1:])
    except SystemExit as exc:
        assert not exc.code, exc.code
    import gc
    hits = sum(sum(d._cache_hits.values()) for d in gc.get_objects() if isinstance(d, dispatcher.Dispatcher))
    print(json.dumps({"refreshes": len(refreshes), "cache_hits": hits}))
""")


def _child_pack(src: Path, out: Path) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, "pack", str(src), "-o", str(out), "-C", "2048", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_cli_run_loads_cached_kernels_without_refreshing_numba(tmp_path):
    src = tmp_path / "demo.parquet"
    pq.write_table(demo_table(2000, seed=3), src)
    _child_pack(src, tmp_path / "first")  # compiles whatever this checkout has not cached yet
    second = _child_pack(src, tmp_path / "second")
    if second["cache_hits"] == 0:
        pytest.skip("numba cannot cache kernels here (read-only package directory?)")
    assert second["refreshes"] == 0, second
    for name in ("manifest.json", "metadata.json"):
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes()


def _cached_probe(tmp_path, monkeypatch, module_name: str, name: str, factor: int):
    """A module with one cached kernel ``name(x) = x * factor``, compiled and cached once."""
    module = tmp_path / f"{module_name}.py"
    module.write_text(f"from numba import njit\n\n@njit(cache=True)\ndef {name}(x):\n    return x * {factor}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = importlib.import_module(module_name)
    assert getattr(probe, name)(np.int64(7)) == 7 * factor
    return probe


def test_a_failing_light_load_falls_back_to_numbas_own(tmp_path, monkeypatch):
    from numba.core import caching
    from numba.core.runtime import nrt

    from packer_cli._jit import light_cache_loads

    probe = _cached_probe(tmp_path, monkeypatch, "jit_probe_kernels", "twice", 2)
    assert light_cache_loads() and light_cache_loads()  # idempotent
    assert caching.Cache.load_overload.packer_light

    real_initialize, calls = nrt.rtsys.initialize, []

    def fails_once(ctx):  # the light load's call fails; numba's own (in its refresh) works
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated: this numba's runtime set-up changed")
        return real_initialize(ctx)

    monkeypatch.setattr(nrt.rtsys, "initialize", fails_once)
    full = []
    real_refresh = type(probe.twice.targetctx).refresh
    monkeypatch.setattr(type(probe.twice.targetctx), "refresh", lambda self: (full.append(1), real_refresh(self))[1])
    probe = importlib.reload(probe)  # a new dispatcher: nothing loaded yet
    assert probe.twice(np.int64(5)) == 10
    assert len(calls) >= 2 and full  # the light load failed, numba's refresh ran
    assert sum(probe.twice._cache_hits.values()) == 1  # and the kernel still came from the cache


class _Interrupt(BaseException):
    """Stands for the CLI's signal exception (a BaseException, like KeyboardInterrupt)."""


def test_an_interrupt_inside_the_light_load_is_not_a_failure_to_fall_back_from(tmp_path, monkeypatch):
    # A signal handler raising inside numba's C dispatcher surfaces as a SystemError with the
    # interrupt as its context; the light loader caught it as a failed load and fell back to
    # numba's own, so a Ctrl-C at that moment was lost and the run went on to exit 0.
    from numba.core.runtime import nrt

    from packer_cli._jit import light_cache_loads

    probe = _cached_probe(tmp_path, monkeypatch, "jit_interrupt_kernels", "thrice", 3)
    assert light_cache_loads()

    def interrupted(ctx):
        try:
            raise _Interrupt()
        except _Interrupt:
            raise SystemError("<built-in method> returned a result with an exception set")

    monkeypatch.setattr(nrt.rtsys, "initialize", interrupted)
    probe = importlib.reload(probe)  # a new dispatcher: the next call loads from the cache
    with pytest.raises(_Interrupt):
        probe.thrice(np.int64(5))


def test_reraise_interrupt_finds_the_interrupt_behind_an_error():
    from packer_cli.errors import reraise_interrupt

    reraise_interrupt(ValueError("plain"))  # an ordinary failure: nothing raised
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as inner:
            raise SystemError("wrapped") from inner
    except SystemError as exc:
        with pytest.raises(KeyboardInterrupt):
            reraise_interrupt(exc)


# --- telling the user that kernels compile ------------------------------------------------------

def _kernel_module(root: Path, name: str, monkeypatch):
    """A module under ``root`` with a kernel ``outer`` calling a kernel ``inner`` and a third,
    ``other``; none cached, so each compiles at its first call in every process."""
    root.mkdir(exist_ok=True)
    (root / f"{name}.py").write_text(textwrap.dedent("""
        from numba import njit

        @njit
        def inner(x):
            return x + 1

        @njit
        def outer(x):
            return inner(x) * 2

        @njit
        def other(x):
            return x - 1
    """))
    monkeypatch.syspath_prepend(str(root))
    return importlib.import_module(name)


@pytest.fixture
def compile_log():
    """A fresh CompileLog fed by numba's compile events for the test's length, and the notices
    it gave."""
    from numba.core import event

    from packer_cli._jit import CompileLog, listen

    notices = []
    log = CompileLog(lambda: notices.append(1))
    listener = listen(log)
    assert listener is not None, "this numba has compile events"
    yield log, notices
    event.unregister("numba:compile", listener)


def test_packers_compiled_kernels_are_counted_once_each_and_announced_once(tmp_path, monkeypatch, compile_log):
    from packer_cli._kernel_cache import install

    log, notices = compile_log
    foreign = _kernel_module(tmp_path / "elsewhere", "compile_log_foreign", monkeypatch)
    assert foreign.outer(np.int64(1)) == 4  # not packer's: neither counted nor announced
    assert (log.kernels, notices) == (0, [])

    install(str(tmp_path / "ours"))  # functions under this root count as packer's
    ours = _kernel_module(tmp_path / "ours", "compile_log_ours", monkeypatch)
    assert ours.outer(np.int64(3)) == 8  # outer's compilation compiles inner inside it: one kernel
    assert (log.kernels, notices) == (1, [1])
    first = log.seconds
    assert first > 0
    assert ours.other(np.int64(3)) == 2
    assert ours.outer(np.int64(5)) == 12  # compiled already: nothing new
    assert ours.outer(5.5) == 13.0  # a new signature is another compilation
    assert (log.kernels, notices) == (3, [1])  # announced once a process, not once a kernel
    assert log.seconds > first


def test_a_failing_notice_does_not_fail_the_compilation(tmp_path, monkeypatch):
    from numba.core import event

    from packer_cli._jit import CompileLog, listen
    from packer_cli._kernel_cache import install

    def broken():
        raise OSError("stderr is gone")

    log = CompileLog(broken)
    listener = listen(log)
    try:
        install(str(tmp_path / "ours"))
        module = _kernel_module(tmp_path / "ours", "compile_log_broken", monkeypatch)
        assert module.outer(np.int64(1)) == 4
        assert module.other(np.int64(1)) == 0
        assert log.kernels == 2
    finally:
        event.unregister("numba:compile", listener)


def test_the_cli_says_on_a_terminal_when_it_compiles_packers_kernels_and_what_it_cost(tmp_path):
    import os

    from packer_cli.cli import COMPILING_NOTICE

    if os.environ.get("NUMBA_CACHE_DIR"):
        pytest.skip("kernels are cached apart (NUMBA_CACHE_DIR): a copy of the package would compile all of them")
    src = tmp_path / "demo.parquet"
    pq.write_table(demo_table(300, seed=4), src)
    copy = package_copy(tmp_path, "sources/_kernels")
    # not the checkout as working directory: python -m puts it first on sys.path
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "400"}

    def pack(out: str, *extra: str, terminal: bool = True) -> tuple[str, str]:
        args = [sys.executable, "-m", "packer_cli", "pack", str(src), "-o", str(tmp_path / out), "-C", "2048", *extra]
        if not terminal:
            done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
            assert done.returncode == 0, done.stderr
            return done.stdout, done.stderr
        status, stdout, shown = run_on_a_terminal(args, env, tmp_path)
        assert status == 0, shown
        return stdout, shown

    stdout, shown = pack("first", "--json")
    assert json.loads(stdout)["ok"] is True  # the notes go to the terminal, never into the document
    assert shown.count(COMPILING_NOTICE) == 1, shown
    compiled = [line for line in shown.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == 1 and "of packer's kernels in" in compiled[0], shown
    assert int(compiled[0].split()[1]) >= 1  # at least the removed module's kernels

    _, shown = pack("second")  # every kernel cached now: not a word about compiling
    assert "compil" not in shown, shown
    assert (tmp_path / "first" / "manifest.json").read_bytes() == (tmp_path / "second" / "manifest.json").read_bytes()

    cached = copy / "packer_cli" / "sources" / "__pycache__"
    for path in cached.glob("_kernels.*.nb[ic]"):
        path.unlink()  # compiling again, stderr a pipe: what a script reads there is as it was
    _, stderr = pack("third", terminal=False)
    assert stderr == "", stderr
    assert list(cached.glob("_kernels.*.nbi"))  # (it did compile them)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_said_while_progress_bars_are_live_goes_above_them(monkeypatch):
    # rich's consoles write past its stderr redirection, so the compile notice printed through
    # packer's stderr console while bars were live landed at the end of the bar's line, to be
    # drawn over by the next refresh.
    from packer_cli._console import Console, say
    from packer_cli.progress import Progress

    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    say("before the bars", err)
    with Progress(enabled=True) as bar:
        task = bar.task("reading", total=None, unit="samples")
        bar.advance(task, 5)
        say("compiling, once", err)
    say("after the bars", err)
    text = screen.getvalue()
    # above them: the bar's line erased first, the bars redrawn below it (a stray console's
    # line followed the bar's last character)
    assert "\x1b[2Kcompiling, once\n" in text, repr(text)
    assert text.startswith("before the bars\n") and text.endswith("after the bars\n"), repr(text)

"""The command line loads cached kernels without numba's compiler set-up, and falls back to
numba's own loading whenever the light way fails."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from packer_cli.demo import demo_table

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

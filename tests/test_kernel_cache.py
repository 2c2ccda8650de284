"""The kernel cache notices changes in what a cached kernel calls, not only in its own file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from packer_cli import _kernel_cache

RUN = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from packer_cli import _kernel_cache
    _kernel_cache.install(sys.argv[1] + "/kpkg")
    from kpkg.caller import total
    value = total(3)
    print(json.dumps({"value": int(value), "hits": sum(total.stats.cache_hits.values()),
                      "misses": sum(total.stats.cache_misses.values())}))
""")

CALLER = textwrap.dedent("""
    from numba import njit
    from kpkg import helper

    @njit(cache=True)
    def total(n):
        return helper.step(n) + helper.OFFSET
""")


# The kernel calls a function defined below it, which calls into the helper module: when the
# decorator runs (and numba asks for the stamp) ``_late`` does not exist yet.
CALLER_LATE = textwrap.dedent("""
    from numba import njit
    from kpkg import helper

    @njit(cache=True)
    def total(n):
        return _late(n) + 1

    @njit(cache=True)
    def _late(n):
        return helper.step(n) + helper.OFFSET
""")


def _helper(body: str, offset: int) -> str:
    return textwrap.dedent(f"""
        from numba import njit

        OFFSET = {offset}

        @njit(cache=True)
        def step(n):
            return {body}
    """)


def _run(tmp_path) -> dict:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", RUN, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("caller, extra", [(CALLER, 0), (CALLER_LATE, 1)], ids=["direct", "defined-later"])
def test_cached_kernel_is_recompiled_when_a_callee_or_constant_changes(tmp_path, caller, extra):
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "caller.py").write_text(caller)
    (pkg / "helper.py").write_text(_helper("n * 2", 0))
    assert _run(tmp_path) == {"value": 6 + extra, "hits": 0, "misses": 1}
    assert _run(tmp_path) == {"value": 6 + extra, "hits": 1, "misses": 0}  # nothing changed: cached
    # Only the callee's file changes (numba alone keys the caller on caller.py and would load
    # the old machine code: value 6).
    (pkg / "helper.py").write_text(_helper("n * 10", 0))
    assert _run(tmp_path) == {"value": 30 + extra, "hits": 0, "misses": 1}
    assert _run(tmp_path) == {"value": 30 + extra, "hits": 1, "misses": 0}
    (pkg / "helper.py").write_text(_helper("n * 10", 5))  # a constant the caller reads
    assert _run(tmp_path) == {"value": 35 + extra, "hits": 0, "misses": 1}


def test_packer_kernels_reach_their_helpers():
    from packer_cli.plan._refine_kernels import _rebuild
    from packer_cli.shards._gather import _pread_gather_kernel

    def files(kernel):
        reach = _kernel_cache._Reach()
        reach.function(kernel.py_func)
        return {os.path.relpath(f, os.path.dirname(_kernel_cache.__file__)) for f in reach.files}

    assert files(_rebuild) == {os.path.join("plan", "_refine_kernels.py"), os.path.join("plan", "_kernels.py")}
    assert files(_pread_gather_kernel) == {os.path.join("shards", "_gather.py"), "_unaligned.py"}


def test_reach_digest_follows_constants_and_options(monkeypatch):
    from packer_cli.plan import _kernels as K
    from packer_cli.plan._refine_kernels import _rebuild

    before = _kernel_cache.reach_digest(_rebuild.py_func)
    assert _kernel_cache.reach_digest(_rebuild.py_func) == before
    table = K._DEBRUIJN_TABLE.copy()
    table[0] = 7
    monkeypatch.setattr(K, "_DEBRUIJN_TABLE", table)  # read by _msb, which _rebuild's helpers call
    changed = _kernel_cache.reach_digest(_rebuild.py_func)
    assert changed != before
    monkeypatch.undo()
    assert _kernel_cache.reach_digest(_rebuild.py_func) == before
    monkeypatch.setitem(K._bitset_prev.targetoptions, "fastmath", True)
    assert _kernel_cache.reach_digest(_rebuild.py_func) != before


def test_locators_installed_for_packer_only():
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    ours = [cls for cls in impl._locator_classes if getattr(cls, "_packer_reaching", False)]
    assert len(ours) == 3 and impl._locator_classes[:3] == ours
    assert _kernel_cache.install() is True and impl._locator_classes[:3] == ours  # idempotent
    assert all(cls.from_function(np.add.reduce, np.__file__) is None for cls in ours)  # numpy's file: not ours


def test_a_failing_walk_leaves_numbas_own_stamp(monkeypatch):
    from packer_cli.plan._refine_kernels import _collect

    def broken(py_func):
        raise RuntimeError("attribute access failed")

    monkeypatch.setattr(_kernel_cache, "reach_digest", broken)
    _kernel_cache._process_reach_digest.cache_clear()
    try:
        assert _kernel_cache._process_reach_digest(_collect.py_func) == "unreached"
    finally:
        _kernel_cache._process_reach_digest.cache_clear()

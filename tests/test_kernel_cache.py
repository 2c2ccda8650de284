"""The kernel cache notices changes in what a cached kernel calls, not only in its own file."""
from __future__ import annotations

import errno
import importlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
import warnings

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


def _run_cached_in(tmp_path, cache_dir) -> dict:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "NUMBA_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", RUN, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kernel_files(directory) -> list[str]:
    return sorted(p.name for p in directory.rglob("caller.*") if p.suffix in (".nbi", ".nbc"))


def _warm_package(tmp_path):
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "caller.py").write_text(CALLER)
    (pkg / "helper.py").write_text(_helper("n * 2", 0))
    assert _run(tmp_path) == {"value": 6, "hits": 0, "misses": 1}  # compiled beside the sources
    (pkg / "__pycache__").chmod(0o755)
    return pkg


def test_a_cache_directory_elsewhere_is_seeded_from_the_kernels_beside_the_sources(tmp_path):
    """An image whose package holds compiled kernels, run by a user who may not write there:
    numba caches in a directory of the user's, and the kernels compiled into the image are
    copied there instead of compiled again."""
    pkg = _warm_package(tmp_path)
    elsewhere = tmp_path / "user-cache"
    elsewhere.mkdir()
    assert _run_cached_in(tmp_path, elsewhere) == {"value": 6, "hits": 1, "misses": 0}  # not compiled
    assert _kernel_files(elsewhere) == _kernel_files(pkg / "__pycache__") != []
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.stat().st_mode & 0o777 for p in elsewhere.rglob("caller.*")}
    assert modes == {0o666 & ~umask}  # as numba makes its own: a cache a group shares stays readable
    (pkg / "helper.py").write_text(_helper("n * 10", 0))  # stale copies are compiled again, as anywhere
    assert _run_cached_in(tmp_path, elsewhere) == {"value": 30, "hits": 0, "misses": 1}


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="trust is decided by POSIX owners and modes")
@pytest.mark.parametrize("case", ["writable by others", "a kernel's file already there"])
def test_the_seed_is_not_taken_from_an_open_directory_nor_mixed_with_another(tmp_path, case):
    pkg = _warm_package(tmp_path)
    elsewhere = tmp_path / "user-cache"
    elsewhere.mkdir()
    if case == "writable by others":  # a cached kernel is a pickle: anyone could have put it there
        (pkg / "__pycache__").chmod(0o777)
    else:  # another version's data file of the same name: the seeded index would name it
        from numba.core.caching import _CacheLocator

        data = next(name for name in _kernel_files(pkg / "__pycache__") if name.endswith(".nbc"))
        where = elsewhere / _CacheLocator.get_suitable_cache_subpath(str(pkg / "caller.py"))
        where.mkdir()
        (where / data).write_bytes(b"another version's machine code")
    assert _run_cached_in(tmp_path, elsewhere) == {"value": 6, "hits": 0, "misses": 1}  # compiled


def _another_owner(monkeypatch, tree) -> None:
    """``tree`` and what is in it owned, as ``os.lstat`` says, by a user who is neither this one
    nor root (without root's power to give files away)."""
    real = os.lstat
    other = os.getuid() + 1

    def lstat(path, *args, **kwargs):
        st = real(path, *args, **kwargs)
        if os.path.abspath(path).startswith(str(tree)):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, other, *st[5:]))
        return st

    monkeypatch.setattr(os, "lstat", lstat)


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="trust is decided by POSIX owners and modes")
@pytest.mark.parametrize("case", ["writable by its group", "owned by another user", "its files writable by others"])
def test_the_seed_is_taken_only_from_kernels_no_one_else_could_have_written(tmp_path, monkeypatch, case):
    """A cached kernel is a pickle, which runs code as it loads: the kernels beside the sources
    are copied into the user's cache only where no one but their owner (this user or root)
    could have written them, their directory or themselves."""
    pkg = _warm_package(tmp_path)
    tree = pkg / "__pycache__"
    for path in tree.glob("caller.*"):
        path.chmod(0o644)
    seed = _kernel_cache._seed_from_tree.__wrapped__  # not the process's memo of what it seeded
    as_built = tmp_path / "as-built"
    as_built.mkdir()
    seed(str(pkg / "caller.py"), str(as_built))
    assert _kernel_files(as_built) == _kernel_files(tree) != []  # trusted as built: copied
    if case == "writable by its group":
        tree.chmod(0o775)
    elif case == "owned by another user":
        _another_owner(monkeypatch, tree)
    else:
        for path in tree.glob("caller.*"):
            path.chmod(0o666)
    user_cache = tmp_path / "user-cache"
    user_cache.mkdir()
    seed(str(pkg / "caller.py"), str(user_cache))
    assert _kernel_files(user_cache) == []


@pytest.mark.parametrize("failing", ["open", "replace"], ids=["writing", "renaming"])
def test_a_seed_copy_that_fails_is_skipped_and_leaves_nothing_behind(tmp_path, monkeypatch, failing):
    """A full disk while a kernel is copied into the user's cache: the copy is given up (the
    kernel compiles instead) rather than the error escaping from numba's locator, which killed
    the import of every module holding a kernel, and no temporary file is left in that cache."""
    src = tmp_path / "caller.total-5.py311.nbi"
    src.write_bytes(b"a kernel's index")
    src.chmod(0o644)
    user_cache = tmp_path / "user-cache"
    user_cache.mkdir()
    real = getattr(os, failing)

    def no_space(path, *args, **kwargs):
        if os.path.basename(path).startswith(".seed-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, failing, no_space)
    assert _kernel_cache._copy_trusted(str(src), str(user_cache / src.name)) is False
    monkeypatch.undo()
    assert os.listdir(user_cache) == []


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


@pytest.fixture
def kernels_here(tmp_path, monkeypatch):
    """``load(files)``: the files written as a package under ``tmp_path`` (``kpkg`` in them
    renamed to a name of its own) and its ``caller`` module imported in this process, the walk
    following its modules as packer's own. Its kernels are not compiled (numba compiles on the
    first call)."""
    name = f"kpkg_{uuid.uuid4().hex}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_kernel_cache, "_ROOTS", [*_kernel_cache._ROOTS, str(tmp_path)])

    def load(files: dict[str, str]):
        pkg = tmp_path / name
        pkg.mkdir(exist_ok=True)
        for file, text in {"__init__.py": "", **files}.items():
            (pkg / file).write_text(textwrap.dedent(text).replace("kpkg", name))
        return importlib.import_module(f"{name}.caller"), pkg

    yield load
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def _inner(body: str) -> str:
    return f"from numba import njit\n\n@njit\ndef inner(n):\n    return {body}\n"


def _step(body: str) -> str:  # a long licence header first: the code lies past the first 4 KB
    return ("# licence header\n" * 300
            + f"from numba import njit\nfrom kpkg.deep import inner\n\n@njit\ndef step(n):\n    return {body}\n")


def test_the_digest_follows_module_kernels_to_their_callees_and_whole_files(kernels_here):
    """``helper.step(n)`` reaches ``helper.py`` whole, not only its head (an edit below a long
    header loaded the old machine code), and what ``step`` calls in a third module (an edit
    there loaded the old machine code too)."""
    caller, pkg = kernels_here({"caller.py": """
        from numba import njit
        from kpkg import helper

        @njit
        def total(n):
            return helper.step(n)
    """, "helper.py": _step("inner(n)"), "deep.py": _inner("n * 2")})
    before = _kernel_cache.reach_digest(caller.total.py_func)
    assert (pkg / "helper.py").stat().st_size > 4096
    (pkg / "helper.py").write_text(_step("inner(n) + 1").replace("kpkg", pkg.name))
    after_helper = _kernel_cache.reach_digest(caller.total.py_func)
    assert after_helper != before
    (pkg / "deep.py").write_text(_inner("n * 10"))
    assert _kernel_cache.reach_digest(caller.total.py_func) != after_helper


def test_the_digest_holds_tuple_and_numpy_scalar_constants_of_another_module(kernels_here, monkeypatch):
    """Constants imported from another module (``from consts import TABLE``) are compiled into
    the kernel's machine code while its own file stays the same: a changed tuple or NumPy
    scalar must make the cached kernel stale."""
    caller, _ = kernels_here({"consts.py": "import numpy as np\nTABLE = (1, 2, 3)\nFACTOR = np.int64(2)\n",
                              "caller.py": """
        from numba import njit
        from kpkg.consts import FACTOR, TABLE

        @njit
        def total(n):
            return n * TABLE[1] * FACTOR
    """})
    before = _kernel_cache.reach_digest(caller.total.py_func)
    monkeypatch.setattr(caller, "TABLE", (1, 10, 3))
    assert _kernel_cache.reach_digest(caller.total.py_func) != before
    monkeypatch.undo()
    assert _kernel_cache.reach_digest(caller.total.py_func) == before
    monkeypatch.setattr(caller, "FACTOR", np.int64(10))
    assert _kernel_cache.reach_digest(caller.total.py_func) != before


def test_the_digest_holds_a_kernels_own_options(kernels_here, monkeypatch):
    """packer's kernels take their options from another module (``@njit(**NJIT_FLAGS)``): turning
    bounds checks on there must not load the machine code compiled without them."""
    caller, _ = kernels_here({"flags.py": "FLAGS = {'boundscheck': False}\n", "caller.py": """
        from numba import njit
        from kpkg.flags import FLAGS

        @njit(**FLAGS)
        def total(a, i):
            return a[i]
    """})
    before = _kernel_cache.reach_digest(caller.total.py_func)
    monkeypatch.setitem(caller.total.targetoptions, "boundscheck", True)
    assert _kernel_cache.reach_digest(caller.total.py_func) != before


def test_locators_installed_for_packer_only():
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    ours = [cls for cls in impl._locator_classes if getattr(cls, "_packer_reaching", False)]
    assert len(ours) == 4 and impl._locator_classes[:4] == ours
    assert [cls.__name__ for cls in ours] == ["PackerUserProvidedCacheLocator", "PackerInTreeCacheLocator",
                                              "PackerUserWideCacheLocator", "PackerPrivateTempCacheLocator"]
    assert _kernel_cache.install() is True and impl._locator_classes[:4] == ours  # idempotent
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


def test_an_interrupt_behind_a_failing_walk_is_raised_not_remembered(monkeypatch):
    """A Ctrl-C that C code turned into another error (a SystemError with the interrupt as its
    context) while the digest is worked out stops the run, instead of the kernel loading
    under numba's own stamp and the process remembering it as 'unreached'."""
    from packer_cli.plan._refine_kernels import _collect

    def interrupted(py_func):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise SystemError("<built-in method> returned a result with an exception set") from None

    monkeypatch.setattr(_kernel_cache, "reach_digest", interrupted)
    _kernel_cache._process_reach_digest.cache_clear()
    try:
        with pytest.raises(KeyboardInterrupt):
            _kernel_cache._process_reach_digest(_collect.py_func)
        monkeypatch.undo()
        assert _kernel_cache._process_reach_digest(_collect.py_func) == _kernel_cache.reach_digest(_collect.py_func)
    finally:
        _kernel_cache._process_reach_digest.cache_clear()


# A read-only install whose user has no writable cache directory, made as root can make it:
# the kernel's __pycache__ is a file, NUMBA_CACHE_DIR and the user cache directory lie under a
# file. Only the private temporary directory is left.
NOWHERE = textwrap.dedent("""
    import json, os, sys, tempfile, warnings
    sys.path.insert(0, sys.argv[1])
    tempfile.tempdir = sys.argv[2]
    from packer_cli import _kernel_cache
    _kernel_cache.install(sys.argv[1] + "/kpkg")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from kpkg.caller import total
        value = total(3)
    print(json.dumps({"value": int(value), "cache": total._cache.__class__.__name__,
                      "path": getattr(total._cache, "cache_path", None),
                      "hits": sum(total.stats.cache_hits.values()), "misses": sum(total.stats.cache_misses.values()),
                      "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))
""")

KERNEL = textwrap.dedent("""
    from packer_cli._kernel_cache import njit

    @njit(cache=True)
    def total(n):
        return 2 * n
""")


def _read_only_install(tmp_path):
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "caller.py").write_text(KERNEL)
    (pkg / "__pycache__").write_text("not a directory")
    (tmp_path / "file").write_text("")
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "NUMBA_CACHE_DIR": str(tmp_path / "file" / "numba"),
           "XDG_CACHE_HOME": str(tmp_path / "file" / "cache")}
    env.pop("NUMBA_CACHE_LOCATOR_CLASSES", None)
    return env


def _run_nowhere(tmp_path, env) -> dict:
    out = subprocess.run([sys.executable, "-c", NOWHERE, str(tmp_path), str(tmp_path / "tmp")], capture_output=True,
                         text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="the private directory is keyed on a POSIX user id")
def test_kernels_are_cached_in_a_private_temporary_directory_when_nothing_else_is_writable(tmp_path):
    env = _read_only_install(tmp_path)
    private = tmp_path / "tmp" / f"packer-kernels-{os.getuid()}"
    first = _run_nowhere(tmp_path, env)
    assert first["value"] == 6 and first["warnings"] == []
    assert (first["hits"], first["misses"]) == (0, 1)  # compiled, and saved there
    assert first["path"].startswith(str(private) + os.sep)
    assert private.stat().st_mode & 0o777 == 0o700
    assert any(name.endswith(".nbi") for name in os.listdir(first["path"]))
    second = _run_nowhere(tmp_path, env)
    assert (second["value"], second["hits"], second["misses"]) == (6, 1, 0)  # loaded from it


def _not_private(kind: str, path, tmp_path) -> None:
    if kind == "open to others":
        path.mkdir()
        path.chmod(0o777)
    elif kind == "open to its group":
        path.mkdir()
        path.chmod(0o770)
    elif kind == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "elsewhere")
    elif kind == "another user's":
        path.mkdir(mode=0o700)
        os.chown(path, os.getuid() + 1, -1)
    else:
        path.write_text("a file")


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="the private directory is keyed on a POSIX user id")
@pytest.mark.parametrize("kind", ["open to others", "open to its group", "a link", "another user's", "a file"])
def test_a_temporary_directory_that_is_not_private_is_not_used(tmp_path, kind):
    """A cached kernel is a pickle: a directory someone else could write into would let them
    run code in packer's process."""
    if kind == "another user's" and os.getuid() != 0:
        pytest.skip("needs root to give a directory away")
    env = _read_only_install(tmp_path)
    private = tmp_path / "tmp" / f"packer-kernels-{os.getuid()}"
    _not_private(kind, private, tmp_path)
    result = _run_nowhere(tmp_path, env)
    assert (result["value"], result["cache"], result["hits"]) == (6, "NullCache", 0)  # compiled in memory
    assert len(result["warnings"]) == 1 and result["warnings"][0].startswith(
        "KernelCacheWarning: no writable directory for packer's compiled kernels")
    assert "set NUMBA_CACHE_DIR to a writable directory" in result["warnings"][0]
    if kind == "a link":
        assert os.listdir(tmp_path / "elsewhere") == []


TWO_KERNELS = KERNEL + textwrap.dedent("""

    @njit(cache=True)
    def other(n):
        return 3 * n
""")


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="the private directory is keyed on a POSIX user id")
def test_compiling_in_memory_is_said_once_a_process_naming_the_directory_refused(tmp_path):
    """A command loads dozens of kernels: nowhere to cache them is one warning, not one a kernel,
    and it names the private directory that was refused, for the user to look at."""
    env = _read_only_install(tmp_path)
    (tmp_path / "kpkg" / "caller.py").write_text(TWO_KERNELS)
    private = tmp_path / "tmp" / f"packer-kernels-{os.getuid()}"
    _not_private("open to others", private, tmp_path)
    result = _run_nowhere(tmp_path, env)
    assert (result["value"], result["cache"]) == (6, "NullCache")
    assert len(result["warnings"]) == 1, result["warnings"]
    assert f"a private {private}): they compile in memory" in result["warnings"][0]


NO_TEMP_DIR = NOWHERE.replace("tempfile.tempdir = sys.argv[2]\n", (
    "def no_temporary_directory():  # as tempfile says it where every candidate is read-only\n"
    "    raise FileNotFoundError(2, 'No usable temporary directory found in [...]')\n"
    "tempfile.tempdir = None\n"
    "tempfile.gettempdir = no_temporary_directory\n"))


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="the private directory is keyed on a POSIX user id")
def test_no_usable_temporary_directory_compiles_in_memory_with_one_warning(tmp_path):
    """A read-only container: install, home, TMPDIR, /tmp and /var/tmp all read-only, so
    Python's tempfile raises where packer asks it for its private directory."""
    assert NO_TEMP_DIR != NOWHERE
    env = _read_only_install(tmp_path)
    out = subprocess.run([sys.executable, "-c", NO_TEMP_DIR, str(tmp_path), str(tmp_path / "tmp")], capture_output=True,
                         text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["value"], result["cache"], result["hits"]) == (6, "NullCache", 0)  # compiled in memory
    assert len(result["warnings"]) == 1 and result["warnings"][0].startswith(
        "KernelCacheWarning: no writable directory for packer's compiled kernels")
    assert "a private $TMPDIR/packer-kernels-<uid>)" in result["warnings"][0]
    assert os.listdir(tmp_path / "tmp") == []


WARN_IN_CLI = textwrap.dedent("""
    import sys, warnings
    from packer_cli import cli
    from packer_cli.errors import KernelCacheWarning

    def loads_after_a_warning():  # where the kernel cache warns: loading a command's kernels
        warnings.warn("no writable directory for packer's compiled kernels (...)", KernelCacheWarning, stacklevel=2)
        warnings.warn("something else", UserWarning)
        return True

    cli.light_cache_loads = loads_after_a_warning
    sys.argv = ["packer", "inspect", sys.argv[1]]
    cli.main()
""")


def test_the_cli_prints_packers_warnings_as_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-c", WARN_IN_CLI, str(tmp_path / "missing")], capture_output=True,
                            text=True, timeout=120)
    lines = result.stderr.splitlines()
    assert lines[0] == "warning: no writable directory for packer's compiled kernels (...)"
    assert "UserWarning: something else" in lines[1]  # others keep Python's format
    assert lines[-1].startswith("error: ") and result.returncode == 2
    assert "KernelCacheWarning" not in result.stderr


def test_numbas_own_warnings_at_import_are_passed_on(monkeypatch):
    """packer rewrites numba's NUMBA_* RuntimeWarnings as one line; any other warning numba gives
    as it is imported (a deprecation it announces) reaches the user as numba gave it."""
    import types

    import numba

    noisy, said = types.ModuleType("numba"), []

    def __getattr__(name):  # numba warns once while ``from numba import njit`` runs
        if not said:
            said.append(name)
            warnings.warn("numba: this NumPy is not supported yet", FutureWarning)
        return getattr(numba, name)

    noisy.__getattr__ = __getattr__
    monkeypatch.setitem(sys.modules, "numba", noisy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _kernel_cache._import_numba() is numba.njit
    assert [(w.category, str(w.message)) for w in caught] == [(FutureWarning, "numba: this NumPy is not supported yet")]

"""numba's on-disk kernel cache, made to notice changes in the code a kernel calls.

numba keys a cached kernel on its own source file and bytecode only. A kernel that calls a
helper in another module (``_rebuild`` → ``plan._kernels._bitset_prev``, ``_pread_gather_kernel``
→ ``_unaligned.load_u64``) or reads a constant from one (``NJIT_FLAGS``, a lookup table) has
that code and those values compiled into its machine code, so after an upgrade or a
``git pull`` that changes only the helper, numba loads the old machine code as valid: the
helper's old behaviour, silently (numba's cache files in ``__pycache__`` outlive an upgrade).

:func:`install` puts packer's own cache locators in front of numba's. They store the cache
where numba would and differ only in the *source stamp* that validates it: the kernel file's
stamp as numba computes it, plus a digest of everything the kernel's code reaches by name,
followed through called kernels: the source of each module holding a called kernel, a
helper intrinsic or a module used by attribute, each called kernel's compile options, and the
value of each constant (numbers, strings, tuples, NumPy arrays). A change to any of them makes
the cached kernel stale, so numba compiles it again and replaces the entry.

Only functions defined in files under the installed root (packer's package) get these
locators; every other function keeps numba's. A numba that lacks the classes this relies on
is left alone (its own stamp then applies, as before).

Where none of numba's places can be written (a read-only install or container image whose user
has no writable home and no ``NUMBA_CACHE_DIR``), packer's kernels are cached in a directory of
this user's own under the temporary directory, ``$TMPDIR/packer-kernels-<uid>``: without it
every run compiled them afresh (8–17 s, by command). A cached kernel is a pickle, which runs
code when loaded, so the directory is used only when it is private: a real directory (not a
link) owned by this user that no one else may enter. It is made with mode 0700 when missing;
one that exists and is not private is left alone. Where no directory is left at all the
kernels compile in memory, with a :class:`~packer_cli.errors.KernelCacheWarning` saying so
once a process.

A cache directory away from the sources is seeded from the kernels cached beside them
(:func:`_seed_from_tree`): an image whose kernels were compiled at build time, run by a user
who may not write to the package, loads them instead of compiling everything again.
"""
from __future__ import annotations

import hashlib
import inspect
import os
import stat
import tempfile
import types
import warnings
from functools import lru_cache

import numpy as np

from packer_cli.errors import (ConfigError, KernelCacheWarning, PackerWarning, check_interrupted, first_line,
                               reraise_interrupt)


def _import_numba():
    """numba's ``njit``. numba reads its NUMBA_* variables as it is imported: a value it refuses
    is a :class:`ConfigError`, one it cannot parse (and ignores) a one-line warning, not the
    RuntimeWarning numba gives, which holds a whole traceback."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            from numba import njit
        except (ValueError, RuntimeError, KeyError) as exc:
            check_interrupted()  # a Ctrl-C that numba's C code turned into an error of its own
            raise ConfigError(f"numba cannot start: {first_line(exc)} (a NUMBA_* environment variable?)") from exc
    from numba.core import config

    if config.DISABLE_JIT:  # numba would run each kernel as Python: intrinsics raise there, the rest crawls
        raise ConfigError("NUMBA_DISABLE_JIT is set: packer's kernels need numba's compiler (some use "
                          "intrinsics that have no Python form); unset it")
    for w in caught:
        if issubclass(w.category, RuntimeWarning) and "NUMBA_" in str(w.message):
            warnings.warn(f"{first_line(w.message)} (numba uses its default)", PackerWarning, stacklevel=3)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return njit


_numba_njit = _import_numba()

# kernel modules take ``njit`` from here: see install()
__all__ = ["install", "is_packer_function", "njit", "reach_digest"]

#: Directories whose functions get the reaching locators (packer's package; tests add others).
_ROOTS: list[str] = [os.path.dirname(os.path.abspath(__file__))]
_CONSTANTS = (bool, int, float, complex, str, bytes, np.generic)


def njit(*args, **options):
    """numba's ``njit``, except that a kernel asking for the disk cache where numba finds no
    writable cache directory is compiled in memory, afresh in every process, instead.

    numba raises at decoration ("no locator available") when neither the package's
    ``__pycache__`` (a read-only install or image) nor ``NUMBA_CACHE_DIR`` nor the home
    directory's cache can be written: every command died with a traceback on import.
    """
    if args and callable(args[0]):  # bare @njit
        return njit(**options)(args[0])
    decorate = _numba_njit(*args, **options)
    if not options.get("cache"):
        return decorate

    def cached_where_possible(py_func):
        try:
            return decorate(py_func)
        except RuntimeError as exc:
            if "NUMBA_CACHE_LOCATOR_CLASSES" in str(exc):  # a value that names no locator class
                raise ConfigError(first_line(exc)) from exc
            if "no locator available" not in str(exc):
                raise
            _warn_compiling_in_memory()
            return _numba_njit(*args, **dict(options, cache=False))(py_func)

    return cached_where_possible


_warned_in_memory = False


def _warn_compiling_in_memory() -> None:
    global _warned_in_memory
    if _warned_in_memory:  # once a process, not once a kernel
        return
    _warned_in_memory = True
    warnings.warn(
        "no writable directory for packer's compiled kernels (the package's __pycache__, "
        f"NUMBA_CACHE_DIR, the user's cache directory, a private {_private_temp_path() or _TEMP_PATH_PATTERN}): "
        "they compile in memory "
        "in every run, several seconds each; set NUMBA_CACHE_DIR to a writable directory",
        KernelCacheWarning, stacklevel=3)


_TEMP_PATH_PATTERN = "$TMPDIR/packer-kernels-<uid>"


def _private_temp_path() -> str | None:
    """Where this user's private kernel cache goes; None where Python finds no usable temporary
    directory at all (a read-only container: ``tempfile`` raises, and every command died with
    a traceback)."""
    uid = os.getuid() if hasattr(os, "getuid") else "<uid>"
    try:
        return os.path.join(tempfile.gettempdir(), f"packer-kernels-{uid}")
    except OSError:
        return None


def private_temp_root() -> str | None:
    """This user's private kernel cache directory under the temporary directory, made when
    missing; None where it cannot be made or is not private (see the module docstring)."""
    if not hasattr(os, "getuid"):  # no user ids to check ownership against
        return None
    path = _private_temp_path()
    return _private_root(path) if path is not None else None


@lru_cache(maxsize=None)  # asked once per kernel; keyed on the path, so a new TMPDIR is looked at
def _private_root(root: str) -> str | None:
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(root)  # lstat: a link planted in its place is not followed
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return root


@lru_cache(maxsize=None)
def _file_digest(path: str, mtime_ns: int, size: int) -> bytes:  # keyed on the stat: re-read if edited
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _source_file(obj) -> str | None:
    try:
        return os.path.abspath(inspect.getfile(obj))
    except (TypeError, OSError):
        return None


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _under_roots(path: str) -> bool:
    path = os.path.abspath(path)
    return any(path.startswith(root + os.sep) for root in _ROOTS)


def is_packer_function(py_func) -> bool:
    """Whether ``py_func`` is defined in a file under packer's package (or a root tests added)."""
    path = _source_file(py_func)
    return path is not None and _under_roots(path)


def _is_kernel(obj) -> bool:
    return hasattr(obj, "py_func") and hasattr(obj, "targetoptions")


class _Reach:
    """What one kernel's code reaches by name: source files, compile options, constants."""

    def __init__(self):
        self.files: set[str] = set()
        self.facts: list[str] = []
        self._seen: set[int] = set()

    def function(self, py_func) -> None:
        if id(py_func) in self._seen:
            return
        self._seen.add(id(py_func))
        path = _source_file(py_func)
        if path:
            self.files.add(path)
        names = set()
        for code in _code_objects(py_func.__code__):
            names.update(code.co_names)
        for name in sorted(names):
            if name in py_func.__globals__:
                self.value(name, py_func.__globals__[name], names)

    def value(self, name: str, obj, names: set[str]) -> None:
        if _is_kernel(obj):
            self.facts.append(f"{name}:options={sorted(obj.targetoptions.items())!r}")
            self.function(obj.py_func)
        elif isinstance(obj, types.ModuleType):
            path = _source_file(obj)
            if path and _under_roots(path):
                self.files.add(path)
                for attr in sorted(names):  # module.kernel(...) reaches the kernel's callees too
                    member = getattr(obj, attr, None)
                    if _is_kernel(member):
                        self.value(f"{name}.{attr}", member, names)
        elif isinstance(obj, np.ndarray):
            digest = hashlib.sha256(np.ascontiguousarray(obj).tobytes()).hexdigest()
            self.facts.append(f"{name}:array={obj.dtype.str}{obj.shape}{digest}")
        elif isinstance(obj, _CONSTANTS) or (isinstance(obj, tuple) and all(isinstance(x, _CONSTANTS) for x in obj)):
            self.facts.append(f"{name}={obj!r}")
        elif hasattr(obj, "_defn"):  # a numba @intrinsic: its codegen's source
            path = _source_file(obj._defn)
            if path:
                self.files.add(path)


def reach_digest(py_func) -> str:
    """Digest of the sources, compile options and constants ``py_func``'s compiled code depends
    on, its own file included (see the module docstring)."""
    reach = _Reach()
    own = py_func.__globals__.get(py_func.__name__)
    if _is_kernel(own) and own.py_func is py_func:  # its own options (``@njit(**NJIT_FLAGS)``)
        reach.facts.append(f"options={sorted(own.targetoptions.items())!r}")
    reach.function(py_func)
    h = hashlib.sha256()
    for path in sorted(reach.files):
        st = os.stat(path)
        h.update(os.path.basename(path).encode() + b"\0" + _file_digest(path, st.st_mtime_ns, st.st_size))
    for fact in reach.facts:
        h.update(fact.encode() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=None)
def _process_reach_digest(py_func) -> str:
    """:func:`reach_digest`, once per function: numba asks for the stamp each time it reads or
    writes a kernel's index, and sources do not change under a running process. Should the
    walk fail (a module whose attributes raise), the stamp is the file's alone, as numba's."""
    try:
        return reach_digest(py_func)
    except Exception as exc:  # noqa: BLE001 - a cache key must never stop a kernel from loading
        reraise_interrupt(exc)  # nor be cached as "unreached" because of a Ctrl-C
        return "unreached"


class _Stamp:
    """numba's stamp of the kernel's file and the kernel's reach digest, the digest worked out
    when the stamp is first compared or saved. numba asks for the stamp when the decorator
    runs, before the functions defined further down the module (and what they reach) exist;
    it compares the stamp when it first loads the kernel and pickles it when it saves one,
    by which time they do. Pickled, it is a plain tuple."""

    __slots__ = ("_file_stamp", "_py_func")

    def __init__(self, file_stamp, py_func):
        self._file_stamp = file_stamp
        self._py_func = py_func

    def value(self) -> tuple:
        return (self._file_stamp, _process_reach_digest(self._py_func))

    def __eq__(self, other):
        return self.value() == (other.value() if isinstance(other, _Stamp) else other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(self.value())

    def __reduce__(self):
        return (tuple, (self.value(),))


def _reaching(base: type, seeded: bool) -> type:
    """``base`` (one of numba's source-file locators) with the reach digest in its stamp, for
    functions under the package root only; ``seeded``: a cache directory away from the sources,
    seeded from the kernels compiled beside them (:func:`_seed_from_tree`)."""

    class Locator(base):
        def __init__(self, py_func, py_file):
            super().__init__(py_func, py_file)
            self._packer_py_func = py_func

        def get_source_stamp(self):
            return _Stamp(super().get_source_stamp(), self._packer_py_func)

        @classmethod
        def from_function(cls, py_func, py_file):
            if not _under_roots(py_file):
                return None
            self = super().from_function(py_func, py_file)
            if self is not None and seeded:
                _seed_from_tree(os.path.abspath(py_file), self.get_cache_path())
            return self

    Locator.__name__ = Locator.__qualname__ = f"Packer{base.__name__.lstrip('_')}"
    return Locator


def _private_temp(base: type) -> type:
    """numba's user-wide locator (``base``), rooted in :func:`private_temp_root` instead."""

    class PrivateTempCacheLocator(base):
        def __init__(self, py_func, py_file):
            super().__init__(py_func, py_file)
            self._cache_path = os.path.join(private_temp_root(), self.get_suitable_cache_subpath(py_file))

        @classmethod
        def from_function(cls, py_func, py_file):
            if private_temp_root() is None:
                return None
            return super().from_function(py_func, py_file)  # makes the kernel's subdirectory

    return PrivateTempCacheLocator


@lru_cache(maxsize=None)  # once per module and directory in a process
def _seed_from_tree(py_file: str, cache_path: str) -> None:
    """Copy the kernels cached beside ``py_file`` (its ``__pycache__``) into ``cache_path``
    where that directory has none of a kernel's files yet.

    An image built with packer's kernels compiled into the package (a first run at build time)
    and run as a user who may not write there: numba uses a cache directory only where it can
    write, so every new container compiled everything again (14-22 s a command) in the user's
    own directory, with the compiled kernels beside it unread. Copies of them load as they are:
    a stale one (another packer version) is compiled again as numba does anywhere.

    A kernel's index and data files go together: a kernel with any file there already is
    left to that directory (an index copied beside another version's data file of the same name
    would name the wrong machine code). The source directory is read only when no one but its
    owner, this user or root, may write to it (a cached kernel is a pickle); each file is
    written under a temporary name and renamed, its data before its index, so a process
    loading meanwhile sees a whole kernel or none."""
    tree = os.path.join(os.path.dirname(py_file), "__pycache__")
    if not _trusted(tree, directory=True) or os.path.realpath(tree) == os.path.realpath(cache_path):
        return
    module = os.path.splitext(os.path.basename(py_file))[0] + "."
    try:
        names = [n for n in os.listdir(tree) if n.startswith(module) and n.endswith((".nbi", ".nbc"))]
        present = {_kernel_of(n) for n in os.listdir(cache_path)}
    except OSError:
        return
    kernels: dict[str, list[str]] = {}
    for name in names:
        kernels.setdefault(_kernel_of(name), []).append(name)
    for kernel, files in kernels.items():
        if kernel in present or not any(n.endswith(".nbi") for n in files):
            continue
        for name in sorted(files, key=lambda n: n.endswith(".nbi")):  # the index last
            if not _copy_trusted(os.path.join(tree, name), os.path.join(cache_path, name)):
                break


def _kernel_of(name: str) -> str:
    """The kernel a cache file belongs to: ``mod.fn-12.py311`` of ``mod.fn-12.py311.nbi`` and
    of its data files ``mod.fn-12.py311.1.nbc``."""
    stem = name.rsplit(".", 1)[0]
    if name.endswith(".nbc"):
        stem = stem.rsplit(".", 1)[0]
    return stem


def _trusted(path: str, directory: bool = False) -> bool:
    if not hasattr(os, "getuid"):  # no owners to check
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    return kind(st.st_mode) and not st.st_mode & 0o022 and st.st_uid in (0, os.getuid())


def _copy_trusted(src: str, dst: str) -> bool:
    if not _trusted(src):
        return False
    tmp = os.path.join(os.path.dirname(dst), f".seed-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with open(src, "rb") as f:
            data = f.read()
        # 0o666 less the umask, as numba creates its own cache files: a directory a group
        # shares (NUMBA_CACHE_DIR, setgid) stays readable to the others (mkstemp's 0o600 was not)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, dst)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True


def install(root: str | None = None) -> bool:
    """Put the reaching locators first in numba's list (idempotent), for functions under
    packer's package and ``root`` when given: numba's three source-file locators, then the
    private temporary directory. False when this numba does not have the pieces,
    or ``NUMBA_CACHE_LOCATOR_CLASSES`` chooses the locators instead."""
    if root is not None and os.path.abspath(root) not in _ROOTS:
        _ROOTS.append(os.path.abspath(root))
    try:
        from numba.core import caching, config
    except ImportError:
        return False
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    bases = [getattr(caching, name, None) or getattr(caching, "_" + name, None)
             for name in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")]
    if impl is None or None in bases or not isinstance(getattr(impl, "_locator_classes", None), list):
        return False
    if getattr(config, "CACHE_LOCATOR_CLASSES", None):
        return False
    if any(getattr(cls, "_packer_reaching", False) for cls in impl._locator_classes):
        return True
    in_tree = bases[1]
    ours = [_reaching(base, seeded=base is not in_tree) for base in bases] + [_reaching(_private_temp(bases[2]), True)]
    for cls in ours:
        cls._packer_reaching = True
    impl._locator_classes = ours + impl._locator_classes
    return True


install()

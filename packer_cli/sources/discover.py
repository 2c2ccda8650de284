"""Turn the user's INPUT arguments into an ordered list of input files.

A file is taken as given; a directory expands to its supported files in sorted order (or is
read as a Hugging Face ``save_to_disk`` directory when it holds ``state.json``); a glob expands
to its matches in sorted order. The files form one stream whose record positions are the
samples' *source indices*.
"""
from __future__ import annotations

import fnmatch
import functools
import glob
import itertools
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from packer_cli.errors import ConfigError, DataError, is_utf8, shown, unless_missing, why_unreachable
from packer_cli.shards._atomic import within
from packer_cli.shards.bridge import is_bridge_dir, layout_files
from packer_cli.shards.format import FORMAT_NAME, MANIFEST_FILE

#: Suffix → format name, matched in this order (compressed JSON Lines by their full suffix:
#: a bare ``.gz`` or ``.zst`` names no format).
SUFFIXES = {
    ".jsonl.gz": "jsonl",
    ".jsonl.zst": "jsonl",
    ".jsonl": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
}


@dataclass(frozen=True)
class InputFile:
    """One input: its path, its format and (for HF directories) the Arrow files inside it."""

    path: str
    format: str
    parts: tuple[str, ...] = ()
    #: :func:`file_identity` of each file as it was found (the path, or each part), if it could
    #: be looked at: what the run reads unless the file changes while it runs
    found_as: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def size(self) -> int:
        paths = self.parts or (self.path,)
        return sum(os.path.getsize(p) for p in paths)

    def identity_now(self) -> tuple[tuple[int, int, int, int], ...]:
        """:func:`file_identity` of each of its files now (``OSError`` where one is gone): where
        it differs from :attr:`found_as`, a file was replaced by a move, rewritten, cut or
        appended to since it was found."""
        return tuple(map(file_identity, self.parts or (self.path,)))


def file_identity(path: str) -> tuple[int, int, int, int]:
    """(device, inode, size, modification time in ns) of the file at ``path`` (links followed)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def format_of(path: str) -> str | None:
    lower = path.lower()
    for suffix, fmt in SUFFIXES.items():
        if lower.endswith(suffix):
            return fmt
    return None


def _input_file(path: str, fmt: str) -> InputFile:
    """An input file, refused unless it is a regular file (or a link to one). Each input is
    opened more than once (its first record names the supervision field, then it is read), and
    Parquet and Arrow files are read at offsets: a FIFO gave the reader what the first look left
    (an error, or records silently missing) or blocked for ever, and a device such as
    /dev/zero never ended."""
    if not is_utf8(path):  # a name found in a directory or by a glob
        raise DataError(f"{path!r}: not a UTF-8 file name (rename it: pyarrow and the metadata's JSON take "
                        "only UTF-8)")
    try:
        st = os.stat(path)
    except OSError:  # a dangling link: reported, with its reason, when it is read
        return InputFile(path=path, format=fmt)
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path}: not a regular file (a FIFO, socket or device); packer reads an input more "
                        "than once: write it to a file first")
    return InputFile(path=path, format=fmt, found_as=((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns),))


def _hf_dataset(path: str) -> InputFile:
    import orjson

    state_path = os.path.join(path, "state.json")
    try:
        with open(state_path, "rb") as f:
            state = orjson.loads(f.read())
    except (OSError, ValueError) as exc:
        raise DataError(f"{state_path}: not a readable Hugging Face datasets state file ({exc})") from None
    if isinstance(state, dict) and state.get("_indices_data_files"):
        raise DataError(f"{state_path}: an indices mapping (_indices_data_files) selects and orders this dataset's "
                        "rows, which packer does not apply (datasets 1.x saved filtered or shuffled datasets so): "
                        "load it and save_to_disk it again with a current datasets, which writes the rows selected")
    parts = tuple(os.path.join(path, name) for name in _data_file_names(state, state_path))
    for part in parts:
        if not os.path.isfile(part):
            raise DataError(f"{path}: datasets file {os.path.basename(part)} listed in state.json is missing")
    try:
        found_as = tuple(map(file_identity, parts))
    except OSError:  # gone since: reported when it is read
        found_as = ()
    return InputFile(path=path, format="hf", parts=parts, found_as=found_as)


def _data_file_names(state, state_path: str) -> list[str]:
    """The data file names a datasets ``state.json`` lists, each checked to lie inside its directory.

    The file is user input like any other: a name that is not a string, or that points outside
    the directory (``save_to_disk`` only ever writes plain names next to state.json), is refused
    rather than joined onto a path.
    """
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise DataError(f"{state_path}: not a Hugging Face datasets state file "
                        "('_data_files' must be a list of objects with a 'filename')")
    if not entries:
        raise DataError(f"{state_path}: '_data_files' lists no data files")
    names = []
    for i, entry in enumerate(entries):
        name = entry.get("filename")
        if not isinstance(name, str) or not name or "\0" in name:
            raise DataError(f"{state_path}: _data_files[{i}].filename is {shown(name)}, not a file name")
        if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] in (os.pardir, os.curdir):
            raise DataError(f"{state_path}: _data_files[{i}].filename {shown(name)} points outside the dataset directory")
        if os.path.basename(name) != name:  # a subdirectory, perhaps a link, may lead outside it too
            raise DataError(f"{state_path}: _data_files[{i}].filename {shown(name)} is not a plain file name "
                            "(save_to_disk writes its data files next to state.json)")
        names.append(name)
    return names


def _expand_directory(path: str) -> list[InputFile]:
    """A directory's inputs: a datasets directory as one input, else every supported file
    below it (hidden entries skipped), in sorted order of their paths."""
    if _marks(path, "state.json", "_data_files"):
        return [_hf_dataset(path)]
    if _marks(path, "dataset_dict.json", "splits"):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise ConfigError(
            f"{path} is a Hugging Face DatasetDict with splits {splits}; pass one split directory, "
            f"e.g. {os.path.join(path, splits[0]) if splits else path + '/train'}"
        )
    _refuse_inside_datasets(path, None, {}, resolve=True)  # a directory inside one is not read loosely either
    _refuse_packer_output(path)
    found = in_path_order(_walk(path, (os.path.realpath(path),)))
    if not found:
        raise DataError(f"{path}: directory holds no supported input files ({', '.join(SUFFIXES)})")
    return found


def _walk(directory: str, ancestors: tuple[str, ...]) -> list[InputFile]:
    """The inputs below ``directory``. A subdirectory is expanded as a directory argument is (a
    datasets directory is one input, read through its state.json, never as loose files: its
    cache files are not data, and its splits must not be mixed); a symbolic link to a
    directory is followed, one that leads back to a directory above it is an error."""
    names = _listdir(directory)
    found = []
    for name in names:
        full = os.path.join(directory, name)
        if name.startswith("."):
            continue
        if os.path.isdir(full):
            real = _not_above(full, ancestors)
            if _holds_datasets(full):
                found += _expand_directory(full)
            else:
                if os.path.islink(full):  # a link may lead inside a datasets directory
                    _refuse_inside_datasets(full, None, {}, resolve=True)
                _refuse_packer_output(full)
                found += _walk(full, ancestors + (real,))
        elif format_of(name):
            found.append(_input_file(full, format_of(name)))
    return found


def _holds_datasets(directory: str, strict: bool = True) -> bool:
    """Whether ``directory`` is a ``datasets`` directory or DatasetDict: its ``state.json`` has
    ``_data_files`` (a damaged list is then reported), its ``dataset_dict.json`` ``splits``. A
    ``state.json`` of something else (a training log's) leaves the directory an ordinary one.
    ``strict``: a marker that cannot be read is an error (else: no marker)."""
    return (_marks(directory, "state.json", "_data_files", strict)
            or _marks(directory, "dataset_dict.json", "splits", strict))


def _marks(directory: str, marker: str, key: str, strict: bool = True) -> bool:
    """Whether ``directory`` holds the file ``marker`` with ``key`` in it. The same test for a
    directory argument and a subdirectory: a training log's state.json left the subdirectory
    an ordinary one but refused the same directory named on the command line. The whole file
    is searched (``save_to_disk`` sorts the keys, a hand-written file need not), once while it
    stays the same file (a glob's matches all look at the directories above them). A marker
    that is there but cannot be read (or is a FIFO, which would wait for a writer) is an error
    where ``strict``, in a directory that is read: taken as absent, a datasets directory was
    walked as loose files, its cache files read as data. Above the inputs (not ``strict``) it
    is no marker: a training log's state.json in a parent nobody named must not stop a run."""
    path = os.path.join(directory, marker)
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            return False
        if not stat.S_ISREG(st.st_mode):
            if not strict:
                return False
            raise DataError(f"{path}: not a regular file (a FIFO, socket or device); it tells whether {directory} "
                            "is a Hugging Face datasets directory")
        return _holds_key(path, f'"{key}"'.encode(), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                                          st.st_ctime_ns))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False
    except OSError as exc:
        if not strict:
            return False
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc}); it tells whether {directory} "
                        "is a Hugging Face datasets directory") from None


@functools.lru_cache(maxsize=1024)
def _holds_key(path: str, needle: bytes, identity: tuple) -> bool:
    """Whether the file at ``path`` holds ``needle``; ``identity`` (device, inode, size, mtime,
    ctime: a rewrite that kept the size and set the mtime back still changes the ctime) keys
    the cache, so a changed file is searched again."""
    with open(path, "rb") as f:
        tail = b""
        while chunk := f.read(1 << 20):
            if needle in tail + chunk:
                return True
            tail = chunk[1 - len(needle):]
    return False


def _listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory or os.curdir)
    except OSError as exc:  # a directory that cannot be listed is not skipped in silence
        raise DataError(f"{directory}: cannot list the directory ({exc.strerror or exc})") from None


def _not_above(directory: str, ancestors: tuple[str, ...]) -> str:
    """The real path of ``directory``, refused when it is one of its own ``ancestors`` (real paths)."""
    real = os.path.realpath(directory)
    if real in ancestors:
        raise DataError(f"{directory}: a symbolic link back to {real}, which holds it: the directory "
                        "would be read without end")
    return real


def _refuse_packer_output(directory: str) -> None:
    """A packer output is not input: its shards hold packs, and a Bridge layout's Parquet file
    has the very columns of a tokenized input, so it would be packed again as samples."""
    if _is_native_output(directory) or (is_bridge_dir(directory) and layout_files(directory) is not None):
        raise DataError(f"{directory}: a packer output, not input: move it out of the input directory, "
                        "or name the input files")


def _is_native_output(directory: str) -> bool:
    try:
        with open(os.path.join(directory, MANIFEST_FILE), "rb") as f:
            return f'"{FORMAT_NAME}"'.encode() in f.read(4096)  # its "format" key comes first
    except OSError:
        return False


def path_argument(value, name: str) -> str:
    """``value`` (a ``str`` or ``os.PathLike``) as a path string; :class:`ConfigError` naming
    ``name`` otherwise (bytes too: a bytes path formatted into a string names another file)."""
    try:
        path = os.fspath(value)
    except TypeError:
        path = None
    if not isinstance(path, str):
        raise ConfigError(f"{name} must be a path (str or os.PathLike), got {shown(value)}")
    if not is_utf8(path):
        raise ConfigError(f"{path!r}: {name} is not a UTF-8 path (rename it: pyarrow and the metadata's JSON "
                          "take only UTF-8)")
    if not path:  # else "error: : no such file", naming nothing
        raise ConfigError(f"{name}: an empty path ('')")
    if not os.path.isabs(path) and not _cwd_exists():  # else a traceback where it is first resolved
        raise ConfigError(f"{path}: a relative path, but the working directory no longer exists (deleted?)")
    return path


def _cwd_exists() -> bool:
    try:
        os.getcwd()
    except FileNotFoundError:
        return False
    return True


def input_paths(inputs, name: str = "inputs") -> list[str]:
    """``inputs`` as a list of path strings: one path (str or ``os.PathLike``) or a list of them
    (a bare string is one path, not a sequence of one-letter names)."""
    if isinstance(inputs, (str, bytes, os.PathLike)):
        inputs = [inputs]
    if isinstance(inputs, (set, frozenset, Mapping)):  # an order that changes from one interpreter to the next
        raise ConfigError(f"{name} must be one path or an ordered list of them (their order numbers the "
                          f"samples), got a {type(inputs).__name__}")
    if not isinstance(inputs, (list, tuple, Iterator)):
        # Iterating a datasets.Dataset or a pyarrow.Table yields its rows or columns, and the
        # error then showed the first one (900 characters of token ids)
        raise ConfigError(f"{name} must be one path or a list of paths (str or os.PathLike), got a "
                          f"{_type_name(inputs)}; packer reads files: write in-memory data out first "
                          "(Dataset.save_to_disk, pyarrow.parquet.write_table) and pass its path")
    return [path_argument(path, name) for path in inputs]


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def discover_inputs(inputs: list[str]) -> list[InputFile]:
    """Expand INPUT arguments (files, directories, globs) into the ordered input stream."""
    if not inputs:
        raise ConfigError("no INPUT given")
    found: list[InputFile] = []
    for arg in inputs:
        if os.path.isdir(arg):
            found.extend(_once(_expand_directory(arg)))
        elif os.path.exists(arg):
            fmt = format_of(arg)
            if fmt is None:
                raise DataError(
                    f"{arg}: unknown file type; supported: {', '.join(SUFFIXES)} or a datasets directory"
                )
            found.append(_input_file(arg, fmt))
        elif glob.has_magic(arg):
            found.extend(_once(_expand_glob(arg)))
        else:
            raise DataError(f"{arg}: {why_unreachable(arg) or 'no such file or directory'}")
    return found


def _expand_glob(pattern: str) -> list[InputFile]:
    """A glob's inputs: its matches, a directory expanded as a directory argument is, a file of
    an unsupported type skipped as a directory's walk skips it, and a match inside a
    ``datasets`` directory refused (its cache files would be read as data, a DatasetDict's
    splits mixed)."""
    whole: set[str] = set()  # `base/**`'s bases: read as directory arguments are
    found = _glob(pattern, whole)
    # one spelling per entry ('e/a/../x' and 'e/b/../x' are 'e/x'; `**` matches 'd' and 'd/x')
    by_entry = {_entry(m): _tidy(m) for m in sorted(found, reverse=True)}
    matches = sorted(by_entry.values())
    if not matches:
        raise DataError(f"{pattern}: the pattern matches no files{_unlistable_base(pattern)}")
    whole = {_entry(m) for m in whole}
    base = _literal_base(pattern)  # once: with its realpath it was a third of a 20,000-match glob's time
    datasets_dirs: dict[tuple[str, bool], bool] = {}
    expanded: list[str] = []  # `**` matches a directory and everything in it: read it once
    files: list[InputFile] = []
    for match in matches:
        entry = _entry(match)
        if any(within(entry, d) for d in expanded):
            continue
        directory = os.path.isdir(match)
        # a directory the pattern names whole by its literal part ('ds/train/**'), or a link to
        # one, is judged where its files are, as a directory argument is (below); any other match
        # where its entry stands ('dd/*/**' matched each split of a DatasetDict whole, mixing them)
        named = entry in whole and os.path.realpath(match) == base
        if not (directory and (named or os.path.islink(match.rstrip(os.sep) or match))):
            _refuse_inside_datasets(match, pattern, datasets_dirs, base=base)
        if directory:
            expanded.append(os.path.realpath(match))
            files.extend(_expand_directory(match))
        elif format_of(match):
            files.extend(discover_inputs([match]))
    if not files:
        raise DataError(f"{pattern}: the pattern matches no supported input files ({', '.join(SUFFIXES)})")
    # a directory's files in order among the others ('d/ab/x' after 'd/ab.jsonl'), as a
    # directory's walk orders them: 'd', 'd/*' and 'd/**' give one stream
    return in_path_order(files)


def _once(files: list[InputFile]) -> list[InputFile]:
    """``files`` (one argument's, in path order) with each file read once, at its first place:
    a directory's walk follows links to directories, so a link to a sibling (``data/latest ->
    v2``) reached the same files twice, and ``d``, ``d/*`` and ``d/**/*.jsonl`` read different
    sets of them depending on the link's name. A file is where its path leads (a hard-linked
    copy is a file of its own, as a copied one is). Files named twice as arguments are read twice."""
    seen, kept = set(), []
    for file in files:
        key = os.path.realpath(file.path)
        if key not in seen:
            seen.add(key)
            kept.append(file)
    return kept


def in_path_order(files: list[InputFile]) -> list[InputFile]:
    """``files`` sorted by where their data lies: a datasets directory's files are below it, so
    it sorts as its path with a separator ('d/ab' after 'd/ab.jsonl', with 'd/ab/x.jsonl'), not
    as the name of a file."""
    return sorted(files, key=lambda f: f.path.rstrip(os.sep) + os.sep if f.format == "hf" else f.path)


def _entry(path: str) -> str:
    """The entry ``path`` names, spelled one way: its directory part resolved, its last part
    kept (it may be a link, read as the link), or resolved too when it is '.' or '..'."""
    trimmed = path.rstrip(os.sep) or path
    name = os.path.basename(trimmed)
    if name in ("", os.curdir, os.pardir):
        return os.path.realpath(trimmed)
    return os.path.join(os.path.realpath(os.path.dirname(trimmed) or os.curdir), name)


def _tidy(match: str) -> str:
    """A glob's match spelled plainly ('./a', 'a/' as 'a'), but a '..' kept: after a symbolic
    link it leads to the link target's parent, which collapsing it as text would not."""
    return match.rstrip(os.sep) or match if os.pardir in match.split(os.sep) else os.path.normpath(match)


def _refuse_inside_datasets(match: str, pattern: str | None, seen: dict[tuple[str, bool], bool],
                            resolve: bool = False, base: str | None = None) -> None:
    """Refuse ``match`` (a glob's, or a directory to read) when it lies inside a ``datasets``
    directory or DatasetDict: nothing there is read but through its ``state.json`` (its cache
    files are not data, a DatasetDict's splits are not mixed). ``seen`` caches the answer per
    directory and strictness (a marker that cannot be read is an error at or below a pattern's
    literal base, no marker above it or above a directory argument). Where the match really
    lies counts ('../x' in the parent, 'link/x' where the link leads); the match itself is not
    resolved (a link to a split or a data file is read as it is in a directory's walk), unless
    ``resolve``: a directory to read is judged by where its files are, wherever a link to it
    stands. ``base``: the pattern's :func:`_literal_base`, computed here when not given."""
    directory = first = os.path.dirname(os.path.realpath(match) if resolve else _entry(match))
    if base is None and pattern is not None:
        base = _literal_base(pattern)
    while True:
        # what a pattern reads, not above it: at or below its literal base, and where a match
        # lies ('P/ds/*/../../x.jsonl' reads P/x.jsonl, above the base P/ds)
        strict = base is not None and (directory == first or within(directory, base))
        if (directory, strict) not in seen:
            seen[directory, strict] = _holds_datasets(directory, strict=strict)
        if seen[directory, strict]:
            where = directory if os.path.isabs(match) else os.path.relpath(directory)
            what = f"'{pattern}' matches a path" if pattern else "a directory"
            if _marks(where, "state.json", "_data_files"):
                raise ConfigError(f"{match}: {what} inside the Hugging Face datasets directory {where}, which is "
                                  f"read whole, through its state.json (its cache files are not data): name {where}"
                                  + (", or a pattern that matches the directory itself" if pattern else ""))
            raise ConfigError(f"{match}: {what} inside the Hugging Face DatasetDict {where}, whose splits are not "
                              "mixed: name one split directory")
        parent = os.path.dirname(directory)
        if parent == directory:
            return
        directory = parent


def _literal_base(pattern: str) -> str:
    """The directory a glob's literal components name (``ds`` of ``ds/**/*.jsonl``), resolved:
    what the pattern reads lies at or below it, so a marker there that cannot be read is an
    error, one above it no marker."""
    return os.path.realpath(_literal_dir(pattern))


def _literal_dir(pattern: str) -> str:
    """The directory a glob's literal components name, as the pattern spells it."""
    literal = _literal_parts(pattern.split(os.sep))
    return os.sep.join(literal) or (os.sep if pattern.startswith(os.sep) else os.curdir)


def _unlistable_base(pattern: str) -> str:
    """`` (DIR: permission denied)`` where the directory a glob's literal components name cannot
    be listed (glob finds nothing there and says nothing), else ``''``."""
    base = _literal_dir(pattern)
    try:
        with os.scandir(base):
            return ""
    except OSError as exc:
        reason = unless_missing(exc)  # nothing there: "the pattern matches no files" says it
        return f" ({base}: {reason})" if reason else ""


def _literal_parts(parts: list[str]) -> list[str]:
    """A glob's leading components without magic (its last one never counts: it names what is
    matched)."""
    return list(itertools.takewhile(lambda part: not glob.has_magic(part), parts[:-1]))


def glob_reaches(pattern: str, path: str) -> bool:
    """Whether the glob ``pattern`` matches ``path`` or a directory above it (below its literal
    base), so that a run over the pattern reads what lies at ``path``: ``d/**`` and ``d/*``
    reach ``d/out``, ``d/*.jsonl`` does not. ``path`` need not exist yet."""
    parts = pattern.split(os.sep)
    literal = len(_literal_parts(parts))
    base, real = _literal_base(pattern), os.path.realpath(path)
    if not within(real, base) or real == base:
        return False
    return _parts_reach([p for p in parts[literal:] if p], os.path.relpath(real, base).split(os.sep))


def _parts_reach(pattern: list[str], path: list[str]) -> bool:
    """Whether the pattern's components match a leading run of ``path``'s, wholly (``**``: any
    number of components; a hidden name only to a part that starts with a dot, as glob does)."""
    if not pattern:
        return True
    if not path:
        return False
    head, name = pattern[0], path[0]
    if head == "**":
        return _parts_reach(pattern[1:], path) or (not name.startswith(".") and _parts_reach(pattern, path[1:]))
    if name.startswith(".") and not head.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, head) and _parts_reach(pattern[1:], path[1:])


def _glob(pattern: str, whole: set[str] | None = None) -> list[str]:
    """The paths ``pattern`` matches, as ``glob.glob(pattern, recursive=True)`` finds them, but
    with each ``**`` component walked by :func:`_directories`: glob follows a link back to a
    directory above it round and round (a file read ~40 times; with two such links it never
    ends), where a directory argument's walk refuses the link."""
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return glob.glob(pattern)
    i = parts.index("**")
    rest = parts[i + 1:]
    while rest[:1] == ["**"]:  # `**/**` is one `**`, as glob reads it
        rest = rest[1:]
    head = os.sep.join(parts[:i]) or (os.sep if pattern.startswith(os.sep) else "")
    bases = [b for b in (glob.glob(head) if glob.has_magic(head) else [head]) if os.path.isdir(b or os.curdir)]
    matches: list[str] = []
    for base in bases:
        if not rest:  # `base/**` is base and all below it: read as a directory (whose walk checks links)
            matches.append(base or os.curdir)  # '**' from here is '.', read as a directory is
            if whole is not None:
                whole.add(base or os.curdir)
            continue
        for directory in _directories(base):
            matches += _glob(os.path.join(glob.escape(directory), *rest), whole)
    return matches


def _directories(base: str) -> list[str]:
    """``base`` and every directory below it, as a ``**`` matches them (hidden ones skipped,
    links to directories followed); a link back to a directory above it is an error."""
    found: list[str] = []

    def visit(directory: str, ancestors: tuple[str, ...]) -> None:
        found.append(directory)
        if directory != base and _holds_datasets(directory):
            return  # matches of its own files are refused; nothing below it is looked at
        for name in _listdir(directory):
            full = os.path.join(directory, name)
            if not name.startswith(".") and os.path.isdir(full):
                visit(full, ancestors + (_not_above(full, ancestors),))

    visit(base, (os.path.realpath(base or os.curdir),))
    return found

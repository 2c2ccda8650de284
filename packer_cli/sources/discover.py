"""Turn the user's INPUT arguments into an ordered list of input files.

A file is taken as given; a directory expands to its supported files in sorted order (or is
read as a Hugging Face ``save_to_disk`` directory when it holds ``state.json``); a glob expands
to its matches in sorted order. The files form one stream whose record positions are the
samples' *source indices*.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from packer_cli.errors import ConfigError, DataError

#: Suffix → format name. Longest suffixes first so ``.jsonl.gz`` wins over ``.gz``.
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

    @property
    def size(self) -> int:
        paths = self.parts or (self.path,)
        return sum(os.path.getsize(p) for p in paths)


def format_of(path: str) -> str | None:
    lower = path.lower()
    for suffix, fmt in SUFFIXES.items():
        if lower.endswith(suffix):
            return fmt
    return None


def _hf_dataset(path: str) -> InputFile:
    import orjson

    state_path = os.path.join(path, "state.json")
    try:
        with open(state_path, "rb") as f:
            state = orjson.loads(f.read())
    except (OSError, ValueError) as exc:
        raise DataError(f"{state_path}: not a readable Hugging Face datasets state file ({exc})") from None
    parts = tuple(os.path.join(path, name) for name in _data_file_names(state, state_path))
    for part in parts:
        if not os.path.isfile(part):
            raise DataError(f"{path}: datasets file {os.path.basename(part)} listed in state.json is missing")
    return InputFile(path=path, format="hf", parts=parts)


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
            raise DataError(f"{state_path}: _data_files[{i}].filename is {name!r}, not a file name")
        if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] in (os.pardir, os.curdir):
            raise DataError(f"{state_path}: _data_files[{i}].filename {name!r} points outside the dataset directory")
        names.append(name)
    return names


def _expand_directory(path: str) -> list[InputFile]:
    if os.path.isfile(os.path.join(path, "state.json")):
        return [_hf_dataset(path)]
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise ConfigError(
            f"{path} is a Hugging Face DatasetDict with splits {splits}; pass one split directory, "
            f"e.g. {os.path.join(path, splits[0]) if splits else path + '/train'}"
        )
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            full = os.path.join(root, name)
            if not name.startswith(".") and format_of(name):
                files.append(full)
    if not files:
        raise DataError(f"{path}: directory holds no supported input files ({', '.join(SUFFIXES)})")
    return [InputFile(path=f, format=format_of(f)) for f in sorted(files)]


def discover_inputs(inputs: list[str]) -> list[InputFile]:
    """Expand INPUT arguments (files, directories, globs) into the ordered input stream."""
    if not inputs:
        raise ConfigError("no INPUT given")
    found: list[InputFile] = []
    for arg in inputs:
        if os.path.isdir(arg):
            found.extend(_expand_directory(arg))
        elif os.path.exists(arg):
            fmt = format_of(arg)
            if fmt is None:
                raise DataError(
                    f"{arg}: unknown file type; supported: {', '.join(SUFFIXES)} or a datasets directory"
                )
            found.append(InputFile(path=arg, format=fmt))
        elif glob.has_magic(arg):
            matches = sorted(glob.glob(arg))
            if not matches:
                raise DataError(f"{arg}: the pattern matches no files")
            for match in matches:
                found.extend(discover_inputs([match]))
        else:
            raise DataError(f"{arg}: no such file or directory")
    return found

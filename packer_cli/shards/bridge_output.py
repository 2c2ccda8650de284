"""``BridgeOutput``: the steps of ``pack()`` that differ for ``--format megatron-bridge``.

``pack()`` calls, in order::

    prepare(out, overwrite, spec) → tmp    check OUT, make a temporary sibling directory
    write(tmp, ...) → manifest             the split's Parquet file, built inside tmp
    annotate(summary, warn)                EOS id, file names, Bridge-scan diagnostics
    commit(tmp, manifest, metadata)        per-split JSON, Bridge's metadata array, rename

OUT may already hold a Bridge layout with the *other* split: then this split's files are
moved into it one by one (each rename is atomic, Bridge's metadata array last), and its dict
is appended to ``{C}_metadata.jsonl`` as Bridge does. Otherwise the whole temporary directory
is renamed into place. Either way no file is ever seen half-written.

Which entry of that array is which split's is decided by one rule, :func:`claim_entries`,
shared with ``packer verify`` (:mod:`packer_cli.audit._bridge_checks`): ``--overwrite`` removes
the replaced split's old entry only where that rule leaves it certain.
"""
from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field


from packer_cli._background import ordered_map
from packer_cli.errors import ConfigError, DataError
from packer_cli.shards._atomic import (check_parent, check_replaceable, check_writable, locked, make_temporary,
                                      overwrite_refusal, remove_tree, replace_dir, signals_held, sync_dir,
                                      write_synced)
from packer_cli.spec import is_int, pad_multiple_for
from packer_cli.shards.format import FORMAT_NAME, is_output_file_name, read_json_value, seal_metadata, write_json
from packer_cli.shards.bridge import (
    BRIDGE_COLUMNS, BRIDGE_FORMAT, BRIDGE_FORMAT_VERSION, PARQUET_ENCODING_NAMES, SPLITS, bridge_metadata_name,
    data_name, default_row_group_size, is_layout_name, layout_files, layout_pack_sizes, split_manifest_name,
    split_metadata_name, splits_in,
)



#: Row groups of this many tokens or more are warned about (BridgeOutput.row_group_memory_note):
#: 100 packs of 131,072 tokens (13M-token groups) peaked at 1.0 GB, 500 of them at 1.9-2.1 GB.
LARGE_GROUP_TOKENS = 16 << 20

class _JoinInstead(Exception):
    """Raised inside replace_dir: the directory at OUT is a layout another run committed since
    this run checked OUT, to be joined, not replaced."""


def foreign_names(out: str, names: list[str]) -> list[str]:
    """The entries ``names`` of directory ``out`` that keep ``--overwrite`` (either format) from
    replacing it: any not named as packer names its files (a native output's or a Bridge
    layout's), a directory under such a name, and a file under such a name that packer did not
    write. ``metadata.json`` and ``manifest.json`` are common names, and a user's own under them
    made a directory of theirs look like packer's output, so files are judged by what they hold
    (:func:`_evidence`): one naming another format is another tool's; one that does not parse is
    damage to packer's output only beside a file of the same kind of output (native, or a Bridge
    layout) that shows it is one, since JSON other tools write (``NaN``, a byte-order mark,
    comments) does not parse either, and a native output never holds a Bridge file, nor the
    reverse."""
    foreign, unparsed, shown = [], [], set()
    for name in names:
        path = os.path.join(out, name)
        kind = "native" if is_output_file_name(name) else "bridge" if is_layout_name(name) else None
        if kind is None or (os.path.isdir(path) and not os.path.islink(path)):
            foreign.append(name)  # packer writes no directory there: its files may be anyone's
            continue
        evidence = _evidence(path)
        if evidence == "packer's":
            shown.add(kind)
        elif evidence == "another tool's":
            foreign.append(name)
        else:
            unparsed.append((name, kind))
    return sorted(foreign + [name for name, kind in unparsed if kind not in shown])


#: A JSON file under one of packer's names larger than this is judged by its first bytes as
#: packer writes them, not parsed whole (a user's 269 MB one took 3.7 GB and up to 17 s to parse).
#: Packer's own metadata lists every input path (17,000 paths of 4,000 characters made 69 MB),
#: after its ``format`` key: before it come at most 1,000 bad records.
_PARSED_JSON = 16 << 20


def _evidence(path: str) -> str:
    """What the file at ``path`` (under one of packer's names) shows: ``packer's`` (a JSON file
    naming packer's format, native or Bridge; a Bridge metadata array; a native shard whose
    schema names packer's format; a Parquet file with Bridge's columns), ``another tool's`` (a
    JSON document or Parquet file that is none of these) or ``unparsed`` (what does not parse,
    or no regular file)."""
    name = os.path.basename(path)
    if name.endswith(".arrow"):
        return _native_shard(path)
    if name.endswith(".parquet"):
        return _bridge_data(path)
    try:
        if os.path.getsize(path) > _PARSED_JSON:  # packer's own: indented, keys sorted, "format" near the top
            with open(path, "rb") as f:
                head = f.read(_PARSED_JSON)
            ours = any(b'\n  "format": "%s"' % f.encode() in head for f in (FORMAT_NAME, BRIDGE_FORMAT))
            return "packer's" if ours and not name.endswith(".jsonl") else "another tool's"
        document = read_json_value(path)
    except (OSError, ValueError):  # orjson's decode error is a ValueError
        return "unparsed"
    if name.endswith(".jsonl"):  # Bridge's array of dicts, whoever wrote the layout
        return "packer's" if isinstance(document, list) and all(isinstance(d, dict) for d in document) else "unparsed"
    ours = isinstance(document, dict) and document.get("format") in (FORMAT_NAME, BRIDGE_FORMAT)
    return "packer's" if ours else "another tool's"


def _native_shard(path: str) -> str:
    """:func:`_evidence` of a file under a native shard's name: an Arrow IPC file whose schema
    names packer's shard format or not, or unreadable."""
    import pyarrow as pa

    try:
        if not os.path.isfile(path):  # opening a FIFO would wait for a writer
            return "unparsed"
        with pa.memory_map(path) as source:
            metadata = pa.ipc.open_file(source).schema.metadata or {}
    except (OSError, pa.ArrowException):
        return "unparsed"
    return "packer's" if metadata.get(b"format") == FORMAT_NAME.encode() else "another tool's"


def _bridge_data(path: str) -> str:
    """:func:`_evidence` of a Parquet file under a Bridge data file's name: Bridge's columns
    (a layout's, packer's or Bridge's own) or not, or unreadable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if not os.path.isfile(path):
            return "unparsed"
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowException):
        return "unparsed"
    return "packer's" if all(column in names for column in BRIDGE_COLUMNS) else "another tool's"


def _is_layout(path: str) -> bool:
    """Whether ``path`` is a directory of a Bridge layout's files only (or an empty one)."""
    try:
        return os.path.isdir(path) and layout_files(path) is not None
    except OSError:  # gone, or not listable
        return False


_JOIN = object()  # BridgeOutput._put_in_place: OUT is a layout to join


def _read_json(path: str):
    try:
        return read_json_value(path)
    except (OSError, ValueError) as exc:  # orjson's decode error is a ValueError
        raise DataError(f"{path}: cannot read ({exc})") from None


def read_bridge_array(path: str) -> list:
    """Bridge's metadata file: a JSON array of dicts (empty when the file does not exist)."""
    if not os.path.exists(path):
        return []
    array = _read_json(path)
    if not isinstance(array, list) or not all(isinstance(d, dict) for d in array):
        raise DataError(f"{path}: not a JSON array of dicts (Bridge's packing metadata)")
    return array


# -- which entry of the array is which split's (shared with packer verify) ---------------------
def entry_equals(entry: dict, values: dict) -> bool:
    """Whether ``entry`` holds ``values`` on Bridge's six keys, exactly as verify compares them."""
    # Imported here: only writing into an existing layout or auditing one needs them, and every
    # `pack` run imports this module at start-up.
    from packer_cli.audit._meta_checks import _same
    from packer_cli.audit._meta_schema import BRIDGE_KEYS

    return all(key in entry and _same(entry[key], values.get(key)) for key in BRIDGE_KEYS)


def claim_entries(array: list, claims) -> tuple[dict, list[int]]:
    """Assign the array's entries to splits: each ``(split, values)`` of ``claims``, in Bridge's
    order, takes the first unclaimed entry equal to its values (values None: unknown, takes none).
    One rule for pack and every split's verify, so two splits with equal values need two entries.
    Returns ``{split: entry index or None}`` and the indices left unclaimed."""
    unclaimed = list(range(len(array)))
    taken = {}
    for split, values in claims:
        found = None if values is None else next((i for i in unclaimed if entry_equals(array[i], values)), None)
        if found is not None:
            unclaimed.remove(found)
        taken[split] = found
    return taken, unclaimed


def present_split_values(out: str, pack_size: int) -> list[tuple[str, dict | None]]:
    """``(split, its recorded six values)`` of every split with a data file in ``out``, in Bridge's
    order; None where packer recorded none (a split Bridge wrote has no packer metadata)."""
    return [(split, recorded_bridge(out, split)) for split in SPLITS
            if os.path.isfile(os.path.join(out, data_name(split, pack_size)))]


def recorded_bridge(out: str, split: str) -> dict | None:
    """The ``bridge`` record of a split's metadata, None when it has none that is usable."""
    from packer_cli.shards.bridge_reader import load_bridge_metadata  # (as in entry_equals)

    if not os.path.isfile(os.path.join(out, split_metadata_name(split))):
        return None
    try:
        record = load_bridge_metadata(out, split).get("bridge")
    except DataError:  # that split's own audit reports it
        return None
    return record if isinstance(record, dict) else None


def old_entry_index(array: list, split: str, others, old: dict | None) -> tuple[int | None, str | None]:
    """The entry of ``array`` that the replaced ``split`` held (None: none is certain), and why it
    is uncertain (None: it is certain, or there is nothing to remove).

    ``others``: the other present splits' ``(split, values)``; ``old``: this split's recorded
    values (None when unknown). The other splits claim theirs first (:func:`claim_entries`), so
    an entry equal to the old values is never taken from a split that it describes too."""
    taken, unclaimed = claim_entries(array, others)
    unmatched = [(s, v) for s, v in others if taken[s] is None]
    if len(unclaimed) <= len(unmatched):  # each left may be an unmatched split's: none is surely stale
        return None, (_why_ambiguous(split, unclaimed, unmatched) if unclaimed else None)
    if old is not None:
        found = next((i for i in unclaimed if entry_equals(array[i], old)), None)
        if found is not None:
            return found, None
    if len(unclaimed) == 1:  # every other split holds its entry: the one left over is the old one
        return unclaimed[0], None
    return None, _why_ambiguous(split, unclaimed, unmatched, old, own=True)


def _why_ambiguous(split: str, unclaimed: list[int], unmatched, old: dict | None = None, *, own=False) -> str:
    """What is left unsure: the unclaimed entries, and who may hold them (``own``: this split
    matched none by its values, so its values are named too)."""
    why = f"no split here claims entr{'y' if len(unclaimed) == 1 else 'ies'} {', '.join(map(str, unclaimed))}"
    if own:
        why += f"; the old {split} split's values " + ("are unknown (no packer metadata)" if old is None
                                                        else "equal none of them")
    for other, values in unmatched:
        why += f"; the {other} split may hold one: " + ("its values are unknown (no packer metadata)"
                                                         if values is None else "none equals its recorded values")
    return why


#: GPTSFTDataset's default pad_seq_length_to_mult: its collate pads a row to a multiple of it
#: (when not padding every row to the pack size).
BRIDGE_ROW_MULTIPLE = 16


def _row_width_multiple(spec: dict) -> tuple[int, int | None]:
    """The layout's alignment and the pad_seq_length_to_mult Bridge needs for its rows to stay
    sliceable, when its default does not do (None when it does, or when every row is padded to
    C). What a row's width must be a multiple of is the layout's own multiple (2·CP, CP·TP
    under SP), not a larger --pad-seq-to-mult: the tail segment is then still a multiple of it;
    and with a --pad-seq-to-mult that 16 divides every row is already a multiple of 16."""
    layout = pad_multiple_for(spec.get("cp", 1), spec.get("tp", 1), bool(spec.get("sp")))
    m = spec.get("pad_seq_to_mult") or layout
    if spec.get("pad_to_max_length") or BRIDGE_ROW_MULTIPLE % layout == 0 or m % BRIDGE_ROW_MULTIPLE == 0:
        return layout, None  # (sequences of a multiple of 16 leave the collate nothing to pad)
    return layout, math.lcm(BRIDGE_ROW_MULTIPLE, layout)


@dataclass
class BridgeOutput:
    """Options of the Megatron-Bridge output, and the state of one ``pack()`` run: ``pack()``
    works on its own copy of the object it is given, so one object may serve several runs,
    one after another or at once (the run's result is in its summary's ``output``)."""

    split: str = "training"
    """``training`` or ``validation``: picks ``{split}_{C}.idx.parquet``."""
    eos_id: int | None = None
    """End-of-sequence id for alignment padding; inferred when every sample ends with one id."""
    row_group_size: int | None = None
    """Packs per Parquet row group; None = :func:`default_row_group_size`."""
    parquet_encoding: str = PARQUET_ENCODING_NAMES[0]
    """How the file is encoded: ``plain-zstd``, ``plain-snappy`` or ``split-zstd``
    (:data:`~packer_cli.shards.bridge_writer.PARQUET_ENCODINGS`)."""
    _out: str = ""
    _pack_size: int = 0
    _replace_whole: bool = True
    _out_existed: bool = False
    _spec: object = None
    _overwrite: bool = False
    _inputs: tuple = ()
    _old_entry: dict | None = None
    _old_index: int | None = None
    _notes: list = field(default_factory=list)
    _result: dict = field(default_factory=dict)

    def validate(self) -> "BridgeOutput":
        if self.split not in SPLITS:
            raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        for name in ("eos_id", "row_group_size"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise ConfigError(f"{name.replace('_', '-')} must be an integer, got {value!r}")
            if value is not None:
                object.__setattr__(self, name, int(value))  # a NumPy integer is recorded as a JSON number
        if self.eos_id is not None and not 0 <= self.eos_id < 2**31:
            raise ConfigError(f"eos-id must be a non-negative int32, got {self.eos_id}")
        if self.row_group_size is not None and not 1 <= self.row_group_size < 2**31:
            # past 2**64 the run failed after writing everything, when the metadata's JSON was written
            raise ConfigError(f"row-group-size must be a number of packs from 1 to 2**31 - 1, got {self.row_group_size}")
        if self.parquet_encoding not in PARQUET_ENCODING_NAMES:
            raise ConfigError(f"parquet-encoding must be one of {', '.join(PARQUET_ENCODING_NAMES)}, "
                              f"got {self.parquet_encoding!r}")
        if self.parquet_encoding == "split-zstd":
            import pyarrow as pa

            from packer_cli.shards.bridge_writer import writes_integer_byte_streams

            if not writes_integer_byte_streams():  # checked here: the write would fail at its first row group
                raise ConfigError(f"parquet-encoding split-zstd needs pyarrow >= 16 to write integers as byte "
                                  f"streams (this is pyarrow {pa.__version__}); use plain-zstd")
        return self

    def rows_per_group(self, pack_size: int) -> int:
        return self.row_group_size or default_row_group_size(pack_size)

    def _steps(self, n_packs: int, pack_size: int) -> tuple[list[tuple[int, int]], int]:
        """The write steps (runs of ``n_packs`` packs, whole row groups each), and how many of
        them a stage of a staged read of the spill takes (about ``STAGE_TOKENS`` tokens)."""
        from packer_cli.shards._staged import STAGE_TOKENS
        from packer_cli.shards.bridge_writer import packs_per_step

        step = packs_per_step(self.rows_per_group(pack_size), pack_size)
        runs = [(a, min(a + step, n_packs)) for a in range(0, n_packs, step)]  # a step's packs each
        return runs, max(1, STAGE_TOKENS // (step * pack_size))

    def stage_first(self, n_packs: int, pack_size: int) -> list[int]:
        """The output position each stage of a staged read of the spill starts at."""
        runs, stage_runs = self._steps(n_packs, pack_size)
        return [a for a, _ in runs[::stage_runs]] or [0]

    def row_group_memory_note(self, pack_size: int) -> str | None:
        """A warning for row groups so large that building them passes packer's memory bound: a
        write step is whole row groups, and a few steps are in flight."""
        rows = self.rows_per_group(pack_size)
        if rows * pack_size < LARGE_GROUP_TOKENS:
            return None
        return (f"--row-group-size {rows:,}: row groups of {rows * pack_size:,} tokens; the writer "
                "holds whole row groups while it builds them, a few at once, so its memory grows with them "
                "(65M-token groups peaked near 2 GB). Row groups of a few million tokens (the default, about "
                "1 MiB) keep it bounded")

    # -- prepare -----------------------------------------------------------------------
    def reset(self) -> None:
        """Forget an earlier run's state (a reused object must report only its own run)."""
        self._old_entry, self._old_index, self._notes, self._result = None, None, [], {}

    def prepare(self, out: str, overwrite: bool, spec, inputs: Sequence[str] = (), create: bool = True) -> str | None:
        """Check OUT against this split and return an empty temporary sibling directory
        (``inputs``: the run's input files, which ``overwrite`` must never replace; without
        ``create``, a dry run's, only the checks)."""
        self.validate()
        self.reset()
        self._overwrite, self._inputs = overwrite, tuple(inputs)
        out = self._out = os.path.normpath(out)
        self._pack_size, self._spec = spec.pack_size, spec
        check_parent(out)
        self._replace_whole = True
        self._out_existed = os.path.exists(out)
        if self._out_existed:
            if not os.path.isdir(out):
                raise ConfigError(f"{out} exists and is not a directory")
            names = layout_files(out)
            if overwrite:  # a Bridge layout, or a native output being replaced by one; nothing else
                check_replaceable(out, inputs, foreign_names)
            if names is None:
                if not overwrite:
                    advice = self._advice(out, "pass --overwrite to replace it, or choose another directory")
                    raise ConfigError(f"{out} exists and is not a Megatron-Bridge layout; {advice}")
            else:
                self._check_layout(out, names, overwrite, spec)
                self._replace_whole = False
        if not create:  # a dry run: would the real run's renames be let in?
            check_writable(os.path.dirname(os.path.abspath(out)), "output parent directory")
            if not self._replace_whole:
                check_writable(out, "the Megatron-Bridge layout's directory")
        return make_temporary(out) if create else None

    def _check_layout(self, out: str, names: list[str], overwrite: bool, spec) -> None:
        C = spec.pack_size
        sizes = sorted(layout_pack_sizes(names))
        if len(sizes) > 1:  # naming one of them sent the user to the other, and back
            raise ConfigError(
                f"{out} holds Bridge files for the pack sizes {', '.join(map(str, sizes))}; Bridge reads both "
                f"splits with one packed_sequence_size, so pack into another directory"
            )
        if sizes and sizes[0] != C:
            raise ConfigError(
                f"{out} holds Bridge files for pack size {sizes[0]}; Bridge reads both splits with one "
                f"packed_sequence_size, so pack with --pack-size {sizes[0]} or into another directory"
            )
        for split in splits_in(out):
            if split == self.split:
                continue
            other = self._split_spec(out, split)
            if other.get("pad_seq_to_mult") != spec.pad_multiple:
                raise ConfigError(
                    f"{out} holds the {split} split packed with pad_seq_to_mult={other.get('pad_seq_to_mult')}, "
                    f"this run uses {spec.pad_multiple}; Bridge uses one pad_seq_to_mult for both splits"
                )
            for flag in ("pad_to_max_length", "pad_cu_seqlens"):  # one runtime setting: one graph shape for both
                if bool(other.get(flag)) != getattr(spec, flag):
                    option = "--" + flag.replace("_", "-")
                    raise ConfigError(
                        f"{out} holds the {split} split packed {'with' if other.get(flag) else 'without'} {option}, "
                        f"this run {'with' if getattr(spec, flag) else 'without'} it; Bridge applies one "
                        f"{flag} to both splits (a CUDA graph captured on one replays on the other)"
                    )
        for name in (split_manifest_name(self.split), data_name(self.split, C), split_metadata_name(self.split),
                     bridge_metadata_name(C)):  # what commit() renames onto, the array last
            path = os.path.join(out, name)
            if os.path.isdir(path) and not os.path.islink(path):  # found only after the split's other renames
                raise ConfigError(f"{path} is a directory where this run writes a file; remove it or choose another "
                                  "directory")
        array, unreadable = self._layout_array(out, C)  # fail early if malformed (without --overwrite)
        unlisted = [s for s in SPLITS if s != self.split and data_name(s, C) in names] if not array else []
        empty = ("it cannot be read" if unreadable else "it is empty") \
            if os.path.exists(os.path.join(out, bridge_metadata_name(C))) else "there is no such file"
        if unreadable:
            self._notes.append(f"{unreadable}: written anew, with the {self.split} split's entry")
        for other in unlisted:  # the array this run writes lacks the other split's entry
            fix = (f"pack the {other} split again with --overwrite to put its entry back" if recorded_bridge(out, other)
                   else "pack that split with packer too")  # packer's split lost the array; Bridge's own had none
            self._notes.append(f"{data_name(other, C)} has no entry in {bridge_metadata_name(C)} ({empty}): the "
                               f"array this run writes holds the {self.split} split's alone, and Bridge's static "
                               f"shapes, taken across its entries, may not fit the {other} split; {fix}")
        mine = [n for n in (data_name(self.split, C), split_metadata_name(self.split),
                            split_manifest_name(self.split)) if n in names]
        if mine and not overwrite:
            raise ConfigError(f"{out} already holds the {self.split} split ({mine[0]}); "  # not --overwrite where
                              f"{self._advice(out, 'pass --overwrite to replace that split')}")  # it would be refused
        if mine:
            self._find_old_entry(out, C, array)

    def _split_spec(self, out: str, split: str) -> dict:
        """The ``spec`` recorded in the metadata of the layout's other ``split``; a file that is
        not such metadata is OUT's problem (exit 2), not the input's."""
        path = os.path.join(out, split_metadata_name(split))
        try:
            metadata = _read_json(path)
        except DataError as exc:
            raise ConfigError(f"{exc}: the {split} split's settings cannot be checked against this run's; "
                              f"{self._advice(out, f'pack the {split} split again with --overwrite')}") from None
        if not isinstance(metadata, dict) or not isinstance(metadata.get("spec", {}), dict):
            raise ConfigError(f"{path}: not the metadata packer writes for a split (a JSON object with a spec); "
                              f"{self._advice(out, 'remove it or choose another directory')}")
        return metadata.get("spec", {})

    def _advice(self, out: str, default: str) -> str:
        """What to do about OUT: ``default``, unless ``--overwrite`` would refuse it too (files
        packer did not write, an input inside it), which is said instead."""
        return overwrite_refusal(out, foreign_names, self._inputs) or default

    def _layout_array(self, out: str, C: int) -> tuple[list, str | None]:
        """The layout's Bridge metadata array, and what is wrong with it where it cannot be read:
        then empty under ``--overwrite``, which writes it anew (what an array lost altogether
        gets), and refused without (the run would replace a file it was not asked to)."""
        try:
            return read_bridge_array(os.path.join(out, bridge_metadata_name(C))), None
        except DataError as exc:
            if not self._overwrite:
                advice = "pass --overwrite to write it anew (with this split's entry, and no other split's)"
                raise ConfigError(f"{exc}; {self._advice(out, advice)}") from None
            return [], str(exc)

    def _find_old_entry(self, out: str, C: int, array: list) -> None:
        """Which entry the replaced split held, for ``commit`` to remove; a note when unsure."""
        others = [(s, v) for s, v in present_split_values(out, C) if s != self.split]
        i, why = old_entry_index(array, self.split, others, recorded_bridge(out, self.split))
        if i is not None:
            self._old_index, self._old_entry = i, array[i]
        elif why:
            self._notes.append(f"could not tell which entry of {bridge_metadata_name(C)} belonged to the old "
                               f"{self.split} split ({why}); kept them all and appended a new one (Bridge "
                               "takes max/min over entries)")

    # -- write -------------------------------------------------------------------------
    def write(self, tmp, spill_dir, items, sources, plan, pack_order, spec, progress, direct_io: bool = True,
              spill_memory=None, spill_read: str = "random", spill_record: dict | None = None) -> dict:
        """Write the split's Parquet file into ``tmp`` and return its manifest.

        As for the native shards, each step's packs are read from the plan order parked in the
        spill directory (``plan`` holds only the per-pack arrays) and resolved, gathered, laid
        out as Bridge's rows and encoded as Parquet on two threads while this thread joins them
        into the file in order. ``spill_read="staged"`` gathers the steps from the spill's stages
        (:mod:`packer_cli.shards._staged`); ``spill_record`` then gets their number and bytes.
        """
        from packer_cli.shards.bridge_writer import bridge_step, resolve_eos, write_bridge_file

        rows, n_packs = self.rows_per_group(spec.pack_size), pack_order.size
        runs, stage_runs = self._steps(n_packs, spec.pack_size)
        from packer_cli.shards import _staged  # loads the compiler: not for a reader of this module's helpers

        reader = _staged.open_spill(spill_read, spill_dir, spill_memory, items, plan.pack_offsets, pack_order, [runs],
                                    spill_record, stage_runs, last_tokens=True)
        with reader as spill:
            last_tokens = spill.last_tokens(items.lengths)
            eos, source = resolve_eos(self.eos_id, last_tokens, items.misaligned > 0)
            not_ending = int((last_tokens != eos).sum()) if eos is not None else None
            del last_tokens

            def build(run_packs: tuple[int, int]):
                a, b = run_packs
                run, run_offsets = spill.run_items(plan.pack_offsets, pack_order[a:b])
                seq = items.resolve(run)
                tokens, mask, last, _, buffers = spill.gather_run(a, seq, run_offsets, spec.pad_id)
                built = bridge_step(tokens, mask, last, seq.length, seq.padded, sources[seq.sample], seq.offset,
                                    run_offsets, eos=eos, pad_multiple=spec.pad_multiple, row_group_size=rows,
                                    encoding=self.parquet_encoding)
                spill.recycle(buffers)  # the table holds copies laid out Bridge's way
                return built

            with closing(ordered_map(build, runs, workers=2, ahead=3)) as steps:
                entry, diagnostics = write_bridge_file(
                    os.path.join(tmp, data_name(self.split, spec.pack_size)), steps=steps, n_packs=n_packs,
                    eos=eos, row_group_size=rows, progress=progress, direct_io=direct_io,
                    encoding=self.parquet_encoding)
        self._result = {"eos_id": eos, "eos_id_source": source, "samples_not_ending_with_eos": not_ending,
                        **diagnostics}
        return {"format": BRIDGE_FORMAT, "format_version": BRIDGE_FORMAT_VERSION, "split": self.split,
                "shards": [entry]}

    # -- summary -----------------------------------------------------------------------
    def annotate(self, summary, warn=None) -> dict:
        """Add the ``output`` record to ``summary`` (and emit warnings worth a user's attention)."""
        C = summary.spec["pack_size"]
        result = self._result or {"eos_id": self.eos_id,
                                  "eos_id_source": "given" if self.eos_id is not None else "not checked"}
        output = {
            "format": BRIDGE_FORMAT, "split": self.split, "row_group_size": self.rows_per_group(C),
            "parquet_encoding": self.parquet_encoding,
            "files": {"data": data_name(self.split, C), "bridge_metadata": bridge_metadata_name(C),
                      "metadata": split_metadata_name(self.split), "manifest": split_manifest_name(self.split)},
            **result,
        }
        summary.output = output
        if warn:
            for note in self._notes:
                warn(note)
            m, row_multiple = _row_width_multiple(summary.spec)
            if row_multiple:
                warn(f"Bridge's collate pads each row to a multiple of its pad_seq_length_to_mult (16 unless set), "
                     f"which this layout's alignment ({m}) does not divide: a row of that width is no multiple of "
                     f"{m}, and CP slicing or the sequence-parallel split fails at run time. Give Bridge's "
                     f"dataset_kwargs pad_seq_length_to_mult {row_multiple}, or pack with --pad-to-max-length "
                     "(docs/MEGATRON_BRIDGE.md)")
            if output.get("eos_scan_too_short"):
                n = output["eos_scan_too_short"]
                warn(f"{n:,} {'sequence ends its' if n == 1 else 'sequences end their'} inputs with the EOS id "
                     f"{output['eos_id']}: with pad_seq_to_mult > 1 Bridge's real-length scan stops before "
                     "those trailing EOS inputs and treats them as padding (docs/MEGATRON_BRIDGE.md)")
        return output

    # -- commit ------------------------------------------------------------------------
    def data_name(self) -> str:
        """The split's Parquet file's name, in the temporary output and in OUT."""
        return data_name(self.split, self._pack_size)

    def commit(self, tmp: str, manifest: dict, metadata: dict) -> str | None:
        """Write the JSON files into ``tmp`` and move everything into OUT; returns a replaced
        OUT that could not be deleted (see :func:`replace_dir`)."""
        out, C = self._out, self._pack_size
        metadata = seal_metadata(dict(metadata, format=BRIDGE_FORMAT, format_version=BRIDGE_FORMAT_VERSION,
                                      split=self.split))
        write_json(os.path.join(tmp, split_manifest_name(self.split)), manifest)
        write_json(os.path.join(tmp, split_metadata_name(self.split)), metadata)
        array_name = bridge_metadata_name(C)
        replace = self._replace_whole  # prepare() found OUT absent, or no layout (a native output, --overwrite)
        while True:
            if replace:
                write_synced(os.path.join(tmp, array_name), json.dumps([metadata["bridge"]]).encode())
                kept = self._put_in_place(tmp, out)
                if kept is not _JOIN:
                    return kept
                # another run created OUT meanwhile, or put a layout where the output this run was
                # to replace stood (the other split, packed side by side): join it; replacing it
                # lost that split
                os.remove(os.path.join(tmp, array_name))
            # Another run may have written into OUT while this one packed (its other split, or
            # this same split): what prepare() saw is read again under a lock, so neither run's
            # entry is lost or left stale, and a split that appeared meanwhile is not silently replaced.
            with locked(out):
                if not os.path.isdir(out) or (self._overwrite and not _is_layout(out)):
                    # the layout was removed (renamed onto, as for an absent OUT), a file took its
                    # place (refused), or a native output did (replaced, with --overwrite)
                    replace = True
                    continue
                self._check_layout_again(out)
                array, _ = self._layout_array(out, C)
                i = self._entry_to_replace(out, C, array)
                if i is not None:
                    del array[i]  # by index: list.remove takes the first == dict, maybe another split's (2 == 2.0)
                array.append(metadata["bridge"])
                write_synced(os.path.join(tmp, array_name), json.dumps(array).encode())
                with signals_held():  # no signal lands between the split's files
                    # the manifest first: a run killed outright between these renames leaves a
                    # split with its manifest but not its metadata, which verify reports; a data
                    # file alone was no split at all to it, and passed
                    for name in (split_manifest_name(self.split), data_name(self.split, C),
                                 split_metadata_name(self.split), array_name):
                        os.replace(os.path.join(tmp, name), os.path.join(out, name))
                sync_dir(out, in_place=True)  # the renames durable (each file was synced as it was written)
            remove_tree(tmp)
            return None

    def _put_in_place(self, tmp: str, out: str):
        """The whole layout in ``tmp`` made OUT: replacing what is there (``--overwrite``; without
        it, something that appeared meanwhile is an error), or renamed onto an absent OUT. Returns
        a replaced OUT that could not be deleted, or None; :data:`_JOIN` where OUT is a layout.
        Any layout at OUT is another run's (prepare() found none here), whatever its inode (a
        freed one is reused at once): joined, never replaced."""
        if not os.path.lexists(out):
            sync_dir(tmp)
            try:
                os.rename(tmp, out)  # refused onto anything but an empty directory
                sync_dir(os.path.dirname(out), in_place=True)
                return None
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise
        if _is_layout(out):
            return _JOIN
        try:  # a native output (--overwrite), or a file, a dangling link, a native output that appeared
            return replace_dir(tmp, out, self._overwrite, self._still_ours, foreign_names)
        except _JoinInstead:  # found as OUT was judged again, before it moved (or put back): joined
            return _JOIN

    def _still_ours(self, moved: str) -> None:
        """OUT as it is just before it is replaced (replace_dir): a layout another run put there since
        prepare() is joined (:class:`_JoinInstead`), anything not packer's is kept."""
        if _is_layout(moved):
            raise _JoinInstead
        check_replaceable(moved, (), foreign_names, shown=self._out)

    def _check_layout_again(self, out: str) -> None:
        """prepare()'s checks on OUT as it is now (another run may have written into it since):
        one pack size, one ``pad_seq_to_mult`` and one static-shape setting for both splits."""
        names = layout_files(out)
        if names is None:
            raise ConfigError(f"{out} is not a Megatron-Bridge layout (it appeared or changed while this run was "
                              "packing: another run?); choose another directory")
        old = self._old_entry, self._old_index
        try:
            self._check_layout(out, names, True, self._spec)  # whether this split is present: below
        except ConfigError as exc:
            raise ConfigError(f"{exc} (the layout changed while this run was packing: another run?)") from None
        finally:
            self._old_entry, self._old_index = old

    def _entry_to_replace(self, out: str, C: int, array: list) -> int | None:
        """The entry of the split being replaced, as OUT holds it now; refuses a split that
        appeared while this run packed unless ``--overwrite`` was given."""
        present = [n for n in (data_name(self.split, C), split_metadata_name(self.split), split_manifest_name(self.split))
                   if os.path.lexists(os.path.join(out, n))]
        if not present:
            return None
        if not self._overwrite:
            advice = self._advice(out, "pass --overwrite to replace that split")
            raise ConfigError(f"{out} already holds the {self.split} split ({present[0]}; it appeared while this run "
                              f"was packing: another run?); {advice}")
        # what is renamed over is judged again: a user's file may have been put there meanwhile
        if foreign := [n for n in foreign_names(out, sorted(os.listdir(out))) if n in present]:
            raise ConfigError(f"{out} holds files packer did not write ({', '.join(foreign)}, put there while this "
                              "run was packing); --overwrite replaces only packer's own: remove them yourself")
        i = self._old_index
        if i is not None and i < len(array) and array[i] == self._old_entry:  # as prepare() read it
            return i
        others = [(s, v) for s, v in present_split_values(out, C) if s != self.split]
        return old_entry_index(array, self.split, others, recorded_bridge(out, self.split))[0]



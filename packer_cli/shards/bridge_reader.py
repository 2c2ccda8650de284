"""Read a Megatron-Bridge split back as packer's native rows.

``PackedReader(out_dir[, split=...])`` returns a :class:`BridgeReader` when ``out_dir`` holds
the Bridge layout, so ``PackedDataset`` (and the audit, through
:class:`~packer_cli.shards.bridge_store.BridgeStore`) sees the same
:class:`~packer_cli.shards.reader.PackRow` for both formats of one plan. The conversion
undoes :func:`packer_cli.shards.bridge_writer.to_bridge_rows` with the ``packer_*`` columns::

    stored   x0 x1 x2 x3 x4 x5 E E E | ...     seq_start_id [0, ...], packer_seq_lens [5, ...]
    native   x0 x1 x2 x3 x4 P  P P   | ...     tokens: stored[0:p], pad_id from s on
             last_token = x5 = stored[s];  loss_mask = stored loss_mask[0:p]

Like Bridge's own reader, it decodes one Parquet row group at a time and keeps the last one.

Nothing in a file is taken on trust: :func:`schema_problem` checks its columns, their types and
its schema metadata when it is opened, and :func:`native_columns` checks the rows it converts
(no nulls; each column's per-row lengths those of ``input_ids`` or ``seq_start_id``; starts that
begin at 0, increase and stay inside the row), raising :class:`BridgeRowError` naming the first
bad row; the audit also has it check Bridge's stored padding (``check_padding``).
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packer_cli._arrow import bits_to_numpy, to_numpy
from packer_cli._parquet_thrift import ThriftError, data_page_levels
from packer_cli.errors import DataError, counted, not_a_directory
from packer_cli.shards.bridge import (
    BRIDGE_COLUMNS, BRIDGE_FORMAT, BRIDGE_FORMAT_VERSION, PACKER_COLUMNS, SPLITS, data_only_split, lost_metadata, packer_splits_in,
    split_manifest_name, split_metadata_name, splits_in,
)
from packer_cli.shards.reader import (PackedReader, PackRow, check_layout_for_reading, check_recorded_rows, column_name_problem, first_line,
                                     footer_name_problem, read_json)

#: The split file's columns and the value types of their lists, the writer's first: those of
#: ``bridge_writer.BRIDGE_SCHEMA`` (a test holds them equal; that module loads the compiler, which
#: a data-loader reading a split never needs). packer 0.2.0 stored ids and starts as int64.
COLUMN_TYPES = {
    "input_ids": (pa.int32(), pa.int64()),
    "loss_mask": (pa.int8(),),
    "seq_start_id": (pa.int32(), pa.int64()),
    "packer_seq_lens": (pa.int32(),),
    "packer_source_index": (pa.int64(),),
    "packer_source_offset": (pa.int32(),),
}
COLUMNS = BRIDGE_COLUMNS + PACKER_COLUMNS
assert tuple(COLUMN_TYPES) == COLUMNS
#: ``recorded_eos`` of a split metadata that records no usable ``output.eos_id``
UNKNOWN = object()


def resolve_split(out_dir: str, split: str | None) -> str:
    """``split`` if present in ``out_dir``; by default ``training``, else the only split there."""
    present = splits_in(out_dir)
    if split is None:
        if present:
            return present[0]
        damaged = packer_splits_in(out_dir)  # with a manifest but no metadata
        if not damaged:
            names = ", ".join(map(split_metadata_name, SPLITS))
            raise DataError(f"{out_dir}: no split written by packer ({names} missing)")
        split = damaged[0]
    if split not in present:
        if problem := lost_metadata(out_dir, split):
            error = DataError(f"{os.path.join(out_dir, split_metadata_name(split))}: {problem}")
            error.check = "structure.json"  # damage to a split, as verify's structure checks report it
            raise error
        if data := data_only_split(out_dir, split):  # Bridge's own split, or one that lost packer's files
            raise DataError(f"{os.path.join(out_dir, data)}: the {split} split's data file is here without "
                            f"{split_metadata_name(split)} or {split_manifest_name(split)}: packer cannot read or "
                            "verify it")
        raise DataError(f"{out_dir}: no {split!r} split here (found: {', '.join(present) or 'none'})")
    return split


def load_bridge_metadata(out_dir: str, split: str | None = None) -> dict:
    """The split's metadata (``{split}.metadata.json``), rejecting unknown versions by name."""
    if not os.path.isdir(out_dir):
        raise DataError(not_a_directory(out_dir))
    split = resolve_split(out_dir, split)
    meta = read_json(os.path.join(out_dir, split_metadata_name(split)))
    if not isinstance(meta, dict) or meta.get("format") != BRIDGE_FORMAT:
        raise DataError(f"{out_dir}: {split_metadata_name(split)} is not packer's {BRIDGE_FORMAT!r} metadata")
    if type(meta.get("format_version")) is not int or meta["format_version"] != BRIDGE_FORMAT_VERSION:  # not true
        raise DataError(f"{out_dir}: unsupported {BRIDGE_FORMAT} version {meta.get('format_version')!r}; "
                        f"this packer reads version {BRIDGE_FORMAT_VERSION}")
    output = meta.get("output") if isinstance(meta.get("output"), dict) else {}
    named_split = meta.get("split")  # a name that is none at all is metadata.schema's finding
    for key, named in (("split", named_split if named_split in SPLITS else split),
                       ("output.split", output.get("split", split))):
        if named != split:  # another split's metadata in this one's place (renamed, copied)
            raise DataError(f"{split_metadata_name(split)}: {key} is {named!r}, but the file is the {split} split's")
    return meta


def read_split_manifest(out_dir: str, split: str) -> dict:
    """The split's manifest (``{split}.manifest.json``); :class:`DataError` names the file and
    says what is wrong when it is not the manifest packer writes."""
    from packer_cli.audit.store import read_json_file

    name = split_manifest_name(split)
    manifest = read_json_file(os.path.join(out_dir, name))
    problems = split_manifest_problems(manifest, split)
    if problems:
        raise DataError(f"{name}: {'; '.join(problems)}")
    return manifest


def split_manifest_problems(manifest: dict, split: str) -> list[str]:
    """Why a split's manifest cannot be used (empty when it can): format, version, split, entries."""
    from packer_cli.audit.store import shard_entry_problems

    version = manifest.get("format_version")
    if manifest.get("format") != BRIDGE_FORMAT:
        return [f"format is {manifest.get('format')!r}, expected {BRIDGE_FORMAT!r}"]
    if type(version) is not int or version != BRIDGE_FORMAT_VERSION:
        return [f"format_version is {version!r}; this packer reads version {BRIDGE_FORMAT_VERSION}"]
    if manifest.get("split") != split:
        return [f"split is {manifest.get('split')!r}, but the file is the {split} split's"]
    reserved = [name(s) for s in SPLITS for name in (split_metadata_name, split_manifest_name)]
    return shard_entry_problems(manifest.get("shards"), reserved=reserved)


def pad_id_of(metadata: dict) -> int:
    """The pad id packer's readers put in a rebuilt native row's padding (``spec.pad_id``)."""
    spec = metadata.get("spec")
    pad_id = spec.get("pad_id", 0) if isinstance(spec, dict) else 0
    if type(pad_id) is not int or not 0 <= pad_id < 2**31:  # written into the int32 token column
        raise DataError(f"spec.pad_id is {pad_id!r}, not a token id")
    return pad_id


def _type_text(t: pa.DataType) -> str:
    """A column type in a few characters (``list<int32>``; a long nested type cut short)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"{'large_' if pa.types.is_large_list(t) else ''}list<{_type_text(t.value_type)}>"
    text = str(t)
    return text if len(text) <= 40 else text[:37] + "..."


def _meta_text(value: bytes | None) -> str:
    if value is None:
        return "missing"
    text = value.decode("utf-8", "replace")
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _eos_of(value: bytes | None):
    """The EOS id a split file's ``eos_id`` schema metadata holds (None for ``''``); UNKNOWN when
    it holds something the writer never writes."""
    if value == b"":
        return None
    if value is None or not value.isdigit() or str(int(value)).encode() != value or int(value) >= 2**31:
        return UNKNOWN
    return int(value)


def file_eos(schema: pa.Schema) -> int | None:
    """The EOS id recorded in a split file's schema metadata (check it with :func:`schema_problem`)."""
    eos = _eos_of((schema.metadata or {}).get(b"eos_id"))
    return None if eos is UNKNOWN else eos


def recorded_eos(metadata: dict | None):
    """The EOS id (or None) the split's metadata records as ``output.eos_id``; UNKNOWN if it does
    not record a usable one (``metadata.schema`` reports that)."""
    output = metadata.get("output") if isinstance(metadata, dict) else None
    if not isinstance(output, dict) or "eos_id" not in output:
        return UNKNOWN
    eos = output["eos_id"]
    return eos if eos is None or type(eos) is int else UNKNOWN


def row_count_problem(pf: pq.ParquetFile) -> str | None:
    """The footer's row groups' row counts against its total, or None. Packs are found, and
    numbered, by those counts, so a damaged one would serve (or summarize) other packs than the
    file holds."""
    meta = pf.metadata
    counts = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    if any(n < 0 for n in counts) or sum(counts) != meta.num_rows:
        shown = ", ".join(map(str, counts[:8])) + ("..." if len(counts) > 8 else "")
        return f"its footer's row groups hold {shown} rows, not {meta.num_rows:,} in all (a damaged footer)"
    return None


def schema_problem(schema: pa.Schema, metadata: dict | None = None,
                   metadata_name: str = "the split metadata") -> str | None:
    """Why a split file's Arrow ``schema`` is not one packer writes (one short line), or None.

    Its columns are :data:`COLUMNS` in that order, each a list of one of its :data:`COLUMN_TYPES`;
    its key-value metadata names the format and version, and an EOS id (``''``: none) that is the
    one ``metadata`` (the split's) records as ``output.eos_id``, where it records one.
    """
    head = f"schema differs from the {BRIDGE_FORMAT} version {BRIDGE_FORMAT_VERSION} schema"
    if undecodable := column_name_problem(schema):
        return f"{head}: {undecodable}"
    names = list(schema.names)
    missing = [c for c in COLUMNS if c not in names]
    extra = [n if len(n) <= 40 else n[:37] + "..." for n in names if n not in COLUMN_TYPES]
    if missing or extra:
        some = lambda cols: ", ".join(cols[:3]) + (f" and {len(cols) - 3} more" if len(cols) > 3 else "")  # noqa: E731
        parts = [f"missing column{'s' if len(missing) > 1 else ''} {some(missing)}"] if missing else []
        parts += [f"unexpected column{'s' if len(extra) > 1 else ''} {some(extra)}"] if extra else []
        return f"{head}: {'; '.join(parts)}"
    if len(names) != len(COLUMNS):
        twice = next(n for n in names if names.count(n) > 1)
        return f"{head}: column {twice} appears {names.count(twice)} times"
    if names != list(COLUMNS):
        i = next(i for i, (got, want) in enumerate(zip(names, COLUMNS)) if got != want)
        return f"{head}: column {i} is {names[i]}, expected {COLUMNS[i]}"
    for field in schema:
        t, types = field.type, COLUMN_TYPES[field.name]
        if not (pa.types.is_list(t) and t.value_type in types):
            expected = " or ".join(f"list<{v}>" for v in types)
            return f"{head}: column {field.name} is {_type_text(t)}, expected {expected}"
    meta = schema.metadata or {}
    for key, want in (("packer_format", BRIDGE_FORMAT), ("packer_format_version", str(BRIDGE_FORMAT_VERSION))):
        if meta.get(key.encode()) != want.encode():
            return f"schema metadata {key} is {_meta_text(meta.get(key.encode()))}, expected {want!r}"
    eos, recorded = _eos_of(meta.get(b"eos_id")), recorded_eos(metadata)
    if eos is UNKNOWN:
        return f"schema metadata eos_id is {_meta_text(meta.get(b'eos_id'))}, expected an id or ''"
    if recorded is not UNKNOWN and recorded != eos:
        return (f"schema metadata eos_id is {_meta_text(meta.get(b'eos_id'))}, but {metadata_name} records "
                f"output.eos_id {recorded}")
    return None


class BridgeRowError(ValueError):
    """A row :func:`native_columns` cannot convert: ``row`` counts from the table's first row."""

    def __init__(self, row: int, reason: str):
        self.row, self.reason = int(row), reason
        super().__init__(f"row {self.row}: {reason}")

    def __reduce__(self):  # pickle's default calls the class with the message alone
        return type(self), (self.row, self.reason)


def _first(flags) -> int:
    """Index of the first true entry of a boolean pyarrow array (there is one)."""
    return int(np.flatnonzero(bits_to_numpy(flags))[0])


def _row_of(offsets: np.ndarray, position) -> int:
    return int(np.searchsorted(offsets, position, side="right") - 1)


def _list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column's flat values and int64 offsets, both from 0 (a sliced table's too);
    :class:`BridgeRowError` for a null row or value (NumPy would turn the values to floats)."""
    column = table.column(name)
    arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()  # one chunk: no copy
    if arr.null_count:
        raise BridgeRowError(_first(arr.is_null()), f"{name} is null")
    offsets = to_numpy(arr.offsets).astype(np.int64)
    start = int(offsets[0])
    values = arr.values.slice(start, int(offsets[-1]) - start)
    if start:
        offsets -= start
    if values.null_count:
        raise BridgeRowError(_row_of(offsets, _first(values.is_null())), f"{name} holds a null value")
    return to_numpy(values), offsets


def _check_lengths(cols: dict) -> None:
    """Every row of ``loss_mask`` has ``input_ids``' length (when the ids were read), of each
    packer column ``seq_start_id``'s."""
    for name, like, what in (("loss_mask", "input_ids", "values"),
                             *((col, "seq_start_id", "entries") for col in PACKER_COLUMNS)):
        if like not in cols:
            continue
        offsets, reference = cols[name][1], cols[like][1]
        if not np.array_equal(offsets, reference):  # both from 0, one entry a row more than rows
            n, m = np.diff(offsets), np.diff(reference)
            r = int(np.flatnonzero(n != m)[0])
            raise BridgeRowError(r, f"{name} has {n[r]} {what} but {like} has {m[r]}")


def _check_starts(starts: np.ndarray, seq_off: np.ndarray, row_len: np.ndarray) -> None:
    """Each row's ``seq_start_id`` is non-empty, starts at 0, increases and stays inside the row
    (so every sequence has a stored slot); :class:`BridgeRowError` names the first row that fails."""
    counts = np.diff(seq_off)
    if not counts.all():
        raise BridgeRowError(int(np.flatnonzero(counts == 0)[0]), "seq_start_id is empty (every row holds a sequence)")
    problems = []
    head = starts[seq_off[:-1]]
    if head.any():
        r = int(np.flatnonzero(head)[0])
        problems.append((r, f"seq_start_id starts at {head[r]}, not 0"))
    down = np.diff(starts) <= 0
    down[seq_off[1:-1] - 1] = False  # a row's first start after the previous row's last
    if down.any():
        j = int(np.flatnonzero(down)[0])
        r = _row_of(seq_off, j + 1)
        problems.append((r, f"seq_start_id is not increasing: {starts[j]} then {starts[j + 1]} at seq "
                            f"{j + 1 - seq_off[r]}"))
    tail = starts[seq_off[1:] - 1]
    beyond = tail >= row_len
    if beyond.any():
        r = int(np.flatnonzero(beyond)[0])
        problems.append((r, f"seq_start_id {tail[r]} at seq {counts[r] - 1} is beyond the row's {row_len[r]} "
                            f"stored slots"))
    if problems:
        raise BridgeRowError(*min(problems, key=lambda problem: problem[0]))


def _check_ids(ids: np.ndarray, row_off: np.ndarray) -> None:
    """int64 ids (packer 0.2.0's files) fit the native int32 tokens."""
    if ids.dtype != np.int32 and ids.size:
        wide = (ids < -2**31) | (ids >= 2**31)
        if wide.any():
            j = int(np.flatnonzero(wide)[0])
            raise BridgeRowError(_row_of(row_off, j), f"input_ids holds id {ids[j]}, beyond int32")


def _check_stored_padding(ids, loss, a, b, s, sound, eos, seq_off, row_of_seq) -> None:
    """Bridge's stored padding: its ``p - s`` slots after each sequence's last label hold the EOS id
    (0 without one) and the sequence's final slot has no loss. Bridge's loader feeds those slots to
    the model; the native columns hold ``pad_id`` there and drop the final slot, so the pack checks
    cannot see them. Sequences whose real length is not ``1 <= s <= p`` are left to ``pack.lengths``."""
    fill = 0 if eos is None else eos
    found = []
    final = loss[b - 1]
    if final.any():
        k = int(np.flatnonzero(final)[0])
        found.append((k, f"loss_mask is {final[k]} on the final stored slot, expected 0"))
    pads = np.where(sound, b - a - 1 - s, 0)
    total = int(pads.sum())
    if total:
        ends = np.cumsum(pads)
        slots = np.repeat(a + s + 1 - (ends - pads), pads) + np.arange(total)
        wrong = ids[slots] != fill
        if wrong.any():
            j = int(np.flatnonzero(wrong)[0])
            expected = f"the eos id {eos}" if eos is not None else "0 (the file records no eos id)"
            found.append((int(np.searchsorted(ends, j, side="right")),
                          f"input_ids holds {ids[slots[j]]} in the stored padding, expected {expected}"))
    if found:
        k, message = min(found, key=lambda problem: problem[0])
        r = int(row_of_seq[k])
        raise BridgeRowError(r, f"seq {k - seq_off[r]}: {message}")


def stored_columns(tokens: bool = True) -> list[str]:
    """The file's columns :func:`native_columns` reads: all, or all but the token ids."""
    return list(COLUMNS) if tokens else [name for name in COLUMNS if name != "input_ids"]


def native_columns(table: pa.Table, pad_id: int, *, check_padding: bool = False,
                   eos: int | None = None, tokens: bool = True,
                   compiled: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The native columns (``values``, int64 ``offsets``) of all packs in ``table``, vectorized.

    ``table`` holds Bridge rows with packer's columns (one decoded row group, say), of the types
    :func:`schema_problem` accepts. Sequence k spans stored ``[a_k, b_k)``; its runtime length is
    ``p_k = b_k - a_k - 1``. Rows that cannot be converted (nulls, per-row lengths that disagree,
    a damaged ``seq_start_id``) raise :class:`BridgeRowError` naming the first; a real length
    outside ``0..p`` is kept in ``seq_lens`` for the pack checks (``pack.lengths``) and clipped
    for the conversion. ``check_padding`` also checks the stored padding against ``eos``.

    ``tokens=False`` converts without the token ids (``table`` need not hold ``input_ids``: the
    rows' lengths come from ``loss_mask``), for readers that never look at them (``inspect``);
    the result has no ``tokens`` or ``last_token`` and the padding is not checked. Decoding the
    ids is most of the work of reading a Bridge file.

    ``compiled=True`` builds the token and loss-mask streams with a numba kernel that releases
    the GIL (:mod:`packer_cli.shards._bridge_kernels`): the audit's readers, which decode the
    next row groups on other threads and have numba loaded already. Without it (the torch
    dataset, whose workers never import numba) NumPy does the same copy.
    """
    cols = {name: _list_column(table, name) for name in stored_columns(tokens)}
    _check_lengths(cols)
    ids, row_off = cols["input_ids"] if tokens else (None, cols["loss_mask"][1])
    starts, seq_off = cols["seq_start_id"]
    starts = starts.astype(np.int64, copy=False)
    n_rows = row_off.size - 1
    _check_starts(starts, seq_off, np.diff(row_off))
    if tokens:
        _check_ids(ids, row_off)
    counts = np.diff(seq_off)
    row_of_seq = np.repeat(np.arange(n_rows), counts)
    first = seq_off[:-1]
    a = starts + row_off[:-1][row_of_seq]
    b = np.empty_like(a)
    b[:-1] = a[1:]
    b[first + counts - 1] = row_off[1:]                # a row's last sequence ends with the row
    p = b - a - 1                                      # >= 0: the starts increase inside their rows
    real = cols["packer_seq_lens"][0].astype(np.int64)
    within = (real >= 0) & (real <= p)
    s = real if within.all() else np.clip(real, 0, p)  # the pack checks report the real ones
    if check_padding and tokens:
        _check_stored_padding(ids, cols["loss_mask"][0], a, b, s, within & (real >= 1), eos, seq_off, row_of_seq)
    P = np.concatenate([[0], np.cumsum(p)])
    cu_off = first + np.arange(n_rows + 1)[:-1]
    cu_len = counts + 1
    cu_idx = np.arange(int(cu_len.sum())) - np.repeat(cu_off, cu_len) + np.repeat(first, cu_len)
    cu = (P[cu_idx] - np.repeat(P[first], cu_len)).astype(np.int32)
    per_seq = lambda name, dtype: (cols[name][0].astype(dtype), seq_off)  # noqa: E731
    token_offsets = P[seq_off]
    stored_mask = cols["loss_mask"][0]
    if tokens and compiled:
        from packer_cli.shards._bridge_kernels import runtime_streams

        runtime_ids, runtime_mask = runtime_streams(ids, stored_mask, a, p, s, pad_id)
    else:
        # The runtime stream is the stored one without each sequence's last slot (its last
        # label): a boolean compress, not a gather (no per-token index arrays).
        keep = np.ones(int(row_off[-1]), dtype=bool)
        keep[b - 1] = False
        runtime_mask = stored_mask[keep].view(np.uint8)
        runtime_ids = _runtime_tokens(ids, keep, P, p, s, pad_id) if tokens else None
    columns = {
        "loss_mask": (runtime_mask, token_offsets),
        "cu_seqlens": (cu, seq_off + np.arange(n_rows + 1)),
        "seq_lens": (real.astype(np.int32), seq_off),
        "source_index": per_seq("packer_source_index", np.int64),
        "source_offset": per_seq("packer_source_offset", np.int32),
    }
    if tokens:
        columns["tokens"] = (runtime_ids, token_offsets)
        columns["last_token"] = (ids[a + s].astype(np.int32), seq_off)
    return columns


def _runtime_tokens(ids, keep, P, p, s, pad_id) -> np.ndarray:
    """The native token stream: the stored ids without each sequence's last slot, pad_id on the
    alignment padding (stored as EOS) of each sequence (real length ``s``, runtime length ``p``,
    starting at ``P``)."""
    tokens = ids[keep].astype(np.int32, copy=False)
    pads = p - s
    if pads.any():
        first_pad = P[:-1] + s
        before = np.cumsum(pads) - pads
        tokens[np.repeat(first_pad - before, pads) + np.arange(int(pads.sum()))] = pad_id
    return tokens


class PagesDisagree(ValueError):
    """A column chunk whose page headers hold other than the values its footer entry states:
    ``reason`` says so, the message names its row group too."""

    def __init__(self, group: int, reason: str):
        super().__init__(f"row group {group}: {reason}")
        self.group, self.reason = group, reason


def unreadable_group(exc: Exception) -> str:
    """Why one row group could not be read, for a message that names the group itself."""
    return exc.reason if isinstance(exc, PagesDisagree) else first_line(exc)


def read_row_groups(path: str, pf: pq.ParquetFile, groups: range, columns: list[str]) -> pa.Table:
    """Row groups ``groups`` of ``columns`` of the Parquet file at ``path`` (open as ``pf``),
    decoded by pyarrow once :func:`check_pages` finds nothing."""
    check_pages(path, pf, groups, columns)
    return pf.read_row_groups(groups, columns=columns)


def check_pages(path: str, pf: pq.ParquetFile, groups: range, columns: list[str]) -> None:
    """:class:`PagesDisagree` naming the first row group of ``groups`` and column of ``columns``
    whose page headers hold other values than its footer entry states (:func:`pages_problem`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for g in groups:
            problem = pages_problem(fd, size, pf, g, columns)
            if problem:
                raise PagesDisagree(g, problem)
    finally:
        os.close(fd)


def pages_problem(fd: int, file_size: int, pf: pq.ParquetFile, group: int, columns: list[str]) -> str | None:
    """Why a column chunk of ``columns`` in row group ``group`` cannot be decoded as its footer
    entry states: its page headers hold another number of values. pyarrow decodes every value
    the pages hold, whatever the footer says (a 1.2 MB file, its footer agreeing with the
    manifest and its pages holding 200 times the values, took 0.8 GB to verify before its rows
    were found wrong). None where they agree, or where the headers cannot be walked (pyarrow's
    reading then reports the damage). In pure Python, ~15 us a column chunk of one page (a
    Bridge row group's are one page or a few): 0.09-0.17 ms a group of six, 5-10% of pyarrow's
    decoding of it, which :class:`BridgeReader` pays once a group."""
    group_meta = pf.metadata.row_group(group)
    leaves = {pf.schema.column(i).path.split(".")[0]: i for i in range(group_meta.num_columns)}
    for name in columns:
        if name not in leaves:
            continue
        chunk = group_meta.column(leaves[name])
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
            start = chunk.dictionary_page_offset
        end = start + chunk.total_compressed_size
        if not 0 <= start <= end <= file_size:
            return None
        try:
            paged = data_page_levels(fd, start, end)
        except ThriftError:
            return None
        if paged != chunk.num_values:
            return (f"column {name!r}: its footer entry states {counted(chunk.num_values, 'value')}, "
                    f"its pages' headers {paged:,}")
    return None


class _Group:
    """One decoded row group as native columns; :meth:`row` slices one pack out of them."""

    def __init__(self, table: pa.Table, pad_id: int):
        self.columns = native_columns(table, pad_id)

    def row(self, i: int) -> PackRow:
        return PackRow(**{name: values[offsets[i]:offsets[i + 1]]
                          for name, (values, offsets) in self.columns.items()})


class BridgeReader(PackedReader):
    """Random access to the packs of one split of a Bridge layout, as native rows."""

    def __init__(self, out_dir, split: str | None = None, *, check: bool = True):
        self.out_dir = out_dir = os.fspath(out_dir)
        self.split = resolve_split(out_dir, split)
        self.metadata = load_bridge_metadata(out_dir, self.split)
        if check:
            check_layout_for_reading(out_dir, self.split)
        self.manifest = read_split_manifest(out_dir, self.split)
        self._pad_id = pad_id_of(self.metadata)
        self._groups: list[tuple[pq.ParquetFile, int]] = []
        self._paths: list[str] = []
        starts = [0]
        for entry in self.manifest["shards"]:
            path = os.path.join(out_dir, entry["name"])
            try:
                pf = pq.ParquetFile(path, memory_map=True)
            except (OSError, pa.ArrowException) as exc:
                raise DataError(f"{path}: cannot open Parquet file ({first_line(exc)})") from None
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}: cannot open Parquet file ({footer_name_problem(exc)})") from None
            problem = schema_problem(pf.schema_arrow, self.metadata, split_metadata_name(self.split))
            if problem:
                raise DataError(f"{path}: {problem} (not written by packer --format megatron-bridge)")
            problem = row_count_problem(pf)
            if problem:
                raise DataError(f"{path}: {problem}")
            first = starts[-1]
            for g in range(pf.num_row_groups):
                self._groups.append((pf, g))
                self._paths.append(path)
                starts.append(starts[-1] + pf.metadata.row_group(g).num_rows)
            check_recorded_rows(path, starts[-1] - first, entry, "the split's manifest")
        self._starts = np.asarray(starts, dtype=np.int64)
        self._cached: tuple[int, _Group] | None = None
        self._pages_checked = np.zeros(len(self._groups), dtype=bool)

    def _group(self, g: int) -> _Group:
        if self._cached is None or self._cached[0] != g:
            pf, index = self._groups[g]
            try:
                if not self._pages_checked[g]:  # once a group: a shuffled read decodes one many times
                    check_pages(self._paths[g], pf, range(index, index + 1), stored_columns())
                    self._pages_checked[g] = True
                table = pf.read_row_group(index, columns=stored_columns())
            except (OSError, pa.ArrowException, PagesDisagree) as exc:
                raise DataError(f"{self._paths[g]}: cannot read row group {index} ({unreadable_group(exc)}); "
                                f"run `packer verify` for a full report") from None
            try:
                group = _Group(table, self._pad_id)
            except BridgeRowError as exc:
                raise DataError(f"{self._paths[g]}: pack {int(self._starts[g]) + exc.row}: {exc.reason} (row group "
                                f"{index}); run `packer verify` for a full report") from None
            except (ValueError, IndexError) as exc:
                raise DataError(f"{self._paths[g]}: row group {index} is malformed ({first_line(exc)}); "
                                f"run `packer verify` for a full report") from None
            self._cached = (g, group)
        return self._cached[1]

    def row(self, i: int) -> PackRow:
        if not -len(self) <= i < len(self):
            raise IndexError(f"pack {i} out of range for {counted(len(self), 'pack')}")
        i %= len(self)
        g = int(np.searchsorted(self._starts, i, side="right") - 1)
        return self._group(g).row(i - int(self._starts[g]))


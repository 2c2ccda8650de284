"""Validate one batch of records and normalize it to flat token / target arrays.

Every reader hands a :class:`pyarrow.RecordBatch` to :func:`normalize_batch`. It checks every
record with vectorized NumPy (no per-token Python), and returns a :class:`SampleBatch`:

* ``tokens``  — int32, all kept samples' token ids concatenated;
* ``targets`` — uint8, input-aligned: 1 where that token is a training target;
* ``lengths`` — int64 tokens per kept sample; ``source_index`` — int64 stream position.

Supervision comes from one of (detected from the field names, or forced):

==================  ===========================================================
``loss_mask``       input-aligned 0/1, 1 = this token is a target
``labels``          HF style, unshifted: -100 = ignored, otherwise the token id
``answer_start_idx`` targets from that index on
(none)              every token is a target
==================  ===========================================================

Bad records (null/missing field, non-integer or negative ids, ids ≥ vocab size, a mask whose
length differs from the tokens, ...) are reported as :class:`BadRecord` with the file and the
row (or JSONL line); samples with fewer than 2 tokens are dropped and counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from packer_cli._arrow import to_numpy
from packer_cli.errors import BadRecord, ConfigError, DataError
from packer_cli.spec import SourceSpec

INT32_MAX = 2**31 - 1
INT64_MAX = np.uint64(2**63 - 1)
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Supervision:
    """Where the training targets come from: kind ∈ {mask, labels, answer, all}."""

    kind: str
    field: str | None = None

    def describe(self) -> str:
        return "every token" if self.kind == "all" else f"{self.kind} field '{self.field}'"


#: The fields detected as supervision, in order of preference (a mask, labels, an answer start).
SUPERVISION_FIELDS = ("loss_mask", "labels", "answer_start_idx")


def detect_supervision(names: list[str], spec: SourceSpec) -> Supervision:
    """Pick the supervision source from the available field names (or the forced one)."""
    sup = _pick_supervision(names, spec)
    if sup.field is not None and sup.field == spec.tokens_field:  # one column read twice would mean no supervision
        if spec.mask_field or spec.labels_field:
            option = "--mask-field" if spec.mask_field else "--labels-field"
            fix = f"{option} must name another column"
        else:
            option = "auto-detected"
            fix = "name the supervision column with --mask-field or --labels-field"
        raise ConfigError(f"field '{sup.field}' is the tokens field (--tokens-field) and cannot also be "
                          f"the {sup.kind} field ({option}); {fix}")
    return sup


def _pick_supervision(names: list[str], spec: SourceSpec) -> Supervision:
    if spec.mask_field:
        return Supervision("mask", spec.mask_field)
    if spec.labels_field:
        return Supervision("labels", spec.labels_field)
    for kind, name in zip(("mask", "labels", "answer"), SUPERVISION_FIELDS):
        if name in names:
            return Supervision(kind, name)
    return Supervision("all")


@dataclass
class SampleBatch:
    """Normalized, validated samples of one record batch."""

    tokens: np.ndarray
    targets: np.ndarray
    lengths: np.ndarray
    source_index: np.ndarray
    records: int = 0
    too_short: int = 0
    no_targets: int = 0
    bad: list[BadRecord] = field(default_factory=list)
    max_token: int | None = None  # the largest id when validation found it (an upper bound once rows are dropped)


#: What pyarrow raises handing an array of a type it cannot wrap for Python to it
#: (``month_interval``: ``KeyError``), as a column or as a list's values.
_UNWRAPPABLE = (KeyError, NotImplementedError, pa.ArrowNotImplementedError)


def _is_list(t: pa.DataType) -> bool:
    """A variable-size list (``list`` or ``large_list``)."""
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _list_parts(arr: pa.Array, name: str, path: str, row0: int):
    """Flat values and rebased int64 offsets of a list column; rejects non-list types.

    A column of type null (no record of the batch has the field, e.g. every JSONL line is
    malformed) reads as empty lists: the callers have already marked each row bad, so each is
    reported with its own reason and line, or skipped, like any other bad record.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not _is_list(arr.type):
        if pa.types.is_fixed_size_list(arr.type):
            arr = arr.cast(pa.list_(arr.type.value_type))
        elif pa.types.is_null(arr.type):
            arr = pa.nulls(len(arr), pa.list_(pa.int64()))
        else:
            raise DataError(f"{path}: row {row0}: field '{name}' has type {arr.type}, expected a list of integers")
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    try:
        values = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
    except _UNWRAPPABLE:  # month_interval values
        raise DataError(f"{path}: row {row0}: field '{name}' has type {arr.type}, expected a list of integers") from None
    return values, offsets - offsets[0]


def _row_of(offsets: np.ndarray, flat_index: np.ndarray) -> np.ndarray:
    return np.searchsorted(offsets, flat_index, side="right") - 1


def _first_per_row(bad: dict, offsets, violating: np.ndarray, message) -> None:
    """Record, for each row with a violating value, a message about its first one."""
    idx = np.flatnonzero(violating)
    if idx.size == 0:
        return
    rows = _row_of(offsets, idx)
    rows_unique, first = np.unique(rows, return_index=True)
    for row, flat in zip(rows_unique.tolist(), idx[first].tolist()):
        bad.setdefault(row, message(flat - offsets[row], flat))


def _int_values(values: pa.Array, name: str, path: str, row0: int, offsets, bad: dict,
                allow_bool: bool = False) -> np.ndarray:
    if pa.types.is_null(values.type):  # JSON lists that are all empty or all null in this batch
        values = pa.nulls(len(values), pa.int64())
    elif allow_bool and pa.types.is_boolean(values.type):
        values = values.cast(pa.int8())  # before fill_null: a boolean array takes no integer fill
    if not pa.types.is_integer(values.type):
        raise DataError(
            f"{path}: row {row0 + int(_row_of(offsets, np.array([0]))[0])}: field '{name}' holds "
            f"{values.type} values, expected integers"
        )
    if values.null_count:
        nulls = np.asarray(values.is_null().to_numpy(zero_copy_only=False))
        _first_per_row(bad, offsets, nulls, lambda j, _: f"{name}[{j}] is null")
        values = values.fill_null(0)
    array = np.asarray(values.to_numpy(zero_copy_only=False))
    if array.dtype == np.uint64:  # values past int64 would wrap to negatives that are not in the file
        beyond = array > INT64_MAX
        if beyond.any():
            _first_per_row(bad, offsets, beyond, lambda j, flat: f"{name}[{j}] = {array[flat]} is out of range")
            array = np.where(beyond, 0, array)
    return array.astype(np.int64, copy=False)


def _null_rows(arr, name: str, bad: dict) -> None:
    if arr.null_count:
        for row in np.flatnonzero(np.asarray(arr.is_null().to_numpy(zero_copy_only=False))).tolist():
            bad.setdefault(int(row), f"field '{name}' is null")


def _targets(batch: pa.RecordBatch, sup: Supervision, tokens, offsets, lengths, path, row0, bad, name):
    """Input-aligned uint8 target flags, same length as ``tokens``."""
    if sup.kind == "all":
        return np.ones(tokens.size, dtype=np.uint8)
    if sup.field not in batch.schema.names:
        raise DataError(f"{path}: row {row0}: missing field '{sup.field}' (fields: {', '.join(batch.schema.names)})")
    col = readable_column(batch, sup.field, path, row0)
    _null_rows(col, sup.field, bad)
    if sup.kind == "answer":
        if pa.types.is_null(col.type):  # no record of the batch has it: each row is already marked bad
            col = pa.nulls(len(col), pa.int64())
        if not pa.types.is_integer(col.type):
            raise DataError(f"{path}: row {row0}: field '{sup.field}' has type {col.type}, expected an integer")
        stored = np.asarray(col.fill_null(0).to_numpy(zero_copy_only=False))
        # uint64 starts past int64 are clamped (still past every length), not wrapped to negatives
        start = (np.minimum(stored, INT64_MAX) if stored.dtype == np.uint64 else stored).astype(np.int64)
        for row in np.flatnonzero((start < 0) | (start > lengths)).tolist():
            bad.setdefault(row, f"{sup.field} = {stored[row]} is outside [0, {lengths[row]}]")
        position = np.arange(tokens.size, dtype=np.int64) - np.repeat(offsets[:-1], lengths)
        return (position >= np.repeat(start, lengths)).astype(np.uint8)
    values, m_offsets = _list_parts(col, sup.field, path, row0)
    m_lengths = np.diff(m_offsets)
    mismatch = np.flatnonzero(m_lengths != lengths)
    for row in mismatch.tolist():
        bad.setdefault(row, f"{sup.field} has {m_lengths[row]} values but {name} has {lengths[row]}")
    if mismatch.size:  # drop the ragged rows' values so the checks below stay vectorized
        same = m_lengths == lengths
        values = values.filter(pa.array(np.repeat(same, m_lengths)))
        m_offsets = np.concatenate([[0], np.cumsum(np.where(same, lengths, 0))])
    mask = _int_values(values, sup.field, path, row0, m_offsets, bad, allow_bool=sup.kind == "mask")
    if mismatch.size:
        full = np.zeros(tokens.size, dtype=np.int64)
        full[np.repeat(same, lengths)] = mask
        mask = full
    if sup.kind == "mask":
        _first_per_row(bad, offsets, (mask != 0) & (mask != 1),
                       lambda j, flat: f"{sup.field}[{j}] = {mask[flat]} is not 0 or 1")
        return mask.astype(np.uint8)
    _first_per_row(
        bad, offsets, (mask != IGNORE_INDEX) & (mask != tokens),
        lambda j, flat: f"{sup.field}[{j}] = {mask[flat]} is neither -100 nor the token id {tokens[flat]}",
    )
    return (mask != IGNORE_INDEX).astype(np.uint8)


#: Integer value types the compiled fast path reads directly (bool and uint64 take the full path).
_FAST_INTS = frozenset(
    pa.from_numpy_dtype(np.dtype(t)) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")
)


def _clean_list(arr):
    """(values as NumPy, rebased offsets) of a null-free list column of fast-path integers, else None."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not _is_list(arr.type) or arr.null_count:
        return None
    if arr.type.value_type not in _FAST_INTS:
        return None
    offsets = to_numpy(arr.offsets)
    if offsets.size == 0:
        return None
    values = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
    if values.null_count:
        return None
    return to_numpy(values), offsets - offsets[0]


def _fast_batch(batch: pa.RecordBatch, name: str, sup: Supervision, spec: SourceSpec, index0: int):
    """The batch's :class:`SampleBatch` when every record is good, checked in one compiled pass.

    Returns None whenever anything is unusual (a bad record, nulls, an unexpected type, a missing
    field); :func:`normalize_batch` then runs the vectorized checks that word each problem.
    """
    from packer_cli.sources import _kernels

    names = batch.schema.names
    if name not in names or (sup.field and sup.field not in names) or not _fast_types(batch.schema, name, sup):
        return None
    parts = _clean_list(batch.column(name))
    if parts is None:
        return None
    values, offsets = parts
    limit = INT32_MAX + 1 if spec.vocab_size is None else min(spec.vocab_size, INT32_MAX + 1)
    in_range, max_token = _kernels.tokens_in_range(values, limit)
    if not in_range:
        return None
    tokens = values.astype(np.int32, copy=False)
    lengths = np.diff(offsets).astype(np.int64, copy=False)
    if sup.kind == "all":
        targets = np.ones(tokens.size, dtype=np.uint8)
    elif sup.kind == "answer":
        col = batch.column(sup.field)
        if not pa.types.is_integer(col.type) or col.null_count:
            return None
        start = to_numpy(col).astype(np.int64)
        if ((start < 0) | (start > lengths)).any():
            return None
        targets = np.empty(tokens.size, dtype=np.uint8)
        _kernels.answer_targets(offsets, start, targets)
    else:
        sup_parts = _clean_list(batch.column(sup.field))
        if sup_parts is None or not np.array_equal(sup_parts[1], offsets):
            return None
        mask = sup_parts[0]
        if sup.kind == "mask":
            if not _kernels.mask_is_binary(mask):
                return None
            targets = mask.astype(np.uint8, copy=False)
        else:
            targets = np.empty(tokens.size, dtype=np.uint8)
            if not _kernels.labels_to_targets(mask, tokens, targets):
                return None
    n_rows = batch.num_rows
    out = SampleBatch(tokens=tokens, targets=targets, lengths=lengths, max_token=int(max_token),
                      source_index=np.arange(index0, index0 + n_rows, dtype=np.int64), records=n_rows)
    keep = lengths >= 2
    if not keep.all():
        out.too_short = int(n_rows - keep.sum())
        token_keep = np.repeat(keep, lengths)
        out.tokens, out.targets = tokens[token_keep], targets[token_keep]
        out.lengths, out.source_index = lengths[keep], out.source_index[keep]
    return out


def readable_column(batch: pa.RecordBatch, name: str, path: str, row0: int):
    """The batch's column ``name``; :class:`DataError` for a type pyarrow cannot hand to Python
    (``month_interval``: its ``column()`` raises ``KeyError``)."""
    try:
        return batch.column(name)
    except _UNWRAPPABLE:
        raise DataError(f"{path}: row {row0}: field '{name}' has type {batch.schema.field(name).type}, "
                        "which packer does not read") from None


def _fast_types(schema: pa.Schema, name: str, sup: Supervision) -> bool:
    """Whether the fields the fast path reads have the types it takes (checked on the schema:
    a column of a type pyarrow cannot hand to Python must not be touched there)."""
    if not _is_list(schema.field(name).type):
        return False
    if sup.kind == "all":
        return True
    t = schema.field(sup.field).type
    return pa.types.is_integer(t) if sup.kind == "answer" else _is_list(t)


def normalize_batch(
    batch: pa.RecordBatch,
    *,
    path: str,
    row0: int,
    index0: int,
    sup: Supervision,
    spec: SourceSpec,
    lines: np.ndarray | None = None,
    pre_bad: dict[int, str] | None = None,
) -> SampleBatch:
    """Validate and flatten one batch; rows are numbered from ``row0`` within ``path``.

    ``index0`` is the stream position (source index) of the batch's first record. Bad records
    raise :class:`BadRecord` (the first in file order) unless ``spec.on_bad_record`` is skip.
    A batch whose records are all good takes a compiled one-pass path with the same result.
    """
    name = spec.tokens_field
    if not pre_bad:
        fast = _fast_batch(batch, name, sup, spec, index0)
        if fast is not None:
            return fast
    n_rows = batch.num_rows
    bad: dict[int, str] = dict(pre_bad or {})
    if name not in batch.schema.names:
        raise DataError(f"{path}: row {row0}: missing field '{name}' (fields: {', '.join(batch.schema.names) or 'none'})")
    col = readable_column(batch, name, path, row0)
    _null_rows(col, name, bad)
    values, offsets = _list_parts(col, name, path, row0)
    tokens = _int_values(values, name, path, row0, offsets, bad)
    lengths = np.diff(offsets)
    _first_per_row(bad, offsets, tokens < 0, lambda j, flat: f"{name}[{j}] = {tokens[flat]} is negative")
    if spec.vocab_size is not None:
        _first_per_row(bad, offsets, tokens >= spec.vocab_size,
                       lambda j, flat: f"{name}[{j}] = {tokens[flat]} is >= vocab size {spec.vocab_size}")
    _first_per_row(bad, offsets, tokens > INT32_MAX,
                   lambda j, flat: f"{name}[{j}] = {tokens[flat]} does not fit in int32")
    targets = _targets(batch, sup, tokens, offsets, lengths, path, row0, bad, name)

    def located(row: int) -> BadRecord:
        line = int(lines[row]) if lines is not None else None
        return BadRecord(path, row0 + row, bad[row], line=line)

    bad_list = [located(row) for row in sorted(bad)]
    if bad_list and spec.on_bad_record.value == "error":
        raise bad_list[0]
    keep = np.ones(n_rows, dtype=bool)
    if bad:
        keep[list(bad)] = False
    too_short = keep & (lengths < 2)
    keep &= ~too_short
    out = SampleBatch(
        tokens=tokens.astype(np.int32),
        targets=targets,
        lengths=lengths.astype(np.int64),
        source_index=np.arange(index0, index0 + n_rows, dtype=np.int64),
        records=n_rows,
        too_short=int(too_short.sum()),
        bad=bad_list,
    )
    if not keep.all():
        token_keep = np.repeat(keep, lengths)
        out.tokens, out.targets = out.tokens[token_keep], out.targets[token_keep]
        out.lengths, out.source_index = out.lengths[keep], out.source_index[keep]
    return out

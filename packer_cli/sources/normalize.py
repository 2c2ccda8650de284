"""Validate one batch of records and normalize it to flat token / target arrays.

Every reader hands a :class:`pyarrow.RecordBatch` to :func:`normalize_batch`. It checks every
record with vectorized NumPy (no per-token Python), and returns a :class:`SampleBatch`:

* ``tokens``  — int32, all kept samples' token ids concatenated;
* ``targets`` — uint8, input-aligned: 1 where that token is a training target;
* ``lengths`` — int64 tokens per kept sample; ``source_index`` — int64 stream position.

Supervision comes from one of (detected from the field names, or forced):

======================  =======================================================
``loss_mask``           input-aligned 0/1, 1 = this token is a target (also TRL's
                        ``completion_mask`` and ``assistant_masks``: both, when a record
                        has both, a target where both are 1, as TRL applies them)
``labels``              HF style, unshifted: -100 = ignored, otherwise the token id
``answer_start_idx``    targets from that index on
(none)                  every token is a target
======================  =======================================================

A record may also mark its padding: an ``attention_mask`` (``SourceSpec.attention_field``)
is read when the first record has one, and a sample's 0s before and after its 1s are dropped
(HF's right or left padding), after the targets are taken from the full row.

Bad records (null/missing field, non-integer or negative ids, ids ≥ vocab size, a mask whose
length differs from the tokens, ...) are reported as :class:`BadRecord` with the file and the
row (or JSONL line); samples with fewer than 2 tokens are dropped and counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import field as dataclass_field

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
    also: tuple[str, ...] = ()
    """Further mask fields (kind mask): a token is a target only where ``field`` and each of these are 1."""
    ignored: tuple[str, ...] = dataclass_field(default=(), compare=False)
    """Other supervision fields the first record has, which this one outranks (not read)."""

    @property
    def fields(self) -> tuple[str, ...]:
        """Every field the targets are read from."""
        return (self.field, *self.also) if self.field else ()

    def describe(self) -> str:
        if self.kind == "all":
            return "every token"
        if self.also:
            return "mask fields " + " and ".join(f"'{name}'" for name in self.fields)
        return f"{self.kind} field '{self.field}'"


#: The fields detected as supervision, in order of preference, with their kind: a loss mask
#: (packer's and Megatron-Bridge's name, then TRL's masks of the completion and of the
#: assistant's turns), HF labels, an answer start.
SUPERVISION_KIND = {"loss_mask": "mask", "completion_mask": "mask", "assistant_masks": "mask",
                    "labels": "labels", "answer_start_idx": "answer"}
SUPERVISION_FIELDS = tuple(SUPERVISION_KIND)
#: TRL's masks, which its trainer applies together (a token is trained where both are 1): a
#: conversational prompt-completion dataset tokenized with ``assistant_only_loss`` has both.
TRL_MASKS = ("completion_mask", "assistant_masks")


def detect_supervision(names: list[str], spec: SourceSpec) -> Supervision:
    """Pick the supervision source from the available field names (or the forced one)."""
    sup = _pick_supervision(names, spec)
    if spec.tokens_field in sup.fields:  # one column read twice would mean no supervision
        if spec.mask_field or spec.labels_field:
            option = "--mask-field" if spec.mask_field else "--labels-field"
            fix = f"{option} must name another column"
        else:
            option = "auto-detected"
            fix = "name the supervision column with --mask-field or --labels-field"
        raise ConfigError(f"field '{spec.tokens_field}' is the tokens field (--tokens-field) and cannot also be "
                          f"the {sup.kind} field ({option}); {fix}")
    return sup


def _pick_supervision(names: list[str], spec: SourceSpec) -> Supervision:
    if spec.mask_field:
        return Supervision("mask", spec.mask_field, also=spec.also_mask_fields)
    if spec.labels_field:
        return Supervision("labels", spec.labels_field)
    if spec.all_targets:
        return Supervision("all")
    present = [name for name in SUPERVISION_FIELDS if name in names]
    if not present:
        return Supervision("all")
    if tuple(present[:2]) == TRL_MASKS:
        return Supervision("mask", TRL_MASKS[0], also=TRL_MASKS[1:], ignored=tuple(present[2:]))
    return Supervision(SUPERVISION_KIND[present[0]], present[0], ignored=tuple(present[1:]))


def detect_attention(names: list[str], spec: SourceSpec, sup: Supervision) -> str | None:
    """The padding mask field to read: ``spec.attention_field`` when the first record has it and
    it is neither the tokens nor the supervision field."""
    name = spec.attention_field
    return name if name and name in names and name not in (spec.tokens_field, *sup.fields) else None


@dataclass
class SampleBatch:
    """Normalized, validated samples of one record batch."""

    tokens: np.ndarray
    targets: np.ndarray
    lengths: np.ndarray
    source_index: np.ndarray
    records: int = 0
    too_short: int = 0
    padding: int = 0  # tokens of the good records dropped as padding (the attention mask's 0s)
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
    if sup.also:
        return _all_masks(batch, sup, tokens, offsets, lengths, path, row0, bad, name)
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
    mask = _aligned_values(col, sup.field, tokens.size, lengths, path, row0, bad, name, flags=sup.kind == "mask")
    if sup.kind == "mask":
        _check_binary(mask, sup.field, offsets, bad)
        return mask.astype(np.uint8)
    _first_per_row(
        bad, offsets, (mask != IGNORE_INDEX) & (mask != tokens),
        lambda j, flat: f"{sup.field}[{j}] = {mask[flat]} is neither -100 nor the token id {tokens[flat]}",
    )
    return (mask != IGNORE_INDEX).astype(np.uint8)


def _all_masks(batch: pa.RecordBatch, sup: Supervision, tokens, offsets, lengths, path, row0, bad, name):
    """Targets where every one of ``sup``'s masks is 1, each mask checked as a lone one is."""
    targets = np.ones(tokens.size, dtype=np.uint8)
    for field_name in sup.fields:
        targets &= _targets(batch, Supervision("mask", field_name), tokens, offsets, lengths, path, row0, bad, name)
    return targets


def _aligned_values(col, field_name: str, n_tokens: int, lengths, path, row0, bad, name, flags: bool) -> np.ndarray:
    """int64 values of list column ``col``, one for each token (0 in a row whose list has
    another length than its tokens, marked bad); ``flags``: booleans read as 1/0."""
    values, m_offsets = _list_parts(col, field_name, path, row0)
    m_lengths = np.diff(m_offsets)
    mismatch = np.flatnonzero(m_lengths != lengths)
    for row in mismatch.tolist():
        bad.setdefault(row, f"{field_name} has {m_lengths[row]} values but {name} has {lengths[row]}")
    if mismatch.size:  # drop the ragged rows' values so the checks below stay vectorized
        same = m_lengths == lengths
        values = values.filter(pa.array(np.repeat(same, m_lengths)))
        m_offsets = np.concatenate([[0], np.cumsum(np.where(same, lengths, 0))])
    aligned = _int_values(values, field_name, path, row0, m_offsets, bad, allow_bool=flags)
    if mismatch.size:
        full = np.zeros(n_tokens, dtype=np.int64)
        full[np.repeat(same, lengths)] = aligned
        aligned = full
    return aligned


def _check_binary(mask: np.ndarray, field_name: str, offsets, bad: dict) -> None:
    _first_per_row(bad, offsets, (mask != 0) & (mask != 1),
                   lambda j, flat: f"{field_name}[{j}] = {mask[flat]} is not 0 or 1")


def _real_tokens(batch: pa.RecordBatch, attention: str, tokens, offsets, lengths, path, row0, bad, name):
    """(which tokens are real, per row the count of them) from the padding mask ``attention``:
    a row's 0s before its first 1 and after its last are padding; a 0 between two 1s makes the
    row bad (packer does not join the pieces of a sample)."""
    if attention not in batch.schema.names:
        raise DataError(f"{path}: row {row0}: missing field '{attention}' (fields: {', '.join(batch.schema.names)})")
    col = readable_column(batch, attention, path, row0)
    _null_rows(col, attention, bad)
    mask = _aligned_values(col, attention, tokens.size, lengths, path, row0, bad, name, flags=True)
    _check_binary(mask, attention, offsets, bad)
    first, last, _, _ = _spans(mask, offsets)
    row_of_token = np.repeat(np.arange(lengths.size), lengths)
    position = np.arange(tokens.size, dtype=np.int64)
    hole = (mask == 0) & (position > first[row_of_token]) & (position < last[row_of_token])
    _first_per_row(bad, offsets, hole, lambda j, _: f"{attention}[{j}] = 0 lies between 1s (only the padding "
                   "before or after a sample is dropped)")
    real = mask != 0
    before = np.concatenate(([0], np.cumsum(real, dtype=np.int64)))  # real tokens before each position
    return real, before[offsets[1:]] - before[offsets[:-1]]


def _spans(mask: np.ndarray, offsets: np.ndarray):
    """Each row's first and last flat position of a nonzero mask value (-1 for none), the
    mask's 0s and the rows with a 0 between two 1s."""
    from packer_cli.sources import _kernels

    first = np.empty(offsets.size - 1, dtype=np.int64)
    last = np.empty(offsets.size - 1, dtype=np.int64)
    zeros, holes = _kernels.real_spans(mask, offsets, first, last)
    return first, last, zeros, holes


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


def _fast_batch(batch: pa.RecordBatch, name: str, sup: Supervision, spec: SourceSpec, index0: int,
                attention: str | None = None):
    """The batch's :class:`SampleBatch` when every record is good, checked in one compiled pass.

    Returns None whenever anything is unusual (a bad record, nulls, an unexpected type, a missing
    field); :func:`normalize_batch` then runs the vectorized checks that word each problem.
    """
    from packer_cli.sources import _kernels

    names = batch.schema.names
    if name not in names or any(f not in names for f in sup.fields) or not _fast_types(batch.schema, name, sup):
        return None
    if attention and (attention not in names or not _is_list(batch.schema.field(attention).type)):
        return None
    parts = _clean_list(batch.column(name))
    if parts is None:
        return None
    values, offsets = parts
    lengths = np.diff(offsets).astype(np.int64, copy=False)
    targets = _fast_targets(batch, sup, values, offsets, lengths)  # from the stored rows, padding and all
    if targets is None:
        return None
    padding = 0
    if attention:
        found = _fast_padding(batch.column(attention), offsets)
        if found is None:
            return None
        real, lengths, padding = found
        if padding:  # HF's padding="max_length": the copies are paid only where there is padding
            values, targets = values[real], targets[real]
    limit = INT32_MAX + 1 if spec.vocab_size is None else min(spec.vocab_size, INT32_MAX + 1)
    in_range, max_token = _kernels.tokens_in_range(values, limit)  # padding dropped is not checked: never packed
    if not in_range:
        return None
    tokens = values.astype(np.int32, copy=False)
    n_rows = batch.num_rows
    out = SampleBatch(tokens=tokens, targets=targets, lengths=lengths, max_token=int(max_token), padding=padding,
                      source_index=np.arange(index0, index0 + n_rows, dtype=np.int64), records=n_rows)
    keep = lengths >= 2
    if not keep.all():
        out.too_short = int(n_rows - keep.sum())
        token_keep = np.repeat(keep, lengths)
        out.tokens, out.targets = tokens[token_keep], targets[token_keep]
        out.lengths, out.source_index = lengths[keep], out.source_index[keep]
    return out


def _fast_targets(batch: pa.RecordBatch, sup: Supervision, values, offsets, lengths):
    """uint8 target flags of the stored tokens ``values``, or None for anything unusual."""
    from packer_cli.sources import _kernels

    if sup.kind == "all":
        return np.ones(values.size, dtype=np.uint8)
    if sup.kind == "answer":
        col = batch.column(sup.field)
        if not pa.types.is_integer(col.type) or col.null_count:
            return None
        start = to_numpy(col).astype(np.int64)
        if ((start < 0) | (start > lengths)).any():
            return None
        targets = np.empty(values.size, dtype=np.uint8)
        _kernels.answer_targets(offsets, start, targets)
        return targets
    if sup.kind == "mask":  # with the masks applied with it: a target where every one is 1
        masks = [_binary_mask(batch.column(name), offsets) for name in sup.fields]
        if any(mask is None for mask in masks):
            return None
        targets = masks[0].astype(np.uint8, copy=False)
        for mask in masks[1:]:
            targets = targets & mask.astype(np.uint8, copy=False)
        return targets
    sup_parts = _clean_list(batch.column(sup.field))
    if sup_parts is None or not np.array_equal(sup_parts[1], offsets):
        return None
    targets = np.empty(values.size, dtype=np.uint8)
    return targets if _kernels.labels_to_targets(sup_parts[0], values, targets) else None


def _binary_mask(column, offsets):
    """The flat values of a 0/1 list ``column`` whose rows line up with ``offsets``; None for
    anything the full path must word (nulls, another row length, a value not 0 or 1)."""
    from packer_cli.sources import _kernels

    parts = _clean_list(column)
    if parts is None or not np.array_equal(parts[1], offsets) or not _kernels.mask_is_binary(parts[0]):
        return None
    return parts[0]


def _fast_padding(column, offsets):
    """(which tokens are real, each row's length without its padding, the padding's tokens) by
    the attention mask ``column``; None for anything the full path must word (a hole, a value
    not 0 or 1)."""
    mask = _binary_mask(column, offsets)
    if mask is None:
        return None
    first, last, zeros, holes = _spans(mask, offsets)
    if holes:
        return None
    return mask != 0 if zeros else None, np.where(first >= 0, last - first + 1, 0), int(zeros)


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
    return pa.types.is_integer(t) if sup.kind == "answer" else all(_is_list(schema.field(f).type) for f in sup.fields)


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
    attention: str | None = None,
) -> SampleBatch:
    """Validate and flatten one batch; rows are numbered from ``row0`` within ``path``.

    ``index0`` is the stream position (source index) of the batch's first record; ``attention``
    the padding mask field to drop each sample's padding by, if any. Bad records
    raise :class:`BadRecord` (the first in file order) unless ``spec.on_bad_record`` is skip.
    A batch whose records are all good takes a compiled one-pass path with the same result.
    """
    name = spec.tokens_field
    if not pre_bad:
        fast = _fast_batch(batch, name, sup, spec, index0, attention)
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
    lengths = stored_lengths = np.diff(offsets)
    padding_bad: dict[int, str] = {}  # reported after the ids' and the supervision's problems
    real = (_real_tokens(batch, attention, tokens, offsets, lengths, path, row0, padding_bad, name)
            if attention else None)
    packed = True if real is None else real[0]  # padding is dropped, not packed: its ids are not checked
    _first_per_row(bad, offsets, (tokens < 0) & packed, lambda j, flat: f"{name}[{j}] = {tokens[flat]} is negative")
    if spec.vocab_size is not None:
        _first_per_row(bad, offsets, (tokens >= spec.vocab_size) & packed,
                       lambda j, flat: f"{name}[{j}] = {tokens[flat]} is >= vocab size {spec.vocab_size}")
    _first_per_row(bad, offsets, (tokens > INT32_MAX) & packed,
                   lambda j, flat: f"{name}[{j}] = {tokens[flat]} does not fit in int32")
    targets = _targets(batch, sup, tokens, offsets, lengths, path, row0, bad, name)  # of the stored rows
    for row, reason in padding_bad.items():
        bad.setdefault(row, reason)
    if real is not None:
        tokens, targets, lengths = tokens[real[0]], targets[real[0]], real[1]

    def located(row: int) -> BadRecord:
        line = int(lines[row]) if lines is not None else None
        return BadRecord(path, row0 + row, bad[row], line=line)

    bad_list = [located(row) for row in sorted(bad)]
    if bad_list and spec.on_bad_record.value == "error":
        raise bad_list[0]
    keep = np.ones(n_rows, dtype=bool)
    if bad:
        keep[list(bad)] = False
    padding = int((stored_lengths - lengths)[keep].sum())  # of the good records, short ones too
    too_short = keep & (lengths < 2)
    keep &= ~too_short
    out = SampleBatch(
        tokens=tokens.astype(np.int32),
        targets=targets,
        lengths=lengths.astype(np.int64),
        source_index=np.arange(index0, index0 + n_rows, dtype=np.int64),
        records=n_rows,
        too_short=int(too_short.sum()),
        padding=padding,
        bad=bad_list,
    )
    if not keep.all():
        token_keep = np.repeat(keep, lengths)
        out.tokens, out.targets = out.tokens[token_keep], out.targets[token_keep]
        out.lengths, out.source_index = out.lengths[keep], out.source_index[keep]
    return out

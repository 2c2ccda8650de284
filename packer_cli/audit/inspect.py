"""``inspect_output``: stream an output's shards once and build its :class:`InspectReport`.

The statistics read three columns: ``cu_seqlens`` (padded lengths p), ``seq_lens`` (real
lengths s) and ``loss_mask`` (target count); token ids are never touched. ``--pack`` reads its
one pack's source indices and offsets too (memory-mapped; verify, not inspect, checks those
columns). Memory stays bounded by one record batch plus histograms of size about C. Each record batch gives a partial report;
partials add up to one report per shard and shard reports add up to the whole output.

    >>> report = inspect_output("packed/")                      # doctest: +SKIP
    >>> report.to_dict()["attention"]["overstatement"]          # doctest: +SKIP
    4.87

Before reading, ``inspect`` runs verify's checks that need no read of the shards' content
(:mod:`packer_cli.audit._layout_checks`: metadata checksum and schema, manifest against
metadata, shard files and sizes, Bridge's metadata array) and summarizes nothing when one
fails: an :class:`~packer_cli.audit._layout_checks.InconsistentOutput` error lists the
findings. It does not hash the shards; beyond that it trusts the data as far as its
arithmetic needs (lengths are consistent and non-negative); anything else is a
:class:`DataError` that points at ``packer verify``.
"""
from __future__ import annotations

import numpy as np

from packer_cli.audit._bridge_checks import check_bridge_entries
from packer_cli.audit._layout_checks import (CHANGED, Layout, check_layout, directory_state, raise_if_inconsistent,
                                           check_split_argument, require_directory)
from packer_cli.audit.findings import FindingSink
from packer_cli.audit.report import InspectReport, PackDetail
from packer_cli.audit.store import PackBatch
from packer_cli.errors import ConfigError, DataError, PackerError, counted, interrupts_kept
from packer_cli.sources.discover import path_argument
from packer_cli.spec import is_int

INSPECT_COLUMNS = ("cu_seqlens", "seq_lens", "loss_mask")
RECORDED = ("records", "samples_packed", "bad_records", "too_short_dropped", "no_target_samples", "overlong")


def consistent_layout(out: str, split: str | None = None) -> Layout:
    """``out`` opened after verify's layout checks, which all hold (else
    :class:`~packer_cli.audit._layout_checks.InconsistentOutput`).

    The split's entry in Bridge's metadata array is compared with what its metadata records
    (verify compares it with what the data gives).
    """
    sink = FindingSink()
    layout = check_layout(out, sink, split)
    bridge = layout.metadata.get("bridge") if layout.metadata else None
    if layout.bridge_array is not None and isinstance(bridge, dict):
        check_bridge_entries(layout.store, layout.bridge_array, bridge, sink, f"{layout.store.metadata_name} records")
    raise_if_inconsistent(out, sink, "summarized")
    return layout


def padded_lengths(batch: PackBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(real, padded, seq_counts)`` of a batch's sequences, pack after pack.

    ``padded`` is ``diff(cu_seqlens)`` inside each pack. Raises :class:`DataError` naming the
    first bad row when ``cu_seqlens`` and ``seq_lens`` disagree in length, ``cu_seqlens`` does
    not run from 0 to the pack's length, or a size is negative (so every length is bounded by
    the data actually there).
    """
    cu_v, cu_o = batch.column("cu_seqlens")
    s_v, s_o = batch.column("seq_lens")
    counts, n_cu = np.diff(s_o), np.diff(cu_o)
    bad = np.flatnonzero((n_cu != counts + 1) | (counts < 1))
    if bad.size:
        _malformed(batch, int(bad[0]), f"{n_cu[bad[0]]} cu_seqlens entries for {counts[bad[0]]} sequences")
    ends = batch.lengths("loss_mask")
    bad = np.flatnonzero((cu_v[cu_o[:-1]] != 0) | (cu_v[cu_o[1:] - 1] != ends))
    if bad.size:
        _malformed(batch, int(bad[0]), f"cu_seqlens does not run from 0 to the pack's {ends[bad[0]]} positions")
    cu = cu_v[cu_o[0]:cu_o[-1]].astype(np.int64)
    real = s_v[s_o[0]:s_o[-1]].astype(np.int64)
    keep = np.ones(max(cu.size - 1, 0), dtype=bool)
    keep[cu_o[1:-1] - cu_o[0] - 1] = False  # differences across two packs
    padded = np.diff(cu)[keep]
    wrong = (padded < real) | (real < 0) | (padded < 0)
    if wrong.any():
        seq = int(np.flatnonzero(wrong)[0])
        row = int(np.searchsorted(np.cumsum(counts), seq, side="right"))
        _malformed(batch, row, f"a sequence has real length {real[seq]} and padded length {padded[seq]}")
    return real, padded, counts


def _malformed(batch: PackBatch, row: int, what: str):
    raise DataError(f"{batch.shard} row {batch.first_row + row}: malformed pack ({what}); "
                    f"run `packer verify` for a full report")


def pack_detail(batch: PackBatch, i: int, pack: int, pack_len: int | None) -> PackDetail:
    """Pack ``i`` of ``batch`` in detail: where each sequence sits and what it holds."""
    row = batch.row(i)
    starts = row.cu_seqlens[:-1].astype(np.int64)
    mask = row.loss_mask.astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(mask)])
    real = row.seq_lens.astype(np.int64)
    ends = np.clip(starts + real, 0, mask.size)
    starts_c = np.clip(starts, 0, mask.size)
    return PackDetail(
        pack=pack, shard=batch.shard, row=batch.first_row + i,
        pack_len=int(pack_len if pack_len is not None else row.tokens.size),
        source_index=row.source_index.tolist(), source_offset=row.source_offset.tolist(),
        start=starts.tolist(), real_len=real.tolist(), padded_len=np.diff(row.cu_seqlens).tolist(),
        target_tokens=(cum[ends] - cum[starts_c]).tolist(),
    )


def _spec_of(meta: dict) -> dict:
    spec = meta.get("spec")
    C = spec.get("pack_size") if isinstance(spec, dict) else None
    if type(C) is not int or C < 1:
        raise DataError("metadata.json: the spec has no usable pack_size; run `packer verify`")
    return spec


@interrupts_kept
def inspect_output(out: str, pack: int | None = None, split: str | None = None) -> InspectReport:
    """Read ``out`` and return its report; ``pack`` adds that pack's detail (global index).

    Raises :class:`ConfigError` when ``out`` is not a packer output, ``pack`` is out of
    range or ``out`` is a Megatron-Bridge layout of several splits and ``split`` names none, :class:`~packer_cli.audit._layout_checks.InconsistentOutput` when verify's layout
    checks fail, :class:`DataError` when the output cannot be read.
    """
    out = path_argument(out, "out")  # a Path would reach the report's JSON document as is
    if pack is not None:
        if not is_int(pack):  # 3.0, "3" and True failed deep inside NumPy, or read pack 1
            raise ConfigError(f"pack must be an integer pack index, got {pack!r}")
        pack = int(pack)
    require_directory(out)
    check_split_argument(out, split, "inspect")
    state = directory_state(out)
    try:
        total = _inspect(out, pack, split)
    except PackerError as exc:  # a shard gone missing mid-read, a --pack past a shorter output: said as what it was
        if directory_state(out) != state:
            raise DataError(f"{out} changed {CHANGED}: inspect it again ({exc})") from exc
        if isinstance(exc, DataError) and not str(exc).startswith(f"{out}: "):  # an OUT named "packs" too
            raise _in_output(out, exc) from exc
        raise
    if directory_state(out) != state:
        raise DataError(f"{out} changed {CHANGED}: inspect it again")
    return total


def _in_output(out: str, exc: DataError) -> DataError:
    """``exc`` naming the output it is in: a shard's name alone (``packs-00000.arrow``) is
    every output's, and a job inspecting several could not tell which one failed."""
    hint = "" if "packer verify" in str(exc) else "; run `packer verify` for a full report"
    return DataError(f"{out}: {exc}{hint}")


def _inspect(out: str, pack: int | None, split: str | None) -> InspectReport:
    """:func:`inspect_output`'s reading of ``out``."""
    store = consistent_layout(out, split).store
    spec = _spec_of(store.metadata)
    counts = store.metadata.get("counts") if isinstance(store.metadata.get("counts"), dict) else {}
    recorded = {k: counts.get(k) for k in RECORDED}
    pack_len = spec["pack_size"] if spec.get("pad_to_max_length") else None
    empty = InspectReport(out=out, spec=spec, recorded=recorded)
    total, seen = empty, 0
    for name in store.shard_names():
        shard = empty
        for batch in store.read_shard(name, INSPECT_COLUMNS):
            real, padded, seq_counts = padded_lengths(batch)
            m_v, m_o = batch.column("loss_mask")
            part = InspectReport.partial(out=out, spec=spec, recorded=recorded, real=real, padded=padded,
                                         seq_counts=seq_counts,
                                         target_tokens=np.count_nonzero(m_v[m_o[0]:m_o[-1]]))
            if pack is not None and seen <= pack < seen + batch.num_rows:
                part.detail = pack_detail(batch, pack - seen, pack, pack_len)
            shard = shard + part
            seen += batch.num_rows
        total = total + shard
    if pack is not None and total.detail is None:
        split_name = getattr(store, "split", None)  # a Bridge layout's splits each count from 0
        where = f"{out} split {split_name}" if split_name else out
        raise ConfigError(f"--pack {pack} is out of range: {where} has {counted(seen, 'pack')} (0..{seen - 1})")
    return total

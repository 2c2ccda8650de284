"""Verify's per-pack checks, vectorized over one record batch at a time.

For every pack (row) of a batch, in this order:

1. ``pack.columns``   — per-token columns have one length, ``cu_seqlens`` has N+1 entries and
   every per-sequence column N ≥ 1 entries.
2. ``pack.cu_seqlens`` — starts at 0, never decreases, ends at the runtime length.
3. ``pack.capacity``  — Σp ≤ C.
4. ``pack.lengths``   — 1 ≤ s ≤ p and s ≤ the longest a sequence may be (⌊C/m⌋·m).
5. ``pack.alignment`` — every padded length p is ceil(s/m)·m: a multiple of m, less than m above s.
6. ``pack.source``    — 0 ≤ source index < records read, offset ≥ 0 and a multiple of ⌊C/m⌋·m.
7. ``pack.padding``   — loss mask 0 and token = pad id on all alignment padding;
   ``pack.loss_mask`` — mask values are 0/1; ``pack.tokens`` — ids ≥ 0 (and < vocab if recorded).
8. ``pack.window``    — with ``spec.window`` W: a pack's source indices lie in one window of W
   records, and with ``spec.shuffle`` off no pack's window comes before an earlier pack's.

Only packs whose boundaries are sound (1–2 hold, 1 ≤ s ≤ p) go on to the token scan (7) and
into the statistics the metadata is compared with, so a corrupted ``cu_seqlens`` can never
send the scan outside its pack.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from packer_cli.audit._kernels import fingerprints, scan_sequences
from packer_cli.audit._layout_checks import Limits
from packer_cli.audit.findings import FindingSink
from packer_cli.audit.report import InspectReport
from packer_cli.audit.store import PackBatch

#: What verify keeps of every sound sequence (24 bytes): its source index and offset (int64),
#: its real length and target count (int32).
SEQ_FIELDS = ("index", "offset", "real", "targets")
#: Kept as well for ``verify --source`` (20 bytes more): its last label (int32) and
#: fingerprints of its tokens and loss mask.
SOURCE_FIELDS = ("last", "tokens_fp", "mask_fp")


@dataclass(frozen=True)
class BatchPlace:
    """Where a batch is, kept instead of the batch when its data is no longer needed."""

    shard: str
    first_row: int
    num_rows: int


@dataclass
class Sequences:
    """Per-sequence facts verify keeps for the whole output (a few ints each, never tokens).

    Only each batch's place is kept, so every shard is unmapped (or its decoded row groups
    freed) once it has been checked. With ``fingerprint`` (``verify --source``) each
    sequence's tokens and loss mask are also fingerprinted as they pass, which is all the
    source check needs of them: memory grows by the facts of each sequence (24 bytes, 44 for
    the source check), never by its tokens.

    A fact is found again by its position in the collected order (its *ordinal*): the sound
    packs' rows and sequence counts (8 bytes a pack) say which pack and place it came from,
    so no sequence carries its batch, row and place (12 bytes more each) for the few that a
    finding names.
    """

    fingerprint: bool = False
    batches: list = field(default_factory=list)
    first_pack: list = field(default_factory=list)
    parts: dict = field(default_factory=lambda: {k: [] for k in SEQ_FIELDS + SOURCE_FIELDS})
    sound_packs: list = field(default_factory=list)
    """Per batch checked to the end: its id, the rows of its sound packs (whose sequences
    were collected) and how many sequences each holds."""
    _packs: tuple | None = None
    window_reached: int = -1
    """The latest window of records the packs checked so far reached (``pack.window``)."""

    def where(self, batch: int, row: int, seq: int | None = None) -> dict:
        b = self.batches[batch]
        return {"shard": b.shard, "row": b.first_row + int(row), "pack": self.first_pack[batch] + int(row),
                "seq": None if seq is None else int(seq)}

    def place(self, ordinal: int) -> tuple[int, int, int]:
        """``(batch, row, seq)`` of the collected sequence number ``ordinal``."""
        if self._packs is None:  # built at the first finding that needs it: O(packs)
            parts = self.sound_packs or [(0, np.zeros(0, np.int32), np.zeros(0, np.int32))]
            counts = np.concatenate([p[2] for p in parts])
            first = np.cumsum(counts, dtype=np.int64) - counts
            batch = np.repeat([p[0] for p in parts], [p[1].size for p in parts])
            self._packs = (first, batch, np.concatenate([p[1] for p in parts]))
        first, batch, rows = self._packs
        p = int(np.searchsorted(first, int(ordinal), side="right")) - 1
        return int(batch[p]), int(rows[p]), int(ordinal) - int(first[p])

    def locate(self, ordinal: int) -> dict:
        """:meth:`where` of the collected sequence number ``ordinal``."""
        return self.where(*self.place(ordinal))

    def arrays(self) -> dict[str, np.ndarray]:
        """Each fact as one array. The per-batch parts are handed over, a field at a time, so
        the facts are never held twice."""
        out = {}
        for k in SEQ_FIELDS + (SOURCE_FIELDS if self.fingerprint else ()):
            v = self.parts[k]
            out[k] = np.concatenate(v) if v else np.zeros(0, np.int64)
            self.parts[k] = []
        return out


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(x)[:-1]]).astype(np.int64) if x.size else np.zeros(0, np.int64)


def _column_problems(batch: PackBatch) -> tuple[np.ndarray, list[str]]:
    """Per row: the first column-length inconsistency, or '' when there is none."""
    n_tok = batch.lengths("tokens")
    n_seq = batch.lengths("seq_lens")
    rules = [
        (batch.lengths("loss_mask") != n_tok, lambda i: f"loss_mask has {batch.lengths('loss_mask')[i]} values "
                                                        f"but tokens has {n_tok[i]}"),
        (n_seq == 0, lambda i: "the pack holds no sequence"),
        (batch.lengths("cu_seqlens") != n_seq + 1,
         lambda i: f"cu_seqlens has {batch.lengths('cu_seqlens')[i]} entries for {n_seq[i]} sequences"),
    ]
    for col in ("last_token", "source_index", "source_offset"):
        n = batch.lengths(col)
        rules.append((n != n_seq, lambda i, n=n, col=col: f"{col} has {n[i]} entries but seq_lens has {n_seq[i]}"))
    bad = np.zeros(batch.num_rows, dtype=bool)
    for violated, _ in rules:
        bad |= violated
    return bad, rules


def _check_windows(index: np.ndarray, counts: np.ndarray, lim: Limits, seqs: Sequences, sink: FindingSink,
                   where) -> None:
    """``pack.window`` over a batch's packs of sound shape (``counts`` sequences each, their
    source indices ``index`` in pack order): each within one window of ``lim.window`` records,
    and, in plan order, never in a window before the latest one already reached."""
    starts = _excl_cumsum(counts)
    window = np.maximum(index, 0) // lim.window  # a negative index is pack.source's finding
    low, high = np.minimum.reduceat(window, starts), np.maximum.reduceat(window, starts)
    low_index, high_index = np.minimum.reduceat(index, starts), np.maximum.reduceat(index, starts)
    sink.add_many("pack.window", np.flatnonzero(low != high), lambda j: (
        f"the pack mixes windows of {lim.window:,} records: source indices {low_index[j]:,} and {high_index[j]:,}",
        where(j)))
    if lim.ordered:
        reached = np.maximum.accumulate(np.concatenate([[seqs.window_reached], high]))
        sink.add_many("pack.window", np.flatnonzero(low < reached[:-1]), lambda j: (
            f"the pack holds records of window {low[j]:,} after a pack of window {reached[j]:,} "
            f"(windows of {lim.window:,} records, packs not shuffled)", where(j)))
        seqs.window_reached = int(reached[-1])


def check_batch(batch: PackBatch, first_pack: int, lim: Limits, sink: FindingSink, seqs: Sequences,
                spec: dict, out: str) -> InspectReport:
    """Run the checks on one batch, collect its sound sequences, return its statistics.

    ``first_pack`` is the global index of the batch's first pack (for messages).
    """
    bid = len(seqs.batches)
    seqs.batches.append(BatchPlace(batch.shard, batch.first_row, batch.num_rows))
    seqs.first_pack.append(first_pack)
    where = lambda row, seq=None: seqs.where(bid, row, seq)  # noqa: E731

    bad_shape, rules = _column_problems(batch)
    for violated, describe in rules:
        sink.add_many("pack.columns", np.flatnonzero(violated), lambda i: (describe(i), where(i)))
    good = np.flatnonzero(~bad_shape)
    n_tok = batch.lengths("tokens")
    sink.add_many("pack.capacity", good[n_tok[good] > lim.C],
                  lambda i: (f"the pack holds {n_tok[i]:,} runtime tokens (Σp), more than C = {lim.C:,}", where(i)))

    cu_v, cu_o = batch.column("cu_seqlens")
    counts = batch.lengths("seq_lens")[good]
    row = np.repeat(good, counts)
    k = np.arange(row.size, dtype=np.int64) - np.repeat(_excl_cumsum(counts), counts)
    cu_pos = cu_o[row] + k
    left, right = cu_v[cu_pos].astype(np.int64), cu_v[cu_pos + 1].astype(np.int64)
    p = right - left
    first, last = cu_v[cu_o[good]].astype(np.int64), cu_v[cu_o[good + 1] - 1].astype(np.int64)
    sink.add_many("pack.cu_seqlens", np.flatnonzero(first != 0),
                  lambda j: (f"cu_seqlens starts at {first[j]}, not 0", where(good[j])))
    sink.add_many("pack.cu_seqlens", np.flatnonzero(last != n_tok[good]),
                  lambda j: (f"cu_seqlens ends at {last[j]} but the pack has {n_tok[good[j]]} runtime tokens",
                             where(good[j])))
    sink.add_many("pack.cu_seqlens", np.flatnonzero(p < 0),
                  lambda j: (f"cu_seqlens decreases from {left[j]} to {right[j]}", where(row[j], k[j])))

    def per_seq(name):
        values, offsets = batch.column(name)
        pos = offsets[row] + k
        return values[pos].astype(np.int64), pos

    s, _ = per_seq("seq_lens")
    index, _ = per_seq("source_index")
    offset, _ = per_seq("source_offset")
    last_tok, _ = per_seq("last_token")
    seq_msg = lambda text: lambda j: (text(j), where(row[j], k[j]))  # noqa: E731
    sink.add_many("pack.lengths", np.flatnonzero(s < 1), seq_msg(lambda j: f"real length {s[j]} is below 1"))
    sink.add_many("pack.lengths", np.flatnonzero((s > p) & (p >= 0)),
                  seq_msg(lambda j: f"real length {s[j]} exceeds the padded length {p[j]}"))
    sink.add_many("pack.lengths", np.flatnonzero(s > lim.cap),
                  seq_msg(lambda j: f"real length {s[j]} exceeds the longest allowed, {lim.cap}"))
    sink.add_many("pack.alignment", np.flatnonzero(p % lim.m != 0),
                  seq_msg(lambda j: f"padded length {p[j]} is not a multiple of m = {lim.m}"))
    sink.add_many("pack.alignment", np.flatnonzero((s >= 1) & (p - s >= lim.m)), seq_msg(
        lambda j: f"padded length {p[j]} holds {s[j]} real tokens: more padding than m = {lim.m} allows"))
    sink.add_many("pack.source", np.flatnonzero(index < 0), seq_msg(lambda j: f"source index {index[j]} is negative"))
    if lim.records is not None:
        sink.add_many("pack.source", np.flatnonzero(index >= lim.records), seq_msg(
            lambda j: f"source index {index[j]} is beyond the {lim.records:,} records the run read"))
    sink.add_many("pack.source", np.flatnonzero((offset < 0) | (offset % lim.cap != 0)), seq_msg(
        lambda j: f"source offset {offset[j]} is " + ("negative" if offset[j] < 0 else f"not a multiple of {lim.cap}")))
    sink.add_many("pack.tokens", np.flatnonzero(last_tok < 0),
                  seq_msg(lambda j: f"last_token {last_tok[j]} is negative"))

    if lim.window is not None and good.size:
        _check_windows(index, counts, lim, seqs, sink, lambda j: where(good[j]))

    # Packs whose boundaries are sound go on to the token scan and into the statistics.
    seq_ok = (s >= 1) & (s <= p)
    pack_ok = (first == 0) & (last == n_tok[good])
    pack_ok &= np.bincount(np.repeat(np.arange(good.size), counts), weights=~seq_ok, minlength=good.size) == 0
    keep = np.repeat(pack_ok, counts)
    tok_v, tok_o = batch.column("tokens")
    mask_v, mask_o = batch.column("loss_mask")
    start, mstart = tok_o[row[keep]] + left[keep], mask_o[row[keep]] + left[keep]
    scan = scan_sequences(tok_v, mask_v, start, mstart, s[keep], p[keep], lim.pad_id)
    sel = np.flatnonzero(keep)
    msg = lambda text: lambda i: (text(i), where(row[sel[i]], k[sel[i]]))  # noqa: E731
    sink.add_many("pack.padding", np.flatnonzero(scan["pad_loss"] > 0),
                  msg(lambda i: f"loss mask is non-zero on {scan['pad_loss'][i]} of its {p[sel[i]] - s[sel[i]]} "
                                f"padding positions"))
    sink.add_many("pack.padding", np.flatnonzero(scan["pad_tok"] > 0),
                  msg(lambda i: f"{scan['pad_tok'][i]} padding tokens differ from pad id {lim.pad_id}"))
    sink.add_many("pack.loss_mask", np.flatnonzero(scan["mask_bits"] > 1),
                  msg(lambda i: "loss mask holds a value other than 0 and 1"))
    sink.add_many("pack.tokens", np.flatnonzero(scan["tok_bits"] < 0), msg(lambda i: "a token id is negative"))
    if lim.vocab is not None:
        high = np.maximum(scan["tok_max"], last_tok[keep])
        sink.add_many("pack.tokens", np.flatnonzero(high >= lim.vocab),
                      msg(lambda i: f"token id {high[i]} is >= the vocab size {lim.vocab}"))

    # Collected together, at the end, so a batch that fails half-way adds nothing.
    facts = {"index": index[keep], "offset": offset[keep], "real": s[keep].astype(np.int32),
             "targets": scan["targets"].astype(np.int32)}  # lengths, counts and ids are below 2^31
    if seqs.fingerprint:
        facts.update(last=last_tok[keep].astype(np.int32), tokens_fp=fingerprints(tok_v, start, s[keep]),
                     mask_fp=fingerprints(mask_v, mstart, s[keep]))
    for name, values in facts.items():
        seqs.parts[name].append(values)
    seqs.sound_packs.append((bid, good[pack_ok].astype(np.int32), counts[pack_ok].astype(np.int32)))
    return InspectReport.partial(out=out, spec=spec, recorded={}, real=s[keep], padded=p[keep],
                                 seq_counts=counts[pack_ok], target_tokens=int(scan["targets"].sum()))

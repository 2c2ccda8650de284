"""``verify --source``: replay the inputs and account for every sample exactly once.

::

    SampleStream (recorded source spec) ──▶ windows of ≥ 4M tokens, in source order
        │                                          │
        │  expected pieces of each kept sample      │  packed sequences whose source index falls
        │  under the recorded over-long policy      │  in the window (one slice of the sorted table)
        └──────────── match (index, offset) ───────┘
             missing ◀─┘   │   └─▶ length differs
                           ▼
          fingerprints of tokens and targets compared, and the last label
          (a piece that differs is read again from its shard to name the position)

A sample of n tokens is expected as the pieces ``(offset o, length s)`` its runtime positions
``0..n−2`` make under the policy: one ``(0, n−1)`` when it fits, ``(0, cap)`` when truncated,
``(k·cap, min(cap, n−1−k·cap))`` for each piece when split, none when dropped. Samples the
stream itself leaves out (bad records, fewer than 2 tokens) must not be packed at all, and the
counts the run recorded for them are compared exactly.

Memory: one window of source tokens, plus what verify keeps per packed sequence anyway and two
64-bit fingerprints (its tokens, its loss mask) taken while the shards streamed past. No shard
stays mapped and no decoded row group is kept, so ``verify --source`` needs the same memory for
a terabyte of shards as for a megabyte, bar about 70 bytes per packed sequence (its facts, the
fingerprints, and the sorted key and ordinal the matching needs). A piece differs from its
source when a fingerprint does (any one changed value always changes it; other changes escape
with probability about 2⁻⁶⁴); only then is its batch read again, to report the first position
that differs.
"""
from __future__ import annotations

from contextlib import closing

import numpy as np

from packer_cli._background import background
from packer_cli.audit._kernels import fingerprints, segment_sums
from packer_cli.audit._meta_checks import _get, compare
from packer_cli.audit.findings import FindingSink
from packer_cli.errors import PackerError
from packer_cli.shards.format import MAX_LISTED_BAD
from packer_cli.sources import SampleStream
from packer_cli.spec import BadRecordPolicy, SourceSpec

WINDOW_TOKENS = 1 << 22


def _excl(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(x)[:-1]]).astype(np.int64) if x.size else np.zeros(0, np.int64)


def _members(keys: np.ndarray, of: np.ndarray) -> np.ndarray:
    """``np.isin(keys, of)`` by binary search in ``of`` (sorted first unless it is, as the
    stream's keys are: source order): ``np.isin`` took 4.8 s on 2M keys against 0.09 s, half of
    ``verify --source``'s time on outputs of tiny samples."""
    if of.size == 0:
        return np.zeros(keys.size, dtype=bool)
    if (of[1:] < of[:-1]).any():
        of = np.sort(of)
    at = np.minimum(np.searchsorted(of, keys), of.size - 1)
    return of[at] == keys


def recorded_source_spec(meta: dict) -> SourceSpec:
    """The :class:`SourceSpec` the output was packed with, from ``metadata["source"]``."""
    src = meta["source"]
    sup = src["supervision"]
    kind, name = sup["kind"], sup.get("field")
    return SourceSpec(tokens_field=src["tokens_field"], mask_field=name if kind == "mask" else None,
                      # the masks applied with it; an output of a packer that applied none records none
                      also_mask_fields=src.get("also_mask_fields", []) if kind == "mask" else (),
                      labels_field=name if kind == "labels" else None, all_targets=kind == "all",
                      vocab_size=src.get("vocab_size"),
                      # an output of a packer that did not read padding masks records none
                      attention_field=src.get("attention_field"),
                      on_bad_record=BadRecordPolicy(src["on_bad_record"])).validate()


class _Replay:
    """State of one source replay: the sorted packed table, counters and the sink."""

    def __init__(self, meta, lim, arr, seqs, sink: FindingSink, stream: SampleStream, store, unread: int):
        self.lim, self.seqs, self.sink, self.stream, self.store = lim, seqs, sink, stream, store
        self._reread: tuple = (None, None)  # (batch id, PackBatch): the last batch read again
        self.policy = meta["spec"].get("overlong")
        self.not_found = ("is not in the output" if not unread else
                          f"is not in the packs read ({unread:,} {'pack' if unread == 1 else 'packs'} could not be)")
        # The table is sorted by one key, (index, offset) packed into an int64 (offsets are
        # int32 in the shards); a negative index or offset, or an index past 2^32, is no
        # sample's piece, and verify's other checks name it.
        valid = (arr["index"] >= 0) & (arr["index"] < 2**32) & (arr["offset"] >= 0) & (arr["offset"] < 2**31)
        kept = None if valid.all() else np.flatnonzero(valid)
        key = (arr.pop("index") << 31) | arr.pop("offset")  # they live on in the key alone
        key = key if kept is None else key[kept]
        order = np.argsort(key, kind="stable")
        self.key = key[order]
        del key, valid
        order = order if kept is None else kept[order]
        for k in list(arr):  # sorted in place, a field at a time: the facts are never held twice
            arr[k] = arr[k][order]
        self.t = arr
        # Each sorted fact's ordinal, to find its pack again for a finding (Sequences.place).
        self.ordinal = order.astype(np.int32) if order.size < 2**31 else order
        self.matched = np.zeros(order.size, dtype=bool)
        self.counts = dict(records=0, too_short=0, bad=0, over=0, tokens_lost=0, targets_lost=0, dropped=0,
                           no_target=0, no_target_before_cap=0, packed=0, compared_tokens=0)
        self.bad_listed: list[tuple] = []

    def where(self, q: int) -> dict:
        return self.seqs.locate(self.ordinal[q])

    def add_batch(self, batch) -> None:
        c = self.counts
        c["records"] += batch.records
        c["too_short"] += batch.too_short
        c["bad"] += len(batch.bad)
        for bad in batch.bad[: max(0, MAX_LISTED_BAD - len(self.bad_listed))]:
            self.bad_listed.append((bad.row, bad.line, bad.reason))

    def window(self, batches, lo: int, hi: int) -> None:
        """Compare the samples with source index in ``[lo, hi)`` against their packed pieces."""
        cap, c, sink = self.lim.cap, self.counts, self.sink
        tok = np.concatenate([b.tokens for b in batches])
        tgt = np.concatenate([b.targets for b in batches])
        n = np.concatenate([b.lengths for b in batches])
        sidx = np.concatenate([b.source_index for b in batches])
        ss = _excl(n)
        r = n - 1
        over = r > cap
        runtime_t = segment_sums(tgt, ss + 1, ss + n)  # targets of labels 1..n-1
        c["over"] += int(over.sum())
        kept_t = runtime_t  # targets a kept sample trains on: under truncate, those before the cap
        if self.policy == "truncate":
            c["tokens_lost"] += int((r[over] - cap).sum())
            tail = segment_sums(tgt, (ss + cap + 1)[over], (ss + n)[over])
            c["targets_lost"] += int(tail.sum())
            kept_t = runtime_t.copy()
            kept_t[over] -= tail
        left_out = over if self.policy in ("drop", "error") else np.zeros(n.size, dtype=bool)
        if self.policy == "drop":
            c["dropped"] += int(over.sum())
            c["tokens_lost"] += int(r[over].sum())
            c["targets_lost"] += int(runtime_t[over].sum())
        if self.policy == "error":
            sink.add_many("source.counts", np.flatnonzero(over), lambda i: (
                f"{self.stream.locate(int(sidx[i]))}: sample has {r[i]} runtime tokens, more than {cap}, "
                f"but the policy is error", {}))
        c["no_target"] += int(((kept_t == 0) & ~left_out).sum())
        c["no_target_before_cap"] += int(((runtime_t == 0) & ~left_out).sum())  # as earlier outputs counted
        c["packed"] += int((~left_out).sum())

        pieces = np.where(left_out, 0, np.where(over & (self.policy == "split"), -(-r // cap), 1))
        e_sample = np.repeat(np.arange(n.size), pieces)
        e_off = (np.arange(e_sample.size) - np.repeat(_excl(pieces), pieces)) * cap
        e_len = np.minimum(r[e_sample] - e_off, cap)
        e_idx = sidx[e_sample]
        e_key = (e_idx << 31) | e_off

        a, b = np.searchsorted(self.key, [lo << 31, hi << 31])
        p_key = self.key[a:b]
        self.matched[a:b] = _members(p_key, e_key)
        pos = np.minimum(np.searchsorted(p_key, e_key), max(p_key.size - 1, 0))
        found = (p_key[pos] == e_key) if p_key.size else np.zeros(e_key.size, dtype=bool)
        piece = lambda i: f"piece at offset {e_off[i]} of " if pieces[e_sample[i]] > 1 else ""  # noqa: E731
        sink.add_many("source.missing", np.flatnonzero(~found), lambda i: (
            f"{self.stream.locate(int(e_idx[i]))}: {piece(i)}sample (source index {e_idx[i]}) {self.not_found}, "
            f"and not listed as dropped", {}))
        fe = np.flatnonzero(found)
        q = a + pos[fe]
        same = self.t["real"][q] == e_len[fe]
        sink.add_many("source.length", np.flatnonzero(~same), lambda j: (
            f"holds {self.t['real'][q[j]]} runtime tokens of source index {e_idx[fe[j]]} offset {e_off[fe[j]]}, "
            f"the source and policy give {e_len[fe[j]]}", self.where(q[j])))
        self._compare_tokens(fe[same], q[same], tok, tgt, ss[e_sample] + e_off, e_len, e_idx)

    def _compare_tokens(self, E, Q, tok, tgt, src_start, e_len, e_idx) -> None:
        """Tokens, targets and last label of matched pieces ``E`` (expected) ↔ ``Q`` (packed)."""
        t = self.t
        L, starts = e_len[E], src_start[E]
        self.counts["compared_tokens"] += int(L.sum())
        source = lambda j: self.stream.locate(int(e_idx[E[j]]))  # noqa: E731
        for check, fp, column, values, shift, what in (
                ("source.tokens", "tokens_fp", "tokens", tok, 0, "token"),
                ("source.targets", "mask_fp", "loss_mask", tgt, 1, "loss mask (target) at")):
            differs = np.flatnonzero(fingerprints(values, starts + shift, L) != t[fp][Q])

            def message(j, column=column, values=values, shift=shift, what=what):
                ours = values[starts[j] + shift:starts[j] + shift + L[j]]
                try:
                    packed = self._packed(Q[j], column, L[j])
                except (PackerError, OSError, IndexError, ValueError) as exc:  # the shard changed meanwhile
                    return (f"{what} values differ from the source ({source(j)}); the shard could not be read "
                            f"again to say where ({exc})", self.where(Q[j]))
                pos = np.flatnonzero(packed != ours)
                if not pos.size:  # equal now: the shard changed while verify read it
                    return (f"{what} values differed from the source ({source(j)}) when the shard was first read, "
                            f"but not when read again (the shard changed meanwhile)", self.where(Q[j]))
                pos = int(pos[0])
                return (f"{what} position {pos} is {packed[pos]} but the source ({source(j)}) has {ours[pos]}",
                        self.where(Q[j]))
            self.sink.add_many(check, differs, message)
        want, got_last = tok[starts + L], t["last"][Q]
        self.sink.add_many("source.tokens", np.flatnonzero(got_last != want), lambda j: (
            f"last label is {got_last[j]} but the source ({source(j)}) has {want[j]}", self.where(Q[j])))

    def _packed(self, q: int, column: str, length: int) -> np.ndarray:
        """``length`` values of packed sequence ``q`` in ``column``, read again from its shard
        (only for a piece whose fingerprint differs: the findings are few and capped). Its place
        in the batch is found again from the pack's ``cu_seqlens``, checked when first read."""
        b, row, seq = self.seqs.place(self.ordinal[q])
        if self._reread[0] != b:
            place = self.seqs.batches[b]
            self._reread = (b, self.store.batch_at(place.shard, place.first_row))
        batch = self._reread[1]
        values, offsets = batch.column(column)
        cu_values, cu_offsets = batch.column("cu_seqlens")
        at = int(offsets[row]) + int(cu_values[cu_offsets[row] + seq])
        return values[at:at + length]


def check_source(files, meta: dict, lim, arr: dict, seqs, sink: FindingSink, store, unread: int = 0) -> dict:
    """Replay ``files`` with the recorded source spec and compare; returns a summary.

    ``arr`` (the per-sequence facts, with fingerprints) is sorted in place and kept; ``store``
    reads a batch again when a finding needs its values. ``unread`` packs could not be read:
    a sample not found may be in one of them, and its finding says so."""
    try:
        spec = recorded_source_spec(meta)
    except (PackerError, KeyError, TypeError, ValueError) as exc:
        sink.add("source.spec", f"metadata.json does not record a usable source spec ({exc})", shard="metadata.json")
        return incomplete_source(files, 0)
    stream = SampleStream(files, spec, arrow_parquet=True)  # not the decoder pack read the inputs with
    replay = _Replay(meta, lim, arr, seqs, sink, stream, store, unread)
    window, tokens, lo, records = [], 0, 0, 0
    try:
        # The inputs are read and decoded on a second thread while this one compares: the
        # stream's own count runs ahead, so windows are cut by the records taken here.
        with closing(background(iter(stream), depth=2)) as batches:
            for batch in batches:
                replay.add_batch(batch)
                window.append(batch)
                tokens += int(batch.tokens.size)
                records += batch.records
                if tokens >= WINDOW_TOKENS:
                    replay.window(window, lo, records)
                    window, tokens, lo = [], 0, records
        replay.window(window, lo, records) if window else None
    except PackerError as exc:
        sink.add("source.read", f"the source could not be read to the end: {exc}")
        return incomplete_source(files, records)
    key = replay.key
    sink.add_many("source.unexpected", np.flatnonzero(~replay.matched), lambda q: (
        f"source index {key[q] >> 31} offset {key[q] & (2**31 - 1)} is not a piece of any kept source sample "
        f"(out of range, a bad or too-short record, or dropped)", replay.where(q)))
    _compare_counts(meta, replay, stream, files, sink)
    c = replay.counts
    return {"inputs": len(files), "records": c["records"], "samples_packed": c["packed"],
            "tokens_compared": c["compared_tokens"], "complete": True}


def incomplete_source(files, records: int) -> dict:
    """The summary of a comparison that did not finish: the same keys as a finished one's (a
    pipeline reads them whatever happened), what it did not get to count ``None``."""
    return {"inputs": len(files), "records": records, "samples_packed": None, "tokens_compared": None,
            "complete": False}


def _compare_counts(meta, replay: _Replay, stream, files, sink: FindingSink) -> None:
    c = replay.counts
    src = "the source has"
    if _get(meta, "counts.no_target_samples") == c["no_target_before_cap"]:
        c["no_target"] = c["no_target_before_cap"]  # written before packer counted truncation (targets before it)
    for path, value in (("counts.records", c["records"]), ("counts.bad_records", c["bad"]),
                        ("counts.too_short_dropped", c["too_short"]), ("counts.samples_packed", c["packed"]),
                        ("counts.no_target_samples", c["no_target"]), ("counts.overlong.samples", c["over"]),
                        ("counts.overlong.tokens_lost", c["tokens_lost"]),
                        ("counts.overlong.target_tokens_lost", c["targets_lost"]),
                        ("counts.overlong.dropped", c["dropped"])):
        compare(sink, "source.counts", meta, path, value, src)
    listed = meta.get("bad_records") if isinstance(meta.get("bad_records"), list) else []
    recorded = [(e.get("row"), e.get("line"), e.get("reason")) if isinstance(e, dict) else None for e in listed]
    if recorded != replay.bad_listed:
        sink.add("source.counts", f"bad_records lists {len(recorded)} records that differ from the "
                 f"{len(replay.bad_listed)} the source gives", shard="metadata.json")
    sup = meta["source"]["supervision"]
    recorded = (sup["kind"], sup.get("field"), tuple(meta["source"].get("also_mask_fields", ())))
    if stream.supervision and (stream.supervision.kind, stream.supervision.field, stream.supervision.also) != recorded:
        also = "".join(f" and {name!r}" for name in recorded[2])
        sink.add("source.spec", f"targets come from {stream.supervision.describe()} in the source, but the "
                 f"output recorded {sup['kind']} {sup.get('field')!r}{also}", shard="metadata.json")
    recorded_attention = meta["source"].get("attention_field")
    if stream.attention != recorded_attention:
        sink.add("source.spec", f"the source's padding mask is {stream.attention!r}, but the output recorded "
                 f"{recorded_attention!r}", shard="metadata.json")
    elif "padding_dropped" in meta["source"]:
        compare(sink, "source.counts", meta, "source.padding_dropped", stream.padding, src)
    inputs = meta["source"].get("inputs")
    inputs = inputs if isinstance(inputs, list) else []  # anything else is metadata.schema's to report
    sizes = [e.get("bytes") if isinstance(e, dict) else None for e in inputs]
    if len(files) != len(inputs):
        sink.warn("source.inputs", f"{len(files)} input files given, the output records {len(inputs)}")
    else:
        for f, size in zip(files, sizes):
            if f.size != size:  # a size that is no count (metadata.schema's too) is shown as it is
                shown = f"{size:,}" if type(size) is int else repr(size)
                sink.warn("source.inputs", f"{f.path}: {f.size:,} bytes, the output recorded {shown}")

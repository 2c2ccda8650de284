"""Verify's whole-output checks: sequence provenance, then metadata.json against the data.

``check_provenance`` sorts every packed sequence by ``(source_index, source_offset)`` (or, when
every offset is 0, only a copy of the indices, to see that none repeats):

* ``output.duplicate`` — no ``(index, offset)`` pair occurs twice;
* ``output.pieces``    — with ``split``, a sample's pieces sit at offsets 0, cap, 2·cap, … and all
  but the last are exactly cap long; with any other policy every offset is 0.

``check_metadata`` recomputes what the data determines and compares it with metadata.json:
``metadata.counts`` (totals, samples, pieces, and what the over-long policy implies),
``metadata.quality`` (efficiency, fill, both lower bounds and gaps), ``metadata.bridge``
(Megatron-Bridge's six keys), ``metadata.static`` and ``metadata.spec``. Counts that only the
source knows (records, bad, too short, over-long) are compared exactly by the source check.
"""
from __future__ import annotations

import math

import numpy as np

from packer_cli.audit.findings import FindingSink
from packer_cli.audit.report import InspectReport
from packer_cli.shards.format import MAX_LISTED_BAD, METADATA_FILE

MISSING = object()


def check_provenance(arr: dict, cap: int, policy: str, seqs, sink: FindingSink, complete: bool = True) -> dict:
    """Duplicate and piece checks; returns per-sample facts the metadata check needs. With
    ``complete`` false (some packs were not read) a gap between a sample's pieces may be a piece
    in a pack that was not read, and is not named."""
    at_cap = int((arr["real"] == cap).sum())
    # sequences without targets that no truncation made: what earlier outputs recorded at least
    untruncated = int(((arr["targets"] == 0) & (arr["real"] < cap)).sum())
    if _whole_samples_once(arr):
        # The usual output: nothing split, nothing twice. Every check below would pass, and
        # every sequence is one sample: its facts follow without sorting the table.
        return {"samples_packed": int(arr["index"].size), "extra_pieces": 0, "multi_piece_samples": 0,
                "zero_target_samples": int((arr["targets"] == 0).sum()), "at_cap_sequences": at_cap,
                "untruncated_zero_target": untruncated}
    order = np.lexsort((arr["offset"], arr["index"]))
    idx, off, real = arr["index"][order], arr["offset"][order], arr["real"][order]
    loc = lambda j: seqs.locate(order[j])  # noqa: E731
    dup = np.flatnonzero((idx[1:] == idx[:-1]) & (off[1:] == off[:-1])) + 1
    sink.add_many("output.duplicate", dup, lambda j: (
        f"source index {idx[j]} offset {off[j]} is packed twice (also at {_fmt(loc(j - 1))})", loc(j)))
    unique = np.ones(idx.size, dtype=bool)
    unique[dup] = False
    if dup.size:
        idx, off, real, order_u = idx[unique], off[unique], real[unique], np.flatnonzero(unique)
    else:
        order_u = np.arange(idx.size)
    new = np.concatenate([[True], idx[1:] != idx[:-1]]) if idx.size else np.zeros(0, bool)
    starts = np.flatnonzero(new)
    pieces = np.diff(np.append(starts, idx.size))
    at = lambda j: loc(order_u[j])  # noqa: E731
    if policy == "split":
        group = np.cumsum(new) - 1
        rank = np.arange(idx.size) - starts[group]
        sink.add_many("output.pieces", np.flatnonzero((off != rank * cap) & complete), lambda j: (
            f"piece of source index {idx[j]} at offset {off[j]} should be at {rank[j] * cap} "
            f"(a piece is missing)", at(j)))
        not_last = np.flatnonzero(~np.concatenate([new[1:], [True]]) & (real != cap)) if idx.size else []
        sink.add_many("output.pieces", not_last, lambda j: (
            f"piece of source index {idx[j]} at offset {off[j]} has {real[j]} tokens; every piece "
            f"but the last must have {cap}", at(j)))
    else:
        sink.add_many("output.pieces", np.flatnonzero(off != 0), lambda j: (
            f"source index {idx[j]} has offset {off[j]}, but only --overlong split makes pieces", at(j)))
    targets = arr["targets"][order][unique]
    per_sample = np.add.reduceat(targets, starts) if starts.size else np.zeros(0, np.int64)
    return {
        "samples_packed": int(starts.size), "extra_pieces": int(idx.size - starts.size),
        "multi_piece_samples": int((pieces > 1).sum()), "zero_target_samples": int((per_sample == 0).sum()),
        "at_cap_sequences": at_cap, "untruncated_zero_target": untruncated,
    }


def _whole_samples_once(arr: dict) -> bool:
    """Every offset is 0 and no source index occurs twice (a sorted copy of the indices, 8
    bytes a sequence, where the full check holds the sorted table and its order)."""
    if arr["offset"].any():
        return False
    ordered = np.sort(arr["index"])
    return not (ordered[1:] == ordered[:-1]).any()


def _fmt(where: dict) -> str:
    return f"{where['shard']} row {where['row']} seq {where['seq']}"


def _get(meta: dict, path: str):
    node = meta
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return MISSING
        node = node[key]
    return node


def _same(recorded, expected) -> bool:
    """Exact equality (floats too: both sides come from the same integer sums by one division)."""
    if isinstance(expected, float) and isinstance(recorded, (int, float)) and not isinstance(recorded, bool):
        return recorded == expected or (math.isnan(recorded) and math.isnan(expected))
    return type(recorded) is type(expected) and recorded == expected


def _compare_no_target_truncated(sink: FindingSink, meta: dict, facts: dict) -> None:
    """``counts.no_target_samples`` under truncation: packer counts a sample truncated to no
    target; outputs written before it did (2026-12-03) counted targets before truncation, a
    number the output alone cannot give but which lies between the untruncated samples without
    targets and today's count (``verify --source`` checks either exactly)."""
    recorded, now = _get(meta, "counts.no_target_samples"), facts["zero_target_samples"]
    if recorded is MISSING or _same(recorded, now):
        return compare(sink, "metadata.counts", meta, "counts.no_target_samples", now)
    low = facts["untruncated_zero_target"]
    if not (type(recorded) is int and low <= recorded <= now):
        sink.add("metadata.counts", f"counts.no_target_samples is {recorded!r} but the data has {now!r} "
                 f"({low} of them not truncated)", shard=METADATA_FILE)


def compare(sink: FindingSink, check: str, meta: dict, path: str, expected, what: str = "the data has") -> None:
    """One finding when ``meta[path]`` is missing or differs from ``expected``."""
    recorded = _get(meta, path)
    if recorded is MISSING:
        sink.add(check, f"{path} is missing", shard=METADATA_FILE)
    elif not _same(recorded, expected):
        sink.add(check, f"{path} is {recorded!r} but {what} {expected!r}", shard=METADATA_FILE)


def expected_bridge(report: InspectReport) -> dict:
    """Megatron-Bridge's metadata keys recomputed from the packs (runtime lengths incl. padding)."""
    C = int(report.spec["pack_size"])
    loads = report.load_hist.values
    return {
        "dataset_max_seqlen": int(report.padded_hist.values[-1]),
        "max_samples_per_bin": int(report.seqs_hist.values[-1]),
        "packing_factor": round(report.sequences / report.packs, 2),
        "packing_efficiency": round(report.padded_tokens / report.packs / C * 100, 2),
        "pack_size": C,
        "min_packed_seqlen": int(loads[0]),
    }


def check_metadata(meta: dict, report: InspectReport, facts: dict, sink: FindingSink) -> None:
    """Compare metadata.json with what ``report`` and ``facts`` (from the data) determine."""
    if report.packs == 0:
        sink.add("metadata.counts", "no pack could be read, so no count can be checked", shard=METADATA_FILE)
        return
    d = report.to_dict()
    t = d["totals"]
    for key in ("packs", "sequences", "runtime_tokens", "padded_tokens", "target_tokens", "alignment_padding",
                "tail_padding"):
        compare(sink, "metadata.counts", meta, f"counts.{key}", t[key])
    compare(sink, "metadata.counts", meta, "counts.samples_packed", facts["samples_packed"])
    compare(sink, "metadata.counts", meta, "counts.overlong.extra_pieces", facts["extra_pieces"])
    _check_policy_counts(meta, facts, sink)
    # Outputs of a pack size that is no multiple of m recorded bounds for the whole C before
    # packer counted only the ⌊C/m⌋·m tokens such sequences can fill: those stand too.
    older = report.quality(whole_capacity=True)
    for key, value in d["quality"].items():
        if not _same(_get(meta, f"quality.{key}"), older[key]):
            compare(sink, "metadata.quality", meta, f"quality.{key}", value)
    bridge = expected_bridge(report)
    for key, value in bridge.items():
        compare(sink, "metadata.bridge", meta, f"bridge.{key}", value)
    spec = report.spec
    pad_max = bool(spec.get("pad_to_max_length"))
    C = int(spec["pack_size"])
    compare(sink, "metadata.static", meta, "static.pack_len", C if pad_max else None)
    compare(sink, "metadata.static", meta, "static.cu_seqlens_len", bridge["max_samples_per_bin"] + 2)
    compare(sink, "metadata.static", meta, "static.max_seqlen",
            max(bridge["dataset_max_seqlen"], C - bridge["min_packed_seqlen"]) if pad_max
            else bridge["dataset_max_seqlen"])


def _check_tokens_lost(sink: FindingSink, policy, samples, lost, targets_lost) -> None:
    """Tokens lost against targets lost and over-long samples: a target is a token, and each
    sample truncated or dropped loses at least one token (it is longer than the pack)."""
    if lost is not None and targets_lost is not None and targets_lost > lost:
        sink.add("metadata.counts", f"counts.overlong.target_tokens_lost is {targets_lost} but only {lost} tokens "
                 "were lost", shard=METADATA_FILE)
    if policy in ("truncate", "drop") and lost is not None and samples is not None and (
            samples > lost or (samples == 0) != (lost == 0)):
        sink.add("metadata.counts", f"counts.overlong.tokens_lost is {lost} for {samples} over-long samples "
                 f"(policy {policy} loses at least one token of each, and none without one)", shard=METADATA_FILE)


def _check_policy_counts(meta: dict, facts: dict, sink: FindingSink) -> None:
    """What the over-long policy implies about its counts, and records = packed + left out."""
    counts = meta.get("counts") if isinstance(meta.get("counts"), dict) else {}
    over = counts.get("overlong") if isinstance(counts.get("overlong"), dict) else {}
    policy = _get(meta, "spec.overlong")
    compare(sink, "metadata.counts", meta, "counts.overlong.policy", policy, "the spec says")
    n = lambda v: v if type(v) is int else None  # noqa: E731
    samples, dropped = n(over.get("samples")), n(over.get("dropped"))
    if policy == "split":
        compare(sink, "metadata.counts", meta, "counts.overlong.samples", facts["multi_piece_samples"])
    if policy in ("split", "truncate", "error"):
        compare(sink, "metadata.counts", meta, "counts.overlong.dropped", 0, f"policy {policy} drops")
    if policy in ("split", "error"):
        compare(sink, "metadata.counts", meta, "counts.overlong.tokens_lost", 0, f"policy {policy} loses")
        compare(sink, "metadata.counts", meta, "counts.overlong.target_tokens_lost", 0, f"policy {policy} loses")
    _check_tokens_lost(sink, policy, samples, n(over.get("tokens_lost")), n(over.get("target_tokens_lost")))
    if policy == "error":
        compare(sink, "metadata.counts", meta, "counts.overlong.samples", 0, "policy error allows")
    if policy == "drop" and samples is not None:
        compare(sink, "metadata.counts", meta, "counts.overlong.dropped", samples, "overlong.samples says")
    if policy == "truncate" and samples is not None and samples > facts["at_cap_sequences"]:
        sink.add("metadata.counts", f"counts.overlong.samples is {samples} but only {facts['at_cap_sequences']} "
                 f"sequences are at the truncation length", shard=METADATA_FILE)
    if policy == "truncate":
        _compare_no_target_truncated(sink, meta, facts)
    else:
        compare(sink, "metadata.counts", meta, "counts.no_target_samples", facts["zero_target_samples"])
    parts = [n(counts.get(k)) for k in ("samples_packed", "too_short_dropped", "bad_records")] + [dropped]
    records = n(counts.get("records"))
    if records is not None and None not in parts and records != sum(parts):
        sink.add("metadata.counts", f"counts.records is {records} but samples_packed + too_short_dropped + "
                 f"bad_records + overlong.dropped = {sum(parts)}", shard=METADATA_FILE)
    listed, bad = meta.get("bad_records"), n(counts.get("bad_records"))
    if not isinstance(listed, list) or (bad is not None and len(listed) != min(bad, MAX_LISTED_BAD)):
        sink.add("metadata.counts", f"bad_records lists {len(listed) if isinstance(listed, list) else 'no'} "
                 f"records but counts.bad_records is {bad}", shard=METADATA_FILE)

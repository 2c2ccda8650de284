"""The result of a pack run: counts, quality against lower bounds, Bridge's metadata keys.

One object serves the summary table, ``--json`` and ``metadata.json`` so the three always agree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from packer_cli.errors import DataError
from packer_cli.plan.bounds import l2_of_histogram, usable_capacity
from packer_cli.shards.format import FORMAT_NAME, FORMAT_VERSION
from packer_cli.spec import OverlongPolicy, PackSpec


def bridge_keys(pack_load: np.ndarray, seqs_per_pack: np.ndarray, max_padded: int, sequences: int,
                pack_size: int) -> dict:
    """Megatron-Bridge's six metadata keys, in runtime tokens including alignment padding."""
    return {
        "dataset_max_seqlen": int(max_padded),
        "max_samples_per_bin": int(seqs_per_pack.max()),
        "packing_factor": round(float(sequences / pack_load.size), 2),
        "packing_efficiency": round(float(pack_load.mean() / pack_size * 100), 2),
        "pack_size": int(pack_size),
        "min_packed_seqlen": int(pack_load.min()),
    }


@dataclass
class PackSummary:
    spec: dict
    source: dict
    counts: dict
    quality: dict
    bridge: dict
    static: dict
    bad_records: list
    out: str | None
    dry_run: bool
    output: dict | None = None
    """Format-specific record (``--format megatron-bridge``: split, files, EOS id); None for native."""
    seconds: dict | None = None
    """Wall time of the run's phases: ``read`` (pass one: decode, validate, spill), ``plan``
    (sequences, plan, summary), ``write`` (pass two: gather, write, hash, rename into place) and
    ``total``. In the printed summary and ``--json``, never in ``metadata.json`` (the same inputs
    give the same bytes)."""
    spill: dict | None = None
    """How pass two read the spill (native shards and Bridge layouts alike): ``read`` (``random`` or ``staged``),
    ``bytes`` (the spill's size), ``room`` (the page cache ``auto`` judged it against) and, when
    staged, ``stages`` and ``stage_bytes``. Reported like ``seconds``, never in
    ``metadata.json``."""

    disk: dict | None = None
    """A dry run's estimate of what the real run writes: ``spill_bytes`` (of which
    ``spill_disk_bytes`` beyond ``--spill-memory``), ``output_bytes`` (native shards; None for a
    Bridge file, which is compressed) and ``free`` (bytes free where the output and the spill
    go, when known). Never in ``metadata.json``."""

    def to_dict(self) -> dict:
        record = {
            "out": self.out, "dry_run": self.dry_run, "spec": self.spec, "source": self.source,
            "counts": self.counts, "quality": self.quality, "bridge": self.bridge, "static": self.static,
            "bad_records": self.bad_records,
        }
        if self.output is not None:
            record["output"] = self.output
        if self.seconds is not None:
            record["seconds"] = self.seconds
        if self.spill is not None:
            record["spill"] = self.spill
        if self.disk is not None:
            record["disk"] = {k: v if k != "free" else {w: {"path": f["path"], "bytes": f["bytes"]} for w, f in v.items()}
                              for k, v in self.disk.items()}
        return record

    def metadata(self, version: str) -> dict:
        record = self.to_dict()
        record.pop("out")
        record.pop("dry_run")
        record.pop("seconds", None)
        record.pop("spill", None)
        record.pop("disk", None)
        record.update(format=FORMAT_NAME, format_version=FORMAT_VERSION, packer_version=version)
        return record


def _recorded_path(path: str) -> str:
    """``path`` made absolute as it leads: a '..' after a symbolic link goes to the link target's
    parent, which ``os.path.abspath`` (collapsing it as text) would not name."""
    if os.pardir not in path.split(os.sep):
        return os.path.abspath(path)
    return os.path.normpath(os.path.join(os.path.realpath(os.path.dirname(path) or os.curdir),
                                         os.path.basename(path)))  # 'x/..' named plainly


def _recorded_bad(bad_listed: list[dict]) -> list[dict]:
    """The bad records as recorded: each file named as ``source.inputs`` names it (absolute), not
    as typed, so that the same inputs record the same bytes wherever they were packed from."""
    return [{**bad, "path": _recorded_path(bad["path"])} for bad in bad_listed]


def _input_bytes(file) -> int:
    """An input's size, looked up once it has been read; one removed, moved or changed meanwhile
    is the input's error (a removed one was reported as the output failing to be written, exit 3;
    one replaced by a move gave exit 0 and recorded the new file's size, so that verifying the
    output against its source failed on a file the run never read)."""
    try:
        now = file.identity_now()
    except OSError as exc:
        raise DataError(f"{file.path}: the input is gone after it was read (removed or moved during the run?): "
                        f"{exc.strerror or exc}") from None
    if file.found_as and now != file.found_as:
        raise DataError(f"{file.path}: the input changed while this run read it (replaced, rewritten, cut or "
                        "appended to: its inode, size or modification time differ), so the output would not be "
                        "its; pack it again once it stays put")
    return sum(size for _, _, size, _ in now)


def summarize(*, spec: PackSpec, files, stream, read_counts, bad_listed, totals, overlong, padded_hist, plan,
              out, dry_run) -> PackSummary:
    """The run's record. ``totals`` are pass one's :class:`~packer_cli._sequences.ReadTotals`,
    ``padded_hist`` the histogram of the planned (padded) sequence lengths (index 0: dropped)."""
    C = spec.pack_size
    n_packs = plan.num_packs
    seqs_per_pack = np.diff(plan.pack_offsets)
    # The lengths present, not all C + 1 of them: at C = 2^24 a copy of the histogram and an
    # index vector of its size took 1.5 s (fresh pages) for what a few thousand entries say.
    hist = np.asarray(padded_hist, dtype=np.int64)
    lengths_present = np.flatnonzero(hist[1:]) + 1  # index 0 counts the dropped samples
    counts_present = hist[lengths_present]
    sequences = int(counts_present.sum())
    padded_total = int(counts_present @ lengths_present)
    max_padded = int(lengths_present[-1])
    policy = spec.overlong
    dropped = overlong.dropped
    runtime_total = totals.runtime_tokens
    targets_kept = totals.target_tokens
    no_target = totals.no_target
    if policy is OverlongPolicy.TRUNCATE:
        runtime_total -= totals.over_excess
        targets_kept -= totals.over_tail_targets
        # a sample kept without a target is one whose targets all lay past the cap, too
        no_target += totals.over_none_kept - totals.over_no_target
    elif policy is OverlongPolicy.DROP:
        runtime_total -= totals.over_runtime
        targets_kept -= totals.over_targets
        no_target -= totals.over_no_target
    usable = usable_capacity(C, spec.pad_multiple)
    lower = -(-padded_total // usable)
    l2 = l2_of_histogram(hist, usable)
    counts = {
        "records": read_counts["records"],
        "bad_records": read_counts["bad_records"],
        "too_short_dropped": read_counts["too_short"],
        "no_target_samples": int(no_target),
        "samples_packed": int(totals.samples - dropped),
        "sequences": sequences,
        "packs": int(n_packs),
        "runtime_tokens": int(runtime_total),
        "padded_tokens": padded_total,
        "target_tokens": int(targets_kept),
        "alignment_padding": padded_total - int(runtime_total),
        "tail_padding": n_packs * C - padded_total,
        "overlong": {
            "policy": policy.value,
            "samples": overlong.samples,
            "tokens_lost": overlong.tokens_lost,
            "target_tokens_lost": overlong.targets_lost,
            "extra_pieces": max(0, overlong.pieces - overlong.samples),
            "dropped": int(dropped),
        },
    }
    quality = {
        "plan": plan.algorithm,
        "efficiency": runtime_total / (n_packs * C),
        "fill": padded_total / (n_packs * C),
        "lower_bound": lower,
        "gap_to_lower_bound": n_packs - lower,
        "gap_to_lower_bound_pct": 100.0 * (n_packs - lower) / lower,
        "l2_bound": l2,
        "gap_to_l2": n_packs - l2,
        "gap_to_l2_pct": 100.0 * (n_packs - l2) / l2,
    }
    bridge = bridge_keys(plan.pack_load, seqs_per_pack, max_padded, sequences, C)
    static = {
        "pack_len": C if spec.pad_to_max_length else None,
        "cu_seqlens_len": bridge["max_samples_per_bin"] + 2,
        "max_seqlen": (max(bridge["dataset_max_seqlen"], C - bridge["min_packed_seqlen"])
                       if spec.pad_to_max_length else bridge["dataset_max_seqlen"]),
    }
    sup = stream.supervision
    source = {
        "inputs": [{"path": _recorded_path(f.path), "format": f.format, "bytes": _input_bytes(f)} for f in files],
        "tokens_field": stream.spec.tokens_field,
        "supervision": {"kind": sup.kind, "field": sup.field},
        "also_mask_fields": list(sup.also),
        "attention_field": stream.attention,
        "padding_dropped": stream.padding,
        "vocab_size": stream.spec.vocab_size,
        "on_bad_record": stream.spec.on_bad_record.value,
    }
    return PackSummary(spec=spec.as_dict(), source=source, counts=counts, quality=quality, bridge=bridge,
                       static=static, bad_records=_recorded_bad(bad_listed), out=out, dry_run=dry_run)

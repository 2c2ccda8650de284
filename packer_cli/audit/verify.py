"""``verify_output``: is an output complete, self-consistent and faithful to its source?

::

    layout ──▶ packs (streamed, shard by shard) ──▶ whole output ──▶ metadata ──▶ source
    metadata.json    columns, cu_seqlens, capacity,      duplicates,      counts,       every sample
    manifest.json    lengths, alignment, padding,        pieces           bounds,       packed once with
    (order, totals)  loss mask, token ids                                 Bridge keys   the same tokens
    files, sizes;                                                         (and Bridge's (--source only)
    then checksums                                                        own file)

The layout checks (:mod:`packer_cli.audit._layout_checks`) need no read of the shards' content;
``inspect`` runs them too.

Every problem becomes a :class:`~packer_cli.audit.findings.Finding` with its location; nothing
is asserted and nothing raises for bad data, so a corrupted output gives a report, never a
traceback. Only unusable *arguments* raise :class:`ConfigError` (exit code 2).

Memory: one record batch of tokens at a time plus a few integers per sequence (for the
duplicate, piece and source checks); the histograms are about C entries each.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from packer_cli.audit._bridge_checks import check_bridge_entries
from packer_cli.audit._layout_checks import (CHANGED, check_layout, directory_state, recorded_count,
                                           check_split_argument, require_directory)
from packer_cli.audit._meta_checks import check_metadata, check_provenance, expected_bridge
from packer_cli.audit._pack_checks import Sequences, check_batch
from packer_cli.audit.findings import ERROR, WARNING, Finding, FindingSink
from packer_cli.audit.report import InspectReport
from packer_cli.audit.store import ShardError
from packer_cli.errors import ConfigError, PackerError, counted, env_choice, interrupts_kept, reading_document
from packer_cli.sources.discover import input_paths, path_argument
from packer_cli.spec import is_int
from packer_cli.shards.format import METADATA_FILE
from packer_cli.shards.writer import file_checksum


def _rate(tokens_per_s: float) -> str:
    """Tokens a second in the unit that keeps its digits: a small output's "0M tokens/s" said nothing."""
    for scale, unit in ((1e6, "M "), (1e3, "k ")):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:,.0f}{unit}tokens/s"
    return f"{tokens_per_s:,.0f} tokens/s"


@dataclass
class VerifyReport:
    """The verdict of ``verify``: findings with locations, and what was checked how fast."""

    out: str
    findings: list[Finding] = field(default_factory=list)
    errors: dict = field(default_factory=dict)
    """Error findings per check, including those not listed."""
    warnings: dict = field(default_factory=dict)
    packs: int = 0
    sequences: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    source: dict | None = None
    """With ``--source``: inputs, records and samples compared."""

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def verdict(self) -> str:
        # a source skipped (the output unusable) or read only in part is not said to be checked
        scope = (f"{counted(self.packs, 'pack')}, {counted(self.tokens, 'token')}"
                 + (" and the source" if self.source and self.source["complete"] else ""))
        speed = f"in {self.seconds:.2f} s ({_rate(self.tokens_per_s)})"
        if self.ok:
            return f"verify: OK: {self.out} ({scope} checked {speed})"
        n = sum(self.errors.values())
        return (f"verify: FAILED: {n:,} problem{'s' if n > 1 else ''} in {len(self.errors)} "
                f"check{'s' if len(self.errors) > 1 else ''} ({', '.join(sorted(self.errors))}); {scope} {speed}")

    def to_dict(self) -> dict:
        return {
            "out": self.out, "ok": self.ok, "exit_code": self.exit_code, "errors": self.errors,
            "warnings": self.warnings, "findings": [f.to_dict() for f in self.findings],
            "packs": self.packs, "sequences": self.sequences, "tokens": self.tokens, "bytes": self.bytes,
            "seconds": self.seconds, "tokens_per_s": self.tokens_per_s, "source": self.source,
        }

    @classmethod
    def from_dict(cls, record: dict) -> "VerifyReport":
        """Inverse of :meth:`to_dict`; ValueError for a document it did not write. Unchecked, a
        count of ``-5`` printed "FAILED: -5 problem", ``"errors": {}`` beside error findings
        printed "OK", and a list where a count belongs failed later with a traceback."""
        keys = ("out", "errors", "warnings", "packs", "sequences", "tokens", "bytes", "seconds", "source")
        with reading_document("a verify report"):
            report = cls(findings=[Finding.from_dict(f) for f in record["findings"]], **{k: record[k] for k in keys})
        _check_document(report)
        return report

    def __rich__(self):
        from packer_cli.audit._render import render_verify

        return render_verify(self)


def _check_document(report: VerifyReport) -> None:
    """ValueError where a verify report read from a document is not one ``to_dict`` writes."""
    def count(x) -> bool:
        return type(x) is int and x >= 0

    problems = []
    if not isinstance(report.out, str):
        problems.append("out is not a path")
    for name in ("errors", "warnings"):
        tally = getattr(report, name)
        if not isinstance(tally, dict) or not all(isinstance(k, str) and count(v) and v for k, v in tally.items()):
            problems.append(f"{name} is not a count (at least 1) per check")
    problems += [f"{name} is not a count" for name in ("packs", "sequences", "tokens", "bytes")
                 if not count(getattr(report, name))]
    if type(report.seconds) not in (int, float) or not math.isfinite(report.seconds) or report.seconds < 0:
        problems.append("seconds is not a duration")
    if report.source is not None and not (isinstance(report.source, dict)
                                          and isinstance(report.source.get("complete"), bool)):
        problems.append("source is not a comparison's summary")
    if not problems:
        for finding in report.findings:
            tally = report.warnings if finding.severity == WARNING else report.errors
            if finding.severity not in (ERROR, WARNING) or finding.check not in tally:
                problems.append(f"finding of check {finding.check!r} is not counted in errors or warnings")
                break
    if problems:
        raise ValueError(f"not a verify report as to_dict() writes it: {problems[0]}")


def _check_shard_checksum(out: str, entry: dict, manifest_name: str, sink: FindingSink) -> bool:
    """``shard.checksum``: the file's xxh3_64 is the manifest's (a byte changed anywhere).
    False when the file cannot be read at all (``shard.unreadable``)."""
    if isinstance(entry.get("xxh3_64"), str):
        try:
            digest = file_checksum(os.path.join(out, entry["name"]))
        except OSError as exc:
            sink.add("shard.unreadable", f"cannot be read ({exc.strerror or exc})", shard=entry["name"])
            return False
        if digest != entry["xxh3_64"]:
            sink.add("shard.checksum", f"xxh3_64 is {digest} but {manifest_name} records {entry['xxh3_64']} "
                     f"(the file changed after it was written)", shard=entry["name"])
    return True


def _check_shard_rows(store, entry, first_pack, lim, sink, seqs, spec, out):
    """Stream one shard's batches through the pack checks; returns (stats, tokens read)."""
    name = entry["name"]
    stats, rows, tokens, complete = None, 0, 0, True
    try:
        for batch in store.read_shard(name):
            part = check_batch(batch, first_pack + rows, lim, sink, seqs, spec, out)
            stats = part if stats is None else stats + part
            rows += batch.num_rows
            tokens += int(batch.lengths("tokens").sum())
    except ShardError as exc:
        sink.add("shard.unreadable", exc.reason, shard=name, row=exc.row)
        complete = False
    except (ValueError, IndexError, OverflowError, MemoryError) as exc:  # defensive: report, never crash
        sink.add("shard.unreadable", f"could not be checked after row {rows} ({type(exc).__name__}: {exc})",
                 shard=name)
        complete = False
    for key, value, what in (("rows", rows, "packs"), ("tokens", tokens, "tokens")):
        recorded = recorded_count(entry, key)
        if complete and recorded is not None and value != recorded:
            sink.add(f"shard.{key}", f"{value:,} {what}, but {store.manifest_name} records {recorded:,}", shard=name)
    return stats, tokens


def _check_bridge_values(store, array: list, stats: InspectReport | None, sink: FindingSink) -> None:
    """This split's entry of Bridge's metadata array against the values the data gives (or,
    when no pack could be read, those its metadata records)."""
    if stats is not None and stats.packs > 0:
        check_bridge_entries(store, array, expected_bridge(stats), sink)
    elif isinstance(store.metadata.get("bridge"), dict):
        check_bridge_entries(store, array, store.metadata["bridge"], sink, f"{store.metadata_name} records")


def _not_compared(files) -> dict | None:
    """``source`` of a report whose inputs were not compared (``None`` without ``--source``)."""
    if files is None:
        return None
    from packer_cli.audit._source_check import incomplete_source

    return incomplete_source(files, 0)


@interrupts_kept
def verify_output(out: str, sources: list[str] | None = None, *, limit: int = 20,
                  split: str | None = None) -> VerifyReport:
    """Verify ``out``; with ``sources``, also replay those inputs and match every sample.

    Raises :class:`ConfigError` only when the arguments are unusable: ``out`` is not a
    directory or not a packer output at all, a source path cannot be found, or ``out`` is a
    Megatron-Bridge layout of several splits and ``split`` names none (one report is one split's). Every problem
    in the data is a finding in the returned report (at most ``limit`` listed per check).
    """
    start = time.perf_counter()
    out = path_argument(out, "out")  # a Path would reach the report's JSON document as is
    if not is_int(limit) or limit < 0:
        raise ConfigError(f"limit must be an integer >= 0 (problems listed per check), got {limit!r}")
    limit = int(limit)
    require_directory(out)
    check_split_argument(out, split, "verify")
    state = directory_state(out)
    files = None
    if sources is not None:
        sources = input_paths(sources, "sources")  # a bare string is one path, not one-letter names
    if sources:
        from packer_cli.sources import discover_inputs

        try:
            files = discover_inputs(sources)
        except PackerError as exc:
            raise ConfigError(f"--source: {exc}") from None
        from packer_cli.sources.readers import ENV_GZIP, GZIP_DECODERS

        env_choice(ENV_GZIP, GZIP_DECODERS)  # as pack checks it: a misspelt switch is the command's error
    sink = FindingSink(limit)
    layout = check_layout(out, sink, split)
    store, meta, entries, lim = layout.store, layout.metadata, layout.entries, layout.limits
    report = VerifyReport(out=out)
    stats, seqs = None, Sequences(fingerprint=files is not None)
    if entries is not None:
        first_pack = 0
        for entry in entries:
            if os.path.isfile(os.path.join(out, entry["name"])):  # shard.missing otherwise
                report.bytes += os.path.getsize(os.path.join(out, entry["name"]))
                readable = _check_shard_checksum(out, entry, store.manifest_name, sink)
                if lim is not None and readable:
                    part, tokens = _check_shard_rows(store, entry, first_pack, lim, sink, seqs, meta["spec"], out)
                    report.tokens += tokens
                    if part is not None:
                        stats = part if stats is None else stats + part
            first_pack += recorded_count(entry, "rows") or 0
    if lim is not None and entries is not None:
        arr = seqs.arrays()
        # Packs of a shard that could not be read, or that failed the pack checks, are not in
        # the data below: what the whole output determines cannot be compared with a part of it.
        unread = max(0, first_pack - stats.packs) if stats is not None else 0
        facts = check_provenance(arr, lim.cap, meta["spec"].get("overlong"), seqs, sink, complete=not unread)
        if unread:
            sink.warn("metadata.counts", f"{unread:,} of the {first_pack:,} packs could not be read soundly (the "
                      "findings above), so the recorded counts, quality and Bridge figures were not compared with "
                      "the data", shard=METADATA_FILE)
        else:
            check_metadata(meta, stats or InspectReport(out=out, spec=meta["spec"], recorded={}), facts, sink)
            if layout.bridge_array is not None:
                _check_bridge_values(store, layout.bridge_array, stats, sink)
        if files is not None:
            from packer_cli.audit._source_check import check_source

            report.source = check_source(files, meta, lim, arr, seqs, sink, store, unread=unread)
    elif files is not None:
        sink.add("source.skipped", "the output itself is unusable, so the source was not compared")
        report.source = _not_compared(files)
    if directory_state(out) != state:  # what was read may be of two outputs: its findings and figures are of neither
        sink = FindingSink(limit)
        sink.add("structure.changed", f"{out} changed {CHANGED}: what was read may be of two outputs; verify it again")
        stats, report = None, VerifyReport(out=out, source=_not_compared(files))
    if stats is not None:
        report.packs, report.sequences = stats.packs, stats.sequences
    report.findings = sink.findings()
    report.errors, report.warnings = sink.counts(ERROR), sink.counts(WARNING)
    report.seconds = time.perf_counter() - start
    return report


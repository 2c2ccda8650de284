"""``verify_output``: is an output complete, self-consistent and faithful to its source?

::

    structure ──▶ packs (streamed, shard by shard) ──▶ whole output ──▶ metadata ──▶ source
    metadata.json    columns, cu_seqlens, capacity,      duplicates,      counts,       every sample
    manifest.json    lengths, alignment, padding,        pieces           bounds,       packed once with
    files, sizes,    loss mask, token ids                                 Bridge keys   the same tokens
    checksums                                                                           (--source only)

Every problem becomes a :class:`~packer_cli.audit.findings.Finding` with its location; nothing
is asserted and nothing raises for bad data, so a corrupted output gives a report, never a
traceback. Only unusable *arguments* raise :class:`ConfigError` (exit code 2).

Memory: one record batch of tokens at a time plus a few integers per sequence (for the
duplicate, piece and source checks); the histograms are about C entries each.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from packer_cli.audit._meta_checks import check_metadata, check_provenance
from packer_cli.audit._meta_schema import check_schema
from packer_cli.audit._pack_checks import Limits, Sequences, check_batch
from packer_cli.audit.findings import ERROR, WARNING, Finding, FindingSink
from packer_cli.audit.report import InspectReport
from packer_cli.audit.store import STORES, NativeStore, ShardError, manifest_problems, read_json_file
from packer_cli.errors import ConfigError, DataError, PackerError
from packer_cli.shards.format import FORMAT_NAME, MANIFEST_FILE, METADATA_FILE, metadata_checksum_problem
from packer_cli.shards.writer import file_checksum
from packer_cli.spec import PackSpec


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
        scope = f"{self.packs:,} packs, {self.tokens:,} tokens" + (" and the source" if self.source else "")
        speed = f"in {self.seconds:.2f} s ({self.tokens_per_s / 1e6:,.0f}M tokens/s)"
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
        keys = ("out", "errors", "warnings", "packs", "sequences", "tokens", "bytes", "seconds", "source")
        return cls(findings=[Finding.from_dict(f) for f in record["findings"]], **{k: record[k] for k in keys})

    def __rich__(self):
        from packer_cli.audit._render import render_verify

        return render_verify(self)


def _load(out: str, name: str, sink: FindingSink) -> dict | None:
    try:
        return read_json_file(os.path.join(out, name))
    except DataError as exc:
        sink.add("structure.json", str(exc).split(": ", 1)[-1], shard=name)
        return None


def _open_output(out: str, listing: list[str], sink: FindingSink, split: str | None = None):
    """``(store, metadata, shard entries)`` of ``out``; None for each part that is unusable.

    The native layout is opened piece by piece so that a broken metadata.json still lets the
    shards be checked against the manifest. Another registered format is opened by its store,
    found by the ``format`` in metadata.json or by the store's ``detect(out)``.
    """
    if METADATA_FILE not in listing:
        for cls in STORES.values():
            if getattr(cls, "detect", None) and cls.detect(out):
                try:
                    store = cls.open(out, split=split)
                except DataError as exc:
                    sink.add("structure.manifest", str(exc))
                    return None, None, None
                return store, store.metadata, store.shard_entries()
        if MANIFEST_FILE not in listing:
            raise ConfigError(f"{out}: not a packer output (neither {METADATA_FILE} nor {MANIFEST_FILE} is there)")
        sink.add("structure.json", "missing", shard=METADATA_FILE)
        meta = None
    else:
        meta = _load(out, METADATA_FILE, sink)
    fmt = meta.get("format") if meta else FORMAT_NAME
    if fmt != FORMAT_NAME and fmt in STORES:
        try:
            store = STORES[fmt].open(out, meta)
        except DataError as exc:
            sink.add("structure.manifest", str(exc))
            return None, meta, None
        return store, meta, store.shard_entries()
    manifest = _load(out, MANIFEST_FILE, sink)
    if manifest is None:
        return None, meta, None
    problems = manifest_problems(manifest, meta)
    for problem in problems:
        sink.add("structure.manifest", problem, shard=MANIFEST_FILE)
    return (None, meta, None) if problems else (NativeStore(out, meta or {}, manifest), meta, manifest["shards"])


def _limits(meta: dict | None, sink: FindingSink) -> Limits | None:
    """The recorded spec as limits, or None (with a finding) when it cannot be used."""
    if meta is None:
        return None
    fmt, version = meta.get("format"), meta.get("format_version")
    known = STORES.get(fmt) if isinstance(fmt, str) else None
    readable = _versions(known) if known is not None else None
    if known is None or (readable is not None and (type(version) is not int or version not in readable)):
        knows = ", ".join(f"{name!r} version {' or '.join(map(str, _versions(cls) or ('?',)))}"
                          for name, cls in STORES.items())
        sink.add("structure.format", f"format {fmt!r} version {version!r} is unknown; this packer knows {knows}",
                 shard=METADATA_FILE)
        return None
    record = meta.get("spec")
    try:
        spec = PackSpec.from_dict(record).validate()
    except (PackerError, TypeError, ValueError, KeyError, AttributeError) as exc:
        sink.add("metadata.spec", f"the spec is unusable ({exc}); pack checks skipped", shard=METADATA_FILE)
        return None
    if record.get("pad_seq_to_mult") != spec.pad_multiple:
        sink.add("metadata.spec", f"spec.pad_seq_to_mult is {record.get('pad_seq_to_mult')!r} but CP={spec.cp}, "
                 f"TP={spec.tp}, SP={spec.sp} give {spec.pad_multiple}", shard=METADATA_FILE)
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    vocab = source.get("vocab_size") if type(source.get("vocab_size")) is int else None
    counts = meta.get("counts") if isinstance(meta.get("counts"), dict) else {}
    records = counts.get("records") if type(counts.get("records")) is int else None
    return Limits(C=spec.pack_size, m=spec.pad_multiple, cap=spec.max_sequence_length, pad_id=spec.pad_id,
                  vocab=vocab, records=records)


def _versions(store) -> tuple | None:
    """The format versions a store class reads (None: it checks its own version when opened)."""
    if getattr(store, "versions", None):
        return tuple(store.versions)
    return (store.version,) if hasattr(store, "version") else None


def _check_files(out: str, listing: list[str], expected: set[str], sink: FindingSink) -> None:
    for name in sorted(set(listing) - expected):
        kind = "directory" if os.path.isdir(os.path.join(out, name)) else "file"
        sink.add("structure.files", f"unexpected {kind}, not listed in {MANIFEST_FILE}", shard=name)


def _recorded(entry: dict, key: str):
    value = entry.get(key)
    return value if type(value) is int else None


def _check_shard_file(out: str, entry: dict, sink: FindingSink) -> int:
    """Presence, size and checksum of one shard; returns its size (0 when missing)."""
    name, path = entry["name"], os.path.join(out, entry["name"])
    if not os.path.isfile(path):
        sink.add("shard.missing", f"listed in {MANIFEST_FILE} but missing", shard=name)
        return 0
    size = os.path.getsize(path)
    if _recorded(entry, "bytes") is not None and size != entry["bytes"]:
        sink.add("shard.size", f"{size:,} bytes, but {MANIFEST_FILE} records {entry['bytes']:,} (truncated or "
                 f"rewritten)", shard=name)
    if isinstance(entry.get("xxh3_64"), str):
        digest = file_checksum(path)
        if digest != entry["xxh3_64"]:
            sink.add("shard.checksum", f"xxh3_64 is {digest} but {MANIFEST_FILE} records {entry['xxh3_64']} "
                     f"(the file changed after it was written)", shard=name)
    return size


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
        recorded = _recorded(entry, key)
        if complete and recorded is not None and value != recorded:
            sink.add(f"shard.{key}", f"{value:,} {what}, but {MANIFEST_FILE} records {recorded:,}", shard=name)
    return stats, tokens


def verify_output(out: str, sources: list[str] | None = None, *, limit: int = 20,
                  split: str | None = None) -> VerifyReport:
    """Verify ``out``; with ``sources``, also replay those inputs and match every sample.

    Raises :class:`ConfigError` only when the arguments are unusable: ``out`` is not a
    directory or not a packer output at all, or a source path cannot be found. Every problem
    in the data is a finding in the returned report (at most ``limit`` listed per check).
    """
    start = time.perf_counter()
    if not os.path.isdir(out):
        raise ConfigError(f"{out}: not a directory")
    files = None
    if sources:
        from packer_cli.sources import discover_inputs

        try:
            files = discover_inputs(list(sources))
        except PackerError as exc:
            raise ConfigError(f"--source: {exc}") from None
    listing = os.listdir(out)
    sink = FindingSink(limit)
    store, meta, entries = _open_output(out, listing, sink, split)
    lim = _limits(meta, sink)
    if meta is not None and (problem := metadata_checksum_problem(meta)):
        sink.add("metadata.checksum", problem, shard=METADATA_FILE)
    if lim is not None:
        check_schema(meta, sink)
    report = VerifyReport(out=out)
    stats, seqs = None, Sequences(fingerprint=files is not None)
    if entries is not None:
        _check_files(out, listing, store.expected_files(), sink)
        first_pack = 0
        for entry in entries:
            report.bytes += _check_shard_file(out, entry, sink)
            if lim is not None and os.path.isfile(os.path.join(out, entry["name"])):
                part, tokens = _check_shard_rows(store, entry, first_pack, lim, sink, seqs, meta["spec"], out)
                report.tokens += tokens
                if part is not None:
                    stats = part if stats is None else stats + part
            first_pack += _recorded(entry, "rows") or 0
    if lim is not None and entries is not None:
        arr = seqs.arrays()
        facts = check_provenance(arr, lim.cap, meta["spec"].get("overlong"), seqs, sink)
        check_metadata(meta, stats or InspectReport(out=out, spec=meta["spec"], recorded={}), facts, sink)
        if files is not None:
            from packer_cli.audit._source_check import check_source

            report.source = check_source(files, meta, lim, arr, seqs, sink, store)
    elif files is not None:
        sink.add("source.skipped", "the output itself is unusable, so the source was not compared")
    if stats is not None:
        report.packs, report.sequences = stats.packs, stats.sequences
    report.findings = sink.findings()
    report.errors, report.warnings = sink.counts(ERROR), sink.counts(WARNING)
    report.seconds = time.perf_counter() - start
    return report


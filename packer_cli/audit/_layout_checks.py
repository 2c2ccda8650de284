"""The checks of an output that need no read of its shards' content, shared by verify and inspect.

::

    metadata.json  parses; known format and version; usable spec; schema; self-checksum
    manifest.json  parses; entries well-formed; entry i is the writer's shard i; totals = metadata counts
    directory      nothing unexpected; every listed shard there, with its recorded size
    Bridge         {C}_metadata.jsonl parses and has Bridge's keys (audit._bridge_checks)

Each is a JSON read or a stat, never a pass over the shards, so ``inspect`` runs all of them
before it summarizes (an output that fails one is not summarized) and ``verify`` runs them
before it hashes and streams the shards.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from packer_cli.audit._meta_schema import check_schema
from packer_cli.audit.findings import ERROR, Finding, FindingSink
from packer_cli.audit.store import STORES, NativeStore, manifest_problems, read_json_file
from packer_cli.errors import ConfigError, DataError, PackerError, not_a_directory
from packer_cli.shards.bridge import (BRIDGE_FORMAT, SPLITS, is_bridge_dir, packer_splits_in, split_has_files,
                                       splits_in)
from packer_cli.shards.format import FORMAT_NAME, MANIFEST_FILE, METADATA_FILE, metadata_checksum_problem
from packer_cli.spec import PackSpec, bridge_pack_size_problem


@dataclass(frozen=True)
class Limits:
    """What the recorded spec allows (the pack checks' bounds)."""

    C: int
    m: int
    cap: int
    pad_id: int
    vocab: int | None
    records: int | None = None
    """Records the run read (metadata counts.records): every source index must be below it."""
    window: int | None = None
    """``spec.window``: no pack may hold records of two windows of this many records."""
    ordered: bool = False
    """The packs are in plan order (``spec.shuffle`` off): with ``window``, windows never go back."""


@dataclass
class Layout:
    """What the layout checks found usable; None for each part that is not."""

    store: object | None
    metadata: dict | None
    entries: list[dict] | None
    """The manifest's shard entries, each an object with a safe ``name`` and counts."""
    limits: Limits | None
    """The recorded spec as limits (None: pack checks cannot run)."""
    bridge_array: list | None = None
    """A Bridge layout's ``{C}_metadata.jsonl`` entries, when the file could be read."""


class InconsistentOutput(DataError):
    """An output that fails the layout checks, so it is not ``refused`` (summarized, loaded);
    ``findings`` are verify's, the message one line with the first finding of each failed check."""

    def __init__(self, out: str, findings: list[Finding], errors: dict[str, int], refused: str):
        self.out, self.findings, self.errors, self.refused = out, findings, errors, refused
        n = sum(errors.values())
        first = {}  # one line for each failed check, in the order they were found
        for finding in findings:
            first.setdefault(finding.check, finding.line())
        super().__init__(f"{out}: not {refused}, {n} problem{'s' if n > 1 else ''} in {len(errors)} "
                         f"check{'s' if len(errors) > 1 else ''}: {'; '.join(first.values())}; "
                         f"run `packer verify` for a full report")

    def __reduce__(self):  # pickle's default calls the class with the message alone
        return type(self), (self.out, self.findings, self.errors, self.refused)


def raise_if_inconsistent(out: str, sink: FindingSink, refused: str, ignore: tuple[str, ...] = ()) -> None:
    """Raise :class:`InconsistentOutput` when ``sink`` holds errors, those of checks starting
    with an ``ignore`` prefix aside."""
    errors = {check: n for check, n in sink.counts(ERROR).items() if not check.startswith(ignore)}
    if errors:
        findings = [f for f in sink.findings() if f.severity == ERROR and f.check in errors]
        raise InconsistentOutput(out, findings, errors, refused)


def require_directory(out: str) -> None:
    """:class:`ConfigError` unless ``out`` is a directory, worded as ``pack`` words a missing
    input: a path that does not exist is not called "not a directory"."""
    if not os.path.isdir(out):
        raise ConfigError(not_a_directory(out))


def directory_state(out: str) -> tuple[int, int, int] | None:
    """(device, inode, modification time) of the directory ``out``: another directory renamed
    into its place (``pack --overwrite``) or files renamed in or out of it (a Bridge split
    committed into it) change it, and an audit reading meanwhile mixes two outputs."""
    try:
        st = os.stat(out)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


CHANGED = "while it was read (another run writing it: pack --overwrite, a Bridge split committed into it?)"


def check_split_argument(out: str, split, verb: str) -> None:
    """:class:`ConfigError` for a ``split`` that cannot be audited: not a split's name, or one
    this Bridge layout never held (reported as damage, a missing manifest, exit 1); or none
    named where the layout holds several: the API's one report is one split's, and the first
    alone would be audited (the others' damage passed by). ``packer verify`` and ``packer
    inspect`` name each split in turn. A native output given a split is refused where it is
    opened."""
    bridge = os.path.isdir(out) and not os.path.exists(os.path.join(out, METADATA_FILE))
    if split is not None:
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if bridge and is_bridge_dir(out) and not split_has_files(out, split):
            raise ConfigError(f"{out} holds no {split!r} split (it holds: {', '.join(packer_splits_in(out))}); "
                              "pass one of those as split=")
    elif bridge:
        present = splits_in(out)
        if len(present) > 1:
            raise ConfigError(f"{out} holds the splits {', '.join(present)}: name the one to {verb} "
                              f"(split=...), or {verb} each in turn as `packer {verb}` does")


def check_layout(out: str, sink: FindingSink, split: str | None = None) -> Layout:
    """Run every check that needs no read of the shards' content; findings go to ``sink``.

    Raises :class:`ConfigError` only when ``out`` is not a packer output at all.
    """
    try:
        listing = os.listdir(out)
    except OSError as exc:
        raise ConfigError(f"{out}: cannot list the directory ({exc.strerror or exc})") from None
    store, meta, entries = _open_output(out, listing, sink, split)
    if store is not None:  # findings name this output's JSON files (a Bridge split's own)
        sink.files.update({METADATA_FILE: store.metadata_name, MANIFEST_FILE: store.manifest_name})
    layout = Layout(store, meta, entries, _limits(meta, sink))
    if meta is not None and (problem := metadata_checksum_problem(meta)):
        sink.add("metadata.checksum", problem, shard=METADATA_FILE)
    if layout.limits is not None:
        check_schema(meta, sink)
    if entries is None:
        return layout
    _check_files(out, listing, store.expected_files(), store.manifest_name, sink)
    check_shard_order(store, entries, sink)
    check_totals(meta, entries, store.manifest_name, sink)
    for entry in entries:
        check_shard_size(out, entry, store.manifest_name, sink)
    if store.format == BRIDGE_FORMAT:
        from packer_cli.audit._bridge_checks import (  # Bridge's modules, only for a Bridge split
            check_bridge_array, check_file_facts, check_split_metadata_present)

        check_split_metadata_present(store, sink)
        check_file_facts(store, sink)
        layout.bridge_array = check_bridge_array(store, sink)
    return layout


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
                    sink.add(getattr(exc, "check", "structure.manifest"), str(exc))
                    return None, None, None
                return store, store.metadata, store.shard_entries()
        if MANIFEST_FILE not in listing:
            raise ConfigError(f"{out}: not a packer output (neither {METADATA_FILE} nor {MANIFEST_FILE} is there)")
    if split is not None:  # a native output has no splits: --split names something that is not there
        raise ConfigError(f"{out}: --split {split} applies to a Megatron-Bridge layout; this is a native output")
    if METADATA_FILE not in listing:
        sink.add("structure.json", "missing", shard=METADATA_FILE)
        meta = None
    else:
        meta = _load(out, METADATA_FILE, sink)
    fmt = meta.get("format") if meta else FORMAT_NAME
    if fmt != FORMAT_NAME and isinstance(fmt, str) and fmt in STORES:  # a list or object is not a name
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
    if fmt == BRIDGE_FORMAT and (problem := bridge_pack_size_problem(spec)):  # written before pack refused it
        sink.add("metadata.spec", problem, shard=METADATA_FILE)
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    vocab = source.get("vocab_size") if type(source.get("vocab_size")) is int else None
    _check_padding_ids(meta, spec, vocab, sink)
    counts = meta.get("counts") if isinstance(meta.get("counts"), dict) else {}
    records = counts.get("records") if type(counts.get("records")) is int else None
    return Limits(C=spec.pack_size, m=spec.pad_multiple, cap=spec.max_sequence_length, pad_id=spec.pad_id,
                  vocab=vocab, records=records, window=spec.window, ordered=not spec.shuffle)


def _check_padding_ids(meta: dict, spec: PackSpec, vocab: int | None, sink: FindingSink) -> None:
    """The ids written as padding (the pad id; a Bridge layout's EOS id) are input tokens like
    any other, so they too must be below a recorded vocabulary size."""
    if vocab is None:
        return
    output = meta.get("output") if isinstance(meta.get("output"), dict) else {}
    for name, value in (("spec.pad_id", spec.pad_id), ("output.eos_id", output.get("eos_id"))):
        if type(value) is int and value >= vocab:
            sink.add("metadata.spec", f"{name} {value} is not below source.vocab_size {vocab}: padding would "
                     "feed the model an id outside its vocabulary", shard=METADATA_FILE)


def _versions(store) -> tuple | None:
    """The format versions a store class reads (None: it checks its own version when opened)."""
    if getattr(store, "versions", None):
        return tuple(store.versions)
    return (store.version,) if hasattr(store, "version") else None


def _check_files(out: str, listing: list[str], expected: set[str], manifest_name: str, sink: FindingSink) -> None:
    for name in sorted(set(listing) - expected):
        kind = "directory" if os.path.isdir(os.path.join(out, name)) else "file"
        sink.add("structure.files", f"unexpected {kind}, not listed in {manifest_name}", shard=name)


def recorded_count(entry: dict, key: str) -> int | None:
    value = entry.get(key)
    return value if type(value) is int else None


def check_shard_order(store, entries: list[dict], sink: FindingSink) -> None:
    """``structure.order``: entry i names the file the writer wrote as shard i. The manifest
    has no checksum, and its order is the pack order, so a reordered list is caught only here."""
    for i, entry in enumerate(entries):
        expected = store.shard_name(i)
        if expected is not None and entry["name"] != expected:
            sink.add("structure.order", f"shard entry {i} is {entry['name']}, but the writer names shard {i} "
                     f"{expected} (entries reordered, removed or renamed)", shard=MANIFEST_FILE)


def check_totals(meta: dict | None, entries: list[dict], manifest_name: str, sink: FindingSink) -> None:
    """``structure.totals``: the shards' packs and tokens add up to the metadata's counts, so an
    entry removed from (or added to) the manifest is caught without reading a shard."""
    counts = meta.get("counts") if isinstance(meta, dict) else None
    if not isinstance(counts, dict):
        return  # metadata.schema reports it
    for key, total, what in (("rows", "packs", "packs"), ("tokens", "padded_tokens", "runtime tokens (Σp)")):
        listed = [recorded_count(entry, key) for entry in entries]
        recorded = counts.get(total)
        if type(recorded) is int and None not in listed and sum(listed) != recorded:
            sink.add("structure.totals", f"its {len(listed)} shards hold {sum(listed):,} {what} in all, but "
                     f"counts.{total} is {recorded:,} (a shard entry is missing, added or edited)",
                     shard=manifest_name)


def check_shard_size(out: str, entry: dict, manifest_name: str, sink: FindingSink) -> None:
    """``shard.missing`` / ``shard.size``: the listed shard is there, with its recorded size."""
    name, path = entry["name"], os.path.join(out, entry["name"])
    if not os.path.isfile(path):
        what = "not a regular file (a directory, FIFO, socket or device)" if os.path.exists(path) else "missing"
        sink.add("shard.missing", f"listed in {manifest_name} but {what}", shard=name)
        return
    size = os.path.getsize(path)
    if recorded_count(entry, "bytes") is not None and size != entry["bytes"]:
        sink.add("shard.size", f"{size:,} bytes, but {manifest_name} records {entry['bytes']:,} (truncated or "
                 f"rewritten)", shard=name)

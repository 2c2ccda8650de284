"""`pack()`: read → plan → write, the typed API the CLI is a thin layer over.

::

    inputs ─read─▶ spill (tokens, targets) + lengths ─sequences─▶ padded lengths
           ─plan─▶ packs ─shuffle─▶ gather ─▶ packs-*.arrow ─▶ manifest.json, metadata.json ─rename─▶ OUT

Pass one streams every input once, validating records and appending their tokens to flat
spill files in the temporary output directory; only per-sample lengths stay in memory. The
plan needs only the padded lengths. Pass two gathers each pack's tokens from the spill with a
compiled kernel (``pread`` straight into the output buffers, so no spill page is ever resident)
and writes and hashes the shards. Everything is written into a temporary sibling directory
that is renamed into place at the end, so OUT either is complete or absent.

Both passes use both cores: in pass one a reader thread decodes and validates the next batch
while this thread spills the previous one; in pass two two threads gather runs of packs while
this thread writes them in order. The kernels, Arrow's decoder and the file writes release
the GIL; memory stays bounded by a few batches in flight.
"""
from __future__ import annotations

import os
import shutil
from contextlib import closing
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from packer_cli import __version__
from packer_cli._background import background, ordered_map
from packer_cli._sequences import SequenceTable, build_sequences
from packer_cli._summary import PackSummary, summarize
from packer_cli.errors import ConfigError, DataError
from packer_cli.plan import plan_packs
from packer_cli.progress import Progress
from packer_cli.shards._atomic import replace_dir
from packer_cli.shards._gather import SpillReader, output_order
from packer_cli.shards.bridge_output import BridgeOutput
from packer_cli.shards.format import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, METADATA_FILE, seal_metadata
from packer_cli.shards.writer import ShardWriter, pack_record_batch
from packer_cli.sources import SampleStream, discover_inputs
from packer_cli.spec import PackSpec, SourceSpec

DEFAULT_SHARD_BYTES = 256 << 20
BATCH_TOKENS = 8 << 20  # tokens per record batch: bounds gather memory (~45 MB)
MAX_LISTED_BAD = 1000


@dataclass
class _Samples:
    """Per-sample columns collected in pass one (the only per-sample state kept in memory).

    Columns are stored in the narrowest safe dtype (int32 unless a value needs more), so the
    resident cost stays at 16 bytes per sample however many tokens the samples hold.
    """

    lengths: list = field(default_factory=list)
    source_index: list = field(default_factory=list)
    targets: list = field(default_factory=list)
    tail_targets: list = field(default_factory=list)

    def add(self, lengths: np.ndarray, source_index: np.ndarray, targets: np.ndarray, tail: np.ndarray) -> None:
        self.lengths.append(_narrow(lengths))
        self.source_index.append(_narrow(source_index))
        self.targets.append(_narrow(targets))
        self.tail_targets.append(_narrow(tail))

    def arrays(self):
        """The four columns, concatenated; the per-batch pieces are released."""
        def cat(parts: list) -> np.ndarray:
            out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            parts.clear()
            return out

        return cat(self.lengths), cat(self.source_index), cat(self.targets), cat(self.tail_targets)


def _narrow(values: np.ndarray) -> np.ndarray:
    """int32 when every value fits, else int64 (concatenation promotes mixed pieces)."""
    if values.size == 0 or (values.min() >= -(2**31) and values.max() < 2**31):
        return values.astype(np.int32, copy=False)
    return values.astype(np.int64, copy=False)


def _target_counts(batch, cap: int):
    """Runtime targets per sample (Σ targets[1:n]) and those past a truncation at ``cap``."""
    from packer_cli.sources._kernels import target_counts

    runtime = np.empty(batch.lengths.size, dtype=np.int64)
    tail = np.empty(batch.lengths.size, dtype=np.int64)
    target_counts(batch.targets, batch.lengths, cap, runtime, tail)
    return runtime, tail


def _read_inputs(stream: SampleStream, spill_dir: str | None, cap: int, progress: Progress):
    """Pass one: validate, spill tokens/targets, keep lengths and counts."""
    samples = _Samples()
    counts = {"records": 0, "too_short": 0, "bad_records": 0}
    bad_listed: list[dict] = []
    tok_file = tgt_file = None
    if spill_dir:
        tok_file = open(os.path.join(spill_dir, "tokens.bin"), "wb")
        tgt_file = open(os.path.join(spill_dir, "targets.bin"), "wb")
    try:
        task = progress.task("reading", total=None, unit="samples")
        with closing(background(iter(stream), depth=2)) as validated:  # read + validate on a second core
            for batch in validated:
                _take(batch, counts, bad_listed, samples, cap, tok_file, tgt_file)
                progress.advance(task, batch.records)
    finally:
        if tok_file:
            tok_file.close()
            tgt_file.close()
    return samples, counts, bad_listed


def _take(batch, counts: dict, bad_listed: list, samples: _Samples, cap: int, tok_file, tgt_file) -> None:
    """Count one validated batch, keep its per-sample columns and spill its tokens and targets."""
    counts["records"] += batch.records
    counts["too_short"] += batch.too_short
    counts["bad_records"] += len(batch.bad)
    for bad in batch.bad[: max(0, MAX_LISTED_BAD - len(bad_listed))]:
        bad_listed.append({"path": bad.path, "row": bad.row, "line": bad.line, "reason": bad.reason})
    if batch.lengths.size:
        runtime, tail = _target_counts(batch, cap)
        samples.add(batch.lengths, batch.source_index, runtime, tail)
        if tok_file:
            batch.tokens.tofile(tok_file)
            batch.targets.tofile(tgt_file)


def _output_sequences(plan, pack_order: np.ndarray):
    """Sequence indices in output order and the per-output-pack offsets into them."""
    return output_order(plan.order, plan.pack_offsets, np.ascontiguousarray(pack_order, dtype=np.int64))


def _runs(pack_tokens: np.ndarray):
    """(first, end) output packs of each record batch: about ``BATCH_TOKENS`` tokens, at least one pack."""
    n_packs = pack_tokens.size - 1
    a = 0
    while a < n_packs:
        b = int(np.searchsorted(pack_tokens, pack_tokens[a] + BATCH_TOKENS, side="right")) - 1
        b = min(max(b, a + 1), n_packs)
        yield a, b
        a = b


def _write_shards(tmp: str, spill_dir: str, seqs: SequenceTable, sample_start, source_index,
                  plan, pack_order, spec: PackSpec, shard_bytes: int, progress: Progress) -> list[dict]:
    """Pass two: two threads gather runs of packs (``pread`` from the spill, compiled, GIL
    released) while this thread writes and hashes the record batches in order."""
    order, pack_offsets = _output_sequences(plan, pack_order)
    pack_tokens = np.concatenate([[0], np.cumsum(plan.pack_load[pack_order])])
    writer = ShardWriter(tmp, shard_bytes)
    task = progress.task("writing", total=pack_order.size, unit="packs")

    def gather(spill: SpillReader, a: int, b: int):
        s0, s1 = pack_offsets[a], pack_offsets[b]
        run_offsets = pack_offsets[a:b + 1] - s0
        run = order[s0:s1]
        tokens, mask, last, cu, buffers = spill.gather(
            sample_start, seqs.sample, seqs.offset, seqs.length, seqs.padded, run, run_offsets, spec.pad_id,
            min_buffer=BATCH_TOKENS + spec.pack_size,
        )
        batch = pack_record_batch(tokens, mask, cu, seqs.length[run], last, source_index[seqs.sample[run]],
                                  seqs.offset[run], run_offsets)
        return batch, int(tokens.size), b - a, buffers

    with SpillReader(spill_dir) as spill:
        runs = ordered_map(lambda run: gather(spill, *run), _runs(pack_tokens), workers=2, ahead=3)
        with closing(runs) as gathered:
            for batch, n_tokens, n_packs, buffers in gathered:
                writer.write(batch, n_tokens)
                del batch  # the file holds the bytes now; the buffers can take the next run
                spill.recycle(buffers)
                progress.advance(task, n_packs)
    return writer.finish()


def _write_json(path: str, obj) -> None:
    import orjson

    with open(path, "wb") as f:
        f.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")


def _prepare_out(out: str, overwrite: bool) -> str:
    out = os.path.normpath(out)
    if os.path.exists(out) and not overwrite:
        raise ConfigError(f"{out} already exists; pass --overwrite to replace it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"{out} exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ConfigError(f"{parent}: output parent directory does not exist")
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def pack(
    inputs: list[str],
    out: str | None,
    spec: PackSpec,
    source: SourceSpec = SourceSpec(),
    *,
    overwrite: bool = False,
    dry_run: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = False,
    warn: Callable[[str], None] | None = None,
    output: BridgeOutput | None = None,
) -> PackSummary:
    """Pack tokenized samples from ``inputs`` into ``out`` (nothing is written with ``dry_run``).

    ``output``: a :class:`~packer_cli.shards.bridge_output.BridgeOutput` writes Megatron-Bridge's
    Parquet layout (one split per call) instead of native shards, from the same plan.

    Raises :class:`ConfigError` for unusable options and :class:`DataError` for bad data;
    on any error nothing is left at ``out``.
    """
    spec.validate()
    source.validate()
    if shard_bytes < 1:
        raise ConfigError(f"shard size must be positive, got {shard_bytes}")
    files = discover_inputs(list(inputs))
    if not dry_run and not out:
        raise ConfigError("an output directory (-o OUT) is required unless --dry-run")
    if output:
        output.validate()
    tmp = None if dry_run else (output.prepare(out, overwrite, spec) if output else _prepare_out(out, overwrite))
    spill_dir = None
    try:
        if tmp:
            spill_dir = os.path.join(tmp, "_spill")
            os.makedirs(spill_dir)
        with Progress(enabled=progress) as bar:
            stream = SampleStream(files, source)
            samples, read_counts, bad_listed = _read_inputs(stream, spill_dir, spec.max_sequence_length, bar)
            lengths, source_index, targets, tail_targets = samples.arrays()
            if read_counts["records"] == 0:
                raise DataError(f"{files[0].path}: empty input (no records)")
            seqs, overlong, dropped = build_sequences(
                lengths, tail_targets, targets, spec,
                locate=lambda k: stream.locate(int(source_index[k])),
            )
            if seqs.padded.size == 0:
                raise DataError("no samples left to pack (all were too short, bad or dropped)")
            task = bar.task("planning", total=None, unit="sequences")
            plan = plan_packs(seqs.padded, spec.pack_size, spec.algorithm.value, seed=spec.seed,
                              refine=spec.refines)
            bar.advance(task, seqs.padded.size)
            pack_order = (np.random.default_rng(spec.seed).permutation(plan.num_packs)
                          if spec.shuffle else np.arange(plan.num_packs))
            manifest = None
            if tmp:
                sample_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
                if output:
                    manifest = output.write(tmp, spill_dir, seqs, sample_start, lengths, source_index, plan,
                                            pack_order, spec, bar)
                else:
                    entries = _write_shards(tmp, spill_dir, seqs, sample_start, source_index, plan,
                                            pack_order, spec, shard_bytes, bar)
                    manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "shards": entries}
        summary = summarize(
            spec=spec, files=files, stream=stream, read_counts=read_counts, bad_listed=bad_listed,
            lengths=lengths, targets=targets, dropped=dropped, seqs=seqs, overlong=overlong,
            plan=plan, pack_order=pack_order, out=out, dry_run=dry_run,
        )
        if summary.counts["no_target_samples"] and warn:
            warn(f"{summary.counts['no_target_samples']} samples have no target tokens (kept, they add no loss)")
        if output:
            output.annotate(summary, warn)
        if tmp and output:
            shutil.rmtree(spill_dir)
            output.commit(tmp, manifest, summary.metadata(__version__))
            tmp = None
        if tmp:
            shutil.rmtree(spill_dir)
            _write_json(os.path.join(tmp, MANIFEST_FILE), manifest)
            _write_json(os.path.join(tmp, METADATA_FILE), seal_metadata(summary.metadata(__version__)))
            replace_dir(tmp, out)
            tmp = None
        return summary
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

"""`pack()`: read → plan → write, the typed API the CLI is a thin layer over.

::

    inputs ─read─▶ spill (tokens, targets) + lengths ─sequences─▶ padded lengths
           ─plan─▶ packs ─shuffle─▶ gather ─▶ packs-*.arrow ─▶ manifest.json, metadata.json ─rename─▶ OUT

Pass one streams every input once, validating records and appending each sample's tokens and
target flags to the spill file in the temporary output directory (or under ``spill_dir``; its
first batches in memory instead with ``spill_memory``); only one token count per sample (2 or 4
bytes) stays in memory (targets are summed as batches pass; see :mod:`packer_cli._sequences`). The plan needs only the padded lengths, while the counts wait in
the spill directory; in pass two the plan's order waits there instead. No stage holds more than
about 16 bytes per sample (planning: the padded lengths and the planner's arrays) plus 16 per
pack, besides the spill's memory part (256 MiB at most by default: a fixed amount). Pass two
gathers each pack's tokens from the spill with a compiled kernel (``pread``, so no page of the
spill's file is ever resident) and writes (``O_DIRECT`` where the file system
takes it) and hashes the shards, or hands the same runs to a
:class:`~packer_cli.shards.bridge_output.BridgeOutput`. Everything is written into a temporary
sibling directory that is renamed into place at the end, so OUT either is complete or absent.

Both passes use both cores: in pass one a reader thread decodes and validates the next batch
while this thread spills the previous one; in pass two two shards are written at once, each
by its own thread, fed by two gathering threads. The kernels, Arrow's decoder and the file writes
release the GIL; memory stays bounded by a few batches in flight.
"""
from __future__ import annotations

import errno
import functools
import glob
import os
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from packer_cli import __version__
from packer_cli import _compile_ahead
from packer_cli._background import background, ordered_map
from packer_cli._kernel_cache import njit
from packer_cli._sequences import Items, SampleLog, SourceMap, build_items
from packer_cli._summary import PackSummary, summarize
from packer_cli.errors import (ConfigError, DataError, Interrupted, OutputError, PackerWarning, check_interrupted,
                               counted, env_choice, interrupts_deferred, interrupts_kept, out_of_memory, result_in_place)
from packer_cli.plan import plan_packs
from packer_cli.plan.plan import PackPlan
from packer_cli.plan.bounds import histogram, usable_capacity
from packer_cli.progress import Progress
from packer_cli.shards._atomic import (REPLACED, check_parent, check_replaceable, check_writable, foreign_files,
                                      make_temporary, output_target, overwrite_refusal, remove_tree, replace_dir,
                                      signals_held, spill_dir_prefix, stale_spill_dirs, stale_temporaries, sync_dir,
                                      within)
from packer_cli.shards._gather import (ORDER_FILE, SPILL_FILE, SpillError, SpillMemory, SpillReader, SpillTally,
                                       SpillWriter, block_bytes, load_array, save_array, spill_os_error)
from packer_cli.shards._sink import use_direct_io
from packer_cli.shards._staged import (SPILL_READ_MODES, choose_spill_read, group_stages, open_spill, pack_stages,
                                       page_cache_room, split_copies, split_samples, staged_memory)
from packer_cli.shards.bridge_output import BridgeOutput, foreign_names
from packer_cli.shards.bridge_writer import ENCODERS, ENV_ENCODER
from packer_cli.shards.format import (
    FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, MAX_LISTED_BAD, METADATA_FILE, seal_metadata, write_json,
)
from packer_cli.shards.writer import ShardFile, pack_record_batch
from packer_cli.sources import SampleStream, discover_inputs
from packer_cli.sources.discover import glob_reaches, input_paths, path_argument
from packer_cli.sources.parquet_lists import DECODERS, ENV_DECODER
from packer_cli.sources.readers import ENV_GZIP, GZIP_DECODERS
from packer_cli.spec import PackSpec, SourceSpec, is_bool, is_int

DEFAULT_SHARD_BYTES = 256 << 20
# The spill's first bytes held in memory (see SpillMemory): at most 256 MiB more resident whatever
# the input's size (a smaller spill is held whole), and on the benchmark VM writing them measured
# several times faster than writing them into new page-cache pages.
DEFAULT_SPILL_MEMORY = 256 << 20
BATCH_TOKENS = 4 << 20  # tokens per record batch (about 20 MB): at most 4 in flight (see _write_shards)


def _target_counts(batch, cap: int):
    """Runtime targets per sample (Σ targets[1:n]) and those past a truncation at ``cap``."""
    from packer_cli.sources._kernels import target_counts

    runtime = np.empty(batch.lengths.size, dtype=np.int64)
    tail = np.empty(batch.lengths.size, dtype=np.int64)
    target_counts(batch.targets, batch.lengths, cap, runtime, tail)
    return runtime, tail


def _read_inputs(stream: SampleStream, spill_dir: str | None, cap: int, progress: Progress,
                 spill_named: str | None = None, memory: SpillMemory | None = None, dry_memory: int = 0):
    """Pass one: validate, spill tokens/targets, keep lengths and totals.

    ``spill_named``: the directory to blame when writing the spill fails (``--spill-dir``);
    by default such a failure is the output's."""
    log = SampleLog(cap)
    counts = {"records": 0, "too_short": 0, "bad_records": 0}
    bad_listed: list[dict] = []
    try:
        # a dry run counts what the spill would take, and what the memory the real run reserves would hold
        spill = SpillWriter(spill_dir, memory) if spill_dir else SpillTally(dry_memory)
        try:
            task = progress.task("reading", total=None, unit="samples")
            with closing(background(iter(stream), depth=2)) as validated:  # read + validate on a second core
                for k, batch in enumerate(validated, 1):
                    check_interrupted()  # a Ctrl-C whose exception was lost stops the run within a batch
                    _take(batch, counts, bad_listed, log, cap, spill)
                    progress.advance(task, batch.records)
                    if k % 32 == 0:
                        _trim_heap()
        except BaseException:  # a data error, a signal, a full disk: reported as it is, the spill abandoned
            spill.abandon()
            raise
        spill.close()
        counts.update(spill_bytes=spill.total_bytes, spill_memory_used=spill.in_memory_bytes,
                      spill_bits=spill.max_bits)
    except SpillError:  # worded already (pack names the spill directory, or OUT)
        raise
    except OSError as exc:  # the readers report their own errors as DataError
        if spill_named:
            raise OutputError(f"{spill_named}: writing the spill failed: {exc}") from exc
        raise
    log.sources.finish()
    return log, counts, bad_listed


def _take(batch, counts: dict, bad_listed: list, log: SampleLog, cap: int, spill: SpillWriter | SpillTally) -> None:
    """Count one validated batch, keep its lengths and totals and spill its samples."""
    counts["records"] += batch.records
    counts["too_short"] += batch.too_short
    counts["bad_records"] += len(batch.bad)
    for bad in batch.bad[: max(0, MAX_LISTED_BAD - len(bad_listed))]:
        bad_listed.append({"path": bad.path, "row": bad.row, "line": bad.line, "reason": bad.reason})
    if batch.lengths.size:
        runtime, tail = _target_counts(batch, cap)
        log.add(batch.lengths, batch.source_index, runtime, tail)
        spill.write(batch.tokens, batch.targets, batch.max_token)


def _window_starts(sources: SourceMap, extra_sample: np.ndarray, window: int) -> np.ndarray:
    """The stream-ordered item index where each window of ``window`` input records begins: record
    positions count bad and dropped records too, and a split sample's later pieces (items
    ``num_samples + e``, placed after their own first piece in stream order) stay in its window."""
    num_samples = sources.num_samples
    last = int(sources[[num_samples - 1]][0])
    samples = sources.first_kept_at(np.arange(window, last + 1, window, dtype=np.int64))
    samples = np.unique(samples[samples < num_samples])
    starts = samples + np.searchsorted(extra_sample, samples, side="left")  # the pieces of earlier samples
    return np.concatenate([[0], starts[starts > 0]]).astype(np.int64)


def _plan(padded: np.ndarray, spec: PackSpec, progress: Progress, extra_sample: np.ndarray,
          sources: SourceMap | None = None):
    task = progress.task("planning", total=None, unit="sequences")
    stream_order = None
    window_starts = None
    if spec.window is not None:
        window_starts = _window_starts(sources, extra_sample, spec.window)
    if (spec.algorithm.value == "sequential" or spec.window is not None) and extra_sample.size:
        # Items N + e, the later pieces of split samples, come after every sample's first
        # piece; in input order each follows its own first piece. Two sorted runs: the stable
        # sort merges them in linear time.
        stream_order = np.argsort(np.concatenate([np.arange(padded.size - extra_sample.size), extra_sample]),
                                  kind="stable").astype(np.int32)
        padded = padded[stream_order]
    plan = plan_packs(padded, spec.pack_size, spec.algorithm.value, seed=spec.seed, refine=spec.refines,
                      skip_empty=True, window_starts=window_starts)
    if stream_order is not None:
        order = stream_order[plan.order]
        order.setflags(write=False)
        plan = replace(plan, order=order)
    progress.advance(task, plan.order.size)
    return plan


def _pack_order(num_packs: int, spec: PackSpec) -> np.ndarray:
    """Output position → plan pack (int32: 4 bytes a pack)."""
    if spec.shuffle:
        return np.random.default_rng(spec.seed).permutation(num_packs).astype(np.int32)
    return np.arange(num_packs, dtype=np.int32)


# Bits a shard gains per token (int32 token, one loss-mask bit), bytes per sequence (cu_seqlens,
# seq_lens, last_token, source_offset: int32; source_index: int64) and per pack (list offsets).
SHARD_BITS_PER_TOKEN, SHARD_BYTES_PER_SEQUENCE, SHARD_BYTES_PER_PACK = 33, 24, 32
# Arrow IPC's own bytes, for a dry run's estimate: each file's magic, schema and footer, and each
# record batch's message header, footer entry and buffer padding (measured: 1 file and 1 batch
# 2,679-2,712 B; 15 files and 29 batches 51,901 B; a batch's padding moves by up to ~40 B)
SHARD_BYTES_PER_FILE, SHARD_BYTES_PER_RUN = 1_850, 840
SHARDS_IN_FLIGHT = 2
GATHER_THREADS = 2
GATHERED_AHEAD = 1  # runs each shard has gathered or is gathering while it writes one


def _shard_runs(pack_offsets: np.ndarray, pack_load: np.ndarray, pack_order: np.ndarray,
                shard_bytes: int) -> list[list[tuple[int, int]]]:
    """The runs of output packs (one record batch each, about ``BATCH_TOKENS`` tokens) of every
    shard: a shard ends with the run that brings its estimated size to ``shard_bytes``.

    Sizes are estimated from the plan (tokens, sequences and packs times the bytes each adds),
    so every shard's contents are known before any is written and two can be written at once.
    """
    ends, run_bytes = _runs_of_packs(pack_offsets, pack_load, pack_order, BATCH_TOKENS)
    starts = [0] + ends[:-1].tolist()
    shards, shard, size = [], [], 0
    for a, b, nbytes in zip(starts, ends.tolist(), run_bytes.tolist()):
        shard.append((a, b))
        size += nbytes
        if size >= shard_bytes:
            shards.append(shard)
            shard, size = [], 0
    return shards + [shard] if shard else shards


def _write_shards(tmp: str, spill_dir: str, items: Items, sources: SourceMap, plan: _ParkedPlan, pack_order,
                  spec: PackSpec, shard_bytes: int, progress: Progress, direct_io: bool = True,
                  memory: SpillMemory | None = None, spill_read: str = "random",
                  spill_record: dict | None = None) -> list[dict]:
    """Pass two: ``SHARDS_IN_FLIGHT`` shards are written at once, each by its own thread, while
    ``GATHER_THREADS`` shared threads gather the runs of packs they will write next (``pread``
    from the spill, compiled, GIL released). Each run's items are read from the parked order
    and every sequence is recomputed from the sample lengths (:meth:`Items.resolve`).

    Shards are written with ``O_DIRECT`` where the file system takes it (``direct_io``; see
    :mod:`packer_cli.shards._sink`): through the page cache, copying them in was most of pass
    two's work, at the speed of one core per file. Shards are written side by side either way.
    Memory in flight is bounded here, by ``GATHERED_AHEAD``, not by shrinking the record
    batches: smaller batches cost every reader per-batch overhead (with 2M tokens ``inspect``
    read 3.0–4.5 instead of 5.2–7.0 G tok/s).

    ``spill_read="staged"`` first copies the spill into per-stage regions in one sequential
    pass and gathers each run from its stage's image in memory (:mod:`packer_cli.shards._staged`,
    for a spill the page cache cannot hold); ``spill_record`` gets the number of stages and
    their bytes.
    """
    task = progress.task("writing", total=pack_order.size, unit="packs")

    def gather(spill: SpillReader, a: int, b: int):
        run, run_offsets = spill.run_items(plan.pack_offsets, pack_order[a:b])
        seq = items.resolve(run)
        tokens, mask, last, cu, buffers = spill.gather_run(a, seq, run_offsets, spec.pad_id,
                                                           min_buffer=BATCH_TOKENS + spec.pack_size)
        batch = pack_record_batch(tokens, mask, cu, seq.length, last, sources[seq.sample], seq.offset, run_offsets)
        return batch, int(tokens.size), b - a, buffers

    def write_shard(spill: SpillReader, gatherers, index: int, runs: list[tuple[int, int]]) -> dict:
        gathered = ordered_map(lambda run: gather(spill, *run), runs, ahead=GATHERED_AHEAD, pool=gatherers)
        with ShardFile(tmp, index, direct=direct_io) as shard, closing(gathered):
            for batch, n_tokens, n_packs, buffers in gathered:
                shard.write(batch, n_tokens)
                del batch  # the file holds the bytes now; the buffers can take the next run
                spill.recycle(buffers)
                progress.advance(task, n_packs)
            return shard.finish()

    shards = _shard_runs(plan.pack_offsets, plan.pack_load, pack_order, shard_bytes)
    spill_reader = open_spill(spill_read, spill_dir, memory, items, plan.pack_offsets, pack_order, shards,
                              spill_record)
    gatherers = ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="packer-gather")
    with spill_reader as spill, gatherers:
        written = ordered_map(lambda job: write_shard(spill, gatherers, *job), enumerate(shards),
                              workers=SHARDS_IN_FLIGHT, ahead=SHARDS_IN_FLIGHT)
        with closing(written) as entries:
            done = []
            for entry in entries:
                check_interrupted()  # a Ctrl-C whose exception was lost stops the run within a shard
                done.append(entry)
            return done


def _same_file(path: str, stat: os.stat_result) -> bool:
    """Whether ``path`` is the file ``stat`` was taken of (moved there by a rename)."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (stat.st_dev, stat.st_ino)


def _trim_heap() -> None:
    """Return the C heap's free pages to the OS (glibc; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None. Looked up once: each ``ctypes.CDLL`` makes a class of
    its own, a reference cycle (3.4 KB) that the CLI, running without the cyclic collector,
    never frees; called every 32 batches, they added up."""
    try:
        import ctypes

        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _release_memory() -> None:
    """Hand freed memory back to the OS between passes.

    Pass one frees hundreds of megabytes of decode buffers; Arrow's allocator and glibc's
    per-thread arenas otherwise keep them resident, and how much they keep grows with the
    length of the run, not with anything packer holds.
    """
    import pyarrow as pa

    from packer_cli._arrow import memory_pool

    pa.default_memory_pool().release_unused()
    memory_pool().release_unused()
    _trim_heap()


def _park(lengths: np.ndarray, spill_dir: str | None):
    """Move the sample lengths out of memory (into the spill directory) while the planner runs."""
    if not spill_dir:
        return None  # dry run: nothing needs them after the plan
    path = os.path.join(spill_dir, "lengths.bin")
    save_array(path, lengths)
    return path, lengths.dtype, lengths.size


def _unpark(parked) -> np.ndarray:
    path, dtype, count = parked
    return load_array(path, dtype, count)


@dataclass
class _ParkedPlan:
    """A plan whose item order waits in the spill directory (``order.bin``, int32)."""

    pack_offsets: np.ndarray
    pack_load: np.ndarray


def _park_order(plan, spill_dir: str) -> _ParkedPlan:
    save_array(os.path.join(spill_dir, ORDER_FILE), plan.order)
    return _ParkedPlan(plan.pack_offsets, plan.pack_load)


@njit(cache=True, nogil=True)
def _runs_of_packs(pack_offsets, pack_load, pack_order, budget):
    """End (exclusive output pack) and estimated shard bytes of each run of about ``budget``
    tokens, at least one pack each (one pass, nothing allocated per pack)."""
    ends, sizes = [], []
    tokens = size = 0
    for k in range(pack_order.size):
        p = pack_order[k]
        tokens += pack_load[p]
        sequences = pack_offsets[p + 1] - pack_offsets[p]
        size += (pack_load[p] * SHARD_BITS_PER_TOKEN + 7) // 8 + sequences * SHARD_BYTES_PER_SEQUENCE + SHARD_BYTES_PER_PACK
        if tokens >= budget:
            ends.append(k + 1)
            sizes.append(size)
            tokens = size = 0
    if tokens > 0 or not ends:
        ends.append(pack_order.size)
        sizes.append(size)
    return np.array(ends, dtype=np.int64), np.array(sizes, dtype=np.int64)


class _PhaseClock:
    """Wall time per phase of a run (the summary's ``seconds``)."""

    def __init__(self):
        self._start = self._last = time.perf_counter()
        self._laps: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self._laps[phase] = now - self._last
        self._last = now

    def seconds(self) -> dict:
        laps = {phase: round(self._laps.get(phase, 0.0), 4) for phase in ("read", "plan", "write")}
        return {**laps, "total": round(self._last - self._start, 4)}


#: Address space left to the rest of a run when ``--spill-memory`` meets an address-space limit
#: (``ulimit -v``, a batch scheduler's vmem limit): thread stacks, allocator arenas, the
#: compiler and the batches in flight reserve far more than they make resident.
ADDRESS_SPACE_HEADROOM = 2 << 30


def _address_space_room() -> int | None:
    """Bytes of address space this process may still reserve, None without a limit."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            in_use = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        in_use = 0
    return max(0, soft - in_use)


#: The default spill memory takes at most the memory the run can count on (what a container's
#: limit leaves, or the node's available memory) divided by this: a quarter.
DEFAULT_SPILL_DIVISOR = 4


def _reserve_spill_memory(budget: int, warn=None, asked: bool = True) -> SpillMemory:
    """The spill's memory; a budget the caller did not ask for (the default) is cut to what can
    be had without a word: at most a quarter of the memory the run can count on (under a
    container's limit the whole 256 MiB on top of the run's own needs was killed for memory,
    where a spill in the file fit), within the address space, and none where no anonymous
    memory can be mapped."""
    if budget and not asked:
        room = page_cache_room()
        if room is not None:
            budget = min(budget, room // DEFAULT_SPILL_DIVISOR)
    room = _address_space_room() if budget else None
    if room is not None and budget > room - ADDRESS_SPACE_HEADROOM:
        # the whole budget is reserved up front: near the limit, every later allocation failed
        # (a traceback, or an abort inside the compiler) although the spill needed little of it
        smaller = max(0, room - ADDRESS_SPACE_HEADROOM)
        if warn and asked:
            warn(f"--spill-memory: reserving {smaller:,} of the {budget:,} bytes asked: the address-space limit "
                 f"(ulimit -v) leaves {room:,} and a run needs about {ADDRESS_SPACE_HEADROOM:,} besides; the rest of "
                 "the spill goes to its file")
        budget = smaller
    try:
        return SpillMemory(budget)
    except (OSError, OverflowError) as exc:  # no such address space (a ulimit -v, no overcommit)
        if not asked:
            return SpillMemory(0)
        raise ConfigError(f"spill memory: cannot reserve {budget:,} bytes ({exc})") from exc


def _check_spill_parent(spill_parent: str | None, dry_run: bool) -> str | None:
    if spill_parent is None:
        return None
    spill_parent = os.path.abspath(spill_parent)
    if not os.path.isdir(spill_parent):
        what = "is not a directory" if os.path.exists(spill_parent) else "does not exist"
        raise ConfigError(f"{spill_parent}: spill directory {what}")
    if dry_run:  # the real run finds out by creating its directory there
        check_writable(spill_parent, "spill directory")
    return spill_parent


#: Errors creating a directory that say the device is full or failing (exit 3, as when writing
#: fails), not that the path is unusable (exit 2).
_DEVICE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO)


def _creation_error(message: str, exc: OSError) -> ConfigError | OutputError:
    return (OutputError if exc.errno in _DEVICE_ERRNOS else ConfigError)(message)


def _make_spill_dir(tmp: str, spill_parent: str | None) -> str:
    """The pass-one spill: inside the temporary output by default, else a private directory
    made in ``spill_parent`` (removed with the temporary output, whatever happens)."""
    if spill_parent is None:
        spill_dir = os.path.join(tmp, "_spill")
        os.makedirs(spill_dir)
        return spill_dir
    try:
        return tempfile.mkdtemp(prefix=spill_dir_prefix(), dir=spill_parent)
    except OSError as exc:
        raise _creation_error(f"{spill_parent}: cannot create the spill directory: {exc}", exc) from exc


def _disk_needs(summary: PackSummary, spill_bytes: int, in_memory: int, spill_read: str, out: str | None,
                spill_parent: str | None, planned: _Planned, shard_runs: list | None, lengths_bytes: int,
                stage_first: np.ndarray) -> dict:
    """What a dry run expects the real run to write: the spill (on disk: all but the whole
    batches ``--spill-memory`` holds, ``in_memory`` bytes of them; read back ``staged``, a copy of
    all of it besides, ``stage_bytes``, each sample rounded to whole blocks of the spill's widest
    ids and a split one whole again in each further stage one of its pieces lands in (stages
    starting at the output positions ``stage_first``): an estimate from above) and, for native
    shards (``shard_runs``: the runs of packs of each shard, as pass
    two would write them), the output (the shard formula pass two sizes its runs with, plus
    Arrow's bytes for each file and record batch; a Bridge file is compressed, so none is
    given); where each goes and the free space there."""
    c = summary.counts
    output = None
    if shard_runs is not None:
        output = ((c["padded_tokens"] * SHARD_BITS_PER_TOKEN + 7) // 8 + c["sequences"] * SHARD_BYTES_PER_SEQUENCE
                  + c["packs"] * SHARD_BYTES_PER_PACK + len(shard_runs) * SHARD_BYTES_PER_FILE
                  + sum(map(len, shard_runs)) * SHARD_BYTES_PER_RUN)
    on_disk = int(spill_bytes - in_memory)
    room = page_cache_room()  # the real run's memory part will hold memory this dry run does not
    room = None if room is None else max(0, room - int(in_memory))
    places = {}
    if out:  # the output is built beside OUT, and the spill in it unless --spill-dir
        places["output"] = os.path.dirname(os.path.abspath(out))
    if spill_parent or out:
        places["spill"] = spill_parent or places["output"]
    # what the real run's auto would choose here, now
    mode, _ = choose_spill_read(spill_read, on_disk, room, places.get("spill"),
                                staged_memory(spill_bytes, c["padded_tokens"], planned.split_bytes()))
    stage = 0
    if mode == "staged":  # each sample in whole blocks of its own, a split one whole in each stage holding a piece
        plan, items = planned.plan, planned.items
        pack_stage = pack_stages(planned.pack_order, stage_first)
        copies = split_copies(planned.split, plan.order, plan.pack_offsets, pack_stage, items.num_samples,
                              items.extra_sample)
        stage = int(spill_bytes) + (c["samples_packed"] + copies) * block_bytes(planned.spill_bits)
    # beside the spill, whatever of it lies in memory: the sample lengths and the plan's order (int32 an item)
    index = int(lengths_bytes) + 4 * c["sequences"]
    needs = {"spill_bytes": int(spill_bytes), "spill_disk_bytes": on_disk, "spill_index_bytes": index,
             "stage_bytes": stage, "output_bytes": output}
    needs["free"] = {}
    for what, directory in places.items():
        try:
            st = os.statvfs(directory)
            needs["free"][what] = {"path": directory, "bytes": st.f_bavail * st.f_frsize, "device": os.stat(directory).st_dev}
        except OSError:
            pass
    return needs


def _short_of_space(needs: dict) -> list[str]:
    """Warnings for each file system with less room free than the run is expected to need there
    (the spill and the output summed where they share one)."""
    from packer_cli.report import byte_size

    free, lines, counted = needs.get("free", {}), [], set()
    for what in ("spill", "output"):
        if what not in free or free[what]["device"] in counted:
            continue
        device = free[what]["device"]
        counted.add(device)
        here = {part for part in ("spill", "output") if part in free and free[part]["device"] == device}
        spill = needs["spill_disk_bytes"] + needs.get("spill_index_bytes", 0) if "spill" in here else 0
        stage = needs["stage_bytes"] if "spill" in here else 0
        output = (needs["output_bytes"] or 0) if "output" in here else 0
        # the peak: the spill file is deleted once the stages are built, before any shard is written
        need = max(spill + stage, stage + output) if needs["stage_bytes"] else spill + output
        if need > free[what]["bytes"]:
            lines.append(f"{free[what]['path']}: {byte_size(free[what]['bytes'])} free, the run needs about "
                         f"{byte_size(need)} there (spill and shards as estimated); it would fail for space")
    return lines


def _check_out_outside_input_directories(out: str, inputs: list[str]) -> None:
    """An OUT inside a directory given as input would be read as input by every later run over
    that directory (and by ``verify --source``): refuse it before anything is written."""
    real_out = os.path.realpath(out)
    for path in inputs:
        if not os.path.exists(path) and glob.has_magic(path) and glob_reaches(path, out):  # d/**, d/*
            raise ConfigError(f"{out} is where the input pattern {path} reads, so a later run over it would read "
                              "the output as input: write the output elsewhere")
        if os.path.isdir(path):
            real = os.path.realpath(path)
            if within(real_out, real):
                raise ConfigError(f"{out} is inside the input directory {path}, so a later run over it would read "
                                  "the output as input: write the output elsewhere")


def _check_arguments(spec, source, shard_bytes, spill_memory, output) -> None:
    """Raise :class:`ConfigError` for unusable arguments of :func:`pack`, before anything is read."""
    if not isinstance(spec, PackSpec):
        raise ConfigError(f"spec must be a PackSpec, got {type(spec).__name__}")
    if not isinstance(source, SourceSpec):
        raise ConfigError(f"source must be a SourceSpec, got {type(source).__name__}")
    if output is not None and not isinstance(output, BridgeOutput):
        raise ConfigError(f"output must be a BridgeOutput or None, got {output!r}")
    spec.validate(for_bridge=output is not None)
    source.validate()
    if output is not None:
        output.validate()
    if not is_int(shard_bytes) or shard_bytes < 1:
        raise ConfigError(f"shard size must be a positive number of bytes, got {shard_bytes!r}")
    if spill_memory is not None and (not is_int(spill_memory) or spill_memory < 0):
        raise ConfigError(f"spill memory must be 0 or more bytes, got {spill_memory!r}")
    vocab = source.vocab_size
    # padding is fed to the model as input ids like any token, so it must be in the vocabulary
    if vocab is not None and spec.pad_id >= vocab:
        raise ConfigError(f"pad-id {spec.pad_id} is not below vocab-size {vocab}")
    eos = getattr(output, "eos_id", None)
    if vocab is not None and eos is not None and eos >= vocab:
        raise ConfigError(f"eos-id {eos} is not below vocab-size {vocab}")


def _nothing_left(files, read_counts: dict, dropped: int, bad_listed: list[dict]) -> str:
    """Why a run that read records has none to pack, naming the input and the first bad record."""
    where = files[0].path if len(files) == 1 else f"{files[0].path} and {counted(len(files) - 1, 'more input')}"
    why = [f"{n:,} {what}" for n, what in ((read_counts["bad_records"], "bad (skipped)"),
                                           (read_counts["too_short"], "shorter than 2 tokens"),
                                           (dropped, "over-long (dropped)")) if n]
    text = f"{where}: no samples left to pack: of {counted(read_counts['records'], 'record')}, {', '.join(why)}"
    if bad_listed:
        first = bad_listed[0]
        place = f"line {first['line']}" if first.get("line") is not None else f"row {first['row']}"
        text += f"; the first bad one: {first['path']}: {place}: {first['reason']}"
    return text


def _prepare_out(out: str, overwrite: bool, inputs: list[str], create: bool = True) -> str | None:
    """Check OUT for a native output and, with ``create``, make its temporary sibling."""
    out = os.path.normpath(out)
    if os.path.exists(out) and not os.path.isdir(out):  # first: --overwrite would not replace it either
        raise ConfigError(f"{out} exists and is not a directory")
    check_parent(out)  # a mount point too, before any advice to pass --overwrite
    if os.path.exists(out) and not overwrite:
        refusal = overwrite_refusal(out, foreign_names, inputs)
        raise ConfigError(f"{out} already exists; {refusal or 'pass --overwrite to replace it'}")
    if os.path.exists(out):  # a native output, or a Bridge layout being replaced by one
        check_replaceable(out, inputs, foreign_names)
    if not create:
        check_writable(os.path.dirname(os.path.abspath(out)), "output parent directory")
    return make_temporary(out) if create else None


def python_warning(line: str) -> None:
    """``pack()``'s default ``warn``: each warning a :class:`~packer_cli.errors.PackerWarning`
    through :mod:`warnings`, so a program's filters and ``catch_warnings`` see it. It is shown
    for every run, at the program's line that called packer: by the default filter's rule (once
    for each message and place) a second run's warning was dropped, its text the same and its
    place a line of packer's."""
    frame = sys._getframe(1)
    while frame is not None and _is_packers(frame.f_globals.get("__name__")):
        frame = frame.f_back
    if frame is None:  # packer called from nowhere else (python -m): its own line, then
        warnings.warn(line, PackerWarning, stacklevel=2)
        return
    module = frame.f_globals.get("__name__")
    named = {"module": module} if isinstance(module, str) else {}  # None drops the warning: Python names it
    place = (line, PackerWarning, frame.f_code.co_filename, frame.f_lineno)
    try:  # the caller's globals let the warning show its line from a zip or an egg
        warnings.warn_explicit(*place, registry=None, module_globals=frame.f_globals, **named)
    except ImportError:  # a REPL, `python -c`, stdin, `python -m`: the loader of __main__ raises
        warnings.warn_explicit(*place, registry=None, **named)  # when asked for its source


def _is_packers(module) -> bool:
    """Whether a frame's module is packer's own (a user's ``packer_cli_jobs`` is not)."""
    return isinstance(module, str) and (module == "packer_cli" or module.startswith("packer_cli."))


@interrupts_kept
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
    warn: Callable[[str], None] | None = python_warning,
    output: BridgeOutput | None = None,
    spill_dir: str | None = None,
    spill_memory: int | None = None,
    direct_io: bool | None = None,
    spill_read: str = "auto",
    compile_ahead: bool = False,
) -> PackSummary:
    """Pack tokenized samples from ``inputs`` into ``out`` (nothing is written with ``dry_run``).

    ``inputs``: one path or an ordered list of them (files, directories, globs); their order
    numbers the samples, so a set is refused.

    ``output``: a :class:`~packer_cli.shards.bridge_output.BridgeOutput` writes Megatron-Bridge's
    Parquet layout (one split per call) instead of native shards, from the same plan. The run
    works on its own copy: one object may serve several runs, at once too.

    ``warn``: called with each warning's line; by default each is a
    :class:`~packer_cli.errors.PackerWarning` through :mod:`warnings`; None: not reported.

    ``spill_dir``: an existing directory to hold pass one's spill (about 2¼ bytes a token, read
    back at random in pass two) instead of the temporary output directory, e.g. local disk when
    ``out`` is on a network file system; a private subdirectory is made there and removed at
    the end.

    ``spill_memory``: bytes of the spill held in memory rather than in the file (the first
    batches, up to this budget, in the process's own anonymous memory; 0: all in the file).
    Resident only as far as used. None: 256 MiB (``DEFAULT_SPILL_MEMORY``), cut without a
    warning to a quarter of the memory the run can count on (``MemAvailable``, or a container's
    room) and to what the address space allows, and none where that memory cannot be mapped
    (an explicit budget is held as asked, warns near the address-space limit, and fails where
    it cannot be mapped).

    ``direct_io``: write the output files with ``O_DIRECT`` (bypassing the page cache; True),
    through the page cache (False), or (None) with ``O_DIRECT`` where OUT's file system is a
    local or parallel one that takes it well (:func:`~packer_cli.shards._sink.use_direct_io`).
    The bytes are the same either way.

    ``spill_read``: how pass two reads the spill back: ``random`` (a read per sequence, in
    output order; the page cache serves it), ``staged`` (first copied into stages in one
    sequential pass, each stage then read whole: for a spill the page cache cannot hold, see
    :mod:`packer_cli.shards._staged`), or ``auto`` (staged when the spill is larger than the
    page cache this process can count on). The bytes written are the same either way.

    ``compile_ahead``: where packer's kernels are not compiled yet (the first run after an install
    or upgrade), compile the plan's and pass two's in a second process while this one reads
    (:mod:`packer_cli._compile_ahead`; the command line does; ``PACKER_COMPILE_AHEAD=0`` never).

    Raises :class:`ConfigError` for unusable options (or an ``out`` that cannot be created),
    :class:`DataError` for bad data and :class:`OutputError` when writing the output or the
    spill fails (disk full, I/O error); on any error nothing is left at ``out``.
    """
    check_interrupted()  # a Ctrl-C lost while this module's imports compiled (errors.check_interrupted)
    opts = _checked_options(spec, source, output, overwrite=overwrite, dry_run=dry_run, progress=progress,
                            shard_bytes=shard_bytes, spill_memory=spill_memory, direct_io=direct_io,
                            spill_read=spill_read, compile_ahead=compile_ahead)
    if warn is not None and not callable(warn):  # it failed after the whole run, at the first warning
        raise ConfigError(f"warn must be a callable taking one line of text, or None, got {warn!r}")
    paths = input_paths(inputs)
    out = None if out is None else path_argument(out, "out")
    spill_parent = None if spill_dir is None else path_argument(spill_dir, "spill_dir")
    files = discover_inputs(paths)
    if not opts.dry_run and not out:
        raise ConfigError("an output directory (-o OUT) is required unless --dry-run")
    if out:  # a dry run with OUT checks it as the real run would, and makes nothing
        out = output_target(out)
        _check_out_outside_input_directories(out, paths)
    spill_parent = _check_spill_parent(spill_parent, opts.dry_run)
    if output:
        # The run's own copy: the object holds a run's state (its OUT, spec, EOS result), and one
        # passed to two pack() calls at once sent one run's layout into the other's OUT. A
        # reused one reported its last run's EOS result in a dry run.
        output = replace(output)
        output.reset()
        if warn and (note := output.row_group_memory_note(spec.pack_size)):
            warn(note)
    if warn and spec.pack_size % spec.pad_multiple:
        usable = usable_capacity(spec.pack_size, spec.pad_multiple)
        warn(f"pack size {spec.pack_size} is not a multiple of the padding multiple {spec.pad_multiple}: "
             f"sequences padded to multiples of it fill at most {usable} tokens of a pack, and the last "
             f"{spec.pack_size - usable} are always padding (--pack-size {usable} gives the same packs)")
    run = _Run(spec, opts, files, out, spill_parent, output, warn)
    try:  # from the moment the temporary output exists: a signal anywhere after this still removes it
        run.tmp = _temporary_output(out, opts.overwrite, spec, files, output, create=not opts.dry_run) if out else None
        return run.execute(source)
    except MemoryError as exc:  # pyarrow's ArrowMemoryError too: a ulimit -v, the node's memory
        raise out_of_memory(out, exc) from exc
    except RuntimeError as exc:
        if "can't start new thread" not in str(exc):  # a thread's stack could not be mapped: memory too
            raise
        raise out_of_memory(out, exc) from exc
    except SpillError as exc:  # the spill's own directory, when --spill-dir put it elsewhere than OUT
        where = spill_parent or f"{out}: writing the output failed"
        raise OutputError(f"{where}: {exc}") from exc
    except OSError as exc:  # readers report their own errors as DataError: this is the writing side
        raise OutputError(f"{out}: writing the output failed: {exc}") from exc
    finally:
        with signals_held():  # a second Ctrl-C (or a SIGTERM after one) must not stop the cleanup half-way
            run.clean_up()


@dataclass(frozen=True)
class _Options:
    """:func:`pack`'s keyword options, checked and normalized (NumPy integers to ``int``)."""

    overwrite: bool
    dry_run: bool
    progress: bool
    shard_bytes: int
    spill_memory: int
    spill_memory_asked: bool  # False: the default budget, cut quietly to what can be reserved
    direct_io: bool | None
    spill_read: str
    compile_ahead: bool


def _checked_options(spec, source, output, *, overwrite, dry_run, progress, shard_bytes, spill_memory, direct_io,
                     spill_read, compile_ahead=False) -> _Options:
    """Raise :class:`ConfigError` for unusable arguments of :func:`pack`, before anything is read."""
    _check_arguments(spec, source, shard_bytes, spill_memory, output)
    env_choice(ENV_DECODER, DECODERS)  # checked here, whether or not this run decodes Parquet or writes it
    env_choice(ENV_ENCODER, ENCODERS)
    env_choice(ENV_GZIP, GZIP_DECODERS)
    env_choice(_compile_ahead.ENV_COMPILE_AHEAD, _compile_ahead.CHOICES)
    if spill_read not in SPILL_READ_MODES:
        raise ConfigError(f"spill read must be one of {', '.join(SPILL_READ_MODES)}, got {spill_read!r}")
    for name, flag in (("overwrite", overwrite), ("dry_run", dry_run), ("progress", progress),
                       ("compile_ahead", compile_ahead)):
        if not is_bool(flag):  # overwrite="false" is truthy: it replaced the output
            raise ConfigError(f"{name} must be True or False, got {flag!r}")
    if direct_io is not None and not is_bool(direct_io):
        raise ConfigError(f"direct_io must be True, False or None, got {direct_io!r}")
    return _Options(overwrite=bool(overwrite), dry_run=bool(dry_run), progress=bool(progress),
                    shard_bytes=int(shard_bytes),
                    spill_memory=DEFAULT_SPILL_MEMORY if spill_memory is None else int(spill_memory),
                    spill_memory_asked=spill_memory is not None,
                    direct_io=None if direct_io is None else bool(direct_io), spill_read=spill_read,
                    compile_ahead=bool(compile_ahead))


def _temporary_output(out: str, overwrite: bool, spec: PackSpec, files, output: BridgeOutput | None,
                      create: bool = True) -> str | None:
    """The temporary sibling of ``out`` the run builds in (checked replaceable when ``out`` exists);
    without ``create`` (a dry run) only the checks."""
    file_paths = [f.path for f in files]
    try:
        if output:
            return output.prepare(out, overwrite, spec, file_paths, create=create)
        return _prepare_out(out, overwrite, file_paths, create=create)
    except OSError as exc:
        raise _creation_error(f"{out}: cannot create the output: {exc}", exc) from exc


class _Run:
    """One :func:`pack` run once its arguments are checked: pass one, the plan, pass two and
    the rename into place (:meth:`execute`, into the temporary output ``tmp``), and what is
    removed whatever happens (:meth:`clean_up`). Without ``tmp`` (a dry run) only pass one and
    the plan run."""

    def __init__(self, spec: PackSpec, opts: _Options, files, out: str | None, spill_parent: str | None,
                 output: BridgeOutput | None, warn: Callable[[str], None] | None):
        self.spec, self.opts, self.files, self.out = spec, opts, files, out
        self.spill_parent, self.output, self.warn = spill_parent, output, warn
        self.tmp: str | None = None
        self.spill_dir: str | None = None
        self.memory = SpillMemory(0)
        self.helper: _compile_ahead.Helper | None = None

    def execute(self, source: SourceSpec) -> PackSummary:
        clock = _PhaseClock()
        direct_io = None
        if self.tmp:
            direct_io = use_direct_io(self.tmp, self.opts.direct_io)
            self._warn_about_leftovers()
            self.spill_dir = _make_spill_dir(self.tmp, self.spill_parent)
            self.memory = _reserve_spill_memory(self.opts.spill_memory, self.warn, self.opts.spill_memory_asked)
        dry_memory = 0
        if not self.tmp and self.opts.spill_memory:  # a dry run spills nothing, but says what the real run's reservation would
            reservation = _reserve_spill_memory(self.opts.spill_memory, self.warn, self.opts.spill_memory_asked)
            dry_memory = reservation.budget
            reservation.release()
        if self.tmp and self.opts.compile_ahead:
            self.helper = _compile_ahead.start(self.spec, self.output)
        with Progress(enabled=self.opts.progress) as bar:
            stream = SampleStream(self.files, source)
            log, read_counts, bad_listed = _read_inputs(stream, self.spill_dir, self.spec.max_sequence_length, bar,
                                                        spill_named=self.spill_parent, memory=self.memory,
                                                        dry_memory=dry_memory)
            clock.lap("read")
            check_interrupted()  # no input yields no records: the stream refuses an empty one
            planned = self._plan(log, stream, read_counts, bad_listed, bar)
            clock.lap("plan")
            check_interrupted()
            if self.helper is not None:  # pass two then loads what it compiled, not compiling it a second time
                self.helper.wait()
            manifest = self._write(planned, bar, direct_io) if self.tmp else None
        summary = planned.summary
        if self.opts.dry_run:
            shard_runs = self._shard_runs(planned)
            summary.disk = _disk_needs(summary, read_counts["spill_bytes"], read_counts["spill_memory_used"],
                                       self.opts.spill_read, self.out, self.spill_parent, planned,
                                       shard_runs=shard_runs, lengths_bytes=read_counts["lengths_bytes"],
                                       stage_first=self._stage_first(planned, shard_runs))
            if self.warn:
                for line in _short_of_space(summary.disk):
                    self.warn(line)
        if stream.supervision.ignored and self.warn:
            ignored = ", ".join(f"'{name}'" for name in stream.supervision.ignored)
            self.warn(f"targets come from '{stream.supervision.field}'; the records' {ignored} "
                      f"{'was' if len(stream.supervision.ignored) == 1 else 'were'} not read "
                      "(name the one to use with --mask-field or --labels-field)")
        if summary.counts["no_target_samples"] and self.warn:
            n = summary.counts["no_target_samples"]
            self.warn(f"{n:,} {'sample has' if n == 1 else 'samples have'} no target tokens (kept, they add no loss)")
        if self.output:
            self.output.annotate(summary, self.warn)
        check_interrupted()  # never publish the output of a run the user stopped
        if self.tmp:
            self._publish(manifest, summary)
        clock.lap("write")
        summary.seconds = clock.seconds()
        return summary

    def _stage_first(self, planned: _Planned, shard_runs: list | None) -> np.ndarray:
        """The output position each stage of a staged read of the spill would start at."""
        if self.output is not None:
            first = self.output.stage_first(planned.pack_order.size, self.spec.pack_size)
        else:
            first = [runs[0][0] for runs in group_stages(shard_runs)] or [0]
        return np.array(first, dtype=np.int64)

    def _shard_runs(self, planned: _Planned) -> list | None:
        """The native shards' runs of packs, as pass two will cut them (None for a Bridge split)."""
        if self.output is not None:
            return None
        plan = planned.plan
        return _shard_runs(plan.pack_offsets, plan.pack_load, planned.pack_order, self.opts.shard_bytes)

    def _warn_about_leftovers(self) -> None:
        """Name the temporary outputs and spills of earlier runs killed outright (left alone)."""
        if not self.warn:
            return
        stale_spills = stale_spill_dirs(self.spill_parent) if self.spill_parent else []
        for stale in stale_temporaries(self.out, self.tmp) + stale_spills:
            self.warn(f"{stale} was left by an earlier run that did not finish (killed outright?); "
                      "remove it to free its space")
        for stale in stale_temporaries(self.out, self.tmp, REPLACED):
            if os.path.lexists(self.out):
                self.warn(f"{stale} holds an output an earlier run moved aside to replace it and did not delete "
                          "(killed meanwhile, or it could not be deleted); remove it to free its space")
            else:
                self.warn(f"{self.out} was missing as this run started and {stale} is most likely what it was (a run "
                          f"replacing it was killed between two renames); this run writes a new {self.out}: keep "
                          f"or remove {stale} yourself")

    def _plan(self, log: SampleLog, stream: SampleStream, read_counts: dict, bad_listed: list, bar) -> _Planned:
        """Sequences from pass one's lengths, the plan and the run's summary. Only the planner's
        input and output are resident while it runs: the sample lengths wait in the spill
        directory."""
        spec, files = self.spec, self.files
        sources, totals = log.sources, log.totals
        lengths = log.lengths()
        items, padded, overlong = build_items(
            lengths, totals, spec, locate=lambda k: stream.locate(int(sources[[k]][0])))
        padded_hist = histogram(padded, spec.pack_size + 1)
        if padded_hist[1:].sum() == 0:
            raise DataError(_nothing_left(files, read_counts, overlong.dropped, bad_listed))
        read_counts["lengths_bytes"] = int(lengths.nbytes)  # lengths.bin's size, for a dry run's estimate
        split = split_samples(lengths, items.extra_sample)  # what staging copies more than once
        parked = _park(lengths, self.spill_dir)
        del lengths
        _release_memory()
        plan = _plan(padded, spec, bar, items.extra_sample, sources)
        del padded
        summary = summarize(
            spec=spec, files=files, stream=stream, read_counts=read_counts, bad_listed=bad_listed, totals=totals,
            overlong=overlong, padded_hist=padded_hist, plan=plan, out=self.out, dry_run=self.opts.dry_run,
        )
        return _Planned(items, sources, parked, plan, _pack_order(plan.num_packs, spec), summary, split,
                        read_counts["spill_bits"])

    def _write(self, planned: _Planned, bar, direct_io: bool) -> dict | None:
        """Pass two, into the temporary output: native shards (their manifest returned) or the
        Bridge split. It reads each run's slice of the plan's order from the spill directory
        too, so what stays resident is the lengths and a few arrays per pack."""
        spill_dir, summary, opts = self.spill_dir, planned.summary, self.opts
        layout = _park_order(planned.plan, spill_dir)
        planned.plan = None
        _release_memory()
        items = planned.items
        items.attach(_unpark(planned.parked_lengths))
        try:
            spill_file = os.path.getsize(os.path.join(spill_dir, SPILL_FILE))
        except OSError as exc:  # the spill directory removed meanwhile
            raise spill_os_error(exc, "reading the spill files") from exc
        mode, room = choose_spill_read(opts.spill_read, spill_file, spill_dir=spill_dir,
                                       staged_needs=staged_memory(self.memory.used + spill_file,
                                                                  summary.counts["padded_tokens"],
                                                                  planned.split_bytes()))
        summary.spill = {"read": mode, "bytes": self.memory.used + spill_file, "memory_bytes": self.memory.used}
        if room is not None:
            summary.spill["room"] = room
        if self.output:
            return self.output.write(self.tmp, spill_dir, items, planned.sources, layout, planned.pack_order,
                                     self.spec, bar, direct_io=direct_io, spill_memory=self.memory, spill_read=mode,
                                     spill_record=summary.spill)
        entries = _write_shards(self.tmp, spill_dir, items, planned.sources, layout, planned.pack_order, self.spec,
                                opts.shard_bytes, bar, direct_io, self.memory, mode, summary.spill)
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "shards": entries}

    def _publish(self, manifest: dict | None, summary: PackSummary) -> None:
        """Drop the spill and rename the finished output into place (a Bridge split: commit it)."""
        # A spill inside the temporary output must go (it would be renamed into OUT with it); one
        # elsewhere (--spill-dir) is the clean-up's to remove, whatever is left of it: a spill
        # directory removed meanwhile is no reason to lose the finished output.
        remove_tree(self.spill_dir, ignore_errors=self.spill_parent is not None)
        if not self.output:
            write_json(os.path.join(self.tmp, MANIFEST_FILE), manifest)
            write_json(os.path.join(self.tmp, METADATA_FILE), seal_metadata(summary.metadata(__version__)))
        placed = self.output.data_name() if self.output else MANIFEST_FILE  # a file that ends up in OUT
        ours = os.stat(os.path.join(self.tmp, placed))
        try:
            if self.output:
                kept = self.output.commit(self.tmp, manifest, summary.metadata(__version__))
            else:
                kept = replace_dir(self.tmp, self.out, self.opts.overwrite,
                                   lambda moved: check_replaceable(moved, (), foreign_names, shown=self.out),
                                   foreign_names)
            self.tmp = None  # in place: nothing left to remove
            result_in_place()
        except Interrupted:
            # A signal held across the renames is raised as they end, or one came just after:
            # if this run's files are in OUT, the run is done, and it exits as one that is.
            if not _same_file(os.path.join(self.out, placed), ours):
                raise
            result_in_place()
            for directory in (self.out, os.path.dirname(os.path.normpath(self.out))):  # the syncs it cut short
                sync_dir(directory, in_place=True)
            kept = None
        if kept and self.warn:  # a replaced OUT left behind
            if foreign := foreign_files(kept, foreign_names):  # written into OUT as it was swapped out
                self.warn(f"{kept} holds the output this run replaced, kept because files packer did not write "
                          f"({foreign}) appeared in it as it was replaced; move them out, then remove it")
            else:
                self.warn(f"{kept} holds the output this run replaced, which could not be deleted (read-only?); "
                          "remove it to free its space")

    def clean_up(self) -> None:
        """Release the spill's memory and remove what is left: the spill (when elsewhere than
        the temporary output) and the temporary output of a run that did not finish."""
        self.memory.release()
        if self.helper is not None:  # a run that failed or was stopped in pass one
            self.helper.stop()
        with interrupts_deferred():  # a signal's exception waits until both are removed
            if self.spill_dir and self.spill_parent:
                remove_tree(self.spill_dir)
            if self.tmp:
                remove_tree(self.tmp)


@dataclass
class _Planned:
    """What pass two needs from the plan stage; ``plan`` is dropped once its order is parked."""

    items: Items
    sources: SourceMap
    parked_lengths: tuple | None
    plan: PackPlan | None
    pack_order: np.ndarray
    summary: PackSummary
    #: the split samples and their spill blocks (``_staged.split_samples``)
    split: tuple[np.ndarray, np.ndarray]
    #: the widest token ids the spill holds
    spill_bits: int

    def split_bytes(self) -> int:
        """Bytes of the split samples in the spill (about: whole blocks of the widest ids)."""
        return int(self.split[1].sum()) * block_bytes(self.spill_bits)

"""Staged reading of the spill: pass two's random reads made sequential, for a spill the page
cache cannot hold.

Pass two gathers each pack's sequences in output order, which is random order in the spill.
While the spill sits in the page cache every read is a copy. Once it does not fit (a spill
larger than the node's free memory, or a container whose memory limit counts the page cache)
every read goes to the device, and a device serves small random reads at a fraction of its
sequential rate: on the benchmark machine ~12k reads a second from one thread, ~50k at best
with many in flight, against ~1.5 GB/s read in order.

Staged reading cuts the output into *stages* (consecutive runs of packs of one shard, at most
``STAGE_RUNS`` of them: about 32M tokens) and, before pass two, copies every spilled sample into
the stage that will need it, in one pass over the spill in file order: ``stages.bin`` holds the
stages one after the other, each stage's samples in spill order, each sample as the spill
blocks that hold the tokens its sequences read (a truncated sample's first ``cap + 1``). Pass two
then reads a stage's bytes with one sequential read and gathers its runs from memory with the
spill's own kernel, through a layout with one entry per sample of the stage. A sample split into
pieces (``--overlong split``) is copied whole into every stage that one of its pieces lands in
(the layout has no room for a part of a sample), so samples many packs long can make the stage
file and each stage image several times their share (:func:`split_copies` counts it).

The cost: one more read and write of about the spill's size, in large sequential pieces; the
stage file on disk beside the spill while pass two runs; per sample, 8 bytes during the copy
(which stage needs it, and the samples grouped by stage) and 4 while pass two runs; the copy's
write buffers (1 MiB a stage, 128 MiB in all at most); and stage images in memory, two to three
at a time (each about 75 MB with a 17-bit vocabulary).
"""
from __future__ import annotations

import bisect
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from packer_cli._kernel_cache import njit
from packer_cli._sequences import BLOCK, Items, sample_start
from packer_cli.shards._gather import (
    BLOCK_TOKENS, MAX_BITS, ORDER_FILE, READ_SLACK, SPILL_FILE, SpillMemory, SpillReader, _load_token, _read_exact,
    SpillError, _span, _write_exact, block_bytes, spill_error, spill_os_error,
)
from packer_cli.shards._sink import file_system_type
from packer_cli.spec import SpillRead

STAGES_FILE = "stages.bin"
STAGE_TOKENS = 32 << 20  # tokens of output per stage, about
STAGE_RUNS = 8  # runs of packs per stage at most for native shards (runs of about 4M tokens)
SCATTER_CHUNK = 32 << 20  # bytes of the spill read at a time while copying it into the stages
WRITE_BUFFERS = 128 << 20  # bytes of all stages' write buffers together
MIN_WRITE_BUFFER, MAX_WRITE_BUFFER = 64 << 10, 1 << 20
ORDER_CHUNK = 1 << 22  # items of the plan order read at a time
SPARE_IMAGES = 2  # buffers of finished stages kept for the next ones
#: Memory pass two holds besides the spill's pages (two shards in flight, each writing one run of
#: ~20 MB while the next is gathered, direct-I/O blocks, the plan's per-pack arrays); the
#: measured crossover (see choose_spill_read) lies between 110 and 200 MB.
PASS_TWO_RESERVE = 160 << 20
UNPLACED, SPLIT = -1, -2  # sample_stage markers: in no pack; pieces in several (see the pair list)


SPILL_READ_MODES = tuple(mode.value for mode in SpillRead)


#: File systems whose files are memory: a spill there is read at random without a page cache to
#: miss, and staging it would put a second copy of it in memory.
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def split_samples(lengths: np.ndarray, extra_sample: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The split samples (``--overlong split``; ``extra_sample`` names one for each extra piece),
    sorted, and each one's spill blocks as staging copies it (at most: one more where it does
    not start a block)."""
    samples = np.unique(extra_sample).astype(np.int64)
    return samples, -(-lengths[samples].astype(np.int64) // BLOCK_TOKENS) + 1


def pack_stages(pack_order: np.ndarray, stage_first: np.ndarray) -> np.ndarray:
    """int32: the stage of every pack, from the output position each stage starts at
    (``pack_order``: the pack at each output position)."""
    position_of_pack = np.empty(pack_order.size, dtype=np.int64)
    position_of_pack[pack_order] = np.arange(pack_order.size)
    return (np.searchsorted(stage_first, position_of_pack, side="right") - 1).astype(np.int32)


def split_copies(split: tuple[np.ndarray, np.ndarray], order: np.ndarray, pack_offsets: np.ndarray,
                 pack_stage: np.ndarray, num_samples: int, extra_sample: np.ndarray) -> int:
    """Blocks the staged copy writes for split samples (``split``: :func:`split_samples`) beyond
    one copy each: a split sample goes whole into every stage one of its pieces lands in. From
    the plan (``order``, ``pack_offsets``; items past ``num_samples`` are extra pieces of
    ``extra_sample``) and each pack's stage: what a dry run counts, without a spill to copy."""
    samples, blocks = split
    if samples.size == 0:
        return 0
    n = num_samples
    is_split = np.zeros(n, dtype=np.bool_)
    is_split[samples] = True
    piece = order >= n
    piece[~piece] = is_split[order[~piece]]
    positions = np.flatnonzero(piece)
    items = order[positions].astype(np.int64)
    sample = np.where(items < n, items, extra_sample[np.maximum(items - n, 0)])
    stage = pack_stage[np.searchsorted(pack_offsets, positions, side="right") - 1].astype(np.int64)
    stages = int(pack_stage.max()) + 1
    distinct = np.unique(sample * stages + stage) // stages  # one per (sample, stage) holding a piece
    copies = np.bincount(np.searchsorted(samples, distinct), minlength=samples.size)
    return int((blocks * np.maximum(copies - 1, 0)).sum())


def staged_memory(spill_total: int, output_tokens: int, split_bytes: int = 0) -> int:
    """Memory staging holds itself (about): the stages' write buffers and the chunks of spill
    read while copying it into them, then the stage images it reads (the current one and
    ``SPARE_IMAGES`` kept), each about the spill's share of one stage's ``STAGE_TOKENS``, and
    from above the split samples' ``split_bytes`` besides (each goes whole into every stage one
    of its pieces lands in: samples many packs long can make every image about the spill's size).
    ``auto`` stages only where the room holds this on top of ``PASS_TWO_RESERVE``. Measured on a
    233 MB spill in 4 stages (175 MB by this count) under memory cgroups, staged was killed for
    memory with 158 and 174 MB of room, and in one run of three with 217 and with 257 MB, while
    reading at random finished every time (13-18 s, against staged's 4-5 s where it lived)."""
    stages = max(1, -(-int(output_tokens) // STAGE_TOKENS))
    image = min(-(-int(spill_total) // stages) + int(split_bytes), int(spill_total))
    return max(WRITE_BUFFERS + 2 * SCATTER_CHUNK, (1 + SPARE_IMAGES) * image)


def choose_spill_read(mode: str, spill_bytes: int, room: int | None = None,
                      spill_dir: str | None = None, staged_needs: int = 0) -> tuple[str, int | None]:
    """(``random`` or ``staged``, the room it was judged against) for ``mode`` (one of
    ``SPILL_READ_MODES``): ``auto`` stages a spill larger than the page cache it can count on
    (``room``, by default :func:`page_cache_room`; None when not asked or unknown) less what
    pass two itself will hold (``PASS_TWO_RESERVE``), unless ``spill_dir`` (the spill's
    directory, or the one it will be made in) is on a file system held in memory
    (``MEMORY_FILE_SYSTEMS``): that spill is itself shared memory, which counts against the
    room, and staging it there was killed for memory in containers where reading it at random
    fit; or unless the room cannot hold staging itself (``staged_needs``, from
    :func:`staged_memory`): under a memory limit that tight staging was killed for memory, while
    reading at random finished, slowly (a 233 MB spill under a 300 MB cgroup: 13 s).

    Where the line lies, measured (5× the benchmark input, a 1.33 GB spill, under memory cgroups
    of 1.2-1.8 GB): reading at random, pass two took 2.3-2.7 s with 1.53 GB of room, then fell
    off a cliff (7.2-7.9 s with 1.44 GB, 12 s with ~1.3 GB, 19.8 s with 1.17 GB), while staged
    took 4.3-6.2 s throughout."""
    if mode != "auto":
        return mode, None
    if spill_dir is not None and file_system_type(spill_dir) in MEMORY_FILE_SYSTEMS:
        return "random", None
    room = page_cache_room() if room is None else room
    stage = room is not None and spill_bytes > room - PASS_TWO_RESERVE and room - PASS_TWO_RESERVE >= staged_needs
    return ("staged" if stage else "random"), room


def page_cache_room() -> int | None:
    """Bytes of page cache this process can count on: the kernel's estimate of memory available
    without swapping (``MemAvailable``, which counts reclaimable cache), less where a cgroup
    memory limit (v1 or v2, this process's group or one above it) leaves less: its limit less
    what of it cannot be reclaimed, its anonymous memory (the spill's memory part among it) and
    its shared memory, since the page cache a group uses is charged to it. None when unknown."""
    rooms = [_mem_available()] + _cgroup_rooms()
    rooms = [r for r in rooms if r is not None]
    return max(0, min(rooms)) if rooms else None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _stat_value(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _cgroup_rooms(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> list[int]:
    """Limit less anonymous and shared memory of every memory-limited cgroup this process is in
    (its own and each above it), for cgroup v2 (``0::/path``) and v1's memory controller. Shared
    memory counts as page cache in both (v1's ``cache``, v2's ``file``) but without swap it
    cannot be reclaimed like the rest of it."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base, limit_file, stat_keys = root, "memory.max", ("anon", "shmem")
            if not os.path.exists(os.path.join(root, "cgroup.controllers")):
                base = os.path.join(root, "unified")
        elif "memory" in controllers.split(","):
            base, limit_file = os.path.join(root, "memory"), "memory.limit_in_bytes"
            stat_keys = ("total_rss", "total_shmem")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            group = os.path.join(base, *parts[:depth])
            limit = _read_int(os.path.join(group, limit_file))
            if limit is None or limit >= 1 << 60:  # no limit ("max", or v1's huge number)
                continue
            held = sum(_stat_value(os.path.join(group, "memory.stat"), key) or 0 for key in stat_keys)
            rooms.append(limit - held)
    return rooms


def group_stages(shards: list[list[tuple[int, int]]], stage_runs: int | None = None) -> list[list[tuple[int, int]]]:
    """The stages: consecutive runs ``(first, end)`` of output positions of one shard, at most
    ``stage_runs`` (default ``STAGE_RUNS``) each, in output order."""
    stage_runs = stage_runs or STAGE_RUNS
    return [runs[i:i + stage_runs] for runs in shards for i in range(0, len(runs), stage_runs)]


# --- kernels -----------------------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _needed(k, lengths, cap1, split):
    """Tokens of sample ``k`` its sequences read: all of a split sample's, else the first
    piece's s + 1 (s = min(n − 1, cap))."""
    return np.int64(lengths[k]) if split else min(np.int64(lengths[k]), cap1)


@njit(cache=True, nogil=True)
def _assign_stages(items, first_pack, pack_offsets, pack_stage, n, extra_sample, sample_stage,
                   pair_sample, pair_stage, n_pairs):
    """Record the stage of every sample of a slice of the plan order (``items``, the items of
    packs ``first_pack``.. in plan order): in ``sample_stage``, or for a split sample (marked
    ``SPLIT``) as a (sample, stage) pair from ``n_pairs`` on. Returns the new pair count."""
    p = first_pack
    base = pack_offsets[first_pack]
    for t in range(items.size):
        while pack_offsets[p + 1] <= base + t:
            p += 1
        q = items[t]
        k = q if q < n else extra_sample[q - n]
        if sample_stage[k] == SPLIT:
            pair_sample[n_pairs] = k
            pair_stage[n_pairs] = pack_stage[p]
            n_pairs += 1
        else:
            sample_stage[k] = pack_stage[p]
    return n_pairs


@njit(cache=True, nogil=True)
def _stage_sizes(lengths, cap1, sample_stage, pair_sample, pair_stage, token_starts, byte_starts, widths,
                 counts, nbytes):
    """Samples and bytes each stage receives (``counts``, ``nbytes``: one entry per stage)."""
    position = np.int64(0)
    j = 0
    for k in range(lengths.size):
        st = sample_stage[k]
        if st != UNPLACED:
            _, _, blocks, w = _span(position, _needed(k, lengths, cap1, st == SPLIT), token_starts, byte_starts,
                                    widths)
            if st >= 0:
                counts[st] += 1
                nbytes[st] += blocks * (w + 1)
            while j < pair_sample.size and pair_sample[j] == k:
                counts[pair_stage[j]] += 1
                nbytes[pair_stage[j]] += blocks * (w + 1)
                j += 1
        position += lengths[k]


@njit(cache=True, nogil=True, inline="always")
def _put(fd, stage, source, at, size, buffers, filled, cursor):
    """Append ``size`` bytes of ``source`` from ``at`` to ``stage``'s region of the stage file
    through its write buffer, which goes out whole whenever it fills."""
    room = buffers.shape[1]
    while size > 0:
        n = min(size, room - filled[stage])
        buffers[stage, filled[stage]:filled[stage] + n] = source[at:at + n]
        filled[stage] += n
        at += n
        size -= n
        if filled[stage] == room:
            if not _write_exact(fd, np.uint64(buffers[stage].ctypes.data), room, cursor[stage]):
                return False
            cursor[stage] += room
            filled[stage] = 0
    return True


@njit(cache=True, nogil=True)
def _scatter(state, chunk, chunk_from, chunk_to, limit, memory, memory_bytes, lengths, cap1, sample_stage, pair_sample,
             pair_stage, token_starts, byte_starts, widths, out_fd, cursor, buffers, filled, grouped, group_cursor,
             last_tokens):
    """Copy placed samples' blocks into their stage(s) (``cursor``: where each stage's next bytes
    go in the stage file), in spill order from the sample ``state`` holds (sample, its stream
    position, next pair), while their blocks start in the file before ``limit``: ``chunk`` holds
    the file's bytes from ``chunk_from`` to ``chunk_to`` (at least ``limit`` plus the largest
    sample's blocks, unless the file ends first). The spill's first ``memory_bytes`` bytes are
    ``memory``. ``grouped`` gets each stage's samples in spill order (from ``group_cursor``);
    ``last_tokens``, unless empty, every sample's last token (placed or not).
    Returns 1 when every sample is done, 0 when one starts at or past ``limit`` (``state`` then
    points at it), -1 when a write fails, -2 when a sample runs past the end of the file."""
    k, position, j = state[0], state[1], state[2]
    want_last = last_tokens.size > 0
    while k < lengths.size:
        st = sample_stage[k]
        if st != UNPLACED or want_last:
            n = np.int64(lengths[k])
            first, at, blocks, w = _span(position, n if want_last else _needed(k, lengths, cap1, st == SPLIT),
                                         token_starts, byte_starts, widths)
            size = blocks * (w + 1)
            if at + size <= memory_bytes:
                source = memory
            else:
                if at - memory_bytes >= limit:
                    state[0], state[1], state[2] = k, position, j
                    return 0
                if at - memory_bytes + size > chunk_to:
                    return -2
                source = chunk
                at -= memory_bytes + chunk_from
            if want_last:  # the span was the whole sample's; what the stages need may be less
                last_tokens[k] = _load_token(np.uint64(source.ctypes.data) + np.uint64(at), position - first + n - 1, w)
                size = ((position - first + _needed(k, lengths, cap1, st == SPLIT) - 1) // BLOCK_TOKENS + 1) * (w + 1)
            if st >= 0:
                if not _put(out_fd, st, source, at, size, buffers, filled, cursor):
                    return -1
                grouped[group_cursor[st]] = k
                group_cursor[st] += 1
            while j < pair_sample.size and pair_sample[j] == k:
                if not _put(out_fd, pair_stage[j], source, at, size, buffers, filled, cursor):
                    return -1
                grouped[group_cursor[pair_stage[j]]] = k
                group_cursor[pair_stage[j]] += 1
                j += 1
        position += lengths[k]
        k += 1
    state[0], state[1], state[2] = k, position, j
    for st in range(filled.size):  # each stage's last bytes
        if filled[st] and not _write_exact(out_fd, np.uint64(buffers[st].ctypes.data), filled[st], cursor[st]):
            return -1
        cursor[st] += filled[st]
        filled[st] = 0
    return 1


@njit(cache=True, nogil=True)
def _stage_layout(samples, lengths, block_start, cap1, extra_sample, token_starts, byte_starts, widths,
                  out_tokens, out_bytes, out_widths, out_first):
    """The layout of one stage's image (one entry per sample, then an end entry of 0 bits) and
    each sample's first block's stream position (``out_first``); returns the image's bytes."""
    tokens = nbytes = np.int64(0)
    for i in range(samples.size):
        k = samples[i]
        split = extra_sample.size > 0 and _contains(extra_sample, k)
        first, _, blocks, w = _span(sample_start(k, lengths, block_start, BLOCK), _needed(k, lengths, cap1, split),
                                    token_starts, byte_starts, widths)
        out_tokens[i], out_bytes[i], out_widths[i], out_first[i] = tokens, nbytes, w, first
        tokens += BLOCK_TOKENS * blocks
        nbytes += blocks * (w + 1)
    out_tokens[samples.size], out_bytes[samples.size], out_widths[samples.size] = tokens, nbytes, 0
    return nbytes


@njit(cache=True, nogil=True, inline="always")
def _contains(sorted_values, k):
    lo, hi = 0, sorted_values.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if sorted_values[mid] < k:
            lo = mid + 1
        else:
            hi = mid
    return lo < sorted_values.size and sorted_values[lo] == k


def open_spill(mode: str, spill_dir: str, memory: SpillMemory | None, items: Items, pack_offsets: np.ndarray,
               pack_order: np.ndarray, runs: list[list[tuple[int, int]]], record: dict | None = None,
               stage_runs: int | None = None, last_tokens: bool = False) -> SpillReader:
    """The spill's reader for ``mode`` (``random`` or ``staged``): a :class:`SpillReader`, or a
    :class:`StagedSpillReader` whose stages group ``runs`` (per shard; :func:`group_stages`,
    ``stage_runs`` a stage), in which case ``record`` gets the number of stages and their bytes."""
    if mode != "staged":
        return SpillReader(spill_dir, memory)
    stages = group_stages(runs, stage_runs)
    reader = StagedSpillReader(spill_dir, memory, items, pack_offsets, pack_order, stages, last_tokens)
    if record is not None:
        record.update(stages=len(stages), stage_bytes=reader.stage_bytes)
    return reader


# --- the reader --------------------------------------------------------------------------------

class _Image:
    """One stage's bytes in memory and its layout, loaded by the first run that needs it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.loaded = False


class StagedSpillReader(SpillReader):
    """A :class:`SpillReader` that gathers each run from its stage's image (module docstring).

    ``stages``: consecutive runs of output positions (:func:`group_stages`), covering every run
    pass two will gather, in output order. Building copies the spill into ``stages.bin`` and
    deletes ``samples.bin``; the plan order (``order.bin``) is read from the spill directory.
    ``last_tokens``: also read every sample's last token on the way (:meth:`last_tokens`).
    """

    def __init__(self, spill_dir: str, memory: SpillMemory | None, items: Items, pack_offsets: np.ndarray,
                 pack_order: np.ndarray, stages: list[list[tuple[int, int]]], last_tokens: bool = False):
        super().__init__(spill_dir, memory)
        self._items = items
        # every sample's last token, read during the copy when asked (Bridge's EOS check needs them)
        self._last_tokens = np.empty(items.num_samples if last_tokens else 0, dtype=np.int32)
        self._stage_first = [runs[0][0] for runs in stages]
        self._runs_left = [len(runs) for runs in stages]
        self._images: dict[int, _Image] = {}
        self._spare: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._cap1 = np.int64(items.cap) + 1
        self._extra_sorted = np.unique(items.extra_sample).astype(np.int64)
        # Buffered, not O_DIRECT like the shards: with the spill 6x a cgroup's room, direct 1 MiB
        # writes (synchronous) made the copy 4.1-4.3 s instead of 2.8-3.0 s and direct reads of
        # the stages 2.7-3.1 s instead of 1.4-1.5 s (5x benchmark input, alternating runs).
        try:
            self._stage_fd = os.open(os.path.join(spill_dir, STAGES_FILE), os.O_RDWR | os.O_CREAT | os.O_TRUNC,
                                     0o600)
            self._fds.append(self._stage_fd)
            sample_stage, pair_sample, pair_stage = self._assign(spill_dir, pack_offsets, pack_order)
            self._build(spill_dir, sample_stage, pair_sample, pair_stage, len(stages))
            self._memory.release()  # its bytes are in the stages now, which is all pass two reads
        except OSError as exc:  # all of it is the spill directory's: named as such (not OUT) under --spill-dir
            self.close()
            raise spill_os_error(exc, "copying the spill into its stages") from exc
        except BaseException:
            self.close()
            raise

    @property
    def stage_bytes(self) -> int:
        """Bytes copied into the stages (the stage file's size)."""
        return int(self._stage_bytes.sum())

    # -- building

    def _assign(self, spill_dir, pack_offsets, pack_order):
        """Which stage needs each sample: read the plan order once, in plan order."""
        items, n = self._items, self._items.num_samples
        pack_stage = pack_stages(pack_order, np.asarray(self._stage_first))
        sample_stage = np.full(n, UNPLACED, dtype=np.int32)
        sample_stage[self._extra_sorted] = SPLIT
        n_split_items = self._extra_sorted.size + items.extra_sample.size
        pair_sample = np.empty(n_split_items, dtype=np.int64)
        pair_stage = np.empty(n_split_items, dtype=np.int64)
        n_pairs = 0
        total = int(pack_offsets[-1])
        with open(os.path.join(spill_dir, ORDER_FILE), "rb") as order:
            first_pack = 0
            while first_pack < pack_order.size:
                last_pack = int(np.searchsorted(pack_offsets, pack_offsets[first_pack] + ORDER_CHUNK, side="right")) - 1
                last_pack = min(max(last_pack, first_pack + 1), pack_order.size)
                count = int(pack_offsets[last_pack] - pack_offsets[first_pack])
                chunk = np.fromfile(order, dtype=np.int32, count=count)
                if chunk.size != count:
                    raise SpillError(f"reading the spill files failed: {ORDER_FILE} ends early: {total} items expected "
                                     "(removed or truncated?)")
                n_pairs = _assign_stages(chunk, first_pack, pack_offsets, pack_stage, n, items.extra_sample,
                                         sample_stage, pair_sample, pair_stage, n_pairs)
                first_pack = last_pack
        n_stages = max(1, len(self._stage_first))
        keys = np.unique(pair_sample[:n_pairs] * n_stages + pair_stage[:n_pairs])  # sorted by sample, then stage
        return sample_stage, keys // n_stages, keys % n_stages

    def _build(self, spill_dir, sample_stage, pair_sample, pair_stage, n_stages):
        lengths = self._items.lengths
        counts = np.zeros(n_stages, dtype=np.int64)
        self._stage_bytes = np.zeros(n_stages, dtype=np.int64)
        _stage_sizes(lengths, self._cap1, sample_stage, pair_sample, pair_stage, *self._layout, counts,
                     self._stage_bytes)
        self._stage_base = np.zeros(n_stages + 1, dtype=np.int64)
        np.cumsum(self._stage_bytes, out=self._stage_base[1:])
        self._group_offsets = np.zeros(n_stages + 1, dtype=np.int64)
        np.cumsum(counts, out=self._group_offsets[1:])
        self._grouped = np.empty(int(self._group_offsets[-1]), dtype=np.int32)
        room = int(min(MAX_WRITE_BUFFER, max(MIN_WRITE_BUFFER, WRITE_BUFFERS // max(1, n_stages))))
        buffers = np.empty((n_stages, room), dtype=np.uint8)
        self._scatter_spill(sample_stage, pair_sample, pair_stage, buffers)
        # everything pass two reads is in the stages now: the spill's disk space goes back
        os.close(self._fds.pop(0))
        os.unlink(os.path.join(spill_dir, SPILL_FILE))

    def _scatter_spill(self, sample_stage, pair_sample, pair_stage, buffers) -> None:
        """Run :func:`_scatter` over the spill file a chunk at a time, the next chunk read on a
        second thread meanwhile (so the device and the copy overlap). Consecutive chunks
        overlap by the largest sample's blocks, so every sample lies whole in one of them."""
        lengths, n_stages = self._items.lengths, self._stage_bytes.size
        spill_fd = self._fds[0]
        file_bytes = os.fstat(spill_fd).st_size
        overlap = (int(lengths.max(initial=0)) // BLOCK_TOKENS + 2) * block_bytes(MAX_BITS)
        size = max(SCATTER_CHUNK, 2 * overlap)
        chunks = [np.empty(size + READ_SLACK, dtype=np.uint8) for _ in range(2)]  # a token is an 8-byte load

        def read(index: int, start: int) -> tuple[np.ndarray, int, int]:
            nbytes = min(size, file_bytes - start)
            if nbytes and not _read_exact(spill_fd, np.uint64(chunks[index].ctypes.data), np.int64(nbytes),
                                          np.int64(start)):
                raise SpillError("copying the spill into its stages failed (the spill was removed or cut short?)")
            return chunks[index], start, start + nbytes

        state = np.zeros(3, dtype=np.int64)
        cursor, filled = self._stage_base[:-1].copy(), np.zeros(n_stages, dtype=np.int64)
        group_cursor = self._group_offsets[:-1].copy()
        with ThreadPoolExecutor(1, thread_name_prefix="packer-stage-read") as reader:
            pending, index = reader.submit(read, 0, 0), 0
            while True:
                chunk, start, end = pending.result()
                limit = file_bytes if end >= file_bytes else end - overlap
                if end < file_bytes:
                    index ^= 1
                    pending = reader.submit(read, index, limit)
                done = _scatter(state, chunk, np.int64(start), np.int64(end), np.int64(limit), self._memory.array,
                                np.int64(self._memory.used), lengths, self._cap1, sample_stage, pair_sample,
                                pair_stage, *self._layout, self._stage_fd, cursor, buffers, filled, self._grouped,
                                group_cursor, self._last_tokens)
                if done == -1:
                    raise spill_error(f"copying the spill into its stages ({STAGES_FILE})", "disk full?")
                if done or end >= file_bytes:
                    break
        if done != 1:
            raise SpillError("copying the spill into its stages failed (the spill was cut short?)")

    # -- gathering

    def gather(self, *args, **kwargs):
        raise NotImplementedError("a staged spill is gathered a run at a time, with gather_run")

    def last_tokens(self, lengths):
        """Every sample's last token, as :meth:`SpillReader.last_tokens` (read during the copy:
        the reader must have been made with ``last_tokens=True``)."""
        if self._last_tokens.size != lengths.size:
            raise RuntimeError("this staged spill was built without its samples' last tokens")
        return self._last_tokens

    def gather_run(self, first: int, seq, pack_seq_offsets, pad_id, min_buffer: int = 0):
        stage = bisect.bisect_right(self._stage_first, first) - 1
        image = self._image(stage)
        try:
            k = np.searchsorted(image.samples, seq.sample)
            if k.size and (k.max() >= image.samples.size or np.any(image.samples[k] != seq.sample)):
                raise RuntimeError(f"a sequence of the run at output pack {first} is missing from stage {stage}")
            src = image.layout[0][k] + (seq.src - image.first[k])
            return self._gather_from(self._stage_fd, image.layout, np.uint64(image.bytes.ctypes.data),
                                     image.size, src, seq.length, seq.padded, pack_seq_offsets, pad_id, min_buffer)
        finally:
            self._run_done(stage)

    def _image(self, stage: int) -> _Image:
        with self._lock:
            image = self._images.setdefault(stage, _Image())
        with image.lock:
            if not image.loaded:
                self._load(stage, image)
        return image

    def _load(self, stage: int, image: _Image) -> None:
        a, b = self._group_offsets[stage], self._group_offsets[stage + 1]
        image.samples = samples = self._grouped[a:b]
        layout = tuple(np.empty(samples.size + 1, dtype=np.int64) for _ in range(3))
        image.first = np.empty(samples.size, dtype=np.int64)
        items = self._items
        size = _stage_layout(samples, items.lengths, items.block_start, self._cap1, self._extra_sorted,
                             *self._layout, *layout, image.first)
        if size != self._stage_bytes[stage]:
            raise RuntimeError(f"stage {stage}: layout of {size} bytes for {self._stage_bytes[stage]} written")
        image.layout, image.size = layout, np.int64(size)
        image.bytes = self._image_buffer()
        if size and not _read_exact(self._stage_fd, np.uint64(image.bytes.ctypes.data), np.int64(size),
                                    np.int64(self._stage_base[stage])):
            raise SpillError("reading the spill's stages failed (was the stage file removed or truncated?)")
        image.loaded = True

    def _image_buffer(self) -> np.ndarray:
        """A buffer for any stage's bytes: a spare one when a finished stage left one (a fresh
        allocation is fresh pages, and faulting them in costs as much as reading the stage)."""
        with self._lock:
            if self._spare:
                return self._spare.pop()
        return np.empty(int(self._stage_bytes.max(initial=0)) + READ_SLACK, dtype=np.uint8)

    def _run_done(self, stage: int) -> None:
        with self._lock:
            self._runs_left[stage] -= 1
            if self._runs_left[stage] == 0:
                image = self._images.pop(stage, None)
                if image is not None and image.loaded and len(self._spare) < SPARE_IMAGES:
                    self._spare.append(image.bytes)  # no run reads it any more

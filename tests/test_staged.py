"""Staged reading of the spill (``--spill-read staged``): the same bytes as reading it at random,
every sample copied once per stage that needs it, the choice ``auto`` makes, and failures."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from packer_cli import pipeline
from packer_cli.cli import app
from packer_cli.demo import demo_table
from packer_cli.errors import ConfigError, OutputError
from packer_cli.pipeline import pack
from packer_cli.shards import _gather, _staged
from packer_cli.shards.bridge_output import BridgeOutput
from packer_cli.spec import OverlongPolicy, PackSpec


def _files(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def mixed_inputs(tmp_path_factory) -> list[str]:
    """Two files whose write batches need different bits per token (a 17-bit and a 30-bit
    vocabulary), with a quarter of the samples past 513 tokens (truncated, dropped or split at the
    tests' pack size of 512)."""
    root = tmp_path_factory.mktemp("staged")
    small, large = root / "small.parquet", root / "large.parquet"
    pq.write_table(demo_table(1500, seed=3, vocab=100_000, max_len=5000), small, row_group_size=700)
    pq.write_table(demo_table(900, seed=4, vocab=1 << 30, max_len=5000), large, row_group_size=400)
    return [str(small), str(large)]


@pytest.fixture
def small_runs(monkeypatch):
    """Runs of ~3 packs and stages of two runs: dozens of stages, two shards in flight."""
    monkeypatch.setattr(pipeline, "BATCH_TOKENS", 6000)
    monkeypatch.setattr(_staged, "STAGE_RUNS", 2)
    monkeypatch.setattr(_staged, "WRITE_BUFFERS", 1 << 16)  # small write buffers: flushed many times
    monkeypatch.setattr(_staged, "MIN_WRITE_BUFFER", 4096)
    monkeypatch.setattr(_staged, "SCATTER_CHUNK", 1 << 16)  # the spill read in many pieces


@pytest.mark.parametrize("spec_kw,pack_kw", [
    ({}, {}),
    ({"overlong": OverlongPolicy.SPLIT}, {}),
    ({"overlong": OverlongPolicy.DROP, "cp": 2, "tp": 2}, {}),
    ({"overlong": OverlongPolicy.SPLIT, "cp": 4, "pad_to_max_length": True}, {"spill_memory": 3 << 20}),
    ({"overlong": OverlongPolicy.SPLIT}, {"spill_memory": 1 << 30}),
    ({"shuffle": False}, {"shard_bytes": 1 << 20}),
], ids=["truncate", "split", "drop-cp2-tp2", "split-cp4-part-in-memory", "all-in-memory", "no-shuffle-small-shards"])
def test_staged_writes_the_same_bytes_as_random(mixed_inputs, tmp_path, small_runs, spec_kw, pack_kw):
    spec = PackSpec(pack_size=512, **spec_kw)
    random = pack(mixed_inputs, str(tmp_path / "random"), spec, spill_read="random", **pack_kw)
    staged = pack(mixed_inputs, str(tmp_path / "staged"), spec, spill_read="staged", **pack_kw)
    assert random.spill["read"] == "random" and staged.spill["read"] == "staged"
    assert staged.spill["stages"] >= 8
    assert _files(tmp_path / "random") == _files(tmp_path / "staged")


def test_each_sample_is_copied_once_per_stage_that_needs_it(mixed_inputs, tmp_path, small_runs):
    """Without split samples the stage file holds each placed sample's blocks once: no more
    bytes than the spill plus a block at each end of a sample (blocks two samples share); with
    split samples, more (a piece landing in another stage takes the whole sample along)."""
    spec = PackSpec(pack_size=512, overlong=OverlongPolicy.DROP)
    dropped = pack(mixed_inputs, str(tmp_path / "drop"), spec, spill_read="staged")
    sequences = dropped.counts["sequences"]
    assert dropped.spill["stage_bytes"] <= dropped.spill["bytes"] + 2 * sequences * 31
    split = pack(mixed_inputs, str(tmp_path / "split"), PackSpec(pack_size=512, overlong=OverlongPolicy.SPLIT),
                 spill_read="staged")
    assert split.spill["stage_bytes"] > split.spill["bytes"]


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_a_staged_copy_of_samples_split_over_many_packs_is_estimated_from_above(tmp_path, small_runs, monkeypatch,
                                                                                 fmt):
    """A split sample goes whole into every stage one of its pieces lands in: 100k-token samples
    over 3 stages made stages.bin 3.0x the spill, where the dry run counted a pack's worth for
    each extra piece (2.0x), said nothing on a disk it did not fit, and the run failed (exit 3).
    The memory auto judges staging by counts the split samples in every stage image too."""
    import pyarrow as pa

    from packer_cli.shards import bridge_writer

    monkeypatch.setattr(_staged, "STAGE_TOKENS", 24_000)  # a Bridge split's steps in several stages too
    monkeypatch.setattr(bridge_writer, "BATCH_TOKENS", 6000)
    rng = np.random.default_rng(5)
    ids = [rng.integers(0, 1000, int(n), dtype=np.int32) for n in rng.integers(10_000, 20_000, 12)]
    pq.write_table(pa.table({"input_ids": ids}), tmp_path / "long.parquet")
    spec = PackSpec(pack_size=512, overlong=OverlongPolicy.SPLIT)

    def run(out, dry_run):
        output = BridgeOutput(row_group_size=4) if fmt == "megatron-bridge" else None
        return pack([str(tmp_path / "long.parquet")], out, spec, spill_read="staged", spill_memory=0,
                    shard_bytes=1 << 16, output=output, dry_run=dry_run)

    dry, real = run(None, True).disk, run(str(tmp_path / "out"), False).spill
    assert real["read"] == "staged" and real["stages"] >= 4
    assert real["stage_bytes"] > 2 * real["bytes"]  # each long sample in several stages
    # from above, by each sample's block rounding at most
    assert real["stage_bytes"] <= dry["stage_bytes"] <= 1.02 * real["stage_bytes"]
    assert CliRunner().invoke(app, ["verify", str(tmp_path / "out")]).exit_code == 0
    split_bytes = 12 * 20_000 * 11 // 8  # every sample split, 10-bit ids and a loss bit a token: at least
    assert _staged.staged_memory(real["bytes"], 10 ** 9, split_bytes) > _staged.staged_memory(real["bytes"], 10 ** 9)


def test_staged_build_matches_a_plain_copy(mixed_inputs, tmp_path, small_runs, monkeypatch):
    """The stage file is each stage's samples in sample order, each as the spill bytes of the
    blocks holding the tokens its sequences read: checked against a plain slice-and-join of
    ``samples.bin``."""
    built = {}

    init = _staged.StagedSpillReader.__init__

    def spying_init(self, spill_dir, memory, items, pack_offsets, pack_order, stages, *rest):
        spill = (Path(spill_dir) / _gather.SPILL_FILE).read_bytes()
        init(self, spill_dir, memory, items, pack_offsets, pack_order, stages, *rest)
        built.update(spill=spill, stages=(Path(spill_dir) / _staged.STAGES_FILE).read_bytes(),
                     grouped=self._grouped.copy(), offsets=self._group_offsets.copy(), layout=self._layout,
                     items=items, cap1=int(self._cap1))

    monkeypatch.setattr(_staged.StagedSpillReader, "__init__", spying_init)
    pack(mixed_inputs, str(tmp_path / "out"), PackSpec(pack_size=512), spill_read="staged")
    token_starts, byte_starts, widths = built["layout"]
    lengths = built["items"].lengths.astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    expected = []
    for stage in range(built["offsets"].size - 1):
        samples = built["grouped"][built["offsets"][stage]:built["offsets"][stage + 1]]
        assert np.all(np.diff(samples) > 0)
        for k in samples:
            b = int(np.searchsorted(token_starts, starts[k], side="right")) - 1
            w = int(widths[b])
            r = int(starts[k] - token_starts[b])
            last = r + min(int(lengths[k]), built["cap1"]) - 1
            first_byte = int(byte_starts[b]) + (r // 8) * (w + 1)
            expected.append(built["spill"][first_byte:first_byte + (last // 8 - r // 8 + 1) * (w + 1)])
    assert built["stages"] == b"".join(expected)
    placed = np.sort(built["grouped"])
    assert np.array_equal(placed, np.arange(lengths.size))  # truncate: every sample, once


def test_the_memory_part_is_given_back_once_copied_into_the_stages(mixed_inputs, tmp_path, small_runs, monkeypatch):
    """Nothing reads the spill's memory part after the copy: it stayed resident (anonymous
    memory, charged to a container's limit) through the whole of pass two."""
    held = []
    init = _staged.StagedSpillReader.__init__

    def spying_init(self, spill_dir, memory, *rest):
        before = memory.used
        init(self, spill_dir, memory, *rest)
        held.append((before, memory.used, memory.budget))

    monkeypatch.setattr(_staged.StagedSpillReader, "__init__", spying_init)
    staged = pack(mixed_inputs, str(tmp_path / "staged"), PackSpec(pack_size=512), spill_read="staged",
                  spill_memory=1 << 30)
    pack(mixed_inputs, str(tmp_path / "random"), PackSpec(pack_size=512), spill_read="random", spill_memory=1 << 30)
    assert len(held) == 1 and held[0][0] == staged.spill["memory_bytes"] > 0 and held[0][1:] == (0, 0)
    assert _files(tmp_path / "staged") == _files(tmp_path / "random")


def test_auto_stages_only_a_spill_larger_than_the_room_pass_two_leaves():
    room, reserve = 10 << 30, _staged.PASS_TWO_RESERVE
    assert _staged.choose_spill_read("auto", room - reserve + 1, room=room) == ("staged", room)
    assert _staged.choose_spill_read("auto", room - reserve, room=room) == ("random", room)
    assert _staged.choose_spill_read("random", 1 << 40) == ("random", None)
    assert _staged.choose_spill_read("staged", 0) == ("staged", None)


def test_auto_stages_only_where_the_room_holds_staging_itself():
    """Under a memory cgroup too tight for staging's own buffers and stage images (a 233 MB
    spill, 158-257 MB of room) auto staged and the run was killed for memory, where reading at
    random finished."""
    reserve = _staged.PASS_TWO_RESERVE
    needs = _staged.staged_memory(233_002_170, 103_000_000)  # 4 stages of about 58 MB
    assert needs == max(_staged.WRITE_BUFFERS + 2 * _staged.SCATTER_CHUNK, 3 * -(-233_002_170 // 4))
    for room in (158 << 20, 257 << 20, reserve + needs - 1):
        assert _staged.choose_spill_read("auto", 130_000_000, room=room, staged_needs=needs) == ("random", room)
    room = reserve + needs
    assert _staged.choose_spill_read("auto", 130_000_000, room=room, staged_needs=needs) == ("random", room)  # fits
    assert _staged.choose_spill_read("auto", needs + 1, room=room, staged_needs=needs) == ("staged", room)
    assert _staged.choose_spill_read("auto", 10, room=0) == ("random", 0)  # no room at all: staging would not fit
    assert _staged.choose_spill_read("staged", 1 << 40, room=0, staged_needs=needs) == ("staged", None)  # as asked
    # where the stage images outweigh the buffers: the current image and SPARE_IMAGES kept, three
    needs = _staged.staged_memory(1_330_000_000, 4 * _staged.STAGE_TOKENS)
    assert needs == 3 * -(-1_330_000_000 // 4) > _staged.WRITE_BUFFERS + 2 * _staged.SCATTER_CHUNK
    room = reserve + 800_000_000  # room for two images, not three
    assert _staged.choose_spill_read("auto", 1_330_000_000, room=room, staged_needs=needs) == ("random", room)


def test_auto_reads_a_spill_held_in_memory_at_random(tmp_path, mixed_inputs, monkeypatch):
    """A spill on tmpfs is shared memory, which the room now counts as held: auto staged it, a
    second copy in memory, and a container's limit killed the run where reading it at random fit."""
    for module in (_staged, pipeline):  # a tight container, which still holds staging itself
        monkeypatch.setattr(module, "page_cache_room", lambda: _staged.PASS_TWO_RESERVE)
    monkeypatch.setattr(pipeline, "staged_memory", lambda *sizes: 0)
    scratch = tmp_path / "shm"
    scratch.mkdir()
    assert _staged.choose_spill_read("auto", 1 << 30, spill_dir=str(scratch))[0] == "staged"
    monkeypatch.setattr(_staged, "file_system_type", lambda path: "tmpfs" if str(path).startswith(str(scratch))
                        else None)
    assert _staged.choose_spill_read("auto", 1 << 30, spill_dir=str(scratch / "x")) == ("random", None)
    assert _staged.choose_spill_read("staged", 1 << 30, spill_dir=str(scratch))[0] == "staged"  # as asked
    summary = pack(mixed_inputs, str(tmp_path / "out"), PackSpec(pack_size=512), spill_dir=str(scratch))
    assert summary.spill["read"] == "random"
    import json

    from typer.testing import CliRunner as Runner

    dry = Runner().invoke(app, ["pack", *mixed_inputs, "-o", str(tmp_path / "dry"), "--pack-size", "512",
                                "--dry-run", "--json", "--spill-dir", str(scratch)])
    assert dry.exit_code == 0 and json.loads(dry.stdout)["disk"]["stage_bytes"] == 0, dry.output
    dry = Runner().invoke(app, ["pack", *mixed_inputs, "-o", str(tmp_path / "dry"), "--pack-size", "512",
                                "--dry-run", "--json"])  # the spill beside OUT, not on "tmpfs": staged
    assert dry.exit_code == 0 and json.loads(dry.stdout)["disk"]["stage_bytes"] > 0, dry.output


def test_auto_reads_a_small_spill_at_random_here(tmp_path, mixed_inputs, monkeypatch):
    monkeypatch.setattr(_staged, "page_cache_room", lambda: 1 << 40)
    summary = pack(mixed_inputs, str(tmp_path / "a"), PackSpec(pack_size=512))
    assert summary.spill["read"] == "random" and summary.spill["room"] == 1 << 40
    monkeypatch.setattr(_staged, "page_cache_room", lambda: _staged.PASS_TWO_RESERVE)  # a tight container,
    monkeypatch.setattr(pipeline, "staged_memory", lambda *sizes: 0)  # which still holds staging itself
    summary = pack(mixed_inputs, str(tmp_path / "b"), PackSpec(pack_size=512))
    assert summary.spill["read"] == "staged" and summary.spill["stages"] >= 1
    assert summary.spill["room"] == _staged.PASS_TWO_RESERVE
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_rooms_v1_and_v2(tmp_path):
    """Limit less anonymous and shared memory for every limited group on the path (shared memory,
    where the spill's memory part lies, was counted as room for the page cache: auto read a
    spill at random that it should have staged); unlimited ones skipped."""
    root = tmp_path / "cg"
    _write(root / "memory" / "jobs" / "memory.limit_in_bytes", str(5 << 30))
    _write(root / "memory" / "jobs" / "memory.stat",
           f"cache 123\nrss 1\nshmem 5\ntotal_rss {1 << 30}\ntotal_shmem {1 << 30}\n")
    _write(root / "memory" / "jobs" / "one" / "memory.limit_in_bytes", "9223372036854771712")
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/jobs/one\n3:cpu:/jobs\n0::/\n")
    assert _staged._cgroup_rooms(str(proc), str(root)) == [3 << 30]
    _write(root / "cgroup.controllers", "memory cpu\n")
    _write(root / "pod" / "memory.max", str(2 << 30))
    _write(root / "pod" / "memory.stat", f"anon {512 << 20}\nfile {300 << 20}\nshmem {256 << 20}\n")
    _write(root / "pod" / "c" / "memory.max", "max\n")
    proc.write_text("0::/pod/c\n")
    assert _staged._cgroup_rooms(str(proc), str(root)) == [(2 << 30) - (768 << 20)]
    assert _staged._cgroup_rooms(str(tmp_path / "missing"), str(root)) == []


def test_page_cache_room_is_known_on_linux():
    room = _staged.page_cache_room()
    assert room is None or room >= 0
    if os.path.exists("/proc/meminfo"):
        assert room is not None and room > 0


def test_only_named_modes(mixed_inputs, tmp_path):
    with pytest.raises(ConfigError, match="spill read must be one of auto, random, staged"):
        pack(mixed_inputs, str(tmp_path / "c"), PackSpec(pack_size=512), spill_read="sequential")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("spec_kw", [{}, {"overlong": OverlongPolicy.SPLIT, "cp": 2}, {"overlong": OverlongPolicy.DROP}],
                         ids=["truncate", "split-cp2", "drop"])
def test_bridge_output_staged_writes_the_same_bytes(mixed_inputs, tmp_path, small_runs, monkeypatch, spec_kw):
    """Megatron-Bridge's layout from a staged spill: the same files and the same EOS verdict,
    with every sample's last token read during the copy (compared with the random reader's)."""
    from packer_cli.shards import bridge_writer

    monkeypatch.setattr(bridge_writer, "BATCH_TOKENS", 6000)  # steps of one row group
    monkeypatch.setattr(_staged, "STAGE_TOKENS", 12000)  # stages of about two steps: many stages
    seen = {}
    random_last = _gather.SpillReader.last_tokens

    def spying_random_last(self, lengths):
        seen["random"] = random_last(self, lengths).copy()
        return seen["random"]

    staged_last = _staged.StagedSpillReader.last_tokens

    def spying_staged_last(self, lengths):
        seen["staged"] = staged_last(self, lengths).copy()
        return seen["staged"]

    monkeypatch.setattr(_gather.SpillReader, "last_tokens", spying_random_last)
    monkeypatch.setattr(_staged.StagedSpillReader, "last_tokens", spying_staged_last)
    spec = PackSpec(pack_size=512, **spec_kw)
    random = pack(mixed_inputs, str(tmp_path / "random"), spec, output=BridgeOutput(row_group_size=8),
                  spill_read="random")
    staged = pack(mixed_inputs, str(tmp_path / "staged"), spec, output=BridgeOutput(row_group_size=8),
                  spill_read="staged")
    assert staged.spill["read"] == "staged" and staged.spill["stages"] >= 8
    assert seen["staged"].size == seen["random"].size == random.counts["records"]  # dropped samples too
    assert np.array_equal(seen["staged"], seen["random"])
    assert staged.output == random.output
    assert _files(tmp_path / "random") == _files(tmp_path / "staged")


def test_a_spill_cut_short_fails_the_staged_copy_cleanly(mixed_inputs, tmp_path, monkeypatch):
    """A spill that lost its tail (another process, a full disk) is an OutputError naming the
    output, and nothing is left behind."""
    choose = _staged.choose_spill_read

    def truncate_then_choose(mode, spill_bytes, room=None, spill_dir=None, staged_needs=0):
        for spill in tmp_path.rglob(_gather.SPILL_FILE):
            os.truncate(spill, spill_bytes // 2)
        return choose(mode, spill_bytes, room, spill_dir, staged_needs)

    monkeypatch.setattr(pipeline, "choose_spill_read", truncate_then_choose)
    with pytest.raises(OutputError, match="copying the spill into its stages failed"):
        pack(mixed_inputs, str(tmp_path / "out"), PackSpec(pack_size=512), spill_read="staged")
    assert not any(tmp_path.iterdir())


def test_a_failing_stage_write_names_the_spill_directory_and_its_error(mixed_inputs, tmp_path, monkeypatch):
    """With --spill-dir, a stage file that cannot be written (its disk full: it needs about the
    spill's size again) was blamed on OUT, as 'disk full?' without the system's error."""
    opened = os.open

    def stage_file_read_only(path, flags, *args, **kwargs):
        if os.path.basename(path) == _staged.STAGES_FILE:  # every write to it fails: EBADF
            flags = (flags & ~(os.O_RDWR | os.O_WRONLY)) | os.O_RDONLY
        return opened(path, flags, *args, **kwargs)

    monkeypatch.setattr(_staged.os, "open", stage_file_read_only)
    spill = tmp_path / "scratch"
    spill.mkdir()
    with pytest.raises(OutputError) as raised:
        pack(mixed_inputs, str(tmp_path / "out"), PackSpec(pack_size=512), spill_read="staged", spill_dir=str(spill))
    assert str(raised.value) == (f"{spill}: copying the spill into its stages ({_staged.STAGES_FILE}) failed: "
                                 "[Errno 9] Bad file descriptor")
    assert list(spill.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["scratch"]


def test_cli_spill_read_option(mixed_inputs, tmp_path):
    import orjson

    runner = CliRunner()
    result = runner.invoke(app, ["pack", *mixed_inputs, "-o", str(tmp_path / "out"), "--pack-size", "512",
                                 "--spill-read", "staged", "--json"])
    assert result.exit_code == 0, result.output
    record = orjson.loads(result.stdout)
    assert record["spill"]["read"] == "staged" and record["spill"]["stages"] >= 1
    metadata = orjson.loads((tmp_path / "out" / "metadata.json").read_bytes())
    assert "spill" not in metadata  # an I/O choice: the output is the same either way
    result = runner.invoke(app, ["pack", *mixed_inputs, "-o", str(tmp_path / "x"), "--spill-read", "sideways"])
    assert result.exit_code == 2
    result = runner.invoke(app, ["pack", *mixed_inputs, "-o", str(tmp_path / "y"), "--pack-size", "512",
                                 "--spill-read", "staged"])
    assert result.exit_code == 0 and "spill read back" in result.output, result.output
    assert f"staged, {record['spill']['stages']:,} stages" in result.output



def test_the_spill_file_is_deleted_once_the_stages_are_built(mixed_inputs, tmp_path, small_runs, monkeypatch):
    """Pass two reads the stages only: the spill file goes as soon as they are built, so the
    disk holds spill and stages together only while copying (the dry run's disk estimate
    counts on it, docs/PACK.md)."""
    from packer_cli.shards._gather import SPILL_FILE

    seen = []
    init, gather_run = _staged.StagedSpillReader.__init__, _staged.StagedSpillReader.gather_run

    def watched_init(self, spill_dir, *args, **kwargs):
        seen.append(spill_dir)
        return init(self, spill_dir, *args, **kwargs)

    def watched_gather_run(self, *args, **kwargs):
        if len(seen) == 1:
            seen.append(sorted(os.listdir(seen[0])))
        return gather_run(self, *args, **kwargs)

    monkeypatch.setattr(_staged.StagedSpillReader, "__init__", watched_init)
    monkeypatch.setattr(_staged.StagedSpillReader, "gather_run", watched_gather_run)
    pack(mixed_inputs, str(tmp_path / "out"), PackSpec(pack_size=512), spill_read="staged", spill_memory=0,
         spill_dir=str(tmp_path))
    assert len(seen) == 2 and seen[1], seen  # the stages were there as pass two read them
    assert SPILL_FILE not in seen[1]


def test_a_cgroup_v2_limit_at_a_namespaced_root_is_counted():
    """In a container with its own cgroup namespace, /proc/self/cgroup reads "0::/" and the
    container's limit is memory.max at the root of /sys/fs/cgroup: that group counts too."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "cg"
        _write(root / "cgroup.controllers", "memory cpu\n")
        _write(root / "memory.max", str(2 << 30))
        _write(root / "memory.stat", f"anon {512 << 20}\nfile {300 << 20}\nshmem {256 << 20}\n")
        proc = Path(scratch) / "cgroup"
        proc.write_text("0::/\n")
        assert _staged._cgroup_rooms(str(proc), str(root)) == [(2 << 30) - (768 << 20)]


def test_page_cache_room_is_the_tightest_of_free_memory_and_every_cgroup(monkeypatch):
    monkeypatch.setattr(_staged, "_mem_available", lambda: 64 << 30)
    monkeypatch.setattr(_staged, "_cgroup_rooms", lambda: [8 << 30, 2 << 30])
    assert _staged.page_cache_room() == 2 << 30
    monkeypatch.setattr(_staged, "_cgroup_rooms", lambda: [-(1 << 20)])  # a group over its limit: no room
    assert _staged.page_cache_room() == 0
    monkeypatch.setattr(_staged, "_mem_available", lambda: None)
    monkeypatch.setattr(_staged, "_cgroup_rooms", lambda: [])
    assert _staged.page_cache_room() is None


def test_a_spill_cut_short_where_a_sample_starts_fails_the_staged_copy_cleanly(mixed_inputs, tmp_path, monkeypatch):
    """Cut at the first block of a sample (here: the whole file part), no sample runs past the
    end: the copy stops with samples not copied, which is the same error."""
    choose = _staged.choose_spill_read

    def truncate_then_choose(mode, spill_bytes, room=None, spill_dir=None, staged_needs=0):
        for spill in tmp_path.rglob(_gather.SPILL_FILE):
            os.truncate(spill, 0)
        return choose(mode, spill_bytes, room, spill_dir, staged_needs)

    monkeypatch.setattr(pipeline, "choose_spill_read", truncate_then_choose)
    with pytest.raises(OutputError, match="copying the spill into its stages failed"):
        pack(mixed_inputs, str(tmp_path / "out"), PackSpec(pack_size=512), spill_read="staged", spill_memory=0)
    assert not any(tmp_path.iterdir())


def test_a_pack_of_more_items_than_a_chunk_of_the_plan_order_is_read_whole(mixed_inputs, tmp_path, small_runs,
                                                                            monkeypatch):
    """The plan order is read ORDER_CHUNK items at a time, but a pack at least: a pack holding
    more items than that (tiny samples, a huge pack size) must not make an empty chunk (and no
    progress, for ever)."""
    assign = _staged._assign_stages

    def no_empty_chunk(items, *args):
        assert items.size > 0, "an empty chunk of the plan order: no progress"
        return assign(items, *args)

    monkeypatch.setattr(_staged, "ORDER_CHUNK", 1)
    monkeypatch.setattr(_staged, "_assign_stages", no_empty_chunk)
    spec = PackSpec(pack_size=512, overlong=OverlongPolicy.SPLIT)
    staged = pack(mixed_inputs, str(tmp_path / "staged"), spec, spill_read="staged")
    pack(mixed_inputs, str(tmp_path / "random"), spec, spill_read="random")
    assert staged.spill["read"] == "staged" and _files(tmp_path / "staged") == _files(tmp_path / "random")


def test_at_most_spare_images_are_kept_for_the_next_stages(mixed_inputs, tmp_path, small_runs, monkeypatch):
    """staged_memory counts the current image and SPARE_IMAGES kept; one more kept is one more
    stage's bytes resident, beyond what auto judged the room by."""
    kept = []
    run_done = _staged.StagedSpillReader._run_done

    def watched(self, stage):
        run_done(self, stage)
        kept.append(len(self._spare))

    def fresh_buffer(self):  # no stage takes a spare: finished stages pile up, as where several end at once
        return np.empty(int(self._stage_bytes.max(initial=0)) + _gather.READ_SLACK, dtype=np.uint8)

    monkeypatch.setattr(_staged.StagedSpillReader, "_run_done", watched)
    monkeypatch.setattr(_staged.StagedSpillReader, "_image_buffer", fresh_buffer)
    summary = pack(mixed_inputs, str(tmp_path / "out"), PackSpec(pack_size=512), spill_read="staged", warn=None)
    assert summary.spill["stages"] > _staged.SPARE_IMAGES + 2
    assert max(kept) == _staged.SPARE_IMAGES


def test_an_interrupted_staged_copy_closes_its_files(mixed_inputs, tmp_path, monkeypatch):
    """A Ctrl-C while the spill is copied into its stages: the reader is not made, so nothing
    else can close the spill and stage files it opened (a library caller kept them open)."""
    def fds():
        return set(os.listdir("/proc/self/fd"))

    def interrupted(self, *args):
        raise KeyboardInterrupt

    pack(mixed_inputs, str(tmp_path / "warm"), PackSpec(pack_size=512), spill_read="staged", warn=None)
    monkeypatch.setattr(_staged.StagedSpillReader, "_scatter_spill", interrupted)
    before = fds()
    with pytest.raises(KeyboardInterrupt):
        pack(mixed_inputs, str(tmp_path / "out"), PackSpec(pack_size=512), spill_read="staged")
    assert fds() <= before
    assert not (tmp_path / "out").exists()


def test_every_stage_image_has_room_for_the_last_token_s_8_byte_load(mixed_inputs, tmp_path, small_runs, monkeypatch):
    """The gather loads a token as 8 bytes: a stage image's buffer holds READ_SLACK bytes past the
    largest stage, so the last token of a full one is not read past the allocation."""
    sizes = []
    image_buffer = _staged.StagedSpillReader._image_buffer

    def watched(self):
        buffer = image_buffer(self)
        sizes.append((buffer.size, int(self._stage_bytes.max())))
        return buffer

    monkeypatch.setattr(_staged.StagedSpillReader, "_image_buffer", watched)
    pack(mixed_inputs, str(tmp_path / "out"), PackSpec(pack_size=512), spill_read="staged", warn=None)
    assert sizes and all(size >= largest + _gather.READ_SLACK for size, largest in sizes)

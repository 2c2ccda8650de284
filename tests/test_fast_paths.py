"""The compiled fast paths give exactly what the reference paths give.

* ``normalize_batch``: the one-pass kernels (all records good) against the vectorized checks;
* the spill layout, and ``SpillReader.gather`` (``pread``) against the naive ``gather_packs``;
* ``ShardFile``: the hash taken while writing equals the hash of the file read back.
"""
from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pyarrow as pa
import pytest

from naive import gather_packs
from packer_cli._arrow import numpy_dtype
from packer_cli.errors import BadRecord
from packer_cli.shards._gather import (
    LAYOUT_FILE, ORDER_FILE, READ_SLACK, SPILL_FILE, SpillError, SpillMemory, SpillReader, SpillTally, SpillWriter,
    _store_blocks, block_bytes, token_bits,
)
from packer_cli.shards.writer import ShardFile, file_checksum, pack_record_batch
from packer_cli.sources import normalize
from packer_cli.sources.normalize import Supervision, normalize_batch
from packer_cli.spec import SourceSpec


def _batch(rng, n_rows, value_type, list_type, kind):
    lengths = rng.integers(0, 40, n_rows)
    lengths[::7] = 1  # some too short to keep
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64 if list_type is pa.large_list else np.int32)
    tokens = rng.integers(0, 120, int(offsets[-1])).astype(numpy_dtype(value_type))
    ids = list_type(value_type)
    columns = {"input_ids": pa.Array.from_buffers(ids, n_rows, [None, pa.py_buffer(offsets)],
                                                  children=[pa.array(tokens, type=value_type)])}
    if kind == "mask":
        mask = rng.integers(0, 2, tokens.size).astype(np.uint8)
        columns["loss_mask"] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(mask))
    elif kind == "labels":
        labels = np.where(rng.random(tokens.size) < 0.5, -100, tokens.astype(np.int64))
        columns["labels"] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(labels))
    elif kind == "answer":
        columns["answer_start_idx"] = pa.array((lengths * rng.random(n_rows)).astype(np.int64))
    return pa.RecordBatch.from_pydict(columns), Supervision(kind, {"mask": "loss_mask", "labels": "labels",
                                                                   "answer": "answer_start_idx"}.get(kind))


@pytest.mark.parametrize("value_type", [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(),
                                        pa.uint32()])
@pytest.mark.parametrize("list_type", [pa.list_, pa.large_list])
@pytest.mark.parametrize("kind", ["all", "mask", "labels", "answer"])
def test_normalize_fast_path_matches_vectorized(monkeypatch, value_type, list_type, kind):
    rng = np.random.default_rng(hash((str(value_type), str(list_type), kind)) % 2**32)
    batch, sup = _batch(rng, 300, value_type, list_type, kind)
    for spec in (SourceSpec(), SourceSpec(vocab_size=1000)):
        kwargs = dict(path="x", row0=10, index0=1000, sup=sup, spec=spec)
        fast = normalize._fast_batch(batch, spec.tokens_field, sup, spec, 1000)
        assert fast is not None, "a clean batch must take the fast path"
        monkeypatch.setattr(normalize, "_fast_batch", lambda *a: None)
        slow = normalize_batch(batch, **kwargs)
        monkeypatch.undo()
        for name in ("tokens", "targets", "lengths", "source_index"):
            got, want = getattr(fast, name), getattr(slow, name)
            assert got.dtype == want.dtype, name
            np.testing.assert_array_equal(got, want, err_msg=name)
        assert (fast.records, fast.too_short, fast.bad) == (slow.records, slow.too_short, slow.bad)


def test_normalize_fast_path_declines_bad_batches():
    """Batches with a bad record are left to the vectorized checks, which word the problem: a
    mask whose rows' lengths differ from the tokens' but add up to the same total was taken as
    clean, each row's targets read from its neighbour's mask values."""
    batch = pa.RecordBatch.from_pydict({"input_ids": pa.array([[1, 2], [3, -4]], type=pa.list_(pa.int32()))})
    assert normalize._fast_batch(batch, "input_ids", Supervision("all"), SourceSpec(), 0) is None
    big = pa.RecordBatch.from_pydict({"input_ids": pa.array([[1, 2], [3, 70000]], type=pa.list_(pa.int32()))})
    assert normalize._fast_batch(big, "input_ids", Supervision("all"), SourceSpec(vocab_size=32000), 0) is None
    # each row's mask as long as another row's tokens: the same values in all, split elsewhere
    shifted = pa.RecordBatch.from_pydict({"input_ids": [[1, 2], [3, 4, 5]], "loss_mask": [[0, 1, 1], [1, 1]]})
    sup = Supervision("mask", "loss_mask")
    assert normalize._fast_batch(shifted, "input_ids", sup, SourceSpec(), 0) is None
    with pytest.raises(BadRecord, match=r"^x: row 0: loss_mask has 3 values but input_ids has 2$"):
        normalize_batch(shifted, path="x", row0=0, index0=0, sup=sup, spec=SourceSpec())


def _spill(tmp_path, tokens, targets, lengths, batches=3, memory: SpillMemory | None = None):
    """Write a spill of these samples the way pass one does (SpillWriter, a few batches; the
    first ones into ``memory`` as far as its budget goes)."""
    cuts = np.linspace(0, lengths.size, batches + 1).astype(int)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    writer = SpillWriter(str(tmp_path), memory)
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b > a:
            writer.write(tokens[starts[a]:starts[b]], targets[starts[a]:starts[b]])
    writer.close()
    return writer


# how much of the spill goes to memory: none, the first batch or two only, all of it
BUDGETS = {"file": lambda total: 0, "split": lambda total: total // 2, "memory": lambda total: total}


def _ids_of_every_width(rng, lengths):
    """Token ids whose write batches need 16, 17, 24 and 31 bits a token."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    cuts = np.linspace(0, lengths.size, 5).astype(int)
    tokens = np.empty(int(starts[-1]), dtype=np.int32)
    for (a, b), top in zip(zip(cuts[:-1], cuts[1:]), (1 << 16, 1 << 17, 1 << 24, 2**31 - 1)):
        tokens[starts[a]:starts[b]] = rng.integers(top // 2, top, int(starts[b] - starts[a]))
    return tokens


def _blocks(tokens, flags, bits):
    """The spill layout of one batch, spelled out: blocks of 8 tokens packed little-endian at
    ``bits`` bits each (``bits`` bytes), then a byte of their flags, the last block padded
    with zeros."""
    out = b""
    for a in range(0, len(tokens), 8):
        ids = [int(t) for t in tokens[a:a + 8]] + [0] * (8 - len(tokens[a:a + 8]))
        packed = sum(t << (j * bits) for j, t in enumerate(ids))
        flag_bits = sum(int(f) << j for j, f in enumerate(flags[a:a + 8]))
        out += packed.to_bytes(bits, "little") + bytes([flag_bits])
    return out


def test_spill_layout_is_blocks_of_tokens_then_their_flags(tmp_path):
    lengths = np.array([11, 1, 2, 9])
    tokens = np.array([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 70000, 2**30, 31,
                       1, 0, 1, 1, 0, 1, 1, 0, 1], dtype=np.int32)
    targets = np.array([0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 0, 1, 1, 1, 1], dtype=np.uint8)
    _spill(tmp_path, tokens, targets, lengths, batches=4)  # one sample a batch: 5, 17, 31 and 1 bits
    raw = (tmp_path / SPILL_FILE).read_bytes()
    spans, bits = [(0, 11), (11, 12), (12, 14), (14, 23)], (5, 17, 31, 1)
    want = [_blocks(tokens[a:b], targets[a:b], w) for (a, b), w in zip(spans, bits)]
    assert [len(x) for x in want] == [12, 18, 32, 4]  # two blocks of 6 bytes, one of 18, one of 32, two of 2
    assert raw == b"".join(want)
    layout = np.fromfile(tmp_path / LAYOUT_FILE, dtype=np.int64).reshape(-1, 3)
    assert layout.tolist() == [[0, 0, 5], [11, 12, 17], [12, 30, 31], [14, 62, 1], [23, 66, 0]]  # then the end
    assert [token_bits(x) for x in (0, 1, 2, 100256, 131071, 131072, 2**24 - 1, 2**31 - 1)] == [1, 1, 2, 17, 17, 18,
                                                                                                  24, 31]


def test_every_width_and_tail_stores_exactly_the_documented_blocks():
    """The store kernel against the layout spelled out, for every width (the common ones run a
    copy of the loop with the width a constant) and every length of the last block."""
    rng = np.random.default_rng(12)
    for bits in range(1, 32):
        for n in [*range(1, 18), 64, 203]:
            tokens = rng.integers(0, 1 << bits, n).astype(np.int32)
            tokens[::5] = (1 << bits) - 1
            targets = rng.integers(0, 3, n).astype(np.uint8)  # 2 is a target too
            out = np.full(-(-n // 8) * block_bytes(bits), 0xAB, dtype=np.uint8)  # garbage where nothing is stored
            _store_blocks(tokens, targets, bits, out)
            assert out.tobytes() == _blocks(tokens, targets != 0, bits), (bits, n)


def test_every_bit_width_round_trips(tmp_path):
    """For each width from 1 to 31 bits: ids at the top of the range, every block length, the
    gather and the last tokens read back exactly what was written."""
    rng = np.random.default_rng(11)
    for bits in range(1, 32):
        lengths = rng.integers(2, 40, 25)
        n = int(lengths.sum())
        tokens = rng.integers(0, 1 << bits, n).astype(np.int32)
        tokens[::7] = (1 << bits) - 1  # all bits set
        targets = rng.integers(0, 2, n, dtype=np.uint8)
        work = tmp_path / f"b{bits}"
        work.mkdir()
        writer = _spill(work, tokens, targets, lengths, batches=1)
        assert writer._batches[0][2] == bits  # the top id needs every bit
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        seq_len = lengths - 1
        offsets = np.array([0, lengths.size], dtype=np.int64)
        np.arange(lengths.size, dtype=np.int32).tofile(work / ORDER_FILE)
        with SpillReader(str(work)) as spill:
            got = spill.gather(starts, seq_len, seq_len, offsets, 0)
            want = gather_packs(tokens, targets, starts, np.arange(lengths.size), np.zeros(lengths.size, np.int64),
                                seq_len, seq_len, offsets, 0)
            for g, w in zip(got[:4], want):
                np.testing.assert_array_equal(g, w, err_msg=f"{bits} bits")
            np.testing.assert_array_equal(spill.last_tokens(lengths), tokens[np.cumsum(lengths) - 1])


def _memory_for(tmp_path, tokens, targets, lengths, budget) -> SpillMemory:
    """A SpillMemory whose budget is ``budget(total spill bytes)``, checked to split as meant."""
    probe = tmp_path / "probe"
    probe.mkdir()
    total = _spill(probe, tokens, targets, lengths)._bytes
    memory = SpillMemory(budget(total))
    writer = _spill(tmp_path, tokens, targets, lengths, memory=memory)
    on_file = (tmp_path / SPILL_FILE).stat().st_size
    assert memory.used + on_file == writer._bytes == total
    assert (memory.used > 0) == (budget(total) > 0) and (on_file > 0) == (budget(total) < total)
    return memory


@pytest.mark.parametrize("budget", BUDGETS.values(), ids=BUDGETS.keys())
def test_pread_gather_matches_naive_gather(tmp_path, budget):
    rng = np.random.default_rng(5)
    lengths = rng.integers(2, 300, 2000)
    lengths[::97] = 9000  # long samples: truncated or split
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = _ids_of_every_width(rng, lengths)
    targets = rng.integers(0, 2, tokens.size, dtype=np.uint8)
    memory = _memory_for(tmp_path, tokens, targets, lengths, budget)
    # sequence table: every sample once, some split into two pieces, some cut short
    sample = np.repeat(np.arange(lengths.size), 2)[: 3000]
    # odd entries start anywhere in their sample (so anywhere in a spill block), at least one token left
    offset = np.where(np.arange(sample.size) % 2 == 1, rng.integers(0, lengths[sample] - 1), 0).astype(np.int64)
    length = np.maximum(1, lengths[sample] - 1 - offset - rng.integers(0, 2, sample.size))
    length = np.minimum(length, 4000)
    assert (offset + length <= lengths[sample] - 1).all()  # every label lies inside its sample
    padded = -(-length // 4) * 4
    plan_order = rng.permutation(sample.size).astype(np.int32)
    plan_offsets = np.concatenate([[0], np.cumsum(np.full(sample.size // 6, 6))]).astype(np.int64)
    pack_order = rng.permutation(plan_offsets.size - 1).astype(np.int32)
    plan_order.tofile(tmp_path / ORDER_FILE)
    with SpillReader(str(tmp_path), memory) as spill:
        for a, b in [(0, 1), (3, 40), (40, pack_order.size)]:
            packs = [plan_order[plan_offsets[p]:plan_offsets[p + 1]] for p in pack_order[a:b]]
            run, run_offsets = spill.run_items(plan_offsets, pack_order[a:b])  # order read from order.bin
            np.testing.assert_array_equal(run, np.concatenate(packs))
            np.testing.assert_array_equal(run_offsets, np.cumsum([0] + [p.size for p in packs]))
            want = gather_packs(tokens, targets, starts, sample[run], offset[run], length[run], padded[run],
                                run_offsets, 7)
            got = spill.gather(starts[sample[run]] + offset[run], length[run], padded[run], run_offsets, 7)
            for g, w in zip(got[:4], want):
                np.testing.assert_array_equal(g, w)
            spill.recycle(got[4])


def test_a_batch_after_one_that_went_to_the_file_goes_to_the_file_too(tmp_path):
    """The memory part holds whole batches from the first up to the first that does not fit, and
    every later one goes to the file: a small last batch that fit the room left went back into
    memory, the memory part was no longer the spill's start, and the gather read the wrong
    bytes (``pack --spill-memory`` exit 3, "reading the spill files failed")."""
    rng = np.random.default_rng(8)
    lengths = np.array([400, 800, 40])  # one sample a batch: big, bigger (does not fit), small (would fit)
    tokens = rng.integers(1024, 2048, int(lengths.sum())).astype(np.int32)  # 11 bits: 12-byte blocks
    targets = rng.integers(0, 2, tokens.size, dtype=np.uint8)
    first, second, third = (n // 8 * block_bytes(11) for n in lengths)
    budget = first + third
    memory = SpillMemory(budget)
    writer = _spill(tmp_path, tokens, targets, lengths, memory=memory)
    tally = SpillTally(budget)  # a dry run's count
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for a, b in zip(starts[:-1], starts[1:]):
        tally.write(tokens[a:b], targets[a:b])
    assert memory.used == tally.in_memory_bytes == first
    assert (tmp_path / SPILL_FILE).stat().st_size == second + third
    assert writer.total_bytes == tally.total_bytes == first + second + third
    seq_len = lengths - 1
    offsets = np.array([0, 3], dtype=np.int64)
    with SpillReader(str(tmp_path), memory) as spill:
        got = spill.gather(starts[:-1], seq_len, seq_len, offsets, 0)
        want = gather_packs(tokens, targets, starts[:-1], np.arange(3), np.zeros(3, np.int64), seq_len, seq_len,
                            offsets, 0)
        for g, w in zip(got[:4], want):
            np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(spill.last_tokens(lengths), tokens[starts[1:] - 1])


def test_a_spill_file_cut_short_is_an_error_not_an_endless_read(tmp_path):
    """A ``pread`` at the end of a truncated ``samples.bin`` reads 0 bytes: taken as progress,
    the gather asked again forever (compiled code without the GIL: not even Ctrl-C stopped it).
    The gather runs in a thread here, so such a loop fails the test instead of hanging it."""
    tokens = np.arange(1000, dtype=np.int32)
    _spill(tmp_path, tokens, np.ones(1000, np.uint8), np.array([1000]), batches=1)
    seq = (np.array([0], np.int64), np.array([999]), np.array([999]), np.array([0, 1], np.int64), 0)
    with SpillReader(str(tmp_path)) as spill:
        np.testing.assert_array_equal(spill.gather(*seq)[0], tokens[:999])  # whole: read (and compiled) here
        os.truncate(tmp_path / SPILL_FILE, 500)
        outcome = []

        def gather():
            try:
                spill.gather(*seq)
                outcome.append("read")
            except Exception as exc:
                outcome.append(exc)

        reading = threading.Thread(target=gather, daemon=True)
        reading.start()
        reading.join(timeout=30)
        assert not reading.is_alive(), "the gather of a truncated spill never returned"
    (error,) = outcome
    assert type(error) is SpillError and str(error) == \
        "reading the spill files failed (were they removed or truncated?)"


@pytest.mark.parametrize("damage", ["end mark lost", "last two rows lost", "a stray item"])
def test_a_damaged_layout_is_refused(tmp_path, damage):
    """layout.bin that lost whole rows (its end mark) was taken as whole, and the last batch read
    with the previous batch's width: wrong tokens, no error; one holding an item too many (not
    rows of 3) failed with a bare ValueError from NumPy's reshape."""
    narrow, wide = np.arange(100, 164, dtype=np.int32), np.arange(70000, 70064, dtype=np.int32)  # 7 and 17 bits
    tokens = np.concatenate([narrow, wide])
    _spill(tmp_path, tokens, np.ones(tokens.size, np.uint8), np.array([64, 64]), batches=2)
    layout = np.fromfile(tmp_path / LAYOUT_FILE, dtype=np.int64)
    assert layout.tolist() == [0, 0, 8, 64, 72, 17, 128, 216, 0]
    layout = {"end mark lost": layout[:-3], "last two rows lost": layout[:-6],
              "a stray item": np.append(layout, 0)}[damage]
    layout.tofile(tmp_path / LAYOUT_FILE)
    with pytest.raises(SpillError) as raised:
        SpillReader(str(tmp_path)).close()
    assert str(raised.value) == "reading the spill files failed: layout.bin is damaged (removed or truncated?)"


@pytest.mark.parametrize("budget", [0, 1, mmap.PAGESIZE, 3 * mmap.PAGESIZE + 5])
def test_the_memory_part_is_readable_past_its_budget(tmp_path, budget):
    """The decoder loads 8 bytes where a token starts (4 for a flag byte), so it reads up to
    READ_SLACK bytes past the last block: a memory part mapped at exactly its budget was read
    past the end of its mapping once filled to a page-aligned budget (a segfault where the next
    page is not mapped)."""
    memory = SpillMemory(budget)
    try:
        assert memory.array.size >= memory.budget + READ_SLACK
        assert not memory.array[memory.budget:memory.budget + READ_SLACK].any()  # readable, and zeros
        n = memory.budget // block_bytes(15) * 8  # 15-bit ids filling the budget exactly, block by block
        if n:
            tokens = np.full(n, (1 << 15) - 1, dtype=np.int32)
            _spill(tmp_path, tokens, np.ones(n, np.uint8), np.array([n]), batches=1, memory=memory)
            assert memory.used == n // 8 * block_bytes(15) and (tmp_path / SPILL_FILE).stat().st_size == 0
            with SpillReader(str(tmp_path), memory) as spill:
                assert spill.last_tokens(np.array([n])).tolist() == [(1 << 15) - 1]
    finally:
        memory.release()


def test_a_shard_abandoned_by_an_error_is_closed(tmp_path):
    """Left by an exception before ``finish``, a shard is discarded: its file closed (20
    abandoned shards held 20 file descriptors open)."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to see which files are open")

    def open_files():
        named = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                named.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the listing's own descriptor, closed by now
                pass
        return named

    batch = pack_record_batch(np.arange(3, dtype=np.int32), np.ones(3, np.uint8), np.array([0, 3], np.int32),
                              np.array([3]), np.array([1]), np.array([0]), np.array([0]), np.array([0, 1]))
    with pytest.raises(RuntimeError, match="^the gather failed$"):
        with ShardFile(str(tmp_path), 0) as shard:
            shard.write(batch, 3)
            assert os.path.realpath(shard.path) in open_files()
            raise RuntimeError("the gather failed")
    assert os.path.realpath(shard.path) not in open_files()


def test_hash_while_writing_equals_file_hash(tmp_path):
    rng = np.random.default_rng(0)
    with ShardFile(str(tmp_path), 0) as first, ShardFile(str(tmp_path), 1) as second:
        for k in range(5):
            n_seq = 40
            seq_lens = rng.integers(1, 100, n_seq)
            pack_seq_offsets = np.arange(0, n_seq + 1, 4)
            cu = np.concatenate([np.concatenate([[0], np.cumsum(seq_lens[i:i + 4])])
                                 for i in range(0, n_seq, 4)]).astype(np.int32)
            tokens = rng.integers(0, 1000, int(seq_lens.sum()), dtype=np.int32)
            batch = pack_record_batch(tokens, np.ones(tokens.size, np.uint8), cu, seq_lens, np.zeros(n_seq, np.int32),
                                      np.arange(n_seq), np.zeros(n_seq), pack_seq_offsets)
            (first if k % 2 else second).write(batch, int(tokens.size))
        entries = [first.finish(), second.finish()]
    assert [e["rows"] for e in entries] == [20, 30]
    for entry in entries:
        assert entry["bytes"] == (tmp_path / entry["name"]).stat().st_size
        assert entry["xxh3_64"] == file_checksum(str(tmp_path / entry["name"]))


@pytest.mark.parametrize("budget", BUDGETS.values(), ids=BUDGETS.keys())
def test_last_tokens_reads_each_samples_last_token(tmp_path, budget):
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 9, 30)
    tokens = _ids_of_every_width(rng, lengths)
    memory = _memory_for(tmp_path, tokens, np.zeros(tokens.size, dtype=np.uint8), lengths, budget)
    with SpillReader(str(tmp_path), memory) as spill:
        np.testing.assert_array_equal(spill.last_tokens(lengths), tokens[np.cumsum(lengths) - 1])
        with pytest.raises(OSError, match="reading the spill files failed"):
            spill.last_tokens(np.append(lengths, 5))  # one sample more than the spill holds


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64])
def test_validation_kernels_match_numpy(dtype):
    """The vectorized checks (flags accumulated, no early exit) answer what the obvious NumPy does,
    for every bit of the value: a mask value of 256 read through its low byte passed as 0."""
    from packer_cli.sources import _kernels

    info = np.iinfo(dtype)
    edges = [0, 1, 2, info.max, info.max - 1, info.min, info.min + 1 if info.min else 3]
    rng = np.random.default_rng(int(info.bits))
    high = info.min if info.min else info.max // 2 + 1  # the top bit alone: its low byte is 0 (but in 8 bits)
    for values in [np.array(edges, dtype=dtype), np.zeros(0, dtype=dtype), rng.integers(0, 2, 1000).astype(dtype),
                   np.concatenate([rng.integers(0, 2, 999).astype(dtype), np.array([info.max], dtype=dtype)]),
                   np.array([0, 1, high, high + 1, 1], dtype=dtype),
                   np.array([1, 256 if info.bits > 8 else 2], dtype=dtype)]:
        wide = values.astype(np.float64)  # exact enough to compare with the small limits below
        assert _kernels.mask_is_binary(values) == bool(np.isin(values, [0, 1]).all())
        for limit in (1, 2, 128, 2**31):
            in_range, top = _kernels.tokens_in_range(values, limit)
            assert in_range == bool(((wide >= 0) & (wide < limit)).all())
            if in_range:
                assert top == (int(wide.max()) if wide.size else 0)


def test_labels_to_targets_ignores_minus_100_whatever_the_token():
    from packer_cli.sources import _kernels

    tokens = np.array([5, -100, 7, 9], dtype=np.int32)
    labels = np.array([-100, -100, 7, -100], dtype=np.int64)
    out = np.full(4, 9, dtype=np.uint8)
    assert _kernels.labels_to_targets(labels, tokens, out)
    assert out.tolist() == [0, 0, 1, 0]
    assert not _kernels.labels_to_targets(np.array([-100, 3, 7, -100]), tokens, out)


def test_target_counts_match_python():
    from packer_cli.sources import _kernels

    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 60, 300)
    targets = rng.integers(0, 2, int(lengths.sum())).astype(np.uint8)
    runtime, tail = np.empty(300, np.int64), np.empty(300, np.int64)
    _kernels.target_counts(targets, lengths, 20, runtime, tail)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for k, (a, n) in enumerate(zip(starts, lengths)):
        row = targets[a:a + n].astype(int)
        assert runtime[k] == row[1:].sum() and tail[k] == row[21:].sum()


def _smaps_entry(address: int) -> dict:
    """This process's ``/proc/self/smaps`` entry of the mapping holding ``address``: its
    permissions (``perms``), flags (``VmFlags``) and sizes in kB."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                start, end = (int(x, 16) for x in head[0].split("-"))
                entry = {"perms": head[1]} if start <= address < end else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.split() if key == "VmFlags" else int(value.split()[0])
                if key == "VmFlags":
                    return entry
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_the_memory_part_is_private_memory_in_small_pages():
    """The pages written become the process's own anonymous memory (faulting shared memory's
    pages costs more) and never huge pages (which cost seconds to fault in where free memory
    goes back to a hypervisor); only what is written is resident."""
    memory = SpillMemory(64 << 20)
    try:
        memory.array[: 16 << 20] = 1
        entry = _smaps_entry(int(memory.address))
        assert entry["perms"].endswith("p")  # private, not shared
        assert 16 << 10 <= entry["Anonymous"] == entry["Rss"] < 32 << 10  # kB: what was written, no more
        assert entry["Shared_Dirty"] == 0 and entry["AnonHugePages"] == 0
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            assert "nh" in entry["VmFlags"]
    finally:
        memory.release()


def _bridge_rows(rng, rows: int, id_type, pad_fill: int) -> pa.Table:
    """Random Bridge rows in packer's columns: sequences of runtime length p (n = p + 1 stored
    slots), real length s (some outside 0..p, which the reader keeps and clips)."""
    ids, mask, starts, lens = [], [], [], []
    for _ in range(rows):
        p = rng.integers(0, 9, rng.integers(1, 5))
        s = np.where(rng.random(p.size) < 0.1, rng.integers(-2, 12, p.size), rng.integers(0, p + 1))
        row_ids, row_mask = [], []
        for pk, sk in zip(p, s):
            real = int(np.clip(sk, 0, pk))
            row_ids += rng.integers(1, 1 << 20, real).tolist() + [pad_fill] * (int(pk) - real + 1)
            row_mask += rng.integers(0, 2, int(pk) + 1).tolist()
        ids.append(row_ids)
        mask.append(row_mask)
        starts.append(np.concatenate([[0], np.cumsum(p + 1)[:-1]]).tolist())
        lens.append(s.tolist())
    k = [len(x) for x in starts]
    return pa.table({"input_ids": pa.array(ids, pa.list_(id_type)), "loss_mask": pa.array(mask, pa.list_(pa.int8())),
                     "seq_start_id": pa.array(starts, pa.list_(pa.int32())),
                     "packer_seq_lens": pa.array(lens, pa.list_(pa.int32())),
                     "packer_source_index": pa.array([list(range(n)) for n in k], pa.list_(pa.int64())),
                     "packer_source_offset": pa.array([[0] * n for n in k], pa.list_(pa.int32()))})


@pytest.mark.parametrize("id_type", [pa.int32(), pa.int64()])
def test_bridge_runtime_kernel_matches_numpy_and_a_slow_reference(id_type):
    """The audit's compiled Bridge conversion gives the columns NumPy's compress does, and both
    are the stored ids without each sequence's last slot, pad_id on its padding."""
    from packer_cli.shards.bridge_reader import native_columns

    rng = np.random.default_rng(7)
    for trial in range(40):
        table = _bridge_rows(rng, int(rng.integers(1, 12)), id_type, pad_fill=2)
        if trial % 5 == 0:
            table = table.slice(1)  # offsets that do not start at 0
        fast = native_columns(table, pad_id=99, compiled=True)
        slow = native_columns(table, pad_id=99)
        assert fast.keys() == slow.keys()
        for name in fast:
            for got, want in zip(fast[name], slow[name]):
                assert got.dtype == want.dtype and np.array_equal(got, want), name
        tokens, masks = [], []
        for row in table.to_pylist():
            bounds = row["seq_start_id"] + [len(row["input_ids"])]
            for k, real in enumerate(row["packer_seq_lens"]):
                a, b = bounds[k], bounds[k + 1]
                real = min(max(real, 0), b - a - 1)
                tokens += row["input_ids"][a:a + real] + [99] * (b - a - 1 - real)
                masks += row["loss_mask"][a:b - 1]
        assert fast["tokens"][0].tolist() == tokens and fast["loss_mask"][0].tolist() == masks

"""Sequences derived from sample lengths (``_sequences``) against an obvious per-sequence table."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import naive
from packer_cli._sequences import BLOCK, SampleLog, SourceMap, build_items
from packer_cli.errors import DataError
from packer_cli.spec import OverlongPolicy, PackSpec


def _log(lengths, cap, targets=None):
    log = SampleLog(cap)
    targets = np.ones(lengths.size, np.int64) if targets is None else targets
    tail = np.maximum(0, np.minimum(targets, lengths - 1 - cap))
    for a in range(0, lengths.size, 7):  # several batches, as pass one sees them
        sl = slice(a, a + 7)
        log.add(lengths[sl], np.arange(lengths.size)[sl] * 2, targets[sl], tail[sl])
    return log


@pytest.mark.parametrize("policy", ["truncate", "drop", "split"])
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(2, 90), min_size=1, max_size=3 * BLOCK), m=st.sampled_from([1, 2, 4]))
def test_items_match_a_plain_sequence_table(policy, lengths, m):
    lengths = np.array(lengths, dtype=np.int32)
    spec = PackSpec(pack_size=32, pad_seq_to_mult=m, overlong=OverlongPolicy(policy))
    cap = spec.max_sequence_length
    log = _log(lengths, cap)
    got_lengths = log.lengths()
    np.testing.assert_array_equal(got_lengths, lengths)
    items, padded, counts = build_items(got_lengths, log.totals, spec, locate=str)
    want = naive.sequence_table(lengths.tolist(), cap, m, policy)
    assert padded.dtype == np.int32 and padded.size == len(want) == items.num_items
    np.testing.assert_array_equal(padded, [0 if w is None else w[3] for w in want])
    assert items.misaligned == sum(1 for w in want if w is not None and w[2] != w[3])
    items.attach(got_lengths)
    kept = np.array([q for q, w in enumerate(want) if w is not None], dtype=np.int32)
    seq = items.resolve(kept[::-1].copy())  # any order, any subset
    rows = list(zip(seq.sample.tolist(), seq.offset.tolist(), seq.length.tolist(), seq.padded.tolist(),
                    seq.src.tolist()))
    assert rows == [want[q] for q in kept[::-1]]
    over = (lengths - 1) > cap
    assert counts.samples == int(over.sum())
    assert counts.dropped == (int(over.sum()) if policy == "drop" else 0)


def test_error_policy_names_the_first_overlong_sample():
    lengths = np.array([5, 50, 60], dtype=np.int32)
    spec = PackSpec(pack_size=32, overlong=OverlongPolicy.ERROR)
    log = _log(lengths, spec.max_sequence_length)
    with pytest.raises(DataError, match=r"^sample 1: sample has 49 runtime tokens"):
        build_items(log.lengths(), log.totals, spec, locate=lambda k: f"sample {k}")


@pytest.mark.parametrize("lengths, first", [
    ([5] * 8 + [50, 60], 8),  # the first over-long sample in the second batch of 7
    ([5, 50] + [5] * 6 + [60], 1),  # over-long samples in two batches: the first is named
])
def test_error_policy_names_the_first_overlong_sample_across_batches(lengths, first):
    lengths = np.array(lengths, dtype=np.int32)
    spec = PackSpec(pack_size=32, overlong=OverlongPolicy.ERROR)
    log = _log(lengths, spec.max_sequence_length)
    assert log.totals.first_over == first
    with pytest.raises(DataError, match=rf"^sample {first}: sample has {lengths[first] - 1} runtime tokens"):
        build_items(log.lengths(), log.totals, spec, locate=lambda k: f"sample {k}")


def test_error_policy_names_the_capacity_of_a_pack_size_no_multiple_of_m():
    """C = 18 with m = 4: a sequence fills at most 16 tokens, and 17 runtime tokens are more than that."""
    lengths = np.array([5, 18], dtype=np.int32)
    spec = PackSpec(pack_size=18, pad_seq_to_mult=4, overlong=OverlongPolicy.ERROR)
    log = _log(lengths, spec.max_sequence_length)
    with pytest.raises(DataError) as err:
        build_items(log.lengths(), log.totals, spec, locate=lambda k: f"sample {k}")
    assert str(err.value) == ("sample 1: sample has 17 runtime tokens, more than the 16 a pack of 18 can hold "
                              "(alignment 4); use --overlong truncate|drop|split")


@pytest.mark.parametrize("longest", [60, 70_000])
def test_lengths_past_the_first_block_come_back_whole(longest):
    """The counts' array starts at 65,536 entries and doubles: each one survives the growth."""
    lengths = np.random.default_rng(1).integers(2, 60, 200_003)
    lengths[150_000] = longest
    log = SampleLog(1 << 20)
    for a in range(0, lengths.size, 9_999):
        part = lengths[a:a + 9_999]
        log.add(part, np.arange(a, a + part.size), np.ones(part.size, np.int64), np.zeros(part.size, np.int64))
    np.testing.assert_array_equal(log.lengths(), lengths)


def test_totals_count_targets_and_overlong_samples():
    cap = 10
    lengths = np.array([5, 20, 12, 3], dtype=np.int64)
    targets = np.array([2, 0, 7, 0], dtype=np.int64)
    tail = np.array([0, 0, 1, 0], dtype=np.int64)
    log = SampleLog(cap)
    log.add(lengths, np.arange(4), targets, tail)
    t = log.totals
    assert (t.samples, t.runtime_tokens, t.target_tokens, t.no_target) == (4, 36, 9, 2)
    assert (t.over_samples, t.over_runtime, t.over_excess, t.over_targets) == (2, 30, 10, 7)
    assert (t.over_tail_targets, t.over_no_target, t.over_pieces, t.first_over) == (1, 1, 4, 1)


@settings(max_examples=80, deadline=None)
@given(skips=st.lists(st.integers(0, 5), min_size=1, max_size=60), split=st.integers(1, 9))
def test_source_map_recovers_stream_positions(skips, split):
    """Positions with gaps (skipped records), fed in batches, come back exactly."""
    positions = np.cumsum(np.array(skips) + 1) - 1
    smap = SourceMap()
    for a in range(0, positions.size, split):
        smap.add(positions[a:a + split])
    smap.finish()
    np.testing.assert_array_equal(smap[np.arange(positions.size)], positions)
    runs = 1 + int((np.diff(positions) != 1).sum())
    assert smap.starts.size == runs  # one entry per run of consecutive positions, not per sample


@pytest.mark.parametrize("longest,dtype", [(65_535, np.uint16), (65_536, np.int32)])
def test_lengths_take_two_bytes_unless_a_sample_needs_more(longest, dtype):
    lengths = np.array([3, longest, 40] * 30, dtype=np.int64)
    spec = PackSpec(pack_size=128, pad_seq_to_mult=4, overlong=OverlongPolicy.SPLIT)
    log = _log(lengths, spec.max_sequence_length)
    kept = log.lengths()
    assert kept.dtype == dtype
    items, padded, _ = build_items(kept, log.totals, spec, locate=str)
    items.attach(kept)
    want = naive.sequence_table(lengths.tolist(), spec.max_sequence_length, 4, "split")
    seq = items.resolve(np.arange(items.num_items, dtype=np.int32))
    assert list(zip(seq.sample.tolist(), seq.offset.tolist(), seq.length.tolist(), seq.padded.tolist(),
                    seq.src.tolist())) == want


def test_a_sample_of_2_to_the_31_tokens_is_refused_and_one_less_is_kept():
    """Token counts are stored as int32: 2**31 would be kept as -2**31, a negative length."""
    log = SampleLog(4095)
    lengths = np.array([10, 2**31 - 1], np.int64)
    log.add(lengths, np.arange(2), np.minimum(lengths - 1, 5), np.zeros(2, np.int64))
    assert log.lengths().tolist() == [10, 2**31 - 1]
    with pytest.raises(DataError, match=r"^a sample of 2147483648 tokens is longer than packer supports \(2\*\*31 - 1\)$"):
        SampleLog(4095).add(lengths + 1, np.arange(2), np.minimum(lengths, 5), np.zeros(2, np.int64))

"""End-to-end `pack()` on real and synthetic data: lossless, aligned, deterministic."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest

from conftest import packed_sequences, read_samples
from packer_cli import PackSpec, pack
from packer_cli.spec import Algorithm, OverlongPolicy


def assert_lossless(out, source_tokens, source_masks, spec: PackSpec):
    """Every sample is recoverable exactly: inputs t[0:n-1], labels t[1:n], loss on label j iff
    token j+1 is a target — whole, or as the declared prefix / pieces under the policy."""
    got = packed_sequences(out)
    cap = spec.max_sequence_length
    seen = 0
    for idx, (tok, mask) in enumerate(zip(source_tokens, source_masks)):
        n = tok.size
        runtime = n - 1
        offsets = [0]
        if runtime > cap and spec.overlong is OverlongPolicy.SPLIT:
            offsets = list(range(0, runtime, cap))
        if runtime > cap and spec.overlong is OverlongPolicy.DROP:
            assert (idx, 0) not in got
            continue
        for off in offsets:
            inputs, labels, lmask, padded = got[(idx, off)]
            s = min(runtime - off, cap)
            assert inputs.size == s
            np.testing.assert_array_equal(inputs, tok[off:off + s])
            np.testing.assert_array_equal(labels, tok[off + 1:off + s + 1])
            np.testing.assert_array_equal(lmask, mask[off + 1:off + s + 1])
            assert padded % spec.pad_multiple == 0 and padded >= s
            seen += 1
    assert seen == len(got), "output holds sequences that match no source sample"


def test_lossless_on_real_parquet(shared_files, tmp_path):
    spec = PackSpec(pack_size=4096, cp=2, tp=2, sp=True)
    for path in shared_files:
        out = tmp_path / path.stem
        summary = pack([str(path)], str(out), spec)
        tokens, masks = read_samples(path)
        assert summary.counts["samples_packed"] == len(tokens)
        assert summary.counts["target_tokens"] == sum(int(m[1:].sum()) for m in masks)
        assert_lossless(out, tokens, masks, spec)


def test_lossless_on_jsonl_written_from_real_data(shared_files, tmp_path):
    path = shared_files[0]
    table = pq.read_table(path).slice(0, 2500)
    jsonl = tmp_path / "data.jsonl"
    with open(jsonl, "wb") as f:
        for row in table.to_pylist():
            f.write(orjson.dumps(row) + b"\n")
    spec = PackSpec(pack_size=1024, cp=4)
    pack([str(jsonl)], str(tmp_path / "out"), spec)
    tokens = [np.asarray(x) for x in table.column("input_ids").to_pylist()]
    masks = [np.asarray(x) for x in table.column("loss_mask").to_pylist()]
    assert_lossless(tmp_path / "out", tokens, masks, spec)


@pytest.mark.parametrize("policy", list(OverlongPolicy)[:3])
def test_overlong_policies_lossless_on_synthetic(synthetic_parquet, tmp_path, policy):
    spec = PackSpec(pack_size=2048, cp=2, overlong=policy)
    summary = pack([str(synthetic_parquet)], str(tmp_path / "out"), spec)
    tokens, masks = read_samples(synthetic_parquet)
    runtime = np.array([t.size - 1 for t in tokens])
    over = runtime > spec.max_sequence_length
    assert over.sum() > 0, "the synthetic data must exercise the over-long path"
    ov = summary.counts["overlong"]
    assert ov["samples"] == over.sum()
    if policy is OverlongPolicy.TRUNCATE:
        assert ov["tokens_lost"] == (runtime[over] - spec.max_sequence_length).sum()
        lost_targets = sum(int(m[spec.max_sequence_length + 1:].sum()) for m, o in zip(masks, over) if o)
        assert ov["target_tokens_lost"] == lost_targets
    if policy is OverlongPolicy.DROP:
        assert ov["dropped"] == over.sum() and ov["tokens_lost"] == runtime[over].sum()
    if policy is OverlongPolicy.SPLIT:
        assert ov["tokens_lost"] == 0
        assert summary.counts["sequences"] == len(tokens) + ov["extra_pieces"]
    assert_lossless(tmp_path / "out", tokens, masks, spec)


def test_overlong_error_names_the_sample(synthetic_parquet, tmp_path):
    from packer_cli.errors import DataError

    with pytest.raises(DataError, match=r"synthetic\.parquet: row \d+: sample has \d+ runtime tokens"):
        pack([str(synthetic_parquet)], str(tmp_path / "out"), PackSpec(pack_size=2048, overlong=OverlongPolicy.ERROR))
    assert not any(tmp_path.iterdir()), "nothing may be written on error"


def test_overlong_error_in_json_lines_names_the_line(tmp_path):
    """JSON Lines errors name physical lines (blank lines are not records): the over-long record
    here is record 2 on line 5, and verify --source names the same line for it."""
    from packer_cli.audit.verify import verify_output
    from packer_cli.errors import DataError

    path = tmp_path / "d.jsonl"
    long = {"input_ids": list(range(1, 40)), "loss_mask": [1] * 39}
    short = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    path.write_bytes(b"\n".join([orjson.dumps(short), b"", orjson.dumps(short), b"  ", orjson.dumps(long)]) + b"\n")
    with pytest.raises(DataError, match=r"d\.jsonl: line 5: sample has 38 runtime tokens"):
        pack([str(path)], str(tmp_path / "out"), PackSpec(pack_size=16, overlong=OverlongPolicy.ERROR))
    pack([str(path)], str(tmp_path / "out"), PackSpec(pack_size=16, overlong=OverlongPolicy.DROP))
    assert verify_output(str(tmp_path / "out"), [str(path)]).ok
    changed = dict(short, input_ids=[1, 2, 4])  # the second record (line 3) differs from what was packed
    path.write_bytes(b"\n".join([orjson.dumps(short), b"", orjson.dumps(changed), b"  ", orjson.dumps(long)]) + b"\n")
    report = verify_output(str(tmp_path / "out"), [str(path)])
    assert any("d.jsonl: line 3" in f.message for f in report.findings), [f.message for f in report.findings]


@pytest.mark.parametrize("cp,tp,sp,m", [(1, 1, False, 1), (2, 1, False, 4), (1, 4, True, 4), (2, 2, True, 4),
                                        (2, 8, True, 16), (4, 4, True, 16), (3, 1, False, 6),
                                        (1, 4, False, 1), (2, 4, False, 4)])  # no SP: TP does not matter
def test_padded_lengths_are_multiples_of_m(synthetic_parquet, tmp_path, cp, tp, sp, m):
    spec = PackSpec(pack_size=4096 - 4096 % (2 * cp), cp=cp, tp=tp, sp=sp)
    assert spec.pad_multiple == m
    pack([str(synthetic_parquet)], str(tmp_path / "o"), spec)
    import pyarrow as pa

    for shard in (tmp_path / "o").glob("packs-*.arrow"):
        table = pa.ipc.open_file(pa.memory_map(str(shard))).read_all()
        for cu, lens in zip(table.column("cu_seqlens").to_pylist(), table.column("seq_lens").to_pylist()):
            padded = np.diff(cu)
            assert (padded % m == 0).all() and (padded >= np.asarray(lens)).all()
            assert (padded - np.asarray(lens) < m).all(), "padding never exceeds one multiple"
            assert cu[-1] <= spec.pack_size


@pytest.mark.parametrize("algorithm", list(Algorithm))
def test_every_algorithm_respects_capacity_and_determinism(synthetic_parquet, tmp_path, algorithm):
    spec = PackSpec(pack_size=2048, algorithm=algorithm, seed=3)
    digests = []
    for run in ("a", "b"):
        pack([str(synthetic_parquet)], str(tmp_path / run), spec)
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / run).iterdir()})
    assert digests[0] == digests[1], "same inputs, options and seed must give byte-identical files"
    meta = json.loads((tmp_path / "a" / "metadata.json").read_text())
    assert meta["bridge"]["pack_size"] == 2048
    assert meta["counts"]["padded_tokens"] <= meta["counts"]["packs"] * 2048


def test_shards_written_side_by_side_hold_the_single_shard_output_in_order(synthetic_parquet, tmp_path, monkeypatch):
    import pyarrow as pa

    from packer_cli import pipeline

    def rows_and_entries(out):
        entries = orjson.loads((out / "manifest.json").read_bytes())["shards"]
        tables = [pa.ipc.open_file(pa.memory_map(str(out / e["name"]))).read_all() for e in entries]
        for entry, table in zip(entries, tables):
            assert (entry["rows"], entry["tokens"]) == (table.num_rows, len(table.column("tokens").combine_chunks().values))
        return pa.concat_tables(tables), entries

    spec = PackSpec(pack_size=2048, seed=4)
    pack([str(synthetic_parquet)], str(tmp_path / "one"), spec)
    whole, entries = rows_and_entries(tmp_path / "one")
    assert len(entries) == 1
    monkeypatch.setattr(pipeline, "BATCH_TOKENS", 20_000)  # about 60 record batches
    for shard_bytes in (1, 500_000, 2_000_000):
        out = tmp_path / f"split{shard_bytes}"
        pipeline.pack([str(synthetic_parquet)], str(out), spec, shard_bytes=shard_bytes)
        split, entries = rows_and_entries(out)
        assert [e["name"] for e in entries] == [f"packs-{k:05d}.arrow" for k in range(len(entries))]
        assert split.equals(whole), "splitting into shards written side by side must not move a pack"
        assert len(entries) > 2 and all(e["bytes"] >= 0.9 * shard_bytes for e in entries[:-1])
        if shard_bytes > 1:  # a shard closes with the batch that fills it: at most one batch over
            assert all(e["bytes"] < shard_bytes + 20_000 * 6 for e in entries)
    again = tmp_path / "again"
    pipeline.pack([str(synthetic_parquet)], str(again), spec, shard_bytes=500_000)
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "split500000").iterdir()}


def test_seed_changes_pack_order_not_content(synthetic_parquet, tmp_path):
    pack([str(synthetic_parquet)], str(tmp_path / "s0"), PackSpec(pack_size=2048, seed=0))
    pack([str(synthetic_parquet)], str(tmp_path / "s1"), PackSpec(pack_size=2048, seed=1))
    pack([str(synthetic_parquet)], str(tmp_path / "ns"), PackSpec(pack_size=2048, shuffle=False))
    import pyarrow as pa

    def packs(d):
        t = pa.ipc.open_file(pa.memory_map(str(d / "packs-00000.arrow"))).read_all()
        return [tuple(x) for x in t.column("source_index").to_pylist()]

    a, b, plain = packs(tmp_path / "s0"), packs(tmp_path / "s1"), packs(tmp_path / "ns")
    assert a != b and sorted(a) == sorted(b) == sorted(plain)
    tokens, _ = read_samples(synthetic_parquet)
    runtime = np.minimum([t.size - 1 for t in tokens], 2048)
    longest = int(np.argmax(runtime))  # first of the longest (ties in input order)
    assert plain[0][0] == longest, "--no-shuffle keeps plan order: FFD opens pack 0 with the longest sample"


def test_multiple_inputs_form_one_stream(synthetic_parquet, tmp_path):
    table = pq.read_table(synthetic_parquet)
    inputs = tmp_path / "in"
    inputs.mkdir()
    pq.write_table(table.slice(0, 1000), inputs / "b.parquet")
    pq.write_table(table.slice(1000, 2000), inputs / "a.parquet")
    summary = pack([str(inputs / "b.parquet"), str(inputs / "a.parquet")], str(tmp_path / "out"),
                   PackSpec(pack_size=8192))
    got = packed_sequences(tmp_path / "out")
    tokens, _ = read_samples(synthetic_parquet)
    assert summary.counts["records"] == 3000
    np.testing.assert_array_equal(got[(0, 0)][0], tokens[0][:-1])      # b.parquet row 0
    np.testing.assert_array_equal(got[(1000, 0)][0], tokens[1000][:-1])  # a.parquet row 0
    # A directory expands in sorted order: a.parquet first.
    pack([str(inputs)], str(tmp_path / "out2"), PackSpec(pack_size=8192))
    got2 = packed_sequences(tmp_path / "out2")
    np.testing.assert_array_equal(got2[(0, 0)][0], tokens[1000][:-1])


def test_pad_to_max_length_records_static_metadata(synthetic_parquet, tmp_path):
    spec = PackSpec(pack_size=2048, cp=2, pad_to_max_length=True, pad_cu_seqlens=True)
    summary = pack([str(synthetic_parquet)], str(tmp_path / "o"), spec)
    assert summary.static["pack_len"] == 2048
    assert summary.static["cu_seqlens_len"] == summary.bridge["max_samples_per_bin"] + 2
    assert summary.static["max_seqlen"] == max(summary.bridge["dataset_max_seqlen"],
                                               2048 - summary.bridge["min_packed_seqlen"])


def test_the_reader_gives_each_pack_its_length_as_a_loader_builds_it(synthetic_parquet, tmp_path):
    """``PackedReader.pack_len``: C for every pack of an output padded to max length, the pack's
    own tokens otherwise."""
    from packer_cli.shards.reader import PackedReader

    for padded in (True, False):
        out = tmp_path / f"o-{padded}"
        pack([str(synthetic_parquet)], str(out), PackSpec(pack_size=2048, pad_to_max_length=padded))
        reader = PackedReader(out)
        lengths = [reader.pack_len(reader.row(i)) for i in range(len(reader))]
        stored = [int(reader.row(i).tokens.size) for i in range(len(reader))]
        assert lengths == ([2048] * len(reader) if padded else stored) and min(stored) < 2048


def test_truncation_keeps_the_largest_multiple_of_m_when_c_is_not_one(tmp_path):
    """C = 100, m = 8: a sample of 99 runtime tokens keeps 96 (the largest multiple of m that a
    pack holds), not 99 padded to 104."""
    import pyarrow as pa

    path = tmp_path / "in.parquet"
    rows = [list(range(1, 101)), list(range(1, 12))]
    pq.write_table(pa.table({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows]}), path)
    with pytest.warns(UserWarning, match="the last 4 are always padding"):
        summary = pack([str(path)], str(tmp_path / "out"), PackSpec(pack_size=100, pad_seq_to_mult=8, shuffle=False))
    got = packed_sequences(tmp_path / "out")
    assert got[(0, 0)][0].tolist() == rows[0][:96] and got[(1, 0)][0].tolist() == rows[1][:10]
    assert summary.counts["overlong"]["samples"] == 1 and summary.counts["overlong"]["tokens_lost"] == 3


def test_dry_run_writes_nothing(synthetic_parquet, tmp_path):
    summary = pack([str(synthetic_parquet)], str(tmp_path / "o"), PackSpec(pack_size=2048), dry_run=True)
    assert summary.counts["packs"] > 0 and not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_dry_run_checks_out_as_the_real_run_would(synthetic_parquet, tmp_path, monkeypatch):
    """A dry run with OUT says what the real run would refuse (and still writes nothing)."""
    from packer_cli import BridgeOutput
    from packer_cli.errors import ConfigError

    spec, inputs = PackSpec(pack_size=2048), [str(synthetic_parquet)]
    pack(inputs, str(tmp_path / "o"), spec)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError, match="already exists; pass --overwrite"):
        pack(inputs, str(tmp_path / "o"), spec, dry_run=True)
    with pytest.raises(ConfigError, match="output parent directory does not exist"):
        pack(inputs, str(tmp_path / "missing" / "o"), spec, dry_run=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match="todo.txt"):
        pack(inputs, str(tmp_path / "notes"), spec, overwrite=True, dry_run=True)
    pack([str(synthetic_parquet)], str(tmp_path / "b"), spec, output=BridgeOutput(split="training"))
    with pytest.raises(ConfigError, match="already holds the training split"):
        pack(inputs, str(tmp_path / "b"), spec, dry_run=True, output=BridgeOutput(split="training"))
    with pytest.raises(ConfigError, match="pack size 2048"):
        pack(inputs, str(tmp_path / "b"), PackSpec(pack_size=1024), dry_run=True,
             output=BridgeOutput(split="validation"))
    (tmp_path / "locked").mkdir()
    writable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path).endswith("locked")
                        else writable(path, mode, **kw))
    with pytest.raises(ConfigError, match="locked: output parent directory is not writable"):
        pack(inputs, str(tmp_path / "locked" / "o"), spec, dry_run=True)
    with pytest.raises(ConfigError, match="locked: output parent directory is not writable"):
        pack(inputs, str(tmp_path / "locked" / "o"), spec, dry_run=True, output=BridgeOutput(split="training"))
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path).endswith("/b")
                        else writable(path, mode, **kw))
    with pytest.raises(ConfigError, match="b: the Megatron-Bridge layout's directory is not writable"):
        pack(inputs, str(tmp_path / "b"), spec, dry_run=True, output=BridgeOutput(split="validation"))
    monkeypatch.undo()
    assert pack(inputs, str(tmp_path / "o"), spec, overwrite=True, dry_run=True).counts["packs"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["notes", "b", "locked"])


def test_bridge_keys_match_plan(synthetic_parquet, tmp_path):
    summary = pack([str(synthetic_parquet)], str(tmp_path / "o"), PackSpec(pack_size=4096, cp=2))
    got = packed_sequences(tmp_path / "o")
    padded = np.array([v[3] for v in got.values()])
    assert summary.bridge["dataset_max_seqlen"] == padded.max()
    assert summary.bridge["packing_factor"] == round(len(got) / summary.counts["packs"], 2)
    assert summary.bridge["packing_efficiency"] == round(padded.sum() / summary.counts["packs"] / 4096 * 100, 2)
    assert summary.quality["lower_bound"] == -(-padded.sum() // 4096)


@pytest.mark.parametrize("cp", [1, 2])
def test_sequential_keeps_the_pieces_of_split_samples_in_input_order(tmp_path, cp):
    """``sequential`` is order-preserving next fit; a split sample's later pieces were planned
    after every other sample (they are items N + e), so they came out last."""
    rng = np.random.default_rng(cp)
    lengths = [int(n) for n in rng.choice([5, 9, 40, 75], size=60, p=[0.4, 0.3, 0.2, 0.1])]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"input_ids": list(range(1, n + 1))}) + b"\n" for n in lengths))
    spec = PackSpec(pack_size=16, cp=cp, algorithm=Algorithm.SEQUENTIAL, shuffle=False, overlong=OverlongPolicy.SPLIT)
    summary = pack([str(path)], str(tmp_path / "out"), spec)
    assert summary.counts["overlong"]["samples"] > 5
    keys = list(packed_sequences(tmp_path / "out"))  # in output order
    assert keys == sorted(keys) and len({k[0] for k in keys}) == len(lengths)


def test_a_shard_whose_estimate_reaches_shard_size_exactly_closes():
    """--shard-size is where a shard ends: one whose estimated size equals it exactly took one
    more run (twice the size asked for)."""
    from packer_cli import pipeline

    load = np.full(8, pipeline.BATCH_TOKENS // 2, dtype=np.int64)  # two packs a run of BATCH_TOKENS tokens
    offsets, order = np.arange(9, dtype=np.int64), np.arange(8, dtype=np.int32)  # one sequence a pack
    _, sizes = pipeline._runs_of_packs(offsets, load, order, pipeline.BATCH_TOKENS)
    assert len(sizes) == 4 and len(set(sizes.tolist())) == 1
    shards = pipeline._shard_runs(offsets, load, order, int(sizes[0]))
    assert shards == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]
    assert pipeline._shard_runs(offsets, load, order, int(sizes[0]) + 1) == [[(0, 2), (2, 4)], [(4, 6), (6, 8)]]


def test_a_seed_gives_numpys_permutation_of_the_planned_packs(synthetic_parquet, tmp_path):
    """The pack order a seed gives is part of the output: the same seed must shuffle the same
    way in every version (a changed permutation went unnoticed)."""
    import pyarrow as pa

    def packs(d):
        t = pa.ipc.open_file(pa.memory_map(str(d / "packs-00000.arrow"))).read_all()
        return [tuple(x) for x in t.column("source_index").to_pylist()]

    pack([str(synthetic_parquet)], str(tmp_path / "plain"), PackSpec(pack_size=2048, shuffle=False))
    plain = packs(tmp_path / "plain")
    for seed in (0, 7):
        pack([str(synthetic_parquet)], str(tmp_path / f"s{seed}"), PackSpec(pack_size=2048, seed=seed))
        order = np.random.default_rng(seed).permutation(len(plain))
        assert packs(tmp_path / f"s{seed}") == [plain[i] for i in order]



def test_only_packer_s_own_file_names_are_output_file_names():
    """A native output's names, shard numbers past 99999 included; a user's backup beside them is not one."""
    from packer_cli.shards.format import is_output_file_name, shard_name

    for index in (0, 99999, 100000, 1234567):
        assert is_output_file_name(shard_name(index))
    assert is_output_file_name("metadata.json") and is_output_file_name("manifest.json")
    for name in ("packs-00000.arrow.bak", "packs-00000.arrow~", "old-packs-00000.arrow", "packs-0000.arrow",
                 "metadata.json.bak"):
        assert not is_output_file_name(name), name

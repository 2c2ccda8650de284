"""`packer verify`: good outputs pass; each corruption is caught with its location and exit 1.

Broken outputs are made from real ones: a pack is edited with pyarrow, the shard rewritten
and its manifest entry (bytes, rows, tokens, checksum) fixed, so only the intended check fires
among the structural ones. Runs on a synthetic dataset made here, and on /work/shared/data
when it exists.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import numpy.testing as npt
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from packer_cli import pipeline
from packer_cli.audit import VerifyReport, verify_output
from packer_cli.errors import DataError
from packer_cli.cli import app
from packer_cli.shards.format import PACK_SCHEMA
from packer_cli.spec import BadRecordPolicy, OverlongPolicy, PackSpec, SourceSpec

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
GSM8K = DATA / "sft_gsm8k.parquet"
C, CP = 256, 2  # m = 4, cap = 256
runner = CliRunner()


def write_synthetic(path: Path, n: int = 300, seed: int = 0) -> Path:
    """Prompt/response samples: lengths 2..300, two too short, two far over C."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 300, n)
    lengths[[5, 17]] = 1
    lengths[[30, 31]] = [700, 1000]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(0, 5000, int(lengths.sum())).astype(np.int32)
    pos = np.arange(ids.size) - np.repeat(offsets[:-1], lengths)
    mask = (pos >= np.repeat((lengths * rng.uniform(0.2, 0.8, n)).astype(int), lengths)).astype(np.uint8)
    pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
                             "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask))}), path)
    return path


def pack_to(inputs, out: Path, spec: PackSpec, source: SourceSpec = SourceSpec()) -> Path:
    """Pack with small record batches and shards, so the output has several shards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "BATCH_TOKENS", 12_000)
        pipeline.pack([str(p) for p in inputs], str(out), spec, source, shard_bytes=1)
    return out


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    src = write_synthetic(root / "train.parquet")
    outs = {p: pack_to([src], root / f"out-{p.value}", PackSpec(pack_size=C, cp=CP, overlong=p))
            for p in (OverlongPolicy.TRUNCATE, OverlongPolicy.SPLIT, OverlongPolicy.DROP)}
    return src, outs


@pytest.fixture
def broken(synth, tmp_path):
    """A fresh copy of the truncate output to corrupt."""
    return Path(shutil.copytree(synth[1][OverlongPolicy.TRUNCATE], tmp_path / "out"))


def verify(*args):
    result = runner.invoke(app, ["verify", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def rewrite(out: Path, shard: str, edit, schema: pa.Schema = PACK_SCHEMA) -> None:
    """Apply ``edit(rows)`` to a shard's rows (dicts of lists, the loss mask as 0/1 ints),
    rewrite it with ``schema``, fix the manifest."""
    path = out / shard
    rows = pa.ipc.open_file(str(path)).read_all().to_pylist()
    for r in rows:
        r["loss_mask"] = [int(x) for x in r["loss_mask"]]
    edit(rows)
    if pa.types.is_boolean(schema.field("loss_mask").type.value_type):
        for r in rows:
            r["loss_mask"] = [bool(x) for x in r["loss_mask"]]
    with pa.ipc.new_file(str(path), schema) as writer:
        writer.write_table(pa.Table.from_pylist(rows, schema=schema))
    man = manifest(out)
    entry = next(e for e in man["shards"] if e["name"] == shard)
    entry.update(bytes=path.stat().st_size, rows=len(rows), tokens=sum(len(r["tokens"]) for r in rows),
                 xxh3_64=xxhash.xxh3_64(path.read_bytes()).hexdigest())
    (out / "manifest.json").write_text(json.dumps(man))


def first_shard(out: Path) -> str:
    return manifest(out)["shards"][0]["name"]


def assert_finds(out: Path, shard: str, edit, line) -> str:
    """``edit`` applied to ``shard`` (checksums made to hold): verify exits 1 and prints
    ``line()`` (called after the edit, which records where it changed what)."""
    rewrite(out, shard, edit)
    result = verify(out)
    assert result.exit_code == 1
    assert line() in result.output, result.output
    return result.output


# --- good outputs --------------------------------------------------------------------------

@pytest.mark.parametrize("policy", [OverlongPolicy.TRUNCATE, OverlongPolicy.SPLIT, OverlongPolicy.DROP])
def test_good_output_passes(synth, policy):
    src, outs = synth
    assert len(manifest(outs[policy])["shards"]) > 2
    for args in ([outs[policy]], [outs[policy], "--source", src]):
        result = verify(*args)
        assert result.exit_code == 0, result.output
        assert "verify: OK" in result.output


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_an_output_replaced_while_it_is_read(synth, tmp_path, monkeypatch, command):
    """`pack --overwrite` renamed another output into place while verify read the first shards:
    a valid output was reported FAILED (counts, quality and rows mixed from the two), and inspect
    named a shard 'missing'."""
    from packer_cli.audit import _layout_checks, inspect_output
    from packer_cli.errors import DataError
    from packer_cli.audit import store as store_module

    out = Path(shutil.copytree(synth[1][OverlongPolicy.TRUNCATE], tmp_path / "out"))
    other = Path(shutil.copytree(synth[1][OverlongPolicy.SPLIT], tmp_path / "other"))
    real_read_shard = store_module.NativeStore.read_shard
    swapped = []

    def replaced_after_the_first_shard(self, name, *args, **kwargs):
        if swapped == [] and name != first_shard(out):
            os.rename(out, tmp_path / "old")
            os.rename(other, out)
            swapped.append(True)
        return real_read_shard(self, name, *args, **kwargs)

    monkeypatch.setattr(store_module.NativeStore, "read_shard", replaced_after_the_first_shard)
    said = f"{out} changed {_layout_checks.CHANGED}"
    if command == "verify":
        report = verify_output(str(out), sources=[synth[0]])
        assert swapped and report.exit_code == 1
        assert [f.line() for f in report.findings] == [f"{said}: what was read may be of two outputs; verify it "
                                                      "again [structure.changed]"]
        assert (report.packs, report.tokens, report.bytes) == (0, 0, 0)  # of neither output
        assert report.source == {"inputs": 1, "records": 0, "samples_packed": None, "tokens_compared": None,
                                 "complete": False}  # not compared with either
    else:
        with pytest.raises(DataError, match=re.escape(said) + ": inspect it again"):
            inspect_output(str(out))
        assert swapped
        # a pack index of the first output past the end of the second: 'out of range' (exit 2)
        # replaced as inspect begins: a pack index of the first output past the end of the
        # second was 'out of range' (exit 2), blaming a valid argument
        from packer_cli.audit import inspect as inspect_module

        by_packs = sorted(synth[1].values(), key=lambda o: sum(e["rows"] for e in manifest(o)["shards"]))
        for path in (out, tmp_path / "old"):
            shutil.rmtree(path)
        shutil.copytree(by_packs[-1], out)  # the most packs, replaced by the fewest
        shutil.copytree(by_packs[0], other)
        last = sum(e["rows"] for e in manifest(out)["shards"]) - 1
        real_layout = inspect_module.consistent_layout

        def replaced_first(*args, **kwargs):
            os.rename(out, tmp_path / "old")
            os.rename(other, out)
            return real_layout(*args, **kwargs)

        monkeypatch.setattr(inspect_module, "consistent_layout", replaced_first)
        with pytest.raises(DataError, match=re.escape(said) + r": inspect it again \(--pack .* is out of range"):
            inspect_output(str(out), pack=last)
    monkeypatch.undo()
    assert verify_output(str(out)).ok  # the output now there is whole


def test_bad_and_short_records_are_accounted_for(tmp_path):
    lines = [json.dumps({"input_ids": list(range(1, n + 1)), "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)})
             for n in (5, 1, 40, 300, 12)]
    lines[2] = "{not json"
    lines.append(json.dumps({"input_ids": [1, "x", 3], "loss_mask": [0, 1, 1]}))
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = pack_to([src], tmp_path / "out", PackSpec(pack_size=64, overlong=OverlongPolicy.DROP),
                  SourceSpec(on_bad_record=BadRecordPolicy.SKIP))
    report = verify_output(str(out), [str(src)])
    assert report.ok, [f.line() for f in report.findings]
    assert report.source["records"] == 6 and report.source["samples_packed"] == 2
    meta = json.loads((out / "metadata.json").read_text())
    meta["counts"]["too_short_dropped"] = 0
    meta["counts"]["records"] -= 1
    (out / "metadata.json").write_text(json.dumps(meta))
    result = verify(out, "--source", src)
    assert result.exit_code == 1 and "counts.too_short_dropped is 0 but the source has 1" in result.output


def test_what_an_older_packer_recorded_still_verifies(tmp_path):
    """Two figures earlier packers recorded otherwise, which verify accepts as such: samples
    without targets counted before truncation (here 0 where packer now counts the one
    truncated to none; anything outside 0..1 is a finding), and the quality bounds taken over
    the whole C where m does not divide it (C = 500, m = 8)."""
    from packer_cli.audit import inspect_output

    src = tmp_path / "train.jsonl"
    rows = [{"input_ids": list(range(1, 201)), "loss_mask": [0] * 150 + [1] * 50}]  # its targets past C = 128
    rows += [{"input_ids": list(range(1, 31 + k)), "loss_mask": [0] * 10 + [1] * (20 + k)} for k in range(9)]
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = pack_to([src], tmp_path / "out", PackSpec(pack_size=128))
    assert json.loads((out / "metadata.json").read_text())["counts"]["no_target_samples"] == 1
    _resealed(out, lambda doc: doc["counts"].update(no_target_samples=0))
    assert verify(out).exit_code == 0
    _resealed(out, lambda doc: doc["counts"].update(no_target_samples=2))
    result = verify(out)
    assert result.exit_code == 1
    assert ("metadata.json: counts.no_target_samples is 2 but the data has 1 (0 of them not truncated) "
            "[metadata.counts]") in result.output, result.output

    src = tmp_path / "even.jsonl"  # 35 samples of 128 padded tokens: ⌈4480/500⌉ = 9 packs, ⌈4480/496⌉ = 10
    src.write_text("".join(json.dumps({"input_ids": list(range(1, 125)), "loss_mask": [1] * 124}) + "\n"
                           for _ in range(35)))
    out = pack_to([src], tmp_path / "older", PackSpec(pack_size=500, pad_seq_to_mult=8))
    older = inspect_output(str(out)).quality(whole_capacity=True)
    now = json.loads((out / "metadata.json").read_text())["quality"]
    assert (older["lower_bound"], now["lower_bound"]) == (9, 10)
    _resealed(out, lambda doc: doc["quality"].update(older))
    assert verify(out).exit_code == 0, verify(out).output


def test_recorded_counts_and_gaps_are_the_datas(tmp_path):
    """What pack records is what verify recomputes: a truncated sample with no target at all
    counts once among the samples without targets (not also as one truncated to none), and the
    gap to L2 is a share of L2 (a plan in input order, unshuffled, leaves one)."""
    src = tmp_path / "train.jsonl"
    rows = [{"input_ids": list(range(1, 201)), "loss_mask": [0] * 200}]  # over C = 128, no target anywhere
    rows += [{"input_ids": list(range(1, 41 + 7 * k)), "loss_mask": [0] * 10 + [1] * (30 + 7 * k)} for k in range(12)]
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = pack_to([src], tmp_path / "out", PackSpec(pack_size=128, algorithm="sequential", shuffle=False))
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["counts"]["no_target_samples"] == 1
    q = meta["quality"]
    assert q["gap_to_l2"] > 0 and q["gap_to_l2_pct"] == pytest.approx(100 * q["gap_to_l2"] / q["l2_bound"])
    assert verify(out).exit_code == 0
    assert verify(out, "--source", src).exit_code == 0


def test_a_loss_mask_on_the_first_token_alone_is_no_target_against_the_source(tmp_path):
    """A sample's first token is never a label: one whose loss mask marks only it has no target,
    and a dropped over-long one loses no target token; `verify --source` counts both as pack did,
    so the sound output passes (a replay counting that first flag failed it)."""
    src = tmp_path / "train.jsonl"
    rows = [{"input_ids": list(range(1, 11)), "loss_mask": [1] + [0] * 9}]
    rows += [{"input_ids": list(range(1, 21 + k)), "loss_mask": [0] * 5 + [1] * (15 + k)} for k in range(5)]
    rows += [{"input_ids": list(range(1, 301)), "loss_mask": [1] + [0] * 299}]  # over C = 128: dropped
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = pack_to([src], tmp_path / "out", PackSpec(pack_size=128, overlong=OverlongPolicy.DROP))
    counts = json.loads((out / "metadata.json").read_text())["counts"]
    assert (counts["no_target_samples"], counts["overlong"]["target_tokens_lost"]) == (1, 0)
    result = verify(out, "--source", src)
    assert result.exit_code == 0, result.output
    _resealed(out, lambda doc: doc["counts"].update(no_target_samples=0))
    result = verify(out, "--source", src)
    assert "counts.no_target_samples is 0 but the source has 1 [source.counts]" in result.output, result.output

def test_more_bad_records_than_the_metadata_lists_pass(tmp_path):
    """metadata.json lists the first 1,000 bad records and counts them all: 1,001 skipped ones
    are a sound output, with and without the source (a check wanting every one listed failed
    it), and one listed fewer is a finding."""
    lines = [json.dumps({"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]})] * 20 + ["{not json"] * 1001
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = pack_to([src], tmp_path / "out", PackSpec(pack_size=64), SourceSpec(on_bad_record=BadRecordPolicy.SKIP))
    meta = json.loads((out / "metadata.json").read_text())
    assert (meta["counts"]["bad_records"], len(meta["bad_records"])) == (1001, 1000)
    assert verify(out).exit_code == 0
    assert verify(out, "--source", src).exit_code == 0
    _resealed(out, lambda doc: doc["bad_records"].pop())
    result = verify(out)
    assert result.exit_code == 1
    assert ("metadata.json: bad_records lists 999 records but counts.bad_records is 1001 [metadata.counts]"
            in result.output), result.output


@pytest.mark.skipif(not GSM8K.exists(), reason=f"{GSM8K} not available")
def test_real_data_passes_with_source(tmp_path):
    out = pack_to([GSM8K], tmp_path / "out", PackSpec(pack_size=4096, cp=2, tp=2, sp=True))
    report = verify_output(str(out), [str(GSM8K)])
    assert report.ok, [f.line() for f in report.findings]
    assert report.source["tokens_compared"] == 1_252_770 - 7_473


# --- corruptions: each caught with its location --------------------------------------------

def test_flipped_byte_in_shard(broken):
    shard = first_shard(broken)
    data = bytearray((broken / shard).read_bytes())
    data[len(data) // 2] ^= 0x10
    (broken / shard).write_bytes(bytes(data))
    result = verify(broken)
    assert result.exit_code == 1
    assert re.search(rf"{shard}: xxh3_64 is \w+ but manifest.json records \w+ .*\[shard.checksum\]", result.output)
    assert "verify: FAILED" in result.output


def test_truncated_shard(broken):
    shard = first_shard(broken)
    data = (broken / shard).read_bytes()
    (broken / shard).write_bytes(data[: len(data) // 3])
    result = verify(broken)
    assert result.exit_code == 1
    assert f"{shard}: {len(data) // 3:,} bytes, but manifest.json records {len(data):,}" in result.output
    assert re.search(rf"{shard}: cannot open as Arrow IPC .*\[shard.unreadable\]", result.output)


def test_missing_shard(broken):
    shard = manifest(broken)["shards"][1]["name"]
    (broken / shard).unlink()
    result = verify(broken)
    assert result.exit_code == 1
    assert f"{shard}: listed in manifest.json but missing [shard.missing]" in result.output


def test_extra_file(broken):
    (broken / "notes.txt").write_text("hello")
    result = verify(broken)
    assert result.exit_code == 1
    assert "notes.txt: unexpected file, not listed in manifest.json [structure.files]" in result.output


def test_tampered_metadata_count(broken):
    meta = json.loads((broken / "metadata.json").read_text())
    true = meta["counts"]["target_tokens"]
    meta["counts"]["target_tokens"] += 1
    (broken / "metadata.json").write_text(json.dumps(meta))
    result = verify(broken)
    assert result.exit_code == 1
    assert f"metadata.json: counts.target_tokens is {true + 1} but the data has {true} [metadata.counts]" in result.output


def test_token_changed_in_source(synth, tmp_path):
    src, outs = synth
    table = pq.read_table(src)
    ids = table.column("input_ids").to_pylist()
    ids[40][3] += 1
    changed = tmp_path / "changed.parquet"
    pq.write_table(table.set_column(0, "input_ids", pa.array(ids, pa.list_(pa.int32()))), changed)
    result = verify(outs[OverlongPolicy.TRUNCATE], "--source", changed)
    assert result.exit_code == 1
    line = next(x for x in result.output.splitlines() if "[source.tokens]" in x)
    assert re.match(r"packs-\d{5}\.arrow row \d+ \(pack \d+\) seq \d+: token position 3 is \d+ but the source "
                    rf"\(.*changed.parquet: row 40\) has {ids[40][3]}", line), line


def _edited_source(src: Path, tmp_path: Path, edit) -> Path:
    """A copy of ``src`` with ``edit(columns)`` applied to its columns (lists of lists)."""
    table = pq.read_table(src)
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    edit(columns)
    path = tmp_path / "changed.parquet"
    pq.write_table(pa.table({name: pa.array(v, table.schema.field(name).type) for name, v in columns.items()}), path)
    return path


def _plain_sample(columns, after: int = 40) -> int:
    """A sample past ``after`` that fits a pack whole and has at least 20 tokens."""
    return next(i for i, ids in enumerate(columns["input_ids"]) if i > after and 20 <= len(ids) <= C)


def test_target_and_last_label_changed_in_source(synth, tmp_path):
    src, outs = synth
    picked = {}

    def edit(columns):
        k = picked["mask"] = _plain_sample(columns)
        columns["loss_mask"][k][7] ^= 1  # the label of packed position 6
        j = picked["last"] = _plain_sample(columns, after=k)
        columns["input_ids"][j][-1] += 1  # only the last label: it is no runtime token
        picked["values"] = (columns["loss_mask"][k][7], columns["input_ids"][j][-1])

    result = verify(outs[OverlongPolicy.TRUNCATE], "--source", _edited_source(src, tmp_path, edit))
    assert result.exit_code == 1
    mask, last = picked["values"]
    lines = [x for x in result.output.splitlines() if "[source." in x]
    assert len(lines) == 2, result.output
    assert re.search(rf"seq \d+: loss mask \(target\) at position 6 is {1 - mask} but the source "
                     rf"\(.*changed.parquet: row {picked['mask']}\) has {mask} \[source.targets\]", lines[0]), lines
    assert re.search(rf"seq \d+: last label is {last - 1} but the source \(.*changed.parquet: row {picked['last']}\) "
                     rf"has {last} \[source.tokens\]", lines[1]), lines


def test_token_changed_in_source_of_a_bridge_output(synth, tmp_path):
    src = synth[0]
    out = tmp_path / "br"
    packed = runner.invoke(app, ["pack", str(src), "-o", str(out), "-C", str(C), "--cp", str(CP),
                                 "--format", "megatron-bridge", "--eos-id", "4999", "--row-group-size", "8"])
    assert packed.exit_code == 0, packed.output
    picked = {}

    def edit(columns):
        k = picked["k"] = _plain_sample(columns, after=200)
        columns["input_ids"][k][11] += 1
        picked["value"] = columns["input_ids"][k][11]

    result = verify(out, "--source", _edited_source(src, tmp_path, edit))
    assert result.exit_code == 1
    line = next(x for x in result.output.splitlines() if "[source.tokens]" in x)
    assert re.search(rf"token position 11 is {picked['value'] - 1} but the source \(.*changed.parquet: "
                     rf"row {picked['k']}\) has {picked['value']}", line), line


def test_the_first_of_several_changed_tokens_of_a_sample_is_named(synth, tmp_path):
    """Two tokens of one sample changed in the source: the finding names the first that differs."""
    src, outs = synth
    picked = {}

    def edit(columns):
        ids = columns["input_ids"]
        picked["values"] = (ids[40][3], ids[40][7])
        ids[40][3] += 1
        ids[40][7] += 1

    result = verify(outs[OverlongPolicy.TRUNCATE], "--source", _edited_source(src, tmp_path, edit))
    assert result.exit_code == 1
    lines = [x for x in result.output.splitlines() if "[source.tokens]" in x]
    first = picked["values"][0]
    assert len(lines) == 1 and re.search(rf"token position 3 is {first} but the source \(.*changed.parquet: row 40\) "
                                         rf"has {first + 1} \[source.tokens\]", lines[0]), result.output


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_no_shard_stays_mapped_while_the_source_is_replayed(synth, monkeypatch):
    """The source check works from fingerprints: its memory does not grow with the output."""
    from packer_cli.audit import _source_check

    out = synth[1][OverlongPolicy.TRUNCATE]
    mapped = []
    window = _source_check._Replay.window

    def spying_window(self, *args):
        maps = Path("/proc/self/maps").read_text().splitlines()
        mapped.append(sum(str(out) in line for line in maps))
        return window(self, *args)

    monkeypatch.setattr(_source_check._Replay, "window", spying_window)
    report = verify_output(str(out), [str(synth[0])])
    assert report.exit_code == 0 and report.source["tokens_compared"] > 0
    assert mapped and max(mapped) == 0


@pytest.mark.parametrize("policy", [OverlongPolicy.TRUNCATE, OverlongPolicy.SPLIT])
def test_what_verify_keeps_per_sequence(synth, monkeypatch, policy):
    """24 bytes of facts a packed sequence (44 with --source), nothing that names its place;
    and the table is sorted only where offsets make pieces."""
    from packer_cli.audit import _meta_checks, verify as verify_module

    seen, sorts = {}, []
    check = _meta_checks.check_provenance

    def spying_check(arr, *args, **kwargs):
        seen[len(seen)] = {k: (v.dtype.itemsize, v.size) for k, v in arr.items()}
        return check(arr, *args, **kwargs)

    monkeypatch.setattr(verify_module, "check_provenance", spying_check)
    lexsort = np.lexsort
    monkeypatch.setattr(np, "lexsort", lambda keys: sorts.append(len(keys)) or lexsort(keys))
    out = synth[1][policy]
    for sources in (None, [str(synth[0])]):
        assert verify_output(str(out), sources).exit_code == 0
    packs = sum(entry["rows"] for entry in manifest(out)["shards"])
    plain, with_source = seen[0], seen[1]
    assert set(plain) == {"index", "offset", "real", "targets"}
    assert set(with_source) == set(plain) | {"last", "tokens_fp", "mask_fp"}
    n = plain["index"][1]
    assert n > packs  # more sequences than packs: several share a pack
    assert sum(size * count for size, count in plain.values()) == 24 * n
    assert sum(size * count for size, count in with_source.values()) == 44 * n
    assert sorts == ([2, 2] if policy == OverlongPolicy.SPLIT else [])


@pytest.mark.parametrize("window", [1, 900, 20_000])
def test_source_compared_in_many_windows(synth, tmp_path, monkeypatch, window):
    """The source is compared a window of records at a time while a second thread reads ahead;
    windows are cut by the records taken, so tiny batches and windows change nothing: every
    policy passes, and a changed token is still found in its sample."""
    from packer_cli.audit import _source_check
    from packer_cli.sources import readers

    monkeypatch.setattr(_source_check, "WINDOW_TOKENS", window)
    monkeypatch.setattr(readers, "BATCH_ROWS", 7)
    src, outs = synth
    for policy, out in outs.items():
        report = verify_output(str(out), [str(src)])
        assert report.ok, (policy, [f.line() for f in report.findings][:5])
        assert report.source["records"] == 300 and report.source["complete"]
    k = 200
    changed = _edited_source(src, tmp_path, lambda columns: columns["input_ids"][k].__setitem__(
        1, columns["input_ids"][k][1] + 1))
    report = verify_output(str(outs[OverlongPolicy.TRUNCATE]), [str(changed)])
    assert [f.check for f in report.findings] == ["source.tokens"], [f.line() for f in report.findings]
    assert f"row {k})" in report.findings[0].message


def test_a_source_that_breaks_half_way_is_a_finding(tmp_path, monkeypatch):
    """A record that no longer parses stops the replay at its batch: one ``source.read`` finding,
    and the records compared before it (whole batches read ahead on the second thread are not
    counted until taken)."""
    from packer_cli.sources import readers

    lines = [json.dumps({"input_ids": list(range(1, 3 + k % 40)), "loss_mask": [1] * (2 + k % 40)})
             for k in range(200)]
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = pack_to([src], tmp_path / "out", PackSpec(pack_size=64))
    lines[149] = "{not json"
    src.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(readers, "BATCH_ROWS", 7)
    report = verify_output(str(out), [str(src)])
    assert [f.check for f in report.findings] == ["source.read"], [f.line() for f in report.findings]
    assert "line 150" in report.findings[0].message, report.findings[0].line()
    assert report.source == {"inputs": 1, "records": 147, "samples_packed": None, "tokens_compared": None,
                             "complete": False}


def test_a_source_not_compared_because_the_output_is_unusable_has_the_summarys_keys(tmp_path):
    """``source`` was ``null`` (documented as "no --source given") when the output's own
    metadata was unusable and the source was skipped."""
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [1, 2, 3, k + 4]}) + "\n" for k in range(20)))
    out = pack_to([src], tmp_path / "out", PackSpec(pack_size=64))
    (out / "metadata.json").write_text((out / "metadata.json").read_text()[:-40])  # cut short
    doc = json.loads(runner.invoke(app, ["verify", str(out), "--source", str(src), "--json"]).stdout)
    assert doc["errors"].get("source.skipped") == 1, doc["errors"]
    assert doc["source"] == {"inputs": 1, "records": 0, "samples_packed": None, "tokens_compared": None,
                             "complete": False}
    assert json.loads(runner.invoke(app, ["verify", str(out), "--json"]).stdout)["source"] is None
    verdict = runner.invoke(app, ["verify", str(out), "--source", str(src)]).output.strip().splitlines()[-1]
    assert verdict.startswith("verify: FAILED") and "and the source" not in verdict, verdict


def test_an_unusable_recorded_source_spec_is_a_finding_with_the_summarys_keys(tmp_path):
    """--json's ``source`` was ``null`` here (documented as "no --source given"), and lacked
    ``samples_packed``/``tokens_compared`` after a source that broke half way: a pipeline
    reading it met a missing key instead of ``complete: false``."""
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [1, 2, 3, k + 4]}) + "\n" for k in range(20)))
    out = pack_to([src], tmp_path / "out", PackSpec(pack_size=64))
    meta = json.loads((out / "metadata.json").read_text())
    meta["source"]["tokens_field"] = 5
    del meta["checksum"]  # signed again: the spec alone is wrong
    meta["checksum"] = {"xxh3_64": xxhash.xxh3_64_hexdigest(orjson.dumps(meta, option=orjson.OPT_SORT_KEYS))}
    (out / "metadata.json").write_text(json.dumps(meta))
    doc = json.loads(runner.invoke(app, ["verify", str(out), "--source", str(src), "--json"]).stdout)
    assert doc["exit_code"] == 1 and doc["errors"].get("source.spec") == 1, doc["errors"]
    assert doc["source"] == {"inputs": 1, "records": 0, "samples_packed": None, "tokens_compared": None,
                             "complete": False}


def test_a_shard_that_changed_before_it_is_read_again_is_a_finding(synth, tmp_path, monkeypatch):
    """The first differing position is found by reading the batch again; if the shard no longer
    holds that sequence (rewritten meanwhile), the finding says so instead of a traceback."""
    from packer_cli.audit.store import NativeStore, PackBatch

    src, outs = synth

    def edit(columns):
        columns["input_ids"][40][3] += 1

    changed = _edited_source(src, tmp_path, edit)
    empty = np.zeros(0, np.int32), np.zeros(1, np.int64)
    monkeypatch.setattr(NativeStore, "batch_at", lambda self, name, row: PackBatch(name, row, 0, lambda c: empty))
    result = verify(outs[OverlongPolicy.TRUNCATE], "--source", changed)
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = next(x for x in result.output.splitlines() if "[source.tokens]" in x)
    assert "token values differ from the source (" in line and "could not be read again to say where" in line, line


def test_sample_missing_from_output(broken, synth):
    shard = first_shard(broken)
    removed = {}

    def drop_sequence(rows):
        row = next(r for r in rows if len(r["seq_lens"]) > 1)
        a, b = row["cu_seqlens"][0], row["cu_seqlens"][1]
        removed["index"] = row["source_index"][0]
        for col in ("tokens", "loss_mask"):
            del row[col][a:b]
        row["cu_seqlens"] = [c - (b - a) for c in row["cu_seqlens"][1:]]
        for col in ("seq_lens", "last_token", "source_index", "source_offset"):
            del row[col][0]

    rewrite(broken, shard, drop_sequence)
    result = verify(broken, "--source", synth[0])
    assert result.exit_code == 1
    assert (f"train.parquet: row {removed['index']}: sample (source index {removed['index']}) is not in the "
            f"output, and not listed as dropped [source.missing]") in result.output
    assert "counts.sequences" in verify(broken).output  # without the source, the counts still disagree


def piece_places(out: Path) -> dict[tuple[int, int], tuple[int, str, int, int]]:
    """``(source index, offset)`` of every packed sequence → ``(pack, shard, row, seq)``."""
    found, pack = {}, 0
    for entry in manifest(out)["shards"]:
        for row, r in enumerate(pa.ipc.open_file(str(out / entry["name"])).read_all().to_pylist()):
            for seq, key in enumerate(zip(r["source_index"], r["source_offset"])):
                found[key] = (pack + row, entry["name"], row, seq)
        pack += entry["rows"]
    return found


def places(out: Path) -> dict[int, tuple[int, str, int, int]]:
    """Where each source index's first piece was packed: ``(pack, shard, row, seq)``."""
    return {index: place for (index, offset), place in piece_places(out).items() if offset == 0}


def named(place: tuple[int, str, int, int]) -> str:
    """A place as verify's findings name it."""
    return f"{place[1]} row {place[2]} (pack {place[0]}) seq {place[3]}"


def test_whole_output_findings_name_the_exact_place(broken, synth, tmp_path):
    """Verify keeps no place per sequence, only per pack: a duplicate found after sorting, and a
    source mismatch, still name the very shard, row, pack and place (in a later shard)."""
    shard = manifest(broken)["shards"][-2]["name"]
    before, twice = places(broken), {}

    def repeat_a_sample(rows):
        row = next(r for r in rows[3:] if len(r["seq_lens"]) > 1)
        kept = next(i for i in before if before[i][1] == shard and i != row["source_index"][1])
        twice.update(index=kept, seq=row["source_index"][1])
        row["source_index"][1] = kept

    rewrite(broken, shard, repeat_a_sample)
    result = verify(broken)
    assert result.exit_code == 1
    line = next(x for x in result.output.splitlines() if "[output.duplicate]" in x)
    first, second = sorted([before[twice["index"]], before[twice["seq"]]])  # in pack order
    assert line == (f"{named(second)}: source index {twice['index']} offset 0 is packed twice "
                    f"(also at {first[1]} row {first[2]} seq {first[3]}) [output.duplicate]"), (line, first, second)

    k = max(i for i in before if before[i][1] == shard and i not in twice.values())
    changed = _edited_source(synth[0], tmp_path, lambda columns: columns["input_ids"][k].__setitem__(
        5, columns["input_ids"][k][5] + 1))
    result = verify(broken, "--source", changed)
    line = next(x for x in result.output.splitlines() if "[source.tokens]" in x)
    assert line.startswith(f"{named(before[k])}: token position 5 is "), (line, before[k])


@pytest.mark.parametrize("policy", [OverlongPolicy.SPLIT, OverlongPolicy.TRUNCATE])
def test_a_piece_at_the_wrong_offset(synth, tmp_path, policy):
    """Split: sample 31 (999 runtime tokens) is pieces at 0, 256, 512 and 768; moving one leaves a
    gap. Any other policy: an offset other than 0 is a piece no run made."""
    out = Path(shutil.copytree(synth[1][policy], tmp_path / "out"))
    index, offset = (31, 512) if policy == OverlongPolicy.SPLIT else (40, 0)
    at = piece_places(out)[index, offset]
    moved = 1024 if policy == OverlongPolicy.SPLIT else 256

    def move_piece(rows):
        rows[at[2]]["source_offset"][at[3]] = moved

    rewrite(out, at[1], move_piece)
    result = verify(out)
    assert result.exit_code == 1
    says = (f"piece of source index {index} at offset {moved} should be at 768 (a piece is missing)"
            if policy == OverlongPolicy.SPLIT else
            f"source index {index} has offset {moved}, but only --overlong split makes pieces")
    assert f"{named(at)}: {says} [output.pieces]" in result.output, result.output


@pytest.mark.parametrize("column,check,what", [("tokens", "source.tokens", "token"),
                                                ("loss_mask", "source.targets", "loss mask (target) at")])
def test_a_consistent_rewrite_of_a_shard_passes_alone_but_not_against_the_source(broken, synth, column, check, what):
    shard = first_shard(broken)
    edited = {}

    def change_one_value(rows):
        row = next(r for r in rows if r["seq_lens"][0] > 12)
        position = 9  # runtime position 9 of the pack's first sequence
        old = row[column][position]
        row[column][position] = old + 7 if column == "tokens" else 1 - old
        edited.update(index=row["source_index"][0], old=old, new=row[column][position])

    rewrite(broken, shard, change_one_value)
    if column == "tokens":  # a token id changed: the structure still holds
        assert verify(broken).exit_code == 0
    result = verify(broken, "--source", synth[0])
    assert result.exit_code == 1
    line = next(x for x in result.output.splitlines() if f"[{check}]" in x)
    assert f"{what} position 9 is {edited['new']} but the source (" in line, line
    assert f"train.parquet: row {edited['index']}) has {edited['old']}" in line, line


def test_pack_over_capacity(broken):
    shard = first_shard(broken)
    moved = {}

    def move_sequence(rows):
        loads = [len(r["tokens"]) for r in rows]
        src = next(i for i, r in enumerate(rows) if len(r["seq_lens"]) > 1)
        p = rows[src]["cu_seqlens"][1]
        dst = next(i for i in range(len(rows)) if i != src and loads[i] + p > C)
        moved["row"], moved["load"] = dst, loads[dst] + p
        a, b = rows[src], rows[dst]
        b["cu_seqlens"] += [loads[dst] + p]
        for col in ("tokens", "loss_mask"):
            b[col] += a[col][:p]
            del a[col][:p]
        a["cu_seqlens"] = [c - p for c in a["cu_seqlens"][1:]]
        for col in ("seq_lens", "last_token", "source_index", "source_offset"):
            b[col].append(a[col].pop(0))

    assert_finds(broken, shard, move_sequence, lambda: (
        f"{shard} row {moved['row']} (pack {moved['row']}): the pack holds {moved['load']:,} runtime tokens (Σp), "
        f"more than C = {C} [pack.capacity]"))


@pytest.mark.parametrize("case", ["empty", "empty-but-3-real", "past-its-padding"])
def test_a_real_length_outside_one_to_its_padded_length_is_a_finding(broken, case):
    """A sequence of real length 0 in an empty segment (cu_seqlens repeated), one claiming 3 real
    tokens in such a segment, or one more than its padded length: no other check names any of
    them (an empty segment is aligned, p = 0)."""
    shard = first_shard(broken)
    where = {}

    def empty(rows, real=0):
        r = rows[0]
        r["cu_seqlens"].insert(1, r["cu_seqlens"][1])
        for col, value in (("seq_lens", real), ("last_token", 1 if real else 0),
                           ("source_index", r["source_index"][0]), ("source_offset", 0)):
            r[col].insert(1, value)
        where.update(row=0, seq=1, says=f"real length {real} exceeds the padded length 0" if real else
                     "real length 0 is below 1")

    def past_its_padding(rows):
        for i, r in enumerate(rows):
            cu, lens = r["cu_seqlens"], r["seq_lens"]
            k = next((k for k in range(len(lens)) if cu[k + 1] - cu[k] == lens[k]), None)
            if k is not None:
                lens[k] += 1
                where.update(row=i, seq=k, says=f"real length {lens[k]} exceeds the padded length {lens[k] - 1}")
                return

    edit = {"empty": empty, "empty-but-3-real": lambda rows: empty(rows, real=3)}.get(case, past_its_padding)
    assert_finds(broken, shard, edit, lambda: (
        f"{shard} row {where['row']} (pack {where['row']}) seq {where['seq']}: {where['says']} [pack.lengths]"))


@pytest.mark.parametrize("case", ["no-sequence", "real-past-padded"])
def test_inspect_refuses_a_pack_of_no_sequence_or_a_real_length_past_its_padded_one(broken, case):
    """inspect, which reads only the lengths, refuses (exit 1, one line naming the row) a pack
    whose ``cu_seqlens`` is ``[0]`` (no sequence) and a sequence whose real length is one past
    its padded length, each for what it is."""
    shard = first_shard(broken)
    said = {}

    def no_sequence(rows):  # its tokens kept (the manifest's totals still hold), no sequence over them
        r = rows[0]
        for col in ("seq_lens", "last_token", "source_index", "source_offset"):
            r[col] = []
        r["cu_seqlens"] = [0]
        said.update(text="1 cu_seqlens entries for 0 sequences")

    def real_past_padded(rows):
        r = rows[0]
        padded = r["cu_seqlens"][1] - r["cu_seqlens"][0]
        r["seq_lens"][0] = padded + 1
        said.update(text=f"a sequence has real length {padded + 1} and padded length {padded}")

    rewrite(broken, shard, no_sequence if case == "no-sequence" else real_past_padded)
    result = runner.invoke(app, ["inspect", str(broken)])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (f"error: {broken}: {shard} row 0: malformed pack ({said['text']}); run "
                                     f"`packer verify` for a full report"), result.output


@pytest.mark.parametrize("column", ["last_token", "source_index", "source_offset"])
def test_a_per_sequence_column_of_another_length_is_a_finding(broken, column):
    """Each per-sequence list has one entry a sequence: one short is named, and the pack's
    other checks (which index them by sequence) are not run on it."""
    shard = first_shard(broken)
    where = {}

    def one_short(rows):
        i = next(i for i, r in enumerate(rows) if len(r["seq_lens"]) > 1)
        rows[i][column].pop()
        where.update(row=i, n=len(rows[i]["seq_lens"]))

    output = assert_finds(broken, shard, one_short, lambda: (
        f"{shard} row {where['row']} (pack {where['row']}): {column} has {where['n'] - 1} entries but seq_lens has "
        f"{where['n']} [pack.columns]"))
    assert "Traceback" not in output


def test_a_piece_of_no_kept_sample_is_a_finding_against_the_source(synth, tmp_path):
    """Under --overlong drop, a packed sequence relabelled as a dropped sample: the index is in
    range and unique, so only the source tells; the sample it stood for is then missing."""
    src, outs = synth
    out = Path(shutil.copytree(outs[OverlongPolicy.DROP], tmp_path / "out"))
    packed = places(out)
    dropped = next(i for i in range(300) if i not in packed)
    shard = first_shard(out)
    moved = {}

    def relabel(rows):
        r = rows[0]
        moved.update(index=r["source_index"][0], place=named(packed[r["source_index"][0]]))
        r["source_index"][0] = dropped

    rewrite(out, shard, relabel)
    result = verify(out, "--source", src)
    assert result.exit_code == 1
    assert (f"{moved['place']}: source index {dropped} offset 0 is not a piece of any kept source sample (out of "
            f"range, a bad or too-short record, or dropped) [source.unexpected]") in result.output, result.output
    assert (f"row {moved['index']}: sample (source index {moved['index']}) is not in the output, and not listed "
            f"as dropped [source.missing]") in result.output, result.output


def test_a_piece_past_the_last_source_sample_is_a_finding_against_the_source(synth, tmp_path):
    """A packed sequence relabelled with an index past the source's last record (the highest key
    of the sorted table, after every window) is named as no kept sample's piece."""
    src, outs = synth
    out = Path(shutil.copytree(outs[OverlongPolicy.DROP], tmp_path / "out"))
    packed = places(out)
    shard = first_shard(out)
    moved = {}

    def relabel(rows):
        r = rows[0]
        moved.update(index=r["source_index"][0], place=named(packed[r["source_index"][0]]))
        r["source_index"][0] = 300  # the source has records 0..299

    rewrite(out, shard, relabel)
    result = verify(out, "--source", src)
    assert result.exit_code == 1
    assert (f"{moved['place']}: source index 300 offset 0 is not a piece of any kept source sample (out of "
            f"range, a bad or too-short record, or dropped) [source.unexpected]") in result.output, result.output
    assert f"sample (source index {moved['index']}) is not in the output" in result.output, result.output

def test_padded_length_not_multiple_of_m(broken):
    shard = first_shard(broken)
    where = {}

    def grow_last(rows):
        i = next(i for i, r in enumerate(rows) if len(r["tokens"]) < C)
        r = rows[i]
        r["tokens"].append(0)
        r["loss_mask"].append(0)
        r["cu_seqlens"][-1] += 1
        where.update(row=i, seq=len(r["seq_lens"]) - 1, p=r["cu_seqlens"][-1] - r["cu_seqlens"][-2])

    rewrite(broken, shard, grow_last)
    result = verify(broken)
    assert result.exit_code == 1
    assert (f"{shard} row {where['row']} (pack {where['row']}) seq {where['seq']}: padded length {where['p']} is not "
            f"a multiple of m = 4 [pack.alignment]") in result.output
    assert "[pack.padding]" not in result.output and "[pack.cu_seqlens]" not in result.output


def test_padding_of_m_or_more_is_a_finding(broken):
    """A sequence padded past the next multiple of m (m more pad tokens, or a real length lowered
    by m): every length is still a multiple of m, but the format pads to ceil(s/m)·m only, and
    a loader would train on a boundary that is not the sample's."""
    shard = first_shard(broken)
    where = {}

    def pad_more(rows):
        i = next(i for i, r in enumerate(rows) if len(r["tokens"]) + 4 <= C)
        r = rows[i]
        r["tokens"] += [0] * 4
        r["loss_mask"] += [0] * 4
        r["cu_seqlens"][-1] += 4
        where.update(row=i, seq=len(r["seq_lens"]) - 1, p=r["cu_seqlens"][-1] - r["cu_seqlens"][-2],
                     s=r["seq_lens"][-1])

    rewrite(broken, shard, pad_more)
    result = verify(broken)
    assert result.exit_code == 1
    assert (f"{shard} row {where['row']} (pack {where['row']}) seq {where['seq']}: padded length {where['p']} holds "
            f"{where['s']} real tokens: more padding than m = 4 allows [pack.alignment]") in result.output
    assert "not a multiple of m" not in result.output and "[pack.padding]" not in result.output


def test_padding_of_exactly_m_is_a_finding(broken):
    """The boundary of the rule above: a real length lowered by exactly m (its last m tokens made
    padding) leaves p - s = m, one slot more than ceil(s/m)·m allows."""
    shard = first_shard(broken)
    where = {}

    def lower_by_m(rows):
        for i, r in enumerate(rows):
            cu, s = r["cu_seqlens"], r["seq_lens"]
            k = next((k for k in range(len(s)) if cu[k + 1] - cu[k] == s[k] and s[k] > 4), None)
            if k is not None:
                end = cu[k] + s[k]
                r["tokens"][end - 4:end] = [0] * 4
                r["loss_mask"][end - 4:end] = [0] * 4
                s[k] -= 4
                where.update(row=i, seq=k, p=cu[k + 1] - cu[k], s=s[k])
                return

    assert_finds(broken, shard, lower_by_m, lambda: (
        f"{shard} row {where['row']} (pack {where['row']}) seq {where['seq']}: padded length {where['p']} holds "
        f"{where['s']} real tokens: more padding than m = 4 allows [pack.alignment]"))


def test_a_recorded_alignment_the_layout_does_not_give_is_the_metadatas_fault(broken):
    """spec.pad_seq_to_mult edited to 8 (CP = 2 gives 4; no override recorded), the metadata
    re-sealed: verify names the metadata, and checks the packs against the layout's 4 (they
    are right), instead of blaming every pack's alignment on the edited 8."""
    def to_8(doc):
        assert doc["spec"]["pad_seq_to_mult"] == 4 and doc["spec"]["pad_seq_to_mult_override"] is False
        doc["spec"]["pad_seq_to_mult"] = 8

    _resealed(broken, to_8)
    result = verify(broken)
    assert result.exit_code == 1
    assert "spec.pad_seq_to_mult is 8 but CP=2, TP=1, SP=False give 4 [metadata.spec]" in result.output, result.output
    assert "[pack.alignment]" not in result.output, result.output


def test_a_recorded_alignment_without_its_override_flag_is_the_metadatas_fault(broken):
    """The same edit with spec.pad_seq_to_mult_override gone as well: a missing flag means no
    override (as as_dict writes it for a layout's own alignment), so the packs are still checked
    against the layout's 4 and the metadata is named, not every pack's alignment."""
    def to_8(doc):
        doc["spec"]["pad_seq_to_mult"] = 8
        del doc["spec"]["pad_seq_to_mult_override"]

    _resealed(broken, to_8)
    result = verify(broken)
    assert result.exit_code == 1
    assert "spec.pad_seq_to_mult is 8 but CP=2, TP=1, SP=False give 4 [metadata.spec]" in result.output, result.output
    assert "[pack.alignment]" not in result.output, result.output


def test_loss_on_padding(broken):
    shard = first_shard(broken)
    where = {}

    def set_loss(rows):
        for i, r in enumerate(rows):
            cu, s = r["cu_seqlens"], r["seq_lens"]
            pads = [k for k in range(len(s)) if cu[k + 1] - cu[k] > s[k]]
            if pads:
                k = pads[0]
                r["loss_mask"][cu[k] + s[k]] = 1
                where.update(row=i, seq=k)
                return

    rewrite(broken, shard, set_loss)
    result = verify(broken)
    assert result.exit_code == 1
    assert re.search(rf"{shard} row {where['row']} \(pack {where['row']}\) seq {where['seq']}: loss mask is non-zero on 1 of "
                     r"its \d padding positions \[pack.padding\]", result.output)
    assert "[metadata.counts]" not in result.output  # targets count real positions only


def test_a_loss_mask_one_value_too_long_is_its_packs_finding_alone(broken, synth):
    """A pack whose loss mask has one value more than its tokens is a ``pack.columns`` finding;
    the sound packs after it in the same record batch are still read at their own mask offsets
    (those of the loss mask column, not of the tokens): no padding, loss mask or target finding
    for them, with or without --source."""
    shard = first_shard(broken)
    rewrite(broken, shard, lambda rows: rows[0]["loss_mask"].append(0))
    for args in ([], ["--source", synth[0]]):
        result = verify(broken, *args)
        assert result.exit_code == 1
        assert f"{shard} row 0 (pack 0): loss_mask has " in result.output, result.output
        findings = [x for x in result.output.splitlines() if "[pack." in x or "[source.targets]" in x]
        assert all("[pack.columns]" in x for x in findings), result.output


@pytest.fixture(scope="module")
def with_vocab(synth, tmp_path_factory):
    """The synthetic input packed with its vocabulary size recorded (ids are 0..4999)."""
    return pack_to([synth[0]], tmp_path_factory.mktemp("vocab") / "out", PackSpec(pack_size=C, cp=CP),
                   SourceSpec(vocab_size=5000))


def _set_first(column: str, value: int):
    """An edit setting the first value of pack 0's ``column`` (its first sequence's)."""
    return lambda rows: rows[0][column].__setitem__(0, value)


def _first_padding_slot(rows, value: int):
    """An edit writing ``value`` into the first padding slot of the output: (row, seq) it chose."""
    for i, r in enumerate(rows):
        cu, s = r["cu_seqlens"], r["seq_lens"]
        for k in range(len(s)):
            if cu[k + 1] - cu[k] > s[k]:
                r["tokens"][cu[k] + s[k]] = value
                return i, k
    raise AssertionError("no sequence is padded")


@pytest.mark.parametrize("edit, says", [
    (_set_first("source_index", 300), "seq 0: source index 300 is beyond the 300 records the run read [pack.source]"),
    (_set_first("last_token", -1), "seq 0: last_token -1 is negative [pack.tokens]"),
    (_set_first("last_token", 5000), "seq 0: token id 5000 is >= the vocab size 5000 [pack.tokens]"),
    (_set_first("tokens", -5), "seq 0: a token id is negative [pack.tokens]"),
    (_set_first("tokens", 5000), "seq 0: token id 5000 is >= the vocab size 5000 [pack.tokens]"),
    (lambda rows: _first_padding_slot(rows, 77), ": 1 padding tokens differ from pad id 0 [pack.padding]"),
    (lambda rows: _first_padding_slot(rows, -1), ": 1 padding tokens differ from pad id 0 [pack.padding]"),
    (_set_first("source_index", -1), "seq 0: source index -1 is negative [pack.source]"),
    (_set_first("source_offset", -256), "seq 0: source offset -256 is negative [pack.source]"),
], ids=["index-equal-to-records", "last-token-negative", "last-token-equal-to-vocab", "token-negative",
        "token-equal-to-vocab", "padding-token", "padding-token-below-pad-id", "index-negative", "offset-negative"])
def test_one_value_just_out_of_range_is_a_finding(with_vocab, tmp_path, edit, says):
    """Each per-sequence range check at its boundary (the first value out of range, not a far one):
    one value edited, the checksums made to hold, verify names it."""
    out = Path(shutil.copytree(with_vocab, tmp_path / "out"))
    assert json.loads((out / "metadata.json").read_text())["counts"]["records"] == 300
    assert verify(out).exit_code == 0
    shard = first_shard(out)
    rewrite(out, shard, edit)
    result = verify(out)
    assert result.exit_code == 1
    line = next((x for x in result.output.splitlines() if x.endswith(says)), None)
    assert line is not None and line.startswith(f"{shard} row "), result.output


def test_padding_is_checked_against_the_recorded_pad_id(synth, tmp_path):
    """An output packed with pad_id=7 passes (its padding holds 7, not 0), and a padding slot
    holding 0, the usual pad id but not this output's, is a finding at its place."""
    out = pack_to([synth[0]], tmp_path / "out", PackSpec(pack_size=C, cp=CP, pad_id=7))
    result = verify(out, "--source", synth[0])
    assert result.exit_code == 0, result.output
    shard, at = first_shard(out), {}
    rewrite(out, shard, lambda rows: at.update(zip(("row", "seq"), _first_padding_slot(rows, 0))))
    result = verify(out)
    assert result.exit_code == 1
    assert (f"{shard} row {at['row']} (pack {at['row']}) seq {at['seq']}: 1 padding tokens differ from pad id 7 "
            "[pack.padding]") in result.output, result.output


def test_a_piece_one_token_short_is_a_finding(synth, tmp_path):
    """Split: every piece but a sample's last holds cap tokens; sample 30's first piece shortened
    by one (its last token made padding, within m) breaks only that rule."""
    out = Path(shutil.copytree(synth[1][OverlongPolicy.SPLIT], tmp_path / "out"))
    at = piece_places(out)[30, 0]

    def shorten(rows):
        r, k = rows[at[2]], at[3]
        end = r["cu_seqlens"][k] + r["seq_lens"][k]
        assert r["seq_lens"][k] == C
        r["tokens"][end - 1], r["loss_mask"][end - 1] = 0, 0
        r["seq_lens"][k] -= 1

    rewrite(out, at[1], shorten)
    result = verify(out)
    assert result.exit_code == 1
    assert (f"{named(at)}: piece of source index 30 at offset 0 has {C - 1} tokens; every piece but the last "
            f"must have {C} [output.pieces]") in result.output, result.output


@pytest.mark.parametrize("delta", [-1, 1], ids=["one-short", "one-long"])
def test_a_sequence_of_another_length_than_its_source_sample_is_a_finding(broken, synth, delta):
    """A real length lowered by one (its last token made padding) or raised by one (a padding
    slot made real: it reads as a token equal to pad_id) leaves a well-formed pack (only the
    metadata's counts see it); against the source it is one ``source.length`` finding at its
    place, the sample's tokens not compared. Taking a longer piece as matched (``>=`` for ``==``) passed every test."""
    shard = first_shard(broken)
    at = {}

    def change_length(rows):
        for i, r in enumerate(rows):
            cu, lens = r["cu_seqlens"], r["seq_lens"]
            for k, s in enumerate(lens):
                padding = cu[k + 1] - cu[k] - s
                if s > 12 and r["source_offset"][k] == 0 and (padding <= 2 if delta < 0 else padding >= 1):
                    end = cu[k] + s
                    if delta < 0:
                        r["tokens"][end - 1], r["loss_mask"][end - 1] = 0, 0
                    lens[k] += delta
                    at.update(index=r["source_index"][k], s=s, place=named(places_before[r["source_index"][k]]))
                    return

    places_before = places(broken)
    rewrite(broken, shard, change_length)
    alone = verify(broken).output  # the metadata's token counts disagree; the pack itself is well-formed
    assert "[pack." not in alone and "[output." not in alone, alone
    result = verify(broken, "--source", synth[0])
    assert result.exit_code == 1
    lines = [x for x in result.output.splitlines() if x.endswith("]") and "[source." in x]
    assert lines == [f"{at['place']}: holds {at['s'] + delta} runtime tokens of source index {at['index']} offset 0, "
                     f"the source and policy give {at['s']} [source.length]"], result.output


def _resealed(out: Path, edit) -> None:
    """``edit(doc)`` applied to the metadata, its checksum made to hold again."""
    from packer_cli.shards.format import seal_metadata

    doc = json.loads((out / "metadata.json").read_text())
    edit(doc)
    doc.pop("checksum")
    (out / "metadata.json").write_text(json.dumps(seal_metadata(doc)))


def _seven_short_samples(root: Path) -> Path:
    """Seven samples of 50 tokens, every one a target."""
    src = root / "seven.parquet"
    pq.write_table(pa.table({"input_ids": [list(range(1, 51))] * 7, "loss_mask": [[1] * 50] * 7}), src)
    return src


@pytest.mark.parametrize("key", ["quality.efficiency", "quality.l2_bound", "bridge.max_samples_per_bin",
                                 "bridge.dataset_max_seqlen", "bridge.min_packed_seqlen", "bridge.packing_factor",
                                 "static.cu_seqlens_len", "static.max_seqlen", "static.pack_len",
                                 "padded static.max_seqlen", "padded static.pack_len"])
def test_a_recorded_figure_the_packs_do_not_give_is_a_finding(synth, broken, tmp_path, key):
    """What a trainer sizes by (Bridge's keys, the static shapes) and the recorded quality are
    recomputed from the packs: each one off, its checksum resealed, is one finding naming it.
    Under --pad-to-max-length the tail padding is the last sequence's, so max_seqlen is at least
    C less the least-filled pack's tokens (here above the longest sample's)."""
    if key.startswith("padded "):
        key = key.split()[1]
        src = _seven_short_samples(tmp_path)  # packs of 4 and 3 (208 and 156 tokens)
        broken = pack_to([src], tmp_path / "padded", PackSpec(pack_size=C, cp=CP, pad_to_max_length=True))
        assert verify(broken).exit_code == 0
        bridge = json.loads((broken / "metadata.json").read_text())["bridge"]
        assert C - bridge["min_packed_seqlen"] > bridge["dataset_max_seqlen"]
    group, name = key.split(".")
    old = json.loads((broken / "metadata.json").read_text())[group][name]
    new = 1 if old is None else old + 1  # static.pack_len is None without --pad-to-max-length
    _resealed(broken, lambda doc: doc[group].update({name: new}))
    result = verify(broken)
    assert result.exit_code == 1
    assert [line for line in result.output.splitlines() if line.endswith("]")] == [
        f"metadata.json: {key} is {new!r} but the data has {old!r} [metadata.{group}]"], result.output


def _over(doc: dict) -> dict:
    return doc["counts"]["overlong"]


COUNT_EDITS = [  # (output, edit of the metadata, the finding it gives: {key} is the edited count's old value)
    ("split", lambda d, at_cap: _over(d).update(samples=_over(d)["samples"] + 1),
     "counts.overlong.samples is {new} but the data has {old}"),
    ("split", lambda d, at_cap: _over(d).update(dropped=1), "counts.overlong.dropped is 1 but policy split drops 0"),
    ("truncate", lambda d, at_cap: _over(d).update(dropped=1), "counts.overlong.dropped is 1 but policy truncate drops 0"),
    ("split", lambda d, at_cap: _over(d).update(tokens_lost=1), "counts.overlong.tokens_lost is 1 but policy split loses 0"),
    ("split", lambda d, at_cap: _over(d).update(target_tokens_lost=1),
     "counts.overlong.target_tokens_lost is 1 but policy split loses 0"),
    ("error", lambda d, at_cap: _over(d).update(samples=1), "counts.overlong.samples is 1 but policy error allows 0"),
    ("drop", lambda d, at_cap: _over(d).update(dropped=_over(d)["dropped"] + 1),
     "counts.overlong.dropped is {new} but overlong.samples says {old}"),
    ("truncate", lambda d, at_cap: _over(d).update(samples=at_cap + 1),  # the first count past the cap's
     "counts.overlong.samples is {new} but only {at_cap} sequences are at the truncation length"),
    ("drop", lambda d, at_cap: d["counts"].update(no_target_samples=d["counts"]["no_target_samples"] + 1),
     "counts.no_target_samples is {new} but the data has {old}"),
    ("truncate", lambda d, at_cap: d["counts"].update(records=d["counts"]["records"] + 1),
     "counts.records is {new} but samples_packed + too_short_dropped + bad_records + overlong.dropped = {old}"),
    ("truncate", lambda d, at_cap: d["counts"].update(bad_records=1), "bad_records lists 0 records but counts.bad_records is 1"),
    ("truncate", lambda d, at_cap: _over(d).update(policy="split"), "counts.overlong.policy is 'split' but the spec says "
                                                            "'truncate'"),
]


@pytest.mark.parametrize("output, edit, says", COUNT_EDITS, ids=[
    "split-samples", "split-dropped", "truncate-dropped", "split-tokens-lost", "split-targets-lost", "error-samples",
    "drop-dropped", "truncate-samples", "no-target", "records", "bad-records", "policy"])
def test_counts_the_policy_rules_out_are_findings(synth, tmp_path, output, edit, says):
    """What the over-long policy implies of the recorded counts (split and truncate drop
    nothing, split and error lose nothing, error allows no over-long sample, drop drops each
    one, truncation leaves each at the cap), and records = packed + left out: each count edited,
    its checksum resealed, is named. The sample counts must match the data exactly."""
    if output == "error":  # no sample over C
        out = pack_to([_seven_short_samples(tmp_path)], tmp_path / "out",
                      PackSpec(pack_size=C, cp=CP, overlong=OverlongPolicy.ERROR))
    else:
        out = Path(shutil.copytree(synth[1][OverlongPolicy(output)], tmp_path / "out"))
    at_cap = sum(pa.ipc.open_file(str(out / e["name"])).read_all().column("seq_lens").combine_chunks()
                 .flatten().to_numpy().tolist().count(C) for e in manifest(out)["shards"])
    before = json.loads((out / "metadata.json").read_text())
    _resealed(out, lambda doc: edit(doc, at_cap))
    after = json.loads((out / "metadata.json").read_text())
    changed = [(a, b) for a, b in _leaves(before["counts"], after["counts"]) if a != b]
    old, new = changed[0] if changed else (None, None)
    result = verify(out)
    assert result.exit_code == 1
    said = says.format(old=old, new=new, at_cap=at_cap)
    assert f"metadata.json: {said} [metadata.counts]" in result.output, result.output


def test_an_over_long_source_sample_under_the_error_policy_is_named(tmp_path):
    """An output packed under --overlong error holds no sample over the cap: one in the source
    (the source changed since) is named with its place, its length and the policy."""
    out = pack_to([_seven_short_samples(tmp_path)], tmp_path / "out",
                  PackSpec(pack_size=C, cp=CP, overlong=OverlongPolicy.ERROR))
    longer = tmp_path / "longer.parquet"
    ids = [list(range(1, 51))] * 7
    ids[3] = list(range(1, C + 3))  # C + 2 tokens: C + 1 runtime tokens, one more than the cap
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": [[1] * len(x) for x in ids]}), longer)
    result = verify(out, "--source", longer)
    assert result.exit_code == 1
    assert (f"longer.parquet: row 3: sample has {C + 1} runtime tokens, more than {C}, but the policy is error "
            f"[source.counts]") in result.output, result.output

def _leaves(a, b):
    """Pairs of corresponding scalars of two nested dicts of one shape."""
    if isinstance(a, dict):
        for key in a:
            yield from _leaves(a[key], b[key])
    else:
        yield a, b


@pytest.mark.parametrize("edit, says, code", [
    (lambda m: m["bad_records"][0].update(line=m["bad_records"][0]["line"] + 1),
     "bad_records lists 1 records that differ from the 1 the source gives [source.counts]", 1),
    (lambda m: m["source"].update(padding_dropped=3), "source.padding_dropped", 1),
    (lambda m: m["source"]["inputs"][0].update(bytes=m["source"]["inputs"][0]["bytes"] + 100),
     "bytes, the output recorded", 0),
], ids=["bad-record-line", "padding-dropped", "input-bytes"])
def test_recorded_source_facts_are_checked_against_the_source(tmp_path, edit, says, code):
    """What the metadata records of the inputs (the bad records' places, the padding dropped,
    each file's size), edited and re-sealed as a packer that got them wrong would have written
    them: `verify --source` replays the inputs and says so (the size as a warning)."""
    src = tmp_path / "in.jsonl"
    records = [{"input_ids": [1, 2, 3, 4 + k], "loss_mask": [0, 1, 1, 1]} for k in range(10)]
    records[7]["input_ids"][1] = -1  # line 8: a bad record, skipped
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = pack_to([src], tmp_path / "out", PackSpec(pack_size=C, cp=CP), SourceSpec(on_bad_record=BadRecordPolicy.SKIP))
    assert verify(out, "--source", src).exit_code == 0
    _resealed(out, edit)
    result = verify(out, "--source", src)
    assert result.exit_code == code
    line = next((x for x in result.output.splitlines() if says in x), None)
    assert line is not None, result.output
    if code:
        assert "[source.counts]" in line, line


def _every_cu_seqlens_starting_at_1(out: Path) -> str:
    """``out``'s first shard with every row's cu_seqlens starting at 1 (a problem in each row);
    the shard's name."""
    shard = first_shard(out)

    def start_at_1(rows):
        for r in rows:
            r["cu_seqlens"][0] = 1

    rewrite(out, shard, start_at_1)
    return shard


def test_json_report_and_limit(broken):
    shard = _every_cu_seqlens_starting_at_1(broken)
    result = runner.invoke(app, ["verify", str(broken), "--json", "--limit", "3"])
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert doc["ok"] is False and doc["exit_code"] == 1
    rows = len(pa.ipc.open_file(str(broken / shard)).read_all())
    assert doc["errors"]["pack.cu_seqlens"] == rows
    first = doc["findings"][0]
    assert first == {"check": "pack.cu_seqlens", "message": "cu_seqlens starts at 1, not 0", "shard": shard,
                     "row": 0, "pack": 0, "seq": None, "severity": "error", "omitted": None}
    # the line standing for the rest says how many it stands for, where a reader need not parse it
    assert [f for f in doc["findings"] if f["omitted"] is not None and f["check"] == "pack.cu_seqlens"] == [
        {"check": "pack.cu_seqlens", "message": f"{rows - 3} more pack.cu_seqlens problems not shown", "shard": None,
         "row": None, "pack": None, "seq": None, "severity": "error", "omitted": rows - 3}]
    assert VerifyReport.from_dict(doc).to_dict() == doc
    # a document it did not write is a ValueError saying so, not a bare KeyError or TypeError
    for bad, text in (({k: v for k, v in doc.items() if k != "tokens"}, "verify report .* key 'tokens' is missing"),
                      ({**doc, "findings": [{"check": "x"}]}, "not a finding"), ([], "not a verify report"),
                      # read unchecked these printed "FAILED: -5 problem", or "OK" beside error findings,
                      # or failed with a traceback once printed
                      ({**doc, "errors": {"pack.cu_seqlens": -5}}, "errors is not a count"),
                      ({**doc, "errors": {}}, "not counted in errors"),
                      ({**doc, "errors": [1, 2]}, "errors is not a count"),
                      ({**doc, "packs": 1.5}, "packs is not a count"), ({**doc, "tokens": True}, "tokens is not"),
                      ({**doc, "seconds": float("nan")}, "seconds is not a duration"),
                      ({**doc, "source": {}}, "source is not"), ({**doc, "out": 5}, "out is not a path")):
        with pytest.raises(ValueError, match=text):
            VerifyReport.from_dict(bad)


# --- unusable arguments: exit 2 -------------------------------------------------------------

def test_unusable_arguments(tmp_path, synth):
    assert verify(tmp_path / "nope").exit_code == 2
    (tmp_path / "empty").mkdir()
    result = verify(tmp_path / "empty")
    assert result.exit_code == 2 and "not a packer output" in result.output
    result = verify(synth[1][OverlongPolicy.TRUNCATE], "--source", tmp_path / "missing.parquet")
    assert result.exit_code == 2 and "--source" in result.output


# --- fuzz: random byte flips and truncations never give a traceback --------------------------

def test_fuzz_never_tracebacks(synth, tmp_path):
    good = synth[1][OverlongPolicy.SPLIT]
    rng = random.Random(1234)
    for it in range(30):
        out = Path(shutil.copytree(good, tmp_path / f"fz{it}"))
        name = rng.choice(sorted(os.listdir(out)))
        data = bytearray((out / name).read_bytes())
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.choice([1, 1, 3, 20])):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        (out / name).write_bytes(bytes(data))
        result = verify(out)
        assert result.output.strip(), name
        if result.exit_code == 0:  # only when the flips cancelled out: every byte is covered
            assert bytes(data) == (good / name).read_bytes(), f"{name}: a change went unnoticed"
        else:
            assert result.exit_code in (1, 2), result.output
        inspected = runner.invoke(app, ["inspect", str(out)])
        assert inspected.exception is None or isinstance(inspected.exception, SystemExit), inspected.output
        shutil.rmtree(out)


def test_megatron_bridge_output(synth, tmp_path):
    """The Bridge layout is read through its own store; the same checks run on it."""
    src = synth[0]
    packed = runner.invoke(app, ["pack", str(src), "-o", str(tmp_path / "br"), "-C", str(C), "--cp", str(CP),
                                 "--format", "megatron-bridge", "--eos-id", "4999"])
    if packed.exit_code != 0 and "--format" in packed.output:
        pytest.skip("this build has no --format megatron-bridge")
    assert packed.exit_code == 0, packed.output
    out = tmp_path / "br"
    result = verify(out, "--source", src)
    assert result.exit_code == 0, result.output
    native = json.loads((synth[1][OverlongPolicy.TRUNCATE] / "metadata.json").read_text())["counts"]
    totals = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).output)["totals"]
    assert (totals["packs"], totals["runtime_tokens"]) == (native["packs"], native["runtime_tokens"])
    data = next(out.glob("*.parquet"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    result = verify(out)
    assert result.exit_code == 1 and data.name in result.output


def test_any_metadata_edit_breaks_its_checksum(synth, tmp_path):
    """Fields no data check can recompute (paths, seed, version) are still sealed by the checksum."""
    out = Path(shutil.copytree(synth[1][OverlongPolicy.TRUNCATE], tmp_path / "seal"))
    meta = json.loads((out / "metadata.json").read_text())
    meta["spec"]["seed"] += 1
    (out / "metadata.json").write_text(json.dumps(meta))
    result = verify(out)
    assert result.exit_code == 1
    # named against the file whose checksum broke, metadata.json, not the manifest
    lines = [line for line in result.output.splitlines() if line.endswith("[metadata.checksum]")]
    assert len(lines) == 1 and lines[0].startswith("metadata.json: checksum.xxh3_64 is "), result.output



@pytest.mark.parametrize("checksum", [{}, {"sha256": "00"}], ids=["empty", "another-hash"])
def test_a_metadata_checksum_without_its_xxh3_64_key_is_one_line(broken, checksum):
    """checksum present but holding no xxh3_64: a finding naming metadata.json, not a KeyError."""
    meta = json.loads((broken / "metadata.json").read_text())
    meta["checksum"] = checksum
    (broken / "metadata.json").write_text(json.dumps(meta))
    result = verify(broken)
    assert result.exit_code == 1, result.output
    assert any(line.startswith("metadata.json: has no checksum.xxh3_64") for line in result.output.splitlines()), \
        result.output

# --- the fingerprint the source check compares ------------------------------------------------

_M64 = (1 << 64) - 1
_P1, _P2, _P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9


def _fingerprint_reference(values: list[int]) -> int:
    """The kernel's fingerprint, one Python int at a time."""
    rotl = lambda x, r: ((x << r) | (x >> (64 - r))) & _M64  # noqa: E731
    rnd = lambda acc, v: rotl((acc + (v & _M64) * _P2) & _M64, 31) * _P1 & _M64  # noqa: E731
    lanes = [(_P1 + _P2) & _M64, _P2, 0, (-_P1) & _M64]
    full = len(values) // 4 * 4
    for j in range(0, full, 4):
        lanes = [rnd(a, v) for a, v in zip(lanes, values[j:j + 4])]
    h = (rotl(lanes[0], 1) + rotl(lanes[1], 7) + rotl(lanes[2], 12) + rotl(lanes[3], 18) + len(values)) & _M64
    for v in values[full:]:
        h = rnd(h, v)
    h ^= h >> 33
    h = h * _P2 & _M64
    h ^= h >> 29
    h = h * _P3 & _M64
    return h ^ (h >> 32)


def test_fingerprints_match_the_reference_and_see_every_single_change():
    from packer_cli.audit._kernels import fingerprints

    rng = np.random.default_rng(7)
    lens = rng.integers(0, 40, 300)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    values = rng.integers(-5, 200_000, int(lens.sum()))
    got = fingerprints(values.astype(np.int32), starts, lens)
    assert [int(x) for x in got] == [_fingerprint_reference(values[a:a + n].tolist()) for a, n in zip(starts, lens)]
    assert np.array_equal(fingerprints(values, starts, lens), got)  # the numbers decide, not the dtype
    small = values % 2
    assert np.array_equal(fingerprints(small.astype(np.uint8), starts, lens), fingerprints(small, starts, lens))
    for i in np.flatnonzero(lens > 1)[:60]:
        a, n = starts[i], lens[i]
        for j in rng.integers(0, n, 3):
            changed = values.copy()
            changed[a + j] += int(rng.integers(1, 3))
            assert fingerprints(changed, starts[i:i + 1], lens[i:i + 1])[0] != got[i]
        swapped = values.copy()
        swapped[a], swapped[a + n - 1] = values[a + n - 1], values[a]
        if values[a] != values[a + n - 1]:
            assert fingerprints(swapped, starts[i:i + 1], lens[i:i + 1])[0] != got[i]
    by_content = {tuple(values[a:a + n].tolist()): int(fp) for a, n, fp in zip(starts, lens, got)}
    assert len(set(by_content.values())) == len(by_content)  # different sequences, different fingerprints


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_split_on_a_native_output_is_a_usage_error(synth, command):
    """A native output has no splits: --split names something that is not there (exit 2), it
    is not silently ignored."""
    out = synth[1][OverlongPolicy.TRUNCATE]
    result = CliRunner().invoke(app, [command, str(out), "--split", "validation"])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {out}: --split validation applies to a Megatron-Bridge layout; " \
                                    "this is a native output"


@pytest.mark.parametrize("edit,says", [
    (lambda t: t.append_column("extra", pa.array([0] * t.num_rows)), "unexpected column extra"),
    (lambda t: t.drop_columns(["source_offset"]), "column source_offset is missing"),
    (lambda t: t.set_column(0, "tokens", t.column(0).cast(pa.list_(pa.int64()))), "column tokens is list<item: int64>, expected list<item: int32> not null"),
    (lambda t: t.rename_columns(["toks", *t.column_names[1:]]), "column 0 is toks, expected tokens"),
])
def test_a_shard_of_another_schema_is_named_in_a_few_words(broken, edit, says):
    """The finding names the first difference, not the whole schema (hundreds of characters)."""
    shard = sorted(broken.glob("packs-*.arrow"))[0]
    with pa.ipc.open_file(shard) as reader:
        table = reader.read_all()
    table = edit(table).replace_schema_metadata(table.schema.metadata)
    with pa.ipc.new_file(shard, table.schema) as writer:
        writer.write_table(table)
    result = runner.invoke(app, ["verify", str(broken)])
    line = next(x for x in result.output.splitlines() if "[shard.unreadable]" in x)
    assert says in line and len(line) < 250, line


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=60), st.lists(st.integers(0, 40), max_size=60), st.integers(0, 33))
def test_source_replay_membership_is_isin(keys, of, shift):
    # verify --source marks packed pieces found among the source's by binary search (np.isin
    # took 4.8 s on 2M keys of this shape); duplicates, unsorted and empty arrays included
    from packer_cli.audit._source_check import _members

    keys = np.sort(np.array(keys, np.int64) << shift)
    of = np.array(of, np.int64) << shift
    npt.assert_array_equal(_members(keys, of), np.isin(keys, of))


@pytest.mark.parametrize("codec,named,legacy", [("zstd", "Zstandard", False), ("lz4", "LZ4", False),
                                                ("zstd", "Zstandard", True)], ids=["zstd", "lz4", "zstd-pre-1.0"])
def test_a_compressed_shard_is_refused_before_its_batches_are_read(broken, codec, named, legacy):
    """Shards are uncompressed, to be memory-mapped: pyarrow decompresses a compressed batch whole
    as it reads it (70 KB of Zstandard held a 2^29-token pack, 2.3 GB to inspect), and such a
    shard passed verify. The same packs rewritten compressed, the manifest fixed: verify and
    inspect name it, and the dataset refuses it; in Arrow's pre-1.0 framing (messages without
    the continuation marker) too."""
    shard = sorted(broken.glob("packs-*.arrow"))[0]
    with pa.ipc.open_file(shard) as reader:
        table = reader.read_all()
    options = pa.ipc.IpcWriteOptions(compression=codec, use_legacy_format=legacy)
    with pa.ipc.new_file(shard, table.schema, options=options) as writer:
        writer.write_table(table, max_chunksize=max(1, table.num_rows // 3))
    man = manifest(broken)
    entry = next(e for e in man["shards"] if e["name"] == shard.name)
    entry.update(bytes=shard.stat().st_size, xxh3_64=xxhash.xxh3_64(shard.read_bytes()).hexdigest())
    (broken / "manifest.json").write_text(json.dumps(man))
    says = f"{shard.name}: record batch 0 is compressed ({named}): packer-thd shards are uncompressed"
    result = verify(broken)
    assert result.exit_code == 1 and says in result.output and "[shard.unreadable]" in result.output, result.output
    result = runner.invoke(app, ["inspect", str(broken)])
    assert result.exit_code == 1 and says in result.output, result.output
    from packer_cli.shards.reader import PackedReader

    with pytest.raises(DataError, match=re.escape(f"{shard}: record batch 0 is compressed ({named})")):
        PackedReader(str(broken))


def _footer_of(data: bytearray) -> tuple[int, list]:
    """(where the footer starts, its record batch blocks) of an IPC file's bytes."""
    from packer_cli._ipc_footer import footer_blocks

    length = int.from_bytes(data[-10:-6], "little", signed=True)
    start = len(data) - 10 - length
    return start, footer_blocks(bytes(data[start:-10]), (3,))


def _rewrite_compressed_the_arrow_0_17_way(shard: Path) -> None:
    """Compressed bodies marked as Arrow 0.17 marked them, which pyarrow still decompresses:
    metadata version V4, no RecordBatch.compression, the message's custom metadata
    ``ARROW:experimental_compression``."""
    import struct

    from packer_cli._ipc_footer import _field, u32

    with pa.ipc.open_file(shard) as reader:
        table = reader.read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        for batch in table.to_batches(max_chunksize=max(1, table.num_rows // 2)):
            writer.write_batch(batch, custom_metadata={"ARROW:experimental_compression": "zstd"})
    data = bytearray(sink.getvalue().to_pybytes())
    for offset, metadata_length, _ in _footer_of(data)[1]:
        at = offset + 8  # after the continuation marker and the length
        flat = bytes(data[at:offset + metadata_length])
        message = u32(flat, 0)
        data[at + message + _field(flat, message, 0)] = 3  # MetadataVersion V4
        batch = message + _field(flat, message, 2) + u32(flat, message + _field(flat, message, 2))
        vtable = batch - struct.unpack_from("<i", flat, batch)[0]
        struct.pack_into("<H", data, at + vtable + 4 + 2 * 3, 0)  # RecordBatch.compression: absent
    shard.write_bytes(data)
    with pa.ipc.open_file(shard) as reader:
        assert reader.read_all().equals(table)  # pyarrow reads it, decompressing


def _fix_manifest(out: Path, shard: Path) -> None:
    man = manifest(out)
    entry = next(e for e in man["shards"] if e["name"] == shard.name)
    entry.update(bytes=shard.stat().st_size, xxh3_64=xxhash.xxh3_64(shard.read_bytes()).hexdigest())
    (out / "manifest.json").write_text(json.dumps(man))


def test_a_current_shard_carrying_the_arrow_0_17_mark_is_read_as_pyarrow_reads_it(broken):
    """The mark means compression only in a V4 message, as Arrow's reader has it: a V5 shard
    whose batches carry it, uncompressed, is read whole by pyarrow and is not refused."""
    from packer_cli._ipc_footer import first_compressed_batch
    from packer_cli.shards.reader import PackedReader

    shard = sorted(broken.glob("packs-*.arrow"))[0]
    with pa.ipc.open_file(shard) as reader:
        table = reader.read_all()
    with pa.ipc.new_file(shard, table.schema) as writer:  # V5, no compression
        for batch in table.to_batches(max_chunksize=max(1, table.num_rows // 2)):
            writer.write_batch(batch, custom_metadata={"ARROW:experimental_compression": "zstd"})
    _fix_manifest(broken, shard)
    with pa.ipc.open_file(shard) as reader:
        assert reader.num_record_batches > 1 and reader.read_all().equals(table)
    with pa.memory_map(str(shard)) as source:
        assert first_compressed_batch(source) is None
    result = verify(broken)
    assert result.exit_code == 0, result.output
    assert len(PackedReader(str(broken))) > 0


def _with_a_later_batch_compressed(shard: Path) -> None:
    """``shard`` rewritten in two record batches of which only the second is compressed
    (Zstandard), which pyarrow reads: batch 1 of a compressed copy put after batch 0 of an
    uncompressed one, the footer's block for it made to match."""
    import struct

    with pa.ipc.open_file(shard) as reader:
        table = reader.read_all()

    def written(**options) -> bytearray:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as writer:
            writer.write_table(table, max_chunksize=(table.num_rows + 1) // 2)
        return bytearray(sink.getvalue().to_pybytes())

    plain, packed = written(), written(compression="zstd")
    _, (_, (offset, metadata_length, body_length)) = _footer_of(plain)
    _, (_, (packed_offset, packed_metadata, packed_body)) = _footer_of(packed)
    tail = plain[offset + metadata_length + body_length:]  # the end-of-stream marker, the footer, the magic
    data = plain[:offset] + packed[packed_offset:packed_offset + packed_metadata + packed_body] + tail
    at = offset + packed_metadata + packed_body + bytes(tail).index(struct.pack("<qi4xq", offset, metadata_length,
                                                                                   body_length))
    struct.pack_into("<qi4xq", data, at, offset, packed_metadata, packed_body)
    shard.write_bytes(data)
    with pa.ipc.open_file(shard) as reader:
        assert reader.num_record_batches > 1 and reader.read_all().equals(table)  # pyarrow reads it


@pytest.mark.parametrize("rewrite, batch", [(_rewrite_compressed_the_arrow_0_17_way, 0),
                                            (_with_a_later_batch_compressed, 1)],
                         ids=["the Arrow 0.17 way", "a later batch"])
def test_a_compressed_shard_is_refused(broken, rewrite, batch):
    """Compressed as Arrow 0.17 marked it, or only in its second batch (every record batch is
    checked, not the first alone: such a shard passed verify and was decompressed whole by the
    dataset)."""
    shard = sorted(broken.glob("packs-*.arrow"))[0]
    rewrite(shard)
    _fix_manifest(broken, shard)
    says = f"{shard.name}: record batch {batch} is compressed (Zstandard)"
    result = verify(broken)
    assert result.exit_code == 1 and says in result.output, result.output
    from packer_cli.shards.reader import PackedReader

    with pytest.raises(DataError, match=re.escape(says)):
        PackedReader(str(broken))


@pytest.mark.parametrize("damage", ["negative metadata length", "fewer batches listed"])
def test_a_damaged_shard_footer_is_one_finding(broken, damage):
    """A flipped byte in a shard's footer, the manifest untouched: a negative Block length made
    the compression check crash with a SystemError traceback; a footer listing fewer batches
    than the shard holds served fewer packs from the dataset without a word."""
    shard = sorted(broken.glob("packs-*.arrow"))[0]
    with pa.ipc.open_file(shard) as reader:
        table = reader.read_all()
    with pa.ipc.new_file(shard, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(1, table.num_rows // 4))
    _fix_manifest(broken, shard)
    assert verify(broken).exit_code == 0
    data = bytearray(shard.read_bytes())
    start, blocks = _footer_of(data)
    offset, metadata_length, _ = blocks[0]
    at = start + bytes(data[start:]).find(offset.to_bytes(8, "little", signed=True)
                                          + metadata_length.to_bytes(4, "little", signed=True))
    if damage == "negative metadata length":
        data[at + 11] ^= 0xFF
        said = "the Arrow IPC footer or a record batch header is damaged"
    else:
        assert int.from_bytes(data[at - 4:at], "little") == len(blocks)
        data[at - 4:at] = (len(blocks) - 2).to_bytes(4, "little")
        said = "the manifest records"
    shard.write_bytes(data)
    result = verify(broken)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    result = runner.invoke(app, ["inspect", str(broken)])
    if damage == "negative metadata length":
        assert result.exit_code == 1 and said in result.output, result.output
    else:  # inspect summarizes the packs it reads; counts against the manifest are verify's (docs/AUDIT.md)
        assert result.exit_code == 0, result.output
    from packer_cli.shards.reader import PackedReader

    with pytest.raises(DataError, match=re.escape(said)):
        PackedReader(str(broken))


def test_limit_zero_lists_only_how_many_problems_each_check_found(broken):
    """`verify --limit 0` lists no problem of a check, only its "N more … not shown" line with
    all N of them, and still fails with exit 1 (no traceback for a check counted wholesale)."""
    shard = _every_cu_seqlens_starting_at_1(broken)
    result = runner.invoke(app, ["verify", str(broken), "--json", "--limit", "0"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.output)
    rows = len(pa.ipc.open_file(str(broken / shard)).read_all())
    assert doc["errors"]["pack.cu_seqlens"] == rows and doc["exit_code"] == 1
    assert all(f["omitted"] is not None for f in doc["findings"]), doc["findings"]
    assert {"check": "pack.cu_seqlens", "message": f"{rows} more pack.cu_seqlens problems not shown", "shard": None,
            "row": None, "pack": None, "seq": None, "severity": "error", "omitted": rows} in doc["findings"]


def test_warnings_left_out_by_the_limit_stay_warnings():
    """The "N more … not shown" line of a warning check is printed as a warning ("warning: ",
    severity "warning" in the JSON), and warnings, listed or not, are no errors (verify OK)."""
    from packer_cli.audit.findings import FindingSink

    sink = FindingSink(limit=1)
    for k in range(3):
        sink.warn("source.bytes", f"size {k} differs", shard="in.jsonl")
    first, more = sink.findings()
    assert first.line() == "warning: in.jsonl: size 0 differs [source.bytes]"
    assert more.line() == "warning: 2 more source.bytes problems not shown [source.bytes]"
    assert (more.severity, more.omitted) == ("warning", 2)
    assert sink.counts() == {} and sink.counts("warning") == {"source.bytes": 3}


def test_one_problem_left_out_is_singular_and_row_zero_is_named():
    """A finding at row 0, pack 0, sequence 0 names all three places, and one problem past the
    limit reads "1 more … problem not shown"."""
    from packer_cli.audit.findings import FindingSink

    sink = FindingSink(limit=1)
    sink.add("pack.capacity", "over", shard="packs-00000.arrow", row=0, pack=0, seq=0)
    sink.add("pack.capacity", "over", shard="packs-00000.arrow", row=1, pack=1, seq=0)
    assert [f.line() for f in sink.findings()] == [
        "packs-00000.arrow row 0 (pack 0) seq 0: over [pack.capacity]",
        "1 more pack.capacity problem not shown [pack.capacity]"]
    assert sink.count("pack.capacity") == 2


def test_the_limit_lists_exactly_that_many_problems_per_check():
    """`--limit N` lists exactly the first N problems of each check, found one by one or handed
    over at once, then one line with the number left out."""
    from packer_cli.audit.findings import FindingSink

    sink = FindingSink(limit=2)
    for k in range(5):
        sink.add("a", f"a{k}", row=k)
    sink.add_many("b", np.arange(5), lambda i: (f"b{i}", {"row": int(i)}))
    sink.add_many("c", np.arange(2), lambda i: (f"c{i}", {"row": int(i)}))  # exactly N: no "0 more" line
    assert [f.line() for f in sink.findings()] == [
        "row 0: a0 [a]", "row 1: a1 [a]", "row 0: b0 [b]", "row 1: b1 [b]", "row 0: c0 [c]", "row 1: c1 [c]",
        "3 more a problems not shown [a]", "3 more b problems not shown [b]"]
    assert sink.counts() == {"a": 5, "b": 5, "c": 2}


def test_no_progress_bar_is_written_when_stderr_is_not_a_terminal(monkeypatch):
    """With stderr a pipe or a file (a log, CI), no progress bar is written to it."""
    import io
    import sys

    from packer_cli.progress import Progress

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with Progress(enabled=True) as progress:
        task = progress.task("verify", 10, "packs")
        progress.advance(task, 10)
    assert err.getvalue() == ""


def test_findings_after_an_unsound_pack_name_their_own_row(broken):
    """A shard whose first pack has a column of the wrong length (left out of the sequence
    checks) and whose second has cu_seqlens starting at 4 (left out of the token scan): the
    findings of the packs after them must still name their own row and sequence, not the one
    at the same position among the packs or sequences that were checked."""
    shard = first_shard(broken)
    where = {}

    def damage(rows):
        rows[0]["source_offset"].pop()
        rows[1]["cu_seqlens"][0] = 4
        over = next(i for i in range(2, len(rows)) if len(rows[i]["seq_lens"]) > 1 and any(
            rows[i]["cu_seqlens"][k + 1] - rows[i]["cu_seqlens"][k] > s for k, s in enumerate(rows[i]["seq_lens"])))
        r = rows[over]
        cu, s = r["cu_seqlens"], r["seq_lens"]
        k = next(k for k in range(len(s)) if cu[k + 1] - cu[k] > s[k])
        r["loss_mask"][cu[k] + s[k]] = 1
        grow = (C - len(r["tokens"])) // 4 * 4 + 4  # padding of the last sequence, past C
        r["tokens"] += [0] * grow
        r["loss_mask"] += [0] * grow
        cu[-1] += grow
        down = next(i for i in range(over + 1, len(rows)) if len(rows[i]["seq_lens"]) > 1)
        rows[down]["cu_seqlens"][1] = rows[down]["cu_seqlens"][2] + 4
        where.update(over=over, seq=k, load=len(r["tokens"]), down=down, to=rows[down]["cu_seqlens"][2])

    rewrite(broken, shard, damage)
    result = verify(broken)
    assert result.exit_code == 1
    for line in (f"{shard} row 0 (pack 0): source_offset has ",
                 f"{shard} row 1 (pack 1): cu_seqlens starts at 4, not 0 [pack.cu_seqlens]",
                 f"{shard} row {where['over']} (pack {where['over']}): the pack holds {where['load']:,} runtime tokens "
                 f"(Σp), more than C = {C} [pack.capacity]",
                 f"{shard} row {where['over']} (pack {where['over']}) seq {where['seq']}: loss mask is non-zero on 1 of its ",
                 f"{shard} row {where['down']} (pack {where['down']}) seq 1: cu_seqlens decreases from "
                 f"{where['to'] + 4} to {where['to']} [pack.cu_seqlens]"):
        assert line in result.output, result.output


@pytest.mark.parametrize("case", ["start-below-0", "end-short"])
def test_cu_seqlens_not_spanning_exactly_the_packs_tokens_is_a_finding(broken, case):
    """cu_seqlens must start at 0 and end at the pack's runtime length: a start of -4 (aligned,
    only the first boundary moved) and an end 4 tokens short (those tokens in no sequence, the
    real length lowered with it so no length check fires) are each named."""
    shard = first_shard(broken)
    where = {}

    def below_0(rows):
        rows[0]["cu_seqlens"][0] = -4
        where.update(row=0, says="cu_seqlens starts at -4, not 0")

    def end_short(rows):
        i = next(i for i, r in enumerate(rows) if r["seq_lens"][-1] > 8)
        r = rows[i]
        r["cu_seqlens"][-1] -= 4
        r["seq_lens"][-1] -= 4
        where.update(row=i, says=f"cu_seqlens ends at {r['cu_seqlens'][-1]} but the pack has {len(r['tokens'])} "
                                 f"runtime tokens")

    assert_finds(broken, shard, below_0 if case == "start-below-0" else end_short, lambda: (
        f"{shard} row {where['row']} (pack {where['row']}): {where['says']} [pack.cu_seqlens]"))


@pytest.mark.parametrize("damage", ["malformed-pack", "shard-cut-short"])
def test_packs_not_read_soundly_are_named_once_not_again_as_the_metadatas_fault(broken, synth, damage):
    """Every figure the whole output determines (counts, quality, Bridge's keys) differs from the
    recorded one once a pack is left out of the data, whether it failed the pack checks (its
    cu_seqlens running past its tokens) or its shard could not be read: the metadata is not
    compared then, one warning says why, and with --source a sample of such a pack is named as
    not in the packs read rather than missing from the output."""
    shard = first_shard(broken)
    lost = {}

    def past_the_tokens(rows):
        rows[3]["cu_seqlens"][-1] += 8
        lost.update(packs=1, indices=rows[3]["source_index"])

    if damage == "malformed-pack":
        rewrite(broken, shard, past_the_tokens)
        expected = {"pack.cu_seqlens", "pack.alignment"}
    else:
        rows = pa.ipc.open_file(str(broken / shard)).read_all()
        lost.update(packs=rows.num_rows, indices=[i for r in rows.column("source_index").to_pylist() for i in r])
        with open(broken / shard, "r+b") as f:  # cut in half: the Arrow file's footer is gone
            f.truncate(f.seek(0, 2) // 2)
        expected = {"shard.size", "shard.checksum", "shard.unreadable"}
    packs = sum(e["rows"] for e in manifest(broken)["shards"])
    for args in ([], ["--source", synth[0]]):
        result = runner.invoke(app, ["verify", str(broken), *map(str, args), "--json", "--limit", "100000"])
        assert result.exit_code == 1, result.output
        findings = json.loads(result.stdout)["findings"]
        errors = {f["check"] for f in findings if f["severity"] == "error"}
        assert errors == expected | ({"source.missing"} if args else set()), result.stdout
        warning = [f["message"] for f in findings if f["severity"] == "warning" and f["check"] == "metadata.counts"]
        assert warning == [f"{lost['packs']:,} of the {packs:,} packs could not be read soundly (the findings "
                           "above), so the recorded counts, quality and Bridge figures were not compared with "
                           "the data"], result.stdout
        if args:
            missing = sorted(int(re.search(r"source index (\d+)", f["message"])[1]) for f in findings
                             if f["check"] == "source.missing")
            assert missing == sorted(lost["indices"])
            could_not = f"{lost['packs']:,} pack{'s' if lost['packs'] > 1 else ''} could not be"
            assert all(f"is not in the packs read ({could_not}), and not listed as dropped" in f["message"]
                       for f in findings if f["check"] == "source.missing")


def test_a_split_samples_piece_in_a_malformed_pack_is_not_called_missing(synth, tmp_path):
    """With the pack holding a split sample's first piece left out (malformed), its later pieces
    start at cap, not 0: that is the left-out pack, not a missing piece, and is not named."""
    out = Path(shutil.copytree(synth[1][OverlongPolicy.SPLIT], tmp_path / "split"))
    shard = first_shard(out)
    rows = pa.ipc.open_file(str(out / shard)).read_all().to_pylist()
    later = {i for e in manifest(out)["shards"] for r in pa.ipc.open_file(str(out / e["name"])).read_all().to_pylist()
             for i, o in zip(r["source_index"], r["source_offset"]) if o > 0}
    row = next(k for k, r in enumerate(rows) if any(i in later and o == 0
                                                     for i, o in zip(r["source_index"], r["source_offset"])))
    rewrite(out, shard, lambda rows: rows[row]["cu_seqlens"].__setitem__(-1, rows[row]["cu_seqlens"][-1] + 8))
    result = verify(out)
    assert result.exit_code == 1
    assert "[pack.cu_seqlens]" in result.output and "[output.pieces]" not in result.output, result.output


def test_a_split_output_whose_pack_size_is_no_multiple_of_m_passes(synth, tmp_path):
    """At C = 258 and m = 4 a sequence is at most ⌊C/m⌋·m = 256 long, and a split sample's pieces
    sit at offsets 0, 256, 512, …: verify checks them against 256, not against C."""
    src = synth[0]
    out = pack_to([src], tmp_path / "c258", PackSpec(pack_size=258, pad_seq_to_mult=4, overlong=OverlongPolicy.SPLIT))
    offsets = {o for e in manifest(out)["shards"]
               for o in pa.ipc.open_file(str(out / e["name"])).read_all().column("source_offset").combine_chunks()
               .flatten().to_pylist()}
    assert 256 in offsets and 258 not in offsets
    for args in ([out], [out, "--source", src]):
        result = verify(*args)
        assert result.exit_code == 0, result.output


def test_extra_directory_is_named_a_directory(broken):
    """An unlisted directory is reported as one (the check looks inside the output, not the
    current directory)."""
    (broken / "notes").mkdir()
    result = verify(broken)
    assert result.exit_code == 1
    assert "notes: unexpected directory, not listed in manifest.json [structure.files]" in result.output, result.output


@pytest.mark.parametrize("key", ["bridge.pack_size", "static.cu_seqlens_len", "bridge.max_samples_per_bin"])
def test_a_recorded_integer_figure_written_as_a_float_is_a_finding(broken, key):
    """A trainer sizes its buffers by these: 256.0 where the packs give 256 (same value, another
    type), its checksum resealed, is a finding naming the key, not equal enough to pass."""
    group, name = key.split(".")
    old = json.loads((broken / "metadata.json").read_text())[group][name]
    assert type(old) is int
    _resealed(broken, lambda doc: doc[group].update({name: float(old)}))
    result = verify(broken)
    assert result.exit_code == 1
    assert f"metadata.json: {key} is {float(old)!r} but the data has {old!r} [metadata.{group}]" in result.output, \
        result.output


def test_the_verdict_counts_every_problem_of_a_check_and_the_report_its_packs_and_sequences(broken, synth):
    """A check with many problems is said with their number, not the number of checks; a good
    output's report carries the packs and sequences it read."""
    shard = _every_cu_seqlens_starting_at_1(broken)
    rows = len(pa.ipc.open_file(str(broken / shard)).read_all())
    bad = verify_output(str(broken))
    assert bad.exit_code == 1 and bad.errors["pack.cu_seqlens"] == rows > 1
    n = sum(bad.errors.values())
    assert bad.verdict().startswith(f"verify: FAILED: {n:,} problems in {len(bad.errors)} checks (")
    assert f"verify: FAILED: {n:,} problems in" in verify(broken).output
    good = synth[1][OverlongPolicy.TRUNCATE]
    table = pa.concat_tables(pa.ipc.open_file(str(good / e["name"])).read_all() for e in manifest(good)["shards"])
    report = verify_output(str(good))
    assert report.ok and report.packs == table.num_rows > 1
    assert report.sequences == len(table.column("seq_lens").combine_chunks().flatten())
    assert report.tokens == len(table.column("tokens").combine_chunks().flatten())
    assert report.bytes == sum((good / e["name"]).stat().st_size for e in manifest(good)["shards"])
    one = VerifyReport(out="o", errors={"pack.lengths": 1})
    assert one.verdict().startswith("verify: FAILED: 1 problem in 1 check (pack.lengths); ")


def test_a_shard_that_cannot_be_read_is_not_also_said_to_hold_no_packs(broken):
    """Rows and tokens of a shard read only in part (or not at all) are not compared with its
    manifest entry: "0 packs, but manifest.json records N" is no second problem."""
    shard = sorted(broken.glob("packs-*.arrow"))[0]
    with pa.ipc.open_file(shard) as reader:
        table = reader.read_all()
    table = table.drop_columns(["source_offset"]).replace_schema_metadata(table.schema.metadata)
    with pa.ipc.new_file(shard, table.schema) as writer:
        writer.write_table(table)
    result = verify(broken)
    assert result.exit_code == 1 and f"{shard.name}: schema differs" in result.output, result.output
    assert "[shard.rows]" not in result.output and "[shard.tokens]" not in result.output, result.output


def test_the_rate_is_tokens_over_seconds_for_a_run_under_a_second(synth):
    """A verify of well under a second still says its rate: tokens / seconds, not 0."""
    assert VerifyReport(out="o", tokens=1_000, seconds=0.5).tokens_per_s == 2_000.0
    assert "(2k tokens/s)" in VerifyReport(out="o", tokens=1_000, seconds=0.5).verdict()
    assert VerifyReport(out="o", tokens=1_000, seconds=0.0).tokens_per_s == 0.0


def test_inspect_names_the_row_of_a_bad_first_sequence_past_the_first_pack(broken):
    """The sequence at fault is the first of pack 2: inspect names row 2, not the pack before it."""
    shard = first_shard(broken)
    said = {}

    def real_past_padded(rows):
        r = rows[2]
        padded = r["cu_seqlens"][1] - r["cu_seqlens"][0]
        r["seq_lens"][0] = padded + 1
        said.update(text=f"a sequence has real length {padded + 1} and padded length {padded}")

    rewrite(broken, shard, real_past_padded)
    result = runner.invoke(app, ["inspect", str(broken)])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (f"error: {broken}: {shard} row 2: malformed pack ({said['text']}); run "
                                     f"`packer verify` for a full report"), result.output


def test_a_null_token_inside_a_pack_is_a_corrupted_record_batch(broken):
    """A shard whose schema is the pack schema but whose token values hold a null (Arrow does
    not enforce ``not null`` on a list's items) is unreadable, not read as whatever the null's
    slot holds."""
    shard = first_shard(broken)
    path = broken / shard
    with pa.ipc.open_file(str(path)) as reader:
        table = reader.read_all().combine_chunks()
    tokens = table.column("tokens").chunk(0)
    values = tokens.values.to_pylist()
    values[1] = None
    nulled = pa.ListArray.from_arrays(tokens.offsets, pa.array(values, pa.int32()),
                                      type=PACK_SCHEMA.field("tokens").type)
    table = table.set_column(0, PACK_SCHEMA.field("tokens"), nulled)
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    man = manifest(broken)
    entry = next(e for e in man["shards"] if e["name"] == shard)
    entry.update(bytes=path.stat().st_size, xxh3_64=xxhash.xxh3_64(path.read_bytes()).hexdigest())
    (broken / "manifest.json").write_text(json.dumps(man))
    result = verify(broken)
    assert result.exit_code == 1, result.output
    assert f"{shard} row 0: record batch 0 is corrupted (column tokens holds nulls) [shard.unreadable]" in result.output, \
        result.output


def test_the_rows_of_a_shard_whose_checksum_cannot_be_read_are_not_tried(broken, monkeypatch):
    """A shard that cannot be read to hash it is one finding; its packs are not read (nor counted)."""
    from packer_cli.audit import verify as verify_module

    first, checksum = first_shard(broken), verify_module.file_checksum
    rows = len(pa.ipc.open_file(str(broken / first)).read_all())
    whole = verify_output(str(broken)).packs

    def refuse(path):
        if path.endswith(first):
            raise PermissionError(13, "Permission denied")
        return checksum(path)

    monkeypatch.setattr(verify_module, "file_checksum", refuse)
    report = verify_output(str(broken))
    assert report.errors["shard.unreadable"] == 1 and report.packs == whole - rows > 0


def test_an_empty_source_list_compares_no_source(synth):
    """``sources=[]`` (no --source path given through the API) verifies the output alone."""
    report = verify_output(str(synth[1][OverlongPolicy.TRUNCATE]), sources=[])
    assert report.ok and report.source is None


def test_a_finding_in_a_later_record_batch_of_a_shard_names_its_pack(synth, tmp_path):
    """Packs are counted across a shard's record batches: a problem in the third batch names
    the pack by its index in the output, not by its row within its batch."""
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "BATCH_TOKENS", 4_000)
        pipeline.pack([str(synth[0])], str(out), PackSpec(pack_size=C, cp=CP), shard_bytes=1 << 30)
    shard = first_shard(out)
    path = out / shard
    with pa.ipc.open_file(str(path)) as reader:
        batches = [reader.get_batch(b) for b in range(reader.num_record_batches)]
    assert len(batches) > 2 and len(manifest(out)["shards"]) == 1
    target = batches[2]
    rows = target.to_pylist()
    rows[1]["cu_seqlens"][0] = 1
    batches[2] = pa.RecordBatch.from_pylist(rows, schema=target.schema)
    with pa.ipc.new_file(str(path), batches[0].schema) as writer:
        for b in batches:
            writer.write_batch(b)
    man = manifest(out)
    man["shards"][0].update(bytes=path.stat().st_size, xxh3_64=xxhash.xxh3_64(path.read_bytes()).hexdigest())
    (out / "manifest.json").write_text(json.dumps(man))
    row = batches[0].num_rows + batches[1].num_rows + 1
    result = verify(out)
    assert result.exit_code == 1
    assert f"{shard} row {row} (pack {row}): cu_seqlens starts at 1, not 0 [pack.cu_seqlens]" in result.output, \
        result.output


def test_inspect_of_a_compressed_shard_points_at_verify(broken):
    """inspect's error for a shard it cannot read names the output and points at `packer verify`,
    whatever the reason's own words (here "packer-thd shards are uncompressed")."""
    shard = sorted(broken.glob("packs-*.arrow"))[0]
    with pa.ipc.open_file(shard) as reader:
        table = reader.read_all()
    with pa.ipc.new_file(shard, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    man = manifest(broken)
    entry = next(e for e in man["shards"] if e["name"] == shard.name)
    entry.update(bytes=shard.stat().st_size, xxh3_64=xxhash.xxh3_64(shard.read_bytes()).hexdigest())
    (broken / "manifest.json").write_text(json.dumps(man))
    result = runner.invoke(app, ["inspect", str(broken)])
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"error: {broken}: {shard.name}: record batch 0 is compressed (Zstandard)"), line
    assert line.endswith("; run `packer verify` for a full report"), line

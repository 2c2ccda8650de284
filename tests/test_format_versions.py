"""Format version 2 stores the loss mask as a bitmap; outputs of version 1 still read the same.

Every pack read back through packer's reader, the audit's store and the torch dataset is
compared with what plain pyarrow reads from the raw shard files, and a version-1 copy of the
same output (the loss mask rewritten as one uint8 a token, as packer 0.1.0 wrote it) must
give identical rows, batches, inspect figures and a passing verify.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from packer_cli import pipeline
from packer_cli._arrow import bits_from_numpy, bits_to_numpy
from packer_cli.audit.store import open_store
from packer_cli.cli import app
from packer_cli.errors import DataError
from packer_cli.shards.format import FORMAT_VERSION, MANIFEST_FILE, METADATA_FILE, pack_schema, seal_metadata
from packer_cli.shards.reader import PackedReader, load_metadata
from packer_cli.spec import PackSpec

runner = CliRunner()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1), max_size=300), st.integers(0, 20), st.data())
def test_bits_round_trip_any_slice(values, shift, data):
    """Packing then unpacking any slice of any (sliced) boolean array gives the 0/1 values back."""
    mask = np.asarray(values, dtype=np.uint8)
    arr = bits_from_numpy(np.concatenate([np.ones(shift, np.uint8), mask])).slice(shift)
    assert arr.to_pylist() == [bool(v) for v in values]
    start = data.draw(st.integers(0, mask.size))
    stop = data.draw(st.integers(start, mask.size))
    got = bits_to_numpy(arr, start, stop)
    assert got.dtype == np.uint8 and got.tolist() == values[start:stop]
    assert bits_to_numpy(arr).tolist() == values


def _pack(src: Path, out: Path, spec: PackSpec) -> Path:
    """Small record batches and shards, so packs start mid-byte in several batches and shards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "BATCH_TOKENS", 20_000)
        pipeline.pack([str(src)], str(out), spec, shard_bytes=1)
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["m1", "m4"])
def packed(request, tmp_path_factory, synthetic_parquet):
    """A version-2 output (m = 1 or m = 4: packs start at any bit, or every fourth) and its
    version-1 copy."""
    cp = request.param
    root = tmp_path_factory.mktemp(f"versions-cp{cp}")
    v2 = _pack(synthetic_parquet, root / "v2", PackSpec(pack_size=2048, cp=cp))
    return synthetic_parquet, v2, downgrade_to_v1(v2, root / "v1")


def downgrade_to_v1(out: Path, dest: Path) -> Path:
    """A copy of ``out`` as format version 1 wrote it: uint8 loss mask, version 1 everywhere,
    manifest sizes and checksums and the metadata's own checksum made consistent again."""
    shutil.copytree(out, dest)
    manifest = json.loads((dest / MANIFEST_FILE).read_text())
    schema = pack_schema(1)
    for entry in manifest["shards"]:
        path = dest / entry["name"]
        table = pa.ipc.open_file(str(path)).read_all()
        mask = table.column("loss_mask").cast(pa.list_(pa.uint8()))
        table = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask", mask).cast(schema)
        with pa.ipc.new_file(str(path), schema) as writer:
            writer.write_table(table, max_chunksize=64)
        entry.update(bytes=path.stat().st_size, xxh3_64=xxhash.xxh3_64(path.read_bytes()).hexdigest())
    manifest["format_version"] = 1
    (dest / MANIFEST_FILE).write_text(json.dumps(manifest))
    meta = json.loads((dest / METADATA_FILE).read_text())
    meta.pop("checksum")
    meta["format_version"] = 1
    (dest / METADATA_FILE).write_text(json.dumps(seal_metadata(meta)))
    return dest


def raw_masks(out: Path) -> list[list[int]]:
    """Every pack's loss mask as plain pyarrow reads it from the shard files, in order."""
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    masks = []
    for entry in manifest["shards"]:
        table = pa.ipc.open_file(str(out / entry["name"])).read_all()
        masks += [[int(v) for v in row] for row in table.column("loss_mask").to_pylist()]
    return masks


def test_version_2_stores_one_bit_a_token(packed):
    _, v2, v1 = packed
    meta = json.loads((v2 / METADATA_FILE).read_text())
    manifest = json.loads((v2 / MANIFEST_FILE).read_text())
    assert meta["format_version"] == manifest["format_version"] == FORMAT_VERSION == 2
    for entry in manifest["shards"]:
        reader = pa.ipc.open_file(str(v2 / entry["name"]))
        assert reader.schema.field("loss_mask").type == pa.list_(pa.bool_())
        assert reader.schema.metadata[b"format_version"] == b"2"
    tokens = sum(e["tokens"] for e in manifest["shards"])
    saved = sum(e["bytes"] for e in json.loads((v1 / MANIFEST_FILE).read_text())["shards"]) - \
        sum(e["bytes"] for e in manifest["shards"])
    # 7/8 of a byte a token, less the per-batch alignment of the bitmap buffers.
    assert 0.85 * tokens < saved <= 0.875 * tokens + 64 * len(manifest["shards"]) * 100


def test_every_reader_gives_the_stored_bits(packed):
    """PackedReader, the audit store and the torch dataset agree with pyarrow on every mask bit."""
    _, v2, _ = packed
    expected = raw_masks(v2)
    reader = PackedReader(str(v2))
    assert len(reader) == len(expected)
    ones = 0
    for i, mask in enumerate(expected):
        row = reader.row(i)
        assert row.loss_mask.dtype == np.uint8 and row.loss_mask.tolist() == mask
        ones += sum(mask)
    assert 0 < ones < sum(len(m) for m in expected)  # both values present: the test can fail
    store, seen = open_store(str(v2)), []
    for name in store.shard_names():
        for batch in store.read_shard(name):
            values, offsets = batch.column("loss_mask")
            assert values.dtype == np.uint8
            seen += [values[offsets[k]:offsets[k + 1]].tolist() for k in range(batch.num_rows)]
    assert seen == expected


def test_version_1_outputs_read_verify_and_inspect_the_same(packed):
    src, v2, v1 = packed
    new, old = PackedReader(str(v2)), PackedReader(str(v1))
    assert len(new) == len(old)
    for i in range(len(new)):
        a, b = new.row(i), old.row(i)
        for name in ("tokens", "loss_mask", "cu_seqlens", "seq_lens", "last_token", "source_index", "source_offset"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (i, name)
    for out in (v1, v2):
        result = runner.invoke(app, ["verify", str(out), "--source", str(src)])
        assert result.exit_code == 0, result.output
    reports = [json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).output) for out in (v1, v2)]
    for report in reports:
        report.pop("seconds", None), report.pop("tokens_per_s", None), report.pop("bytes", None)
        report.pop("out", None)
    assert reports[0] == reports[1]


def test_version_1_batches_match_in_the_torch_dataset(packed):
    pytest.importorskip("torch")
    from packer_cli.torch import PackedDataset

    _, v2, v1 = packed
    new, old = PackedDataset(str(v2)), PackedDataset(str(v1))
    cp = json.loads((v2 / METADATA_FILE).read_text())["spec"]["cp"]
    cases = [([0], cp, cp - 1), ([len(new) - 1], cp, 0)] if cp > 1 else [([1, 2, 3], 1, 0), (list(range(len(new))), 1, 0)]
    for indices, cp_size, cp_rank in cases:
        a, b = new.micro_batch(indices, cp_size, cp_rank), old.micro_batch(indices, cp_size, cp_rank)
        assert a.loss_mask.sum() > 0
        for name in ("tokens", "labels", "loss_mask", "position_ids"):
            assert getattr(a, name).equal(getattr(b, name)), name


@pytest.mark.parametrize("value", [2, 128, 255])
@pytest.mark.parametrize("packed, where", [(1, "first-target"), (2, "first-target"), (1, "mid-sequence"),
                                           (2, "mid-sequence"), (2, "padding")],
                         ids=["m1-first-target", "m4-first-target", "m1-mid-sequence", "m4-mid-sequence", "m4-padding"],
                         indirect=["packed"])
def test_a_version_1_mask_value_other_than_0_or_1_is_found_wherever_it_is(packed, tmp_path, value, where):
    """A uint8 mask value other than 0/1 is a finding at its pack whatever its bits (one above the
    lowest, or the sign bit of an int8) and wherever it sits: at the shard's first target, at a
    real position that is not its sequence's last (the mask is OR-ed over every real position),
    or in the alignment padding (loss on padding, not only where the value is 1; only m = 4 has
    alignment padding)."""
    _, _, v1 = packed
    out, manifest, table = _copy_with_first_shard(v1, tmp_path / "v1")
    entry = manifest["shards"][0]
    rows = table.to_pylist()
    r = rows[0]
    cu, s = r["cu_seqlens"], r["seq_lens"]
    if where == "padding":
        k = next(k for k in range(len(s)) if cu[k + 1] - cu[k] > s[k])
        r["loss_mask"][cu[k] + s[k]], check = value, "[pack.padding]"
    elif where == "first-target":
        at = r["loss_mask"].index(1)
        k = next(k for k in range(len(s)) if cu[k] <= at < cu[k] + s[k])
        r["loss_mask"][at], check = value, "[pack.loss_mask]"
    else:
        k = next(k for k in range(len(s)) if s[k] > 2)
        r["loss_mask"][cu[k] + s[k] // 2], check = value, "[pack.loss_mask]"
    _rewrite_shard(out, manifest, pa.Table.from_pylist(rows, schema=pack_schema(1)))
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 1
    line = next((x for x in result.output.splitlines() if check in x), None)
    assert line is not None and f"{entry['name']} row 0 (pack 0) seq {k}:" in line, result.output


def _copy_with_first_shard(src: Path, dst: Path) -> tuple[Path, dict, pa.Table]:
    """A copy of the output ``src`` at ``dst``, its manifest, and its first shard's table."""
    out = Path(shutil.copytree(src, dst))
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    return out, manifest, pa.ipc.open_file(str(out / manifest["shards"][0]["name"])).read_all()


def _rewrite_shard(out: Path, manifest: dict, table: pa.Table) -> None:
    """The first shard rewritten as ``table``, its manifest entry made to hold again."""
    entry = manifest["shards"][0]
    path = out / entry["name"]
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    entry.update(bytes=path.stat().st_size, xxh3_64=xxhash.xxh3_64(path.read_bytes()).hexdigest())
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))


def _edit_json(path: Path, **changes) -> None:
    record = json.loads(path.read_text())
    record.update(changes)
    if path.name == METADATA_FILE:
        record.pop("checksum")
        record = seal_metadata(record)
    path.write_text(json.dumps(record))


def test_versions_must_be_known_and_agree(packed, tmp_path):
    _, v2, _ = packed
    mixed = Path(shutil.copytree(v2, tmp_path / "mixed"))
    _edit_json(mixed / MANIFEST_FILE, format_version=1)
    result = runner.invoke(app, ["verify", str(mixed)])
    assert result.exit_code == 1
    assert "format_version is 1, but metadata.json records 2 [structure.manifest]" in result.output, result.output

    v1_schema = Path(shutil.copytree(v2, tmp_path / "v1-claimed"))  # v2 shards under v1 labels
    _edit_json(v1_schema / MANIFEST_FILE, format_version=1)
    _edit_json(v1_schema / METADATA_FILE, format_version=1)
    result = runner.invoke(app, ["verify", str(v1_schema)])
    assert result.exit_code == 1 and "version 1 pack schema" in result.output, result.output

    for bad in (3, True):
        future = Path(shutil.copytree(v2, tmp_path / f"future-{bad}"))
        _edit_json(future / METADATA_FILE, format_version=bad)
        result = runner.invoke(app, ["verify", str(future)])
        assert result.exit_code == 1
        assert f"format 'packer-thd' version {json.dumps(bad)} is unknown; this packer knows 'packer-thd' version 1 or 2" \
            in result.output.replace("True", "true"), result.output
        assert "'megatron-bridge' version 1 [structure.format]" in result.output, result.output  # not "version ?"
        with pytest.raises(DataError, match="this packer reads versions 1, 2"):
            PackedReader(str(future))

    # another format's name (re-sealed): refused by the reader itself, not only by the layout checks
    other = Path(shutil.copytree(v2, tmp_path / "other-format"))
    _edit_json(other / METADATA_FILE, format="someone-elses-format")
    said = f"{other}: unsupported data format 'someone-elses-format'; expected 'packer-thd'"
    for read in (load_metadata, PackedReader, lambda out: PackedReader(out, check=False)):
        with pytest.raises(DataError) as raised:
            read(str(other))
        assert str(raised.value) == said


@pytest.mark.parametrize("keys, says", [
    ({"format": "not-packer", "format_version": "2"}, "schema format is 'not-packer', expected packer-thd"),
    ({"fnrmat": "packer-thd", "format_version": "2"}, "schema format is missing, expected packer-thd"),
    ({"format": "packer-thd", "format_version": "1"}, "schema format_version is '1', expected 2"),
])
def test_a_shards_schema_names_the_format_and_its_version(packed, tmp_path, keys, says):
    """FORMAT.md: every shard's schema carries both keys; the format's name went unchecked (a
    shard labelled another format, with the manifest's checksum made to hold, passed)."""
    _, v2, _ = packed
    out, manifest, table = _copy_with_first_shard(v2, tmp_path / "relabelled")
    entry = manifest["shards"][0]
    _rewrite_shard(out, manifest, table.replace_schema_metadata(keys))
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 1 and f"{entry['name']}: {says}" in result.output, result.output


def test_a_version_1_mask_value_2_alone_in_its_sequence_is_a_finding(packed, tmp_path):
    """The mask check ORs a sequence's values: a 2 beside 1s gives 3, but a 2 in a sequence
    whose other positions are 0 gives 2, which must be caught as well (any value above 1)."""
    _, _, v1 = packed
    out, manifest, table = _copy_with_first_shard(v1, tmp_path / "v1")
    entry = manifest["shards"][0]
    rows = table.to_pylist()
    r = rows[0]
    start, real = r["cu_seqlens"][0], r["seq_lens"][0]
    r["loss_mask"][start:start + real] = [2] + [0] * (real - 1)
    _rewrite_shard(out, manifest, pa.Table.from_pylist(rows, schema=pack_schema(1)))
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 1
    line = next((x for x in result.output.splitlines() if "[pack.loss_mask]" in x), None)
    assert line is not None and f"{entry['name']} row 0 (pack 0) seq 0" in line, result.output


def test_the_metadata_checksum_is_xxh3_64_of_its_canonical_json(packed):
    """FORMAT.md: checksum.xxh3_64 is the xxh3_64 of metadata.json's canonical JSON (sorted keys,
    compact) without "checksum": every field sealed, computed here without packer's own helper,
    as another tool would check it."""
    _, v2, _ = packed
    meta = json.loads((v2 / METADATA_FILE).read_text())
    body = {k: v for k, v in meta.items() if k != "checksum"}
    assert {"spec", "counts", "format_version"} <= body.keys()
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert meta["checksum"] == {"xxh3_64": xxhash.xxh3_64_hexdigest(canonical)}

"""`--format megatron-bridge`: Bridge's reader contract checked from the Parquet file alone,
a lossless round trip with the native format of the same plan, the metadata array and split
handling, and assignment identity with a transcription of Bridge's packing."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import read_samples
from packer_cli import ConfigError, OutputError, PackSpec, pack
from packer_cli.cli import app
from packer_cli.demo import DEMO_EOS, demo_table
from packer_cli.shards.bridge import PARQUET_ENCODING_NAMES, default_row_group_size
from packer_cli.shards.bridge_output import BridgeOutput
from packer_cli.shards.bridge_writer import writes_integer_byte_streams
from packer_cli.shards.reader import PackedReader, load_metadata
from packer_cli.spec import Algorithm, OverlongPolicy

BRIDGE_KEYS = {"dataset_max_seqlen", "max_samples_per_bin", "packing_factor", "packing_efficiency",
               "pack_size", "min_packed_seqlen"}
BRIDGE_DEFAULT_SEED = 1234


# -- helpers --------------------------------------------------------------------------------
def write_samples(path: Path, n: int, seed: int, max_len: int = 900, last=None) -> Path:
    """Synthetic chat samples ending with DEMO_EOS; ``last`` overrides some final tokens."""
    table = demo_table(n, seed=seed, max_len=max_len)
    if last:
        tokens = [list(t) for t in table.column("input_ids").to_pylist()]
        for i, tok in last.items():
            tokens[i][-len(tok):] = tok
        table = table.set_column(0, "input_ids", pa.array(tokens, type=pa.list_(pa.int32())))
    pq.write_table(table, path)
    return path


def bridge_pack(inputs, out, spec, *, warn=None, overwrite=False, **options):
    return pack([str(p) for p in inputs], str(out), spec, overwrite=overwrite, warn=warn,
                output=BridgeOutput(**options))


def bridge_rows(path):
    """(input_ids, loss_mask, seq_start_id, source_index, source_offset) per row, plain pyarrow."""
    table = pq.read_table(path)
    cols = {}
    for name in table.column_names:
        arr = table.column(name).combine_chunks()
        cols[name] = (np.asarray(arr.values), np.asarray(arr.offsets))

    def get(name, i):
        values, offsets = cols[name]
        return values[offsets[i]:offsets[i + 1]]

    return [tuple(get(n, i) for n in ("input_ids", "loss_mask", "seq_start_id", "packer_source_index",
                                       "packer_source_offset")) for i in range(table.num_rows)]


def check_bridge_contract(path: Path, pack_size: int, m: int, tokens, masks, eos):
    """Everything Bridge's reader and collate rely on, from the Parquet file (and the sources)."""
    schema = pq.read_schema(path)
    # the types Bridge's reader documents (it reads any integer type: rows go through as_py())
    assert schema.field("input_ids").type == pa.list_(pa.int32())
    assert schema.field("loss_mask").type == pa.list_(pa.int8())
    assert schema.field("seq_start_id").type == pa.list_(pa.int32())
    assert schema.names[:3] == ["input_ids", "loss_mask", "seq_start_id"]
    seen, runtime_of, loads, counts = set(), [], [], []
    for ids, loss, starts, src, off in bridge_rows(path):
        # GPTSFTPackedParquetDataset.validate_row
        assert len(loss) == len(ids) and len(starts) > 0 and starts[0] == 0
        assert (starts < len(ids)).all() and (np.diff(starts) >= 0).all()
        ends = np.append(starts[1:], len(ids))
        runtime = ends - starts - 1
        assert (runtime % m == 0).all() and (runtime >= 1).all() and runtime.sum() <= pack_size
        runtime_of.extend(runtime.tolist())
        loads.append(int(runtime.sum()))
        counts.append(len(starts))
        for k, (s, e) in enumerate(zip(starts, ends)):
            # Bridge's collate for one sequence
            inputs, labels, lmask = ids[s:e - 1], ids[s + 1:e], loss[s:e - 1]
            tok, msk = tokens[src[k]], masks[src[k]]
            real = min(tok.size - 1 - off[k], e - s - 1)
            np.testing.assert_array_equal(inputs[:real], tok[off[k]:off[k] + real])
            np.testing.assert_array_equal(labels[:real], tok[off[k] + 1:off[k] + real + 1])
            np.testing.assert_array_equal(lmask[:real], msk[off[k] + 1:off[k] + real + 1])
            assert not lmask[real:].any() and loss[e - 1] == 0, "loss on padding"
            assert (labels[real:] == eos).all(), "alignment padding is not EOS"
            if m > 1 and eos is not None and inputs[real - 1] != eos and labels[real - 1] == eos:
                # Bridge's real-length scan (last input that is not EOS) recovers the real length
                assert np.flatnonzero(inputs != eos)[-1] + 1 == real
            assert (src[k], off[k]) not in seen
            seen.add((src[k], off[k]))
    return seen, np.asarray(runtime_of), np.asarray(loads), np.asarray(counts)


def recompute_metadata(runtime, loads, counts, pack_size):
    """Bridge's create_packing_strategy formulas, from the rows."""
    return {
        "dataset_max_seqlen": int(runtime.max()),
        "max_samples_per_bin": int(counts.max()),
        "packing_factor": round(len(runtime) / len(loads), 2),
        "packing_efficiency": round(sum(loads.tolist()) / len(loads) / pack_size * 100, 2),
        "pack_size": pack_size,
        "min_packed_seqlen": int(loads.min()),
    }


def assert_same_rows(a: PackedReader, b: PackedReader):
    assert len(a) == len(b)
    for i in range(len(a)):
        ra, rb = a.row(i), b.row(i)
        for name in ra.__dataclass_fields__:
            x, y = getattr(ra, name), getattr(rb, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), f"pack {i}: {name} differs"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_samples(tmp_path_factory.mktemp("bridge") / "small.parquet", 600, seed=3)


# -- Bridge's reader contract -----------------------------------------------------------------
@pytest.mark.parametrize("cp,overlong", [(1, "truncate"), (2, "truncate"), (4, "split")])
def test_contract_on_synthetic_data(small, tmp_path, cp, overlong):
    spec = PackSpec(pack_size=512, cp=cp, overlong=OverlongPolicy(overlong))
    summary = bridge_pack([small], tmp_path / "out", spec)
    tokens, masks = read_samples(small)
    seen, runtime, loads, counts = check_bridge_contract(
        tmp_path / "out" / "training_512.idx.parquet", 512, spec.pad_multiple, tokens, masks, DEMO_EOS)
    assert len(seen) == summary.counts["sequences"]
    assert {i for i, _ in seen} == set(range(len(tokens)))  # every sample (or its pieces) once
    array = json.loads((tmp_path / "out" / "512_metadata.jsonl").read_text())
    assert isinstance(array, list) and len(array) == 1 and set(array[0]) == BRIDGE_KEYS
    assert array[0] == recompute_metadata(runtime, loads, counts, 512) == summary.bridge
    assert summary.output["eos_id"] == DEMO_EOS and summary.output["eos_id_source"] == "inferred"


def test_contract_on_real_data(shared_files, tmp_path):
    spec = PackSpec(pack_size=4096, cp=2, tp=2, sp=True)  # m = 4
    for path in shared_files:
        out = tmp_path / path.stem
        summary = bridge_pack([path], out, spec)
        assert summary.output["eos_id"] == 100257 and summary.output["eos_id_source"] == "inferred"
        assert summary.output["eos_scan_too_short"] == 0
        tokens, masks = read_samples(path)
        seen, runtime, loads, counts = check_bridge_contract(
            out / "training_4096.idx.parquet", 4096, 4, tokens, masks, 100257)
        assert len(seen) == len(tokens)
        array = json.loads((out / "4096_metadata.jsonl").read_text())
        assert array == [recompute_metadata(runtime, loads, counts, 4096)]


def test_row_groups(small, tmp_path):
    spec = PackSpec(pack_size=512)
    bridge_pack([small], tmp_path / "a", spec, row_group_size=7)
    meta = pq.ParquetFile(tmp_path / "a" / "training_512.idx.parquet").metadata
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    assert all(s == 7 for s in sizes[:-1]) and 1 <= sizes[-1] <= 7
    bridge_pack([small], tmp_path / "b", spec)
    meta = pq.ParquetFile(tmp_path / "b" / "training_512.idx.parquet").metadata
    assert meta.row_group(0).num_rows == min(default_row_group_size(512), meta.num_rows)
    assert default_row_group_size(4096) == 28 and default_row_group_size(1 << 17) == 1


def test_row_groups_past_the_memory_bound_are_warned_about_before_the_run(small, tmp_path):
    """The writer builds whole row groups, a few at once: Bridge's own 500 packs a group at
    C = 131,072 peaked near 2 GB, past packer's bound. Such a size is warned about as the run
    starts (a dry run too); the default and smaller sizes are not."""
    said = []
    bridge_pack([small], tmp_path / "a", PackSpec(pack_size=1 << 17), warn=said.append, row_group_size=500)
    assert [line for line in said if "--row-group-size 500: row groups of 65,536,000 tokens" in line]
    for size, out in ((None, "b"), (127, "c")):  # 127 packs of 131,072: 16,646,144 tokens, below 16 Mi
        said.clear()
        bridge_pack([small], tmp_path / out, PackSpec(pack_size=1 << 17), warn=said.append, row_group_size=size)
        assert not [line for line in said if "row groups of" in line]


# -- round trip with the native format ----------------------------------------------------------
@pytest.mark.parametrize("cp,pad_id", [(1, 0), (2, 0), (2, DEMO_EOS)])
def test_native_and_bridge_rows_identical(small, tmp_path, cp, pad_id):
    spec = PackSpec(pack_size=512, cp=cp, pad_id=pad_id, seed=5)
    pack([str(small)], str(tmp_path / "native"), spec)
    bridge_pack([small], tmp_path / "bridge", spec)
    native, bridge = PackedReader(tmp_path / "native"), PackedReader(tmp_path / "bridge")
    assert type(bridge).__name__ == "BridgeReader" and isinstance(bridge, PackedReader)
    assert_same_rows(native, bridge)
    assert bridge.spec == native.spec and bridge.metadata["bridge"] == native.metadata["bridge"]
    assert load_metadata(str(tmp_path / "bridge"))["split"] == "training"
    assert bridge.manifest["shards"][0]["tokens"] == native.manifest["shards"][0]["tokens"]


@pytest.mark.parametrize("encoding", ["plain-snappy", "split-zstd"])
def test_every_parquet_encoding_holds_the_same_rows(small, tmp_path, encoding):
    """The encodings change bytes, never rows: each file reads back (pyarrow, packer's reader,
    Bridge's contract) row for row as the default's, and verify passes it."""
    from packer_cli.audit import verify_output

    if encoding == "split-zstd" and not writes_integer_byte_streams():
        pytest.skip(f"pyarrow {pa.__version__} cannot write integers as byte streams (needs 16)")
    spec = PackSpec(pack_size=512, cp=2, seed=3)
    bridge_pack([small], tmp_path / "default", spec, eos_id=DEMO_EOS)
    bridge_pack([small], tmp_path / encoding, spec, eos_id=DEMO_EOS, parquet_encoding=encoding)
    a, b = tmp_path / "default" / "training_512.idx.parquet", tmp_path / encoding / "training_512.idx.parquet"
    assert a.read_bytes() != b.read_bytes()
    for x, y in zip(bridge_rows(a), bridge_rows(b), strict=True):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)
    assert_same_rows(PackedReader(tmp_path / "default"), PackedReader(tmp_path / encoding))
    meta = json.loads((tmp_path / encoding / "training.metadata.json").read_text())
    assert meta["output"]["parquet_encoding"] == encoding
    assert json.loads((tmp_path / encoding / "training.manifest.json").read_text())["shards"][0][
        "parquet_encoding"] == encoding
    report = verify_output(str(tmp_path / encoding), sources=[str(small)])
    assert report.ok, report.findings


@pytest.mark.parametrize("encoding", PARQUET_ENCODING_NAMES)
def test_packers_encoder_writes_what_pyarrows_writer_would(small, tmp_path, monkeypatch, encoding):
    """The split's row groups are encoded by packer (``_parquet_encode``); with
    ``PACKER_PARQUET_ENCODER=arrow`` by pyarrow's writer. Same Arrow schema and metadata, same
    row groups, same rows; both verify against the source."""
    from packer_cli.audit import verify_output

    if encoding == "split-zstd" and not writes_integer_byte_streams():
        pytest.skip(f"pyarrow {pa.__version__} cannot write integers as byte streams (needs 16)")
    spec = PackSpec(pack_size=512, cp=2, seed=5)
    monkeypatch.delenv("PACKER_PARQUET_ENCODER", raising=False)
    bridge_pack([small], tmp_path / "ours", spec, eos_id=DEMO_EOS, row_group_size=3, parquet_encoding=encoding)
    monkeypatch.setenv("PACKER_PARQUET_ENCODER", "arrow")
    bridge_pack([small], tmp_path / "arrow", spec, eos_id=DEMO_EOS, row_group_size=3, parquet_encoding=encoding)
    a, b = (pq.ParquetFile(tmp_path / d / "training_512.idx.parquet") for d in ("ours", "arrow"))
    assert a.metadata.created_by.startswith("packer-cli") and b.metadata.created_by.startswith("parquet-cpp")
    assert a.schema_arrow == b.schema_arrow and a.schema_arrow.metadata == b.schema_arrow.metadata
    assert a.schema == b.schema
    assert a.metadata.num_row_groups == b.metadata.num_row_groups > 1
    for g in range(a.metadata.num_row_groups):
        assert a.read_row_group(g).equals(b.read_row_group(g))
    for d in ("ours", "arrow"):
        report = verify_output(str(tmp_path / d), sources=[str(small)])
        assert report.ok, report.findings


def test_int64_files_of_earlier_versions_still_read(small, tmp_path):
    """Packer 0.2.0 and earlier stored the ids and starts as int64 (Bridge's own writer's types):
    such a file reads and verifies the same."""
    import xxhash

    from packer_cli.audit import verify_output

    spec = PackSpec(pack_size=512, cp=2, seed=3)
    bridge_pack([small], tmp_path / "new", spec, eos_id=DEMO_EOS)
    bridge_pack([small], tmp_path / "old", spec, eos_id=DEMO_EOS)
    data = tmp_path / "old" / "training_512.idx.parquet"
    table = pq.read_table(data)
    wide = table.schema.set(0, pa.field("input_ids", pa.list_(pa.int64()))).set(
        2, pa.field("seq_start_id", pa.list_(pa.int64())))
    pq.write_table(table.cast(wide), data, row_group_size=default_row_group_size(512), compression="zstd")
    manifest_path = tmp_path / "old" / "training.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    raw = data.read_bytes()
    manifest["shards"][0].update(bytes=len(raw), xxh3_64=xxhash.xxh3_64(raw).hexdigest())
    manifest_path.write_text(json.dumps(manifest))
    assert pq.read_schema(data).field("input_ids").type == pa.list_(pa.int64())
    assert_same_rows(PackedReader(tmp_path / "new"), PackedReader(tmp_path / "old"))
    report = verify_output(str(tmp_path / "old"), sources=[str(small)])
    assert report.ok, report.findings


def test_verify_names_the_damaged_row_group_inside_a_run(small, tmp_path):
    """verify reads runs of row groups at once; a damaged group is still named exactly, with its
    first row, and the packs before it are read (the run is read again group by group)."""
    from packer_cli.audit import verify_output

    out = tmp_path / "out"
    bridge_pack([small], out, PackSpec(pack_size=512), row_group_size=4)
    data = out / "training_512.idx.parquet"
    meta = pq.ParquetFile(data).metadata
    assert meta.num_row_groups > 6  # all in one run of the audit
    chunk = meta.row_group(5).column(0)
    raw = bytearray(data.read_bytes())
    start = chunk.data_page_offset + 40
    raw[start:start + 64] = bytes(64)  # zeros over the ids' compressed page
    data.write_bytes(bytes(raw))
    report = verify_output(str(out))
    unreadable = [f for f in report.findings if f.check == "shard.unreadable"]
    assert len(unreadable) == 1 and "row group 5 is unreadable" in unreadable[0].message
    assert unreadable[0].row == 20 and "\n" not in unreadable[0].message
    assert report.packs == 20


def test_packed_dataset_batches_identical(small, tmp_path):
    torch = pytest.importorskip("torch")
    dataset = pytest.importorskip("packer_cli.torch.dataset", reason="packer_cli.torch.PackedDataset not available")
    spec = PackSpec(pack_size=512, cp=2)
    pack([str(small)], str(tmp_path / "native"), spec)
    bridge_pack([small], tmp_path / "bridge", spec)
    a, b = dataset.PackedDataset(str(tmp_path / "native")), dataset.PackedDataset(str(tmp_path / "bridge"))
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        for name in x.__dataclass_fields__:
            u, v = getattr(x, name), getattr(y, name)
            assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, f"batch {i}: {name}"


def test_audit_store_matches_native(small, tmp_path):
    """The audit reads a Bridge split through BridgeStore exactly as it reads native shards."""
    from packer_cli.audit import inspect
    from packer_cli.audit.store import open_store
    from packer_cli.shards.bridge_store import BridgeStore

    spec = PackSpec(pack_size=512, cp=2)
    pack([str(small)], str(tmp_path / "native"), spec)
    bridge_pack([small], tmp_path / "bridge", spec, row_group_size=5)
    store = BridgeStore.open(str(tmp_path / "bridge"))
    rows = [batch.row(i) for name in store.shard_names() for batch in store.read_shard(name)
            for i in range(batch.num_rows)]
    native = PackedReader(tmp_path / "native")
    assert_same_rows(native, type("Rows", (), {"__len__": lambda _: len(rows), "row": lambda _, i: rows[i]})())
    assert isinstance(open_store(str(tmp_path / "bridge")), BridgeStore)  # found by its layout alone
    a = inspect.inspect_output(str(tmp_path / "native")).to_dict()
    b = inspect.inspect_output(str(tmp_path / "bridge")).to_dict()
    a.pop("out", None), b.pop("out", None)
    assert a == b
    # inspect reads a Bridge split without its ids; one pack's detail reads them (rows, tokens)
    for k in (0, len(rows) // 2, len(rows) - 1):
        a = inspect.inspect_output(str(tmp_path / "native"), pack=k).to_dict()
        b = inspect.inspect_output(str(tmp_path / "bridge"), pack=k).to_dict()
        a.pop("out", None), b.pop("out", None)
        assert a["pack"].pop("shard") == "packs-00000.arrow" and b["pack"].pop("shard") == "training_512.idx.parquet"
        assert a["pack"]["pack"] == k and a == b


@pytest.mark.parametrize("encoding", ["plain-zstd", "plain-snappy"])
def test_audit_decodes_bridge_runs_with_packers_decoder(small, tmp_path, monkeypatch, encoding):
    """inspect and verify read a Bridge split's runs of row groups with packer's own decoder
    (RowGroupRuns, each next run read ahead), never pyarrow's, and report exactly what they
    report with pyarrow decoding (PACKER_PARQUET_DECODER=arrow); the rows equal the native
    output's."""
    from packer_cli.audit import inspect_output, verify_output
    from packer_cli.shards import bridge_store
    from packer_cli.sources.parquet_lists import RowGroupRuns

    spec = PackSpec(pack_size=512, cp=2)
    pack([str(small)], str(tmp_path / "native"), spec)
    bridge_pack([small], tmp_path / "bridge", spec, row_group_size=5, parquet_encoding=encoding)
    monkeypatch.setattr(bridge_store, "BATCH_TOKENS", 512 * 12)  # runs of 3 groups: read ahead matters
    store = bridge_store.BridgeStore.open(str(tmp_path / "bridge"))
    counts = {"bulk": 0, "pyarrow": 0}
    bulk, pyarrow_read = RowGroupRuns._read_bulk, pq.ParquetFile.read_row_groups

    def spy_bulk(self, *args):
        counts["bulk"] += 1
        return bulk(self, *args)

    def spy_pyarrow(self, *args, **kwargs):
        counts["pyarrow"] += 1
        return pyarrow_read(self, *args, **kwargs)

    monkeypatch.setattr(RowGroupRuns, "_read_bulk", spy_bulk)
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy_pyarrow)
    rows = [batch.row(i) for name in store.shard_names() for batch in store.read_shard(name)
            for i in range(batch.num_rows)]
    assert counts["bulk"] >= 5 and counts["pyarrow"] == 0, counts
    native = PackedReader(tmp_path / "native")
    assert_same_rows(native, type("Rows", (), {"__len__": lambda _: len(rows), "row": lambda _, i: rows[i]})())
    ours = [verify_output(str(tmp_path / "bridge"), sources=[str(small)]).to_dict(),
            inspect_output(str(tmp_path / "bridge")).to_dict()]
    assert counts["pyarrow"] == 0 and ours[0]["ok"], ours[0]
    monkeypatch.setenv("PACKER_PARQUET_DECODER", "arrow")
    theirs = [verify_output(str(tmp_path / "bridge"), sources=[str(small)]).to_dict(),
              inspect_output(str(tmp_path / "bridge")).to_dict()]
    assert counts["pyarrow"] > 0
    for a, b in zip(ours, theirs):
        for report in (a, b):
            report.pop("seconds", None), report.pop("elapsed_s", None), report.pop("tokens_per_s", None)
        assert a == b


# -- splits, the metadata array, atomic writes -------------------------------------------------
def test_second_split_appends(small, tmp_path):
    val = write_samples(tmp_path / "val.parquet", 150, seed=11)
    out, spec = tmp_path / "out", PackSpec(pack_size=512, cp=2)
    train = bridge_pack([small], out, spec)
    before = (out / "training_512.idx.parquet").read_bytes()
    valid = bridge_pack([val], out, spec, split="validation")
    assert (out / "training_512.idx.parquet").read_bytes() == before
    assert json.loads((out / "512_metadata.jsonl").read_text()) == [train.bridge, valid.bridge]
    pack([str(val)], str(tmp_path / "native_val"), spec)
    assert_same_rows(PackedReader(tmp_path / "native_val"), PackedReader(out, split="validation"))
    assert PackedReader(out).split == "training"
    assert sorted(os.listdir(tmp_path)) == ["native_val", "out", "val.parquet"]  # no temporary left

    with pytest.raises(ConfigError, match="already holds the training split"):
        bridge_pack([small], out, spec)
    with pytest.raises(ConfigError, match="pack size 512"):
        bridge_pack([val], out, PackSpec(pack_size=1024, cp=2), split="validation", overwrite=True)
    with pytest.raises(ConfigError, match="pad_seq_to_mult"):
        bridge_pack([val], out, PackSpec(pack_size=512, cp=4), split="validation", overwrite=True)
    # Bridge applies one pad_to_max_length and pad_cu_seqlens to both splits: a static and a
    # ragged split were both written, and a graph captured on one did not replay on the other
    for flags, says in (({"pad_to_max_length": True}, "without --pad-to-max-length, this run with it"),
                        ({"pad_to_max_length": True, "pad_cu_seqlens": True}, "without --pad-to-max-length")):
        with pytest.raises(ConfigError, match=f"holds the training split packed {says}.*one pad_to_max_length"):
            bridge_pack([val], out, PackSpec(pack_size=512, cp=2, **flags), split="validation", overwrite=True)
    again = bridge_pack([small], out, PackSpec(pack_size=512, cp=2, seed=9), overwrite=True)
    assert json.loads((out / "512_metadata.jsonl").read_text()) == [valid.bridge, again.bridge]


def test_adds_split_to_a_layout_bridge_wrote(small, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    foreign = {k: 1 for k in BRIDGE_KEYS}
    (out / "512_metadata.jsonl").write_text(json.dumps([foreign]))
    bridge_pack([small], out, PackSpec(pack_size=512), split="validation")
    array = json.loads((out / "512_metadata.jsonl").read_text())
    assert len(array) == 2 and array[0] == foreign
    assert PackedReader(out).split == "validation"


# A split Bridge wrote itself: its Parquet file and its entry, no packer metadata.
BRIDGE_WRITTEN_ENTRY = {"dataset_max_seqlen": 3, "max_samples_per_bin": 2, "packing_factor": 2.0,
                        "packing_efficiency": 31.25, "pack_size": 16, "min_packed_seqlen": 5}


def write_tiny(path: Path, *samples) -> Path:
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in samples))
    return path


def bridge_written_training(out: Path) -> None:
    out.mkdir()
    pq.write_table(pa.Table.from_pylist([{"input_ids": [5, 6, 7, 2, 8, 9, 2], "loss_mask": [0, 1, 0, 0, 1, 0, 0],
                                          "seq_start_id": [0, 4]}]), out / "training_16.idx.parquet")
    (out / "16_metadata.jsonl").write_text(json.dumps([BRIDGE_WRITTEN_ENTRY]))


def verify_cli(out: Path):
    result = CliRunner().invoke(app, ["verify", str(out)])
    assert result.exit_code == 0, result.output


def test_overwriting_a_split_bridge_wrote_drops_its_entry(tmp_path):
    """With no packer metadata its old values are unknown, but with every other split holding its
    own entry (here: none, then validation's), the entry left over is certainly the old one."""
    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2])
    v = write_tiny(tmp_path / "v.jsonl", [20, 21, 2])
    spec, notes = PackSpec(pack_size=16), []
    alone = tmp_path / "alone"
    bridge_written_training(alone)
    train = bridge_pack([t], alone, spec, overwrite=True, warn=notes.append)
    assert json.loads((alone / "16_metadata.jsonl").read_text()) == [train.bridge]
    assert not [n for n in notes if "could not tell" in n]
    verify_cli(alone)

    both = tmp_path / "both"
    bridge_written_training(both)
    valid = bridge_pack([v], both, spec, split="validation")
    train = bridge_pack([t], both, spec, overwrite=True)
    assert json.loads((both / "16_metadata.jsonl").read_text()) == [valid.bridge, train.bridge]
    verify_cli(both)


def test_overwrite_keeps_an_entry_it_cannot_place(tmp_path):
    """Two splits Bridge wrote, two entries: either may be the overwritten one's, so both stay."""
    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2])
    out, notes = tmp_path / "out", []
    bridge_written_training(out)
    shutil.copy(out / "training_16.idx.parquet", out / "validation_16.idx.parquet")
    other = dict(BRIDGE_WRITTEN_ENTRY, packing_efficiency=12.5)
    (out / "16_metadata.jsonl").write_text(json.dumps([BRIDGE_WRITTEN_ENTRY, other]))
    train = bridge_pack([t], out, PackSpec(pack_size=16), overwrite=True, warn=notes.append)
    assert json.loads((out / "16_metadata.jsonl").read_text()) == [BRIDGE_WRITTEN_ENTRY, other, train.bridge]
    [note] = [n for n in notes if "could not tell" in n]
    assert "entries 0, 1" in note and "the validation split may hold one" in note, note


def test_crash_recovery_keeps_the_other_splits_equal_entry(tmp_path):
    """After a crash between moving validation's files and updating the array, its recorded values
    equal training's, whose entry is the only one: re-running with --overwrite must keep it."""
    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2])
    v = write_tiny(tmp_path / "v.jsonl", [20, 21, 2])
    out, spec = tmp_path / "out", PackSpec(pack_size=16)
    train = bridge_pack([t], out, spec)
    bridge_pack([t], out, spec, split="validation")
    array = json.loads((out / "16_metadata.jsonl").read_text())
    assert array == [train.bridge, train.bridge]
    (out / "16_metadata.jsonl").write_text(json.dumps(array[:1]))  # the crash's state
    valid = bridge_pack([v], out, spec, split="validation", overwrite=True)
    assert json.loads((out / "16_metadata.jsonl").read_text()) == [train.bridge, valid.bridge]
    verify_cli(out)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_split_written_while_this_run_packed(tmp_path, monkeypatch, overwrite):
    """Two runs packing the same split into one layout at once: the one committing second took
    what prepare() had seen, so both exited 0 (one split silently replaced) and the array kept
    the loser's entry beside the winner's (verify: 3 entries for 2 splits)."""
    from packer_cli.shards.bridge_output import BridgeOutput

    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2])
    first = write_tiny(tmp_path / "v1.jsonl", [20, 21, 2])
    second = write_tiny(tmp_path / "v2.jsonl", [30, 31, 32, 33, 34, 2], [40, 41, 2], [50, 2, 51, 2])
    out, spec = tmp_path / "out", PackSpec(pack_size=16)
    train = bridge_pack([t], out, spec)
    commit = BridgeOutput.commit
    other = {}

    def the_other_run_commits_first(self, *args):
        if not other:  # this run packed; meanwhile another one wrote the same split
            other["summary"] = None
            other["summary"] = bridge_pack([second], out, spec, split="validation", overwrite=overwrite)
        return commit(self, *args)

    monkeypatch.setattr(BridgeOutput, "commit", the_other_run_commits_first)
    if not overwrite:
        with pytest.raises(ConfigError, match="already holds the validation split .*appeared while this run"):
            bridge_pack([first], out, spec, split="validation")
        winner = other["summary"]
    else:
        winner = bridge_pack([first], out, spec, split="validation", overwrite=True)
    assert winner.bridge != other["summary"].bridge or not overwrite
    assert json.loads((out / "16_metadata.jsonl").read_text()) == [train.bridge, winner.bridge]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    verify_cli(out)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_user_s_file_put_under_this_split_s_name_while_it_packed_is_kept(tmp_path, monkeypatch, overwrite):
    """Joining a layout with --overwrite renamed this split's files over whatever stood under
    their names as it committed, a user's own JSON put there meanwhile included (exit 0); and
    without --overwrite the refusal advised it, which then refused."""
    from packer_cli.shards.bridge_output import BridgeOutput

    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2])
    v = write_tiny(tmp_path / "v.jsonl", [20, 21, 2])
    out, spec = tmp_path / "out", PackSpec(pack_size=16)
    bridge_pack([v], out, spec, split="validation")
    commit = BridgeOutput.commit

    def a_user_writes_first(self, *args):
        (out / "training.metadata.json").write_text('{"mine": 1}')
        return commit(self, *args)

    monkeypatch.setattr(BridgeOutput, "commit", a_user_writes_first)
    refusal = ("holds files packer did not write (training.metadata.json, put there while this run was packing)"
               if overwrite else "it holds files packer did not write (training.metadata.json): choose another")
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        bridge_pack([t], out, spec, overwrite=overwrite)
    assert (out / "training.metadata.json").read_text() == '{"mine": 1}'
    assert not (out / "training_16.idx.parquet").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("content", ["[]", '"x"', '{"spec": 3}'])
def test_another_split_s_metadata_that_is_no_metadata_is_one_line(tmp_path, content):
    """A training.metadata.json holding a JSON list made a --split validation run end in an
    AttributeError traceback (exit 1)."""
    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2])
    out = tmp_path / "out"
    out.mkdir()
    (out / "training.metadata.json").write_text(content)
    result = CliRunner().invoke(app, ["pack", str(t), "-o", str(out), "-C", "16", "--format", "megatron-bridge",
                                      "--split", "validation"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.strip() == (f"error: {out / 'training.metadata.json'}: not the metadata packer writes for a "
                                     "split (a JSON object with a spec); it holds files packer did not write "
                                     "(training.metadata.json): choose another directory")


def test_an_unreadable_array_of_another_tool_is_not_said_to_want_overwrite(tmp_path):
    """A directory holding a JSON Lines file under the array's name: 'pass --overwrite to write
    it anew', and --overwrite then refused it as not packer's."""
    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2])
    out = tmp_path / "out"
    out.mkdir()
    (out / "16_metadata.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    for overwrite in ([], ["--overwrite"]):
        result = CliRunner().invoke(app, ["pack", str(t), "-o", str(out), "-C", "16", "--format", "megatron-bridge",
                                          *overwrite])
        assert result.exit_code == 2 and "holds files packer did not write (16_metadata.jsonl)" in result.output
        assert "pass --overwrite" not in result.output, result.output


def _validation_finishes_first(monkeypatch, v, out, spec, overwrite: bool) -> dict:
    """Make the next commit first pack ``v`` as the validation split into ``out`` (another run,
    finishing first); its summary lands in the returned dict."""
    from packer_cli.shards.bridge_output import BridgeOutput

    commit = BridgeOutput.commit
    done = {}

    def validation_finishes_first(self, *args):
        if not done:
            done["validation"] = None
            done["validation"] = bridge_pack([v], out, spec, split="validation", overwrite=overwrite)
        return commit(self, *args)

    monkeypatch.setattr(BridgeOutput, "commit", validation_finishes_first)
    return done


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("other_spec", ["same", "other pad_seq_to_mult"])
def test_two_splits_packed_side_by_side_into_a_new_layout(tmp_path, monkeypatch, overwrite, other_spec):
    """OUT absent when both runs started: the second to finish renamed its whole layout onto the
    first's (with --overwrite, deleting the other split: exit 0, verify OK on the one left) or was
    refused; and checks prepare() made were not made again, so splits of two pad_seq_to_mult values
    were both written."""
    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2])
    v = write_tiny(tmp_path / "v.jsonl", [20, 21, 2], [30, 31, 32, 33, 34, 2])
    out, spec = tmp_path / "out", PackSpec(pack_size=16)
    other = PackSpec(pack_size=16) if other_spec == "same" else PackSpec(pack_size=16, pad_seq_to_mult=4)
    done = _validation_finishes_first(monkeypatch, v, out, other, overwrite)
    if other_spec != "same":
        with pytest.raises(ConfigError, match="pad_seq_to_mult=4, this run uses 1.*changed while this run was packing"):
            bridge_pack([t], out, spec, overwrite=overwrite)
        assert sorted(os.listdir(out)) == ["16_metadata.jsonl", "validation.manifest.json",
                                           "validation.metadata.json", "validation_16.idx.parquet"]
    else:
        train = bridge_pack([t], out, spec, overwrite=overwrite)
        assert json.loads((out / "16_metadata.jsonl").read_text()) == [done["validation"].bridge, train.bridge]
        assert {"training_16.idx.parquet", "validation_16.idx.parquet"} <= set(os.listdir(out))
        verify_cli(out)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_two_splits_packed_side_by_side_over_a_native_output(tmp_path, monkeypatch):
    """Both runs found a native output at OUT and were to replace it (--overwrite): the second to
    finish replaced the layout the first had put there, its split lost, both runs exit 0."""
    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2])
    v = write_tiny(tmp_path / "v.jsonl", [20, 21, 2], [30, 31, 32, 33, 34, 2])
    out, spec = tmp_path / "out", PackSpec(pack_size=16)
    pack([str(t)], str(out), spec)  # the native output both runs replace
    done = _validation_finishes_first(monkeypatch, v, out, spec, overwrite=True)
    train = bridge_pack([t], out, spec, overwrite=True)
    assert json.loads((out / "16_metadata.jsonl").read_text()) == [done["validation"].bridge, train.bridge]
    assert {"training_16.idx.parquet", "validation_16.idx.parquet"} <= set(os.listdir(out))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    verify_cli(out)


def test_a_layout_committed_after_the_check_is_joined_not_replaced(tmp_path, monkeypatch):
    """The other split's run committed its layout in place of the native output after this run
    looked (and before it renamed OUT aside): renamed aside as packer's own files, it was
    deleted, that split lost, both runs exit 0."""
    from packer_cli.shards import bridge_output

    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2])
    v = write_tiny(tmp_path / "v.jsonl", [20, 21, 2], [30, 31, 32, 33, 34, 2])
    out, spec = tmp_path / "out", PackSpec(pack_size=16)
    pack([str(t)], str(out), spec)  # the native output both runs replace
    real_replace_dir = bridge_output.replace_dir
    done = {}

    def the_other_run_commits_first(*args, **kwargs):  # after this run's look at OUT, before its renames
        if not done:
            done["validation"] = None
            done["validation"] = bridge_pack([v], out, spec, split="validation", overwrite=True)
        return real_replace_dir(*args, **kwargs)

    monkeypatch.setattr(bridge_output, "replace_dir", the_other_run_commits_first)
    train = bridge_pack([t], out, spec, overwrite=True)
    assert json.loads((out / "16_metadata.jsonl").read_text()) == [done["validation"].bridge, train.bridge]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    verify_cli(out)


def test_a_split_to_join_replaces_a_native_output_that_took_the_layouts_place(tmp_path, monkeypatch):
    """With --overwrite, a native output that replaced the layout while this split waited for its
    lock is replaced, as it would have been had this run found it (exit 2: 'choose another
    directory')."""
    from packer_cli.shards import bridge_output

    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2])
    v = write_tiny(tmp_path / "v.jsonl", [20, 21, 2], [30, 31, 32, 33, 34, 2])
    out, spec = tmp_path / "out", PackSpec(pack_size=16)
    bridge_pack([t], out, spec)  # the layout this run's split is to join
    real_locked = bridge_output.locked
    replaced = []

    def a_native_run_replaces_it_first(path):
        if not replaced:
            replaced.append(pack([str(t)], str(out), spec, overwrite=True))
        return real_locked(path)

    monkeypatch.setattr(bridge_output, "locked", a_native_run_replaces_it_first)
    bridge_pack([v], out, spec, split="validation", overwrite=True)
    assert replaced and sorted(os.listdir(out)) == ["16_metadata.jsonl", "validation.manifest.json",
                                                    "validation.metadata.json", "validation_16.idx.parquet"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    verify_cli(out)


def test_a_split_whose_layout_was_removed_meanwhile_makes_a_new_one(tmp_path, monkeypatch):
    """The layout this split was to join removed while it packed: exit 3, 'No such file or
    directory', the split lost."""
    from packer_cli.shards import bridge_output

    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2])
    v = write_tiny(tmp_path / "v.jsonl", [20, 21, 2], [30, 31, 32, 33, 34, 2])
    out, spec = tmp_path / "out", PackSpec(pack_size=16)
    bridge_pack([t], out, spec)
    real_locked = bridge_output.locked

    def removed_first(path):
        shutil.rmtree(out, ignore_errors=True)
        return real_locked(path)

    monkeypatch.setattr(bridge_output, "locked", removed_first)
    val = bridge_pack([v], out, spec, split="validation")
    assert sorted(os.listdir(out)) == ["16_metadata.jsonl", "validation.manifest.json", "validation.metadata.json",
                                       "validation_16.idx.parquet"]
    assert json.loads((out / "16_metadata.jsonl").read_text()) == [val.bridge]
    verify_cli(out)


def test_a_joined_split_moves_its_manifest_in_first(tmp_path, monkeypatch):
    """Killed outright between the renames, a run that had moved the data file in first left a
    split without manifest or metadata, which verify passed as no split at all."""
    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2])
    out = tmp_path / "out"
    bridge_pack([t], out, PackSpec(pack_size=16))
    moved = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (moved.append(os.path.basename(dst)), real_replace(src, dst)))
    bridge_pack([t], out, PackSpec(pack_size=16), split="validation")
    assert moved == ["validation.manifest.json", "validation_16.idx.parquet", "validation.metadata.json",
                     "16_metadata.jsonl"]


@pytest.mark.parametrize("appeared", ["a file", "a dangling link"])
def test_an_out_that_appeared_as_a_file_is_refused_as_for_a_native_output(tmp_path, monkeypatch, appeared):
    # the Bridge commit took it for a layout to join: exit 3, '[Errno 20] Not a directory'
    from packer_cli.shards.bridge_output import BridgeOutput

    t = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2])
    out = tmp_path / "out"
    commit = BridgeOutput.commit

    def something_appears(self, *args):
        out.write_text("x") if appeared == "a file" else out.symlink_to(tmp_path / "nowhere")
        return commit(self, *args)

    monkeypatch.setattr(BridgeOutput, "commit", something_appears)
    with pytest.raises(ConfigError, match="appeared while this run was packing"):
        bridge_pack([t], out, PackSpec(pack_size=16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "t.jsonl"]


def test_refuses_foreign_directory(small, tmp_path):
    out = tmp_path / "out"
    pack([str(small)], str(out), PackSpec(pack_size=512))  # a native output
    with pytest.raises(ConfigError, match="not a Megatron-Bridge layout"):
        bridge_pack([small], out, PackSpec(pack_size=512))
    bridge_pack([small], out, PackSpec(pack_size=512), overwrite=True)
    assert sorted(os.listdir(out)) == ["512_metadata.jsonl", "training.manifest.json", "training.metadata.json",
                                       "training_512.idx.parquet"]


def test_overwrite_never_replaces_a_foreign_directory(small, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.parquet").write_bytes(small.read_bytes())
    with pytest.raises(ConfigError, match=r"holds files packer did not write \(train.parquet\)"):
        bridge_pack([small], out, PackSpec(pack_size=512), overwrite=True)
    assert sorted(os.listdir(out)) == ["train.parquet"]
    native = tmp_path / "native"
    pack([str(small)], str(native), PackSpec(pack_size=512))
    with pytest.raises(ConfigError, match="this input lies inside"):  # its own shard as the input
        bridge_pack([native / "packs-00000.arrow"], native, PackSpec(pack_size=512), overwrite=True)
    assert (native / "packs-00000.arrow").exists()


@pytest.mark.parametrize("other_split", [False, True])
@pytest.mark.parametrize("bridge_s_own", [False, True])
def test_a_damaged_metadata_array_is_written_anew_under_overwrite(small, tmp_path, other_split, bridge_s_own):
    """--overwrite of a split whose layout's 512_metadata.jsonl is not JSON failed 'cannot read'
    with exit 1, where a native --overwrite replaced the same directory; without --overwrite a
    run adding a split is refused with exit 2, not exit 1 (a data error is the input's). In a
    layout Bridge wrote itself (its data files and the array), the data files show it is one."""
    out, spec = tmp_path / "out", PackSpec(pack_size=512)
    bridge_pack([small], out, spec)
    if other_split:
        bridge_pack([small], out, spec, split="validation")
    if bridge_s_own:
        for packer_s in out.glob("*.json"):
            packer_s.unlink()
    array = out / "512_metadata.jsonl"
    array.write_text("garbage")
    warnings = []
    bridge_pack([small], out, spec, overwrite=True, warn=warnings.append)
    # (orjson's wording of the decode error differs between its versions)
    anew = re.compile(re.escape(f"{array}: cannot read (unexpected character") + r".*\(char 0\)\): written anew, "
                      "with the training split's entry")
    assert sum(bool(anew.fullmatch(w)) for w in warnings) == 1, warnings
    assert any("validation_512.idx.parquet has no entry in 512_metadata.jsonl (it cannot be read)" in w
               for w in warnings) == other_split
    assert len(json.loads(array.read_text())) == 1
    result = CliRunner().invoke(app, ["verify", str(out)])
    # the validation split packer wrote lost its entry (one Bridge wrote is not verified)
    assert (result.exit_code == 0) != (other_split and not bridge_s_own), result.output
    array.write_text("garbage")
    split = "training" if other_split else "validation"
    with pytest.raises(ConfigError, match=r"512_metadata.jsonl: cannot read \(.*\); pass --overwrite to write it anew"):
        bridge_pack([small], out, spec, split=split, overwrite=False)
    assert array.read_text() == "garbage"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_under_a_layout_file_s_name_is_refused_before_anything_is_renamed(small, tmp_path, overwrite):
    """With --overwrite, the split's files were renamed into OUT and the array's rename then
    failed (exit 3, a split without its entry); a native --overwrite deleted the directory."""
    out, spec = tmp_path / "out", PackSpec(pack_size=512)
    bridge_pack([small], out, spec)
    listing = {p: (out / p).read_bytes() for p in os.listdir(out) if p != "512_metadata.jsonl"}
    os.remove(out / "512_metadata.jsonl")
    (out / "512_metadata.jsonl").mkdir()
    (out / "512_metadata.jsonl" / "notes.txt").write_text("the user's")
    message = ("holds files packer did not write (512_metadata.jsonl)" if overwrite
               else "512_metadata.jsonl is a directory where this run writes a file")
    with pytest.raises(ConfigError, match=re.escape(message)):
        bridge_pack([small], out, spec, split="validation", overwrite=overwrite)
    if overwrite:
        with pytest.raises(ConfigError, match=re.escape(message)):
            pack([str(small)], str(out), spec, overwrite=True)
    assert {p: (out / p).read_bytes() for p in os.listdir(out) if p != "512_metadata.jsonl"} == listing
    assert (out / "512_metadata.jsonl" / "notes.txt").read_text() == "the user's"


def test_failed_write_leaves_out_untouched(small, tmp_path, monkeypatch):
    out, spec = tmp_path / "out", PackSpec(pack_size=512)
    bridge_pack([small], out, spec)
    listing = {p: (out / p).read_bytes() for p in os.listdir(out)}
    import packer_cli.shards.bridge_writer as writer

    def broken(path, **kwargs):
        Path(path).write_bytes(b"PAR1 half")
        raise OSError("disk full")

    monkeypatch.setattr(writer, "write_bridge_file", broken)
    with pytest.raises(OutputError, match="out: writing the output failed: disk full"):
        bridge_pack([small], out, spec, split="validation")
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == listing
    assert sorted(os.listdir(tmp_path)) == ["out"]


# -- the end-of-sequence id -----------------------------------------------------------------------
def test_eos_inference_and_errors(tmp_path):
    mixed = write_samples(tmp_path / "mixed.parquet", 200, seed=4, last={3: [7], 8: [9]})
    with pytest.raises(ConfigError, match="--eos-id"):
        bridge_pack([mixed], tmp_path / "a", PackSpec(pack_size=512, cp=2))
    assert not (tmp_path / "a").exists()
    summary = bridge_pack([mixed], tmp_path / "b", PackSpec(pack_size=512))  # m = 1: no padding
    assert summary.output["eos_id"] is None and summary.output["eos_id_source"] == "not needed"
    summary = bridge_pack([mixed], tmp_path / "c", PackSpec(pack_size=512, cp=2), eos_id=DEMO_EOS)
    assert summary.output["eos_id_source"] == "given" and summary.output["samples_not_ending_with_eos"] == 2
    tokens, masks = read_samples(mixed)
    check_bridge_contract(tmp_path / "c" / "training_512.idx.parquet", 512, 4, tokens, masks, DEMO_EOS)


def test_a_reused_bridge_output_reports_only_its_own_run(tmp_path):
    """A dry run without OUT reported the previous real run's EOS result (eos_id_source
    'inferred' for input it never looked at)."""
    data = write_samples(tmp_path / "s.parquet", 60, seed=2)
    output = BridgeOutput(split="training")
    pack([str(data)], str(tmp_path / "out"), PackSpec(pack_size=512), output=output)
    assert output.annotate(pack([str(data)], str(tmp_path / "o2"), PackSpec(pack_size=512), output=output))
    fresh = pack([str(data)], None, PackSpec(pack_size=512), dry_run=True, output=BridgeOutput(split="training"))
    reused = pack([str(data)], None, PackSpec(pack_size=512), dry_run=True, output=output)
    assert reused.output == fresh.output and fresh.output["eos_id_source"] == "not checked"


def test_trailing_eos_inputs_are_reported(tmp_path):
    doubled = write_samples(tmp_path / "eos2.parquet", 100, seed=6, last={5: [DEMO_EOS, DEMO_EOS]})
    warnings = []
    summary = bridge_pack([doubled], tmp_path / "out", PackSpec(pack_size=512, cp=2), warn=warnings.append)
    assert summary.output["eos_scan_too_short"] == 1
    assert any("real-length scan" in w for w in warnings)


@pytest.mark.parametrize("spec,warned", [
    (PackSpec(pack_size=516, cp=3), "pad_seq_length_to_mult 48"),  # m = 6
    (PackSpec(pack_size=516, tp=3, sp=True), "pad_seq_length_to_mult 48"),  # m = 3
    (PackSpec(pack_size=512, cp=16), None),  # m = 32: every row a multiple of 32 already
    (PackSpec(pack_size=516, cp=3, pad_to_max_length=True), None),  # every row is C wide
    (PackSpec(pack_size=512, cp=4, tp=2, sp=True), None),  # m = 8 divides 16
    (PackSpec(pack_size=516, pad_seq_to_mult=3), None),  # no CP, no SP: nothing is sliced
    (PackSpec(pack_size=528, cp=2, pad_seq_to_mult=24), None),  # 2·CP = 4 divides 16
    (PackSpec(pack_size=576, cp=3, pad_seq_to_mult=96), None),  # rows a multiple of 96: 16 adds nothing
    (PackSpec(pack_size=960, cp=3, pad_seq_to_mult=24), "pad_seq_length_to_mult 48"),  # what CP=3 needs
])
def test_an_alignment_bridge_rows_are_not_padded_to_is_warned_about(tmp_path, spec, warned):
    """Bridge's collate pads a row to a multiple of its pad_seq_length_to_mult (16 unless set)
    without pad_to_max_length: with m = 6 a row 4096 wide is no multiple of 2·CP and TE's CP
    partition fails at run time, with m = 3 the sequence-parallel scatter."""
    data = write_samples(tmp_path / "s.parquet", 60, seed=2)
    warnings = []
    bridge_pack([data], tmp_path / "out", spec, warn=warnings.append)
    said = [w for w in warnings if "pad_seq_length_to_mult" in w]
    if warned:
        assert len(said) == 1 and warned in said[0] and "--pad-to-max-length" in said[0]
    else:
        assert said == []


# -- assignment identity with Bridge ----------------------------------------------------------------
def bridge_prepad(tokens, masks, m, eos):
    """Bridge main's pre-pad (`_pre_pad_data_point`) of samples already within the cap."""
    items = []
    for tok, msk in zip(tokens, masks):
        runtime = tok.size - 1
        pad = -(-runtime // m) * m - runtime
        items.append({"input_ids": tok.tolist() + [eos] * pad, "loss_mask": msk.tolist() + [0] * pad})
    return items


def bridge_reference(items, pack_size, seed):
    """Transcription of Bridge's create_hist → first_fit_shuffle → fill_packing_strategy."""
    sequences = defaultdict(list)
    for item in items:
        sequences[len(item["input_ids"]) - 1].append(item)
    all_seq_lens = [n for n in range(pack_size + 1) for _ in sequences[n]]
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        shuffled = all_seq_lens[:]
        np.random.shuffle(shuffled)
        bins, sums = [], []
        for n in shuffled:  # first fit: leftmost bin with room
            k = next((k for k, s in enumerate(sums) if s + n <= pack_size), len(bins))
            if k == len(bins):
                bins.append([])
                sums.append(0)
            bins[k].append(n)
            sums[k] += n
        handles = {}
        for n in range(pack_size + 1):
            if sequences[n]:
                perm = np.random.permutation(len(sequences[n]))
                ids = np.array([x["input_ids"] for x in sequences[n]])[perm].tolist()
                loss = np.array([x["loss_mask"] for x in sequences[n]])[perm].tolist()
                handles[n] = (ids, [x[1:] + [0] for x in loss])
        rows = []
        for b in bins:
            ids, loss, starts = [], [], []
            for n in b:
                starts.append(len(ids))
                ids.extend(handles[n][0].pop())
                loss.extend(handles[n][1].pop())
            rows.append((ids, loss, starts))
    finally:
        np.random.set_state(state)
    return rows


def assert_rows_equal_reference(path, reference):
    rows = bridge_rows(path)
    assert len(rows) == len(reference)
    for (ids, loss, starts, _, _), (rids, rloss, rstarts) in zip(rows, reference):
        assert ids.tolist() == rids and loss.tolist() == rloss and starts.tolist() == rstarts


@pytest.mark.parametrize("cp", [1, 2])
def test_assignment_identical_to_bridge(small, tmp_path, cp):
    spec = PackSpec(pack_size=1024, cp=cp, algorithm=Algorithm.FIRST_FIT_SHUFFLE, seed=BRIDGE_DEFAULT_SEED,
                    shuffle=False)
    bridge_pack([small], tmp_path / "out", spec)
    tokens, masks = read_samples(small)
    reference = bridge_reference(bridge_prepad(tokens, masks, spec.pad_multiple, DEMO_EOS), 1024,
                                 BRIDGE_DEFAULT_SEED)
    assert_rows_equal_reference(tmp_path / "out" / "training_1024.idx.parquet", reference)


def test_assignment_identical_to_bridge_on_real_data(shared_files, tmp_path):
    path = min(shared_files, key=lambda p: p.stat().st_size)
    spec = PackSpec(pack_size=2048, cp=2, algorithm=Algorithm.FIRST_FIT_SHUFFLE, seed=BRIDGE_DEFAULT_SEED,
                    shuffle=False)
    bridge_pack([path], tmp_path / "out", spec)
    tokens, masks = read_samples(path)
    reference = bridge_reference(bridge_prepad(tokens, masks, 4, 100257), 2048, BRIDGE_DEFAULT_SEED)
    assert_rows_equal_reference(tmp_path / "out" / "training_2048.idx.parquet", reference)


def _load_bridge_packing():
    """Bridge's own packing module: installed, or a source file named by PACKER_BRIDGE_PACKING_UTILS."""
    reasons = []
    for name in ("megatron.bridge.data.packing.algorithms", "megatron.bridge.data.datasets.packing_utils"):
        try:
            return importlib.import_module(name)
        except Exception as exc:  # megatron-core / Transformer Engine missing, or no GPU
            reasons.append(f"{name}: {type(exc).__name__}: {str(exc)[:80]}")
    path = os.environ.get("PACKER_BRIDGE_PACKING_UTILS")
    if path:
        spec = importlib.util.spec_from_file_location("bridge_packing_utils", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    pytest.skip("megatron-bridge is not importable here (it needs megatron-core and Transformer Engine); "
                "the contract and transcription tests stand in for it. " + "; ".join(reasons))


def test_against_installed_megatron_bridge(small, tmp_path):
    bridge = _load_bridge_packing()
    spec = PackSpec(pack_size=1024, cp=2, algorithm=Algorithm.FIRST_FIT_SHUFFLE, seed=BRIDGE_DEFAULT_SEED,
                    shuffle=False)
    summary = bridge_pack([small], tmp_path / "out", spec)
    tokens, masks = read_samples(small)
    items = np.array(bridge_prepad(tokens, masks, 4, DEMO_EOS))
    state = np.random.get_state()
    np.random.seed(BRIDGE_DEFAULT_SEED)
    try:
        sequences, histogram = bridge.create_hist(items, 1024)
        assignments, metadata = bridge.create_packing_strategy(histogram, 1024, "first_fit_shuffle")
        rows = bridge.fill_packing_strategy(assignments, sequences, 1024, DEMO_EOS)
    finally:
        np.random.set_state(state)
    assert metadata == summary.bridge
    assert_rows_equal_reference(tmp_path / "out" / "training_1024.idx.parquet",
                                [(r["input_ids"], [int(x) for x in r["loss_mask"]], r["seq_start_id"]) for r in rows])


# -- CLI ------------------------------------------------------------------------------------------
def test_cli_options(small, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["pack", str(small), "-o", str(tmp_path / "out"), "--pack-size", "512", "--cp", "2",
                                 "--format", "megatron-bridge", "--split", "validation", "--eos-id", str(DEMO_EOS),
                                 "--row-group-size", "4"])
    assert result.exit_code == 0, result.output
    assert "validation_512.idx.parquet" in result.output and "--eos-id" in result.output
    assert (tmp_path / "out" / "validation_512.idx.parquet").exists()
    result = runner.invoke(app, ["pack", str(small), "-o", str(tmp_path / "n"), "--split", "validation"])
    assert result.exit_code == 2 and "--split applies only to --format megatron-bridge" in result.output
    result = runner.invoke(app, ["pack", str(small), "-o", str(tmp_path / "n"), "--parquet-encoding", "split-zstd",
                                 "--eos-id", "1"])
    assert result.exit_code == 2 and "--eos-id, --parquet-encoding apply only to" in result.output
    result = runner.invoke(app, ["pack", str(small), "-o", str(tmp_path / "s"), "--pack-size", "512",
                                 "--format", "megatron-bridge", "--parquet-encoding", "split-zstd"])
    if writes_integer_byte_streams():
        assert result.exit_code == 0, result.output
        column = pq.ParquetFile(tmp_path / "s" / "training_512.idx.parquet").metadata.row_group(0).column(0)
        assert "BYTE_STREAM_SPLIT" in column.encodings and column.compression == "ZSTD"
    else:  # refused before anything is read or written
        assert result.exit_code == 2 and result.output.strip().endswith("; use plain-zstd"), result.output
        assert not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match="parquet-encoding must be one of plain-zstd, plain-snappy, split-zstd"):
        BridgeOutput(parquet_encoding="gzip").validate()


def test_split_zstd_on_a_pyarrow_that_cannot_write_it_is_a_usage_error(small, tmp_path, monkeypatch):
    """Before pyarrow 16 the write failed at the first row group, reported as the output's error
    (exit 3: "writing the output failed: BYTE_STREAM_SPLIT only supports FLOAT and DOUBLE")."""
    monkeypatch.setattr(pa, "__version__", "15.0.2")
    result = CliRunner().invoke(app, ["pack", str(small), "-o", str(tmp_path / "s"), "--pack-size", "512",
                                      "--format", "megatron-bridge", "--parquet-encoding", "split-zstd"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "error: parquet-encoding split-zstd needs pyarrow >= 16 to write integers as byte streams "
        "(this is pyarrow 15.0.2); use plain-zstd")
    assert not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match="needs pyarrow >= 16"):
        BridgeOutput(parquet_encoding="split-zstd").validate()
    monkeypatch.setattr(pa, "__version__", "16.0.0")
    BridgeOutput(parquet_encoding="split-zstd").validate()


@pytest.mark.parametrize("args,step,sizes", [
    (["-C", "2046", "--tp", "4", "--sp"], 4, "2044 or 2048"),
    (["-C", "2048", "--tp", "3", "--sp"], 3, "2046 or 2049"),
    (["-C", "2048", "--cp", "2", "--tp", "3", "--sp"], 12, "2040 or 2052"),
    # the 2*CP rule named 2048, which this one then refused; and no size past the largest
    (["-C", "2050", "--cp", "2", "--tp", "3", "--sp"], 12, "2040 or 2052"),
    (["-C", "16777216", "--tp", "3", "--sp"], 3, "16777215"),
    (["-C", "4096", "--cp", "2", "--tp", "8388609", "--sp"], 33554436, None),  # no pack size is a multiple
])
def test_a_pack_size_the_sequence_parallel_split_cannot_divide_is_refused(tmp_path, args, step, sizes):
    """Bridge's collate pads a full row to the pack size: -C 2046 --tp 4 --sp packed without a
    word, and every full row reached TP's sequence split 2046 wide (and -C 2048 --tp 3 --sp got
    a warning whose pad_seq_length_to_mult advice could not help, the row being capped at C)."""
    runner = CliRunner()
    data = write_samples(tmp_path / "s.parquet", 40, seed=1)
    for dry in ([], ["--dry-run"]):
        result = runner.invoke(app, ["pack", str(data), "-o", str(tmp_path / "out"), "--format", "megatron-bridge",
                                     *args, *dry])
        assert result.exit_code == 2, result.output
        assert f"must be a multiple of {step}" in result.output and result.output.strip().endswith(
            f"use --pack-size {sizes}" if sizes else f"no pack size up to 16,777,216 is a multiple of {step:,}: "
            "use a smaller CP or TP"), result.output
        assert not (tmp_path / "out").exists()
    if sizes is None:
        return
    native = runner.invoke(app, ["pack", str(data), "-o", str(tmp_path / "native"), *args])
    # a native pack is Σp wide, a multiple of the alignment: only 2*CP must divide its pack size
    assert native.exit_code == (2 if "2050" in args else 0), native.output


def test_a_layout_of_two_pack_sizes_is_named_whole(tmp_path):
    """With training_2048 and training_4096 in one directory, -C 2048 was told to use 4096 and
    -C 4096 to use 2048."""
    data = write_samples(tmp_path / "s.parquet", 40, seed=1)
    for C in (2048, 4096):
        bridge_pack([data], tmp_path / f"o{C}", PackSpec(pack_size=C))
    (tmp_path / "both").mkdir()
    for C in (2048, 4096):
        shutil.copy(tmp_path / f"o{C}" / f"training_{C}.idx.parquet", tmp_path / "both")
    for C in (2048, 4096, 1024):
        with pytest.raises(ConfigError, match="holds Bridge files for the pack sizes 2048, 4096; .* pack into another "
                                              "directory"):
            bridge_pack([data], tmp_path / "both", PackSpec(pack_size=C), split="validation")



def test_a_metadata_array_of_another_pack_size_alone_is_named(tmp_path):
    """2048_metadata.jsonl names the layout's pack size as the data files do: -C 4096 into a
    directory holding only it is refused, not written beside it."""
    data = write_samples(tmp_path / "s.parquet", 40, seed=1)
    bridge_pack([data], tmp_path / "src", PackSpec(pack_size=2048))
    (tmp_path / "out").mkdir()
    shutil.copy(tmp_path / "src" / "2048_metadata.jsonl", tmp_path / "out")
    with pytest.raises(ConfigError, match="holds Bridge files for pack size 2048; .* --pack-size 2048"):
        bridge_pack([data], tmp_path / "out", PackSpec(pack_size=4096), split="validation")
    assert sorted(os.listdir(tmp_path / "out")) == ["2048_metadata.jsonl"]


def test_the_layout_helpers_tell_splits_and_names_apart(tmp_path):
    """Which split a file belongs to, which files say packer wrote a split, and which names are a layout's."""
    from packer_cli.shards.bridge import (data_only_split, is_bridge_dir, is_layout_name, lost_metadata,
                                          packer_splits_in, split_has_files)

    data_only = tmp_path / "data_only"
    data_only.mkdir()
    (data_only / "validation_2048.idx.parquet").touch()
    assert data_only_split(str(data_only), "training") is None
    assert data_only_split(str(data_only), "validation") == "validation_2048.idx.parquet"
    assert split_has_files(str(data_only), "validation") and not split_has_files(str(data_only), "training")
    assert packer_splits_in(data_only) == [] and not is_bridge_dir(data_only)

    lost = tmp_path / "lost"
    lost.mkdir()
    (lost / "training.manifest.json").touch()
    assert packer_splits_in(lost) == ["training"] and is_bridge_dir(lost)
    assert lost_metadata(str(lost), "training").startswith("missing, but training.manifest.json is here")
    (lost / "training.metadata.json").mkdir()
    assert lost_metadata(str(lost), "training").startswith("not a regular file, but training.manifest.json")
    assert lost_metadata(str(lost), "validation") is None

    for name in ("training_2048.idx.parquet", "2048_metadata.jsonl", "validation.manifest.json"):
        assert is_layout_name(name)
        assert not is_layout_name(name + ".bak") and not is_layout_name("old." + name)

@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_a_directory_of_other_files_is_not_said_to_want_overwrite(tmp_path, fmt):
    """"pass --overwrite to replace it", and --overwrite then refused it (files packer did not write)."""
    data = write_samples(tmp_path / "s.parquet", 40, seed=1)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    result = CliRunner().invoke(app, ["pack", str(data), "-o", str(tmp_path / "out"), "--format", fmt])
    assert result.exit_code == 2 and "holds files packer did not write (notes.txt): choose another directory" \
        in result.output and "--overwrite" not in result.output, result.output
    (tmp_path / "out" / "notes.txt").unlink()  # an empty directory: a native output still wants --overwrite
    assert CliRunner().invoke(app, ["pack", str(data), "-o", str(tmp_path / "out"), "--format", fmt,
                                    *(["--overwrite"] if fmt == "native" else [])]).exit_code == 0
    again = CliRunner().invoke(app, ["pack", str(data), "-o", str(tmp_path / "out"), "--format", fmt])
    assert again.exit_code == 2 and "--overwrite" in again.output, again.output  # an output of packer's: it may


def test_joining_a_split_whose_data_has_no_entry_says_so(tmp_path):
    """Bridge's own training file without 2048_metadata.jsonl: the validation run wrote an array
    of its own entry alone, without a word, and Bridge's static shapes then missed training's."""
    data = write_samples(tmp_path / "s.parquet", 40, seed=1)
    bridge_pack([data], tmp_path / "src", PackSpec(pack_size=2048))
    (tmp_path / "out").mkdir()
    shutil.copy(tmp_path / "src" / "training_2048.idx.parquet", tmp_path / "out")
    said = []
    bridge_pack([data], tmp_path / "out", PackSpec(pack_size=2048), warn=said.append, split="validation")
    assert any(line.startswith("training_2048.idx.parquet has no entry in 2048_metadata.jsonl (there is no such "
                               "file)") for line in said), said
    said.clear()
    bridge_pack([data], tmp_path / "src", PackSpec(pack_size=2048), warn=said.append, split="validation")
    assert not any("has no entry" in line for line in said), said  # training's entry is there


def test_verify_reports_a_bridge_layout_whose_pack_size_sequence_parallelism_cannot_split(tmp_path, monkeypatch):
    """Written before pack refused it (-C 2046 --tp 4 --sp): verify said OK."""
    from packer_cli import spec as spec_module
    from packer_cli.audit import verify_output

    data = write_samples(tmp_path / "s.parquet", 40, seed=1)
    monkeypatch.setattr(spec_module, "bridge_pack_size_problem", lambda spec: None)  # as pack was
    bridge_pack([data], tmp_path / "old", PackSpec(pack_size=2046, tp=4, sp=True))
    monkeypatch.undo()
    report = verify_output(tmp_path / "old")
    assert report.errors == {"metadata.spec": 1}, [f.line() for f in report.findings]
    assert "pack-size 2046 must be a multiple of 4" in report.findings[0].message
    native = pack([str(data)], str(tmp_path / "native"), PackSpec(pack_size=2046, tp=4, sp=True))
    assert native.counts["packs"] and verify_output(tmp_path / "native").ok  # a native pack is Σp wide


def test_overwrite_is_advised_only_where_it_would_be_let_in(tmp_path, monkeypatch):
    """A file OUT, or an OUT holding an input: "pass --overwrite", then --overwrite refused."""
    monkeypatch.chdir(tmp_path)
    data = write_samples(tmp_path / "s.parquet", 40, seed=1)
    (tmp_path / "f.txt").write_text("x")
    runner = CliRunner()
    result = runner.invoke(app, ["pack", str(data), "-o", "f.txt"])
    assert result.exit_code == 2 and result.output.strip() == "error: f.txt exists and is not a directory"
    assert runner.invoke(app, ["pack", str(data), "-o", "br", "-C", "512", "--format", "megatron-bridge"]).exit_code == 0
    result = runner.invoke(app, ["pack", "br/training_512.idx.parquet", "-o", "br"])
    assert result.exit_code == 2 and result.output.strip() == (
        "error: br already exists; the input br/training_512.idx.parquet lies inside it: write the output elsewhere")


def test_a_split_whose_input_lies_inside_the_layout_is_not_told_to_overwrite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = write_samples(tmp_path / "s.parquet", 40, seed=1)
    bridge_pack([data], tmp_path / "bl", PackSpec(pack_size=1024))
    result = CliRunner().invoke(app, ["pack", "bl/training_1024.idx.parquet", "-o", "bl", "-C", "1024", "--format",
                                      "megatron-bridge"])
    assert result.exit_code == 2 and result.output.strip().endswith(
        "the input bl/training_1024.idx.parquet lies inside it: write the output elsewhere"), result.output


def test_the_missing_entry_warning_of_a_split_packer_wrote_says_how_to_restore_it(tmp_path):
    data = write_samples(tmp_path / "s.parquet", 40, seed=1)
    bridge_pack([data], tmp_path / "out", PackSpec(pack_size=2048))
    (tmp_path / "out" / "2048_metadata.jsonl").unlink()
    said = []
    bridge_pack([data], tmp_path / "out", PackSpec(pack_size=2048), warn=said.append, split="validation")
    assert any(line.startswith("training_2048.idx.parquet has no entry in 2048_metadata.jsonl") and
               line.endswith("pack the training split again with --overwrite to put its entry back")
               for line in said), said


@pytest.mark.parametrize("swept_from", [1, 10**9])
def test_a_large_footer_read_for_the_file_checks_is_freed_at_once(small, tmp_path, monkeypatch, swept_from):
    """pyarrow holds a footer in a reference cycle, and the CLI runs with the collector off: the
    copy the file checks read stayed for the whole audit (255k row groups: 1.4 GB more)."""
    import gc

    from packer_cli import _cycles
    from packer_cli.audit import _bridge_checks
    from packer_cli.audit.findings import FindingSink
    from packer_cli.shards.bridge_store import BridgeStore

    bridge_pack([small], tmp_path / "out", PackSpec(pack_size=512), row_group_size=1)
    store = BridgeStore.open(str(tmp_path / "out"))
    monkeypatch.setattr(_bridge_checks, "SWEPT_FOOTER_GROUPS", swept_from)
    monkeypatch.setattr(_cycles, "_sweeping", True)  # as the CLI runs
    footers = lambda: sum(type(o) is pq.FileMetaData for o in gc.get_objects())  # noqa: E731
    gc.collect()
    gc.disable()
    try:
        before = footers()
        sink = FindingSink(20)
        _bridge_checks.check_file_facts(store, sink)
        left = footers() - before
    finally:
        gc.enable()
        gc.unfreeze()
    assert not sink.findings()
    assert left == (0 if swept_from == 1 else 1)


# -- survivors of a mutation review of bridge_output.py ---------------------------------------------
def test_a_user_s_parquet_with_some_of_bridge_s_columns_is_not_replaced_by_overwrite(tmp_path):
    """A user's own Parquet file under a split's data name, holding input_ids but not Bridge's
    other columns, is not a packer output: --overwrite refuses and leaves it as it was."""
    data = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 2])
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]], "text": ["my own data"]}), out / "training_64.idx.parquet")
    before = (out / "training_64.idx.parquet").read_bytes()
    with pytest.raises(ConfigError, match=r"holds files packer did not write \(training_64.idx.parquet\)"):
        bridge_pack([data], out, PackSpec(pack_size=64), overwrite=True)
    assert (out / "training_64.idx.parquet").read_bytes() == before


def test_a_large_jsonl_under_the_metadata_name_is_another_tool_s(tmp_path):
    """A metadata array too large to parse (over 16 MiB) is never taken for packer's own, even
    with packer's indented format key near its top: --overwrite must not replace it."""
    from packer_cli.shards.bridge import BRIDGE_FORMAT
    from packer_cli.shards.bridge_output import foreign_names

    big = tmp_path / "512_metadata.jsonl"
    big.write_text('{\n  "format": "%s",\n  "x": "%s"\n}\n' % (BRIDGE_FORMAT, "y" * (17 << 20)))
    assert foreign_names(str(tmp_path), ["512_metadata.jsonl"]) == ["512_metadata.jsonl"]


def test_a_dry_run_with_row_groups_past_a_stage_completes(tmp_path):
    """Row groups of more tokens than a staged read's stage (70,000 packs of 512) are a plan a
    dry run reports, not a 'slice step cannot be zero' traceback."""
    data = write_tiny(tmp_path / "t.jsonl", *[[k + 3, k + 4, 2] for k in range(30)])
    said = []
    summary = pack([str(data)], None, PackSpec(pack_size=512), dry_run=True, warn=said.append,
                   output=BridgeOutput(split="training", row_group_size=70_000))
    assert summary.counts["packs"] >= 1 and summary.output["row_group_size"] == 70_000


def test_a_row_group_size_of_zero_is_refused(tmp_path):
    """0 is no number of packs (it would silently mean the default): a usage error."""
    data = write_tiny(tmp_path / "t.jsonl", [5, 6, 2])
    with pytest.raises(ConfigError, match="row-group-size must be a number of packs from 1"):
        pack([str(data)], None, PackSpec(pack_size=64), dry_run=True, output=BridgeOutput(row_group_size=0))


def test_a_split_packed_with_another_pad_cu_seqlens_is_refused(tmp_path):
    """Bridge applies one pad_cu_seqlens to both splits: a validation split without it cannot
    join a training split packed with it (both --pad-to-max-length)."""
    data = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 2])
    out = tmp_path / "out"
    bridge_pack([data], out, PackSpec(pack_size=64, pad_to_max_length=True, pad_cu_seqlens=True))
    listing = sorted(os.listdir(out))
    with pytest.raises(ConfigError, match="packed with --pad-cu-seqlens, this run without it"):
        bridge_pack([data], out, PackSpec(pack_size=64, pad_to_max_length=True), split="validation")
    assert sorted(os.listdir(out)) == listing


def test_default_row_groups_stay_whole_across_write_steps(tmp_path, monkeypatch):
    """With the default row-group size, a split that takes several write steps is still row
    groups of default_row_group_size packs (all but the last), not one group per step."""
    from packer_cli.shards import bridge, bridge_writer

    # A default of 8 packs a group and steps of 3 groups (24 packs) in ~12 steps, as a large input
    # has at the real sizes (this input's ~280 packs would be one default group of 455 otherwise).
    monkeypatch.setattr(bridge, "ROW_GROUP_BYTES", 8 * bridge.STORED_TOKEN_BYTES * 256)
    monkeypatch.setattr(bridge_writer, "BATCH_TOKENS", 3 * 8 * 256)
    rows = default_row_group_size(256)
    assert rows == 8 and bridge_writer.packs_per_step(rows, 256) == 24
    data = write_tiny(tmp_path / "t.jsonl", *[[(k + i) % 900 + 3 for i in range(4 + k % 40)] + [2]
                                              for k in range(3000)])
    summary = bridge_pack([data], tmp_path / "out", PackSpec(pack_size=256))
    meta = pq.ParquetFile(tmp_path / "out" / "training_256.idx.parquet").metadata
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    assert sum(sizes) == summary.counts["packs"] > 10 * 24
    assert all(s == rows for s in sizes[:-1]) and 1 <= sizes[-1] <= rows, sizes


def test_samples_not_ending_with_a_given_eos_counts_the_first_too(tmp_path):
    """samples_not_ending_with_eos counts every sample whose last token is not the given EOS id,
    the first sample of the input included."""
    samples = [[k + 3, k + 4, k + 5, 2] for k in range(20)]
    samples[0][-1], samples[5][-1] = 7, 9
    data = write_tiny(tmp_path / "t.jsonl", *samples)
    summary = bridge_pack([data], tmp_path / "out", PackSpec(pack_size=64), eos_id=2)
    assert summary.output["samples_not_ending_with_eos"] == sum(s[-1] != 2 for s in samples)


def test_one_trailing_eos_input_is_worded_in_the_singular(tmp_path):
    """The warning for exactly one sequence with trailing EOS inputs reads '1 sequence ends its'."""
    doubled = write_samples(tmp_path / "eos2.parquet", 100, seed=6, last={5: [DEMO_EOS, DEMO_EOS]})
    warnings = []
    summary = bridge_pack([doubled], tmp_path / "out", PackSpec(pack_size=512, cp=2), warn=warnings.append)
    assert summary.output["eos_scan_too_short"] == 1
    assert [w for w in warnings if w.startswith(f"1 sequence ends its inputs with the EOS id {DEMO_EOS}:")]


def test_row_groups_of_exactly_16_mi_tokens_are_warned_about(tmp_path):
    """The memory warning starts at 16 Mi tokens a row group: 128 packs of 131,072 is warned about."""
    data = write_tiny(tmp_path / "t.jsonl", [5, 6, 2])
    said = []
    pack([str(data)], None, PackSpec(pack_size=1 << 17), dry_run=True, warn=said.append,
         output=BridgeOutput(row_group_size=128))
    assert [line for line in said if "--row-group-size 128: row groups of 16,777,216 tokens" in line], said


def test_a_file_appearing_at_out_just_before_the_final_rename_is_refused(tmp_path, monkeypatch):
    """A file put at OUT between the last check and the rename of a new layout is refused as
    for a native output (another run?), not 'writing the output failed: Not a directory'."""
    from packer_cli.shards import bridge_output

    data = write_tiny(tmp_path / "t.jsonl", [5, 6, 7, 8, 9, 10, 11, 2])
    out = tmp_path / "out"
    rename = os.rename

    def appears_first(src, dst, *args, **kwargs):
        if str(dst) == str(out) and not os.path.lexists(dst):
            out.write_text("a user's file\n")
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(bridge_output.os, "rename", appears_first)
    with pytest.raises(ConfigError, match="appeared while this run was packing"):
        bridge_pack([data], out, PackSpec(pack_size=16))
    assert out.read_text() == "a user's file\n"


def test_store_batches_past_the_second_start_at_the_rows_before_them(small, tmp_path, monkeypatch):
    """Each batch a Bridge split is read in starts at the pack after the previous batch's last
    (the third and later too), and batch_at finds each by that row, and no batch by a row
    inside one."""
    from packer_cli.audit.store import ShardError
    from packer_cli.shards import bridge_store

    bridge_pack([small], tmp_path / "bridge", PackSpec(pack_size=512, cp=2), row_group_size=5)
    monkeypatch.setattr(bridge_store, "BATCH_TOKENS", 512 * 12)  # batches of 3 row groups
    store = bridge_store.BridgeStore.open(str(tmp_path / "bridge"))
    name = store.shard_names()[0]
    batches = list(store.read_shard(name))
    assert len(batches) >= 4
    starts = [b.first_row for b in batches]
    assert starts == np.concatenate([[0], np.cumsum([b.num_rows for b in batches])[:-1]]).tolist()
    assert sum(b.num_rows for b in batches) == len(bridge_rows(tmp_path / "bridge" / "training_512.idx.parquet"))
    for k in (1, 2, len(batches) - 1):
        again = store.batch_at(name, starts[k])
        assert again.first_row == starts[k] and again.num_rows == batches[k].num_rows
        assert (again.row(0).tokens == batches[k].row(0).tokens).all()
    with pytest.raises(ShardError, match=f"no batch starts at row {starts[2] + 1}"):
        store.batch_at(name, starts[2] + 1)


@pytest.mark.parametrize("last,listed", [
    ([100] * 5 + [7] * 3 + [9], "100 (5 samples), 7 (3 samples), 9 (1 sample))"),
    ([100] * 5 + [7] * 3 + [9] + [11] * 2, "100 (5 samples), 7 (3 samples), 11 (2 samples), ...)"),
])
def test_the_missing_terminator_error_lists_the_commonest_last_tokens(last, listed):
    """Without --eos-id and with samples ending in different tokens, the error names the three
    most common last tokens, most common first, and '...' only when there are more than three."""
    from packer_cli.shards.bridge_writer import resolve_eos

    with pytest.raises(ConfigError) as caught:
        resolve_eos(None, np.array(last), True)
    assert f"different tokens ({listed}; pass --eos-id" in str(caught.value)


def test_a_given_group_size_stays_whole_across_many_write_steps(tmp_path, monkeypatch):
    """A split written in many steps (each a few row groups) is row groups of exactly
    --row-group-size packs but the last: no short group where one step ends."""
    from packer_cli.shards import bridge_writer

    monkeypatch.setattr(bridge_writer, "BATCH_TOKENS", 3000)  # steps of 2 groups of 4 packs of 256
    data = write_tiny(tmp_path / "t.jsonl", *[[(k + i) % 900 + 3 for i in range(4 + k % 40)] + [2]
                                              for k in range(3000)])
    summary = bridge_pack([data], tmp_path / "out", PackSpec(pack_size=256), row_group_size=4)
    meta = pq.ParquetFile(tmp_path / "out" / "training_256.idx.parquet").metadata
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    assert bridge_writer.packs_per_step(4, 256) < summary.counts["packs"] == sum(sizes)
    assert all(s == 4 for s in sizes[:-1]) and 1 <= sizes[-1] <= 4, sizes


@pytest.mark.parametrize("version,writes", [("15.0.2", False), ("16.0.0", True), ("17.0.0", True)])
def test_integer_byte_streams_are_written_from_pyarrow_16_on(monkeypatch, version, writes):
    """split-zstd needs BYTE_STREAM_SPLIT for integers, which pyarrow writes from 16.0 on."""
    from packer_cli.shards import bridge_writer

    monkeypatch.setattr(bridge_writer.pa, "__version__", version)
    assert bridge_writer.writes_integer_byte_streams() is writes

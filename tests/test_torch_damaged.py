"""Damaged outputs never load silently, and never fail with an exception that hides the file.

Every damage below is a :class:`DataError` (or subclass) whose message names the output or the
file (and the shard row where one is at fault). Layout damage (manifest entries, metadata edits)
is caught when the dataset opens, by verify's checks that read no shard content; a damaged row
is caught when it is built; a corrupt Parquet page when its row group is read.
"""
import json
import pickle
import shutil

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")

import packer_cli  # noqa: E402
from packer_cli.errors import DataError  # noqa: E402
from packer_cli.shards import reader as reader_module  # noqa: E402
from packer_cli.shards.bridge_output import BridgeOutput  # noqa: E402
from packer_cli.shards.format import seal_metadata  # noqa: E402
from packer_cli.shards.reader import PackedReader  # noqa: E402
from packer_cli.torch import PackedDataset, THDLoader  # noqa: E402
from packer_cli.torch.build import build_thd_batch  # noqa: E402

SHARD = "packs-00000.arrow"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("damaged")
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps({"input_ids": list(range(3, 5 + k % 29)) + [2]}) + "\n" for k in range(120)))
    spec = packer_cli.PackSpec(pack_size=64, cp=2)
    packer_cli.pack([str(src)], str(tmp / "native"), spec)
    packer_cli.pack([str(src)], str(tmp / "other"), packer_cli.PackSpec(pack_size=128))
    packer_cli.pack([str(src)], str(tmp / "bridge"), spec, output=BridgeOutput())
    return tmp


def copy(outputs, tmp_path, name="native"):
    dest = tmp_path / name
    shutil.copytree(outputs / name, dest)
    return dest


def edit_json(path, change, *, seal=False):
    record = json.loads(path.read_text())
    record = change(record)
    if seal:
        record = seal_metadata({k: v for k, v in record.items() if k != "checksum"})
    path.write_text(json.dumps(record))


def load_all(out):
    """Open ``out`` and build every pack, as training would (dataset, then a CPU loader)."""
    ds = PackedDataset(out)
    batches = [ds[i] for i in range(len(ds))]
    loader = THDLoader(ds, cp_size=2, cp_rank=0, seed=3, device="cpu", num_workers=0, pin_memory=False)
    return batches + list(loader)


def assert_refused(out, *names):
    with pytest.raises(DataError) as info:
        load_all(out)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message
    return message


# -- D5: layout damage that used to load silently -----------------------------------------

def test_duplicated_shard_entry(outputs, tmp_path):
    out = copy(outputs, tmp_path)
    edit_json(out / "manifest.json", lambda m: {**m, "shards": m["shards"] * 2})
    message = assert_refused(out, str(out), "manifest.json")
    assert "shard packs-00000.arrow is listed twice" in message  # verify's own finding, word for word


@pytest.mark.parametrize("with_nulls", [False, True], ids=["no-nulls", "a-null-pack"])
def test_a_shard_rewritten_with_nullable_columns(outputs, tmp_path, with_nulls):
    """The same columns, values and schema metadata, fields left nullable (pyarrow's default) and
    the manifest's size and hash updated: verify refused it and the loader served it, nulls too."""
    import xxhash
    from packer_cli.audit import verify_output

    out = copy(outputs, tmp_path)
    shard = pa.ipc.open_file(pa.memory_map(str(outputs / "native" / SHARD)))
    schema = pa.schema([pa.field(f.name, f.type) for f in shard.schema], metadata=shard.schema.metadata)
    with pa.ipc.new_file(str(out / SHARD), schema) as writer:
        for b in range(shard.num_record_batches):
            columns = shard.get_batch(b).columns
            if with_nulls and b == 0:
                columns = [pa.array([None] + column.to_pylist()[1:], column.type) for column in columns]
            writer.write_batch(pa.record_batch(columns, schema=schema))
    data = (out / SHARD).read_bytes()
    edit_json(out / "manifest.json", lambda m: {**m, "shards": [{**m["shards"][0], "bytes": len(data),
                                                                   "xxh3_64": xxhash.xxh3_64_hexdigest(data)}]})
    said = "schema differs from the packer-thd version 2 pack schema: column tokens is list<item: int32>, " \
           "expected list<item: int32> not null"
    assert said in assert_refused(out, SHARD)
    report = verify_output(str(out))
    assert report.exit_code == 1 and said in report.findings[0].message


def test_empty_shard_list(outputs, tmp_path):
    out = copy(outputs, tmp_path)
    edit_json(out / "manifest.json", lambda m: {**m, "shards": []})
    assert "counts.packs" in assert_refused(out, str(out), "manifest.json")


def test_shard_name_pointing_at_another_output(outputs, tmp_path):
    out = copy(outputs, tmp_path)
    other = copy(outputs, tmp_path, "other")
    name = f"../{other.name}/{SHARD}"

    def point(m):
        m["shards"][0]["name"] = name
        return m

    edit_json(out / "manifest.json", point)
    assert "unusable name" in assert_refused(out, str(out), name)


@pytest.mark.parametrize("name,split", [("native", None), ("bridge", "training")])
def test_spec_edited_after_writing(outputs, tmp_path, name, split):
    out = copy(outputs, tmp_path, name)
    meta = "metadata.json" if split is None else f"{split}.metadata.json"

    def pad(m):
        m["spec"]["pad_to_max_length"] = True
        return m

    edit_json(out / meta, pad)
    message = assert_refused(out, str(out), meta)
    assert "checksum" in message


def test_bridge_manifest_entry_repeated(outputs, tmp_path):
    out = copy(outputs, tmp_path, "bridge")
    edit_json(out / "training.manifest.json", lambda m: {**m, "shards": m["shards"] * 2})
    assert_refused(out, str(out), "training.manifest.json")


# -- D6: damage that used to raise an exception naming no file ----------------------------

@pytest.mark.parametrize("content", [{"format": "packer-thd", "format_version": 2}, [1],
                                     {"format": "packer-thd", "format_version": 2, "shards": {}}],
                         ids=["no-shards", "not-an-object", "shards-not-a-list"])
def test_manifest_without_shards(outputs, tmp_path, content):
    """Refused by the checks of the first open, and by a worker re-opening without them
    (``check=False``), which failed with a bare KeyError, or read no packs at all."""
    out = copy(outputs, tmp_path)
    meta = json.loads((out / "metadata.json").read_text())
    if isinstance(content, dict):
        content["format_version"] = meta["format_version"]
    (out / "manifest.json").write_text(json.dumps(content))
    assert_refused(out, str(out), "manifest.json")
    with pytest.raises(DataError) as raised:
        PackedReader(str(out), check=False)
    assert str(raised.value) == f"{out / 'manifest.json'}: no 'shards' list"


@pytest.mark.parametrize("seal", [False, True], ids=["edited", "edited-and-resealed"])
@pytest.mark.parametrize("change", [
    lambda m: {**m, "spec": []},
    lambda m: {**m, "spec": {**m["spec"], "pad_id": "abc"}},
    lambda m: {**m, "spec": {**m["spec"], "pack_size": "1024"}},
], ids=["spec-list", "pad-id-text", "pack-size-text"])
def test_unusable_spec(outputs, tmp_path, change, seal):
    out = copy(outputs, tmp_path)
    edit_json(out / "metadata.json", change, seal=seal)
    assert_refused(out, str(out), "metadata.json")


def _patch_int32(path, column, part, index, value):
    """Overwrite entry ``index`` of ``column``'s list offsets (``part="offsets"``) or values in a
    native shard, in place (the file keeps its size, so only the rows tell)."""
    with pa.memory_map(str(path)) as mm:
        base = mm.read_buffer(1).address
        mm.seek(0)
        arr = pa.ipc.open_file(mm).get_batch(0).column(column)
        buf = arr.buffers()[1] if part == "offsets" else arr.values.buffers()[1]
        at = buf.address - base + 4 * index
    with open(path, "r+b") as f:
        f.seek(at)
        assert len(f.read(4)) == 4
        f.seek(at)
        f.write(np.int32(value).tobytes())


@pytest.mark.parametrize("column,part,index,value", [
    ("tokens", "offsets", 3, 5),            # row 2 claims 5 tokens fewer/more than its boundaries
    ("cu_seqlens", "values", 1, 1_000_000),  # a boundary far past the pack
    ("seq_lens", "values", 0, 0),            # a sequence of length 0
    ("tokens", "values", 10, -200_000),      # a negative token id (a review saw it trained)
    ("last_token", "values", 0, -1),         # a negative final label (cross_entropy's IndexError mid-step)
], ids=["list-offset", "cu_seqlens", "seq_lens", "negative-token", "negative-last-token"])
def test_damaged_row_names_shard_and_row(outputs, tmp_path, column, part, index, value):
    out = copy(outputs, tmp_path)
    _patch_int32(out / SHARD, column, part, index, value)
    message = assert_refused(out, str(out / SHARD), " row ")
    assert "malformed pack" in message


def _real_length_lowered_by_m(lengths):
    """Lower the first sequence longer than m=4 by m: still 1 <= s <= p and p a multiple of m, so
    only the padding rule (p = ceil(s/m)·m) tells; the batch would train its last real tokens
    as padding and put its last label on a real position."""
    k = next(k for k, s in enumerate(lengths) if s > 4)
    lengths[k] -= 4
    return k


def test_real_length_lowered_by_m_is_refused(outputs, tmp_path):
    out = copy(outputs, tmp_path)
    with pa.memory_map(str(out / SHARD)) as mm:
        lengths = pa.ipc.open_file(mm).get_batch(0).column("seq_lens").values.to_numpy().tolist()
    k = _real_length_lowered_by_m(lengths)
    _patch_int32(out / SHARD, "seq_lens", "values", k, lengths[k])
    message = assert_refused(out, str(out / SHARD), " row ")
    assert "more padding than pad_seq_to_mult=4 allows" in message, message


def test_real_length_lowered_within_the_padding_is_refused(outputs, tmp_path):
    """Lowered by 1 where the padding rule still holds (p - s stays below m): the slot it gives
    up holds a real token, not pad_id, and the batch would train the token before it to predict
    a pad. A length raised within the padding reads the same as a real token equal to pad_id
    (docs/LOADER.md: only verify's checksums see it)."""
    out = copy(outputs, tmp_path)
    with pa.memory_map(str(out / SHARD)) as mm:
        batch = pa.ipc.open_file(mm).get_batch(0)
        lengths = batch.column("seq_lens")[0].values.to_numpy().tolist()  # row 0's: the column's first values
        physical = np.diff(batch.column("cu_seqlens")[0].values.to_numpy()).tolist()
    k = next(k for k, (s, p) in enumerate(zip(lengths, physical)) if s > 1 and p - s <= 2)
    _patch_int32(out / SHARD, "seq_lens", "values", k, lengths[k] - 1)
    message = assert_refused(out, str(out / SHARD), " row ")
    assert "but its padding slot at token" in message and "not pad_id=0 with loss 0" in message, message


def test_bridge_real_length_lowered_by_m_is_refused(outputs, tmp_path):
    import pyarrow.parquet as pq

    out = copy(outputs, tmp_path, "bridge")
    (data,) = out.glob("*.parquet")
    table = pq.read_table(data)
    lengths = table.column("packer_seq_lens").to_pylist()
    _real_length_lowered_by_m(lengths[0])
    column = table.schema.get_field_index("packer_seq_lens")
    table = table.set_column(column, "packer_seq_lens", pa.array(lengths, table.schema.field(column).type))
    pq.write_table(table, data, compression="zstd")  # as written: only the rows differ
    manifest_path = next(out.glob("*.manifest.json"))
    manifest = json.loads(manifest_path.read_text())
    manifest["shards"][0]["bytes"] = data.stat().st_size
    manifest_path.write_text(json.dumps(manifest))
    message = assert_refused(out, str(data))
    assert "more padding than pad_seq_to_mult=4 allows" in message, message


def test_corrupt_bridge_parquet_names_the_file(outputs, tmp_path):
    out = copy(outputs, tmp_path, "bridge")
    (data,) = out.glob("*.parquet")
    raw = bytearray(data.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 256] = bytes(range(256))
    data.write_bytes(bytes(raw))
    # the manifest records the size only, which is unchanged: the layout checks pass
    assert_refused(out, str(data))


@pytest.mark.parametrize("name,column", [("bridge", b"packer_source_index"), ("native", b"source_offset")])
def test_a_column_name_that_is_not_utf8_names_the_file(outputs, tmp_path, name, column):
    """pyarrow decodes a Parquet footer's column names as it opens the file: a flipped high bit
    left one that is not UTF-8, and UnicodeDecodeError came out of the Bridge reader."""
    out = copy(outputs, tmp_path, name)
    (data,) = [p for p in out.iterdir() if p.suffix in (".parquet", ".arrow")]
    raw = bytearray(data.read_bytes())
    tail = 8 if raw.endswith(b"PAR1") else 10  # the footer's length, then PAR1 or ARROW1
    footer = len(raw) - tail - int.from_bytes(raw[-tail:4 - tail], "little")
    raw[raw.index(column, footer) + len(column) - 1] ^= 0x80  # the footer's schema, where it is first
    data.write_bytes(bytes(raw))
    # the manifest records the size only, which is unchanged: the layout checks pass
    assert_refused(out, str(data))


# -- good outputs: unchanged batches, checks once a process --------------------------------

@pytest.mark.parametrize("name", ["native", "bridge"])
def test_good_output_gives_the_same_batches(outputs, name):
    out = outputs / name
    ds = PackedDataset(out)
    raw = PackedReader(str(out), check=False)  # the rows as stored, no checks in the way
    assert len(ds) == len(raw) == ds.metadata["counts"]["packs"]
    for i in range(len(ds)):
        got, want = ds[i], build_thd_batch(raw.row(i), ds.metadata)
        for field in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (i, field)
    total = sum(b.num_real_tokens for b in THDLoader(ds, seed=1, device="cpu", num_workers=0, pin_memory=False))
    assert total == ds.metadata["counts"]["runtime_tokens"]


def test_workers_do_not_rerun_the_checks(outputs, monkeypatch):
    ds = PackedDataset(outputs / "native")
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned worker gets
    assert clone._reader is None

    def fail(*args):
        raise AssertionError("layout checks ran again in a worker")

    monkeypatch.setattr(reader_module, "check_layout_for_reading", fail)
    assert torch.equal(clone[2].tokens, ds[2].tokens)
    with pytest.raises(AssertionError, match="ran again"):
        PackedDataset(outputs / "native")  # a fresh open does check


# -- rows whose damage a batch would otherwise carry silently --------------------------------

def _shift_offset(path, column, index, delta):
    """Move entry ``index`` of ``column``'s list offsets by ``delta`` (in place)."""
    with pa.memory_map(str(path)) as mm:
        offsets = pa.ipc.open_file(mm).get_batch(0).column(column).offsets
        value = offsets[index].as_py()
    _patch_int32(path, column, "offsets", index, value + delta)


@pytest.mark.parametrize("column", ["source_index", "source_offset", "last_token"])
def test_per_sequence_column_of_another_length_is_refused(outputs, tmp_path, column):
    """One pack's per-sequence list one entry longer (the next one shorter): the batch would
    carry another pack's source index; it is a DataError naming the shard and row."""
    out = copy(outputs, tmp_path)
    _shift_offset(out / SHARD, column, 3, -1)
    message = assert_refused(out, str(out / SHARD), " row ")
    assert f"{column} entries for" in message, message


def _padded_at(values, *slots):
    """``values`` with 0 (pad_id, or loss 0) at ``slots``: the stored alignment padding."""
    values = values.copy()
    values[list(slots)] = 0
    return values


def _row(**changes):
    from types import SimpleNamespace

    row = dict(tokens=_padded_at(np.arange(1, 17, dtype=np.int32), 7), loss_mask=_padded_at(np.ones(16, np.uint8), 7),
               cu_seqlens=np.array([0, 8, 16], np.int32), seq_lens=np.array([7, 8], np.int32),
               last_token=np.array([9, 9], np.int32), source_index=np.array([0, 1]), source_offset=np.array([0, 0]))
    row.update(changes)
    return SimpleNamespace(**row)


@pytest.mark.parametrize("changes,says", [
    (dict(cu_seqlens=np.array([0, 6, 16], np.int32), seq_lens=np.array([6, 8], np.int32)),
     "sequence 0 spans 6 tokens, not a multiple of pad_seq_to_mult=4"),
    (dict(seq_lens=np.array([7, 4], np.int32)),
     "sequence 1 has 4 real tokens in 8, more padding than pad_seq_to_mult=4 allows"),
    (dict(loss_mask=_padded_at(np.array([1] * 15 + [2], np.uint8), 7)), "loss_mask holds 2 at token 15, not 0 or 1"),
    (dict(loss_mask=_padded_at(np.array([1] * 15 + [-1], np.int8), 7).view(np.uint8)), "loss_mask holds 255 at token 15"),
    (dict(source_index=np.array([0, 1, 2])), "3 source_index entries for 2 sequences"),
    (dict(source_index=np.array([0, 10])), "source_index 10 is not one of the 10 input records"),
    (dict(source_index=np.array([-1, 1])), "source_index -1 is not one of the 10 input records"),
    (dict(tokens=_padded_at(np.arange(1, 21, dtype=np.int32), 7, 17, 18, 19),
          loss_mask=_padded_at(np.ones(20, np.uint8), 7, 17, 18, 19),
          cu_seqlens=np.array([0, 8, 20], np.int32), seq_lens=np.array([7, 9], np.int32)), "pack has 20 physical tokens, more than pack_size=16"),
    # a real length lowered within the padding (7 -> 6): a real token and its loss in a padding slot
    (dict(seq_lens=np.array([6, 8], np.int32)),
     r"sequence 0 has 6 real tokens in 8, but its padding slot at token 6 holds 7 with loss 1, not pad_id=0 with loss 0"),
    (dict(loss_mask=_padded_at(np.ones(16, np.uint8), 7, 6), seq_lens=np.array([6, 8], np.int32)),
     "padding slot at token 6 holds 7 with loss 0"),
    (dict(tokens=_padded_at(np.arange(1, 17, dtype=np.int32), 7, 6), seq_lens=np.array([6, 8], np.int32)),
     "padding slot at token 6 holds 0 with loss 1"),
    # a zero-length sequence: its last_token would overwrite the previous sequence's last label
    (dict(cu_seqlens=np.array([0, 8, 8, 16], np.int32), seq_lens=np.array([7, 0, 8], np.int32),
          last_token=np.array([9, 5, 9], np.int32), source_index=np.array([0, 1, 2]), source_offset=np.array([0, 0, 0])),
     r"need 1 <= seq_lens <= physical lengths, got \[7, 0, 8\]"),
    (dict(loss_mask=_padded_at(np.array([1] * 15 + [-1], np.int8), 7)), "loss_mask holds -1 at token 15, not 0 or 1"),
    # a float mask inside [0, 1] but not 0 or 1 (a range check passes it): weights of 0.5 and 1.5
    (dict(loss_mask=_padded_at(np.array([1] * 14 + [0.5, 1], np.float32), 7)), "loss_mask holds 0.5 at token 14, not 0 or 1"),
    (dict(loss_mask=_padded_at(np.array([1.5] + [1] * 15, np.float64), 7)), "loss_mask holds 1.5 at token 0, not 0 or 1"),
    (dict(loss_mask=_padded_at(np.array([1] * 15 + [np.nan], np.float32), 7)), "loss_mask holds nan at token 15, not 0 or 1"),
])
def test_build_refuses_rows_that_would_train_wrongly(changes, says):
    """A boundary off the recorded alignment (tokens shifted; CP slicing would also fail), a loss
    mask value that would weight the loss, per-sequence lists of another length, a source index
    that is no input record, a pack longer than C (a metadata re-signed with a smaller C)."""
    meta = {"spec": {"pad_id": 0, "pack_size": 16, "pad_seq_to_mult": 4}, "counts": {"records": 10}}
    build_thd_batch(_row(), meta)  # the unchanged row builds
    with pytest.raises(ValueError, match=says):
        build_thd_batch(_row(**changes), meta)


def test_bridge_loss_mask_value_other_than_0_or_1_is_refused(outputs, tmp_path):
    import pyarrow.parquet as pq

    out = copy(outputs, tmp_path, "bridge")
    (data,) = out.glob("*.parquet")
    table = pq.read_table(data)
    masks = table.column("loss_mask").to_pylist()
    masks[0][0] = 2
    table = table.set_column(1, "loss_mask", pa.array(masks, table.schema.field("loss_mask").type))
    pq.write_table(table, data, compression="zstd")  # as written: only the rows differ
    manifest = json.loads(next(out.glob("*.manifest.json")).read_text())
    manifest["shards"][0]["bytes"] = data.stat().st_size
    next(out.glob("*.manifest.json")).write_text(json.dumps(manifest))
    message = assert_refused(out, str(data))
    assert "loss_mask holds 2" in message, message


def test_index_types_and_ranges(outputs):
    """Only integers index packs (numpy ints too; not bools, floats, strings, slices or arrays);
    an index out of range is named as it was given; an empty micro-batch or a bad CP rank is a
    clear ValueError."""
    ds = PackedDataset(outputs / "native")
    n = len(ds)
    assert torch.equal(ds[np.int64(1)].tokens, ds[1].tokens) and torch.equal(ds[-1].tokens, ds[n - 1].tokens)
    for bad in (True, 1.0, "3", None, slice(0, 2), np.array([1, 2])):
        with pytest.raises(TypeError, match=f"pack index must be an integer, got {type(bad).__name__}$"):
            ds[bad]
    for bad in (n, -n - 1, 2**63, -2**63):
        with pytest.raises(IndexError, match=rf"pack index {bad} out of range for {n} packs"):
            ds[bad]
    with pytest.raises(ValueError, match="at least one pack index"):
        ds.micro_batch([])
    for size, rank in ((0, 0), (2, 2), (2.0, 0), (2, -1)):
        with pytest.raises(ValueError, match="cp_size must be an integer >= 1"):
            ds.micro_batch([0], size, rank)
    assert ds.micro_batch([0], np.int64(2), 1).cp_rank == 1


def _flatbuffer_field(buf, table, index):
    """Where field ``index`` of the flatbuffer table at ``table`` lies in ``buf`` (None: absent)."""
    import struct

    vtable = table - struct.unpack_from("<i", buf, table)[0]
    if 4 + 2 * index >= struct.unpack_from("<H", buf, vtable)[0]:
        return None
    field = struct.unpack_from("<H", buf, vtable + 4 + 2 * index)[0]
    return table + field if field else None


def _first_batch_header(data):
    """Offset and length in the shard ``data`` of its first record batch's header (its message:
    continuation marker, length, flatbuffer), where the footer's first block says."""
    import struct

    footer_length = int.from_bytes(data[-10:-6], "little")
    footer = data[len(data) - 10 - footer_length:len(data) - 10]
    field = _flatbuffer_field(footer, int.from_bytes(footer[:4], "little"), 3)  # recordBatches
    vector = field + int.from_bytes(footer[field:field + 4], "little")
    offset, header_length, _ = struct.unpack_from("<qi4xq", footer, vector + 4)
    return offset, header_length


def _field_node_null_counts(data):
    """Offsets in the shard ``data`` of the null counts its first record batch's header states,
    one a field node (a column, then its list's values, in schema order)."""
    offset, _ = _first_batch_header(data)
    message = data[offset + 8:]
    header = _flatbuffer_field(message, int.from_bytes(message[:4], "little"), 2)  # Message.header
    batch = header + int.from_bytes(message[header:header + 4], "little")
    field = _flatbuffer_field(message, batch, 1)  # RecordBatch.nodes: structs (length, null_count)
    nodes = field + int.from_bytes(message[field:field + 4], "little")
    count = int.from_bytes(message[nodes:nodes + 4], "little")
    return [offset + 8 + nodes + 4 + 16 * k + 8 for k in range(count)]


def test_a_null_count_stated_in_a_record_batch_header_is_a_data_error(outputs, tmp_path):
    """A pack column has no validity bitmap: a header whose flipped bit states nulls in one
    (the file keeps its size, so the layout checks pass) is refused when the shard is opened;
    taken as written, the values of some were served changed, and others failed in NumPy."""
    out = copy(outputs, tmp_path)
    path = out / SHARD
    data = path.read_bytes()
    null_counts = _field_node_null_counts(data)
    assert len(null_counts) == 14  # seven list columns and their values
    for k, at in enumerate(null_counts):
        assert data[at:at + 8] == bytes(8)
        damaged = bytearray(data)
        damaged[at] ^= 1 << 2  # 4 nulls
        path.write_bytes(bytes(damaged))
        with pytest.raises(DataError) as raised:
            PackedReader(str(out))
        column = k // 2
        assert str(raised.value).startswith(f"{path}: cannot open shard (In column {column}: Invalid: "), k
        assert "Buffer #0 too small" in str(raised.value), k


def test_a_damaged_record_batch_header_is_a_data_error(outputs, tmp_path):
    """Bits flipped in a shard's record batch header (the file keeps its size, so the layout
    checks pass): NumPy's views of buffers the header misdescribed failed with a bare
    ValueError, even a SystemError, instead of a DataError naming the shard."""
    out = copy(outputs, tmp_path)
    path = out / SHARD
    data = path.read_bytes()
    offset, header_length = _first_batch_header(data)
    outcomes = set()
    for at in range(offset, offset + header_length):
        for bit in (2, 7):
            damaged = bytearray(data)
            damaged[at] ^= 1 << bit
            path.write_bytes(bytes(damaged))
            try:
                ds = PackedDataset(out)
                for i in range(len(ds)):
                    ds[i]
                outcomes.add("read")
            except DataError as exc:
                assert "\n" not in str(exc)
                outcomes.add("DataError")
    assert outcomes == {"read", "DataError"}  # some flips change only values, as documented


def _bridge_rewritten(outputs, tmp_path, **write):
    """The Bridge output's data file written again from its own rows (``write``: pyarrow's
    options, and ``rows``: how many to keep), its manifest's byte count fixed and nothing else."""
    import pyarrow.parquet as pq

    out = copy(outputs, tmp_path, "bridge")
    (data,) = out.glob("*.parquet")
    pf = pq.ParquetFile(data)
    table = pf.read()
    table = table.slice(0, write.pop("rows", table.num_rows))
    pq.write_table(table, data, row_group_size=pf.metadata.row_group(0).num_rows, **write)
    manifest_path = next(out.glob("*.manifest.json"))
    manifest = json.loads(manifest_path.read_text())
    manifest["shards"][0]["bytes"] = data.stat().st_size
    manifest_path.write_text(json.dumps(manifest))
    return out, data


def test_a_bridge_file_its_footer_contradicts_is_refused_at_open(outputs, tmp_path):
    """The data file's footer findings (verify's bridge.file) stop a reader too: a footer stating
    a row of 2^27 ids in 181 KB was decoded (5.6 GB) before the row was found longer than C.
    Here the columns' codec differs from the one the manifest records."""
    out, data = _bridge_rewritten(outputs, tmp_path, compression="snappy")
    with pytest.raises(DataError, match=r"compressed with SNAPPY \[bridge\.file\]"):
        PackedDataset(out)


def test_a_shard_holding_more_packs_than_its_manifest_records_is_refused(outputs, tmp_path):
    """A shard rewritten with packs appended (the manifest's size and hash made to hold, so the
    layout checks pass) served the extra packs; fewer packs are refused the same way."""
    import xxhash

    out = copy(outputs, tmp_path)
    path = out / SHARD
    table = pa.ipc.open_file(pa.memory_map(str(outputs / "native" / SHARD))).read_all()
    rows = table.num_rows
    for extra in (5, -1):
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(pa.concat_tables([table, table.slice(0, extra)]) if extra > 0
                               else table.slice(0, rows + extra))
        data = path.read_bytes()
        edit_json(out / "manifest.json", lambda m: {**m, "shards": [{**m["shards"][0], "bytes": len(data),
                                                                       "xxh3_64": xxhash.xxh3_64_hexdigest(data)}]})
        said = f"{path}: holds {rows + extra} packs, the manifest records {rows} (a damaged footer, or the file replaced)"
        for check in (True, False):
            with pytest.raises(DataError) as raised:
                PackedReader(str(out), check=check)
            assert str(raised.value) == said, check


def test_a_bridge_file_holding_fewer_packs_than_its_manifest_is_refused_by_a_worker_too(outputs, tmp_path):
    """A footer listing fewer row groups served fewer packs silently. The first open's checks
    see it; a worker re-opening without them compares the file's packs with the manifest."""
    from packer_cli.shards.bridge_reader import BridgeReader

    manifest = json.loads(next((outputs / "bridge").glob("*.manifest.json")).read_text())
    rows = manifest["shards"][0]["rows"]
    out, data = _bridge_rewritten(outputs, tmp_path, compression="zstd", rows=rows - 1)
    with pytest.raises(DataError, match=r"\[bridge\.file\]"):
        PackedDataset(out)
    with pytest.raises(DataError, match=rf"{data.name}: holds {rows - 1} packs, the split's manifest records {rows}"):
        BridgeReader(str(out), check=False)


@pytest.mark.parametrize("length", [0, -2**30, 10**6, 64], ids=["zero", "negative", "huge", "pack-overfull"])
def test_a_balancing_loader_weighs_a_damaged_pack_as_nothing(outputs, tmp_path, length):
    """A damaged pack's impossible lengths (one of 64 tokens makes the 64-token pack overfull)
    neither stop a balancing loader from being built nor weigh on the balance; the pack itself is
    refused where it is served (here replaced by a lossless stand-in)."""
    out = copy(outputs, tmp_path)
    sound = PackedDataset(outputs / "native").pack_statistics()
    _patch_int32(out / SHARD, "seq_lens", "values", 0, length)  # pack 0's first sequence
    ds = PackedDataset(out)
    tokens, squares = ds.pack_statistics()
    assert (tokens[0], squares[0]) == (0, 0)
    assert tokens[1:].tolist() == sound[0][1:].tolist() and squares[1:].tolist() == sound[1][1:].tolist()
    served = 0
    with pytest.warns(UserWarning, match=f"{out / SHARD} row 0"):
        for rank in range(2):
            loader = THDLoader(ds, dp_size=2, dp_rank=rank, cp_size=2, device="cpu", num_workers=0, seed=1,
                               on_damaged="lossless", balance="tokens", micro_batches_per_step=2)
            served += sum(1 for _ in loader) - len(loader)
    assert served == 0


def test_a_shard_swapped_after_opening_is_refused_when_balancing(outputs, tmp_path):
    out = copy(outputs, tmp_path)
    ds = PackedDataset(out)
    shutil.copyfile(outputs / "other" / SHARD, out / SHARD)  # another output's packs, fewer of them
    with pytest.raises(DataError, match=r"its shards hold \d+ packs, the dataset \d+ packs: the output changed after"):
        ds.pack_statistics()

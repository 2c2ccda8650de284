"""PackedDataset: map-style access to packs, static shapes from metadata, pickling for workers."""

import json
import pickle

import pytest

torch = pytest.importorskip("torch")

from packer_cli.errors import DataError  # noqa: E402
from packer_cli.torch import PackedDataset, StaticShapeError, THDBatch  # noqa: E402
from packer_cli.torch.testing import InMemoryReader, make_meta, make_row  # noqa: E402

ROWS = [make_row([[1, 2, 3, 4], [5, 6, 7]], multiple=2), make_row([[8, 9, 10, 11, 12]], multiple=2)]


def test_map_style_access():
    ds = PackedDataset(InMemoryReader(ROWS, make_meta(ROWS, pack_size=8, multiple=2)))
    assert len(ds) == 2 and not ds.static and ds.pad_multiple == 2
    assert isinstance(ds[0], THDBatch) and ds[0].cu_seqlens_padded.tolist() == [0, 4, 6]
    assert ds[-1].tokens.tolist() == [[8, 9, 10, 11]]
    with pytest.raises(IndexError):
        ds[2]
    both = ds.micro_batch([1, 0])
    assert both.source_index.tolist() == [0, 0, 1] and both.num_packs == 2


def test_static_follows_metadata_and_fails_early():
    meta = make_meta(ROWS, pack_size=8, multiple=2, pad_to_max_length=True, pad_cu_seqlens=True)
    ds = PackedDataset(InMemoryReader(ROWS, meta))
    assert ds.static and {ds[i].cu_seqlens.numel() for i in range(2)} == {4}
    assert not PackedDataset(InMemoryReader(ROWS, meta), static=False).static
    plain = make_meta(ROWS, pack_size=8, multiple=2)
    with pytest.raises(StaticShapeError, match="pad_to_max_length"):
        PackedDataset(InMemoryReader(ROWS, plain), static=True)


@pytest.mark.parametrize("sample", [[5], []])
def test_a_hand_made_pack_refuses_a_sample_of_fewer_than_2_tokens(sample):
    """A sample of one token has no label: no sequence packer would write (it drops such samples)."""
    with pytest.raises(ValueError, match="a sample needs at least 2 tokens"):
        make_row([[1, 2, 3], sample])


def test_hand_made_metadata_records_the_padded_longest_sequence():
    """``make_meta`` records ``dataset_max_seqlen`` as packer does, over the padded lengths: a
    static pack whose sequence is padded from 7 to 8 tokens is then accepted, not refused as
    longer than the recorded longest."""
    rows = [make_row([list(range(1, 9))], multiple=4), make_row([list(range(1, 6)), [1, 2, 3, 4]], multiple=4)]
    meta = make_meta(rows, pack_size=8, multiple=4, pad_to_max_length=True, pad_cu_seqlens=True)
    assert meta["bridge"]["dataset_max_seqlen"] == 8
    ds = PackedDataset(InMemoryReader(rows, meta))
    assert ds.static and ds[0].cu_seqlens_padded.tolist()[:2] == [0, 8]


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory):
    packer = pytest.importorskip("packer_cli")
    tmp = tmp_path_factory.mktemp("packed")
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps({"input_ids": list(range(1, 3 + k % 17))}) + "\n" for k in range(60)))
    spec = packer.PackSpec(pack_size=64, cp=2, tp=2, sp=True, pad_to_max_length=True, pad_cu_seqlens=True)
    packer.pack([str(src)], str(tmp / "out"), spec)
    return tmp / "out"


def test_real_output_batches(packed_dir):
    ds = PackedDataset(packed_dir)
    meta = ds.metadata
    assert ds.static and ds.pad_multiple == 4 and len(ds) == meta["counts"]["packs"]
    total = 0
    for i in range(len(ds)):
        b = ds[i]
        assert b.num_tokens == 64 and b.cu_seqlens_padded[-1] == 64
        assert b.cu_seqlens.numel() == meta["static"]["cu_seqlens_len"] and b.max_seqlen == meta["static"]["max_seqlen"]
        assert bool((b.cu_seqlens_padded % 4 == 0).all())
        total += b.num_real_tokens
        half = b.for_cp_rank(2, 1)
        assert half.tokens.shape == (1, 32)
    assert total == meta["counts"]["runtime_tokens"]


def test_pickles_without_the_memory_map(packed_dir):
    ds = PackedDataset(packed_dir)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._reader is None  # reopened lazily in the worker process
    assert torch.equal(clone[3].tokens, ds[3].tokens)


def test_a_bridge_split_by_name_pickles_and_loads_in_spawned_workers(tmp_path):
    """split= picks a Bridge layout's split and travels with the path, so spawn/forkserver
    workers reopen it (an open reader holds pyarrow objects that do not pickle)."""
    packer = pytest.importorskip("packer_cli")
    from packer_cli.shards.bridge_output import BridgeOutput
    from packer_cli.shards.reader import PackedReader

    rows = {"training": 60, "validation": 24}
    for split, n in rows.items():
        src = tmp_path / f"{split}.jsonl"
        src.write_text("".join(json.dumps({"input_ids": list(range(1, 4 + k % 13)) + [2]}) + "\n" for k in range(n)))
        packer.pack([str(src)], str(tmp_path / "bridge"), packer.PackSpec(pack_size=64),
                    output=BridgeOutput(split=split))
    val = PackedDataset(tmp_path / "bridge", split="validation")
    assert val.metadata["counts"]["records"] == 24
    assert PackedDataset(tmp_path / "bridge").metadata["counts"]["records"] == 60  # training by default
    clone = pickle.loads(pickle.dumps(val))
    assert clone.split == "validation" and torch.equal(clone[0].tokens, val[0].tokens)
    loader = torch.utils.data.DataLoader(val, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    assert sum(b.num_real_tokens for b in loader) == val.metadata["counts"]["runtime_tokens"]
    with pytest.raises(ValueError, match="split= goes with an output directory"):
        PackedDataset(PackedReader(str(tmp_path / "bridge"), "validation"), split="validation")


def test_static_shapes_of_a_bridge_layout_are_the_same_for_both_splits(tmp_path):
    """Bridge sizes static batches from every entry of ``{C}_metadata.jsonl`` (max, max, min), so
    a CUDA graph captured on training batches replays on validation ones; each split's own
    values gave training max_seqlen 4 and validation boundaries of length 4 instead."""
    packer = pytest.importorskip("packer_cli")
    from packer_cli.shards.bridge_output import BridgeOutput

    lengths = {"training": [4] * 16, "validation": [30, 31, 20, 12]}  # many short / few long samples
    spec = packer.PackSpec(pack_size=32, cp=2, pad_to_max_length=True, pad_cu_seqlens=True)
    for split, lens in lengths.items():
        src = tmp_path / f"{split}.jsonl"
        src.write_text("".join(json.dumps({"input_ids": list(range(10, 10 + n)) + [7]}) + "\n" for n in lens))
        packer.pack([str(src)], str(tmp_path / "bridge"), spec, output=BridgeOutput(split=split))
    entries = json.loads((tmp_path / "bridge" / "32_metadata.jsonl").read_text())
    assert len({e["max_samples_per_bin"] for e in entries}) == 2  # the splits differ on their own
    cu_len = max(e["max_samples_per_bin"] for e in entries) + 2
    max_seqlen = max(max(e["dataset_max_seqlen"] for e in entries), 32 - min(e["min_packed_seqlen"] for e in entries))
    assert max_seqlen == 32  # a 30-token sample fills a pack: served as 32 + m (m = 4), never T itself
    max_seqlen = 36
    for split in lengths:
        ds = PackedDataset(tmp_path / "bridge", split=split)
        assert ds.static
        for batch in (ds[i] for i in range(len(ds))):
            assert batch.tokens.shape[-1] == 32
            assert batch.cu_seqlens_padded.numel() == cu_len and batch.max_seqlen == max_seqlen


def _static_bridge_layout(tmp_path, *splits):
    """A Bridge layout of ``splits`` (C = 32, static shapes), each packed from the same 4 samples."""
    packer = pytest.importorskip("packer_cli")
    from packer_cli.shards.bridge_output import BridgeOutput

    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps({"input_ids": list(range(10, 10 + n)) + [7]}) + "\n" for n in [5, 9, 20, 3]))
    spec = packer.PackSpec(pack_size=32, pad_to_max_length=True, pad_cu_seqlens=True)
    for split in splits:
        packer.pack([str(src)], str(tmp_path / "bridge"), spec, output=BridgeOutput(split=split))
    return tmp_path / "bridge"


@pytest.mark.parametrize("where", ["the split's metadata", "the other split's metadata", "an entry of {C}_metadata.jsonl"])
@pytest.mark.parametrize("key,value", [("max_samples_per_bin", 2**27), ("max_samples_per_bin", 0),
                                       ("dataset_max_seqlen", 2**40), ("min_packed_seqlen", -1),
                                       ("max_samples_per_bin", 4.0)])
def test_a_static_shape_no_pack_can_have_is_refused_at_open(tmp_path, where, key, value):
    """Each static-shape key sizes every static batch: an entry appended to the Bridge layout's
    metadata file (which has no checksum) with max_samples_per_bin = 2**27 made each pack's
    boundaries 134M entries (2.3 GB), 2**40 a MemoryError; a metadata edited and sealed again
    the same. Refused when the dataset opens, naming the file."""
    if value == 0 and where.startswith("an entry"):
        pytest.skip("another writer's entry for an empty split holds 0s: see the test below")
    from packer_cli.shards.format import seal_metadata

    out = _static_bridge_layout(tmp_path, "training", "validation")
    assert PackedDataset(out, split="training").static  # as written, it opens
    if where == "the other split's metadata":  # its values size this split's batches too
        path = out / "validation.metadata.json"
        meta = json.loads(path.read_text())
        meta["bridge"][key] = value  # the checksum left stale: only verify reads it
        path.write_text(json.dumps(meta))
        named = r"validation\.metadata\.json: bridge"
    elif where == "the split's metadata":
        path = out / "training.metadata.json"
        meta = json.loads(path.read_text())
        meta["bridge"][key] = value
        path.write_text(json.dumps(seal_metadata({k: v for k, v in meta.items() if k != "checksum"})))
        named = r"training\.metadata\.json: bridge"
    else:
        path = out / "32_metadata.jsonl"
        entries = json.loads(path.read_text())
        path.write_text(json.dumps(entries + [dict(entries[0], **{key: value})]))
        named = r"32_metadata\.jsonl: entry 2"  # after the two splits' own entries
    with pytest.raises(DataError, match=rf"{named}: {key} = {value!r} is impossible for packs of 32 tokens"):
        PackedDataset(out, split="training")


def test_another_writers_entry_for_an_empty_split_opens(tmp_path):
    """A writer of Bridge's metadata file records 0s for a split without packs. It opens, with
    the shapes Bridge gives it: the boundaries this output's own (the largest
    max_samples_per_bin across entries), max_seqlen from the smallest min_packed_seqlen, 0,
    so C, served as C + 1 (m = 1)."""
    out = _static_bridge_layout(tmp_path, "training")
    shapes = [tuple(b.cu_seqlens_padded.shape) for b in PackedDataset(out)]
    path = out / "32_metadata.jsonl"
    entries = json.loads(path.read_text())
    empty = {"max_samples_per_bin": 0, "dataset_max_seqlen": 0, "packing_factor": 0.0, "packing_efficiency": 0.0,
             "pack_size": 32, "min_packed_seqlen": 0}
    path.write_text(json.dumps(entries + [empty]))
    ds = PackedDataset(out)
    assert ds.static and [tuple(b.cu_seqlens_padded.shape) for b in ds] == shapes
    assert {b.max_seqlen for b in ds} == {33}


def _pack_jsonl(tmp_path, name, lengths, *options):
    packer = pytest.importorskip("packer_cli")
    from packer_cli.spec import Algorithm

    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"input_ids": list(range(1, n + 1))}) + "\n" for n in lengths))
    spec = packer.PackSpec(pack_size=1024, pad_seq_to_mult=2, pad_to_max_length=True, algorithm=Algorithm.SEQUENTIAL,
                           shuffle=False)
    packer.pack([str(src)], str(tmp_path / name), spec, overwrite=True)
    return tmp_path / name


def test_a_worker_reopens_the_output_the_dataset_opened(tmp_path, monkeypatch):
    """A spawned worker re-opens the dataset by path: a relative path read another directory
    after a chdir, and an output replaced meanwhile was served under the same indices."""
    out = _pack_jsonl(tmp_path, "out", [601, 600, 601, 600])
    monkeypatch.chdir(tmp_path)
    ds = PackedDataset("out")
    first = ds[0].tokens
    (tmp_path / "elsewhere").mkdir()
    _pack_jsonl(tmp_path / "elsewhere", "out", [300, 200, 100])
    monkeypatch.chdir(tmp_path / "elsewhere")
    clone = pickle.loads(pickle.dumps(ds))  # what a spawn/forkserver worker gets
    assert torch.equal(clone[0].tokens, first)
    _pack_jsonl(tmp_path, "out", [300, 200, 100])  # `pack --overwrite` replaces it
    with pytest.raises(Exception, match=r"out: the output changed after the dataset was opened"):
        pickle.loads(pickle.dumps(ds))[0]
    assert out.is_dir()


def test_joined_packs_count_a_tail_as_real_in_neither_or_both_vectors(tmp_path):
    """A pack without alignment padding keeps its tail in its one boundary vector; joined with
    a padded pack it was still counted real there, 424 tokens that num_real_tokens and
    seqlen_sq_sum leave out."""
    ds = PackedDataset(_pack_jsonl(tmp_path, "out", [601, 600, 601, 600]))  # runtime 600 (even) and 599
    plain = next(i for i in range(len(ds)) if not ds[i].has_padding)
    padded = next(i for i in range(len(ds)) if ds[i].has_padding)
    for pair in ([plain, padded], [padded, plain]):
        row = ds.micro_batch(pair)
        assert row.has_padding and row.cu_seqlens is not row.cu_seqlens_padded
        segments = torch.diff(row.cu_seqlens.long())
        assert int(segments.sum()) == row.num_real_tokens == 1199
        assert int((segments * segments).sum()) == row.seqlen_sq_sum
        assert int(row.cu_seqlens_padded[-1]) == 2048


def test_static_shapes_of_a_bridge_split_opened_as_a_reader_are_the_layouts(tmp_path):
    packer = pytest.importorskip("packer_cli")
    from packer_cli.shards.bridge_output import BridgeOutput
    from packer_cli.shards.reader import PackedReader

    spec = packer.PackSpec(pack_size=32, cp=2, pad_to_max_length=True, pad_cu_seqlens=True)
    for split, lens in {"training": [4] * 16, "validation": [30, 31, 20, 12]}.items():
        src = tmp_path / f"{split}.jsonl"
        src.write_text("".join(json.dumps({"input_ids": list(range(10, 10 + n)) + [7]}) + "\n" for n in lens))
        packer.pack([str(src)], str(tmp_path / "bridge"), spec, output=BridgeOutput(split=split))
    by_path = PackedDataset(tmp_path / "bridge", split="training")[0]
    by_reader = PackedDataset(PackedReader(str(tmp_path / "bridge"), "training"))[0]
    assert by_reader.max_seqlen == by_path.max_seqlen == 32 + 4  # Bridge's bound is T: served as T + m
    assert by_reader.cu_seqlens_padded.numel() == by_path.cu_seqlens_padded.numel()


def test_a_split_asked_of_a_native_output_says_it_has_none(packed_dir):
    """It said "no 'training' split here (found: none)", as if the directory were empty."""
    from packer_cli.errors import ConfigError

    assert len(PackedDataset(packed_dir)) > 0
    with pytest.raises(ConfigError, match="this is a native output, which has no splits: leave split out"):
        PackedDataset(packed_dir, split="training")[0]


def test_a_recorded_min_packed_seqlen_of_0_opens():
    """min_packed_seqlen's range is 0..pack_size (Bridge takes the smallest across entries, and
    pack_size - 0 bounds every segment): a 0 is no impossible shape, unlike a 0 max_samples_per_bin."""
    meta = make_meta(ROWS, pack_size=8, multiple=2, pad_to_max_length=True, pad_cu_seqlens=True)
    meta["bridge"]["min_packed_seqlen"] = 0
    ds = PackedDataset(InMemoryReader(ROWS, meta))
    assert ds.static and {ds[i].max_seqlen for i in range(2)} == {8 + 2}  # bound 8 == C: served as C + m


@pytest.mark.parametrize("key,value", [("dataset_max_seqlen", 2**40), ("max_samples_per_bin", 2**27)])
def test_an_impossible_static_shape_of_an_open_reader_is_refused_at_open(key, value):
    """Only a Bridge layout opened by path has its splits' keys checked again: a native output's
    or an open reader's key is checked once, when the dataset opens (2**27 made every pack's boundaries 134M entries)."""
    meta = make_meta(ROWS, pack_size=8, multiple=2, pad_to_max_length=True, pad_cu_seqlens=True)
    meta["bridge"][key] = value
    with pytest.raises(DataError, match=rf"bridge: {key} = {value} is impossible for packs of 8 tokens"):
        PackedDataset(InMemoryReader(ROWS, meta))

"""A THDBatch crossing a process boundary: one buffer, every field back as it was."""

import copy
import dataclasses
import json
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest

torch = pytest.importorskip("torch")

from packer_cli import PackSpec, pack  # noqa: E402
from packer_cli.torch import PackedDataset, THDBatch, THDLoader  # noqa: E402

SPECS = {
    "unaligned": PackSpec(pack_size=64),                                  # no sequence padded: one boundary vector
    "cp2": PackSpec(pack_size=64, cp=2),                                  # alignment padding, CP slices
    "static": PackSpec(pack_size=64, cp=2, tp=2, sp=True, pad_to_max_length=True, pad_cu_seqlens=True),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wire")
    src = tmp / "in.jsonl"
    records = ({"input_ids": list(range(1, 3 + k % 23)), "loss_mask": [k % 2] + [1] * (1 + k % 23)} for k in range(80))
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    made = {}
    for name, spec in SPECS.items():
        pack([str(src)], str(tmp / name), spec)
        made[name] = PackedDataset(tmp / name)
    return made


def _batches(outputs):
    yield "unaligned pack", outputs["unaligned"][0]
    yield "three packs in one row", outputs["unaligned"].micro_batch([1, 2, 3])
    yield "padded pack", outputs["cp2"][4]
    yield "CP rank 1 of 2", outputs["cp2"].micro_batch([5], cp_size=2, cp_rank=1)
    yield "static shapes", outputs["static"][2]
    yield "static shapes, CP rank 0", outputs["static"].micro_batch([3], cp_size=2, cp_rank=0)


def assert_same_batch(got, want):
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, field.name
            assert torch.equal(a, b), field.name
        else:
            assert type(a) is type(b) and a == b, field.name
    assert got.has_padding == want.has_padding


def test_a_batch_pickles_as_one_buffer_and_comes_back_equal(outputs):
    for what, batch in _batches(outputs):
        sent = batch.tokens.clone()
        wire = ForkingPickler.dumps(batch)  # what a DataLoader worker's queue sends
        data_bytes = sum(t.numel() * t.element_size() for t in batch.tensors())
        # The tensors' bytes travel inside the pickle (torch's own reduction would send a
        # shared-memory handle per tensor, a few hundred bytes each, instead).
        assert len(wire) >= data_bytes, what
        back = pickle.loads(wire)
        assert_same_batch(back, batch)
        assert len({t.untyped_storage().data_ptr() for t in back.tensors()}) == 1, what
        if not batch.has_padding:
            assert back.cu_seqlens_padded is back.cu_seqlens, what  # TE's pad_between_seqs test keeps working
        labels = back.labels.clone()
        back.tokens.fill_(7)  # the views are writable and do not overlap
        assert torch.equal(back.labels, labels) and bool((back.tokens == 7).all()), what
        assert torch.equal(batch.tokens, sent), what  # a copy: the sender's batch is untouched


class TaggedBatch(THDBatch):
    """A user's subclass (pickle finds it by module and name)."""


def test_a_subclass_stays_itself(outputs):
    batch = outputs["cp2"][2]
    tagged = TaggedBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)})
    for sent in (tagged, tagged.to("meta")):
        back = pickle.loads(pickle.dumps(sent))
        assert type(back) is TaggedBatch
    assert_same_batch(pickle.loads(pickle.dumps(tagged)), tagged)


def test_copies_shallow_and_deep(outputs):
    batch = outputs["cp2"][3]
    shallow = copy.copy(batch)
    assert all(a is b for a, b in zip(shallow.tensors(), batch.tensors()))
    source = outputs["unaligned"][3]
    deep = copy.deepcopy(source)
    assert_same_batch(deep, source)
    assert deep.cu_seqlens_padded is deep.cu_seqlens and deep.tokens.data_ptr() != source.tokens.data_ptr()


def test_any_dtype_travels(outputs):
    batch = outputs["cp2"][6]
    bf16 = dataclasses.replace(batch, loss_mask=batch.loss_mask.to(torch.bfloat16))  # a user's cast
    assert_same_batch(pickle.loads(ForkingPickler.dumps(bf16)), bf16)


def test_a_batch_off_the_cpu_pickles_field_by_field(outputs):
    batch = outputs["cp2"][1]
    on_meta = batch.to("meta")
    back = pickle.loads(pickle.dumps(on_meta))
    assert back.tokens.device.type == "meta" and back.tokens.shape == batch.tokens.shape
    assert back.has_padding and back.num_real_tokens == batch.num_real_tokens and back.max_seqlen == batch.max_seqlen


@pytest.mark.parametrize("name, cp_size", [("unaligned", 1), ("cp2", 2), ("static", 2)])
def test_loader_workers_serve_what_the_dataset_builds(outputs, name, cp_size):
    ds = outputs[name]
    for rank in range(cp_size):
        loader = THDLoader(ds, cp_size=cp_size, cp_rank=rank, seed=11, device="cpu", num_workers=1)
        order = loader.sampler.epoch_order(0).tolist()
        served = list(loader)
        assert len(served) == len(ds)
        for step, got in enumerate(served):
            assert_same_batch(got, ds.micro_batch(order[step], cp_size=cp_size, cp_rank=rank))

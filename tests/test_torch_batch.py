"""THDBatch built from hand-made packs: exact layouts, static shapes, CP slices, consumers."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from packer_cli.torch import PackedSeqParams, StaticShapeError, THDBatch, cp_partition_indices  # noqa: E402
from packer_cli.torch.batch import CP_MBS_ERROR, PER_TOKEN_FIELDS  # noqa: E402
from packer_cli.torch.testing import make_meta, make_row  # noqa: E402

# thd_layout §3.3: real lengths [5, 3, 9], CP=2 -> multiple 4 -> physical [8, 4, 12]
SAMPLES_539 = [list(range(1, 7)), [7, 8, 9, 10], list(range(11, 21))]


def _batch(samples, multiple=1, pack_size=None, static=False, **meta_kw):
    row = make_row(samples, multiple=multiple)
    pack_size = pack_size or int(row.cu_seqlens[-1])
    return THDBatch.from_row(row, make_meta([row], pack_size=pack_size, multiple=multiple, **meta_kw), static=static)


def test_worked_example_exact():
    b = _batch(SAMPLES_539, multiple=4, cp=2)
    assert b.cu_seqlens.tolist() == [0, 5, 8, 17]
    assert b.cu_seqlens_padded.tolist() == [0, 8, 12, 24]
    assert b.cu_seqlens.dtype == b.cu_seqlens_padded.dtype == torch.int32
    assert b.max_seqlen == 12 and isinstance(b.max_seqlen, int)
    assert b.position_ids.tolist() == [list(range(8)) + list(range(4)) + list(range(12))]
    assert b.seq_idx.tolist() == [[0] * 8 + [1] * 4 + [2] * 12] and b.seq_idx.dtype == torch.int32
    assert torch.nonzero(b.padding_mask[0]).flatten().tolist() == [5, 6, 7, 11, 21, 22, 23]
    assert b.tokens.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0, 7, 8, 9, 0] + list(range(11, 20)) + [0, 0, 0]]
    assert b.labels.tolist() == [
        [2, 3, 4, 5, 6, -100, -100, -100, 8, 9, 10, -100] + list(range(12, 21)) + [-100] * 3
    ]
    assert b.loss_mask.dtype == torch.float32 and b.loss_mask.tolist() == [(~b.padding_mask[0]).float().tolist()]
    assert (b.num_seqs, b.num_real_tokens, b.seqlen_sq_sum, b.num_loss_tokens) == (3, 17, 115, 17)
    assert (b.num_tokens, b.num_segments, b.has_padding) == (24, 3, True)
    assert b.source_index.tolist() == [0, 1, 2] and b.source_index.dtype == torch.int64
    assert all(getattr(b, f).shape == (1, 24) for f in PER_TOKEN_FIELDS)
    assert b.tokens.dtype == b.labels.dtype == b.position_ids.dtype == torch.int64


def test_labels_never_cross_a_boundary_and_follow_targets():
    # input-aligned targets: sample 0 trains only its last 2 tokens (a prompt/answer split)
    row = make_row([[1, 2, 3, 4], [5, 6, 7]], targets=[[0, 0, 1, 1], [1, 1, 1]])
    b = THDBatch.from_row(row, make_meta([row], pack_size=5))
    assert b.cu_seqlens.tolist() == [0, 3, 5] and not b.has_padding
    assert b.labels.tolist() == [[2, 3, 4, 6, 7]]  # label of input 3 is 4 (its own last), not 5
    assert b.loss_mask.tolist() == [[0.0, 1.0, 1.0, 1.0, 1.0]]
    assert b.num_loss_tokens == 4


def test_unpadded_pack_shares_one_boundary_vector():
    b = _batch([[1, 2, 3, 4], [5, 6, 7]])
    assert b.cu_seqlens_padded is b.cu_seqlens
    p = b.packed_seq_params()
    assert p.qkv_format == "thd" and p.cu_seqlens_q is p.cu_seqlens_kv is b.cu_seqlens
    assert p.cu_seqlens_q_padded is None and p.cu_seqlens_kv_padded is None
    assert p.max_seqlen_q == p.max_seqlen_kv == 3 and type(p.max_seqlen_q) is int
    moved = b.to("cpu")
    assert moved.cu_seqlens_padded is moved.cu_seqlens


def test_padded_pack_sets_padded_fields(monkeypatch):
    # The stand-in (tests/test_megatron_core.py covers Megatron-core's own class).
    monkeypatch.setattr("packer_cli.torch.params.packed_seq_params_class", lambda: PackedSeqParams)
    b = _batch(SAMPLES_539, multiple=4)
    p = b.packed_seq_params(with_total_tokens=True)
    assert type(p) is PackedSeqParams
    assert p.cu_seqlens_q.tolist() == [0, 5, 8, 17] and p.cu_seqlens_q_padded.tolist() == [0, 8, 12, 24]
    assert p.cu_seqlens_kv_padded is p.cu_seqlens_q_padded and p.total_tokens == 24
    assert p.cu_seqlens_kv is p.cu_seqlens_q  # the keys' real boundaries too: padding is never attended


def test_tail_segment_when_padded_to_max_length():
    # lengths [3, 2] with multiple 2 -> physical [4, 2]; pack_size 10 -> tail of 4
    b = _batch([[1, 2, 3, 4], [5, 6, 7]], multiple=2, pack_size=10, pad_to_max_length=True)
    assert b.cu_seqlens_padded.tolist() == [0, 4, 6, 10]
    assert b.cu_seqlens.tolist() == [0, 3, 5, 5]  # the tail has no real tokens
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]  # tail restarts at 0
    assert b.padding_mask.tolist() == [[False] * 3 + [True] + [False] * 2 + [True] * 4]
    assert b.labels[0, 6:].tolist() == [-100] * 4 and b.loss_mask[0, 6:].sum() == 0
    assert (b.num_seqs, b.num_segments, b.num_tokens, b.max_seqlen) == (2, 3, 10, 4)


def test_tail_of_unpadded_pack_keeps_one_vector():
    b = _batch([[1, 2, 3, 4], [5, 6, 7]], pack_size=8, pad_to_max_length=True)
    assert b.cu_seqlens is b.cu_seqlens_padded and b.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert b.num_real_tokens == 5 and b.padding_mask[0].tolist() == [False] * 5 + [True] * 3


def test_static_shapes():
    rows = [make_row([[1, 2, 3, 4], [5, 6, 7]], multiple=2), make_row([[1, 2, 3, 4, 5, 6, 7, 8, 9]], multiple=2)]
    meta = make_meta(rows, pack_size=12, multiple=2, pad_to_max_length=True, pad_cu_seqlens=True)
    # max_samples_per_bin 2 -> 4 entries; max_seqlen = max(8, 12 - 6) = 8
    batches = [THDBatch.from_row(r, meta, static=True) for r in rows]
    assert [b.cu_seqlens_padded.tolist() for b in batches] == [[0, 4, 6, 12], [0, 8, 12, 12]]
    # the 2nd pack has no alignment padding, yet carries a real vector too (its tail a
    # zero-length segment): a CUDA graph captured on one pack replays on every other
    assert [b.cu_seqlens.tolist() for b in batches] == [[0, 3, 5, 5], [0, 8, 8, 8]]
    assert {b.num_tokens for b in batches} == {12} and {b.max_seqlen for b in batches} == {8}
    assert all(b.has_padding for b in batches)
    assert [b.padding_mask[0].tolist() for b in batches][1] == [False] * 8 + [True] * 4


def test_static_packs_share_one_packed_seq_params_structure():
    # m = 4 (CP=2): pack 0's sequences need no alignment padding, pack 1's do
    rows = [make_row([list(range(1, 6)), list(range(1, 10))], multiple=4),
            make_row([list(range(1, 7)), list(range(1, 5))], multiple=4)]
    meta = make_meta(rows, pack_size=32, multiple=4, cp=2, pad_to_max_length=True, pad_cu_seqlens=True)
    params = [THDBatch.from_row(r, meta, static=True).packed_seq_params() for r in rows]

    def structure(p):
        fields = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
        return [(f, None if getattr(p, f) is None else tuple(getattr(p, f).shape)) for f in fields] + [
            ("max_seqlen_q", p.max_seqlen_q), ("max_seqlen_kv", p.max_seqlen_kv)]

    assert structure(params[0]) == structure(params[1])
    assert params[0].cu_seqlens_q_padded is not None
    assert params[0].cu_seqlens_q.tolist() == [0, 4, 12, 12] and params[0].cu_seqlens_q_padded.tolist() == [0, 4, 12, 32]
    # without static shapes a pack without alignment padding keeps one vector (FlashAttention)
    assert THDBatch.from_row(rows[0], meta).packed_seq_params().cu_seqlens_q_padded is None


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m["spec"].update(pad_to_max_length=False), "pad_to_max_length"),
        (lambda m: m["bridge"].pop("max_samples_per_bin"), "max_samples_per_bin"),
        (lambda m: m.pop("bridge"), "missing"),
        (lambda m: m["bridge"].update(max_samples_per_bin=1), "max_samples_per_bin allows 1"),
        (lambda m: m["bridge"].update(dataset_max_seqlen=2, min_packed_seqlen=10), "exceeds the static max_seqlen"),
    ],
)
def test_static_errors(change, match):
    row = make_row([[1, 2, 3, 4], [5, 6, 7]], multiple=2)
    meta = make_meta([row], pack_size=12, multiple=2, pad_to_max_length=True)
    change(meta)
    with pytest.raises(StaticShapeError, match=match):
        THDBatch.from_row(row, meta, static=True)


def test_for_cp_rank_slices_tokens_only_and_partitions():
    b = _batch(SAMPLES_539, multiple=4, cp=2)
    slices = [b.for_cp_rank(2, r) for r in range(2)]
    for r, s in enumerate(slices):
        idx = cp_partition_indices(b.cu_seqlens_padded, 24, 2, r).long()
        for f in PER_TOKEN_FIELDS:
            if f == "seq_idx":  # [1, T] whole, as the THD contract has it: a Mamba mixer under CP sees every token
                assert getattr(s, f) is b.seq_idx and b.seq_idx.shape == (1, 24)
                continue
            assert torch.equal(getattr(s, f), getattr(b, f)[:, idx])
            assert getattr(s, f).shape == (1, 12)
        assert s.cu_seqlens is b.cu_seqlens and s.cu_seqlens_padded is b.cu_seqlens_padded
        assert (s.max_seqlen, s.seqlen_sq_sum, s.num_tokens, s.cp_size, s.cp_rank) == (12, 115, 24, 2, r)
    assert slices[0].position_ids.tolist() == [[0, 1, 6, 7, 0, 3, 0, 1, 2, 9, 10, 11]]
    together = torch.cat([s.tokens for s in slices], 1)
    assert sorted(together[0].tolist()) == sorted(b.tokens[0].tolist())
    assert b.for_cp_rank(1, 0) is b


def test_for_cp_rank_rejects_misaligned_data_and_double_slicing():
    b = _batch(SAMPLES_539, multiple=2)  # physical [6, 4, 10]: not multiples of 4
    with pytest.raises(ValueError, match="not divisible by 2\\*cp_size=4"):
        b.for_cp_rank(2, 0)
    ok = _batch(SAMPLES_539, multiple=4)
    with pytest.raises(ValueError, match="already sliced"):
        ok.for_cp_rank(2, 0).for_cp_rank(2, 1)


def test_concat_offsets_boundaries_and_rejects_cp():
    a = _batch([[1, 2, 3, 4], [5, 6, 7]], multiple=2, pack_size=8, pad_to_max_length=True)
    b = _batch(SAMPLES_539, multiple=4)
    c = THDBatch.concat([a, b])
    assert a.cu_seqlens_padded.tolist() == [0, 4, 6, 8]
    assert c.cu_seqlens_padded.tolist() == [0, 4, 6, 8, 16, 20, 32]
    assert c.cu_seqlens.tolist() == [0, 3, 5, 5, 10, 13, 22]
    assert c.seq_idx.tolist() == [[0] * 4 + [1] * 2 + [2] * 2 + [3] * 8 + [4] * 4 + [5] * 12]
    assert (c.num_tokens, c.num_seqs, c.num_packs, c.num_segments, c.max_seqlen) == (32, 5, 2, 6, 12)
    assert c.seqlen_sq_sum == 9 + 4 + 115 and c.source_index.tolist() == [0, 1, 0, 1, 2]
    assert torch.equal(c.tokens, torch.cat([a.tokens, b.tokens], 1))
    with pytest.raises(ValueError, match=CP_MBS_ERROR.replace("(", "\\(").replace(")", "\\)")):
        c.for_cp_rank(2, 0)
    d = THDBatch.concat([_batch([[1, 2, 3]]), _batch([[4, 5, 6, 7]])])
    assert d.cu_seqlens is d.cu_seqlens_padded and d.cu_seqlens.tolist() == [0, 2, 5]
    with pytest.raises(ValueError, match=r"^concatenate at least one pack \(got an empty list\)$"):
        THDBatch.concat([])  # was an IndexError from inside the concatenation


def test_flash_attn_and_hf_kwargs():
    row = make_row([[1, 2, 3, 4], [5, 6, 7]], multiple=2, targets=[[0, 0, 1, 1], [1, 1, 1]])
    b = THDBatch.from_row(row, make_meta([row], pack_size=6, multiple=2))
    fa = b.flash_attn_kwargs()
    assert fa["cu_seqlens_q"] is fa["cu_seqlens_k"] is b.cu_seqlens_padded
    assert fa["max_seqlen_q"] == fa["max_seqlen_k"] == b.max_seqlen == 4
    hf = b.hf_kwargs()
    assert set(hf) == {"input_ids", "labels", "shift_labels", "position_ids", "use_cache", "cu_seq_lens_q",
                       "cu_seq_lens_k", "max_length_q", "max_length_k"} and hf["use_cache"] is False
    assert hf["labels"].tolist() == [[-100, 3, 4, -100, 6, 7]] and hf["shift_labels"] is hf["labels"]
    assert hf["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1]]


def test_hf_loss_uses_preshifted_labels():
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    b = _batch(SAMPLES_539, multiple=4)
    logits = torch.randn(1, b.num_tokens, 32, generator=torch.Generator().manual_seed(0))
    hf = b.hf_kwargs()
    ours = torch.nn.functional.cross_entropy(logits[0], hf["labels"][0], ignore_index=-100)
    theirs = loss_utils.ForCausalLMLoss(logits, hf["labels"], 32, shift_labels=hf["shift_labels"])
    assert torch.allclose(ours, theirs)


@pytest.mark.parametrize("with_tail", [False, True])
def test_hf_recovers_boundaries_from_position_ids(with_tail):
    fa_utils = pytest.importorskip("transformers.modeling_flash_attention_utils")
    pack_size = 32 if with_tail else 24
    b = _batch(SAMPLES_539, multiple=4, pack_size=pack_size, pad_to_max_length=with_tail)
    (cu_q, cu_k), (max_q, _) = fa_utils.prepare_fa_kwargs_from_position_ids(b.position_ids)
    assert cu_q.tolist() == b.cu_seqlens_padded.tolist() and int(max_q) == b.max_seqlen


def test_fallback_params_have_megatron_field_names():
    names = [f.name for f in dataclasses.fields(PackedSeqParams)]
    assert names == [
        "qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
        "max_seqlen_q", "max_seqlen_kv", "local_cp_size", "cp_group", "total_tokens", "seq_idx",
        "tokens_per_sample", "pad_between_seqs", "cp_scatter_cache",
    ]  # fmt: skip


def test_malformed_rows_are_rejected():
    row = make_row([[1, 2, 3, 4]], multiple=2)
    row.seq_lens = row.seq_lens + 5
    with pytest.raises(ValueError, match="seq_lens"):
        THDBatch.from_row(row, make_meta([row], pack_size=4))
    row = make_row([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="more than pack_size"):
        THDBatch.from_row(row, make_meta([row], pack_size=2, pad_to_max_length=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_cuda_keeps_identity_and_host_ints():
    for samples, mult in ((SAMPLES_539, 4), ([[1, 2, 3]], 1)):
        b = _batch(samples, multiple=mult).pin_memory()
        g = b.to("cuda", non_blocking=True)
        assert g.tokens.is_cuda and g.cu_seqlens.is_cuda and type(g.max_seqlen) is int
        assert (g.cu_seqlens_padded is g.cu_seqlens) == (b.cu_seqlens_padded is b.cu_seqlens)
        assert torch.equal(g.for_cp_rank(1, 0).tokens.cpu(), b.tokens)


def test_to_blocks_towards_the_cpu_only(monkeypatch):
    # a non-blocking copy from a GPU hands back host memory the DMA may not have filled yet;
    # towards a device it stays asynchronous (pinned memory, no host sync)
    b = _batch([[1, 2, 3, 4], [5, 6, 7]], multiple=2)
    seen = []
    to = torch.Tensor.to

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("non_blocking"))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording)
    b.to("cpu")
    assert seen and set(seen) == {False}
    seen.clear()
    moved = b.to("meta")  # a device other than the CPU, available without a GPU
    assert set(seen) == {True} and moved.tokens.device.type == "meta"
    seen.clear()
    b.to("cpu", non_blocking=True)
    assert set(seen) == {True}


def test_hf_kwargs_refuse_a_transformers_that_would_shift_the_labels_again(monkeypatch):
    """transformers 4.46-4.49's ForCausalLMLoss has no shift_labels: the model swallows it in
    **kwargs and shifts the pre-shifted labels once more, a silently wrong loss."""
    import sys
    import types

    from packer_cli.torch import batch as batch_module

    def old_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
        raise AssertionError("not called")

    fake = types.ModuleType("transformers")
    fake.__version__ = "4.46.3"
    loss_pkg, loss_utils = types.ModuleType("transformers.loss"), types.ModuleType("transformers.loss.loss_utils")
    loss_utils.ForCausalLMLoss = old_loss
    for name, module in (("transformers", fake), ("transformers.loss", loss_pkg),
                         ("transformers.loss.loss_utils", loss_utils)):
        monkeypatch.setitem(sys.modules, name, module)
    batch_module._hf_loss_takes_shift_labels.cache_clear()
    try:
        b = _batch(SAMPLES_539, multiple=4)
        with pytest.raises(RuntimeError, match=r"transformers 4\.46\.3 shifts the labels itself"):
            b.hf_kwargs()
    finally:
        batch_module._hf_loss_takes_shift_labels.cache_clear()
    monkeypatch.undo()
    pytest.importorskip("transformers.loss.loss_utils")  # the real one takes them
    assert "shift_labels" in b.hf_kwargs()


@pytest.mark.parametrize("multiple", [1, 2])
def test_a_batch_moved_off_the_cpu_keeps_host_copies_of_its_boundaries(multiple):
    """Every tensor moved, so host code that needed the boundaries read them back from the GPU
    (a device sync); the THD contract asks for host copies."""
    b = _batch([[1, 2, 3, 4], [5, 6, 7]], multiple=multiple)
    assert b.cu_seqlens_cpu is b.cu_seqlens and b.cu_seqlens_padded_cpu is b.cu_seqlens_padded
    assert b.host_cu_seqlens is None
    moved = b.to("meta")  # a device other than the CPU, available without a GPU
    assert moved.cu_seqlens.device.type == "meta"
    assert moved.cu_seqlens_cpu is b.cu_seqlens and moved.cu_seqlens_padded_cpu is b.cu_seqlens_padded
    assert (moved.cu_seqlens_padded_cpu is moved.cu_seqlens_cpu) == (multiple == 1)
    sliced = moved.for_cp_rank(1, 0)
    assert sliced.cu_seqlens_cpu is b.cu_seqlens
    back = b.to("cpu")
    assert back.host_cu_seqlens is None and back.cu_seqlens_cpu is back.cu_seqlens
    import pickle
    again = pickle.loads(pickle.dumps(b))
    assert again.host_cu_seqlens is None and torch.equal(again.cu_seqlens_cpu, b.cu_seqlens)


def test_static_packs_of_an_unaligned_output_keep_one_boundary_vector():
    """pad_seq_to_mult=1: no pack can have alignment padding, so static batches carry one vector
    (cu_seqlens_padded is cu_seqlens, no padded PackedSeqParams fields: TE keeps FlashAttention);
    only m > 1 makes every static pack carry two."""
    rows = [make_row([[1, 2, 3, 4], [5, 6, 7]]), make_row([[1, 2, 3, 4, 5, 6, 7, 8, 9]])]
    meta = make_meta(rows, pack_size=12, multiple=1, pad_to_max_length=True, pad_cu_seqlens=True)
    batches = [THDBatch.from_row(r, meta, static=True) for r in rows]
    assert [b.cu_seqlens.tolist() for b in batches] == [[0, 3, 5, 12], [0, 8, 12, 12]]
    assert not any(b.has_padding for b in batches)
    assert all(b.packed_seq_params().cu_seqlens_q_padded is None for b in batches)


def test_hf_kwargs_refuse_a_transformers_without_a_loss_module(monkeypatch):
    """Before 4.46 transformers had no transformers.loss: each model shifted the labels inline,
    so the pre-shifted labels would be shifted again."""
    import sys
    import types

    from packer_cli.torch import batch as batch_module

    fake = types.ModuleType("transformers")
    fake.__version__ = "4.45.2"
    monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.setitem(sys.modules, "transformers.loss", None)  # its import raises ImportError
    monkeypatch.delitem(sys.modules, "transformers.loss.loss_utils", raising=False)
    batch_module._hf_loss_takes_shift_labels.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"transformers 4\.45\.2 shifts the labels itself"):
            _batch(SAMPLES_539, multiple=4).hf_kwargs()
    finally:
        batch_module._hf_loss_takes_shift_labels.cache_clear()


def test_static_max_seqlen_of_a_full_pack_is_no_multiple_of_pack_size_when_m_is_pack_size():
    """A sequence fills a pack and pad_seq_to_mult == pack_size: the served max_seqlen is
    pack_size + 1, not pack_size + m = 2 * pack_size, which is the length of a 2-pack static row
    (Megatron-core's unfused THD RoPE would rotate each sequence from its offset in the row)."""
    rows = [make_row([list(range(1, 10))], multiple=8), make_row([list(range(1, 6))], multiple=8)]
    meta = make_meta(rows, pack_size=8, multiple=8, pad_to_max_length=True, pad_cu_seqlens=True)
    batches = [THDBatch.from_row(r, meta, static=True) for r in rows]
    assert {b.max_seqlen for b in batches} == {9}
    row = THDBatch.concat(batches)
    assert row.num_tokens == 16 and row.max_seqlen % 8 != 0


def test_concat_of_a_concatenated_row_counts_every_stored_pack():
    ab = THDBatch.concat([_batch([[1, 2, 3]]), _batch([[4, 5, 6, 7]])])
    abc = THDBatch.concat([ab, _batch([[8, 9]])])
    assert (ab.num_packs, abc.num_packs, abc.num_seqs) == (2, 3, 3)


def test_total_tokens_of_a_cp_slice_are_the_whole_pack(monkeypatch):
    """Boundaries and seq_idx stay whole under CP, so Megatron's total_tokens is the pack's T, not
    the T/CP tokens the rank holds."""
    monkeypatch.setattr("packer_cli.torch.params.packed_seq_params_class", lambda: PackedSeqParams)
    b = _batch(SAMPLES_539, multiple=4, cp=2)
    for r in range(2):
        p = b.for_cp_rank(2, r).packed_seq_params(with_total_tokens=True)
        assert p.total_tokens == 24 == int(p.cu_seqlens_q_padded[-1])


def test_total_tokens_is_set_only_when_asked(monkeypatch):
    """A class with a total_tokens field (the stand-in, newer Megatron-core) gets None by default:
    int(None) made every plain packed_seq_params() call a TypeError."""
    monkeypatch.setattr("packer_cli.torch.params.packed_seq_params_class", lambda: PackedSeqParams)
    b = _batch(SAMPLES_539, multiple=4)
    assert b.packed_seq_params().total_tokens is None
    p = b.packed_seq_params(with_total_tokens=True)
    assert type(p.total_tokens) is int and p.total_tokens == b.num_tokens == 24


def test_a_megatron_class_with_cp_partition_mode_is_told_zigzag(monkeypatch):
    """Newer Megatron-core has cp_partition_mode; our CP slices are TE's zig-zag, so that is the
    mode it must be given (its own default would slice the rows differently)."""

    @dataclasses.dataclass
    class NewerPackedSeqParams(PackedSeqParams):
        cp_partition_mode: str = "contiguous"

    monkeypatch.setattr("packer_cli.torch.params.packed_seq_params_class", lambda: NewerPackedSeqParams)
    p = _batch(SAMPLES_539, multiple=4, cp=2).packed_seq_params()
    assert type(p) is NewerPackedSeqParams and p.cp_partition_mode == "zigzag"
    monkeypatch.setattr("packer_cli.torch.params.packed_seq_params_class", lambda: PackedSeqParams)
    assert not hasattr(_batch(SAMPLES_539, multiple=4, cp=2).packed_seq_params(), "cp_partition_mode")


def test_make_packed_seq_params_gives_host_ints_for_max_seqlen():
    """TE reads max_seqlen_q/kv as Python ints (a tensor means a .item() sync, which CUDA graphs
    forbid); a NumPy int or a 0-d tensor given is turned into one."""
    from packer_cli.torch.params import make_packed_seq_params

    cu = torch.tensor([0, 5, 8, 17], dtype=torch.int32)
    for given in (np.int64(9), torch.tensor(9)):
        p = make_packed_seq_params(cu, None, given)
        assert type(p.max_seqlen_q) is int and type(p.max_seqlen_kv) is int and p.max_seqlen_q == p.max_seqlen_kv == 9

"""The THD batch contract checked against references written from the layout note, not from the code.

* every tensor of random packs (CP 1-8 with TP/SP multiples, tails, one-token sequences,
  sequences of exactly the multiple) equals a slow per-token Python construction;
* the consumers: a Hugging Face model trained on ``hf_kwargs()`` sees each sequence alone,
  and the kwargs of whole-row consumers are refused for a CP slice;
* host reads: the loader's device-side steps read nothing back, in-batch packing reads once.
"""

import math
import random

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from packer_cli.torch import THDBatch, cp_partition_indices, pack_batch_sequences, pad_multiple  # noqa: E402
from packer_cli.torch.testing import make_meta, make_row  # noqa: E402


def reference(samples, targets, m, t, cp, rank, pad_id):
    """Per-token lists of one pack as the layout note describes it, then rank ``rank``'s slice."""
    s = [len(x) - 1 for x in samples]
    p = [-(-n // m) * m for n in s]
    tail = t - sum(p)
    seg_p = p + ([tail] if tail else [])
    cu_pad = [0]
    for n in seg_p:
        cu_pad.append(cu_pad[-1] + n)
    cols = {k: [] for k in ("tokens", "labels", "loss_mask", "position_ids", "seq_idx", "padding_mask")}

    def put(tok, lab, loss, pos, seq, pad):
        for k, v in zip(cols, (tok, lab, loss, pos, seq, pad)):
            cols[k].append(v)

    for i, (x, n, phys) in enumerate(zip(samples, s, p)):
        for j in range(phys):  # inputs x[:-1], targets x[1:] of the same sequence; padding keeps counting
            if j < n:
                put(x[j], x[j + 1], float(targets[i][j + 1]), j, i, False)
            else:
                put(pad_id, -100, 0.0, j, i, True)
    for j in range(tail):  # the tail segment restarts its positions
        put(pad_id, -100, 0.0, j, len(samples), True)
    padded = s != p
    cu_real = [0]
    for n in s + ([0] if tail else []):
        cu_real.append(cu_real[-1] + n)
    idx = list(range(t))
    if cp > 1:  # thd_layout §3.3: chunk r and 2cp-1-r of every segment
        idx = []
        for o, e in zip(cu_pad[:-1], cu_pad[1:]):
            c = (e - o) // (2 * cp)
            idx += list(range(o + rank * c, o + (rank + 1) * c))
            idx += list(range(o + (2 * cp - 1 - rank) * c, o + (2 * cp - rank) * c))
    out = {k: [v[i] for i in idx] if k != "seq_idx" else v for k, v in cols.items()}  # seq_idx: [1, T] whole
    out.update(
        cu_seqlens=cu_real if padded else cu_pad, cu_seqlens_padded=cu_pad, max_seqlen=max(seg_p),
        num_seqs=len(s), num_real_tokens=sum(s), seqlen_sq_sum=sum(n * n for n in s),
        num_loss_tokens=int(sum(cols["loss_mask"])), num_tokens=t, num_segments=len(seg_p),
    )
    return out, padded


DTYPES = dict(tokens=torch.int64, labels=torch.int64, loss_mask=torch.float32, position_ids=torch.int64,
              seq_idx=torch.int32, padding_mask=torch.bool)


@pytest.mark.parametrize("seed", range(4))
def test_random_packs_match_the_reference(seed):
    rng = random.Random(seed)
    for _ in range(150):
        cp, tp, sp = rng.choice([1, 1, 2, 3, 4, 8]), rng.choice([1, 2, 4]), rng.random() < 0.5
        m = pad_multiple(cp, tp, sp) * rng.choice([1, 1, 2])
        lengths = [rng.choice([1, m, 2 * m, rng.randint(1, 40)]) for _ in range(rng.choice([1, 2, 3, 6]))]
        samples = [[rng.randint(1, 999) for _ in range(n + 1)] for n in lengths]
        targets = [[rng.randint(0, 1) for _ in x] for x in samples]
        pad_id = rng.choice([0, 100277])
        row = make_row(samples, multiple=m, targets=targets, pad_id=pad_id)
        tail = rng.choice([0, 0, 1, 3]) * math.lcm(m, 2 * cp if cp > 1 else 1)
        t = int(row.cu_seqlens[-1]) + tail
        meta = make_meta([row], pack_size=t, multiple=m, cp=cp, pad_id=pad_id, pad_to_max_length=tail > 0)
        rank = rng.randrange(cp)
        b = THDBatch.from_row(row, meta).for_cp_rank(cp, rank)
        want, padded = reference(samples, targets, m, t, cp, rank, pad_id)
        for name, dtype in DTYPES.items():
            got = getattr(b, name)
            assert got.dtype == dtype and got.shape == (1, t if name == "seq_idx" else t // cp), name
            assert got.is_contiguous(), name
            assert got[0].tolist() == want[name], (name, lengths, m, t, cp, rank)
        assert b.cu_seqlens.dtype == b.cu_seqlens_padded.dtype == torch.int32
        assert b.cu_seqlens.tolist() == want["cu_seqlens"] and b.cu_seqlens_padded.tolist() == want["cu_seqlens_padded"]
        assert b.has_padding == padded
        for name in ("max_seqlen", "num_seqs", "num_real_tokens", "seqlen_sq_sum", "num_loss_tokens", "num_tokens",
                     "num_segments"):
            assert type(getattr(b, name)) is int and getattr(b, name) == want[name], name


# -- consumers ------------------------------------------------------------------------------------


def _tiny_llama(attn):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().train()  # training, as the loader is used


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("multiple, tail", [(1, 0), (4, 0), (2, 8)])
def test_hf_model_on_hf_kwargs_sees_each_sequence_alone(attn, multiple, tail):
    model = _tiny_llama(attn)
    samples = [[5, 9, 3, 7, 1, 2], [8, 4, 6], [3, 3, 9, 10, 11, 12, 13, 2]]
    row = make_row(samples, multiple=multiple)
    t = int(row.cu_seqlens[-1]) + tail
    b = THDBatch.from_row(row, make_meta([row], pack_size=t, multiple=multiple, pad_to_max_length=tail > 0))
    with torch.no_grad():
        packed = model(**b.hf_kwargs()).loss
        alone = [torch.nn.functional.cross_entropy(model(input_ids=torch.tensor([x[:-1]])).logits[0],
                                                   torch.tensor(x[1:]), reduction="sum") for x in samples]
    # transformers computes its loss in float32
    assert abs(float(packed) - float(sum(alone)) / b.num_loss_tokens) < 1e-5


def test_readmes_loss_from_logits_is_the_models_own_loss():
    """docs/LOADER.md's recipe for a model that would shift the labels again: logits and hf_kwargs()'s
    labels give the loss transformers computes, per target token."""
    model = _tiny_llama("sdpa")
    samples = [[5, 9, 3, 7, 1, 2], [8, 4, 6], [3, 3, 9, 10, 11, 12, 13, 2]]
    row = make_row(samples, multiple=4, targets=[[0, 0, 0, 1, 1, 1], [0, 0, 1], [0, 0, 0, 0, 1, 1, 1, 1]])
    b = THDBatch.from_row(row, make_meta([row], pack_size=int(row.cu_seqlens[-1]) + 8, multiple=4,
                                         pad_to_max_length=True))
    with torch.no_grad():
        theirs = model(**b.hf_kwargs()).loss
        kw = b.hf_kwargs(); labels = kw.pop("labels"); kw.pop("shift_labels")  # noqa: E702 - as docs/LOADER.md
        logits = model(**kw).logits
        loss = torch.nn.functional.cross_entropy(logits[0].float(), labels[0], ignore_index=-100,
                                                 reduction="sum") / max(b.num_loss_tokens, 1)
    assert b.num_loss_tokens == 3 + 1 + 4  # prompts untrained
    assert abs(float(loss) - float(theirs)) < 1e-6


@pytest.mark.parametrize("tail", [0, 8])
def test_hf_kwargs_carry_the_flash_attention_boundaries(tail):
    # Without them transformers' flash-attention path finds the boundaries from position_ids in
    # every layer: a nonzero and two scalar reads, each a device sync, per layer and step.
    fa_utils = pytest.importorskip("transformers.modeling_flash_attention_utils")
    row = make_row([[5, 9, 3, 7, 1, 2], [8, 4, 6], [3, 3, 9, 10, 11, 12, 13, 2]], multiple=4)
    t = int(row.cu_seqlens[-1]) + tail
    b = THDBatch.from_row(row, make_meta([row], pack_size=t, multiple=4, pad_to_max_length=tail > 0))
    hf = b.hf_kwargs()
    (cu_q, cu_k), (max_q, max_k) = fa_utils.prepare_fa_kwargs_from_position_ids(b.position_ids)
    assert hf["cu_seq_lens_q"].tolist() == hf["cu_seq_lens_k"].tolist() == cu_q.tolist() == cu_k.tolist()
    assert hf["cu_seq_lens_q"].dtype == torch.int32 and hf["max_length_q"] == hf["max_length_k"] == int(max_q)
    assert type(hf["max_length_q"]) is int


def test_whole_row_consumers_refuse_a_cp_slice():
    row = make_row([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], multiple=4)
    b = THDBatch.from_row(row, make_meta([row], pack_size=12, multiple=4, cp=2))
    assert b.flash_attn_kwargs()["cu_seqlens_q"][-1] == b.tokens.shape[1]
    part = b.for_cp_rank(2, 1)
    # its boundaries describe 12 tokens, it holds 6: flash-attn would index past them, HF would
    # find sequences in zig-zag positions
    for consumer in (part.flash_attn_kwargs, part.hf_kwargs):
        with pytest.raises(ValueError, match="CP rank 1 of 2"):
            consumer()
    assert part.packed_seq_params().cu_seqlens_q is b.cu_seqlens  # TE's: global boundaries, fine


# -- host reads -----------------------------------------------------------------------------------


class HostReads(TorchDispatchMode):
    """Record every op that reads device data back to the host (a sync on CUDA), on any device:
    scalar reads, ``nonzero`` and its users (boolean-mask indexing), ``repeat_interleave``
    without ``output_size``. ``.tolist()`` of a CPU tensor bypasses the dispatcher, so it
    is counted by patching it (``count_tolist``)."""

    SYNCING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_consecutive",
               "aten::_unique2", "aten::unique_dim"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in self.SYNCING:
            self.reads.append(name)
        elif name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        ):
            self.reads.append(name + " (boolean mask)")
        elif name == "aten::repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None:
            self.reads.append(name + " (no output_size)")
        return func(*args, **kwargs)


@pytest.fixture
def host_reads(monkeypatch):
    mode = HostReads()
    tolist = torch.Tensor.tolist

    def counted(self):
        mode.reads.append("tolist")
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return mode


def test_device_side_steps_read_nothing_back(host_reads):
    rows = [make_row([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], multiple=4), make_row([[1, 2, 3, 4, 5]], multiple=4)]
    meta = make_meta(rows, pack_size=16, multiple=4, cp=2, pad_to_max_length=True, pad_cu_seqlens=True)
    a, b = (THDBatch.from_row(r, meta, static=True) for r in rows)
    with host_reads:
        THDBatch.concat([a, b]).to("cpu").packed_seq_params(with_total_tokens=True)
        idx = cp_partition_indices(a.cu_seqlens_padded, a.num_tokens, 2, 1)
        a.tokens.index_select(1, idx)
        a.hf_kwargs(), a.flash_attn_kwargs()
    assert host_reads.reads == []


def test_in_batch_packing_reads_the_host_once(host_reads):
    tokens = torch.tensor([[1, 2, 3, 0], [0, 0, 0, 0], [4, 5, 0, 0]])
    for mask in (None, tokens != 0):
        host_reads.reads.clear()
        with host_reads:
            out = pack_batch_sequences(tokens, tokens + 1, torch.ones(3, 4), None, torch.arange(4).expand(3, 4),
                                       pad_to_multiple_of=4, padding_mask=mask)
        # the output's size depends on the data: one read, and no boolean mask (each is another sync)
        assert len(host_reads.reads) == 1, host_reads.reads
        assert out[0].tolist() == [[1, 2, 3, 0, 4, 5, 0, 0]] and out[5].tolist() == [0, 4, 8]
        assert out[4].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]] and int(out[6]) == 4


def test_num_segments_of_a_row_of_static_packs():
    rows = [make_row([[1, 2, 3]], multiple=2), make_row([[1, 2, 3, 4, 5], [6, 7, 8]], multiple=2)]
    meta = make_meta(rows, pack_size=8, multiple=2, pad_to_max_length=True, pad_cu_seqlens=True)
    b = THDBatch.concat([THDBatch.from_row(r, meta, static=True) for r in rows])
    assert b.cu_seqlens_padded.tolist() == [0, 2, 8, 8, 12, 14, 16]
    # 5 segments carry tokens, but the first pack's repeat (8, 8) sits between them: the slice
    # [: num_segments + 1] keeps it and drops only trailing repeats
    assert b.num_segments == 6 and b.cu_seqlens_padded[b.num_segments] == b.num_tokens
    assert b.seq_idx[0].tolist() == [0] * 2 + [1] * 6 + [3] * 4 + [4] * 2 + [5] * 2

"""Proof of correctness: a packed batch trains exactly like its samples run one by one.

A tiny causal transformer in float64 reads only what a THD consumer reads: attention is
allowed between two tokens iff they are in the same segment of ``cu_seqlens_padded``, the
key is a real token (``cu_seqlens``) and not in the future; positions come from
``position_ids``. Its per-token losses on a packed batch must equal (1e-9) the losses of
each sample run alone, for every padding multiple, with a tail segment, under CP slicing,
and on packs written by ``packer_cli.pack``.
"""

import json
import math

import pytest

torch = pytest.importorskip("torch")

from packer_cli.torch import PackedDataset, THDBatch, cp_partition_indices  # noqa: E402
from packer_cli.torch.testing import make_meta, make_row  # noqa: E402

VOCAB, MAX_POS = 50, 128


class TinyCausalLM(torch.nn.Module):
    def __init__(self, d=16, heads=2, layers=2):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.pos = torch.nn.Embedding(MAX_POS, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                dict(
                    ln1=torch.nn.LayerNorm(d),
                    qkv=torch.nn.Linear(d, 3 * d),
                    out=torch.nn.Linear(d, d),
                    ln2=torch.nn.LayerNorm(d),
                    mlp=torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)),
                )
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, tokens, positions, allowed):
        """tokens, positions: [T]; allowed: [T, T] bool (query, key)."""
        x = self.emb(tokens) + self.pos(positions)
        t, d = x.shape
        dh = d // self.heads
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(t, 3, self.heads, dh).permute(1, 2, 0, 3)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
            attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            x = x + blk["out"]((attn @ v).transpose(0, 1).reshape(t, d))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.head(x)


def thd_mask(cu_seqlens, cu_seqlens_padded, total):
    """Attention allowed from boundaries only: same segment, real key, causal."""
    t = torch.arange(total)
    seg = torch.searchsorted(cu_seqlens_padded[1:].long(), t, right=True)
    real_len = (cu_seqlens[1:] - cu_seqlens[:-1]).long()[seg]
    real = (t - cu_seqlens_padded[:-1].long()[seg]) < real_len
    allowed = (seg[:, None] == seg[None, :]) & (t[None, :] <= t[:, None]) & real[None, :]
    return allowed | torch.eye(total, dtype=torch.bool)  # a padding query sees itself (no NaN)


def packed_losses(model, b: THDBatch):
    logits = model(b.tokens[0], b.position_ids[0], thd_mask(b.cu_seqlens, b.cu_seqlens_padded, b.num_tokens))
    return torch.nn.functional.cross_entropy(logits, b.labels[0].clamp(min=0), reduction="none")


def alone_losses(model, sample):
    x = torch.tensor(sample)
    s = x.numel() - 1
    logits = model(x[:-1], torch.arange(s), torch.ones(s, s, dtype=torch.bool).tril())
    return torch.nn.functional.cross_entropy(logits, x[1:], reduction="none")


def assert_equivalent(model, b: THDBatch, samples):
    """Every real position of every sequence: same label, same loss as the sample alone."""
    losses = packed_losses(model, b)
    # sequence starts: position 0 on a real token (a tail segment starts on padding)
    starts = torch.nonzero((b.position_ids[0] == 0) & ~b.padding_mask[0]).flatten().tolist()
    assert len(starts) == b.num_seqs
    seen = 0
    for i, src in enumerate(b.source_index.tolist()):
        sample = samples[src]
        s = len(sample) - 1
        sl = slice(starts[i], starts[i] + s)
        assert b.labels[0, sl].tolist() == sample[1:]
        assert b.tokens[0, sl].tolist() == sample[:-1]
        assert torch.allclose(losses[sl], alone_losses(model, sample), rtol=0, atol=1e-9)
        seen += s
    assert seen == b.num_real_tokens
    assert int(b.loss_mask.sum()) == b.num_loss_tokens


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyCausalLM().double().eval()


def _samples(seed, n):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 20, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("multiple", [1, 2, 4, 8])
@pytest.mark.parametrize("tail", [0, 8])
@pytest.mark.parametrize("seed", [0, 1])
@torch.no_grad()
def test_packed_losses_equal_samples_alone(model, multiple, tail, seed):
    samples = _samples(seed, 5)
    row = make_row(samples, multiple=multiple)
    pack_size = int(row.cu_seqlens[-1]) + tail
    b = THDBatch.from_row(row, make_meta([row], pack_size=pack_size, multiple=multiple, pad_to_max_length=tail > 0))
    assert b.num_tokens == pack_size
    assert_equivalent(model, b, samples)


@pytest.mark.parametrize("cp", [2, 4])
@torch.no_grad()
def test_cp_slices_carry_the_same_losses(model, cp):
    samples = _samples(7, 4)
    row = make_row(samples, multiple=2 * cp)
    b = THDBatch.from_row(row, make_meta([row], pack_size=int(row.cu_seqlens[-1]), multiple=2 * cp, cp=cp))
    full = packed_losses(model, b) * b.loss_mask[0]
    total = 0.0
    covered = []
    for r in range(cp):
        part = b.for_cp_rank(cp, r)
        idx = cp_partition_indices(b.cu_seqlens_padded, b.num_tokens, cp, r).long()
        assert torch.equal(part.labels[0], b.labels[0, idx]) and torch.equal(part.position_ids[0], b.position_ids[0, idx])
        total += float((full[idx] * part.loss_mask[0]).sum())
        covered += idx.tolist()
    assert sorted(covered) == list(range(b.num_tokens))
    assert abs(total - float(full.sum())) < 1e-9  # per-token loss sums reduce exactly over CP


@torch.no_grad()
def test_concatenated_packs_are_equivalent(model):
    samples = _samples(3, 6)
    rows = [make_row(samples[:3], multiple=2, source_index=[0, 1, 2]), make_row(samples[3:], multiple=2, source_index=[3, 4, 5])]
    meta = make_meta(rows, pack_size=64, multiple=2, pad_to_max_length=True)
    b = THDBatch.concat([THDBatch.from_row(r, meta) for r in rows])
    assert b.num_tokens == 128
    assert_equivalent(model, b, samples)


@pytest.mark.parametrize("pad_to_max_length", [False, True])
@torch.no_grad()
def test_packer_output_is_equivalent(model, tmp_path, pad_to_max_length):
    packer = pytest.importorskip("packer_cli")
    samples = _samples(11, 40)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in samples))
    spec = packer.PackSpec(pack_size=48, cp=2, pad_to_max_length=pad_to_max_length, pad_cu_seqlens=pad_to_max_length)
    packer.pack([str(src)], str(tmp_path / "out"), spec)
    ds = PackedDataset(tmp_path / "out")
    assert ds.static == pad_to_max_length
    seen = []
    for i in range(len(ds)):
        b = ds[i]
        assert_equivalent(model, b, samples)
        seen += b.source_index.tolist()
    assert sorted(seen) == list(range(len(samples)))

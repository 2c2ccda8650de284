"""FLOPs from host statistics: attention grows with Σ s_i², not T²."""

import pytest

pytest.importorskip("torch")

from packer_cli.torch import THDBatch, attention_flops, pack_flops, training_flops  # noqa: E402
from packer_cli.torch.flops import linear_flops  # noqa: E402
from packer_cli.torch.testing import make_meta, make_row  # noqa: E402


def test_attention_uses_sum_of_squares_of_real_lengths():
    row = make_row([list(range(1, 7)), [7, 8, 9, 10], list(range(11, 21))], multiple=4)
    b = THDBatch.from_row(row, make_meta([row], pack_size=24, multiple=4))
    assert b.seqlen_sq_sum == 115  # not Σp² = 224, not T² = 576
    assert attention_flops(b.seqlen_sq_sum, num_heads=2, head_dim=8) == 2 * 115 * 2 * 8
    assert attention_flops(115, 2, 8, num_layers=3) == 3 * 2 * 115 * 16


@pytest.mark.parametrize(
    "kw, per_token",
    [
        # MHA, 4h MLP not gated: qkv 2·h·3h + proj 2h² + mlp 2·h·4h·2 = 6h²+2h²+16h² = 24h²
        (dict(hidden_size=8, num_heads=2, head_dim=4, gated_mlp=False), 24 * 64),
        # GQA (1 group of 2 heads), gated ffn 16: qkv 2·8·(2+2)·4 + proj 2·2·4·8 + mlp 2·8·16·3
        (dict(hidden_size=8, num_heads=2, head_dim=4, num_query_groups=1, ffn_hidden_size=16), 256 + 128 + 768),
    ],
)
def test_linear_flops_per_token(kw, per_token):
    assert linear_flops(10, **kw) == 10 * per_token


def test_pack_and_training_flops():
    f = pack_flops(17, 115, num_layers=2, hidden_size=8, num_heads=2, gated_mlp=False, vocab_size=10)
    assert f.attention == 2 * 2 * 115 * 2 * 4
    assert f.linear == 17 * (2 * 24 * 64 + 2 * 8 * 10)
    assert f.forward == f.attention + f.linear and f.training == 3 * f.forward
    kw = dict(num_layers=2, hidden_size=8, num_heads=2, gated_mlp=False, vocab_size=10)
    assert training_flops(17, 115, **kw) == f.training
    assert isinstance(f.training, int)


def test_large_lengths_stay_exact():
    s = 131072  # s² overflows int32
    assert attention_flops(s * s, 64, 128) == 2 * s * s * 64 * 128

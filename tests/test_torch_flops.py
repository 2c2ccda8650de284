"""FLOPs from host statistics: attention grows with Σ s_i², not T²."""

import numpy as np
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
        # heads·head_dim ≠ h (Gemma's 3072 wide, 16 heads of 256): qkv 2·h·3·16·256, proj 2·16·256·h, mlp 2·h·4h·2
        (dict(hidden_size=3072, num_heads=16, head_dim=256, gated_mlp=False),
         2 * 3072 * 48 * 256 + 2 * 16 * 256 * 3072 + 16 * 3072 * 3072),
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


def test_an_explicit_head_dim_is_the_one_counted():
    """A head_dim given is used, not hidden_size // num_heads (192 here, against 256)."""
    f = pack_flops(100, 5000, num_layers=2, hidden_size=3072, num_heads=16, head_dim=256, gated_mlp=False)
    assert f.attention == 2 * 2 * 5000 * 16 * 256
    assert f.linear == linear_flops(100, 3072, 16, 256, num_layers=2, gated_mlp=False)


def test_large_lengths_stay_exact():
    s = 131072  # s² overflows int32
    assert attention_flops(s * s, 64, 128) == 2 * s * s * 64 * 128


def test_pack_flops_counts_the_models_query_groups_and_ffn_width():
    """pack_flops/training_flops pass GQA groups and the FFN width on: dropped, a Llama-like model
    was counted as MHA with a 4h MLP."""
    kw = dict(num_layers=2, hidden_size=8, num_heads=2, head_dim=4, num_query_groups=1, ffn_hidden_size=16, vocab_size=10)
    f = pack_flops(17, 115, **kw)
    # per layer and token: qkv 2·8·(2+2)·4 + proj 2·2·4·8 + gated mlp 2·8·16·3; logits 2·8·10
    assert f.linear == 17 * (2 * (256 + 128 + 768) + 2 * 8 * 10)
    assert f.linear == linear_flops(17, 8, 2, 4, num_layers=2, num_query_groups=1, ffn_hidden_size=16, vocab_size=10)
    assert training_flops(17, 115, **kw) == 3 * (f.attention + f.linear)


def test_numpy_statistics_count_as_exact_python_ints():
    """Statistics summed with NumPy (np.int32 token counts, np.int64 Σs²) are Python ints first:
    NumPy arithmetic wrapped past 2**63 or refused a per-token count above int32."""
    big = attention_flops(np.int64(2**40), 128, 128, num_layers=256)
    assert type(big) is int and big == 2**63
    per_token = linear_flops(1, 4096, 32, 128, num_layers=32, ffn_hidden_size=14336, num_query_groups=8, vocab_size=128256)
    assert per_token > 2**31
    n = linear_flops(np.int32(100_000), 4096, 32, 128, num_layers=32, ffn_hidden_size=14336, num_query_groups=8,
                     vocab_size=128256)
    assert type(n) is int and n == 100_000 * per_token

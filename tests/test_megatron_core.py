"""Against the real Megatron-core (CPU): its PackedSeqParams and its THD rotary embedding.

Megatron-core's attention takes ``cu_seqlens_q_padded`` (or ``cu_seqlens_q`` when that is
``None``) and hands it to ``apply_rotary_pos_emb``, whose unfused THD path splits this CP
rank's tokens by ``cu_seqlens // cp_size`` and gives each piece the positions of TE's
zig-zag chunks. If packer's CP slice or its boundaries disagreed with that rule, every
rotated query and key would land at the wrong position. So: rotate with Megatron's THD code
from our ``PackedSeqParams`` and compare with rotating by our own ``position_ids``.
"""

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mcore_params = pytest.importorskip("megatron.core.packed_seq_params", reason="megatron-core not installed")
rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")

import packer_cli  # noqa: E402
from packer_cli.torch import PackedDataset  # noqa: E402
from packer_cli.torch.testing import make_meta, make_row  # noqa: E402
from packer_cli.torch.batch import THDBatch  # noqa: E402

HEADS, DIM = 2, 8


class _CPGroup:
    """What Megatron's RoPE asks of a context-parallel process group: its size and our rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _freqs(length: int) -> torch.Tensor:
    """Rotary angles [length, 1, 1, DIM] laid out as Megatron's RotaryEmbedding returns them."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM))
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _rotate_like_megatron(batch: THDBatch, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    params = batch.packed_seq_params()
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_CPGroup(batch.cp_size, batch.cp_rank))


def _rotate_by_position_ids(batch: THDBatch, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    angles = freqs[batch.position_ids[0]]  # [T_local, 1, 1, DIM]
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), angles).squeeze(1)


def _assert_rope_agrees(full: THDBatch, cp: int, seed: int) -> None:
    # The rotary table as Megatron's GPTModel sizes it for packed sequences (get_rotary_seq_len):
    # max(max_seqlen_q, max_seqlen_kv) angles. Were that the row's length, its RoPE would take
    # the table as covering the whole row and rotate each sequence from its offset, not from 0.
    params = full.packed_seq_params()
    freqs = _freqs(max(params.max_seqlen_q, params.max_seqlen_kv))
    gen = torch.Generator().manual_seed(seed)
    for rank in range(cp):
        part = full.for_cp_rank(cp, rank)
        t = torch.randn(part.tokens.shape[1], HEADS, DIM, generator=gen, dtype=torch.float64)
        ours = _rotate_by_position_ids(part, t, freqs)
        assert not torch.equal(ours, t)  # positions > 0 rotate: the comparison can fail
        torch.testing.assert_close(_rotate_like_megatron(part, t, freqs), ours, rtol=0, atol=0)


def test_make_packed_seq_params_builds_megatrons_class():
    row = make_row([list(range(1, 7)), [7, 8, 9, 10], list(range(11, 21))], multiple=4)
    batch = THDBatch.from_row(row, make_meta([row], pack_size=24, multiple=4, cp=2))
    params = batch.packed_seq_params(with_total_tokens=True)
    assert type(params) is mcore_params.PackedSeqParams
    assert params.qkv_format == "thd" and type(params.max_seqlen_q) is int and params.max_seqlen_q == 12
    assert params.cu_seqlens_q.tolist() == [0, 5, 8, 17] and params.cu_seqlens_kv_padded.tolist() == [0, 8, 12, 24]
    names = {f.name for f in dataclasses.fields(mcore_params.PackedSeqParams)}
    assert (getattr(params, "total_tokens", None) == 24) == ("total_tokens" in names)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("pad_to_max_length", [False, True])
def test_megatron_thd_rope_matches_our_positions_on_packed_shards(tmp_path, synthetic_parquet, cp, pad_to_max_length):
    spec = packer_cli.PackSpec(pack_size=2048, cp=cp, pad_to_max_length=pad_to_max_length)
    packer_cli.pack([str(synthetic_parquet)], str(tmp_path / "out"), spec)
    ds = PackedDataset(tmp_path / "out")
    checked_padding = False
    for index in range(0, len(ds), max(1, len(ds) // 12)):
        full = ds[index]
        checked_padding |= full.has_padding
        _assert_rope_agrees(full, cp, seed=index)
    assert checked_padding or cp == 1  # alignment padding (and its positions) was exercised


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_megatron_thd_rope_matches_our_positions_on_static_packs_a_sequence_fills(tmp_path, cp):
    """Static batches carry Bridge's bound as max_seqlen, and that bound is the pack size once a
    sequence fills a pack (truncated here, or exactly C long). Served as such, Megatron's table
    was as long as the row and every later sequence of every pack was rotated from its offset."""
    rng = np.random.default_rng(cp)
    lengths = [*rng.integers(2, 120, size=60), 300, 257, 256]  # two truncated to C=256, one exactly C
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [int(t) for t in rng.integers(1, 500, size=n)]}) + "\n"
                           for n in lengths))
    spec = packer_cli.PackSpec(pack_size=256, cp=cp, pad_to_max_length=True, pad_cu_seqlens=True)
    packer_cli.pack([str(src)], str(tmp_path / "out"), spec)
    ds = PackedDataset(tmp_path / "out")
    assert ds.static and ds.metadata["static"]["max_seqlen"] == 256  # Bridge's bound: the pack size
    rows = [ds[i] for i in range(len(ds))]
    if cp == 1:
        rows.append(ds.micro_batch([0, 1]))  # a row of two static packs: T = 2C
    for index, full in enumerate(rows):
        assert full.max_seqlen not in (full.num_tokens, 256) and full.max_seqlen > 256
        _assert_rope_agrees(full, cp, seed=index)

"""pack_batch_sequences: Megatron-Bridge's in-batch packing, on the values of Bridge's tests."""

import logging

import pytest

torch = pytest.importorskip("torch")

from packer_cli.torch import pack_batch_sequences  # noqa: E402


def _pack(tokens, m=1, labels=True, loss=True, positions=None, padding_mask=None):
    tokens = torch.tensor(tokens)
    b, s = tokens.shape
    lab = torch.where(tokens != 0, tokens + 1, torch.full_like(tokens, -100)) if labels else None
    lm = torch.ones(b, s, dtype=torch.float32) if loss else None
    pos = torch.arange(s).unsqueeze(0).expand(b, -1) if positions is None else torch.tensor(positions)
    return pack_batch_sequences(
        tokens=tokens,
        labels=lab,
        loss_mask=lm,
        attention_mask=None,
        position_ids=pos,
        pad_token_id=0,
        pad_to_multiple_of=m,
        padding_mask=padding_mask,
    )


@pytest.mark.parametrize(
    "name, tokens, m, total, cu, max_seqlen",
    [
        ("basic_packing", [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 6, 7, 0, 0, 0, 0]], 1, 7, [0, 3, 7], 4),
        ("pad_to_multiple_of", [[1, 2, 3] + [0] * 7, [4, 5, 6, 7, 8] + [0] * 5], 2, 10, [0, 4, 10], 6),
        ("larger_multiple", [[1, 2] + [0] * 6, [3, 4, 5] + [0] * 5], 4, 8, [0, 4, 8], 4),
        ("single_sequence", [[1, 2, 3, 4, 5, 0, 0, 0]], 1, 5, [0, 5], 5),
        ("no_padding_sequences", [[1, 2, 3, 4], [5, 6, 7, 8]], 1, 8, [0, 4, 8], 4),
        ("none_labels_with_padding", [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 6, 7, 8, 0, 0, 0]], 4, 12, [0, 4, 12], 8),
        ("get_batch_enable_packing", [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]], 1, 8, [0, 3, 8], 5),
        ("get_batch_with_cp2", [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]], 4, 12, [0, 4, 12], 8),
    ],
)
def test_bridge_vectors(name, tokens, m, total, cu, max_seqlen):
    out_tokens, labels, loss, attn, pos, cu_seqlens, max_len = _pack(tokens, m)
    assert out_tokens.shape == (1, total) and labels.shape == loss.shape == pos.shape == (1, total)
    assert cu_seqlens.tolist() == cu and cu_seqlens.dtype == torch.int32
    assert max_len.item() == max_seqlen and max_len.dtype == torch.int32 and max_len.dim() == 0
    assert attn is None


def test_values_of_packed_rows_and_padding():
    tokens, labels, loss, _, pos, cu, _ = _pack([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]], m=4)
    assert tokens.tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]]
    assert labels.tolist() == [[2, 3, 4, -100, 5, 6, 7, 8, 9, -100, -100, -100]]
    assert loss.tolist() == [[1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]]
    # padding continues the positions, even past the input width (row 2 is full)
    assert pos.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]


def test_preserves_loss_mask_zeros():
    t = torch.tensor([[1, 2, 3, 0, 0]])
    out = pack_batch_sequences(
        t, torch.tensor([[2, 3, -100, -100, -100]]), torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.0]]), None, torch.arange(5)[None]
    )
    assert out[2].tolist() == [[1.0, 0.0, 1.0]]


def test_position_ids_reset_and_extend():
    """The padding continues from the row's last real position, whatever the positions before
    it: it counted from the first position as if they stepped by one (a row starting at 5, or
    one with a repeated position, got a jump or a repeat at the padding)."""
    pos = _pack([[1, 2, 0, 0], [3, 4, 5, 0]], positions=[[0, 1, 2, 3], [0, 1, 2, 3]])[4]
    assert pos.tolist() == [[0, 1, 0, 1, 2]]
    pos = _pack([[1, 2, 3, 0]], m=4, positions=[[0, 1, 2, 3]])[4]
    assert pos.tolist() == [[0, 1, 2, 3]]  # padding_extends_position_ids
    pos = _pack([[1, 2, 3, 0], [4, 5, 6, 0]], m=4, positions=[[5, 6, 7, 0], [0, 1, 1, 0]])[4]
    assert pos.tolist() == [[5, 6, 7, 8, 0, 1, 1, 2]]


def test_empty_batch_warns(caplog):
    with caplog.at_level(logging.WARNING):
        tokens, labels, loss, attn, pos, cu, max_len = _pack([[0, 0, 0, 0]])
    assert tokens.shape == labels.shape == loss.shape == pos.shape == (1, 0)
    assert cu.tolist() == [0] and max_len.item() == 0 and attn is None
    assert "padding" in caplog.text
    tokens, labels, loss, *_ = _pack([[0, 0, 0]], labels=False, loss=False)  # none_labels_empty_batch
    assert tokens.shape == (1, 0) and labels is None and loss is None


def test_none_labels_and_dtypes():
    tokens, labels, loss, attn, pos, cu, max_len = _pack(
        [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 6, 7, 0, 0, 0, 0]], labels=False, loss=False
    )
    assert tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7]] and labels is None and loss is None
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3]] and cu.tolist() == [0, 3, 7] and max_len.item() == 4
    t, lab, lm, _, p, _, _ = _pack([[1, 2, 3, 0]])
    assert (t.dtype, lab.dtype, lm.dtype, p.dtype) == (torch.long, torch.long, torch.float32, torch.long)
    # int32 positions stay int32, padding included (they came back int64, the padding's arithmetic type)
    p = pack_batch_sequences(torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]]), None, None, None,
                             torch.arange(4, dtype=torch.int32).expand(2, 4), pad_to_multiple_of=4)[4]
    assert p.dtype == torch.int32 and p.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]


def test_padding_is_filled_with_the_pad_token_id():
    """The added padding holds pad_token_id, not 0 (it was filled with 0 whatever the pad id)."""
    tokens = torch.tensor([[1, 2, 3, 9, 9], [4, 5, 6, 7, 8]])
    out = pack_batch_sequences(tokens, None, None, None, torch.arange(5).expand(2, 5), pad_token_id=9,
                               pad_to_multiple_of=4)
    assert out[0].tolist() == [[1, 2, 3, 9, 4, 5, 6, 7, 8, 9, 9, 9]] and out[5].tolist() == [0, 4, 12]


def test_rows_keep_their_order_in_a_large_batch():
    """Kept rows stay in batch order, empty rows dropped between them: with 17 rows or more an
    unstable sort of the keep flags reordered them (no longer matching per-row data such as images)."""
    b = 40
    tokens = torch.zeros(b, 3, dtype=torch.long)
    for i in range(b):
        if i % 3:  # every third row is empty
            tokens[i, : 1 + i % 2] = i
    out = pack_batch_sequences(tokens, None, None, None, torch.arange(3).expand(b, 3))
    expected = [i for i in range(b) if i % 3 for _ in range(1 + i % 2)]
    assert out[0].tolist() == [expected]
    assert out[5].tolist() == [0] + torch.cumsum(torch.tensor([1 + i % 2 for i in range(b) if i % 3]), 0).tolist()


def test_padding_mask_gives_lengths_and_empty_rows_are_dropped():
    # row 0 has a real token equal to pad id 0 inside it: the mask, not the ids, decides
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    tokens, _, _, _, pos, cu, _ = _pack([[5, 0, 6, 0], [0, 0, 0, 0], [7, 8, 0, 0]], padding_mask=mask)
    assert tokens.tolist() == [[5, 0, 6, 7, 8]] and cu.tolist() == [0, 3, 5]
    assert pos.tolist() == [[0, 1, 2, 0, 1]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tensors_stay_on_device():
    t = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]], device="cuda")
    out = pack_batch_sequences(t, None, None, None, torch.arange(4, device="cuda").expand(2, -1), pad_to_multiple_of=2)
    assert out[0].is_cuda and out[5].is_cuda and out[5].tolist() == [0, 4, 6]


def test_inputs_of_other_shapes_are_refused():
    """labels, loss_mask, position_ids or padding_mask of another shape than tokens (they used
    to be gathered out of bounds, or silently mismatched), and a multiple that is not a count."""
    tokens = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [4, 0, 0, 0, 0]])
    positions = torch.arange(5).expand(3, 5)
    for name in ("labels", "loss_mask", "position_ids", "padding_mask"):
        args = dict(tokens=tokens, labels=tokens.clone(), loss_mask=torch.ones(3, 5), attention_mask=None,
                    position_ids=positions)
        args[name] = torch.ones(3, 3, dtype=torch.int64)
        with pytest.raises(ValueError, match=rf"{name} has shape \[3, 3\], but tokens has \[3, 5\]"):
            pack_batch_sequences(**args)
    for m in (0, 2.5, True, "2"):
        with pytest.raises(ValueError, match="pad_to_multiple_of must be an integer >= 1"):
            pack_batch_sequences(tokens, None, None, None, positions, pad_to_multiple_of=m)
    with pytest.raises(ValueError, match="tokens must be a \\[B, S\\] tensor"):
        pack_batch_sequences(tokens[0], None, None, None, positions[0])


def test_inputs_of_other_types_are_refused():
    """Each used to fail deep inside (a list of tokens: AttributeError; position_ids=None:
    'NoneType' object is not subscriptable; pad_token_id=None: 'bool' object has no attribute
    'flip') or not at all: uint8 labels turned the padding's -100 into 156, a label trained on."""
    tokens = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]])
    positions = torch.arange(5).expand(2, 5)
    with pytest.raises(TypeError, match="tokens must be a tensor, got list"):
        pack_batch_sequences(tokens.tolist(), None, None, None, positions)
    with pytest.raises(TypeError, match="position_ids must be a tensor, got NoneType"):
        pack_batch_sequences(tokens, None, None, None, None)
    with pytest.raises(TypeError, match="labels must be a tensor or None, got list"):
        pack_batch_sequences(tokens, tokens.tolist(), None, None, positions)
    for pad in (None, 0.0, True, "0"):
        with pytest.raises(TypeError, match="pad_token_id must be an integer"):
            pack_batch_sequences(tokens, None, None, None, positions, pad_token_id=pad)
    for dtype in (torch.uint8, torch.bool):
        with pytest.raises(TypeError, match=f"labels of dtype {dtype} cannot hold -100"):
            pack_batch_sequences(tokens, tokens.to(dtype), None, None, positions, pad_to_multiple_of=4)
    for dtype in (torch.int8, torch.int32, torch.float32):  # these hold it: the padding is ignored
        labels = pack_batch_sequences(tokens, tokens.to(dtype), None, None, positions, pad_to_multiple_of=4)[1]
        assert labels.dtype == dtype and labels[0, 3].item() == -100
    import numpy as np

    assert pack_batch_sequences(tokens, None, None, None, positions, pad_token_id=np.int64(0))[0].shape == (1, 5)
    # a pad id at either end of the tokens' dtype fits (the largest was refused as not fitting)
    for dtype, pad in ((torch.int16, 32767), (torch.int16, -32768), (torch.int8, 127)):
        t = torch.tensor([[5, 6, pad, pad], [7, pad, pad, pad]], dtype=dtype)
        out = pack_batch_sequences(t, None, None, None, positions[:, :4], pad_token_id=pad, pad_to_multiple_of=4)
        assert out[0].tolist() == [[5, 6, pad, pad, 7, pad, pad, pad]] and out[0].dtype == dtype
    # the padding is filled with the pad id: one the tokens cannot hold failed inside torch
    for dtype, pad in ((torch.int32, 2**31), (torch.int16, 40000), (torch.uint8, -1)):
        with pytest.raises(ValueError, match=f"pad_token_id {pad} does not fit the tokens' dtype {dtype}"):
            pack_batch_sequences(tokens.to(dtype), None, None, None, positions, pad_token_id=pad)


def test_padding_mask_values_count_tokens_and_empty_widths_are_empty():
    """A mask's nonzero entries are real tokens (a 2 is one token, not two); a batch of width 0
    is all padding; a NumPy integer multiple is accepted."""
    import numpy as np

    tokens = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[2, 2, 2, 0], [1, 1, 0, 0]])
    out = pack_batch_sequences(tokens, None, None, None, torch.arange(4).expand(2, 4), padding_mask=mask,
                               pad_to_multiple_of=np.int64(2))
    assert out[5].tolist() == [0, 4, 6]
    negative = torch.tensor([[-1, -1, -1, 0], [-1, -1, 0, 0]])  # nonzero: real, whatever the sign
    out = pack_batch_sequences(tokens, None, None, None, torch.arange(4).expand(2, 4), padding_mask=negative)
    assert out[0].tolist() == [[5, 6, 7, 8, 9]] and out[5].tolist() == [0, 3, 5]
    empty = torch.zeros(2, 0, dtype=torch.int64)
    out = pack_batch_sequences(empty, None, None, None, empty)
    assert out[0].shape == (1, 0) and out[5].tolist() == [0]


def test_a_mask_that_is_not_right_padding_is_refused():
    """Rows are read from column 0 for the mask's count: a left-padded row, or a mask with a gap,
    packed the padding as content and dropped the last real tokens, without a word."""
    tokens = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
    positions = torch.arange(5).expand(2, 5)
    for mask, row, col in (([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], 0, 2), ([[1, 1, 1, 0, 0], [1, 1, 0, 1, 0]], 1, 3)):
        with pytest.raises(ValueError, match=rf"padding_mask row {row} has a real token at column {col} after "
                                             r"padding: the batch must be right-padded"):
            pack_batch_sequences(tokens, None, None, None, positions, padding_mask=torch.tensor(mask))
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert pack_batch_sequences(tokens, None, None, None, positions, padding_mask=right)[5].tolist() == [0, 3, 8]

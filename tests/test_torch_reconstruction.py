"""Proof of correctness on real data: every THD batch gives back its source samples exactly."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

from conftest import read_samples, require_shared  # noqa: E402
from packer_cli import PackSpec, pack  # noqa: E402
from packer_cli.torch import PackedDataset  # noqa: E402


@pytest.mark.parametrize("static", [False, True])
def test_every_sequence_of_real_data_reconstructs(tmp_path, static):
    """CP2/TP2/SP, padded to max length: inputs, labels and loss mask of each sequence in each
    batch equal its source sample's t[0:n−1], t[1:n] and targets[1:n]; padding is never trained."""
    files = require_shared()
    spec = PackSpec(pack_size=4096, cp=2, tp=2, sp=True, pad_to_max_length=True, pad_cu_seqlens=True)
    for path in files:
        out = tmp_path / path.stem
        pack([str(path)], str(out), spec)
        tokens, masks = read_samples(path)
        ds = PackedDataset(str(out), static=static)
        seen = np.zeros(len(tokens), dtype=bool)
        for k in range(len(ds)):
            b = ds[k]
            assert b.tokens.shape == (1, 4096)
            cu_pad = b.cu_seqlens_padded.tolist()
            cu_real = b.cu_seqlens.tolist()
            toks, labels = b.tokens[0].numpy(), b.labels[0].numpy()
            loss, pos = b.loss_mask[0].numpy(), b.position_ids[0].numpy()
            for i, src in enumerate(b.source_index.tolist()):
                start, s = cu_pad[i], cu_real[i + 1] - cu_real[i]
                t, m = tokens[src], masks[src]
                assert s == t.size - 1
                np.testing.assert_array_equal(toks[start:start + s], t[:-1])
                np.testing.assert_array_equal(labels[start:start + s], t[1:])
                np.testing.assert_array_equal(loss[start:start + s], m[1:].astype(np.float32))
                np.testing.assert_array_equal(pos[start:start + s], np.arange(s))
                assert (cu_pad[i + 1] - start) % spec.pad_multiple == 0
                assert not loss[start + s:cu_pad[i + 1]].any() and (labels[start + s:cu_pad[i + 1]] == -100).all()
                assert not seen[src]
                seen[src] = True
            assert not loss[cu_pad[b.num_seqs]:].any(), "the tail is never trained"
            assert b.num_loss_tokens == int(loss.sum())
            if static:
                assert len(cu_pad) == ds.reader.metadata["bridge"]["max_samples_per_bin"] + 2
        assert seen.all(), "every source sample appears in exactly one batch"

"""Synthetic tokenized SFT data with a realistic shape, for the demo and the tests.

Each sample is a chat turn: a prompt (loss 0) followed by a response (loss 1) ending with
the end-of-sequence id. Prompt and response lengths are lognormal, as in real instruction
data (a long tail of long answers); token ids are uniform random below the vocabulary size.

>>> table = demo_table(100, seed=0)
>>> table.column_names
['input_ids', 'loss_mask']
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

DEMO_VOCAB = 32000
DEMO_EOS = 2


def demo_lengths(n: int, rng: np.random.Generator, max_len: int = 6000) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and response lengths: lognormal, medians ≈ 90 and ≈ 180 tokens."""
    prompt = np.clip(rng.lognormal(np.log(90), 0.8, n), 4, max_len // 2).astype(np.int64)
    response = np.clip(rng.lognormal(np.log(180), 0.9, n), 2, max_len // 2).astype(np.int64)
    return prompt, response


def demo_table(n: int, seed: int = 0, *, vocab: int = DEMO_VOCAB, eos: int = DEMO_EOS,
               max_len: int = 6000) -> pa.Table:
    """A table of ``n`` samples with ``input_ids`` (int32 lists) and ``loss_mask`` (uint8 lists)."""
    rng = np.random.default_rng(seed)
    prompt, response = demo_lengths(n, rng, max_len)
    lengths = prompt + response
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(3, vocab, size=int(offsets[-1]), dtype=np.int32)
    tokens[offsets[1:] - 1] = eos
    position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    mask = (position >= np.repeat(prompt, lengths)).astype(np.uint8)
    offsets32 = pa.array(offsets.astype(np.int32))
    return pa.table({
        "input_ids": pa.ListArray.from_arrays(offsets32, pa.array(tokens)),
        "loss_mask": pa.ListArray.from_arrays(offsets32, pa.array(mask)),
    })

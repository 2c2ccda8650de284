"""Pass two's gather kernel alone: sequences decoded from an in-memory spill in random order.

The spill is laid out by pass one's own writer (17-bit ids, the width of cl100k and Llama 3;
``--bits`` for another), every sample a sequence, the sequences in a random order and grouped
into packs of ``--per-pack``, the way pass two gathers a run of packs. The baseline, measured in
the same process, is NumPy copying the same number of tokens (int32) and mask bytes between two
arrays: the least a gather can cost, since it writes those bytes too. Both write into buffers
that were used before (fresh memory would time page faults instead).

    python benchmarks/bench_gather.py
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from _util import emit
from packer_cli.shards._gather import _pread_gather_kernel, _store_blocks, batch_spill_bytes


def _median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=40_000)
    ap.add_argument("--bits", type=int, default=17)
    ap.add_argument("--per-pack", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(400), 0.8, args.samples), 2, 4096).astype(np.int64)
    n = int(lengths.sum())
    tokens = rng.integers(0, 1 << args.bits, n).astype(np.int32)
    tokens[0] = (1 << args.bits) - 1  # the widest id: the batch takes exactly --bits bits
    targets = (rng.random(n) < 0.6).astype(np.uint8)
    nbytes = batch_spill_bytes(n, args.bits)
    spill = np.zeros(nbytes + 64, np.uint8)
    _store_blocks(tokens, targets, args.bits, spill)

    order = rng.permutation(args.samples)
    seq_src = (np.cumsum(lengths) - lengths)[order]
    seq_len = (lengths[order] - 1).astype(np.int32)
    seq_pad = (-(-seq_len // 8) * 8).astype(np.int32)
    packs = np.append(np.arange(0, args.samples, args.per_pack), args.samples).astype(np.int64)
    total = int(seq_pad.sum())
    out_tokens, out_mask = np.empty(total, np.int32), np.empty(total, np.uint8)
    out_last, out_cu = np.empty(args.samples, np.int32), np.empty(args.samples + packs.size - 1, np.int32)
    scratch = np.empty((int(seq_len.max()) // 8 + 2) * 33 + 8, np.uint8)
    layout = (np.array([0, n], np.int64), np.array([0, nbytes], np.int64), np.array([args.bits, 0], np.int64))

    def gather():
        assert _pread_gather_kernel(-1, *layout, np.uint64(spill.ctypes.data), np.int64(nbytes), seq_src, seq_len,
                                    seq_pad, packs, np.int32(0), scratch, out_tokens, out_mask, out_last, out_cu)

    copy_tokens, copy_mask = np.ones(total, np.int32), np.ones(total, np.uint8)

    def copy():
        np.copyto(out_tokens, copy_tokens)
        np.copyto(out_mask, copy_mask)

    gather()  # compile or load the kernel; touch every output page
    check = int(rng.integers(args.samples))
    k = int(np.flatnonzero(order == order[check])[0])
    at = int(seq_pad[:k].sum())
    first = int(seq_src[k])
    assert np.array_equal(out_tokens[at:at + seq_len[k]], tokens[first:first + seq_len[k]])
    gathered, copied = _median_seconds(gather, args.repeats), _median_seconds(copy, args.repeats)
    real = int(seq_len.sum())
    emit({"what": "gather", "bits": args.bits, "tokens": real, "sequences": args.samples,
          "gather_ns_per_token": gathered / real * 1e9, "copy_ns_per_token": copied / real * 1e9,
          "gather_vs_copy": gathered / copied})


if __name__ == "__main__":
    main()

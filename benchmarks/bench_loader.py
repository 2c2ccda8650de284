"""Host-side throughput of ``packer_cli.torch``: one worker building batches, and the batches a
training loop receives through ``THDLoader``'s worker processes (needs torch).

Packs the input once (CP=2 by default), then measures:

* ``build``: ``PackedDataset.micro_batch`` over ``--build-batches`` micro-batches spread evenly over
  the output, in one process: read the packs from
  the memory-mapped shards, build the THD batch (tokens, labels, position ids, ``cu_seqlens``),
  slice it for a CP rank. The work one worker does.
* ``served``: ``THDLoader(device="cpu", num_workers=W)`` for CP rank 0, shuffled, as the training
  loop's ``for batch in loader`` gets them: built in W worker processes and sent to the main
  process, which unpickles them. Batches go through the queue as one buffer each (see
  ``packer_cli/torch/_wire.py``); the ``per tensor`` rows send the same batches the way torch
  sends any batch of tensors, such as the dict a collate function returns, each tensor through
  a shared-memory segment of its own (what the loader did before). ``main CPU`` is the main
  process's CPU time per batch: taken from the training loop.
* ``demand``: how many packs per second a CP group of GPUs consumes when training a given model,
  from the packs' own ``Σ s`` and ``Σ s²`` (``packer_cli.torch.training_flops``, mean over up to
  2,000 packs) at an assumed throughput per GPU (``--peak-tflops`` × ``--mfu``), against the
  batches per second one worker serves: the headroom before the loader would be what a GPU waits on.

Tokens per second are full-pack tokens: each CP rank's loader builds every pack and keeps its
``1/CP`` slice, so a rank serving B batches a second serves the group B packs a second.

    python benchmarks/bench_loader.py --input benchmarks/_data/sft4k_200000.parquet
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from contextlib import nullcontext

from _util import HERE, emit, median

OUT = os.path.join(HERE, "_out", "loader")

#: Public configurations (layers, hidden, heads, KV heads, head dim, FFN, vocabulary).
MODELS = {
    "SmolLM2-135M": dict(num_layers=30, hidden_size=576, num_heads=9, num_query_groups=3, head_dim=64,
                         ffn_hidden_size=1536, vocab_size=49152),
    "Qwen2.5-0.5B": dict(num_layers=24, hidden_size=896, num_heads=14, num_query_groups=2, head_dim=64,
                         ffn_hidden_size=4864, vocab_size=151936),
    "Llama-3.2-1B": dict(num_layers=16, hidden_size=2048, num_heads=32, num_query_groups=8, head_dim=64,
                         ffn_hidden_size=8192, vocab_size=128256),
    "Llama-3.1-8B": dict(num_layers=32, hidden_size=4096, num_heads=32, num_query_groups=8, head_dim=128,
                         ffn_hidden_size=14336, vocab_size=128256),
}


def time_build(ds, batches, cp: int, runs: int) -> float:
    """Median seconds for one rank's worker to build every micro-batch."""
    times = []
    for r in range(runs + 1):
        t0 = time.perf_counter()
        for rank in range(cp):
            for indices in batches:
                ds.micro_batch(indices, cp_size=cp, cp_rank=rank)
        if r:  # the first pass warms the page cache and the reader
            times.append((time.perf_counter() - t0) / cp)  # one rank's worker sees every pack once
    return median(times)


def time_served(ds, cp: int, workers: int, count: int, seed: int) -> dict:
    """Batches a second the training loop receives from a fresh THDLoader, after a warm-up."""
    from packer_cli.torch import THDLoader

    loader = THDLoader(ds, cp_size=cp, cp_rank=0, seed=seed, device="cpu", num_workers=workers)
    batches = iter(loader)
    for _ in range(min(50, count)):  # start the workers, fill their queues
        next(batches)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        next(batches)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    del batches, loader
    return {"batches_per_s": count / wall, "main_cpu_ms": cpu / count * 1e3}


class per_tensor_pickling:
    """Within the block, THDBatch pickles tensor by tensor, with torch's own reductions.

    Worker processes forked inside the block inherit it; spawned ones would not, so the
    caller checks the start method."""

    def __enter__(self):
        from packer_cli.torch import batch

        self._batch, self._saved = batch, batch.THDBatch.__reduce__

        def by_field(b):
            return batch._from_fields, (type(b), {f.name: getattr(b, f.name) for f in dataclasses.fields(b)})

        batch.THDBatch.__reduce__ = by_field

    def __exit__(self, *exc):
        self._batch.THDBatch.__reduce__ = self._saved


def mean_pack_flops(ds, model: dict, sample: int = 2000) -> float:
    import numpy as np

    from packer_cli.torch import training_flops

    picks = np.random.default_rng(0).choice(len(ds), size=min(sample, len(ds)), replace=False)
    flops = [training_flops(b.num_real_tokens, b.seqlen_sq_sum, **model) for b in (ds[int(i)] for i in picks)]
    return float(np.mean(flops))


def main() -> None:
    global OUT  # --out replaces the default every function here uses
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT, help="the output directory (default: benchmarks/_out/loader)")
    ap.add_argument("--input", required=True)
    ap.add_argument("--pack-size", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1, help="packs per micro-batch (THD + CP needs 1)")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--build-batches", type=int, default=5000, help="micro-batches built per timed pass (evenly spread)")
    ap.add_argument("--served-batches", type=int, default=2000, help="batches timed per served run")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="a GPU's dense BF16 peak (H100/H200 SXM)")
    ap.add_argument("--mfu", type=float, default=0.6, help="share of the peak training reaches (assumed)")
    args = ap.parse_args()
    OUT = os.path.abspath(args.out)
    try:
        import torch.multiprocessing as mp

        from packer_cli.torch import PackedDataset
    except ImportError as exc:
        emit({"what": "skipped", "reason": str(exc)})
        return
    from packer_cli import PackSpec, pack

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    summary = pack([args.input], OUT, PackSpec(pack_size=args.pack_size, cp=args.cp), overwrite=True)
    tokens = summary.counts["padded_tokens"]
    try:
        ds = PackedDataset(OUT)
        packs = len(ds)
        tokens_per_pack = tokens / packs
        batches = [list(range(i, min(i + args.micro_batch, packs))) for i in range(0, packs, args.micro_batch)]
        batches = batches[::max(1, len(batches) // args.build_batches)]
        sec = time_build(ds, batches, args.cp, args.runs)

        forked = mp.get_start_method(allow_none=False) == "fork"
        variants = [("one buffer", 1), ("one buffer", 2)] + ([("per tensor", 1)] if forked else [])
        served = {v: [] for v in variants}
        for r in range(args.runs):  # interleaved, so every variant sees the same machine
            for ipc, workers in variants:
                with per_tensor_pickling() if ipc == "per tensor" else nullcontext():
                    served[(ipc, workers)].append(time_served(ds, args.cp, workers, args.served_batches, r))
        served_rows = []
        for (ipc, workers), rows in served.items():
            bps = median([x["batches_per_s"] for x in rows])
            row = {"what": "served", "ipc": ipc, "workers": workers, "batches_per_s": bps,
                   "tokens_per_s": bps * tokens_per_pack * args.micro_batch,
                   "main_cpu_ms": median([x["main_cpu_ms"] for x in rows]), "runs": args.runs}
            served_rows.append(row)
            emit(row)
        if not forked:
            emit({"what": "served_skipped", "reason": "per-tensor rows need forked workers"})

        one = next(r["batches_per_s"] for r in served_rows if r["ipc"] == "one buffer" and r["workers"] == 1)
        per = next((r["batches_per_s"] for r in served_rows if r["ipc"] == "per tensor"), None)
        gpu_flops = args.peak_tflops * 1e12 * args.mfu
        for name, model in MODELS.items():
            flops = mean_pack_flops(ds, model)
            demand = args.cp * gpu_flops / (flops * args.micro_batch)  # batches a second the CP group consumes
            emit({"what": "demand", "model": name, "training_flops_per_pack": flops, "cp": args.cp,
                  "gpu_tflops": gpu_flops / 1e12, "peak_tflops": args.peak_tflops, "mfu": args.mfu,
                  "batches_per_s": demand, "headroom_one_worker": one / demand,
                  "headroom_per_tensor": None if per is None else per / demand})
        built = len(batches) / sec  # micro-batches a second; evenly spread, so their packs are the mean pack
        emit({"what": "summary", "packs": packs, "tokens": tokens, "micro_batch": args.micro_batch, "cp": args.cp,
              "built_batches": len(batches), "median_s": sec, "batches_per_s": built,
              "tokens_per_s": built * tokens_per_pack * args.micro_batch, "runs": args.runs})
    finally:
        shutil.rmtree(OUT, ignore_errors=True)


if __name__ == "__main__":
    main()

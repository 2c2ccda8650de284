"""End-to-end throughput: ``packer pack`` against TRL, pyarrow and the disk, interleaved.

Each round runs every selected tool once, in turn, so all of them see the same machine noise;
the summary reports medians over the rounds and ratios between tools of the same run.

Tools (``--tools``):

* ``cli``        ``packer pack IN -o OUT`` in a fresh process (interpreter start, imports and
                 numba cache loading included), Parquet or JSONL to shards on disk; the summary's
                 phase times give pass two (gather, write, hash) apart;
* ``cli_floor``  the same command on the input's first ``FLOOR_SAMPLES`` samples: a fresh
                 process's fixed cost (interpreter, imports, argument parsing, kernel loads, the
                 output's files), which no amount of packing speed removes from a CLI run;
* ``cli_bridge`` ``packer pack IN -o OUT --format megatron-bridge``: the same run writing
                 Megatron-Bridge's Parquet layout (one ``training_{C}.idx.parquet``, the default
                 ``plain-zstd`` encoding) instead of native shards, its row groups encoded by
                 packer's own Parquet encoder;
* ``cli_bridge_arrow`` the same with ``PACKER_PARQUET_ENCODER=arrow``: the row groups encoded
                 by pyarrow's ``ParquetWriter`` (what packer did before it had its own encoder);
* ``api``        ``packer_cli.pack()`` in a warm process (same work, no start-up);
* ``trl``        TRL ``pack_dataset(ds, C, strategy="bfd")`` on the same table held in memory
                 (``datasets`` default: packed in 1,000-row ``map`` batches);
* ``trl_file``   the same on the file loaded as a TRL user loads it (``datasets.load_dataset(
                 "parquet", ...)``: a memory-mapped Arrow cache file, converted untimed), ``map``
                 writing its result to a cache file; the ratios against TRL use the faster of
                 ``trl`` and ``trl_file``;
* ``trl_whole``  the same as ``trl`` with ``map_kwargs={"batch_size": None}`` (one global BFD);
* ``trl_process`` TRL the way a script runs it, in a fresh process like the CLI: import
                 ``datasets`` and ``trl``, read the Parquet file (``pq.read_table``, wrapped as a
                 ``datasets.Dataset``), ``pack_dataset(bfd)``, ``save_to_disk``; each phase timed
                 apart (``--serve trl_once``), the wall time from outside;
* ``decode``     pyarrow ``ParquetFile.iter_batches`` over the input (2,048-row batches, both columns);
* ``decode_packer`` packer's own Parquet decoder (``ListColumnReader``) over the same columns;
* ``cli_zlib``   ``packer pack`` with ``PACKER_GZIP_DECODER=zlib``: a ``.jsonl.gz`` input
                 decompressed by Python's gzip module instead of igzip (isal);
* ``read_json``  ``pyarrow.json.read_json`` of a JSON Lines input, given the columns' types
                 (a ``.gz`` one decompressed by pyarrow as it reads);
* ``disk``       sequential write of ``--disk-gb`` GiB with ``np.tofile`` + ``fsync`` (through the
                 page cache: on this VM bounded by the kernel's page allocation, not the disk);
* ``disk_direct`` the same bytes with ``O_DIRECT`` in 16 MiB writes + ``fsync``: the device's rate;
* ``pages``      page-cache write of 512 MB (no fsync) into memory freed 4 s earlier ("cold") and
                 into memory freed just before ("hot"): on a VM whose balloon driver reports free
                 memory to the host, memory idle for a few seconds must be faulted in again.

    python benchmarks/bench_e2e.py --input benchmarks/_data/sft4k_200000.parquet --runs 5
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

from _util import HERE, PACKER, PYTHON, Worker, dir_bytes, emit, median, run_measured, serve, user_env

OUT = os.path.join(HERE, "_out")


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # the parent package is missing
        return False


def _count_tokens(path: str) -> tuple[int, int]:
    """(samples, tokens) of the input (tokens = Σ len(input_ids))."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        samples = tokens = 0
        for batch in pq.ParquetFile(path).iter_batches(columns=["input_ids"]):  # streamed: keeps this process small
            samples += batch.num_rows
            tokens += len(batch.column(0).values)
        return samples, tokens
    import gzip

    samples = tokens = 0
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        for line in f:
            samples += 1
            start = line.index(b"[")
            tokens += line.count(b",", start, line.index(b"]", start)) + 1
    return samples, tokens


# --- workers (persistent processes) ----------------------------------------------------------

def serve_packer(args) -> None:
    from packer_cli import PackSpec, pack

    def run_pack():
        shutil.rmtree(args.out, ignore_errors=True)  # a fresh output directory, as for the CLI
        t0 = time.perf_counter()
        summary = pack([args.input], args.out, PackSpec(pack_size=args.pack_size))
        return {"seconds": time.perf_counter() - t0, "packs": summary.counts["packs"],
                "runtime_tokens": summary.counts["runtime_tokens"], "out_bytes": dir_bytes(args.out),
                "write_s": summary.seconds["write"], "read_s": summary.seconds["read"]}

    def run_decode():
        import pyarrow.parquet as pq

        t0 = time.perf_counter()
        for _ in pq.ParquetFile(args.input).iter_batches(batch_size=2048):
            pass
        return {"seconds": time.perf_counter() - t0}

    def run_decode_packer():
        import pyarrow.parquet as pq

        from packer_cli.sources.parquet_lists import ListColumnReader

        reader = ListColumnReader(args.input, pq.read_schema(args.input).names, 2048)
        t0 = time.perf_counter()
        for _ in reader:
            pass
        return {"seconds": time.perf_counter() - t0, "fast_rows": reader.fast_rows}

    run_pack()  # warm-up: numba cache load, page cache
    serve({"api": run_pack, "decode": run_decode, "decode_packer": run_decode_packer})


def serve_trl(args) -> None:
    import tempfile

    import datasets
    import pyarrow.parquet as pq
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from trl import pack_dataset

    datasets.disable_progress_bars()
    in_memory = Dataset(InMemoryTable(pq.read_table(args.input)))
    # The way a TRL user loads a file: datasets converts it once into an Arrow cache file
    # (memory-mapped; untimed here), and map writes its result to a cache file too. In memory,
    # map writes into a growing buffer instead, which took TRL up to 1.5x longer on some runs
    # (and not on others): the faster of the two ways is the peer. Caching is off so each run
    # packs again rather than loading the previous run's result.
    cache = tempfile.mkdtemp(prefix="trl-cache-", dir=os.path.dirname(args.out))
    from_file = datasets.load_dataset("parquet", data_files=args.input, split="train", cache_dir=cache)
    datasets.disable_caching()

    def run(ds, map_kwargs):
        def go():
            t0 = time.perf_counter()
            out = pack_dataset(ds, args.pack_size, strategy="bfd", map_kwargs=map_kwargs)
            return {"seconds": time.perf_counter() - t0, "packs": len(out)}
        return go

    handlers = {"trl": run(in_memory, None), "trl_file": run(from_file, None),
                "trl_whole": run(in_memory, {"batch_size": None})}
    for warm_up in handlers.values():  # untimed, as packer's tools get: imports, caches, allocator
        warm_up()
    try:
        serve(handlers)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def trl_once(args) -> None:
    """One TRL packing job from a cold start (the ``trl_process`` tool): prints its phase times."""
    t0 = time.perf_counter()
    import datasets
    import pyarrow.parquet as pq
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from trl import pack_dataset

    datasets.disable_progress_bars()
    t1 = time.perf_counter()
    # The leanest way in: no conversion cache, and a given fingerprint (without one, Dataset
    # hashes the whole table, ~2.5 s of this input, which is not reading it).
    ds = Dataset(InMemoryTable(pq.read_table(args.input)), fingerprint="bench-input")
    t2 = time.perf_counter()
    packed = pack_dataset(ds, args.pack_size, strategy="bfd")
    t3 = time.perf_counter()
    packed.save_to_disk(args.out)
    t4 = time.perf_counter()
    emit({"import_s": t1 - t0, "load_s": t2 - t1, "pack_s": t3 - t2, "save_s": t4 - t3, "packs": len(packed)})


def serve_read_json(args) -> None:
    import pyarrow as pa
    import pyarrow.json as pj

    # The peer at its best: told the columns' types (ids int32, mask uint8), as packer is by the
    # data, instead of inferring int64 lists (about 1.5x slower here).
    fields = [("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))]
    parse = pj.ParseOptions(explicit_schema=pa.schema(fields), unexpected_field_behavior="infer")

    def run():
        t0 = time.perf_counter()
        table = pj.read_json(args.input, parse_options=parse)
        return {"seconds": time.perf_counter() - t0, "rows": table.num_rows, "schema_given": 1}

    run()  # warm-up, untimed, as packer's tools get
    serve({"read_json": run})


# --- in-process tools -------------------------------------------------------------------------

def run_cli(args, extra: tuple[str, ...] = (), out: str | None = None, env: dict | None = None) -> dict:
    # Each run packs into a fresh directory: deleting the previous run's output (what
    # --overwrite would do, 0.03-0.06 s of page-cache truncation) is not part of packing.
    out = out or args.out
    shutil.rmtree(out, ignore_errors=True)
    cmd = [PACKER, "pack", args.input, "-o", out, "--pack-size", str(args.pack_size), "--json", *extra]
    r = run_measured(cmd, env=None if env is None else {**user_env(), **env})
    phases = json.loads(r["stdout"])["seconds"]  # the summary's own clock: pass two is "write"
    return {"seconds": r["wall_s"], "peak_rss_bytes": r["peak_rss_bytes"], "cpu_s": r["cpu_s"],
            "out_bytes": dir_bytes(out), "write_s": phases["write"], "read_s": phases["read"]}


def run_cli_bridge(args, env: dict | None = None) -> dict:
    out = args.out + "_bridge"
    row = run_cli(args, ("--format", "megatron-bridge"), out, env)
    row["read_group_ms"] = bridge_group_read_ms(os.path.join(out, f"training_{args.pack_size}.idx.parquet"))
    shutil.rmtree(out, ignore_errors=True)
    return row


def bridge_group_read_ms(path: str, reads: int = 300) -> float:
    """What Bridge's ``GPTSFTPackedParquetDataset`` pays per sample in shuffled order: one row
    group read (its three columns) and one row turned into Python lists; ms, the file cached."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    groups = np.random.default_rng(0).integers(0, pf.metadata.num_row_groups, reads)
    start = time.perf_counter()
    for g in groups:
        table = pf.read_row_group(int(g), columns=["input_ids", "seq_start_id", "loss_mask"])
        [table.column(name)[0].as_py() for name in ("input_ids", "seq_start_id", "loss_mask")]
    return (time.perf_counter() - start) / reads * 1e3


FLOOR_SAMPLES = 256


def floor_input(path: str, directory: str) -> str:
    """The first ``FLOOR_SAMPLES`` samples of ``path``, in the same format, written once in
    ``directory`` (beside ``--out``: on the disk being measured)."""
    ext = ".parquet" if path.endswith(".parquet") else ".jsonl"
    small = os.path.join(directory, f"floor_input{ext}")
    if ext == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(pq.ParquetFile(path).read_row_group(0).slice(0, FLOOR_SAMPLES), small)
    else:
        with open(path, "rb") as src, open(small, "wb") as dst:
            for _, line in zip(range(FLOOR_SAMPLES), src):
                dst.write(line)
    return small


def run_cli_floor(args) -> dict:
    out = args.out + "_floor"
    shutil.rmtree(out, ignore_errors=True)
    r = run_measured([PACKER, "pack", args.floor_input, "-o", out, "--pack-size", str(args.pack_size), "--json"])
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": r["wall_s"], "cpu_s": r["cpu_s"]}


def run_trl_process(args) -> dict:
    out = args.out + "_trl"
    shutil.rmtree(out, ignore_errors=True)
    r = run_measured([PYTHON, os.path.abspath(__file__), "--input", args.input, "--pack-size", str(args.pack_size),
                      "--out", out, "--serve", "trl_once"])
    row = json.loads(r["stdout"].strip().splitlines()[-1])
    row.update(seconds=r["wall_s"], cpu_s=r["cpu_s"], peak_rss_bytes=r["peak_rss_bytes"], out_bytes=dir_bytes(out))
    shutil.rmtree(out, ignore_errors=True)
    return row


def run_disk(args) -> dict:
    """Sequential write bandwidth: ``np.tofile`` of 64 MiB blocks, then ``fsync``, timed together."""
    path = os.path.join(os.path.dirname(args.out), "disk_probe.bin")  # the disk packer writes to
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    n_blocks = max(1, int(args.disk_gb * (1 << 30)) // block.size)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n_blocks):
            block.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return {"seconds": seconds, "bytes": n_blocks * block.size, "bytes_per_s": n_blocks * block.size / seconds}


def run_disk_direct(args) -> dict:
    """The device's sequential write rate: 16 MiB ``O_DIRECT`` writes from one reused page-aligned
    buffer, then ``fsync``, timed together (``dd oflag=direct bs=16M conv=fsync``). No page
    cache is involved, so this is the disk, not the cost of the kernel's page allocation."""
    import mmap

    path = os.path.join(os.path.dirname(args.out), "disk_direct_probe.bin")  # the disk packer writes to
    block = mmap.mmap(-1, 16 << 20)
    np.frombuffer(block, dtype=np.uint8)[:] = np.random.default_rng(2).integers(0, 255, 16 << 20, dtype=np.uint8)
    n_blocks = max(1, int(args.disk_gb * (1 << 30)) // len(block))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for _ in range(n_blocks):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return {"seconds": seconds, "bytes": n_blocks * len(block), "bytes_per_s": n_blocks * len(block) / seconds}


def run_pages(args) -> dict:
    """Page-cache write speed into memory idle for 4 s ("cold") and just freed ("hot")."""
    block = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)

    def write(path: str) -> float:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(8):  # 512 MB
                block.tofile(f)
        return time.perf_counter() - t0

    path = os.path.join(os.path.dirname(args.out), "pages_probe.bin")  # beside the output, as the disk probes
    time.sleep(4)
    cold = write(path)
    os.unlink(path)
    hot = write(path)
    os.unlink(path)
    return {"seconds": cold, "cold_s": cold, "hot_s": hot, "bytes": 8 * block.size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--pack-size", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    # `pages` must not follow `disk`, which has just freed 2 GB of memory it would reuse
    ap.add_argument("--tools", default="cli,cli_floor,cli_bridge,cli_bridge_arrow,api,trl,trl_file,trl_whole,trl_process,decode,disk,disk_direct,"
                                        "decode_packer,pages")
    ap.add_argument("--disk-gb", type=float, default=2.0)
    ap.add_argument("--out", default=os.path.join(OUT, "e2e"))
    ap.add_argument("--serve", choices=["packer", "trl", "trl_once", "read_json"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        {"packer": serve_packer, "trl": serve_trl, "trl_once": trl_once, "read_json": serve_read_json}[args.serve](args)
        return
    # the helper processes run in benchmarks/: a path given relative to here must still name the file
    args.input, args.out = os.path.abspath(args.input), os.path.abspath(args.out)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tools = args.tools.split(",")
    missing = {tool: peer for tool, peer in (("trl", "trl"), ("trl_file", "trl"), ("trl_whole", "trl"), ("trl_process", "trl"),
                                             ("read_json", "pyarrow.json")) if tool in tools and not _importable(peer)}
    for tool, peer in missing.items():  # a peer is an optional benchmark dependency: skip it, keep packer's rows
        emit({"what": "skipped", "tool": tool, "reason": f"{peer} is not importable (pip install {peer.split('.')[0]})"})
    tools = [tool for tool in tools if tool not in missing]
    samples, tokens = _count_tokens(args.input)
    base = ["bench_e2e.py", "--input", args.input, "--pack-size", str(args.pack_size)]
    workers: dict[str, Worker] = {}
    try:
        if {"api", "decode", "decode_packer"} & set(tools):
            workers["packer"] = Worker(base + ["--serve", "packer", "--out", args.out + "_api"])
        if {"trl", "trl_file", "trl_whole"} & set(tools):
            workers["trl"] = Worker(base + ["--serve", "trl"])
        if "read_json" in tools:
            workers["read_json"] = Worker(base + ["--serve", "read_json"])
        if "cli" in tools:
            run_cli(args)  # warm-up (page cache, numba cache files)
        if "cli_floor" in tools:
            args.floor_input = floor_input(args.input, os.path.dirname(args.out))
        rows: dict[str, list[dict]] = {t: [] for t in tools}
        for r in range(args.runs):
            for tool in tools:
                if tool == "cli":
                    row = run_cli(args)
                elif tool == "cli_floor":
                    row = run_cli_floor(args)
                elif tool == "cli_zlib":
                    row = run_cli(args, env={"PACKER_GZIP_DECODER": "zlib"})
                elif tool == "cli_bridge":
                    row = run_cli_bridge(args)
                elif tool == "cli_bridge_arrow":
                    row = run_cli_bridge(args, {"PACKER_PARQUET_ENCODER": "arrow"})
                elif tool == "trl_process":
                    row = run_trl_process(args)
                elif tool == "disk":
                    row = run_disk(args)
                elif tool == "disk_direct":
                    row = run_disk_direct(args)
                elif tool == "pages":
                    row = run_pages(args)
                elif tool in ("api", "decode", "decode_packer"):
                    row = workers["packer"].call(tool)
                elif tool in ("trl", "trl_file", "trl_whole"):
                    row = workers["trl"].call(tool)
                else:
                    row = workers["read_json"].call(tool)
                row.update(what="run", tool=tool, round=r)
                emit(row)
                rows[tool].append(row)
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(args.out + "_api", ignore_errors=True)
    summary = {"what": "summary", "input": os.path.relpath(args.input, os.path.dirname(HERE)), "samples": samples,
               "tokens": tokens, "input_bytes": os.path.getsize(args.input), "pack_size": args.pack_size,
               "runs": args.runs, "python": PYTHON}
    for tool, tool_rows in rows.items():
        sec = median([x["seconds"] for x in tool_rows])
        entry = {"median_s": sec, "min_s": min(x["seconds"] for x in tool_rows)}
        if tool not in ("disk", "disk_direct", "pages", "cli_floor"):
            entry["tokens_per_s"] = tokens / sec
        for key in ("packs", "out_bytes", "peak_rss_bytes", "bytes_per_s", "cold_s", "hot_s", "cpu_s", "fast_rows", "bytes",
                    "write_s", "read_s", "schema_given", "import_s", "load_s", "pack_s", "save_s", "read_group_ms"):
            if key in tool_rows[0]:
                entry[key] = median([x[key] for x in tool_rows])
        summary[tool] = entry
    trl_ways = [tool for tool in ("trl", "trl_file") if tool in summary]
    if trl_ways:  # the peer of every ratio against TRL: TRL's faster way on this run
        summary["trl_peer"] = min(trl_ways, key=lambda tool: summary[tool]["median_s"])
    emit(summary)
    shutil.rmtree(args.out, ignore_errors=True)
    if getattr(args, "floor_input", None):
        os.unlink(args.floor_input)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()

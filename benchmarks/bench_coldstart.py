"""Cold start: what each command costs the first time it runs after an install, and after that.

packer's kernels are compiled by numba at their first use and cached (docs/PACK.md, *Compiled
kernels and their cache*); every other benchmark step runs with them cached. This step copies
the package's sources (no ``__pycache__``, so no cached kernel and no bytecode) into a
temporary directory, puts it first on ``PYTHONPATH`` (``NUMBA_CACHE_DIR`` unset: the kernels go
beside the copy's sources, as in a user's install) and runs the commands a new user would, in
this order, each twice: the first run compiles what no earlier command compiled, the second
loads everything from the cache. The input is the benchmark table's first ``--samples``
samples, as Parquet and as JSON Lines, so the first run's time is mostly compiling.

Each row has both wall times, the kernels the command said it compiled and the seconds it said
that took (its ``compiled N of packer's kernels in S s`` line, which it prints where stderr is
a terminal: each command runs with stderr on a pseudo-terminal).

    python benchmarks/bench_coldstart.py --input benchmarks/_data/sft4k_200000.parquet --samples 2000
"""
from __future__ import annotations

import argparse
import os
import pty
import re
import shutil
import subprocess
import sys
import tempfile
import time

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from _util import PYTHON, REPO, emit, user_env

COMPILED = re.compile(r"^compiled (\d+) of packer's kernels in ([0-9.]+) s", re.M)


def commands(work: str) -> list[tuple[str, list[str]]]:
    """(name, arguments of ``python -m packer_cli``) in the order a new user runs them."""
    parquet, jsonl = os.path.join(work, "in.parquet"), os.path.join(work, "in.jsonl")
    native, bridge = os.path.join(work, "native"), os.path.join(work, "bridge")
    return [
        ("pack (Parquet)", ["pack", parquet, "-o", native, "--overwrite"]),
        ("pack (JSON Lines)", ["pack", jsonl, "-o", os.path.join(work, "from_jsonl"), "--overwrite"]),
        ("pack --format megatron-bridge", ["pack", parquet, "-o", bridge, "--format", "megatron-bridge",
                                           "--overwrite"]),
        ("inspect", ["inspect", native]),
        ("verify", ["verify", native]),
        ("verify --source", ["verify", native, "--source", parquet]),
        ("inspect (Bridge split)", ["inspect", bridge]),
        ("verify (Bridge split)", ["verify", bridge]),
    ]


def run(args: list[str], env: dict, cwd: str) -> dict:
    """One command, its stderr on a pseudo-terminal (packer speaks of compiling only to a
    terminal), stdout discarded; its wall time and what it said it compiled."""
    master, slave = pty.openpty()
    t0 = time.perf_counter()
    child = subprocess.Popen([PYTHON, "-m", "packer_cli", *args], env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                             stderr=slave)
    os.close(slave)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed its side
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    status = child.wait()
    seconds = time.perf_counter() - t0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode(errors="replace")).replace("\r", "\n")
    if status != 0:
        sys.exit(f"packer {' '.join(args)} failed ({status}): {text.strip()[-500:]}")
    said = COMPILED.search(text)
    return {"seconds": seconds, "kernels": int(said.group(1)) if said else 0,
            "compile_s": float(said.group(2)) if said else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="tokenized Parquet file (its first samples are used)")
    ap.add_argument("--samples", type=int, default=2000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="packer-coldstart-") as work:
        copy = os.path.join(work, "pkg")
        shutil.copytree(os.path.join(REPO, "packer_cli"), os.path.join(copy, "packer_cli"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        table = pq.ParquetFile(args.input).iter_batches(batch_size=args.samples)
        first = pa.Table.from_batches([next(table)])
        pq.write_table(first, os.path.join(work, "in.parquet"))
        with open(os.path.join(work, "in.jsonl"), "wb") as f:
            for record in first.to_pylist():
                f.write(orjson.dumps(record) + b"\n")
        env = user_env()
        env.pop("NUMBA_CACHE_DIR", None)
        env["PYTHONPATH"] = copy
        env["COLUMNS"] = "400"  # the terminal's lines unwrapped
        # the working directory is not the checkout: ``python -m`` puts it first on sys.path
        probe = subprocess.run([PYTHON, "-c", "import packer_cli; print(packer_cli.__file__)"], env=env, cwd=work,
                               capture_output=True, text=True, check=True).stdout.strip()
        if not probe.startswith(copy):
            sys.exit(f"the copy is not what Python imports ({probe})")
        total_cold = total_warm = 0.0
        for name, cmd in commands(work):
            cold = run(cmd, env, work)
            warm = run(cmd, env, work)
            total_cold += cold["seconds"]
            total_warm += warm["seconds"]
            emit({"what": "command", "command": name, "args": " ".join(cmd).replace(work, "WORK"),
                  "first_s": cold["seconds"], "second_s": warm["seconds"], "kernels": cold["kernels"],
                  "compile_s": cold["compile_s"], "second_kernels": warm["kernels"]})
        emit({"what": "summary", "samples": first.num_rows, "first_s": total_cold, "second_s": total_warm})


if __name__ == "__main__":
    main()

"""Cold start: what each command costs the first time it runs after an install, and after that.

packer's kernels are compiled by numba at their first use and cached (docs/PACK.md, *Compiled
kernels and their cache*); every other benchmark step runs with them cached. This step copies
the package's sources (no ``__pycache__``, so no cached kernel and no bytecode) into a
temporary directory, puts it first on ``PYTHONPATH`` (``NUMBA_CACHE_DIR`` unset: the kernels go
beside the copy's sources, as in a user's install) and runs the commands a new user would, in
this order, each twice: the first run compiles what no earlier command compiled, the second
loads everything from the cache. Alternating with that sequence, the first ``pack`` alone runs in
another fresh copy with ``PACKER_COMPILE_AHEAD=0``: without the helper process that compiles the
plan's and pass two's kernels while the run reads (``packer_cli/_compile_ahead.py``). Each
variant runs ``--rounds`` times, every round from a fresh copy; the rows are medians. The input is the benchmark table's first ``--samples``
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

from _util import PYTHON, REPO, emit, median, user_env

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


def fresh_copy(work: str, name: str) -> str:
    """The package's sources, without ``__pycache__`` (no cached kernel, no bytecode), in ``work/name``."""
    copy = os.path.join(work, name)
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(os.path.join(REPO, "packer_cli"), os.path.join(copy, "packer_cli"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def environment(copy: str, work: str, **extra: str) -> dict:
    env = user_env()
    env.pop("NUMBA_CACHE_DIR", None)
    env.update(PYTHONPATH=copy, COLUMNS="400", **extra)  # COLUMNS: the terminal's lines unwrapped
    # the working directory is not the checkout: ``python -m`` puts it first on sys.path
    probe = subprocess.run([PYTHON, "-c", "import packer_cli; print(packer_cli.__file__)"], env=env, cwd=work,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not probe.startswith(copy):
        sys.exit(f"the copy is not what Python imports ({probe})")
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="tokenized Parquet file (its first samples are used)")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3, help="fresh copies per variant, alternating (medians)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="packer-coldstart-") as work:
        table = pq.ParquetFile(args.input).iter_batches(batch_size=args.samples)
        first = pa.Table.from_batches([next(table)])
        pq.write_table(first, os.path.join(work, "in.parquet"))
        with open(os.path.join(work, "in.jsonl"), "wb") as f:
            for record in first.to_pylist():
                f.write(orjson.dumps(record) + b"\n")
        runs: dict[str, list[tuple[dict, dict]]] = {}
        alone: list[dict] = []
        for k in range(args.rounds):
            for variant in (("sequence", "no helper") if k % 2 == 0 else ("no helper", "sequence")):
                if variant == "no helper":  # the first pack again, without the compile-ahead helper
                    copy = fresh_copy(work, "pkg-alone")
                    env = environment(copy, work, PACKER_COMPILE_AHEAD="0")
                    alone.append(run(commands(work)[0][1], env, work))
                    continue
                copy = fresh_copy(work, "pkg")
                env = environment(copy, work)
                for name, cmd in commands(work):
                    runs.setdefault(name, []).append((run(cmd, env, work), run(cmd, env, work)))
        total_cold = total_warm = 0.0
        for name, cmd in commands(work):
            cold = sorted(runs[name], key=lambda r: r[0]["seconds"])[len(runs[name]) // 2][0]  # the median run
            warm = median([r[1]["seconds"] for r in runs[name]])
            total_cold += cold["seconds"]
            total_warm += warm
            emit({"what": "command", "command": name, "args": " ".join(cmd).replace(work, "WORK"),
                  "first_s": cold["seconds"], "second_s": warm, "kernels": cold["kernels"],
                  "compile_s": cold["compile_s"], "every_first_s": [r[0]["seconds"] for r in runs[name]],
                  "second_kernels": max(r[1]["kernels"] for r in runs[name])})
        middle = sorted(alone, key=lambda r: r["seconds"])[len(alone) // 2]
        emit({"what": "no_helper", "command": commands(work)[0][0], "first_s": middle["seconds"],
              "kernels": middle["kernels"], "compile_s": middle["compile_s"],
              "every_first_s": [r["seconds"] for r in alone]})
        emit({"what": "summary", "samples": first.num_rows, "first_s": total_cold, "second_s": total_warm,
              "rounds": args.rounds})


if __name__ == "__main__":
    main()

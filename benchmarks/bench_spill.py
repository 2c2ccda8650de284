"""Reading the spill back at random or staged, with and without room for it in the page cache.

Pass two reads the spill one sequence at a time in output order (``--spill-read random``): fast
while the page cache holds the spill, a device read per sequence once it does not. To measure
the second case on a machine with plenty of memory, the k× input is packed inside a memory
cgroup (v1 or v2, made under this process's own group; needs the right to create one, e.g. as
root) whose limit leaves the spill no room: the page cache a group uses is charged to it.
``random`` and ``staged`` run interleaved, ``--rounds`` times; ``auto`` once, to show its choice.
The same two modes also run at 1× without a limit, where the spill stays cached: what staging
costs when it is not needed. Without a usable cgroup the limited part is skipped (reported).

    python benchmarks/bench_spill.py --input benchmarks/_data/sft4k_200000.parquet --times 5 --limit-mb 1200
    python benchmarks/bench_spill.py ... --format megatron-bridge   # the same for Bridge's layout
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

from _util import HERE, PACKER, emit, median, run_measured

OUT = os.path.join(HERE, "_out", "spill")


class MemoryCgroup:
    """A child memory cgroup of this process's own, with a limit; ``wrap(cmd)`` runs a command in it."""

    def __init__(self, limit_bytes: int, root: str = "/sys/fs/cgroup"):
        self.path = self._make(root)
        limit_file = "memory.max" if self.v2 else "memory.limit_in_bytes"
        with open(os.path.join(self.path, limit_file), "w") as f:
            f.write(str(limit_bytes))

    def _make(self, root: str) -> str:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                self.v2 = False
                base = os.path.join(root, "memory", path.lstrip("/"))
                break
        else:
            self.v2 = True
            path = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
            base = os.path.join(root, path.lstrip("/"))
        group = os.path.join(base, f"packer-bench-{os.getpid()}")
        os.mkdir(group)
        return group

    def wrap(self, cmd: list[str]) -> list[str]:
        procs = os.path.join(self.path, "cgroup.procs")
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *cmd]

    def close(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def run_pack(inputs: list[str], mode: str, pack_size: int, cgroup: MemoryCgroup | None, fmt: str = "native") -> dict:
    shutil.rmtree(OUT, ignore_errors=True)
    os.sync()  # the last run's dirty pages are not this run's to write back
    cmd = [PACKER, "pack", *inputs, "-o", OUT, "--pack-size", str(pack_size), "--json", "--spill-read", mode,
           "--format", fmt]
    r = run_measured(cgroup.wrap(cmd) if cgroup else cmd)
    summary = json.loads(r["stdout"])
    shutil.rmtree(OUT, ignore_errors=True)
    return {"mode": mode, "copies": len(inputs), "limited": cgroup is not None, "seconds": r["wall_s"],
            "cpu_s": r["cpu_s"], "peak_rss_bytes": r["peak_rss_bytes"], "phases": summary["seconds"],
            "spill": summary["spill"], "tokens": summary["counts"]["runtime_tokens"]}


def _summary(rows: list[dict]) -> dict:
    out = {}
    for mode in ("random", "staged"):
        mine = [r for r in rows if r["mode"] == mode]
        if mine:
            out[mode] = {"median_s": median([r["seconds"] for r in mine]),
                         "write_s": median([r["phases"]["write"] for r in mine]),
                         "peak_rss_bytes": median([r["peak_rss_bytes"] for r in mine]),
                         "all_seconds": [r["seconds"] for r in mine], "spill": mine[0]["spill"],
                         "tokens": mine[0]["tokens"]}
    if "random" in out and "staged" in out:
        out["staged_speedup"] = out["random"]["median_s"] / out["staged"]["median_s"]
        out["staged_write_speedup"] = out["random"]["write_s"] / out["staged"]["write_s"]
    return out


def main() -> None:
    global OUT  # --out replaces the default every function here uses
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT, help="the output directory (default: benchmarks/_out/spill)")
    ap.add_argument("--input", required=True)
    ap.add_argument("--times", type=int, default=5, help="copies of the input packed under the limit")
    ap.add_argument("--limit-mb", type=int, default=1200, help="the cgroup's memory limit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pack-size", type=int, default=4096)
    ap.add_argument("--format", default="native", help="native or megatron-bridge (the output written)")
    args = ap.parse_args()
    OUT = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)

    unlimited = []
    for _ in range(args.rounds):
        for mode in ("random", "staged"):
            unlimited.append(run_pack([args.input], mode, args.pack_size, None, args.format))
            emit({"what": "run", **unlimited[-1]})
    emit({"what": "summary", "part": "unlimited", "copies": 1, "format": args.format, **_summary(unlimited)})

    try:
        cgroup = MemoryCgroup(args.limit_mb << 20)
    except (OSError, StopIteration) as exc:
        emit({"what": "skipped", "part": "limited", "reason": f"no memory cgroup could be made: {exc}"})
        return
    try:
        limited = []
        inputs = [args.input] * args.times
        for _ in range(args.rounds):
            for mode in ("random", "staged"):
                limited.append(run_pack(inputs, mode, args.pack_size, cgroup, args.format))
                emit({"what": "run", **limited[-1]})
        auto = run_pack(inputs, "auto", args.pack_size, cgroup, args.format)
        emit({"what": "run", **auto})
        emit({"what": "summary", "part": "limited", "copies": args.times, "limit_bytes": args.limit_mb << 20,
              "format": args.format,
              "auto_chose": auto["spill"]["read"], **_summary(limited)})
    finally:
        cgroup.close()


if __name__ == "__main__":
    main()

"""Run every packer benchmark against its peers and write ``benchmarks/RESULTS.md``.

    .venv/bin/python benchmarks/run.py            # full run, about 20 minutes
    .venv/bin/python benchmarks/run.py --quick    # smaller inputs, about 5 minutes on this 2-core machine

Each step is a separate script (runnable on its own, one JSON row per line on stdout);
this runner generates the data, runs them in turn, keeps every row in
``benchmarks/_out/results.json`` and renders the tables. Timings are medians of ``--runs``
interleaved rounds; ratios compare tools measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

from _util import HERE, PYTHON, REPO, code_state, machine, versions

OUT = os.path.join(HERE, "_out")

FULL = {"inputs_samples": 100_000, "samples": 200_000, "jsonl_samples": 200_000, "plan_n": 1_000_000, "python_n": 100_000,
        "quality_n": 1_000_000, "disk_gb": 2.0, "memory_times": 10, "audit_tokens": 200e6, "runs": 5,
        "spill_times": 5, "spill_limit_mb": 1200, "balance_n": 200_000, "order_n": 200_000,
        "coldstart_samples": 2_000}
QUICK = {"inputs_samples": 20_000, "samples": 50_000, "jsonl_samples": 10_000, "plan_n": 200_000, "python_n": 20_000,
         "quality_n": 200_000, "disk_gb": 0.5, "memory_times": 10, "audit_tokens": 20e6, "runs": 5,
         "spill_times": 10, "spill_limit_mb": 900, "balance_n": 50_000, "order_n": 50_000,
         "coldstart_samples": 2_000}

TARGETS = {"e2e_vs_trl": 5.0, "e2e_vs_disk": 0.5, "jsonl_vs_read_json": 2.0, "audit_tokens_per_s": 100e6}


def step(name: str, args: list[str], log: list) -> list[dict]:
    """Run one benchmark script; its JSON rows (stdout), echoed to the terminal."""
    print(f"\n== {name}: {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([PYTHON, *args], cwd=HERE, stdout=subprocess.PIPE, text=True)
    rows = []
    for line in proc.stdout.splitlines():
        print("  " + line[:200], flush=True)
        if line.startswith("{"):
            rows.append(json.loads(line))
    log.append({"step": name, "command": "python benchmarks/" + " ".join(args), "seconds": time.perf_counter() - t0,
                "returncode": proc.returncode})
    if proc.returncode != 0:
        print(f"!! {name} failed with exit code {proc.returncode}", flush=True)
    return rows


def last(rows: list[dict], what: str = "summary") -> dict:
    found = [r for r in rows if r.get("what") == what]
    return found[-1] if found else {}


#: The steps ``--only`` may name (``data`` always runs: the others read its files).
STEPS = ("plan", "quality", "order", "e2e", "inputs", "jsonl", "memory", "spill", "audit", "loader", "balance",
         "coldstart")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller inputs (about 5 minutes on 2 cores)")
    ap.add_argument("--only", nargs="+", choices=STEPS, metavar="STEP",
                    help=f"run only these steps ({' '.join(STEPS)}; memory includes memory_bridge)")
    ap.add_argument("--no-write", action="store_true", help="do not rewrite RESULTS.md")
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    os.makedirs(OUT, exist_ok=True)
    started = time.perf_counter()
    results: dict = {"mode": "quick" if args.quick else "full", "config": cfg, "machine": machine(),
                     "versions": versions(), "code": code_state(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                     "steps": []}
    log = results["steps"]
    wanted = set(args.only or STEPS)

    data = step("data", ["bench_data.py", "--samples", str(cfg["samples"]), "--jsonl-samples",
                         str(cfg["jsonl_samples"])], log)
    parquet = os.path.join(REPO, last(data, "parquet")["path"])
    jsonl = os.path.join(REPO, last(data, "jsonl")["path"])
    jsonl_gz = os.path.join(REPO, last(data, "jsonl_gz")["path"])
    results["data"] = data
    runs = str(cfg["runs"])
    if "e2e" in wanted:
        results["e2e"] = step("e2e", ["bench_e2e.py", "--input", parquet, "--runs", runs,
                                      "--disk-gb", str(cfg["disk_gb"])], log)
    if "jsonl" in wanted:
        results["jsonl"] = step("jsonl", ["bench_e2e.py", "--input", jsonl, "--runs", runs,
                                          "--tools", "cli,api,read_json", "--out", os.path.join(OUT, "jsonl")], log)
        results["jsonl_gz"] = step("jsonl_gz", ["bench_e2e.py", "--input", jsonl_gz, "--runs", runs,
                                                "--tools", "cli,cli_zlib,read_json", "--out",
                                                os.path.join(OUT, "jsonl_gz")], log)
    if "memory" in wanted:
        results["memory"] = step("memory", ["bench_memory.py", "--input", parquet, "--times",
                                            str(cfg["memory_times"]), "--repeats", "5", "--verify-source"], log)
        # the same for Bridge's layout (once each: it is reported, not a target)
        results["memory_bridge"] = step("memory_bridge", ["bench_memory.py", "--input", parquet, "--times",
                                                          str(cfg["memory_times"]), "--repeats", "1",
                                                          "--format", "megatron-bridge"], log)
    if "inputs" in wanted:
        results["inputs"] = step("inputs", ["bench_inputs.py", "--input", parquet, "--samples",
                                            str(cfg["inputs_samples"]), "--runs", runs], log)
    if "spill" in wanted:
        results["spill"] = step("spill", ["bench_spill.py", "--input", parquet, "--times", str(cfg["spill_times"]),
                                          "--limit-mb", str(cfg["spill_limit_mb"]), "--rounds", "3"], log)
    if "plan" in wanted:
        plan_json = os.path.join(OUT, "bench_plan.json")
        step("plan", ["bench_plan.py", "--n", str(cfg["plan_n"]), "--runs", runs, "--python-n", str(cfg["python_n"]),
                      "--json-out", plan_json], log)
        if os.path.exists(plan_json):
            with open(plan_json) as f:
                results["plan"] = json.load(f)
    if "quality" in wanted:
        results["quality"] = step("quality", ["bench_quality.py", "--n", str(cfg["quality_n"]), "--python-n",
                                              str(cfg["quality_n"] if not args.quick else cfg["python_n"])], log)
    if "order" in wanted:
        results["order"] = step("order", ["bench_order.py", "--n", str(cfg["order_n"])], log)
    if "audit" in wanted and os.path.exists(os.path.join(HERE, "bench_audit.py")):
        results["audit"] = step("audit", ["bench_audit.py", "--tokens", str(cfg["audit_tokens"]),
                                          "--repeat", runs], log)
    if "loader" in wanted:
        results["loader"] = step("loader", ["bench_loader.py", "--input", parquet, "--runs", runs], log)
    if "balance" in wanted:
        results["balance"] = step("balance", ["bench_balance.py", "--n", str(cfg["balance_n"])], log)
    if "coldstart" in wanted:
        results["coldstart"] = step("coldstart", ["bench_coldstart.py", "--input", parquet, "--samples",
                                                  str(cfg["coldstart_samples"])], log)
    results["total_seconds"] = time.perf_counter() - started
    results["load_avg_end"] = os.getloadavg()
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if not args.no_write:
        from report import render

        with open(os.path.join(HERE, "RESULTS.md"), "w") as f:
            f.write(render(results, TARGETS))
        print(f"\nwrote benchmarks/RESULTS.md ({results['total_seconds']:.0f} s)")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()

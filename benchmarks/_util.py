"""Shared helpers of the benchmark scripts: timing subprocesses, peak memory, machine facts.

Every script prints one JSON object per line on stdout (``emit``); ``run.py`` collects them.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PYTHON = sys.executable
PACKER = os.path.join(os.path.dirname(PYTHON), "packer")


def emit(obj: dict) -> None:
    """One JSON result row on stdout."""
    print(json.dumps(obj, sort_keys=True), flush=True)


def median(values) -> float:
    return float(statistics.median(values))


#: Fields of /proc/PID/status polled by :func:`run_measured`: the resident high-water mark, and
#: the three parts of the resident set now (anonymous memory; pages of mapped files, shared
#: libraries included; shared memory, where ``pack`` held the spill's first 256 MiB before they
#: became anonymous memory).
_RSS_FIELDS = {"VmHWM": "hwm", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


def _rss(pid: int) -> dict[str, int] | None:
    """The process's :data:`_RSS_FIELDS` in bytes; None once it exited."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in _RSS_FIELDS:
                    found[_RSS_FIELDS[name]] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    return found or None


def user_env() -> dict:
    """This environment as a user's shell would have it: Python writes and reuses bytecode.

    Sandboxes often set ``PYTHONDONTWRITEBYTECODE``, which makes every fresh process compile
    packer's modules from source again (about 0.05 s a start here); a user's install does not.
    """
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_measured(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> dict:
    """Run ``cmd`` (by default in :func:`user_env`); wall seconds, peak RSS (bytes), CPU seconds and output.

    Peak RSS is the child's ``VmHWM``, polled every 5 ms until it exits: ``wait4``'s
    ``ru_maxrss`` would also count the parent's pages (a child started with ``vfork`` inherits
    the parent's high-water mark at ``exec``). The same polls keep the largest ``RssAnon`` and
    ``RssFile`` seen: how much of the peak is the process's own memory, and how much is pages of
    mapped files (shared libraries: how many of those count depends on how the page cache holds
    them, see benchmarks/README.md). Raises ``RuntimeError`` with the tail of stderr when the
    command fails.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env if env is not None else user_env(), cwd=cwd)
        peaks = dict.fromkeys(_RSS_FIELDS.values(), 0)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            for key, value in (_rss(proc.pid) or {}).items():
                peaks[key] = max(peaks[key], value)
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}): {stderr.strip()[-2000:]}")
    return {
        "wall_s": wall,
        "peak_rss_bytes": peaks["hwm"],
        "peak_rss_anon_bytes": peaks["anon"],
        "peak_rss_file_bytes": peaks["file"],
        "peak_rss_shmem_bytes": peaks["shmem"],
        "wait4_maxrss_bytes": usage.ru_maxrss * 1024,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "stdout": stdout,
        "stderr": stderr,
    }


class Worker:
    """A persistent helper process answering one JSON line per command (keeps imports and data
    loaded between timed runs, so runs of different tools can be interleaved)."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([PYTHON, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=HERE)
        self.ready = self.call(None)

    def call(self, command: str | None) -> dict:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            args = self.proc.args
            role = args[args.index("--serve") + 1] if "--serve" in args[:-1] else " ".join(args[1:2])
            raise RuntimeError(f"the {role} worker ({args[1]} --serve {role}) exited with {self.proc.wait()}; "
                               "its error is printed above")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def serve(handlers: dict, ready: dict | None = None) -> None:
    """Worker side of :class:`Worker`: answer each stdin command with one JSON line."""
    print(json.dumps(ready or {"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        print(json.dumps(handlers[command]()), flush=True)


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("packer-cli", "typer", "numpy", "pyarrow", "numba", "orjson", "xxhash", "trl", "datasets",
                 "lightbinpack", "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def code_state() -> dict:
    """The commit the benchmarked code is at, and whether packer's files differ from it (None
    outside a git checkout)."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", "../packer_cli", "../pyproject.toml") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
            "system": platform.system(), "load_avg": os.getloadavg()}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)

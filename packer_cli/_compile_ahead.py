"""Compile pass two's kernels in a second process while pass one compiles its own.

The first ``pack`` after an install compiles every kernel it uses, one after another as the run
reaches them (numba compiles under one lock a process): about 25-40 s on the benchmark machine
for a Parquet input, of which reading's kernels (the footer and page walks, the decoders) take
about half and the spill, the plan and the gather (the largest kernel) the other half. Both
halves can compile at once in two processes, since the cache on disk is shared::

    pack        compiles reading's kernels ── reads ── plans ── waits ── writes (kernels loaded)
    helper      packs a tiny generated input ──────────────▶ (its kernels cached, then it exits)

:func:`start` launches the helper (``python -m packer_cli._compile_ahead``) where the gather
kernel has nothing cached for this CPU, this numba and this source (a later run finds it and
starts nothing). The helper packs a few generated samples from an Arrow IPC file, with the run's
spec and output format, in a temporary directory the run made for it and removes however the
helper ends (a killed one cleans up nothing): that compiles the same kernels, for the same
argument types, as the run's spill, plan and pass two, whatever the run reads. The run waits for
it before pass two (:meth:`Helper.wait`), so that it loads what the helper compiled rather than
compiling it a second time. The helper's samples plan without a gap to the L2 bound, so the
improvement pass's kernels (about 10 s) are the run's own: it reaches them while the helper
still compiles the gather, which is the better split of the work on two cores. Measured on the
benchmark machine (2 cores), the first ``pack`` of 256 samples took 14.4-16.9 s against
20.1-23.8 s without the helper, of 2,000 (whose plan runs the improvement pass) 23.1-27.9 s
against 30.0-35.5 s.

Anything that goes wrong in the helper only costs the run the time it would have spent anyway:
the run compiles whatever it does not find cached. ``PACKER_COMPILE_AHEAD=0`` never starts one
(``1``, or unset, is the default); nor does a machine with one core, a dry run or the Python API
unless asked (``pack(..., compile_ahead=True)``).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile

import orjson

from packer_cli.errors import env_choice, reraise_interrupt

#: ``0`` never starts the helper; ``1`` (the default) starts it where kernels need compiling.
ENV_COMPILE_AHEAD = "PACKER_COMPILE_AHEAD"
CHOICES = ("1", "0")  # the first is the default

#: The options of a Bridge output the helper's run takes over (the rest is a run's own state).
_OUTPUT_OPTIONS = ("split", "eos_id", "row_group_size", "parquet_encoding")

#: Longest wait for the helper before the run goes on and compiles what it still needs itself.
WAIT_S = 120.0


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def needs_compiling() -> bool:
    """Whether pass two's largest kernel has nothing cached for this CPU (the first run after an
    install or upgrade). False where that cannot be told (a numba without these internals, or
    kernels compiled in memory: nothing a helper compiled could be shared then)."""
    try:
        from packer_cli.shards._gather import _pread_gather_kernel as kernel

        index = kernel._cache._cache_file._load_index()
        magic = kernel.targetctx.codegen().magic_tuple()
        return not any(len(key) > 1 and key[1] == magic for key in index)
    except Exception as exc:  # noqa: BLE001 - numba's internals moved: just compile as before
        reraise_interrupt(exc)
        return False


class Helper:
    """A running helper process and the directory it works in; :meth:`wait` for it, :meth:`stop`
    it in any case. The run removes the directory itself: a helper stopped with SIGKILL (or by
    a signal during a compilation, which Python cannot interrupt) never runs its own clean-up."""

    def __init__(self, process: subprocess.Popen, workdir: str):
        self._process = process
        self.workdir = workdir

    def wait(self, limit: float = WAIT_S) -> None:
        """Until the helper exits, at most ``limit`` seconds (then it is stopped and the run
        compiles what it still needs itself)."""
        try:
            self._process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            pass
        self.stop()

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # unkillable for now: the system reaps it later
            return  # (its directory too may still be written to: left for the temporary directory's cleaner)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start(spec, output=None) -> Helper | None:
    """Start the helper for a run of ``spec`` (and a Bridge ``output``), where it pays (see the
    module docstring); None otherwise."""
    if (env_choice(ENV_COMPILE_AHEAD, CHOICES) == "0" or _cores() < 2 or not sys.executable
            or not needs_compiling()):  # (an embedded interpreter may not know its executable)
        return None
    job = {"spec": dataclasses.asdict(spec),
           "output": None if output is None else {name: getattr(output, name) for name in _OUTPUT_OPTIONS}}
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)  # the same cache, decoders and encoders; this package first on the path
    env["PYTHONPATH"] = os.pathsep.join([package_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        workdir = tempfile.mkdtemp(prefix="packer-compile-ahead-")
    except OSError:  # no temporary directory to be had: compile as before
        return None
    try:
        process = subprocess.Popen([sys.executable, "-m", "packer_cli._compile_ahead", orjson.dumps(job).decode(),
                                    workdir], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env=env, cwd=package_parent)
    except OSError:  # no process to be had (a limit, no memory): compile as before
        shutil.rmtree(workdir, ignore_errors=True)
        return None
    return Helper(process, workdir)


def _tiny_input(path: str, spec) -> None:
    """A few samples of int32 ids and a 0/1 mask, each ending with the same id (an EOS a Bridge
    output infers), short enough for any pack size: what pass one hands the spill and plan."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.feather as feather

    longest = max(2, min(spec.pack_size // 2, 300))
    lengths = np.unique(np.linspace(2, longest, 12).astype(np.int64))
    rng = np.random.default_rng(0)
    ids = [np.append(rng.integers(0, 50_000, n - 1, dtype=np.int32), np.int32(2)) for n in lengths]
    masks = [np.concatenate([np.zeros(n // 2, np.uint8), np.ones(n - n // 2, np.uint8)]) for n in lengths]
    table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())), "loss_mask": pa.array(masks, pa.list_(pa.uint8()))})
    feather.write_feather(table, path, compression="uncompressed")


def main(argv: list[str]) -> int:
    """The helper: pack a tiny input the way the run will (``argv``: the job, and the directory
    to work in, which the run removes)."""
    from packer_cli.pipeline import pack
    from packer_cli.spec import PackSpec

    try:
        os.nice(5)  # the run's own work first
    except OSError:
        pass
    job, work = orjson.loads(argv[0]), argv[1]
    spec = PackSpec(**job["spec"])
    output = None
    if job["output"] is not None:
        from packer_cli.shards.bridge_output import BridgeOutput

        output = BridgeOutput(**job["output"])
    source = os.path.join(work, "tiny.arrow")
    _tiny_input(source, spec)
    pack([source], os.path.join(work, "out"), spec, output=output, warn=None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The first ``pack`` after an install compiles pass two's kernels in a helper process while it
reads (packer_cli/_compile_ahead.py): the run then loads them instead of compiling them itself."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from packer_cli import _compile_ahead
from packer_cli.demo import demo_table
from packer_cli.errors import ConfigError
from packer_cli.spec import PackSpec

from firstrun import package_copy, run_on_a_terminal


@pytest.fixture
def own_cache():
    if os.environ.get("NUMBA_CACHE_DIR"):
        pytest.skip("kernels are cached apart (NUMBA_CACHE_DIR): a copy of the package would compile all of them")


@pytest.mark.parametrize("missing, expected", [("shards/_gather", True), (None, False)], ids=["cold", "cached"])
def test_needs_compiling_tells_a_cold_gather_kernel_from_a_cached_one(tmp_path, own_cache, missing, expected):
    if not missing:  # this checkout's own gather kernel may not be compiled yet (a fresh clone's suite)
        subprocess.run([sys.executable, "-m", "packer_cli", "pack", str(_demo(tmp_path)), "-o",
                        str(tmp_path / "warm-up")], capture_output=True, check=True)
    copy = package_copy(tmp_path, missing)
    said = subprocess.run([sys.executable, "-c", "from packer_cli._compile_ahead import needs_compiling as n; print(n())"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(copy)}, capture_output=True, text=True,
                          check=True)
    assert said.stdout.strip() == str(expected)


def _demo(tmp_path: Path) -> Path:
    src = tmp_path / "demo.parquet"
    if not src.exists():
        pq.write_table(demo_table(400, seed=6), src)
    return src


def test_the_first_pack_loads_pass_twos_kernels_that_the_helper_compiled(tmp_path, own_cache):
    # Two copies missing the gather module's kernels: with the helper the run compiles at most the
    # spill's (pass one needs it before the helper may have it), without it every one of them.
    src = _demo(tmp_path)
    counts, outputs = {}, {}
    for mode in ("1", "0"):
        here = tmp_path / f"mode{mode}"
        here.mkdir()
        copy = package_copy(here, "shards/_gather")
        scratch = here / "tmp"
        scratch.mkdir()
        env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "400",
               "TMPDIR": str(scratch), "PACKER_COMPILE_AHEAD": mode}
        status, _, shown = run_on_a_terminal([sys.executable, "-m", "packer_cli", "pack", str(src), "-o",
                                               str(here / "out"), "-C", "2048"], env, here)
        assert status == 0, shown
        said = [line for line in shown.splitlines() if line.startswith("compiled ")]
        assert len(said) == 1, shown
        counts[mode] = int(said[0].split()[1])
        outputs[mode] = {name: (here / "out" / name).read_bytes() for name in ("manifest.json", "metadata.json")}
        assert not list(scratch.iterdir())  # the helper removed its input and output
    assert counts["0"] >= 3 and counts["1"] <= 1, counts
    assert outputs["1"] == outputs["0"]


def test_start_hands_the_helper_the_runs_spec_and_bridge_options(tmp_path, monkeypatch):
    from packer_cli.shards.bridge_output import BridgeOutput

    record = tmp_path / "argv.json"
    fake = tmp_path / "fake_python.py"
    fake.write_text(f"import json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    monkeypatch.setattr(_compile_ahead, "needs_compiling", lambda: True)
    monkeypatch.setattr(_compile_ahead, "_cores", lambda: 2)
    spec = PackSpec(pack_size=1024, cp=2, algorithm="bfd", overlong="split", seed=7)
    output = BridgeOutput(split="validation", eos_id=3, row_group_size=5, parquet_encoding="plain-snappy")
    real_popen = subprocess.Popen

    def popen(args, **kwargs):  # the same command, run by a script that records its arguments
        assert args[:3] == [sys.executable, "-m", "packer_cli._compile_ahead"]
        return real_popen([sys.executable, str(fake), *args[3:]], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    helper = _compile_ahead.start(spec, output)
    assert helper is not None
    workdir = helper.workdir
    assert os.path.isdir(workdir) and os.path.dirname(workdir) == str(tmp_path)
    helper.wait(60)
    argv_job, given_dir = json.loads(record.read_text())
    assert given_dir == workdir and not os.path.exists(workdir)  # the run removed its helper's directory
    job = json.loads(argv_job)
    assert PackSpec(**job["spec"]) == spec
    assert job["output"] == {"split": "validation", "eos_id": 3, "row_group_size": 5, "parquet_encoding": "plain-snappy"}


@pytest.mark.parametrize("case", ["switched off", "one core", "cached", "no executable"])
def test_no_helper_where_it_cannot_pay(monkeypatch, case):
    monkeypatch.setattr(_compile_ahead, "needs_compiling", lambda: case != "cached")
    monkeypatch.setattr(_compile_ahead, "_cores", lambda: 1 if case == "one core" else 4)
    if case == "switched off":
        monkeypatch.setenv("PACKER_COMPILE_AHEAD", "0")
    if case == "no executable":  # an embedded interpreter's sys.executable may be empty
        monkeypatch.setattr(sys, "executable", "")
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    assert _compile_ahead.start(PackSpec(pack_size=64)) is None and not started


def test_a_helper_past_its_time_is_killed_and_its_directory_removed(tmp_path):
    # a killed helper runs no clean-up of its own: the run removes what it left
    work = tmp_path / "helper"
    (work / "out.tmp-1").mkdir(parents=True)
    (work / "out.tmp-1" / "spill.bin").write_bytes(b"x" * 100)
    helper = _compile_ahead.Helper(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]), str(work))
    helper.wait(0.5)
    assert helper._process.poll() is not None  # killed, and reaped
    assert not work.exists()
    helper.stop()  # again, as the run's clean-up does: nothing left to do


def test_the_helper_packs_a_tiny_input_the_runs_way(tmp_path):
    # What the helper runs, in this process: the run's spec and a Bridge output, in the
    # directory it is given.
    job = {"spec": json.loads(orjson.dumps(dataclasses.asdict(PackSpec(pack_size=96, cp=2, pad_to_max_length=True)))),
           "output": {"split": "training", "eos_id": None, "row_group_size": None, "parquet_encoding": "plain-zstd"}}
    assert _compile_ahead.main([json.dumps(job), str(tmp_path)]) == 0
    metadata = json.loads((tmp_path / "out" / "training.metadata.json").read_text())
    assert metadata["spec"]["cp"] == 2 and metadata["spec"]["pad_to_max_length"] is True
    assert pq.read_table(tmp_path / "out" / "training_96.idx.parquet").num_rows > 0


def test_a_misspelt_switch_is_a_usage_error(tmp_path, monkeypatch):
    from packer_cli import pack

    src = _demo(tmp_path)
    monkeypatch.setenv("PACKER_COMPILE_AHEAD", "yes")
    with pytest.raises(ConfigError, match="PACKER_COMPILE_AHEAD"):
        pack([str(src)], str(tmp_path / "out"), PackSpec(pack_size=2048))
    assert not (tmp_path / "out").exists()
    monkeypatch.delenv("PACKER_COMPILE_AHEAD")
    with pytest.raises(ConfigError, match="compile_ahead"):
        pack([str(src)], str(tmp_path / "out"), PackSpec(pack_size=2048), compile_ahead="yes")
    done = subprocess.run([sys.executable, "-m", "packer_cli", "pack", str(src), "-o", str(tmp_path / "cli")],
                          env={**os.environ, "PACKER_COMPILE_AHEAD": "2"}, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "PACKER_COMPILE_AHEAD" in done.stderr, done.stderr

"""The Python API inside a user's process: warnings through :mod:`warnings`, exceptions that
cross a process pool, a Ctrl-C that comes out as ``KeyboardInterrupt``."""
from __future__ import annotations

import multiprocessing
import pickle
import warnings
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import orjson
import pytest

from packer_cli import DataError, PackSpec, pack
from packer_cli import plan as plan_module
from packer_cli.audit.findings import Finding
from packer_cli.audit._layout_checks import InconsistentOutput
from packer_cli.audit.store import ShardError
from packer_cli.errors import BadRecord, PackerWarning, interrupts_kept
from packer_cli.shards.bridge_reader import BridgeRowError


def _write(path, records):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def test_warnings_go_through_the_warnings_module(tmp_path):
    path = _write(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0],
                                           "labels": [1, 2, 3]}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pack([str(path)], str(tmp_path / "out"), PackSpec(pack_size=16))
    lines = [str(w.message) for w in caught if issubclass(w.category, PackerWarning)]
    assert any("the records' 'labels' was not read" in line for line in lines), lines
    assert any("no target tokens" in line for line in lines), lines
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackerWarning)  # a program's filters apply
        with pytest.raises(PackerWarning):
            pack([str(path)], str(tmp_path / "o2"), PackSpec(pack_size=16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pack([str(path)], str(tmp_path / "o3"), PackSpec(pack_size=16), warn=None)
    assert not [w for w in caught if issubclass(w.category, PackerWarning)]


def test_every_run_s_warnings_show_at_the_caller_s_line(tmp_path):
    """Python's default filter shows a warning once for each message and place: a second run's
    warnings (the same text, raised at the same line of packer's) were dropped."""
    path = _write(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for k in range(2):
            pack([str(path)], str(tmp_path / f"o{k}"), PackSpec(pack_size=16))
    ours = [w for w in caught if issubclass(w.category, PackerWarning)]
    assert [str(w.message) for w in ours] == ["1 sample has no target tokens (kept, they add no loss)"] * 2
    assert all(w.filename == __file__ for w in ours), [w.filename for w in ours]


@pytest.mark.parametrize("how", ["stdin", "-c", "-i"])
def test_a_warning_in_a_session_with_no_source_file_is_shown(tmp_path, how):
    """A REPL, ``python -c`` or a script on stdin: Python's loader of ``__main__`` raises when
    asked for the caller's line, and pack() failed with ImportError ("'__main__' is not a
    built-in module") at its first warning."""
    import subprocess
    import sys

    path = _write(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]}])
    script = (f"from packer_cli import PackSpec, pack\n"
              f"s = pack([{str(path)!r}], {str(tmp_path / 'out')!r}, PackSpec(pack_size=16))\n"
              f"print('packs', s.counts['packs'])\n")
    argv = {"stdin": ["-"], "-c": ["-c", script], "-i": ["-i"]}[how]
    done = subprocess.run([sys.executable, *argv], input=script if how != "-c" else None, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "packs 1" in done.stdout, done.stderr
    assert "PackerWarning: 1 sample has no target tokens" in done.stderr and "Error" not in done.stderr, done.stderr
    strict = "import warnings\nwarnings.filterwarnings('error', module='__main__')\n" + script.replace("out", "out2")
    argv = {"stdin": ["-"], "-c": ["-c", strict], "-i": ["-i"]}[how]  # a filter for __main__ applies there too
    done = subprocess.run([sys.executable, *argv], input=strict if how != "-c" else None, capture_output=True,
                          text=True, timeout=120)
    assert "packer_cli.errors.PackerWarning: 1 sample has no target tokens" in done.stderr, done.stderr
    assert "packs" not in done.stdout and not (tmp_path / "out2").exists()


def test_a_warning_reaches_callers_packer_does_not_own(tmp_path, monkeypatch):
    """Code run with globals that have no ``__name__`` (``exec(code, {})``: the warning was
    dropped), and a user's module whose name merely starts with packer_cli (skipped as packer's
    own: the warning named a line of importlib's)."""
    import sys

    path = _write(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]}])
    code = (f"from packer_cli import PackSpec, pack\n"
            f"pack([{str(path)!r}], OUT, PackSpec(pack_size=16))\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(code, "job.py", "exec"), {"OUT": str(tmp_path / "a")})
        (tmp_path / "packer_cli_jobs.py").write_text(f"OUT = {str(tmp_path / 'b')!r}\n" + code)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "packer_cli_jobs", raising=False)
        __import__("packer_cli_jobs")
    ours = [(w.filename, w.lineno) for w in caught if issubclass(w.category, PackerWarning)]
    assert ours == [("job.py", 2), (str(tmp_path / "packer_cli_jobs.py"), 3)], ours


@pytest.mark.parametrize("error", [
    BadRecord("in.jsonl", 4, "input_ids[2] = -1 is negative", line=5),
    BadRecord("in.parquet", 7, "field 'input_ids' is null"),
    ShardError("packs-00000.arrow", "checksum differs", row=3),
    InconsistentOutput("out", [Finding("shard.missing", "gone", shard="packs-00001.arrow")],
                       {"shard.missing": 1}, "inspected"),
    BridgeRowError(12, "packer_seq_lens holds a negative length"),
], ids=["line", "row", "shard", "inconsistent", "bridge-row"])
def test_errors_survive_pickling(error):
    """A process pool sends a worker's exception back pickled: the default pickling called the
    class with the message alone, and multiprocessing.Pool hung on a bad record."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy.__dict__ == error.__dict__


def _pack_in_worker(path: str, out: str):
    return pack([path], out, PackSpec(pack_size=16))


def test_a_bad_record_in_a_pool_worker_is_the_callers_data_error(tmp_path):
    path = _write(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [1, -2, 3]}])
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        future = pool.submit(_pack_in_worker, str(path), str(tmp_path / "out"))
        with pytest.raises(DataError, match=r"in.jsonl: line 2: input_ids\[1\] = -2 is negative"):
            future.result(timeout=120)
    assert not (tmp_path / "out").exists()


def test_an_interrupt_c_code_reported_as_a_system_error_comes_out_as_itself():
    """numba's dispatcher turns a Ctrl-C that lands in a kernel into ``SystemError: ... returned a
    result with an exception set``, the KeyboardInterrupt its context."""
    @interrupts_kept
    def kernel_call():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise SystemError("CPUDispatcher(<function _ffd_positions>) returned a result with an "
                              "exception set") from exc

    with pytest.raises(KeyboardInterrupt) as raised:
        kernel_call()
    assert raised.value.__suppress_context__  # its traceback shows no SystemError above it

    @interrupts_kept
    def plain_failure():
        raise SystemError("a real one")

    with pytest.raises(SystemError, match="a real one"):
        plain_failure()


def test_the_public_entry_points_keep_interrupts():
    from packer_cli import plan
    from packer_cli.audit import inspect_output, verify_output
    from packer_cli.pipeline import pack as pipeline_pack

    for func in (pipeline_pack, plan.first_fit_decreasing, plan.best_fit_decreasing, plan.next_fit,
                 plan.bridge_first_fit_shuffle, plan.plan_packs, plan.refine_plan, plan.validate_plan,
                 plan.PackPlan.pack_of_item.func, inspect_output, verify_output):
        assert getattr(func, "__wrapped__", None) is not None, func.__name__


@pytest.mark.parametrize("kernel, call", [
    ("_layout_problem", lambda plan, lengths: plan_module.validate_plan(plan, lengths)),
    ("_pack_of_item", lambda plan, lengths: plan.pack_of_item),
])
def test_a_ctrl_c_inside_a_plan_s_own_kernels_is_a_keyboard_interrupt(monkeypatch, kernel, call):
    """Checking a plan and deriving its pack of each item run compiled code too: a Ctrl-C there
    reached the caller as numba's ``SystemError`` (an ``except Exception`` took it for a failure)."""
    from packer_cli.plan import _kernels

    lengths = np.array([300, 200, 100], dtype=np.int32)
    plan = plan_module.plan_packs(lengths, 512)

    def interrupted(*args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise SystemError("CPUDispatcher returned a result with an exception set") from exc

    monkeypatch.setattr(_kernels, kernel, interrupted)
    with pytest.raises(KeyboardInterrupt):
        call(plan, lengths)

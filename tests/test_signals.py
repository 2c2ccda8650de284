"""Signals: Ctrl-C and SIGTERM (a scheduler preempting the job) unwind like an error.

``packer pack`` runs in a child process on data made here; once its spill (pass one) or a
shard (pass two) has data, the test sends the signal and checks the exit code, the one-line
message and that neither OUT nor its temporary directory is left behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")


@pytest.fixture(scope="module")
def big_parquet(tmp_path_factory) -> Path:
    """About 45M tokens: long enough that a signal sent mid-run finds the pipeline at work."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(50, 850, 100_000)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(0, 50_000, int(offsets[-1])).astype(np.int32)
    path = tmp_path_factory.mktemp("signals") / "big.parquet"
    pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))}), path,
                   row_group_size=4096)
    return path


def _has_data(parent: Path, pattern: str) -> bool:
    for path in parent.glob(pattern):
        try:
            if path.stat().st_size > 0:
                return True
        except FileNotFoundError:
            pass
    return False


# what shows a phase under way, and the options that make it show: in pass one the spill's file
# (so all of the spill goes there); in pass two a shard, while the gatherers read the spill from
# memory (this input's spill, ~96 MB, fits the budget), which is released only once they stopped
# ``packer ARGS`` with Python's own SIGINT handler and the default SIGHUP: a child inherits an
# ignored SIGINT (tests run in the background of a shell) or SIGHUP (tests run under nohup),
# which packer rightly keeps ignored
WITH_DEFAULT_SIGINT = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                       "signal.signal(signal.SIGHUP, signal.SIG_DFL); "
                       "sys.argv[0] = 'packer'; from packer_cli.cli import main; main()")

PHASES = {"pass one": ("out.tmp-*/_spill/samples.bin", ["--spill-memory", "0"]),
          "pass two": ("out.tmp-*/packs-*.arrow", ["--spill-memory", "256MB"])}


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("sig,code,message", [(signal.SIGTERM, 143, "error: terminated"),
                                              (signal.SIGINT, 130, "error: interrupted"),
                                              (signal.SIGHUP, 129, "error: hung up")], ids=["TERM", "INT", "HUP"])
def test_a_signal_mid_run_removes_everything_and_exits_with_its_code(big_parquet, tmp_path, sig, code, message,
                                                                     phase):
    out = tmp_path / "out"
    pattern, options = PHASES[phase]
    child = subprocess.Popen([sys.executable, "-c", WITH_DEFAULT_SIGINT, "pack", str(big_parquet), "-o", str(out),
                              "--json", "--shard-size", "16MB", *options], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _has_data(tmp_path, pattern) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert child.poll() is None, f"the run ended before {phase} could be interrupted: {child.stderr.read()}"
    child.send_signal(sig)
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == code, stderr
    assert stderr.strip().splitlines() == [message], stderr
    assert stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither OUT nor OUT.tmp-PID


def test_an_ignored_sigint_stays_ignored(big_parquet, tmp_path):
    """A job started in the background of a shell ignores Ctrl-C; packer keeps it that way."""
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); sys.argv = ['packer', 'pack', "
            f"{str(big_parquet)!r}, '-o', {str(tmp_path / 'out')!r}, '--json', '--spill-memory', '0']; "
            "from packer_cli.cli import main; main()")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not _has_data(tmp_path, PHASES["pass one"][0]) and child.poll() is None:
        time.sleep(0.002)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, stderr
    assert (tmp_path / "out" / "metadata.json").exists()


def test_a_signal_that_c_code_reports_as_a_system_error_still_exits_with_its_code(tmp_path):
    """The handler can fire inside C code that calls back into Python (numba's dispatcher
    loading a kernel); that code then reports ``SystemError: ... returned a result with an
    exception set``, with the signal as its context. It is still an interrupt, not a crash."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    code = ("import os, signal, sys, time\n"
            "import packer_cli.pipeline as pipeline\n"
            "def pack(*args, **kwargs):\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        time.sleep(5)\n"
            "    except BaseException as exc:\n"
            "        raise SystemError('<dispatcher> returned a result with an exception set') from exc\n"
            "pipeline.pack = pack\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"sys.argv = ['packer', 'pack', {str(data)!r}, '-o', {str(tmp_path / 'out')!r}]\n"
            "from packer_cli.cli import main; main()\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert child.returncode == 130, child.stderr
    assert child.stderr.strip().splitlines() == ["error: interrupted"]


# Python runs a signal handler wherever the main thread is, C code included, and C code may
# clear the error it raised (seen inside compile(), importing a module from source) or only
# print it (a finalizer): the handler's exception is gone.
# Here a wrapper swallows it the same way, by raising the signal where it is caught and dropped.
SWALLOWING = ("import signal, sys\n"
              "{where}\n"
              "real = where.{name}\n"
              "class Finalized:\n"
              "    def __del__(self):\n"
              "        signal.raise_signal(signal.SIGINT)\n"
              "def swallowing(*args, **kwargs):\n"
              "{swallow}"
              "    return real(*args, **kwargs)\n"
              "where.{name} = swallowing\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "sys.argv = ['packer', *sys.argv[1:]]\n"
              "from packer_cli.cli import main; main()\n")
SWALLOW = {"except": ("    try:\n"
                      "        signal.raise_signal(signal.SIGINT)\n"
                      "    except BaseException:\n"
                      "        pass\n"),
           # a finalizer's exception is printed as "Exception ignored in ...", then dropped
           "finalizer": "    Finalized()\n",
           # replaced by an error that does not carry it: numba's import, a Ctrl-C 0.2 s in, ended
           # in "ImportError: numba._devicearray failed to import" and a traceback, exit 1
           "replaced": ("    lost = False\n"
                        "    try:\n"
                        "        signal.raise_signal(signal.SIGINT)\n"
                        "    except BaseException:\n"
                        "        lost = True\n"
                        "    if lost:\n"
                        "        raise ImportError('numba._devicearray failed to import')\n")}


def _swallowing(where: str, name: str, how: str = "except") -> list[str]:
    """``python -c`` running the CLI with ``where.name`` swallowing a Ctrl-C; then the CLI's arguments."""
    return [sys.executable, "-c", SWALLOWING.format(where=where, name=name, swallow=SWALLOW[how])]


def _small_jsonl(path: Path) -> Path:
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(f'{{"input_ids": [1, 2, {n}]}}\n' for n in range(50)))
    return path


def _small_output(tmp_path: Path, data: Path | None = None) -> Path:
    """``tmp_path/out``, a finished native output of ``data`` (default: 50 small samples made here)."""
    data = data or _small_jsonl(tmp_path / "data.jsonl")
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", "from packer_cli.cli import main; main()", "pack", str(data), "-o", str(out)],
                   check=True, capture_output=True)
    return out


@pytest.mark.parametrize("where,name,options", [
    ("import packer_cli.pipeline as where", "discover_inputs", []),  # before pass one
    ("import packer_cli.pipeline as where", "_write_shards", []),  # the last phase, before the output moves
    ("from packer_cli.shards.bridge_output import BridgeOutput as where", "write", ["--format", "megatron-bridge"]),
], ids=["start", "native-write", "bridge-write"])
@pytest.mark.parametrize("how", list(SWALLOW))
def test_a_ctrl_c_whose_exception_was_swallowed_still_stops_the_run_and_writes_nothing(tmp_path, where, name,
                                                                                        options, how):
    data = _small_jsonl(tmp_path / "in" / "data.jsonl")
    child = subprocess.run([*_swallowing(where, name, how), "pack", str(data), "-o", str(tmp_path / "out"), "--json",
                            *options], capture_output=True, text=True, timeout=120)
    assert (child.returncode, child.stderr.strip().splitlines()) == (130, ["error: interrupted"]), child.stderr
    assert child.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # neither OUT nor OUT.tmp-PID


def test_verify_whose_ctrl_c_was_swallowed_exits_as_interrupted_not_with_its_verdict(tmp_path):
    out = _small_output(tmp_path)
    child = subprocess.run([*_swallowing("import packer_cli.audit as where", "verify_output"), "verify", str(out),
                            "--json"], capture_output=True, text=True, timeout=120)
    assert child.returncode == 130, (child.stdout, child.stderr)
    assert child.stderr.strip().splitlines() == ["error: interrupted"]
    assert child.stdout == ""  # no verdict for a run the user stopped


@pytest.mark.parametrize("inherited,expected", [("signal.default_int_handler", "signal.SIG_DFL"),
                                                ("signal.SIG_IGN", "signal.SIG_IGN")], ids=["terminal", "ignored"])
def test_the_console_script_gives_ctrl_c_its_default_action_until_a_command_runs(inherited, expected):
    code = ("import signal, sys\n"
            f"signal.signal(signal.SIGINT, {inherited})\n"
            "import packer_cli.cli as cli\n"
            f"cli.main = lambda: sys.exit(0 if signal.getsignal(signal.SIGINT) is {expected} else 1)\n"
            "from packer_cli._entry import main; main()\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_console_script_reaches_its_handler_without_importing_a_module_from_disk():
    """Until ``_entry`` has given Ctrl-C its default action, a Ctrl-C prints a traceback: it
    imported ``signal`` (and enum with it, about a millisecond), where one in 60 Ctrl-Cs sent
    35-70 ms into a run landed. What it imports now is built into the interpreter."""
    code = ("import sys; before = set(sys.modules); import packer_cli._entry; "
            "print(sorted(set(sys.modules) - before - {'packer_cli', 'packer_cli._entry'}))")
    new = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert all(name in sys.builtin_module_names for name in eval(new)), new


def _sigint_caught(pid: int) -> bool | None:
    """Whether process ``pid`` has a handler for SIGINT (Linux ``/proc``); None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:
        return None
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), None)
    return None if caught is None else bool(int(caught, 16) >> (signal.SIGINT - 1) & 1)


def _wait_for_default_sigint(pid: int, timeout: float = 20.0) -> bool:
    """Until the console script has given Ctrl-C its default action (true once seen). Called
    once the child said it is running Python code, so the interpreter's own handler is in place
    and a default action means ``packer_cli._entry`` removed it. (Polling for the interpreter's
    handler to appear and go missed that moment on a loaded machine.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        caught = _sigint_caught(pid)
        if caught is None:
            return False
        if not caught:
            return True
        time.sleep(0.0005)
    return False


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads signal dispositions from /proc")
def test_ctrl_c_while_starting_up_ends_quietly(big_parquet, tmp_path):
    """Ctrl-C during the imports before a command's handlers are installed ends the process at
    once, and once they are installed it unwinds the command: no traceback either way. (The
    interpreter's own start, before the console script runs, is Python's: the test sends its
    signals from the moment the script has taken over, however long a loaded machine took.)"""
    for delay in (0.0, 0.1, 0.25):
        script = "import sys; print('started', flush=True); from packer_cli._entry import main; main()"
        child = subprocess.Popen([sys.executable, "-c", script, "pack", str(big_parquet), "-o", str(tmp_path / "out"),
                                  "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "started\n"  # the interpreter is up, its SIGINT handler installed
        assert _wait_for_default_sigint(child.pid), "the console script never gave Ctrl-C its default action"
        time.sleep(delay)
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=120)
        assert "Traceback" not in stderr, (delay, stderr)
        assert child.returncode in (-signal.SIGINT, 130), (delay, child.returncode, stderr)
        assert stderr.strip() in ("", "error: interrupted"), stderr
        assert not any(tmp_path.iterdir()), (delay, list(tmp_path.iterdir()))


# The first signal (here a SIGTERM) is raised where the run writes its output; the second (a
# Ctrl-C) as the run starts removing its temporary output, as when a user presses Ctrl-C while
# a preempted job unwinds.
SECOND_SIGNAL_IN_CLEANUP = ("import shutil, signal, sys\n"
                            "{where}\n"
                            "real, real_rmtree, stopping = where.{name}, shutil.rmtree, []\n"
                            "def first(*args, **kwargs):\n"
                            "    stopping.append(True)\n"
                            "    signal.raise_signal(signal.SIGTERM)\n"
                            "    return real(*args, **kwargs)\n"
                            "def rmtree(path, *args, **kwargs):\n"
                            "    if stopping and '.tmp-' in str(path):\n"
                            "        stopping.clear()\n"
                            "        signal.raise_signal(signal.SIGINT)\n"
                            "    return real_rmtree(path, *args, **kwargs)\n"
                            "where.{name}, shutil.rmtree = first, rmtree\n"
                            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                            "sys.argv = ['packer', *sys.argv[1:]]\n"
                            "from packer_cli.cli import main; main()\n")


@pytest.mark.parametrize("where,name,options", [
    ("import packer_cli.pipeline as where", "_write_shards", []),
    ("from packer_cli.shards.bridge_output import BridgeOutput as where", "write", ["--format", "megatron-bridge"]),
], ids=["native", "bridge"])
def test_a_second_signal_while_the_run_cleans_up_does_not_stop_the_cleanup(tmp_path, where, name, options):
    """The first signal is what stopped the run, and what the exit code and message say."""
    data = _small_jsonl(tmp_path / "in" / "data.jsonl")
    code = SECOND_SIGNAL_IN_CLEANUP.format(where=where, name=name)
    child = subprocess.run([sys.executable, "-c", code, "pack", str(data), "-o", str(tmp_path / "out"), "--json",
                            *options], capture_output=True, text=True, timeout=120)
    assert (child.returncode, child.stderr.strip().splitlines()) == (143, ["error: terminated"]), child.stderr
    assert child.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no OUT.tmp-PID, whole or in part


# Ctrl-C pressed twice: the second lands in the run's cleanup before the cleanup holds signals
# (the stress harness's INT+INT, 1 run in 200 left OUT.tmp-PID when every signal raised).
SECOND_CTRL_C_BEFORE_THE_HOLD = ("import signal, sys\n"
                                 "from contextlib import contextmanager\n"
                                 "import packer_cli.pipeline as pipeline\n"
                                 "real_write, real_held = pipeline._write_shards, pipeline.signals_held\n"
                                 "def write(*args, **kwargs):\n"
                                 "    signal.raise_signal(signal.SIGINT)\n"
                                 "    return real_write(*args, **kwargs)\n"
                                 "@contextmanager\n"
                                 "def held():\n"
                                 "    signal.raise_signal(signal.SIGINT)\n"
                                 "    with real_held():\n"
                                 "        yield\n"
                                 "pipeline._write_shards, pipeline.signals_held = write, held\n"
                                 "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                                 "sys.argv = ['packer', *sys.argv[1:]]\n"
                                 "from packer_cli.cli import main; main()\n")


def test_ctrl_c_twice_leaves_nothing_even_before_the_cleanup_holds_signals(tmp_path):
    data = _small_jsonl(tmp_path / "in" / "data.jsonl")
    child = subprocess.run([sys.executable, "-c", SECOND_CTRL_C_BEFORE_THE_HOLD, "pack", str(data), "-o",
                            str(tmp_path / "out"), "--json"], capture_output=True, text=True, timeout=120)
    assert (child.returncode, child.stderr.strip().splitlines()) == (130, ["error: interrupted"]), child.stderr
    assert child.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no OUT.tmp-PID


# A Ctrl-C raised the moment the temporary output exists: as makedirs returns it (inside
# make_temporary), or while the run checks the directory's file system (use_direct_io).
SIGNAL_AFTER = ("import os, signal, sys\n"
                "{where}\n"
                "real = where.{name}\n"
                "def signalling(*args, **kwargs):\n"
                "    result = real(*args, **kwargs)\n"
                "    if '.tmp-' in str(args[0]):\n"
                "        signal.raise_signal(signal.SIGINT)\n"
                "    return result\n"
                "where.{name} = signalling\n"
                "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                "sys.argv = ['packer', *sys.argv[1:]]\n"
                "from packer_cli.cli import main; main()\n")


@pytest.mark.parametrize("where,name", [("import os as where", "makedirs"),
                                        ("import packer_cli.pipeline as where", "use_direct_io")],
                         ids=["makedirs", "use_direct_io"])
@pytest.mark.parametrize("options", [[], ["--format", "megatron-bridge"]], ids=["native", "bridge"])
def test_a_ctrl_c_just_after_the_temporary_output_is_made_removes_it(tmp_path, where, name, options):
    data = _small_jsonl(tmp_path / "in" / "data.jsonl")
    child = subprocess.run([sys.executable, "-c", SIGNAL_AFTER.format(where=where, name=name), "pack", str(data),
                            "-o", str(tmp_path / "out"), "--json", *options], capture_output=True, text=True,
                           timeout=120)
    assert (child.returncode, child.stderr.strip().splitlines()) == (130, ["error: interrupted"]), child.stderr
    assert child.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no OUT.tmp-PID


def test_a_ctrl_c_while_the_replaced_output_is_deleted_does_not_leave_it_behind(tmp_path):
    """``--overwrite`` renames the old OUT aside, moves the new one in, then deletes the old one;
    a Ctrl-C during that deletion stopped it and left ``OUT.old-PID`` (a whole output's size).
    The new output is in place by then: the run is done, and exits 0 saying the signal came late."""
    data = _small_jsonl(tmp_path / "in" / "data.jsonl")
    out = _small_output(tmp_path, data)
    code = ("import shutil, signal, sys\n"
            "real = shutil.rmtree\n"
            "def rmtree(path, *args, **kwargs):\n"
            "    if '.old-' in str(path):\n"
            "        signal.raise_signal(signal.SIGINT)\n"
            "    return real(path, *args, **kwargs)\n"
            "shutil.rmtree = rmtree\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "sys.argv = ['packer', *sys.argv[1:]]\n"
            "from packer_cli.cli import main; main()\n")
    child = subprocess.run([sys.executable, "-c", code, "pack", str(data), "-o", str(out), "--overwrite", "--seed", "5",
                            "--json"], capture_output=True, text=True, timeout=120)
    _assert_done_despite_a_late_signal(child, out, "interrupted")  # and no out.old-PID


def _assert_done_despite_a_late_signal(child, out: Path, word: str) -> None:
    """A run that a signal reached once its output was in OUT: exit 0, its summary on stdout,
    one warning, OUT complete and nothing else beside the input directory."""
    assert (child.returncode, child.stderr.strip().splitlines()) == (
        0, [f"warning: {word} after {out} was complete: the output is kept"]), child.stderr
    assert json.loads(child.stdout)["ok"] is True
    assert sorted(p.name for p in out.parent.iterdir()) == ["in", "out"]
    verify = subprocess.run([sys.executable, "-c", "from packer_cli.cli import main; main()", "verify", str(out)],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


# A signal just as the finished output lands in OUT: raised inside the rename that puts it there
# (OUT absent, so nothing holds signals across it), or once the renames are done.
SIGNAL_AS_PUBLISHED = ("import os, signal, sys\n"
                       "real = os.rename\n"
                       "def rename(src, dst, *args, **kwargs):\n"
                       "    real(src, dst, *args, **kwargs)\n"
                       "    if os.path.basename(os.path.normpath(dst)) == 'out':\n"
                       "        signal.raise_signal(signal.{signal})\n"
                       "os.rename = rename\n"
                       "sys.argv = ['packer', *sys.argv[1:]]\n"
                       "from packer_cli.cli import main; main()\n")


@pytest.mark.parametrize("options", [[], ["--format", "megatron-bridge"]], ids=["native", "bridge"])
@pytest.mark.parametrize("sig,word", [("SIGINT", "interrupted"), ("SIGTERM", "terminated")])
def test_a_signal_once_the_output_is_in_place_is_no_failure(tmp_path, options, sig, word):
    """The output is complete in OUT: exiting 130 or 143 told a job it failed, and its retry then
    failed on the existing OUT. It exits 0 with its summary and says the signal came late."""
    data = _small_jsonl(tmp_path / "in" / "data.jsonl")
    out = tmp_path / "out"
    child = subprocess.run([sys.executable, "-c", SIGNAL_AS_PUBLISHED.format(signal=sig), "pack", str(data), "-o",
                            str(out), "--json", *options], capture_output=True, text=True, timeout=120)
    _assert_done_despite_a_late_signal(child, out, word)  # and no OUT.tmp-PID


# A signal whose handler runs right after shutil.rmtree closed a directory's descriptor and before
# it marked it closed: rmtree's cleanup then closed it again (Python 3.11), and the run ended in
# 'Bad file descriptor' beside the signal's own line.
SIGNAL_AS_RMTREE_CLOSES = ("import os, signal, sys\n"
                           "real, armed = os.close, [True]\n"
                           "def close(fd):\n"
                           "    try:\n"
                           "        target = os.readlink(f'/proc/self/fd/{{fd}}')\n"
                           "    except OSError:\n"
                           "        target = ''\n"
                           "    real(fd)\n"
                           "    if armed[0] and os.path.isdir(target) and {which}:\n"
                           "        armed[0] = False\n"
                           "        os.kill(os.getpid(), signal.SIGHUP)\n"
                           "os.close = close\n"
                           "sys.argv = ['packer', *sys.argv[1:]]\n"
                           "from packer_cli.cli import main; main()\n")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to tell which directory closed")
@pytest.mark.parametrize("which", ["spill", "joined"])
def test_a_signal_inside_a_directory_s_removal_is_one_line_or_none(tmp_path, which):
    """The spill's removal as the output is published: exit 129 and two lines ('writing the
    output failed: Bad file descriptor', then 'hung up'). The emptied temporary directory's
    removal once a Bridge split joined OUT: the same, with the split in place (its retry then
    failed on the existing split); it is a late signal (exit 0, a warning)."""
    data = _small_jsonl(tmp_path / "in" / "data.jsonl")
    out = tmp_path / "out"
    options = []
    if which == "joined":
        other = subprocess.run([sys.executable, "-c", "from packer_cli.cli import main; main()", "pack", str(data),
                                "-o", str(out), "--format", "megatron-bridge"], capture_output=True, text=True)
        assert other.returncode == 0, other.stderr
        options = ["--format", "megatron-bridge", "--split", "validation"]
    test = ("target.endswith('/_spill')" if which == "spill"
            else "os.path.basename(target).startswith('out.tmp-') and not os.listdir(target)")
    child = subprocess.run([sys.executable, "-c", SIGNAL_AS_RMTREE_CLOSES.format(which=test), "pack", str(data),
                            "-o", str(out), "--json", *options], capture_output=True, text=True, timeout=120)
    if which == "spill":
        assert (child.returncode, child.stderr.strip()) == (129, "error: hung up"), child.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    else:
        _assert_done_despite_a_late_signal(child, out, "hung up")
        assert (out / "validation_4096.idx.parquet").exists()


# verify stopped by a Ctrl-C, and a second signal where nothing once caught it: as the CLI
# flushes its output on the way out, or while it reports the first (as the report starts
# writing, and as a handler is swapped, where the report once switched signals off one by one
# and the other's handler was still in place).
STOPPED_VERIFY = ("import signal, sys\n"
                  "import packer_cli.audit as audit\n"
                  "def verify_output(*args, **kwargs):\n"
                  "    signal.raise_signal(signal.SIGINT)\n"
                  "audit.verify_output = verify_output\n"
                  "{second}"
                  "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                  "sys.argv = ['packer', *sys.argv[1:]]\n"
                  "from packer_cli.cli import main\n"
                  "{install}"
                  "main()\n")
SECOND_SIGNAL = {
    "in-the-final-flush": ("class Stdout:\n"
                           "    def __init__(self, f):\n"
                           "        self.f = f\n"
                           "    def __getattr__(self, name):\n"
                           "        return getattr(self.f, name)\n"
                           "    def flush(self):\n"
                           "        signal.raise_signal(signal.SIGINT)\n"
                           "        return self.f.flush()\n",
                           "sys.stdout = Stdout(sys.stdout)\n"),
    "while-reporting": ("real_signal = signal.signal\n"
                        "def swap(signum, handler):\n"
                        "    previous = real_signal(signum, handler)\n"
                        "    if handler is signal.SIG_IGN and signum == signal.SIGINT:\n"
                        "        signal.raise_signal(signal.SIGTERM)\n"
                        "    return previous\n"
                        "class Stderr:\n"
                        "    def __init__(self, f):\n"
                        "        self.f, self.sent = f, False\n"
                        "    def __getattr__(self, name):\n"
                        "        return getattr(self.f, name)\n"
                        "    def write(self, text):\n"
                        "        if not self.sent:\n"
                        "            self.sent = True\n"
                        "            signal.raise_signal(signal.SIGTERM)\n"
                        "        return self.f.write(text)\n",
                        "signal.signal = swap\nsys.stderr = Stderr(sys.stderr)\n"),
}


@pytest.mark.parametrize("when", list(SECOND_SIGNAL))
def test_a_second_signal_after_the_first_stopped_the_command_is_no_traceback(tmp_path, when):
    out = _small_output(tmp_path)
    second, install = SECOND_SIGNAL[when]
    child = subprocess.run([sys.executable, "-c", STOPPED_VERIFY.format(second=second, install=install), "verify",
                            str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert (child.returncode, child.stderr.strip().splitlines()) == (130, ["error: interrupted"]), child.stderr
    assert child.stdout == ""


def _verify_stopped_in(tmp_path, body: list[str], setup: str = "") -> subprocess.CompletedProcess:
    """``packer verify`` of a small output, through the console's ``main``, with the command's
    work replaced by ``body`` (lines of a function body; ``setup`` runs before it is defined)."""
    out = _small_output(tmp_path)
    code = ("import signal, sys, warnings\n"
            "import packer_cli.audit as audit\n"
            f"{setup}"
            "def verify_output(*args, **kwargs):\n"
            + "".join(f"    {line}\n" for line in body)
            + "audit.verify_output = verify_output\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "sys.argv = ['packer', *sys.argv[1:]]\n"
            "from packer_cli.cli import main; main()\n")
    return subprocess.run([sys.executable, "-c", code, "verify", str(out)], capture_output=True, text=True,
                          timeout=120)


def test_a_finalizer_that_fails_after_a_ctrl_c_prints_nothing(tmp_path):
    """What the Ctrl-C cut short may fail when it is freed (llvmlite closing a half-closed
    module reference raised AttributeError): after the one line, nothing."""
    child = _verify_stopped_in(tmp_path, ["held = HalfClosed()  # freed with the traceback that holds this frame",
                                          "signal.raise_signal(signal.SIGINT)"],
                               setup=("class HalfClosed:\n"
                                      "    def __del__(self):\n"
                                      "        raise AttributeError('half-closed')\n"))
    assert (child.returncode, child.stderr.strip().splitlines()) == (130, ["error: interrupted"]), child.stderr


def test_a_warning_from_what_a_ctrl_c_cut_short_prints_nothing(tmp_path):
    """A Ctrl-C landing in a Cython extension's import (pyarrow 14's, at the lowest versions)
    makes the extension warn "failed to patch module with custom type" as it gives up: after
    the signal only ``error: interrupted`` is printed, while a warning before it still shows."""
    child = _verify_stopped_in(tmp_path, [
        "warnings.warn('before the signal', RuntimeWarning)",
        "try:",
        "    signal.raise_signal(signal.SIGINT)",
        "finally:  # as the extension's init does with the exception it caught",
        "    warnings.warn('module failed to patch module with custom type', RuntimeWarning)"])
    assert child.returncode == 130, child.stderr
    lines = child.stderr.strip().splitlines()
    assert lines[-1] == "error: interrupted" and "custom type" not in child.stderr, child.stderr
    assert any("before the signal" in line for line in lines), child.stderr


def test_a_traceback_that_native_code_prints_after_a_ctrl_c_is_not_shown(tmp_path):
    """Native code that must not raise prints the exception it met with ``PyErr_Print`` and
    goes on (a Cython ``noexcept`` callback importing a module when the Ctrl-C came, at the
    lowest versions): that goes through ``sys.excepthook``, which is quiet after a signal."""
    child = _verify_stopped_in(tmp_path, [
        "try:",
        "    signal.raise_signal(signal.SIGINT)",
        "except BaseException:",
        "    sys.excepthook(*sys.exc_info())  # what PyErr_Print does, and the code goes on",
        "signal.raise_signal(signal.SIGINT)  # recorded; the next check raises the first",
        "from packer_cli.errors import check_interrupted; check_interrupted()"])
    assert (child.returncode, child.stderr.strip().splitlines()) == (130, ["error: interrupted"]), child.stderr


def test_of_two_signals_pending_at_once_the_first_to_arrive_is_the_one_reported(tmp_path):
    """Python runs the handlers of signals pending at one check by number: a SIGTERM then a
    Ctrl-C, both arriving while the main thread was in C code, reported ``interrupted`` (130)
    for a run its scheduler had terminated. Here another thread receives both, in that order,
    while the main thread holds them off; the main thread then runs both handlers."""
    child = _verify_stopped_in(tmp_path, [
        "both = {signal.SIGINT, signal.SIGTERM}",
        "go, done = threading.Event(), threading.Event()",
        "def send():  # made before the main thread blocks them: this thread takes both",
        "    go.wait()",
        "    os.kill(os.getpid(), signal.SIGTERM)",
        "    time.sleep(0.05)",
        "    os.kill(os.getpid(), signal.SIGINT)",
        "    done.set()",
        "threading.Thread(target=send).start()",
        "signal.pthread_sigmask(signal.SIG_BLOCK, both)",
        "go.set()",
        "done.wait()",
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, both)",
        "from packer_cli.errors import check_interrupted; check_interrupted()"],
        setup="import os, threading, time\n")
    assert (child.returncode, child.stderr.strip().splitlines()) == (143, ["error: terminated"]), child.stderr


ORJSON_IMPORTED_FIRST = """
import signal, sys
from packer_cli.errors import raise_interrupted
import packer_cli.cli
assert signal.getsignal(signal.SIGINT) is not raise_interrupted  # main() installs it later
print("orjson" in sys.modules)
"""


def test_orjson_is_imported_before_the_signal_handlers_are_installed():
    """orjson's extension crashes the process (SIGSEGV) when an import its initialization makes
    raises, as the handler's Interrupted does when a signal lands there (shown below), so the
    CLI imports it while Ctrl-C still has its default action."""
    result = subprocess.run([sys.executable, "-c", ORJSON_IMPORTED_FIRST], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


INTERRUPTED_INSIDE_ORJSON_INIT = """
import sys
class InterruptOrjsonsImports:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("orjson"):
            return None  # the package and its extension: the imports *inside* its initialization follow
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.endswith("orjson/__init__.py"):
                raise KeyboardInterrupt
            frame = frame.f_back
        return None
sys.meta_path.insert(0, InterruptOrjsonsImports())
try:
    import orjson
except BaseException:
    print("raised")
"""


def test_an_interrupt_inside_orjsons_initialization_crashes_the_process():
    """Why the test above matters: an orjson release that handles this would make it moot."""
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_INSIDE_ORJSON_INIT], capture_output=True, text=True,
                            timeout=120)
    if result.returncode == 0:
        pytest.skip(f"this orjson survives it ({result.stdout.strip()!r}): importing it first is no longer needed")
    assert result.returncode == -signal.SIGSEGV


SIGNAL_INSIDE_A_KERNEL_LOAD = """
import os, signal, sys
import numpy as np
from numba.core import caching
from packer_cli import errors
from packer_cli._jit import light_cache_loads
light_cache_loads()
real, steps = caching.Cache._load_overload, []

def loading(self, sig, target_context):
    os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the load's next bytecode
    steps.append("signalled")
    result = real(self, sig, target_context)
    steps.append("loaded" if result is not None else "not cached")
    return result

caching.Cache._load_overload = loading
signal.signal(signal.SIGINT, errors.raise_interrupted)
from packer_cli.sources._kernels import tokens_in_range
try:
    tokens_in_range(np.arange(5, dtype=np.int32), 10)
    print("not interrupted", steps)
except errors.Interrupted:
    print("interrupted after", steps)
"""


def test_a_signal_during_a_kernel_load_is_raised_once_the_load_is_done():
    """numba cut short in the middle of loading a cached kernel left its machine code
    half-registered and then wrote through a null address: SIGSEGV with numba 0.59."""
    from packer_cli.sources._kernels import tokens_in_range

    tokens_in_range(np.arange(5, dtype=np.int32), 10)  # in the cache, so the child loads it
    result = subprocess.run([sys.executable, "-c", SIGNAL_INSIDE_A_KERNEL_LOAD], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "interrupted after ['signalled', 'loaded']"


SIGNAL_WHILE_A_KERNEL_BOXES_ITS_RESULT = """
import signal, sys, time
import numpy as np
from packer_cli import errors
from packer_cli.plan import _kernels as K
counts = np.zeros(9, np.int64)
counts[8] = 4
slots = np.array([0, 0, 1, 1], np.int64)
K._positions_to_slots(slots.copy(), counts, 2)  # loaded before the signal handler is installed
calls = [int(sys.argv[1])]

def signal_in_the_nth_unpickle(frame, event, arg):  # numba boxes each returned array through it
    if event == "call" and frame.f_code.co_name == "_numba_unpickle":
        calls[0] -= 1
        if calls[0] == 0:
            signal.raise_signal(signal.SIGINT)  # the handler runs at the callback's next bytecode

signal.signal(signal.SIGINT, errors.raise_interrupted)
sys.setprofile(signal_in_the_nth_unpickle)
try:
    offsets, load = K._positions_to_slots(slots.copy(), counts, 2)
    sys.setprofile(None)
    print("returned", offsets.tolist(), load.tolist())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the signal comes back within a millisecond
        time.sleep(0.001)
    print("not interrupted")
except BaseException as exc:
    sys.setprofile(None)
    print(type(exc).__name__)
"""


@pytest.mark.parametrize("nth", [1, 2])
def test_a_signal_while_a_kernel_boxes_its_arrays_is_raised_after_it_returns(nth):
    """numba boxes a kernel's returned arrays by calling back into Python
    (``numba.core.serialize._numba_unpickle``): a Ctrl-C handled there made the call fail as a
    ``SystemError`` or, in a run, return a tuple holding a NULL item, which crashed the process
    (SIGSEGV) as it was unpacked. The kernel now returns whole and the signal is raised after."""
    result = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_A_KERNEL_BOXES_ITS_RESULT, str(nth)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["returned [0, 2, 4] [16, 16]", "Interrupted"], result.stdout


def test_the_first_signal_is_the_one_recorded(monkeypatch):
    """SIGTERM, then Ctrl-C during the cleanup it set off: the run stopped for SIGTERM, so its
    exit status is 143, not 130."""
    from packer_cli import errors

    monkeypatch.setattr(errors, "_signal_received", None)
    monkeypatch.setattr(errors, "_raising", True)
    monkeypatch.setattr(errors, "_arrivals", None)
    with pytest.raises(errors.Interrupted) as first:
        errors.raise_interrupted(signal.SIGTERM)
    errors.raise_interrupted(signal.SIGINT)  # recorded only: not raised, not what stopped the run
    assert first.value.signum == errors.signal_received() == signal.SIGTERM


def test_deferred_interrupts_are_raised_once_and_not_on_other_threads(monkeypatch):
    import threading

    from packer_cli import errors

    monkeypatch.setattr(errors, "_signal_received", None)
    monkeypatch.setattr(errors, "_raising", True)
    after_inner = []
    with pytest.raises(errors.Interrupted):
        with errors.interrupts_deferred():
            with errors.interrupts_deferred():
                errors.raise_interrupted(signal.SIGTERM)  # held: nested blocks raise at the outer end
            assert errors.interrupted()
            after_inner.append(True)  # the inner block's end raised nothing: the outer one is still native code
    assert after_inner == [True]
    with errors.interrupts_deferred():  # already raised once: not again
        errors.raise_interrupted(signal.SIGINT)
    monkeypatch.setattr(errors, "_signal_received", None)
    monkeypatch.setattr(errors, "_raising", True)
    seen = []

    def worker():
        with errors.interrupts_deferred():  # not the main thread: nothing is held, nothing raised there
            seen.append(errors._deferred)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [0]

"""`packer pack` where the file system or the process environment works against it: real
limits (RLIMIT_FSIZE, unusable paths) rather than patched functions, in child processes.

Each failure must be one line on stderr, a non-zero exit, ``ok: false`` with ``--json``, and
nothing left where OUT was to go.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX resource limits and file modes")

PACKER = "import sys; sys.argv[0] = 'packer'; from packer_cli._entry import main; main()"


def packer(*args, cwd=None, env=None, file_limit: int | None = None, timeout_s: float = 120,
           **kw) -> subprocess.CompletedProcess:
    """``packer ARGS`` in a child process; ``file_limit``: its RLIMIT_FSIZE in bytes (Python
    ignores SIGXFSZ, so a write past it fails with EFBIG, as on a full quota)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    return subprocess.run([sys.executable, "-c", PACKER, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout_s, preexec_fn=limit if file_limit else None, **kw)


def assert_one_line_failure(result, code: int, text: str) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1 and text in lines[0], result.stderr


def assert_json_failure(result, code: int) -> None:
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["exit_code"] == code, result.stdout


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("out"))


# The synthetic input's spill (~2.6 MB) is held in memory, so the limit is met by the shard:
# below one direct-write block (4 MiB: in a block's write) and between one and two (in the tail's)
@pytest.mark.parametrize("limit", [1 << 20, 3 << 20 | 1000], ids=["block", "tail"])
@pytest.mark.parametrize("io", ["--direct-io", "--buffered-io"])
def test_a_file_size_limit_met_by_a_shard_is_exit_3_not_a_traceback(synthetic_parquet, tmp_path, limit, io):
    result = packer("pack", synthetic_parquet, "-o", tmp_path / "out", "--spill-memory", "1G", io, "--json",
                    file_limit=limit)
    assert_one_line_failure(result, 3, f"{tmp_path / 'out'}: writing the output failed: [Errno 27] File too large")
    assert_json_failure(result, 3)
    assert leftovers(tmp_path) == []


def _fifo(path: Path) -> Path:
    try:
        os.mkfifo(path)
    except (OSError, AttributeError) as exc:
        pytest.skip(f"cannot make a FIFO here: {exc}")
    return path


@pytest.mark.parametrize("given", ["file", "directory", "glob"])
def test_a_fifo_input_is_refused_not_read_twice(tmp_path, given):
    """The input is opened twice (field names, then records): a FIFO blocked for ever, or lost
    the records the first look consumed (exit 0 under --on-bad-record skip)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    fifo = _fifo(data / "b.jsonl")
    arg = {"file": fifo, "directory": data, "glob": data / "*.jsonl"}[given]
    result = packer("pack", arg, "-o", tmp_path / "out", "--json", timeout_s=30)
    assert_one_line_failure(result, 1, f"{fifo}: not a regular file (a FIFO, socket or device)")
    assert_json_failure(result, 1)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("fmt, shard", [("native", "packs-00000.arrow"),
                                        ("megatron-bridge", "training_4096.idx.parquet")])
def test_a_fifo_in_place_of_a_shard_is_a_finding_not_a_wait(synthetic_parquet, tmp_path, fmt, shard):
    """verify and inspect opened a Bridge split's Parquet file to read its footer, and a FIFO
    there blocked them in open() until SIGKILL (SIGTERM too waits for the open to return)."""
    out = tmp_path / "out"
    assert packer("pack", synthetic_parquet, "-o", out, "--format", fmt).returncode == 0
    (out / shard).unlink()
    _fifo(out / shard)
    verify = packer("verify", out, timeout_s=60)
    assert verify.returncode == 1, verify.stderr
    finding = f"{shard}: listed in {'manifest.json' if fmt == 'native' else 'training.manifest.json'} but not a " \
              "regular file (a directory, FIFO, socket or device) [shard.missing]"
    assert finding in verify.stdout and "Traceback" not in verify.stderr, verify.stdout
    inspect = packer("inspect", out, timeout_s=60)
    assert inspect.returncode == 1 and "[shard.missing]" in inspect.stderr, inspect.stderr


def test_a_device_input_is_refused_not_read_without_end(tmp_path):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    result = packer("pack", tmp_path / "zero.jsonl", "-o", tmp_path / "out", timeout_s=30)
    assert_one_line_failure(result, 1, f"{tmp_path / 'zero.jsonl'}: not a regular file")
    assert leftovers(tmp_path) == []


IN_DELETED_CWD = ("import os, sys; os.chdir(sys.argv.pop(1)); os.rmdir(os.getcwd()); sys.argv[0] = 'packer'; "
                  "from packer_cli._entry import main; main()")
# As the console script runs: without the working directory ('') in front of sys.path, which
# `python -c` puts there (-P, Python 3.11 on, leaves it out); with it, Python 3.13 cannot even
# import numpy from a deleted directory (SystemError inside numpy's own import).
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


@pytest.mark.parametrize("relative", ["out", "input"])
def test_a_relative_path_in_a_deleted_working_directory_is_one_line(synthetic_parquet, tmp_path, relative):
    """Resolving a relative OUT (os.path.realpath) raised FileNotFoundError from os.getcwd."""
    (tmp_path / "gone").mkdir()
    out = "out" if relative == "out" else str(tmp_path / "out")
    source = "synthetic.parquet" if relative == "input" else str(synthetic_parquet)
    result = subprocess.run([sys.executable, *SAFE_PATH, "-c", IN_DELETED_CWD, str(tmp_path / "gone"), "pack", source,
                             "-o", out,
                             "--json"], capture_output=True, text=True, timeout=120)
    name = out if relative == "out" else source
    assert_one_line_failure(result, 2, f"{name}: a relative path, but the working directory no longer exists")
    assert_json_failure(result, 2)
    assert leftovers(tmp_path) == []


# numba with no writable cache directory (a read-only install, no writable NUMBA_CACHE_DIR or
# home): none of its locators takes a kernel, so its cache=True decorator raises at import
NO_CACHE_LOCATOR = """
from numba.core import caching
impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
import packer_cli._kernel_cache
impl._locator_classes = []
import packer_cli.pipeline, packer_cli.audit.verify, packer_cli.audit.inspect, packer_cli.sources.parquet_lists
import packer_cli.shards.bridge_writer, packer_cli.plan.refine
from packer_cli._kernel_cache import njit

@njit(cache=True, nogil=True)
def twice(x):
    return 2 * x

print(twice(21), twice._cache.__class__.__name__)
"""


def test_kernels_compile_in_memory_where_no_cache_directory_is_writable():
    result = subprocess.run([sys.executable, "-c", NO_CACHE_LOCATOR], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["42", "NullCache"]


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_an_out_that_appears_during_the_run_is_not_replaced_without_overwrite(synthetic_parquet, tmp_path,
                                                                             monkeypatch, fmt):
    """Two runs to one OUT at once: the one finishing second replaced the first one's output
    (no --overwrite given), and both exited 0."""
    from typer.testing import CliRunner

    from packer_cli import pipeline
    from packer_cli.cli import app
    from packer_cli.shards.bridge_output import BridgeOutput

    out = tmp_path / "out"

    def other_run_finishes(write):
        def writing(*args, **kwargs):
            result = write(*args, **kwargs)
            out.mkdir()
            (out / "metadata.json").write_text('{"format": "packer-thd", "the other run\'s": 1}')
            return result
        return writing

    if fmt == "native":
        monkeypatch.setattr(pipeline, "_write_shards", other_run_finishes(pipeline._write_shards))
    else:
        monkeypatch.setattr(BridgeOutput, "write", other_run_finishes(BridgeOutput.write))
    result = CliRunner().invoke(app, ["pack", str(synthetic_parquet), "-o", str(out), "--format", fmt, "--json"])
    assert result.exit_code == 2, result.output
    # a Bridge split would join a Bridge layout that appeared; what appeared here is a native output
    expected = f"{out} already exists (it appeared while this run was packing: another run?); pass --overwrite to " \
               "replace it"
    assert result.output.strip().splitlines()[-1] == f"error: {expected}"
    assert json.loads(result.stdout.split("\nerror:")[0])["ok"] is False
    assert sorted(p.name for p in out.iterdir()) == ["metadata.json"]
    assert (out / "metadata.json").read_text() == '{"format": "packer-thd", "the other run\'s": 1}'
    assert leftovers(tmp_path) == ["out"]  # no temporary left


def test_an_input_removed_once_read_is_the_input_s_error_not_the_output_s(synthetic_parquet, tmp_path, monkeypatch):
    """Its size, looked up for the metadata after pass one, was an OSError blamed on OUT (exit 3)."""
    import shutil

    from typer.testing import CliRunner

    from packer_cli import pipeline
    from packer_cli.cli import app

    source = tmp_path / "in.parquet"
    shutil.copy(synthetic_parquet, source)
    read = pipeline._read_inputs

    def read_then_remove(*args, **kwargs):
        result = read(*args, **kwargs)
        source.unlink()
        return result

    monkeypatch.setattr(pipeline, "_read_inputs", read_then_remove)
    result = CliRunner().invoke(app, ["pack", str(source), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (f"error: {source}: the input is gone after it was read (removed or moved "
                                     "during the run?): No such file or directory")
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("change", ["moved over", "appended to", "rewritten"])
@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_an_input_changed_while_read_is_an_error_not_a_record_of_another_file(synthetic_parquet, tmp_path,
                                                                               monkeypatch, change, fmt):
    """A file moved over the input while pass one read it: exit 0, the shards of the old file and
    the metadata recording the new one's size, so `verify --source` failed on a file the run never
    read."""
    import shutil

    from typer.testing import CliRunner

    from packer_cli import pipeline
    from packer_cli.cli import app

    source, other = tmp_path / "in.parquet", tmp_path / "other.parquet"
    shutil.copy(synthetic_parquet, source)
    read = pipeline._read_inputs

    def read_then_change(*args, **kwargs):
        result = read(*args, **kwargs)
        if change == "moved over":
            shutil.copy(synthetic_parquet, other)
            with open(other, "ab") as f:
                f.write(b"\0")
            os.replace(other, source)
        elif change == "appended to":
            with open(source, "ab") as f:
                f.write(b"\0")
        else:  # same inode, same size: only the modification time tells
            st = os.stat(source)
            os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        return result

    monkeypatch.setattr(pipeline, "_read_inputs", read_then_change)
    result = CliRunner().invoke(app, ["pack", str(source), "-o", str(tmp_path / "out"), "--format", fmt])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (f"error: {source}: the input changed while this run read it (replaced, "
                                     "rewritten, cut or appended to: its inode, size or modification time differ), "
                                     "so the output would not be its; pack it again once it stays put")
    assert leftovers(tmp_path) == []


def _pack_in_process(*args):
    from typer.testing import CliRunner

    from packer_cli.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_a_replaced_out_that_cannot_be_deleted_is_pointed_out(synthetic_parquet, tmp_path, monkeypatch, fmt):
    """--overwrite of a read-only OUT: the old output stayed behind as OUT.old-PID, in silence."""
    import shutil

    from packer_cli.shards import _atomic

    out = tmp_path / "out"
    # a native OUT: a Bridge layout's own split would be replaced file by file, inside it
    assert _pack_in_process("pack", synthetic_parquet, "-o", out).exit_code == 0
    rmtree = shutil.rmtree

    def read_only_old(path, *args, **kwargs):  # as for a directory without write permission
        if ".old-" not in os.path.basename(path):
            rmtree(path, *args, **kwargs)

    monkeypatch.setattr(_atomic.shutil, "rmtree", read_only_old)
    result = _pack_in_process("pack", synthetic_parquet, "-o", out, "--format", fmt, "--overwrite", "--seed", 5)
    assert result.exit_code == 0, result.output
    [old] = [str(p) for p in tmp_path.iterdir() if p.name.startswith(f"out.old-{os.getpid()}-")]
    assert [line for line in result.output.splitlines() if line.startswith("warning:")] == [
        f"warning: {old} holds the output this run replaced, which could not be deleted (read-only?); "
        "remove it to free its space"]
    assert leftovers(tmp_path) == ["out", os.path.basename(old)]


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_a_file_written_into_out_as_it_is_swapped_out_is_kept(synthetic_parquet, tmp_path, monkeypatch, fmt):
    """OUT is judged in place, then swapped: a file written into it in between was deleted with
    the old output, and the run said nothing. The old output is judged again once swapped out."""
    from packer_cli.shards import _atomic

    out = tmp_path / "out"
    assert _pack_in_process("pack", synthetic_parquet, "-o", out).exit_code == 0
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir(), b.mkdir()
    if not _atomic._exchange(str(a), str(b)):
        pytest.skip("this file system cannot swap two names (renameat2 RENAME_EXCHANGE)")
    a.rmdir(), b.rmdir()
    exchange = _atomic._exchange

    def written_meanwhile(tmp, target):
        (out / "notes.txt").write_text("mine")
        return exchange(tmp, target)

    monkeypatch.setattr(_atomic, "_exchange", written_meanwhile)
    result = _pack_in_process("pack", synthetic_parquet, "-o", out, "--format", fmt, "--overwrite", "--seed", 5)
    assert result.exit_code == 0, result.output
    [old] = [p for p in tmp_path.iterdir() if p.name.startswith(f"out.old-{os.getpid()}-")]
    assert (old / "notes.txt").read_text() == "mine"
    assert [line for line in result.output.splitlines() if line.startswith("warning:")] == [
        f"warning: {old} holds the output this run replaced, kept because files packer did not write (notes.txt) "
        "appeared in it as it was replaced; move them out, then remove it"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root deletes from read-only directories")
def test_a_read_only_out_replaced_is_pointed_out(synthetic_parquet, tmp_path):
    out = tmp_path / "out"
    assert _pack_in_process("pack", synthetic_parquet, "-o", out).exit_code == 0
    out.chmod(0o555)
    try:
        result = packer("pack", synthetic_parquet, "-o", out, "--overwrite", "--seed", 5)
        assert result.returncode == 0, result.stderr
        assert "holds the output this run replaced, which could not be deleted" in result.stderr
    finally:
        for old in tmp_path.glob("out.old-*"):
            old.chmod(0o755)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_spill_memory_under_an_address_space_limit_is_reduced_not_fatal(synthetic_parquet, tmp_path):
    """The whole --spill-memory budget is reserved up front: near a ulimit -v (a batch scheduler's
    vmem limit) every later allocation failed, a traceback (ArrowMemoryError) or an abort inside
    the compiler (exit 134, OUT.tmp left behind), although the spill needed a few MB of it."""
    limit = 3_900_000_000

    def address_space_limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", PACKER, "pack", str(synthetic_parquet), "-o", str(out),
                             "--spill-memory", "3G"], capture_output=True, text=True, timeout=300,
                            preexec_fn=address_space_limit)
    assert result.returncode == 0, result.stderr
    assert "warning: --spill-memory: reserving" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "metadata.json").exists()


def test_the_default_spill_memory_gives_way_quietly(synthetic_parquet, tmp_path, monkeypatch):
    """The 256 MiB held by default (not asked for) is cut without a warning to a quarter of what
    a container's memory limit leaves and near an address-space limit, and is none where no
    anonymous memory can be mapped; the same budget asked for explicitly is held, warns, or is an
    error."""
    from conftest import DEFAULT_SPILL_MEMORY

    from packer_cli import PackSpec, pack, pipeline
    from packer_cli.errors import ConfigError

    monkeypatch.setattr(pipeline, "DEFAULT_SPILL_MEMORY", DEFAULT_SPILL_MEMORY)
    spec, said = PackSpec(pack_size=4096), []
    whole = pack([str(synthetic_parquet)], str(tmp_path / "whole"), spec, warn=said.append).spill
    assert whole["memory_bytes"] == whole["bytes"] > 0 and said == []  # this small spill: all of it

    # a container whose limit leaves 4 MiB: a quarter of it (it took all 256 MiB and was killed)
    monkeypatch.setattr(pipeline, "page_cache_room", lambda: 4 << 20)
    tight = pack([str(synthetic_parquet)], str(tmp_path / "tight"), spec, warn=said.append).spill
    assert tight["memory_bytes"] <= 1 << 20 and tight["bytes"] == whole["bytes"] and said == []
    asked = pack([str(synthetic_parquet)], str(tmp_path / "asked-in-container"), spec, spill_memory=256 << 20).spill
    assert asked["memory_bytes"] == whole["bytes"]  # asked for: as asked
    monkeypatch.setattr(pipeline, "page_cache_room", lambda: None)

    monkeypatch.setattr(pipeline, "_address_space_room", lambda: pipeline.ADDRESS_SPACE_HEADROOM + (1 << 20))
    near = pack([str(synthetic_parquet)], str(tmp_path / "near"), spec, warn=said.append).spill
    assert near["memory_bytes"] <= 1 << 20 and near["bytes"] == whole["bytes"] and said == []
    pack([str(synthetic_parquet)], str(tmp_path / "asked"), spec, warn=said.append, spill_memory=256 << 20)
    assert len(said) == 1 and said[0].startswith("--spill-memory: reserving 1,048,576 of the 268,435,456 bytes")
    monkeypatch.undo()
    monkeypatch.setattr(pipeline, "DEFAULT_SPILL_MEMORY", DEFAULT_SPILL_MEMORY)

    unmappable = pipeline.SpillMemory

    def no_anonymous_memory(budget):
        if budget:
            raise OSError(12, "Cannot allocate memory")
        return unmappable(budget)

    monkeypatch.setattr(pipeline, "SpillMemory", no_anonymous_memory)
    none = pack([str(synthetic_parquet)], str(tmp_path / "none"), spec, warn=said.append).spill
    assert none["memory_bytes"] == 0 and none["bytes"] == whole["bytes"] and len(said) == 1
    with pytest.raises(ConfigError, match="spill memory: cannot reserve 268,435,456 bytes"):
        pack([str(synthetic_parquet)], str(tmp_path / "refused"), spec, spill_memory=256 << 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["asked", "asked-in-container", "near", "none", "tight",
                                                          "whole"]


def test_a_fresh_process_holds_a_small_spill_in_memory(synthetic_parquet, tmp_path):
    result = subprocess.run([sys.executable, "-c", PACKER, "pack", str(synthetic_parquet), "-o", str(tmp_path / "out"),
                             "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    spill = json.loads(result.stdout)["spill"]
    assert spill["memory_bytes"] == spill["bytes"] > 0


def _packer_with(args, stdout, preexec_fn=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user's shell runs it
    return subprocess.run([sys.executable, "-c", PACKER, *map(str, args)], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=120, env=env, preexec_fn=preexec_fn)


@pytest.mark.parametrize("command", ["inspect", "verify", "pack"])
def test_a_reader_that_went_away_is_no_traceback(synthetic_parquet, tmp_path, command):
    """`packer ... --json | head -c 10`: a BrokenPipeError traceback and exit 120, or click's
    silent exit 1 ('problems found') for a longer document."""
    out = tmp_path / "out"
    assert _pack_in_process("pack", synthetic_parquet, "-o", out).exit_code == 0
    args = {"inspect": ["inspect", out, "--json"], "verify": ["verify", out, "--json"],
            "pack": ["pack", synthetic_parquet, "--dry-run", "--json"]}[command]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        result = _packer_with(args, stdout=write)
    finally:
        os.close(write)
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
    assert result.returncode in (0, 141), result  # the verdict, or 141 when the document was cut


@pytest.fixture(scope="module")
def one_big_pack(synthetic_parquet, tmp_path_factory):
    """An output whose pack 0 holds all 3,000 sequences: `inspect --pack 0` is a long report."""
    out = tmp_path_factory.mktemp("big") / "out"
    assert _pack_in_process("pack", synthetic_parquet, "-o", out, "-C", 2_000_000).exit_code == 0
    return out


@pytest.mark.parametrize("flags", [["--json"], []], ids=["json", "table"])
def test_a_long_report_cut_by_its_reader_exits_141(one_big_pack, flags):
    """`packer inspect OUT --json --pack 0 | head -c 10`: the report is larger than a pipe holds,
    the reader leaves after 10 bytes. Python's buffered stdout took the short write for the
    whole and dropped the rest: exit 0 as though the report had been delivered."""
    read, write = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", PACKER, "inspect", str(one_big_pack), "--pack", "0", *flags],
                             stdout=write, stderr=subprocess.PIPE, text=True)
    os.close(write)
    with os.fdopen(read, "rb") as reader:
        assert len(reader.read(10)) == 10
    stderr = child.communicate(timeout=120)[1]
    assert child.returncode == 141 and "Traceback" not in stderr, stderr


def test_a_long_report_onto_a_filling_disk_exits_74(one_big_pack, tmp_path):
    """`packer inspect OUT --json --pack 0 > report.json` with room for 64 kB of it: the rest
    was dropped without a word (exit 0, a cut report.json that is not JSON)."""
    with open(tmp_path / "report.json", "w") as report:
        result = subprocess.run([sys.executable, "-c", PACKER, "inspect", str(one_big_pack), "--json", "--pack", "0"],
                                stdout=report, stderr=subprocess.PIPE, text=True, timeout=120,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10)))
    assert result.returncode == 74, result.stderr
    assert result.stderr.splitlines()[-1] == "error: cannot write to stdout: [Errno 27] File too large"
    assert (tmp_path / "report.json").stat().st_size == 64 << 10


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_stdout_encoding_without_the_reports_characters(synthetic_parquet, tmp_path, encoding):
    """PYTHONIOENCODING=ascii: the summary's arrow, the histogram's bars and an accented OUT raised
    UnicodeEncodeError — a traceback and exit 1 after the output was complete."""
    env = {**os.environ, "PYTHONIOENCODING": encoding}
    out = tmp_path / "sortie→é"
    result = packer("pack", synthetic_parquet, "-o", out, "--json", env=env, encoding=encoding)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert json.loads(result.stdout)["out"] == str(out)  # escaped as JSON escapes, not as Python does
    for args in (["pack", synthetic_parquet, "-o", tmp_path / "other"], ["inspect", out], ["verify", out]):
        result = packer(*args, env=env, encoding=encoding)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        assert "\\u2192" in result.stdout or "\\u2588" in result.stdout or args[0] == "verify"


@pytest.mark.parametrize("variable,message", [
    ("NUMBA_NUM_THREADS=0", "error: numba cannot start: Number of threads specified must be > 0. "
                            "(a NUMBA_* environment variable?)"),
    ("NUMBA_CACHE_LOCATOR_CLASSES=junk", "error: Unknown cache locator class: 'junk' specified via "
                                         "NUMBA_CACHE_LOCATOR_CLASSES env variable"),
])
def test_a_numba_variable_numba_refuses_is_one_line(synthetic_parquet, tmp_path, variable, message):
    """numba reads its variables as it is imported or a kernel is decorated: a traceback, exit 1."""
    name, value = variable.split("=")
    import numba
    from numba.core import config

    if name == "NUMBA_CACHE_LOCATOR_CLASSES" and not hasattr(config, "CACHE_LOCATOR_CLASSES"):
        pytest.skip(f"numba {numba.__version__} reads no {name} (later releases do)")
    out = tmp_path / "out"
    for args in (["pack", synthetic_parquet, "-o", out], ["inspect", tmp_path], ["verify", tmp_path, "--json"]):
        result = packer(*args, env={**os.environ, name: value})
        assert result.returncode == 2 and result.stderr.splitlines() == [message], result.stderr
    assert json.loads(result.stdout)["error"] == message.removeprefix("error: ")
    assert not out.exists()


def test_a_non_blocking_stdout_gets_the_whole_report(one_big_pack):
    """A pipe handed down non-blocking (an event loop's): a full pipe's EAGAIN cut the report
    (exit 0 with the first 64 kB, then exit 74 with them) although its reader kept reading."""
    expected = packer("inspect", one_big_pack, "--json", "--pack", "0").stdout.encode()
    read, write = os.pipe()
    os.set_blocking(write, False)
    child = subprocess.Popen([sys.executable, "-c", PACKER, "inspect", str(one_big_pack), "--json", "--pack", "0"],
                             stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    time.sleep(1)  # the pipe fills, and the child meets EAGAIN
    with os.fdopen(read, "rb") as reader:
        got = reader.read()
    stderr = child.communicate(timeout=120)[1]
    assert child.returncode == 0, stderr
    assert len(expected) > 200_000 and got == expected


@pytest.mark.parametrize("env", [{"PYTHONIOENCODING": "ascii:surrogateescape"},
                                 {"PYTHONIOENCODING": "utf-16"}], ids=["surrogateescape", "utf-16"])
def test_stdout_encodings_pythons_own_stdout_takes(synthetic_parquet, tmp_path, env):
    """ascii with surrogateescape (a C locale without UTF-8 mode): the summary's arrow raised
    UnicodeEncodeError after the output was complete; UTF-16 into a file lost its BOM."""
    out = tmp_path / "out"
    with open(tmp_path / "report.txt", "wb") as report:
        result = subprocess.run([sys.executable, "-c", PACKER, "pack", str(synthetic_parquet), "-o", str(out)],
                                stdout=report, stderr=subprocess.PIPE, text=True, timeout=120,
                                env={**os.environ, **env})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    text = (tmp_path / "report.txt").read_bytes()
    if env["PYTHONIOENCODING"] == "utf-16":
        assert text[:2] in (b"\xff\xfe", b"\xfe\xff") and str(out) in text.decode("utf-16")
    else:
        assert "\\u2192" in text.decode("ascii")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "ascii"])
def test_a_non_utf8_file_name_on_any_stdout_encoding(synthetic_parquet, tmp_path, encoding):
    """verify names a stray file whose name is not UTF-8: its byte went out raw, which UTF-16 and
    UTF-32 refuse (a traceback and an empty report)."""
    out = tmp_path / "out"
    assert _pack_in_process("pack", synthetic_parquet, "-o", out).exit_code == 0
    open(os.path.join(os.fsencode(out), b"x\xff"), "wb").close()
    result = subprocess.run([sys.executable, "-c", PACKER, "verify", str(out)], capture_output=True, timeout=120,
                            env={**os.environ, "PYTHONIOENCODING": encoding})
    assert result.returncode == 1 and b"Traceback" not in result.stderr, result.stderr
    report = result.stdout.decode(encoding, errors="surrogateescape")
    if encoding == "ascii":  # one byte a character: the name's byte goes out raw, as `ls` shows it
        assert "x\udcff: unexpected file" in report, report
    else:  # a raw byte would break UTF-16 and UTF-32: its escape
        assert "x\\udcff: unexpected file" in report, report


def test_a_numba_variable_numba_cannot_parse_is_one_warning_line(synthetic_parquet, tmp_path):
    """numba ignores a value it cannot parse with a RuntimeWarning holding a whole traceback."""
    result = packer("pack", synthetic_parquet, "-o", tmp_path / "out", env={**os.environ, "NUMBA_OPT": "x"})
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["warning: Environment variable 'NUMBA_OPT' is defined but its associated "
                                          "value 'x' could not be parsed. (numba uses its default)"]


@pytest.mark.parametrize("closed", [1, 2])
def test_a_closed_stdout_or_stderr_is_dev_null(synthetic_parquet, tmp_path, closed):
    """`packer pack ... >&-` wrote its output and then failed with a traceback (sys.stdout is
    None); with stderr closed it exited 1 before reading anything, saying nothing."""
    out = tmp_path / "out"
    result = _packer_with(["pack", synthetic_parquet, "-o", out, "--json"], stdout=subprocess.PIPE,
                          preexec_fn=lambda: os.close(closed))
    assert result.returncode == 0, result
    assert "Traceback" not in result.stderr and (out / "metadata.json").exists()
    result = _packer_with(["inspect", out], stdout=subprocess.PIPE, preexec_fn=lambda: os.close(closed))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result


def test_a_stderr_reader_that_went_away_does_not_abandon_the_run(synthetic_parquet, tmp_path):
    """`packer pack ... 2>&1 | head -1`: the first warning written to the dead pipe ended the run
    with exit 1 (rich's SystemExit, or its BrokenPipeError) and the output was removed."""
    out = tmp_path / "out"
    (tmp_path / "out.tmp-99999999-abcd1234").mkdir()  # a killed run's: the run warns about it
    read, write = os.pipe()
    os.close(read)
    try:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        result = subprocess.run([sys.executable, "-c", PACKER, "pack", str(synthetic_parquet), "-o", str(out)],
                                stdout=subprocess.PIPE, stderr=write, text=True, timeout=120, env=env)
    finally:
        os.close(write)
    assert result.returncode == 0 and (out / "metadata.json").exists(), result


def test_a_stdout_reader_gone_without_json_exits_141(synthetic_parquet, tmp_path):
    # the summary table (rich) met the closed pipe: rich's SystemExit(1), 'problems found' for verify
    out = tmp_path / "out"
    for args in (["pack", synthetic_parquet, "-o", out], ["verify", out]):
        read, write = os.pipe()
        os.close(read)
        try:
            result = _packer_with(args, stdout=write)
        finally:
            os.close(write)
        assert result.returncode == 141 and "Traceback" not in result.stderr, result
    assert (out / "metadata.json").exists()


needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")


@needs_dev_full
@pytest.mark.parametrize("command", ["pack", "pack --json", "inspect", "inspect --json", "verify", "verify --json",
                                     "pack --help"])
def test_a_stdout_that_cannot_be_written_is_one_line_and_exit_74(synthetic_parquet, tmp_path, command):
    """`packer verify OUT --json > report.json` on a full disk: a traceback (exit 1), or, for a
    report written through rich, nothing said at all (exit 0) and an empty report.json."""
    out = tmp_path / "out"
    name, *flags = command.split()
    if name != "pack":
        assert _pack_in_process("pack", synthetic_parquet, "-o", out).exit_code == 0
    args = [name, synthetic_parquet, "-o", out, *flags] if name == "pack" else [name, out, *flags]
    with open("/dev/full", "w") as full:
        result = _packer_with(args if "--help" not in flags else [name, "--help"], stdout=full)
    assert result.returncode == 74, result
    assert result.stderr.splitlines()[-1] == "error: cannot write to stdout: [Errno 28] No space left on device"
    assert "Traceback" not in result.stderr, result.stderr
    if name == "pack" and "--help" not in flags:  # the report was lost, not the output
        assert (out / "metadata.json").exists() and _pack_in_process("verify", out).exit_code == 0


@needs_dev_full
def test_a_failure_whose_json_document_cannot_be_written_keeps_its_status(tmp_path):
    with open("/dev/full", "w") as full:
        result = _packer_with(["inspect", tmp_path / "missing", "--json"], stdout=full)
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [f"error: {tmp_path / 'missing'}: no such file or directory",
                                          "error: cannot write to stdout: [Errno 28] No space left on device"]


@needs_dev_full
@pytest.mark.parametrize("flags", [[], ["--json"]], ids=["table", "json"])
def test_verify_that_found_problems_keeps_exit_1_when_stdout_cannot_be_written(synthetic_parquet, tmp_path, flags):
    """A verdict known before the report is printed was lost with it: exit 74, as for a success."""
    out = tmp_path / "out"
    assert _pack_in_process("pack", synthetic_parquet, "-o", out).exit_code == 0
    shard = next(out.glob("packs-*.arrow"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with open("/dev/full", "w") as full:
        result = _packer_with(["verify", out, *flags], stdout=full)
    assert result.returncode == 1, result
    assert result.stderr.splitlines()[-1] == "error: cannot write to stdout: [Errno 28] No space left on device"


@needs_dev_full
def test_a_stderr_that_cannot_be_written_does_not_abandon_the_run(synthetic_parquet, tmp_path):
    """`packer pack ... 2> log` on a full disk: the first warning failed the run (exit 1, the
    output removed, nothing said anywhere)."""
    out = tmp_path / "out"
    (tmp_path / "out.tmp-99999999-abcd1234").mkdir()  # a killed run's: the run warns about it
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-c", PACKER, "pack", str(synthetic_parquet), "-o", str(out), "--json"],
                                stdout=subprocess.PIPE, stderr=full, text=True, timeout=120)
    assert result.returncode == 0, result
    assert json.loads(result.stdout)["out"] == str(out) and _pack_in_process("verify", out).exit_code == 0


def test_help_cut_by_its_reader_exits_141():
    """`packer pack --help | true`: rich's own broken-pipe answer, exit 1."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = _packer_with(["pack", "--help"], stdout=write)
    finally:
        os.close(write)
    assert result.returncode == 141 and result.stderr == "", result


@pytest.mark.parametrize("command", ["pack", "inspect", "verify"])
def test_a_path_that_is_not_utf8_is_a_one_line_config_error(tmp_path, command):
    """argv bytes that are not UTF-8 (Python decodes them to lone surrogates): --json printed a
    traceback (orjson refuses such strings), and an output packed to such a path could not be
    opened by inspect (pyarrow), a traceback too."""
    bad = os.fsencode(str(tmp_path)) + b"/o\xffut"
    args = {"pack": [b"pack", bad, b"-o", os.fsencode(str(tmp_path / "o"))], "inspect": [b"inspect", bad],
            "verify": [b"verify", bad]}[command]
    for flags in ([], [b"--json"]):
        result = subprocess.run([sys.executable.encode(), b"-c", PACKER.encode(), *args, *flags],
                                capture_output=True, timeout=120)
        assert result.returncode == 2, result
        assert b"Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
        assert b"is not a UTF-8 path" in result.stderr
        if flags:
            assert json.loads(result.stdout)["exit_code"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_spill_that_cannot_be_deleted_is_not_published_inside_out(synthetic_parquet, tmp_path, monkeypatch):
    """The spill is built inside the temporary output: one that could not be deleted (EIO) was
    published in OUT as _spill/, exit 0, and verify then failed the output."""
    import errno

    from packer_cli.shards._gather import SPILL_FILE

    unlink = os.unlink

    def failing(path, *args, **kwargs):
        if os.path.basename(str(path)) == SPILL_FILE:
            raise OSError(errno.EIO, "Input/output error", path)
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", failing)
    result = _pack_in_process("pack", synthetic_parquet, "-o", tmp_path / "out", "--spill-memory", "0")
    assert result.exit_code == 3, result.output
    assert result.output.startswith(f"error: {tmp_path / 'out'}: writing the output failed: [Errno 5] "), result.output
    assert not (tmp_path / "out").exists()

"""Moving a finished output into place: one rename, signals held across it, the old one kept on failure."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from packer_cli.shards import _atomic
from packer_cli.errors import ConfigError
from packer_cli.shards._atomic import replace_dir, signals_held


class Stop(Exception):
    pass


def make(path, text):
    path.mkdir()
    (path / "data").write_text(text)
    return path


@pytest.fixture(autouse=True)
def default_sigint():
    """Python's own SIGINT handler, whatever this test process inherited (a test run started in
    the background of a shell, or under nohup, starts with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def raising_term_handler():
    def handler(signum, frame):
        raise Stop(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_new_and_replaced_outputs(tmp_path):
    replace_dir(str(make(tmp_path / "a.tmp", "first")), str(tmp_path / "out"))
    assert (tmp_path / "out" / "data").read_text() == "first"
    replace_dir(str(make(tmp_path / "b.tmp", "second")), str(tmp_path / "out"))
    assert (tmp_path / "out" / "data").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("signum,raised", [(signal.SIGTERM, Stop), (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_between_the_renames_waits_for_both(tmp_path, monkeypatch, raising_term_handler, signum, raised):
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)  # a file system that cannot swap
    make(tmp_path / "out", "old")
    renames = []
    rename = os.rename

    def rename_then_signal(src, dst):
        rename(src, dst)
        renames.append(dst)
        if len(renames) == 1:  # OUT has just been renamed aside
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(_atomic.os, "rename", rename_then_signal)
    with pytest.raises(raised):
        replace_dir(str(make(tmp_path / "new.tmp", "new")), str(tmp_path / "out"))
    assert len(renames) == 2
    assert (tmp_path / "out" / "data").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old one deleted all the same
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_the_old_output_comes_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)  # a file system that cannot swap
    make(tmp_path / "out", "old")
    rename = os.rename

    def second_fails(src, dst):
        if src.endswith("new.tmp"):
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(_atomic.os, "rename", second_fails)
    with pytest.raises(OSError):
        replace_dir(str(make(tmp_path / "new.tmp", "new")), str(tmp_path / "out"))
    assert (tmp_path / "out" / "data").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.tmp", "out"]


def _swaps(tmp_path) -> bool:
    a, b = make(tmp_path / "probe-a", "a"), make(tmp_path / "probe-b", "b")
    swapped = _atomic._exchange(str(a), str(b))
    for p in (a, b):
        (p / "data").unlink()
        p.rmdir()
    return swapped


def test_a_replaced_out_is_never_absent(tmp_path, monkeypatch, raising_term_handler):
    """OUT was renamed aside, then the new one renamed in: a run killed outright between the
    two left no OUT. Where the file system can swap two names in one step, OUT is always there."""
    if not _swaps(tmp_path):
        pytest.skip("this file system cannot swap two names (renameat2 RENAME_EXCHANGE)")
    out = tmp_path / "out"
    make(out, "old")
    seen = []
    rename, exchange = os.rename, _atomic._exchange

    def watched_rename(src, dst):
        seen.append(("rename", (out / "data").read_text()))
        rename(src, dst)
        os.kill(os.getpid(), signal.SIGTERM)  # held: the old one is still deleted

    def watched_exchange(a, b):
        swapped = exchange(a, b)
        seen.append(("exchange", (out / "data").read_text()))
        return swapped

    monkeypatch.setattr(_atomic.os, "rename", watched_rename)
    monkeypatch.setattr(_atomic, "_exchange", watched_exchange)
    with pytest.raises(Stop):
        replace_dir(str(make(tmp_path / "new.tmp", "new")), str(out))
    assert seen == [("exchange", "new"), ("rename", "new")]  # the old one renamed to OUT.old-* once swapped out
    assert (out / "data").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_refused_out_is_judged_in_place_and_never_moves(tmp_path, monkeypatch):
    """Judged after the swap, a refused OUT had the new output published meanwhile, and a signal
    or a failed swap back lost the user's files; it is judged first, under OUT's lock."""
    out = make(tmp_path / "out", "foreign")
    judged = []

    def refuse(path):
        judged.append((path, (tmp_path / "out" / "data").read_text()))
        raise ConfigError("not packer's")

    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: pytest.fail("swapped a refused OUT"))
    with pytest.raises(ConfigError, match="not packer's"):
        replace_dir(str(make(tmp_path / "new.tmp", "new")), str(out), still_replaceable=refuse)
    assert judged == [(str(out), "foreign")]
    assert (out / "data").read_text() == "foreign" and (tmp_path / "new.tmp" / "data").read_text() == "new"


def test_the_new_directory_is_locked_before_it_becomes_out(tmp_path, monkeypatch):
    """The lock was on the old OUT's directory only: once swapped, OUT named an unlocked one,
    and another run replaced or joined it in the middle of this one."""
    import fcntl

    if not _swaps(tmp_path):
        pytest.skip("this file system cannot swap two names (renameat2 RENAME_EXCHANGE)")
    out, new = make(tmp_path / "out", "old"), make(tmp_path / "new.tmp", "new")
    exchange, held = _atomic._exchange, []

    def probe_then_swap(a, b):
        fd = os.open(a, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        return exchange(a, b)

    monkeypatch.setattr(_atomic, "_exchange", probe_then_swap)
    replace_dir(str(new), str(out))
    assert held == [True] and (out / "data").read_text() == "new"


def test_a_failure_after_the_swap_keeps_the_new_output(tmp_path, monkeypatch):
    """Renaming the swapped-out old OUT failed and the run exited 3 'not written' with the new
    output in place (and the old one deleted by the clean-up of what it took for its own)."""
    if not _swaps(tmp_path):
        pytest.skip("this file system cannot swap two names (renameat2 RENAME_EXCHANGE)")
    out = make(tmp_path / "out", "old")

    def failing_rename(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_atomic.os, "rename", failing_rename)
    assert replace_dir(str(make(tmp_path / "new.tmp", "new")), str(out)) is None  # deleted where it lay
    assert (out / "data").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("target", ["another-output", "missing"])
def test_a_link_that_appeared_at_out_is_refused_where_it_is(tmp_path, monkeypatch, target):
    """OUT is resolved when the run begins; a link found there at the end is someone else's. It
    was renamed aside to be judged: a kill or a failed put-back left no OUT."""
    make(tmp_path / "another-output", "theirs")
    out = tmp_path / "out"
    out.symlink_to(tmp_path / target)
    rename = os.rename
    monkeypatch.setattr(_atomic.os, "rename", lambda a, b: pytest.fail(f"moved {a}") if a == str(out) else rename(a, b))
    with pytest.raises(ConfigError, match="is now a symbolic link"):
        replace_dir(str(make(tmp_path / "new.tmp", "new")), str(out), still_replaceable=lambda path: None)
    assert os.readlink(out) == str(tmp_path / target) and (tmp_path / "another-output" / "data").read_text() == "theirs"


def test_outside_the_main_thread_the_block_just_runs(tmp_path):
    ran = []

    def work():
        with signals_held():
            ran.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert ran == [signal.default_int_handler]


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_an_out_name_of_250_bytes_packs_and_replaces(synthetic_parquet, tmp_path, fmt):
    """A valid 250-byte OUT failed with "File name too long" on its OUT.tmp-PID sibling (exit 2)."""
    from typer.testing import CliRunner

    from packer_cli.audit import verify_output
    from packer_cli.cli import app

    out = tmp_path / ("é" * 100 + "o" * 50)  # 250 bytes in UTF-8, cut mid-character by a naive cut
    for extra in ([], ["--overwrite"]):  # the second run renames the first aside (OUT.old-PID) to replace it
        result = CliRunner().invoke(app, ["pack", str(synthetic_parquet), "-o", str(out), "--format", fmt, *extra])
        assert result.exit_code == 0, result.output
        assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    assert verify_output(str(out)).exit_code == 0
    stale = tmp_path / (_atomic._sibling_prefix(out.name, ".tmp-") + "99999")  # a run killed outright
    stale.mkdir()
    result = CliRunner().invoke(app, ["pack", str(synthetic_parquet), "-o", str(out), "--format", fmt, "--overwrite"])
    assert result.exit_code == 0 and f"{stale} was left by an earlier run" in result.output


def test_long_names_get_siblings_of_their_own():
    from packer_cli.shards._atomic import _NAME_MAX, _sibling_prefix

    short = _sibling_prefix("out", ".tmp-")
    assert short == "out.tmp-"
    a, b = "x" * 240 + "a", "x" * 240 + "b"
    pa_, pb = _sibling_prefix(a, ".tmp-"), _sibling_prefix(b, ".tmp-")
    assert pa_ != pb and pa_.endswith(".tmp-") and pa_.startswith("x" * 200)
    assert len(os.fsencode(pa_ + "4194304-0123abcd")) <= _NAME_MAX
    assert _sibling_prefix(a, ".tmp-") == pa_  # the same every time: stale siblings are found again
    multibyte = _sibling_prefix("é" * 125, ".old-")
    multibyte.encode("utf-8")  # no half character left at the cut


def test_a_temporary_name_is_never_another_runs(tmp_path):
    """The name held the process id alone, and was emptied first: two runs with one id (two
    containers, two nodes on a shared file system) built in one directory, one deleting the
    other's files, and the survivor renamed a mix into place with exit 0."""
    from packer_cli.shards._atomic import make_temporary

    out = tmp_path / "out"
    other = tmp_path / f"out.tmp-{os.getpid()}"  # what another run with our id built under the old name
    (other / "_spill").mkdir(parents=True)
    first, second = make_temporary(str(out)), make_temporary(str(out))
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    assert os.path.basename(first).startswith(f"out.tmp-{os.getpid()}-")
    assert (other / "_spill").is_dir()


def test_stale_temporaries_leave_out_live_processes(tmp_path):
    from packer_cli.shards._atomic import make_temporary, stale_temporaries

    out = str(tmp_path / "out")
    ours = make_temporary(out)
    live = tmp_path / f"out.tmp-{os.getppid()}-0123abcd"  # a run still packing (a live process here)
    dead = [tmp_path / "out.tmp-99999999-0123abcd", tmp_path / "out.tmp-99999999"]  # killed; and an older name
    for path in [live, *dead, tmp_path / "out.tmp-12-notrandom"]:
        path.mkdir()
    assert stale_temporaries(out, ours) == sorted(map(str, dead))


def test_a_bind_mount_from_the_same_file_system_is_a_mount_point(tmp_path, monkeypatch):
    """os.path.ismount cannot see a bind mount from the same file system (a container's volume):
    OUT there was refused only after the whole run (EBUSY, EXDEV). /proc/self/mountinfo can."""
    import io

    from packer_cli.shards import _atomic

    out = tmp_path / "out dir"
    out.mkdir()
    escaped = str(out).replace(" ", "\\040").encode()
    table = (b"22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
             b"99 22 8:1 /srv/data " + escaped + b" rw,relatime - ext4 /dev/sda1 rw\n")
    real_open = open
    monkeypatch.setattr(_atomic, "open", lambda path, *a, **k: io.BytesIO(table) if path == "/proc/self/mountinfo"
                        else real_open(path, *a, **k), raising=False)
    assert _atomic._is_mount_point(str(out)) and not _atomic._is_mount_point(str(tmp_path))
    with pytest.raises(ConfigError, match="is a mount point: the output is built beside OUT"):
        _atomic.check_parent(str(out))


@pytest.mark.parametrize("fmt, overwrite", [("native", False), ("native", True), ("megatron-bridge", False),
                                            ("megatron-bridge", "join")])
def test_an_output_is_durable_before_it_is_renamed_into_place(synthetic_parquet, tmp_path, monkeypatch, fmt,
                                                                overwrite):
    """Nothing was synced: after a power loss (or a kernel crash) a renamed OUT could hold
    shards or JSON files the page cache never wrote back. Every file is synced as it is closed,
    the temporary directory before the rename and OUT's parent after it (the directory a Bridge
    split joins, after its files are moved in)."""
    from typer.testing import CliRunner

    from packer_cli.cli import app

    out = tmp_path / "out"
    args = ["pack", str(synthetic_parquet), "-o", str(out), "--pack-size", "256"]
    if fmt != "native":
        args += ["--format", "megatron-bridge"]
    if overwrite is True:
        assert CliRunner().invoke(app, args).exit_code == 0
        args.append("--overwrite")
    if overwrite == "join":  # a validation split joins the training split's layout
        assert CliRunner().invoke(app, args).exit_code == 0
        args += ["--split", "validation"]
    events = []
    fsync, rename, replace = os.fsync, os.rename, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("sync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                  fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(b))), rename(a, b))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(b))), replace(a, b))[1])
    exchange = _atomic._exchange  # --overwrite swaps the new OUT in where the file system can
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: (events.append(("rename", str(b))), exchange(a, b))[1])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    into_out = [k for k, (what, path) in enumerate(events) if what == "rename" and os.path.dirname(path) in
                (str(out), str(tmp_path)) and os.path.basename(path) in ("out", *os.listdir(out))]
    assert into_out, events
    first = into_out[0]
    synced_before = {os.path.basename(path) for what, path in events[:first] if what == "sync"}
    written = set(os.listdir(out)) if overwrite != "join" else {n for n in os.listdir(out) if "validation" in n}
    assert written <= synced_before, (written, events)
    synced_after = [path for what, path in events[into_out[-1]:] if what == "sync"]
    parent = str(out) if overwrite == "join" else str(tmp_path)
    assert parent in synced_after, events


def test_a_file_that_appeared_at_out_is_refused_where_it_is(tmp_path, monkeypatch):
    from packer_cli.shards._atomic import check_replaceable

    out = tmp_path / "out"
    out.write_text("someone's file")
    rename = os.rename
    monkeypatch.setattr(_atomic.os, "rename", lambda a, b: pytest.fail(f"moved {a}") if a == str(out) else rename(a, b))
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        replace_dir(str(make(tmp_path / "new.tmp", "new")), str(out),
                    still_replaceable=lambda path: check_replaceable(path, (), lambda name: True))
    assert out.read_text() == "someone's file"


def test_another_runs_out_appearing_between_the_two_renames_is_replaced_in_turn(tmp_path, monkeypatch):
    """Without a swap OUT is absent between the two renames, and another run can put its OUT
    there: the second rename fails (directory not empty). The old OUT renamed aside is deleted
    all the same and the replacement is tried again, replacing the other run's OUT in turn:
    none is left behind as OUT.old-*, and no error."""
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)  # a file system that cannot swap
    out, new = make(tmp_path / "out", "old"), make(tmp_path / "new.tmp", "new")
    rename, raced = os.rename, []

    def another_run_first(src, dst):
        if src == str(new) and dst == str(out) and not raced:
            raced.append(dst)
            make(out, "another run's")
        rename(src, dst)

    monkeypatch.setattr(_atomic.os, "rename", another_run_first)
    assert replace_dir(str(new), str(out)) is None
    assert raced and (out / "data").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_input_beside_out_in_a_directory_named_like_it_is_not_inside_it(tmp_path):
    """--overwrite refuses an OUT that holds an input; ``out2/`` beside ``out/`` does not hold it
    (a plain prefix test said it did, and refused to replace an empty ``out/``)."""
    from packer_cli.shards._atomic import _input_inside, check_replaceable
    from packer_cli.shards.bridge_output import foreign_names

    (tmp_path / "out").mkdir()
    (tmp_path / "out2").mkdir()
    beside = tmp_path / "out2" / "data.jsonl"
    beside.write_text("{}\n")
    check_replaceable(str(tmp_path / "out"), [str(beside)], foreign_names)
    assert _input_inside(str(tmp_path / "out2"), [str(beside)]) == str(beside)


def test_a_drawn_temporary_name_that_exists_is_drawn_again(tmp_path, monkeypatch):
    """A drawn name already taken (another run with our process id drew the same random part)
    is drawn again, never handed back: that run's files would be built over and deleted."""
    from packer_cli.shards._atomic import make_temporary

    draws = iter(["0123abcd", "4567ef01"])
    monkeypatch.setattr(_atomic.secrets, "token_hex", lambda nbytes: next(draws))
    theirs = tmp_path / f"out.tmp-{os.getpid()}-0123abcd"
    theirs.mkdir()
    (theirs / "shard").write_text("theirs")
    ours = make_temporary(str(tmp_path / "out"))
    assert ours == str(tmp_path / f"out.tmp-{os.getpid()}-4567ef01") and os.listdir(ours) == []
    assert (theirs / "shard").read_text() == "theirs"


def test_an_interrupt_as_the_temporary_is_made_leaves_nothing(tmp_path, monkeypatch):
    """A Ctrl-C raised as mkdir returns: the caller never learns the name, so the empty
    directory is removed here (else it stayed as OUT.tmp-*, named by every later run)."""
    from packer_cli.shards._atomic import make_temporary

    mkdir = os.mkdir

    def mkdir_then_interrupt(path, *args, **kwargs):
        mkdir(path, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(_atomic.os, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        make_temporary(str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failing_sync_of_out_s_parent_once_in_place_does_not_fail_the_replacement(tmp_path, monkeypatch, overwrite):
    """OUT's parent is synced after the rename: the new output is in place by then, and failing
    the run ('not written', its clean-up) for an output that is there was wrong."""
    import errno

    if overwrite:
        make(tmp_path / "out", "old")
    fsync = os.fsync

    def failing_for_the_parent(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path):
            raise OSError(errno.EIO, "Input/output error")
        return fsync(fd)

    monkeypatch.setattr(_atomic.os, "fsync", failing_for_the_parent)
    assert replace_dir(str(make(tmp_path / "new.tmp", "new")), str(tmp_path / "out"), overwrite) is None
    assert (tmp_path / "out" / "data").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_temporary_output_is_synced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """The new directory's own entries (the files created in it) are made durable before the
    rename publishes it, and OUT's parent after it."""
    events = []
    fsync, rename = os.fsync, os.rename
    monkeypatch.setattr(_atomic.os, "fsync", lambda fd: (events.append(("sync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                         fsync(fd))[1])
    monkeypatch.setattr(_atomic.os, "rename", lambda a, b: (events.append(("rename", str(a))), rename(a, b))[1])
    new = make(tmp_path / "new.tmp", "new")
    replace_dir(str(new), str(tmp_path / "out"), overwrite=False)
    assert events == [("sync", str(new)), ("rename", str(new)), ("sync", str(tmp_path))]


def test_a_foreign_out_that_appeared_while_packing_is_not_met_with_advice_to_overwrite(tmp_path):
    """Without --overwrite, an OUT of someone else's files that appeared meanwhile: advising
    --overwrite sent the user round in a circle (it refuses such an OUT too)."""
    from packer_cli.shards.bridge_output import foreign_names

    out = make(tmp_path / "out", "notes")
    with pytest.raises(ConfigError) as raised:
        replace_dir(str(make(tmp_path / "new.tmp", "new")), str(out), overwrite=False, foreign_names=foreign_names)
    assert str(raised.value) == (f"{out} already exists (it appeared while this run was packing: another run?); "
                                 "it holds files packer did not write (data): choose another directory")
    assert (out / "data").read_text() == "notes" and (tmp_path / "new.tmp" / "data").read_text() == "new"


def test_a_file_written_into_out_before_it_is_renamed_aside_is_kept(tmp_path, monkeypatch):
    """Where OUT cannot be swapped in one step, the OUT renamed aside is judged again under its
    new name: a file written into OUT between the judgement in place and that rename was
    deleted with the old output."""
    from packer_cli.shards._atomic import check_replaceable
    from packer_cli.shards.bridge_output import foreign_names

    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)  # a file system that cannot swap
    out, new = tmp_path / "out", make(tmp_path / "new.tmp", "new")
    out.mkdir()
    rename = os.rename

    def written_into_first(src, dst):
        if src == str(out):
            (out / "notes.txt").write_text("the user's")
        rename(src, dst)

    monkeypatch.setattr(_atomic.os, "rename", written_into_first)
    with pytest.raises(ConfigError, match=r"holds files packer did not write \(notes.txt\)"):
        replace_dir(str(new), str(out), still_replaceable=lambda path: check_replaceable(path, (), foreign_names,
                                                                                          shown=str(out)))
    assert (out / "notes.txt").read_text() == "the user's" and (new / "data").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.tmp", "out"]


def test_a_run_waiting_on_out_s_lock_locks_the_directory_that_replaced_it(tmp_path):
    """The lock is taken on the directory at OUT; where OUT was replaced while this run waited,
    the lock it got was on the old one, and OUT (the new one) was another run's to replace or
    join in the middle of this one's block."""
    import fcntl
    import time

    from packer_cli.shards._atomic import locked

    out = tmp_path / "out"
    out.mkdir()
    seen = []

    def waiter():
        with locked(str(out)):
            fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("unlocked")
            except BlockingIOError:
                seen.append("locked")
            finally:
                os.close(fd)

    with locked(str(out)):
        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.3)  # the waiter blocks on the old OUT's lock
        os.rename(out, tmp_path / "old")
        out.mkdir()
    thread.join()
    assert seen == ["locked"]


def test_a_failure_renaming_the_old_out_aside_is_the_error_reported(tmp_path, monkeypatch):
    """Where OUT cannot be swapped and renaming it aside fails (busy, no permission), that is the
    error: a put-back of the name never made ('No such file or directory') hid why."""
    import errno

    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)  # a file system that cannot swap
    out, new = make(tmp_path / "out", "old"), make(tmp_path / "new.tmp", "new")
    rename = os.rename

    def busy(src, dst):
        if src == str(out):
            raise OSError(errno.EBUSY, "Device or resource busy", src)
        rename(src, dst)

    monkeypatch.setattr(_atomic.os, "rename", busy)
    with pytest.raises(OSError) as raised:
        replace_dir(str(new), str(out))
    assert raised.value.errno == errno.EBUSY
    assert (out / "data").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["new.tmp", "out"]


def test_out_s_lock_lets_one_run_in_at_a_time(tmp_path):
    """Runs replacing or joining one OUT take turns: a second run waits until the first leaves."""
    import time

    from packer_cli.shards._atomic import locked

    out = tmp_path / "out"
    out.mkdir()
    events = []

    def second():
        with locked(str(out)):
            events.append("second in")

    with locked(str(out)):
        events.append("first in")
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        events.append("first out")
    thread.join()
    assert events == ["first in", "first out", "second in"]

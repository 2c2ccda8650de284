"""Moving a finished output into place: one rename, signals held across it, the old one kept on failure."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from packer_cli.shards import _atomic
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


def test_outside_the_main_thread_the_block_just_runs(tmp_path):
    ran = []

    def work():
        with signals_held():
            ran.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert ran == [signal.default_int_handler]

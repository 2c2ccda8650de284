"""Readers: every input format gives the same samples; supervision fields are detected."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from packer_cli.demo import demo_table
from packer_cli.sources import SampleStream, discover_inputs
from packer_cli.spec import SourceSpec


def collect(paths, spec=SourceSpec()):
    stream = SampleStream(discover_inputs([str(p) for p in paths]), spec)
    batches = list(stream)
    tokens = np.concatenate([b.tokens for b in batches])
    targets = np.concatenate([b.targets for b in batches])
    lengths = np.concatenate([b.lengths for b in batches])
    index = np.concatenate([b.source_index for b in batches])
    return tokens, targets, lengths, index, stream


@pytest.fixture(scope="module")
def table():
    return demo_table(300, seed=1)


def write_all_formats(table: pa.Table, d):
    rows = table.to_pylist()
    lines = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    (d / "a.jsonl").write_bytes(lines)
    (d / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    import zstandard

    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(table, d / "d.parquet", row_group_size=100)
    with pa.ipc.new_file(str(d / "e.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=70)
    with pa.ipc.new_stream(str(d / "f_stream.arrow"), table.schema) as w:
        w.write_table(table)
    feather.write_feather(table, d / "g.feather")
    return sorted(d.iterdir())


def test_all_formats_read_identically(table, tmp_path):
    files = write_all_formats(table, tmp_path)
    expected_tokens = np.concatenate([np.asarray(x) for x in table.column("input_ids").to_pylist()])
    expected_mask = np.concatenate([np.asarray(x) for x in table.column("loss_mask").to_pylist()])
    for f in files:
        tokens, targets, lengths, index, stream = collect([f])
        np.testing.assert_array_equal(tokens, expected_tokens, err_msg=f.name)
        np.testing.assert_array_equal(targets, expected_mask, err_msg=f.name)
        assert stream.supervision.kind == "mask"
        np.testing.assert_array_equal(index, np.arange(300))
    # the directory is one stream in sorted order
    tokens, _, _, index, _ = collect([tmp_path])
    assert index.size == 300 * len(files) and tokens.size == expected_tokens.size * len(files)


def test_hf_datasets_directory(table, tmp_path):
    datasets = pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")
    ds = datasets.Dataset(table)
    ds.save_to_disk(str(tmp_path / "hf"), max_shard_size="200KB")
    tokens, targets, lengths, index, _ = collect([tmp_path / "hf"])
    expected = np.concatenate([np.asarray(x) for x in table.column("input_ids").to_pylist()])
    np.testing.assert_array_equal(tokens, expected)
    assert index.size == 300
    dd = datasets.DatasetDict({"train": ds})
    dd.save_to_disk(str(tmp_path / "dd"))
    from packer_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="DatasetDict with splits .'train'."):
        discover_inputs([str(tmp_path / "dd")])


def test_supervision_kinds(tmp_path):
    rows = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}]
    labels = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}]
    answer = [{"input_ids": [5, 6, 7, 8], "answer_start_idx": 2}]
    plain = [{"input_ids": [5, 6, 7, 8]}]
    for name, recs, kind in (("m", rows, "mask"), ("l", labels, "labels"), ("a", answer, "answer"), ("p", plain, "all")):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        tokens, targets, _, _, stream = collect([path])
        assert stream.supervision.kind == kind
        expected = [1, 1, 1, 1] if kind == "all" else [0, 0, 1, 1]
        np.testing.assert_array_equal(targets, expected)


def test_forced_mask_field(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"ids": [1, 2, 3], "labels": [1, 2, 3], "assistant": [0, 1, 1]}) + "\n")
    _, targets, _, _, stream = collect([path], SourceSpec(tokens_field="ids", mask_field="assistant"))
    assert stream.supervision.field == "assistant"
    np.testing.assert_array_equal(targets, [0, 1, 1])


def test_too_short_samples_are_dropped_and_counted(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([1], [], [1, 2], [3, 4, 5])))
    stream = SampleStream(discover_inputs([str(path)]), SourceSpec())
    batches = list(stream)
    assert sum(b.too_short for b in batches) == 2
    np.testing.assert_array_equal(np.concatenate([b.source_index for b in batches]), [2, 3])


def test_unknown_type_and_missing_inputs(tmp_path):
    from packer_cli.errors import DataError

    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"x\.csv: unknown file type"):
        discover_inputs([str(tmp_path / "x.csv")])
    with pytest.raises(DataError, match="matches no files"):
        discover_inputs([str(tmp_path / "*.parquet")])
    with pytest.raises(DataError, match="no supported input files"):
        discover_inputs([str(tmp_path)])


def test_a_later_input_without_records_is_an_error(tmp_path):
    """Every input must hold a record, not only the first: a later file of blank lines was
    passed over without a word (the check counted the records of all inputs so far)."""
    from packer_cli.errors import DataError

    (tmp_path / "a.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    (tmp_path / "b.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"b\.jsonl: empty input \(no records\)"):
        collect([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])


def test_a_source_index_is_located_at_its_own_file_and_line(tmp_path, monkeypatch):
    """Error messages name a sample by file and line (blank lines are not records). The first
    record of a file was named as the previous file's row past its end ('a.jsonl: row 6'), and
    the first record of a later batch by its row, not its line ('a.jsonl: row 4')."""
    from packer_cli.sources import readers

    monkeypatch.setattr(readers, "BATCH_ROWS", 4)  # a.jsonl is read in two batches
    record = b'{"input_ids": [1, 2, 3]}\n'
    (tmp_path / "a.jsonl").write_bytes(b"\n" + record * 3 + b"\n" + record * 3)
    (tmp_path / "b.jsonl").write_bytes(record + b"  \n" + record)
    *_, stream = collect([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    assert [stream.locate(k).replace(str(tmp_path) + "/", "") for k in range(9)] == [
        "a.jsonl: line 2", "a.jsonl: line 3", "a.jsonl: line 4", "a.jsonl: line 6", "a.jsonl: line 7",
        "a.jsonl: line 8", "b.jsonl: line 1", "b.jsonl: line 3", "source index 8"]


def _footers_alive() -> int:
    import gc

    return sum(type(o).__name__ == "FileMetaData" for o in gc.get_objects())


def _footers_left_by(paths, collector_on: bool) -> tuple[int, int]:
    """Footers still alive after reading ``paths`` with the cyclic collector on or off, and how
    many objects the sweeps froze."""
    import gc

    was_on = gc.isenabled()
    gc.collect()
    before = _footers_alive()
    try:
        gc.enable() if collector_on else gc.disable()
        _, _, lengths, _, _ = collect(paths)
        assert lengths.size == 6000
        return _footers_alive() - before, gc.get_freeze_count()
    finally:
        gc.unfreeze()
        gc.enable() if was_on else gc.disable()
        gc.collect()


def test_many_parquet_files_leave_no_footers_behind_with_the_collector_off(tmp_path, monkeypatch):
    # pyarrow leaves each Parquet file it opens in a reference cycle holding its footer; the CLI
    # runs with the cyclic collector off, so 5,000 files held 0.4 GB until every 256th file read
    # began to sweep them (packer_cli._cycles). With the collector on nothing is swept or frozen.
    import itertools

    from packer_cli import _cycles

    every = _cycles.FILES_PER_SWEEP
    monkeypatch.setattr(_cycles, "_files_read", itertools.count(1))  # this test's files are the 1st to 600th
    monkeypatch.setattr(_cycles, "_sweeping", True)  # as in the CLI, which turned the collector off
    table = pa.table({"input_ids": pa.array([[1, 2, 3], [4, 5]] * 5, pa.list_(pa.int32()))})
    for k in range(600):
        pq.write_table(table, tmp_path / f"part-{k:04d}.parquet", row_group_size=2)
    swept, frozen = _footers_left_by([tmp_path], collector_on=False)
    assert frozen > 0
    _, frozen = _footers_left_by([tmp_path], collector_on=True)
    assert frozen == 0
    monkeypatch.setattr(_cycles, "FILES_PER_SWEEP", 10**9)  # what it was: every file's footers stay
    kept, frozen = _footers_left_by([tmp_path], collector_on=False)
    assert frozen == 0 and kept >= 600  # one or more a file (pyarrow 14 leaves more than one)
    # only the files read since the last sweep (600 - 2 * 256 = 88 of 600) leave theirs
    assert swept <= kept * (600 - 2 * every) / 600 + 10, (swept, kept)


def test_a_program_that_turned_the_collector_off_has_nothing_frozen(tmp_path, monkeypatch):
    """A training loop that collects by hand turned the collector off itself: the library
    reading its 256th file froze every object the program held (a cycle it dropped later was
    never freed). Only the CLI, whose collector packer turned off, is swept."""
    import itertools

    from packer_cli import _cycles

    monkeypatch.setattr(_cycles, "_files_read", itertools.count(1))
    monkeypatch.setattr(_cycles, "_sweeping", False)  # the library in a program of its own
    table = pa.table({"input_ids": pa.array([[1, 2, 3], [4, 5]] * 5, pa.list_(pa.int32()))})
    for k in range(600):
        pq.write_table(table, tmp_path / f"part-{k:04d}.parquet", row_group_size=2)
    _, frozen = _footers_left_by([tmp_path], collector_on=False)
    assert frozen == 0


def test_an_unreachable_input_is_named_with_its_reason_not_as_missing(tmp_path, monkeypatch):
    """``os.path.exists`` is False for a loop of links, a path through a file and a file below
    a directory that may not be searched: each was reported as "no such file or directory",
    and a glob below a directory that cannot be listed as matching nothing, without why."""
    from packer_cli.errors import DataError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    os.symlink("loop", tmp_path / "loop")
    for arg, says in (("loop", "loop: too many levels of symbolic links"),
                      ("f.jsonl/x.jsonl", "f.jsonl/x.jsonl: not a directory"),
                      ("f.jsonl/*.jsonl", "f.jsonl/*.jsonl: the pattern matches no files (f.jsonl: not a directory)"),
                      ("gone/x.jsonl", "gone/x.jsonl: no such file or directory"),
                      ("gone/*.jsonl", "gone/*.jsonl: the pattern matches no files")):
        with pytest.raises(DataError) as caught:
            discover_inputs([arg])
        assert str(caught.value) == says


def _without_root_access(command: list[str]) -> list[str] | None:
    """``command`` run so that file permissions bind (root passes them unless its capabilities
    to override them are dropped), or None where that cannot be arranged."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    caps = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", *command]


def test_a_file_below_a_directory_that_may_not_be_searched_is_named_unreadable(tmp_path):
    for name, mode in (("nox", 0o600), ("noread", 0o311)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
        (tmp_path / name).chmod(mode)
    try:
        for arg, says in (("nox/f.jsonl", "error: nox/f.jsonl: permission denied"),
                          ("noread/*.jsonl", "error: noread/*.jsonl: the pattern matches no files "
                                             "(noread: permission denied)")):
            command = _without_root_access([sys.executable, "-m", "packer_cli", "pack", arg, "-o", "out"])
            if command is None:
                pytest.skip("runs as root without setpriv: permissions do not bind")
            run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            if run.returncode != 0 and "setpriv" in run.stderr:
                pytest.skip(f"setpriv cannot drop the capabilities here: {run.stderr.strip()}")
            assert (run.returncode, run.stderr.splitlines()) == (1, [says])
            assert not (tmp_path / "out").exists()
    finally:
        for name in ("nox", "noread"):
            (tmp_path / name).chmod(0o700)

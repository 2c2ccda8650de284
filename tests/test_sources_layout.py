"""Inputs as a user lays them out: directories (nested datasets directories, symbolic links,
packer outputs), globs, suffix case, duplicate columns, and supervision fields that only
some records have. Each case was once read wrongly without a word, or with a traceback."""
from __future__ import annotations

import gzip
import json
import os
import re

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from packer_cli import PackSpec, pack
from packer_cli.cli import app
from packer_cli.errors import ConfigError, DataError
from packer_cli.sources import SampleStream, discover_inputs
from packer_cli.spec import SourceSpec

runner = CliRunner()


def jsonl(path, records) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return str(path)


def sample(first: int, n: int = 4) -> dict:
    return {"input_ids": list(range(first, first + n)), "loss_mask": [0] + [1] * (n - 1)}


def datasets_dir(root, firsts) -> str:
    """A save_to_disk-like directory (stream-format Arrow file + state.json) of one sample per entry."""
    root.mkdir(parents=True)
    table = pa.Table.from_pylist([sample(f) for f in firsts])
    with pa.ipc.new_stream(str(root / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return str(root)


def read(*paths, spec=SourceSpec()):
    """(first token of each sample, number of records) of the stream over ``paths``."""
    stream = SampleStream(discover_inputs([str(p) for p in paths]), spec)
    firsts = []
    for batch in stream:
        starts = np.concatenate([[0], np.cumsum(batch.lengths)[:-1]]).astype(np.int64)
        firsts += batch.tokens[starts].tolist() if batch.lengths.size else []  # all of it skipped
    return firsts, stream.records


# --- directories ------------------------------------------------------------------------------

def test_a_datasets_directory_inside_a_directory_is_read_through_its_state_json(tmp_path):
    """Walked as loose files, a ``datasets.map`` cache file next to the data was read as data."""
    jsonl(tmp_path / "data" / "a.jsonl", [sample(100)])
    ds = datasets_dir(tmp_path / "data" / "b_ds", [200, 300])
    table = pa.Table.from_pylist([sample(900)])
    with pa.ipc.new_stream(os.path.join(ds, "cache-1234.arrow"), table.schema) as writer:
        writer.write_table(table)
    assert read(tmp_path / "data") == ([100, 200, 300], 3)


def test_a_datasetdict_inside_a_directory_is_refused_as_at_the_top(tmp_path):
    """Read as loose files, its test split was packed into the training data."""
    jsonl(tmp_path / "data" / "a.jsonl", [sample(100)])
    dd = tmp_path / "data" / "dd"
    datasets_dir(dd / "train", [200])
    datasets_dir(dd / "test", [300])
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ConfigError, match=r"dd is a Hugging Face DatasetDict with splits \['test', 'train'\]"):
        discover_inputs([str(tmp_path / "data")])


def test_a_symbolic_link_to_a_directory_is_followed_and_a_loop_refused(tmp_path):
    jsonl(tmp_path / "data" / "a.jsonl", [sample(100)])
    jsonl(tmp_path / "elsewhere" / "c.jsonl", [sample(300)])
    os.symlink(tmp_path / "elsewhere", tmp_path / "data" / "b_link")
    assert read(tmp_path / "data") == ([100, 300], 2)  # the linked directory was skipped
    os.symlink(tmp_path / "data", tmp_path / "elsewhere" / "back")
    with pytest.raises(DataError, match=r"back: a symbolic link back to .*data, which holds it"):
        discover_inputs([str(tmp_path / "data")])


def test_a_directory_walk_keeps_sorted_path_order(tmp_path):
    # "a.b/x" sorts before "a/y" as a path ("." < "/"): the order source indices were always given in
    jsonl(tmp_path / "data" / "a" / "y.jsonl", [sample(200)])
    jsonl(tmp_path / "data" / "a.b" / "x.jsonl", [sample(100)])
    jsonl(tmp_path / "data" / ".hidden" / "z.jsonl", [sample(900)])
    assert read(tmp_path / "data") == ([100, 200], 2)


def test_a_double_star_glob_spans_directories(tmp_path):
    jsonl(tmp_path / "data" / "f1.jsonl", [sample(100)])
    jsonl(tmp_path / "data" / "x" / "f2.jsonl", [sample(200)])
    jsonl(tmp_path / "data" / "x" / "y" / "f3.jsonl", [sample(300)])
    assert read(tmp_path / "data" / "**" / "*.jsonl") == ([100, 200, 300], 3)


def test_a_double_star_glob_skips_hidden_directories_as_a_walk_does(tmp_path):
    jsonl(tmp_path / "data" / "f1.jsonl", [sample(100)])
    jsonl(tmp_path / "data" / "x" / "f2.jsonl", [sample(200)])
    jsonl(tmp_path / "data" / ".cache" / "stale.jsonl", [sample(900)])
    jsonl(tmp_path / "data" / "x" / ".old" / "y" / "stale.jsonl", [sample(901)])
    assert read(tmp_path / "data" / "**" / "*.jsonl") == ([100, 200], 2)
    assert read(tmp_path / "data") == ([100, 200], 2)


@pytest.mark.parametrize("pattern", ["d/**/*.jsonl", "d/sub/**/*.jsonl", "d/**/sub/**/*.jsonl", "d/**/a.*"])
def test_a_double_star_glob_refuses_a_link_back_to_a_directory_above_it(tmp_path, monkeypatch, pattern):
    """glob followed d/sub/up -> d round and round: a.jsonl was read ~40 times (two such links:
    without end). A link elsewhere is followed, as by a directory walk."""
    monkeypatch.chdir(tmp_path)
    jsonl(tmp_path / "d" / "sub" / "a.jsonl", [sample(100)])
    jsonl(tmp_path / "other" / "a.jsonl", [sample(200)])
    os.symlink(tmp_path / "other", tmp_path / "d" / "sub" / "elsewhere")
    assert read(pattern) == ([100, 200], 2)
    os.symlink("..", tmp_path / "d" / "sub" / "up")
    with pytest.raises(DataError, match=r"d/sub/up(/sub)?: a symbolic link back to .*/d(/sub)?, which holds it"):
        discover_inputs([pattern])


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_a_packer_output_inside_an_input_directory_is_refused(tmp_path, fmt):
    """A Bridge layout's Parquet file has the columns of a tokenized input: it was packed
    again as samples. Native shards failed on a missing field."""
    data = tmp_path / "data"
    jsonl(data / "a.jsonl", [sample(100 * i, 8) for i in range(1, 6)])
    result = runner.invoke(app, ["pack", str(data / "a.jsonl"), "-o", str(tmp_path / "out"), "-C", "16",
                                 "--format", fmt])
    assert result.exit_code == 0, result.output
    os.rename(tmp_path / "out", data / "packed")
    with pytest.raises(DataError, match=r"data/packed: a packer output, not input"):
        discover_inputs([str(data)])
    assert read(data / "a.jsonl")[1] == 5  # named on its own, the input still reads


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_a_packer_output_named_as_the_input_is_refused(tmp_path, fmt):
    """The output directory itself as INPUT (not only one inside an input directory): its shards
    are packs, not samples, and a Bridge layout's Parquet file would be packed again."""
    jsonl(tmp_path / "a.jsonl", [sample(100 * i, 8) for i in range(1, 6)])
    result = runner.invoke(app, ["pack", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "out"), "-C", "16",
                                 "--format", fmt])
    assert result.exit_code == 0, result.output
    for given in (tmp_path / "out", tmp_path / "out" / ""):
        with pytest.raises(DataError, match=r"out/?: a packer output, not input"):
            discover_inputs([str(given)])


def test_an_output_inside_an_input_directory_is_refused_before_anything_is_written(tmp_path):
    data = tmp_path / "data"
    jsonl(data / "a.jsonl", [sample(100, 8)])
    with pytest.raises(ConfigError, match=r"data/packed is inside the input directory .*data, so a later run"):
        pack([str(data)], str(data / "packed"), PackSpec(pack_size=16))
    result = runner.invoke(app, ["pack", str(tmp_path / "data"), "-o", str(data / "sub" / ".." / "packed"),
                                 "-C", "16"])
    assert result.exit_code == 2 and "is inside the input directory" in result.output, result.output
    assert sorted(os.listdir(data)) == ["a.jsonl"]
    assert pack([str(data / "a.jsonl")], str(data / "packed"), PackSpec(pack_size=16)).counts["records"] == 1  # a file is fine


@pytest.mark.parametrize("pattern,refused", [("data/**", True), ("data/*", True), ("data/*.jsonl", False),
                                             ("data/**/*.jsonl", False)])
def test_an_output_where_an_input_pattern_reads_is_refused(tmp_path, monkeypatch, pattern, refused):
    """'data/**' reads as 'data' does, and 'data/*' reaches data/packed too: such an OUT was let
    in, and the next run over the pattern failed on it ("a packer output, not input")."""
    monkeypatch.chdir(tmp_path)
    jsonl(tmp_path / "data" / "a.jsonl", [sample(100, 8)])
    if refused:
        with pytest.raises(ConfigError, match=f"data/packed is where the input pattern {re.escape(pattern)} reads"):
            pack([pattern], "data/packed", PackSpec(pack_size=16))
        assert sorted(os.listdir("data")) == ["a.jsonl"]
    else:
        assert pack([pattern], "data/packed", PackSpec(pack_size=16)).counts["records"] == 1
        assert pack([pattern], "again", PackSpec(pack_size=16)).counts["records"] == 1  # the pattern misses it


def test_an_output_in_a_hidden_directory_a_double_star_skips_is_not_refused(tmp_path, monkeypatch):
    """'data/**/*' never reads below data/.cache (a '**' skips hidden directories), so an OUT
    there is no input of a later run: it is written, not refused."""
    monkeypatch.chdir(tmp_path)
    jsonl(tmp_path / "data" / "a.jsonl", [sample(100, 8)])
    (tmp_path / "data" / ".cache").mkdir()
    assert pack(["data/**/*"], "data/.cache/packed", PackSpec(pack_size=16)).counts["records"] == 1
    assert pack(["data/**/*"], "again", PackSpec(pack_size=16)).counts["records"] == 1  # the pattern misses it


# --- files --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["UP.JSONL.GZ", "mixed.jsonl.Gz"])
def test_compressed_suffixes_in_any_case_are_decompressed(tmp_path, name):
    """Matched as JSON Lines whatever the case, the file was then read as plain text."""
    records = [sample(100 * i) for i in range(1, 4)]
    (tmp_path / name).write_bytes(gzip.compress(b"".join(orjson.dumps(r) + b"\n" for r in records)))
    assert read(tmp_path / name) == ([100, 200, 300], 3)


@pytest.mark.parametrize("suffix", ["parquet", "arrow"])
@pytest.mark.parametrize("column", ["input_ids", "loss_mask"])
def test_a_column_named_twice_is_a_data_error(tmp_path, suffix, column):
    """It was a KeyError traceback."""
    other = "loss_mask" if column == "input_ids" else "input_ids"
    table = pa.Table.from_arrays([pa.array([[1, 2, 3]]), pa.array([[0, 1, 1]]), pa.array([[1, 2, 3]])],
                                 names=[column, other, column])
    path = tmp_path / f"dup.{suffix}"
    _columnar(path, table, rows=table.num_rows)
    with pytest.raises(DataError, match=rf"dup\.{suffix}: column '{column}' appears 2 times"):
        read(path)


@pytest.mark.filterwarnings("ignore:Feather V1 files are deprecated")
def test_feather_version_1_is_named(tmp_path):
    path = tmp_path / "v1.feather"
    feather.write_feather(pa.table({"input_ids": [1, 2]}), str(path), version=1)
    with pytest.raises(DataError, match=r"v1\.feather: a Feather version 1 file; packer reads Feather version 2"):
        read(path)


@pytest.mark.parametrize("line,message", [
    (b'{"input_ids": [1, 99999999999999999999999, 3]}', "input_ids[1] = 99999999999999999999999 is out of range"),
    (b'{"input_ids": null}', "field 'input_ids' is null"),
    (b'{"tokens": [1, 2]}', "missing field 'input_ids'"),
    # a record with two faults is named by its first field's, not the later one's
    (b'{"input_ids": [1, "a", 3], "loss_mask": [0, "b", 1]}', 'input_ids[1] = "a" is not an integer'),
    (b'{"input_ids": null, "loss_mask": [0, "b", 1]}', "field 'input_ids' is null"),
])
def test_bad_values_are_named_for_what_they_are(tmp_path, line, message):
    """A record with a null field and a bad value in a later one was named by the later one
    (the null went unsaid); one with two bad values, by the later field's."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(line + b"\n")
    with pytest.raises(DataError, match=r"d\.jsonl: line 1: " + re.escape(message)):
        read(path)


def test_a_null_row_of_a_columnar_input_is_named_null(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], None], pa.list_(pa.int32()))}), path)
    with pytest.raises(DataError, match=r"d\.parquet: row 1: field 'input_ids' is null"):
        read(path)


# --- supervision that only some records have ---------------------------------------------------

def test_a_later_columnar_input_with_a_mask_is_an_error_not_ignored(tmp_path):
    """The first input decided "every token is a target"; the second one's mask was ignored."""
    first = tmp_path / "a.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), first)
    second = tmp_path / "b.parquet"
    pq.write_table(pa.table({"input_ids": [[4, 5, 6]], "loss_mask": [[0, 0, 1]]}), second)
    with pytest.raises(DataError, match=r"b\.parquet: row 0: column 'loss_mask' is a supervision field, but the "
                                        "first record of the input has none, so every token would be a target"):
        read(first, second)


def _columnar(path, table, rows: int = 2) -> None:
    """``table`` as Parquet, an Arrow IPC stream or file (by ``path``'s name), in row groups or
    record batches of ``rows`` rows."""
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=rows)
    elif path.name.endswith(".stream.arrow"):
        with pa.ipc.new_stream(str(path), table.schema) as writer:
            writer.write_table(table, max_chunksize=rows)
    else:
        feather.write_feather(table, str(path), chunksize=rows)


@pytest.mark.parametrize("name", ["b.parquet", "b.arrow", "b.stream.arrow"])
def test_a_later_columnar_input_with_a_null_mask_column_is_no_supervision(tmp_path, name):
    """A column of nulls carries no supervision, as a JSON null does not; it was refused."""
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "a.parquet")
    ids = pa.array([[4, 5, 6], [7, 8, 9], [10, 11, 12]])
    _columnar(tmp_path / name, pa.table({"input_ids": ids, "loss_mask": pa.nulls(3, pa.list_(pa.int8()))}))
    stream = SampleStream(discover_inputs([str(tmp_path / "a.parquet"), str(tmp_path / name)]), SourceSpec())
    targets = np.concatenate([batch.targets for batch in stream])
    assert stream.records == 4 and targets.size == 12 and targets.all()
    # one value in the third row (a later batch, or row group) is a mask: refused, naming that row
    mask = pa.array([None, None, [0, 1, 1]], pa.list_(pa.int8()))
    _columnar(tmp_path / name, pa.table({"input_ids": ids, "loss_mask": mask}))
    with pytest.raises(DataError, match=rf"{re.escape(name)}: row 2: column 'loss_mask' is a supervision field"):
        read(tmp_path / "a.parquet", tmp_path / name)


@pytest.mark.parametrize("name", ["b.parquet", "b.arrow"])
@pytest.mark.parametrize("values", ["values", "nulls"])
def test_a_later_columnar_input_with_a_supervision_column_named_twice_is_an_error(tmp_path, name, values):
    """Which of two 'loss_mask' columns would be the mask is ambiguous, so the file is refused
    before any row is read, whatever they hold. It was a KeyError traceback (Arrow IPC), an error
    naming only row 0 (Parquet), or, both columns all null, packed without a word (Parquet)."""
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "a.parquet")
    if values == "values":
        masks = [pa.array([[0, 1, 1]]), pa.array([[0, 0, 1]])]
    else:
        masks = [pa.nulls(1, pa.list_(pa.int64()))] * 2
    table = pa.Table.from_arrays([pa.array([[4, 5, 6]]), *masks], names=["input_ids", "loss_mask", "loss_mask"])
    path = tmp_path / name
    _columnar(path, table, rows=table.num_rows)
    with pytest.raises(DataError, match=rf"{re.escape(name)}: column 'loss_mask' is a supervision field, but the "
                                        "first record of the input has none"):
        read(tmp_path / "a.parquet", path)


@pytest.mark.parametrize("name", ["b.parquet", "b.arrow"])
def test_the_first_supervised_row_of_a_later_columnar_input_is_named(tmp_path, name):
    """The mask holds values at rows 1 and 3, the labels at row 2: the first of them, row 1 of
    'loss_mask', is named. The last value of a column, the later of two columns' first rows, or
    (Parquet) the last column looked at was named instead."""
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "a.parquet")
    table = pa.table({"input_ids": [[4, 5], [6, 7], [8, 9], [1, 2]],
                      "loss_mask": pa.array([None, [0, 1], None, [1, 1]], pa.list_(pa.int64())),
                      "labels": pa.array([None, None, [1, 1], None], pa.list_(pa.int64()))})
    path = tmp_path / name
    _columnar(path, table, rows=table.num_rows)
    stream = SampleStream(discover_inputs([str(tmp_path / "a.parquet"), str(path)]), SourceSpec())
    with pytest.raises(DataError, match=rf"{re.escape(name)}: row 1: column 'loss_mask' is a supervision field"):
        list(stream)
    assert stream.records == 2  # a.parquet's record and row 0, the one before it


def test_a_supervision_value_far_into_a_later_parquet_input_names_its_row(tmp_path, monkeypatch):
    """The mask column is searched in batches of 64 * ``BATCH_ROWS`` rows; the row named and the
    rows read before it are counted across them. Past the first batch (131,072 rows at the
    default) the row was counted from that batch's start, named wrong and read too few rows."""
    from packer_cli.sources import readers

    monkeypatch.setattr(readers, "BATCH_ROWS", 4)  # batches of 256 rows
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "a.parquet")
    mask = [None] * 1000
    mask[700] = [0, 1]
    pq.write_table(pa.table({"input_ids": [[4, 5]] * 1000, "loss_mask": pa.array(mask, pa.list_(pa.int64()))}),
                   tmp_path / "b.parquet")
    stream = SampleStream(discover_inputs([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]), SourceSpec())
    with pytest.raises(DataError, match=r"b\.parquet: row 700: column 'loss_mask' is a supervision field"):
        list(stream)
    assert stream.records == 1 + 700


@pytest.mark.parametrize("name", ["b.parquet", "b.arrow", "b.stream.arrow"])
def test_the_supervised_row_itself_is_not_read(tmp_path, name):
    """The rows before a supervision value are read, the row holding it is not: it was read with
    them (Parquet), so its own fault (here null tokens) was reported instead of the supervision
    field, and with valid tokens it was counted and packed as a record before the error."""
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "a.parquet")
    mask = pa.array([None, [0, 1], None], pa.list_(pa.int64()))
    path = tmp_path / name
    for ids in (pa.array([[4, 5], None, [6, 7]]), pa.array([[4, 5], [8, 9], [6, 7]])):
        _columnar(path, pa.table({"input_ids": ids, "loss_mask": mask}))
        stream = SampleStream(discover_inputs([str(tmp_path / "a.parquet"), str(path)]), SourceSpec())
        with pytest.raises(DataError, match=rf"{re.escape(name)}: row 1: column 'loss_mask' is a supervision field"):
            list(stream)
        assert stream.records == 2  # a.parquet's record and row 0


@pytest.mark.parametrize("record", [
    {"input_ids": [4, 5, 6], "loss_mask": [0, 0, 1]},
    {"input_ids": [4, 5, 6], "labels": [-100, 5, 6]},
    {"input_ids": [4, 5, 6], "answer_start_idx": 1},
    {"input_ids": [4, 5, 6], "l\\u006fss_mask": [0, 0, 1]},  # an escaped key: orjson reads it
], ids=["mask", "labels", "answer", "escaped key"])
def test_a_later_json_record_with_supervision_is_an_error_not_ignored(tmp_path, record):
    path = tmp_path / "d.jsonl"
    lines = [orjson.dumps({"input_ids": [1, 2, 3]}), b"", json.dumps(record).encode().replace(b"\\\\", b"\\")]
    path.write_bytes(b"\n".join(lines) + b"\n")
    name = next(k for k in ("loss_mask", "labels", "answer_start_idx") if k in json.loads(lines[2]))
    with pytest.raises(DataError, match=rf"d\.jsonl: line 3: field '{name}' is a supervision field, but the first "
                                        "record of the input has none"):
        read(path)


# --- a padding mask that only some records have -------------------------------------------------

@pytest.mark.parametrize("first", [
    {"input_ids": [1, 2, 3]},
    {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
    {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
], ids=["no supervision", "labels", "mask"])
@pytest.mark.parametrize("key", ["attention_mask", "att\\u0065ntion_mask"], ids=["plain", "escaped key"])
def test_a_later_json_record_with_a_padding_mask_is_an_error_not_ignored(tmp_path, first, key):
    """The first record had no attention_mask, so masks were not read: a later record's padding
    (here its two 0s) was packed as tokens, and trained on, without a word."""
    later = dict(first, input_ids=[4, 5, 0, 0])
    for name, values in first.items():
        if name != "input_ids":
            later[name] = values + [values[-1]]
    later_line = orjson.dumps(later)[:-1] + b', "' + key.encode() + b'": [1, 1, 0, 0]}'
    path = tmp_path / "d.jsonl"
    path.write_bytes(orjson.dumps(first) + b"\n" + orjson.dumps(first) + b"\n" + later_line + b"\n")
    with pytest.raises(DataError, match=r"d\.jsonl: line 3: field 'attention_mask' is a padding mask, but the first "
                                        r"record of the input has none, so the padding it marks would be packed"):
        read(path)


def test_a_later_null_padding_mask_is_no_mask_and_none_is_looked_for_when_not_asked(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6], "attention_mask": None},
                                        {"input_ids": [7, 8, 9], "meta": {"attention_mask": [1, 0, 0]}}])
    assert read(path) == ([1, 4, 7], 3)
    jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 0], "attention_mask": [1, 1, 0]}])
    # SourceSpec(attention_field=None) packs the records as stored: the 0 is a token
    stream = SampleStream(discover_inputs([path]), SourceSpec(attention_field=None))
    assert sum(batch.lengths.sum() for batch in stream) == 6 and stream.padding == 0
    # a padding mask of another name is looked for under that name alone
    stream = SampleStream(discover_inputs([path]), SourceSpec(attention_field="pad_mask"))
    assert sum(batch.lengths.sum() for batch in stream) == 6


@pytest.mark.parametrize("name", ["b.parquet", "b.arrow", "b.stream.arrow"])
def test_a_later_columnar_input_with_a_padding_mask_is_an_error_not_ignored(tmp_path, name):
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "a.parquet")
    ids = pa.array([[4, 5, 6], [7, 8, 9], [10, 11, 0]])
    _columnar(tmp_path / name, pa.table({"input_ids": ids, "attention_mask": pa.nulls(3, pa.list_(pa.int8()))}))
    assert read(tmp_path / "a.parquet", tmp_path / name) == ([1, 4, 7, 10], 4)  # nulls mark nothing
    mask = pa.array([None, None, [1, 1, 0]], pa.list_(pa.int8()))
    _columnar(tmp_path / name, pa.table({"input_ids": ids, "attention_mask": mask}))
    with pytest.raises(DataError, match=rf"{re.escape(name)}: row 2: column 'attention_mask' is a padding mask, "
                                        "but the first record of the input has none"):
        read(tmp_path / "a.parquet", tmp_path / name)


def test_supervision_names_elsewhere_in_a_record_are_not_supervision(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]},
                                        {"input_ids": [4, 5, 6], "note": "loss_mask"},
                                        {"input_ids": [7, 8, 9], "meta": {"loss_mask": [1, 1, 1]}}])
    stream = SampleStream(discover_inputs([path]), SourceSpec())
    targets = np.concatenate([batch.targets for batch in stream])
    assert stream.records == 3 and targets.all()


def test_a_subdirectory_that_cannot_be_listed_is_an_error_not_skipped(tmp_path, monkeypatch):
    """The directory walk skipped it without a word (root ignores permissions: the refusal is simulated)."""
    jsonl(tmp_path / "data" / "a.jsonl", [sample(100)])
    (tmp_path / "data" / "sub").mkdir()
    listdir = os.listdir

    def refusing(path):
        if str(path).endswith("sub"):
            raise PermissionError(13, "Permission denied")
        return listdir(path)

    monkeypatch.setattr(os, "listdir", refusing)
    with pytest.raises(DataError, match=r"data/sub: cannot list the directory \(Permission denied\)"):
        discover_inputs([str(tmp_path / "data")])


@pytest.mark.parametrize("marker,content", [("state.json", {"step": 3}), ("dataset_dict.json", {"note": 1})])
def test_a_subdirectory_with_an_unrelated_state_file_is_walked(tmp_path, marker, content):
    """Only a datasets state file (with _data_files) or DatasetDict (with splits) makes a
    subdirectory a datasets directory; a training log's state.json refused the whole input."""
    jsonl(tmp_path / "data" / "a.jsonl", [sample(100)])
    jsonl(tmp_path / "data" / "logs" / "b.jsonl", [sample(200)])
    (tmp_path / "data" / "logs" / marker).write_text(json.dumps(content))
    assert read(tmp_path / "data") == ([100, 200], 2)


@pytest.mark.parametrize("marker,content", [("state.json", {"global_step": 100}), ("dataset_dict.json", {"note": 1})])
def test_a_directory_argument_with_an_unrelated_state_file_is_walked(tmp_path, marker, content):
    """Named on the command line, the same directory was refused as a broken datasets directory
    (or a DatasetDict): the two now follow one rule."""
    jsonl(tmp_path / "logs" / "b.jsonl", [sample(200)])
    (tmp_path / "logs" / marker).write_text(json.dumps(content))
    assert read(tmp_path / "logs") == ([200], 1)


@pytest.mark.parametrize("spelling", ["", "/*", "/**"])
def test_a_datasets_directory_takes_its_place_by_its_files_paths(tmp_path, spelling):
    """Its files lie below it, so it comes where an ordinary subdirectory's files would ('d/ab'
    after 'd/ab.jsonl'): it came first, by the directory's own name."""
    jsonl(tmp_path / "d" / "ab-c.jsonl", [sample(100)])
    jsonl(tmp_path / "d" / "ab.jsonl", [sample(200)])
    datasets_dir(tmp_path / "d" / "ab", [300])
    jsonl(tmp_path / "d" / "ab0.jsonl", [sample(400)])
    assert read(str(tmp_path / "d") + spelling) == ([100, 200, 300, 400], 4)


def refuse_to_open(monkeypatch, suffix: str) -> None:
    """``open`` of a path ending in ``suffix`` fails as for a file another user owns."""
    real_open = open

    def refusing(path, *args, **kwargs):
        if str(path).endswith(suffix):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refusing)


def test_a_state_file_that_cannot_be_read_is_an_error_not_a_plain_directory(tmp_path, monkeypatch):
    """Unreadable, it made a datasets directory an ordinary one: its cache files were read as data."""
    ds = datasets_dir(tmp_path / "data" / "ds", [200])
    refuse_to_open(monkeypatch, os.path.join("ds", "state.json"))
    for where in (ds, str(tmp_path / "data")):
        with pytest.raises(DataError, match=r"ds/state\.json: cannot read it \(Permission denied\)"):
            discover_inputs([where])


def test_a_state_file_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    """Opened to be searched, a FIFO named state.json waited for a writer for ever."""
    jsonl(tmp_path / "data" / "logs" / "b.jsonl", [sample(200)])
    os.mkfifo(tmp_path / "data" / "logs" / "state.json")
    (tmp_path / "data" / "sub" / "state.json").mkdir(parents=True)  # a directory of that name is no marker
    jsonl(tmp_path / "data" / "sub" / "c.jsonl", [sample(300)])
    with pytest.raises(DataError, match=r"logs/state\.json: not a regular file"):
        discover_inputs([str(tmp_path / "data")])
    os.unlink(tmp_path / "data" / "logs" / "state.json")
    assert read(tmp_path / "data") == ([200, 300], 2)


def test_an_unreadable_state_file_above_the_inputs_is_not_looked_into(tmp_path, monkeypatch):
    """A training log's state.json in a parent directory nobody named, unreadable to this user,
    stopped every directory and glob input below it."""
    jsonl(tmp_path / "project" / "data" / "a.jsonl", [sample(100)])
    (tmp_path / "project" / "state.json").write_text(json.dumps({"step": 3}))
    refuse_to_open(monkeypatch, os.path.join("project", "state.json"))
    assert read(tmp_path / "project" / "data") == ([100], 1)
    assert read(str(tmp_path / "project" / "data" / "*.jsonl")) == ([100], 1)


@pytest.mark.parametrize("pattern", ["ds/*.jsonl", "ds/**/*.jsonl", "ds/*/*.jsonl", "ds/extra/*/../../*.jsonl"])
def test_an_unreadable_state_file_in_a_patterns_base_is_an_error(tmp_path, monkeypatch, pattern):
    """Judged leniently as a directory above the inputs, 'ds/**/*.jsonl' read ds/z.jsonl loosely
    where 'ds/*.jsonl' was refused (the lenient answer was cached for both)."""
    jsonl(tmp_path / "ds" / "z.jsonl", [sample(100)])
    jsonl(tmp_path / "ds" / "extra" / "a.jsonl", [sample(200)])
    (tmp_path / "ds" / "extra" / "sub").mkdir()  # '..' after the magic: the match lies in ds, above the base
    (tmp_path / "ds" / "state.json").write_text(json.dumps({"_data_files": []}))
    refuse_to_open(monkeypatch, os.path.join("ds", "state.json"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"ds/state\.json: cannot read it"):
        discover_inputs([pattern])


def test_a_marker_file_is_read_once_however_many_directories_lie_below_it(tmp_path, monkeypatch):
    """Every glob match re-read the markers of every directory above it (a 200 MB state.json
    of a training log: 0.03 s became 5.5 s for 20 matches)."""
    for k in range(5):
        jsonl(tmp_path / "p" / "data" / f"s{k}" / "a.jsonl", [sample(100 * k)])
    (tmp_path / "p" / "state.json").write_text(json.dumps({"step": 3}))
    real_open, opened = open, []

    def counting(path, *args, **kwargs):
        if str(path).endswith(os.path.join("p", "state.json")):
            opened.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting)
    assert read(str(tmp_path / "p" / "data" / "*"))[1] == 5
    assert read(str(tmp_path / "p" / "data" / "*"))[1] == 5
    assert len(opened) <= 1


def test_a_state_file_is_searched_whole(tmp_path):
    """'_data_files' past the first MiB (a hand-written state.json, keys unsorted) was not seen."""
    ds = datasets_dir(tmp_path / "ds", [200])
    table = pa.Table.from_pylist([sample(900)])
    with pa.ipc.new_stream(os.path.join(ds, "cache-1234.arrow"), table.schema) as writer:
        writer.write_table(table)
    state = {"note": "x" * (1 << 20), "_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
    (tmp_path / "ds" / "state.json").write_text(json.dumps(state, sort_keys=False))
    assert read(ds) == ([200], 1)


def test_a_marker_key_across_the_first_mib_of_a_state_file_is_seen(tmp_path):
    """The key '"_data_files"' split by the 1 MiB read boundary (some of it in each read) must be
    found as well: missed, the datasets directory was walked as loose files, its cache file read."""
    ds = datasets_dir(tmp_path / "ds", [200])
    table = pa.Table.from_pylist([sample(900)])
    with pa.ipc.new_stream(os.path.join(ds, "cache-1234.arrow"), table.schema) as writer:
        writer.write_table(table)
    head = '{"note": "'
    for before in (1, 5, 12):  # bytes of the key in the first MiB
        note = "x" * ((1 << 20) - len(head) - len('", ') - before)
        text = head + note + '", "_data_files": [{"filename": "data-00000-of-00001.arrow"}]}'
        assert text.index('"_data_files"') == (1 << 20) - before
        (tmp_path / "ds" / "state.json").write_text(text)
        assert read(ds) == ([200], 1), before


def test_a_missing_datasets_file_is_named(tmp_path):
    """The error names the data file state.json lists and the directory lacks."""
    ds = datasets_dir(tmp_path / "ds", [200])
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}, {"filename": "data-00001-of-00002.arrow"}]}
    (tmp_path / "ds" / "state.json").write_text(json.dumps(state))
    with pytest.raises(DataError, match=r"ds: datasets file data-00001-of-00002\.arrow listed in state\.json "
                                        r"is missing$"):
        discover_inputs([ds])


def test_an_indices_mapping_is_refused(tmp_path):
    """datasets 1.x saved a filtered or shuffled dataset whole with an indices file: reading the
    data files alone trained on the rows the filter removed."""
    ds = datasets_dir(tmp_path / "ds", [200, 300])
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
             "_indices_data_files": [{"filename": "indices.arrow"}]}
    (tmp_path / "ds" / "state.json").write_text(json.dumps(state))
    with pytest.raises(DataError, match="ds/state.json: an indices mapping .*save_to_disk"):
        discover_inputs([ds])
    state["_indices_data_files"] = None  # what a flattened dataset may record
    (tmp_path / "ds" / "state.json").write_text(json.dumps(state))
    assert read(ds) == ([200, 300], 2)


def test_a_double_star_glob_reads_each_file_once(tmp_path):
    """`k/**` matches k itself, each subdirectory and each file: all were read, some three times."""
    jsonl(tmp_path / "k" / "a.jsonl", [sample(100)])
    jsonl(tmp_path / "k" / "sub" / "b.jsonl", [sample(200)])
    datasets_dir(tmp_path / "k" / "sub" / "ds", [300])
    assert read(tmp_path / "k" / "**") == ([100, 200, 300], 3)


@pytest.mark.parametrize("link", ["alias", "zalias"])  # sorting before its target, and after it
def test_a_link_to_a_sibling_directory_reads_its_files_once_in_every_spelling(tmp_path, monkeypatch, link):
    """d and d/** read alias/b.jsonl and real/b.jsonl both, d/* and d/**/*.jsonl one of them or
    both depending on the link's name: other records and source indices for one tree."""
    monkeypatch.chdir(tmp_path)
    jsonl(tmp_path / "d" / "a.jsonl", [sample(100)])
    jsonl(tmp_path / "d" / "real" / "b.jsonl", [sample(200)])
    (tmp_path / "d" / link).symlink_to("real")
    first = f"{link}/b.jsonl" if link < "real" else "real/b.jsonl"  # the first place in path order
    for spelling in ("d", "d/*", "d/**", "d/**/*.jsonl"):
        files = discover_inputs([spelling])
        assert [os.path.relpath(f.path, "d") for f in files] == ["a.jsonl", first], spelling
    assert len(discover_inputs(["d/a.jsonl", "d/a.jsonl"])) == 2  # named twice: read twice, as asked


def test_a_hard_linked_copy_is_read_as_a_copy_is(tmp_path, monkeypatch):
    """Keyed by inode, a hard-linked copy (cp -al snapshots) was dropped where a plain copy was read."""
    monkeypatch.chdir(tmp_path)
    jsonl(tmp_path / "d" / "a.jsonl", [sample(100)])
    os.link(tmp_path / "d" / "a.jsonl", tmp_path / "d" / "b.jsonl")
    assert [os.path.basename(f.path) for f in discover_inputs(["d"])] == ["a.jsonl", "b.jsonl"]


def test_a_null_supervision_field_in_a_later_record_is_no_supervision(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6], "labels": None}])
    stream = SampleStream(discover_inputs([path]), SourceSpec())
    assert sum(int(batch.targets.sum()) for batch in stream) == 6 and stream.records == 2  # every token a target


@pytest.mark.parametrize("filler,policy", [(b"\n", "error"), (b"  \r\n", "error"), (b"{oops\n", "skip")])
def test_the_first_record_decides_the_supervision_wherever_it_is(tmp_path, filler, policy):
    """Only the first 10,000 lines (blank or malformed ones too) were searched for the first
    record: the mask after them was refused as a supervision field the first record lacked."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(filler * 10_000 + orjson.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + b"\n")
    stream = SampleStream(discover_inputs([str(path)]), SourceSpec(on_bad_record=policy))
    targets = np.concatenate([batch.targets for batch in stream])
    assert stream.supervision.kind == "mask" and targets.tolist() == [0, 1, 1]


@pytest.mark.parametrize("spelling", ["d", "d/*", "d/**", "d/**/*"])
def test_a_glob_matching_a_directory_keeps_sorted_path_order(tmp_path, spelling):
    # 'd/ab' sorts before 'd/ab-c.jsonl' ('-' < '/' only within a longer path): a glob put the
    # matched directory's files at the directory's place, and packing 'd' then verifying against
    # 'd/*' failed on the same data
    jsonl(tmp_path / "d" / "ab" / "x.jsonl", [sample(300)])
    jsonl(tmp_path / "d" / "ab-c.jsonl", [sample(100)])
    jsonl(tmp_path / "d" / "ab.jsonl", [sample(200)])
    files = discover_inputs([str(tmp_path / spelling)])
    assert [os.path.relpath(f.path, tmp_path / "d") for f in files] == ["ab-c.jsonl", "ab.jsonl", "ab/x.jsonl"]


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_the_first_record_decides_the_supervision_in_a_later_file(tmp_path, policy):
    """A first file of malformed lines alone decided 'every token is a target', and the next
    file's mask was refused, where the same lines in one file were read with their mask."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "00_bad.jsonl").write_bytes(b"{broken\n[1, 2]\n\n")
    jsonl(tmp_path / "in" / "01_good.jsonl", [sample(10), sample(20)])
    stream = SampleStream(discover_inputs([str(tmp_path / "in")]), SourceSpec(on_bad_record=policy))
    if policy == "error":
        with pytest.raises(DataError, match="00_bad.jsonl: line 1: malformed JSON"):
            list(stream)
        return
    targets = np.concatenate([batch.targets for batch in stream])
    assert stream.supervision.kind == "mask" and stream.records == 4 and targets.tolist() == [0, 1, 1, 1] * 2


def test_an_empty_first_record_decides_the_supervision(tmp_path):
    """The first record '{}' is an object without supervision (and a bad record, skipped here):
    it decides that every token is a target, so the next file's mask is an error, as it is with
    both records in one file. Having no fields, it was passed over as if the file held no record,
    the next file's record decided instead, and its mask was read."""
    (tmp_path / "a.jsonl").write_bytes(b"{}\n")
    jsonl(tmp_path / "b.jsonl", [sample(10)])
    stream = SampleStream(discover_inputs([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]),
                          SourceSpec(on_bad_record="skip"))
    with pytest.raises(DataError, match=r"b\.jsonl: line 1: field 'loss_mask' is a supervision field, but the first "
                                        "record of the input has none"):
        list(stream)
    assert stream.supervision.kind == "all"


@pytest.mark.parametrize("pattern", ["d/**/*.arrow", "d/ds/*.arrow", "d/ds/*", "d/ds/data-*"])
def test_a_glob_into_a_datasets_directory_is_refused(tmp_path, pattern):
    """A glob's matches inside a datasets directory were read as loose files: its cache files
    (same suffix, written by datasets' map) were packed as data, and verify --source agreed."""
    jsonl(tmp_path / "d" / "a.jsonl", [sample(100)])
    datasets_dir(tmp_path / "d" / "ds", [300])
    feather.write_feather(pa.Table.from_pylist([sample(900)]), str(tmp_path / "d" / "ds" / "cache-1a2b.arrow"))
    with pytest.raises(ConfigError, match=r"matches a path inside the Hugging Face datasets directory "
                                          r".*ds, which is read whole, through its state\.json"):
        discover_inputs([str(tmp_path / pattern)])
    assert read(tmp_path / "d") == ([100, 300], 2)  # the directory itself: through state.json, cache unread
    assert read(tmp_path / "d" / "*") == ([100, 300], 2)


@pytest.mark.parametrize("pattern", ["dd/*", "dd/t*", "dd/**/*.arrow", "dd/*/**", "dd/t*/**", "*/train/**"])
def test_a_glob_into_a_datasetdict_is_refused(tmp_path, pattern, monkeypatch):
    """'dd/*' read a DatasetDict's splits one after the other, mixed into one stream, where the
    directory 'dd' is refused ('pass one split'); 'dd/*/**' did so still (each split a directory
    the pattern read whole)."""
    datasets_dir(tmp_path / "dd" / "test", [100])
    datasets_dir(tmp_path / "dd" / "train", [200])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"inside the Hugging Face (DatasetDict .*dd, whose splits are not mixed"
                                          r"|datasets directory .*dd/te?s?t?)"):
        discover_inputs([pattern])
    assert read("dd/train") == read("dd/train/**") == read("dd/../dd/train/**") == ([200], 1)


def test_datasets_directories_a_glob_reads_whole_outside_a_datasetdict(tmp_path):
    datasets_dir(tmp_path / "p" / "a", [100])
    datasets_dir(tmp_path / "p" / "b", [200])
    assert read(tmp_path / "p" / "*" / "**") == read(tmp_path / "p") == ([100, 200], 2)


def test_a_glob_skips_unsupported_files_as_a_directory_walk_does(tmp_path):
    """'d' and 'd/**' skip a README; 'd/*' stopped on it with 'unknown file type'."""
    jsonl(tmp_path / "d" / "a.jsonl", [sample(100)])
    (tmp_path / "d" / "README.txt").write_text("notes")
    assert read(tmp_path / "d" / "*") == read(tmp_path / "d") == ([100], 1)
    with pytest.raises(DataError, match=r"\*\.txt: the pattern matches no supported input files"):
        discover_inputs([str(tmp_path / "d" / "*.txt")])


@pytest.mark.parametrize("name", ["d.jsonl", "b.parquet", "b.arrow", "b.stream.arrow"])
@pytest.mark.parametrize("policy", ["error", "skip"])
def test_a_bad_record_before_a_supervision_field_is_reported_first(tmp_path, name, policy):
    """The first record has no mask, the second is bad, the third has a mask. Stopping at the
    first problem means the second record's: the third one's was reported instead wherever the
    two shared a batch (JSON Lines, Arrow) or file (Parquet's mask column was read first)."""
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_bytes(b'{"input_ids": [1, 2, 3]}\n{"input_ids": [4, "x"]}\n'
                         b'{"input_ids": [4, 5, 6], "loss_mask": [0, 1, 1]}\n')
        bad, supervised = r'line 2: input_ids\[1\] = "x" is not an integer', "line 3: field 'loss_mask'"
    else:
        pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "a.parquet")  # the first record
        table = pa.table({"input_ids": pa.array([None, [4, 5, 6]]),
                          "loss_mask": pa.array([None, [0, 1, 1]], pa.list_(pa.int8()))})
        _columnar(path, table)
        if name.endswith(".arrow"):  # one batch: the old check looked at a whole batch before any row of it
            with (pa.ipc.new_stream if "stream" in name else pa.ipc.new_file)(str(path), table.schema) as writer:
                writer.write_table(table)
        bad, supervised = r"row 0: field 'input_ids' is null", "row 1: column 'loss_mask'"
    expected = bad if policy == "error" else rf"{supervised} is a supervision field"
    inputs = [path] if name.endswith(".jsonl") else [tmp_path / "a.parquet", path]
    with pytest.raises(DataError, match=rf"{re.escape(name)}: {expected}"):
        read(*inputs, spec=SourceSpec(on_bad_record=policy))


def test_a_relative_glob_is_judged_by_where_its_matches_lie(tmp_path, monkeypatch):
    """'../plain/*.jsonl' run inside a datasets directory was refused (its text has no directory
    part, so '.' was taken for the match's), and '*.arrow' run in a directory below one was read."""
    jsonl(tmp_path / "plain" / "a.jsonl", [sample(100)])
    datasets_dir(tmp_path / "ds", [300])
    (tmp_path / "ds" / "sub").mkdir()
    feather.write_feather(pa.Table.from_pylist([sample(900)]), str(tmp_path / "ds" / "sub" / "cache-1.arrow"))
    monkeypatch.chdir(tmp_path / "ds")
    assert read("../plain/*.jsonl") == ([100], 1)
    monkeypatch.chdir(tmp_path / "ds" / "sub")
    assert read("../../plain/*") == ([100], 1)
    with pytest.raises(ConfigError, match=r"cache-1\.arrow: '\*\.arrow' matches a path inside the Hugging Face "
                                          r"datasets directory \.\., which is read whole"):
        discover_inputs(["*.arrow"])


def test_a_glob_through_a_symbolic_link_is_judged_by_where_it_leads(tmp_path, monkeypatch):
    """A link to a directory inside a datasets directory read its files ('link/*'), while the same
    pattern run from inside the link was refused; a link out of one was refused the other way."""
    datasets_dir(tmp_path / "ds", [300])
    jsonl(tmp_path / "ds" / "extra" / "a.jsonl", [sample(100)])
    jsonl(tmp_path / "plain" / "b.jsonl", [sample(200)])
    (tmp_path / "into").symlink_to(tmp_path / "ds" / "extra")
    (tmp_path / "ds" / "out").symlink_to(tmp_path / "plain")
    monkeypatch.chdir(tmp_path)
    for pattern, cwd in (("into/*.jsonl", tmp_path), ("*.jsonl", tmp_path / "into")):
        monkeypatch.chdir(cwd)
        with pytest.raises(ConfigError, match="inside the Hugging Face datasets directory"):
            discover_inputs([pattern])
    for pattern, cwd in (("ds/out/*.jsonl", tmp_path), ("*.jsonl", tmp_path / "ds" / "out")):
        monkeypatch.chdir(cwd)
        assert read(pattern) == ([200], 1)


def test_a_glob_may_match_links_into_a_datasetdict_or_to_a_data_file(tmp_path):
    """A link to one split of a DatasetDict, or to a data file, is read as a directory's walk reads
    it: the glob was refused once the match itself was resolved to where it leads."""
    datasets_dir(tmp_path / "dd" / "train", [200])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / "train").symlink_to(tmp_path / "dd" / "train")
    assert read(tmp_path / "inputs" / "*") == read(tmp_path / "inputs") == ([200], 1)
    jsonl(tmp_path / "ds_files" / "a.jsonl", [sample(100)])
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "a.jsonl").symlink_to(tmp_path / "ds_files" / "a.jsonl")
    datasets_dir(tmp_path / "ds", [300])
    (tmp_path / "more" / "b.arrow").symlink_to(tmp_path / "ds" / "data-00000-of-00001.arrow")
    assert read(tmp_path / "more" / "*") == read(tmp_path / "more") == ([100, 300], 2)


def test_nothing_inside_a_datasets_directory_is_read_loosely_however_it_is_named(tmp_path, monkeypatch):
    """'ds/extra' (a directory inside a datasets directory), a link to it, '.' from inside it and
    '**' were read while 'ds/extra/*' was refused; '**' run inside the datasets directory itself
    was refused while '.' read it."""
    datasets_dir(tmp_path / "ds", [300])
    jsonl(tmp_path / "ds" / "extra" / "a.jsonl", [sample(100)])
    (tmp_path / "lx").symlink_to(tmp_path / "ds" / "extra")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "lx").symlink_to(tmp_path / "ds" / "extra")  # found in a directory's walk
    for name in ("ds/extra", "ds/extra/*", "ds/extra/**", "lx", "lx/*", "lx/**", "d", "d/*", "d/**"):
        with pytest.raises(ConfigError, match="inside the Hugging Face datasets directory"):
            discover_inputs([name])
    monkeypatch.chdir(tmp_path / "ds" / "extra")
    for name in (".", "*", "**"):
        with pytest.raises(ConfigError, match=r"inside the Hugging Face datasets directory \.\."):
            discover_inputs([name])
    monkeypatch.chdir(tmp_path / "ds")
    assert read(".") == read("**") == ([300], 1)


def test_a_glob_with_dotdot_after_a_link_reads_where_the_link_leads(tmp_path, monkeypatch):
    """'lp/../*.jsonl' was collapsed as text to './*.jsonl': another file of the same name was
    read, and a plain 'lp/../p.jsonl' was recorded under that other file's path."""
    jsonl(tmp_path / "plain" / "p.jsonl", [sample(100)])
    (tmp_path / "plain" / "sub").mkdir()
    jsonl(tmp_path / "p.jsonl", [sample(900)])
    (tmp_path / "lp").symlink_to(tmp_path / "plain" / "sub")
    monkeypatch.chdir(tmp_path)
    assert read("lp/../*.jsonl") == read("lp/../p.jsonl") == ([100], 1)
    summary = pack(["lp/../p.jsonl"], str(tmp_path / "out"), PackSpec(pack_size=64))
    assert summary.source["inputs"][0]["path"] == str((tmp_path / "plain" / "p.jsonl").resolve())


def test_a_directory_a_pattern_names_whole_reads_as_the_directory_does(tmp_path, monkeypatch):
    """'dd/train/**' (a DatasetDict's split), 'ds/out/**' (a link out of a datasets directory)
    and '**' run inside a split were refused where the directory itself was read."""
    datasets_dir(tmp_path / "dd" / "train", [200])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    datasets_dir(tmp_path / "ds", [300])
    jsonl(tmp_path / "plain" / "b.jsonl", [sample(100)])
    (tmp_path / "ds" / "out").symlink_to(tmp_path / "plain")
    monkeypatch.chdir(tmp_path)
    assert read("dd/train") == read("dd/train/**") == ([200], 1)
    assert read("ds/out") == read("ds/out/**") == read("ds/o[u]t") == read("ds/out/*") == ([100], 1)
    monkeypatch.chdir(tmp_path / "dd" / "train")
    assert read(".") == read("**") == ([200], 1)


@pytest.mark.parametrize("pattern", ["e/*/../x.jsonl", "e/**/../x.jsonl"])
def test_a_glob_reads_each_file_once_whatever_its_spellings(tmp_path, pattern):
    """With '..' kept in matches, 'e/a/../x.jsonl' and 'e/b/../x.jsonl' were one file read twice."""
    jsonl(tmp_path / "e" / "x.jsonl", [sample(100)])
    (tmp_path / "e" / "a").mkdir()
    (tmp_path / "e" / "b").mkdir()
    assert read(tmp_path / pattern) == read(tmp_path / "e") == ([100], 1)


def test_a_double_star_does_not_walk_inside_a_datasets_directory(tmp_path):
    """'d/**/*' descended into a datasets directory and met a link loop there, which 'd' never looks at."""
    jsonl(tmp_path / "d" / "a.jsonl", [sample(100)])
    datasets_dir(tmp_path / "d" / "ds", [300])
    (tmp_path / "d" / "ds" / "extra").mkdir()
    (tmp_path / "d" / "ds" / "extra" / "up").symlink_to(tmp_path / "d" / "ds")
    assert read(tmp_path / "d" / "**" / "*") == read(tmp_path / "d") == ([100, 300], 2)

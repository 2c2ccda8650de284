"""`packer pack` from the command line: exit codes, one-line errors, nothing half-written."""
from __future__ import annotations

import json
import re
import shutil
import os
import subprocess
import sys

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from packer_cli.cli import app

runner = CliRunner()
GOOD = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def write_jsonl(path, records, raw_line3: str | None = None):
    lines = [orjson.dumps(r).decode() for r in records]
    if raw_line3 is not None:
        lines.insert(2, raw_line3)
    path.write_text("\n".join(lines) + "\n")
    return path


def assert_nothing_written(parent):
    leftovers = [p.name for p in parent.iterdir() if p.name.startswith("out")]
    assert leftovers == [], f"half-written output left behind: {leftovers}"


BAD_LINES = [
    # the parser's own place is within the record (it said "line 2 column 1" of a record on line 3)
    ('{"input_ids": [1, 2,', "line 3: malformed JSON: unexpected end of data at character 21 of the record"),
    ('{"input_ids": [1 2]}', "line 3: malformed JSON: unexpected character"),  # orjson versions word the rest apart
    ('[1, 2, 3]', "line 3: malformed JSON: the record is not a JSON object"),
    ('{"loss_mask": [0, 1]}', "line 3: missing field 'input_ids'"),
    ('{"input_ids": [1, 2.5, 3], "loss_mask": [0, 1, 1]}', "line 3: input_ids[1] = 2.5 is not an integer"),
    ('{"input_ids": [1, "a"], "loss_mask": [0, 1]}', 'line 3: input_ids[1] = "a" is not an integer'),
    ('{"input_ids": [1, -4, 3], "loss_mask": [0, 1, 1]}', "line 3: input_ids[1] = -4 is negative"),
    ('{"input_ids": 7, "loss_mask": [0, 1, 1]}', "line 3: field 'input_ids' is not a list"),
    ('{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}', "line 3: loss_mask has 2 values but input_ids has 3"),
    ('{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 2]}', "line 3: loss_mask[2] = 2 is not 0 or 1"),
    ('{"input_ids": [1, 2, 3], "loss_mask": [false, true, "yes"]}', 'line 3: loss_mask[2] = "yes" is not an integer'),
    ('{"input_ids": [1, true, 3], "loss_mask": [0, 1, 1]}', "line 3: input_ids[1] = true is not an integer"),
    # null as the columnar path says it, whether or not another bad record shares its batch
    ('{"input_ids": [1, null, 3], "loss_mask": [0, 1, 1]}', "line 3: input_ids[1] is null"),
    ('{"input_ids": [1, 1e400, 3], "loss_mask": [0, 1, 1]}', "line 3: input_ids[1] = inf is not an integer"),
    ('{"input_ids": [1, 2, 3]}', "line 3: missing field 'loss_mask'"),
    ('{"input_ids": [1, 2, 40000], "loss_mask": [0, 1, 1]}', "line 3: input_ids[2] = 40000 is >= vocab size 32000"),
]


@pytest.mark.parametrize("line,message", BAD_LINES)
def test_bad_jsonl_record_is_one_line_error(tmp_path, line, message):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 4, raw_line3=line)
    result = run("pack", path, "-o", tmp_path / "out", "--vocab-size", 32000)
    assert result.exit_code == 1, result.output
    assert f"data.jsonl: {message}" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert_nothing_written(tmp_path)


def test_a_malformed_records_place_is_given_within_the_record(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 4, raw_line3='{"input_ids": [1 2]}')
    result = run("pack", path, "-o", tmp_path / "out")
    assert result.exit_code == 1 and result.output.strip().endswith(" at character 17 of the record"), result.output
    assert "column" not in result.output


def test_a_bad_records_reason_quotes_a_long_value_shortened(tmp_path):
    """A reason quoted the offending value whole: a 4 MB string in one record made a 4 MB error
    line, and under skip a 4 MB entry in metadata.json."""
    long_value = "x" * (4 << 20)
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 4, raw_line3=orjson.dumps({"input_ids": [1, long_value], "loss_mask": [0, 1]}).decode())
    result = run("pack", path, "-o", tmp_path / "out")
    assert result.exit_code == 1 and len(result.output) < 300, result.output[:300]
    assert 'line 3: input_ids[1] = "xxxxxxxx' in result.output and "(4,194,306 characters) is not an integer" in result.output
    result = run("pack", path, "-o", tmp_path / "out", "--on-bad-record", "skip")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "metadata.json").stat().st_size < 10_000


@pytest.mark.parametrize("width, whole", [(58, True), (59, False)])
def test_a_quoted_value_of_60_characters_is_whole_and_one_more_is_cut(tmp_path, width, whole):
    value = "x" * width  # quoted: width + 2 characters
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 2, raw_line3=orjson.dumps({"input_ids": [1, value], "loss_mask": [0, 1]}).decode())
    result = run("pack", path, "-o", tmp_path / "out")
    assert result.exit_code == 1
    quoted = f'input_ids[1] = "{value}" is not an integer'
    assert (quoted in result.output) == whole, result.output
    assert ("(61 characters) is not an integer" in result.output) == (not whole), result.output


def test_skip_bad_records_counts_and_lists_them(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 4, raw_line3='{"input_ids": [1, -4]}')
    result = run("pack", path, "-o", tmp_path / "out", "--on-bad-record", "skip", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["counts"]["bad_records"] == 1 and summary["counts"]["samples_packed"] == 4
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["bad_records"][0]["line"] == 3 and meta["bad_records"][0]["row"] == 2


def test_a_bad_record_of_a_datasets_directory_names_its_data_file_and_row_there(tmp_path):
    """FORMAT.md: a datasets directory's bad record names the data file holding it, its row
    counted in that file; its source index is that row plus the records of the files before."""
    datasets = pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")
    import pyarrow as pa

    ids = [[5, 6, 7, k] for k in range(300)]
    ids[150] = None  # the second data file's first row, with two shards of 150
    directory = tmp_path / "hf"
    datasets.Dataset(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))})).save_to_disk(str(directory),
                                                                                             num_shards=2)
    out = tmp_path / "out"
    assert run("pack", directory, "-o", out, "--on-bad-record", "skip").exit_code == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert [i["path"] for i in meta["source"]["inputs"]] == [str(directory)]
    (bad,) = meta["bad_records"]
    assert (bad["path"], bad["row"], bad["line"]) == (str(directory / "data-00001-of-00002.arrow"), 0, None)
    with pa.memory_map(str(directory / "data-00000-of-00002.arrow")) as source:
        first_file_rows = pa.ipc.open_stream(source).read_all().num_rows
    assert first_file_rows + bad["row"] == 150  # the documented rule gives the record's source index
    assert run("verify", out, "--source", directory).exit_code == 0


def test_bad_records_name_their_file_as_the_inputs_do(tmp_path, monkeypatch):
    """They were named as typed: 'data/a.jsonl' beside source.inputs' absolute path, and the
    same input packed from data/ recorded 'a.jsonl' (other metadata bytes for the same data)."""
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", [GOOD] * 4, raw_line3='{"input_ids": [1, -4]}')
    recorded = []
    for where, arg in ((tmp_path, "data/a.jsonl"), (tmp_path / "data", "a.jsonl")):
        monkeypatch.chdir(where)
        out = tmp_path / f"out{len(recorded)}"
        assert run("pack", arg, "-o", out, "--on-bad-record", "skip").exit_code == 0
        meta = json.loads((out / "metadata.json").read_text())
        assert [b["path"] for b in meta["bad_records"]] == [i["path"] for i in meta["source"]["inputs"]]
        recorded.append(meta["bad_records"])
    assert recorded[0] == recorded[1] == [{"path": str(tmp_path / "data" / "a.jsonl"), "row": 2, "line": 3,
                                           "reason": "missing field 'loss_mask'"}]


def test_bad_parquet_rows_name_the_row(tmp_path):
    table = pa.table({"input_ids": [[1, 2, 3]] * 5 + [[1, -2, 3]], "loss_mask": [[0, 1, 1]] * 6})
    pq.write_table(table, tmp_path / "d.parquet")
    result = run("pack", tmp_path / "d.parquet", "-o", tmp_path / "out")
    assert result.exit_code == 1 and "d.parquet: row 5: input_ids[1] = -2 is negative" in result.output
    float_table = pa.table({"input_ids": [[1.0, 2.0]], "loss_mask": [[0, 1]]})
    pq.write_table(float_table, tmp_path / "f.parquet")
    result = run("pack", tmp_path / "f.parquet", "-o", tmp_path / "out")
    assert result.exit_code == 1 and "f.parquet: row 0: field 'input_ids' holds double values" in result.output
    assert_nothing_written(tmp_path)


def test_empty_unreadable_and_unknown_inputs(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    result = run("pack", tmp_path / "empty.jsonl", "-o", tmp_path / "out")
    assert result.exit_code == 1 and "empty.jsonl: empty input" in result.output
    (tmp_path / "junk.parquet").write_bytes(b"this is not parquet at all")
    result = run("pack", tmp_path / "junk.parquet", "-o", tmp_path / "out")
    assert result.exit_code == 1 and "junk.parquet: cannot read as Parquet" in result.output
    (tmp_path / "x.txt").write_text("hello")
    result = run("pack", tmp_path / "x.txt", "-o", tmp_path / "out")
    assert result.exit_code == 1 and "x.txt: unknown file type" in result.output
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("args,message", [
    (["--cp", "2", "--pack-size", "4094"], "pack-size 4094 must be divisible by 2*CP = 4"),
    (["--cp", "2", "--tp", "4", "--sp", "--pad-seq-to-mult", "12"], "must be a positive multiple of 8"),
    (["--pad-cu-seqlens"], "--pad-cu-seqlens requires --pad-to-max-length"),
    (["--pack-size", "0"], "pack-size must be a positive integer"),
    (["--cp", "8", "--pack-size", "10"], "must be divisible by 2*CP = 16 with context parallelism; use --pack-size 16\n"),
    (["--pack-size", "99999999999"], "pack-size 99,999,999,999 is above the largest supported, 16,777,216 tokens"),
    # no pack size divides by such layouts (a TP of 2**64 failed once the run was done, writing its metadata)
    (["--tp", str(2**64)], "tp 18,446,744,073,709,551,616 is above the largest supported, 16,777,216"),
    (["--cp", "9000000", "--pack-size", "16777216"], "cp 9,000,000 is above the largest supported, 8,388,608"),
])
def test_bad_options_exit_2(tmp_path, args, message):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD])
    result = run("pack", path, "-o", tmp_path / "out", *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("env,value,fmt", [("PACKER_PARQUET_DECODER", "pyarrow", "native"),
                                           ("PACKER_PARQUET_ENCODER", "arow", "megatron-bridge")])
def test_a_misspelt_switch_variable_is_an_error(tmp_path, monkeypatch, env, value, fmt):
    """A value the switch does not know was ignored: the run went ahead with the other coder."""
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7]] * 4, "loss_mask": [[0, 1, 1]] * 4}), path)
    monkeypatch.setenv(env, value)
    result = run("pack", path, "-o", tmp_path / "out", "--format", fmt, "--pack-size", 16)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {env}='{value}': expected 'packer' or 'arrow' (or unset)"
    assert_nothing_written(tmp_path)
    # checked as the run starts, whatever it reads or writes (a JSONL input, a dry run, native shards)
    jsonl = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 4)
    for args in (["--dry-run"], ["--format", "native"], ["--format", "megatron-bridge"]):
        result = run("pack", jsonl, "-o", tmp_path / "out", *args)
        assert result.exit_code == 2 and f"{env}='{value}'" in result.output, result.output
    assert_nothing_written(tmp_path)
    monkeypatch.setenv(env, " Arrow ")  # any case, spaces around: still the switch
    assert run("pack", path, "-o", tmp_path / "out", "--format", fmt, "--pack-size", 16).exit_code == 0


@pytest.mark.parametrize("args,message", [
    (["pack", "DATA", "--pack-size", "abc"], "Invalid value for '--pack-size' / '-C'"),
    (["pack", "DATA", "--pack-size", "4.5"], "Invalid value for '--pack-size' / '-C'"),
    (["pack", "DATA", "--overlong", "xx"], "Invalid value for '--overlong'"),
    (["pack", "DATA", "--shard-size", "abc"], "--shard-size: not a size: 'abc'"),
    (["pack", "DATA", "--spill-memory", "xyz"], "--spill-memory: not a size: 'xyz'"),
    (["pack"], "Missing argument 'inputs"),  # typer 0.28 spells it 'INPUTS...'
    (["inspect"], "Missing argument 'out'"),
    (["bogus"], "No such command 'bogus'"),
    # click raises these two without a context: still the subcommand's help
    (["verify", "OUT", "--limit"], "Option '--limit' requires an argument"),
    (["inspect", "OUT", "--json=1"], "Option '--json' does not take a value"),
], ids=["int", "float", "choice", "shard-size", "spill-memory", "no-input", "no-out", "command", "no-value",
        "flag-value"])
def test_bad_command_lines_are_one_line_errors(tmp_path, args, message):
    """The console script reports what typer rejects as one line (typer's own boxed panel is
    for the screen, not for a pipeline's log), exit 2."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD])
    argv = [str(path) if a == "DATA" else str(tmp_path) if a == "OUT" else a for a in args]
    argv += ["-o", str(tmp_path / "out")] * (args[0] == "pack")
    script = "import sys; sys.argv[0] = 'packer'; from packer_cli._entry import main; main()"
    child = subprocess.run([sys.executable, "-c", script, *argv],
                           capture_output=True, text=True, timeout=60)
    lines = child.stderr.strip().splitlines()
    assert child.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), child.stderr
    assert message.lower() in lines[0].lower(), lines[0]
    if "not a size" not in message:  # typer's own checks point at the command's help
        assert lines[0].endswith(f"(see 'packer {args[0] if args[0] != 'bogus' else ''}".rstrip() + " --help')"), lines[0]
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("raised", [
    'ImportError("libarrow.so.2600: failed to map segment from shared object")',
    "MemoryError()",
])
def test_running_out_of_memory_while_loading_is_one_line_exit_3(tmp_path, raised):
    """Under ``ulimit -v`` a command's imports can fail for memory (pyarrow's libraries could not be
    mapped): one line, exit 3, as memory failing later is, not a traceback."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD])
    script = ("import sys; sys.argv[0] = 'packer'\n"
              "class Refuse:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              f"        if name == 'packer_cli.pipeline': raise {raised}\n"
              "sys.meta_path.insert(0, Refuse())\n"
              "from packer_cli._entry import main; main()")
    child = subprocess.run([sys.executable, "-c", script, "pack", str(path), "-o", str(tmp_path / "out")],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 3, child.stderr
    assert child.stderr.startswith("error: out of memory loading packer's libraries: ") and \
        child.stderr.count("\n") == 1, child.stderr
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("lines,args,message", [
    (['{bad', '{"input_ids": [1]}'], ["--on-bad-record", "skip"],
     "no samples left to pack: of 2 records, 1 bad (skipped), 1 shorter than 2 tokens; "
     "the first bad one: DATA: line 1: malformed JSON"),
    (['{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}'], ["--pack-size", "4", "--overlong", "drop"],
     "no samples left to pack: of 1 record, 1 over-long (dropped)"),
], ids=["all-bad-or-short", "all-dropped"])
def test_nothing_left_to_pack_says_why(tmp_path, monkeypatch, lines, args, message):
    """The input named as typed, the first bad record's file too (not once as typed and once
    as the absolute path the metadata records)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    result = run("pack", "data.jsonl", "-o", "out", *args)
    assert result.exit_code == 1, result.output
    assert "error: data.jsonl: " + message.replace("DATA", "data.jsonl") in result.output, result.output
    assert_nothing_written(tmp_path)


def test_existing_out_needs_overwrite(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    assert run("pack", path, "-o", tmp_path / "out").exit_code == 0
    result = run("pack", path, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "already exists; pass --overwrite" in result.output
    assert run("pack", path, "-o", tmp_path / "out", "--overwrite", "--pack-size", "8").exit_code == 0
    assert json.loads((tmp_path / "out" / "metadata.json").read_text())["spec"]["pack_size"] == 8


def test_overwrite_replaces_only_a_packer_output(tmp_path):
    """--overwrite deletes the old OUT: never a directory packer did not write, never the inputs."""
    data = tmp_path / "data"
    data.mkdir()
    path = write_jsonl(data / "data.jsonl", [GOOD] * 3)
    (data / "notes.txt").write_text("keep me")
    result = run("pack", path, "-o", data, "--overwrite")  # -o mistyped as the data directory
    assert result.exit_code == 2, result.output
    assert "holds files packer did not write (data.jsonl and 1 more); --overwrite replaces only a packer output" \
        in result.output
    assert sorted(p.name for p in data.iterdir()) == ["data.jsonl", "notes.txt"]
    assert not list(tmp_path.glob("data.*"))  # no temporary sibling either

    out = tmp_path / "out"
    assert run("pack", path, "-o", out).exit_code == 0
    (out / "extra.txt").write_text("not packer's")
    result = run("pack", path, "-o", out, "--overwrite")
    assert result.exit_code == 2 and "holds files packer did not write (extra.txt)" in result.output
    assert (out / "extra.txt").exists() and (out / "metadata.json").exists()


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
@pytest.mark.parametrize("files, foreign", [
    ({"metadata.json": '{"experiment": "run-42"}'}, "metadata.json"),
    ({"metadata.json": '{"run": "exp1", "loss": NaN}'}, "metadata.json"),  # Python's json.dump writes NaN
    ({"metadata.json": '\ufeff{"run": "exp1"}'}, "metadata.json"),  # a byte-order mark
    ({"manifest.json": '[1, 2]', "packs-00000.arrow": "junk"}, "manifest.json and 1 more"),
    ({"training.metadata.json": '{"format": "mine"}'}, "training.metadata.json"),
    ({"metadata.json": '{"format": "packer-thd"}', "manifest.json": '"a string"'}, "manifest.json"),
])
def test_overwrite_never_replaces_a_user_s_json_under_one_of_packer_s_names(tmp_path, fmt, files, foreign):
    """A directory whose only file was the user's own metadata.json was judged packer's output by
    its name: 'already exists; pass --overwrite', then --overwrite deleted it. JSON other tools
    write that does not parse as JSON (NaN, a byte-order mark) is not packer's damage either."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    out = tmp_path / "results"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    result = run("pack", path, "-o", out, "--format", fmt)
    assert result.exit_code == 2 and "--overwrite" not in result.output, result.output
    assert f"holds files packer did not write ({foreign})" in result.output, result.output
    result = run("pack", path, "-o", out, "--format", fmt, "--overwrite")
    assert result.exit_code == 2, result.output
    assert f"holds files packer did not write ({foreign}); --overwrite replaces only a packer output" \
        in result.output
    assert {p.name: p.read_text() for p in out.iterdir()} == files
    assert not list(tmp_path.glob("results.*"))


def test_a_user_s_arrow_file_under_a_shard_name_is_not_packer_s(tmp_path):
    """A readable Arrow file of the user's own schema named packs-00001.arrow in a packer output
    counted as a damaged shard, vouched for by the output's metadata: --overwrite deleted it."""
    import pyarrow as pa

    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 6)
    out = tmp_path / "out"
    assert run("pack", path, "-o", out).exit_code == 0
    table = pa.table({"text": ["my own data"]})
    with pa.ipc.new_file(str(out / "packs-00001.arrow"), table.schema) as writer:
        writer.write_table(table)
    result = run("pack", path, "-o", out, "--overwrite")
    assert result.exit_code == 2 and "holds files packer did not write (packs-00001.arrow)" in result.output
    assert pa.ipc.open_file(str(out / "packs-00001.arrow")).read_all() == table


def test_a_user_s_unparsed_json_in_a_bridge_layout_is_not_its_damage(tmp_path):
    """A user's metadata.json holding NaN inside a Bridge layout counted as damage vouched for by
    the layout's files: --overwrite of the validation split deleted it and the training split.
    Only a file of the same kind of output vouches for one that does not parse."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 6)
    out = tmp_path / "out"
    assert run("pack", path, "-o", out, "--format", "megatron-bridge").exit_code == 0
    (out / "metadata.json").write_text('{"dataset": "mine", "loss": NaN}')
    listing = {p.name: p.read_bytes() for p in out.iterdir()}
    for overwrite in ([], ["--overwrite"]):
        result = run("pack", path, "-o", out, "--format", "megatron-bridge", "--split", "validation", *overwrite)
        assert result.exit_code == 2 and "holds files packer did not write (metadata.json)" in result.output
        assert {p.name: p.read_bytes() for p in out.iterdir()} == listing


def test_a_large_json_file_is_judged_by_the_head_packer_writes(tmp_path, monkeypatch):
    """A user's 269 MB metadata.json was parsed whole to refuse its directory (3.7 GB, 17 s);
    past a size the file's first bytes are read for the format key packer writes near its top."""
    from packer_cli.shards import bridge_output

    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 6)
    out = tmp_path / "out"
    assert run("pack", path, "-o", out).exit_code == 0
    text = (out / "metadata.json").read_text()
    head = text.index('"format"') + 32
    assert len(text) > head
    monkeypatch.setattr(bridge_output, "_PARSED_JSON", head)
    assert run("pack", path, "-o", out, "--overwrite").exit_code == 0  # packer's own, judged by its head
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "metadata.json").write_text(json.dumps({"format": "packer-thd", "rows": list(range(200))}))
    result = run("pack", path, "-o", theirs, "--overwrite")  # the key, but not as packer lays it out
    assert result.exit_code == 2 and "holds files packer did not write (metadata.json)" in result.output


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_overwrite_replaces_a_packer_output_whose_json_files_are_damaged(tmp_path, fmt):
    """Damage is not another tool's file: a manifest cut short and a metadata file that is not
    JSON leave the output packer's, for --overwrite to replace, where another file shows it is
    packer's (a shard naming packer's format; Bridge's metadata array)."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 6)
    out = tmp_path / "out"
    assert run("pack", path, "-o", out, "--format", fmt).exit_code == 0
    for damaged in sorted(out.glob("*.json")):
        damaged.write_bytes(damaged.read_bytes()[: 20] if "manifest" in damaged.name else b"\x00garbage")
    assert run("verify", out).exit_code == 1
    result = run("pack", path, "-o", out, "--format", fmt, "--overwrite")
    assert result.exit_code == 0, result.output
    assert run("verify", out).exit_code == 0
    # nothing left to show it: the files that do not parse may be anyone's
    for damaged in sorted(out.glob("*.json*")) + sorted(out.glob("*.arrow")) + sorted(out.glob("*.parquet")):
        damaged.write_bytes(b"\x00garbage")
    listing = {p.name: p.read_bytes() for p in out.iterdir()}
    result = run("pack", path, "-o", out, "--format", fmt, "--overwrite")
    assert result.exit_code == 2 and "holds files packer did not write" in result.output, result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == listing


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
@pytest.mark.parametrize("at_start", ["absent", "a packer output"])
def test_overwrite_judges_out_again_as_it_replaces_it(tmp_path, monkeypatch, fmt, at_start):
    """OUT checked when the run started, a user's file put into it while the run packed: the
    file was deleted with the old OUT (exit 0)."""
    from packer_cli.shards import _atomic

    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    out = tmp_path / "out"
    if at_start != "absent":
        assert run("pack", path, "-o", out).exit_code == 0
    real_replace_dir = _atomic.replace_dir

    def meanwhile(tmp, target, *args, **kwargs):  # what another process did while this run packed
        os.makedirs(target, exist_ok=True)
        (out / "notes.txt").write_text("precious")
        return real_replace_dir(tmp, target, *args, **kwargs)

    for module in ("packer_cli.pipeline", "packer_cli.shards.bridge_output"):
        monkeypatch.setattr(f"{module}.replace_dir", meanwhile)
    if fmt == "megatron-bridge" and at_start == "absent":  # its commit renames onto an absent OUT itself
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            if os.fspath(dst) == str(out) and ".tmp-" in os.fspath(src) and not out.exists():
                out.mkdir()
                (out / "notes.txt").write_text("precious")
            return real_rename(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "rename", rename)
    result = run("pack", path, "-o", out, "--overwrite", "--format", fmt)
    assert result.exit_code == 2, result.output
    assert "out holds files packer did not write (notes.txt)" in result.output, result.output
    assert (out / "notes.txt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_overwrite_keeps_a_file_that_took_outs_place(tmp_path, monkeypatch, fmt):
    """OUT replaced by a user's file while the run packed: exit 3, 'Not a directory', naming the
    temporary OUT.old-* path (the file was put back)."""
    from packer_cli.shards import _atomic, bridge_output

    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    out = tmp_path / "out"
    assert run("pack", path, "-o", out, "--format", fmt).exit_code == 0

    def a_file_in_outs_place():
        if out.is_dir():
            shutil.rmtree(out)
            out.write_text("precious")

    def before(real):
        def hooked(*args, **kwargs):
            a_file_in_outs_place()
            return real(*args, **kwargs)
        return hooked

    # native: as OUT is replaced; Bridge: as the split takes the lock to join its layout
    monkeypatch.setattr("packer_cli.pipeline.replace_dir", before(_atomic.replace_dir))
    monkeypatch.setattr(bridge_output, "locked", before(bridge_output.locked))
    result = run("pack", path, "-o", out, "--overwrite", "--format", fmt)
    assert result.exit_code == 2, result.output
    assert f"{out} exists and is not a directory (it appeared while this run was packing" in result.output
    assert out.read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


def test_overwrite_wins_over_an_out_that_appears_as_it_renames(tmp_path, monkeypatch):
    """Two --overwrite runs to an absent OUT: the other run's output appeared in the moment this
    one renamed its own into place; it exited 3 ("Directory not empty"). The last one wins."""
    from packer_cli.shards import _atomic

    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    out = tmp_path / "out"
    real_rename = os.rename
    appeared = []

    def rename(src, dst, *args, **kwargs):
        if os.fspath(dst) == str(out) and ".tmp-" in os.fspath(src) and not appeared:
            appeared.append(True)
            assert run("pack", path, "-o", out, "--pack-size", 8).exit_code == 0  # the other run
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(_atomic.os, "rename", rename)
    result = run("pack", path, "-o", out, "--overwrite", "--pack-size", 16, "--json")
    assert result.exit_code == 0 and appeared, result.output
    assert json.loads((out / "metadata.json").read_text())["spec"]["pack_size"] == 16
    assert [p.name for p in tmp_path.iterdir() if p.name != "data.jsonl"] == ["out"]


def test_a_mount_point_out_is_refused_before_the_run(tmp_path, monkeypatch):
    """A volume mounted at OUT: the whole run, then EXDEV or EBUSY renaming into place (exit 3)."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    out = tmp_path / "out"
    out.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == str(out) or real_ismount(p))
    for args in (["--overwrite"], ["--format", "megatron-bridge"], ["--overwrite", "--dry-run"]):
        result = run("pack", path, "-o", out, *args)
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"error: {out} is a mount point: the output is built beside OUT"), result.output
    assert [p.name for p in tmp_path.iterdir()] == ["data.jsonl", "out"] and not any(out.iterdir())


def test_an_old_out_a_killed_run_moved_aside_is_named(tmp_path):
    """Killed between its two renames, a run leaves the old OUT as OUT.old-PID-RANDOM: later
    runs said nothing of it (only of OUT.tmp-…)."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    old = tmp_path / "out.old-99999999-abcd1234"
    old.mkdir()
    result = run("pack", path, "-o", tmp_path / "out")
    assert result.exit_code == 0
    assert f"{tmp_path / 'out'} was missing as this run started and {old} is most likely what it was" in result.output
    result = run("pack", path, "-o", tmp_path / "out", "--overwrite")
    assert result.exit_code == 0
    assert f"{old} holds an output an earlier run moved aside to replace it and did not delete" in result.output


@pytest.mark.parametrize("first,second", [("native", "megatron-bridge"), ("megatron-bridge", "native")])
def test_overwrite_replaces_packer_output_of_either_format(tmp_path, first, second):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 6)
    out = tmp_path / "out"
    assert run("pack", path, "-o", out, "--format", first).exit_code == 0
    result = run("pack", path, "-o", out, "--format", second, "--overwrite")
    assert result.exit_code == 0, result.output
    assert (out / "metadata.json").exists() == (second == "native")
    assert run("verify", out).exit_code == 0


def test_overwrite_refuses_an_out_holding_an_input(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    out = tmp_path / "out"
    assert run("pack", path, "-o", out).exit_code == 0
    shard = out / "packs-00000.arrow"  # packer's own shard, read back as an Arrow input
    result = run("pack", shard, "-o", out, "--overwrite")
    assert result.exit_code == 2 and "this input lies inside" in result.output, result.output
    assert shard.exists()


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_an_out_that_is_a_symbolic_link_is_built_where_it_points(tmp_path, fmt):
    """OUT a link to an earlier output: --overwrite replaces the directory it points to and the
    link stays (nothing renamed aside is left); a dangling link gets its output where it
    points; a link loop is a one-line error before anything is read."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 6)
    real, link = tmp_path / "real", tmp_path / "link"
    assert run("pack", path, "-o", real, "--format", fmt, "--pack-size", "8").exit_code == 0
    link.symlink_to("real")
    assert run("pack", path, "-o", link, "--format", fmt).exit_code == 2  # exists: --overwrite needed
    result = run("pack", path, "-o", link, "--format", fmt, "--overwrite", "--pack-size", "8", "--seed", "7")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "link", "real"]
    assert link.is_symlink() and run("verify", link).exit_code == 0
    metadata = real / ("metadata.json" if fmt == "native" else "training.metadata.json")
    assert json.loads(metadata.read_text())["spec"]["seed"] == 7

    (tmp_path / "dangling").symlink_to("later")
    assert run("pack", path, "-o", tmp_path / "dangling", "--format", fmt).exit_code == 0
    assert (tmp_path / "later").is_dir() and run("verify", tmp_path / "dangling").exit_code == 0

    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    result = run("pack", path, "-o", tmp_path / "loop1", "--format", fmt)
    assert result.exit_code == 2 and "is a symbolic link that does not resolve (a loop)" in result.output
    (tmp_path / "nowhere").symlink_to(tmp_path / "missing" / "out")
    result = run("pack", path, "-o", tmp_path / "nowhere", "--format", fmt)
    assert result.exit_code == 2 and "output parent directory does not exist" in result.output
    result = run("pack", path, "-o", tmp_path / "data.jsonl" / "out", "--format", fmt)  # under a file
    assert result.exit_code == 2 and f"{tmp_path / 'data.jsonl'}: output parent directory is not a directory" in \
        result.output.replace("\n", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "data.jsonl", "later", "link", "loop1",
                                                           "loop2", "nowhere", "real"]


@pytest.mark.parametrize("dry", [[], ["--dry-run"]], ids=["real", "dry-run"])
def test_an_out_name_longer_than_its_directory_allows_exits_2_first(tmp_path, dry):
    """The temporary output's name is shortened, so only the final rename failed: exit 3 after the
    whole run; a dry run said nothing."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 10)
    result = run("pack", path, "-o", tmp_path / ("out" + "x" * 297), *dry)
    assert result.exit_code == 2, result.output
    assert result.output.strip().endswith(": a name of 300 bytes, longer than its directory allows (255)")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("dry", [[], ["--dry-run"]], ids=["real", "dry-run"])
def test_an_out_name_exactly_as_long_as_its_directory_allows_packs(tmp_path, dry):
    """The longest name a directory allows is a valid OUT: only a longer one is refused."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 10)
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    out = tmp_path / ("o" * longest)
    result = run("pack", path, "-o", out, *dry)
    assert result.exit_code == 0, result.output
    assert out.is_dir() == (not dry)


def test_dry_run_and_json(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 10)
    result = run("pack", path, "--dry-run", "--json", "--pack-size", "6")
    assert result.exit_code == 0
    summary = json.loads(result.stdout)
    assert summary["dry_run"] and summary["counts"]["packs"] == 5  # 10 sequences of 3 runtime tokens, 2 per pack
    assert_nothing_written(tmp_path)


def test_phase_times_are_reported_but_never_stored(synthetic_parquet, tmp_path):
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    seconds = json.loads(result.output)["seconds"]
    assert set(seconds) == {"read", "plan", "write", "total"}
    assert all(v > 0 for v in seconds.values())
    assert seconds["read"] + seconds["plan"] + seconds["write"] <= seconds["total"] + 1e-3
    stored = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert "seconds" not in stored  # the same inputs must give the same bytes
    assert "time (read / plan / write)" in run("pack", synthetic_parquet, "-o", tmp_path / "again").output


def test_no_target_samples_are_kept_and_warned(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, {"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]}])
    result = run("pack", path, "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0
    assert "1 sample has no target tokens" in result.stderr
    assert json.loads(result.stdout)["counts"]["no_target_samples"] == 1


@pytest.mark.parametrize("policy,expected", [("truncate", 2), ("split", 1), ("drop", 1)])
def test_samples_whose_targets_all_lie_past_the_cap(tmp_path, policy, expected):
    """A prompt longer than C: truncation keeps the sample without its response, so it trains on
    nothing (counted and warned, like a sample without targets); split keeps the response in a
    later piece; drop keeps nothing of it. Pass one counted targets before truncation, so the
    truncated sample was neither counted nor warned about, and verify skipped the check."""
    records = [{"input_ids": list(range(1, 11)), "answer_start_idx": 8},  # targets only past C=4
               {"input_ids": [1, 2, 3], "answer_start_idx": 3},             # no target at all
               {"input_ids": list(range(1, 11)), "answer_start_idx": 2},    # targets on both sides
               {"input_ids": [1, 2, 3], "answer_start_idx": 0}]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    out = tmp_path / "out"
    result = run("pack", path, "-o", out, "--pack-size", "4", "--overlong", policy, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["counts"]["no_target_samples"] == expected
    assert (f"{expected} samples have no target tokens" if expected > 1 else "1 sample has no target tokens") in result.stderr
    for source in ([], ["--source", path]):
        checked = run("verify", out, *source)
        assert checked.exit_code == 0, checked.output
    # An output written before truncation was counted recorded 1 here (targets before the cap):
    # still verified; a count that is neither is a finding, with the source and without.
    for recorded, ok in ([(1, True)] if policy == "truncate" else []) + [(0, False), (expected + 1, False)]:
        _record_no_target(out, recorded)
        for source in ([], ["--source", path]):
            checked = run("verify", out, *source)
            assert (checked.exit_code == 0) == ok, (recorded, source, checked.output)
            assert ok or "counts.no_target_samples is" in checked.output, checked.output


def _record_no_target(out, value: int) -> None:
    """Rewrite the output's counts.no_target_samples (metadata re-sealed)."""
    from packer_cli.shards.format import seal_metadata

    meta = json.loads((out / "metadata.json").read_text())
    meta["counts"]["no_target_samples"] = value
    (out / "metadata.json").write_text(json.dumps(seal_metadata({k: v for k, v in meta.items() if k != "checksum"})))


@pytest.mark.parametrize("line,message", [
    ('{"input_ids": [1, 2, 3], "labels": [-100, 2]}', "line 3: labels has 2 values but input_ids has 3"),
    ('{"input_ids": [1, 2, 3], "labels": [-100, 2, 9]}', "line 3: labels[2] = 9 is neither -100 nor the token id 3"),
])
def test_bad_labels_records(tmp_path, line, message):
    good = {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}
    path = write_jsonl(tmp_path / "data.jsonl", [good] * 3, raw_line3=line)
    result = run("pack", path, "-o", tmp_path / "out")
    assert result.exit_code == 1 and f"data.jsonl: {message}" in result.output, result.output
    assert_nothing_written(tmp_path)


def test_missing_column_lists_the_fields(tmp_path):
    pq.write_table(pa.table({"ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]]}), tmp_path / "d.parquet")
    result = run("pack", tmp_path / "d.parquet", "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert "d.parquet: row 0: missing field 'input_ids' (fields: ids, loss_mask)" in result.output


def test_supervision_detected_past_a_malformed_first_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"input_ids": [1,\n' + "\n".join(orjson.dumps(GOOD).decode() for _ in range(3)) + "\n")
    result = run("pack", path, "-o", tmp_path / "out", "--on-bad-record", "skip", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["source"]["supervision"]["kind"] == "mask" and summary["counts"]["bad_records"] == 1


def test_a_glob_through_a_link_back_up_is_refused_by_pack_and_verify(tmp_path, monkeypatch):
    """pack read d/sub/a.jsonl ~40 times through d/sub/up -> d and exited 0; verify --source
    with the same glob then passed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "d" / "sub" / "a.jsonl", [GOOD, GOOD])
    assert run("pack", "d/sub/a.jsonl", "-o", "packed", "-C", 64).exit_code == 0
    (tmp_path / "d" / "sub" / "up").symlink_to("..")
    message = "d/sub/up: a symbolic link back to"
    result = run("pack", "d/**/*.jsonl", "-o", "out", "-C", 64)
    assert result.exit_code == 1 and message in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert_nothing_written(tmp_path)
    result = run("verify", "packed", "--source", "d/**/*.jsonl")
    assert result.exit_code == 2 and f"--source: {message}" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_corrupted_inputs_never_traceback(tmp_path):
    """Random byte flips and truncations of every input format: a one-line error (or a clean
    pack when the damage happens to leave valid data), never a traceback or a partial OUT."""
    import gzip
    import random

    from packer_cli.demo import demo_table

    table = demo_table(200, seed=3, max_len=600)
    pq.write_table(table, tmp_path / "good.parquet", row_group_size=50)
    with pa.ipc.new_file(str(tmp_path / "good.arrow"), table.schema) as w:
        w.write_table(table)
    lines = b"".join(orjson.dumps(r) + b"\n" for r in table.to_pylist())
    (tmp_path / "good.jsonl").write_bytes(lines)
    (tmp_path / "good.jsonl.gz").write_bytes(gzip.compress(lines))
    rng = random.Random(7)
    for it in range(48):
        src = ["good.parquet", "good.arrow", "good.jsonl", "good.jsonl.gz"][it % 4]
        data = bytearray((tmp_path / src).read_bytes())
        if it % 3 == 0:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.choice([1, 5, 50])):
                data[rng.randrange(len(data))] = rng.randrange(256)
        bad = tmp_path / ("bad" + src[4:])
        bad.write_bytes(bytes(data))
        out = tmp_path / f"out{it}"
        result = run("pack", bad, "-o", out, "--pack-size", 1024)
        assert result.exception is None or isinstance(result.exception, SystemExit), (src, result.output)
        assert result.exit_code in (0, 1), (src, result.output)
        if result.exit_code:
            assert len(result.output.strip().splitlines()) == 1 and not out.exists(), (src, result.output)
    assert not list(tmp_path.glob("out*.tmp-*"))


def _no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("where", ["spill", "shard", "bridge", "shard-device", "bridge-device", "shard-tail"])
def test_a_full_disk_is_one_line_exit_3_and_nothing_left(synthetic_parquet, tmp_path, monkeypatch, where):
    import threading

    from packer_cli.shards import _gather, _sink, bridge_writer, writer

    if where == "spill":  # pass one
        monkeypatch.setattr(_gather.SpillWriter, "write", _no_space)
    elif where == "shard":  # pass two, in a shard-writing thread
        monkeypatch.setattr(writer.ShardFile, "write", _no_space)
    elif where == "bridge":
        monkeypatch.setattr(bridge_writer, "encode_list_columns", _no_space)  # in an encoding thread
    else:  # the device write itself: in OutputFile's I/O thread, raised through pyarrow's writer
        monkeypatch.setattr(_sink.OutputFile, "_write_staged", _no_space)
        if where != "shard-tail":  # else the file fits one block: the error comes at its close
            monkeypatch.setattr(_sink, "DIRECT_BLOCK", 16 * _sink.ALIGN)
    from packer_cli.sources.parquet_lists import decode_pool

    import time

    for started in [decode_pool().submit(time.sleep, 0.05) for _ in range(2)]:  # both threads made:
        started.result()  # the process's page-decoding threads stay, made by this test or an earlier one
    threads = threading.active_count()
    extra = ["--format", "megatron-bridge"] if where.startswith("bridge") else []
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", *extra)
    assert result.exit_code == 3, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'out'}: writing the output failed: [Errno 28] No space left on device")
    assert "Traceback" not in result.output
    assert_nothing_written(tmp_path)
    assert threading.active_count() == threads, [t.name for t in threading.enumerate()]  # no writer or gatherer outlives it


def test_an_output_that_cannot_be_created_for_space_exits_3(tmp_path, monkeypatch):
    """A full device (or an I/O error) creating OUT's temporary directory, or --spill-dir's
    private one, is the output failing to be written (3), not an unusable option (2): a
    pipeline retrying on 3 would otherwise give up."""
    import os

    path = write_jsonl(tmp_path / "data.jsonl", [GOOD])
    mkdir = os.mkdir
    monkeypatch.setattr(os, "mkdir", lambda path, *a: _no_space() if ".tmp-" in os.path.basename(path)
                        or "packer-spill" in os.path.basename(path) else mkdir(path, *a))
    result = run("pack", path, "-o", tmp_path / "out")
    assert result.exit_code == 3 and "cannot create the output: [Errno 28]" in result.output, result.output
    assert_nothing_written(tmp_path)
    spill = tmp_path / "spill"
    spill.mkdir()
    monkeypatch.setattr(os, "mkdir", lambda path, *a: _no_space() if "packer-spill" in os.path.basename(path)
                        else mkdir(path, *a))
    result = run("pack", path, "-o", tmp_path / "out", "--spill-dir", spill)
    assert result.exit_code == 3 and f"{spill}: cannot create the spill directory: [Errno 28]" in result.output, \
        result.output
    assert_nothing_written(tmp_path)


def test_an_output_that_cannot_be_created_for_permission_exits_2(tmp_path, monkeypatch):
    import os

    path = write_jsonl(tmp_path / "data.jsonl", [GOOD])
    mkdir = os.mkdir

    def refuse(path, *a):
        if ".tmp-" in os.path.basename(path):
            raise PermissionError(13, "Permission denied")
        return mkdir(path, *a)

    monkeypatch.setattr(os, "mkdir", refuse)
    result = run("pack", path, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "cannot create the output: [Errno 13]" in result.output, result.output


def _files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("extra", [[], ["--format", "megatron-bridge"]], ids=["native", "bridge"])
def test_spill_dir_holds_the_spill_and_is_emptied(synthetic_parquet, tmp_path, monkeypatch, extra):
    import os

    from packer_cli.shards import _gather

    spills = []
    close = _gather.SpillWriter.close

    def spying_close(self):
        close(self)
        spills.append((self._dir, os.path.getsize(os.path.join(self._dir, _gather.SPILL_FILE))))

    monkeypatch.setattr(_gather.SpillWriter, "close", spying_close)
    spill = tmp_path / "local-disk"
    spill.mkdir()
    on_disk = ["--spill-memory", "0"]  # all of the spill in the file
    assert run("pack", synthetic_parquet, "-o", tmp_path / "beside", *extra, *on_disk).exit_code == 0
    result = run("pack", synthetic_parquet, "-o", tmp_path / "elsewhere", "--spill-dir", spill, *extra, *on_disk)
    assert result.exit_code == 0, result.output
    (default_dir, default_bytes), (spill_dir, spill_bytes) = spills
    assert default_dir.startswith(str(tmp_path / "beside"))  # the temporary output
    assert os.path.dirname(spill_dir) == str(spill) and spill_bytes == default_bytes > 0
    assert list(spill.iterdir()) == []  # removed at the end
    assert _files(tmp_path / "elsewhere") == _files(tmp_path / "beside")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow"])
def test_boolean_loss_masks_pack_as_their_integers(synthetic_parquet, tmp_path, fmt):
    """A loss mask of booleans (JSON true/false, Arrow list<bool>) packs to the same shards as the
    same mask in 0/1 integers, and verify --source replays it."""
    import pyarrow.feather as feather

    table = pq.read_table(synthetic_parquet)
    as_bools = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                                table.column("loss_mask").cast(pa.list_(pa.bool_())))
    paths = {}
    for name, t in (("ints", table), ("bools", as_bools)):
        path = tmp_path / f"{name}.{fmt}"
        if fmt == "jsonl":
            path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in t.to_pylist()))
        elif fmt == "parquet":
            pq.write_table(t, path, row_group_size=1000)
        else:
            feather.write_feather(t, path, compression="uncompressed")
        paths[name] = path
        result = run("pack", path, "-o", tmp_path / f"out-{name}", "--pack-size", 2048)
        assert result.exit_code == 0, result.output
    if fmt == "jsonl":
        assert paths["bools"].read_bytes().startswith(b'{"input_ids":[') and b"true" in paths["bools"].read_bytes()
    shards = {name: {p.name: p.read_bytes() for p in (tmp_path / f"out-{name}").glob("packs-*")}
              for name in paths}
    assert shards["ints"] and shards["bools"] == shards["ints"]
    result = run("verify", tmp_path / "out-bools", "--source", paths["bools"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("extra", [[], ["--format", "megatron-bridge"]], ids=["native", "bridge"])
def test_direct_and_buffered_io_write_the_same_files(synthetic_parquet, tmp_path, monkeypatch, extra):
    """Every output file goes through OutputFile, direct with --direct-io and buffered with
    --buffered-io, and the two outputs are byte-identical (checksums in the manifests included)."""
    import os

    from packer_cli.shards import _sink

    opened = []
    init = _sink.OutputFile.__init__

    def spying_init(self, path, direct=True, **kw):
        init(self, path, direct=direct, **kw)
        opened.append((os.path.basename(path), direct))

    monkeypatch.setattr(_sink.OutputFile, "__init__", spying_init)
    monkeypatch.setattr(_sink, "DIRECT_BLOCK", 16 * _sink.ALIGN)  # many blocks per file, not one tail
    for name, flag in (("direct", ["--direct-io"]), ("buffered", ["--buffered-io"])):
        result = run("pack", synthetic_parquet, "-o", tmp_path / name, *extra, *flag)
        assert result.exit_code == 0, result.output
    direct = [d for _, d in opened[:len(opened) // 2]]
    buffered = [d for _, d in opened[len(opened) // 2:]]
    assert len(direct) == len(buffered) >= 1
    assert all(direct) and not any(buffered)
    assert _files(tmp_path / "direct") == _files(tmp_path / "buffered")
    assert run("verify", tmp_path / "direct", "--source", synthetic_parquet).exit_code == 0


@pytest.mark.parametrize("extra", [[], ["--format", "megatron-bridge"]], ids=["native", "bridge"])
def test_spill_memory_holds_the_first_batches_and_changes_no_byte(synthetic_parquet, tmp_path, monkeypatch, extra):
    """All of the spill in memory, all in the file, split between the two (a budget smaller than
    the spill), and the default (256 MiB: all of this small spill): the same output files, the
    file holds exactly what did not fit, and the summary says how much lay in memory."""
    import os

    from conftest import DEFAULT_SPILL_MEMORY

    from packer_cli import pipeline
    from packer_cli.shards import _gather

    seen = []
    close = _gather.SpillWriter.close

    def spying_close(self):
        close(self)
        seen.append((self._memory.used, os.path.getsize(os.path.join(self._dir, _gather.SPILL_FILE)),
                     self._bytes))

    monkeypatch.setattr(_gather.SpillWriter, "close", spying_close)
    summaries = []
    for name, budget in (("memory", ["--spill-memory", "1GB"]), ("file", ["--spill-memory", "0"]),
                         ("split", ["--spill-memory", "2MB"]), ("default", [])):
        if name == "default":
            monkeypatch.setattr(pipeline, "DEFAULT_SPILL_MEMORY", DEFAULT_SPILL_MEMORY)
        result = run("pack", synthetic_parquet, "-o", tmp_path / name, "--json", *extra, *budget)
        assert result.exit_code == 0, result.output
        summaries.append(json.loads(result.stdout)["spill"])
    (mem_used, mem_file, total), (file_used, file_file, _), (split_used, split_file, _), default = seen
    assert total > 2 << 20  # the split budget really splits it
    assert (mem_used, mem_file) == (total, 0) and (file_used, file_file) == (0, total)
    assert 0 < split_used <= 2 << 20 and split_used + split_file == total and split_file > 0
    assert DEFAULT_SPILL_MEMORY == 256 << 20 and default[:2] == (total, 0)
    assert [(s["bytes"], s["memory_bytes"]) for s in summaries] == [(total, total), (total, 0), (total, split_used),
                                                                   (total, total)]
    assert (_files(tmp_path / "memory") == _files(tmp_path / "file") == _files(tmp_path / "split")
            == _files(tmp_path / "default"))


def test_unusable_spill_memory_exits_2(synthetic_parquet, tmp_path):
    for size in ("-1", "-0.5", "-1K"):  # -0.5 was taken as 0
        result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--spill-memory", size, "--dry-run")
        assert result.output == f"error: --spill-memory: '{size}' is a negative size\n", result.output
        assert result.exit_code == 2
        result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--shard-size", size)
        assert result.output == f"error: --shard-size: '{size}' is a negative size\n", result.output
    refusals = {str(1 << 62): "error: spill memory: cannot reserve 4,611,686,018,427,387,904 bytes",
                "1e30": "error: --spill-memory: '1e30' is more than 9,223,372,036,854,775,807 bytes"}
    for size, refusal in refusals.items():  # a dry run says so too (it exited 0)
        for dry in ([], ["--dry-run"]):
            result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--spill-memory", size, *dry)
            assert result.exit_code == 2, result.output
            assert result.output.startswith(refusal), result.output
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("fs,default_direct", [("ext4", True), ("xfs", True), ("lustre", True), ("nfs4", False),
                                               ("fuse.sshfs", False), ("tmpfs", False), (None, False)])
def test_direct_io_by_default_only_on_file_systems_that_take_it_well(synthetic_parquet, tmp_path, monkeypatch, fs,
                                                                     default_direct):
    from packer_cli.shards import _sink

    asked = []
    init = _sink.OutputFile.__init__

    def spying_init(self, path, direct=True, **kw):
        init(self, path, direct=direct, **kw)
        asked.append(direct)

    monkeypatch.setattr(_sink.OutputFile, "__init__", spying_init)
    monkeypatch.setattr(_sink, "file_system_type", lambda path: fs)
    for name, flag, want in (("default", [], default_direct), ("forced", ["--direct-io"], True),
                             ("off", ["--buffered-io"], False)):
        asked.clear()
        result = run("pack", synthetic_parquet, "-o", tmp_path / name, *flag)
        assert result.exit_code == 0, result.output
        assert asked and set(asked) == {want}, (name, asked)


def test_missing_spill_dir_exits_2_before_anything_is_written(synthetic_parquet, tmp_path):
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--spill-dir", tmp_path / "nowhere")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {tmp_path / 'nowhere'}: spill directory does not exist"
    (tmp_path / "file").write_text("")
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--spill-dir", tmp_path / "file")
    assert result.exit_code == 2 and result.output.strip() == f"error: {tmp_path / 'file'}: spill directory is not " \
        "a directory", result.output
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("where", ["spill", "shard"])
def test_failures_with_a_spill_dir_name_it_and_leave_it_empty(synthetic_parquet, tmp_path, monkeypatch, where):
    from packer_cli.shards import _gather, writer

    if where == "spill":
        monkeypatch.setattr(_gather.SpillWriter, "write", _no_space)
    else:
        monkeypatch.setattr(writer.ShardFile, "write", _no_space)
    spill = tmp_path / "local-disk"
    spill.mkdir()
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--spill-dir", spill)
    assert result.exit_code == 3, result.output
    blamed = f"{spill}: writing the spill failed" if where == "spill" else f"{tmp_path / 'out'}: writing the output failed"
    assert result.output.strip() == f"error: {blamed}: [Errno 28] No space left on device"
    assert list(spill.iterdir()) == []
    assert_nothing_written(tmp_path)


def _full_device_for(monkeypatch, name: str) -> None:
    """Writes of the spill file ``name`` go to /dev/full (every write: ENOSPC), as a spill
    directory filled by the run, or by a neighbour's job, leaves them."""
    import builtins

    from packer_cli.shards import _gather

    real_open = builtins.open

    def opening(path, mode="r", *args, **kwargs):
        if str(path).endswith(name) and "w" in mode:
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(_gather, "open", opening, raising=False)


@pytest.mark.parametrize("name", ["lengths.bin", "order.bin", "layout.bin"])
@pytest.mark.parametrize("spill_dir", [True, False], ids=["spill-dir", "in-out"])
def test_a_full_device_under_the_parked_spill_files_is_named(synthetic_parquet, tmp_path, monkeypatch, name,
                                                              spill_dir):
    """NumPy's tofile lost a failed flush of these small files (ENOSPC: an empty file, no
    error): pass two then read garbage (a segfault), or said 'ends early' (not why), or blamed
    OUT under --spill-dir with NumPy's '7473 requested and 2048 written'."""
    _full_device_for(monkeypatch, name)
    spill = tmp_path / "local-disk"
    spill.mkdir()
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", *(["--spill-dir", spill] if spill_dir else []))
    assert result.exit_code == 3, result.output
    where = f"{spill}" if spill_dir else f"{tmp_path / 'out'}: writing the output failed"
    assert result.output.strip() == f"error: {where}: writing the spill failed: [Errno 28] No space left on device " \
                                    f"({name})", result.output
    assert list(spill.iterdir()) == []
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("full", ["layout.bin", "samples.bin"])
def test_a_full_spill_directory_does_not_hide_the_error_pass_one_stopped_for(tmp_path, monkeypatch, full):
    """Closing the spill on the way out wrote its layout, and on a full directory that error
    replaced the one pass one was unwinding from: a bad record (exit 1) or a Ctrl-C (130) became
    exit 3 naming layout.bin, as did a full disk under samples.bin itself."""
    _full_device_for(monkeypatch, full)
    records = [{"input_ids": list(range(5, 5 + 40 + k % 50)), "loss_mask": [1] * (40 + k % 50)} for k in range(5000)]
    if full == "layout.bin":
        records[-1] = {"input_ids": [5, 6, 7], "loss_mask": [1, 1]}  # the last record is bad
    path = write_jsonl(tmp_path / "data.jsonl", records)
    spill = tmp_path / "scratch"
    spill.mkdir()
    result = run("pack", path, "-o", tmp_path / "out", "--spill-dir", spill, "--spill-memory", "64MB" if
                 full == "layout.bin" else "0")
    if full == "layout.bin":  # every batch held in memory: the bad record is what stops the run
        assert result.exit_code == 1 and "line 5000" in result.output, result.output
    else:
        assert result.exit_code == 3, result.output
        assert result.output.strip() == f"error: {spill}: writing the spill failed: [Errno 28] No space left on device"
    assert "layout.bin" not in result.output
    assert list(spill.iterdir()) == []
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("memory", ["0", "200KB", "2MB", "1G"])
def test_a_dry_runs_spill_on_disk_is_what_the_run_writes(synthetic_parquet, tmp_path, monkeypatch, memory):
    """--spill-memory holds whole batches up to the first that does not fit: the estimate took
    the budget off the spill, and said less than the run then wrote (no warning; exit 3)."""
    import os

    from packer_cli.shards import _gather

    dry = json.loads(run("pack", synthetic_parquet, "--dry-run", "--json", "--spill-memory", memory).stdout)["disk"]
    written = []
    close = _gather.SpillWriter.close
    monkeypatch.setattr(_gather.SpillWriter, "close", lambda self: (
        written.append(os.path.getsize(os.path.join(self._dir, _gather.SPILL_FILE))), close(self))[1])
    real = json.loads(run("pack", synthetic_parquet, "-o", tmp_path / "out", "--json", "--spill-memory", memory).stdout)
    assert dry["spill_disk_bytes"] == written[0]
    assert dry["spill_bytes"] == real["spill"]["bytes"]
    if real["spill"]["read"] == "staged":  # from above, by each sample's block rounding at most
        assert real["spill"]["stage_bytes"] <= dry["stage_bytes"] <= 1.02 * real["spill"]["stage_bytes"]
    else:
        assert dry["stage_bytes"] == 0


def test_a_dry_run_judges_auto_with_the_room_the_memory_part_will_take(synthetic_parquet, monkeypatch):
    """The real run's memory part is anonymous memory the page cache cannot have; the dry run,
    which holds none, judged auto against all of the room (random where the run would stage)."""
    from packer_cli import pipeline
    from packer_cli.shards._staged import PASS_TWO_RESERVE

    monkeypatch.setattr(pipeline, "staged_memory", lambda *sizes: 0)  # a room that holds staging itself

    def dry(room):
        monkeypatch.setattr(pipeline, "page_cache_room", lambda: room)
        return json.loads(run("pack", synthetic_parquet, "--dry-run", "--json", "--spill-memory", "2MB").stdout)["disk"]

    held = dry(None)
    in_memory = held["spill_bytes"] - held["spill_disk_bytes"]
    assert 0 < in_memory and held["stage_bytes"] == 0  # room unknown: read at random
    just_enough = held["spill_disk_bytes"] + PASS_TWO_RESERVE + in_memory
    assert dry(just_enough)["stage_bytes"] == 0
    assert dry(just_enough - 1)["stage_bytes"] > 0


def test_a_staged_copy_is_estimated_from_above(synthetic_parquet, tmp_path):
    """It was taken as the spill's size, 1-5 % under the stage file the run then wrote (no
    warning on a disk it did not fit)."""
    dry = json.loads(run("pack", synthetic_parquet, "--dry-run", "--json", "--spill-read", "staged").stdout)["disk"]
    real = json.loads(run("pack", synthetic_parquet, "-o", tmp_path / "out", "--json", "--spill-read",
                          "staged").stdout)["spill"]
    assert real["read"] == "staged" and real["stage_bytes"] > dry["spill_bytes"]
    assert real["stage_bytes"] <= dry["stage_bytes"] <= 1.02 * real["stage_bytes"]


def test_the_space_warning_counts_the_peak_not_the_sum():
    """The spill file is deleted once the stages are built, before any shard is written: a run
    whose spill, stages and shards summed past the free space, but whose peak did not, fit."""
    from packer_cli.pipeline import _short_of_space

    def needs(free, staged, same_device=True):
        places = {"spill": {"path": "/s", "bytes": free, "device": 1},
                  "output": {"path": "/o", "bytes": free, "device": 1 if same_device else 2}}
        return {"spill_disk_bytes": 10_000_000, "stage_bytes": 12_000_000 if staged else 0,
                "output_bytes": 5_000_000, "free": places}

    assert _short_of_space(needs(22_000_000, staged=True)) == []  # peak max(10 + 12, 12 + 5) = 22 MB
    assert len(_short_of_space(needs(21_900_000, staged=True))) == 1
    assert _short_of_space(needs(15_000_000, staged=False)) == []  # spill and shards side by side: 15 MB
    assert len(_short_of_space(needs(14_900_000, staged=False))) == 1
    assert _short_of_space(needs(22_000_000, staged=True, same_device=False)) == []
    indexed = {**needs(15_000_000, staged=False), "spill_index_bytes": 1}  # lengths.bin and order.bin too
    assert len(_short_of_space(indexed)) == 1


def test_a_sync_failing_once_the_output_is_in_place_does_not_fail_the_run(synthetic_parquet, tmp_path, monkeypatch):
    """OUT was in place (and the old one deleted) when OUT's parent failed to sync: exit 3 said
    the output was not written. It is there; the run succeeds."""
    import os

    run("pack", synthetic_parquet, "-o", tmp_path / "out")
    fsync = os.fsync

    def failing(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path):
            raise OSError(5, "Input/output error")
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--overwrite")
    assert result.exit_code == 0, result.output
    assert run("verify", tmp_path / "out").exit_code == 0


def test_a_parked_file_cut_short_is_named(tmp_path):
    """A parked file holding fewer items than expected is named, and so is one holding more
    (overwritten or appended to), which was taken as whole."""
    import numpy as np

    from packer_cli.shards._gather import SpillError, load_array, save_array

    path = str(tmp_path / "lengths.bin")
    save_array(path, np.arange(10, dtype=np.uint16))
    assert load_array(path, np.uint16, 10).tolist() == list(range(10))
    with open(path, "r+b") as f:
        f.truncate(6)
    with pytest.raises(SpillError, match=r"reading the spill files failed: lengths.bin holds 3 items, 10 expected"):
        load_array(path, np.uint16, 10)
    save_array(path, np.arange(12, dtype=np.uint16))
    with pytest.raises(SpillError, match=r"reading the spill files failed: lengths.bin holds 12 items, 10 expected"):
        load_array(path, np.uint16, 10)


def test_a_spill_dir_removed_once_the_shards_are_written_loses_nothing(synthetic_parquet, tmp_path, monkeypatch):
    """The run failed with exit 3 and deleted its finished output when --spill-dir's private
    directory was gone by the time it was to be removed (a cleaner of scratch space)."""
    import shutil

    from packer_cli import pipeline

    publish = pipeline._Run._publish

    def after_a_cleaner(self, *args):
        shutil.rmtree(self.spill_dir)
        return publish(self, *args)

    monkeypatch.setattr(pipeline._Run, "_publish", after_a_cleaner)
    spill = tmp_path / "scratch"
    spill.mkdir()
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--spill-dir", spill)
    assert result.exit_code == 0, result.output
    assert run("verify", tmp_path / "out").exit_code == 0


def test_a_dry_run_checks_the_spill_dir_is_writable(synthetic_parquet, tmp_path, monkeypatch):
    """The real run exits 2 there (it cannot make its directory); the dry run said nothing."""
    import os

    spill = tmp_path / "read-only"
    spill.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) == str(spill) else
                        access(path, mode, **kw))  # root passes os.access on a mode-0555 directory
    result = run("pack", synthetic_parquet, "--dry-run", "--spill-dir", spill)
    assert result.exit_code == 2 and result.output.strip() == f"error: {spill}: spill directory is not writable", \
        result.output


@pytest.mark.parametrize("error, reason", [("arrow", "malloc of size 16793600 failed"), ("bare", "MemoryError")])
def test_running_out_of_memory_is_one_line_and_leaves_nothing(synthetic_parquet, tmp_path, monkeypatch, error, reason):
    # pyarrow's ArrowMemoryError (a MemoryError) under a ulimit -v printed a traceback
    import pyarrow as pa

    from packer_cli.shards import writer

    def no_memory(*args, **kwargs):
        raise pa.ArrowMemoryError("malloc of size 16793600 failed") if error == "arrow" else MemoryError()

    monkeypatch.setattr(writer.ShardFile, "write", no_memory)
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out")
    assert result.exit_code == 3, result.output
    assert result.output.strip() == (f"error: {tmp_path / 'out'}: out of memory: {reason} "
                                     "(an address-space limit, ulimit -v, or the node's memory)")
    assert_nothing_written(tmp_path)


def test_a_killed_runs_spill_directory_is_pointed_out_not_removed(synthetic_parquet, tmp_path):
    # only OUT's temporary sibling was named, not the (far larger) spill under --spill-dir
    import os

    from packer_cli.shards._atomic import host_name

    spill = tmp_path / "scratch"
    here = f"packer-spill-{host_name()}"
    dead, live = spill / f"{here}-99999999-k2j4", spill / f"{here}-{os.getppid()}-x7q1"
    other_node = spill / "packer-spill-node17-99999999-k2j4"  # another machine's: no telling
    other_host_like_ours = spill / f"{here}-99999-4242-k2j4"  # host "<ours>-99999", process 4242
    for path in (dead / "x", live, other_node, other_host_like_ours, spill / "packer-spill-abc"):
        path.mkdir(parents=True)
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--spill-dir", spill)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {dead} was left by an earlier run that did not finish (killed outright?); "
                        "remove it to free its space"]
    assert sorted(p.name for p in spill.iterdir()) == sorted([dead.name, live.name, other_node.name,
                                                              other_host_like_ours.name, "packer-spill-abc"])


def test_a_killed_run_s_temporary_output_is_pointed_out_not_removed(synthetic_parquet, tmp_path):
    stale = tmp_path / "out.tmp-99999999"
    (stale / "_spill").mkdir(parents=True)
    (tmp_path / "out.tmp-notapid").mkdir()
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {stale} was left by an earlier run that did not finish (killed outright?); "
                        "remove it to free its space"]
    assert (stale / "_spill").is_dir() and (tmp_path / "out" / "metadata.json").exists()


def test_a_dry_run_estimates_the_disk_the_run_needs(synthetic_parquet, tmp_path, monkeypatch):
    """It said nothing of disk needs: a dry run on a file system without room for the spill and
    the shards passed, and the real run failed for space."""
    import os

    dry = json.loads(run("pack", synthetic_parquet, "-o", tmp_path / "out", "--dry-run", "--json").stdout)
    real = json.loads(run("pack", synthetic_parquet, "-o", tmp_path / "out", "--json").stdout)
    disk = dry["disk"]
    assert disk["spill_bytes"] == disk["spill_disk_bytes"] == real["spill"]["bytes"]  # exact: the same blocks
    shards = sum(os.path.getsize(tmp_path / "out" / e["name"]) for e in
                 json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"])
    assert abs(disk["output_bytes"] - shards) <= 0.01 * shards, (disk["output_bytes"], shards)
    import packer_cli.pipeline as pipeline

    monkeypatch.setattr(pipeline, "BATCH_TOKENS", 50_000)  # record batches of 50k tokens: several shards
    for options in (["-C", "256"], ["--shard-size", "300KB"]):
        out = tmp_path / f"out{len(options[1])}"
        estimate = json.loads(run("pack", synthetic_parquet, "-o", out, "--dry-run", "--json", *options).stdout)
        assert run("pack", synthetic_parquet, "-o", out, *options).exit_code == 0
        files = [out / e["name"] for e in json.loads((out / "manifest.json").read_text())["shards"]]
        batches = sum(pa.ipc.open_file(f).num_record_batches for f in files)
        written = sum(os.path.getsize(f) for f in files)  # Arrow's own bytes too: within a batch's padding
        assert abs(estimate["disk"]["output_bytes"] - written) <= 64 * batches, (estimate["disk"], written, batches)
        assert options[0] == "-C" or len(files) > 1, len(files)
    assert disk["free"]["output"]["path"] == str(tmp_path) and disk["free"]["output"]["bytes"] > 0
    assert "disk" not in json.loads((tmp_path / "out" / "metadata.json").read_text())
    held = json.loads(run("pack", synthetic_parquet, "--dry-run", "--json", "--spill-memory", "1G").stdout)["disk"]
    assert held["spill_disk_bytes"] == 0 and held["spill_bytes"] == disk["spill_bytes"] and held["free"] == {}
    bridge = json.loads(run("pack", synthetic_parquet, "--dry-run", "--json", "--format", "megatron-bridge").stdout)
    assert bridge["disk"]["output_bytes"] is None  # compressed: not estimated


def test_a_dry_run_warns_where_the_run_would_not_fit(synthetic_parquet, tmp_path, monkeypatch):
    import os

    statvfs = os.statvfs

    class Tight:
        def __init__(self, real, free):
            self.f_frsize, self.f_bavail = 1, free

    spill = tmp_path / "scratch"
    spill.mkdir()
    monkeypatch.setattr(os, "statvfs", lambda path: Tight(statvfs(path), 1000) if str(path) == str(spill)
                        else statvfs(path))
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--dry-run", "--spill-dir", spill)
    assert result.exit_code == 0, result.output
    warning = [line for line in result.output.splitlines() if str(spill) in line and "free, the run needs" in line]
    assert len(warning) == 1 and "it would fail for space" in warning[0], result.output
    # in units that show it (it said "0.00 GB free, the run needs about 0.00 GB")
    assert re.search(r": 0\.0 MB free, the run needs about (0\.[1-9]|[1-9][\d.]*) MB there", warning[0]), warning[0]
    result = run("pack", synthetic_parquet, "-o", tmp_path / "out", "--dry-run")  # room enough: no warning
    assert "would fail for space" not in result.output


def test_a_long_out_path_is_printed_whole_on_the_summary_title_line(tmp_path):
    """The summary's title wrapped at the table's width, breaking a long OUT over lines padded
    with spaces: it is one line, whole (a terminal wraps it where it must)."""
    data = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    out = tmp_path / ("d" * 70) / ("e" * 40) / "out"
    out.parent.mkdir(parents=True)
    r = run("pack", data, "-o", out, "--pack-size", "8")
    assert r.exit_code == 0, r.output
    assert f"packer pack → {out}\n" in r.output, r.output


@pytest.mark.parametrize("name", ["run[v2]", "od[/b]"])
def test_bracketed_names_are_printed_as_names_not_styles(tmp_path, monkeypatch, name):
    """rich reads "[v2]" as a style (dropped from the title) and "[/b]" as a closing tag
    with nothing to close (a traceback after the output was written, exit 1)."""
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "in[v2].jsonl", [GOOD] * 3)
    (tmp_path / "od[").mkdir()
    out = name
    r = run("pack", data, "-o", out, "--pack-size", "8")
    assert r.exit_code == 0, r.output
    assert f"packer pack → {out}" in r.output
    r = run("inspect", out)
    assert r.exit_code == 0, r.output
    assert f"packer inspect → {out}" in r.output


def test_emoji_codes_in_names_are_printed_as_written(tmp_path, monkeypatch):
    """rich printed "run:100:" as "run💯" (in the summary, and in an error on a terminal)."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", [GOOD] * 3)
    r = run("pack", "in.jsonl", "-o", "run:100:", "--pack-size", "8")
    assert r.exit_code == 0 and "packer pack → run:100:" in r.output, r.output


def test_an_error_on_a_terminal_names_a_bracketed_path_whole(tmp_path, monkeypatch):
    import io

    from packer_cli import cli
    from packer_cli._console import Console
    from packer_cli.errors import ConfigError

    screen = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=screen, force_terminal=True, highlight=False, soft_wrap=True))
    with pytest.raises(typer.Exit):
        cli.fail(ConfigError("train[v2].jsonl, nope[/x] and ckpt:fire:: no such file or directory"))
    assert re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()) == (
        "error: train[v2].jsonl, nope[/x] and ckpt:fire:: no such file or directory\n")


def test_control_characters_in_a_name_are_escaped_so_an_error_stays_one_line(tmp_path, monkeypatch):
    """A file named ``a<newline>b.jsonl`` made its error two lines (a carriage return likewise)
    and an escape sequence in a name reached the terminal as one; a field name the same."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "a\nb\r\x1b[31m.jsonl", [GOOD, {"input_ids": [1, 2, 3], "loss_mask": [0, 1]}])
    result = subprocess.run([sys.executable, "-m", "packer_cli", "pack", "a\nb\r\x1b[31m.jsonl", "-o", "out"],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (
        1, "error: a\\nb\\r\\x1b[31m.jsonl: line 2: loss_mask has 2 values but input_ids has 3\n")
    write_jsonl(tmp_path / "f.jsonl", [GOOD])
    result = run("pack", "f.jsonl", "-o", "out", "--tokens-field", "x\ny\u2028z")
    assert result.exit_code == 1
    assert result.output == "error: f.jsonl: line 1: missing field 'x\\ny\\u2028z'\n"
    assert_nothing_written(tmp_path)


def test_a_field_name_in_the_summary_table_is_escaped_one_line_a_cell(tmp_path):
    """A mask field name holding a newline broke its cell over two rows of the summary, and an
    escape sequence in one reached the terminal: it is escaped in its cell."""
    mask = "m\nx\r\x1b[31m"
    data = write_jsonl(tmp_path / "data.jsonl", [{"input_ids": [1, 2, 3, 4], mask: [0, 1, 1, 1]}] * 3)
    result = run("pack", data, "-o", tmp_path / "out", "-C", "16", "--mask-field", mask)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\r" not in result.output
    table = result.output.splitlines()[1:]
    assert table and all(line[0] in "┌│└" for line in table), result.output  # no row broken over lines
    assert any("loss mask 'm\\nx\\r\\x1b[31m'" in line for line in table if "targets" in line), result.output


def test_a_pack_summary_printed_by_any_console_shows_a_bracketed_field_name_as_it_is(tmp_path):
    """The cells were strings: a plain rich Console (how the library's users print a summary)
    read a mask field named "m[/]x" as markup and raised a MarkupError."""
    import io

    from rich.console import Console as RichConsole

    from packer_cli import PackSpec, SourceSpec, pack
    from packer_cli.report import print_pack_summary

    data = write_jsonl(tmp_path / "data.jsonl", [{"input_ids": [1, 2, 3, 4], "m[/]x": [0, 1, 1, 1]}] * 3)
    summary = pack([str(data)], str(tmp_path / "out"), PackSpec(pack_size=16), SourceSpec(mask_field="m[/]x"))
    screen = io.StringIO()
    print_pack_summary(summary, RichConsole(file=screen, width=200))
    assert any("loss mask 'm[/]x'" in line for line in screen.getvalue().splitlines() if "targets" in line)


def test_an_error_on_a_terminal_escapes_control_characters_too(monkeypatch):
    import io

    from packer_cli import cli
    from packer_cli._console import Console
    from packer_cli.errors import DataError

    screen = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=screen, force_terminal=True, highlight=False, soft_wrap=True))
    with pytest.raises(typer.Exit):
        cli.fail(DataError("e\x1b[2Jx\n.jsonl: line 1: bad"))
    assert "\x1b[2J" not in screen.getvalue()
    assert re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()) == "error: e\\x1b[2Jx\\n.jsonl: line 1: bad\n"


@pytest.mark.parametrize("text,shown", [
    ("plain: tab\tstays, ünïcode stays", "plain: tab\tstays, ünïcode stays"),
    ("nul\x00 bel\x07 lf\n cr\r esc\x1b del\x7f", "nul\\x00 bel\\x07 lf\\n cr\\r esc\\x1b del\\x7f"),
    ("nel\x85 csi\x9b ls\u2028 ps\u2029", "nel\\x85 csi\\x9b ls\\u2028 ps\\u2029"),
])
def test_one_line_escapes_what_breaks_a_line_or_drives_a_terminal(text, shown):
    from packer_cli._console import one_line

    assert one_line(text) == shown


def test_a_thread_that_cannot_start_is_out_of_memory_not_a_traceback(tmp_path, monkeypatch):
    """Under ulimit -v a decoder thread's stack could not be mapped: "RuntimeError: can't start
    new thread" went to the traceback branch, exit 1, where other allocations failing are exit 3."""
    from packer_cli import pipeline

    def no_thread(self, source):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(pipeline._Run, "execute", no_thread)
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    result = run("pack", path, "-o", tmp_path / "out", "--json")
    assert result.exit_code == 3, result.output
    assert json.loads(result.stdout)["error"] == (f"{tmp_path / 'out'}: out of memory: can't start new thread (an "
                                                  "address-space limit, ulimit -v, or the node's memory)")
    assert_nothing_written(tmp_path)


def test_a_successful_pack_json_says_ok_as_a_failure_says_not(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    doc = json.loads(run("pack", path, "-o", tmp_path / "out", "--json").stdout)
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["out"] == str(tmp_path / "out")
    failed = json.loads(run("pack", path, "-o", tmp_path / "out", "--json").stdout)  # exists: exit 2
    assert failed["ok"] is False and failed["exit_code"] == 2


def test_an_existing_mount_point_is_named_before_any_overwrite_advice(tmp_path, monkeypatch):
    """"pass --overwrite to replace it", and --overwrite then refused the mount point."""
    from packer_cli.shards import _atomic

    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    (tmp_path / "mnt").mkdir()
    monkeypatch.setattr(_atomic, "_is_mount_point", lambda p: os.path.basename(p) == "mnt")
    for extra in ([], ["--overwrite"]):
        result = run("pack", path, "-o", tmp_path / "mnt", *extra)
        assert result.exit_code == 2 and "is a mount point" in result.output and "pass --overwrite" not in \
            result.output, result.output


def test_a_dry_run_counts_the_spills_index_files(synthetic_parquet, tmp_path, monkeypatch):
    """lengths.bin and order.bin lie beside the spill even when all of it is held in memory, and
    were left out: a spill directory with the estimate's room free ran out of space (order.bin)."""
    from packer_cli import pipeline

    dry = json.loads(run("pack", synthetic_parquet, "--dry-run", "--json", "-o", tmp_path / "out").stdout)["disk"]
    written = {}
    save = pipeline.save_array

    def measured(path, array):
        written[os.path.basename(path)] = array.nbytes
        return save(path, array)

    monkeypatch.setattr(pipeline, "save_array", measured)
    assert run("pack", synthetic_parquet, "-o", tmp_path / "out").exit_code == 0
    assert set(written) == {"lengths.bin", "order.bin"}
    assert dry["spill_index_bytes"] == sum(written.values()) > 0


def test_a_null_beside_another_bad_record_is_said_as_alone(tmp_path):
    """With another bad record in its batch the record went the Python way: "= None is not an
    integer" (then "= null ..."), where alone it is "is null"."""
    path = tmp_path / "data.jsonl"
    good = orjson.dumps(GOOD).decode()
    path.write_text("\n".join([good, '{"input_ids": [1, null, 3], "loss_mask": [0, 1, 1]}',
                               '{"input_ids": [1, "a", 3], "loss_mask": [0, 1, 1]}', good]) + "\n")
    result = run("pack", path, "-o", tmp_path / "out", "--on-bad-record", "skip")
    assert result.exit_code == 0, result.output
    bad = json.loads((tmp_path / "out" / "metadata.json").read_text())["bad_records"]
    assert [b["reason"] for b in bad] == ["input_ids[1] is null", 'input_ids[1] = "a" is not an integer']


def _packer_child(argv, tmp_path, **env):
    """`python -m packer_cli ARGV` (how a user without the script on PATH runs it), with ``env``
    added to this environment."""
    return subprocess.run([sys.executable, "-m", "packer_cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, **env})


def test_version_and_python_dash_m(tmp_path):
    from packer_cli import __version__

    child = _packer_child(["--version"], tmp_path)
    assert (child.returncode, child.stdout, child.stderr) == (0, f"packer {__version__}\n", "")
    bare = _packer_child([], tmp_path)  # no command: the help, exit 2
    assert bare.returncode == 2 and "Usage: python -m packer_cli [OPTIONS] COMMAND" in bare.stderr, bare.stderr


@pytest.mark.parametrize("command", ["pack", "inspect", "verify"])
def test_help_keeps_every_option_name_whole_at_80_columns(tmp_path, command):
    """A pipe (``packer pack --help | less``) or a small terminal has 80 columns: rich's option
    tables cut names there (``--pad-to-max-len…``); every option must be readable in full."""
    child = _packer_child([command, "--help"], tmp_path, COLUMNS="80")
    assert child.returncode == 0 and "…" not in child.stdout, child.stdout
    options = [p for p in typer.main.get_command(app).commands[command].params if p.param_type_name == "option"]
    for option in options:
        for name in option.opts + option.secondary_opts:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", child.stdout), (name, child.stdout)
    assert max(map(len, child.stdout.splitlines())) <= 80


def test_columns_zero_counts_as_unset(tmp_path):
    """Some shells and CI runners export COLUMNS=0: rich took it for a width of 0 and printed
    nothing, error lines included."""
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD], raw_line3='{"input_ids": [1, "x"], "loss_mask": [0, 1]}')
    child = _packer_child(["pack", path, "-o", tmp_path / "out"], tmp_path, COLUMNS="0", LINES="0")
    assert child.returncode == 1 and child.stderr == (
        f'error: {path}: line 3: input_ids[1] = "x" is not an integer\n'), child.stderr
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD] * 3)
    child = _packer_child(["pack", good, "-o", tmp_path / "out"], tmp_path, COLUMNS="0")
    assert child.returncode == 0 and "samples packed" in child.stderr + child.stdout, child.stderr
    child = _packer_child(["verify", tmp_path / "out"], tmp_path, COLUMNS="0", LINES="0")
    assert child.returncode == 0 and child.stdout.startswith("verify: OK"), (child.stdout, child.stderr)


def test_numba_disable_jit_is_refused_in_one_line(tmp_path):
    """numba's debugging switch runs kernels as Python, where packer's intrinsics raise (a
    traceback of ~100 lines): a one-line refusal instead, exit 2."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    child = _packer_child(["pack", path, "-o", tmp_path / "out"], tmp_path, NUMBA_DISABLE_JIT="1")
    assert child.returncode == 2 and child.stderr == (
        "error: NUMBA_DISABLE_JIT is set: packer's kernels need numba's compiler (some use intrinsics that "
        "have no Python form); unset it\n"), child.stderr
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("command,api", [("inspect", "inspect_output"), ("verify", "verify_output")])
def test_running_out_of_memory_in_an_audit_names_the_output_exit_3(tmp_path, monkeypatch, command, api):
    """A MemoryError while inspecting or verifying (a huge pack) was reported as 'out of memory
    loading packer's libraries', naming no file."""
    from packer_cli import audit

    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    out = tmp_path / "out"
    assert run("pack", path, "-o", out).exit_code == 0

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 8.00 GiB for an array")

    monkeypatch.setattr(audit, api, no_memory)
    result = run(command, out)
    assert result.exit_code == 3, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"error: {out}: out of memory: Unable to allocate 8.00 GiB for an array (an address-space limit, "
        "ulimit -v, or the node's memory)"), result.output


def test_the_pack_summary_rows_say_what_the_run_did(tmp_path):
    """The dry run's table, row by row: SP is its own flag (TP 2 without --sp is SP off), a
    labels field is named as HF labels, and alignment padding is a share of the packs' C."""
    src = tmp_path / "train.jsonl"
    write_jsonl(src, [{"input_ids": list(range(1, 40 + k)), "labels": [-100] * 10 + list(range(11, 40 + k))}
                      for k in range(30)])
    result = runner.invoke(app, ["pack", str(src), "--dry-run", "-C", "512", "--cp", "2", "--tp", "2", "--json"])
    summary = json.loads(result.stdout)
    c = summary["counts"]
    text = runner.invoke(app, ["pack", str(src), "--dry-run", "-C", "512", "--cp", "2", "--tp", "2"],
                         terminal_width=200).output
    row = lambda label: next(line for line in text.splitlines() if label in line)  # noqa: E731
    assert "C=512 m=4 CP=2 TP=2 SP=off ffd seed=0" in row("spec")
    assert "HF labels 'labels'" in row("targets")
    share = 100 * c["alignment_padding"] / (c["packs"] * 512)
    assert f"{c['alignment_padding']:,} ({share:.2f}%)" in row("alignment padding")
    assert 100 * c["alignment_padding"] / c["runtime_tokens"] != pytest.approx(share, abs=0.005)


def test_every_summary_row_shows_the_runs_own_figure(tmp_path):
    """A real run's table against its ``--json`` summary, on records that give each row a figure
    of its own: an answer start for the targets, right padding dropped by the attention mask, a
    1-token record (too short), two bad lines (skipped), an over-long sample without targets
    (dropped: it is not also a sample without targets), and runtime lengths 33, 20, 33, 20, 33,
    20, 33 at C = 64 in input order, where ⌈Σp/C⌉ = 3 and L2 = 4 differ."""
    def record(runtime: int, answer: int, padding: int = 0):
        ids = list(range(1, runtime + 2))
        return {"input_ids": ids + [0] * padding, "answer_start_idx": answer,
                "attention_mask": [1] * len(ids) + [0] * padding}

    records = [record(n, 5, padding=3 * (k % 2)) for k, n in enumerate([33, 20, 33, 20, 33, 20, 33])]
    records += [{"input_ids": [7], "answer_start_idx": 0, "attention_mask": [1]}, record(80, 81)]
    lines = [orjson.dumps(r).decode() for r in records]
    lines[3:3] = ['{"input_ids": [1, "x"]}', "{not json"]
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(lines) + "\n")
    args = ["pack", str(src), "-C", "64", "--algorithm", "sequential", "--no-refine", "--no-shuffle",
            "--overlong", "drop", "--on-bad-record", "skip", "--spill-memory", "1MB"]
    summary = json.loads(runner.invoke(app, [*args, "-o", str(tmp_path / "a"), "--json"]).stdout)
    c, q = summary["counts"], summary["quality"]
    assert (q["lower_bound"], q["l2_bound"], c["packs"]) == (3, 4, 4)
    assert (c["too_short_dropped"], c["bad_records"], c["overlong"]["dropped"]) == (1, 2, 1)
    assert c["no_target_samples"] == 0 and summary["source"]["padding_dropped"] == 9
    result = runner.invoke(app, [*args, "-o", str(tmp_path / "b")], terminal_width=200)
    assert result.exit_code == 0, result.output
    row = lambda label: next(line for line in result.output.splitlines() if label in line)  # noqa: E731
    assert "answer start 'answer_start_idx'" in row("targets")
    assert "9 tokens" in row("padding dropped (attention_mask)")
    assert f"3 / +1 ({100 / 3:.3f}%)" in row("lower bound")
    assert "4 / +0 (0.000%)" in row("L2 bound")
    tail = c["tail_padding"]
    assert f"{tail:,} ({100 * tail / (4 * 64):.2f}%)" in row("tail padding")
    assert "1 / 1" in row("dropped (too short / over-long)")
    assert "2" in row("bad records skipped") and "0" in row("samples without targets")
    assert "all in memory" in row("spill read back")
    assert run("verify", tmp_path / "b", "--source", src).exit_code == 0
    result = runner.invoke(app, [*args[:-2], "-o", str(tmp_path / "c"), "--spill-memory", "0"], terminal_width=200)
    assert "in memory" not in row("spill read back")


def test_an_input_reached_through_a_link_and_dot_dot_is_recorded_as_the_file_read(tmp_path, monkeypatch):
    """``elsewhere/link/../data.jsonl`` with ``link -> ../real/sub`` is ``real/data.jsonl`` (the
    kernel follows the link, then goes up): collapsing the '..' as text recorded
    ``elsewhere/data.jsonl``, a file that does not exist, and verify --source of the recorded
    inputs could not find it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "link").symlink_to("../real/sub")
    write_jsonl(tmp_path / "real" / "data.jsonl", [GOOD, GOOD])
    assert run("pack", "elsewhere/link/../data.jsonl", "-o", "out", "-C", 64).exit_code == 0
    recorded = json.loads((tmp_path / "out" / "metadata.json").read_text())["source"]["inputs"][0]["path"]
    assert recorded == os.path.realpath(tmp_path / "real" / "data.jsonl")
    assert not (tmp_path / "elsewhere" / "data.jsonl").exists()


def test_skipped_and_too_short_records_are_counted_over_every_input(tmp_path):
    """Each input is read in batches of its own: the counts took only the last batch's bad and
    too-short records (2 inputs: 1 each instead of 2), and verify failed the output."""
    short = {"input_ids": [5], "loss_mask": [1]}
    paths = [write_jsonl(tmp_path / f"{name}.jsonl", [GOOD] * 4 + [short], raw_line3='{"input_ids": [1, -4]}')
             for name in "ab"]
    result = run("pack", *paths, "-o", tmp_path / "out", "--on-bad-record", "skip", "--json")
    assert result.exit_code == 0, result.output
    counts = json.loads(result.stdout)["counts"]
    assert (counts["bad_records"], counts["too_short_dropped"], counts["samples_packed"]) == (2, 2, 8)
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert [b["path"] for b in meta["bad_records"]] == [str(p) for p in paths]
    assert run("verify", tmp_path / "out").exit_code == 0


def test_nothing_left_to_pack_counts_the_other_inputs(tmp_path, monkeypatch):
    """Two inputs, none packable: the error names the first and '1 more input' (it said 2)."""
    monkeypatch.chdir(tmp_path)
    for name in "ab":
        (tmp_path / f"{name}.jsonl").write_text('{"input_ids": [1, "x"]}\n')
    result = run("pack", "a.jsonl", "b.jsonl", "-o", "out", "--on-bad-record", "skip")
    assert result.exit_code == 1, result.output
    assert "error: a.jsonl and 1 more input: no samples left to pack: of 2 records, 2 bad (skipped); " in result.output
    assert_nothing_written(tmp_path)


def test_an_existing_empty_out_needs_overwrite(tmp_path):
    """An empty directory at OUT is still the user's: it was taken without --overwrite."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    (tmp_path / "out").mkdir()
    result = run("pack", path, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "already exists; pass --overwrite" in result.output, result.output
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_fifo_at_out_is_refused_as_no_directory(tmp_path, overwrite):
    """A FIFO (no regular file) at OUT was told 'pass --overwrite', and with --overwrite that it
    'appeared while this run was packing'."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 3)
    os.mkfifo(tmp_path / "out")
    result = run("pack", path, "-o", tmp_path / "out", *overwrite)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {tmp_path / 'out'} exists and is not a directory", result.output
    assert (tmp_path / "out").is_fifo()


def test_the_space_warning_charges_each_file_system_only_what_goes_there():
    """With --spill-dir on another file system, the staged copy was charged to OUT's and the
    shards to the spill's: a spurious 'would fail for space' where each had room enough."""
    from packer_cli.pipeline import _short_of_space

    def needs(spill_free, out_free, staged):
        places = {"spill": {"path": "/scratch", "bytes": spill_free, "device": 1},
                  "output": {"path": "/out", "bytes": out_free, "device": 2}}
        return {"spill_disk_bytes": 10_000_000, "spill_index_bytes": 0, "stage_bytes": 12_000_000 if staged else 0,
                "output_bytes": 5_000_000, "free": places}

    assert _short_of_space(needs(22_000_000, 5_000_000, staged=True)) == []  # spill + stage there, shards here
    assert _short_of_space(needs(10_000_000, 5_000_000, staged=False)) == []
    [short] = _short_of_space(needs(10_000_000, 4_900_000, staged=False))
    assert short.startswith("/out: ")
    [short] = _short_of_space(needs(21_900_000, 5_000_000, staged=True))
    assert short.startswith("/scratch: ")


def test_a_dry_run_charges_the_spill_to_out_s_file_system_without_a_spill_dir(synthetic_parquet, tmp_path,
                                                                               monkeypatch):
    """Without --spill-dir the spill is written beside OUT: a disk with room for the shards but
    not for the spill besides was not warned about."""
    statvfs = os.statvfs
    args = ("pack", synthetic_parquet, "-o", tmp_path / "out", "--dry-run", "--spill-memory", "0")
    disk = json.loads(run(*args, "--json").stdout)["disk"]
    assert disk["spill_disk_bytes"] > 0 and disk["stage_bytes"] == 0
    assert {what: free["path"] for what, free in disk["free"].items()} == {"spill": str(tmp_path), "output": str(tmp_path)}

    class Tight:
        f_frsize, f_bavail = 1, disk["output_bytes"] + disk["spill_disk_bytes"] // 2

    monkeypatch.setattr(os, "statvfs", lambda path: Tight() if str(path) == str(tmp_path) else statvfs(path))
    result = run(*args)
    warning = [line for line in result.output.splitlines() if "would fail for space" in line]
    assert result.exit_code == 0 and len(warning) == 1 and str(tmp_path) in warning[0], result.output


def test_a_dry_run_estimates_the_spill_with_the_default_memory_cut(synthetic_parquet, tmp_path, monkeypatch):
    """In a container the default --spill-memory is cut to a quarter of the room: the dry run
    estimated with the whole default (no spill on disk) where the run wrote one."""
    from conftest import DEFAULT_SPILL_MEMORY

    from packer_cli import pipeline
    from packer_cli.shards import _gather

    monkeypatch.setattr(pipeline, "DEFAULT_SPILL_MEMORY", DEFAULT_SPILL_MEMORY)
    monkeypatch.setattr(pipeline, "page_cache_room", lambda: 8 << 20)  # a quarter: 2 MiB of the spill
    dry = json.loads(run("pack", synthetic_parquet, "--dry-run", "--json").stdout)["disk"]
    written = []
    close = _gather.SpillWriter.close
    monkeypatch.setattr(_gather.SpillWriter, "close", lambda self: (
        written.append(os.path.getsize(os.path.join(self._dir, _gather.SPILL_FILE))), close(self))[1])
    real = json.loads(run("pack", synthetic_parquet, "-o", tmp_path / "out", "--json").stdout)["spill"]
    assert 0 < real["memory_bytes"] < real["bytes"]
    assert dry["spill_disk_bytes"] == written[0] > 0


def test_every_pack_option_reaches_the_spec_the_run_records(tmp_path):
    """Each option given on the command line is the one the run used and recorded: an option
    passed to the wrong PackSpec/SourceSpec field, or dropped, packed with its default."""
    records = [{"input_ids": list(range(1, n + 1)), "loss_mask": [0, 0] + [1] * (n - 2), "m2": [1] * n,
                "m3": [1] * n} for n in (5, 9, 14, 20, 27, 33, 12, 7)]
    src = write_jsonl(tmp_path / "data.jsonl", records)
    out = tmp_path / "out"
    result = run("pack", src, "-o", out, "-C", "64", "--cp", "2", "--tp", "4", "--sp", "--seed", "5",
                 "--no-refine", "--no-shuffle", "--pad-id", "7", "--vocab-size", "100", "--pad-to-max-length",
                 "--pad-cu-seqlens", "--mask-field", "loss_mask", "--mask-field", "m2", "--mask-field", "m3",
                 "--algorithm", "bfd", "--overlong", "drop", "--on-bad-record", "skip", "--spill-read", "staged",
                 "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    spec, source = summary["spec"], summary["source"]
    assert {k: spec[k] for k in ("pack_size", "cp", "tp", "sp", "seed", "refine", "shuffle", "pad_id",
                                 "pad_to_max_length", "pad_cu_seqlens", "algorithm", "overlong")} == {
        "pack_size": 64, "cp": 2, "tp": 4, "sp": True, "seed": 5, "refine": False, "shuffle": False, "pad_id": 7,
        "pad_to_max_length": True, "pad_cu_seqlens": True, "algorithm": "bfd", "overlong": "drop"}
    assert source["supervision"] == {"kind": "mask", "field": "loss_mask"}
    assert source["also_mask_fields"] == ["m2", "m3"]
    assert (source["vocab_size"], source["on_bad_record"]) == (100, "skip")
    assert summary["spill"]["read"] == "staged"
    recorded = json.loads((out / "metadata.json").read_text())
    assert recorded["spec"] == spec and recorded["source"]["also_mask_fields"] == ["m2", "m3"]
    assert run("verify", out, "--source", src).exit_code == 0


@pytest.mark.parametrize("args,message", [
    (["--split", "validation"], "--split applies only to --format megatron-bridge"),
    (["--eos-id", "2"], "--eos-id applies only to --format megatron-bridge"),
    (["--row-group-size", "8"], "--row-group-size applies only to --format megatron-bridge"),
    (["--parquet-encoding", "plain-snappy"], "--parquet-encoding applies only to --format megatron-bridge"),
    (["--eos-id", "2", "--row-group-size", "8", "--format", "native"],
     "--eos-id, --row-group-size apply only to --format megatron-bridge"),
], ids=["split", "eos-id", "row-group-size", "parquet-encoding", "two"])
def test_bridge_options_on_a_native_output_are_refused_by_name(tmp_path, args, message):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 4)
    for dry in ([], ["--dry-run"]):
        result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 16, *args, *dry)
        assert (result.exit_code, result.output) == (2, f"error: {message}\n"), result.output
    assert_nothing_written(tmp_path)


def test_json_output_asks_for_no_progress_display(tmp_path, monkeypatch):
    """--json is for a program reading stdout: the run shows no progress bars (on a terminal's
    stderr they would interleave with the pipeline's own output); without it, it may."""
    from packer_cli import pipeline

    asked = []

    class Recording(pipeline.Progress):
        def __init__(self, enabled: bool = True):
            asked.append(enabled)
            super().__init__(enabled)

    monkeypatch.setattr(pipeline, "Progress", Recording)
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 4)
    assert run("pack", path, "-o", tmp_path / "a", "--pack-size", 16, "--json").exit_code == 0
    assert run("pack", path, "-o", tmp_path / "b", "--pack-size", 16).exit_code == 0
    assert asked == [False, True]

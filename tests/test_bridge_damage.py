"""`verify` / `inspect` / `PackedReader` on a Megatron-Bridge split whose Parquet file was rewritten
with damaged columns: wrong column kinds and schema metadata, nulls, per-row list lengths that
disagree between columns, stored padding that is not the EOS id, and broken ``seq_start_id``.

Each damaged file is rewritten with the manifest's size and checksum made to hold again, so the
damage itself must be found (never a traceback or a NumPy warning), by a finding that names the
column and the damaged row (the pack index: a split has one file).
"""
from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from typer.testing import CliRunner

from packer_cli import PackSpec, pack
from packer_cli.audit import inspect_output, verify_output
from packer_cli.cli import app
from packer_cli.demo import DEMO_EOS, demo_table
from packer_cli.errors import DataError
from packer_cli.shards.bridge_output import BridgeOutput
from packer_cli.shards.reader import PackedReader

C = 512
DATA = f"training_{C}.idx.parquet"
ROW_GROUP = 4
runner = CliRunner()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A Bridge split with alignment padding (m = 4, EOS given) in many small row groups."""
    root = tmp_path_factory.mktemp("bridge_damage")
    src = root / "src.parquet"
    pq.write_table(demo_table(300, seed=5, max_len=700), src)
    out = root / "good"
    pack([str(src)], str(out), PackSpec(pack_size=C, cp=2, seed=1),
         output=BridgeOutput(eos_id=DEMO_EOS, row_group_size=ROW_GROUP))
    assert verify_output(str(out), sources=[str(src)]).ok
    return {"src": src, "out": out}


@pytest.fixture
def copy(made, tmp_path):
    def make() -> Path:
        return Path(shutil.copytree(made["out"], tmp_path / "out"))
    return make


# -- helpers -------------------------------------------------------------------------------------
def read(out: Path) -> pa.Table:
    return pq.read_table(out / DATA)


def write(out: Path, table: pa.Table, metadata: dict | None = None) -> None:
    """Rewrite the split file with ``table`` and make the manifest's size and checksum hold."""
    if metadata is not None:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, out / DATA, row_group_size=ROW_GROUP, compression="zstd")  # as the manifest records
    _reseal(out)


def _reseal(out: Path) -> None:
    """Make the manifest's size and checksum hold for the split file as it now is."""
    manifest_path = out / "training.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    raw = (out / DATA).read_bytes()
    manifest["shards"][0].update(bytes=len(raw), xxh3_64=xxhash.xxh3_64(raw).hexdigest())
    manifest_path.write_text(json.dumps(manifest))


def flat(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    arr = table.column(name).combine_chunks()
    return np.asarray(arr.values).copy(), np.asarray(arr.offsets).astype(np.int64)


def with_column(table: pa.Table, name: str, values, offsets, value_type=None) -> pa.Table:
    arr = pa.ListArray.from_arrays(pa.array(np.asarray(offsets), pa.int32()),
                                   pa.array(values, type=value_type or table.schema.field(name).type.value_type))
    return table.set_column(table.schema.get_field_index(name), pa.field(name, arr.type), arr)


def verify(out: Path, source: Path | None = None):
    """verify_output with NumPy's warnings made errors (a RuntimeWarning is a bug here too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return verify_output(str(out), sources=[str(source)] if source else None)


def only(report, check: str):
    found = [f for f in report.findings if f.check == check]
    assert not report.ok and found, [f.line() for f in report.findings]
    return found[0]


def assert_cli_reports(out: Path, *texts: str, commands=("verify", "inspect")) -> None:
    """verify and inspect (or ``commands``) exit 1 naming ``texts``, with one-line messages and no traceback."""
    for args in ([command, str(out)] for command in commands):
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        assert "Traceback" not in result.output and "Warning" not in result.output, result.output
        for text in texts:
            assert text in result.output, (args, result.output)


def assert_inspect_skips_the_ids(out: Path, r: int) -> None:
    """Damage to the token ids is verify's to find: inspect, which never reads them (as on native
    shards), reports the split; asked for the damaged pack's detail, it reads them and says so."""
    result = runner.invoke(app, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["inspect", str(out), "--pack", str(r)])
    assert result.exit_code == 1 and f"row {r}: " in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output


def padded_sequence(table: pa.Table, min_row: int = 5) -> tuple[int, int, int, int, int]:
    """(row, seq, a, s, b) of the first sequence at or after ``min_row`` with alignment padding:
    stored slots [a, b) of the row, s real inputs."""
    starts, seq_off = flat(table, "seq_start_id")
    lens, _ = flat(table, "packer_seq_lens")
    _, row_off = flat(table, "input_ids")
    for r in range(min_row, table.num_rows):
        row_starts = starts[seq_off[r]:seq_off[r + 1]]
        ends = np.append(row_starts[1:], row_off[r + 1] - row_off[r])
        for k, (a, b) in enumerate(zip(row_starts, ends)):
            s = lens[seq_off[r] + k]
            if b - a - 1 > s:
                return r, k, int(a), int(s), int(b)
    raise AssertionError("no padded sequence")


# -- 1: the file's schema ------------------------------------------------------------------------
def _plain_ids(table):
    lengths = np.diff(flat(table, "input_ids")[1]).astype(np.int32)
    return table.set_column(0, "input_ids", pa.array(lengths))


def _wide_mask(table):
    return with_column(table, "loss_mask", *flat(table, "loss_mask"), pa.int16())


def _bool_mask(table):
    values, offsets = flat(table, "loss_mask")
    return with_column(table, "loss_mask", values.astype(bool), offsets, pa.bool_())


def _extra(table):
    return table.append_column("extra", pa.array(np.arange(table.num_rows)))


def _missing(table):
    return table.drop_columns(["packer_source_offset"])


def _twice(table):
    return table.append_column("packer_source_offset", table.column("packer_source_offset"))


def _large(table):
    values, offsets = flat(table, "packer_seq_lens")
    arr = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values, pa.int32()))
    return table.set_column(3, pa.field("packer_seq_lens", arr.type), arr)


SCHEMA_DAMAGE = {
    "ids-not-a-list": (_plain_ids, "column input_ids is int32, expected list<int32>"),
    "mask-int16": (_wide_mask, "column loss_mask is list<int16>, expected list<int8>"),
    "mask-bool": (_bool_mask, "column loss_mask is list<bool>, expected list<int8>"),
    "extra-column": (_extra, "unexpected column extra"),
    "missing-column": (_missing, "missing column packer_source_offset"),
    "column-twice": (_twice, "column packer_source_offset appears 2 times"),
    "large-list": (_large, "column packer_seq_lens is large_list<int32>, expected list<int32>"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_DAMAGE))
def test_a_column_of_the_wrong_kind_is_a_finding(copy, case):
    out = copy()
    damage, text = SCHEMA_DAMAGE[case]
    table = read(out)
    write(out, damage(table), table.schema.metadata)
    finding = only(verify(out), "shard.unreadable")
    assert text in finding.message and "\n" not in finding.message and len(finding.message) < 200, finding.message
    assert finding.shard == DATA
    assert_cli_reports(out, text)
    with pytest.raises(DataError, match=text.replace("<", ".").replace(">", ".")):
        PackedReader(out)


SCHEMA_METADATA = {
    "format": ({b"packer_format": b"packer-thd"}, "schema metadata packer_format is 'packer-thd', expected "
                                                  "'megatron-bridge'"),
    "version": ({b"packer_format_version": b"2"}, "schema metadata packer_format_version is '2', expected '1'"),
    "eos-not-recorded": ({b"eos_id": b""}, f"schema metadata eos_id is '', but training.metadata.json records "
                                           f"output.eos_id {DEMO_EOS}"),
    "eos-other": ({b"eos_id": b"7"}, f"schema metadata eos_id is '7', but training.metadata.json records "
                                     f"output.eos_id {DEMO_EOS}"),
    "eos-not-an-id": ({b"eos_id": b"x"}, "schema metadata eos_id is 'x', expected an id or ''"),
    "eos-leading-zero": ({b"eos_id": b"0" + str(DEMO_EOS).encode()},
                         f"schema metadata eos_id is '0{DEMO_EOS}', expected an id or ''"),
    "no-metadata": (None, "schema metadata packer_format is missing, expected 'megatron-bridge'"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_METADATA))
def test_schema_metadata_must_be_what_the_writer_writes(copy, case):
    out = copy()
    edit, text = SCHEMA_METADATA[case]
    table = read(out)
    meta = {} if edit is None else {**table.schema.metadata, **edit}
    write(out, table, meta)
    assert only(verify(out), "shard.unreadable").message.endswith(text)
    assert_cli_reports(out, text)
    with pytest.raises(DataError, match=re.escape(text)):  # a loader that skips the layout checks too
        PackedReader(out, check=False)


def test_nulls_in_a_list_column_are_a_finding(copy):
    out = copy()
    table = read(out)
    values, offsets = flat(table, "input_ids")
    r = 9
    mask = np.zeros(values.size, bool)
    mask[offsets[r] + 3] = True
    arr = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, mask=mask))
    write(out, table.set_column(0, pa.field("input_ids", arr.type), arr), table.schema.metadata)
    finding = only(verify(out), "shard.unreadable")
    assert finding.row == r and "input_ids holds a null value" in finding.message, finding.line()
    assert_cli_reports(out, f"row {r}: input_ids holds a null value", commands=("verify",))
    assert_inspect_skips_the_ids(out, r)


def test_a_null_row_is_a_finding(copy):
    out = copy()
    table = read(out)
    values, offsets = flat(table, "packer_source_index")
    r = 6
    valid = np.ones(table.num_rows, bool)
    valid[r] = False
    # the null row holds no values, as Parquet stores it (pyarrow before 24 cannot write one that spans values)
    values = np.delete(values, np.arange(offsets[r], offsets[r + 1]))
    offsets = np.concatenate([offsets[:r + 1], offsets[r + 1:] - (offsets[r + 1] - offsets[r])])
    arr = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values),
                                   mask=pa.array(~valid))
    write(out, table.set_column(4, pa.field("packer_source_index", arr.type), arr), table.schema.metadata)
    finding = only(verify(out), "shard.unreadable")
    assert finding.row == r and "packer_source_index is null" in finding.message, finding.line()


@pytest.mark.parametrize("wide, at", [(2**32 + 5, 2), (2**31, 0)], ids=["wraps-to-5", "first-past-int32"])
def test_int64_ids_beyond_int32_are_a_finding(copy, wide, at):
    """packer 0.2.0 stored ids as int64 (still read); an id beyond int32 cannot be a native token:
    2**32 + 5 would wrap to 5, 2**31 (the first past the bound, as the row's first id) to -2**31."""
    out = copy()
    table = read(out)
    values, offsets = flat(table, "input_ids")
    values = values.astype(np.int64)
    r = 7
    values[offsets[r] + at] = wide
    write(out, with_column(table, "input_ids", values, offsets, pa.int64()), table.schema.metadata)
    finding = only(verify(out), "shard.unreadable")
    assert finding.row == r and f"input_ids holds id {wide}" in finding.message, finding.line()


# -- 2: per-row list lengths -----------------------------------------------------------------------
@pytest.mark.parametrize("name,like", [("loss_mask", "input_ids"), ("packer_seq_lens", "seq_start_id"),
                                       ("packer_source_index", "seq_start_id"),
                                       ("packer_source_offset", "seq_start_id")])
def test_rows_of_a_column_must_have_their_reference_lengths(copy, made, name, like):
    """One entry moved from row r+1 to row r (the flat values unchanged): found at row r, with
    the packs before it checked."""
    out = copy()
    table = read(out)
    values, offsets = flat(table, name)
    r = 10  # inside a row group (groups of 4): the rows before it in its group are checked too
    offsets[r + 1] += 1
    write(out, with_column(table, name, values, offsets), table.schema.metadata)
    for source in (None, made["src"]):
        report = verify(out, source)
        finding = only(report, "shard.unreadable")
        assert finding.row == r and finding.message.startswith(f"{name} has "), finding.line()
        assert f"but {like} has" in finding.message, finding.line()
        assert report.packs == r
    if like == "input_ids":
        assert_cli_reports(out, f"row {r}: {name} has", commands=("verify",))
        assert_inspect_skips_the_ids(out, r)
    else:
        assert_cli_reports(out, f"row {r}: {name} has")
    with pytest.raises(DataError, match=f"pack {r}: {name} has"):
        reader = PackedReader(out)
        for i in range(len(reader)):
            reader.row(i)


# -- 3: Bridge's stored padding -------------------------------------------------------------------
def test_stored_padding_must_be_the_eos_id(copy):
    out = copy()
    table = read(out)
    r, k, a, s, b = padded_sequence(table)
    values, offsets = flat(table, "input_ids")
    values[offsets[r] + b - 1] = DEMO_EOS + 1  # the last padding slot: natively dropped before
    write(out, with_column(table, "input_ids", values, offsets), table.schema.metadata)
    finding = only(verify(out), "shard.unreadable")
    assert finding.row == r and f"seq {k}" in finding.message, finding.line()
    assert f"input_ids holds {DEMO_EOS + 1} in the stored padding, expected the eos id {DEMO_EOS}" \
        in finding.message, finding.line()


def test_stored_padding_inside_the_runtime_stream_too(copy):
    """The first padding slot after the last label (natively a pad_id position, overwritten)."""
    out = copy()
    table = read(out)
    r, k, a, s, b = padded_sequence(table, min_row=20)
    if b - a - 1 - s < 2:
        pytest.skip("needs two padding slots")
    values, offsets = flat(table, "input_ids")
    values[offsets[r] + a + s + 1] = 0
    write(out, with_column(table, "input_ids", values, offsets), table.schema.metadata)
    report = verify(out)
    finding = only(report, "shard.unreadable")
    assert finding.row == r and f"seq {k}" in finding.message and "stored padding" in finding.message
    assert report.packs == r


def test_loss_on_a_sequence_final_slot(copy):
    out = copy()
    table = read(out)
    starts, seq_off = flat(table, "seq_start_id")
    values, offsets = flat(table, "loss_mask")
    r, k = 13, 0
    end = starts[seq_off[r] + 1] if seq_off[r + 1] - seq_off[r] > 1 else offsets[r + 1] - offsets[r]
    values[offsets[r] + end - 1] = 1
    write(out, with_column(table, "loss_mask", values, offsets), table.schema.metadata)
    finding = only(verify(out), "shard.unreadable")
    assert finding.row == r and f"seq {k}" in finding.message and "final stored slot" in finding.message, \
        finding.line()


def _stored_padding_not_eos(out: Path) -> pa.Table:
    """The split rewritten with one sequence's last stored padding slot holding EOS + 1 (the
    manifest made to hold); returns the table as it was."""
    table = read(out)
    r, k, a, s, b = padded_sequence(table)
    values, offsets = flat(table, "input_ids")
    values[offsets[r] + b - 1] = DEMO_EOS + 1
    write(out, with_column(table, "input_ids", values, offsets), table.schema.metadata)
    return table


def test_inspect_does_not_read_token_ids(copy):
    """Like a native output's, a Bridge split's token values are verify's to check."""
    out = copy()
    table = _stored_padding_not_eos(out)
    assert inspect_output(str(out)).packs == table.num_rows
    assert not verify(out).ok


# -- 4: seq_start_id -------------------------------------------------------------------------------
def _starts(edit):
    def damage(table, r):
        values, offsets = flat(table, "seq_start_id")
        lo, hi = offsets[r], offsets[r + 1]
        assert hi - lo >= 3
        edit(values[lo:hi], np.diff(flat(table, "input_ids")[1])[r])
        return with_column(table, "seq_start_id", values, offsets)
    return damage


def _swap(starts, n):
    starts[[1, 2]] = starts[[2, 1]]


def _negative(starts, n):
    starts[1] = -3


def _duplicate(starts, n):
    starts[2] = starts[1]


def _beyond(starts, n):
    starts[-1] = n + 5


def _first(starts, n):
    starts[0] = 1


START_DAMAGE = {
    "out-of-order": (_swap, "seq_start_id is not increasing"),
    "negative": (_negative, "seq_start_id is not increasing"),
    "duplicate": (_duplicate, "seq_start_id is not increasing"),
    "beyond-the-row": (_beyond, "beyond the row's"),
    "first-not-zero": (_first, "seq_start_id starts at 1, not 0"),
}


@pytest.mark.parametrize("case", sorted(START_DAMAGE))
def test_damaged_seq_start_id_names_its_row(copy, made, case):
    out = copy()
    table = read(out)
    edit, text = START_DAMAGE[case]
    counts = np.diff(flat(table, "seq_start_id")[1])
    r = int(np.flatnonzero(counts[10:] >= 3)[0]) + 10
    write(out, _starts(edit)(table, r), table.schema.metadata)
    for source in (None, made["src"]):
        report = verify(out, source)
        finding = only(report, "shard.unreadable")
        assert finding.row == r and text in finding.message, finding.line()
        assert "repeats" not in finding.message and "broadcast" not in finding.message
    assert_cli_reports(out, f"row {r}: ", text)


def bridge_rows(ids, mask, starts, lens=2, index=0, offset=0) -> pa.Table:
    """Bridge's columns (its schema) from Python lists, a list a row; ``lens``, ``index`` and
    ``offset`` are each a list of rows, or one value for every sequence."""
    from packer_cli.shards.bridge_writer import BRIDGE_SCHEMA

    def per_seq(given):
        return given if isinstance(given, list) else [[given] * len(row) for row in starts]

    return pa.table([pa.array(ids, pa.list_(pa.int32())), pa.array(mask, pa.list_(pa.int8())),
                     pa.array(starts, pa.list_(pa.int32())), pa.array(per_seq(lens), pa.list_(pa.int32())),
                     pa.array(per_seq(index), pa.list_(pa.int64())), pa.array(per_seq(offset), pa.list_(pa.int32()))],
                    schema=BRIDGE_SCHEMA)


def test_native_columns_names_the_first_bad_row():
    from packer_cli.shards.bridge_reader import native_columns

    table = bridge_rows([[5, 6, 7, 2], [5, 6, 2, 8, 9, 2], [1, 2, 3]], [[1, 1, 0, 0], [1, 0, 0, 1, 0, 0], [1, 1, 0]], [[0], [0, 3], [0]], index=[[0], [1, 2], [3]])
    cols = native_columns(table, pad_id=0)
    assert cols["tokens"][0].tolist() == [5, 6, 0, 5, 6, 8, 9, 1, 2]
    bad = table.set_column(2, "seq_start_id", pa.array([[0], [0, 7], [0]], pa.list_(pa.int32())))
    with pytest.raises(ValueError, match=r"^row 1: seq_start_id 7 at seq 1 is beyond the row's 6 stored slots"):
        native_columns(bad, pad_id=0)
    with pytest.raises(ValueError, match=r"^row 0: seq_start_id 7 at seq 1 is beyond"):
        native_columns(bad.slice(1), pad_id=0)
    edge = table.set_column(2, "seq_start_id", pa.array([[0], [0, 6], [0]], pa.list_(pa.int32())))
    with pytest.raises(ValueError, match=r"^row 1: seq_start_id 6 at seq 1 is beyond the row's 6 stored slots"):
        native_columns(edge, pad_id=0)  # the first start past the row: no stored slot left for it


def test_native_columns_names_the_first_of_several_nulls():
    """Nulls in two rows (null values, null rows): the error names the first row that holds one,
    a null value that is its row's first value included."""
    from packer_cli.shards.bridge_reader import native_columns

    table = bridge_rows([[5, 6, 7, 2], [None, 6, 2, 8, 9, 2], [1, None, 3]], [[1, 1, 0, 0], [1, 0, 0, 1, 0, 0], [1, 1, 0]], [[0], [0, 3], [0]],
                        index=[[0], None, None])
    with pytest.raises(ValueError, match=r"^row 1: input_ids holds a null value$"):
        native_columns(table, pad_id=0)
    with pytest.raises(ValueError, match=r"^row 1: packer_source_index is null$"):
        native_columns(table, pad_id=0, tokens=False)


@pytest.mark.parametrize("r", [1, 2])
def test_a_row_holding_no_sequence_is_named(r):
    """A row whose seq_start_id (and so each packer column) is empty has no sequence to convert:
    named, whether another row follows it (its tokens went to the row before) or not."""
    from packer_cli.shards.bridge_reader import native_columns

    starts = [[0], [0, 3], [0]]
    starts[r] = []
    table = bridge_rows([[5, 6, 7, 2], [5, 6, 2, 8, 9, 2], [1, 2, 3]], [[1, 1, 0, 0], [1, 0, 0, 1, 0, 0], [1, 1, 0]], starts)
    with pytest.raises(ValueError, match=f"^row {r}: seq_start_id is empty"):
        native_columns(table, pad_id=0)


def test_reader_schema_is_the_writers():
    """bridge_reader keeps its own copy of the column types (the writer's module loads numba)."""
    from packer_cli.shards.bridge_reader import COLUMN_TYPES
    from packer_cli.shards.bridge_writer import BRIDGE_SCHEMA

    assert tuple(COLUMN_TYPES) == tuple(BRIDGE_SCHEMA.names)
    assert [types[0] for types in COLUMN_TYPES.values()] == [f.type.value_type for f in BRIDGE_SCHEMA]


def test_source_findings_in_packs_before_a_damaged_row(copy, made):
    """verify --source reads a batch again to name a differing token: also a batch cut out of a
    damaged run (one row group, or the rows before the bad one)."""
    out = copy()
    table = read(out)
    values, offsets = flat(table, "input_ids")
    values[offsets[5] + 1] += 1    # row 5: in row group 1, a batch of its own once the run fails
    values[offsets[9] + 1] += 1    # row 9: before the damaged row 10 of row group 2
    starts, seq_off = flat(table, "seq_start_id")
    starts[seq_off[10]] = 1        # row 10 is damaged
    table = with_column(with_column(table, "input_ids", values, offsets), "seq_start_id", starts, seq_off)
    write(out, table, table.schema.metadata)
    report = verify(out, made["src"])
    assert only(report, "shard.unreadable").row == 10
    rows = sorted(f.row for f in report.findings if f.check == "source.tokens")
    assert rows == [5, 9], [f.line() for f in report.findings]
    assert all("position 1 is" in f.message for f in report.findings if f.check == "source.tokens"), [
        f.line() for f in report.findings]


def _footer_read_both_ways(path) -> list:
    """What ``_unsafe_footer`` says of ``path`` with numba loaded (compiled walk) and without (pure Python)."""
    import importlib
    import sys

    from packer_cli.audit._bridge_checks import _unsafe_footer

    assert importlib.import_module("numba")  # loaded, as in verify and inspect
    said = []
    for numba_loaded in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            if not numba_loaded:
                patch.delitem(sys.modules, "numba", raising=False)
            said.append(_unsafe_footer(str(path), pq.ParquetFile(path).metadata))
    return said


def _write_resealed(out, raw: bytearray) -> None:
    """Write the damaged data file and make the manifest's size and checksum hold for it, so that
    only the footer's own checks can find the damage."""
    (out / DATA).write_bytes(bytes(raw))
    _reseal(out)


def _rewrite_footer(out: Path, edit) -> None:
    """Apply ``edit`` to the split file's parsed footer (packer's typed Thrift view, in place) and
    write the file back with it, resealed: the pages stay as they are."""
    from packer_cli._thrift import write_fields
    from packer_cli.shards._parquet_stitch import MAGIC, _parse

    view, start, footer = _parse((out / DATA).read_bytes())
    edit(footer)
    tail = bytearray()
    write_fields(tail, footer)
    _write_resealed(out, bytearray(bytes(view[:start]) + bytes(tail) + len(tail).to_bytes(4, "little") + MAGIC))


def test_an_unknown_codec_in_the_footer_is_a_finding_not_an_abort(copy):
    # One flipped bit turned a column chunk's codec from ZSTD (6) into 22: pyarrow's
    # ColumnChunkMetaData.compression threw a C++ exception Python cannot catch, and verify and
    # inspect ended with SIGABRT (found by a review). The footer is now walked by packer first.
    import subprocess
    import sys

    out = copy()
    copy_of_good = out.parent / "good.parquet"
    shutil.copyfile(out / DATA, copy_of_good)
    raw = bytearray((out / DATA).read_bytes())
    footer_start = len(raw) - 8 - int.from_bytes(raw[-8:-4], "little")
    # compact protocol: path_in_schema ends "...element", then field 4 (codec, i32: 0x15) zigzag(6) = 12
    at = raw.index(b"element\x15\x0c", footer_start) + len(b"element\x15")
    raw[at] = 44  # zigzag(22)
    _write_resealed(out, raw)
    # both ways of reading the footer first: compiled (verify, inspect) and pure Python (the PyTorch side)
    assert _footer_read_both_ways(out / DATA) == ["a column chunk names an unknown codec"] * 2
    assert _footer_read_both_ways(copy_of_good) == [None, None]
    for command in (["verify"], ["inspect", "--json"]):  # a process of its own: an abort would end pytest's
        done = subprocess.run([sys.executable, "-m", "packer_cli.cli", *command, str(out)], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 1, (command, done.returncode, done.stderr[-2000:])
        assert "its footer cannot be read: a column chunk names an unknown codec [bridge.file]" in \
            done.stdout + done.stderr, (done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and "terminate called" not in done.stderr


@pytest.mark.parametrize("chunk, codec", [("last", 22), ("first", 8)], ids=["a-later-chunk", "codec-8"])
def test_an_unknown_codec_in_any_column_chunk_is_a_finding(copy, chunk, codec):
    """Every column chunk's codec is looked at before pyarrow's accessors are asked (not only
    the first chunk's), and 8, the first number past LZ4_RAW (7), is unknown to both readers."""
    import subprocess
    import sys

    out = copy()
    raw = bytearray((out / DATA).read_bytes())
    footer_start = len(raw) - 8 - int.from_bytes(raw[-8:-4], "little")
    marks = [footer_start + m.start() for m in re.finditer(re.escape(b"element\x15\x0c"), raw[footer_start:])]
    assert len(marks) > 1  # several column chunks (row groups of ROW_GROUP rows)
    at = (marks[-1] if chunk == "last" else marks[0]) + len(b"element\x15")
    raw[at] = 2 * codec  # zigzag
    _write_resealed(out, raw)
    assert _footer_read_both_ways(out / DATA) == ["a column chunk names an unknown codec"] * 2
    done = subprocess.run([sys.executable, "-m", "packer_cli.cli", "verify", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "its footer cannot be read: a column chunk names an unknown codec [bridge.file]" in done.stdout, done.stdout

def _write_groups(out: Path, table: pa.Table, sizes: list[int], compression="zstd") -> None:
    """Rewrite the split file with row groups of ``sizes`` rows (and ``compression``, one codec
    or one per column), making the manifest's size and checksum hold."""
    assert sum(sizes) == table.num_rows
    with pq.ParquetWriter(out / DATA, table.schema, compression=compression) as writer:
        at = 0
        for n in sizes:
            writer.write_table(table.slice(at, n), row_group_size=n)
            at += n
    _reseal(out)


@pytest.mark.parametrize("layout", ["one-before-the-last-short", "the-last-long"])
def test_row_groups_other_than_the_recorded_size_are_a_finding(copy, layout):
    """Every row group but the last holds row_group_size rows, and the last one 1 to that many:
    a file whose next-to-last group is short, or whose last group is longer, is named."""
    out = copy()
    table = read(out)
    n = table.num_rows
    sizes = [ROW_GROUP] * (n // ROW_GROUP) + ([n % ROW_GROUP] if n % ROW_GROUP else [])
    assert len(sizes) > 2
    if layout == "the-last-long":  # (one group fewer: row_groups is named too)
        sizes[-2:] = [sizes[-2] + sizes[-1]]
    elif sizes[-1] < ROW_GROUP:  # as many groups as recorded: this finding alone
        sizes[-2:] = [sizes[-2] - 1, sizes[-1] + 1]
    else:
        sizes[-1:] = [sizes[-1] - 1, 1]
    _write_groups(out, table, sizes)
    found = [f.message for f in verify(out).findings if f.check == "bridge.file"]
    assert any(m.startswith(f"row_group_size is {ROW_GROUP}, the file's groups hold ") for m in found), found


def test_columns_of_another_codec_than_the_recorded_encoding_are_a_finding(copy):
    """The recorded encoding's codec must be every column's: one column compressed otherwise
    (the others as recorded) is named."""
    out = copy()
    table = read(out)
    encoding = json.loads((out / "training.manifest.json").read_text())["shards"][0]["parquet_encoding"]
    assert encoding.endswith("zstd")
    schema = pq.ParquetFile(out / DATA).schema  # codecs are set per leaf column (a list's "x.list.element")
    leaves = [schema.column(c).path for c in range(len(schema))]
    codecs = {leaf: "zstd" for leaf in leaves} | {leaves[-1]: "snappy"}
    _write_groups(out, table, [min(ROW_GROUP, table.num_rows - at) for at in range(0, table.num_rows, ROW_GROUP)],
                  compression=codecs)
    found = [f.message for f in verify(out).findings if f.check == "bridge.file"]
    assert f"parquet_encoding is {encoding}, the file's columns are compressed with SNAPPY, ZSTD" in found, found

def _pages_hold_more_than_the_footer_states(out: Path, times: int, columns=None) -> list[list[int]]:
    """Rewrite the split file with every list of ``columns`` (default: all) ``times`` times as
    long, then its footer's value counts set back to the original's (which the manifest's
    ``stored_tokens`` agrees with), so only the pages' headers tell; returns the original
    counts, by row group and column."""
    meta = pq.ParquetFile(out / DATA).metadata
    stated = [[meta.row_group(g).column(c).num_values for c in range(meta.num_columns)]
              for g in range(meta.num_row_groups)]
    table = read(out)
    longer = [pa.array([row * times for row in table.column(name).to_pylist()], table.schema.field(name).type)
              if columns is None or name in columns else table.column(name) for name in table.column_names]
    write(out, pa.table(longer, schema=table.schema))

    def state_the_original_counts(footer):
        for g, group in enumerate(next(value for fid, _, value in footer if fid == 4)[1]):
            for c, chunk in enumerate(next(value for fid, _, value in group if fid == 1)[1]):
                column_meta = next(value for fid, _, value in chunk if fid == 3)
                column_meta[:] = [(fid, k, stated[g][c] if fid == 5 else value) for fid, k, value in column_meta]

    _rewrite_footer(out, state_the_original_counts)
    return stated


@pytest.mark.parametrize("decoder", ["packer", "arrow"])
def test_pages_holding_more_values_than_the_footer_states_are_not_decoded(copy, monkeypatch, decoder):
    """A footer agreeing with the manifest over pages that hold 20 times its values: pyarrow,
    given the run, decoded every value the pages held (200 times took 0.8 GB on a 1.2 MB file)
    before the rows were found wrong. The page headers are now counted first, whichever decoder
    reads the file, and pyarrow is never asked to decode such a run."""
    out = copy()
    stated = _pages_hold_more_than_the_footer_states(out, times=20)
    monkeypatch.setenv("PACKER_PARQUET_DECODER", decoder)

    def never(*args, **kwargs):
        raise AssertionError("pyarrow was asked to decode pages that hold more values than the footer states")

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", never)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", never)
    ids = stated[0][0]
    said = f"column 'input_ids': its footer entry states {ids:,} values, its pages' headers {20 * ids:,}"
    found = only(verify(out), "shard.unreadable")
    assert (found.row, found.message) == (0, f"row group 0 is unreadable ({said})")
    loss = stated[0][1]  # inspect reads no ids: the first column it reads is the loss mask
    assert_cli_reports(out, f"column 'loss_mask': its footer entry states {loss:,} values, its pages' headers "
                            f"{20 * loss:,}", commands=("inspect",))
    with pytest.raises(DataError, match=f"^{out / DATA}: cannot read row group 0 \\({said}\\); run `packer verify`"):
        PackedReader(str(out)).row(0)


def test_pages_holding_fewer_values_than_the_footer_states_are_a_finding(copy):
    """The other way round: a footer stating twice the ids the pages hold. pyarrow decodes what
    the pages hold, so only the page headers tell; the loader refuses the row group too."""
    out = copy()
    ids = pq.ParquetFile(out / DATA).metadata.row_group(0).column(0).num_values

    def state_twice_the_ids(footer):
        for group in next(value for fid, _, value in footer if fid == 4)[1]:
            chunk = next(value for fid, _, value in group if fid == 1)[1][0]  # input_ids
            column_meta = next(value for fid, _, value in chunk if fid == 3)
            column_meta[:] = [(fid, k, 2 * value if fid == 5 else value) for fid, k, value in column_meta]

    _rewrite_footer(out, state_twice_the_ids)
    said = f"column 'input_ids': its footer entry states {2 * ids:,} values, its pages' headers {ids:,}"
    found = only(verify(out), "shard.unreadable")
    assert (found.row, found.message) == (0, f"row group 0 is unreadable ({said})")
    with pytest.raises(DataError, match=f"^{out / DATA}: cannot read row group 0 \\({said}\\)"):
        PackedReader(str(out), check=False).row(0)


def test_a_negative_row_count_another_group_makes_up_for_is_a_finding(copy):
    """Row group 0 claiming -n rows and row group 1 n more than it holds: the counts still add up
    to the footer's total, but a negative one is damage all the same (inspect summarized the
    split as healthy and the loader raised IndexError on pack 5)."""
    out = copy()
    meta = pq.ParquetFile(out / DATA).metadata
    first, second = meta.row_group(0).num_rows, meta.row_group(1).num_rows

    def move_rows_to_the_second_group(footer):
        groups = next(value for fid, _, value in footer if fid == 4)[1]
        for g, rows in ((0, -first), (1, second + 2 * first)):
            groups[g] = [(fid, k, rows if fid == 3 else value) for fid, k, value in groups[g]]

    _rewrite_footer(out, move_rows_to_the_second_group)
    assert pq.ParquetFile(out / DATA).metadata.num_rows == meta.num_rows
    text = f"its footer's row groups hold -{first}, {second + 2 * first}, "
    assert text in only(verify(out), "shard.unreadable").message
    assert_cli_reports(out, text)
    with pytest.raises(DataError, match=f"{DATA}: {text}"):
        PackedReader(str(out), check=False)


def test_inspect_walks_the_id_pages_when_a_packs_detail_reads_them(copy, monkeypatch):
    """inspect never decodes the ids, so pages of ids that hold more values than the footer
    states pass its summary; ``--pack`` reads them, and the headers are counted first there too."""
    out = copy()
    ids = _pages_hold_more_than_the_footer_states(out, times=20, columns=["input_ids"])[0][0]
    assert runner.invoke(app, ["inspect", str(out)]).exit_code == 0
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", None)  # not called: it would raise TypeError
    result = runner.invoke(app, ["inspect", str(out), "--pack", "1"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert (f"row group 0: column 'input_ids': its footer entry states {ids:,} values, its pages' headers "
            f"{20 * ids:,}") in result.output, result.output


def test_page_headers_that_agree_with_the_footer_are_read_once_a_row_group(copy, monkeypatch):
    """The loader walks a row group's page headers the first time it decodes the group only (a
    shuffled read decodes one many times), and its rows are what pyarrow reads."""
    import packer_cli.shards.bridge_reader as bridge_reader

    walked = []
    real = bridge_reader.pages_problem
    monkeypatch.setattr(bridge_reader, "pages_problem",
                        lambda fd, size, pf, group, columns: walked.append(group) or real(fd, size, pf, group, columns))
    out = copy()
    reader, table = PackedReader(str(out)), read(out)
    order = [0, 5, 1, 9, 0, 5, 2, len(reader) - 1]
    for i in order:  # the loss mask's labelled slots are Bridge's stored ones
        assert reader.row(i).loss_mask.sum() == np.asarray(table.column("loss_mask")[i].values).sum() > 0
    assert walked == list(dict.fromkeys(i // ROW_GROUP for i in order))  # each group once, in first-read order


def test_bridge_reader_refuses_ids_and_versions_past_their_bounds(tmp_path):
    """The first value past each bound the reader checks: an EOS id of 2**31 in the schema
    metadata, a pad id of 2**31 in the spec, and a format version that is not the integer 1
    (1.0, true); and the writer's column order, with two columns swapped."""
    from packer_cli.shards.bridge import BRIDGE_FORMAT, BRIDGE_FORMAT_VERSION, split_manifest_name, split_metadata_name
    from packer_cli.shards.bridge_reader import load_bridge_metadata, pad_id_of, schema_problem
    from packer_cli.shards.bridge_writer import BRIDGE_SCHEMA

    def schema(eos) -> pa.Schema:
        return BRIDGE_SCHEMA.with_metadata({"packer_format": BRIDGE_FORMAT,
                                            "packer_format_version": str(BRIDGE_FORMAT_VERSION), "eos_id": str(eos)})

    assert schema_problem(schema(2**31 - 1)) is None
    assert schema_problem(schema(2**31)) == "schema metadata eos_id is '2147483648', expected an id or ''"
    assert pad_id_of({"spec": {"pad_id": 2**31 - 1}}) == 2**31 - 1
    with pytest.raises(DataError, match=r"^spec\.pad_id is 2147483648, not a token id$"):
        pad_id_of({"spec": {"pad_id": 2**31}})
    with pytest.raises(DataError, match=r"^spec\.pad_id is True, not a token id$"):  # a bool is no id
        pad_id_of({"spec": {"pad_id": True}})
    fields = list(schema(2))
    swapped = pa.schema([fields[1], fields[0], *fields[2:]], metadata=schema(2).metadata)
    assert schema_problem(swapped) == ("schema differs from the megatron-bridge version 1 schema: column 0 is "
                                       "loss_mask, expected input_ids")
    for version in (1.0, True):
        out = tmp_path / str(version)
        out.mkdir()
        for name in (split_metadata_name("training"), split_manifest_name("training")):
            (out / name).write_text(json.dumps({"format": BRIDGE_FORMAT, "format_version": version,
                                                "split": "training"}))
        with pytest.raises(DataError, match=f"unsupported megatron-bridge version {version}; this packer reads "
                                            f"version {BRIDGE_FORMAT_VERSION}"):
            load_bridge_metadata(str(out), "training")


def test_a_real_length_of_zero_is_left_to_the_pack_checks():
    """A sequence of real length 0 has no stored padding to check: native_columns converts it
    (pack.lengths names it), where checking its padding blamed Bridge's stored padding."""
    from packer_cli.shards.bridge_reader import native_columns

    table = bridge_rows([[5, 7, 7]], [[0, 0, 0]], [[0]], lens=0)
    assert native_columns(table, 0, check_padding=True, eos=2)["seq_lens"][0].tolist() == [0]


def test_a_negative_real_length_is_left_to_the_pack_checks():
    """A real length of -100 is kept in seq_lens for pack.lengths to name, and clipped for the
    conversion (unclipped it indexed 97 slots before the table: IndexError, a malformed group)."""
    from packer_cli.shards.bridge_reader import native_columns

    table = bridge_rows([[5, 6, 7, 2], [5, 6, 2, 8, 9, 2]], [[1, 1, 0, 0], [1, 0, 0, 1, 0, 0]], [[0], [0, 3]],
                        lens=[[2], [-100, 2]])
    for check in (False, True):
        cols = native_columns(table, 0, check_padding=check, eos=2)
        assert cols["seq_lens"][0].tolist() == [2, -100, 2]
        assert cols["tokens"][0].tolist() == [5, 6, 0, 0, 0, 8, 9]
        assert cols["last_token"][0].tolist() == [7, 5, 2]  # the clipped length 0's last token: the seq's first


def test_stored_padding_checks_name_the_first_bad_row_whichever_the_kind():
    """Row 0's stored padding is not the EOS id, row 1's final slot has loss: row 0 is named."""
    from packer_cli.shards.bridge_reader import native_columns

    table = bridge_rows([[5, 6, 7, 9, 2], [5, 6, 7, 2, 2]], [[1, 1, 0, 0, 0], [1, 1, 0, 0, 1]], [[0], [0]])
    with pytest.raises(ValueError, match=r"^row 0: seq 0: input_ids holds 9 in the stored padding, expected the eos id 2$"):
        native_columns(table, 0, check_padding=True, eos=2)


def test_a_pack_index_one_past_either_end_is_an_index_error(copy):
    reader = PackedReader(str(copy()))
    n = len(reader)
    assert reader.row(n - 1).tokens.tolist() == reader.row(-1).tokens.tolist()
    assert reader.row(-n).tokens.tolist() == reader.row(0).tokens.tolist()
    for i in (n, -n - 1):
        with pytest.raises(IndexError, match=f"pack {i} out of range for {n} packs"):
            reader.row(i)


@pytest.mark.parametrize("size", [-1024, 0])
def test_an_unusable_pack_size_names_no_file_of_that_size(copy, size):
    """A Bridge split whose recorded pack size is -1024 or 0 (resealed): the spec is the finding;
    the files are not then judged by names made of that size (``training_-1024.idx.parquet``,
    ``0_metadata.jsonl``), which were findings about files nobody wrote."""
    from packer_cli.shards.format import seal_metadata

    out = copy()
    path = out / "training.metadata.json"
    doc = json.loads(path.read_text())
    doc["spec"]["pack_size"] = size
    doc.pop("checksum")
    path.write_text(json.dumps(seal_metadata(doc)))
    report = verify(out)
    assert {f.check for f in report.findings} == {"metadata.spec", "structure.files"}, [
        f.line() for f in report.findings]
    assert not any(f"{size}_metadata.jsonl" in f.line() or f"_{size}.idx" in f.line() for f in report.findings)


def test_the_audit_stores_read_of_the_ids_checks_bridges_stored_padding(copy):
    """Asked for the token ids by name (the store interface's columns), the Bridge store checks
    the stored padding as verify's read does, not only when asked for every column."""
    from packer_cli.audit.store import COLUMNS, ShardError
    from packer_cli.shards.bridge_store import BridgeStore

    out = copy()
    _stored_padding_not_eos(out)
    store = BridgeStore.open(str(out))
    for columns in (None, COLUMNS, ["tokens"]):
        with pytest.raises(ShardError, match="in the stored padding, expected the eos id"):
            for _ in store.read_shard(store.shard_names()[0], columns):
                pass


def test_an_entry_that_may_be_another_splits_is_not_taken_for_the_replaced_ones():
    """One entry left and one other split whose values are unknown (Bridge wrote it, without
    packer's metadata): the entry may be that split's, so replacing this split removes none
    and says why (it removed the other split's entry, silently)."""
    from packer_cli.shards.bridge_output import old_entry_index

    entry = {"dataset_max_seqlen": 300, "max_samples_per_bin": 3, "packing_factor": 2.0,
             "packing_efficiency": 90.0, "pack_size": C, "min_packed_seqlen": 100}
    index, why = old_entry_index([entry], "training", [("validation", None)], dict(entry))
    assert index is None and why, (index, why)
    assert old_entry_index([entry, dict(entry, dataset_max_seqlen=9)], "training", [("validation", None)],
                           dict(entry)) == (0, None)  # one more entry than splits that may hold one


def test_an_entry_another_writer_added_while_the_split_was_packed_is_kept(copy, made, monkeypatch):
    """Replacing a split removes its old entry from Bridge's metadata array by value, as the
    array is when the run ends: an entry another writer put in front meanwhile stays (the old
    entry's index alone pointed at the newcomer)."""
    out = copy()
    array = out / f"{C}_metadata.jsonl"
    before = json.loads(array.read_text())
    other = {"dataset_max_seqlen": 7, "max_samples_per_bin": 1, "packing_factor": 1.0, "packing_efficiency": 1.0,
             "pack_size": C, "min_packed_seqlen": 9}
    write_output = BridgeOutput.write

    def another_writer_first(self, *args, **kwargs):
        array.write_text(json.dumps([other] + json.loads(array.read_text())))
        return write_output(self, *args, **kwargs)

    monkeypatch.setattr(BridgeOutput, "write", another_writer_first)
    pack([str(made["src"])], str(out), PackSpec(pack_size=C, cp=2, seed=1), overwrite=True,
         output=BridgeOutput(eos_id=DEMO_EOS, row_group_size=ROW_GROUP))
    assert json.loads(array.read_text()) == [other] + before  # the same plan: the same entry again


def test_source_findings_in_the_pack_just_before_a_damaged_second_row(copy, made):
    """When the damaged row is the second of its row group, the group's first pack is still
    read as a batch of its own and checked against the source."""
    out = copy()
    table = read(out)
    values, offsets = flat(table, "input_ids")
    values[offsets[2 * ROW_GROUP] + 1] += 1      # the first row of row group 2
    starts, seq_off = flat(table, "seq_start_id")
    starts[seq_off[2 * ROW_GROUP + 1]] = 1       # its second row is damaged
    table = with_column(with_column(table, "input_ids", values, offsets), "seq_start_id", starts, seq_off)
    write(out, table, table.schema.metadata)
    report = verify(out, made["src"])
    assert only(report, "shard.unreadable").row == 2 * ROW_GROUP + 1
    rows = [f.row for f in report.findings if f.check == "source.tokens"]
    assert rows == [2 * ROW_GROUP], [f.line() for f in report.findings]

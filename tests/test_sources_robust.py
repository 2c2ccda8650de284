"""Inputs that used to crash or read as valid: each must be a one-line error naming the file and record."""
from __future__ import annotations

import io
import json
import os
import re

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from packer_cli.cli import app
from packer_cli.errors import ConfigError, DataError
from packer_cli.sources import SampleStream, discover_inputs
from packer_cli.spec import SourceSpec

runner = CliRunner()
GOOD = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, exit_code: int, text: str) -> None:
    assert result.exit_code == exit_code, result.output
    assert text in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output


def assert_nothing_written(parent):
    assert [p.name for p in parent.iterdir() if p.name.startswith("out")] == []


def assert_pack_refuses(tmp_path, path, text: str) -> None:
    """``packer pack path`` fails with a one-line data error (exit 1) and writes nothing."""
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 64)
    assert_one_line_error(result, 1, text)
    assert_nothing_written(tmp_path)


def records(path, spec=SourceSpec()) -> int:
    stream = SampleStream(discover_inputs([str(path)]), spec)
    for _ in stream:
        pass
    return stream.records


# --- D1: one column named as both tokens and supervision ---------------------------------

def _two_column_input(tmp_path, fmt: str):
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text(json.dumps(GOOD) + "\n")
    else:
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({k: [v] for k, v in GOOD.items()}), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("options", [
    ["--mask-field", "input_ids"],
    ["--labels-field", "input_ids"],
    ["--tokens-field", "loss_mask"],  # auto-detection then picks loss_mask as the mask too
    ["--tokens-field", "loss_mask", "--dry-run"],
])
def test_tokens_and_supervision_in_one_column_is_a_config_error(tmp_path, fmt, options):
    path = _two_column_input(tmp_path, fmt)
    result = run("pack", path, "-o", tmp_path / "out", *options)
    column = "loss_mask" if "--tokens-field" in options else "input_ids"
    assert_one_line_error(result, 2, f"'{column}'")
    assert "is the tokens field (--tokens-field) and cannot also be" in result.output
    assert_nothing_written(tmp_path)


def test_tokens_and_supervision_in_one_column_raised_by_the_stream(tmp_path):
    path = _two_column_input(tmp_path, "jsonl")
    with pytest.raises(ConfigError, match="cannot also be the mask field"):
        records(path, SourceSpec(mask_field="input_ids"))


# --- D2: malformed datasets state.json ------------------------------------------------------

def _datasets_dir(tmp_path, state) -> str:
    """A save_to_disk-like directory: one stream-format Arrow file and the given state.json."""
    root = tmp_path / "ds"
    root.mkdir()
    table = pa.table({k: [v] for k, v in GOOD.items()})
    with pa.ipc.new_stream(str(root / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)
    (root / "state.json").write_text(json.dumps(state))
    return str(root)


def test_well_formed_datasets_dir_reads(tmp_path):
    root = _datasets_dir(tmp_path, {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    assert records(root) == 1


@pytest.mark.parametrize("state,reason", [
    ({"_data_files": [{"filename": 5}]}, "filename"),
    ({"_data_files": [{"filename": None}]}, "filename"),
    ({"_data_files": [{"filename": ""}]}, "filename"),
    ({"_data_files": [{"filename": "../data-00000-of-00001.arrow"}]}, "outside"),
    ({"_data_files": [{"filename": "sub/../../x.arrow"}]}, "outside"),
    ({"_data_files": [{"filename": "/etc/passwd"}]}, "outside"),
    ({"_data_files": [{}]}, "filename"),
    ({"_data_files": ["data-00000-of-00001.arrow"]}, "_data_files"),
    ({"_data_files": {"filename": "data-00000-of-00001.arrow"}}, "_data_files"),
    ({"_data_files": []}, "no data files"),
    ({"_data_files": None}, "_data_files"),
    ([{"_data_files": []}], "_data_files"),
    ({"_data_files": [{"filename": "sub/data-00000-of-00001.arrow"}]}, "not a plain file name"),
])
def test_malformed_state_json_is_a_data_error(tmp_path, state, reason):
    root = _datasets_dir(tmp_path, state)
    with pytest.raises(DataError, match="state.json") as caught:
        discover_inputs([root])
    assert reason in str(caught.value) and "\n" not in str(caught.value)


def test_a_data_file_through_a_linked_subdirectory_is_refused(tmp_path):
    """state.json named sub/x.arrow, sub a link to a directory outside the dataset: it was read."""
    root = _datasets_dir(tmp_path, {"_data_files": [{"filename": "sub/data-00000-of-00001.arrow"}]})
    (tmp_path / "elsewhere").mkdir()
    os.rename(f"{root}/data-00000-of-00001.arrow", tmp_path / "elsewhere" / "data-00000-of-00001.arrow")
    os.symlink(tmp_path / "elsewhere", f"{root}/sub")
    assert_pack_refuses(tmp_path, root, "state.json: _data_files[0].filename 'sub/data-00000-of-00001.arrow' "
                                        "is not a plain file name")


def test_a_state_json_without_data_files_is_no_datasets_directory(tmp_path):
    """Only a state.json listing _data_files makes a datasets directory, as for a subdirectory."""
    root = _datasets_dir(tmp_path, {"global_step": 100})
    assert records(root) == 1  # its Arrow file read as any other


def test_malformed_state_json_on_the_command_line(tmp_path):
    root = _datasets_dir(tmp_path, {"_data_files": [{"filename": 5}]})
    assert_pack_refuses(tmp_path, root, "state.json")


# --- D6: truncated or corrupt .jsonl.zst ------------------------------------------------------

def _lines(first: int, rows: int) -> bytes:
    return b"".join(orjson.dumps({"input_ids": [first, 2, 3, i], "loss_mask": [0, 1, 1, 1]}) + b"\n"
                    for i in range(rows))


def _zstd_frame(first: int, rows: int = 100, checksum: bool = False) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(write_checksum=checksum).compress(_lines(first, rows))


def _long_window_frame(first: int, rows: int = 100, checksum: bool = False) -> bytes:
    """A frame as ``zstd --long=28`` writes one: a 256 MiB window, which Arrow's decompressing
    stream refuses ("Frame requires too much memory for decoding")."""
    import zstandard

    params = zstandard.ZstdCompressionParameters(window_log=28, enable_ldm=True, write_content_size=False,
                                                 write_checksum=checksum)
    out = io.BytesIO()
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(out, closefd=False) as writer:
        writer.write(_lines(first, rows))
    return out.getvalue()


#: Frames as ``zstd`` writes them by default, and with ``--long=28``.
FRAMES = {"short": _zstd_frame, "long": _long_window_frame}


def test_zstd_frames_are_all_read(tmp_path):
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(_zstd_frame(1) + _zstd_frame(5) + _zstd_frame(9))
    assert records(path) == 300


@pytest.mark.parametrize("kind", sorted(FRAMES))
@pytest.mark.parametrize("cut", [0.1, 0.5, 0.99])
@pytest.mark.parametrize("frames", [1, 2])
def test_truncated_zstd_is_a_data_error(tmp_path, frames, cut, kind):
    last = FRAMES[kind](5)
    data = (_zstd_frame(1) if frames == 2 else b"") + last[:int(len(last) * cut)]
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(data)
    with pytest.raises(DataError, match=r"d\.jsonl\.zst: .*truncated or corrupt zstd data"):
        records(path)


@pytest.mark.parametrize("kind", sorted(FRAMES))
def test_corrupt_zstd_with_checksum_is_a_data_error(tmp_path, kind):
    data = bytearray(FRAMES[kind](1, rows=2000, checksum=True))
    data[len(data) // 2] ^= 0x40
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"d\.jsonl\.zst: .*truncated or corrupt zstd data"):
        records(path)


@pytest.mark.parametrize("frames", ["long", "long,long,short", "short,long,short", "short,short,long"])
def test_zstd_frames_with_a_long_window_are_read(tmp_path, frames):
    # A valid file was reported as "truncated or corrupt zstd data" (found by a review).
    kinds = frames.split(",")
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(b"".join(FRAMES[kind](4 * k + 1, rows=3000) for k, kind in enumerate(kinds)))
    plain = tmp_path / "d.jsonl"
    plain.write_bytes(b"".join(_lines(4 * k + 1, 3000) for k in range(len(kinds))))
    assert records(path) == records(plain) == 3000 * len(kinds)
    a, b = tmp_path / "a", tmp_path / "b"
    assert run("pack", path, "-o", a, "--pack-size", 64).exit_code == 0
    assert run("pack", plain, "-o", b, "--pack-size", 64).exit_code == 0
    assert [f.read_bytes() for f in sorted(a.glob("*.arrow"))] == [f.read_bytes() for f in sorted(b.glob("*.arrow"))]


def test_truncated_zstd_on_the_command_line(tmp_path):
    last = _zstd_frame(5)
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(_zstd_frame(1) + last[:len(last) // 2])
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 64)
    assert_one_line_error(result, 1, "d.jsonl.zst: ")
    assert "truncated or corrupt zstd data" in result.output
    assert_nothing_written(tmp_path)


# --- D7: Arrow IPC stream without its end-of-stream marker ---------------------------------

def _stream_bytes(batches: int, legacy: bool = False, close: bool = True) -> bytes:
    table = pa.table({"input_ids": [[1, 2, 3, i] for i in range(batches * 10)],
                      "loss_mask": [[0, 1, 1, 1]] * (batches * 10)})
    sink = io.BytesIO()
    writer = pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(use_legacy_format=legacy))
    for batch in table.to_batches(max_chunksize=10):
        writer.write_batch(batch)
    if close:
        writer.close()
    return sink.getvalue()


@pytest.mark.parametrize("legacy", [False, True], ids=["current", "legacy"])
def test_complete_ipc_streams_read(tmp_path, legacy):
    path = tmp_path / "s.arrow"
    path.write_bytes(_stream_bytes(3, legacy=legacy))
    assert records(path) == 30


@pytest.mark.parametrize("legacy", [False, True], ids=["current", "legacy"])
def test_ipc_stream_cut_at_a_batch_boundary_is_a_data_error(tmp_path, legacy):
    path = tmp_path / "s.arrow"
    path.write_bytes(_stream_bytes(3, legacy=legacy, close=False))
    with pytest.raises(DataError, match=r"s\.arrow: .*end-of-stream marker"):
        records(path)
    assert_pack_refuses(tmp_path, path, "end-of-stream marker")


@pytest.mark.parametrize("legacy", [False, True], ids=["current", "legacy"])
@pytest.mark.parametrize("tail", ["second stream", "garbage", "zeros"])
def test_bytes_after_the_end_of_stream_marker_are_a_data_error(tmp_path, legacy, tail):
    """pyarrow stops at the marker: whatever follows (streams joined with ``cat``, garbage)
    would be dropped unread, a shorter input presented as the whole."""
    extra = {"second stream": _stream_bytes(2, legacy=legacy), "garbage": b"garbage!garbage!",
             "zeros": bytes(64)}[tail]
    path = tmp_path / "s.arrow"
    path.write_bytes(_stream_bytes(3, legacy=legacy) + extra)
    with pytest.raises(DataError, match=rf"s\.arrow: {len(extra):,} bytes follow the Arrow IPC stream's "
                                        r"end-of-stream marker after 30 rows"):
        records(path)
    assert_pack_refuses(tmp_path, path, "bytes follow the Arrow IPC stream's end-of-stream marker")


def test_ipc_stream_with_only_a_schema_is_empty_not_truncated(tmp_path):
    path = tmp_path / "s.arrow"
    path.write_bytes(_stream_bytes(0))
    with pytest.raises(DataError, match="empty input"):
        records(path)


# --- Arrow IPC files: the footer must describe the whole file ------------------------------

def _file_bytes(first: int, rows: int = 30, metadata=None, **options) -> bytes:
    """An IPC file of ``rows`` records in batches of 10 (ids ``first``, ``first + 1``, ...), with a
    dictionary-encoded column so dictionary blocks are laid out too."""
    ids = [[1, 2, first + i] for i in range(rows)]
    table = pa.table({"input_ids": ids, "loss_mask": [[0, 1, 1]] * rows,
                      "source": pa.array(["a", "b"] * (rows // 2) + ["a"] * (rows % 2)).dictionary_encode()},
                     metadata=metadata)
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as writer:
        for batch in table.to_batches(max_chunksize=10):
            writer.write_batch(batch)
    return sink.getvalue()


@pytest.mark.parametrize("options", [{}, {"use_legacy_format": True}, {"compression": "zstd"},
                                     {"metadata_version": pa.ipc.MetadataVersion.V4}],
                         ids=["current", "legacy", "zstd", "v4"])
@pytest.mark.parametrize("rows", [0, 1, 30])
def test_ipc_files_as_arrow_writes_them_read(tmp_path, options, rows):
    path = tmp_path / "f.arrow"
    path.write_bytes(_file_bytes(100, rows, **options))
    if rows:
        assert records(path) == rows
    else:
        with pytest.raises(DataError, match="empty input"):
            records(path)


@pytest.mark.parametrize("first", ["another file", "the same file", "a file with schema metadata"])
def test_ipc_files_joined_together_are_a_data_error(tmp_path, first):
    """pyarrow reads a file from its footer, whose block offsets count from the start: two files
    joined with ``cat`` read as the first file's batches, the second's samples lost unread
    (and ``verify --source`` against the same input agreed)."""
    second = _file_bytes(500)
    head = {"another file": _file_bytes(100), "the same file": second,
            "a file with schema metadata": _file_bytes(100, metadata={b"origin": b"x" * 40})}[first]
    path = tmp_path / "f.arrow"
    path.write_bytes(head + second)
    if "metadata" not in first:  # pyarrow reads the first file's batches as the second's
        assert pa.ipc.open_file(pa.memory_map(str(path))).read_all().num_rows == 30
    # Where the first file's schema message is longer, the second's first batch is not where it
    # ends (pyarrow fails on its own there, with "Invalid flatbuffers message"): the framed
    # schema's end and the first listed block disagree. Otherwise the walk ends far from the footer.
    detail = (r"the first message it lists is at byte [\d,]+, the schema message ends at byte [\d,]+"
              if "metadata" in first else r"its messages end at byte [\d,]+, the footer starts at byte [\d,]+")
    with pytest.raises(DataError, match=rf"f\.arrow: the Arrow IPC file's footer does not describe its contents "
                                        rf"\({detail}\): files joined together"):
        records(path)
    assert_pack_refuses(tmp_path, path, "footer does not describe its contents")


def test_ipc_file_with_a_damaged_head_or_inserted_bytes_is_a_data_error(tmp_path):
    data = _file_bytes(100)
    path = tmp_path / "f.arrow"
    path.write_bytes(b"XRROW1" + data[6:])  # the footer is intact, pyarrow reads it as before
    with pytest.raises(DataError, match=r"f\.arrow: an Arrow IPC file must start with ARROW1"):
        records(path)
    # 8 bytes inserted before the footer: the footer is found from the end as before.
    footer_start = len(data) - 10 - int.from_bytes(data[-10:-6], "little")
    path.write_bytes(data[:footer_start] + bytes(8) + data[footer_start:])
    with pytest.raises(DataError, match=r"footer does not describe its contents \(its messages end at byte "):
        records(path)


def _unframed_schema(data: bytes) -> bytes:
    """``data`` (a pyarrow IPC file) with its schema message written as polars writes it: the
    bare flatbuffer right after the magic, no continuation marker or length before it (padded
    after, so the footer's block offsets still hold)."""
    assert data[8:12] == b"\xff\xff\xff\xff"
    length = int.from_bytes(data[12:16], "little")
    return data[:8] + data[16:16 + length] + bytes(8) + data[16 + length:]


@pytest.mark.parametrize("rows", [1, 30])
def test_ipc_files_with_an_unframed_schema_message_read(tmp_path, rows):
    """polars writes the schema message of an IPC file without its framing; pyarrow reads such
    files (the schema is in the footer too), and so must packer, the joined-files check included."""
    path = tmp_path / "f.arrow"
    path.write_bytes(_unframed_schema(_file_bytes(100, rows, compression="zstd")))
    assert pa.ipc.open_file(str(path)).read_all().num_rows == rows
    assert records(path) == rows


def test_ipc_file_without_batches_and_an_unframed_schema_is_empty_input(tmp_path):
    path = tmp_path / "f.arrow"
    path.write_bytes(_unframed_schema(_file_bytes(100, 0)))
    with pytest.raises(DataError, match="empty input"):
        records(path)


@pytest.mark.parametrize("second_rows", [0, 30])
def test_ipc_files_with_unframed_schemas_joined_together_are_a_data_error(tmp_path, second_rows):
    """Without a framed schema the first block anchors the walk; a file without batches has none,
    and its schema stretch then holds the first file's magic."""
    path = tmp_path / "f.arrow"
    path.write_bytes(_unframed_schema(_file_bytes(100)) + _unframed_schema(_file_bytes(500, second_rows)))
    detail = ("one file's end and another's start lie in its schema message" if not second_rows
              else r"its messages end at byte [\d,]+, the footer starts")
    with pytest.raises(DataError, match=rf"f\.arrow: the Arrow IPC file's footer does not describe its contents \({detail}"):
        records(path)


@pytest.mark.parametrize("name", ["ARROW1", "ARROW1ARROW1", "abARROW1ARROW1"])
@pytest.mark.parametrize("rows", [0, 10])
def test_an_unframed_schema_may_name_a_field_after_the_magic(tmp_path, rows, name):
    """A field named ARROW1 (in an unframed schema) was taken for a second file's magic, and one
    named ARROW1ARROW1 (stored NUL-padded) for a closing and an opening magic end to end."""
    ids = [[1, 2, 3]] * rows if rows else pa.array([], pa.list_(pa.int64()))
    table = pa.table({name: pa.array(["x"] * rows, pa.string()), "input_ids": ids})  # the name first: its
    # length prefix then reads as a footer length, and the name's bytes as a footer
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as writer:
        if rows:
            writer.write_table(table)
    path = tmp_path / "f.arrow"
    path.write_bytes(_unframed_schema(sink.getvalue()))
    if rows:
        assert records(path) == rows
    else:
        with pytest.raises(DataError, match="empty input"):
            records(path)


def _footer_blocks_rewritten(data: bytes, edit) -> bytes:
    """``data`` (a pyarrow IPC file) with each footer block vector (dictionaries, record batches)
    replaced, in place, by ``edit(kind, blocks)`` (no longer than before); a block is
    (offset, metadata length, body length)."""
    import struct

    block = struct.Struct("<qi4xq")
    out = bytearray(data)
    footer_length = int.from_bytes(data[-10:-6], "little")
    start = len(data) - 10 - footer_length
    footer = data[start:start + footer_length]
    table = int.from_bytes(footer[:4], "little")
    vtable = table - struct.unpack_from("<i", footer, table)[0]
    for kind, slot in (("dictionaries", 2), ("batches", 3)):
        field = struct.unpack_from("<H", footer, vtable + 4 + 2 * slot)[0]
        if not field:
            continue
        vector = start + table + field + int.from_bytes(footer[table + field:table + field + 4], "little")
        count = int.from_bytes(data[vector:vector + 4], "little")
        blocks = [block.unpack_from(data, vector + 4 + 24 * i) for i in range(count)]
        new = edit(kind, blocks)
        assert len(new) <= count
        struct.pack_into("<I", out, vector, len(new))
        for i, b in enumerate(new):
            block.pack_into(out, vector + 4 + 24 * i, *b)
    return bytes(out)


def _without_first_batch(data: bytes) -> bytes:
    return _footer_blocks_rewritten(data, lambda kind, blocks: blocks[1:] if kind == "batches" else blocks)


def _undictionaried_file_bytes(rows: int = 30) -> bytes:
    """An IPC file of ``rows`` records in batches of 10 and no dictionary: its first record batch
    is the message right after the schema."""
    table = pa.table({"input_ids": [[1, 2, 100 + i] for i in range(rows)]})
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=10):
            writer.write_batch(batch)
    return sink.getvalue()


def test_a_batch_between_a_framed_schema_and_the_first_listed_block_is_a_data_error(tmp_path):
    """A file whose footer leaves out its first record batch: pyarrow's file reader skips it (the
    footer is all it reads), and packer took the stretch for an unframed schema, so 10 of 30
    records went missing with exit 0 and ``verify --source`` agreed. A framed schema says where
    it ends; the first listed message must start there."""
    data = _without_first_batch(_undictionaried_file_bytes())
    path = tmp_path / "f.arrow"
    path.write_bytes(data)
    assert pa.ipc.open_file(pa.memory_map(str(path))).read_all().num_rows == 20  # pyarrow: 10 fewer, no word
    with pytest.raises(DataError, match=r"f\.arrow: the Arrow IPC file's footer does not describe its contents "
                                        r"\(the first message it lists is at byte [\d,]+, the schema message ends "
                                        r"at byte [\d,]+\)"):
        records(path)
    assert_pack_refuses(tmp_path, path, "footer does not describe its contents")


def test_a_file_without_listed_batches_after_a_framed_schema_must_end_there(tmp_path):
    data = _footer_blocks_rewritten(_file_bytes(100, 10), lambda kind, blocks: [])
    path = tmp_path / "f.arrow"
    path.write_bytes(data)
    with pytest.raises(DataError, match=r"footer does not describe its contents \(the schema message ends at byte "
                                        r"[\d,]+, the footer lists no message and starts at byte [\d,]+\)"):
        records(path)


def test_a_batch_the_footer_leaves_out_after_an_unframed_schema_is_a_data_error(tmp_path):
    """polars writes the schema unframed, which reaches up to the first listed block: a batch
    the footer left out there read as part of the schema (10 of 30 records gone, exit 0)."""
    path = tmp_path / "f.arrow"
    path.write_bytes(_without_first_batch(_unframed_schema(_undictionaried_file_bytes())))
    assert pa.ipc.open_file(pa.memory_map(str(path))).read_all().num_rows == 20
    with pytest.raises(DataError, match=r"footer does not describe its contents \(a message the footer does not list "
                                        r"is at byte [\d,]+, after an unframed schema message and before byte "):
        records(path)


def test_a_batch_the_footer_leaves_out_between_two_listed_ones_is_a_data_error(tmp_path):
    """The footer lists batches 1 and 3 of 3: pyarrow reads 20 of 30 records, and the gap
    before the second listed batch is what tells (a check that only refused overlapping
    batches took the file, 10 records gone, exit 0)."""
    path = tmp_path / "f.arrow"
    path.write_bytes(_footer_blocks_rewritten(_undictionaried_file_bytes(), lambda kind, blocks: (
        [blocks[0], blocks[2]] if kind == "batches" else blocks)))
    assert pa.ipc.open_file(pa.memory_map(str(path))).read_all().num_rows == 20
    with pytest.raises(DataError, match=r"footer does not describe its contents \(message 2 of 2 is at byte [\d,]+, "
                                        r"the one before it ends at byte [\d,]+\)"):
        records(path)


def _without_schema_message(data: bytes) -> bytes:
    """``data`` (a pyarrow IPC file) as arrow-js writes one: no schema message after the magic
    (the footer holds the schema), the first batch at byte 8."""
    assert data[8:12] == b"\xff\xff\xff\xff"
    end = 16 + int.from_bytes(data[12:16], "little")
    moved = _footer_blocks_rewritten(data, lambda kind, blocks: [(o - (end - 8), m, b) for o, m, b in blocks])
    return moved[:8] + moved[end:]


def test_ipc_files_without_a_schema_message_read(tmp_path):
    """arrow-js writes the schema in the footer only: pyarrow reads such files whole, packer
    refused them as damaged (the first block at byte 8, where the schema message would be)."""
    path = tmp_path / "f.arrow"
    path.write_bytes(_without_schema_message(_undictionaried_file_bytes()))
    assert pa.ipc.open_file(pa.memory_map(str(path))).read_all().num_rows == 30
    assert records(path) == 30
    path.write_bytes(_without_schema_message(_undictionaried_file_bytes()) * 2)  # and joined files still are not
    with pytest.raises(DataError, match="footer does not describe its contents"):
        records(path)


def _without_dictionaries_field(data: bytes) -> bytes:
    """``data`` (a pyarrow IPC file) with its footer's ``dictionaries`` field left out, as a
    flatbuffers writer may leave out an empty vector (File.fbs: the field is optional)."""
    import struct

    out = bytearray(data)
    start = len(data) - 10 - int.from_bytes(data[-10:-6], "little")
    table = start + int.from_bytes(data[start:start + 4], "little")
    entry = table - struct.unpack_from("<i", data, table)[0] + 4 + 2 * 2  # Footer.dictionaries
    assert struct.unpack_from("<H", data, entry)[0] != 0  # pyarrow writes it, empty
    struct.pack_into("<H", out, entry, 0)
    return bytes(out)


def test_ipc_files_whose_footer_leaves_out_the_dictionaries_read(tmp_path):
    """The footer's dictionaries are optional; a file without them is read by pyarrow, and its
    record batches must still be found by the layout check (it found none and refused the file
    as damaged or joined)."""
    path = tmp_path / "f.arrow"
    path.write_bytes(_without_dictionaries_field(_undictionaried_file_bytes()))
    assert pa.ipc.open_file(pa.memory_map(str(path))).read_all().num_rows == 30
    assert records(path) == 30


def _aligned_schema(data: bytes, to: int = 64) -> bytes:
    """``data`` (a pyarrow IPC file) laid out as arrow-rs writes it with 64-byte alignment: zero
    padding after the magic up to byte ``to``, where the framed schema message starts (every
    block offset moved as far)."""
    shift = to - 8
    moved = _footer_blocks_rewritten(data, lambda kind, blocks: [(o + shift, m, b) for o, m, b in blocks])
    return moved[:8] + bytes(shift) + moved[8:]


@pytest.mark.parametrize("rows", [0, 30])
def test_ipc_files_with_a_schema_aligned_past_the_magic_read(tmp_path, rows):
    path = tmp_path / "f.arrow"
    path.write_bytes(_aligned_schema(_file_bytes(100, rows)))
    assert pa.ipc.open_file(pa.memory_map(str(path))).read_all().num_rows == rows
    if rows:
        assert records(path) == rows
    else:
        with pytest.raises(DataError, match="empty input"):
            records(path)
    # and a first batch the footer leaves out is found there too
    path.write_bytes(_aligned_schema(_without_first_batch(_undictionaried_file_bytes())))
    with pytest.raises(DataError, match=r"the first message it lists is at byte [\d,]+, the schema message ends"):
        records(path)


def test_bytes_that_pass_the_layout_walk_are_no_file_unless_pyarrow_opens_them():
    """polars lays a field named ARROW1ARROW1 out so that the bytes before it pass the layout walk
    as a file without batches (its length prefix read as a footer length, the bytes before as a
    footer with no blocks): such a file was refused as two joined. Here, the same by hand: a
    schema message, an end-of-stream marker and a footer of no fields, then the two magics."""
    import struct

    from packer_cli.sources._ipc_file import _holds_a_whole_file, check_file_layout

    footer = struct.pack("<IHHi", 8, 4, 4, 4)  # root -> table at 8, whose vtable (at 4) has no fields
    fake = b"ARROW1\0\0" + b"\xff\xff\xff\xff" + struct.pack("<i", 8) + bytes(8) + b"\xff\xff\xff\xff" + bytes(4)
    fake += footer + struct.pack("<i", len(footer)) + b"ARROW1"
    source = pa.BufferReader(fake + b"ARROW1\0\0")
    check_file_layout("fake", pa.BufferReader(fake))  # the walk alone takes it for a file
    assert not _holds_a_whole_file("f.arrow", source, fake[8:] + b"ARROW1\0\0")
    real = _file_bytes(100, 0)  # a real file there is still found
    assert _holds_a_whole_file("f.arrow", pa.BufferReader(real + b"ARROW1\0\0"), real[8:] + b"ARROW1\0\0")


def test_a_truncated_ipc_file_is_reported_as_a_file(tmp_path):
    """A file cut short has no footer; it was then read as a stream, whose error (a metadata length
    of 1.3 G bytes, the magic read as a length) said nothing of what happened."""
    data = _file_bytes(100)
    path = tmp_path / "f.arrow"
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(DataError, match=r"f\.arrow: starts as an Arrow IPC file but cannot be read as one: "
                                        r".*\(truncated\?\)$"):
        records(path)


def test_a_compressed_ipc_file_is_decompressed_one_batch_at_a_time(tmp_path):
    """Every batch of a compressed file was decompressed before the first was read: reading a
    file held all of it decompressed in memory (as did looking up its field names)."""
    from packer_cli.sources.readers import read_ipc
    ids = pa.array([list(range(1000))] * 10_000)  # 40 MB decompressed in 10 batches, a few KB compressed
    table = pa.table({"input_ids": ids})
    path = tmp_path / "f.arrow"
    with pa.ipc.new_file(path, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        for batch in table.to_batches(max_chunksize=1000):
            writer.write_batch(batch)
    del ids, table
    before = pa.total_allocated_bytes()
    most = 0
    for raw in read_ipc(str(path), ["input_ids"]):
        most = max(most, pa.total_allocated_bytes() - before)
        del raw
    assert 4_000_000 <= most < 12_000_000  # one or two 4 MB batches, not 40 MB


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of ``path`` (Linux ``/proc/self/smaps``)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
                inside = line.rstrip("\n").endswith(str(path))
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
@pytest.mark.parametrize("kind", ["file", "stream"])
def test_an_arrow_inputs_pages_are_handed_back_as_it_is_read(tmp_path, monkeypatch, kind):
    """The input is read in place, mapped: every page touched stayed resident until the file was
    done, so a 4 GB Arrow file peaked at 4.3 GB, past the memory bound every other input keeps."""
    from packer_cli.sources import readers
    monkeypatch.setattr(readers, "RELEASE_BYTES", 4 << 20)
    table = pa.table({"input_ids": pa.array([list(range(1000))] * 12_000, pa.list_(pa.int32()))})  # 48 MB
    path = tmp_path / "f.arrow"
    opener = pa.ipc.new_file if kind == "file" else pa.ipc.new_stream
    with opener(path, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=1500):
            writer.write_batch(batch)
    del table
    most, total = 0, 0
    for raw in readers.read_ipc(str(path), ["input_ids"]):
        total += int(pc.sum(raw.batch.column(0).values).as_py())  # touch every token
        most = max(most, _mapped_rss(path))
    assert total == 12_000 * sum(range(1000))
    assert 0 < most < 16 << 20  # a few batches resident at a time, not the 48 MB read


# --- D11: all records malformed; uint64 ids beyond int64 ------------------------------------

MALFORMED = {
    "one bad line": b"{bad\n",
    "two bad lines": b"{bad\n{bad\n",
    "bom on line 2": b"\n\xef\xbb\xbf" + orjson.dumps(GOOD) + b"\n",
    "nan": b'{"input_ids": [1, NaN], "loss_mask": [0, 1]}\n',
    "trailing text": orjson.dumps(GOOD) + b" x\n",
    "not utf-8": b'{"input_ids": [1, 2], "loss_mask": [0, 1], "t": "\xff"}\n',
    "400 digits": b"1" * 400 + b"\n",
    "deep nesting": b"[" * 100_000 + b"]" * 100_000 + b"\n",
}


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz", "jsonl.zst"])
def test_a_byte_order_mark_at_the_start_is_skipped(tmp_path, suffix):
    """A UTF-8 byte order mark before the first record (which pyarrow's JSON reader, and so HF
    datasets, skip) is skipped: the output is the one of the file without it, and verify --source
    replays it. Anywhere else it is malformed JSON, as orjson says."""
    import gzip

    import zstandard

    compress = {"jsonl": bytes, "jsonl.gz": gzip.compress,
                "jsonl.zst": zstandard.ZstdCompressor().compress}[suffix]
    body = b"".join(orjson.dumps({"input_ids": [5, 6, i + 7], "loss_mask": [0, 1, 1]}) + b"\n" for i in range(50))
    for name, data in (("plain", body), ("marked", b"\xef\xbb\xbf" + body)):
        path = tmp_path / f"{name}.{suffix}"
        path.write_bytes(compress(data))
        result = run("pack", path, "-o", tmp_path / f"out-{name}", "--pack-size", 64)
        assert result.exit_code == 0, result.output
    shards = [{p.name: p.read_bytes() for p in (tmp_path / f"out-{name}").glob("packs-*")} for name in ("plain", "marked")]
    assert shards[0] and shards[0] == shards[1]
    result = run("verify", tmp_path / "out-marked", "--source", tmp_path / f"marked.{suffix}")
    assert result.exit_code == 0, result.output
    assert records(tmp_path / f"marked.{suffix}") == 50
    (tmp_path / "twice").mkdir()
    (tmp_path / "twice" / f"d.{suffix}").write_bytes(compress(b"\xef\xbb\xbf" * 2 + body))
    assert_pack_refuses(tmp_path / "twice", tmp_path / "twice" / f"d.{suffix}", "line 1: malformed JSON")


@pytest.mark.parametrize("split_at", [1, 2, 3, 4])
@pytest.mark.parametrize("marked", [True, False])
def test_a_gzip_member_ending_inside_the_byte_order_mark(tmp_path, split_at, marked):
    """Members of 1 or 2 bytes at the start: peek returned only the first member's bytes, so the
    mark was not seen and line 1 was 'malformed JSON: UTF-8 byte order mark'. Without a mark the
    bytes read to look for one come first still."""
    import gzip

    body = b"".join(orjson.dumps({"input_ids": [5, 6, i + 7], "loss_mask": [0, 1, 1]}) + b"\n" for i in range(5))
    data = (b"\xef\xbb\xbf" if marked else b"") + body
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(data[:split_at]) + gzip.compress(data[split_at:]))
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 64)
    assert result.exit_code == 0, result.output
    assert records(path) == 5
    assert run("verify", tmp_path / "out", "--source", path).exit_code == 0


@pytest.mark.parametrize("policy", ["error", "skip"])
@pytest.mark.parametrize("content", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_file_of_only_malformed_json_names_the_line(tmp_path, content, policy):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    result = run("pack", path, "-o", tmp_path / "out", "--on-bad-record", policy)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert "missing field" not in result.output
    if policy == "error":
        line = 2 if content.startswith(b"\n") else 1
        assert f"data.jsonl: line {line}: malformed JSON" in result.output, result.output
    else:  # every record skipped as bad: nothing to pack, and no output that looks valid
        assert "no samples" in result.output, result.output
    assert_nothing_written(tmp_path)


ORJSON_REFUSES = {  # valid JSON (RFC 8259) that orjson refuses, each in a field packer does not read
    "lone surrogate": b'"t": "half an emoji \\ud83d"',  # what Python's json.dumps writes for it
    "number past a double": b'"score": 1e400',
}  # nesting past 1024 levels too, but Python's parser stops near 1000: docs/PACK.md names the limit


@pytest.mark.parametrize("first", [True, False], ids=["first record", "later record"])
@pytest.mark.parametrize("field", list(ORJSON_REFUSES.values()), ids=list(ORJSON_REFUSES))
def test_valid_json_that_orjson_refuses_is_read(tmp_path, field, first):
    """Such records were bad records ("malformed JSON: no low surrogate in string"), and a first
    record among them did not decide the supervision field, though datasets reads them."""
    odd = b'{"input_ids": [7, 8, 9], "loss_mask": [0, 1, 1], ' + field + b"}\n"
    good = orjson.dumps(GOOD) + b"\n"
    path = tmp_path / "d.jsonl"
    path.write_bytes(odd + good if first else good + odd)
    stream = SampleStream(discover_inputs([str(path)]), SourceSpec())
    batches = list(stream)
    assert stream.records == 2 and sum(b.lengths.size for b in batches) == 2 and stream.supervision.kind == "mask"
    tokens = np.concatenate([b.tokens for b in batches]).tolist()
    assert tokens[:3] == [7, 8, 9] if first else tokens[-3:] == [7, 8, 9]
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 64)
    assert result.exit_code == 0, result.output
    assert run("verify", tmp_path / "out", "--source", path).exit_code == 0


def test_an_integer_too_long_for_python_is_out_of_range_not_malformed(tmp_path):
    """An integer of 5,000 digits is valid JSON: in a field packer does not read it is nothing,
    in the tokens it is out of range (Python's parser refused it: "malformed JSON")."""
    digits = "7" * 5000
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "id": ' + digits.encode() + b"}\n")
    assert records(path) == 1
    path.write_bytes(b'{"input_ids": [1, 2, ' + digits.encode() + b'], "loss_mask": [0, 1, 1]}\n')
    with pytest.raises(DataError, match=r"line 1: input_ids\[2\] = 7777.*\(5,000 characters\) is out of range"):
        records(path)


@pytest.mark.parametrize("line,reason", [
    (b'{"input_ids": [1, 2], "loss_mask": [0, 1], "t": "\\ud83d", "x": NaN}', "NaN is not JSON"),
    (b'["\\ud83d"]', "the record is not a JSON object"),
])
def test_a_record_malformed_past_a_lone_surrogate_names_its_real_fault(tmp_path, line, reason):
    """orjson's complaint (the lone surrogate, which is read) was given for a record malformed otherwise."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(orjson.dumps(GOOD) + b"\n" + line + b"\n")
    with pytest.raises(DataError, match=rf"line 2: malformed JSON: {reason}"):
        records(path)


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_stay_malformed_json(tmp_path, value):
    """Python's json reads them, JSON has no such values: the standard parser's fallback refuses them."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(orjson.dumps(GOOD) + b"\n" + b'{"input_ids": [1, 2], "loss_mask": [0, 1], "x": ' + value + b"}\n")
    with pytest.raises(DataError, match=r"d\.jsonl: line 2: malformed JSON"):
        records(path)


def test_a_file_of_only_malformed_json_forced_mask(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"{bad\n")
    with pytest.raises(DataError, match=r"data\.jsonl: line 1: malformed JSON"):
        records(path, SourceSpec(mask_field="loss_mask"))


BIG = 2**63 + 5


@pytest.mark.parametrize("column", ["input_ids", "loss_mask"])
def test_uint64_value_beyond_int64_is_reported_as_in_the_file(tmp_path, column):
    values = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    values[column] = [1, 1, BIG]
    table = pa.table({k: pa.array([v], type=pa.list_(pa.uint64())) for k, v in values.items()})
    pq.write_table(table, tmp_path / "d.parquet")
    result = run("pack", tmp_path / "d.parquet", "-o", tmp_path / "out")
    assert_one_line_error(result, 1, f"d.parquet: row 0: {column}[2] = {BIG} ")
    assert str(BIG - 2**64) not in result.output
    assert_nothing_written(tmp_path)


def test_uint64_answer_start_beyond_int64_is_reported_as_in_the_file(tmp_path):
    table = pa.table({"input_ids": [[1, 2, 3]], "answer_start_idx": pa.array([BIG], type=pa.uint64())})
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(DataError, match=f"row 0: answer_start_idx = {BIG} "):
        records(tmp_path / "d.parquet")


def test_uint64_in_range_still_reads(tmp_path):
    table = pa.table({"input_ids": pa.array([[1, 2, 3]], type=pa.list_(pa.uint64())),
                      "loss_mask": pa.array([[0, 1, 1]], type=pa.list_(pa.uint64()))})
    pq.write_table(table, tmp_path / "d.parquet")
    stream = SampleStream(discover_inputs([str(tmp_path / "d.parquet")]), SourceSpec())
    tokens = np.concatenate([b.tokens for b in stream])
    np.testing.assert_array_equal(tokens, [1, 2, 3])


@pytest.mark.parametrize("value", [BIG, 2**63, 2**64, -(2**63) - 1, 10**30])
def test_jsonl_value_beyond_int64_is_reported_as_in_the_file(tmp_path, value):
    # orjson reads integers past 64 bits as floats: 2**64 was quoted as 1.8446744073709552e+19,
    # and -2**63 - 1, which rounds to -2**63, was called "not an integer"; 2**63 itself, one
    # past the largest int64 (orjson reads it as an int), must be refused, not overflow the column
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2, %d], "loss_mask": [0, 1, 1]}\n' % value)
    with pytest.raises(DataError, match=f"line 1: input_ids\\[2\\] = {value} is out of range"):
        records(path)


@pytest.mark.parametrize("value", [BIG, 2**63, 2**64 + 1], ids=["2**63+5", "2**63", "2**64+1"])
def test_jsonl_answer_start_beyond_int64_is_a_bad_record(tmp_path, value):
    # orjson hands such a scalar back as a Python int; building the int64 column overflowed
    # (an OverflowError traceback), at 2**63 itself too, the first integer past int64; the
    # compiled scanner must give such a scalar up, not read its digits into a wrapping int64
    # (2**64 + 1 would be read as 1 and the record packed)
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [5, 6, 7], "answer_start_idx": 1}\n{"input_ids": [5, 6, 7], "answer_start_idx": %d}\n' % value)
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 16)
    assert_one_line_error(result, 1, f"d.jsonl: line 2: answer_start_idx = {value} is out of range")
    assert_nothing_written(tmp_path)
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 16, "--on-bad-record", "skip", "--json")
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.stdout)["counts"]["bad_records"] == 1


def _columnar_file(tmp_path, table, fmt):
    """``table`` written as ``d.parquet`` or ``d.arrow`` (an IPC file)."""
    path = tmp_path / f"d.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        with pa.ipc.new_file(path, table.schema) as writer:
            writer.write_table(table)
    return path


def _bool_mask_with_a_null(tmp_path, fmt):
    table = pa.table({"input_ids": [[1, 2, 3], [4, 5, 6]],
                      "loss_mask": pa.array([[False, True, True], [True, None, True]], type=pa.list_(pa.bool_()))})
    return _columnar_file(tmp_path, table, fmt)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_null_in_a_boolean_mask_is_a_bad_record(tmp_path, fmt):
    # the null was filled with an integer 0, which a boolean array refuses: a traceback
    path = _bool_mask_with_a_null(tmp_path, fmt)
    assert_pack_refuses(tmp_path, path, f"d.{fmt}: row 1: loss_mask[1] is null")
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 16, "--on-bad-record", "skip", "--json")
    assert result.exit_code == 0, result.output
    summary = orjson.loads(result.stdout)
    assert summary["counts"]["bad_records"] == 1 and summary["counts"]["sequences"] == 1


@pytest.mark.parametrize("lines, text", [
    (['{"input_ids": []}', '{"input_ids": null}'], "line 2: field 'input_ids' is null"),
    (['{"input_ids": []}', '{"input_ids": [1, 2e}'], "line 2: malformed JSON"),
    (['{"input_ids": [1, 2], "loss_mask": [null, null]}'], "line 1: loss_mask[0] is null"),
], ids=["empty-then-null", "empty-then-malformed", "mask-all-null"])
def test_a_jsonl_batch_without_a_single_value_names_its_record(tmp_path, lines, text):
    # such a batch became a list<null> column, refused as a whole naming a row past the file's end
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert_pack_refuses(tmp_path, path, text)
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 16, "--on-bad-record", "skip")
    assert "no samples left to pack" in result.output and "holds null values" not in result.output


@pytest.mark.parametrize("record, text", [
    ('{"input_ids": [1, 2, 1e19]}', "input_ids[2] = 1e+19 is not an integer"),  # a float in the file, however large
    ('{"input_ids": [1, 2, 1.5], "deep": %s1%s}' % ("[" * 1000, "]" * 1000), "input_ids[2] = 1.5 is not an integer"),
], ids=["large-float", "nested-1000-deep"])
def test_a_float_token_is_not_an_integer(tmp_path, record, text):
    # a record with a float is read again by the standard parser (to quote integers past 64 bits
    # exactly); one nested deeper than it goes (orjson reads 1024 levels) raised RecursionError
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n' + record + "\n")
    assert_pack_refuses(tmp_path, path, f"d.jsonl: line 2: {text}")


# --- a column of a type pyarrow cannot hand to Python ------------------------------------

def _write_month_interval_file(path, name: str, with_tokens: bool, as_list: bool = False) -> None:
    """An IPC file whose column ``name`` has type month_interval, which pyarrow writes and reads
    but cannot wrap as a Python array (``batch.column`` raises ``KeyError``). pyarrow cannot
    make one from Python either: the batch comes in through the Arrow C data interface."""
    import ctypes

    class Schema(ctypes.Structure):
        pass

    class Array(ctypes.Structure):
        pass

    release_schema = ctypes.CFUNCTYPE(None, ctypes.POINTER(Schema))
    release_array = ctypes.CFUNCTYPE(None, ctypes.POINTER(Array))
    Schema._fields_ = [("format", ctypes.c_char_p), ("name", ctypes.c_char_p), ("metadata", ctypes.c_char_p),
                       ("flags", ctypes.c_int64), ("n_children", ctypes.c_int64),
                       ("children", ctypes.POINTER(ctypes.POINTER(Schema))), ("dictionary", ctypes.c_void_p),
                       ("release", release_schema), ("private_data", ctypes.c_void_p)]
    Array._fields_ = [("length", ctypes.c_int64), ("null_count", ctypes.c_int64), ("offset", ctypes.c_int64),
                      ("n_buffers", ctypes.c_int64), ("n_children", ctypes.c_int64),
                      ("buffers", ctypes.POINTER(ctypes.c_void_p)), ("children", ctypes.POINTER(ctypes.POINTER(Array))),
                      ("dictionary", ctypes.c_void_p), ("release", release_array), ("private_data", ctypes.c_void_p)]

    @release_schema
    def free_schema(schema):
        schema.contents.release = release_schema()

    @release_array
    def free_array(array):
        array.contents.release = release_array()

    months = np.arange(1, 10, dtype=np.int32)
    offsets = np.array([0, 3, 6, 9], dtype=np.int32)  # as_list: three rows of three
    month_schema = Schema(format=b"tiM", name=b"item" if as_list else name.encode(), release=free_schema)
    month_buffers = (ctypes.c_void_p * 2)(None, months.ctypes.data)
    month_array = Array(length=9 if as_list else 3, n_buffers=2, buffers=month_buffers, release=free_array)
    if as_list:
        item_schemas = (ctypes.POINTER(Schema) * 1)(ctypes.pointer(month_schema))
        item_arrays = (ctypes.POINTER(Array) * 1)(ctypes.pointer(month_array))
        child_schema = Schema(format=b"+l", name=name.encode(), n_children=1, children=item_schemas,
                              release=free_schema)
        list_buffers = (ctypes.c_void_p * 2)(None, offsets.ctypes.data)
        child = Array(length=3, n_buffers=2, n_children=1, buffers=list_buffers, children=item_arrays,
                      release=free_array)
    else:
        child_schema, child = month_schema, month_array
    child_schemas = (ctypes.POINTER(Schema) * 1)(ctypes.pointer(child_schema))
    top_schema = Schema(format=b"+s", name=b"", n_children=1, children=child_schemas, release=free_schema)
    children = (ctypes.POINTER(Array) * 1)(ctypes.pointer(child))
    top_buffers = (ctypes.c_void_p * 1)(None)
    top = Array(length=3, n_buffers=1, n_children=1, buffers=top_buffers, children=children, release=free_array)
    table = pa.Table.from_batches([pa.RecordBatch._import_from_c(ctypes.addressof(top), ctypes.addressof(top_schema))])
    if with_tokens:
        table = table.add_column(0, "input_ids", pa.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    del table  # released while the callbacks and the buffers above are alive


@pytest.mark.parametrize("name, with_tokens, before, as_list", [
    ("input_ids", False, False, False), ("loss_mask", True, False, False), ("loss_mask", True, True, False),
    ("input_ids", False, False, True), ("loss_mask", True, False, True), ("labels", True, False, True)])
def test_a_column_pyarrow_cannot_wrap_is_a_one_line_error(tmp_path, name, with_tokens, before, as_list):
    """A token or supervision column of type month_interval, or a list of them, ended ``packer
    pack`` with a traceback (``KeyError: 21``): as the tokens, as the mask or labels, and as a
    supervision column a later input must not have (``before``: a first input without one)."""
    path = tmp_path / "f.arrow"
    _write_month_interval_file(path, name, with_tokens, as_list)
    inputs = [path]
    if before:
        inputs.insert(0, tmp_path / "first.jsonl")
        inputs[0].write_bytes(b'{"input_ids": [1, 2, 3]}\n')
    result = run("pack", *inputs, "-o", tmp_path / "out", "--pack-size", 64)
    said = ("has type list<item: month_interval" if as_list
            else "has type month_interval, which packer does not read")
    assert_one_line_error(result, 1, f"f.arrow: row 0: field '{name}' {said}")
    assert not (tmp_path / "out").exists()


# --- an Arrow IPC batch of long rows ----------------------------------------------------------

def _ipc_of_long_rows(path, n_rows: int = 3000) -> pa.Table:
    """One record batch: rows of 1-60 tokens, every 97th of 800 (longer than the tests' budget)."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 61, n_rows)
    lengths[::97] = 800
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(offsets[-1])
    table = pa.table({
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 1000, n).astype(np.int32))),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ones(n, np.uint8))),
    })
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_batch(table.to_batches(max_chunksize=n_rows)[0])
    return table


def test_an_ipc_batch_of_long_rows_is_read_in_pieces_of_its_value_budget(tmp_path, monkeypatch):
    """A batch of 2,048 rows of 100k tokens was read in one piece and checked whole first (every
    page of the 1 GB batch resident at once: 1.7 GB at the peak). Pieces now hold at most
    ``BATCH_VALUES`` values (or one longer row) and ``BATCH_ROWS`` rows, and close only where
    the next row would pass; together they are the batch."""
    from packer_cli.sources import readers

    monkeypatch.setattr(readers, "BATCH_VALUES", 500)
    path = tmp_path / "long.arrow"
    table = _ipc_of_long_rows(path)
    pieces = list(readers.read_ipc(str(path), ["input_ids", "loss_mask"]))
    assert pa.Table.from_batches([p.batch for p in pieces]).equals(table)
    lengths = table.column("input_ids").combine_chunks().value_lengths().to_numpy()
    row0 = 0
    for k, piece in enumerate(pieces):
        assert piece.row0 == row0
        rows = piece.batch.num_rows
        size = int(lengths[row0:row0 + rows].sum())
        assert 1 <= rows <= readers.BATCH_ROWS and (size <= 500 or rows == 1)
        row0 += rows
        if k + 1 < len(pieces):
            assert size + lengths[row0] > 500
    assert row0 == 3000 and len(pieces) > 3000 * 30 // 500


def test_damaged_offsets_in_a_later_piece_of_an_ipc_batch_are_a_data_error(tmp_path, monkeypatch):
    """The batch is checked piece by piece now: an offset past the values, late in the batch, is
    still a one-line error naming the file, with nothing written."""
    from packer_cli.sources import readers

    monkeypatch.setattr(readers, "BATCH_VALUES", 500)
    path = tmp_path / "long.arrow"
    table = _ipc_of_long_rows(path)
    raw = bytearray(path.read_bytes())
    offsets = table.column("input_ids").chunk(0).offsets.to_numpy()
    at = bytes(raw).find(offsets.tobytes())  # the tokens' offsets buffer (written first), as written
    assert at > 0
    row = 2500
    raw[at + 4 * row:at + 4 * row + 4] = np.int32(10**8).tobytes()
    path.write_bytes(bytes(raw))
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 1024)
    assert result.exit_code == 1, result.output
    assert "long.arrow" in result.output and "Traceback" not in result.output
    rows = re.search(r"rows ([\d,]+) to ([\d,]+): .*offset for slot (\d+) out of bounds", result.output)
    assert rows, result.output
    start, stop, slot = (int(g.replace(",", "")) for g in rows.groups())
    assert start + slot == row and start <= row <= stop  # the slot counts from the piece's first row
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert_nothing_written(tmp_path)


def test_tiny_ipc_record_batches_are_joined_and_large_ones_pass_alone(tmp_path):
    """A file written one row a record batch was read a batch at a time (a twentieth of the usual
    rate): runs of small batches are now joined up to ``BATCH_ROWS`` rows; a large batch is
    neither joined nor copied; the rows are the file's, in order."""
    from packer_cli.sources import readers

    lengths = np.random.default_rng(5).integers(1, 50, 5000)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.int32)))
    table = pa.table({"input_ids": ids})
    path = tmp_path / "tiny.arrow"
    sizes = [1] * 3000 + [1500] + [1] * 500  # 3,000 one-row batches, one large, 500 more
    with pa.ipc.new_file(str(path), table.schema) as writer:
        at = 0
        for size in sizes:
            writer.write_batch(table.slice(at, size).to_batches()[0])
            at += size
    got = list(readers.read_ipc(str(path), ["input_ids"]))
    assert [b.batch.num_rows for b in got] == [2048, 952, 1500, 500]
    assert [b.row0 for b in got] == [0, 2048, 3000, 4500]
    assert pa.Table.from_batches([b.batch for b in got]).equals(table)


def test_joined_tiny_ipc_batches_stay_within_the_value_budget(tmp_path, monkeypatch):
    """Small record batches are joined while the rows *and* the values fit: joined by rows alone,
    twenty one-row batches of 400,000 tokens (each under an eighth of ``BATCH_VALUES``) became one
    batch of 8M values, twice the bound on a batch's memory."""
    from packer_cli.sources import readers

    monkeypatch.setattr(readers, "BATCH_VALUES", 800)  # a row of 90 values is small (8 * 90 < 800)
    ids = pa.ListArray.from_arrays(pa.array(np.arange(0, 20 * 90 + 1, 90, dtype=np.int32)),
                                   pa.array(np.arange(20 * 90, dtype=np.int32)))
    table = pa.table({"input_ids": ids})
    path = tmp_path / "tiny.arrow"
    with pa.ipc.new_file(str(path), table.schema) as writer:
        for k in range(20):
            writer.write_batch(table.slice(k, 1).to_batches()[0])
    got = list(readers.read_ipc(str(path), ["input_ids"]))
    assert [(b.row0, b.batch.num_rows, len(b.batch.column(0).flatten())) for b in got] == [
        (0, 8, 720), (8, 8, 720), (16, 4, 360)]  # a ninth row of 90 would pass 800
    assert pa.Table.from_batches([b.batch for b in got]).equals(table)


def test_a_supervision_value_after_joined_tiny_batches_comes_after_their_rows(tmp_path):
    """The rows before a supervision value (where the first record had none) are read first,
    joined as usual, then the error, as a file of large batches has it."""
    from packer_cli.errors import DataError
    from packer_cli.sources import readers

    labels = [None] * 700
    labels[600] = [1]
    table = pa.table({"input_ids": [[1, 2]] * 700, "labels": pa.array(labels, pa.list_(pa.int64()))})
    path = tmp_path / "tiny.arrow"
    with pa.ipc.new_file(str(path), table.schema) as writer:
        for k in range(700):
            writer.write_batch(table.slice(k, 1).to_batches()[0])
    read = []
    with pytest.raises(DataError, match="row 600: column 'labels'"):
        for raw in readers.read_ipc(str(path), ["input_ids"], absent=("labels",)):
            read.append(raw.batch.num_rows)
    assert read == [600]


@pytest.mark.parametrize("offset, rows", [(3000, "rows 0 to 2,999"), (2500, "rows 2,048 to 2,999")],
                         ids=["last offset", "inside the last piece"])
def test_a_damaged_last_offset_of_an_ipc_batch_names_the_batch_rows(tmp_path, offset, rows):
    """An offset past the values at the very end of a batch fails the cheap structural check
    before any piece is cut; the message names the batch's rows too. One inside the batch fails
    its piece's check (rows 2,048 to 2,999 at the default 2,048 rows a piece), which named one
    row past the piece, and past the file: 'rows 2,048 to 3,000'."""
    path = tmp_path / "long.arrow"
    table = _ipc_of_long_rows(path)
    raw = bytearray(path.read_bytes())
    offsets = table.column("input_ids").chunk(0).offsets.to_numpy()
    at = bytes(raw).find(offsets.tobytes())
    raw[at + 4 * offset:at + 4 * offset + 4] = np.int32(10**8).tobytes()
    path.write_bytes(bytes(raw))
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 1024)
    assert_one_line_error(result, 1, f"long.arrow: cannot read as Arrow IPC: {rows}: ")
    assert_nothing_written(tmp_path)


# --- values just out of range --------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("bad, options, says", [
    ({"input_ids": [5, 6, 100, 7], "loss_mask": [0, 0, 1, 1]}, ["--vocab-size", 100],
     "input_ids[2] = 100 is >= vocab size 100"),
    ({"input_ids": [5, 6, 7, 8], "loss_mask": [0, -1, 1, 1]}, [], "loss_mask[1] = -1 is not 0 or 1"),
    ({"input_ids": [5, -1, 7, 8], "loss_mask": [0, 0, 1, 1]}, [], "input_ids[1] = -1 is negative"),
], ids=["id-equal-to-vocab-size", "mask-minus-one", "id-minus-one"])
def test_the_first_value_out_of_range_is_a_bad_record(tmp_path, fmt, bad, options, says):
    """The boundary of each value check (an id equal to the vocab size, a mask of -1, an id of -1,
    not far-off values): the clean batch's fast path hands such a batch to the checks, which must
    refuse it."""
    rows = [GOOD, bad, GOOD]
    if fmt == "jsonl":
        path = tmp_path / "in.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        where = "line 2"
    else:
        path = tmp_path / "in.parquet"
        pq.write_table(pa.table({"input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
                                 "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.int8()))}), path)
        where = "row 1"
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 64, *options)
    assert_one_line_error(result, 1, f"{path}: {where}: {says}")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("skip_one", [False, True], ids=["fast-path", "vectorized"])
def test_the_largest_int32_id_is_kept(tmp_path, skip_one):
    """2**31 - 1 fits in int32: a batch with a bad record in it (checked by the vectorized path,
    not the clean batch's) refused it too, "input_ids[1] = 2147483647 does not fit in int32"."""
    rows = [{"input_ids": [5, 2**31 - 1, 7], "loss_mask": [0, 1, 1]}]
    if skip_one:
        rows.append({"input_ids": [1, -2, 3], "loss_mask": [0, 1, 1]})
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stream = SampleStream(discover_inputs([str(path)]), SourceSpec(on_bad_record="skip"))
    batches = list(stream)
    assert np.concatenate([b.tokens for b in batches]).tolist() == [5, 2**31 - 1, 7]
    assert [(b.row, b.reason) for batch in batches for b in batch.bad] == (
        [(1, "input_ids[1] = -2 is negative")] if skip_one else [])


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
@pytest.mark.parametrize("column, second", [("loss_mask", [0, 1, 1]), ("answer_start_idx", 1)],
                         ids=["loss_mask", "answer_start_idx"])
def test_a_null_supervision_field_is_a_bad_record(tmp_path, fmt, column, second):
    """A record whose supervision field is null (Parquet/Arrow null) is named so: a null loss mask
    was "loss_mask has 0 values but input_ids has 3", and a null answer start was read as 0 and
    the record packed with every token a target."""
    path = _columnar_file(tmp_path, pa.table({"input_ids": [[1, 2, 3], [4, 5, 6]], column: [None, second]}), fmt)
    assert_pack_refuses(tmp_path, path, f"d.{fmt}: row 0: field '{column}' is null")
    result = run("pack", path, "-o", tmp_path / "out", "--pack-size", 16, "--on-bad-record", "skip", "--json")
    assert result.exit_code == 0, result.output
    counts = orjson.loads(result.stdout)["counts"]
    assert (counts["bad_records"], counts["samples_packed"], counts["target_tokens"]) == (1, 1, 2)


@pytest.mark.parametrize("encoded", [b"\xed\xa0\x80", b"\xed\xbf\xbf"], ids=["first-surrogate", "last-surrogate"])
def test_a_utf8_encoded_surrogate_in_a_field_not_packed_is_malformed(tmp_path, encoded):
    """UTF-8 has no surrogates (ED A0..BF xx): orjson refuses them, and so must the scanner that
    skips the fields packer does not read, or the record is packed from a file that is no JSON."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"input_ids": [1, 2, 3], "text": "ok"}\n{"input_ids": [4, 5, 6], "text": "' + encoded + b'"}\n')
    assert_pack_refuses(tmp_path, path, f"{path}: line 2: malformed JSON: 'utf-8' codec can't decode byte 0xed")

"""``.jsonl.gz`` inputs: igzip (python-isal, the ``gzip`` extra) and Python's gzip module read
every file alike, and whatever either raises for a damaged one is a one-line data error.

``PACKER_GZIP_DECODER`` picks the decompressor (``isal``, the default where isal is installed;
``zlib``, Python's gzip module). The main test pass has isal; the lowest-versions pass does not,
so there the default is Python's gzip module and the isal cases skip.
"""
from __future__ import annotations

import gzip
import io
import zlib

import orjson
import pytest
from typer.testing import CliRunner

from packer_cli import PackSpec, pack
from packer_cli.cli import app
from packer_cli.errors import DataError
from packer_cli.sources import SampleStream, discover_inputs, readers
from packer_cli.spec import SourceSpec

try:
    from isal import igzip
except ImportError:
    igzip = None

needs_isal = pytest.mark.skipif(igzip is None, reason="isal is not installed (the gzip extra)")
DECODERS = [pytest.param("isal", marks=needs_isal), "zlib"]
ENV = readers.ENV_GZIP
runner = CliRunner()


def _lines(rows: int, first: int = 0) -> bytes:
    return b"".join(orjson.dumps({"input_ids": [first + i % 97, 2, 3, i % 1000, 5][: 2 + i % 4],
                                  "loss_mask": [0, 1, 1, 1, 1][: 2 + i % 4]}) + b"\n" for i in range(rows))


def _member(data: bytes, **kwargs) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", **kwargs) as f:
        f.write(data)
    return out.getvalue()


def _members_split_mid_line(data: bytes, pieces: int) -> bytes:
    step = len(data) // pieces + 1
    return b"".join(gzip.compress(data[k:k + step]) for k in range(0, len(data), step))


TEXT = _lines(6000)
#: Files both decompressors must read, each equal to TEXT as plain JSON Lines.
VALID = {
    "one member": gzip.compress(TEXT),
    "members split inside lines": _members_split_mid_line(TEXT, 7),
    "stored blocks (level 0)": gzip.compress(TEXT, compresslevel=0),
    "a file name, a comment-free header and mtime": _member(TEXT, filename="d.jsonl", mtime=123456),
    "zero padding after the last member": gzip.compress(TEXT) + b"\0" * 512,
    "an empty member first": gzip.compress(b"") + gzip.compress(TEXT),
    "a byte order mark": gzip.compress(readers.UTF8_BOM + TEXT),
}


def _damaged() -> dict[str, bytes]:
    whole = gzip.compress(TEXT)
    two = gzip.compress(TEXT[:200_000]) + gzip.compress(TEXT[200_000:])
    crc = bytearray(whole)
    crc[-8] ^= 0x01  # the CRC-32 in the trailer
    size = bytearray(whole)
    size[-4] ^= 0x01  # the length in the trailer
    block = bytearray(gzip.compress(TEXT))
    block[10] ^= 0x06  # the first deflate block's type: 0b11 is reserved
    return {
        "cut in the first member": whole[: len(whole) // 2],
        "cut before the trailer": whole[:-5],
        "cut in the second member": two[: len(two) - 100],
        "CRC wrong": bytes(crc),
        "length wrong": bytes(size),
        "a reserved deflate block type": bytes(block),
        "bytes after the last member": whole + b"trailing text\n",
        "not gzip at all": b"this is not gzip, " * 10,
    }


DAMAGED = _damaged()


def _read(path, decoder, monkeypatch):
    """(records, a digest of every batch's columns), or the DataError the stream raised."""
    monkeypatch.setenv(ENV, decoder)
    stream = SampleStream(discover_inputs([str(path)]), SourceSpec())
    batches = []
    try:
        for batch in stream:
            batches.append((batch.tokens.tobytes(), batch.targets.tobytes(), batch.lengths.tobytes()))
    except DataError as exc:
        return exc
    return stream.records, batches


@pytest.mark.parametrize("decoder", DECODERS)
def test_the_decoder_asked_for_is_the_one_used(tmp_path, monkeypatch, decoder):
    monkeypatch.setenv(ENV, decoder)
    module = igzip if decoder == "isal" else gzip
    assert readers._gzip_module() is module
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(VALID["one member"])
    with readers._open_text(str(path)) as f:
        assert type(f) is (igzip.IGzipFile if decoder == "isal" else gzip.GzipFile)


def test_without_isal_python_gzip_reads(monkeypatch):
    """The default where isal is not installed (a plain ``pip install packer-cli``)."""
    import builtins

    real_import = builtins.__import__

    def no_isal(name, *args, **kwargs):
        if name == "isal" or name.startswith("isal."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(builtins, "__import__", no_isal)
    assert readers._gzip_module() is gzip


@pytest.mark.parametrize("what", sorted(VALID))
@pytest.mark.parametrize("decoder", DECODERS)
def test_valid_files_read_as_their_plain_text(tmp_path, monkeypatch, decoder, what):
    plain = tmp_path / "d.jsonl"
    plain.write_bytes(TEXT)
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(VALID[what])
    want = _read(plain, decoder, monkeypatch)
    assert want[0] == 6000
    assert _read(packed, decoder, monkeypatch) == want


@pytest.mark.parametrize("what", sorted(DAMAGED))
@pytest.mark.parametrize("decoder", DECODERS)
def test_damaged_files_are_a_data_error_naming_the_file(tmp_path, monkeypatch, decoder, what):
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(DAMAGED[what])
    got = _read(path, decoder, monkeypatch)
    assert isinstance(got, DataError), f"{what}: read {got[0]} records"
    assert str(got).startswith(f"{path}: cannot read as JSON Lines: ") and "\n" not in str(got)


@needs_isal
def test_a_damaged_deflate_block_raises_isal_own_error():
    """igzip's IsalError is no OSError or zlib.error: without READ_ERRORS holding it, a damaged
    block ended ``pack`` with a traceback (the case the test above covers with isal)."""
    from isal import isal_zlib

    with pytest.raises(isal_zlib.IsalError):
        igzip.decompress(DAMAGED["a reserved deflate block type"])
    with pytest.raises(zlib.error):
        gzip.decompress(DAMAGED["a reserved deflate block type"])


@pytest.mark.parametrize("decoder", DECODERS)
def test_pack_of_a_damaged_file_is_one_line_and_writes_nothing(tmp_path, monkeypatch, decoder):
    monkeypatch.setenv(ENV, decoder)
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(DAMAGED["a reserved deflate block type"])
    result = runner.invoke(app, ["pack", str(path), "-o", str(tmp_path / "out"), "--pack-size", "64"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "d.jsonl.gz: cannot read as JSON Lines: " in lines[0], result.output
    assert not (tmp_path / "out").exists()


@needs_isal
def test_both_decoders_pack_the_same_shards(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(VALID["members split inside lines"])
    plain = tmp_path / "d.jsonl"
    plain.write_bytes(TEXT)
    shards = {}
    for name, source, decoder in (("isal", path, "isal"), ("zlib", path, "zlib"), ("plain", plain, "isal")):
        monkeypatch.setenv(ENV, decoder)
        pack([str(source)], str(tmp_path / name), PackSpec(pack_size=64))
        shards[name] = [f.read_bytes() for f in sorted((tmp_path / name).glob("*.arrow"))]
    assert shards["isal"] and shards["isal"] == shards["zlib"] == shards["plain"]


def test_a_misspelt_decoder_is_an_error_before_anything_is_read(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(VALID["one member"])
    monkeypatch.setenv(ENV, "igzip")
    for args in (["pack", str(path), "-o", str(tmp_path / "out")], ["pack", str(path), "--dry-run"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert result.output.strip() == f"error: {ENV}='igzip': expected 'isal' or 'zlib' (or unset)"
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv(ENV, " ZLIB ")  # any case, spaces around
    assert runner.invoke(app, ["pack", str(path), "-o", str(tmp_path / "out")]).exit_code == 0


def test_verify_of_a_gzipped_source_with_a_misspelt_decoder_is_a_usage_error(tmp_path, monkeypatch):
    """Not a finding against the output ("the source could not be read", exit 1): the command's own error."""
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(VALID["one member"])
    pack([str(path)], str(tmp_path / "out"), PackSpec(pack_size=64))
    monkeypatch.setenv(ENV, "gzip")
    result = runner.invoke(app, ["verify", str(tmp_path / "out"), "--source", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {ENV}='gzip': expected 'isal' or 'zlib' (or unset)"
    monkeypatch.setenv(ENV, "zlib")
    assert runner.invoke(app, ["verify", str(tmp_path / "out"), "--source", str(path)]).exit_code == 0

"""LZ4_RAW pages: the compiled LZ4 block decoder against a plain Python encoder of the format
(literal runs, matches overlapping their source at offsets 1..7, lengths continued over several
bytes, every offset up to 65535) and against pyarrow's compressor, its refusals (every
truncation, every wrong output size, the end-of-block rules left to pyarrow), damaged streams
and pages compared with pyarrow's reading, and whole files written by pyarrow read by packer's
decoder equal to pyarrow's reading, down to the packed shards."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packer_cli._arrow import numpy_dtype
from packer_cli._thrift import read_fields, write_fields
from packer_cli.sources._parquet_kernels import TRUNCATED, UNUSUAL
from packer_cli.sources._parquet_lz4 import BAD_OFFSET, OVERRUN, SHORT, lz4_block_decode
from packer_cli.sources.parquet_lists import ListColumnReader, RowGroupRuns
from parquet_checks import count_run_paths, flips_read_otherwise, packed_shard_digests

LZ4 = pa.Codec("lz4_raw")
HARD_ERRORS = {TRUNCATED, BAD_OFFSET, OVERRUN}  # liblz4 refuses these streams whatever their place


# --- a plain Python LZ4 block encoder ---------------------------------------------------------

def _more(length: int) -> bytes:
    """The bytes continuing a nibble of 15: 255s, then the rest (below 255)."""
    return bytes([255] * (length // 255) + [length % 255])


def sequence(literals: bytes, offset: int | None = None, match: int = 0) -> bytes:
    """One sequence: ``literals``, then (unless ``offset`` is None: the last sequence) a match of
    ``match`` bytes (4 or more) ``offset`` bytes back."""
    lit = len(literals)
    code = 0 if offset is None else match - 4
    out = bytearray([min(lit, 15) << 4 | min(code, 15)])
    if lit >= 15:
        out += _more(lit - 15)
    out += literals
    if offset is not None:
        out += offset.to_bytes(2, "little")
        if code >= 15:
            out += _more(code - 15)
    return bytes(out)


def block(sequences, last: bytes) -> bytes:
    """The block of ``sequences`` [(literals, offset, match length)] and the last literals."""
    return b"".join(sequence(*s) for s in sequences) + sequence(last)


def expand(sequences, last: bytes) -> bytes:
    """What the block of ``sequences`` decodes to, copied byte by byte as the format says."""
    out = bytearray()
    for literals, offset, match in sequences:
        out += literals
        for _ in range(match):
            out.append(out[-offset])
    return bytes(out + last)


def compress(data: bytes, window: int = 65535) -> bytes:
    """A greedy LZ4 compressor: the latest earlier position of each 4 bytes, matches within
    ``window`` bytes back, extended as far as the end-of-block rules allow (a match starts at
    least 12 bytes before the end and ends at least 5 before it)."""
    n, seen, sequences = len(data), {}, []
    start = i = 0
    while i + 12 <= n:
        key = data[i:i + 4]
        j = seen.get(key)
        seen[key] = i
        if j is None or i - j > window:
            i += 1
            continue
        length = 4
        while i + length < n - 5 and data[j + length] == data[i + length]:
            length += 1
        sequences.append((data[start:i], i - j, length))
        for k in range(i + 1, min(i + length, n - 3)):
            seen[data[k:k + 4]] = k
        i += length
        start = i
    return block(sequences, data[start:])


def decode(stream: bytes, n: int, lo: int = 0, hi: int | None = None):
    buf = np.frombuffer(stream, dtype=np.uint8)
    out = np.full(n, 0xA5, dtype=np.uint8)
    return lz4_block_decode(buf, lo, len(stream) if hi is None else hi, out), out.tobytes()


def check(stream: bytes, want: bytes) -> None:
    """The kernel decodes ``stream`` to exactly ``want``, as pyarrow's liblz4 does."""
    status, got = decode(stream, len(want))
    assert status == len(want)
    assert got == want
    assert LZ4.decompress(stream, decompressed_size=len(want)).to_pybytes() == want


# --- valid streams --------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 4, 5, 11, 12, 13, 14, 15, 16, 17, 23, 24, 269, 270, 271, 524, 525, 70_000])
def test_literals_only(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    stream = sequence(data)
    assert len(stream) == 1 + size + (len(_more(size - 15)) if size >= 15 else 0)
    check(stream, data)


def test_an_empty_page_is_the_single_byte_0_and_pyarrow_judges_any_other_block():
    """liblz4 reads only the byte 0 as an empty block; a token of no literals (0x01-0x0F) also
    writes nothing, but packer leaves it to pyarrow rather than read what liblz4 refuses."""
    assert decode(b"\x00", 0)[0] == 0
    for token in range(1, 16):
        assert decode(bytes([token]), 0)[0] == UNUSUAL
    assert decode(b"\x00\x00", 0)[0] == TRUNCATED  # (as any byte after the last literals)


@pytest.mark.parametrize("offset", range(1, 17))
@pytest.mark.parametrize("length", [4, 5, 7, 8, 9, 13, 15, 16, 17, 18, 19, 24, 31, 33, 100, 1000])
def test_overlapping_and_short_offset_matches(offset, length):
    """A match as long as or longer than its offset repeats the bytes before it (offset 1: one
    byte), copied one by one at first and then 8 bytes at a time."""
    head = bytes(range(40, 40 + offset)) * 2
    for lead in (head, head[:offset]):  # the match right after its source, and further on
        sequences = [(lead, offset, length)]
        last = b"tail-bytes-12"
        check(block(sequences, last), expand(sequences, last))


@pytest.mark.parametrize("literals", [14, 15, 16, 269, 270, 271, 524, 525, 526, 2000])
@pytest.mark.parametrize("match", [18, 19, 20, 273, 274, 275, 528, 529, 530, 5000])
def test_lengths_continued_over_several_bytes(literals, match):
    """Literal and match lengths at and around each step of their continuation bytes (15, then
    255 more a byte: a byte of 255 continues, a byte below ends)."""
    rng = np.random.default_rng(literals * 7 + match)
    sequences = [(rng.integers(0, 256, literals, dtype=np.uint8).tobytes(), 9, match),
                 (rng.integers(0, 256, 3, dtype=np.uint8).tobytes(), 1, match)]
    last = rng.integers(0, 256, literals, dtype=np.uint8).tobytes()
    check(block(sequences, last), expand(sequences, last))


def test_matches_at_every_offset_up_to_65535():
    rng = np.random.default_rng(11)
    sequences = [(rng.integers(0, 256, 65535, dtype=np.uint8).tobytes(), 65535, 4)]
    sequences += [(b"" if k % 3 else bytes([k % 251]), k, 4 + k % 23) for k in range(1, 65536)]
    last = b"the last literals"
    check(block(sequences, last), expand(sequences, last))


def test_the_end_of_block_rules_at_their_limits():
    """The last match starting exactly 12 bytes before the end and ending exactly 5 before it."""
    sequences = [(b"0123456789abcdef", 8, 7)]
    last = b"vwxyz"
    want = expand(sequences, last)
    assert len(want) == 28  # the match at 16 = 28 - 12, ending at 23 = 28 - 5
    check(block(sequences, last), want)


@st.composite
def sequences(draw):
    """Sequences of any lengths and offsets the format allows, and last literals that keep the
    end-of-block rules."""
    out, size = [], 0
    for _ in range(draw(st.integers(0, 12))):
        lit = draw(st.integers(0 if size else 1, 40) | st.integers(0 if size else 1, 700))
        size += lit
        offset = draw(st.integers(1, min(size, 65535)) | st.integers(1, min(size, 8)))
        match = draw(st.integers(4, 40) | st.integers(4, 1000))
        out.append((draw(st.binary(min_size=lit, max_size=lit)), offset, match))
        size += match
    last = draw(st.binary(min_size=12 if out else 0, max_size=60))
    return out, last


@settings(max_examples=300, deadline=None)
@given(sequences())
def test_the_decoder_reads_back_every_stream_the_format_allows(drawn):
    sequences, last = drawn
    check(block(sequences, last), expand(sequences, last))


def _payloads():
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 50_000, 30_000).astype(np.int32).tobytes()
    text = b" ".join(rng.choice([b"the", b"packer", b"reads", b"lz4", b"pages", b"of", b"tokens"], 20_000))
    return {
        "random": rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes(),
        "zeros": bytes(100_000),
        "one byte repeated": b"\x07" * 5_000,
        "period 3": b"abc" * 10_000,
        "period 7": b"abcdefg" * 10_000,
        "small ints": rng.integers(0, 3, 100_000, dtype=np.uint8).tobytes(),
        "int32 tokens": tokens,
        "int32 tokens repeated": tokens[:4000] * 30,
        "text": text,
        "tiny": b"hi",
        "empty": b"",
    }


@pytest.mark.parametrize("name", list(_payloads()))
def test_streams_pyarrow_compresses(name):
    data = _payloads()[name]
    check(LZ4.compress(data, asbytes=True), data)
    if len(data) <= 20_000 or name == "random":  # the Python encoder is slow on long matches
        check(compress(data[:20_000]), data[:20_000])


def test_the_python_encoder_uses_overlapping_and_long_matches():
    data = b"a" * 1000 + b"ab" * 300 + b"abcdefg" * 100 + bytes(range(256)) * 3 + b"end of it all"
    stream = compress(data)
    assert len(stream) < len(data) // 10
    check(stream, data)


def test_a_block_inside_a_larger_buffer_is_read_between_its_bounds():
    stream = compress(b"xyz" * 100 + b"0123456789ab")
    padded = b"\xff" * 7 + stream + b"\x00" * 9
    assert decode(padded, 312, 7, 7 + len(stream)) == (312, b"xyz" * 100 + b"0123456789ab")


# --- refusals -------------------------------------------------------------------------------------

def _valid_streams():
    """Blocks and what they decode to, which holds no byte 0xEE."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 200, 3000).astype(np.int32).tobytes()
    sequences = [(b"abcdefghij", 3, 40), (b"", 1, 300), (bytes(range(200)), 250, 19 + 255 * 2)]
    return {
        "pyarrow's, tokens": (LZ4.compress(tokens, asbytes=True), tokens),
        "python's, tokens": (compress(tokens), tokens),
        "long lengths": (block(sequences, b"0123456789abcdef" * 20), expand(sequences, b"0123456789abcdef" * 20)),
        "literals only": (sequence(bytes(range(200)) * 2), bytes(range(200)) * 2),
    }


@pytest.mark.parametrize("name", list(_valid_streams()))
def test_a_truncated_stream_is_an_error_at_every_cut(name):
    """Every cut is an error, and nothing past the cut is read: the same cut in a buffer going on
    with bytes 0xEE gives the same status, and no 0xEE reaches the output."""
    stream, data = _valid_streams()[name]
    assert 0xEE not in data
    for cut in range(len(stream)):
        status, _ = decode(stream[:cut], len(data))
        assert status in (TRUNCATED, SHORT), cut
        status_in_buffer, got = decode(stream[:cut] + b"\xee" * 64, len(data), 0, cut)
        assert status_in_buffer == status, cut
        assert 0xEE not in got, cut


@pytest.mark.parametrize("name", list(_valid_streams()))
@pytest.mark.parametrize("change", [-300, -13, -5, -4, -1, 1, 4, 5, 13, 300])
def test_another_output_size_is_an_error(name, change):
    """An output smaller than the block's is written past (the block goes on), a larger one is
    left short: both errors, in each direction."""
    stream, data = _valid_streams()[name]
    size = len(data) + change
    if size < 0:
        return
    assert decode(stream, size)[0] == (OVERRUN if change < 0 else SHORT)


def test_an_empty_stream_and_an_empty_output():
    assert decode(b"", 0)[0] == SHORT  # liblz4 refuses an empty block (packer does not decode one)
    assert decode(b"", 10)[0] == SHORT
    assert decode(b"\x00", 0)[0] == 0  # one token without literals: liblz4's empty block
    assert decode(b"\x00", 1)[0] == SHORT
    assert decode(b"\x10A", 0)[0] == OVERRUN


@pytest.mark.parametrize("stream,n,status,why", [
    (sequence(b"abcd", 5, 4) + sequence(b"0123456789ab"), 20, BAD_OFFSET, "an offset past the output's start"),
    (sequence(b"abcd", 65535, 30) + sequence(b"0123456789ab"), 46, BAD_OFFSET, "a far offset near the start"),
    (sequence(b"", 1, 4) + sequence(b"0123456789ab"), 16, BAD_OFFSET, "a match before any literal"),
    (sequence(b"abcd", 2, 20) + sequence(b"0123456789ab"), 20, OVERRUN, "a match past the output's end"),
    (sequence(b"abcd" * 8), 31, OVERRUN, "literals past the output's end"),
    (sequence(b"abcd" * 8) + b"\x00", 32, TRUNCATED, "a byte after the last literals"),
    (sequence(b"abcd" * 8)[:-1], 32, TRUNCATED, "literals cut short"),
    (bytes([0xF0, 255, 255]), 600, TRUNCATED, "a literal length whose bytes run out"),
    (sequence(b"abcdefgh", 4, 40)[:-1], 100, TRUNCATED, "a match length whose bytes run out"),
    (sequence(b"abcdefgh", 4, 8)[:-1], 100, TRUNCATED, "half an offset"),
    (sequence(b"abcdefgh", 4, 8), 20, SHORT, "a stream ending after a match, output not full"),
    (sequence(b"abcdefgh", 4, 8) + sequence(b"0123456789ab"), 40, SHORT, "an output left short"),
    # the end-of-block rules (and offset 0), some of which liblz4 reads: pyarrow judges
    (sequence(b"abcdefgh", 8, 8), 16, UNUSUAL, "a last sequence with a match"),
    (sequence(b"abcdefgh", 0, 8) + sequence(b"0123456789ab"), 28, UNUSUAL, "offset 0 (liblz4: zeros)"),
    (sequence(b"0123456789abcdef", 8, 7) + sequence(b"wxyz"), 27, UNUSUAL, "a match into the last 5 bytes"),
    (sequence(b"0123456789abcdefg", 8, 6) + sequence(b"vwxyz"), 28, UNUSUAL,
     "a match starting 11 bytes before the end"),
    # liblz4's shortcut reads these two (pyarrow 26: 32 and 34 bytes of data)
    (sequence(bytes(range(14)), 8, 18) + b"\x00", 32, UNUSUAL, "a match filling the output, an empty last sequence"),
    (sequence(bytes(range(14)), 8, 18) + sequence(b"ZZ"), 34, UNUSUAL, "two last literals"),
    # an error further on is that error, not UNUSUAL
    (sequence(b"abcdefgh", 0, 8) + sequence(b"0123456789ab")[:-1], 28, TRUNCATED, "offset 0, then cut short"),
    (sequence(bytes(range(14)), 8, 18) + sequence(b"ZZ"), 35, SHORT, "two last literals, output left short"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_streams_the_decoder_refuses_or_leaves_to_pyarrow(stream, n, status, why):
    assert decode(stream, n)[0] == status, why
    if status in HARD_ERRORS:
        with pytest.raises((pa.ArrowException, OSError)):  # "Corrupt Lz4 compressed data."
            LZ4.decompress(stream, decompressed_size=n)


@pytest.mark.parametrize("name", ["int32 tokens", "text", "small ints"])
def test_a_damaged_stream_is_an_error_or_pyarrow_s_data(name):
    """Every byte of a compressed stream changed three ways: what the decoder reads is what
    liblz4 reads, and a stream it refuses outright liblz4 refuses too (an output left short, or
    a stream left to pyarrow, liblz4 may read: pyarrow's Parquet reader then judges the page)."""
    data = _payloads()[name][:3000]
    stream = LZ4.compress(data, asbytes=True)
    seen = set()
    for at in range(len(stream)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(stream)
            damaged[at] ^= mask
            status, got = decode(bytes(damaged), len(data))
            seen.add(status)
            try:
                theirs = LZ4.decompress(bytes(damaged), decompressed_size=len(data)).to_pybytes()
            except (pa.ArrowException, OSError):
                theirs = None
            if status == len(data):
                assert got == theirs, (at, mask)
            elif status in HARD_ERRORS:
                assert theirs is None, (at, mask, status)
    assert {len(data), TRUNCATED, OVERRUN} <= seen


# --- files ----------------------------------------------------------------------------------------

def _codecs(path) -> set[int]:
    """The codec numbers of a file's column chunks, from its footer."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[-8:-4], "little")
    footer = read_fields(raw[-8 - size:-8])[0]
    groups = next(v for fid, _, v in footer if fid == 4)[1]
    codecs = set()
    for group in groups:
        for column in next(v for fid, _, v in group if fid == 1)[1]:
            meta = next(v for fid, _, v in column if fid == 3)
            codecs.add(next(v for fid, _, v in meta if fid == 4))
    return codecs


def _token_table(value_type, rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 300, rows)
    dtype = numpy_dtype(value_type)  # (pandas, which to_pandas_dtype needs, is not in the lowest-versions pass)
    info = np.iinfo(dtype)
    values = np.where(rng.random(int(lengths.sum())) < 0.5, rng.integers(0, 60, int(lengths.sum())),
                      rng.integers(info.min, info.max, int(lengths.sum()), endpoint=True)).astype(dtype)
    values[:2] = [info.min, info.max]
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.table({
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(values, type=value_type)),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 2, values.size), type=pa.uint8()))})


@pytest.mark.parametrize("value_type", [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(),
                                        pa.uint32()])
@pytest.mark.parametrize("page_version", ["1.0", "2.0"])
@pytest.mark.parametrize("dictionary", [True, False], ids=["dictionary", "plain"])
def test_lz4_files_are_read_by_packer_equal_to_pyarrow(tmp_path, value_type, page_version, dictionary):
    path = tmp_path / "lz4.parquet"
    pq.write_table(_token_table(value_type, 600, seed=5), path, row_group_size=250, data_page_size=4096,
                   data_page_version=page_version, compression="lz4", use_dictionary=dictionary)
    assert _codecs(path) == {7}  # LZ4_RAW
    for batch_rows in (7, 2048):
        reader = ListColumnReader(str(path), ["input_ids", "loss_mask"], batch_rows=batch_rows)
        got = pa.Table.from_batches(list(reader))
        assert (reader.fast_rows, reader.arrow_rows, reader.fallback_reason) == (600, 0, None)
        assert got.equals(pq.read_table(path, columns=["input_ids", "loss_mask"]))


def test_runs_of_small_lz4_row_groups_are_decoded_whole(tmp_path, monkeypatch):
    """A Megatron-Bridge-like file (PLAIN pages v1, many small groups): RowGroupRuns' bulk path."""
    path = tmp_path / "runs.parquet"
    table = _token_table(pa.int64(), 400, seed=8)
    pq.write_table(table, path, row_group_size=20, compression="lz4", use_dictionary=False)
    taken = count_run_paths(monkeypatch)
    pf = pq.ParquetFile(path)
    with RowGroupRuns(str(path), pf) as runs:
        for first, end in ((0, 7), (7, pf.metadata.num_row_groups)):
            batch = runs.read(first, end, table.column_names)
            assert batch is not None
            assert pa.Table.from_batches([batch]).equals(pf.read_row_groups(range(first, end)).cast(batch.schema))
    assert taken == {"bulk": 2, "paged": 0}


def test_legacy_lz4_pages_are_left_to_pyarrow(tmp_path):
    """Codec 5 (LZ4: Hadoop's framing, or a bare block, which pyarrow tells apart by trying) is
    pyarrow's: the same file marked LZ4 instead of LZ4_RAW is read by pyarrow, equal."""
    path = tmp_path / "lz4.parquet"
    pq.write_table(_token_table(pa.int32(), 300, seed=6), path, row_group_size=100, compression="lz4")
    raw = path.read_bytes()
    size = int.from_bytes(raw[-8:-4], "little")
    footer = read_fields(raw[-8 - size:-8])[0]
    for group in next(v for fid, _, v in footer if fid == 4)[1]:
        for column in next(v for fid, _, v in group if fid == 1)[1]:
            meta = next(v for fid, _, v in column if fid == 3)
            meta[:] = [(fid, kind, 5 if fid == 4 else value) for fid, kind, value in meta]
    body = bytearray()
    write_fields(body, footer)
    legacy = tmp_path / "legacy.parquet"
    legacy.write_bytes(raw[:-8 - size] + bytes(body) + len(body).to_bytes(4, "little") + b"PAR1")
    assert _codecs(legacy) == {5}
    reader = ListColumnReader(str(legacy), ["input_ids", "loss_mask"])
    got = pa.Table.from_batches(list(reader))
    assert (reader.fast_rows, reader.arrow_rows) == (0, 300)
    assert reader.fallback_reason == "column 'input_ids' is compressed with LZ4"
    assert got.equals(pq.read_table(path))


def _page_span(path, column: int = 0) -> tuple[int, int]:
    """The file's bytes holding the compressed part of the first data page of the first chunk
    of ``column`` (a data page v2's values, after its levels)."""
    from packer_cli._parquet_thrift import parse_page_header

    chunk = pq.ParquetFile(path).metadata.row_group(0).column(column)
    raw = path.read_bytes()
    header = parse_page_header(raw[chunk.data_page_offset:chunk.data_page_offset + 4096])
    start = chunk.data_page_offset + header.size
    if header.page_type == 3:  # DATA_PAGE_V2: its levels are stored uncompressed
        start += header.rep_bytes + header.def_bytes
    return start, chunk.data_page_offset + header.size + header.compressed_size


@pytest.mark.parametrize("page_version", ["1.0", "2.0"])
def test_a_damaged_page_is_an_error_or_pyarrow_s_reading_never_other_data(tmp_path, page_version):
    """Every byte of an LZ4_RAW page's compressed bytes changed three ways (its low bit, its
    high bit, all its bits): packer's reader raises ValueError, or returns exactly what pyarrow
    returns for the same bytes (pyarrow's Parquet reader checks the decompressed size; its
    ``Codec.decompress`` does not, and a short block read as data with garbage after it)."""
    rng = np.random.default_rng(9)
    parts = [rng.integers(0, 300, int(k)) for k in rng.integers(1, 40, 8)]
    parts[3] = np.repeat(rng.integers(0, 300, 10), 6)  # matches: runs of one token
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets),
                                                            pa.array(np.concatenate(parts), type=pa.int32()))})
    path = tmp_path / "base.parquet"
    pq.write_table(table, path, use_dictionary=False, compression="lz4", data_page_version=page_version)
    assert _codecs(path) == {7}
    start, end = _page_span(path)
    assert 200 < end - start < 2000
    raw = path.read_bytes()
    problems, read = flips_read_otherwise(raw, start, end, tmp_path)
    assert not problems, problems[:10]
    assert read  # literal bytes changed: other data, which both read


def test_pack_of_an_lz4_file_writes_the_shards_of_the_same_table_snappy(tmp_path, synthetic_parquet):
    table = pq.read_table(synthetic_parquet)
    snappy, lz4 = tmp_path / "snappy.parquet", tmp_path / "lz4.parquet"
    pq.write_table(table, snappy, compression="snappy", row_group_size=700)
    pq.write_table(table, lz4, compression="lz4", row_group_size=700)
    assert _codecs(lz4) == {7}
    assert packed_shard_digests(snappy, tmp_path / "snappy", cp=2) == packed_shard_digests(lz4, tmp_path / "lz4", cp=2)

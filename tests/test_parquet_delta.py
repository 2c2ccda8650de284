"""DELTA_BINARY_PACKED pages: the compiled decoder against a plain Python encoder of the format
(block sizes, miniblock counts and bit widths writers rarely use, up to 64 bits), its refusals,
and whole files written by pyarrow read by packer's decoder equal to pyarrow's reading."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packer_cli._arrow import numpy_dtype
from packer_cli.sources._parquet_delta import delta_decode
from packer_cli.sources._parquet_kernels import TRUNCATED, UNUSUAL
from packer_cli.sources.parquet_lists import ListColumnReader
from parquet_checks import flips_read_otherwise, packed_shard_digests


def uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def zigzag(value: int, bits: int) -> int:
    return ((value << 1) ^ (value >> (bits - 1))) & ((1 << bits) - 1)


def encode(values, bits: int, block: int = 128, minis: int = 4, *, pad_last: bool = True,
           absent_minis: bool = False) -> bytes:
    """The DELTA_BINARY_PACKED stream of ``values`` (signed ints of ``bits`` bits), written the way
    the format describes it: deltas wrap at the type's width; each block's min delta is taken off
    and each miniblock bit-packed at the width its largest remainder needs."""
    modulus = 1 << bits
    values = [int(v) for v in values]
    out = bytearray(uvarint(block) + uvarint(minis) + uvarint(len(values)))
    out += uvarint(zigzag(values[0], 64) if values else 0)
    deltas = [(b - a) % modulus for a, b in zip(values, values[1:])]
    signed = [d - modulus if d >= modulus // 2 else d for d in deltas]
    per_mini = block // minis
    for start in range(0, len(signed), block):
        chunk = signed[start:start + block]
        low = min(chunk)
        rest = [(d - low) % modulus for d in chunk]
        out += uvarint(zigzag(low, 64))
        widths, bodies = [], []
        for m in range(minis):
            part = rest[m * per_mini:(m + 1) * per_mini]
            if not part:
                widths.append(0 if not absent_minis else 7)  # any width: the miniblock is not there
                bodies.append(b"")
                continue
            width = max(part).bit_length()
            widths.append(width)
            count = per_mini if pad_last else len(part)
            packed = sum(v << (k * width) for k, v in enumerate(part))
            bodies.append(packed.to_bytes((count * width + 7) // 8, "little"))
        out += bytes(widths) + b"".join(bodies)
    return bytes(out)


def decode(stream: bytes, n: int, bits: int):
    buf = np.frombuffer(stream, dtype=np.uint8)
    out = np.zeros(n, dtype=np.int32 if bits == 32 else np.int64)
    return delta_decode(buf, 0, len(stream), n, bits, out), out


def typed_values(draw, bits: int, n: int):
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    style = draw(st.sampled_from(["extremes", "small steps", "tokens", "constant"]))
    if style == "extremes":
        return draw(st.lists(st.sampled_from([low, high, 0, -1, 1]) | st.integers(low, high), min_size=n, max_size=n))
    if style == "small steps":
        start = draw(st.integers(low, high))
        steps = draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n))
        return [((start + sum(steps[:k + 1]) - low) % (1 << bits)) + low for k in range(n)]
    if style == "tokens":
        return draw(st.lists(st.integers(0, 151_000), min_size=n, max_size=n))
    return [draw(st.integers(low, high))] * n


@settings(max_examples=300, deadline=None)
@given(data=st.data(), bits=st.sampled_from([32, 64]), n=st.integers(0, 700),
       shape=st.sampled_from([(128, 1), (128, 4), (256, 8), (512, 2), (384, 3)]), absent=st.booleans())
def test_the_decoder_reads_back_every_stream_the_format_allows(data, bits, n, shape, absent):
    values = typed_values(data.draw, bits, n)
    stream = encode(values, bits, *shape, absent_minis=absent)
    status, out = decode(stream, n, bits)
    assert status == len(stream)
    assert out.tolist() == values


def test_widths_over_56_bits_and_near_the_end_take_the_byte_path():
    rng = np.random.default_rng(3)
    info = np.iinfo(np.int64)
    values = rng.integers(info.min, info.max, 400, endpoint=True).tolist()  # deltas over the full range
    values[:2] = [info.min, info.max]
    stream = encode(values, 64)
    first_block = len(uvarint(128) + uvarint(4) + uvarint(400) + uvarint(zigzag(values[0], 64)))
    first_block += len(uvarint(zigzag(min(((b - a + 2**63) % 2**64) - 2**63 for a, b in zip(values, values[1:129])),
                                      64)))
    assert set(stream[first_block:first_block + 4]) >= {64}  # width 64 miniblocks
    status, out = decode(stream, len(values), 64)
    assert status == len(stream) and out.tolist() == values


@pytest.mark.parametrize("bits", [32, 64])
def test_a_truncated_stream_is_an_error_at_every_cut(bits):
    values = np.random.default_rng(1).integers(0, 100_000, 600).tolist()
    stream = encode(values, bits, 256, 8)
    results = {decode(stream[:cut], len(values), bits)[0] for cut in range(len(stream))}
    assert results <= {TRUNCATED, UNUSUAL}  # the last miniblock's padding cut short: left to pyarrow
    assert decode(stream[:len(stream) - 40], len(values), bits)[0] == TRUNCATED


@pytest.mark.parametrize("stream,n,why", [
    (uvarint(100) + uvarint(4) + uvarint(1) + uvarint(0), 1, "block size not a multiple of 128"),
    (uvarint(128) + uvarint(0) + uvarint(1) + uvarint(0), 1, "no miniblocks"),
    (uvarint(128) + uvarint(3) + uvarint(1) + uvarint(0), 1, "miniblocks that do not divide the block"),
    (uvarint(128) + uvarint(8) + uvarint(1) + uvarint(0), 1, "16 values a miniblock"),
    (uvarint(128) + uvarint(4) + uvarint(2) + uvarint(0), 1, "another value count than the page's"),
    (encode([1, 2, 3], 32) + b"\x00", 3, "a byte after the values"),
    (encode([1, 5, 2, 9], 32, pad_last=False), 4, "a last miniblock not padded"),
])
def test_streams_writers_do_not_produce_are_left_to_pyarrow(stream, n, why):
    assert decode(stream, n, 32)[0] == UNUSUAL, why


def test_a_bit_width_above_the_type_s_is_left_to_pyarrow():
    stream = bytearray(encode(list(range(0, 4000, 7)), 32))
    header = len(uvarint(128) + uvarint(4) + uvarint(572) + uvarint(0))
    stream[header + 1] = 33  # the first block's first miniblock: width 33 in a 32-bit column
    assert decode(bytes(stream), 572, 32)[0] == UNUSUAL


@pytest.mark.parametrize("value_type", [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(),
                                        pa.uint32()])
@pytest.mark.parametrize("page_version, codec", [("1.0", "snappy"), ("2.0", "zstd"), ("1.0", "none"),
                                                 ("2.0", "gzip")])
def test_files_of_delta_pages_are_read_by_packer_equal_to_pyarrow(tmp_path, value_type, page_version, codec):
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 400, 700)
    dtype = numpy_dtype(value_type)  # (pandas, which to_pandas_dtype needs, is not in the lowest-versions pass)
    info = np.iinfo(dtype)
    values = rng.integers(info.min, info.max, int(lengths.sum()), endpoint=True).astype(dtype)
    values[:4] = [info.min, info.max, 0, info.max]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    table = pa.table({
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type)),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 2, values.size),
                                                                           type=pa.uint8()))})
    path = tmp_path / "delta.parquet"
    pq.write_table(table, path, row_group_size=250, data_page_size=4096, data_page_version=page_version,
                   compression=codec, use_dictionary=False,
                   column_encoding={"input_ids.list.element": "DELTA_BINARY_PACKED",
                                    "loss_mask.list.element": "DELTA_BINARY_PACKED"})
    assert "DELTA_BINARY_PACKED" in pq.ParquetFile(path).metadata.row_group(0).column(0).encodings
    for batch_rows in (7, 2048):
        reader = ListColumnReader(str(path), ["input_ids", "loss_mask"], batch_rows=batch_rows)
        got = pa.Table.from_batches(list(reader))
        assert (reader.fast_rows, reader.arrow_rows, reader.fallback_reason) == (700, 0, None)
        assert got.equals(pq.read_table(path, columns=["input_ids", "loss_mask"]))


def test_pack_of_a_delta_file_writes_the_shards_of_the_same_table_dictionary_encoded(tmp_path, synthetic_parquet):
    table = pq.read_table(synthetic_parquet)
    delta = tmp_path / "delta.parquet"
    pq.write_table(table, delta, use_dictionary=False, row_group_size=700,
                   column_encoding={"input_ids.list.element": "DELTA_BINARY_PACKED",
                                    "loss_mask.list.element": "DELTA_BINARY_PACKED"})
    assert packed_shard_digests(synthetic_parquet, tmp_path / "dict", cp=2) == \
        packed_shard_digests(delta, tmp_path / "delta", cp=2)


def _delta_file(path, value_type, rows: int, seed: int) -> tuple[int, int]:
    """A one-page file of DELTA_BINARY_PACKED values (data page v2, uncompressed, so a byte of the
    file is a byte of the stream) and the span of its first page's values in the file."""
    from packer_cli._parquet_thrift import parse_page_header

    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 50_000, int(k)) for k in rng.integers(1, 200, rows)]  # token ids
    parts[2] = rng.integers(0, 2**30, 150)  # a row of wide deltas
    lengths = [len(p) for p in parts]
    values = np.concatenate(parts)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))})
    pq.write_table(table, path, use_dictionary=False, compression="none", data_page_version="2.0",
                   column_encoding={"input_ids.list.element": "DELTA_BINARY_PACKED"})
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(0)
    raw = path.read_bytes()
    header = parse_page_header(raw[chunk.data_page_offset:chunk.data_page_offset + 4096])
    start = chunk.data_page_offset + header.size + header.rep_bytes + header.def_bytes
    return start, chunk.data_page_offset + header.size + header.compressed_size


@pytest.mark.parametrize("value_type", [pa.int32(), pa.int64()])
def test_a_damaged_stream_is_an_error_or_pyarrow_s_reading_never_other_data(tmp_path, value_type):
    """Every byte of a page's DELTA stream changed three ways (its low bit, its high bit, all its
    bits): packer's reader raises ValueError, or returns exactly what pyarrow returns for the same
    bytes. A varint that lost its high bits, or a miniblock size that wrapped, had read as other
    data without an error where pyarrow refuses the page (and a wrapped size read out of bounds)."""
    path = tmp_path / "base.parquet"
    start, end = _delta_file(path, value_type, rows=6, seed=1)
    raw = path.read_bytes()
    problems, _ = flips_read_otherwise(raw, start, end, tmp_path)
    assert not problems, problems[:10]


def _varints(*values: int) -> bytes:
    return b"".join(uvarint(v) for v in values)


@pytest.mark.parametrize("stream,n,bits,why", [
    # a block size of 2**63: the miniblock size wrapped negative and the read went out of bounds
    (_varints(2**63, 1, 300, zigzag(5, 64), 0) + bytes([1]) + bytes(64), 300, 32, "block size over 32 bits"),
    # 2**61 + 128 in 4 miniblocks: 32 bits a value made the miniblock 1,024 bits long, a stream that
    # ended where the page does and read as data pyarrow refuses
    (_varints(2**61 + 128, 4, 33, zigzag(100, 64), zigzag(1, 64)) + bytes([32, 0, 0, 0]) + bytes(128), 33, 32,
     "block size over 32 bits, a wrapped miniblock size"),
    (_varints(128, 4, 2**32 + 2, 0), 2, 32, "value count over 32 bits"),
    (bytes([0x80, 0x81, 0x80, 0x80, 0x80, 0x00]) + _varints(4, 2, 0), 2, 32, "a 6-byte varint in a header"),
    (_varints(128, 4, 2) + bytes([0x80, 0x80, 0x80, 0x80, 0x10]), 2, 32, "a first value past 32 bits"),
    (_varints(128, 4, 2, 0) + bytes([0x80, 0x80, 0x80, 0x80, 0x80, 0x01]) + bytes([1, 0, 0, 0]) + bytes(4), 2, 32,
     "a min delta of 6 bytes in a 32-bit column"),
    (_varints(128, 4, 2) + bytes([0xFF] * 9 + [0x03]), 2, 64, "a 64-bit first value with bits past 64"),
    (_varints(128, 4, 2, 0, 0) + bytes([1, 0, 0, 33]) + bytes(4), 2, 32, "an unused miniblock 33 bits wide"),
])
def test_streams_pyarrow_refuses_are_left_to_it(stream, n, bits, why):
    assert decode(stream, n, bits)[0] == UNUSUAL, why

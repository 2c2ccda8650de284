"""Thrift's compact protocol (packer_cli._thrift): any typed struct written reads back the same,
pyarrow's own footers and page headers round-trip byte for byte, and damaged bytes are refused."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packer_cli._thrift import (
    BINARY, BYTE, DOUBLE, FALSE, I16, I32, I64, LIST, MAP, SET, STRUCT, TRUE, ThriftError, Truncated, Written,
    read_fields, read_struct, write_fields,
)

_SCALARS = {
    BYTE: st.integers(-128, 127),
    I16: st.integers(-2**15, 2**15 - 1),
    I32: st.integers(-2**31, 2**31 - 1),
    I64: st.integers(-2**63, 2**63 - 1),
    DOUBLE: st.floats(allow_nan=False),
    BINARY: st.binary(max_size=40),
}


def _element(kind: int, depth: int):
    """Items of a collection of ``kind`` (booleans are plain bools there)."""
    if kind in (TRUE, FALSE):
        return st.booleans()
    if kind == STRUCT:
        return _struct(depth + 1)
    return _SCALARS[kind]


def _collection(depth: int):
    kinds = st.sampled_from([TRUE, BYTE, I16, I32, I64, DOUBLE, BINARY] + ([STRUCT] if depth < 3 else []))
    return kinds.flatmap(lambda k: st.tuples(st.just(k), st.lists(_element(k, depth), max_size=20)))


def _map(depth: int):
    kinds = st.sampled_from([TRUE, I32, BINARY])
    return st.tuples(kinds, kinds).flatmap(lambda kv: st.tuples(
        st.just(kv[0]), st.just(kv[1]),
        st.lists(st.tuples(_element(kv[0], depth), _element(kv[1], depth)), min_size=1, max_size=5)))


def _field(depth: int):
    options = [st.tuples(st.just(k), v) for k, v in _SCALARS.items()]
    options.append(st.tuples(st.sampled_from([TRUE, FALSE]), st.none()))
    if depth < 3:
        options += [st.tuples(st.just(STRUCT), _struct(depth + 1)),
                    st.tuples(st.sampled_from([LIST, SET]), _collection(depth)),
                    st.tuples(st.just(MAP), _map(depth))]
    return st.one_of(options)


def _struct(depth: int = 0):
    """A struct: increasing field ids (deltas of 1 to 40: short and long headers), typed values."""
    return st.lists(st.tuples(st.integers(1, 40), _field(depth)), max_size=6).map(
        lambda items: [(int(np.cumsum([d for d, _ in items])[i]), kind, value)
                       for i, (_, (kind, value)) in enumerate(items)])


@settings(max_examples=300, deadline=None)
@given(_struct())
def test_any_struct_round_trips(fields):
    out = bytearray()
    write_fields(out, fields)
    back, end = read_fields(bytes(out))
    assert end == len(out) and back == fields
    again = bytearray()
    write_fields(again, back)
    assert again == out


def _footers_and_headers():
    """pyarrow's bytes: a file footer and its first page header, for several writer settings."""
    rng = np.random.default_rng(2)
    table = pa.table({"ids": pa.array([rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(0, 50, 300)]),
                      "f": pa.array(rng.random(300)), "s": pa.array([str(x) for x in range(300)])})
    for options in (dict(), dict(write_page_index=True, compression="zstd"),
                    dict(use_dictionary=False, data_page_version="2.0"), dict(write_statistics=False)):
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, row_group_size=100, **options)
        raw = sink.getvalue().to_pybytes()
        n = int.from_bytes(raw[-8:-4], "little")
        yield raw[-8 - n:-8], raw[4:4 + 512]


@pytest.mark.parametrize("footer, header", list(_footers_and_headers()))
def test_pyarrow_footers_round_trip_byte_for_byte(footer, header):
    fields, end = read_fields(footer)
    assert end == len(footer)
    out = bytearray()
    write_fields(out, fields)
    assert bytes(out) == footer
    plain, _ = read_struct(footer)
    assert plain[3] == 300 and len(plain[4]) == 3  # num_rows, row groups
    page, size = read_struct(header, what="page header")
    assert page[1] in (0, 2, 3) and size < len(header)  # a data or dictionary page


def test_damaged_bytes_are_refused():
    out = bytearray()
    write_fields(out, [(1, I32, 7), (2, BINARY, b"abcdef"), (3, LIST, (I64, [1, 2, 3]))])
    data = bytes(out)
    for cut in range(len(data)):  # every prefix: truncated, never a wrong struct
        with pytest.raises(Truncated, match="^page header truncated$"):
            read_fields(data[:cut], what="page header")
    with pytest.raises(ThriftError, match="footer: unknown field type 13"):
        read_fields(b"\x1d\x00", what="footer")
    with pytest.raises(ThriftError, match="varint too long"):
        read_fields(b"\x15" + b"\xff" * 11 + b"\x01\x00")
    deep = b"\x1c" * 200 + b"\x00" * 201  # structs nested 200 deep
    with pytest.raises(ThriftError, match="nests too deep"):
        read_fields(deep)
    # at each bound: a varint of 10 bytes (64 bits) is read, one of 11 refused as Thrift refuses
    # it; structs nested 63 deep in the one read (64 levels) are read, 64 refused, as pyarrow does
    assert read_fields(b"\x15" + b"\x80" * 9 + b"\x00\x00")[0] == [(1, I32, 0)]
    with pytest.raises(ThriftError, match="varint too long"):
        read_fields(b"\x15" + b"\x80" * 10 + b"\x00\x00")
    assert read_fields(b"\x1c" * 63 + b"\x00" * 64)[1] == 127
    with pytest.raises(ThriftError, match="nests too deep"):
        read_fields(b"\x1c" * 64 + b"\x00" * 65)
    with pytest.raises(Truncated):  # a list claiming more elements than there are bytes
        read_fields(b"\x19\xf5\xff\xff\x03")
    # lists (and maps) of lists nested deep: a one-line error, where a review found Python's own
    # stack running out (RecursionError) on a page header of 500 nested lists
    for deep in (b"\x49" + b"\x19" * 499, b"\x1b\x01\x99" * 300):
        with pytest.raises(ThriftError, match="nests too deep"):
            read_fields(deep + b"\x00" * 10)


def test_written_items_stand_for_the_items():
    items = [[(1, I32, k), (2, BINARY, b"x" * k)] for k in range(40)]  # more than 15: the long list header
    written = bytearray()
    for item in items:
        write_fields(written, item)
    direct, via_bytes = bytearray(), bytearray()
    write_fields(direct, [(4, LIST, (STRUCT, items))])
    write_fields(via_bytes, [(4, LIST, (STRUCT, Written(len(items), bytes(written))))])
    assert via_bytes == direct
    assert read_fields(bytes(via_bytes))[0] == [(4, LIST, (STRUCT, items))]


@pytest.mark.parametrize("nested", [63, 64])
def test_the_nesting_limit_is_pyarrow_s(tmp_path, nested):
    """A footer with an unknown field of structs nested inside it: what pyarrow reads is read, what
    it refuses is refused (the limit was 16, and a header pyarrow read was refused)."""
    import io
    import struct

    pq.write_table(pa.table({"a": [[1, 2], [3]]}), tmp_path / "base.parquet")
    raw = (tmp_path / "base.parquet").read_bytes()
    size = struct.unpack("<I", raw[-8:-4])[0]
    footer = raw[-8 - size:-8]
    # field 100 (long form: type, zigzag varint id), a struct holding structs nested `nested` deep in all
    unknown = b"\x0c\xc8\x01" + b"\x1c" * (nested - 1) + b"\x00" * nested
    damaged_footer = footer[:-1] + unknown + b"\x00"
    data = raw[:-8 - size] + damaged_footer + struct.pack("<I", len(damaged_footer)) + b"PAR1"
    try:
        pq.read_table(io.BytesIO(data))
        pyarrow_reads = True
    except OSError:
        pyarrow_reads = False
    try:
        fields, end = read_fields(damaged_footer, what="footer")
        reads = end == len(damaged_footer) and fields[-1][:2] == (100, STRUCT)
    except ThriftError:
        reads = False
    assert reads == pyarrow_reads == (nested == 63)


@pytest.mark.parametrize("fields", [
    [(1, MAP, (0, 0, [])), (2, I32, 5)],  # an empty map is its size alone (no key/value type byte)
    [(1, MAP, (I32, BINARY, [])), (2, MAP, (BINARY, I32, [(b"k", 1)])), (3, I32, 7)],
    [(-2, I32, 1), (3, BINARY, b"x")],  # a negative field id (long form, zigzag like any integer)
    [(-300, I64, -1), (-299, TRUE, None)],
])
def test_empty_maps_and_negative_field_ids_round_trip(fields):
    """Unknown fields pass through a rewritten footer unchanged whatever they hold: an empty map
    (Thrift writes no type byte for it) must not swallow the next field, and a long-form field
    id is zigzag-encoded, so a negative one is read back as written, not as another field."""
    out = bytearray()
    write_fields(out, fields)
    back, end = read_fields(bytes(out))
    assert end == len(out)
    assert [(fid, kind) for fid, kind, _ in back] == [(fid, kind) for fid, kind, _ in fields]
    assert [value for _, kind, value in back if kind != MAP] == [value for _, kind, value in fields if kind != MAP]
    assert [value[2] for _, kind, value in back if kind == MAP] == [value[2] for _, kind, value in fields if kind == MAP]
    again = bytearray()
    write_fields(again, back)
    assert again == out

"""Runs of row groups decoded whole (``parquet_lists.RowGroupRuns``) and the compiled page-header
walk under it (``_parquet_pages.page_table``): equal to pyarrow and to the Python header reader,
on files written every way pyarrow writes them, and never out of bounds on damaged headers.

The damaged-file contract (raise or equal pyarrow, never crash) is checked with the page-at-a-time
reader's in ``test_parquet_decoder.test_corrupt_files_raise_and_never_crash_or_lie``, which runs
both readers on every variant.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packer_cli._thrift import I16, I32, I64, STRUCT, read_fields, write_fields
from packer_cli.sources import _parquet_pages as pages
from packer_cli.sources import parquet_lists
from packer_cli._parquet_thrift import ThriftError, parse_page_header
from packer_cli.sources.parquet_lists import RowGroupRuns
from test_parquet_decoder import _field, _footer_of, _layout_table, _random_layout, _set, _with_footer, list_array, token_table


@pytest.fixture(autouse=True)
def _default_decoder(monkeypatch):
    monkeypatch.delenv("PACKER_PARQUET_DECODER", raising=False)


@pytest.fixture
def paths_taken(monkeypatch):
    """Which way each run was read: counts of the bulk path and of the page-at-a-time cursors."""
    taken = {"bulk": 0, "paged": 0}
    bulk, paged = RowGroupRuns._read_bulk, RowGroupRuns._read_paged

    def spy_bulk(self, *args):
        result = bulk(self, *args)
        taken["bulk"] += 1
        return result

    def spy_paged(self, *args):
        taken["paged"] += 1
        return paged(self, *args)

    monkeypatch.setattr(RowGroupRuns, "_read_bulk", spy_bulk)
    monkeypatch.setattr(RowGroupRuns, "_read_paged", spy_paged)
    return taken


def full_table(n_rows: int, seed: int = 0) -> pa.Table:
    """Token ids and a loss mask in rows of 1-60 values: no empty list, so every page is a usual one."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 61, n_rows)
    n = int(lengths.sum())
    return pa.table({
        "input_ids": list_array(lengths, rng.integers(0, 50_000, n).astype(np.int32), pa.int32()),
        "loss_mask": list_array(lengths, rng.integers(0, 2, n).astype(np.uint8), pa.uint8()),
    })


def _runs(n_groups: int, rng) -> list[tuple[int, int]]:
    """The whole file, each group alone (up to 5), and random consecutive runs."""
    runs = [(0, n_groups)] + [(g, g + 1) for g in range(min(n_groups, 5))]
    for _ in range(4):
        a = int(rng.integers(0, n_groups))
        runs.append((a, int(rng.integers(a + 1, n_groups + 1))))
    return runs


def _expected(path, first: int, end: int, fields) -> pa.Table:
    return pq.ParquetFile(path).read_row_groups(range(first, end), columns=fields)


def _assert_runs_equal_pyarrow(path, fields, rng) -> None:
    n_groups = pq.ParquetFile(path).metadata.num_row_groups
    with RowGroupRuns(str(path)) as runs:
        for first, end in _runs(n_groups, rng):
            batch = runs.read(first, end, fields)
            assert batch is not None, f"groups {first}-{end - 1} were left to pyarrow"
            want = _expected(path, first, end, fields)
            got = pa.Table.from_batches([batch], schema=batch.schema)
            assert got.schema == want.schema
            assert got.equals(want), f"groups {first}-{end - 1} differ from pyarrow's"


def _has_empty_lists(table: pa.Table, fields) -> bool:
    return any(pa.compute.any(pa.compute.equal(pa.compute.list_value_length(table.column(f)), 0)).as_py()
               for f in fields if table.num_rows)


@pytest.mark.parametrize("seed", range(24))
def test_runs_equal_pyarrow_over_random_layouts(tmp_path, paths_taken, seed):
    """Random list<int> tables (every type, codec, page version, dictionary or plain, statistics,
    page and row-group sizes): every run of row groups reads equal to pyarrow's
    ``read_row_groups``; the bulk path reads every run of a file of data pages v1 of PLAIN
    values without empty lists."""
    _, n_rows, max_len, columns, fields, options, _ = _random_layout(seed)
    if n_rows == 0:
        n_rows = 50
    table = _layout_table(seed, n_rows, max_len, columns)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, **options)
    _assert_runs_equal_pyarrow(path, fields, np.random.default_rng(seed))
    usual = options["data_page_version"] == "1.0" and not options["use_dictionary"]
    if usual and not _has_empty_lists(table, fields):
        assert paths_taken["paged"] == 0 and paths_taken["bulk"] > 0


@pytest.mark.parametrize("codec", ["none", "snappy", "zstd", "gzip"])
@pytest.mark.parametrize("page_version", ["1.0", "2.0"])
@pytest.mark.parametrize("dictionary", [True, False])
def test_each_codec_and_page_kind_read_equal(tmp_path, paths_taken, codec, page_version, dictionary):
    table = full_table(900, seed=5)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, compression=codec, data_page_version=page_version, use_dictionary=dictionary,
                   row_group_size=64, data_page_size=2048)
    _assert_runs_equal_pyarrow(path, ["input_ids", "loss_mask"], np.random.default_rng(1))
    if page_version == "1.0" and not dictionary:  # as packer writes Bridge's files
        assert paths_taken == {"bulk": paths_taken["bulk"], "paged": 0} and paths_taken["bulk"] >= 10
    else:  # dictionary pages and data pages v2 are read by the cursors
        assert paths_taken["paged"] >= 10


def test_columns_apart_in_the_file_read_in_bulk(tmp_path, paths_taken):
    """Two columns with an unread one between them in every row group (their chunks apart in the
    file, read in one pread with the bytes between): every run reads equal to pyarrow, in bulk.
    The buffer was once sized without the bytes between, its last read came up short, and every
    such run fell to the page-at-a-time cursors."""
    table = full_table(600, seed=9)
    table = table.add_column(1, "name", pa.array([f"record {i}" for i in range(600)]))
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, compression="none", use_dictionary=False, row_group_size=64)
    _assert_runs_equal_pyarrow(path, ["input_ids", "loss_mask"], np.random.default_rng(2))
    assert paths_taken == {"bulk": paths_taken["bulk"], "paged": 0} and paths_taken["bulk"] >= 10


def test_empty_lists_and_odd_pages_read_by_the_cursors(tmp_path, paths_taken, monkeypatch):
    """A page holding empty lists (its values are not where its level count puts them) and a run
    whose page headers the walk does not read are both read by the cursors, equal to pyarrow."""
    lengths = np.array([3, 0, 5, 0, 0, 2] * 50)
    values = pa.array(np.arange(lengths.sum(), dtype=np.int32))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, values)})
    path = tmp_path / "empties.parquet"
    pq.write_table(table, path, row_group_size=40, data_page_size=256)
    _assert_runs_equal_pyarrow(path, ["input_ids"], np.random.default_rng(2))
    assert paths_taken["paged"] > 0

    plain = tmp_path / "plain.parquet"
    pq.write_table(full_table(300, seed=2), plain, row_group_size=50)
    monkeypatch.setattr(pages, "page_table", lambda *args: pages.ODD)
    before = paths_taken["paged"]
    _assert_runs_equal_pyarrow(plain, ["input_ids", "loss_mask"], np.random.default_rng(3))
    assert paths_taken["paged"] > before


def test_nulls_and_other_types_are_left_to_pyarrow(tmp_path):
    """None (pyarrow's to read) for a column with nulls, one that is not a list of integers, and
    under PACKER_PARQUET_DECODER=arrow."""
    ids = pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"input_ids": ids, "text": ["a", "b", "c"]}), path)
    with RowGroupRuns(str(path)) as runs:
        assert runs.read(0, 1, ["input_ids"]) is None
        assert runs.read(0, 1, ["text"]) is None
    good = tmp_path / "good.parquet"
    pq.write_table(token_table(50, seed=1), good)
    with RowGroupRuns(str(good)) as runs:
        assert runs.read(0, 1, ["input_ids"]) is not None
    os.environ["PACKER_PARQUET_DECODER"] = "arrow"
    try:
        with RowGroupRuns(str(good)) as runs:
            assert runs.read(0, 1, ["input_ids"]) is None
    finally:
        del os.environ["PACKER_PARQUET_DECODER"]


@pytest.mark.parametrize("decoder", ["compiled", "arrow"])
def test_a_footer_whose_row_counts_disagree_is_damaged_whichever_decoder(tmp_path, monkeypatch, decoder):
    """A row group's count one lower than its pages hold: ValueError under PACKER_PARQUET_DECODER=arrow
    too (the footer was checked only when the compiled decoder was to read the file), as
    ListColumnReader has it."""
    path = tmp_path / "t.parquet"
    pq.write_table(token_table(40, seed=3), path, row_group_size=10)
    raw = path.read_bytes()
    footer, footer_at = _footer_of(raw)
    group = _field(footer, 4)[1][0]
    _set(group, 3, _field(group, 3) - 1)
    path.write_bytes(_with_footer(raw, footer_at, footer))
    if decoder == "arrow":
        monkeypatch.setenv("PACKER_PARQUET_DECODER", "arrow")
    with RowGroupRuns(str(path)) as runs, pytest.raises(ValueError, match="^the footer is damaged: its row groups'"):
        runs.read(0, 2, ["input_ids"])


def test_read_ahead_gives_the_run_asked_for(tmp_path):
    """A run read ahead is what ``read`` returns for it; asking for another run instead waits
    the read ahead out and reads that one."""
    path = tmp_path / "t.parquet"
    pq.write_table(token_table(600, seed=4), path, row_group_size=50)
    fields = ["input_ids", "loss_mask"]
    with RowGroupRuns(str(path)) as runs:
        runs.read_ahead(2, 5, fields)
        assert pa.Table.from_batches([runs.read(2, 5, fields)]).equals(_expected(path, 2, 5, fields))
        runs.read_ahead(5, 9, fields)
        assert pa.Table.from_batches([runs.read(0, 3, fields)]).equals(_expected(path, 0, 3, fields))
        runs.read_ahead(5, 9, ["input_ids"])
        assert pa.Table.from_batches([runs.read(5, 9, fields)]).equals(_expected(path, 5, 9, fields))


def test_damaged_run_raises_naming_the_groups(tmp_path):
    """Garbage over a run's data pages: ValueError naming the run's row groups and the column."""
    path = tmp_path / "t.parquet"
    pq.write_table(token_table(400, seed=6), path, row_group_size=100, use_dictionary=False, compression="none")
    meta = pq.ParquetFile(path).metadata
    chunk = meta.row_group(2).column(0)
    raw = bytearray(path.read_bytes())
    start = chunk.data_page_offset
    header = parse_page_header(bytes(raw[start:start + 1024]))
    levels_at = start + header.size + 4  # inside the repetition levels of the first page
    raw[levels_at:levels_at + 8] = b"\xff" * 8
    path.write_bytes(bytes(raw))
    with RowGroupRuns(str(path)) as runs:
        assert runs.read(0, 2, ["input_ids"]) is not None
        with pytest.raises(ValueError, match=r"row groups 1-3: column 'input_ids'"):
            runs.read(1, 4, ["input_ids"])


# --- the page-header walk ---------------------------------------------------------------------

def _chunk_bounds(path, fields=None):
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    leaves = [names.index(f) for f in (fields or names)]  # one leaf per top-level list column here
    spans = []
    for g in range(pf.metadata.num_row_groups):
        for leaf in leaves:
            chunk = pf.metadata.row_group(g).column(leaf)  # pyarrow's reading of the footer, as a reference
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
                start = chunk.dictionary_page_offset
            spans.append((start, start + chunk.total_compressed_size))
    return spans


def _python_walk(raw: bytes, spans) -> list[tuple]:
    """(chunk, payload start, payload end, type, uncompressed size, values, encoding) of every
    page, read by the Python header reader; None when it refuses a header."""
    out = []
    for c, (lo, hi) in enumerate(spans):
        pos = lo
        while pos < hi:
            try:
                h = parse_page_header(raw[pos:hi])
            except ThriftError:
                return None
            start = pos + h.size
            if start + h.compressed_size > hi:
                return None
            out.append((c, start, start + h.compressed_size, h.page_type, h.uncompressed_size, h.num_values,
                        h.encoding))
            pos = start + h.compressed_size
    return out


def _walk(raw: bytes, spans):
    buf = np.frombuffer(raw, dtype=np.uint8)
    lo = np.array([a for a, _ in spans], dtype=np.int64)
    hi = np.array([b for _, b in spans], dtype=np.int64)
    table = pages.walk(buf, lo, hi, capacity=3)  # small: the walk must run out of room and retry
    if table is None:
        return None
    cols = [pages.CHUNK, pages.LO, pages.HI, pages.PAGE_TYPE, pages.UNCOMPRESSED, pages.NUM_VALUES, pages.ENCODING]
    return [tuple(int(x) for x in row[cols]) for row in table]


@pytest.mark.parametrize("options", [
    dict(), dict(data_page_version="2.0"), dict(write_statistics=True, use_dictionary=True),
    dict(write_statistics=True, data_page_version="2.0", compression="zstd"),
    dict(write_page_checksum=True), dict(write_page_index=True, data_page_size=128),
    dict(use_dictionary=True, dictionary_pagesize_limit=64, data_page_size=64),
])
def test_page_walk_equals_the_python_header_reader(tmp_path, options):
    path = tmp_path / "t.parquet"
    try:
        pq.write_table(token_table(500, seed=7), path, row_group_size=120, **options)
    except TypeError as exc:  # an option this pyarrow lacks
        pytest.skip(str(exc))
    raw = path.read_bytes()
    spans = _chunk_bounds(path)
    want = _python_walk(raw, spans)
    assert want is not None and len(want) >= len(spans)
    assert _walk(raw, spans) == want


def test_page_walk_on_damaged_headers_agrees_or_declines(tmp_path):
    """Random bytes over page headers (2,000 variants): the walk either declines (ODD) or reads
    exactly the pages the Python reader reads; it never reads past a chunk (numba does not check
    bounds, so an overrun would show as garbage fields or a crash here)."""
    path = tmp_path / "t.parquet"
    pq.write_table(token_table(300, seed=8), path, row_group_size=100, write_statistics=True,
                   data_page_size=512)
    raw = path.read_bytes()
    spans = _chunk_bounds(path)
    heads = [row[1] for row in _python_walk(raw, spans)]
    rng = np.random.default_rng(0)
    agreed = declined = 0
    for _ in range(2000):
        b = bytearray(raw)
        at = int(rng.choice(heads)) - int(rng.integers(1, 40))
        width = int(rng.integers(1, 6))
        b[at:at + width] = rng.integers(0, 256, width, dtype=np.uint8).tobytes()
        # each chunk alone, copied to a buffer that ends with it: any read past it is out of bounds
        c = int(rng.integers(0, len(spans)))
        lo, hi = spans[c]
        alone = bytes(b[lo:hi])
        got, want = _walk(alone, [(0, hi - lo)]), _python_walk(alone, [(0, hi - lo)])
        if got is None:
            declined += 1
        else:
            assert got == want, f"walk and Python reader differ after damage at {at}"
            agreed += 1
    assert agreed > 100 and declined > 100, (agreed, declined)


def _first_pages(tmp_path) -> dict[str, tuple[list, bytes]]:
    """A data page v1, a data page v2 and a dictionary page as pyarrow writes them: (header
    fields, typed, and payload), each the first of its chunk."""
    found = {}
    for name, options in (("v1", dict(use_dictionary=False)),
                          ("v2", dict(data_page_version="2.0", use_dictionary=False)),
                          ("dictionary", dict(use_dictionary=True))):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(token_table(50, seed=3), path, compression="none", **options)
        raw = path.read_bytes()
        start, _ = _chunk_bounds(path, ["input_ids"])[0]
        header, at = read_fields(raw, start)
        found[name] = header, raw[at:at + dict((fid, v) for fid, _, v in header)[3]]
    return found


def _page(header: list, payload: bytes) -> bytes:
    out = bytearray()
    write_fields(out, header)
    return bytes(out) + payload


def _retyped(header: list, path: tuple[int, ...], kind=None, value=None, drop=False) -> list:
    """A copy of ``header`` with the field at ``path`` (field ids, through sub-structs) given
    wire type ``kind`` or ``value``, or dropped."""
    out = []
    for fid, k, v in header:
        if fid != path[0]:
            out.append((fid, k, v))
        elif len(path) > 1:
            out.append((fid, k, _retyped(v, path[1:], kind, value, drop)))
        elif not drop:
            out.append((fid, kind or k, v if value is None else value))
    return out


# Every field of a page header the readers read, each a required i32 (parquet.thrift).
_REQUIRED_I32 = {"v1": [(1,), (2,), (3,), (5, 1), (5, 2), (5, 3), (5, 4)],
                 "v2": [(1,), (2,), (3,), (8, 1), (8, 2), (8, 3), (8, 4), (8, 5), (8, 6)],
                 "dictionary": [(1,), (2,), (3,), (7, 1), (7, 2)]}
# each field of another wire type, dropped, or past 32 bits: what the Python reader says
_CHANGES = [(dict(kind=I16), "is not an i32"), (dict(kind=I64), "is not an i32"), (dict(drop=True), "missing or"),
            (dict(value=2**32 + 7), "missing or invalid")]


def test_header_fields_of_another_wire_type_are_refused(tmp_path):
    """Each required i32 field of a page header given wire type i16 or i64 (the same varint
    follows), dropped, or holding a value past 32 bits: Apache Thrift, pyarrow's reader, skips a
    field of another type and then refuses the header for the missing field, so the Python
    reader refuses it too and the compiled walk declines it (they read it as if well typed:
    pages pyarrow cannot read). The optional is_compressed of another type is skipped, as
    Thrift does: the page reads as compressed."""
    firsts = _first_pages(tmp_path)
    for name, (header, payload) in firsts.items():
        page = _page(header, payload)
        assert _walk(page, [(0, len(page))]) == _python_walk(page, [(0, len(page))]) is not None
        for path in _REQUIRED_I32[name]:
            for change, says in _CHANGES:
                bad = _page(_retyped(header, path, **change), payload)
                with pytest.raises(ThriftError, match=says):
                    parse_page_header(bad)
                assert _walk(bad, [(0, len(bad))]) is None, (name, path, change)
    header, payload = firsts["v2"]
    flag = _page(_retyped(header, (8, 7), kind=I32, value=0), payload)  # is_compressed: false, as an i32
    assert parse_page_header(flag).is_compressed and _walk(flag, [(0, len(flag))]) is None
    for name, sub in (("v1", 5), ("v2", 8), ("dictionary", 7)):  # the page's own header an i32, not a struct
        header, payload = firsts[name]
        bad = _page(_retyped(header, (sub,), kind=I32, value=0), payload)
        with pytest.raises(ThriftError, match="without its header"):
            parse_page_header(bad)
        assert _walk(bad, [(0, len(bad))]) is None, name


def test_a_data_page_header_given_twice_is_read_as_thrift_reads_it(tmp_path):
    """Apache Thrift keeps a field's last value: a data page header (field 5) given again, the
    second holding only the value count, is a header without its encodings, which pyarrow
    refuses. Both readers refuse it (the walk read the first one's encodings and packed it)."""
    header, payload = _first_pages(tmp_path)["v1"]
    sub = next(value for fid, _, value in header if fid == 5)
    twice = _page(header + [(5, STRUCT, [sub[0]])], payload)
    with pytest.raises(ThriftError, match="missing or invalid encoding"):
        parse_page_header(twice)
    assert _walk(twice, [(0, len(twice))]) is None


def test_a_page_header_pyarrow_refuses_is_refused(tmp_path):
    """A data page header whose page type is an i16 (the same varint after it): pyarrow refuses
    the file, and so do both readers now, with a one-line error naming the row groups. (They
    read it: a Megatron-Bridge split ``packer verify`` passed that Bridge cannot load.)"""
    path = tmp_path / "t.parquet"
    pq.write_table(full_table(300, seed=2), path, row_group_size=100, use_dictionary=False, compression="none")
    raw = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    assert raw[start] == 0x15  # field 1, an i32
    raw[start] = 0x14  # field 1, an i16
    path.write_bytes(bytes(raw))
    with pytest.raises((OSError, pa.ArrowException), match="deserialize thrift"):
        pq.read_table(path)
    with pytest.raises(ValueError, match="^row group 1: column 'input_ids': page header: page type is not an i32$"):
        list(parquet_lists.ListColumnReader(str(path), ["input_ids", "loss_mask"]))
    with RowGroupRuns(str(path)) as runs:
        assert runs.read(0, 1, ["input_ids"]) is not None
        with pytest.raises(ValueError, match="^row groups 0-2: column 'input_ids': page header: page type is not"):
            runs.read(0, 3, ["input_ids", "loss_mask"])


def test_damaged_files_of_usual_pages_raise_or_equal_pyarrow(tmp_path):
    """The damaged-file contract on files the bulk path reads (no empty list, so every page is a
    usual one; the variants in test_parquet_decoder mostly are not): random bytes over page
    headers, levels and values, truncations, in plain, Snappy, Zstandard and v2 files. Each read
    by RowGroupRuns raises ValueError, leaves the run to pyarrow or yields exactly pyarrow's
    data; none crashes (each runs in a child process)."""
    from test_parquet_decoder import run_isolated

    table = full_table(400, seed=9)
    jobs, rng = [], np.random.default_rng(11)
    for k, options in enumerate([dict(compression="none"), dict(compression="snappy"),
                                 dict(compression="zstd"), dict(compression="none", data_page_version="2.0")]):
        base = tmp_path / f"base-{k}.parquet"
        pq.write_table(table, base, use_dictionary=False, row_group_size=80, data_page_size=1024, **options)
        raw = base.read_bytes()
        spans = _chunk_bounds(base)
        heads = [row[1] for row in _python_walk(raw, spans)]
        edits = [raw[:len(raw) - 9], raw[:spans[3][0] + 7] + raw[spans[3][0] + 60:]]
        for _ in range(14):
            b = bytearray(raw)
            if rng.random() < 0.5:  # a page header
                at = int(rng.choice(heads)) - int(rng.integers(1, 20))
            else:  # anywhere in a chunk: levels or values
                lo, hi = spans[int(rng.integers(0, len(spans)))]
                at = int(rng.integers(lo, hi - 8))
            width = int(rng.integers(1, 9))
            b[at:at + width] = rng.integers(0, 256, width, dtype=np.uint8).tobytes()
            edits.append(bytes(b))
        for j, data in enumerate(edits):
            path = tmp_path / f"bad-{k}-{j}.parquet"
            path.write_bytes(data)
            jobs.append((path, ["input_ids", "loss_mask"]))
    results = run_isolated(jobs, tmp_path)
    problems, raised = [], 0
    for (path, _), r in zip(jobs, results):
        if "died" in r:
            if r["phase"] in ("packer", "runs"):
                problems.append(f"{path.name}: {r['phase']} {r['died']}\n{r['stderr'][-600:]}")
            continue
        if r["runs"] == "bad":
            problems.append(f"{path.name}: RowGroupRuns raised outside the contract:\n{r['runs_detail']}")
        elif r["runs"] == "ok" and r["pyarrow"] == "ok" and not r["runs_equal"]:
            problems.append(f"{path.name}: RowGroupRuns yielded data different from pyarrow's without an error")
        raised += r["runs"] == "raised"
    assert not problems, "\n\n".join(problems)
    assert raised >= 10, f"only {raised} of {len(jobs)} damaged files were refused"


def _one_run(count: int, level: int) -> np.ndarray:
    """A hybrid stream of ``count`` copies of ``level`` as one repeated-value run."""
    header, out = count << 1, bytearray()
    while header >= 0x80:
        out.append((header & 0x7F) | 0x80)
        header >>= 7
    return np.frombuffer(bytes(out) + bytes([header, level]), np.uint8)


def test_usual_page_rows_stitch_rows_across_pages():
    """``usual_page_rows`` over a chunk cut into pages at random places (rows continue from page to
    page: pyarrow's writer never does that, other writers do) gives the chunk's row lengths, and
    declines a chunk whose first value does not start a row or that holds more rows than its
    row group."""
    from packer_cli.sources._parquet_kernels import usual_page_rows
    from test_parquet_decoder import _hybrid_stream

    rng = np.random.default_rng(3)
    outcomes = set()
    for trial in range(1500):
        n = int(rng.integers(1, 400))
        rep = (rng.random(n) < rng.choice([0.5, 0.9, 0.99])).astype(np.uint8)
        rep[0] = 0 if trial % 10 else rep[0]  # every tenth chunk may start inside a row
        starts = np.flatnonzero(rep == 0)
        want = np.diff(np.append(starts, n)).tolist()
        rows = len(want) - int(trial % 7 == 0 and len(want) > 1)  # every seventh: the footer says one row fewer
        if rep[0] == 1:  # and counting the leading part as a row would agree with the footer
            rows = len(want) + 1
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 6))), replace=False))
        lengths = np.full(rows + 2, -7, dtype=np.int64)
        r, open_length, ok = 0, -1, True
        for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [n]])):
            k = int(b - a)
            rep_raw = np.frombuffer(_hybrid_stream(rep[a:b], 1, rng), np.uint8)
            def_raw = _one_run(k, 3)  # writers store a page of all values' levels as one run
            levels = np.concatenate([rep_raw, def_raw])
            ok, r, open_length = usual_page_rows(levels, 0, rep_raw.size, rep_raw.size, levels.size, k, 2, 3,
                                                 lengths, r, rows, open_length)
            if not ok:
                break
        if ok and open_length >= 0:
            ok = r < rows
            if ok:
                lengths[r] = open_length
                r += 1
        ok = ok and r == rows
        if rep[0] == 1 or rows != len(want):
            assert not ok, trial
            outcomes.add("declined")
        else:
            assert ok and lengths[:rows].tolist() == want, trial
            outcomes.add("read")
    assert outcomes == {"declined", "read"}


def test_runs_without_rows_and_of_empty_lists(tmp_path):
    """A file of no rows (pyarrow writes one row group with a placeholder chunk) and runs whose
    rows are all empty lists read as pyarrow reads them."""
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"a": pa.array([], pa.list_(pa.int32()))}), empty)
    _assert_runs_equal_pyarrow(empty, ["a"], np.random.default_rng(0))
    lists = tmp_path / "lists.parquet"
    pq.write_table(pa.table({"a": pa.array([[], [], [1], [], [], []], pa.list_(pa.int32()))}), lists,
                   row_group_size=2)
    _assert_runs_equal_pyarrow(lists, ["a"], np.random.default_rng(1))


def test_a_page_header_longer_than_the_first_read_is_read_whole(tmp_path):
    """A header with long statistics runs past the 1 KiB read first (exactly 1 KiB came back):
    it is read again with more, up to 16 MiB, and not refused as truncated."""
    from packer_cli._parquet_thrift import HEADER_PROBE, read_page_header
    from packer_cli._thrift import BINARY

    path = tmp_path / "header"
    for stats in (HEADER_PROBE // 2, HEADER_PROBE, 20 * HEADER_PROBE):
        header = [(1, I32, 0), (2, I32, 8), (3, I32, 8),
                  (5, STRUCT, [(1, I32, 2), (2, I32, 0), (3, I32, 3), (4, I32, 3),
                               (5, STRUCT, [(5, BINARY, b"\xff" * stats), (6, BINARY, b"\x00")])])]
        raw = bytearray()
        write_fields(raw, header)
        size = len(raw)
        path.write_bytes(bytes(raw) + bytes(8) + bytes(HEADER_PROBE * 40))  # its payload, then more of the file
        fd = os.open(path, os.O_RDONLY)
        try:
            got = read_page_header(fd, 0, size + 8)
        finally:
            os.close(fd)
        assert (got.size, got.num_values, got.compressed_size) == (size, 2, 8)


@pytest.mark.parametrize("version", ["1.0", "2.0"])
def test_data_page_levels_counts_the_values_of_either_page_version(tmp_path, version):
    """What a column chunk's pages hold, by their headers alone, is the footer's value count,
    for data pages v1 and v2 alike (a dictionary page holds none of the chunk's values)."""
    from packer_cli._parquet_thrift import data_page_levels

    path = tmp_path / "t.parquet"
    pq.write_table(token_table(300, seed=3), path, row_group_size=120, data_page_version=version,
                   data_page_size=256)
    meta = pq.ParquetFile(path).metadata
    fd = os.open(path, os.O_RDONLY)
    try:
        for g in range(meta.num_row_groups):
            for c in range(meta.num_columns):
                chunk = meta.row_group(g).column(c)
                start = chunk.dictionary_page_offset or chunk.data_page_offset
                assert data_page_levels(fd, start, start + chunk.total_compressed_size) == chunk.num_values
    finally:
        os.close(fd)


def test_header_integers_past_an_i32_or_negative_are_refused(tmp_path):
    """A required i32 field holding 2**31 (the varint reads into 64 bits; Thrift refuses it as
    past an i32), or a negative page type, size, count or encoding (only a v2 page's null count
    may be negative: pyarrow takes one): the Python reader refuses the header, the walk declines it."""
    for name, (header, payload) in _first_pages(tmp_path).items():
        for path in _REQUIRED_I32[name]:
            for value in (2**31, -1, -2**31):
                if value < 0 and (name, path) == ("v2", (8, 2)):
                    continue
                bad = _page(_retyped(header, path, value=value), payload)
                with pytest.raises(ThriftError, match="missing or invalid"):
                    parse_page_header(bad)
                assert _walk(bad, [(0, len(bad))]) is None, (name, path, value)

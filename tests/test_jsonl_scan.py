"""The compiled JSON Lines scanner against orjson: it may give up on any record, but every record
it accepts must be one orjson accepts, with the same values; and the reader built on it must give
exactly the batches of the all-orjson reference reader."""
from __future__ import annotations

import gzip
import random
import sys

import numpy as np
import orjson
import pyarrow as pa
import pytest

from packer_cli.sources import _jsonl_scan as scan
from packer_cli.sources.readers import BATCH_ROWS, read_jsonl, read_jsonl_orjson

FIELDS = ["input_ids", "loss_mask", "answer_start_idx"]
SCALAR = {"answer_start_idx"}
FLAGS = {"loss_mask"}  # may hold true/false as well as integers
KINDS = np.array([scan.SCALAR if f in SCALAR else scan.FLAGS if f in FLAGS else scan.LIST for f in FIELDS], np.int8)


def _json_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice(["", "plain", "caf\u00e9", "\u2603 snow", "\U0001F600", 'q"uote', "back\\slash",
                           "line\nbreak", "tab\t", "\x7f", "\u0000"])
    if kind == 1:
        return rng.randint(-(2**63), 2**63 - 1)
    if kind == 2:
        return rng.choice([0.5, -1e-7, 3.25e20, 1e300, float(rng.randint(-5, 5))])
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.randint(-1000, 1000)
    if kind == 5:
        return [rng.randint(-3, 10**6) for _ in range(rng.randrange(4))]
    if kind in (6, 7):
        return [_json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", "b", "input", "é", "ids"]): _json_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def _record(rng: random.Random) -> bytes:
    n = rng.randrange(6)
    rec = {}
    keys = FIELDS + ["text", "meta", "id"]
    rng.shuffle(keys)
    for key in keys:
        roll = rng.random()
        if key == "loss_mask" and roll < 0.3:  # booleans, sometimes mixed with integers
            rec[key] = [rng.random() < 0.5 if rng.random() < 0.98 else rng.choice([0, 1, 2, None, "1"])
                        for _ in range(n)]
        elif key in ("input_ids", "loss_mask"):
            if roll < 0.9:
                rec[key] = [rng.choice([0, 1, 7, 31999, 2**31 - 1, -(2**31), -1, 2**31, 10**12]) if rng.random() < 0.03
                            else rng.randrange(100) for _ in range(n)]
            elif roll < 0.95:
                rec[key] = _json_value(rng)
        elif key == "answer_start_idx":
            if roll < 0.9:
                rec[key] = rng.choice([0, 1, 5, -1, 2**40, None, 1.5, True]) if roll < 0.1 else rng.randrange(-9, 99)
        elif roll < 0.6:
            rec[key] = _json_value(rng)
    text = orjson.dumps(rec)
    if rng.random() < 0.3:
        text = text.replace(b",", b" ,\t").replace(b":", b" : ")
    return text


def _mutate(rng: random.Random, line: bytes) -> bytes:
    b = bytearray(line)
    for _ in range(rng.randrange(1, 3)):
        op = rng.randrange(4)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            del b[min(i, len(b) - 1)]
        elif op == 1:
            b.insert(i, rng.choice(b'{}[],:"\\-.0123456789eE+ \ttrufalsn\x00\x0c\xc3\xa9\xed\xa0\xff'))
        elif op == 2 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        else:
            b[i:i] = rng.choice([b"\\u00e9", b"\\ud83d\\ude00", b"\\udc00", b"01", b"1e999", b"-0", b"[[1]]",
                                 b'"input_ids":[1],', b"null", b"\r"])
    return bytes(b).replace(b"\n", b" ")


def _scan_one(line: bytes):
    """(accepted, values per field) for one line scanned on its own."""
    names = [f.encode() for f in FIELDS]
    buf = np.frombuffer(line + b"\n", dtype=np.uint8)
    k = len(FIELDS)
    state = np.zeros(4, np.int64)
    offsets = np.zeros((k, 2), np.int64)
    values = np.empty((k, 1 << 12), np.int32)
    scalars = np.zeros((k, 1), np.int64)
    slow_rows = np.empty(1, np.int64)
    slow_spans = np.empty((1, 2), np.int64)
    scan.scan(buf, 0, buf.size, True, 1, np.frombuffer(b"".join(names), np.uint8),
              np.cumsum([0] + [len(n) for n in names]).astype(np.int64), KINDS,
              state, np.empty(1, np.int64), offsets, values, scalars, slow_rows, slow_spans)
    if state[scan.ROWS] == 0:
        return None, None  # blank
    if state[scan.SLOW]:
        return False, None
    out = [int(scalars[j, 0]) if FIELDS[j] in SCALAR else values[j, offsets[j, 0]:offsets[j, 1]].tolist()
           for j in range(k)]
    return True, out


def test_accepted_records_match_orjson():
    rng = random.Random(1234)
    accepted = given_up = flags_read = 0
    for i in range(30000):
        line = _record(rng)
        if i % 2:
            line = _mutate(rng, line)
        ok, values = _scan_one(line)
        if ok is None:
            assert not line.strip()
            continue
        if not ok:
            given_up += 1
            continue
        accepted += 1
        record = orjson.loads(line)  # must not raise
        assert isinstance(record, dict)
        assert [_as_read(f, record[f]) for f in FIELDS] == values, line
        flags_read += any(type(v) is bool for v in record["loss_mask"])
    assert accepted > 3000 and given_up > 3000 and flags_read > 300  # all paths exercised


def _as_read(field: str, value):
    """What the scanner must read for a value orjson parsed: booleans only in a flag field (as 1/0),
    never in any other field (``True == 1`` would hide one)."""
    if isinstance(value, list):
        assert field in FLAGS or not any(type(v) is bool for v in value)
        return [int(v) if type(v) is bool else v for v in value]
    assert type(value) is not bool
    return value


def _number_text(rng: random.Random) -> bytes:
    """An integer-looking token of 1 to 12 digits (sometimes signed, zero-led or with a fraction)."""
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12)))
    if rng.random() < 0.7:
        digits = digits.lstrip("0") or "0"
    text = ("-" if rng.random() < 0.15 else "") + digits
    if rng.random() < 0.03:
        text += rng.choice([".5", "e3", "E-1", ".0"])
    return text.encode()


def test_integers_of_every_width_match_orjson():
    """Digits are read 8 at a time: numbers of 1..12 digits, at every distance from the end of
    the data, with every separator the list loop knows, parse exactly as orjson does."""
    rng = random.Random(77)
    seen = set()
    for _ in range(20000):
        numbers = [_number_text(rng) for _ in range(rng.randrange(1, 6))]
        glue = rng.choice([b",", b", ", b" ,", b",\t", b" , ", b",\r  "])  # JSON whitespace, no newline
        ids = b"[" + glue.join(numbers) + rng.choice([b"]", b" ]"])
        line = b'{"loss_mask":[1],"answer_start_idx":0,"input_ids":' + ids + b"}"  # the list ends the line
        ok, values = _scan_one(line)
        try:
            want = orjson.loads(line)["input_ids"]
            valid = all(type(v) is int and -(2**31) <= v < 2**31 for v in want)
        except orjson.JSONDecodeError:
            valid = False
        if ok:
            assert valid and values[0] == want, line
        else:
            assert not valid or any(len(n.lstrip(b"-")) > 10 for n in numbers), line  # only gives up on what it must
        seen.update(len(n.lstrip(b"-")) for n in numbers if ok)
    assert seen >= set(range(1, 11))


@pytest.mark.parametrize("compress", [False, True])
def test_reader_matches_orjson_reader(tmp_path, compress):
    rng = random.Random(99)
    lines = []
    for i in range(3 * BATCH_ROWS + 17):
        line = _record(rng)
        if i % 50 == 3:
            line = _mutate(rng, line)
        if i % 97 == 0:
            lines.append(rng.choice([b"", b"  ", b"\t\x0b\x0c\r"]))
        lines.append(line)
    data = b"\n".join(lines) + (b"\n" if compress else b"")  # one file ends without a newline
    path = tmp_path / ("d.jsonl.gz" if compress else "d.jsonl")
    path.write_bytes(gzip.compress(data) if compress else data)
    got = list(read_jsonl(str(path), FIELDS, SCALAR, flag_fields=FLAGS))
    want = list(read_jsonl_orjson(str(path), FIELDS, SCALAR, flag_fields=FLAGS))
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert (g.path, g.row0, g.pre_bad) == (w.path, w.row0, w.pre_bad)
        np.testing.assert_array_equal(g.lines, w.lines)
        for batch in (g.batch, w.batch):  # booleans are read as integers on both paths
            assert all(pa.types.is_integer(t.value_type if pa.types.is_list(t) else t) for t in batch.schema.types)
        assert g.batch.to_pydict() == w.batch.to_pydict()


def test_scanner_grows_its_buffers(tmp_path, monkeypatch):
    from packer_cli.sources import readers

    monkeypatch.setattr(readers, "SCAN_CHUNK", 64)
    rows = [{"input_ids": list(range(i % 300)), "loss_mask": [1] * (i % 300)} for i in range(2000)]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    got = [b for batch in read_jsonl(str(path), ["input_ids", "loss_mask"], set())
           for b in batch.batch.to_pylist()]
    assert got == rows


def test_a_run_of_blank_lines_is_not_held_whole(tmp_path, monkeypatch):
    """Blank lines before a batch's first record are counted and let go as they are read: a
    gzip file of 400 MB of newlines was held in a buffer that doubled to hold it (753 MB). The
    records' line numbers still count every blank line."""
    from packer_cli.sources import readers

    monkeypatch.setattr(readers, "SCAN_CHUNK", 256)
    monkeypatch.setattr(readers, "BATCH_BYTES", 1024)  # blank lines after a record end its batch here
    grown = []
    fill = readers._ScannedBatches._fill

    def watched(self):
        fill(self)
        grown.append(self.buf.size)

    monkeypatch.setattr(readers._ScannedBatches, "_fill", watched)
    blanks = b"\n" * 100_000 + b"  \t\n" * 1_000
    path = tmp_path / "d.jsonl"
    path.write_bytes(blanks + b'{"input_ids":[1,2]}\n' + blanks + b'{"input_ids":[3]}\n\n' + blanks)
    batches = list(read_jsonl(str(path), ["input_ids"], set()))
    assert [row for b in batches for row in b.batch.to_pylist()] == [{"input_ids": [1, 2]}, {"input_ids": [3]}]
    assert [line for b in batches for line in b.lines.tolist()] == [101_001, 202_002]
    assert max(grown) <= 8 * 256, max(grown)  # a batch's bytes and a chunk, not the run


_LINE = b'{"input_ids":[5,6],"loss_mask":%s,"answer_start_idx":0}'


@pytest.mark.parametrize("mask,read", [
    (b"[true,false]", [1, 0]),
    (b"[ false , true\t]", [0, 1]),
    (b"[false]", [0]),
    (b"[true, 1]", None),  # mixed: orjson's path reads it
    (b"[1, true]", None),
    (b"[true,]", None),  # malformed: orjson's path reports it
    (b"[truex, false]", None),
    (b"[tru, false]", None),
    (b"[true false]", None),
    (b"[True, false]", None),
    (b"[true, null]", None),
])
def test_flag_lists_read_as_integers(mask, read):
    ok, values = _scan_one(_LINE % mask)
    assert ok is (read is not None)
    if read is not None:
        assert values == [[5, 6], read, 0]


@pytest.mark.parametrize("line", [
    b'{"input_ids":[true,false],"loss_mask":[1,0],"answer_start_idx":0}',
    b'{"input_ids":[5,6],"loss_mask":[1,0],"answer_start_idx":true}',
])
def test_booleans_only_in_flag_fields(line):
    assert _scan_one(line) == (False, None)


_SKIPPED = b'{"input_ids":[5,6],"loss_mask":[1,0],"answer_start_idx":0,"x":%s}'  # "x": a field not read


@pytest.mark.parametrize("text, valid", [
    (b"\xe0\xa0\x80", True),  # U+0800, the first code point of three bytes
    (b"\xe0\x80\x80", False),  # overlong: U+0000 in three bytes
    (b"\xe0\x9f\xbf", False),  # overlong: U+07FF in three bytes
    (b"\xed\x9f\xbf", True),  # U+D7FF, the last before the surrogates
    (b"\xf0\x90\x80\x80", True),  # U+10000, the first of four bytes
    (b"\xf4\x8f\xbf\xbf", True),  # U+10FFFF, the last code point
    (b"\xf4\x90\x80\x80", False),  # U+110000: past Unicode
    (b"\xf4\xbf\xbf\xbf", False),
], ids=["U+0800", "overlong-U+0000", "overlong-U+07FF", "U+D7FF", "U+10000", "U+10FFFF", "U+110000", "U+13FFFF"])
def test_utf8_in_a_skipped_string_is_checked_as_orjson_checks_it(text, valid):
    """The scanner validates the UTF-8 of the strings it skips, to the byte orjson does: an
    overlong form (E0 80 80) or a code point past U+10FFFF (F4 90 80 80) was accepted, and the
    record packed from a line that is no JSON."""
    line = _SKIPPED % (b'"a' + text + b'z"')
    ok, values = _scan_one(line)
    assert ok is valid
    if valid:
        assert values == [[5, 6], [1, 0], 0]
        assert orjson.loads(line)["x"] == "a" + text.decode() + "z"
    else:
        with pytest.raises(orjson.JSONDecodeError, match="not valid UTF-8"):
            orjson.loads(line)


@pytest.mark.parametrize("value", [b"[1}", b'{"a":1]', b"[[1]}", b'[{"a":[]]]'])
def test_mismatched_brackets_in_a_skipped_value_are_given_up(value):
    """A ``]`` closing an object or a ``}`` closing a list is malformed JSON: each closed
    whatever was open, and the record was accepted."""
    line = _SKIPPED % value
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(line)
    assert _scan_one(line) == (False, None)


@pytest.mark.parametrize("depth", [1, 64, 65])
def test_nesting_past_64_levels_is_given_up(depth):
    """The scanner keeps 64 levels of nesting (``MAX_DEPTH``) and gives up on a record nested
    deeper, which orjson reads. Past them it wrote beyond its 64-byte stack: a record nested
    1,100 deep aborted the process ("munmap_chunk(): invalid pointer"). (65 levels write one byte
    past it, which fails this test without taking the process down.)"""
    for opening, closing in ((b"[", b"]"), (b'{"k":', b"}")):
        line = _SKIPPED % (opening * depth + b"1" + closing * depth)
        assert orjson.loads(line)["input_ids"] == [5, 6]
        ok, values = _scan_one(line)
        assert ok is (depth <= scan.MAX_DEPTH), (depth, opening)
        if ok:
            assert values == [[5, 6], [1, 0], 0]


def test_reader_reads_boolean_masks_and_names_what_it_cannot(tmp_path):
    lines = [_LINE % m for m in (b"[true,false]", b"[true, 1]", b'[true, "1"]', b"[1, 0]")]
    lines.append(b'{"input_ids":[5,true],"loss_mask":[1,0],"answer_start_idx":0}')
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    for read in (read_jsonl, read_jsonl_orjson):
        (batch,) = read(str(path), FIELDS, SCALAR, flag_fields=FLAGS)
        assert batch.batch.column("loss_mask").to_pylist() == [[1, 0], [1, 1], None, [1, 0], [1, 0]]
        # spelled as the record spells them: JSON's "1" and true, not Python's '1' and True
        assert batch.pre_bad == {2: 'loss_mask[1] = "1" is not an integer',
                                 4: "input_ids[1] = true is not an integer"}
    (batch,) = read_jsonl(str(path), FIELDS, SCALAR)  # not a flag field: booleans are not integers
    assert batch.pre_bad[0] == "loss_mask[0] = true is not an integer"


@pytest.mark.parametrize("split_bytes", [1 << 20, 300])  # (300: few-record batches scanned in two halves)
def test_a_batch_of_long_records_closes_at_its_byte_budget(tmp_path, monkeypatch, split_bytes):
    """A batch closes before ``BATCH_ROWS`` records where they would pass ``BATCH_BYTES`` of text
    (its first record whatever its length): 1,000 lines of 100k tokens were one batch, 2.3 GB at
    the peak. Blank lines and a last line without a newline are counted as before, and the
    records read are orjson's, in order."""
    from packer_cli.sources import readers

    monkeypatch.setattr(readers, "BATCH_BYTES", 2000)
    monkeypatch.setattr(readers, "SPLIT_BYTES", split_bytes)
    monkeypatch.setattr(readers, "SCAN_CHUNK", 256)  # the buffer refills and grows mid-batch
    rng = random.Random(7)
    rows = [{"input_ids": list(range(rng.randrange(0, 300))), "loss_mask": [1, 0, 1]} for _ in range(400)]
    rows[10]["input_ids"] = list(range(1500))  # alone longer than the budget
    lines = [orjson.dumps(r) for r in rows]
    lines[5:5] = [b"", b"   "]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines))  # no newline after the last
    fields = ["input_ids", "loss_mask"]
    got = list(read_jsonl(str(path), fields, set()))
    assert [r for b in got for r in b.batch.to_pylist()] == rows
    want = list(read_jsonl_orjson(str(path), fields, set()))
    assert np.concatenate([b.lines for b in got]).tolist() == np.concatenate([b.lines for b in want]).tolist()
    text = {n: len(line) + 1 for n, line in enumerate(lines, 1)}  # by line number
    row0 = 0
    for k, b in enumerate(got):
        assert b.row0 == row0
        row0 += b.batch.num_rows
        first, last = int(b.lines[0]), int(b.lines[-1])
        size = sum(text[n] for n in range(first, last + 1))
        assert size <= 2000 or b.batch.num_rows == 1
        if k + 1 < len(got):  # closed only where the next record would pass the budget
            after = int(got[k + 1].lines[0])
            assert size + sum(text[n] for n in range(last + 1, after + 1)) > 2000
    assert len(got) > 20


@pytest.mark.parametrize("batch_rows", [8, 16])
def test_a_batch_whose_second_half_needs_another_read_is_scanned_whole(tmp_path, monkeypatch, batch_rows):
    """A later batch whose first half was in the buffer and whose second was not: the read that
    brought the rest moved the buffer's bytes to its start, and the first half's end was left
    where it had been. The halves then overlapped, and valid JSON Lines (8,000 records of 5,000
    bytes, at the default settings) failed with 'Negative buffer resize'."""
    from packer_cli.sources import readers

    monkeypatch.setattr(readers, "BATCH_ROWS", batch_rows)
    monkeypatch.setattr(readers, "SCAN_CHUNK", 256)  # 6 records a read: every later batch straddles one
    monkeypatch.setattr(readers, "SPLIT_BYTES", 1)  # batches this small are scanned in two halves too
    rows = [{"input_ids": [i, i + 1], "loss_mask": [0, 1]} for i in range(100)]
    lines = [orjson.dumps(r) for r in rows]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(line.ljust(40) + b"\n" for line in lines))  # 40 bytes a record
    fields = ["input_ids", "loss_mask"]
    got = list(read_jsonl(str(path), fields, set()))
    assert [b.row0 for b in got] == list(range(0, 100, batch_rows))
    assert [r for b in got for r in b.batch.to_pylist()] == rows
    assert np.concatenate([b.lines for b in got]).tolist() == list(range(1, 101))
    want = list(read_jsonl_orjson(str(path), fields, set()))
    assert [b.batch.to_pydict() for b in got] == [b.batch.to_pydict() for b in want]


def test_records_the_scanner_gives_up_on_are_spliced_into_its_arrays(tmp_path):
    """Records the scanner cannot vouch for (an emoji escaped as a surrogate pair, as
    ``json.dumps`` writes it by default; a float of 18 digits; a malformed token list; a record
    that is no object) are read by orjson and spliced in among the scanned ones: the batches,
    their bad-record reasons and line numbers are the orjson reader's."""
    rng = random.Random(3)
    lines = []
    for i in range(3 * BATCH_ROWS + 5):
        ids = [rng.randrange(0, 50000) for _ in range(rng.randrange(1, 40))]
        record = {"input_ids": ids, "loss_mask": [rng.randrange(0, 2) for _ in ids]}
        line = orjson.dumps(record)
        if i % 97 == 1:
            line = b'{"text":"ok \\ud83d\\ude00",' + line[1:]
        elif i % 89 == 2:
            line = b'{"score":0.07327801014093555,' + line[1:]
        elif i % 331 == 3:
            line = b'{"input_ids":[1,"x",3],"loss_mask":[1,1,1]}'
        elif i % 409 == 4:
            line = b'[1, 2, 3]'
        lines.append(line)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    fields = ["input_ids", "loss_mask"]
    got = list(read_jsonl(str(path), fields, set(), flag_fields={"loss_mask"}))
    want = list(read_jsonl_orjson(str(path), fields, set(), flag_fields={"loss_mask"}))
    assert len(got) == len(want) == 4
    assert sum(len(g.pre_bad) for g in got) > 10
    for g, w in zip(got, want):
        assert (g.row0, g.pre_bad) == (w.row0, w.pre_bad)
        np.testing.assert_array_equal(g.lines, w.lines)
        assert g.batch.to_pydict() == w.batch.to_pydict()
        assert all(pa.types.is_list(t) and pa.types.is_integer(t.value_type) for t in g.batch.schema.types)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="possessive quantifiers: Python 3.10 parses the record as it is")
def test_field_names_of_a_long_first_record_are_found_with_its_integer_lists_emptied(tmp_path, monkeypatch):
    """The first record's keys decide the supervision; orjson made a Python int of each of its
    tokens (a 10M-token first line: 1.17 GB). Lists of integers are emptied first in a long
    record: the keys found, and which records are skipped as malformed, are the same."""
    from packer_cli.sources import readers

    rng = random.Random(11)
    lines = []
    for i in range(600):
        line = _record(rng)
        if i % 3 == 0:
            line = _mutate(rng, line)
        if i % 5 == 0:
            line = b'{"text": "see [1, 2] or [3,]", ' + line[1:]
        lines.append(line)
    found = {}
    for threshold in (1 << 40, 0):  # never emptied, always emptied
        monkeypatch.setattr(readers, "KEYS_ONLY_BYTES", threshold)
        names = []
        for k in range(0, len(lines), 3):  # files whose first records are three of these
            path = tmp_path / f"f{k}.jsonl"
            path.write_bytes(b"\n".join(lines[k:k + 3]) + b"\n")
            names.append(readers.jsonl_field_names(str(path)))
        found[threshold] = names
    assert found[0] == found[1 << 40]
    assert sum(n is None for n in found[0]) < len(found[0])

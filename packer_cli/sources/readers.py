"""Format readers: each yields raw record batches of one input file.

A reader only knows its format. It yields :class:`RawBatch` objects (an Arrow record batch
of the wanted fields, plus the JSONL line numbers and records it already found bad); the
validation and normalization of every format is shared in :mod:`normalize`.
"""
from __future__ import annotations

import gzip
import io
import json
import mmap
import re
import zlib
from dataclasses import dataclass, field
from typing import Collection, Iterator

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from packer_cli._arrow import from_numpy, memory_pool
from packer_cli._cycles import input_file_read
from packer_cli.errors import DataError, env_choice, first_line, shown
from packer_cli.sources._ipc_file import check_file_layout
from packer_cli.sources.discover import InputFile
from packer_cli.sources.normalize import SUPERVISION_KIND, readable_column
from packer_cli.sources.parquet_lists import ListColumnReader

BATCH_ROWS = 2048  # rows per batch: bounds decode memory in flight (a few batches are)
#: ...and tokens per batch: a batch of long samples closes sooner (Parquet, Arrow IPC). 2,048 rows
#: of 100k tokens held 200M tokens at once: 1.9 GB at the peak where 4M tokens a batch need ~0.5.
BATCH_VALUES = 4 << 20
SCAN_CHUNK = 16 << 20  # bytes read per step by the JSON Lines scanner
#: JSON Lines text per batch: records past it wait for the next batch (a batch's first record is
#: taken whatever its size). 1,000 lines of 100k tokens were one batch of 0.6 GB of text and
#: their values, 2.3 GB at the peak.
BATCH_BYTES = 16 << 20
#: A JSON Lines batch this large is scanned in two halves at once even with few records.
SPLIT_BYTES = 1 << 20

#: How ``.jsonl.gz`` inputs are decompressed: ``isal`` (the default) with python-isal's igzip where
#: it is installed (``pip install "packer-cli[gzip]"``), Python's gzip module where it is not;
#: ``zlib`` with Python's gzip module always. Both read the same files the same way (members back
#: to back, zero padding after the last; a cut or damaged one is an error); igzip decompresses
#: about 3x as fast (see :func:`_gzip_module`).
ENV_GZIP = "PACKER_GZIP_DECODER"
GZIP_DECODERS = ("isal", "zlib")
#: What reading an input's bytes raises for bytes that are not what they should be; isal's own
#: error (a damaged deflate block) joins once igzip is loaded.
READ_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, ValueError, zlib.error)

@dataclass
class RawBatch:
    """Records ``row0 .. row0+len`` of ``path`` (a file, or one part of a datasets dir)."""

    path: str
    row0: int
    batch: pa.RecordBatch
    lines: np.ndarray | None = None
    pre_bad: dict[int, str] = field(default_factory=dict)


# --- JSON Lines --------------------------------------------------------------------------

class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of a ``.zst`` file, all its frames, failing on a cut or damaged one.

    zstandard's stream reader ends quietly where the file ends, even inside a frame, so a
    truncated file read as a shorter valid one. Arrow's decompressing stream reads frame after
    frame and raises when the input ends before the last frame does (as gzip does for .gz).
    Arrow's stream refuses a frame whose window passes 128 MiB (``zstd --long=28`` and up); from
    such a frame on, the file is read by :class:`_ZstdFrames` instead.
    """

    def __init__(self, path: str):
        self._path = path
        self._stream = pa.CompressedInputStream(pa.OSFile(path), "zstd")
        self._handed_out = 0  # decompressed bytes returned so far
        self._long = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            n = self._stream.readinto(buffer)
        except OSError as exc:
            if self._long or "too much memory" not in str(exc):
                raise OSError(f"truncated or corrupt zstd data ({exc})") from None
            self._stream.close()
            self._stream, self._long = _ZstdFrames(self._path), True
            self._stream.skip(self._handed_out)  # what Arrow's stream already handed out
            n = self._stream.readinto(buffer)
        self._handed_out += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()


class _ZstdFrames:
    """A ``.zst`` file's frames decompressed one after another by zstandard, with windows up to
    2 GiB (what ``zstd --long=31`` writes), failing where the file ends inside a frame."""

    #: Compressed bytes read at a time.
    CHUNK = 1 << 20

    def __init__(self, path: str):
        import zstandard

        self._file = open(path, "rb")
        self._context = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._frame = None  # the frame being decompressed
        self._input = b""  # compressed bytes past the last frame's end, not yet decompressed
        self._output = memoryview(b"")  # decompressed bytes not yet handed out

    def readinto(self, buffer) -> int:
        import zstandard

        while not self._output:
            chunk = self._input or self._file.read(self.CHUNK)
            self._input = b""
            if not chunk:
                if self._frame is not None and not self._frame.eof:
                    raise OSError("truncated or corrupt zstd data (the file ends inside a frame)")
                return 0
            if self._frame is None or self._frame.eof:
                self._frame = self._context.decompressobj()
            try:
                self._output = memoryview(self._frame.decompress(chunk))
            except zstandard.ZstdError as exc:
                raise OSError(f"truncated or corrupt zstd data ({exc})") from None
            if self._frame.eof:
                self._input = self._frame.unused_data
        n = min(len(buffer), len(self._output))
        buffer[:n] = self._output[:n]
        self._output = self._output[n:]
        return n

    def skip(self, nbytes: int) -> None:
        """Decompress and drop the first ``nbytes``."""
        scratch = bytearray(min(nbytes, self.CHUNK) or 1)
        while nbytes > 0:
            got = self.readinto(memoryview(scratch)[:min(nbytes, len(scratch))])
            if got == 0:
                raise OSError("truncated or corrupt zstd data (shorter when read again)")
            nbytes -= got

    def close(self) -> None:
        self._file.close()


#: UTF-8's byte order mark: JSON parsers may ignore one at the start of the text (RFC 8259 §8.1),
#: and pyarrow's JSON reader (so HF ``datasets``) does; orjson refuses it.
UTF8_BOM = b"\xef\xbb\xbf"


def _gzip_module():
    """igzip where it is installed and not turned off (:data:`ENV_GZIP`), else Python's gzip.

    igzip (Intel's ISA-L inflate) is a drop-in for the gzip module: the same file class, the
    same handling of members, padding, CRC and length checks; only a damaged deflate block
    raises its own error class (added to :data:`READ_ERRORS`). On the benchmark's 50k samples
    (234 MB of JSON Lines, 84 MB gzipped) it decompressed in 0.35-0.37 s where the gzip module
    took 1.0-1.2 s, and `pack` of the file took 1.1-1.2 s instead of 1.8-2.0."""
    global READ_ERRORS
    if env_choice(ENV_GZIP, GZIP_DECODERS) == "isal":
        try:
            from isal import igzip, isal_zlib
        except ImportError:
            return gzip
        if isal_zlib.IsalError not in READ_ERRORS:
            READ_ERRORS = READ_ERRORS + (isal_zlib.IsalError,)
        return igzip
    return gzip


def _open_text(path: str):
    """The (decompressed) bytes of a JSON Lines file, past a byte order mark at its start."""
    suffix = path.lower()  # as discover.format_of matched it: DATA.JSONL.GZ is gzip too
    if suffix.endswith(".gz"):
        f = _gzip_module().open(path, "rb")
    elif suffix.endswith(".zst"):
        f = io.BufferedReader(_ZstdReader(path), buffer_size=1 << 20)
    else:
        f = open(path, "rb", buffering=1 << 20)
    try:
        head = f.peek(len(UTF8_BOM))[:len(UTF8_BOM)]
        if head.startswith(UTF8_BOM):
            f.read(len(UTF8_BOM))
        elif head and UTF8_BOM.startswith(head):  # peek stopped inside the mark (a gzip member ends there)
            head = b""
            while len(head) < len(UTF8_BOM) and (more := f.read(len(UTF8_BOM) - len(head))):
                head += more
            if head != UTF8_BOM:  # no mark after all: what was read goes first
                f = io.BufferedReader(_Prefixed(head, f), buffer_size=1 << 20)
    except BaseException:
        f.close()
        raise
    return f


class _Prefixed(io.RawIOBase):
    """``head`` (bytes already read from ``stream``), then the rest of ``stream``."""

    def __init__(self, head: bytes, stream):
        super().__init__()
        self._head, self._stream = memoryview(head), stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._stream.readinto(buffer)

    def close(self) -> None:
        self._stream.close()
        super().close()


def unexpected_field(where: str, name: str) -> DataError:
    """A record or column with field ``name`` where the stream's first record has none: a
    supervision field (every token would be a target) or the padding mask (the padding would
    be packed as tokens). Read, either would have been applied; ignored, it silently is not."""
    if name in SUPERVISION_KIND:
        return DataError(f"{where} is a supervision field, but the first record of the input has none, so "
                         "every token would be a target: give all records the same fields, or name the "
                         "supervision field with --mask-field or --labels-field")
    return DataError(f"{where} is a padding mask, but the first record of the input has none, so the padding "
                     "it marks would be packed as tokens: give all records the same fields (a mask of 1s "
                     "where a record has no padding)")


def _as_json(value) -> str:
    """A JSON value for a message, spelled as the record spells it (``true``, ``"a"``, not
    Python's ``True``, ``'a'``), cut as :func:`shown` cuts."""
    if isinstance(value, float):  # as Python writes it (valid JSON when finite): orjson's own spelling of
        return shown(value)        # 1e19 changed between releases, and it writes 1e400 as null
    try:
        return shown(value, text=orjson.dumps(value).decode())
    except (TypeError, orjson.JSONEncodeError):
        return shown(value)


def _value_problem(value, scalar: bool, flags: bool = False) -> str | None:
    """Why one JSON value cannot be a token list (or an integer scalar; or, for ``flags``, a list
    of integers and booleans); None if it can."""
    if value is None:
        return None
    if isinstance(value, _LongInteger):
        return f" = {shown(value)} is out of range"
    if scalar:
        if not isinstance(value, int) or isinstance(value, bool):
            return "is not an integer"
        return None if -(2**63) <= value < 2**63 else f" = {shown(value)} is out of range"
    if not isinstance(value, list):
        return "is not a list"
    for j, item in enumerate(value):
        if flags and isinstance(item, bool):
            continue
        if item is None:  # as the columnar path says it, whatever else is in the batch
            return f"[{j}] is null"
        if isinstance(item, _LongInteger):
            return f"[{j}] = {shown(item)} is out of range"
        if not isinstance(item, int) or isinstance(item, bool):
            return f"[{j}] = {_as_json(item)} is not an integer"
        if not -(2**63) <= item < 2**63:
            return f"[{j}] = {shown(item)} is out of range"
    return None


def _column(name: str, values: list, scalar: bool, pre_bad: dict[int, str], flags: bool = False) -> pa.Array:
    """Arrow column of one field; values that are not integers become bad records.

    A ``flags`` field (a loss mask) may hold booleans too: they become the integers 1 and 0,
    as the compiled scanner reads them.
    """
    try:
        arr = pa.array(values)
        ok_type = pa.types.is_integer(arr.type) or pa.types.is_null(arr.type)
        if not scalar:
            if flags and pa.types.is_list(arr.type) and pa.types.is_boolean(arr.type.value_type):
                arr = arr.cast(pa.list_(pa.int64()))
            ok_type = pa.types.is_null(arr.type) or (
                pa.types.is_list(arr.type)
                and (pa.types.is_integer(arr.type.value_type) or pa.types.is_null(arr.type.value_type))
            )
        if ok_type:
            return arr
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        pass
    for row, value in enumerate(values):  # slow path: something in the batch is wrong, or mixes types
        problem = _value_problem(value, scalar, flags)
        if problem:
            pre_bad.setdefault(row, f"field '{name}' {problem}" if problem.startswith("is") else f"{name}{problem}")
            values[row] = None
        elif flags and value and any(isinstance(item, bool) for item in value):
            values[row] = [int(item) for item in value]  # booleans and integers in one list
    return pa.array(values, type=pa.int64() if scalar else pa.list_(pa.int64()))


#: A first record longer than this has its lists of integers emptied before orjson parses it
#: for its keys: orjson makes a Python int of every token, about 100 bytes a token at the peak
#: (a first line of 10M tokens: 1.17 GB; of 50M: 5.3 GB).
KEYS_ONLY_BYTES = 1 << 20
#: A JSON list of integers, strictly as JSON writes one (what is not stays for orjson to judge).
#: It holds no quote, so it lies wholly inside a string or wholly outside any: emptying it
#: changes neither the record's keys nor whether it is well-formed. Possessive quantifiers
#: (Python 3.11): with plain ones the matcher kept a backtracking mark a token (a 10M-token
#: list took 3.7 GB); without them (Python 3.10) the first record is parsed as it is.
try:
    _INTEGER_LIST: re.Pattern | None = re.compile(
        rb"\[[ \t\r\n]*+(?:-?+(?:0|[1-9][0-9]*+)[ \t\r\n]*+(?:,[ \t\r\n]*+-?+(?:0|[1-9][0-9]*+)[ \t\r\n]*+)*+)?+\]")
except re.error:
    _INTEGER_LIST = None


def jsonl_field_names(path: str) -> list[str] | None:
    """Keys of the first JSON object record, wherever it is (used to detect the supervision field).

    Blank lines are no records, and malformed ones are skipped: they are reported (or skipped,
    under --on-bad-record skip) when the file is read, where a later record's supervision field
    must not be what stops the run. The search once gave up after 10,000 lines, and decided
    "every token is a target" for a file whose first record came later.
    """
    with _open_text(path) as f:
        for raw in f:
            if raw.strip():
                if _INTEGER_LIST is not None and len(raw) > KEYS_ONLY_BYTES:
                    raw = _INTEGER_LIST.sub(b"[]", raw)
                try:
                    record = orjson.loads(raw)
                except orjson.JSONDecodeError:  # as the reader parses it: valid JSON orjson refuses counts
                    record = _standard_record(raw)[0]
                if isinstance(record, dict):
                    return list(record)
    return None  # no record: the next input decides


def _orjson_values(raw: bytes, fields: list[str], pre_bad: dict[int, str], row: int) -> list:
    """The wanted fields of one record parsed by orjson (the reference path for every record)."""
    return _field_values(_orjson_record(raw, pre_bad, row, fields), fields, pre_bad, row)


def _holds_a_float(value) -> bool:
    return isinstance(value, float) or (isinstance(value, list) and any(isinstance(v, float) for v in value))


def _orjson_record(raw: bytes, pre_bad: dict[int, str], row: int, fields: list[str]) -> dict:
    """One record parsed by orjson; ``{}`` (and the reason in ``pre_bad``) when it is no object.

    orjson refuses some valid JSON: a lone surrogate escape (``"\\ud83d"``, which Python's
    ``json.dumps`` writes for half an emoji), a number past a double's range. Such a record,
    anywhere in it, is read by the standard parser instead (NaN and Infinity, which that parser
    takes and JSON has not, stay malformed). Nesting deeper than 1024 levels both refuse
    (Python's parser stops at its recursion limit, about 1000).
    """
    try:
        record = orjson.loads(raw)
        if not isinstance(record, dict):
            raise ValueError("the record is not a JSON object")
    except (orjson.JSONDecodeError, ValueError) as exc:
        record, reason = _standard_record(raw)
        if record is None:  # orjson's reason, unless it is one the standard parser got past
            why = reason if _STANDARD_TAKES.search(str(exc)) else str(exc)
            pre_bad[row] = f"malformed JSON: {_RECORD_POSITION.sub(_at_char, why)}"
            return {}
    if any(_holds_a_float(record.get(name)) for name in fields):
        # orjson reads an integer past 64 bits as a float (2**64 as 1.8446744073709552e+19,
        # -2**63 - 1 as -2**63): the standard parser keeps it exact, so the reason quotes the file
        # (nested deeper than that parser goes, orjson's reading stands)
        record = _standard_record(raw)[0] or record
    return record


#: orjson's refusals of valid JSON, which :func:`_standard_record` reads.
_STANDARD_TAKES = re.compile(r"surrogate|parsed as double")
# Both parsers place an error as "line L column C (char N)" of what they were given: one record,
# so their line is not the file's (a record cut short at file line 51 said "line 2 column 1").
_RECORD_POSITION = re.compile(r": line \d+ column \d+ \(char (\d+)\)$")


def _at_char(match: re.Match) -> str:
    return f" at character {match.group(1)} of the record"


def _standard_record(raw: bytes) -> tuple[dict | None, str]:
    """``raw`` parsed by Python's ``json`` as strict JSON: ``(the record, "")`` when it is an
    object, else ``(None, why not)``."""
    try:
        record = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, parse_int=_integer)
    except (ValueError, RecursionError) as exc:
        return None, str(exc) or type(exc).__name__
    return (record, "") if isinstance(record, dict) else (None, "the record is not a JSON object")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class _LongInteger(str):
    """An integer literal longer than Python converts (4,300 digits): far out of any field's
    range, and valid JSON for a field packer does not read."""

    __repr__ = str.__str__


def _integer(digits: str):
    return int(digits) if len(digits) <= 4000 else _LongInteger(digits)


def _field_values(record: dict, fields: list[str], pre_bad: dict[int, str], row: int) -> list:
    """The wanted fields of a parsed record (None where missing or null, each named in ``pre_bad``)."""
    for name in fields:  # both read as None below; the message tells them apart
        if name not in record:
            pre_bad.setdefault(row, f"missing field '{name}'")
        elif record[name] is None:
            pre_bad.setdefault(row, f"field '{name}' is null")
    return [record.get(name) for name in fields]


def _python_batch(path: str, row0: int, fields: list[str], scalar_fields: set[str], columns: dict[str, list],
                  lines, pre_bad: dict[int, str], flag_fields: Collection[str] = ()) -> RawBatch:
    arrays = [_column(n, columns[n], n in scalar_fields, pre_bad, n in flag_fields) for n in fields]
    batch = pa.RecordBatch.from_arrays(arrays, names=fields)
    return RawBatch(path, row0, batch, np.asarray(lines, dtype=np.int64), dict(pre_bad))


def read_jsonl_orjson(path: str, fields: list[str], scalar_fields: set[str],
                      flag_fields: Collection[str] = ()) -> Iterator[RawBatch]:
    """Every record through orjson: the reference the compiled reader must match (see tests)."""
    columns: dict[str, list] = {name: [] for name in fields}
    lines: list[int] = []
    pre_bad: dict[int, str] = {}
    row0 = 0

    def flush() -> RawBatch:
        out = _python_batch(path, row0, fields, scalar_fields, columns, lines, pre_bad, flag_fields)
        for values in columns.values():
            values.clear()
        lines.clear()
        pre_bad.clear()
        return out

    with _open_text(path) as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            for name, value in zip(fields, _orjson_values(raw, fields, pre_bad, len(lines))):
                columns[name].append(value)
            lines.append(line_no)
            if len(lines) == BATCH_ROWS:
                batch = flush()
                row0 += batch.batch.num_rows
                yield batch
        if lines:
            yield flush()


class _ScannedBatches:
    """Batches of a JSON Lines stream parsed by the compiled scanner (:mod:`._jsonl_scan`).

    The stream is read into one buffer until it holds a whole batch; the batch is cut in two
    halves at a line boundary and both are scanned at once (this thread and one helper; the
    scanner releases the GIL). Records the scanner cannot vouch for are parsed by orjson, one
    by one, and a batch holding any of them is assembled exactly as :func:`read_jsonl_orjson`
    assembles it, so messages and results do not change.
    """

    def __init__(self, path: str, f, fields: list[str], scalar_fields: set[str], absent: tuple[str, ...] = (),
                 flag_fields: Collection[str] = ()):
        self.path, self.f, self.fields, self.scalar_fields = path, f, fields, scalar_fields
        self.flag_fields = flag_fields
        # Keys the scanner compares: the wanted fields, then the absent ones (a record with one
        # of those is given up on, so orjson reads it and :meth:`_mixed_batch` reports it).
        self.absent = absent
        encoded = [name.encode() for name in (*fields, *absent)]
        self.names = np.frombuffer(b"".join(encoded) or b"\0", dtype=np.uint8)
        self.name_offsets = np.cumsum([0] + [len(n) for n in encoded]).astype(np.int64)
        from packer_cli.sources import _jsonl_scan as scan

        self.kinds = np.array([scan.SCALAR if name in scalar_fields else scan.FLAGS if name in flag_fields
                               else scan.LIST for name in fields], dtype=np.int8)
        self.scalar = self.kinds == scan.SCALAR
        self.buf = np.empty(SCAN_CHUNK, dtype=np.uint8)
        self.lo = self.hi = 0
        self.eof = False
        self.error: BaseException | None = None
        self.pending: DataError | None = None  # an absent field the batch before it ends at
        self.blank_lines = 0  # blank lines let go of before the next batch's first record

    def _fill(self) -> None:
        """Keep the unscanned bytes, read the next chunk after them (growing the buffer if needed)."""
        tail = self.hi - self.lo
        if self.lo:
            self.buf[:tail] = self.buf[self.lo:self.hi]
        self.lo, self.hi = 0, tail
        if self.buf.size - tail < SCAN_CHUNK // 2:
            grown = np.empty(2 * self.buf.size, dtype=np.uint8)
            grown[:tail] = self.buf[:tail]
            self.buf = grown
        try:
            n = self.f.readinto(memoryview(self.buf)[tail:])
        except READ_ERRORS as exc:  # raised once the lines before it are used
            self.error, n = exc, 0
        if not n:
            self.eof = True
        self.hi += n or 0

    def _span(self):
        """(end, records, lines, half) of the next batch, reading until the buffer holds all of it.

        A batch is ``BATCH_ROWS`` records, fewer where they would pass ``BATCH_BYTES`` of text
        (the first record is taken whatever its length), or the rest of the stream. ``half`` is
        (end, records, lines) of the batch's first half (None unless the batch is full).
        Counting resumes where it stopped after each read, so every byte is looked at once.
        """
        from packer_cli.sources._jsonl_scan import batch_span

        pos, rows, lines, half = self.lo, 0, 0, None
        while True:
            if rows == 0:  # the first record, however long (blank lines before it are counted)
                pos, rows, more_lines = batch_span(self.buf, pos, self.hi, self.eof, 1)
                if rows:
                    lines += more_lines
                else:  # blank lines only, so far: counted and let go (400 MB of them were held whole)
                    self.lo = pos
                    self.blank_lines += more_lines
            capped = False
            if rows:
                end = min(self.hi, max(pos, self.lo + BATCH_BYTES))
                capped = end < self.hi  # the buffer holds more than the batch may
                for target in (BATCH_ROWS // 2, BATCH_ROWS):
                    if rows >= target:
                        continue
                    pos, more_rows, more_lines = batch_span(self.buf, pos, end, self.eof and not capped,
                                                            target - rows)
                    rows, lines = rows + more_rows, lines + more_lines
                    if rows < target:
                        break
                    if target == BATCH_ROWS // 2:
                        half = (pos, rows, lines)
            if rows == BATCH_ROWS or self.eof or capped:
                return pos, rows, lines, half if rows == BATCH_ROWS else None
            shift = self.lo
            self._fill()
            pos -= shift
            if half is not None:
                half = (half[0] - shift, half[1], half[2])

    def _scan(self, lo: int, hi: int, rows: int, line0: int, room: int = 0) -> _ScannedPart:
        """Scan the ``rows`` records of ``buf[lo:hi]`` (whole lines; the first is line ``line0 + 1``).

        Values get room for ``room`` more bytes of input (the half that will be appended).
        """
        from packer_cli.sources import _jsonl_scan as scan

        k = len(self.fields)
        part = _ScannedPart(k, rows, capacity=(hi - lo + room) // 2 + 1)  # a value takes at least 2 bytes
        state = np.zeros(4, dtype=np.int64)
        state[scan.LINE] = line0
        while True:
            scan.scan(self.buf, lo, hi, True, rows, self.names, self.name_offsets, self.kinds, state, part.lines,
                      part.offsets, part.values, part.scalars, part.slow_rows, part.slow_spans)
            if state[scan.STATUS] != scan.NEED_SPACE:  # cannot happen: a value takes at least 2 bytes
                break
            part.values = np.empty((k, 2 * part.values.shape[1]), dtype=np.int32)
            state[scan.ROWS] = state[scan.SLOW] = 0
            state[scan.LINE] = line0
        assert state[scan.ROWS] == rows
        part.slow = {int(part.slow_rows[j]): self.buf[a:b].tobytes()
                     for j, (a, b) in enumerate(part.slow_spans[:state[scan.SLOW]])}
        return part

    def __iter__(self) -> Iterator[RawBatch]:
        from concurrent.futures import ThreadPoolExecutor

        from packer_cli.sources._jsonl_scan import batch_span

        row0 = line0 = 0
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="packer-jsonl") as helper:
            while True:
                end, rows, lines, first_half = self._span()
                line0 += self.blank_lines
                self.blank_lines = 0
                if self.error is not None and rows < BATCH_ROWS and end == self.hi:  # the lines before it are used
                    raise self.error
                if rows == 0:
                    return
                lo = self.lo
                if rows >= 256 or (rows >= 2 and end - lo >= SPLIT_BYTES):
                    mid, half, half_lines = first_half or batch_span(self.buf, lo, end, True, rows // 2)
                    second = helper.submit(self._scan, mid, end, rows - half, line0 + half_lines)
                    part = self._scan(lo, mid, half, line0, room=end - mid)
                    part.append(second.result())
                else:
                    part = self._scan(lo, end, rows, line0)
                self.lo = end
                line0 += lines
                batch = self._batch(row0, part)
                if batch.batch.num_rows:
                    yield batch
                if self.pending is not None:
                    raise self.pending
                row0 += rows

    def _batch(self, row0: int, part: "_ScannedPart") -> RawBatch:
        rows = part.rows
        if part.slow:
            return self._mixed_batch(row0, part)
        arrays = []
        for k, name in enumerate(self.fields):
            if self.scalar[k]:
                arrays.append(from_numpy(part.scalars[k, :rows]))
                continue
            ends = part.offsets[k, :rows + 1]
            flat = from_numpy(part.values[k, :ends[-1]])
            if ends[-1] >= 2**31:
                arrays.append(pa.LargeListArray.from_arrays(from_numpy(ends), flat))
            else:
                arrays.append(pa.ListArray.from_arrays(from_numpy(ends.astype(np.int32)), flat))
        batch = pa.RecordBatch.from_arrays(arrays, names=self.fields)
        return RawBatch(self.path, row0, batch, part.lines[:rows].copy(), {})

    def _absent_field(self, record: dict, line: int) -> DataError | None:
        """The error for an ``absent`` field in the record on ``line``, if it has one (the
        scanner gives up on such a record, and on others it cannot vouch for)."""
        for name in self.absent:
            if record.get(name) is not None:  # null carries nothing
                return unexpected_field(f"{self.path}: line {line}: field '{name}'", name)
        return None

    def _mixed_batch(self, row0: int, part: "_ScannedPart") -> RawBatch:
        """The batch, records the scanner gave up on read by orjson. One with an ``absent``
        field ends it: the records before it are the batch, and the error waits in ``pending``,
        so that a bad record among them is reported first, as the record order has it.

        Only those records go through Python: each column is the scanned records' arrays with
        theirs spliced in, as 64-bit integers (as :func:`read_jsonl_orjson` reads a batch). The
        whole batch went through Python lists before, so one emoji escape (``json.dumps``'s
        default writes a surrogate pair) or a float of 18 digits in any field of one record in
        2,000 made a file read 3-5x slower."""
        rows = part.rows
        pre_bad: dict[int, str] = {}
        slow_rows: list[int] = []
        slow_values: list[list] = []
        for row in sorted(part.slow):
            row_bad: dict[int, str] = {}
            record = _orjson_record(part.slow[row], row_bad, row, self.fields)
            self.pending = self._absent_field(record, int(part.lines[row]))
            if self.pending is not None:
                rows = row
                break
            pre_bad.update(row_bad)
            slow_rows.append(row)
            slow_values.append(_field_values(record, self.fields, pre_bad, row))
        slow_bad = {j: pre_bad[row] for j, row in enumerate(slow_rows) if row in pre_bad}  # by slow record
        arrays = []
        for k, name in enumerate(self.fields):
            kind = pa.int64() if self.scalar[k] else pa.list_(pa.int64())
            slow = _column(name, [values[k] for values in slow_values], bool(self.scalar[k]), slow_bad,
                           name in self.flag_fields).cast(kind)
            arrays.append(_spliced(self._scanned_column(part, k, rows).cast(kind), slow, slow_rows))
        pre_bad.update({slow_rows[j]: reason for j, reason in slow_bad.items()})
        batch = pa.RecordBatch.from_arrays(arrays, names=self.fields)
        return RawBatch(self.path, row0, batch, part.lines[:rows].copy(), pre_bad)

    def _scanned_column(self, part: "_ScannedPart", k: int, rows: int) -> pa.Array:
        """Field ``k`` of the first ``rows`` records as the scanner read them (the records it gave
        up on are empty there)."""
        if self.scalar[k]:
            return from_numpy(part.scalars[k, :rows])
        ends = part.offsets[k, :rows + 1]
        return pa.ListArray.from_arrays(from_numpy(ends.astype(np.int32)), from_numpy(part.values[k, :ends[-1]]))


def _spliced(column: pa.Array, records: pa.Array, rows: list[int]) -> pa.Array:
    """``column`` with its entry at each of ``rows`` (ascending) replaced by the next of ``records``."""
    pieces, start = [], 0
    for j, row in enumerate(rows):
        pieces += [column.slice(start, row - start), records.slice(j, 1)]
        start = row + 1
    pieces.append(column.slice(start))
    return pa.concat_arrays(pieces)


class _ScannedPart:
    """The scanner's output for a run of records: per-field offsets/values, scalars, lines, slow records."""

    def __init__(self, k: int, rows: int, capacity: int):
        self.rows = rows
        self.lines = np.empty(rows, dtype=np.int64)
        self.offsets = np.zeros((k, rows + 1), dtype=np.int64)
        # From Arrow's pool, which keeps and reuses freed memory: a fresh multi-megabyte NumPy
        # array is a fresh memory map whose pages all fault in (the values end up in Arrow anyway).
        self.values = np.frombuffer(pa.allocate_buffer(4 * k * capacity, memory_pool=memory_pool()),
                                    dtype=np.int32).reshape(k, capacity)
        self.scalars = np.zeros((k, rows), dtype=np.int64)
        self.slow_rows = np.empty(rows, dtype=np.int64)
        self.slow_spans = np.empty((rows, 2), dtype=np.int64)
        self.slow: dict[int, bytes] = {}

    def append(self, other: "_ScannedPart") -> None:
        """Extend with the records that follow (the second half of a batch)."""
        k = self.offsets.shape[0]
        ends = self.offsets[:, self.rows]
        counts = other.offsets[:, other.rows]
        if int((ends + counts).max(initial=0)) > self.values.shape[1]:
            grown = np.empty((k, int((ends + counts).max())), dtype=np.int32)
            grown[:, :self.values.shape[1]] = self.values
            self.values = grown
        offsets = np.empty((k, self.rows + other.rows + 1), dtype=np.int64)
        for f in range(k):
            self.values[f, ends[f]:ends[f] + counts[f]] = other.values[f, :counts[f]]
            offsets[f, :self.rows + 1] = self.offsets[f, :self.rows + 1]
            offsets[f, self.rows + 1:] = other.offsets[f, 1:other.rows + 1] + ends[f]
        self.offsets = offsets
        self.scalars = np.concatenate([self.scalars[:, :self.rows], other.scalars[:, :other.rows]], axis=1)
        self.lines = np.concatenate([self.lines[:self.rows], other.lines[:other.rows]])
        self.slow.update({row + self.rows: raw for row, raw in other.slow.items()})
        self.rows += other.rows


def read_jsonl(path: str, fields: list[str], scalar_fields: set[str],
               absent: tuple[str, ...] = (), flag_fields: Collection[str] = ()) -> Iterator[RawBatch]:
    """Batches of a JSON Lines file (plain, .gz or .zst) through the compiled scanner.

    ``flag_fields`` (a loss mask) may hold ``true``/``false`` as well as integers; they are read as 1/0.
    """
    with _open_text(path) as f:
        yield from _ScannedBatches(path, f, fields, scalar_fields, absent, flag_fields)


# --- Arrow family --------------------------------------------------------------------------

def arrow_field_names(file: InputFile) -> list[str]:
    path = file.parts[0] if file.parts else file.path
    if file.format == "parquet":
        return pq.ParquetFile(path).schema_arrow.names
    return _open_ipc(path)[1].names


#: How an IPC stream ends: a continuation marker and a zero length (Arrow >= 0.15), or just the zero length.
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_LEGACY_END_OF_STREAM = b"\x00\x00\x00\x00"


#: Bytes of an Arrow input read between two hand-backs of its mapped pages (see _MappedInput).
RELEASE_BYTES = 64 << 20


class _MappedInput:
    """A read-only mapping of an Arrow IPC input whose pages the process hands back as it reads.

    Batches are read in place (no copy), but a mapped page the process has touched counts in
    its resident set until it is unmapped: reading a 4 GB file left 4 GB resident at its end,
    beyond the memory bound that holds for every other input. So every :data:`RELEASE_BYTES`
    read, :meth:`read` drops the whole mapping's pages (``MADV_DONTNEED``). The file's pages stay
    in the page cache; a batch still in use that touches one again faults it back in, so this
    costs a little time and never changes what is read.
    """

    def __init__(self, path: str) -> None:
        self._map: mmap.mmap | None = None
        self._since_release = 0
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            except ValueError:  # an empty file cannot be mapped: read as what it is, no bytes
                self.source = pa.BufferReader(b"")
                return
            except OSError:  # a file system that cannot map files: pyarrow reads it instead
                self.source = pa.OSFile(path)
                return
        self.source = pa.BufferReader(pa.py_buffer(self._map))

    def read(self, nbytes: int) -> None:
        """Note that ``nbytes`` more were read; past :data:`RELEASE_BYTES`, hand the pages back."""
        self._since_release += nbytes
        if self._map is not None and self._since_release >= RELEASE_BYTES and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED)
            self._since_release = 0


def _open_ipc(path: str):
    mapped = _MappedInput(path)
    source = mapped.source
    if source.read_at(4, 0) == b"FEA1":
        raise DataError(f"{path}: a Feather version 1 file; packer reads Feather version 2 (Arrow IPC): "
                        "rewrite it with pyarrow.feather.write_feather")
    try:
        reader = pa.ipc.open_file(source)
    except pa.ArrowInvalid as exc:
        if source.read_at(6, 0) == b"ARROW1":  # a file, damaged or cut: its own error, not a stream's
            raise DataError(f"{path}: starts as an Arrow IPC file but cannot be read as one: {first_line(exc)} "
                            "(truncated?)") from None
        source.seek(0)
        reader = pa.ipc.open_stream(source)
        return _complete_stream(path, source, reader), reader.schema, mapped
    check_file_layout(path, source)
    # One batch at a time: a compressed file's batch is decompressed when it is read, and a
    # list of them all held the whole file decompressed (as did asking for its field names).
    return (reader.get_batch(i) for i in range(reader.num_record_batches)), reader.schema, mapped


def _complete_stream(path: str, source, reader) -> Iterator[pa.RecordBatch]:
    """The batches of an IPC stream, then a check that its end-of-stream marker follows them.

    A stream has no footer, and pyarrow reads one cut between two messages as a shorter valid
    stream; only the marker every writer puts after the last message tells the two apart.
    """
    end = source.tell()  # where the last message read so far ends
    rows = 0
    for batch in reader:
        end = source.tell()
        rows += batch.num_rows
        yield batch
    tail = source.read_at(min(len(_END_OF_STREAM), source.size() - end), end)
    marker = next((m for m in (_END_OF_STREAM, _LEGACY_END_OF_STREAM) if tail.startswith(m)), None)
    if marker is None:
        raise DataError(f"{path}: Arrow IPC stream ends after {rows:,} rows without its end-of-stream marker "
                        "(truncated?)")
    # Bytes after the marker (a second stream appended, garbage) would be dropped unread.
    extra = source.size() - end - len(marker)
    if extra > 0:
        raise DataError(f"{path}: {extra:,} bytes follow the Arrow IPC stream's end-of-stream marker after "
                        f"{rows:,} rows (streams joined together, or a damaged file)")


def _select(batch: pa.RecordBatch, fields: list[str]) -> pa.RecordBatch:
    names = [n for n in fields if n in batch.schema.names]
    return batch.select(names)


def _require_fields(path: str, schema: pa.Schema, fields: list[str]) -> None:
    """A columnar file lacking a wanted column, or holding it twice, is bad as a whole: say so
    with its fields."""
    for name in fields:
        if name not in schema.names:
            raise DataError(f"{path}: row 0: missing field '{name}' (fields: {', '.join(schema.names) or 'none'})")
        if (times := schema.names.count(name)) > 1:
            raise DataError(f"{path}: column '{name}' appears {times} times; which one holds the field is "
                            "ambiguous")


def _absent_columns(path: str, schema: pa.Schema, absent: tuple[str, ...]) -> tuple[str, ...]:
    """The ``absent`` columns a columnar file has (supervision fields or the padding mask, which
    the stream's first record lacks), each to be all null (see :func:`_first_valued_row`); one
    there twice is refused at once (which of them holds what is ambiguous)."""
    for name in absent:
        if schema.names.count(name) > 1:
            raise unexpected_field(f"{path}: column '{name}'", name)
    return tuple(name for name in absent if name in schema.names)


def _first_valued_row(columns) -> int | None:
    """The first row at which one of ``columns`` (``absent`` columns, where the first record
    had none) holds a value, or None: a column of nulls carries nothing, as a JSON null
    does not (such a column was refused, while the same records in JSON Lines read)."""
    first = None
    for column in columns:
        column.validate(full=True)  # an IPC column's null count is otherwise taken as written
        if column.null_count < len(column):
            row = int(np.flatnonzero(column.is_valid().to_numpy(zero_copy_only=False))[0])
            first = row if first is None else min(first, row)
    return first


def _valued_column(path: str, names: tuple[str, ...], columns, row: int, row0: int) -> DataError:
    """The error for the first of ``names`` that holds a value at ``row`` (of rows ``row0..``)."""
    name = next(n for n, c in zip(names, columns) if c.is_valid()[row].as_py())
    return unexpected_field(f"{path}: row {row0 + row}: column '{name}'", name)


def _parquet_valued_row(path: str, names: tuple[str, ...]) -> tuple[int, str] | None:
    """(row, column) of the first value in an ``absent`` column of a Parquet file, read before any
    row is used (the columns are not among those read), or None."""
    if not names:  # nothing to look for: the file is not opened once more for it (0.1 ms a file)
        return None
    found = None
    with pq.ParquetFile(path) as pf:
        for name in names:
            row0 = 0
            for batch in pf.iter_batches(batch_size=64 * BATCH_ROWS, columns=[name]):
                row = _first_valued_row([batch.column(0)])
                if row is not None:
                    found = min(found, (row0 + row, name)) if found else (row0 + row, name)
                    break
                row0 += batch.num_rows
    return found


def read_parquet(path: str, fields: list[str], arrow_only: bool = False,
                 absent: tuple[str, ...] = ()) -> Iterator[RawBatch]:
    """Batches of a Parquet file: packer's compiled decoder for list-of-integer columns,
    pyarrow's for anything else or with ``arrow_only`` (see :mod:`.parquet_lists`). Pages are
    streamed, never whole row groups, so memory stays bounded by the batch size.

    An ``absent`` column that holds a value (see :func:`_first_valued_row`) ends the file
    there: the rows before it are read first, so that a bad record among them is reported
    first, as the record order has it."""
    schema = pq.read_schema(path)
    _require_fields(path, schema, fields)
    valued = _parquet_valued_row(path, _absent_columns(path, schema, absent))
    stop = valued[0] if valued else None
    row0 = 0
    for batch in ListColumnReader(path, fields, BATCH_ROWS, arrow_only=arrow_only, batch_values=BATCH_VALUES):
        if stop is not None and row0 + batch.num_rows > stop:
            batch = batch.slice(0, stop - row0)
        if batch.num_rows:
            yield RawBatch(path, row0, batch)
        row0 += batch.num_rows
        if stop is not None and row0 >= stop:
            break
    if valued:
        raise unexpected_field(f"{path}: row {valued[0]}: column '{valued[1]}'", valued[1])


def read_ipc(path: str, fields: list[str], absent: tuple[str, ...] = ()) -> Iterator[RawBatch]:
    """Batches of an Arrow IPC file or stream: its record batches cut into pieces of at most
    ``BATCH_ROWS`` rows and ``BATCH_VALUES`` values, and consecutive small ones joined up to
    that (:func:`_joined`)."""
    row0 = 0
    for piece in _joined(_checked_ipc_pieces(path, fields, absent)):
        yield RawBatch(path, row0, piece)
        row0 += piece.num_rows


def _checked_ipc_pieces(path: str, fields: list[str], absent: tuple[str, ...]) -> Iterator[pa.RecordBatch]:
    """The pieces (:func:`_ipc_pieces`) of each record batch, ``fields`` only, each checked."""
    batches, schema, mapped = _open_ipc(path)
    _require_fields(path, schema, fields)
    absent = _absent_columns(path, schema, absent)
    row0 = 0
    for batch in batches:
        selected = _select(batch, fields)
        try:
            selected.validate()  # its buffers are large enough for its rows (each piece's contents are checked below)
        except pa.ArrowInvalid as exc:
            raise pa.ArrowInvalid(f"rows {row0:,} to {row0 + batch.num_rows - 1:,}: {exc}") from None
        # a stream is read once: each batch checked as it comes
        columns = [readable_column(batch, name, path, row0) for name in absent]
        valued = _first_valued_row(columns)
        rows = batch.num_rows if valued is None else valued
        for start, stop in _ipc_pieces(selected, rows):
            piece = selected.slice(start, stop - start)
            # IPC buffers are taken as written: check offsets and bounds before trusting them. A
            # piece at a time: checking a whole batch first touched every page of it, a 1 GB
            # batch resident at once, before any could be handed back.
            try:
                piece.validate(full=True)
            except pa.ArrowInvalid as exc:  # its slots count from the piece's first row
                raise pa.ArrowInvalid(f"rows {row0:,} to {row0 + piece.num_rows - 1:,}: {exc}") from None
            yield piece
            row0 += piece.num_rows
            mapped.read(piece.nbytes)
        if valued is not None:  # the rows before it went first: a bad record among them is reported first
            raise _valued_column(path, absent, columns, valued, row0 - valued)


def _first_list_offsets(batch: pa.RecordBatch) -> np.ndarray | None:
    """The offsets of a batch's first column where it is a list (only they are read), else None.
    The type is looked at first: a column of some types cannot even be wrapped."""
    kind = batch.schema.field(0).type if batch.num_columns else None
    if kind is None or not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return None
    return batch.column(0).offsets.to_numpy()


def _piece_values(piece: pa.RecordBatch) -> int:
    """Values of a piece's first column, where it is a list (0 otherwise)."""
    ends = _first_list_offsets(piece)
    return 0 if ends is None or not piece.num_rows else int(ends[-1]) - int(ends[0])


def _joined(pieces: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``pieces`` with runs of small ones (under an eighth of ``BATCH_ROWS`` rows and of
    ``BATCH_VALUES`` values) joined into batches of up to that many; the others pass as they
    are, uncopied. A file written in 1-row record batches cost ~160 us of Python a batch
    downstream: 20,000 rows read at a twentieth of the usual rate. Pieces held when the reading
    fails go first, so a bad record among them is still reported before the failure."""
    held: list[pa.RecordBatch] = []
    rows = values = 0
    pieces = iter(pieces)
    while True:
        try:
            piece = next(pieces)
        except StopIteration:
            break
        except Exception:
            if held:
                yield _join(held)
            raise
        count = _piece_values(piece)
        small = 8 * piece.num_rows < BATCH_ROWS and 8 * count < BATCH_VALUES
        if held and (not small or rows + piece.num_rows > BATCH_ROWS or values + count > BATCH_VALUES):
            yield _join(held)
            held, rows, values = [], 0, 0
        if not small:
            yield piece
            continue
        held.append(piece)
        rows += piece.num_rows
        values += count
    if held:
        yield _join(held)


def _join(pieces: list[pa.RecordBatch]) -> pa.RecordBatch:
    if len(pieces) == 1:
        return pieces[0]
    return pa.Table.from_batches(pieces).combine_chunks().to_batches()[0]


def _ipc_pieces(batch: pa.RecordBatch, rows: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of the pieces the first ``rows`` rows of an IPC batch are read in: at most
    ``BATCH_ROWS`` rows and, by its first list column's offsets, ``BATCH_VALUES`` values (a
    longer row alone). Offsets not yet checked may be anything: each piece still holds at
    least one row and at most ``BATCH_ROWS``, and its check names what is wrong."""
    ends = _first_list_offsets(batch)
    if ends is not None:
        ends = ends[: rows + 1].astype(np.int64)
    start = 0
    while start < rows:
        stop = min(start + BATCH_ROWS, rows)
        if ends is not None and ends[stop] - ends[start] > BATCH_VALUES:
            within = np.searchsorted(ends[start + 1:stop + 1], ends[start] + BATCH_VALUES, side="right")
            stop = start + max(1, int(within))
        yield start, stop
        start = stop


def read_file(file: InputFile, fields: list[str], scalar_fields: set[str],
              arrow_parquet: bool = False, absent: tuple[str, ...] = (),
              flag_fields: Collection[str] = ()) -> Iterator[RawBatch]:
    """Raw batches of one input, wrapping every reader failure as a one-line DataError.

    ``arrow_parquet`` decodes Parquet with pyarrow instead of packer's own decoder. ``absent``:
    fields no record may have (the supervision fields, when the stream's first record has none,
    so that every token is a target; the padding mask, when it has none: a record that has one
    is an error, not ignored).
    ``flag_fields``: the 0/1 masks (supervision and padding), which JSON Lines may write with
    ``true``/``false`` (the Arrow formats' boolean lists are taken by :mod:`.normalize`).
    """
    paths = file.parts or (file.path,)
    for path in paths:
        try:
            if file.format == "jsonl":
                yield from read_jsonl(path, fields, scalar_fields, absent, flag_fields)
            elif file.format == "parquet":
                yield from read_parquet(path, fields, arrow_parquet, absent)
            else:
                yield from read_ipc(path, fields, absent)
        except DataError:
            raise
        except (pa.ArrowException, UnicodeDecodeError) + READ_ERRORS as exc:
            kind = {"jsonl": "JSON Lines", "parquet": "Parquet", "arrow": "Arrow IPC", "hf": "Arrow IPC"}
            raise DataError(f"{path}: cannot read as {kind[file.format]}: {first_line(exc)}") from None
        input_file_read()  # pyarrow's per-file cycles, freed while the collector is off


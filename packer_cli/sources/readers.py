"""Format readers: each yields raw record batches of one input file.

A reader only knows its format. It yields :class:`RawBatch` objects (an Arrow record batch
of the wanted fields, plus the JSONL line numbers and records it already found bad); the
validation and normalization of every format is shared in :mod:`normalize`.
"""
from __future__ import annotations

import gzip
import io
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from packer_cli.errors import DataError
from packer_cli.sources.discover import InputFile

BATCH_ROWS = 8192
SCAN_CHUNK = 16 << 20  # bytes read per step by the JSON Lines scanner
PARQUET_BUFFER = 4 << 20  # bytes per Parquet page-stream read

try:
    from zstandard import ZstdError as _ZstdError
except ImportError:  # pragma: no cover - zstandard is a core dependency
    class _ZstdError(Exception):
        pass


@dataclass
class RawBatch:
    """Records ``row0 .. row0+len`` of ``path`` (a file, or one part of a datasets dir)."""

    path: str
    row0: int
    batch: pa.RecordBatch
    lines: np.ndarray | None = None
    pre_bad: dict[int, str] = field(default_factory=dict)


# --- JSON Lines --------------------------------------------------------------------------

def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb", buffering=1 << 20)


def _value_problem(value, scalar: bool) -> str | None:
    """Why one JSON value cannot be a token list (or an integer scalar); None if it can."""
    if value is None:
        return None
    if scalar:
        return None if isinstance(value, int) and not isinstance(value, bool) else "is not an integer"
    if not isinstance(value, list):
        return "is not a list"
    for j, item in enumerate(value):
        if not isinstance(item, int) or isinstance(item, bool):
            return f"[{j}] = {item!r} is not an integer"
        if not -(2**63) <= item < 2**63:
            return f"[{j}] = {item} is out of range"
    return None


def _column(name: str, values: list, scalar: bool, pre_bad: dict[int, str]) -> pa.Array:
    """Arrow column of one field; values that are not integers become bad records."""
    try:
        arr = pa.array(values)
        ok_type = pa.types.is_integer(arr.type) or pa.types.is_null(arr.type)
        if not scalar:
            ok_type = pa.types.is_null(arr.type) or (
                pa.types.is_list(arr.type)
                and (pa.types.is_integer(arr.type.value_type) or pa.types.is_null(arr.type.value_type))
            )
        if ok_type:
            return arr
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        pass
    for row, value in enumerate(values):  # slow path: only when something in the batch is wrong
        problem = _value_problem(value, scalar)
        if problem:
            pre_bad.setdefault(row, f"field '{name}' {problem}" if problem.startswith("is") else f"{name}{problem}")
            values[row] = None
    return pa.array(values, type=pa.int64() if scalar else pa.list_(pa.int64()))


def jsonl_field_names(path: str) -> list[str]:
    """Keys of the first JSON object record (used to detect the supervision field)."""
    with _open_text(path) as f:
        for _, raw in zip(range(10_000), f):  # skip malformed lines: they are reported later
            if raw.strip():
                try:
                    record = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(record, dict):
                    return list(record)
    return []


def _orjson_values(raw: bytes, fields: list[str], pre_bad: dict[int, str], row: int) -> list:
    """The wanted fields of one record parsed by orjson (the reference path for every record)."""
    try:
        record = orjson.loads(raw)
        if not isinstance(record, dict):
            raise ValueError("the record is not a JSON object")
    except (orjson.JSONDecodeError, ValueError) as exc:
        pre_bad[row] = f"malformed JSON: {exc}"
        record = {}
    return [record.get(name) for name in fields]


def _python_batch(path: str, row0: int, fields: list[str], scalar_fields: set[str], columns: dict[str, list],
                  lines, pre_bad: dict[int, str]) -> RawBatch:
    arrays = [_column(n, columns[n], n in scalar_fields, pre_bad) for n in fields]
    batch = pa.RecordBatch.from_arrays(arrays, names=fields)
    return RawBatch(path, row0, batch, np.asarray(lines, dtype=np.int64), dict(pre_bad))


def read_jsonl_orjson(path: str, fields: list[str], scalar_fields: set[str]) -> Iterator[RawBatch]:
    """Every record through orjson: the reference the compiled reader must match (see tests)."""
    columns: dict[str, list] = {name: [] for name in fields}
    lines: list[int] = []
    pre_bad: dict[int, str] = {}
    row0 = 0

    def flush() -> RawBatch:
        out = _python_batch(path, row0, fields, scalar_fields, columns, lines, pre_bad)
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

    The stream is read in chunks into one reusable buffer. Records the scanner cannot vouch
    for are parsed by orjson, one by one, and a batch holding any of them is assembled exactly
    as :func:`read_jsonl_orjson` assembles it, so messages and results do not change.
    """

    def __init__(self, path: str, f, fields: list[str], scalar_fields: set[str]):
        self.path, self.f, self.fields, self.scalar_fields = path, f, fields, scalar_fields
        encoded = [name.encode() for name in fields]
        self.names = np.frombuffer(b"".join(encoded) or b"\0", dtype=np.uint8)
        self.name_offsets = np.cumsum([0] + [len(n) for n in encoded]).astype(np.int64)
        self.scalar = np.array([name in scalar_fields for name in fields], dtype=np.bool_)
        self.buf = np.empty(SCAN_CHUNK, dtype=np.uint8)
        self.lo = self.hi = 0
        self.eof = False
        self.error: BaseException | None = None
        self.state = np.zeros(4, dtype=np.int64)
        self.capacity = 1 << 20

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
        except (OSError, EOFError, ValueError, _ZstdError) as exc:  # raised once the lines before it are used
            self.error, n = exc, 0
        if not n:
            self.eof = True
        self.hi += n or 0

    def __iter__(self) -> Iterator[RawBatch]:
        from packer_cli.sources import _jsonl_scan as scan

        k = len(self.fields)
        row0 = 0
        state = self.state
        while True:
            lines = np.empty(BATCH_ROWS, dtype=np.int64)
            offsets = np.zeros((k, BATCH_ROWS + 1), dtype=np.int64)
            values = np.empty((k, self.capacity), dtype=np.int32)
            scalars = np.zeros((k, BATCH_ROWS), dtype=np.int64)
            slow_rows = np.empty(BATCH_ROWS, dtype=np.int64)
            slow_spans = np.empty((BATCH_ROWS, 2), dtype=np.int64)
            slow: dict[int, bytes] = {}
            state[scan.ROWS] = state[scan.SLOW] = 0
            while True:
                self.lo = scan.scan(self.buf, self.lo, self.hi, self.eof, BATCH_ROWS, self.names, self.name_offsets,
                                    self.scalar, state, lines, offsets, values, scalars, slow_rows, slow_spans)
                for j in range(len(slow), int(state[scan.SLOW])):
                    a, b = slow_spans[j]
                    slow[int(slow_rows[j])] = self.buf[a:b].tobytes()
                status = state[scan.STATUS]
                if status == scan.BATCH_FULL:
                    break
                if status == scan.NEED_SPACE:
                    self.capacity *= 2
                    grown = np.empty((k, self.capacity), dtype=np.int32)
                    grown[:, :values.shape[1]] = values
                    values = grown
                    continue
                if self.eof:
                    break
                self._fill()
            rows = int(state[scan.ROWS])
            if rows == 0:
                if self.error is not None:
                    raise self.error
                return
            if self.eof and self.error is not None:
                raise self.error
            yield self._batch(row0, rows, lines, offsets, values, scalars, slow)
            row0 += rows

    def _batch(self, row0, rows, lines, offsets, values, scalars, slow: dict[int, bytes]) -> RawBatch:
        if slow:
            return self._mixed_batch(row0, rows, lines, offsets, values, scalars, slow)
        arrays = []
        for k, name in enumerate(self.fields):
            if self.scalar[k]:
                arrays.append(pa.array(scalars[k, :rows]))
                continue
            ends = offsets[k, :rows + 1]
            flat = pa.array(values[k, :ends[-1]])
            list_type = pa.LargeListArray if ends[-1] >= 2**31 else pa.ListArray
            arrays.append(list_type.from_arrays(pa.array(ends if ends[-1] >= 2**31 else ends.astype(np.int32)), flat))
        batch = pa.RecordBatch.from_arrays(arrays, names=self.fields)
        return RawBatch(self.path, row0, batch, lines[:rows].copy(), {})

    def _mixed_batch(self, row0, rows, lines, offsets, values, scalars, slow: dict[int, bytes]) -> RawBatch:
        columns: dict[str, list] = {name: [] for name in self.fields}
        pre_bad: dict[int, str] = {}
        for row in range(rows):
            if row in slow:
                parsed = _orjson_values(slow[row], self.fields, pre_bad, row)
            else:
                parsed = [int(scalars[k, row]) if self.scalar[k] else values[k, offsets[k, row]:offsets[k, row + 1]].tolist()
                          for k in range(len(self.fields))]
            for name, value in zip(self.fields, parsed):
                columns[name].append(value)
        return _python_batch(self.path, row0, self.fields, self.scalar_fields, columns, lines[:rows], pre_bad)


def read_jsonl(path: str, fields: list[str], scalar_fields: set[str]) -> Iterator[RawBatch]:
    """Batches of a JSON Lines file (plain, .gz or .zst) through the compiled scanner."""
    with _open_text(path) as f:
        yield from _ScannedBatches(path, f, fields, scalar_fields)


# --- Arrow family --------------------------------------------------------------------------

def arrow_field_names(file: InputFile) -> list[str]:
    path = file.parts[0] if file.parts else file.path
    if file.format == "parquet":
        return pq.ParquetFile(path).schema_arrow.names
    return _open_ipc(path)[1].names


def _open_ipc(path: str):
    source = pa.memory_map(path)
    try:
        reader = pa.ipc.open_file(source)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)], reader.schema
    except pa.ArrowInvalid:
        source.seek(0)
        reader = pa.ipc.open_stream(source)
        return reader, reader.schema


def _select(batch: pa.RecordBatch, fields: list[str]) -> pa.RecordBatch:
    names = [n for n in fields if n in batch.schema.names]
    return batch.select(names)


def _require_fields(path: str, schema: pa.Schema, fields: list[str]) -> None:
    """A columnar file lacking a wanted column is bad as a whole: say so with its fields."""
    for name in fields:
        if name not in schema.names:
            raise DataError(f"{path}: row 0: missing field '{name}' (fields: {', '.join(schema.names) or 'none'})")


def read_parquet(path: str, fields: list[str]) -> Iterator[RawBatch]:
    # Stream pages instead of pre-buffering whole row groups: pyarrow's pre-buffering reads
    # far ahead (hundreds of MB), and an unbuffered read holds a whole column chunk, which in
    # a file with million-row groups is gigabytes. Memory stays bounded by the batch size.
    pf = pq.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_BUFFER)
    _require_fields(path, pf.schema_arrow, fields)
    row0 = 0
    pool = pa.default_memory_pool()
    for k, batch in enumerate(pf.iter_batches(batch_size=BATCH_ROWS, columns=fields), 1):
        yield RawBatch(path, row0, batch)
        row0 += batch.num_rows
        if k % 16 == 0:
            pool.release_unused()  # the allocator otherwise keeps freed decode buffers, file after file
    pool.release_unused()


def read_ipc(path: str, fields: list[str]) -> Iterator[RawBatch]:
    batches, schema = _open_ipc(path)
    _require_fields(path, schema, fields)
    row0 = 0
    for batch in batches:
        for start in range(0, batch.num_rows, BATCH_ROWS):
            piece = batch.slice(start, BATCH_ROWS)
            yield RawBatch(path, row0, _select(piece, fields))
            row0 += piece.num_rows


def read_file(file: InputFile, fields: list[str], scalar_fields: set[str]) -> Iterator[RawBatch]:
    """Raw batches of one input, wrapping every reader failure as a one-line DataError."""
    paths = file.parts or (file.path,)
    for path in paths:
        try:
            if file.format == "jsonl":
                yield from read_jsonl(path, fields, scalar_fields)
            elif file.format == "parquet":
                yield from read_parquet(path, fields)
            else:
                yield from read_ipc(path, fields)
        except DataError:
            raise
        except (pa.ArrowException, OSError, EOFError, ValueError, UnicodeDecodeError, _ZstdError) as exc:
            kind = {"jsonl": "JSON Lines", "parquet": "Parquet", "arrow": "Arrow IPC", "hf": "Arrow IPC"}
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"{path}: cannot read as {kind[file.format]}: {message}") from None

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


def read_jsonl(path: str, fields: list[str], scalar_fields: set[str]) -> Iterator[RawBatch]:
    columns: dict[str, list] = {name: [] for name in fields}
    lines: list[int] = []
    pre_bad: dict[int, str] = {}
    row0 = 0

    def flush() -> RawBatch:
        arrays = [_column(n, columns[n], n in scalar_fields, pre_bad) for n in fields]
        batch = pa.RecordBatch.from_arrays(arrays, names=fields)
        out = RawBatch(path, row0, batch, np.asarray(lines, dtype=np.int64), dict(pre_bad))
        for values in columns.values():
            values.clear()
        lines.clear()
        pre_bad.clear()
        return out

    with _open_text(path) as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
                if not isinstance(record, dict):
                    raise ValueError("the record is not a JSON object")
            except (orjson.JSONDecodeError, ValueError) as exc:
                pre_bad[len(lines)] = f"malformed JSON: {exc}"
                record = {}
            for name in fields:
                columns[name].append(record.get(name))
            lines.append(line_no)
            if len(lines) == BATCH_ROWS:
                batch = flush()
                row0 += batch.batch.num_rows
                yield batch
        if lines:
            yield flush()


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
    pf = pq.ParquetFile(path)
    _require_fields(path, pf.schema_arrow, fields)
    row0 = 0
    for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=fields):
        yield RawBatch(path, row0, batch)
        row0 += batch.num_rows


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

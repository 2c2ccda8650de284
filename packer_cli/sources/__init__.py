"""Sources: read tokenized SFT samples from JSONL, Parquet, Arrow IPC and HF datasets dirs.

::

    INPUT... ──discover_inputs──▶ [InputFile] ──SampleStream──▶ SampleBatch, SampleBatch, ...
                                                  (validated, flat int32 tokens + uint8 targets)

All inputs form one stream; a sample's *source index* is its record position in that stream
(bad or dropped records keep their position, so indices always point back at input rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from packer_cli.errors import DataError, reraise_interrupt
from packer_cli.sources.discover import InputFile, discover_inputs
from packer_cli.sources.normalize import (
    SUPERVISION_FIELDS,
    SampleBatch,
    Supervision,
    detect_attention,
    detect_supervision,
    normalize_batch,
)
from packer_cli.sources.readers import arrow_field_names, jsonl_field_names, read_file, read_jsonl
from packer_cli.spec import SourceSpec

__all__ = ["InputFile", "SampleBatch", "SampleStream", "Supervision", "discover_inputs"]


@dataclass
class Segment:
    """A run of consecutive source indices that came from one file (or datasets part)."""

    path: str
    first_index: int
    first_row: int
    count: int


@dataclass
class SampleStream:
    """Iterates validated samples of all inputs and remembers where each index came from.

    ``arrow_parquet`` reads Parquet inputs with pyarrow's decoder rather than packer's own
    (``verify --source`` does, so that it checks the output with a decoder ``pack`` did not use).
    """

    files: list[InputFile]
    spec: SourceSpec
    arrow_parquet: bool = False
    supervision: Supervision | None = None
    attention: str | None = None  # the padding mask field read, if the first record has one
    padding: int = 0  # tokens dropped as padding so far
    segments: list[Segment] = field(default_factory=list)
    records: int = 0

    def _field_names(self, file: InputFile) -> list[str] | None:
        return jsonl_field_names(file.path) if file.format == "jsonl" else arrow_field_names(file)

    def _first_record_fields(self) -> list[str]:
        """The stream's first record's fields: the first file's schema, or the first JSON Lines
        file holding an object record (a file of malformed lines alone decides nothing)."""
        names: list[str] | None = None
        for file in self.files:
            try:
                names = self._field_names(file)
            except Exception as exc:  # the read below reports it with the file name
                reraise_interrupt(exc)
                names = []
            if names is not None:
                break
        return names or []

    def __iter__(self) -> Iterator[SampleBatch]:
        names = self._first_record_fields()
        self.supervision = sup = detect_supervision(names, self.spec)
        self.attention = attention = detect_attention(names, self.spec, sup)
        fields = [self.spec.tokens_field, *sup.fields] + ([attention] if attention else [])
        scalar = {sup.field} if sup.kind == "answer" else set()
        flags = {*(sup.fields if sup.kind == "mask" else ()), *([attention] if attention else [])}
        # The first record decided that every token is a target, or that no padding is marked; a
        # later record with a supervision field or a padding mask would have it ignored, so it is
        # an error instead.
        looked_for = sup.kind == "all" and not self.spec.all_targets
        absent = tuple(n for n in SUPERVISION_FIELDS if n != self.spec.tokens_field) if looked_for else ()
        unread_mask = self.spec.attention_field
        if attention is None and unread_mask not in (None, self.spec.tokens_field, *sup.fields, *absent):
            absent += (unread_mask,)
        for file in self.files:
            before = self.records
            for raw in read_file(file, fields, scalar, self.arrow_parquet, absent, flags):
                n = raw.batch.num_rows
                last = self.segments[-1] if self.segments else None
                if last and last.path == raw.path and last.first_row + last.count == raw.row0:
                    last.count += n
                else:
                    self.segments.append(Segment(raw.path, self.records, raw.row0, n))
                batch = normalize_batch(
                    raw.batch, path=raw.path, row0=raw.row0, index0=self.records, sup=sup,
                    spec=self.spec, lines=raw.lines, pre_bad=raw.pre_bad, attention=attention,
                )
                self.records += n
                self.padding += batch.padding
                yield batch
            if self.records == before:
                raise DataError(f"{file.path}: empty input (no records)")

    def locate(self, source_index: int) -> str:
        """'path: line L' (JSON Lines) or 'path: row R' for a source index (used in error messages)."""
        for seg in self.segments:
            if seg.first_index <= source_index < seg.first_index + seg.count:
                row = seg.first_row + source_index - seg.first_index
                line = self._jsonl_line(seg.path, row)
                return f"{seg.path}: line {line}" if line is not None else f"{seg.path}: row {row}"
        return f"source index {source_index}"

    def _jsonl_line(self, path: str, row: int) -> int | None:
        """The line holding record ``row`` of a JSON Lines input, as its other errors name it
        (blank lines are not records); the file is read again, which only an error message asks."""
        if not any(f.format == "jsonl" and f.path == path for f in self.files):
            return None
        try:
            for raw in read_jsonl(path, [self.spec.tokens_field], set()):
                if row < raw.row0 + raw.batch.num_rows:
                    return int(raw.lines[row - raw.row0])
        except Exception as exc:  # noqa: BLE001 - the row then names it
            reraise_interrupt(exc)
            return None
        return None

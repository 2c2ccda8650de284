"""``BridgeStore``: a Megatron-Bridge split seen through the audit's store interface.

The audit (``packer inspect`` / ``packer verify``) reads an output through a *store*
(:mod:`packer_cli.audit.store`): ``shard_names()``, ``shard_entries()``, ``expected_files()``
and ``read_shard(name, columns)`` yielding :class:`~packer_cli.audit.store.PackBatch` runs of
native columns. This store gives one split of a Bridge layout that interface, a run of Parquet
row groups per batch, converted by :func:`~packer_cli.shards.bridge_reader.native_columns`, so the
audit's checks run unchanged::

    store = BridgeStore.open("packed/", split="validation")
    for batch in store.read_shard(store.shard_names()[0]):
        batch.row(0)                       # the same PackRow as the native output of the plan

What the pack checks cannot see in native columns is checked here, as ``shard.unreadable``
(a :class:`~packer_cli.audit.store.ShardError` naming the row, that is the pack): the file's
schema (:func:`~packer_cli.shards.bridge_reader.schema_problem`), nulls, per-row lengths and
starts, and, when the token ids are read (verify, not inspect), Bridge's stored padding.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from packer_cli.errors import DataError, first_line
from packer_cli.shards.bridge import (BRIDGE_FORMAT, BRIDGE_FORMAT_VERSION, SPLITS, bridge_metadata_name, data_name,
                                      split_manifest_name, split_metadata_name)
from packer_cli.shards.bridge_reader import (BridgeRowError, file_eos, load_bridge_metadata, native_columns,
                                             pad_id_of, read_row_groups, read_split_manifest, resolve_split,
                                             row_count_problem, schema_problem, stored_columns, unreadable_group)
from packer_cli.shards.reader import footer_name_problem

if TYPE_CHECKING:
    from packer_cli.sources.parquet_lists import RowGroupRuns

#: Tokens decoded per batch, about a native record batch's: whole row groups (Bridge's are small,
#: ~1 MiB, for its shuffled reads), read together so that the decoder keeps both cores busy and
#: the per-batch work is paid once per ~36 groups, not per group.
BATCH_TOKENS = 4 << 20
#: What decoding a damaged file raises (pyarrow's errors; the row layout's own checks)
_UNREADABLE = (OSError, pa.ArrowException, ValueError, IndexError)


class BridgeStore:
    """One split of a Bridge layout: its metadata, manifest and Parquet file."""

    format = BRIDGE_FORMAT
    version = BRIDGE_FORMAT_VERSION  # written and read by this packer (checked again when a split is opened)

    def __init__(self, out: str, metadata: dict, manifest: dict, split: str):
        self.out, self.metadata, self.manifest, self.split = out, metadata, manifest, split

    @classmethod
    def open(cls, out: str, meta: dict | None = None, split: str | None = None) -> "BridgeStore":
        """Open ``split`` of ``out`` (default: training, else the only split)."""
        split = resolve_split(out, split)
        meta = meta if meta is not None else load_bridge_metadata(out, split)
        return cls(out, meta, read_split_manifest(out, split), split)

    @property
    def metadata_name(self) -> str:
        return split_metadata_name(self.split)

    @property
    def manifest_name(self) -> str:
        return split_manifest_name(self.split)

    @property
    def pack_size(self) -> int | None:
        """C as the split's metadata records it (None when unusable: the audit reports that)."""
        spec = self.metadata.get("spec")
        C = spec.get("pack_size") if isinstance(spec, dict) else None
        return C if type(C) is int and C > 0 else None

    def shard_entries(self) -> list[dict]:
        return list(self.manifest["shards"])

    def shard_names(self) -> list[str]:
        return [entry["name"] for entry in self.manifest["shards"]]

    def shard_name(self, index: int) -> str | None:
        """The file the writer lists as entry ``index``: one Parquet file per split."""
        return data_name(self.split, self.pack_size) if self.pack_size else None

    def expected_files(self) -> set[str]:
        """Every file the layout may hold at this split's pack size: both splits' (a split that
        Bridge itself wrote has only its Parquet file) and Bridge's metadata array. A file for
        another pack size is not: Bridge reads both splits with one packed_sequence_size."""
        names = set(self.shard_names())
        if self.pack_size is None:
            return names | {self.metadata_name, self.manifest_name}
        for split in SPLITS:
            names |= {data_name(split, self.pack_size), split_metadata_name(split), split_manifest_name(split)}
        return names | {bridge_metadata_name(self.pack_size)}

    def _pad_id(self, name: str) -> int:
        from packer_cli.audit.store import ShardError

        try:
            return pad_id_of(self.metadata)
        except DataError as exc:
            raise ShardError(name, str(exc)) from None

    def _batches(self, pf) -> list[tuple[int, int, int]]:
        """``(first group, end group, first row)`` of each batch: consecutive row groups of about
        :data:`BATCH_TOKENS` tokens (by rows times the pack size)."""
        target = max(1, BATCH_TOKENS // (self.pack_size or 4096))
        meta, batches = pf.metadata, []
        first = row = rows = 0
        for g in range(meta.num_row_groups):
            rows += meta.row_group(g).num_rows
            if rows >= target or g == meta.num_row_groups - 1:
                batches.append((first, g + 1, row))
                first, row, rows = g + 1, row + rows, 0
        return batches

    def _path(self, name: str) -> str:
        return os.path.join(self.out, name)

    def _open(self, name: str):
        """The split's Parquet file, its schema checked (:func:`schema_problem`)."""
        from packer_cli.audit.store import ShardError

        try:
            pf = pq.ParquetFile(self._path(name), memory_map=False)
        except FileNotFoundError:
            raise ShardError(name, "missing") from None
        except (OSError, pa.ArrowException) as exc:
            raise ShardError(name, f"cannot open as Parquet ({first_line(exc)})") from None
        except UnicodeDecodeError as exc:
            raise ShardError(name, f"cannot open as Parquet ({footer_name_problem(exc)})") from None
        problem = schema_problem(pf.schema_arrow, self.metadata, self.metadata_name) or row_count_problem(pf)
        if problem:
            raise ShardError(name, problem)
        return pf

    def _read_run(self, name: str, pf, first: int, end: int, row: int, convert, tokens: bool = True,
                  runs: RowGroupRuns | None = None, then: tuple[int, int] | None = None):
        """Row groups ``first..end-1`` (starting at row ``row``) decoded as one native batch by
        ``convert`` (:func:`native_columns` with its settings); raises one of :data:`_UNREADABLE`
        on a damaged file. ``runs`` decodes them when given (see :func:`_row_groups`), and then
        starts on the groups ``then`` (the next run) while these are converted.

        Without ``tokens`` the ids are not decoded (``inspect``); a caller that asks for
        ``tokens`` or ``last_token`` all the same (one pack's detail) has the run read again
        with them."""
        from packer_cli.audit.store import PackBatch

        table = _row_groups(self._path(name), pf, runs, first, end, stored_columns(tokens))
        if runs is not None and then is not None:
            runs.read_ahead(*then, stored_columns(tokens))
        native = convert(table, tokens=tokens)
        if tokens:
            return PackBatch(name, row, table.num_rows, native.__getitem__)

        def load(column: str):
            if column not in native:
                native.update(self._with_tokens(name, pf, first, end, row, convert))
            return native[column]

        return PackBatch(name, row, table.num_rows, load)

    def _with_tokens(self, name: str, pf, first: int, end: int, row: int, convert) -> dict:
        """The native columns of a run read without its ids, read again with them."""
        from packer_cli.audit.store import ShardError

        try:
            return convert(read_row_groups(self._path(name), pf, range(first, end), stored_columns()))
        except BridgeRowError as bad:
            raise ShardError(name, bad.reason, row=row + bad.row) from None
        except _UNREADABLE as exc:
            raise ShardError(name, f"row groups {first}-{end - 1} are unreadable ({first_line(exc)})",
                             row=row) from None

    def _one_group_at_a_time(self, name: str, pf, first: int, end: int, row: int, convert, exc: Exception,
                             tokens: bool = True):
        """A run that failed to decode, again group by group: the groups before the damaged one
        as batches, then the ShardError naming it (the error path only: good runs are read whole)."""
        from packer_cli.audit.store import ShardError

        for g in range(first, end):
            try:
                batch = self._read_run(name, pf, g, g + 1, row, convert, tokens)
            except BridgeRowError as bad:  # the rows before it, then the ShardError naming it
                yield from self._rows_before(name, pf.read_row_group(g, columns=stored_columns(tokens)), row,
                                             partial(convert, tokens=tokens), bad)  # its pages just checked
            except _UNREADABLE as alone:
                raise ShardError(name, f"row group {g} is unreadable ({unreadable_group(alone)})", row=row) from None
            yield batch
            row += batch.num_rows
        raise ShardError(name, f"row groups {first}-{end - 1} are unreadable together ({first_line(exc)})", row=row)

    @staticmethod
    def _rows_before(name: str, table: pa.Table, row: int, convert, bad: BridgeRowError):
        """The rows of a group (``table``, at row ``row``) before its first bad one as a batch,
        then the ShardError naming that row (so the packs before it are checked too)."""
        from packer_cli.audit.store import PackBatch, ShardError

        while bad.row > 0:
            try:
                columns = convert(table.slice(0, bad.row))
            except BridgeRowError as earlier:  # a row before it fails a check made later
                bad = earlier
                continue
            def load(column: str, columns=columns, bad=bad):
                if column not in columns:  # the ids, asked of rows read without them: the group is damaged
                    raise ShardError(name, bad.reason, row=row + bad.row)
                return columns[column]

            yield PackBatch(name, row, bad.row, load)
            break
        raise ShardError(name, bad.reason, row=row + bad.row)

    def _converter(self, name: str, pf, check_padding: bool):
        return partial(native_columns, pad_id=self._pad_id(name), check_padding=check_padding,
                       eos=file_eos(pf.schema_arrow), compiled=True)

    def read_shard(self, name: str, columns=None) -> Iterator:
        """Runs of row groups of the split's Parquet file as native :class:`PackBatch` runs.

        The token ids are decoded, and the stored padding checked, when ``columns`` (all by
        default) include ``tokens`` or ``last_token``; otherwise (``inspect``) the ids are not
        read at all, as a native output's are not."""
        tokens = columns is None or bool({"tokens", "last_token"} & set(columns))
        return self._read(name, check_padding=tokens, tokens=tokens)

    def _read(self, name: str, check_padding: bool, tokens: bool = True) -> Iterator:
        pf = self._open(name)
        convert = self._converter(name, pf, check_padding)
        with _runs_of(self.out, name, pf) as runs:
            batches = self._batches(pf)
            for k, (first, end, row) in enumerate(batches):
                then = batches[k + 1][:2] if k + 1 < len(batches) else None
                try:
                    batch = self._read_run(name, pf, first, end, row, convert, tokens, runs, then)
                except _UNREADABLE as exc:
                    yield from self._one_group_at_a_time(name, pf, first, end, row, convert, exc, tokens)
                    return  # (not reached: the damaged group raises)
                yield batch

    def batch_at(self, name: str, first_row: int):
        """The batch of ``name`` that starts at row ``first_row`` (as :meth:`read_shard` cut
        it), decoded alone; one cut out of a damaged run (a row group, or the rows before a bad
        row) is found by reading the file again up to it."""
        from packer_cli.audit.store import ShardError

        try:
            pf = self._open(name)
            convert = self._converter(name, pf, check_padding=False)  # checked as it was first read
            for first, end, row in self._batches(pf):
                if row == first_row:
                    return self._read_run(name, pf, first, end, row, convert)
        except BridgeRowError:
            pass
        except _UNREADABLE as exc:
            raise ShardError(name, f"cannot be read again ({exc})") from None
        try:
            for batch in self._read(name, check_padding=False):
                if batch.first_row == first_row:
                    return batch
        except ShardError as exc:
            raise ShardError(name, f"cannot be read again ({exc.reason})", row=exc.row) from None
        raise ShardError(name, f"no batch starts at row {first_row}")


def _runs_of(out: str, name: str, pf):
    """The compiled decoder of the split's file (:class:`RowGroupRuns`), or a stand-in for none
    where it cannot open the file (pyarrow, which could, reads it then). Imported here: the
    decoder's kernels load numba, which readers of native shards (the torch side) never need."""
    from packer_cli.sources.parquet_lists import RowGroupRuns

    try:
        return RowGroupRuns(os.path.join(out, name), pf)
    except OSError:
        return nullcontext()


def _row_groups(path: str, pf, runs: RowGroupRuns | None, first: int, end: int, columns: list[str]) -> pa.Table:
    """Row groups ``first..end-1`` of ``columns``: decoded by packer's compiled decoder (``runs``),
    2-3 times faster than pyarrow on Bridge's small row groups, where it reads the file; else by
    pyarrow. A run the compiled decoder finds damaged is read by pyarrow too, whose error (or
    reading: it is the reference) decides, so the audit's findings do not depend on the decoder.
    pyarrow is given a run only once its page headers hold the values its footer states
    (:func:`~packer_cli.shards.bridge_reader.read_row_groups`): it decodes whatever they hold."""
    if runs is not None:
        try:
            batch = runs.read(first, end, columns)
        except ValueError:
            batch = None
        if batch is not None:
            return pa.Table.from_batches([batch])
    return read_row_groups(path, pf, range(first, end), columns)

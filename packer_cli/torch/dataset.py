"""``PackedDataset``: a map-style torch dataset over packer's output directory.

One item is one stored pack, returned as a CPU :class:`~packer_cli.torch.batch.THDBatch`.
The shards are Arrow IPC files read through memory maps by
``packer_cli.shards.reader.PackedReader``; nothing is loaded up front, so opening a
dataset of any size is instant and DataLoader workers share the page cache.

    >>> ds = PackedDataset("out/")              # doctest: +SKIP
    >>> len(ds), ds[0].cu_seqlens_padded         # doctest: +SKIP

The reader is opened lazily in each process (and dropped when pickled), so the dataset
works with fork and spawn DataLoader workers alike. The first open runs verify's layout checks
(no shard content read) and refuses a damaged output with a :class:`~packer_cli.errors.DataError`;
a worker re-opening the unpickled dataset skips them. A damaged row (bad offsets, lengths)
is a DataError naming its shard file and row.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
from torch.utils.data import Dataset

from packer_cli.errors import DataError, counted, first_line
from packer_cli.torch._ints import flag, integer
from packer_cli.torch.batch import THDBatch
from packer_cli.torch.build import build_thd_batch, concat_batches, static_shape


def _open_reader(out_dir: str, check: bool = True, split: str | None = None) -> Any:
    try:
        from packer_cli.shards.reader import PackedReader
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(f"cannot read packed shards: packer_cli.shards.reader is unavailable ({exc})") from exc
    return PackedReader(out_dir, split, check=check)


def _identity_of(reader: Any) -> tuple:
    """What tells one output from another: its metadata and manifest (every shard's xxh3_64).
    A worker process re-opens the dataset by path and compares, so an output replaced after
    the parent opened it is an error, not other data served under the same indices."""
    return getattr(reader, "metadata", None), getattr(reader, "manifest", None)


def _fingerprint(reader: Any) -> str | None:
    """xxh3_64 of the output's manifest, which names its files with their sizes, rows and own
    xxh3_64: what a loader's state records, so that it resumes only on the same packs. Not the
    metadata, which records where the inputs were read (the same input staged elsewhere and
    packed again gives the same files). None for a reader-like object without a manifest."""
    import orjson
    import xxhash

    manifest = getattr(reader, "manifest", None)
    if manifest is None:
        return None
    try:
        text = orjson.dumps(manifest, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        return None
    return xxhash.xxh3_64_hexdigest(text)


#: Bridge's static-shape keys and how its loader combines them across the splits' entries.
_STATIC_KEYS = {"max_samples_per_bin": max, "dataset_max_seqlen": max, "min_packed_seqlen": min}


def _static_keys_across_splits(out_dir: str, meta: dict) -> dict:
    """``meta`` with its ``bridge`` static-shape keys taken across every split of a Bridge layout.

    Bridge sizes its static batches from all entries of ``{C}_metadata.jsonl`` (the largest
    ``max_samples_per_bin`` and ``dataset_max_seqlen``, the smallest ``min_packed_seqlen``), so
    the training and validation splits get the same shapes and a CUDA graph captured on one
    replays on the other. The same values here: packer's metadata of every split present,
    plus the file's entries where it is readable (it may hold other writers' entries, which
    Bridge counts too). A native output has one split and is returned unchanged.
    """
    from packer_cli.shards.bridge import bridge_metadata_name, is_bridge_dir, split_metadata_name, splits_in
    from packer_cli.shards.bridge_reader import load_bridge_metadata
    from packer_cli.shards.format import read_json_value

    if not is_bridge_dir(out_dir):
        return meta
    entries = []
    for split in splits_in(out_dir):  # another split's values size this one's batches too
        entry = load_bridge_metadata(out_dir, split).get("bridge") or {}
        _check_static_keys(entry, meta["spec"]["pack_size"], f"{os.path.join(out_dir, split_metadata_name(split))}: bridge")
        entries.append(entry)
    listed_path = os.path.join(out_dir, bridge_metadata_name(meta["spec"]["pack_size"]))
    try:
        listed = read_json_value(listed_path)
    except (OSError, ValueError, KeyError, TypeError):  # verify reports it; packer's own entries suffice
        listed = []
    listed = [e for e in listed if isinstance(e, dict)] if isinstance(listed, list) else []
    for k, entry in enumerate(listed):  # the file has no checksum: another writer's, or edited
        _check_static_keys(entry, meta["spec"]["pack_size"], f"{listed_path}: entry {k}", empty_split=True)
    entries += listed
    bridge = dict(meta.get("bridge") or {})
    for key, pick in _STATIC_KEYS.items():
        values = [e[key] for e in entries if type(e.get(key)) is int]
        if bridge.get(key) is not None and values:
            bridge[key] = pick([bridge[key], *values])
    return {**meta, "bridge": bridge}


def _metadata_file(reader: Any, layout_dir: Any) -> str:
    """The file ``reader``'s metadata came from, to name in a message."""
    from packer_cli.shards.bridge import split_metadata_name

    if not isinstance(layout_dir, str):
        return "the output's metadata"
    split = getattr(reader, "split", None)
    return os.path.join(layout_dir, split_metadata_name(split) if isinstance(split, str) else "metadata.json")


def _check_static_keys(bridge: dict, pack_size: Any, where: str, empty_split: bool = False) -> None:
    """Refuse a static-shape key no pack of ``pack_size`` tokens can have: each sizes every
    static batch (``max_samples_per_bin`` = 2**27 made a pack's boundaries 134M entries, 2.3 GB;
    2**40 a ``MemoryError``). A pack holds 1 to ``pack_size`` sequences of 1 to ``pack_size``
    tokens. ``empty_split``: an entry another writer made for a split without packs, all 0s
    (Bridge takes the largest value across entries, so a 0 changes no shape)."""
    if type(pack_size) is not int or pack_size < 1:
        return  # static_shape refuses it
    for key in _STATIC_KEYS:
        value = bridge.get(key)
        if value is None:
            continue
        low = 0 if key == "min_packed_seqlen" or empty_split else 1
        if type(value) is not int or not low <= value <= pack_size:
            raise DataError(f"{where}: {key} = {value!r} is impossible for packs of {pack_size} tokens "
                            f"({low} to {pack_size}): a damaged or edited entry; verify names what else differs")


def _per_pack(lengths: np.ndarray, starts: np.ndarray, capacity: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per pack ``Σ s`` and ``Σ s²`` of the sequence ``lengths``, pack ``i`` being
    ``lengths[starts[i]:starts[i + 1]]``; 0 and 0 for a pack with an impossible length."""
    impossible = (lengths < 1) if capacity is None else (lengths < 1) | (lengths > capacity)
    sound = np.where(impossible, 0, lengths)  # and no overflow squaring a damaged length
    sums = []
    for per_sequence in (sound, sound * sound, impossible.astype(np.int64)):
        running = np.concatenate(([0], np.cumsum(per_sequence)))
        sums.append(running[starts[1:]] - running[starts[:-1]])
    tokens, squares, bad = sums
    damaged = (bad > 0) if capacity is None else (bad > 0) | (tokens > capacity)
    return np.where(damaged, 0, tokens), np.where(damaged, 0, squares)


class PackedDataset(Dataset):
    """Map-style dataset: ``len`` = number of packs, ``ds[i]`` = THDBatch of pack ``i``.

    Args:
        source: the output directory written by ``packer pack``, or an already open
            reader-like object (``.metadata``, ``len()``, ``.row(i)``).
        split: of a Megatron-Bridge layout, ``"training"`` (the default) or ``"validation"``.
            Given with the directory (not as an open reader), the dataset pickles as a path
            and split, so it works with spawn and forkserver DataLoader workers too.
        static: CUDA-graph shapes (fixed ``T``, boundary length and ``max_seqlen``).
            ``None`` follows the data's ``spec.pad_cu_seqlens``. Checked at construction:
            a clear :class:`~packer_cli.torch.build.StaticShapeError` when the data was not
            padded to ``pack_size`` or the metadata lacks Bridge's keys.
    """

    def __init__(self, source: str | os.PathLike | Any, *, static: bool | None = None,
                 split: str | None = None) -> None:
        self.split = split
        self._identity: tuple | None = None
        if isinstance(source, (str, os.PathLike)):
            # Absolute: a spawned worker resolves the path after the parent may have changed directory.
            self.out_dir: str | None = os.path.abspath(os.fspath(source))
            self._reader: Any = None
            self._checked = False  # verify's layout checks run once, at the first open
        else:
            if split is not None:
                raise ValueError("split= goes with an output directory; an open reader already has its split")
            self.out_dir = None
            self._reader = source
            self._checked = True
        meta = self.reader.metadata
        spec = meta.get("spec", {})
        static = flag(static, "static", none=True)  # static="false" was True
        self.static = bool(spec.get("pad_cu_seqlens", False)) if static is None else static
        layout_dir = self.out_dir or getattr(self.reader, "out_dir", None)  # an open reader knows its own
        if self.static:
            where = _metadata_file(self.reader, layout_dir)
            _check_static_keys(meta.get("bridge") or {}, spec.get("pack_size"), f"{where}: bridge")
        if self.static and isinstance(layout_dir, str):
            meta = _static_keys_across_splits(layout_dir, meta)
        self.metadata: dict = meta
        if self.static:
            static_shape(meta)  # raises early with a clear message
        self._len = len(self.reader)
        self.fingerprint: str | None = _fingerprint(self.reader)

    # -- reader lifecycle: open per process, never pickle a memory map ---------------
    @property
    def reader(self) -> Any:
        if self._reader is None:
            reader = _open_reader(self.out_dir, check=not self._checked, split=self.split)  # type: ignore[arg-type]
            identity = _identity_of(reader)
            if self._identity is not None and identity != self._identity:
                raise DataError(f"{self.out_dir}: the output changed after the dataset was opened (replaced by "
                                "another run?); a worker re-opening it would read other packs: open it again")
            self._reader, self._identity, self._checked = reader, identity, True
        return self._reader

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self.out_dir is not None:
            state["_reader"] = None
        return state

    # -- map-style protocol ----------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> THDBatch:
        asked, index = index, integer(index)
        if index is None:
            raise TypeError(f"pack index must be an integer, got {type(asked).__name__}")
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"pack index {asked} out of range for {counted(self._len, 'pack')}")
        reader = self.reader
        row = reader.row(index)
        try:
            return build_thd_batch(row, self.metadata, static=self.static)
        except (ValueError, IndexError) as exc:  # a damaged row (a flipped offset or length)
            where = reader.locate(index) if hasattr(reader, "locate") else f"pack {index}"
            raise DataError(f"{where} (pack {index}): {exc}; run `packer verify` for a full report") from None

    def micro_batch(self, indices: Sequence[int], cp_size: int = 1, cp_rank: int = 0) -> THDBatch:
        """The THD row of packs ``indices`` (concatenated), sliced for one CP rank.

        This is the whole host-side job of a DataLoader worker: read, build, concatenate,
        slice, so only ``T / cp_size`` tokens per pack cross to the GPU.
        """
        if len(indices) == 0:
            raise ValueError("a micro-batch needs at least one pack index")
        batch = concat_batches([self[i] for i in indices])
        return batch.for_cp_rank(cp_size, cp_rank)

    def pack_statistics(self) -> tuple[np.ndarray, np.ndarray]:
        """``(num_real_tokens, seqlen_sq_sum)`` of every pack: two int64 arrays of ``len(self)``
        holding what each pack's :class:`THDBatch` reports, read from the sequence lengths alone
        (what a balancing :class:`~packer_cli.torch.THDLoader` weighs packs by). A pack whose
        lengths are impossible (a length below 1, or more tokens than ``pack_size``: a damaged
        pack, which building refuses) counts 0 and 0.

        An output directory is read one record batch at a time, its ``seq_lens`` column only
        (5–10 ms for 30,000 packs); a Bridge split is decoded without its token ids, a run of
        row groups at a time (0.1–0.2 s). An open reader is read pack by pack."""
        capacity = self.metadata.get("spec", {}).get("pack_size")
        capacity = capacity if integer(capacity) is not None else None
        if self.out_dir is None:
            rows = [np.asarray(self.reader.row(i).seq_lens, dtype=np.int64) for i in range(self._len)]
            starts = np.concatenate(([0], np.cumsum([r.size for r in rows], dtype=np.int64)))
            lengths = np.concatenate(rows) if rows else np.zeros(0, np.int64)
            return _per_pack(lengths, starts, capacity)
        from packer_cli.audit.store import open_store  # the audit side: only a balancing loader needs it

        parts: list[tuple[np.ndarray, np.ndarray]] = []
        try:
            store = open_store(self.out_dir, self.split)
            if store.manifest != getattr(self.reader, "manifest", store.manifest):
                raise DataError("the output changed after the dataset was opened (replaced by another run?): "
                                "open it again")
            for name in store.shard_names():
                for batch in store.read_shard(name, columns=("seq_lens",)):
                    values, offsets = batch.column("seq_lens")
                    parts.append(_per_pack(values[offsets[0]:offsets[-1]].astype(np.int64), offsets - offsets[0],
                                           capacity))
        except DataError as exc:  # a shard error names the file only
            raise DataError(f"{self.out_dir}: {first_line(exc)}; run `packer verify` for a full report") from None
        empty = np.zeros(0, np.int64)
        tokens = np.concatenate([empty] + [t for t, _ in parts])
        squares = np.concatenate([empty] + [q for _, q in parts])
        if tokens.size != self._len:  # the layout checks compared the counts; a race would not
            raise DataError(f"{self.out_dir}: its shards hold {counted(tokens.size, 'pack')}, the dataset "
                            f"{counted(self._len, 'pack')}: the output changed after the dataset was opened")
        return tokens, squares

    @property
    def pad_multiple(self) -> int | None:
        """The per-sequence padding multiple the data was packed with, if recorded."""
        spec = self.metadata.get("spec", {})
        value = spec.get("pad_seq_to_mult")
        return int(value) if value is not None else None

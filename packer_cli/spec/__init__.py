"""The packing spec: capacity, parallel layout, algorithm and policies, validated in one place.

The spec is a frozen dataclass; :meth:`PackSpec.validate` raises :class:`ConfigError` with a
message that names the fix, and :meth:`PackSpec.as_dict` is the JSON record written into every
output's metadata.

The per-sequence alignment ``m`` follows Megatron-Bridge's rule so that context-parallel (CP)
and sequence-parallel (SP) THD training can slice every sequence::

    cp_multiple = 2*CP if CP > 1 else 1          # TE splits each sequence into 2*CP chunks
    sp_multiple = CP*TP if SP and TP > 1 else 1  # SP scatters each CP rank's tokens over TP
    m = lcm(cp_multiple, sp_multiple)

>>> PackSpec(pack_size=4096, cp=2, tp=4, sp=True).pad_multiple
8
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from enum import Enum

from packer_cli.errors import ConfigError, is_utf8
from packer_cli.plan._config import MAX_CAPACITY

#: The largest ``window``: an int64, as the metadata and the checks keep it.
MAX_WINDOW = 2**63 - 1


class Algorithm(str, Enum):
    """How sequences are assigned to packs. All are global over the whole input."""

    FFD = "ffd"
    """First-fit decreasing (default): longest first, each into the first pack with room."""
    BFD = "bfd"
    """Best-fit decreasing: longest first, each into the fullest pack it still fits."""
    FIRST_FIT_SHUFFLE = "first-fit-shuffle"
    """Megatron-Bridge's default: first-fit over a seeded shuffle, Bridge's RNG call order."""
    SEQUENTIAL = "sequential"
    """Order-preserving next-fit, for curricula: packs follow the input order (pack with
    ``shuffle=False``; the default shuffles the packs after planning, as for every algorithm)."""


class OverlongPolicy(str, Enum):
    """What happens to a sequence whose padded runtime length exceeds the pack size."""

    TRUNCATE = "truncate"
    """Keep the first largest-multiple-of-m runtime positions that fit (default)."""
    DROP = "drop"
    """Leave the sample out (counted)."""
    SPLIT = "split"
    """Cut into consecutive pieces, each packed as its own sequence with positions restarting."""
    ERROR = "error"
    """Stop with an error naming the sample."""


class SpillRead(str, Enum):
    """How ``pack``'s pass two reads the spill back (an I/O choice: the output is the same)."""

    AUTO = "auto"
    """Staged when the spill exceeds the page cache this process can count on (default)."""
    RANDOM = "random"
    """A read per sequence, in output order: fast while the page cache holds the spill."""
    STAGED = "staged"
    """Copied into stages in one sequential pass first, each stage then read whole."""


class BadRecordPolicy(str, Enum):
    """What a malformed record does."""

    ERROR = "error"
    """Stop with a one-line error naming the file and record (default)."""
    SKIP = "skip"
    """Skip it, count it and list it in the metadata."""


def _as_enum(enum: type[Enum], name: str, value):
    """``value`` as a member of ``enum``: the enums are ``str`` subclasses, so ``"bfd"`` is a
    natural thing for an API caller to pass, and it means ``Algorithm.BFD``."""
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(member.value for member in enum)
        raise ConfigError(f"{name.replace('_', '-')} must be one of {choices}, got {value!r}") from None


def is_int(value) -> bool:
    """An integer (Python's or NumPy's) that is not a bool (``True`` is an ``int`` to Python,
    never to a spec)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_bool(value) -> bool:
    """True or False, Python's or NumPy's (never a string such as ``"false"``, which is truthy)."""
    kind = type(value)  # NumPy's bool by name: the CLI loads numpy only after setting its thread count
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def _check_types(spec, ints: tuple[str, ...], bools: tuple[str, ...], optional_ints: tuple[str, ...] = ()) -> None:
    """Raise :class:`ConfigError` for a field of the wrong type: a float, a string or a bool
    where an int belongs would otherwise reach the planner or be recorded as it is, and a
    non-empty string such as ``"false"`` would switch a flag on."""
    for name in ints + optional_ints:
        value = getattr(spec, name)
        if not is_int(value) and not (value is None and name in optional_ints):
            raise ConfigError(f"{name.replace('_', '-')} must be an integer, got {value!r}")
        if value is not None:
            object.__setattr__(spec, name, int(value))  # a NumPy integer is recorded as a JSON number
    for name in bools:
        value = getattr(spec, name)
        if not is_bool(value):
            raise ConfigError(f"{name.replace('_', '-')} must be True or False, got {value!r}")
        object.__setattr__(spec, name, bool(value))


def bridge_pack_size_problem(spec: "PackSpec") -> str | None:
    """Why Megatron-Bridge's layout cannot take ``spec``'s pack size, or None. Bridge pads a row
    to the pack size (every row with ``pad_to_max_length``, which offline-packed SFT data takes
    from ``dataset_kwargs``; otherwise its collate caps a row at the pack size), so under
    sequence parallelism the pack size must be a multiple of CP·TP too, not only of the 2·CP
    every output needs: else such a row reaches TP's sequence split unsplittable, at whatever
    step it comes up."""
    step = spec.layout_multiple
    if spec.pack_size % step == 0 or step == (2 * spec.cp if spec.cp > 1 else 1):
        return None  # the 2*CP rule says it, for every output
    return (f"pack-size {spec.pack_size} must be a multiple of {step} (the alignment CP={spec.cp}, TP={spec.tp}, "
            f"SP=on requires) for Megatron-Bridge's layout: Bridge pads rows to the pack size (with "
            f"pad_to_max_length, and caps them at it otherwise), which the sequence-parallel split cannot divide")


def _size_advice(size: int, step: int) -> str:
    """What to use instead of pack size ``size``: the multiples of ``step`` either side of it
    that are pack sizes ("use --pack-size 2044 or 2048"), or that there is none."""
    below, above = size // step * step, (size // step + 1) * step
    sizes = [n for n in (below, above) if 0 < n <= MAX_CAPACITY]
    if not sizes:
        return f"no pack size up to {MAX_CAPACITY:,} is a multiple of {step:,}: use a smaller CP or TP"
    return f"use --pack-size {' or '.join(map(str, sizes))}"


def pad_multiple_for(cp: int, tp: int, sp: bool) -> int:
    """The smallest per-sequence alignment for this parallel layout (Bridge's rule)."""
    cp_multiple = 2 * cp if cp > 1 else 1
    sp_multiple = cp * tp if sp and tp > 1 else 1
    return math.lcm(cp_multiple, sp_multiple)


@dataclass(frozen=True, kw_only=True)
class PackSpec:
    """Everything that decides which sequences land in which pack, and how they are laid out."""

    pack_size: int
    """Capacity C of a pack in padded runtime tokens (Σ p_i ≤ C)."""
    cp: int = 1
    """Context-parallel size the data is prepared for."""
    tp: int = 1
    """Tensor-parallel size (matters only with sequence parallelism)."""
    sp: bool = False
    """Sequence parallelism on: each CP rank's tokens are scattered over TP ranks."""
    pad_seq_to_mult: int | None = None
    """Override of the alignment m; must be a multiple of the layout's own multiple."""
    algorithm: Algorithm = Algorithm.FFD
    """Assignment algorithm."""
    seed: int = 0
    """Seed for the pack-order shuffle (and for first-fit-shuffle)."""
    shuffle: bool = True
    """Shuffle packs after planning so length-sorted order never reaches training."""
    overlong: OverlongPolicy = OverlongPolicy.TRUNCATE
    """Policy for sequences longer than the pack size."""
    pad_to_max_length: bool = False
    """Every pack is read back padded at its tail to exactly C (CUDA graphs, fixed-width kernels)."""
    pad_cu_seqlens: bool = False
    """Record what a static-shape loader needs; requires pad_to_max_length."""
    pad_id: int = 0
    """Token id written into alignment padding."""
    refine: bool = True
    """After ffd/bfd, re-fill the non-full packs toward the Martello–Toth L2 bound (never more
    packs; ignored by the order-defined first-fit-shuffle and sequential algorithms)."""
    window: int | None = None
    """ffd/bfd only: plan each run of this many input records on its own (records numbered as
    source indices, bad and dropped ones included; a split sample's pieces stay in its window).
    No pack mixes windows and packs are numbered window by window, so with ``shuffle=False``
    they follow the input order at window granularity: an order-preserving mode for curricula
    that packs far tighter than ``sequential``. None: one global plan (the default)."""

    def __post_init__(self):
        object.__setattr__(self, "algorithm", _as_enum(Algorithm, "algorithm", self.algorithm))
        object.__setattr__(self, "overlong", _as_enum(OverlongPolicy, "overlong", self.overlong))

    @property
    def refines(self) -> bool:
        """Whether the improvement pass actually runs for this algorithm."""
        return self.refine and self.algorithm in (Algorithm.FFD, Algorithm.BFD)

    @property
    def layout_multiple(self) -> int:
        """The alignment the parallel layout requires."""
        return pad_multiple_for(self.cp, self.tp, self.sp)

    @property
    def pad_multiple(self) -> int:
        """The alignment m every sequence's runtime length is padded to."""
        return self.pad_seq_to_mult or self.layout_multiple

    @property
    def max_sequence_length(self) -> int:
        """Largest runtime length a single sequence may keep: the largest multiple of m ≤ C."""
        return (self.pack_size // self.pad_multiple) * self.pad_multiple

    def validate(self, *, for_bridge: bool = False) -> "PackSpec":
        """Raise :class:`ConfigError` naming the fix when the spec cannot work (``for_bridge``:
        for Megatron-Bridge's layout, whose rows need more of the pack size: see
        :func:`bridge_pack_size_problem`)."""
        _check_types(self, ints=("pack_size", "cp", "tp", "seed", "pad_id"),
                     bools=("sp", "shuffle", "pad_to_max_length", "pad_cu_seqlens", "refine"),
                     optional_ints=("pad_seq_to_mult", "window"))
        for name in ("pack_size", "cp", "tp"):
            value = getattr(self, name)
            if value < 1:  # an int: _check_types saw to that
                raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.pack_size > MAX_CAPACITY:
            raise ConfigError(f"pack-size {self.pack_size:,} is above the largest supported, {MAX_CAPACITY:,} "
                              "tokens (the planners keep tables with one entry per token of capacity)")
        # 2*CP and CP*TP must divide a pack: above these no pack size works (and a TP of 2**64
        # failed only when the finished run's metadata was written)
        for name, largest in (("cp", MAX_CAPACITY // 2), ("tp", MAX_CAPACITY)):
            if getattr(self, name) > largest:
                raise ConfigError(f"{name} {getattr(self, name):,} is above the largest supported, {largest:,}")
        required = self.layout_multiple
        if self.pad_seq_to_mult is not None:
            if self.pad_seq_to_mult < 1 or self.pad_seq_to_mult % required:
                raise ConfigError(
                    f"pad-seq-to-mult {self.pad_seq_to_mult} must be a positive multiple of {required}, "
                    f"the alignment required by CP={self.cp}, TP={self.tp}, SP={'on' if self.sp else 'off'}"
                )
        if for_bridge and (problem := bridge_pack_size_problem(self)):  # its step is a multiple of 2*CP
            raise ConfigError(f"{problem}; {_size_advice(self.pack_size, self.layout_multiple)}")
        if self.cp > 1 and self.pack_size % (2 * self.cp):
            step = 2 * self.cp
            raise ConfigError(
                f"pack-size {self.pack_size} must be divisible by 2*CP = {step} with context "
                f"parallelism; {_size_advice(self.pack_size, step)}"
            )
        if self.max_sequence_length < 1:
            raise ConfigError(
                f"pack-size {self.pack_size} is smaller than the sequence alignment {self.pad_multiple}"
            )
        if self.pad_to_max_length and self.pack_size % self.pad_multiple:
            raise ConfigError(
                f"--pad-to-max-length needs pack-size {self.pack_size} to be a multiple of the "
                f"alignment {self.pad_multiple}, so the tail segment is itself aligned"
            )
        if self.pad_cu_seqlens and not self.pad_to_max_length:
            raise ConfigError("--pad-cu-seqlens requires --pad-to-max-length (as in Megatron-Bridge)")
        if self.window is not None:
            if self.window < 1:
                raise ConfigError(f"window must be a positive number of records, got {self.window}")
            # the metadata and the checks keep it as an int64 (one of 2**64 failed only when the
            # finished run's metadata was written, one of 2**63 in verify)
            if self.window > MAX_WINDOW:
                raise ConfigError(f"window {self.window:,} is above the largest supported, {MAX_WINDOW:,} records "
                                  "(a window of at least the input's number of records is one window)")
            if self.algorithm not in (Algorithm.FFD, Algorithm.BFD):
                raise ConfigError(f"--window applies to ffd and bfd, not {self.algorithm.value}"
                                  + (" (which keeps the input order itself)" if self.algorithm is Algorithm.SEQUENTIAL
                                     else ""))
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be in [0, 2**32), got {self.seed}")
        if not 0 <= self.pad_id < 2**31:
            raise ConfigError(f"pad-id must be a non-negative int32, got {self.pad_id}")
        return self

    def as_dict(self) -> dict:
        """JSON-safe record of the spec, with the derived alignment."""
        record = asdict(self)
        record.update(
            algorithm=self.algorithm.value,
            overlong=self.overlong.value,
            pad_seq_to_mult=self.pad_multiple,
            pad_seq_to_mult_override=self.pad_seq_to_mult is not None,
        )
        if self.window is None:  # recorded only when set: a global plan's metadata is as it always was
            del record["window"]
        return record

    @classmethod
    def from_dict(cls, record: dict) -> "PackSpec":
        """Inverse of :meth:`as_dict` (used when reading an output back; the enums' string values
        become the enums in ``__post_init__``)."""
        names = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in record.items() if k in names}
        if not record.get("pad_seq_to_mult_override", False):
            kwargs["pad_seq_to_mult"] = None
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """How records are read: which fields hold the tokens and the supervision."""

    tokens_field: str = "input_ids"
    """List of token ids."""
    mask_field: str | None = None
    """Force an input-aligned loss mask field (1 = token is a training target)."""
    also_mask_fields: tuple[str, ...] = ()
    """Further 0/1 mask fields applied with ``mask_field``: a token is a target only where every
    mask is 1 (as TRL applies ``completion_mask`` and ``assistant_masks`` together)."""
    labels_field: str | None = None
    """Force an HF-style labels field (unshifted, -100 = ignored)."""
    all_targets: bool = False
    """Every token is a target: no supervision field is detected (``verify --source`` replays an
    output recorded so, whatever fields a later packer would detect in its records)."""
    attention_field: str | None = "attention_mask"
    """A 0/1 field marking each sample's real tokens (HF's ``attention_mask``), read when the
    stream's first record has it: the 0s before and after a sample's ones are padding and are
    dropped, a 0 between ones is a bad record. None: never read (the padding would be packed)."""
    vocab_size: int | None = None
    """When given, ids ≥ vocab_size are bad records."""
    on_bad_record: BadRecordPolicy = BadRecordPolicy.ERROR
    """Stop or skip on malformed records."""

    def __post_init__(self):
        object.__setattr__(self, "on_bad_record", _as_enum(BadRecordPolicy, "on_bad_record", self.on_bad_record))

    def validate(self) -> "SourceSpec":
        _check_types(self, ints=(), bools=("all_targets",), optional_ints=("vocab_size",))
        for name in ("tokens_field", "mask_field", "labels_field", "attention_field"):
            value = getattr(self, name)
            if not (isinstance(value, str) and value) and not (value is None and name != "tokens_field"):
                raise ConfigError(f"{name.replace('_', '-')} must be a field name, got {value!r}")
            if value is not None and not is_utf8(value):  # bytes of another encoding on the command line
                raise ConfigError(f"{name.replace('_', '-')} {value!r} is not UTF-8 text (field names in JSON, "
                                  "Parquet and Arrow files are)")
        if self.mask_field and self.labels_field:
            raise ConfigError("--mask-field and --labels-field are mutually exclusive")
        self._check_also_masks()
        if self.all_targets and (self.mask_field or self.labels_field):
            raise ConfigError("--all-targets excludes --mask-field and --labels-field")
        if self.vocab_size is not None and not 1 <= self.vocab_size <= 2**63:
            # token ids are 64-bit signed integers: 2**63 already admits every one, and the
            # metadata's JSON (its checksum too) holds no larger integer
            raise ConfigError(f"vocab-size must be from 1 to 2**63, got {self.vocab_size}")
        return self

    def _check_also_masks(self) -> None:
        """``also_mask_fields``: field names (a list is kept as a tuple), each once, beside a
        ``mask_field`` they are applied with."""
        also = self.also_mask_fields
        if isinstance(also, str) or not isinstance(also, (tuple, list)):
            raise ConfigError(f"also-mask-fields must be a list of field names, got {also!r}")
        for value in also:
            if not (isinstance(value, str) and value and is_utf8(value)):
                raise ConfigError(f"also-mask-fields must be field names (UTF-8 text), got {value!r}")
        object.__setattr__(self, "also_mask_fields", tuple(also))
        if also and not self.mask_field:
            raise ConfigError("also-mask-fields needs a mask-field to apply them with")
        names = [self.mask_field, *also]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:
            raise ConfigError(f"mask field '{twice}' is named twice (--mask-field)")

"""What ``packer inspect`` reports: additive counts and histograms of a packed output.

An :class:`InspectReport` is plain data. Every field that grows with the data is a sum or a
histogram, so reports of separate shards (or record batches) merge with ``+``::

    total = sum(per_shard_reports[1:], start=per_shard_reports[0])

Derived numbers (efficiency, bounds, medians, the attention ratio) are computed from those
sums in :meth:`InspectReport.to_dict`, which is also the ``--json`` document; docs/AUDIT.md
lists its keys. ``__rich__`` renders the same numbers as tables and terminal histograms.

Attention work. Inside a pack, attention only happens within each sequence, so its cost
grows with ``Σ s_i²`` over the real lengths; a FLOPs counter that treats the pack as one
sequence of length T counts ``T²``. ``attention.overstatement = Σ T² / Σ s_i²`` is how much such
a TFLOP/s figure overstates attention work, and ``attention.linear_real_share = Σ s_i / Σ T``
is the share of token-linear work (projections, MLP) spent on real tokens.

>>> r = InspectReport.partial(out="o", spec={"pack_size": 24}, recorded={}, real=[5, 3, 9],
...                           padded=[8, 4, 12], seq_counts=[3], target_tokens=10)
>>> r.sum_sq_real, r.sum_sq_pack, r.to_dict()["attention"]["overstatement"]
(115, 576, 5.008695652173913)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from packer_cli.audit._histogram import Hist, from_sparse, summarize, to_sparse
from packer_cli.errors import reading_document
from packer_cli.plan._validate import check_capacity
from packer_cli.plan.bounds import l2_of_sizes, usable_capacity


@dataclass
class PackDetail:
    """One pack in detail (``inspect --pack N``); per-sequence lists share one index."""

    pack: int
    shard: str
    row: int
    pack_len: int
    source_index: list[int]
    source_offset: list[int]
    start: list[int]
    real_len: list[int]
    padded_len: list[int]
    target_tokens: list[int]

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, record: dict) -> "PackDetail":
        return cls(**record)


def _i(x) -> int:
    return int(x)


@dataclass
class InspectReport:
    """Counts, sums and histograms of an output (or of part of it: reports add up)."""

    out: str
    spec: dict
    """The spec recorded in metadata.json (C, m, CP, TP, SP, algorithm, seed, policies)."""
    recorded: dict
    """Counts only the packing run knew (records, dropped, bad, over-long), from metadata.json."""
    packs: int = 0
    sequences: int = 0
    runtime_tokens: int = 0
    padded_tokens: int = 0
    target_tokens: int = 0
    pack_len_total: int = 0
    """Σ T over packs: C with pad_to_max_length, otherwise each pack's Σp."""
    sum_sq_real: int = 0
    sum_sq_padded: int = 0
    sum_sq_pack: int = 0
    real_hist: Hist = field(default_factory=Hist)
    """Sequences per real runtime length s."""
    padded_hist: Hist = field(default_factory=Hist)
    load_hist: Hist = field(default_factory=Hist)
    """Packs per load Σp."""
    seqs_hist: Hist = field(default_factory=Hist)
    """Packs per number of sequences."""
    detail: PackDetail | None = None

    @classmethod
    def partial(cls, *, out: str, spec: dict, recorded: dict, real, padded, seq_counts,
                target_tokens: int) -> "InspectReport":
        """The report of some packs from their per-sequence ``real``/``padded`` lengths.

        ``seq_counts`` gives each pack's number of sequences (the sequences are listed pack
        after pack); lengths must be non-negative.
        """
        real = np.asarray(real, np.int64)
        padded = np.asarray(padded, np.int64)
        seq_counts = np.asarray(seq_counts, np.int64)
        # each pack's Σp from the running sum (a pack of no sequence, even the last, loads 0)
        ends = np.concatenate([[0], np.cumsum(seq_counts)]).astype(np.int64)
        load = np.diff(np.concatenate([[0], np.cumsum(padded)])[ends]).astype(np.int64)
        pack_len = np.full(load.size, spec["pack_size"], np.int64) if spec.get("pad_to_max_length") else load
        return cls(
            out=out, spec=spec, recorded=recorded, packs=_i(seq_counts.size), sequences=_i(real.size),
            runtime_tokens=_i(real.sum()), padded_tokens=_i(padded.sum()), target_tokens=_i(target_tokens),
            pack_len_total=_i(pack_len.sum()), sum_sq_real=_i((real * real).sum()),
            sum_sq_padded=_i((padded * padded).sum()), sum_sq_pack=_i((pack_len * pack_len).sum()),
            real_hist=Hist.of(real), padded_hist=Hist.of(padded), load_hist=Hist.of(load),
            seqs_hist=Hist.of(seq_counts),
        )

    def __add__(self, other: "InspectReport") -> "InspectReport":
        if not isinstance(other, InspectReport):
            return NotImplemented
        sums = {name: getattr(self, name) + getattr(other, name) for name in (
            "packs", "sequences", "runtime_tokens", "padded_tokens", "target_tokens", "pack_len_total",
            "sum_sq_real", "sum_sq_padded", "sum_sq_pack")}
        hists = {name: getattr(self, name) + getattr(other, name)
                 for name in ("real_hist", "padded_hist", "load_hist", "seqs_hist")}
        return InspectReport(out=self.out, spec=self.spec, recorded=self.recorded, **sums, **hists,
                             detail=self.detail or other.detail)

    # --- derived numbers -------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.packs * int(self.spec["pack_size"])

    def bounds(self, whole_capacity: bool = False) -> tuple[int, int | None]:
        """``(⌈Σp/C'⌉, Martello–Toth L2)`` for the capacity C' = ⌊C/m⌋·m that sequences padded to
        multiples of m can fill (``whole_capacity``: for C, as packer recorded them before it
        knew better); L2 is None when a padded length is 0 or exceeds C'."""
        C = int(self.spec["pack_size"])
        multiple = self.spec.get("pad_seq_to_mult")
        usable = usable_capacity(C, multiple) if type(multiple) is int and not whole_capacity else C
        lower = -(-self.padded_tokens // usable)
        sizes = self.padded_hist.values
        try:
            check_capacity(C)
        except ValueError:
            return lower, None
        if sizes.size and (sizes[-1] > usable or sizes[0] == 0):
            return lower, None  # lengths no plan could hold: no bound
        return lower, l2_of_sizes(sizes, self.padded_hist.counts, usable)  # no array of every sequence

    def quality(self, whole_capacity: bool = False) -> dict:
        """Efficiency, fill and the gaps to the bounds (``whole_capacity``: see :meth:`bounds`)."""
        cap = max(1, self.capacity_tokens)
        lower, l2 = self.bounds(whole_capacity)

        def gap(bound):
            if bound is None:
                return None, None
            return self.packs - bound, (100.0 * (self.packs - bound) / bound if bound else 0.0)

        gap_l1, gap_l1_pct = gap(lower)
        gap_l2, gap_l2_pct = gap(l2)
        return {
            "efficiency": self.runtime_tokens / cap, "fill": self.padded_tokens / cap,
            "lower_bound": lower, "gap_to_lower_bound": gap_l1, "gap_to_lower_bound_pct": gap_l1_pct,
            "l2_bound": l2, "gap_to_l2": gap_l2, "gap_to_l2_pct": gap_l2_pct,
        }

    def to_dict(self) -> dict:
        """The ``--json`` document (keys documented in docs/AUDIT.md)."""
        cap = max(1, self.capacity_tokens)
        align = self.padded_tokens - self.runtime_tokens
        tail = self.capacity_tokens - self.padded_tokens
        return {
            "out": self.out,
            "spec": self.spec,
            "totals": {
                "packs": self.packs, "sequences": self.sequences, "runtime_tokens": self.runtime_tokens,
                "padded_tokens": self.padded_tokens, "target_tokens": self.target_tokens,
                "capacity_tokens": self.capacity_tokens,
                "alignment_padding": align, "alignment_padding_pct": 100.0 * align / cap,
                "tail_padding": tail, "tail_padding_pct": 100.0 * tail / cap,
            },
            "quality": self.quality(),
            "sequences_per_pack": summarize(self.seqs_hist),
            "sequence_length": summarize(self.real_hist),
            "padded_length": summarize(self.padded_hist),
            "pack_load": summarize(self.load_hist),
            "attention": {
                "sum_sq_real": self.sum_sq_real, "sum_sq_padded": self.sum_sq_padded,
                "sum_sq_pack": self.sum_sq_pack, "sum_pack_len": self.pack_len_total,
                "overstatement": self.sum_sq_pack / self.sum_sq_real if self.sum_sq_real else None,
                "linear_real_share": self.runtime_tokens / self.pack_len_total if self.pack_len_total else None,
            },
            "histograms": {
                "sequence_length": to_sparse(self.real_hist), "padded_length": to_sparse(self.padded_hist),
                "pack_load": to_sparse(self.load_hist), "sequences_per_pack": to_sparse(self.seqs_hist),
            },
            "recorded": self.recorded,
            "pack": self.detail.to_dict() if self.detail else None,
        }

    def __eq__(self, other) -> bool:
        """Reports are equal when their documents are (the generated comparison met the
        histograms' NumPy arrays and raised "the truth value of an array ... is ambiguous")."""
        if not isinstance(other, InspectReport):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    @classmethod
    def from_dict(cls, record: dict) -> "InspectReport":
        """Inverse of :meth:`to_dict` (derived numbers are recomputed, not read); ValueError for a
        document it did not write."""
        with reading_document("an inspect report"):
            return cls._from_document(record)

    @classmethod
    def _from_document(cls, record: dict) -> "InspectReport":
        t, a, h = record["totals"], record["attention"], record["histograms"]
        return cls(
            out=record["out"], spec=record["spec"], recorded=record["recorded"], packs=t["packs"],
            sequences=t["sequences"], runtime_tokens=t["runtime_tokens"], padded_tokens=t["padded_tokens"],
            target_tokens=t["target_tokens"], pack_len_total=a["sum_pack_len"], sum_sq_real=a["sum_sq_real"],
            sum_sq_padded=a["sum_sq_padded"], sum_sq_pack=a["sum_sq_pack"],
            real_hist=from_sparse(h["sequence_length"]), padded_hist=from_sparse(h["padded_length"]),
            load_hist=from_sparse(h["pack_load"]), seqs_hist=from_sparse(h["sequences_per_pack"]),
            detail=PackDetail.from_dict(record["pack"]) if record.get("pack") else None,
        )

    def __rich__(self):
        from packer_cli.audit._render import render_inspect

        return render_inspect(self)

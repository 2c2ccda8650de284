"""Typed results of ``verify``: one :class:`Finding` per problem, collected into a report.

A finding names the check that failed, says what is wrong in one sentence, and carries
where it is: the shard file, the row (pack) inside that shard, the global pack index and the
sequence inside the pack, whichever apply. Verify never uses ``assert``; every check adds
findings to a :class:`FindingSink`, and the report's verdict is "no error findings".

A badly broken output could produce millions of identical findings, so the sink keeps the
first ``limit`` of each check and only counts the rest:

>>> sink = FindingSink(limit=1)
>>> sink.add("pack.capacity", "Σp = 5000 exceeds C = 4096", shard="packs-00000.arrow", row=3)
>>> sink.add("pack.capacity", "Σp = 4100 exceeds C = 4096", shard="packs-00000.arrow", row=9)
>>> [f.line() for f in sink.findings()]  # doctest: +NORMALIZE_WHITESPACE
['packs-00000.arrow row 3: Σp = 5000 exceeds C = 4096 [pack.capacity]',
 '1 more pack.capacity problem not shown [pack.capacity]']
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, fields

from packer_cli.errors import reading_document

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class Finding:
    """One problem (``severity="error"``) or remark (``"warning"``) found by verify."""

    check: str
    """Dotted name of the check, e.g. ``shard.checksum`` (docs/AUDIT.md lists them all)."""
    message: str
    """What is wrong, in one sentence."""
    shard: str | None = None
    """File the problem is in (a shard, ``metadata.json``, ``manifest.json`` or a source)."""
    row: int | None = None
    """Row (pack) within the shard."""
    pack: int | None = None
    """Global pack index (shards in manifest order, rows in file order)."""
    seq: int | None = None
    """Sequence within the pack."""
    severity: str = ERROR
    omitted: int | None = None
    """Set on the line that stands for problems ``--limit`` left out (``"N more … not shown"``):
    their number. ``None`` on every real finding, so a reader of the JSON can tell them apart."""

    def where(self) -> str:
        parts = []
        if self.shard:
            parts.append(self.shard)
        if self.row is not None:
            parts.append(f"row {self.row}")
        if self.pack is not None:
            parts.append(f"(pack {self.pack})")
        if self.seq is not None:
            parts.append(f"seq {self.seq}")
        return " ".join(parts)

    def line(self) -> str:
        """The finding as one line: ``where: message [check]``."""
        where = self.where()
        prefix = "warning: " if self.severity == WARNING else ""
        return f"{prefix}{where + ': ' if where else ''}{self.message} [{self.check}]"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> "Finding":
        names = {f.name for f in fields(cls)}
        with reading_document("a finding"):
            return cls(**{k: v for k, v in record.items() if k in names})


@dataclass
class FindingSink:
    """Collects findings, keeping the first ``limit`` of each check and counting the rest."""

    limit: int = 20
    files: dict = field(default_factory=dict)
    """The generic names checks use for an output's JSON files (``metadata.json``,
    ``manifest.json``) → this output's names (a Bridge split's ``training.metadata.json``)."""
    _kept: list[Finding] = field(default_factory=list)
    _counts: Counter = field(default_factory=Counter)
    _severity: dict = field(default_factory=dict)

    def add(self, check: str, message: str, *, severity: str = ERROR, **where) -> None:
        if where.get("shard") in self.files:
            where["shard"] = self.files[where["shard"]]
        self._counts[check] += 1
        self._severity.setdefault(check, severity)
        if self._counts[check] <= self.limit:
            self._kept.append(Finding(check, message, severity=severity, **where))

    def warn(self, check: str, message: str, **where) -> None:
        self.add(check, message, severity=WARNING, **where)

    def add_many(self, check: str, items, message, *, severity: str = ERROR) -> None:
        """One finding per item: ``message(item)`` returns ``(text, where)`` for the kept ones.

        Only the first items up to the limit are formatted; the rest are just counted, so a
        vectorized check can hand over millions of violations at no cost.
        """
        total = len(items)
        shown = items[: max(0, self.limit - self._counts[check])]
        for item in shown:
            text, where = message(item)
            self.add(check, text, severity=severity, **where)
        if total > len(shown):
            self._counts[check] += total - len(shown)
            self._severity.setdefault(check, severity)

    def count(self, check: str) -> int:
        return self._counts[check]

    def findings(self) -> list[Finding]:
        """Kept findings in the order they were found, plus one line per check that overflowed."""
        out = list(self._kept)
        for check, n in self._counts.items():
            if n > self.limit:
                more = n - self.limit
                out.append(Finding(check, f"{more} more {check} problem{'s' if more > 1 else ''} not shown",
                                   severity=self._severity[check], omitted=more))
        return out

    def counts(self, severity: str = ERROR) -> dict[str, int]:
        """Findings per check of one severity, including those not shown."""
        return {c: n for c, n in self._counts.items() if self._severity[c] == severity}
